"""`sandflow-env`: the name verifiers finds sandflow's environment by (`vf-eval sandflow-env`).

verifiers imports a taskset id as a top-level module exporting its Taskset through
`__all__`; the environment itself is `rl.verifiers_env` (docs/interop.md, "verifiers").
"""

from rl.verifiers_env import SandflowTaskset, load_environment

__all__ = ["SandflowTaskset", "load_environment"]
