"""A data build's budget: `sandflow data build --max-cost USD / --max-run-tokens N` (issue #28).

What the build spent = every reply its generator was paid for + the calibration run's turns:

- synthesis: the build's reply cache (`<out>/cache/synth.jsonl`) holds every reply the
  generator returned to this build, with its usage (a model error is not a reply and
  costs nothing here). It is the build's durable record of its paid calls, read when the
  stage starts, so the budget holds across resumes and whichever process runs the build
  (the folder is the build). A cached reply is reused free: it was counted once.
- calibration: the base policy's episodes are an engine run (`<build>-cal-<key>`), given
  what is left of the budget as its own (engine.budget): its recorded turns in the
  warehouse count, across resumes and Dask workers.

Reached during synthesis: no more slot asks the model (those slots are dropped as
`budget_exhausted`), the stage is not finished (no stage record: the next run does it
again, its cached replies free), and the build stops with BudgetExhausted. During
calibration: the engine stops the run (`budget_exhausted`), nothing is graded from it,
and the build stops the same way. Resuming with a higher budget finishes the build.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tasks.pricing import Price

TERMINATION = "budget_exhausted"  # as engine.budget.TERMINATION


class BudgetExhausted(RuntimeError):
    """The build's budget stopped it; one sentence naming the budget, what was spent and
    how to go on."""


@dataclass
class BuildBudget:
    """The build's limits and what it spent; thread-safe (synthesis asks in threads)."""

    max_cost_usd: float | None = None
    max_tokens: int | None = None
    price: Price | None = None  # the generator's price (needed with max_cost_usd)
    spent_tokens: int = 0
    spent_usd: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def active(self) -> bool:
        return self.max_cost_usd is not None or self.max_tokens is not None

    def add(self, prompt: int, completion: int, cached: int = 0, reasoning: int = 0) -> None:
        usd = (self.price.cost(prompt, completion, cached, reasoning) or 0.0) if self.price is not None else 0.0
        with self._lock:
            self.spent_tokens += prompt + completion
            self.spent_usd += usd

    def add_rows(self, rows: Iterable[Mapping[str, Any]]) -> None:
        """Reply-cache rows (datagen.synth.ReplyCache): each was paid once."""
        for r in rows:
            self.add(*(_count(r.get(k)) for k in ("prompt_tokens", "completion_tokens",
                                                  "cached_tokens", "reasoning_tokens")))

    def exceeded(self) -> str | None:
        """One sentence naming the budget and what is spent, or None while within it."""
        with self._lock:
            tokens, usd = self.spent_tokens, self.spent_usd
        if self.max_tokens is not None and tokens >= self.max_tokens:
            return (f"the build's token budget (--max-run-tokens {self.max_tokens}) is spent: "
                    f"{tokens} tokens")
        if self.max_cost_usd is not None and usd >= self.max_cost_usd:
            return (f"the build's cost budget (--max-cost {self.max_cost_usd:g} USD) is spent: "
                    f"{usd:.4f} USD over {tokens} tokens")
        return None

    def left(self) -> tuple[float | None, int | None]:
        """(USD, tokens) still to spend (None: no such limit); a calibration run's budget."""
        with self._lock:
            usd = None if self.max_cost_usd is None else max(0.0, self.max_cost_usd - self.spent_usd)
            tokens = None if self.max_tokens is None else max(0, self.max_tokens - self.spent_tokens)
        return usd, tokens

    def summary(self) -> dict[str, Any]:
        return {"max_cost_usd": self.max_cost_usd, "max_run_tokens": self.max_tokens,
                "spent_tokens": self.spent_tokens,
                "spent_usd": round(self.spent_usd, 6) if self.max_cost_usd is not None else None}


def _count(v: Any) -> int:
    """A token count from the cache file (a file on disk: bounded, never trusted)."""
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**62 else 0
