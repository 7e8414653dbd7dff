"""What an episode may spend: its `Limits`, one turn's `TurnBudget`, the context budget.

The first limit reached ends the episode with its own termination reason
(records.Termination); the loop (tasks/react.py) asks these before and after each step.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from tasks.defaults import DEFAULT_MAX_STEPS, DEFAULT_WALL_CLOCK_S
from tasks.records import Observation
from tasks.tools import clip_bytes

MAX_CONTEXT_SHRINKS = 4  # a request too long for the model: max_tokens shrunk at most this often


class Limits(BaseModel):
    """Bounds of one episode. The first one reached ends it with its own reason."""

    max_steps: int = Field(DEFAULT_MAX_STEPS, ge=1, description="model calls (turns) per episode")
    context_tokens: int | None = Field(
        None, ge=256, description="budget for one request's prompt + completion tokens"
    )
    max_tokens_per_call: int | None = Field(None, ge=1, description="overrides the model's max_tokens")
    wall_clock_s: float | None = Field(
        DEFAULT_WALL_CLOCK_S, gt=0, description="the model's calls and commands (a hung endpoint: model_error)"
    )
    exec_timeout_s: float | None = Field(None, gt=0, description="per command; default: the sandbox's")
    max_observation_chars: int = Field(16_000, ge=200, description="one tool result, clipped in the middle")
    # One message may carry any number of tool calls (a policy's raw text, a hostile
    # model): these bound what one turn can cost. Calls past either bound are not run;
    # each still gets a short error result, so the chat stays valid and the model can
    # read why (docs/episodes.md, "Bounds of a turn").
    max_tool_calls_per_turn: int = Field(
        32, ge=1, description="tool calls run per assistant message; the rest answered with an error"
    )
    max_observation_bytes_per_turn: int = Field(
        262_144, ge=1024, description="UTF-8 bytes of tool results per turn; later calls are not run"
    )


class TurnBudget:
    """What one turn's tool calls may cost: `max_tool_calls_per_turn` calls run, and their
    results together hold at most `max_observation_bytes_per_turn` UTF-8 bytes.

    The result that crosses the byte budget is clipped to what is left (head and tail,
    with a notice); every call after the budget is spent, or past the call cap, is not
    run and is answered with a one-line error instead (its cost is proportional to the
    call the message sent, itself bounded by the reply's size).
    """

    def __init__(self, limits: Limits, calls: int) -> None:
        self.max_calls = limits.max_tool_calls_per_turn
        self.max_bytes = limits.max_observation_bytes_per_turn
        self.calls = calls
        self.ran = 0
        self.used = 0

    def refusal(self) -> tuple[str, str] | None:
        """(error label, the model's message) for a call that must not run; None: run it."""
        if self.ran >= self.max_calls:
            return (
                "over the tool-call limit",
                f"Not executed: at most {self.max_calls} tool calls run per message "
                f"({self.calls} were sent). Send the others in your next message.",
            )
        if self.used >= self.max_bytes:
            return (
                "over the observation budget",
                f"Not executed: this message's tool results reached {self.max_bytes} bytes. "
                "Call it again in your next message, with less output.",
            )
        return None

    def charge(self, obs: Observation) -> None:
        """Count a call that ran; clip its result to the bytes left in the turn."""
        self.ran += 1
        left = self.max_bytes - self.used
        obs.content, clipped = clip_bytes(
            obs.content, left, f"this message's tool results reached {self.max_bytes} bytes"
        )
        obs.truncated = obs.truncated or clipped
        self.used += len(obs.content.encode("utf-8"))
