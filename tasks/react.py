"""The ReAct loop, in one sitting: one function, read top to bottom (mini-swe-agent style).

`react` is the loop between a model and a sandbox's tools, from turn `start` until the
episode ends; it always ends by raising `End` with the one termination reason (submitted,
max_steps, or a limit or failure a step raised on the way). The steps that are more than
a line are the episode's own methods (tasks/episode.py): `ask` (one model call within the
wall clock and the context budget, retries inside), `call_tool` (one tool call within the
time left; a broken sandbox ends the episode), `record_turn`.

Who takes the turn: the model, asked here (`run_episode`, tasks/loop.py), or a trainer's
policy (`SteppedEpisode`, tasks/stepped.py, with `policy=True`): the loop then yields the
turn index and the trainer sends in (started, reply), so RL episodes run this very loop.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from datetime import datetime

from tasks.budgets import TurnBudget
from tasks.episode import End, Episode, now
from tasks.model import ModelReply
from tasks.records import Observation
from tasks.tools import ToolBox

PolicyTurn = tuple[datetime, ModelReply]  # when the policy got the observation, its reply


def react(
    ep: Episode, toolbox: ToolBox, start: int = 0, *, policy: bool = False
) -> Generator[int, PolicyTurn, None]:
    """Run turns `start`.. of `ep` on `toolbox` until the episode ends (End is raised).

    Without `policy` it never yields: `next(react(...))` runs the whole episode. With
    `policy`, each turn waits at the `yield` for the trainer's reply (see the docstring).
    """
    limits, messages = ep.limits, ep.messages
    for step in range(start, limits.max_steps):
        # 1. The assistant's turn: the model's reply (appended as it is: the history is
        #    append-only, so every request extends the previous one and prefix caches hit).
        if policy:
            started, reply = yield step
        else:
            started = now()
            ep.on_event("request", step)  # a cancelled run stops here (on_event raises End)
            reply = ep.ask(ep.prompts.tools)
        messages.append(reply.as_message())
        turn = ep.turn_record(step, started, reply)
        ep.on_event("reply", turn)
        if not reply.tool_calls:  # no tool called: ask it to go on (a user message)
            nudge = ep.prompts.continue_message()
            messages.append(nudge)
            turn.extra_messages.append(nudge)

        # 2. Every tool call, in order, each answered by its own tool message, within the
        #    turn's budget. A call that must not run (after submit, past the call cap or
        #    the byte budget) is still answered, with why, so the chat stays valid.
        submitted = False
        budget = TurnBudget(limits, len(reply.tool_calls))
        t_tools = time.perf_counter()
        for call in reply.tool_calls:
            refusal = (
                ("not executed after submit", "Not executed: submit already ended the task.")
                if submitted
                else budget.refusal()
            )
            if refusal is not None:
                skipped = Observation(
                    tool_call_id=call.id, name=call.name, error=refusal[0], content=refusal[1]
                )
                turn.observations.append(skipped)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": skipped.content})
                continue
            ep.on_event("tool", call)
            result = ep.call_tool(toolbox, call, turn)  # a limit or a broken sandbox: End
            obs = result.observation
            budget.charge(obs)  # clipped to the bytes the turn has left
            turn.observations.append(obs)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": obs.content})
            ep.on_event("observation", obs)
            if result.submitted:
                submitted, ep.submit_args = True, result.submit_args
        turn.tool_latency_s = time.perf_counter() - t_tools

        # 3. The turn is recorded (the recorder gets it now, not at the episode's end);
        #    submit ends the episode. A policy learns at once that the episode is over
        #    (wall clock, context budget), not when it next replies.
        ep.record_turn(turn)
        if submitted:
            raise End("submitted")
        if policy and step + 1 < limits.max_steps:
            ep.check_limits()
    raise End("max_steps", f"no submit within {limits.max_steps} steps")
