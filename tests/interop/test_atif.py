"""`sandflow export atif`: every episode of a real run becomes one ATIF trajectory that
harbor's own validator accepts, carrying the warehouse's messages, tool calls,
observations, token counts, token ids and logprobs exactly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from interop.atif import ATIF_VERSION
from interop.names import safe_name
from tests.interop.conftest import RealRun, harbor_check, run_cli

pytestmark = pytest.mark.usefixtures("prefect_harness")


def _export(real_run: RealRun, out: Path, *extra: str) -> str:
    res = run_cli("export", "atif", real_run.run_id, "--out", str(out), "-w", str(real_run.warehouse), *extra)
    assert res.exit_code == 0, res.output
    return res.output


def _expected_steps(ep: Any, turns: list[Any]) -> int:
    return len(ep.prompt_messages) + sum(1 + len(t.extra_messages) for t in turns)


def test_every_episode_carried_over(real_run: RealRun, run_data: Any, tmp_path: Path) -> None:
    out = tmp_path / "atif"
    line = _export(real_run, out)
    assert f"atif: {len(run_data.episodes)} episodes -> {len(run_data.episodes)} files" in line
    assert "not carried over: cost_usd" in line  # named, not silently dropped
    assert len(list(out.glob("*.json"))) == len(run_data.episodes) == 6
    for ep in run_data.episodes:
        doc = json.loads((out / safe_name(ep.episode_id, ".json")).read_text())
        turns = run_data.turns_of(ep.episode_id)
        assert doc["schema_version"] == ATIF_VERSION
        assert doc["trajectory_id"] == ep.episode_id and doc["session_id"] == real_run.run_id
        assert len(doc["steps"]) == _expected_steps(ep, turns)
        assert [s["step_id"] for s in doc["steps"]] == list(range(1, len(doc["steps"]) + 1))
        agent = [s for s in doc["steps"] if s["source"] == "agent"]
        assert len(agent) == len(turns) >= 1
        for step, t in zip(agent, turns, strict=True):
            calls = step.get("tool_calls") or []
            assert [c["tool_call_id"] for c in calls] == [c.id for c in t.tool_calls]
            assert [c["function_name"] for c in calls] == [c.name for c in t.tool_calls]
            for c, rec in zip(calls, t.tool_calls, strict=True):
                try:
                    assert c["arguments"] == json.loads(rec.arguments)
                except ValueError:  # the model's non-JSON arguments: {} and the raw text kept
                    assert c["arguments"] == {} and c["extra"]["raw_arguments"] == rec.arguments
            results = (step.get("observation") or {}).get("results", [])
            assert [r["content"] for r in results] == [o.content for o in t.observations]
            assert [r["extra"].get("exit_code") for r in results] == [o.exit_code for o in t.observations]
            m = step["metrics"]
            assert m["prompt_tokens"] == t.usage.prompt_tokens and m["completion_tokens"] == t.usage.completion_tokens
            assert m["completion_token_ids"] == t.completion_token_ids and m["logprobs"] == t.completion_logprobs
            assert m["prompt_token_ids"] == t.prompt_token_ids  # full ids, rebuilt from the stored deltas
            assert step.get("reasoning_content") == (t.reasoning_content or None)
        fm = doc["final_metrics"]
        assert (fm["total_prompt_tokens"], fm["total_completion_tokens"]) == (ep.prompt_tokens, ep.completion_tokens)
        assert fm["total_steps"] == len(doc["steps"])
        assert doc["extra"]["score"] == run_data.scores[ep.episode_id].score
        assert doc["extra"]["termination"] == ep.termination and doc["extra"]["answer"] == ep.answer
    # the run's model really made a non-JSON call and thought aloud: both were exported
    texts = [p.read_text() for p in out.glob("*.json")]
    assert any('"raw_arguments"' in t for t in texts) and any("First look at the input files." in t for t in texts)


def test_one_episode_and_unknown_ones(real_run: RealRun, run_data: Any, tmp_path: Path) -> None:
    eid = run_data.episodes[0].episode_id
    _export(real_run, tmp_path / "one", "--episode", eid)
    assert [p.name for p in (tmp_path / "one").iterdir()] == [safe_name(eid, ".json")]
    for bad in ("nope", "../" + eid, "x' OR '1'='1"):
        res = run_cli("export", "atif", real_run.run_id, "--episode", bad, "-o", str(tmp_path / "bad"), "-w", str(real_run.warehouse))
        assert res.exit_code == 2, res.output
        assert f"has no episode {bad!r}" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "bad").exists()  # nothing written for bad input
    res = run_cli("export", "atif", "no-such-run", "-o", str(tmp_path / "bad"), "-w", str(real_run.warehouse))
    assert res.exit_code == 2 and "run 'no-such-run' has no episodes" in res.output


@pytest.mark.slow
def test_valid_under_harbor(real_run: RealRun, run_data: Any, harbor_python: Path, tmp_path: Path) -> None:
    """harbor's TrajectoryValidator and Trajectory model accept every file, at the newest
    ATIF version harbor knows, and read back the warehouse's tool calls and token figures."""
    out = tmp_path / "atif"
    _export(real_run, out)
    got = harbor_check(harbor_python, out)
    assert got["newest"] == ATIF_VERSION
    assert len(got["files"]) == len(run_data.episodes)
    for ep in run_data.episodes:
        f = got["files"][safe_name(ep.episode_id, ".json")]
        assert f["valid"] and not f["errors"], f["errors"]
        assert f["version"] == ATIF_VERSION and f["trajectory_id"] == ep.episode_id
        turns = run_data.turns_of(ep.episode_id)
        agent = [s for s in f["steps"] if s["source"] == "agent"]
        assert [[c[1] for c in s["calls"]] for s in agent] == [[c.name for c in t.tool_calls] for t in turns]
        assert [[r[1] for r in s["results"]] for s in agent] == [[o.content for o in t.observations] for t in turns]
        assert sum(s["metrics"]["completion_tokens"] for s in agent) == ep.completion_tokens
        assert [s["metrics"]["logprobs"] for s in agent] == [t.completion_logprobs for t in turns]
        assert f["final"]["total_prompt_tokens"] == ep.prompt_tokens
