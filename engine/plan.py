"""Planning a run: which episodes it is made of, and what its id is.

A run is tasks x modes x samples. Every episode gets a stable key
(tasks.records.episode_key: run id, task id, mode, sample index), so a resumed run
plans the same keys and skips those the warehouse already holds.
"""

from __future__ import annotations

import secrets
from collections.abc import Collection
from datetime import UTC, datetime

from pydantic import BaseModel, ConfigDict

from datasets_prep.task import Task
from tasks.defaults import (
    EMBEDDED_MODEL_CONCURRENCY,
    EMBEDDED_MODEL_MAX_STEPS,
    EMBEDDED_MODEL_MAX_TOKENS,
)
from tasks.records import Spend, episode_key
from tasks.spec import RunSpec

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
    # What the episode's recorded attempts paid (the warehouse's, at the run's start): a
    # re-run carries it on in its record (tasks.records.Spend), so the money stays
    # counted when the attempt is replaced. None: nothing recorded for it yet.
    replaced: Spend | None = None

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


def embedded_model_defaults(spec: RunSpec, told: Collection[str]) -> RunSpec:
    """`spec` as a run on the embedded model (no endpoint: it is started for the run) does
    it: of max_steps, concurrency and max_tokens, those the caller was not `told` keep the
    demo to minutes (tasks/defaults.py says why). With an endpoint, `spec` unchanged."""
    if spec.endpoint.base_url:
        return spec
    short = {
        "max_steps": EMBEDDED_MODEL_MAX_STEPS,
        "concurrency": EMBEDDED_MODEL_CONCURRENCY,
        "max_tokens": EMBEDDED_MODEL_MAX_TOKENS,
    }
    return spec.replace(**{k: v for k, v in short.items() if k not in told})
