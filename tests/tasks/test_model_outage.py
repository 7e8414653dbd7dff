"""Issue #22 item 8: an endpoint outage (503s for a while) is ridden out by the model
client's retries, which are bounded by time (a retry window within the episode's wall
clock), not by a count of attempts. The scripted model answers 503 for `outage_s`
seconds, then normally; the window is a parameter, so the tests stay short."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from datasets_prep.task import Task
from tasks.defaults import DEFAULT_WALL_CLOCK_S
from tasks.loop import Limits, run_episode
from tasks.model import DEFAULT_RETRY_WINDOW_S, ModelClient, ModelConfig, ModelError
from tasks.spec import RunSpec
from tests.scripted_model import Fault, Reply, ScriptedModel, text_reply

MSGS = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
OLD_ATTEMPT_BOUND = 5  # max_retries=4: what ended every episode after ~10 s of an outage


def outage(outage_s: float, then: Reply) -> Callable[[dict, int], Reply | Fault]:
    """503 for `outage_s` seconds from the first request, then `then`."""
    start: list[float] = []

    def answer(body: dict, index: int) -> Reply | Fault:
        if not start:
            start.append(time.monotonic())
        if time.monotonic() - start[0] < outage_s:
            return Fault.server_error(503)
        return then

    return answer


def cfg(server: ScriptedModel, window_s: float) -> ModelConfig:
    return ModelConfig(
        model="scripted", base_url=server.url, backoff_initial_s=0.02, backoff_max_s=0.1,
        request_timeout_s=5.0, retry_window_s=window_s,
    )  # fmt: skip


def test_an_outage_shorter_than_the_window_is_ridden_out(scripted_model: ScriptedModel) -> None:
    scripted_model.default = outage(1.5, text_reply("back"))
    reply = ModelClient(cfg(scripted_model, window_s=6.0)).complete(MSGS)
    assert reply.content == "back"
    # more attempts than the old count bound allowed: time, not a count, bounded them
    assert reply.attempts > OLD_ATTEMPT_BOUND, reply.attempts


def test_an_outage_longer_than_the_window_is_a_model_error_naming_it(
    scripted_model: ScriptedModel,
) -> None:
    scripted_model.default = Fault.server_error(503)
    with pytest.raises(ModelError, match=r"HTTP 503") as err:
        ModelClient(cfg(scripted_model, window_s=1.0)).complete(MSGS)
    assert "retry window of 1s" in str(err.value)
    assert len(scripted_model.requests) > OLD_ATTEMPT_BOUND


def test_a_count_bound_still_applies_when_one_is_set(scripted_model: ScriptedModel) -> None:
    scripted_model.default = Fault.server_error(503)
    with pytest.raises(ModelError, match=r"after 3 attempt\(s\)"):
        ModelClient(cfg(scripted_model, window_s=60.0).model_copy(update={"max_retries": 2})).complete(MSGS)
    assert len(scripted_model.requests) == 3


def test_an_episode_rides_out_an_outage_instead_of_failing(scripted_model: ScriptedModel) -> None:
    """The episode of the issue: every call 503 for a while; it ends `submitted`, not
    `model_error`, and records the attempts its turn took."""
    scripted_model.default = outage(1.5, text_reply("The answer is 4."))
    task = Task(id="t", domain="math", problem_statement="2+2?", ground_truth="4")
    result = run_episode(task, cfg(scripted_model, window_s=6.0), mode="llm", run_id="pytest-outage",
                         limits=Limits(wall_clock_s=60))  # fmt: skip
    assert result.record.termination == "submitted", result.record.error
    assert result.turns[0].attempts > OLD_ATTEMPT_BOUND


def test_the_window_stays_within_the_episode_wall_clock(scripted_model: ScriptedModel) -> None:
    """A window longer than the episode's time left: the episode's wall clock ends it
    (model_error naming the wall clock), the window does not keep it waiting."""
    scripted_model.default = Fault.server_error(503)
    task = Task(id="t", domain="math", problem_statement="2+2?", ground_truth="4")
    result = run_episode(task, cfg(scripted_model, window_s=600.0), mode="llm", run_id="pytest-outage",
                         limits=Limits(wall_clock_s=1.5))  # fmt: skip
    assert result.record.termination == "model_error"
    assert "wall clock" in (result.record.error or "")


def test_the_default_window_rides_out_two_minutes_within_the_wall_clock() -> None:
    assert 120 <= DEFAULT_RETRY_WINDOW_S < DEFAULT_WALL_CLOCK_S
    assert ModelConfig().retry_window_s == DEFAULT_RETRY_WINDOW_S
    assert ModelConfig().max_retries is None  # no count bound by default
    assert RunSpec().to_model_config(with_key=False).retry_window_s == DEFAULT_RETRY_WINDOW_S
    assert RunSpec(model_retry_window_s=5).to_model_config(with_key=False).retry_window_s == 5
