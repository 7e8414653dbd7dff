"""The pipeline for real: Prefect (the session harness), Docker, DuckDB, HTTP to a scripted model.

- `sandflow bench` end to end: prepare -> run (both modes) -> score -> usage -> tokens ->
  rollouts -> report, then the SQL it suggests works.
- resume after an interrupted run: finished episodes skipped, nothing recorded twice,
  no model call repeated, no container left.
- infrastructure failures retried as Prefect task retries; a model's own failure is a result.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from tests.flows.conftest import (
    ANSWER,
    containers_of,
    new_run_id,
    run_kwargs,
    solver,
    tiny_tasks,
    write_tasks,
)
from tests.scripted_model import Fault, ScriptedModel

pytestmark = pytest.mark.usefixtures("prefect_harness", "docker_image")


def _query(warehouse: Path, sql: str) -> list[tuple[Any, ...]]:
    from warehouse.query import connect

    with connect(warehouse) as q:
        return q.con.execute(sql).fetchall()


def _thread_runner(n: int = 2) -> Any:
    from prefect.task_runners import ThreadPoolTaskRunner

    return ThreadPoolTaskRunner(max_workers=n)


def test_bench_end_to_end(tmp_path: Path, model: ScriptedModel) -> None:
    from sandflow.cli import app

    ts = write_tasks(tmp_path / "tiny.parquet", tiny_tasks(3))
    wh = tmp_path / "wh"
    res = CliRunner(env={"COLUMNS": "300"}).invoke(
        app,
        ["bench", "--suite", str(ts), "--base-url", model.url, "--model", "scripted",
         "--warehouse", str(wh), "--concurrency", "2", "--max-steps", "6"],
    )  # fmt: skip
    assert res.exit_code == 0, res.output + repr(res.exception)
    out = res.output
    rid = re.search(r"run (\S+): 6 episodes recorded, 0 failed", out)
    assert rid, out
    run_id = rid.group(1)
    report = re.search(r"Report: (\S+report\.html)", out.replace("\n", ""))
    assert report and Path(report.group(1)).exists(), out
    hints = re.findall(r"sandflow sql --warehouse \S+ \"(SELECT [^\"]+)\"", out)
    assert len(hints) == 3, out
    for sql in hints:  # the suggested queries run and return rows
        assert _query(wh, sql), sql
    rows = _query(wh, f"SELECT mode, count(*), avg(score) FROM episodes JOIN scores USING (run_id, episode_id) "
                      f"WHERE run_id = '{run_id}' GROUP BY mode ORDER BY mode")
    assert rows == [("llm", 3, 1.0), ("sandbox", 3, 1.0)]
    caps = dict(_query(wh, f"SELECT capability, count(*) FROM usage WHERE run_id = '{run_id}' GROUP BY 1"))
    assert caps["computation"] == 3 and caps["file_management"] >= 6 and "none" in caps
    exports = wh / "exports" / run_id
    from datasets import load_dataset

    traj = load_dataset("parquet", data_files=str(exports / "trajectories.parquet"), split="train")
    assert len(traj) == 6 and set(traj["reward"]) == {1.0}
    task_rows = load_dataset("parquet", data_files=str(exports / "taskset.parquet"), split="train")
    assert len(task_rows) == 3 and task_rows[0]["reward_model"]["ground_truth"] == ANSWER
    assert containers_of(run_id) == []
    # the report is in the Prefect UI too: a Markdown artifact and one table per section
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from flows.artifacts import artifact_key

    keys = [artifact_key(k, run_id) for k in ("report", "accuracy", "usage", "tokens", "turns", "terminations")]
    with get_client(sync_client=True) as client:
        arts = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=keys)))
    by_key = {a.key: a for a in arts}
    assert set(keys) <= set(by_key), sorted(by_key)
    assert by_key[keys[0]].type == "markdown" and "Accuracy by domain x mode" in str(by_key[keys[0]].data)
    assert by_key[keys[1]].type == "table"


def test_resume_after_interruption(tmp_path: Path, model: ScriptedModel) -> None:
    """Some episodes recorded, one killed mid-episode (journal left), then the same run id again."""
    from engine.episode import run_one
    from engine.plan import plan
    from flows.run import run_flow
    from tasks.records import EpisodeRecord, TurnRecord
    from tasks.spec import RunSpec
    from warehouse.writer import EpisodeWriter

    tasks = tiny_tasks(3)
    ts = write_tasks(tmp_path / "tiny.parquet", tasks)
    wh = tmp_path / "wh"
    rid = new_run_id("resume")
    specs = plan(tasks, rid, "both", 1)
    settings = RunSpec(
        model="scripted",
        base_url=model.url,
        max_steps=6,
        warehouse=str(wh),
    )
    # "Before the crash": two episodes finished and recorded ...
    for spec in specs[:2]:
        assert run_one(spec, settings).termination == "submitted"
    # ... and a third was killed mid-episode: its journal holds one turn, no Parquet.
    killed = specs[2]
    w = EpisodeWriter(wh)
    w.start_episode(EpisodeRecord(run_id=rid, episode_id=killed.key, task_id=killed.task.id, domain="math",
                                  mode=killed.mode, model="scripted", started_at=_now()))  # type: ignore[arg-type]
    w.record_turn(TurnRecord(run_id=rid, episode_id=killed.key, turn_index=0, started_at=_now()))
    w.abandon(rid, killed.key)
    calls_before = len(model.requests)

    summary = run_flow.with_options(task_runner=_thread_runner())(**run_kwargs(ts, model, wh, run_id=rid))
    assert summary["skipped"] == 2 and summary["ran"] == 4 and summary["succeeded"] == 4
    # Only the 4 remaining episodes talked to the model: 2 sandbox (4 calls each) + 2 LLM (1 each)?
    remaining = specs[2:]
    expected = sum(4 if s.mode == "sandbox" else 1 for s in remaining)
    assert len(model.requests) - calls_before == expected
    rows = _query(wh, f"SELECT count(*), count(DISTINCT episode_id) FROM episodes WHERE run_id = '{rid}'")
    assert rows == [(6, 6)]
    raw = _query(wh, f"SELECT episode_id, count(*) FROM _raw_episodes WHERE run_id = '{rid}' GROUP BY 1 HAVING count(*) > 1")
    assert raw == [], f"an episode was stored twice: {raw}"
    assert _query(wh, f"SELECT termination FROM episodes WHERE episode_id = '{killed.key}'") == [("submitted",)]
    # Running it once more does nothing at all.
    calls = len(model.requests)
    again = run_flow.with_options(task_runner=_thread_runner())(**run_kwargs(ts, model, wh, run_id=rid))
    assert again["skipped"] == 6 and again["ran"] == 0 and len(model.requests) == calls
    assert containers_of(rid) == []


def _now() -> Any:
    from datetime import UTC, datetime

    return datetime.now(UTC)


def test_infra_failures_are_retried_and_model_failures_are_results(tmp_path: Path) -> None:
    from flows.run import run_flow

    tasks = tiny_tasks(3)
    ts = write_tasks(tmp_path / "tiny.parquet", tasks)
    wh = tmp_path / "wh"
    seen: dict[str, int] = {}

    def flaky(body: dict, index: int) -> Any:
        text = str(body["messages"][1]["content"])
        first_turn = sum(1 for m in body["messages"] if m["role"] == "assistant") == 0
        if "Task t0" in text and first_turn:
            seen["t0"] = seen.get("t0", 0) + 1
            if seen["t0"] == 1:  # the endpoint fails once (400: not retried by the client)
                return Fault.server_error(400)
        if "Task t1" in text:  # the endpoint always fails for t1
            return Fault.server_error(400)
        if "Task t2" in text:  # the model never submits: its own failure
            return solver({"tools": [1], "messages": []}, index)
        return solver(body, index)

    with ScriptedModel(default=flaky, models=("scripted",)) as server:
        rid = new_run_id("retry")
        summary = run_flow.with_options(task_runner=_thread_runner())(
            **run_kwargs(ts, server, wh, run_id=rid, mode="sandbox", max_steps=4, retries=1)
        )
    assert summary["succeeded"] == 2 and summary["failed"] == 1, summary
    assert "t1/sandbox/0" in summary["failures"][0]
    assert seen["t0"] == 2  # retried once, then fine
    terms = dict(_query(wh, f"SELECT task_id, termination FROM episodes WHERE run_id = '{rid}'"))
    assert terms == {"t0": "submitted", "t1": "model_error", "t2": "max_steps"}
    from warehouse import Warehouse

    assert len(Warehouse(wh).done_keys(rid)) == 2  # t1 is re-run on resume
    assert containers_of(rid) == []


def test_ctrl_c_stops_episodes_at_a_turn_boundary_and_resume_finishes(tmp_path: Path) -> None:
    """Ctrl+C mid-run: in-flight episodes end as `interrupted` with their sandbox closed,
    queued ones never start, the run resumes with the same id, no container is left."""
    import os
    import signal
    import threading

    from flows.run import run_flow
    from warehouse import Warehouse

    ts = write_tasks(tmp_path / "tiny.parquet", tiny_tasks(6))
    wh = tmp_path / "wh"
    rid = new_run_id("ctrlc")
    fired = threading.Event()

    def slow(body: dict, index: int) -> Any:
        reply = solver(body, index)
        reply.delay_s = 0.3
        if index == 5 and not fired.is_set():  # a few turns into the first episodes
            fired.set()
            threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGINT)).start()
        return reply

    # Ctrl+C raises KeyboardInterrupt only where SIGINT is not ignored: a suite started as a
    # background job of a non-interactive shell inherits SIGINT ignored.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    with ScriptedModel(default=slow, models=("scripted",)) as server:
        kwargs = run_kwargs(ts, server, wh, run_id=rid, mode="sandbox", concurrency=2)
        try:
            with pytest.raises(KeyboardInterrupt):
                run_flow.with_options(task_runner=_thread_runner())(**kwargs)
        finally:
            signal.signal(signal.SIGINT, previous)
        assert containers_of(rid) == []
        terms = _query(wh, f"SELECT termination, count(*) FROM episodes WHERE run_id = '{rid}' GROUP BY 1")
        assert dict(terms).get("interrupted", 0) >= 1, terms
        assert sum(n for _, n in terms) < 6  # queued episodes never started
        done_before = len(Warehouse(wh).done_keys(rid))
        summary = run_flow.with_options(task_runner=_thread_runner())(**kwargs)
    assert summary["skipped"] == done_before and summary["succeeded"] == 6 - done_before
    assert len(Warehouse(wh).done_keys(rid)) == 6
    assert _query(wh, f"SELECT count(*), count(DISTINCT episode_id) FROM episodes WHERE run_id = '{rid}'") == [(6, 6)]
    assert containers_of(rid) == []


def _ids(text: str) -> list[int]:
    """A toy tokenizer: one id per character (deterministic, so prefixes line up)."""
    return [ord(c) % 5000 + 1 for c in text]


def _message_ids(m: dict) -> list[int]:
    if m.get("role") == "assistant":
        calls = m.get("tool_calls") or []
        return _ids("".join(c["function"]["name"] + c["function"]["arguments"] for c in calls) + (m.get("content") or ""))
    return _ids(f"<{m.get('role')}>{m.get('content') or ''}")


def test_token_ids_flow_into_token_level_rollouts(tmp_path: Path) -> None:
    """A server that returns exact token ids (as vLLM does): the run records them, and the
    rollouts flow rebuilds prompt/response ids with the environment's tokens masked."""
    from datasets import load_dataset

    from flows.rollouts import rollouts_flow
    from flows.run import run_flow
    from flows.score import score_flow

    def with_ids(body: dict, index: int) -> Any:
        reply = solver(body, index)
        prompt = [i for m in body["messages"] for i in _message_ids(m)]
        args = reply.tool_calls[0]["function"]
        completion = _ids(args["name"] + args["arguments"])
        reply.prompt_token_ids = prompt
        reply.completion_token_ids = completion
        reply.logprobs = [-0.5] * len(completion)
        reply.usage = {"prompt_tokens": len(prompt), "completion_tokens": len(completion),
                       "total_tokens": len(prompt) + len(completion)}
        return reply

    ts = write_tasks(tmp_path / "tiny.parquet", tiny_tasks(2))
    wh = tmp_path / "wh"
    rid = new_run_id("tokens")
    with ScriptedModel(default=with_ids, models=("scripted",)) as server:
        run_flow.with_options(task_runner=_thread_runner())(
            **run_kwargs(ts, server, wh, run_id=rid, mode="sandbox", samples=2, logprobs=True, return_token_ids=True)
        )
    score_flow(run_id=rid, warehouse=str(wh))
    out = rollouts_flow(run_id=rid, warehouse=str(wh))
    assert out["token_rows"] == 4 and out["token_mismatches"] == 0, out
    rows = load_dataset("parquet", data_files=out["files"]["tokens"], split="train")
    for r in rows:
        mask, resp, lps = r["response_mask"], r["response_ids"], r["response_logprobs"]
        assert len(mask) == len(resp) == len(lps) and 0 in mask and 1 in mask
        assert all(lp == -0.5 for lp, m in zip(lps, mask, strict=True) if m == 1)
        assert all(lp == 0.0 for lp, m in zip(lps, mask, strict=True) if m == 0)
        assert r["prompt_ids"][: len(_ids("<system>"))] == _ids("<system>")
        assert r["reward"] == 1.0 and r["advantage_rloo"] == 0.0  # both samples right: no signal
    traj = load_dataset("parquet", data_files=out["files"]["trajectories"], split="train")
    assert len(traj) == 4 and set(traj["group_size"]) == {2}


def test_scores_exports_and_resume_use_the_tasks_the_run_ran(tmp_path: Path, model: ScriptedModel) -> None:
    """Issue #22: scoring and `flows rollouts` rebuilt the task set from its source, so a
    source that changed after the run (a file edited, a suite built differently) gave
    tasks the run never ran. The run keeps its tasks in the warehouse; readers use them."""
    import shutil

    import pyarrow.parquet as pq

    from datasets_prep.rows import task_from_row
    from datasets_prep.task import TaskSet
    from flows.rollouts import rollouts_flow
    from flows.run import run_flow
    from flows.score import ScoreError, score_flow
    from warehouse import Warehouse

    tasks = tiny_tasks(2)
    src = write_tasks(tmp_path / "tiny.parquet", tasks)
    wh = tmp_path / "wh"
    rid = new_run_id("kept")
    first = run_flow.with_options(task_runner=_thread_runner())(**run_kwargs(src, model, wh, run_id=rid, mode="llm"))
    ran = TaskSet.build(tasks).content_hash
    assert first["task_set_hash"] == ran
    kept = Warehouse(wh).run_tasks(rid)
    assert kept is not None and [t.content_hash for t in kept] == [t.content_hash for t in tasks]

    # the source changes after the run: other statements and ground truths under the same ids
    write_tasks(src, [t.model_copy(update={"problem_statement": "changed", "ground_truth": "41"}) for t in tasks])
    assert score_flow(run_id=rid, warehouse=str(wh))["mean_score"] == 1.0  # against 42, as run
    out = rollouts_flow(run_id=rid, warehouse=str(wh))
    rows = pq.read_table(out["files"]["taskset"]).to_pylist()
    assert [task_from_row(r).content_hash for r in rows] == [t.content_hash for t in tasks]
    # resuming the run goes on with its own tasks, not the changed source's
    again = run_flow.with_options(task_runner=_thread_runner())(**run_kwargs(src, model, wh, run_id=rid, mode="llm"))
    assert again["task_set_hash"] == ran and again["ran"] == 0

    # a run recorded before runs kept their tasks: its changed source is refused, not used
    shutil.rmtree(wh / "_tasks" / f"run_id={rid}")
    with pytest.raises(ScoreError, match=r"now gives \w+ \(changed since the run\)"):
        score_flow(run_id=rid, warehouse=str(wh))
