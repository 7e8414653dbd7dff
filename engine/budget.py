"""A run's budget: `--max-cost USD` and `--max-run-tokens N` (issue #28).

What is spent = what the warehouse holds for the run (the tokens of its recorded turns,
priced with the run's price table through tasks.pricing, the cost module's one home)
+ the turns of the episodes running in this process, counted as their replies arrive.
Because the recorded part is read from the warehouse, the budget holds across resumed
runs and across Dask workers: each process re-reads it before an episode starts and
after one ends, at most every REFRESH_EVERY_S, in one SQL aggregate (an episode's turns
land in the warehouse when it ends; its spend is kept in memory until the next read has
counted them).

When the budget is reached the run's cancel token is cancelled with termination
`budget_exhausted`: no new episode starts (engine.episode.attempt), running ones stop
at their next turn boundary (tasks.loop checks the token before every model call) and
are recorded `budget_exhausted`, an infrastructure-like ending (tasks.records
INFRA_TERMINATIONS): never graded, never retried, re-run on resume. A resume with a
higher budget finishes the run.

A turn whose server reported no usage (or an impossible count: tasks.records bounds
every count) cannot be counted, so a budget cannot be held against that endpoint: the
first such reply stops the run with one sentence saying so (its tools run and it is
recorded, as for a spent budget), and a resume with a budget over a run that holds such
turns starts nothing. Resume without --max-cost / --max-run-tokens to go on regardless.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.cancel import CancelToken, renew_after_budget
from engine.plan import RunConfigError
from tasks.pricing import Price, load_prices
from tasks.records import Spend, TurnRecord, Usage
from tasks.spec import RunSpec

TERMINATION = "budget_exhausted"
# How often a process re-reads the warehouse's count as episodes end: what other workers
# spent reaches this one at most this late (its own spend is counted live).
REFRESH_EVERY_S = 2.0


@dataclass(frozen=True)
class Spent:
    """Tokens (prompt + completion) and USD (None: no price, only a token budget), and
    the turns whose server reported no usage (what they cost is not known)."""

    tokens: int
    usd: float | None
    unreported: int = 0

    def __add__(self, other: Spent) -> Spent:
        usd = None if self.usd is None or other.usd is None else self.usd + other.usd
        return Spent(self.tokens + other.tokens, usd, self.unreported + other.unreported)

    def __sub__(self, other: Spent) -> Spent:
        usd = None if self.usd is None or other.usd is None else self.usd - other.usd
        return Spent(self.tokens - other.tokens, usd, self.unreported - other.unreported)


def price_for(run: RunSpec) -> Price | None:
    """The run's model's price at its endpoint from the run's table (None: not named)."""
    return load_prices(run.budget.prices or None).lookup(run.endpoint.model, run.endpoint.base_url)


def check_priced(run: RunSpec) -> None:
    """A cost budget needs a price for the model: one sentence, before any work."""
    if run.budget.max_cost_usd is not None and price_for(run) is None:
        raise RunConfigError(
            f"--max-cost {run.budget.max_cost_usd:g}: the price table has no price for model "
            f"{run.endpoint.model!r} (at {run.endpoint.base_url}), so its cost cannot be counted; add it "
            "with --prices (docs/cost.md)"
        )


def _usage_spent(price: Price | None, priced: bool, u: Usage) -> Spent:
    tokens = (u.prompt_tokens or 0) + (u.completion_tokens or 0)
    if u.prompt_tokens is None or u.completion_tokens is None:
        return Spent(tokens, 0.0 if priced else None, unreported=1)
    if not priced:
        return Spent(tokens, None)
    usd = (
        price.cost(u.prompt_tokens or 0, u.completion_tokens or 0, u.cached_tokens, u.reasoning_tokens)
        if price is not None
        else None
    )
    return Spent(tokens, usd or 0.0)


class RunBudget:
    """One run's budget in one process; thread-safe (every episode thread reports here)."""

    def __init__(self, run: RunSpec, token: CancelToken) -> None:
        if not run.run_id:
            raise ValueError("a budget needs the run's id")
        self.run = run
        self.run_id = run.run_id
        self.max_cost_usd = run.budget.max_cost_usd
        self.max_tokens = run.budget.max_run_tokens
        self.price = price_for(run)
        self.token = token
        self._lock = threading.Lock()
        # the warehouse's count at the last read: per episode, and in total for the
        # episodes this process has not run (those it ran are counted from memory only)
        self._by_episode: dict[str, Spent] = {}
        self._others = self._zero()
        # episodes run here: what their finished attempts paid (earlier ones included)
        self._mine: dict[str, Spent] = {}
        self._mine_total = self._zero()
        self._running: dict[str, Spent] = {}  # the attempt in flight, reply by reply
        self._last_refresh = float("-inf")

    # -- what is spent --------------------------------------------------------------
    def _zero(self) -> Spent:
        return Spent(0, 0.0 if self.max_cost_usd is not None else None)

    def _spent(self, spend: Spend | None) -> Spent:
        """A recorded Spend in this budget's units (tokens, USD at the run's price)."""
        if spend is None:
            return self._zero()
        tokens = spend.prompt_tokens + spend.completion_tokens
        if self.max_cost_usd is None:
            return Spent(tokens, None, spend.unreported_turns)
        usd = (
            self.price.cost(spend.prompt_tokens, spend.completion_tokens, spend.cached_tokens,
                            spend.reasoning_tokens)
            if self.price else None
        )  # fmt: skip
        return Spent(tokens, usd or 0.0, spend.unreported_turns)

    def recorded_by_episode(self) -> dict[str, Spent]:
        """What each recorded episode of the run paid (0 without a warehouse): its current
        attempt's turns and every attempt it replaced (warehouse.cost.paid_by_episode, one
        SQL aggregate: the text of the turns is never read)."""
        if not self.run.recording.warehouse or not Path(self.run.recording.warehouse).is_dir():
            return {}
        from warehouse import Warehouse
        from warehouse.cost import paid_by_episode

        with Warehouse(self.run.recording.warehouse).query(
            run_id=self.run_id, tables=("episodes", "turns")
        ) as q:
            paid = paid_by_episode(q, self.run_id)
        return {k: self._spent(v) for k, v in paid.items()}

    def recorded(self) -> Spent:
        """What the warehouse says the run has paid."""
        total = self._zero()
        for s in self.recorded_by_episode().values():
            total = total + s
        return total

    def spent(self) -> Spent:
        with self._lock:
            total = self._others + self._mine_total
            for s in self._running.values():
                total = total + s
            return total

    def refresh(self) -> Spent:
        """Re-read the warehouse (other processes' and earlier runs' episodes), then check.
        An episode this process runs or ran is counted from memory, never from the read
        too: no episode is counted twice, and none is lost while its attempt is replaced."""
        with self._lock:
            self._last_refresh = time.monotonic()
        by_episode = self.recorded_by_episode()
        with self._lock:
            self._by_episode = by_episode
            others = self._zero()
            for key, s in by_episode.items():
                if key not in self._mine:
                    others = others + s
            self._others = others
        return self.check()

    def refresh_if_due(self) -> Spent:
        """Before an episode starts: refresh when the last read is REFRESH_EVERY_S old,
        else check what is known (a worker's first episode always reads the warehouse)."""
        with self._lock:
            due = time.monotonic() - self._last_refresh >= REFRESH_EVERY_S
        return self.refresh() if due else self.check()

    # -- the episodes of this process -------------------------------------------------
    def _track(self, episode_key: str, prior: Spend | None) -> None:
        """From now on `episode_key` is counted from memory (under the lock): what its
        earlier attempts paid (`prior`: the engine's record of it, the warehouse's at the
        run's start) moves from the warehouse's part to this process's."""
        if episode_key in self._mine:
            return
        recorded = self._by_episode.get(episode_key)
        if recorded is not None:
            self._others = self._others - recorded
        start = self._spent(prior) if prior is not None else (recorded or self._zero())
        self._mine[episode_key] = start
        self._mine_total = self._mine_total + start

    def attempt_started(self, episode_key: str, prior: Spend | None) -> None:
        """An attempt of `episode_key` starts here; `prior`: what its episode's earlier
        attempts paid (None: none known)."""
        with self._lock:
            self._track(episode_key, prior)
            self._running[episode_key] = self._zero()

    def hook(self, episode_key: str) -> Any:
        """The agent loop's event hook for one episode: counts each reply's usage."""

        def on_event(kind: str, payload: Any) -> None:
            if kind == "reply" and isinstance(payload, TurnRecord):
                add = _usage_spent(self.price, self.max_cost_usd is not None, payload.usage)
                with self._lock:
                    self._track(episode_key, None)
                    self._running[episode_key] = self._running.get(episode_key, self._zero()) + add
                self.check()

        return on_event

    def episode_ended(self, episode_key: str) -> None:
        """The attempt ended: what it paid stays counted with its episode (whatever a
        later attempt replaces); the warehouse is re-read at most every REFRESH_EVERY_S (a
        run of thousands of episodes re-read it once per episode: quadratic)."""
        with self._lock:
            spent = self._running.pop(episode_key, None)
            if spent is not None:
                self._track(episode_key, None)
                self._mine[episode_key] = self._mine[episode_key] + spent
                self._mine_total = self._mine_total + spent
        self.refresh_if_due()

    # -- the decision --------------------------------------------------------------
    def exceeded(self, spent: Spent) -> str | None:
        """One sentence naming the budget and what was spent, or None while within it."""
        if spent.unreported:
            return (
                f"the run's budget ({self._flags()}) cannot be held: the model endpoint "
                f"reported no usage for {spent.unreported} turn(s) of the run, so what they "
                "cost is unknown; resume without the budget, or against an endpoint that "
                "reports usage (docs/cost.md)"
            )
        if self.max_tokens is not None and spent.tokens >= self.max_tokens:
            return (
                f"the run's token budget (--max-run-tokens {self.max_tokens}) is spent: "
                f"{spent.tokens} tokens"
            )
        if self.max_cost_usd is not None and spent.usd is not None and spent.usd >= self.max_cost_usd:
            return (
                f"the run's cost budget (--max-cost {self.max_cost_usd:g} USD) is spent: "
                f"{spent.usd:.4f} USD over {spent.tokens} tokens"
            )
        return None

    def _flags(self) -> str:
        flags = []
        if self.max_cost_usd is not None:
            flags.append(f"--max-cost {self.max_cost_usd:g} USD")
        if self.max_tokens is not None:
            flags.append(f"--max-run-tokens {self.max_tokens}")
        return ", ".join(flags)

    def check(self) -> Spent:
        spent = self.spent()
        reason = self.exceeded(spent)
        if reason is not None:
            self.token.cancel(reason, termination=TERMINATION)
        return spent

    def summary(self) -> dict[str, Any]:
        """JSON-safe: the limits, what is spent, and whether the budget stopped the run."""
        spent = self.spent()
        return {
            "max_cost_usd": self.max_cost_usd,
            "max_run_tokens": self.max_tokens,
            "spent_tokens": spent.tokens,
            "spent_usd": spent.usd,
            "unreported_turns": spent.unreported,
            "exhausted": self.exceeded(spent) is not None,
        }


_lock = threading.Lock()
_budgets: dict[str, RunBudget] = {}


def has_budget(run: RunSpec) -> bool:
    return run.budget.max_cost_usd is not None or run.budget.max_run_tokens is not None


def budget_for(run: RunSpec) -> RunBudget | None:
    """The run's budget in this process (None: the run has none). A process that runs
    episodes of a run it did not start (a Dask worker) makes its own, reading the
    warehouse for what the others spent."""
    if not has_budget(run) or not run.run_id:
        return None
    with _lock:
        b = _budgets.get(run.run_id)
        if b is None or (b.max_cost_usd, b.max_tokens) != (run.budget.max_cost_usd, run.budget.max_run_tokens):
            # another budget than the one this process knew: a resume with a higher one
            b = _budgets[run.run_id] = RunBudget(run, renew_after_budget(run.run_id, TERMINATION))
        return b


def start(run: RunSpec, token: CancelToken) -> RunBudget | None:
    """The engine's budget for a run it starts (replacing any left from an earlier run in
    this process), checked against the warehouse before any episode starts."""
    if not has_budget(run) or not run.run_id:
        return None
    b = RunBudget(run, token)
    with _lock:
        _budgets[run.run_id] = b
    b.refresh()
    return b


def stop(run_id: str, budget: RunBudget | None) -> None:
    """Forget the run's budget in this process (the run ended)."""
    with _lock:
        if budget is not None and _budgets.get(run_id) is budget:
            del _budgets[run_id]
