"""One exact token sequence per trajectory, from the ids the server returned per turn.

The one implementation (issue #23: "token assembly once") behind the token rows of
`sandflow flows rollouts` and the rollout server's replies (both named by
analysis.trajectory: `token_row`, `rollout_fields`) and the `token_ids_status` every RL
episode records (rl.recording).

Layout (verl / SkyRL multi-turn): ``prompt_ids`` is the first request's prompt;
``response_ids`` are the turns' completions (mask 1, their logprobs) with the
environment's tokens between them (mask 0, logprob 0.0), the latter taken from the next
request's prompt ids. That is only sound when every request's prompt ids extend the
previous prompt plus its completion exactly (an append-only history and a chat template
that renders it back token for token), and when the ids agree with the usage the server
reported. When they do not, nothing is re-tokenized: the trajectory carries no ids and
`status` says why ("mismatch at turn N: ..."). Logprobs are all-or-nothing: when any turn
came without them the trajectory has none (None), never zeros standing in for them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tasks.records import TurnRecord

Detokenize = Callable[[list[int]], str]


@dataclass
class TokenTrajectory:
    status: str  # "exact" | "missing" | "mismatch at turn N: why"
    prompt_ids: list[int] | None = None
    response_ids: list[int] | None = None
    response_mask: list[int] | None = None
    response_logprobs: list[float] | None = None  # None when a turn came without logprobs
    spans: list[tuple[int, int]] = field(default_factory=list)  # completion i: [start, end)

    @property
    def exact(self) -> bool:
        return self.status == "exact"


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def _turn_problem(t: TurnRecord, detokenize: Detokenize | None) -> str | None:
    """Why one turn's recorded ids cannot be trusted, or None."""
    if t.prompt_token_ids is None or t.completion_token_ids is None:
        which = "prompt" if t.prompt_token_ids is None else "completion"
        return f"the server returned no {which} token ids"
    if t.usage.prompt_tokens is not None and len(t.prompt_token_ids) != t.usage.prompt_tokens:
        return f"{len(t.prompt_token_ids)} prompt ids but usage says {t.usage.prompt_tokens}"
    if t.usage.completion_tokens is not None and len(t.completion_token_ids) != t.usage.completion_tokens:
        return f"{len(t.completion_token_ids)} completion ids but usage says {t.usage.completion_tokens}"
    if t.completion_logprobs is not None and len(t.completion_logprobs) != len(t.completion_token_ids):
        return f"{len(t.completion_logprobs)} logprobs for {len(t.completion_token_ids)} completion ids"
    text = t.assistant_content
    if detokenize is not None and text and text.strip() not in detokenize(list(t.completion_token_ids)):
        return ("its completion ids decode to text that does not contain the recorded assistant "
                "content (re-tokenization drift)")
    return None


def assemble(turns: Sequence[TurnRecord], detokenize: Detokenize | None = None) -> TokenTrajectory:
    """The trajectory's tokens, or the reason there are none (see the module docstring).
    `detokenize`: also check each completion's ids against the recorded text."""
    if not turns or all(t.prompt_token_ids is None and t.completion_token_ids is None for t in turns):
        return TokenTrajectory(status="missing")
    for t in turns:
        problem = _turn_problem(t, detokenize)
        if problem is not None:
            return TokenTrajectory(status=f"mismatch at turn {t.turn_index}: {problem}")
    with_logprobs = all(t.completion_logprobs is not None for t in turns)
    prompt = list(turns[0].prompt_token_ids or [])
    response: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    spans: list[tuple[int, int]] = []
    seen = list(prompt)
    for i, t in enumerate(turns):
        p = list(t.prompt_token_ids or [])
        if p[: len(seen)] != seen:
            at = _first_difference(p, seen)
            return TokenTrajectory(
                status=f"mismatch at turn {t.turn_index}: its prompt ids do not extend the previous "
                f"prompt and completion (first difference at token {at} of {len(seen)}; the chat "
                "template re-renders the history differently, e.g. it drops reasoning)"
            )
        if i > 0:
            env = p[len(seen) :]
            response += env
            mask += [0] * len(env)
            logprobs += [0.0] * len(env)
        c = list(t.completion_token_ids or [])
        spans.append((len(response), len(response) + len(c)))
        response += c
        mask += [1] * len(c)
        logprobs += list(t.completion_logprobs or []) if with_logprobs else [0.0] * len(c)
        seen = p + c
    return TokenTrajectory(
        status="exact",
        prompt_ids=prompt,
        response_ids=response,
        response_mask=mask,
        response_logprobs=logprobs if with_logprobs else None,
        spans=spans,
    )
