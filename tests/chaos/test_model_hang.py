"""A model endpoint that hangs until the episode's wall clock is infrastructure, not a grade.

Where the boundary is: the wall clock is charged to whoever holds the episode when it
runs out. Waiting for the model server (a request in flight, a retry's backoff, a reply
that only came after the deadline) is infrastructure: `model_error`, retried by the run
and re-run on resume, never scored. The model's own work in the sandbox running into the
wall clock (a command that takes too long) is the model's result: `wall_clock`, graded.

Real parts: the scripted OpenAI-compatible server over HTTP made to hang, the agent loop,
the warehouse, Prefect (the session harness) for the run-level retry and resume, and the
real Docker sandbox for the sandbox-mode cases.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.chaos.conftest import query
from tests.flows.conftest import ANSWER, new_run_id, run_kwargs, solver, tiny_tasks, write_tasks
from tests.scripted_model import Fault, ScriptedModel, tool_reply

pytestmark = pytest.mark.chaos

WALL = 4.0


def _episode(model: ScriptedModel, wh: Path, run_id: str, mode: str, **limits: Any) -> Any:
    from sandbox.base import SandboxConfig, SandboxLimits
    from tasks.loop import Limits, run_episode
    from tasks.model import ModelConfig
    from warehouse.writer import EpisodeWriter

    cfg = ModelConfig(model="scripted", base_url=model.url, request_timeout_s=120, max_retries=4)
    with EpisodeWriter(wh, durability="flush") as writer:
        return run_episode(
            tiny_tasks(1)[0],
            cfg,
            SandboxConfig(run_id=run_id, limits=SandboxLimits(memory_mb=512, network="none")),
            writer,
            mode=mode,  # type: ignore[arg-type]
            run_id=run_id,
            limits=Limits(max_steps=6, wall_clock_s=WALL, **limits),
        )


def test_llm_mode_endpoint_hangs_past_the_wall_clock_is_model_error(
    tmp_path: Path, test_run_id: str
) -> None:
    rid = f"{test_run_id}-hang-llm"
    with ScriptedModel([Fault.hang(60)], default=solver, models=("scripted",)) as model:
        result = _episode(model, tmp_path / "wh", rid, "llm")
    rec = result.record
    assert rec.termination == "model_error", (rec.termination, rec.error)
    assert "wall clock" in (rec.error or "") and "did not answer" in (rec.error or "")
    assert rec.wall_s < WALL + 5, "the hang was not cut at the wall clock"
    rows = query(
        tmp_path / "wh",
        f"SELECT termination, is_infra_failure FROM episodes WHERE run_id = '{rid}'",
    )
    assert rows == [("model_error", True)], rows


@pytest.mark.usefixtures("sandbox_image")
def test_sandbox_mode_endpoint_hangs_mid_episode_is_model_error(
    tmp_path: Path, test_run_id: str
) -> None:
    rid = f"{test_run_id}-hang-sb"
    script = [tool_reply("execute_bash", {"command": "ls /testbed"}), Fault.hang(60)]
    with ScriptedModel(script, default=solver, models=("scripted",)) as model:
        result = _episode(model, tmp_path / "wh", rid, "sandbox")
    rec = result.record
    assert rec.termination == "model_error", (rec.termination, rec.error)
    assert len(result.turns) == 1  # the turn before the hang is kept


@pytest.mark.usefixtures("sandbox_image")
def test_the_models_own_slow_command_is_still_wall_clock(tmp_path: Path, test_run_id: str) -> None:
    """The boundary: time the model spends *in the sandbox* is its own."""
    rid = f"{test_run_id}-slowcmd"
    script = [tool_reply("execute_bash", {"command": "sleep 30"})]
    with ScriptedModel(script, default=solver, models=("scripted",)) as model:
        result = _episode(model, tmp_path / "wh", rid, "sandbox")
    assert result.record.termination == "wall_clock", (
        result.record.termination,
        result.record.error,
    )


def test_a_reply_that_comes_only_after_the_wall_clock_is_model_error(
    tmp_path: Path, test_run_id: str
) -> None:
    """A reply held back past the deadline (e.g. queued behind other episodes' calls)."""
    from tasks.loop import Limits, run_episode
    from tasks.model import ModelConfig, ModelReply

    rid = f"{test_run_id}-late"
    with ScriptedModel(default=solver, models=("scripted",)) as model:
        cfg = ModelConfig(model="scripted", base_url=model.url)
        from tasks.model import ModelClient

        class QueuedClient(ModelClient):  # the wait for a call slot, as flows/limits.py does it
            def complete(self, *a: Any, **kw: Any) -> ModelReply:
                import time

                time.sleep(WALL + 0.5)
                return super().complete(*a, **kw)

        client = QueuedClient(cfg)
        result = run_episode(
            tiny_tasks(1)[0], cfg, mode="llm", run_id=rid, client=client,
            limits=Limits(max_steps=3, wall_clock_s=WALL),
        )  # fmt: skip
    assert result.record.termination == "model_error", (
        result.record.termination,
        result.record.error,
    )


def test_run_retries_a_hung_endpoint_and_resume_reruns_it(
    tmp_path: Path, prefect_harness: None
) -> None:
    from flows.run import run_flow

    ts = write_tasks(tmp_path / "tiny.parquet", tiny_tasks(1))
    wh = tmp_path / "wh"
    rid = new_run_id("hang")
    # 1. the endpoint hangs once: the episode's first attempt is model_error, Prefect's
    #    retry (infrastructure) records the real answer
    with ScriptedModel([Fault.hang(60)], default=solver, models=("scripted",)) as model:
        out = run_flow(
            **run_kwargs(ts, model, wh, mode="llm", run_id=rid, wall_clock_s=WALL, retries=1)
        )
    assert out["succeeded"] == 1 and out["failed"] == 0, out
    rows = query(wh, f"SELECT termination, answer FROM episodes WHERE run_id = '{rid}'")
    assert rows == [("submitted", ANSWER)], rows

    # 2. an endpoint that keeps hanging: no retry left, the episode is a failure (not a
    #    graded wall_clock) and a resume against a healthy endpoint runs it again
    rid2 = new_run_id("hang-resume")
    with ScriptedModel(default=Fault.hang(60), models=("scripted",)) as model:
        out = run_flow(
            **run_kwargs(ts, model, wh, mode="llm", run_id=rid2, wall_clock_s=WALL, retries=0)
        )
    assert out["failed"] == 1 and out["succeeded"] == 0, out
    rows = query(wh, f"SELECT termination, is_infra_failure FROM episodes WHERE run_id = '{rid2}'")
    assert rows == [("model_error", True)], rows
    with ScriptedModel(default=solver, models=("scripted",)) as model:
        out = run_flow(
            **run_kwargs(ts, model, wh, mode="llm", run_id=rid2, wall_clock_s=WALL, retries=0)
        )
        assert len(model.requests) == 1, "resume did not re-run the hung episode"
    assert out["succeeded"] == 1 and out["skipped"] == 0, out
    rows = query(wh, f"SELECT termination, answer FROM episodes WHERE run_id = '{rid2}'")
    assert rows == [("submitted", ANSWER)], rows
