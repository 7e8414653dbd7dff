"""`sandflow export inspect`: one .eval per mode that inspect-ai's own reader opens, with
the warehouse's episodes as samples: messages, tool calls, scores, usage and results.
Every public reader of inspect-ai's log API reads it: `read_eval_log`,
`read_eval_log_samples`, `read_eval_log_sample_summaries`, and `inspect_ai.analysis`'s
`evals_df`, `samples_df`, `messages_df`, `events_df`; `inspect view`'s server lists and
serves it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.interop.conftest import RealRun, peer_folder, peer_problem, run_cli

pytestmark = pytest.mark.usefixtures("prefect_harness")


def test_logs_read_back_with_inspect(real_run: RealRun, run_data: Any, tmp_path: Path) -> None:
    from inspect_ai.log import read_eval_log, read_eval_log_sample_summaries

    out = tmp_path / "logs"
    res = run_cli("export", "inspect", real_run.run_id, "--out", str(out), "-w", str(real_run.warehouse))
    assert res.exit_code == 0, res.output
    assert "inspect: 6 episodes -> 2 files" in res.output
    assert "not carried over: token ids and logprobs" in res.output
    logs = sorted(out.glob("*.eval"))
    assert [p.name for p in logs] == [f"{real_run.run_id}_llm.eval", f"{real_run.run_id}_sandbox.eval"]
    for path in logs:
        log = read_eval_log(str(path))
        mode = log.eval.task_args["mode"]
        eps = {(e.task_id, e.sample_index + 1): e for e in run_data.episodes if e.mode == mode}
        assert log.status == "success" and log.eval.task == f"tiny-{mode}"
        assert log.eval.dataset.samples == len(eps) == len(log.samples) == 3
        assert log.eval.model == "scripted"
        scored = []
        for s in log.samples:
            ep = eps[(s.id, s.epoch)]
            turns = run_data.turns_of(ep.episode_id)
            want_msgs = len(ep.prompt_messages) + sum(1 + len(t.observations) + len(t.extra_messages) for t in turns)
            assert len(s.messages) == want_msgs
            assistants = [m for m in s.messages if m.role == "assistant"]
            assert [[c.function for c in (m.tool_calls or [])] for m in assistants] == [[c.name for c in t.tool_calls] for t in turns]
            for m, t in zip(assistants, turns, strict=True):
                for c, rec in zip(m.tool_calls or [], t.tool_calls, strict=True):
                    if c.parse_error:  # the model's non-JSON arguments: named, raw text kept
                        assert rec.arguments in c.parse_error and c.arguments == {}
                    else:
                        assert c.arguments == json.loads(rec.arguments)
            tools = [m for m in s.messages if m.role == "tool"]
            assert [m.text for m in tools] == [o.content for t in turns for o in t.observations]
            assert [m.tool_call_id for m in tools] == [o.tool_call_id for t in turns for o in t.observations]
            usage = s.model_usage["scripted"]
            assert (usage.input_tokens, usage.output_tokens) == (ep.prompt_tokens, ep.completion_tokens)
            assert usage.input_tokens_cache_read == ep.cached_tokens
            score = run_data.scores[ep.episode_id]
            assert s.scores[score.verifier].value == score.score and s.target == "42"
            assert s.metadata["episode_id"] == ep.episode_id and s.metadata["termination"] == ep.termination
            assert s.output.completion == (ep.answer or "")
            scored.append(score.score)
        acc = log.results.scores[0].metrics["accuracy"].value
        assert acc == pytest.approx(sum(scored) / len(scored)) and 0 < acc < 1  # t1 was wrong
        assert log.results.total_samples == 3
        total = sum(e.prompt_tokens for e in eps.values())
        assert log.stats.model_usage["scripted"].input_tokens == total
        # what `inspect view` lists first: the header and the sample summaries, without samples
        head = read_eval_log(str(path), header_only=True)
        assert head.samples is None and head.results.total_samples == 3
        summaries = read_eval_log_sample_summaries(str(path))
        assert sorted((x.id, x.epoch) for x in summaries) == sorted(eps)
    sandbox = read_eval_log(str(out / f"{real_run.run_id}_sandbox.eval"))
    first = next(m for m in sandbox.samples[0].messages if m.role == "assistant")
    assert any(getattr(c, "reasoning", None) == "First look at the input files." for c in first.content)


def test_inspect_view_lists_and_serves_the_logs(real_run: RealRun, tmp_path: Path) -> None:
    """`inspect view` opens them: its own server app (the one `inspect view` runs) lists
    both logs with their tasks and serves each one's header and samples."""
    from fastapi.testclient import TestClient
    from inspect_ai._view.fastapi_server import view_server_app

    out = tmp_path / "logs"
    res = run_cli("export", "inspect", real_run.run_id, "--out", str(out), "-w", str(real_run.warehouse))
    assert res.exit_code == 0, res.output
    client = TestClient(view_server_app(default_dir=str(out)))
    listing = client.get("/logs")
    assert listing.status_code == 200, listing.text
    files = listing.json()["files"]
    assert sorted(f["task"] for f in files) == ["tiny-llm", "tiny-sandbox"]
    for f in files:
        log = client.get(f"/logs/{f['name']}")
        assert log.status_code == 200, log.text[:500]
        body = log.json()
        assert body["status"] == "success" and body["results"]["total_samples"] == 3
        assert len(body["samples"]) == 3 and {s["id"] for s in body["samples"]} == {"t0", "t1", "t2"}


def test_every_reader_of_the_log_api_reads_the_export(real_run: RealRun, run_data: Any, tmp_path: Path) -> None:
    """read_eval_log_samples (needs the header's sample ids and epochs), evals_df (the
    headline), samples_df, messages_df (needs message ids), events_df (needs events: a
    model event per turn with its input, a tool event per call, a score event)."""
    import warnings

    from inspect_ai.analysis import (
        EventInfo,
        EventTiming,
        ModelEventColumns,
        ToolEventColumns,
        evals_df,
        events_df,
        messages_df,
        samples_df,
    )
    from inspect_ai.log import read_eval_log, read_eval_log_samples

    from analysis.metrics import ALL, accuracy

    out = tmp_path / "logs"
    res = run_cli("export", "inspect", real_run.run_id, "--out", str(out), "-w", str(real_run.warehouse))
    assert res.exit_code == 0, res.output
    warnings.filterwarnings("ignore", module="inspect_ai")
    by_key = {(e.mode, e.task_id, e.sample_index + 1): e for e in run_data.episodes}
    seen: set[str] = set()  # ids of the messages up to each sample's last model reply
    for path in sorted(out.glob("*.eval")):
        whole = read_eval_log(str(path))
        mode = whole.eval.task_args["mode"]
        streamed = list(read_eval_log_samples(str(path)))  # all_samples_required: every (id, epoch)
        assert sorted((s.id, s.epoch) for s in streamed) == sorted((s.id, s.epoch) for s in whole.samples)
        assert whole.eval.dataset.sample_ids == ["t0", "t1", "t2"] and whole.eval.config.epochs == 1
        for s in streamed:
            ep = by_key[(mode, s.id, s.epoch)]
            turns = run_data.turns_of(ep.episode_id)
            ids = [m.id for m in s.messages]
            assert len(set(ids)) == len(ids) and all(ids)
            model_events = [ev for ev in s.events if ev.event == "model"]
            tool_events = [ev for ev in s.events if ev.event == "tool"]
            assert len(model_events) == len(turns)
            assert [ev.id for ev in tool_events] == [o.tool_call_id for t in turns for o in t.observations]
            assert [ev.result for ev in tool_events] == [o.content for t in turns for o in t.observations]
            for ev, t in zip(model_events, turns, strict=True):  # the input: every message before the reply
                reply = ev.output.choices[0].message
                assert ev.input == s.messages[: ids.index(reply.id)]
                assert ev.output.usage.output_tokens == t.usage.completion_tokens
            last = max(i for i, m in enumerate(s.messages) if m.role == "assistant")
            seen.update(ids[: last + 1])
            score_events = [ev for ev in s.events if ev.event == "score"]
            assert [ev.score.value for ev in score_events] == [run_data.scores[ep.episode_id].score]
    want = {r["mode"]: r["accuracy"] / 100 for r in accuracy(run_data) if r["domain"] == ALL}

    evals = evals_df(str(out))
    assert len(evals) == 2
    for _, row in evals.iterrows():
        mode = row["task_arg_mode"]
        assert row["score_headline_name"] == "sandflow" and row["score_headline_metric"] == "accuracy"
        assert row["score_headline_value"] == pytest.approx(want[mode], abs=1e-3)

    samples = samples_df(str(out))
    assert len(samples) == len(run_data.episodes) == 6
    assert samples["score_sandflow"].notna().all()

    # messages_df rebuilds the conversation from the model events: every message a model
    # call saw, and its reply (so not the tool results after the last call, as in
    # Inspect's own logs)
    messages = messages_df(str(out))
    assert messages["message_id"].is_unique and set(messages["message_id"]) == seen
    assert set(messages["role"]) == {"system", "user", "assistant", "tool"}

    all_events = events_df(str(out))
    assert all_events["event_id"].is_unique
    models = events_df(str(out), columns=EventInfo + EventTiming + ModelEventColumns, filter=lambda e: e.event == "model")
    assert len(models) == sum(len(run_data.turns_of(e.episode_id)) for e in run_data.episodes)
    tools = events_df(str(out), columns=EventInfo + EventTiming + ToolEventColumns, filter=lambda e: e.event == "tool")
    assert set(tools["tool_event_function"]) == {"execute_bash", "str_replace_editor", "submit"}
    assert len(all_events) == len(models) + len(tools) + 6  # and one score event per sample


# --------------------------------------------- runs made without Docker: imported peer folders
_MIXED = [  # (verifier, ground truth, answer): only t3 is right
    ("choice_single", "B", "A"), ("choice_single", "C", "D"), ("exact", "42", "41"), ("exact", "7", "7"),
    ("exact", "9", "8"), ("math", "2", "3"), ("math", "4", "5"), ("math", "6", "1"),
    ("numeric", "3.5", "9"), ("numeric", "1", "2"), ("numeric", "10", "11"), ("numeric", "5", "6"),
]  # fmt: skip


def _import(tmp_path: Path, rows: list[tuple[str, str, str]], folders: int = 1) -> tuple[Path, str]:
    from datasets_prep.io import write_taskset
    from datasets_prep.task import Task, TaskSet

    tasks = [Task(id=f"t{i}", domain="math", problem_statement=f"q{i}", ground_truth=gt, verifier=v) for i, (v, gt, _a) in enumerate(rows)]
    ts_path = write_taskset(TaskSet.build(tasks, name="mixed"), tmp_path / "mixed.parquet")
    problems = {f"t{i}": {**peer_problem(answer=a), "problem_statement": f"q{i}", "ground_truth": gt} for i, (_v, gt, a) in enumerate(rows)}
    peer = tmp_path / "peer"
    peer_folder(peer, problems)
    for k in range(1, folders):  # another sandbox run of the first task only: its next sample
        peer_folder(peer, {"t0": problems["t0"]}, stamp=f"20261126_0300{k:02d}")
    src = peer if folders > 1 else next(peer.iterdir())
    wh = tmp_path / "wh"
    res = run_cli("import", "llm-in-sandbox", str(src), "--tasks", str(ts_path), "--run-id", "mixed", "-w", str(wh))
    assert res.exit_code == 0, res.output
    return wh, "mixed"


def test_the_headline_is_the_runs_accuracy_over_every_verifier(tmp_path: Path) -> None:
    """12 samples scored by 4 verifiers, one right: the log list's score (the headline
    `evals_df` and `inspect view` show) is 1/12 = 8.3%, as `sandflow` reports the run,
    not the first verifier's accuracy (0.0 over its 2 samples)."""
    import warnings

    from inspect_ai.analysis import evals_df
    from inspect_ai.log import read_eval_log

    from analysis.metrics import ALL, accuracy
    from warehouse import Warehouse

    warnings.filterwarnings("ignore", module="inspect_ai")
    wh, rid = _import(tmp_path, _MIXED)
    out = tmp_path / "logs"
    res = run_cli("export", "inspect", rid, "--out", str(out), "-w", str(wh))
    assert res.exit_code == 0, res.output
    run = [r for r in accuracy(Warehouse(wh).load_run(rid)) if r["domain"] == ALL]
    assert [r["accuracy"] for r in run] == [8.3]
    row = evals_df(str(out)).iloc[0]
    assert row["score_headline_name"] == "sandflow"
    assert row["score_headline_value"] == pytest.approx(1 / 12)
    log = read_eval_log(str(out / f"{rid}_sandbox.eval"), header_only=True)
    first = log.results.scores[0]
    assert (first.name, first.scored_samples, first.unscored_samples) == ("sandflow", 12, 0)
    per_verifier = {s.name: (s.scored_samples, s.metrics["accuracy"].value) for s in log.results.scores[1:]}
    assert per_verifier == {"choice_single": (2, 0.0), "exact": (3, pytest.approx(1 / 3)), "math": (3, 0.0), "numeric": (4, 0.0)}


def test_a_log_without_every_epoch_of_every_task_says_so(tmp_path: Path) -> None:
    """t0 has two samples, the other tasks one: Inspect's grid (sample ids x epochs) is not
    full, so the log is not "success" (which promises every sample); its own reader says
    so in one sentence and reads what there is when asked."""
    from inspect_ai.log import read_eval_log_samples

    wh, rid = _import(tmp_path, _MIXED[:3], folders=2)
    out = tmp_path / "logs"
    res = run_cli("export", "inspect", rid, "--out", str(out), "-w", str(wh))
    assert res.exit_code == 0, res.output
    path = str(out / f"{rid}_sandbox.eval")
    with pytest.raises(RuntimeError, match="does not have all samples"):
        list(read_eval_log_samples(path))
    got = sorted((s.id, s.epoch) for s in read_eval_log_samples(path, all_samples_required=False))
    assert got == [("t0", 1), ("t0", 2), ("t1", 1), ("t2", 1)]
