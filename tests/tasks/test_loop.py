"""The ReAct loop in sandbox mode: a scripted model over real HTTP, a real Docker sandbox."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from datasets_prep.task import Task
from sandbox.base import Sandbox
from tasks.loop import Limits, run_episode
from tasks.records import NullRecorder
from tests.scripted_model import Fault, Reply, ScriptedModel, text_reply, tool_call, tool_reply
from tests.tasks.conftest import fast_model, sandbox_config

pytestmark = pytest.mark.docker

BASH = "execute_bash"


def bash(cmd: str, **kw: object) -> Reply:
    return tool_reply(BASH, {"command": cmd}, **kw)


def submit() -> Reply:
    return tool_reply("submit", {})


def task(**kw: object) -> Task:
    base: dict[str, object] = {"id": "t", "domain": "math", "problem_statement": "What is 6*7?", "ground_truth": "42"}
    base.update(kw)
    return Task(**base)  # type: ignore[arg-type]


def assert_append_only(requests: list[dict]) -> None:
    for prev, cur in zip(requests, requests[1:], strict=False):
        assert cur["messages"][: len(prev["messages"])] == prev["messages"]
        assert len(cur["messages"]) > len(prev["messages"])


def test_submitted_episode_reads_answer_file_and_is_append_only(
    scripted_model: ScriptedModel, clean_box: Sandbox, tmp_path: Path
) -> None:
    scripted_model.push(
        bash("cat /testbed/documents/q.txt; python3 -c 'print(6*7)'", content="Let me compute."),
        Reply(tool_calls=[  # two calls in one message: both run, in order, each answered
            tool_call(BASH, {"command": "echo 42 > /testbed/output/answer.txt"}, "a1"),
            tool_call(BASH, {"command": "cat /testbed/output/answer.txt"}, "a2"),
        ]),
        text_reply("Done, I think."),  # no tool call -> continue prompt
        tool_reply(BASH, '{"command": "ls"'),  # malformed JSON -> error observation
        submit(),
    )
    rec = NullRecorder()
    t = task(input_files={"q.txt": "six times seven", "raw.bin": b"\x00\xff"})
    result = run_episode(t, fast_model(scripted_model), recorder=rec, sandbox=clean_box,
                         output_dir=tmp_path / "files", run_id="r")
    ep = result.record
    assert ep.termination == "submitted" and ep.error is None
    assert ep.answer == "42" and ep.answer_source == "answer_file"
    assert ep.num_turns == 5 and [t.turn_index for t in rec.turns] == [0, 1, 2, 3, 4]
    assert (tmp_path / "files" / "answer.txt").read_text() == "42\n"
    assert clean_box.read_file("/testbed/documents/raw.bin") == b"\x00\xff"

    reqs = scripted_model.requests
    assert_append_only(reqs)
    assert reqs[0]["messages"] == ep.prompt_messages
    assert [t["function"]["name"] for t in reqs[0]["tools"]] == ["execute_bash", "str_replace_editor", "submit"]
    # turn 1 observation
    assert rec.turns[0].observations[0].content.startswith("six times seven42\n")
    # turn 2: two tool results, in order, with their own ids
    tail = reqs[2]["messages"][-3:]
    assert tail[0]["role"] == "assistant" and len(tail[0]["tool_calls"]) == 2
    assert [(m["role"], m["tool_call_id"]) for m in tail[1:]] == [("tool", "a1"), ("tool", "a2")]
    assert tail[2]["content"] == "42\n[exit code: 0]"
    # turn 3: the continue prompt
    assert reqs[3]["messages"][-1]["role"] == "user" and "did not call a tool" in reqs[3]["messages"][-1]["content"]
    assert rec.turns[2].extra_messages == [reqs[3]["messages"][-1]]
    # turn 4: malformed JSON -> an error the model can act on
    bad = rec.turns[3].observations[0]
    assert bad.error == "invalid JSON arguments" and "Invalid JSON" in reqs[4]["messages"][-1]["content"]
    assert rec.episodes == [ep]


def test_answer_falls_back_to_last_message_and_max_steps(scripted_model: ScriptedModel, clean_box: Sandbox) -> None:
    scripted_model.default = lambda body, i: bash("true", content=f"step {i}: Final answer: 9")
    ep = run_episode(task(), fast_model(scripted_model), sandbox=clean_box, limits=Limits(max_steps=3)).record
    assert ep.termination == "max_steps" and ep.num_turns == 3
    assert ep.answer == "9" and ep.answer_source == "last_message"


def test_rate_limit_inside_episode_then_success(scripted_model: ScriptedModel, clean_box: Sandbox) -> None:
    scripted_model.push(Fault.rate_limit(0.05), bash("echo x > /testbed/output/answer.txt"), submit())
    rec = NullRecorder()
    ep = run_episode(task(), fast_model(scripted_model), recorder=rec, sandbox=clean_box).record
    assert ep.termination == "submitted" and ep.answer == "x"
    assert [t.attempts for t in rec.turns] == [2, 1]


def test_server_error_forever_is_model_error_with_turns_kept(scripted_model: ScriptedModel, clean_box: Sandbox) -> None:
    scripted_model.push(bash("echo 1"))
    scripted_model.default = Fault.server_error(500)
    rec = NullRecorder()
    ep = run_episode(task(), fast_model(scripted_model, max_retries=2), recorder=rec, sandbox=clean_box).record
    assert ep.termination == "model_error" and ep.is_infra_failure
    assert "HTTP 500" in (ep.error or "") and ep.num_turns == 1 and len(rec.turns) == 1
    assert len(scripted_model.requests) == 1 + 3


def test_hang_past_request_timeout(scripted_model: ScriptedModel, clean_box: Sandbox) -> None:
    scripted_model.default = Fault.hang(20)
    ep = run_episode(task(), fast_model(scripted_model, request_timeout_s=0.5, max_retries=1),
                     sandbox=clean_box).record
    assert ep.termination == "model_error" and "timed out" in (ep.error or "")


def test_context_error_shrinks_then_exhausts(scripted_model: ScriptedModel, clean_box: Sandbox) -> None:
    scripted_model.push(
        bash("echo 1"),
        Fault.context_length(max_context=4096, prompt_tokens=3500),
        bash("echo 2"),
    )
    scripted_model.default = Fault.context_length(max_context=4096, prompt_tokens=4080)
    rec = NullRecorder()
    ep = run_episode(task(), fast_model(scripted_model, max_tokens=1024), recorder=rec, sandbox=clean_box).record
    assert ep.termination == "context_exhausted" and not ep.is_infra_failure
    assert [r["max_tokens"] for r in scripted_model.requests] == [1024, 1024, 588, 588]
    assert [t.request_max_tokens for t in rec.turns] == [1024, 588]


def test_context_budget_limit(scripted_model: ScriptedModel, clean_box: Sandbox) -> None:
    usage = {"prompt_tokens": 900, "completion_tokens": 50, "total_tokens": 950}
    scripted_model.default = lambda body, i: bash("true", usage=usage)
    ep = run_episode(task(), fast_model(scripted_model, max_tokens=512, min_max_tokens=100),
                     sandbox=clean_box, limits=Limits(context_tokens=1000)).record
    assert ep.termination == "context_exhausted" and ep.num_turns == 1
    assert "budget of 1000" in (ep.error or "")


def test_wall_clock(scripted_model: ScriptedModel, clean_box: Sandbox) -> None:
    scripted_model.default = lambda body, i: bash("sleep 30")
    ep = run_episode(task(), fast_model(scripted_model), sandbox=clean_box,
                     limits=Limits(wall_clock_s=2)).record
    assert ep.termination == "wall_clock" and not ep.is_infra_failure
    assert ep.num_turns == 1


def test_sandbox_failure_is_sandbox_error(scripted_model: ScriptedModel) -> None:
    """The episode opens its own sandbox; it dies mid-episode -> sandbox_error, not a score."""
    def kill_then_bash(body: dict, i: int) -> Reply:
        import docker

        client = docker.from_env()
        for c in client.containers.list(ignore_removed=True, filters={"label": "sandflow.run_id=pytest-tasks-kill"}):
            c.remove(force=True)
        return bash("echo after death")

    scripted_model.push(bash("echo alive"), kill_then_bash)
    cfg = sandbox_config().model_copy(update={"run_id": "pytest-tasks-kill"})
    rec = NullRecorder()
    ep = run_episode(task(), fast_model(scripted_model), cfg, rec, run_id="pytest-tasks-kill").record
    assert ep.termination == "sandbox_error" and ep.is_infra_failure, ep
    assert len(rec.turns) == 2 and rec.turns[1].error


def test_secrets_never_in_records_or_logs(
    scripted_model: ScriptedModel, clean_box: Sandbox, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from tasks.journal import JournalRecorder, read_journal

    secret = "sk-test-SECRET-0xDEADBEEF"
    scripted_model.push(Fault.rate_limit(0.01), bash("echo $OPENAI_API_KEY $SANDFLOW_API_KEY; env | grep -c sk- || true"), submit())
    caplog.set_level("DEBUG")
    path = tmp_path / "records.jsonl"
    with JournalRecorder(path) as rec:
        result = run_episode(task(), fast_model(scripted_model, api_key=secret), recorder=rec,
                             sandbox=clean_box, output_dir=tmp_path / "out")
    assert result.record.termination == "submitted"
    assert scripted_model.headers[-1]["authorization"] == f"Bearer {secret}"  # it was used
    blobs = [path.read_text(), caplog.text, json.dumps(result.messages),
             result.record.model_dump_json()] + [t.model_dump_json() for t in result.turns]
    blobs += [r.decode() for r in scripted_model.raw_requests]
    for blob in blobs:
        assert secret not in blob
    assert "retrying" in caplog.text  # the retry was logged (without the key)
    assert read_journal(path).finished[0].episode_id == result.record.episode_id


def test_bad_task_input_is_a_clear_error(scripted_model: ScriptedModel) -> None:
    # Tasks validate themselves; run_episode checks again for tasks built without validation.
    bad = Task.model_construct(id="t", domain="math", problem_statement="q", input_files={"../x": "a"})
    with pytest.raises(ValueError, match=r"task 't': input file name '../x'"):
        run_episode(bad, fast_model(scripted_model))


def test_own_sandbox_is_closed_and_exact_tokens_recorded(scripted_model: ScriptedModel) -> None:
    import docker

    scripted_model.push(
        Reply(tool_calls=[tool_call(BASH, {"command": "echo 7 > /testbed/output/answer.txt"})],
              completion_token_ids=[101, 102, 103], prompt_token_ids=[1, 2], logprobs=[-0.5, -0.25, 0.0]),
        submit(),
    )
    rec = NullRecorder()
    run_id = "pytest-tasks-own"
    cfg = sandbox_config().model_copy(update={"run_id": run_id})
    ep = run_episode(task(), fast_model(scripted_model, logprobs=True, return_token_ids=True), cfg, rec,
                     run_id=run_id).record
    assert ep.termination == "submitted" and ep.answer == "7"
    first = rec.turns[0]
    assert first.completion_token_ids == [101, 102, 103] and first.prompt_token_ids == [1, 2]
    assert first.completion_logprobs == [-0.5, -0.25, 0.0]
    assert rec.turns[1].completion_token_ids is None  # the server gave none: never re-tokenized
    left = docker.from_env().containers.list(ignore_removed=True, all=True, filters={"label": f"sandflow.run_id={run_id}"})
    assert left == []


def test_failing_recorder_propagates_and_closes_the_sandbox(scripted_model: ScriptedModel) -> None:
    import docker

    class Broken(NullRecorder):
        def record_turn(self, turn: object) -> None:  # type: ignore[override]
            raise OSError("disk full")

    scripted_model.push(bash("echo 1"))
    run_id = "pytest-tasks-broken-rec"
    cfg = sandbox_config().model_copy(update={"run_id": run_id})
    with pytest.raises(OSError, match="disk full"):
        run_episode(task(), fast_model(scripted_model), cfg, Broken(), run_id=run_id)
    left = docker.from_env().containers.list(ignore_removed=True, all=True, filters={"label": f"sandflow.run_id={run_id}"})
    assert left == []


def test_calls_after_submit_are_answered_not_run(scripted_model: ScriptedModel, clean_box: Sandbox) -> None:
    scripted_model.push(Reply(tool_calls=[
        tool_call(BASH, {"command": "echo 5 > /testbed/output/answer.txt"}, "x1"),
        tool_call("submit", {}, "x2"),
        tool_call(BASH, {"command": "echo 6 > /testbed/output/answer.txt"}, "x3"),
    ]))
    rec = NullRecorder()
    result = run_episode(task(), fast_model(scripted_model), recorder=rec, sandbox=clean_box)
    assert result.record.termination == "submitted" and result.record.answer == "5"
    obs = rec.turns[0].observations
    assert [o.tool_call_id for o in obs] == ["x1", "x2", "x3"]
    assert obs[2].error == "not executed after submit"
    assert [m.get("tool_call_id") for m in result.messages[-3:]] == ["x1", "x2", "x3"]


def test_tool_calls_past_the_per_turn_cap_are_answered_not_run(
    scripted_model: ScriptedModel, clean_box: Sandbox
) -> None:
    """Issue #22.9: a message with more calls than `max_tool_calls_per_turn` runs only that
    many; every call still gets its own tool result, the rest an error the model can read."""
    calls = [tool_call(BASH, {"command": f"echo {i} >> /testbed/ran"}, f"c{i}") for i in range(7)]
    scripted_model.push(Reply(tool_calls=calls), bash("cat /testbed/ran"), submit())
    rec = NullRecorder()
    limits = Limits(max_tool_calls_per_turn=3)
    result = run_episode(task(), fast_model(scripted_model), recorder=rec, sandbox=clean_box, limits=limits)
    assert result.record.termination == "submitted"
    obs = rec.turns[0].observations
    assert [o.tool_call_id for o in obs] == [f"c{i}" for i in range(7)]
    assert [o.error for o in obs] == [None] * 3 + ["over the tool-call limit"] * 4
    assert "at most 3 tool calls run per message (7 were sent)" in obs[3].content
    # only the first three ran; the next turn's calls run again (the cap is per turn)
    assert rec.turns[1].observations[0].content == "0\n1\n2\n[exit code: 0]"
    # the chat stays valid: one tool message per call id, in order, before the next request
    sent = scripted_model.requests[1]["messages"]
    assert [m["tool_call_id"] for m in sent if m["role"] == "tool"] == [f"c{i}" for i in range(7)]


def test_tool_results_past_the_per_turn_byte_budget_are_clipped_then_refused(
    scripted_model: ScriptedModel, clean_box: Sandbox
) -> None:
    """Issue #22.9: a turn's tool results hold at most `max_observation_bytes_per_turn`
    bytes: the result that crosses it is clipped (head and tail kept, a notice), the calls
    after it are not run."""
    big = "python3 -c 'print(\"é\" * 1500)'; echo {i} >> /testbed/ran"  # 3,000 bytes of output
    calls = [tool_call(BASH, {"command": big.format(i=i)}, f"b{i}") for i in range(4)]
    scripted_model.push(Reply(tool_calls=calls), bash("cat /testbed/ran"), submit())
    rec = NullRecorder()
    limits = Limits(max_tool_calls_per_turn=10, max_observation_bytes_per_turn=5000)
    result = run_episode(task(), fast_model(scripted_model), recorder=rec, sandbox=clean_box, limits=limits)
    assert result.record.termination == "submitted"
    obs = rec.turns[0].observations
    assert not obs[0].truncated and obs[0].content.count("é") == 1500
    assert obs[1].truncated and "bytes omitted, this message's tool results reached 5000 bytes" in obs[1].content
    assert obs[1].content.endswith("[exit code: 0]")  # the tail is kept
    assert [o.error for o in obs[2:]] == ["over the observation budget"] * 2
    assert "reached 5000 bytes" in obs[2].content
    sizes = [len(o.content.encode()) for o in obs[:2]]
    assert sum(sizes) < 5000 + 200, sizes  # the budget plus one notice
    assert rec.turns[1].observations[0].content == "0\n1\n[exit code: 0]"


def test_an_episode_names_its_host_and_engine_even_when_the_engine_refuses(
    scripted_model: ScriptedModel, clean_box: Sandbox
) -> None:
    """`worker_host` and `sandbox_engine` say where an episode ran (several engines or
    hosts: GROUP BY them); an engine that refuses is named too, without its password."""
    import os
    import socket

    scripted_model.push(submit())
    ep = run_episode(task(), fast_model(scripted_model), sandbox=clean_box).record
    assert ep.worker_host == socket.gethostname()
    assert ep.sandbox_engine == "docker " + (os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock")
    refused = sandbox_config().model_copy(update={"docker_host": "tcp://me:hunter2@127.0.0.1:9"})
    ep = run_episode(task(), fast_model(scripted_model), refused, run_id="pytest-refused").record
    assert ep.termination == "sandbox_error", ep
    assert ep.sandbox_engine == "docker tcp://me@127.0.0.1:9" and "hunter2" not in ep.model_dump_json()
    scripted_model.push(text_reply("42"))
    llm = run_episode(task(), fast_model(scripted_model), mode="llm").record
    assert llm.sandbox_engine is None and llm.worker_host == socket.gethostname()


def test_a_prompt_set_offers_its_own_tools_and_the_records_say_which(
    scripted_model: ScriptedModel, clean_box: Sandbox
) -> None:
    """One tool contract: the small prompt set offers `submit(answer)` (the tools a policy
    trained on it saw), the model's answer in the call is the episode's answer, and every
    export of the episode names the tools it was really offered."""
    from analysis.trajectory import sft_row
    from tasks.prompts import PROMPT_SETS
    from tasks.tool_schemas import tool_schemas

    scripted_model.push(tool_reply("submit", {"answer": "42"}))
    rec = NullRecorder()
    ep = run_episode(task(), fast_model(scripted_model), recorder=rec, sandbox=clean_box,
                     prompt_dir=str(PROMPT_SETS["small"])).record
    (req,) = scripted_model.requests
    submit_schema = next(t for t in req["tools"] if t["function"]["name"] == "submit")
    assert submit_schema["function"]["parameters"]["properties"] == {"answer": {"type": "string", "description": "The final answer, e.g. `B` or `42`."}}
    assert req["tools"] == tool_schemas("small")
    assert "submit(answer=...)" in req["messages"][1]["content"]
    assert ep.termination == "submitted" and ep.answer == "42" and ep.answer_source == "submit_argument"
    assert ep.config["tools"] == "small"
    assert sft_row(ep, rec.turns, 1.0)["tools"] == req["tools"]

    # sandflow's own prompts: the paper's submit, and the record stays as it always was
    scripted_model.push(submit())
    ep = run_episode(task(), fast_model(scripted_model), sandbox=clean_box).record
    assert scripted_model.requests[-1]["tools"] == tool_schemas()
    assert "tools" not in ep.config and sft_row(ep, [], 1.0)["tools"] == tool_schemas()
