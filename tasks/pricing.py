"""What a model's tokens cost: the price table, its one home.

A price table maps a model (or an endpoint + model) to dollars per million tokens of four
kinds. The application (sandflow/config.py) resolves it from the config file's
``[prices]`` table, ``--prices FILE`` or ``SANDFLOW_PRICES``; a run records the table it
ran with (``runs.config.prices``), so its cost is computed from what the warehouse holds
(warehouse/cost.py: the ``turn_cost`` / ``episode_cost`` / ``run_cost`` views).

Why no default prices: a price that is silently wrong is worse than none. A model the
table does not name costs *unknown* (NULL in SQL, None here), never 0.

Token semantics follow the OpenAI usage object, which every OpenAI-compatible server
reports the same way: ``prompt_tokens`` *includes* the cached ones and
``completion_tokens`` *includes* the reasoning ones. So a turn costs

    (prompt - cached) * input + cached * cached_input
    + (completion - reasoning) * output + reasoning * reasoning

per million; ``cached_input`` defaults to ``input`` and ``reasoning`` to ``output``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, RootModel, ValidationError, field_validator

PER = 1_000_000  # prices are per million tokens


class Price(BaseModel):
    """Dollars per million tokens of one model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    input: float = Field(..., ge=0, description="USD per million prompt tokens (not cached)")
    cached_input: float | None = Field(None, ge=0, description="USD per million cached prompt tokens; default: input")
    output: float = Field(..., ge=0, description="USD per million completion tokens (not reasoning)")
    reasoning: float | None = Field(None, ge=0, description="USD per million reasoning tokens; default: output")

    @field_validator("input", "cached_input", "output", "reasoning")
    @classmethod
    def _finite(cls, v: float | None) -> float | None:
        if v is not None and not math.isfinite(v):
            raise ValueError("a price must be a finite number of dollars per million tokens")
        return v

    def rates(self) -> tuple[float, float, float, float]:
        """(input, cached_input, output, reasoning) in USD per million, defaults filled in."""
        cached = self.input if self.cached_input is None else self.cached_input
        reasoning = self.output if self.reasoning is None else self.reasoning
        return self.input, cached, self.output, reasoning

    def cost(
        self,
        prompt_tokens: int | None,
        completion_tokens: int | None,
        cached_tokens: int | None = 0,
        reasoning_tokens: int | None = 0,
    ) -> float | None:
        """USD of one call's usage; None when the server reported no usage (unknown, not 0)."""
        if prompt_tokens is None or completion_tokens is None:
            return None
        inp, cached_rate, out, reas = self.rates()
        cached = min(cached_tokens or 0, prompt_tokens)
        reasoning = min(reasoning_tokens or 0, completion_tokens)
        return (
            (prompt_tokens - cached) * inp
            + cached * cached_rate
            + (completion_tokens - reasoning) * out
            + reasoning * reas
        ) / PER


class PriceTable(RootModel[dict[str, Price]]):
    """Model -> Price. A key is a model name, or ``"<base_url> <model>"`` (one space) for a
    price that holds at one endpoint only; the endpoint's entry wins over the model's.

    JSON / TOML example::

        {"gpt-4o-mini": {"input": 0.15, "cached_input": 0.075, "output": 0.60},
         "http://gpu:8000/v1 Qwen3-Coder": {"input": 0.0, "output": 0.0}}
    """

    root: dict[str, Price] = Field(default_factory=dict)

    @field_validator("root")
    @classmethod
    def _keys(cls, v: dict[str, Price]) -> dict[str, Price]:
        for key in v:
            parts = key.split(" ")
            if not key.strip() or len(parts) > 2 or any(not p for p in parts):
                raise ValueError(
                    f"price table key {key!r}: use a model name, or '<base_url> <model>' "
                    "separated by one space"
                )
        return v

    def lookup(self, model: str | None, base_url: str | None = None) -> Price | None:
        """The model's price at this endpoint; None: not in the table (its cost is unknown)."""
        if not model:
            return None
        if base_url:
            for url in (base_url, base_url.rstrip("/")):
                hit = self.root.get(f"{url} {model}")
                if hit is not None:
                    return hit
        return self.root.get(model)

    def __bool__(self) -> bool:
        return bool(self.root)

    def public_dict(self) -> dict[str, Any]:
        """JSON-safe: what a run records in its config."""
        return self.model_dump(mode="json", exclude_none=True)


def load_prices(value: str | Path | dict[str, Any] | None) -> PriceTable:
    """A price table from a mapping, JSON text or a JSON file's path; raises ValueError
    with one sentence naming the file, key or field that is wrong."""
    if value is None:
        return PriceTable({})
    where = "the price table"
    data: Any = value
    if isinstance(value, Path | str):
        text = str(value)
        if isinstance(value, Path) or not text.lstrip().startswith(("{", "[")):
            path = Path(value).expanduser()
            where = f"price file {path}"
            try:
                text = path.read_text(encoding="utf-8")
            except OSError as exc:
                raise ValueError(f"{where} cannot be read: {exc.strerror or exc}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where} is not JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be a JSON object of model -> prices, not {type(data).__name__}")
    try:
        return PriceTable.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"] if p != "root") or "(top level)"
        msg = str(err["msg"]).removeprefix("Value error, ")
        raise ValueError(f"{where}: {loc}: {msg}") from None
