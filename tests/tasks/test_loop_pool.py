"""The agent loop on the warm pool (SandboxConfig.reuse="pool"): episodes share a reset sandbox."""

from __future__ import annotations

import time

import pytest

from datasets_prep.task import Task
from tasks.loop import run_episode
from tasks.records import NullRecorder
from tests.scripted_model import ScriptedModel, tool_reply
from tests.tasks.conftest import fast_model, sandbox_config

pytestmark = pytest.mark.docker


def test_episodes_reuse_a_reset_sandbox(scripted_model: ScriptedModel) -> None:
    from sandbox.pool import close_all, pool_for

    cfg = sandbox_config().model_copy(update={"reuse": "pool"})
    seen = []
    # the pool of this config may have served earlier tests of this process: count from here
    close_all()  # the pools earlier tests of this process left: this one starts from zero
    try:
        for i in range(2):
            scripted_model.push(
                tool_reply("execute_bash", {"command": "ls -A /testbed /tmp; hostname; echo $$"}),
                tool_reply(
                    "execute_bash", {"command": "echo left > /tmp/mine; (setsid sleep 999 &)"}
                ),
                tool_reply("submit", {}),
            )
            t = Task(id=f"p{i}", domain="math", problem_statement="6*7?", ground_truth="42")
            result = run_episode(
                t, fast_model(scripted_model), cfg, NullRecorder(), run_id="pool-run"
            )
            assert result.record.termination == "submitted", result.record.error
            seen.append(result.turns[0].observations[0].content)
            pool = pool_for(cfg)
            deadline = time.monotonic() + 30
            while pool.idle < 1 and time.monotonic() < deadline:
                time.sleep(0.02)
        assert pool.stats.created == 1 and pool.stats.reused == 1 and pool.stats.resets_failed == 0
    finally:
        close_all()
    assert "mine" not in seen[1] and "sandbox" in seen[1]  # the first episode's file is gone
