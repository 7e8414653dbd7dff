"""`sandflow export inspect`: one .eval per mode that inspect-ai's own reader opens, with
the warehouse's episodes as samples: messages, tool calls, scores, usage and results."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.interop.conftest import RealRun, run_cli

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
