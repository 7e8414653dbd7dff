"""Prefect flows: prepare -> run -> score -> usage -> tokens -> rollouts -> report.

sandflow's Prefect settings (flows/prefect_env.py) are set by whoever starts the process,
before it imports prefect: the CLI (`prefect_env.apply()`), the tests' conftest, the
benchmarks. Importing a library never changes the process environment
(tests/test_settings_boundary.py); Dask workers inherit the environment of the process
that starts them.
"""
