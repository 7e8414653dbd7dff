"""The embedded model's chat engine: ChatML in, exact token ids out, one generation a turn.

What tasks/local_model_app.py serves (an OpenAI-compatible /v1/chat/completions), built on
llama-cpp-python's low-level API rather than its chat handlers, for four reasons:

- **Exact token ids, as vLLM returns them** (``return_token_ids``): ``prompt_token_ids``
  are the ids llama.cpp evaluated and ``choices[0].token_ids`` the ids it sampled, with
  each sampled token's logprob read from the logits that produced it. Nothing is
  re-tokenized afterwards. llama-cpp-python's chatml-function-calling handler made up to
  three generations per tool call and inserted text of its own between them, so no id
  sequence was "the completion".
- **An append-only history, token for token**: the prompt is tokenized message by
  message (header, body, trailer), and an assistant message this engine generated is
  put back as the very ids it sampled (a bounded map from the prompt it followed and its
  text to them),
  so turn k+1's prompt ids extend turn k's prompt + completion exactly
  (analysis/token_ids.py then assembles them with status "exact"), and the KV cache
  (llama.cpp's prefix reuse) pays only for a turn's new tokens.
- **Slots**: ``slots`` independent llama.cpp contexts on one model file (its weights
  mmapped once); a request goes to the free slot whose cached tokens share the longest
  prefix with its prompt, so interleaved episodes keep their caches.
- **Structured output that does not crash**: a tool call and a ``json_schema`` /
  ``json_object`` response format become one GBNF grammar, parsed by llama.cpp BEFORE
  sampling. llama-cpp-python passes a grammar's parser result to the sampler chain
  unchecked: a grammar llama.cpp rejects is a NULL sampler, and the next token is a
  SIGSEGV that takes the server down. Here a schema that cannot become a grammar is one
  clear 400 error.

Tool calls come in one of two text formats (``TOOL_FORMATS``, the engine's `tool_format`):

- ``chatml-function-calling`` (the default; what SmolLM2 was served with before):
  llama-cpp-python's format. The system message lists ``functions.NAME:`` with each
  parameters schema; the model answers either ``message:\\n<text>`` or one or more
  ``functions.NAME:\\n<JSON arguments>`` separated by newlines, the arguments constrained
  by the tool's schema. Tool results are rendered as ChatML ``tool`` messages (the old
  handler dropped them: the model never saw an observation).
- ``qwen2.5``: what TRL's Qwen2.5 chat template renders (``trl.chat_template_utils.
  qwen2_5_chat_template``, the template `sandflow train` trains with: rl/train.py), token
  for token: the tools as JSON lines in ``<tools>`` in the system message (Qwen's default
  system text when there is none), each call ``<tool_call>\\n{"name": ..., "arguments":
  ...}\\n</tool_call>``, tool results as ``<tool_response>`` blocks in one user turn, and
  each turn's text between the special tokens tokenized in one piece, as the template's
  tokenizer does (tests/rl/test_tool_format.py compares the ids). The model answers text,
  or ``<tool_call>`` blocks (after text or not), each block's JSON constrained by its
  tool's schema and the text unable to contain ``<tool_call>``; the blocks are read by
  tasks/replies.py. One difference from the template on purpose: message text is never
  read as special tokens (a tool output that prints ``<|im_end|>`` stays text).
"""

from __future__ import annotations

import ctypes
import json
import re
import threading
import time
import unicodedata
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

MAX_SCHEMA_BYTES = 64 << 10  # a response schema or one tool's parameters
MAX_TOOLS = 64
MAX_LOGIT_BIAS = 1024
MAX_TOP_LOGPROBS = 20
MAX_STOP = 8
EXACT_IDS_KEPT = 4096  # assistant messages whose sampled ids are remembered (LRU)

TOOLS_INTRO = (
    "\n\nYou have access to the following functions:\n"
)
TOOLS_OUTRO = (
    "\n\nYou can respond to users messages with either a single message or one or more function calls."
    "\n\nTo respond with a message begin the message with 'message:', use the following format:"
    "\n\nmessage:"
    "\n<message>"
    "\n\nTo respond with one or more function calls begin the message with 'functions.<function_name>:', "
    "use the following format:"
    "\n\nfunctions.<function_name>:"
    '\n{ "arg1": "value1", "arg2": "value2" }'
    "\nfunctions.<function_name>:"
    '\n{ "arg1": "value1", "arg2": "value2" }'
)
MESSAGE_PREFIX = "message:\n"
CHATML_FUNCTIONS = "chatml-function-calling"
QWEN25 = "qwen2.5"
TOOL_FORMATS = (CHATML_FUNCTIONS, QWEN25)
DEFAULT_TOOL_FORMAT = CHATML_FUNCTIONS
# TRL's qwen2_5_chat_template, its literal text
QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
QWEN_TOOLS_INTRO = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
QWEN_TOOLS_OUTRO = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}\n</tool_call>"
)
QWEN_CALL_OPEN = "<tool_call>"
_WS_BEFORE_ANY = re.compile(r"(?<=\s)\s(?=\S)")  # the last of a whitespace run: cut before it if a number follows
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_\-]{1,64}$")
# `{"type":"string"}` and friends: what json_schema_to_gbnf calls a JSON value of any kind
JSON_VALUE_GBNF = r"""
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws
object ::= "{" ws ( string ":" ws value ("," ws string ":" ws value)* )? "}" ws
array  ::= "[" ws ( value ("," ws value)* )? "]" ws
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F]) )* "\"" ws
number ::= "-"? ([0-9] | [1-9] [0-9]{0,15}) ("." [0-9]{1,16})? ([eE] [-+]? [0-9]{1,15})? ws
ws ::= | " " | "\n" [ \t]{0,20}
"""


class RequestError(Exception):
    """A request this engine refuses: `status` and one sentence for the client."""

    def __init__(self, message: str, status: int = 400, code: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.code = code


# --------------------------------------------------------------------------- grammars
def _schema_rules(converter: Any, schema: Any, name: str, what: str) -> str:
    """Add `schema`'s rules to `converter` under `name`; the rule's name."""
    if not isinstance(schema, dict):
        raise RequestError(f"{what}: a JSON schema must be an object, not {type(schema).__name__}")
    text = json.dumps(schema)
    if len(text) > MAX_SCHEMA_BYTES:
        raise RequestError(f"{what}: the schema is {len(text)} bytes, over the {MAX_SCHEMA_BYTES}-byte limit")
    try:
        resolved = converter.resolve_refs(json.loads(text), "request")
        return str(converter.visit(resolved, name))
    except RequestError:
        raise
    except Exception as e:  # the converter's own refusals (unsupported keywords, bad refs)
        raise RequestError(f"{what}: the schema cannot become a grammar ({type(e).__name__}: {e})") from None


# A JSON string's character. llama-cpp-python 0.3.16's port of llama.cpp's schema converter
# has `char ::= [^"\\] | ...`, which lets a raw newline or tab into a string: the reply is
# then not JSON (measured: "Invalid control character" in 1 of 6 question replies). The
# rule as llama.cpp's own converter writes it:
JSON_CHAR_RULE = r'[^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])'


def _converter() -> Any:
    from llama_cpp.llama_grammar import SchemaConverter

    return SchemaConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)


def _format(conv: Any) -> str:
    if "char" in conv._rules:  # noqa: SLF001
        conv._rules["char"] = JSON_CHAR_RULE  # noqa: SLF001
    return str(conv.format_grammar())


def schema_grammar(schema: dict[str, Any] | None, what: str = "response_format") -> str:
    """The GBNF grammar of JSON that validates against `schema` (None: any JSON object)."""
    if schema is None or schema == {} or schema == {"type": "object"}:
        return JSON_VALUE_GBNF
    conv = _converter()
    _schema_rules(conv, schema, "", what)  # "" is the converter's name for root
    return _format(conv)


def tools_grammar(tools: Sequence[dict[str, Any]], choice: str | None) -> str:
    """The grammar of one assistant turn with `tools`: a message or tool calls (`choice`
    "auto"), calls only ("required"), or a call of the one tool named by `choice`."""
    conv = _converter()
    calls = " | ".join(
        f"{conv._format_literal('functions.' + name + ':' + chr(10))} {rule}"  # noqa: SLF001
        for name, rule in _call_rules(conv, tools, choice)
    )
    if choice in (None, "auto"):
        root = f'root ::= {conv._format_literal(MESSAGE_PREFIX)} msg-text | tool-calls'  # noqa: SLF001
    else:
        root = "root ::= tool-calls"
    return "\n".join([
        root,
        'msg-text ::= [^\\x00]*',
        'tool-calls ::= tool-call ("\\n" tool-call)*',
        f"tool-call ::= {calls}",
        _format(conv),
    ])


def _without_rules(name: str, pattern: str) -> list[str]:
    """GBNF rules: `name` is any text (no NUL) that does not contain `pattern` (the
    pattern's matching automaton, one rule per matched prefix; deterministic)."""
    def step(k: int, c: str) -> int:  # longest prefix of pattern ending text[:k] + c
        t = pattern[:k] + c
        return next(j for j in range(min(len(t), len(pattern)), -1, -1) if t.endswith(pattern[:j]))

    def cls_char(c: str) -> str:
        return "\\" + c if c in "^]-\\" else c

    rules = []
    for k in range(len(pattern)):
        moves = {c: step(k, c) for c in sorted(set(pattern))}
        alts = [f'"{json.dumps(c)[1:-1]}" {name}-{j}' for c, j in moves.items() if 0 < j < len(pattern)]
        special = "".join(cls_char(c) for c, j in moves.items() if j != 0)
        alts.insert(0, f"[^{special}\\x00] {name}-0")
        rules.append(f"{name}-{k} ::= ( {' | '.join(alts)} )?")
    return [f"{name} ::= {name}-0", *rules]


def qwen_tools_grammar(tools: Sequence[dict[str, Any]], choice: str | None) -> str:
    """`tools_grammar` in the qwen2.5 format: text that holds no ``<tool_call>``, or
    ``<tool_call>`` blocks (after such text and a newline, or not) with each tool's
    arguments; "required" or a tool's name: blocks only."""
    conv = _converter()
    tail = conv._format_literal("}\n</tool_call>")  # noqa: SLF001
    alternatives = []
    for name, rule in _call_rules(conv, tools, choice):
        head = conv._format_literal(f'{QWEN_CALL_OPEN}\n{{"name": "{name}", "arguments": ')  # noqa: SLF001
        alternatives.append(f"{head} {rule} {tail}")
    if choice in (None, "auto"):
        root = 'root ::= tool-calls | msg-text | msg-text "\\n" tool-calls'
    else:
        root = "root ::= tool-calls"
    return "\n".join([
        root,
        *_without_rules("msg-text", QWEN_CALL_OPEN),
        'tool-calls ::= tool-call ("\\n" tool-call)*',
        f"tool-call ::= {' | '.join(alternatives)}",
        _format(conv),
    ])


def _call_rules(conv: Any, tools: Sequence[dict[str, Any]], choice: str | None) -> list[tuple[str, str]]:
    """(name, arguments rule) of each tool a turn may call under `choice` (every tool's
    arguments rule is defined, so the rule names stay the same whatever the choice)."""
    rules = [(t["function"]["name"], _args_rule(conv, t["function"], f"args{i}")) for i, t in enumerate(tools)]
    return [(name, rule) for name, rule in rules if choice in (None, "auto", "required") or choice == name]


def _args_rule(conv: Any, fn: dict[str, Any], rule: str) -> str:
    """The rule of one tool's arguments (any JSON object when its schema says nothing)."""
    params = fn.get("parameters") or {"type": "object"}
    if params in ({}, {"type": "object"}):
        conv._add_rule(rule, "object")  # noqa: SLF001 (the converter's one way in)
        for line in JSON_VALUE_GBNF.strip().splitlines()[1:]:
            k, v = line.split(" ::= ", 1)
            conv._add_rule(k.strip(), v)  # noqa: SLF001
        return rule
    return str(_schema_rules(conv, params, rule, f"tool {fn['name']!r} parameters"))


def check_grammar(vocab: Any, grammar: str) -> Any:
    """llama.cpp's own parse of `grammar`: a sampler, or RequestError (never NULL on)."""
    import llama_cpp

    sampler = llama_cpp.llama_sampler_init_grammar(vocab, grammar.encode("utf-8"), b"root")
    if not sampler:
        raise RequestError(
            "the requested structured output's grammar does not parse in llama.cpp "
            "(see the server log for its error)"
        )
    return sampler


# --------------------------------------------------------------------------- requests
@dataclass
class ChatRequest:
    """A validated /v1/chat/completions body (only what this engine uses)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_specs: list[dict[str, Any]] = field(default_factory=list)  # each tool as sent (qwen2.5 renders it)
    tool_choice: str | None = None  # None/"auto" | "none" | "required" | a tool's name
    max_tokens: int | None = None
    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 40
    min_p: float = 0.05
    repeat_penalty: float = 1.1
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    schema: dict[str, Any] | None = None
    json_mode: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    return_token_ids: bool = False
    tokens_as_ids: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)


def _num(body: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise RequestError(f"{key}: {v!r} is not a number in [{lo:g}, {hi:g}]")
    return float(v)


def _int_field(body: dict[str, Any], key: str, lo: int, hi: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise RequestError(f"{key}: {v!r} is not an integer in [{lo}, {hi}]")
    return v


def _text_of(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: the text ones
        parts = []
        for p in content:
            if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str):
                parts.append(p["text"])
            else:
                raise RequestError(f"{where}: only text content parts are supported")
        return "".join(parts)
    raise RequestError(f"{where}: content must be a string or a list of text parts")


def parse_request(body: Any, n_vocab: int) -> ChatRequest:
    """The request, or RequestError naming the field that is wrong."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    if body.get("stream"):
        raise RequestError("stream: the embedded model server answers non-streamed requests only")
    if body.get("n") not in (None, 1):
        raise RequestError("n: the embedded model server makes one choice per request")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise RequestError("messages: a non-empty list of messages is required")
    messages = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise RequestError(f"messages[{i}]: role must be system, user, assistant or tool")
        msg: dict[str, Any] = {"role": "system" if m["role"] == "developer" else m["role"],
                               "content": _text_of(m.get("content"), f"messages[{i}]")}
        calls = m.get("tool_calls")
        if calls:
            if m["role"] != "assistant" or not isinstance(calls, list):
                raise RequestError(f"messages[{i}]: tool_calls belong to assistant messages, as a list")
            msg["tool_calls"] = []
            for j, c in enumerate(calls):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise RequestError(f"messages[{i}].tool_calls[{j}]: a function with a name is required")
                args = fn.get("arguments")
                msg["tool_calls"].append({"name": fn["name"],
                                          "arguments": args if isinstance(args, str) else json.dumps(args)})
        messages.append(msg)
    req = ChatRequest(messages=messages)
    tools = body.get("tools") or []
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise RequestError(f"tools: a list of at most {MAX_TOOLS} tools")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not _TOOL_NAME.match(fn["name"]):
            raise RequestError(f"tools[{i}]: a function whose name is 1-64 letters, digits, _ or -")
        req.tools.append({"function": {"name": fn["name"], "description": fn.get("description"),
                                       "parameters": fn.get("parameters") or {"type": "object"}}})
        req.tool_specs.append(t)
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if isinstance(choice.get("function"), dict) else None
        if name not in {t["function"]["name"] for t in req.tools}:
            raise RequestError(f"tool_choice: no tool named {name!r} among the request's tools")
        req.tool_choice = name
    elif choice in (None, "auto", "none", "required"):
        req.tool_choice = choice
    else:
        raise RequestError("tool_choice: auto, none, required or {\"type\": \"function\", ...}")
    if req.tool_choice == "required" and not req.tools:
        raise RequestError("tool_choice required: the request has no tools")
    mt = body.get("max_completion_tokens", body.get("max_tokens"))
    if mt is not None and (isinstance(mt, bool) or not isinstance(mt, int)):
        raise RequestError(f"max_tokens: {mt!r} is not an integer")
    req.max_tokens = mt if isinstance(mt, int) and mt > 0 else None
    req.temperature = _num(body, "temperature", 0.8, 0.0, 100.0)
    req.top_p = _num(body, "top_p", 0.95, 0.0, 1.0)
    req.top_k = int(_num(body, "top_k", 40, -1, n_vocab))
    req.min_p = _num(body, "min_p", 0.05, 0.0, 1.0)
    req.repeat_penalty = _num(body, "repeat_penalty", _num(body, "repetition_penalty", 1.1, 0.0, 10.0), 0.0, 10.0)
    req.frequency_penalty = _num(body, "frequency_penalty", 0.0, -2.0, 2.0)
    req.presence_penalty = _num(body, "presence_penalty", 0.0, -2.0, 2.0)
    req.seed = _int_field(body, "seed", -(2**63), 2**64 - 1)
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stops, list) or len(stops) > MAX_STOP or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(f"stop: a string or a list of at most {MAX_STOP} non-empty strings")
    req.stop = stops
    req.logprobs = bool(body.get("logprobs"))
    req.top_logprobs = _int_field(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
    req.return_token_ids = bool(body.get("return_token_ids"))
    req.tokens_as_ids = bool(body.get("return_tokens_as_token_ids"))
    bias = body.get("logit_bias") or {}
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
        raise RequestError(f"logit_bias: an object of at most {MAX_LOGIT_BIAS} token ids")
    for k, v in bias.items():
        try:
            tok = int(k)
        except ValueError:
            raise RequestError(f"logit_bias: {k!r} is not a token id") from None
        if not 0 <= tok < n_vocab or isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
            raise RequestError(f"logit_bias: token {k} must be in [0, {n_vocab}) with a bias in [-100, 100]")
        req.logit_bias[tok] = float(v)
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
            raise RequestError("response_format: type text, json_object or json_schema")
        if rf["type"] == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
                raise RequestError("response_format.json_schema: an object with a schema")
            req.schema, req.json_mode = js.get("schema") or None, True
        elif rf["type"] == "json_object":
            req.schema, req.json_mode = rf.get("schema"), True
    guided = body.get("guided_json")  # vLLM's older field
    if guided is not None:
        req.schema, req.json_mode = (json.loads(guided) if isinstance(guided, str) else guided), True
    return req


# --------------------------------------------------------------------------- the engine
@dataclass
class Generation:
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]
    finish_reason: str
    cached_tokens: int
    text: str
    prefill_s: float
    decode_s: float


class Slot:
    """One llama.cpp context (its own KV cache) on the shared model file."""

    def __init__(self, llama: Any, index: int) -> None:
        self.llama = llama
        self.index = index
        self.busy = False
        self.last_used = 0.0

    def cached_prefix(self, prompt: Sequence[int]) -> int:
        ids = self.llama._input_ids  # noqa: SLF001 (the tokens its KV cache holds)
        n = min(len(ids), len(prompt))
        if n == 0:
            return 0
        a = np.asarray(ids[:n])
        b = np.asarray(prompt[:n])
        diff = np.nonzero(a != b)[0]
        return int(diff[0]) if diff.size else n


class Sampling:
    """A sampler chain and, apart from it, a grammar checked only when needed.

    llama.cpp's own common sampler does the same: sample with the chain, check the one
    token against the grammar, and only when it is rejected apply the grammar to the
    whole vocabulary and sample again. A grammar in the chain would walk all ~49k
    candidates at every token (measured: twice the decode time of a plain reply)."""

    _DTYPE = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)], align=True)

    def __init__(self, chain: Any, grammar: Any, n_vocab: int) -> None:
        self.chain = chain
        self.grammar = grammar
        self.n_vocab = n_vocab
        self.buf = np.zeros(n_vocab, dtype=self._DTYPE) if grammar is not None else None
        self.ids = np.arange(n_vocab, dtype=np.int32)

    def _candidates(self, logits: Any) -> Any:
        import llama_cpp

        assert self.buf is not None
        self.buf["id"] = self.ids
        self.buf["logit"] = logits
        self.buf["p"] = 0.0
        return llama_cpp.llama_token_data_array(
            data=self.buf.ctypes.data_as(llama_cpp.llama_token_data_p), size=self.n_vocab,
            selected=-1, sorted=False)

    def sample(self, ctx: Any) -> int:
        import llama_cpp

        if self.grammar is None:
            return int(llama_cpp.llama_sampler_sample(self.chain.sampler, ctx, -1))
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(self.n_vocab,))
        cur = self._candidates(logits)
        llama_cpp.llama_sampler_apply(self.chain.sampler, ctypes.byref(cur))
        tok = int(cur.data[cur.selected].id)
        one = (llama_cpp.llama_token_data * 1)()
        one[0].id, one[0].logit, one[0].p = tok, 1.0, 0.0  # type: ignore[assignment]
        single = llama_cpp.llama_token_data_array(data=one, size=1, selected=-1, sorted=False)
        llama_cpp.llama_sampler_apply(self.grammar, ctypes.byref(single))
        if not np.isfinite(one[0].logit):  # rejected: the grammar first, then the chain
            cur = self._candidates(logits)
            llama_cpp.llama_sampler_apply(self.grammar, ctypes.byref(cur))
            llama_cpp.llama_sampler_apply(self.chain.sampler, ctypes.byref(cur))
            tok = int(cur.data[cur.selected].id)
        llama_cpp.llama_sampler_accept(self.grammar, tok)
        llama_cpp.llama_sampler_accept(self.chain.sampler, tok)
        return tok

    def close(self) -> None:
        import llama_cpp

        if self.grammar is not None:
            llama_cpp.llama_sampler_free(self.grammar)
            self.grammar = None


StopNow = Callable[[], bool]  # per sampled token: True stops (client gone, budget spent)
Gone = Callable[[], bool]  # True once the client has left (asked while waiting for a slot)


class ChatEngine:
    """Slots over one GGUF file; thread-safe (each request takes a slot)."""

    def __init__(self, model_path: str, n_ctx: int = 8192, n_threads: int = 2, slots: int = 1,
                 n_batch: int = 512, verbose: bool = False, tool_format: str = DEFAULT_TOOL_FORMAT) -> None:
        import llama_cpp

        if tool_format not in TOOL_FORMATS:
            raise ValueError(f"tool_format {tool_format!r}: one of {', '.join(TOOL_FORMATS)}")
        self.tool_format = tool_format
        self.n_ctx = n_ctx
        self.slots = [
            Slot(llama_cpp.Llama(model_path=model_path, n_ctx=n_ctx, n_threads=n_threads,
                                 n_threads_batch=n_threads, n_batch=n_batch, logits_all=False,
                                 verbose=verbose), i)
            for i in range(max(1, slots))
        ]
        first = self.slots[0].llama
        self.vocab = first._model.vocab  # noqa: SLF001
        self.n_vocab = first.n_vocab()
        self.add_bos = bool(first._model.add_bos_token())  # noqa: SLF001
        self._cond = threading.Condition()
        # (hash of the prompt ids it followed, its text) -> the ids sampled for it: the same
        # text can come from different ids, never after the same prompt
        self._exact: OrderedDict[tuple[int, str], tuple[int, ...]] = OrderedDict()
        self._exact_lock = threading.Lock()
        self._tok_lock = threading.Lock()
        self.stats = {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0,
                      "prefill_s": 0.0, "decode_s": 0.0, "grammar_refused": 0}

    # ---- tokens
    def tokenize(self, text: str, special: bool, bos: bool = False) -> list[int]:
        if not text:
            return []
        with self._tok_lock:
            return list(self.slots[0].llama.tokenize(text.encode("utf-8"), add_bos=bos, special=special))

    def detokenize(self, ids: Sequence[int]) -> str:
        with self._tok_lock:
            return self.slots[0].llama.detokenize(list(ids)).decode("utf-8", errors="replace")

    def piece(self, tok: int) -> bytes:
        with self._tok_lock:
            return bytes(self.slots[0].llama.detokenize([tok]))

    def remember(self, prompt: Sequence[int], body: str, ids: Sequence[int]) -> None:
        key = (hash(tuple(prompt)), body)
        with self._exact_lock:
            self._exact[key] = tuple(ids)
            self._exact.move_to_end(key)
            while len(self._exact) > EXACT_IDS_KEPT:
                self._exact.popitem(last=False)

    def _exact_ids(self, prompt: Sequence[int], body: str) -> list[int] | None:
        key = (hash(tuple(prompt)), body)
        with self._exact_lock:
            ids = self._exact.get(key)
            if ids is not None:
                self._exact.move_to_end(key)
            return list(ids) if ids is not None else None

    # ---- prompt
    @staticmethod
    def tools_text(tools: Sequence[dict[str, Any]]) -> str:
        lines = [TOOLS_INTRO]
        for t in tools:
            fn = t["function"]
            lines.append(f"\nfunctions.{fn['name']}:\n{json.dumps(fn['parameters'])}\n")
        return "".join(lines) + TOOLS_OUTRO

    @staticmethod
    def assistant_body(msg: dict[str, Any], with_tools: bool) -> str:
        calls = msg.get("tool_calls") or []
        parts = []
        if msg.get("content") or not calls:
            parts.append((MESSAGE_PREFIX if with_tools else "") + msg.get("content", ""))
        parts += [f"functions.{c['name']}:\n{c['arguments']}" for c in calls]
        return "\n".join(parts)

    def prompt_ids(self, req: ChatRequest) -> list[int]:
        """The request's prompt, message by message (see the module doc)."""
        if self.tool_format == QWEN25:
            return self.qwen_prompt_ids(req)
        with_tools = bool(req.tools) and req.tool_choice != "none"
        msgs = list(req.messages)
        if with_tools and not any(m["role"] == "system" for m in msgs):
            msgs.insert(0, {"role": "system", "content": ""})
        ids: list[int] = []
        tools_done = False
        end = self.tokenize("<|im_end|>", special=True)
        nl = self.tokenize("\n", special=False)
        for m in msgs:
            head = self.tokenize(f"<|im_start|>{m['role']}\n", special=True, bos=self.add_bos and not ids)
            if m["role"] == "assistant":
                body = self.assistant_body(m, with_tools)
                body_ids = self._exact_ids(ids + head, body)
                if body_ids is None:
                    body_ids = self.tokenize(body, special=False)
            else:
                text = m["content"]
                if m["role"] == "system" and with_tools and not tools_done:
                    text += self.tools_text(req.tools)
                    tools_done = True
                body_ids = self.tokenize(text, special=False)
            ids += head + body_ids + end + nl
        ids += self.tokenize("<|im_start|>assistant\n", special=True)
        return ids

    def tokenize_as_trained(self, text: str) -> list[int]:
        """`text` tokenized as the training's tokenizer does (transformers' reading of the
        GGUF file: GPT-2's byte-level split with no digit split of its own). llama.cpp's
        smollm split takes digits out first, so a whitespace run before a digit is one
        piece there and gives its last character to the digit in transformers ("\\n  1":
        "\\n " + " " + "1", not "\\n  " + "1"); the text is cut there, then tokenized."""
        cuts = [m.start() for m in _WS_BEFORE_ANY.finditer(text)
                if unicodedata.category(text[m.start() + 1])[0] == "N"]  # \\p{N}, as both splits mean it
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        return [t for chunk in chunks for t in self.tokenize(chunk, special=False)]

    def qwen_prompt_ids(self, req: ChatRequest) -> list[int]:
        """The qwen2.5 format's prompt: each turn's text between <|im_start|> and
        <|im_end|> tokenized in one piece (as the template's tokenizer does), an assistant
        turn this engine generated as the ids it sampled."""
        start = self.tokenize("<|im_start|>", special=True, bos=self.add_bos)
        im_start = start[-1:]
        ids: list[int] = start[:-1]  # the BOS, if the model wants one
        end = self.tokenize("<|im_end|>", special=True)
        nl = self.tokenize("\n", special=False)
        head = self.tokenize("assistant\n", special=False)
        tools = req.tool_specs if req.tools and req.tool_choice != "none" else []
        for text, body in qwen_turns(req.messages, tools):
            exact = self._exact_ids(ids + im_start + head, body) if body is not None else None
            turn = head + exact if exact is not None else self.tokenize_as_trained(text)
            ids += im_start + turn + end + nl
        return ids + im_start + head

    # ---- slots
    def _take_slot(self, prompt: Sequence[int], gone: Gone) -> Slot:
        with self._cond:
            while True:
                free = [s for s in self.slots if not s.busy]
                if free:
                    # the longest cached prefix, if it is worth keeping; else the least
                    # recently used slot (a prompt that shares only its first tokens with
                    # a cache must not evict it)
                    best = max(free, key=lambda s: (s.cached_prefix(prompt), -s.last_used))
                    if best.cached_prefix(prompt) < min(64, len(prompt) // 2):
                        best = min(free, key=lambda s: s.last_used)
                    best.busy = True
                    return best
                if gone():
                    raise RequestError("the client left while waiting for a slot", status=499)
                self._cond.wait(timeout=0.2)

    def _give_back(self, slot: Slot) -> None:
        with self._cond:
            slot.busy = False
            slot.last_used = time.monotonic()
            self._cond.notify()

    # ---- generation
    def _sampler(self, req: ChatRequest, grammar: str | None) -> Sampling:
        import llama_cpp
        from llama_cpp import _internals

        chain = _internals.LlamaSampler()
        if req.logit_bias:
            chain.add_logit_bias(self.n_vocab, req.logit_bias)
        if req.repeat_penalty != 1.0 or req.frequency_penalty or req.presence_penalty:
            chain.add_penalties(penalty_last_n=64, penalty_repeat=req.repeat_penalty,
                                penalty_freq=req.frequency_penalty, penalty_present=req.presence_penalty)
        seed = req.seed if req.seed is not None else llama_cpp.LLAMA_DEFAULT_SEED
        seed &= 0xFFFFFFFF
        if req.temperature == 0.0:
            chain.add_greedy()
        else:
            chain.add_top_k(req.top_k if req.top_k > 0 else self.n_vocab)
            chain.add_top_p(req.top_p, 1)
            chain.add_min_p(req.min_p, 1)
            chain.add_temp(req.temperature)
            chain.add_dist(seed)
        return Sampling(chain, check_grammar(self.vocab, grammar) if grammar else None, self.n_vocab)

    def generate(self, req: ChatRequest, prompt: list[int], max_tokens: int, grammar: str | None,
                 stop_now: StopNow, gone: Gone = lambda: False) -> Generation:
        import llama_cpp

        if len(prompt) >= self.n_ctx:
            raise RequestError(
                f"This model's maximum context length is {self.n_ctx} tokens. However, you requested "
                f"{len(prompt) + 1} tokens ({len(prompt)} in the messages, at least 1 in the completion).",
                code="context_length_exceeded")
        max_tokens = min(max_tokens, self.n_ctx - len(prompt))
        slot = self._take_slot(prompt, gone)
        try:
            llama = slot.llama
            sampler = self._sampler(req, grammar)
            cached = min(slot.cached_prefix(prompt), len(prompt) - 1)  # the last one gives logits
            t0 = time.perf_counter()
            llama.n_tokens = cached
            llama.eval(prompt[cached:])
            t1 = time.perf_counter()
            ctx = llama._ctx.ctx  # noqa: SLF001
            out: list[int] = []
            lps: list[float] = []
            tops: list[list[tuple[int, float]]] = []
            text = b""
            finish = "length"
            stop_bytes = [s.encode("utf-8") for s in req.stop]
            while len(out) < max_tokens:
                tok = sampler.sample(ctx)
                if stop_now():
                    finish = "length"
                    break
                logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(self.n_vocab,))
                m = float(logits.max())
                lse = m + float(np.log(np.exp(logits - m).sum()))
                out.append(tok)
                lps.append(float(logits[tok]) - lse)
                if req.top_logprobs:
                    k = req.top_logprobs
                    idx = np.argpartition(-logits, k)[:k]
                    idx = idx[np.argsort(-logits[idx])]
                    tops.append([(int(i), float(logits[i]) - lse) for i in idx])
                if llama_cpp.llama_vocab_is_eog(self.vocab, tok):
                    finish = "stop"
                    break
                text += self.piece(tok)
                if stop_bytes and any(s in text for s in stop_bytes):
                    finish = "stop"
                    break
                llama.eval([tok])
            t2 = time.perf_counter()
            sampler.close()
        finally:
            self._give_back(slot)
        decoded = self.detokenize(out[:-1] if finish == "stop" and out and _is_eog(self.vocab, out[-1]) else out)
        cut = decoded
        for s in req.stop:
            if s in cut:
                cut = cut[: cut.index(s)]
        with self._cond:
            st = self.stats
            st["requests"] += 1
            st["prompt_tokens"] += len(prompt)
            st["cached_tokens"] += cached
            st["completion_tokens"] += len(out)
            st["prefill_s"] += t1 - t0
            st["decode_s"] += t2 - t1
        return Generation(prompt, out, lps, tops, finish, cached, cut, t1 - t0, t2 - t1)

    # ---- one chat completion
    def chat(self, body: Any, max_tokens_cap: int, stop_now: StopNow, model: str,
             always_token_ids: bool = False, gone: Gone = lambda: False) -> dict[str, Any]:
        """One /v1/chat/completions reply. `always_token_ids`: every reply carries the
        prompt and completion ids and the logprobs, asked for or not (the embedded model's
        default: every run on it gets exact token rows)."""
        req = parse_request(body, self.n_vocab)
        if always_token_ids:
            req.return_token_ids = req.logprobs = True
        with_tools = bool(req.tools) and req.tool_choice != "none"
        qwen = self.tool_format == QWEN25
        grammar = None
        if with_tools:
            grammar = (qwen_tools_grammar if qwen else tools_grammar)(req.tools, req.tool_choice)
        elif req.json_mode:
            grammar = schema_grammar(req.schema)
        prompt = self.prompt_ids(req)
        limit = min(req.max_tokens or max_tokens_cap, max_tokens_cap)
        gen = self.generate(req, prompt, limit, grammar, stop_now, gone)
        message: dict[str, Any] = {"role": "assistant", "content": gen.text}
        finish = gen.finish_reason
        if with_tools:
            names = [t["function"]["name"] for t in req.tools]
            content, calls = (qwen_parse(gen.text) if qwen else parse_tool_text(gen.text, names))
            message["content"] = content
            if calls:
                message["tool_calls"] = [
                    {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                     "function": {"name": n, "arguments": a}} for n, a in calls
                ]
                if finish == "stop":
                    finish = "tool_calls"
            turn = {"content": content or "", "tool_calls": [{"name": n, "arguments": a} for n, a in calls]}
            remembered = qwen_assistant_body(turn) if qwen else self.assistant_body(turn, True)
        else:
            remembered = self.assistant_body({"content": gen.text}, False)
        body_ids = gen.completion_ids
        if body_ids and finish != "length" and _is_eog(self.vocab, body_ids[-1]):
            body_ids = body_ids[:-1]
        if not req.stop:  # with a stop string the text is cut: its ids are not the body's
            self.remember(prompt, remembered, body_ids)
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
        if req.logprobs:
            choice["logprobs"] = {"content": [self._lp_entry(t, lp, req, gen.top[i] if gen.top else [])
                                              for i, (t, lp) in enumerate(zip(gen.completion_ids, gen.logprobs,
                                                                              strict=True))]}
        reply: dict[str, Any] = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(gen.prompt_ids),
                "completion_tokens": len(gen.completion_ids),
                "total_tokens": len(gen.prompt_ids) + len(gen.completion_ids),
                "prompt_tokens_details": {"cached_tokens": gen.cached_tokens},
            },
            "timings": {"prefill_s": round(gen.prefill_s, 6), "decode_s": round(gen.decode_s, 6),
                        "prompt_evaluated": len(gen.prompt_ids) - gen.cached_tokens},
        }
        if req.return_token_ids:
            reply["prompt_token_ids"] = gen.prompt_ids
            choice["token_ids"] = gen.completion_ids
        return reply

    def _lp_entry(self, tok: int, lp: float, req: ChatRequest, top: list[tuple[int, float]]) -> dict[str, Any]:
        def name(t: int) -> tuple[str, list[int]]:
            raw = self.piece(t)
            return (f"token_id:{t}" if req.tokens_as_ids else raw.decode("utf-8", errors="replace")), list(raw)

        text, raw = name(tok)
        entry: dict[str, Any] = {"token": text, "logprob": lp, "bytes": raw, "top_logprobs": []}
        for t, v in top:
            tt, tb = name(t)
            entry["top_logprobs"].append({"token": tt, "logprob": v, "bytes": tb})
        return entry


def _is_eog(vocab: Any, tok: int) -> bool:
    import llama_cpp

    return bool(llama_cpp.llama_vocab_is_eog(vocab, tok))


def parse_tool_text(text: str, names: Sequence[str]) -> tuple[str | None, list[tuple[str, str]]]:
    """(content, [(tool name, arguments text)]) of a generated turn in the tool format;
    text in neither form is the content."""
    if text.startswith(MESSAGE_PREFIX):
        return text[len(MESSAGE_PREFIX):], []
    alternation = "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))
    if not alternation:
        return text, []
    header = re.compile(rf"(?:^|\n)functions\.({alternation}):\n")
    marks = list(header.finditer(text))
    if not marks or marks[0].start() != 0:
        return text, []
    calls = []
    for i, m in enumerate(marks):
        end = marks[i + 1].start() if i + 1 < len(marks) else len(text)
        calls.append((m.group(1), text[m.end():end]))
    return None, calls


# --------------------------------------------------------------------------- qwen2.5
def _tojson(value: Any) -> str:
    """The template's `tojson` filter (transformers': json.dumps, non-ASCII kept)."""
    return json.dumps(value, ensure_ascii=False)


def qwen_call_block(name: str, arguments: str) -> str:
    """One tool call as the template renders it; arguments that are JSON are rendered as
    the value they are (the trainer's calls hold objects), others as the string."""
    try:
        value: Any = json.loads(arguments)
    except ValueError:
        value = arguments
    return f'{QWEN_CALL_OPEN}\n{{"name": "{name}", "arguments": {_tojson(value)}}}\n</tool_call>'


def qwen_assistant_body(msg: dict[str, Any]) -> str:
    """An assistant turn's text after ``<|im_start|>assistant\\n``: its content, then
    each call's block on a line of its own."""
    parts = [msg["content"]] if msg.get("content") else []
    parts += [qwen_call_block(c["name"], c["arguments"]) for c in msg.get("tool_calls") or []]
    return "\n".join(parts)


def qwen_turns(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]]) -> list[tuple[str, str | None]]:
    """The turns TRL's qwen2_5_chat_template renders for `messages` and `tools`, each as
    (its text between <|im_start|> and <|im_end|>, the assistant body or None)."""
    first_system = bool(messages) and messages[0]["role"] == "system"
    system = messages[0]["content"] if first_system else QWEN_SYSTEM
    if tools:
        system += QWEN_TOOLS_INTRO + "".join("\n" + _tojson(t) for t in tools) + QWEN_TOOLS_OUTRO
    turns: list[tuple[str, str | None]] = [("system\n" + system, None)]
    previous = None
    for m in messages[1 if first_system else 0:]:
        if m["role"] == "tool":
            block = f"\n<tool_response>\n{m['content']}\n</tool_response>"
            if previous == "tool":  # consecutive results share one user turn
                turns[-1] = (turns[-1][0] + block, None)
            else:
                turns.append(("user" + block, None))
        elif m["role"] == "assistant":
            body = qwen_assistant_body(m)
            turns.append(("assistant\n" + body, body))
        else:
            turns.append((f"{m['role']}\n{m['content']}", None))
        previous = m["role"]
    return turns


def qwen_parse(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """(content, [(tool name, arguments text)]) of a turn generated in the qwen2.5 format:
    the ``<tool_call>`` blocks as tasks/replies.py reads them, the text before them the
    content (None when there is none)."""
    from tasks.replies import parse_text_tool_calls

    calls = parse_text_tool_calls(text, "hermes")
    if not calls:
        return text, []
    content = text[: text.find(QWEN_CALL_OPEN)]
    content = content[:-1] if content.endswith("\n") else content
    return content or None, [(c.name, c.arguments) for c in calls]
