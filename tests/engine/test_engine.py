"""The run engine (engine/), without Prefect: plan -> resume -> preflight -> record ->
fan out -> retries -> cancel -> the run's status. Real HTTP to the scripted model, real
warehouse (DuckDB over Parquet), real Docker for the sandbox episodes."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest

import engine
from engine import CancelToken, RetryPolicy, RunSpec, ThreadExecutor, progress
from tests.flows.conftest import ANSWER, containers_of, new_run_id, solver, tiny_tasks
from tests.scripted_model import Fault, Reply, ScriptedModel, text_reply

REPO = Path(__file__).resolve().parents[2]


def spec(server: ScriptedModel, wh: Path | None, **kw: Any) -> RunSpec:
    base: dict[str, Any] = dict(
        task_set="tiny", model="scripted", base_url=server.url, mode="llm", concurrency=2,
        max_steps=6, wall_clock_s=60.0, durability="flush",
        warehouse=str(wh) if wh is not None else None, model_retry_window_s=0.0,
    )  # fmt: skip
    base.update(kw)
    return RunSpec(**base)


def episodes_of(wh: Path, rid: str) -> dict[str, str]:
    from warehouse import Warehouse

    t = Warehouse(wh).episodes(rid).to_pylist()
    return {r["episode_id"]: r["termination"] for r in t}


def test_a_run_is_a_library_call_and_records_every_episode(tmp_path: Path) -> None:
    """engine.run(tasks, spec): both modes, every episode recorded once, the run record
    `finished`; run again with the same id: everything is skipped (resume)."""
    wh, rid = tmp_path / "wh", new_run_id("engine-lib")
    with ScriptedModel(default=solver, models=("scripted",)) as model:
        result = engine.run(tiny_tasks(3), spec(model, wh, run_id=rid, mode="both"))
        again = engine.run(tiny_tasks(3), spec(model, wh, run_id=rid, mode="both"))
    s = result.summary
    assert (s["planned"], s["ran"], s["succeeded"], s["failed"], s["status"]) == (6, 6, 6, 0, "finished")
    assert {o.answer for o in result.outcomes} == {ANSWER}
    assert sorted(episodes_of(wh, rid).values()) == ["submitted"] * 6
    from warehouse import Warehouse

    info = Warehouse(wh).run_info(rid)
    assert info is not None and info["status"] == "finished"
    assert info["dataset_hash"] == s["task_set_hash"]
    config = info["config"] if isinstance(info["config"], dict) else json.loads(info["config"])
    assert config["prompts"] is None  # the built-in set; a series compares it night to night
    assert (again.summary["skipped"], again.summary["ran"]) == (6, 0)
    assert containers_of(rid) == []


def test_the_engine_runs_without_prefect(tmp_path: Path) -> None:
    """A process that runs a whole run through the engine never imports Prefect."""
    with ScriptedModel(default=solver, models=("scripted",)) as model:
        code = textwrap.dedent(
            f"""
            import sys
            import engine
            from datasets_prep.task import Task
            tasks = [Task(id="a", domain="math", problem_statement="6*7?", ground_truth="42")]
            r = engine.run(tasks, engine.RunSpec(task_set="one", mode="llm", model="scripted",
                           base_url={model.url!r}, warehouse={str(tmp_path / "wh")!r}))
            assert r.summary["succeeded"] == 1, r.summary
            bad = sorted(m for m in sys.modules if m.split(".")[0] in ("prefect", "prefect_dask", "dask"))
            print("PREFECT", bad)
            """
        )
        proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                              env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": str(tmp_path)})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "PREFECT []" in proc.stdout, proc.stdout


def test_infrastructure_failures_are_retried_and_model_results_are_not(tmp_path: Path) -> None:
    """One episode's first attempt hits a 503 (model_error: infrastructure): retried under
    the run's policy, the latest attempt recorded. A model that answers nothing useful is
    a result, never retried."""
    wh, rid = tmp_path / "wh", new_run_id("engine-retry")
    failed_once: set[str] = set()
    lock = threading.Lock()

    def answer(body: dict, index: int) -> Reply | Fault:
        prompt = body["messages"][-1]["content"]
        with lock:
            if "t0" in prompt and "t0" not in failed_once:
                failed_once.add("t0")
                return Fault.server_error(503)
        return text_reply(ANSWER)

    with ScriptedModel(default=answer, models=("scripted",)) as model:
        result = engine.run(tiny_tasks(2), spec(model, wh, run_id=rid, retries=1))
        sent = len(model.requests)
    assert result.summary["succeeded"] == 2 and result.summary["failed"] == 0
    assert sent == 3  # t0 twice (503, then its retry), t1 once
    assert sorted(episodes_of(wh, rid).values()) == ["submitted", "submitted"]


def test_an_episode_failing_every_attempt_fails_the_run(tmp_path: Path) -> None:
    """After the last attempt the episode is a failure of the run (its record says
    model_error); a run whose episodes all failed says so: status failed, all_failed."""
    wh, rid = tmp_path / "wh", new_run_id("engine-allfail")
    with ScriptedModel(default=Fault.server_error(503), models=("scripted",)) as model:
        result = engine.run(tiny_tasks(2), spec(model, wh, run_id=rid, retries=1))
        sent = len(model.requests)
    s = result.summary
    assert (s["succeeded"], s["failed"], s["status"]) == (0, 2, "failed")
    assert result.all_failed
    assert sent == 4  # two attempts each: the policy's retries=1
    assert all("model_error" in line for line in s["failures"]), s["failures"]
    assert sorted(episodes_of(wh, rid).values()) == ["model_error", "model_error"]
    from warehouse import Warehouse

    assert Warehouse(wh).run_info(rid)["status"] == "failed"  # type: ignore[index]


def test_a_global_limit_whose_service_fails_is_an_infrastructure_failure(tmp_path: Path) -> None:
    """Issue #37: a global limit's service failing (Prefect's API answering 500 while its
    database restarts) failed the episode unretried. Taking a sandbox slot or a model-call
    slot fails once each, giving one back fails once: both attempts are retried under the
    run's policy, the failed give-back is only logged; every episode submitted.
    (tests/chaos/test_orchestrator_outage.py does it with a real Prefect server.)"""
    import contextlib
    from collections import Counter

    from engine.slots import MODEL_LIMIT, SANDBOX_LIMIT

    calls: Counter[str] = Counter()
    lock = threading.Lock()

    @contextlib.contextmanager
    def flaky(name: str, timeout_s: float | None) -> Any:
        with lock:
            calls[name] += 1
            n = calls[name]
        if n == 1:
            raise RuntimeError(f"Unable to acquire concurrency slots on [{name!r}]: 500")
        yield
        if n == 2:
            raise RuntimeError("decrement-with-lease: 500")

    wh, rid = tmp_path / "wh", new_run_id("engine-gcl")
    with ScriptedModel(default=solver, models=("scripted",)) as model:
        result = engine.run(tiny_tasks(2), spec(model, wh, run_id=rid, mode="both", retries=2,
                                                concurrency=1), global_limit=flaky)  # fmt: skip
    s = result.summary
    assert (s["succeeded"], s["failed"], s["status"]) == (4, 0, "finished"), s["failures"]
    assert calls[SANDBOX_LIMIT] >= 3 and calls[MODEL_LIMIT] >= 3, calls  # the failed ones again
    assert sorted(episodes_of(wh, rid).values()) == ["submitted"] * 4


def test_the_retry_policy_is_one_definition() -> None:
    assert {"sandbox_error", "model_error"} == engine.RETRYABLE
    assert not engine.is_retryable("max_steps") and not engine.is_retryable("interrupted")
    policy = RetryPolicy(retries=3, delay_s=2.0, max_delay_s=5.0)
    assert policy.attempts == 4 and policy.delays() == [2.0, 4.0, 5.0]
    assert policy.prefect_task_options()["retries"] == 3
    from rl import batch

    assert not hasattr(batch, "RETRYABLE")  # the rollout server uses the engine's


def test_a_cancel_token_stops_the_run_and_its_record_says_interrupted(tmp_path: Path) -> None:
    """Cancelled while the first episode waits for the model: it stops at its next step
    (recorded interrupted), the others never start, nothing is retried, and the run's
    record is `interrupted`, not left `running`."""
    wh, rid = tmp_path / "wh", new_run_id("engine-cancel")
    token = CancelToken()
    asked = threading.Event()

    def slow(body: dict, index: int) -> Reply:
        asked.set()
        return Reply(content=ANSWER, delay_s=1.0)

    with ScriptedModel(default=slow, models=("scripted",)) as model:
        threading.Thread(target=lambda: asked.wait(30) and token.cancel("budget reached"), daemon=True).start()
        result = engine.run(tiny_tasks(3), spec(model, wh, run_id=rid, concurrency=1), cancel=token)
        sent = len(model.requests)
    s = result.summary
    assert s["status"] == "interrupted" and s["cancel_reason"] == "budget reached"
    assert sent == 1
    assert s["cancelled"] == 3 and s["succeeded"] == 0 and s["failed"] == 0
    assert list(episodes_of(wh, rid).values()) == ["interrupted"]
    from warehouse import Warehouse

    info = Warehouse(wh).run_info(rid)
    assert info is not None and info["status"] == "interrupted"
    assert "budget reached" in (info.get("notes") or "")


@pytest.mark.usefixtures("sandbox_image")
def test_cancel_stops_sandbox_episodes_mid_command_and_removes_their_sandboxes(tmp_path: Path) -> None:
    """Sandbox episodes: a command in flight (sleep 30) when the token is cancelled; a
    callback removes the sandbox (as the rollout server does), the episode ends
    `interrupted`, not sandbox_error, and is not retried; no container is left."""
    wh, rid = tmp_path / "wh", new_run_id("engine-cancel-sb")
    token = CancelToken()
    running = threading.Event()

    def sleeper(body: dict, index: int) -> Reply:
        from tests.scripted_model import tool_reply

        running.set()
        return tool_reply("execute_bash", {"command": "sleep 30"})

    def kill_sandboxes(reason: str) -> None:
        from sandbox import registry

        for box in registry.live():
            if getattr(getattr(box, "config", None), "run_id", None) == rid:
                box.kill()

    token.on_cancel(kill_sandboxes)
    with ScriptedModel(default=sleeper, models=("scripted",)) as model:
        threading.Thread(target=lambda: running.wait(60) and token.cancel("trainer left"), daemon=True).start()
        result = engine.run(tiny_tasks(2), spec(model, wh, run_id=rid, mode="sandbox", retries=2), cancel=token)
    s = result.summary
    assert s["status"] == "interrupted" and s["failed"] == 0, s
    assert set(episodes_of(wh, rid).values()) == {"interrupted"}
    assert containers_of(rid) == []


def test_progress_events_tell_every_renderer_the_same_story(tmp_path: Path) -> None:
    events: list[tuple[str, dict]] = []
    unsubscribe = progress.subscribe(lambda kind, data: events.append((kind, data)))
    rid = new_run_id("engine-progress")
    try:
        with ScriptedModel(default=solver, models=("scripted",)) as model:
            engine.run(tiny_tasks(2), spec(model, None, run_id=rid), executor=ThreadExecutor(1))
    finally:
        unsubscribe()
    keys = {ep.key for ep in engine.plan(tiny_tasks(2), rid, "llm", 1)}
    mine = [(k, d) for k, d in events if d.get("run_id") == rid or d.get("key") in keys]
    assert mine[0] == ("planned", {"total": 2, "skipped": 0, "run_id": rid})
    assert [k for k, _ in mine[1:]] == ["started", "finished", "started", "finished"]
    assert all(d["ok"] for k, d in mine if k == "finished")


def test_bad_parameters_are_one_sentence_before_any_work(tmp_path: Path) -> None:
    with ScriptedModel(default=solver, models=("scripted",)) as model:
        with pytest.raises(engine.RunConfigError, match="--samples 0"):
            engine.run(tiny_tasks(1), spec(model, tmp_path / "wh", samples=0))
        with pytest.raises(engine.RunConfigError, match="does not serve model 'nope'"):
            engine.run(tiny_tasks(1), spec(model, tmp_path / "wh", model="nope"))
        assert model.requests == []


def test_the_embedded_models_defaults_fill_only_what_the_caller_was_not_told() -> None:
    """`bench` without an endpoint keeps its demo short, in the library (not the command):
    4 steps, one episode at a time, 256 tokens; what the user said wins; an endpoint
    changes nothing."""
    from engine.plan import embedded_model_defaults
    from tasks.defaults import DEFAULT_MAX_STEPS, EMBEDDED_MODEL_MAX_STEPS

    spec = RunSpec(task_set="smoke")
    short = embedded_model_defaults(spec, told=())
    assert (short.limits.max_steps, short.fanout.concurrency, short.sampling.max_tokens) == (EMBEDDED_MODEL_MAX_STEPS, 1, 256)
    told = embedded_model_defaults(RunSpec(task_set="smoke", max_steps=9, max_tokens=700), {"max_steps", "max_tokens"})
    assert (told.limits.max_steps, told.fanout.concurrency, told.sampling.max_tokens) == (9, 1, 700)
    remote = RunSpec(task_set="smoke", base_url="http://127.0.0.1:9/v1")
    assert embedded_model_defaults(remote, told=()) == remote
    assert remote.limits.max_steps == DEFAULT_MAX_STEPS and remote.fanout.concurrency == 4
