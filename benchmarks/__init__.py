"""Benchmark scripts (run each as a script: see benchmarks/README.md)."""
