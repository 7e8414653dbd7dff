"""One episode: a model, a sandbox, a task, and the ReAct loop between them.

The loop, in one sitting (mini-swe-agent style), is one function: `react` in
tasks/react.py::

    messages = [system, instance]                     # the prefix every request extends
    for step in range(max_steps):
        reply = model(messages, tools)                # retries inside; infra errors end it
        messages.append(reply)                        # append-only: never edited later
        if no tool calls: messages.append(continue prompt)
        for each tool call, in order: messages.append(its own tool result)
        record the turn
        if submit was called: stop
    answer = output/answer.txt (fallbacks: submit's argument, the last message)

Exactly one termination reason per episode (records.Termination). Infrastructure
failures (model_error, sandbox_error, interrupted) are told apart from the model's
own (max_steps, context_exhausted, wall_clock) so they can be retried, not graded.

`run_episode` is the entry point the flows call from a Prefect task (one task per
episode). `mode="llm"` runs the paper's baseline through the same records.

The rest is in modules of their own, and importable from here as before:

    tasks/episode.py   the episode's state and steps (ask the model, run a tool, record,
                       read the answer, end); EpisodeResult, EpisodePrefix, End
    tasks/react.py     the loop
    tasks/stepped.py   SteppedEpisode: the same loop with a trainer's policy taking turns
    tasks/budgets.py   Limits, TurnBudget (what one turn's tool calls may cost)
    tasks/opening.py   the sandbox's config, opening it, placing the task's inputs
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from datasets_prep.task import Task
from sandbox.base import Sandbox, SandboxConfig
from tasks.answers import extract_answer
from tasks.budgets import Limits, TurnBudget
from tasks.episode import (
    CancelCheck,
    End,
    Episode,
    EpisodePrefix,
    EpisodeResult,
    EventHook,
    load_task_prompts,
    now,
    prepare,
    take_prefix,
)
from tasks.model import ModelClient, ModelConfig
from tasks.opening import enter, open_sandbox, place_inputs, sandbox_config
from tasks.react import react
from tasks.records import Mode, NullRecorder, Recorder
from tasks.stepped import SteppedEpisode

# What other modules import from here.
__all__ = [
    "CancelCheck",
    "EpisodePrefix",
    "EpisodeResult",
    "EventHook",
    "Limits",
    "SteppedEpisode",
    "TurnBudget",
    "load_task_prompts",
    "place_inputs",
    "run_episode",
]


def run_episode(
    task: Task,
    model_cfg: ModelConfig,
    sandbox_cfg: SandboxConfig | None = None,
    recorder: Recorder | None = None,
    *,
    mode: Mode = "sandbox",
    sample_index: int = 0,
    run_id: str = "adhoc",
    limits: Limits | None = None,
    sandbox: Sandbox | None = None,
    client: ModelClient | None = None,
    output_dir: Path | str | None = None,
    prompt_dir: str | None = None,
    on_event: EventHook | None = None,
    cancel: CancelCheck | None = None,
    prefix: EpisodePrefix | None = None,
) -> EpisodeResult:
    """Run one episode of `task` and record it; never raises for model or sandbox failures.

    Args:
        task: the question; its `input_files` are written to the prompt's input dir.
        model_cfg: endpoint and sampling (its API key is never recorded).
        sandbox_cfg: how to open the sandbox (mode="sandbox"); ignored when `sandbox` is given.
        recorder: receives start_episode / record_turn (after every turn) / finish_episode.
        mode: "sandbox" (tools in a sandbox) or "llm" (one call, documents inline, no tools).
        sample_index, run_id: with task.id and mode they make the episode id (records.episode_key).
        limits: max steps, context budget, tokens per call, wall clock, exec timeout.
        sandbox: an already open sandbox to use (left open); otherwise one is opened and closed.
        client: a ModelClient to reuse (connection pooling across episodes).
        output_dir: if set, the sandbox's output directory is copied here at the end.
        prompt_dir: a folder of prompt YAML files overriding the packaged ones.
        on_event: live-view hook, see EventHook.
        cancel: the run's cancel token (engine.cancel.CancelToken; anything with
            `is_set()`), checked after every model reply and tool call: once set, the
            episode ends as `interrupted` at that point (recorded, sandbox closed) and
            returns; as `budget_exhausted` when the token says so (`termination`: the
            run's budget was reached, engine.budget). A sandbox or model failure while it is set (the canceller removed the
            sandbox or closed the client under us) is `interrupted` too, not infrastructure.
        prefix: continue from these turns (tasks.replay): mode "sandbox" and `sandbox`
            (its state already rebuilt) are required; the model is first asked at turn
            len(prefix.turns), and `limits.max_steps` counts the prefix's turns too.

    Raises:
        KeyboardInterrupt: after recording the episode as "interrupted".
    """
    limits = limits or Limits()
    recorder = recorder or NullRecorder()
    prompts, messages, record = prepare(
        task, model_cfg, sandbox_cfg, limits, mode, sample_index, run_id, prompt_dir, sandbox
    )
    episode = Episode(
        task, model_cfg, prompts, limits, record, recorder, messages, on_event, client
    )
    episode.cancel = cancel
    if prefix is not None:
        if mode != "sandbox" or sandbox is None:
            raise ValueError("run_episode(prefix=...) needs mode 'sandbox' and the rebuilt sandbox")
        take_prefix(episode, prefix)
    recorder.start_episode(record)
    for turn in episode.turns:  # a prefix's turns, recorded as this episode's
        recorder.record_turn(turn)
    owned: Sandbox | None = None
    try:
        if mode == "llm":
            _run_llm(episode)
        else:
            if sandbox is None:
                owned = sandbox = open_sandbox(sandbox_config(sandbox_cfg, record, task))
            _run_sandbox(episode, sandbox, output_dir, start=len(episode.turns))
    except End as end:
        episode.end(end, sandbox)
    except KeyboardInterrupt:
        record.termination, record.error = "interrupted", "interrupted by the user (Ctrl+C)"
        episode.finish(owned)
        raise
    except BaseException:  # a bug, or the recorder failed: never leak the sandbox
        if owned is not None:
            with contextlib.suppress(Exception):
                owned.close()
        raise
    episode.finish(owned)
    return EpisodeResult(record, episode.turns, messages, episode.output_files)


def _run_sandbox(ep: Episode, sandbox: Sandbox, output_dir: Path | str | None, start: int) -> None:
    """The loop from turn `start` (0: a new episode, its inputs placed first), then the
    answer and the outputs, however it ended."""
    try:
        next(react(ep, enter(ep, sandbox, place=start == 0), start))  # ends by raising End
    finally:
        ep.collect(sandbox, output_dir)


def _run_llm(ep: Episode) -> None:
    """LLM mode (the paper's baseline): one call, the documents inline, no tools."""
    started = now()
    ep.on_event("request", 0)
    reply = ep.ask(None)
    ep.messages.append(reply.as_message())
    turn = ep.turn_record(0, started, reply)
    ep.on_event("reply", turn)
    ep.record_turn(turn)
    ep.record.answer = extract_answer(reply.content, ep.prompts.llm_answer)
    ep.record.answer_source = "reply" if ep.record.answer is not None else None
    raise End("submitted")
