"""Planning a run: which episodes it is made of, and what its id is.

A run is tasks x modes x samples. Every episode gets a stable key
(tasks.records.episode_key: run id, task id, mode, sample index), so a resumed run
plans the same keys and skips those the warehouse already holds.
"""

from __future__ import annotations

import secrets
from datetime import UTC, datetime

from pydantic import BaseModel, ConfigDict

from datasets_prep.task import Task
from tasks.records import episode_key

MODES = {"sandbox": ("sandbox",), "llm": ("llm",), "both": ("sandbox", "llm")}


class RunConfigError(ValueError):
    """A run parameter is wrong; the message names it (one sentence, exit code 2)."""


class RunLockedError(RunConfigError):
    """Another process is running this run id (the message names it: pid, host, start)."""


class WarehouseFullError(RunConfigError):
    """The warehouse's disk is full: every further episode would fail too, so the run stops."""


class EpisodeSpec(BaseModel):
    """What one episode is: a task, a mode, a sample. Its key is stable across runs/resumes."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    run_id: str
    task: Task
    mode: str
    sample_index: int = 0

    @property
    def key(self) -> str:
        return episode_key(self.run_id, self.task.id, self.mode, self.sample_index)

    @property
    def label(self) -> str:
        """task/mode/sample: how a person names the episode (Prefect's task-run name)."""
        return f"{self.task.id}/{self.mode}/{self.sample_index}"


def new_run_id(name: str) -> str:
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in name)[:40].strip("-.") or "run"
    return f"{safe}-{stamp}-{secrets.token_hex(2)}"


def plan(tasks: list[Task], run_id: str, mode: str, samples: int) -> list[EpisodeSpec]:
    """Every (task, mode, sample) of the run, in order. A task listed twice continues its
    sample numbering, so no two episodes share a key."""
    if mode not in MODES:
        raise RunConfigError(f"--mode {mode!r}: use one of sandbox, llm, both")
    if samples < 1:
        raise RunConfigError(f"--samples {samples}: must be at least 1")
    seen: dict[str, int] = {}
    out: list[EpisodeSpec] = []
    for t in tasks:
        start = seen.get(t.id, 0)
        for m in MODES[mode]:
            out.extend(
                EpisodeSpec(run_id=run_id, task=t, mode=m, sample_index=start + s)
                for s in range(samples)
            )
        seen[t.id] = start + samples
    return out
