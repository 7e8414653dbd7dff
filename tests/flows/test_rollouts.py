"""RL exports: advantages hand-checked, loss masks, token rows, over-length filter, and
every export loads back with `datasets.load_dataset("parquet", ...)`."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from pathlib import Path

import pytest

from analysis.advantages import group_advantages, grpo, rloo
from analysis.rollouts import ExportStats, RolloutError, token_rows, trajectory_rows
from analysis.token_ids import assemble
from analysis.trajectory import TOKEN_SCHEMA, TRAJECTORY_SCHEMA
from datasets_prep.rows import row_schema, task_rows
from datasets_prep.task import Task
from tasks.records import EpisodeRecord, Observation, ToolCall, TurnRecord, Usage
from warehouse.exports import write_export
from warehouse.rundata import RunData

NOW = datetime(2026, 1, 1, tzinfo=UTC)
RUN = "pytest-rollouts"


def _ep(eid: str, task: str, sample: int, termination: str = "submitted", mode: str = "sandbox") -> EpisodeRecord:
    return EpisodeRecord(
        run_id=RUN,
        episode_id=eid,
        task_id=task,
        domain="math",
        mode=mode,  # type: ignore[arg-type]
        sample_index=sample,
        model="m",
        started_at=NOW,
        termination=termination,  # type: ignore[arg-type]
        prompt_messages=[{"role": "system", "content": "sys"}, {"role": "user", "content": "q"}],
        prompt_tokens=100,
        completion_tokens=20,
    )


def _turns(eid: str) -> list[TurnRecord]:
    return [
        TurnRecord(
            run_id=RUN,
            episode_id=eid,
            turn_index=0,
            started_at=NOW,
            assistant_content="let me compute",
            tool_calls=[ToolCall(id="c1", name="execute_bash", arguments='{"command": "python3 -c \\"print(6*7)\\""}')],
            observations=[Observation(tool_call_id="c1", name="execute_bash", content="42", exit_code=0)],
            usage=Usage(prompt_tokens=3, completion_tokens=2),
            prompt_token_ids=[1, 2, 3],
            completion_token_ids=[10, 11],
            completion_logprobs=[-0.1, -0.2],
        ),
        TurnRecord(
            run_id=RUN,
            episode_id=eid,
            turn_index=1,
            started_at=NOW,
            assistant_content=None,
            tool_calls=[ToolCall(id="c2", name="submit", arguments="{}")],
            observations=[Observation(tool_call_id="c2", name="submit", content="submitted")],
            usage=Usage(prompt_tokens=7, completion_tokens=1),
            prompt_token_ids=[1, 2, 3, 10, 11, 20, 21],
            completion_token_ids=[12],
            completion_logprobs=[-0.3],
        ),
    ]


@pytest.fixture
def run() -> RunData:
    eps = [_ep(f"a{i}", "A", i) for i in range(4)] + [_ep("b0", "B", 0), _ep("x0", "A", 9, "sandbox_error")]
    turns = [t for e in eps for t in _turns(e.episode_id)]
    scores = {"a0": 1.0, "a1": 0.0, "a2": 0.0, "a3": 1.0, "b0": 1.0, "x0": 0.0}
    return RunData.from_records(RUN, eps, turns, scores)


def test_advantages_hand_checked() -> None:
    # RLOO: r_i - mean of the others.  [1,0,0,1]: 1 - 1/3 = 2/3, 0 - 2/3 = -2/3
    assert rloo([1, 0, 0, 1]) == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    # GRPO: (r - 0.5) / sample std (sqrt(1/3))
    s = math.sqrt(1 / 3)
    assert grpo([1, 0, 0, 1]) == pytest.approx([0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s], rel=1e-5)
    # a lone sample and an all-equal group carry no signal
    assert rloo([1.0]) == [0.0] and grpo([1.0]) == [0.0]
    assert grpo([1, 1, 1]) == [0.0, 0.0, 0.0] and rloo([1, 1]) == [0.0, 0.0]
    # groups are independent
    keys = ["A", "B", "A", "B"]
    assert group_advantages(keys, [1, 0.5, 0, 0.5], "rloo") == pytest.approx([1, 0, -1, 0])
    with pytest.raises(ValueError, match="unknown advantage method"):
        group_advantages(keys, [1, 0, 0, 0], "ppo")


def test_trajectories_masks_advantages_and_infra_excluded(run: RunData) -> None:
    stats = ExportStats()
    rows = trajectory_rows(run, stats=stats)
    by = {r["episode_id"]: r for r in rows}
    assert set(by) == {"a0", "a1", "a2", "a3", "b0"}  # the sandbox_error episode is not exported
    assert stats.skipped_infra == 1
    a0 = by["a0"]
    roles = [m["role"] for m in a0["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "tool"]
    assert a0["loss_mask"] == [0, 0, 1, 0, 1, 0]
    assert a0["messages"][2]["tool_calls"][0]["function"]["name"] == "execute_bash"
    assert a0["messages"][3]["tool_call_id"] == "c1" and a0["messages"][3]["content"] == "42"
    assert a0["advantage_rloo"] == pytest.approx(2 / 3)
    assert by["a1"]["advantage_rloo"] == pytest.approx(-2 / 3)
    assert a0["advantage_grpo"] == pytest.approx(0.5 / math.sqrt(1 / 3), rel=1e-5)
    assert by["b0"]["advantage_rloo"] == 0.0 and by["b0"]["group_size"] == 1
    assert a0["group_size"] == 4 and a0["termination"] == "submitted"


def test_overlong_filter_drop_mask_keep(run: RunData) -> None:
    run.episodes[0] = run.episodes[0].model_copy(update={"termination": "context_exhausted"})
    assert {r["episode_id"] for r in trajectory_rows(run, overlong="drop")} == {"a1", "a2", "a3", "b0"}
    masked = {r["episode_id"]: r for r in trajectory_rows(run, overlong="mask")}
    assert masked["a0"]["overlong"] and set(masked["a0"]["loss_mask"]) == {0}
    kept = {r["episode_id"]: r for r in trajectory_rows(run, overlong="keep")}
    assert kept["a0"]["overlong"] and 1 in kept["a0"]["loss_mask"]
    # a token limit below the conversation's length (7 prompt + 1 completion) marks all
    assert trajectory_rows(run, max_seq_tokens=7, overlong="drop") == []
    assert len(trajectory_rows(run, max_seq_tokens=8, overlong="drop")) == 4


def test_token_assembly_rebuilds_response_and_detects_drift() -> None:
    """analysis.token_ids.assemble: the one assembly the export and the rollout server use."""
    turns = _turns("e")
    t = assemble(turns)
    assert t.exact and t.prompt_ids == [1, 2, 3]
    assert t.response_ids == [10, 11, 20, 21, 12]
    assert t.response_mask == [1, 1, 0, 0, 1]
    assert t.response_logprobs == [-0.1, -0.2, 0.0, 0.0, -0.3]
    drift = _turns("e")
    drift[1].prompt_token_ids = [1, 2, 3, 10, 99, 20, 21]
    assert assemble(drift).status.startswith("mismatch at turn 1: its prompt ids do not extend")
    wrong_count = _turns("e")
    wrong_count[0].usage.completion_tokens = 5
    assert assemble(wrong_count).status == "mismatch at turn 0: 2 completion ids but usage says 5"
    wrong_prompt = _turns("e")
    wrong_prompt[1].usage.prompt_tokens = 3
    assert assemble(wrong_prompt).status == "mismatch at turn 1: 7 prompt ids but usage says 3"
    # checked against the recorded text with a detokenizer
    vocab = {10: "let me ", 11: "compute", 12: ""}
    assert assemble(turns, lambda ids: "".join(vocab.get(i, "?") for i in ids)).exact
    assert "re-tokenization drift" in assemble(turns, lambda ids: "something else").status
    # logprobs are all or nothing: a turn without them leaves the trajectory without any
    partial = _turns("e")
    partial[1].completion_logprobs = None
    assert assemble(partial).exact and assemble(partial).response_logprobs is None
    assert assemble([]).status == "missing"


def test_token_rows_skip_mismatched_episodes(run: RunData) -> None:
    run.turns["a1"][1].prompt_token_ids = [9, 9, 9, 9, 9, 9, 9]
    stats = ExportStats()
    rows = token_rows(run, stats=stats)
    assert {r["episode_id"] for r in rows} == {"a0", "a2", "a3", "b0"}
    assert len(stats.token_mismatches) == 1 and stats.token_mismatches[0].startswith("a1:")


def test_no_scores_is_a_clear_error(run: RunData) -> None:
    run.scores = {}
    with pytest.raises(RolloutError, match="no scores yet: run `sandflow flows score --run-id pytest-rollouts`"):
        trajectory_rows(run)


def test_exports_load_with_datasets(run: RunData, tmp_path: Path) -> None:
    from datasets import load_dataset

    tasks = [
        Task(id="A", domain="math", problem_statement="6*7?", ground_truth="42", qa_type="math",
             input_files={"notes.txt": "hello"}),
        Task(id="B", domain="chem", problem_statement="mass of H2O?", ground_truth={"value": 18.015, "unit": "g/mol"}),
    ]
    ts_path = write_export(
        task_rows(tasks, lambda t: [{"role": "user", "content": t.problem_statement}]),
        row_schema(),
        tmp_path / "taskset.parquet",
    )
    tr_path = write_export(trajectory_rows(run), TRAJECTORY_SCHEMA, tmp_path / "trajectories.parquet")
    tk_path = write_export(token_rows(run), TOKEN_SCHEMA, tmp_path / "tokens.parquet")

    ds = load_dataset("parquet", data_files=str(ts_path), split="train")
    assert ds.column_names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    assert ds[0]["data_source"] == "sandflow/math" and ds[0]["ability"] == "math"
    assert ds[0]["reward_model"] == {"style": "rule", "ground_truth": "42"}
    assert json.loads(ds[1]["reward_model"]["ground_truth"]) == {"value": 18.015, "unit": "g/mol"}
    assert json.loads(ds[0]["extra_info"]["input_files"]) == {"notes.txt": "hello"}
    assert ds[0]["prompt"] == [{"role": "user", "content": "6*7?"}]

    tr = load_dataset("parquet", data_files=str(tr_path), split="train")
    assert len(tr) == 5
    row = next(r for r in tr if r["episode_id"] == "a0")
    assert row["loss_mask"] == [0, 0, 1, 0, 1, 0]
    assert row["advantage_rloo"] == pytest.approx(2 / 3)
    assert row["messages"][2]["tool_calls"][0]["function"]["arguments"].startswith('{"command"')

    tk = load_dataset("parquet", data_files=str(tk_path), split="train")
    row = next(r for r in tk if r["episode_id"] == "a0")
    assert row["response_ids"] == [10, 11, 20, 21, 12] and row["response_mask"] == [1, 1, 0, 0, 1]
    assert row["response_logprobs"] == pytest.approx([-0.1, -0.2, 0.0, 0.0, -0.3])
