"""Episodes: the agent loop, its tools and prompts, model clients, LLM mode, the embedded model.

`from tasks import run_episode, ModelConfig, Limits` — loaded lazily, so importing the
package (e.g. for `sandflow --help`) does not pull in the openai SDK.
"""

from __future__ import annotations

from datasets_prep.lazy import lazy_exports

__all__ = ["EpisodeResult", "Limits", "ModelClient", "ModelConfig", "run_episode"]

_HOME = {
    "run_episode": "tasks.loop",
    "Limits": "tasks.loop",
    "EpisodeResult": "tasks.loop",
    "ModelConfig": "tasks.model",
    "ModelClient": "tasks.model",
}

__getattr__ = lazy_exports(__name__, _HOME)
