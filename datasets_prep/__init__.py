"""Datasets into sandbox tasks, built-in offline suites, and verifiers.

    from datasets_prep import load_taskset, score, read_taskset, write_taskset
    ts = load_taskset("smoke")                  # or "hf:NAME", "my.jsonl", mapping="context=..."
    r = score(ts[0], "The answer is \\boxed{4}")  # VerifierResult(score, reason, ...)

Names are imported lazily so `import datasets_prep` stays cheap.
"""

from __future__ import annotations

from datasets_prep.lazy import lazy_exports

_EXPORTS = {
    "Task": "datasets_prep.task",
    "TaskSet": "datasets_prep.task",
    "TaskValidationError": "datasets_prep.task",
    "read_taskset": "datasets_prep.io",
    "write_taskset": "datasets_prep.io",
    "TaskSetIOError": "datasets_prep.io",
    "load_taskset": "datasets_prep.prepare",
    "build_suite": "datasets_prep.suites",
    "score": "datasets_prep.verifiers",
    "VerifierResult": "datasets_prep.verifiers",
    "VerifierError": "datasets_prep.verifiers",
}

__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
