"""sandflow as the environment an on-policy RL trainer drives.

Two forms (docs/rl.md):

- step-wise, in-process: `SandboxEnv` (gym style: reset(task) -> messages,
  step(assistant turn) -> observations, done, reward) and its SkyRL adapter
  (`rl.skyrl`);
- whole episodes as a service: the rollout server (`rl.server`, `sandflow rl serve`) and
  its client (`rl.client.RolloutClient`).

Both record every rollout in the warehouse, tagged with the training run, step and
policy version. Imports are lazy: `import rl` pulls in neither docker nor FastAPI.
"""

from __future__ import annotations

from datasets_prep.lazy import lazy_exports

_EXPORTS = {
    "SandboxEnv": "rl.env",
    "StepResult": "rl.env",
    "InfraError": "rl.env",
    "finish_runs": "rl.envruns",
    "RolloutTags": "rl.recording",
    "task_from_row": "datasets_prep.rows",
    "RowError": "datasets_prep.rows",
    "reply_from_action": "rl.toolcalls",
    "parse_text_tool_calls": "rl.toolcalls",
    "RolloutClient": "rl.client",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
