"""One recorded episode, every shape it leaves sandflow in (issue #38: one trajectory module).

The episode is real: the agent loop (tasks.loop) drives a Docker sandbox with a scripted
model over HTTP that answers with exact token ids and logprobs, vLLM style
(tests/scripted_model.py's ToyTokenizer). Its three turns: a tool call (with reasoning),
a reply without a tool call (the loop's nudge follows), a submit. Each test below shows
one step of the path in analysis/trajectory.py, on that same episode:

    turns -> messages (tools) -> loss mask -> token ids -> reward -> score row
          -> RL row, token row, the rollout server's fields, SFT row, ATIF, Inspect, HF
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from analysis.token_ids import assemble
from analysis.trajectory import (
    TOKEN_SCHEMA,
    TRAJECTORY_SCHEMA,
    RewardError,
    reward,
    rl_row,
    rollout_fields,
    score_row,
    sft_row,
    token_row,
)
from datasets_prep.task import Task, make_task
from tasks.conversation import episode_messages, loss_mask, tools_of, turn_messages
from tasks.records import EpisodeRecord, Observation, ToolCall, TurnRecord
from tests.scripted_model import ScriptedModel, ToyTokenizer, text_reply, tool_reply

pytestmark = pytest.mark.docker

SCRIPT = [
    tool_reply("execute_bash", {"command": "echo $((1 + 2))"}, content="Let me count.",
               reasoning_content="Use the shell."),  # fmt: skip
    text_reply("I think it is 3."),  # no tool call: the loop's nudge follows
    tool_reply("submit", {"answer": "3"}),
]


@dataclass
class Recorded:
    task: Task
    record: EpisodeRecord
    turns: list[TurnRecord]
    sent: list[dict[str, Any]]  # the loop's own history: what the model saw


@pytest.fixture(scope="module")
def episode() -> Iterator[Recorded]:
    from tasks.loop import Limits, run_episode
    from tasks.records import NullRecorder
    from tests.tasks.conftest import fast_model, sandbox_config

    task = make_task({"id": "three", "domain": "math", "problem_statement": "What is 1 + 2?",
                      "ground_truth": "3"}, "test")  # fmt: skip
    with ScriptedModel(tokenizer=ToyTokenizer()) as model:
        model.push(*SCRIPT)
        cfg = fast_model(model, logprobs=True, return_token_ids=True)
        result = run_episode(task, cfg, sandbox_config(), NullRecorder(), run_id="traj",
                             limits=Limits(max_steps=5))  # fmt: skip
    assert result.record.termination == "submitted", result.record
    yield Recorded(task, result.record, list(result.turns), list(result.messages))


# ------------------------------------------------------------------ turns -> messages
def test_the_rebuilt_messages_are_the_ones_the_loop_sent(episode: Recorded) -> None:
    """The wire shape, rebuilt from the records alone, is the loop's history message for
    message: what the replay continues from (tasks.replay)."""
    assert episode_messages(episode.record, episode.turns, wire=True) == episode.sent


def test_each_turn_is_its_assistant_message_then_its_tool_results_then_appended_messages(
    episode: Recorded,
) -> None:
    msgs = episode_messages(episode.record, episode.turns)
    assert [m["role"] for m in msgs] == [
        "system", "user",           # the prompt
        "assistant", "tool",        # turn 0: a call and its result
        "assistant", "user",        # turn 1: no call, the loop's nudge
        "assistant", "tool",        # turn 2: submit and its result
    ]  # fmt: skip
    # the row shape: six keys on every message (analysis.trajectory.MESSAGE)
    assert {tuple(m) for m in msgs} == {
        ("role", "content", "reasoning_content", "tool_calls", "tool_call_id", "name")
    }
    first = msgs[2]
    assert first["content"] == "Let me count." and first["reasoning_content"] == "Use the shell."
    (call,) = first["tool_calls"]
    assert call["function"] == {"name": "execute_bash", "arguments": '{"command": "echo $((1 + 2))"}'}
    assert msgs[3]["tool_call_id"] == call["id"] and msgs[3]["content"].strip().startswith("3")


def test_tool_results_come_before_appended_messages() -> None:
    """A turn with both (the loop never makes one today): the tool message right after
    the assistant message whose call it answers, as endpoints and chat templates require."""
    turn = TurnRecord(
        run_id="r", episode_id="e", turn_index=0, started_at=datetime.now(UTC),
        tool_calls=[ToolCall(id="c1", name="execute_bash", arguments="{}")],
        observations=[Observation(tool_call_id="c1", name="execute_bash", content="ok")],
        extra_messages=[{"role": "user", "content": "Go on."}],
    )  # fmt: skip
    assert [m["role"] for m in turn_messages(turn)] == ["assistant", "tool", "user"]
    assert turn_messages(turn, wire=True)[1] == {"role": "tool", "tool_call_id": "c1", "content": "ok"}


def test_the_tools_list_is_the_modes() -> None:
    assert [t["function"]["name"] for t in tools_of("sandbox")] == ["execute_bash", "str_replace_editor", "submit"]
    assert tools_of("llm") == []


def test_a_tool_set_this_version_does_not_know_names_the_episode(episode: Recorded) -> None:
    record = episode.record.model_copy(update={"config": {**episode.record.config, "tools": "future"}})
    with pytest.raises(ValueError, match=rf"episode {record.episode_id}: config.tools: tools 'future'"):
        sft_row(record, episode.turns, 1.0)


# ------------------------------------------------------------------ loss mask, tokens
def test_the_loss_mask_is_one_on_what_the_policy_wrote(episode: Recorded) -> None:
    msgs = episode_messages(episode.record, episode.turns)
    assert loss_mask(msgs) == [0, 0, 1, 0, 1, 0, 1, 0]


def test_the_token_ids_are_one_exact_sequence(episode: Recorded) -> None:
    """analysis.token_ids: the first prompt, then each completion (mask 1, its logprobs)
    with the environment's tokens between them (mask 0)."""
    tokens = assemble(episode.turns)
    assert tokens.exact, tokens.status
    tok = ToyTokenizer()
    completions = [tokens.response_ids[a:b] for a, b in tokens.spans]  # type: ignore[index]
    assert completions == [t.completion_token_ids for t in episode.turns]
    assert tokens.prompt_ids == tok.render(episode.sent[:2])
    assert tokens.prompt_ids + tokens.response_ids == tok.render(episode.sent, add_generation_prompt=False)[
        : len(tokens.prompt_ids) + len(tokens.response_ids)  # type: ignore[arg-type]
    ]  # fmt: skip
    ones = [i for i, m in enumerate(tokens.response_mask or []) if m]
    assert [tokens.response_ids[i] for i in ones] == [x for c in completions for x in c]  # type: ignore[index]


# ------------------------------------------------------------------ reward, score row
def test_the_reward_is_the_tasks_verifier_and_its_score_row_is_the_warehouses(episode: Recorded) -> None:
    from warehouse.labels import ScoreRow

    r = reward(episode.task, episode.record.answer)
    assert (r.score, r.passed, r.verifier) == (1.0, True, "math")
    row = score_row(episode.record, episode.task, r, write_id="w1")
    assert list(row) == list(ScoreRow.model_fields)  # one shape, whoever scores
    assert row["episode_write_id"] == "w1" and row["answer"] == "3" and row["ground_truth"] == "3"
    ScoreRow.model_validate(row)
    assert reward(episode.task, "4").score == 0.0  # a wrong answer is a 0 with a reason


def test_a_ground_truth_the_verifier_cannot_use_is_an_error_naming_the_task() -> None:
    from datasets_prep.verifiers import VerifierError

    task = make_task({"id": "t1", "domain": "math", "problem_statement": "?", "ground_truth": "3"}, "test")
    with pytest.raises(RewardError, match="task 't1'") as err:
        reward(task, "3", "no-such-verifier")
    assert isinstance(err.value, VerifierError)  # what the commands already catch


# ------------------------------------------------------------------ the rows
def test_the_rl_row_is_the_trajectories_file_row(episode: Recorded) -> None:
    row = rl_row(episode.record, episode.turns, 1.0, advantages=(0.5, 0.25), group_size=4)
    pa.Table.from_pylist([row], schema=TRAJECTORY_SCHEMA)  # the file's columns, typed
    assert list(row) == TRAJECTORY_SCHEMA.names
    assert row["messages"] == episode_messages(episode.record, episode.turns)
    assert row["loss_mask"] == [0, 0, 1, 0, 1, 0, 1, 0] and row["num_turns"] == 3
    masked = rl_row(episode.record, episode.turns, 1.0, overlong=True, masked=True)
    assert set(masked["loss_mask"]) == {0} and masked["overlong"]


def test_the_token_row_is_the_tokens_file_row(episode: Recorded) -> None:
    tokens = assemble(episode.turns)
    row = token_row(episode.record, episode.turns, tokens, 1.0, advantages=(0.5, 0.25))
    pa.Table.from_pylist([row], schema=TOKEN_SCHEMA)
    assert list(row) == TOKEN_SCHEMA.names
    assert row["response_logprobs"] == tokens.response_logprobs and len(row["response_logprobs"]) == len(row["response_ids"])


def test_the_rollout_servers_fields_use_the_same_names(episode: Recorded) -> None:
    """rl.batch's trajectory event: the live history, the same loss mask and token
    columns as the files (`loss_mask`, `response_logprobs`)."""
    got = rollout_fields(episode.record, episode.turns, episode.sent)
    assert got["messages"] == episode.sent and got["loss_mask"] == [0, 0, 1, 0, 1, 0, 1, 0]
    row = token_row(episode.record, episode.turns, assemble(episode.turns), 1.0)
    for name in ("prompt_ids", "response_ids", "response_mask", "response_logprobs"):
        assert got[name] == row[name], name
    assert got["token_ids_status"] == "exact" and got["overlong"] is False
    # without the live history, the rebuilt one (the same, as shown above)
    assert rollout_fields(episode.record, episode.turns)["messages"] == episode.sent


def test_the_sft_row_is_messages_and_tools(episode: Recorded) -> None:
    row = sft_row(episode.record, episode.turns, 1.0)
    assert row["tools"] == tools_of("sandbox") and row["reward"] == 1.0
    assistant = row["messages"][2]
    assert assistant["tool_calls"][0]["function"]["arguments"] == {"command": "echo $((1 + 2))"}
    assert "reasoning_content" not in assistant and row["messages"][3]["name"] == "execute_bash"
    assert [m["role"] for m in row["messages"]] == [m["role"] for m in episode.sent]
    json.dumps(row)  # one JSONL line


def test_invalid_arguments_stay_text_in_the_sft_row(episode: Recorded) -> None:
    broken = [t.model_copy(deep=True) for t in episode.turns]
    broken[0].tool_calls[0].arguments = '{"command": "ls'
    msg = sft_row(episode.record, broken, 1.0)["messages"][2]
    assert msg["tool_calls"][0]["function"]["arguments"] == '{"command": "ls'


# ------------------------------------------------------------------ the formats (interop/)
def _as_export(episode: Recorded) -> Any:
    from interop.source import Episode
    from warehouse.rundata import Score

    return Episode(episode.record, episode.turns, Score(episode.record.episode_id, 1.0, "math", True, "ok"),
                   "w1", {}, "3")  # fmt: skip


def test_atif_inspect_and_hf_carry_the_same_conversation_in_the_same_order(
    episode: Recorded, tmp_path: Path
) -> None:
    from interop.atif import trajectory
    from interop.hf import episode_row
    from interop.inspect_log import messages as inspect_messages
    from interop.summary import Summary

    ep = _as_export(episode)
    roles = [m["role"] for m in episode_messages(episode.record, episode.turns)]
    # ATIF: an agent step holds its turn's tool results; the nudge is a user step after it
    doc = trajectory(ep, {}, Summary("atif", tmp_path))
    assert doc is not None
    assert [s["source"] for s in doc["steps"]] == ["system", "user", "agent", "agent", "user", "agent"]
    assert [t["function"]["name"] for t in doc["agent"]["tool_definitions"]] == [
        t["function"]["name"] for t in tools_of("sandbox")
    ]
    # Inspect: one message per message, in the same order
    msgs, starts = inspect_messages(ep)
    assert [m["role"] for m in msgs] == roles and starts == [2, 4, 6]
    # Hugging Face: the row shape itself
    assert episode_row(ep, Summary("hf", tmp_path))["messages"] == episode_messages(episode.record, episode.turns)
