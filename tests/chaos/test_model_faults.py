"""The model endpoint misbehaves: retried where that makes sense, else the right reason.

Each test runs a real episode (Docker sandbox, the scripted OpenAI-compatible server
over HTTP, the warehouse writer) with one fault injected on its first model call, and
reads back what was recorded. Transient faults (429 with Retry-After, 5xx, a timeout, a
dropped connection, a proxy's HTML page) are retried by the client and the episode goes
on; a bad tool call is the model's mistake, shown to it as an error observation; an
endpoint that stays broken ends the episode as `model_error` (an infrastructure failure:
not graded, retried by the run). The last test takes the endpoint away in the middle of
a real run: the run still ends (no hang, no crash), no container is left, and the same
run id completes once an endpoint is back.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from tests.chaos.conftest import chaos_run_id, containers_of, query
from tests.flows.conftest import ANSWER, run_kwargs, solver, tiny_tasks, write_tasks
from tests.scripted_model import Fault, Reply, ScriptedModel, tool_reply

pytestmark = [pytest.mark.chaos, pytest.mark.usefixtures("sandbox_image")]


def _episode(model: ScriptedModel, wh: Path, run_id: str, **model_kw: Any) -> Any:
    """One sandbox episode of task t0 against `model`, recorded in warehouse `wh`."""
    from sandbox.base import SandboxConfig, SandboxLimits
    from tasks.loop import Limits, run_episode
    from tasks.model import ModelConfig
    from warehouse.writer import EpisodeWriter

    cfg = ModelConfig(model="scripted", base_url=model.url, backoff_initial_s=0.05, **model_kw)
    with EpisodeWriter(wh, durability="flush") as writer:
        return run_episode(
            tiny_tasks(1)[0],
            cfg,
            SandboxConfig(run_id=run_id, limits=SandboxLimits(memory_mb=512, network="none")),
            writer,
            run_id=run_id,
            limits=Limits(max_steps=6, wall_clock_s=120),
        )


def _recorded(wh: Path, run_id: str) -> tuple[str, str | None, int]:
    rows = query(wh, f"SELECT termination, answer, num_turns FROM episodes WHERE run_id = '{run_id}'")
    assert len(rows) == 1, rows
    return rows[0]


TRANSIENT = {
    "429-retry-after": (Fault.rate_limit(retry_after=0.3), {}),
    "500": (Fault.server_error(500), {}),
    "503": (Fault.server_error(503), {}),
    "timeout": (Fault.hang(5.0), {"request_timeout_s": 1.0}),
    "dropped-connection": (Fault.drop(), {}),
    "non-json-200": (Fault.non_json(), {}),
}


@pytest.mark.parametrize("name", list(TRANSIENT))
def test_transient_fault_is_retried_and_the_episode_goes_on(
    name: str, tmp_path: Path, test_run_id: str
) -> None:
    fault, kw = TRANSIENT[name]
    rid = f"{test_run_id}-m-{name}"
    with ScriptedModel([fault, fault], default=solver, models=("scripted",)) as model:
        result = _episode(model, tmp_path / "wh", rid, **kw)
        sent = len(model.requests)
    assert result.record.termination == "submitted", result.record.error
    assert result.record.answer == ANSWER
    assert result.turns[0].attempts == 3, "the first call should have taken two retries"
    assert sent == 4 + 2  # four turns, two of them retried... the first one twice
    assert _recorded(tmp_path / "wh", rid) == ("submitted", ANSWER, 4)
    assert containers_of(rid) == []


def test_retry_after_is_honoured(tmp_path: Path, test_run_id: str) -> None:
    """The retry waits at least as long as the server asked (measured by the server's clock)."""
    import time

    arrivals: list[float] = []

    def stamp(item: Any) -> Any:
        def fn(body: dict, index: int) -> Any:
            arrivals.append(time.monotonic())
            return item if not callable(item) or isinstance(item, (Reply, Fault)) else item(body, index)

        return fn

    rid = f"{test_run_id}-m-retry-after"
    with ScriptedModel(
        [stamp(Fault.rate_limit(retry_after=1.0)), stamp(solver)], default=solver, models=("scripted",)
    ) as model:
        result = _episode(model, tmp_path / "wh", rid)
    assert result.record.termination == "submitted"
    # Not a timing assertion on our speed: a lower bound the client must respect.
    assert arrivals[1] - arrivals[0] >= 1.0, "the client retried before the server's Retry-After"


def test_invalid_tool_call_json_is_the_models_mistake(tmp_path: Path, test_run_id: str) -> None:
    """Broken arguments are shown to the model as an error observation; the episode goes on."""
    bad = tool_reply("execute_bash", '{"command": "ls /testbed", ')  # truncated JSON
    rid = f"{test_run_id}-m-badjson"
    with ScriptedModel([bad], default=solver, models=("scripted",)) as model:
        result = _episode(model, tmp_path / "wh", rid)
        second_request = model.requests[1]
    assert result.record.termination == "submitted"
    obs = result.turns[0].observations[0]
    assert obs.error and "json" in obs.error.lower()
    # The model saw the error as its tool result (and can correct itself).
    tool_msgs = [m for m in second_request["messages"] if m.get("role") == "tool"]
    assert tool_msgs and "json" in tool_msgs[0]["content"].lower()
    rows = query(
        tmp_path / "wh",
        "SELECT c.arguments, o.error FROM turns t, unnest(t.tool_calls) AS u(c), unnest(t.observations) AS v(o) "
        f"WHERE t.run_id = '{rid}' AND t.turn_index = 0",
    )
    assert rows and rows[0][0] == '{"command": "ls /testbed", ' and "json" in rows[0][1].lower()


# 3,000 levels of brackets (12 KB): Python's json reader recurses once per level.
DEEP = '{"command": ' + "[" * 3000 + "]" * 3000 + "}"


@pytest.mark.parametrize("shape", ["object", "list"])
def test_arguments_nested_thousands_deep_are_the_models_mistake_and_every_reader_survives(
    shape: str, tmp_path: Path, test_run_id: str
) -> None:
    """Issue #37: tool-call arguments nested 3,000 levels deep were a RecursionError in the
    tool's parser, recorded as sandbox_error (infrastructure: retried, never graded), and
    then `export atif`, `export inspect` and `flows usage` crashed on the run. Now: an
    error observation the model sees, the episode goes on and is graded, and every reader
    of the run (exports, usage labels, the viewer's display) reads it."""
    from analysis import metrics
    from interop.atif import export_atif
    from interop.inspect_log import export_inspect
    from sandflow.viewer.present import parse_arguments as display
    from warehouse import Warehouse

    args = {"object": DEEP, "list": "[" * 3000 + "]" * 3000}[shape]
    bad = tool_reply("execute_bash", args)
    rid = f"{test_run_id}-m-deep-{shape}"
    with ScriptedModel([bad], default=solver, models=("scripted",)) as model:
        result = _episode(model, tmp_path / "wh", rid)
        second_request = model.requests[1]
    assert result.record.termination == "submitted", result.record.error
    assert not result.record.is_infra_failure
    obs = result.turns[0].observations[0]
    assert obs.error == "invalid JSON arguments", obs
    tool_msgs = [m for m in second_request["messages"] if m.get("role") == "tool"]
    assert "nested deeper than 64 levels" in tool_msgs[0]["content"]
    assert _recorded(tmp_path / "wh", rid) == ("submitted", ANSWER, 4)  # graded, as any turn
    assert result.turns[0].tool_calls[0].arguments == args  # kept as the model sent it

    wh = tmp_path / "wh"
    atif = export_atif(wh, rid, tmp_path / "atif")
    assert atif.files == 1
    inspect = export_inspect(wh, rid, tmp_path / "inspect")
    assert inspect.files == 1
    data = Warehouse(wh).load_run(rid)
    rows = metrics.usage_call_rows(data)
    assert rows and metrics.usage_rates(metrics.turn_labels(data))
    valid, _headline, shown = display("execute_bash", args)
    assert not valid and shown


def test_a_reply_whose_body_nests_too_deep_is_not_retried(tmp_path: Path, test_run_id: str) -> None:
    """Arguments sent as a JSON *object* 3,000 levels deep make the whole reply body
    unreadable to Python's json: one model_error naming it, not a retry loop for the
    retry window nor a crash."""
    call = '{"id": "c1", "type": "function", "function": {"name": "execute_bash", "arguments": ' + DEEP + "}}"
    bad = Fault.raw_body(
        '{"id": "x", "object": "chat.completion", "model": "scripted", "choices": [{"index": 0, '
        '"message": {"role": "assistant", "content": null, "tool_calls": [' + call + "]}, "
        '"finish_reason": "tool_calls"}], "usage": {"prompt_tokens": 10, "completion_tokens": 5}}'
    )
    rid = f"{test_run_id}-m-deepbody"
    with ScriptedModel([bad], default=solver, models=("scripted",)) as model:
        result = _episode(model, tmp_path / "wh", rid)
        sent = len(model.requests)
    assert sent == 1
    assert result.record.termination == "model_error"
    assert "nests JSON deeper than can be read" in (result.record.error or "")


@pytest.mark.parametrize(
    "fault",
    [Fault.server_error(500), Fault.non_json(), Fault.drop()],
    ids=["500", "non-json", "drop"],
)
def test_endpoint_that_stays_broken_ends_the_episode_as_model_error(
    fault: Fault, tmp_path: Path, test_run_id: str
) -> None:
    """After the retries: termination model_error, the turns before it kept, no container."""
    rid = f"{test_run_id}-m-broken-{fault.kind}{fault.status}"
    first = solver({"tools": [1], "messages": []}, 0)
    with ScriptedModel([first], default=fault, models=("scripted",)) as model:
        result = _episode(model, tmp_path / "wh", rid, max_retries=2)
        sent = len(model.requests)
    assert result.record.termination == "model_error"
    assert result.record.is_infra_failure
    assert sent == 1 + 3  # one good turn, then one call tried three times
    term, _answer, turns = _recorded(tmp_path / "wh", rid)
    assert (term, turns) == ("model_error", 1)
    assert containers_of(rid) == []


def test_bad_request_400_is_not_retried(tmp_path: Path, test_run_id: str) -> None:
    """A 400 that is not about context ends the episode at once (retrying cannot help)."""
    rid = f"{test_run_id}-m-400"
    bad_request = Fault("status", 400, message="tools[0].function.parameters: invalid schema")
    with ScriptedModel([bad_request], default=solver, models=("scripted",)) as model:
        result = _episode(model, tmp_path / "wh", rid)
        sent = len(model.requests)
    assert sent == 1
    assert result.record.termination == "model_error"
    assert "400" in (result.record.error or "")


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_harness")
def test_endpoint_disappears_mid_run_then_resume(tmp_path: Path) -> None:
    """The server goes away after a few calls: the run ends with every episode accounted
    for (done or failed as infrastructure), no container left; resume completes the run."""
    from prefect.task_runners import ThreadPoolTaskRunner

    from flows.run import run_flow

    def runner() -> Any:
        return ThreadPoolTaskRunner(max_workers=2)

    ts = write_tasks(tmp_path / "tiny.parquet", tiny_tasks(4))
    wh = tmp_path / "wh"
    rid = chaos_run_id("endpoint-gone")
    served = threading.Event()

    with ScriptedModel(models=("scripted",)) as model:

        def then_vanish(body: dict, index: int) -> Any:
            if index < 5:
                return solver(body, index)
            if not served.is_set():
                served.set()
                threading.Thread(target=model.stop, daemon=True).start()
            return Fault.drop()

        model.default = then_vanish
        summary = run_flow.with_options(task_runner=runner())(
            **run_kwargs(ts, model, wh, run_id=rid, mode="sandbox", retries=0, model_retry_window_s=1.0)
        )
    assert served.is_set()
    assert summary["planned"] == 4
    assert summary["succeeded"] + summary["failed"] == 4
    assert summary["failed"] >= 1, summary
    failed = query(wh, f"SELECT termination, count(*) FROM episodes WHERE run_id = '{rid}' AND termination != 'submitted' GROUP BY 1")
    assert failed and {t for t, _ in failed} == {"model_error"}, failed
    assert containers_of(rid) == []

    with ScriptedModel(default=solver, models=("scripted",)) as back:
        again = run_flow.with_options(task_runner=runner())(
            **run_kwargs(ts, back, wh, run_id=rid, mode="sandbox")
        )
    assert again["failed"] == 0 and again["skipped"] + again["succeeded"] == 4
    rows = query(wh, f"SELECT termination, count(*) FROM episodes WHERE run_id = '{rid}' GROUP BY 1")
    assert rows == [("submitted", 4)]
    assert containers_of(rid) == []
