"""Episodes -> ATIF trajectories (Agent Trajectory Interchange Format, Harbor's RFC 0001).

One JSON file per episode, at ATIF_VERSION, the newest version the `harbor` package's
models accept (harbor 0.26: v1.0-v1.8). What maps to what (docs/interop.md):

- The prompt messages (system, first user message) -> `system` / `user` steps.
- Each turn (one model call) -> one `agent` step: the assistant text as `message`, its
  reasoning, its tool calls (`arguments` parsed from the raw JSON text; text that is not
  a JSON object becomes `{}` with the raw text in the call's `extra`), the observations
  as `observation.results` (linked by `source_call_id`; exit code, time-out, OOM kill,
  truncation, error and duration in each result's `extra`), and `metrics`: prompt /
  completion / cached tokens, the server's token ids and logprobs where recorded.
- Messages the loop appended after the tools (a continue prompt) -> `user` steps.
- `final_metrics`: the episode's token totals and step count; the verdict (score,
  passed, verifier), termination, answer and task in the root `extra`.

Not carried over: cost (sandflow records no prices), and an episode with no prompt and
no turns (ATIF needs at least one step) is skipped; the summary names both.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from interop.common import (
    drop_none,
    iso,
    outcome,
    parse_arguments,
    sandflow_version,
    text_of,
    verdict,
)
from interop.names import atomic_open, prepare_out, safe_name
from interop.source import Episode, RunSource
from interop.summary import Summary
from tasks.conversation import tools_of, turn_parts
from tasks.records import TurnRecord

ATIF_VERSION = "ATIF-v1.8"
NO_COST = "cost_usd (sandflow records no prices)"


def _prompt_step(step_id: int, message: dict[str, Any]) -> dict[str, Any]:
    role = str(message.get("role") or "user")
    step: dict[str, Any] = {
        "step_id": step_id,
        "source": "system" if role == "system" else ("agent" if role == "assistant" else "user"),
        "message": text_of(message.get("content")),
    }
    if role not in ("system", "user", "assistant"):
        step["extra"] = {"role": role}
    return step


def _agent_step(step_id: int, turn: TurnRecord, model: str, summary: Summary) -> dict[str, Any]:
    calls, ids = [], set()
    for c in turn.tool_calls:
        args, problem = parse_arguments(c.arguments)
        call: dict[str, Any] = {"tool_call_id": c.id, "function_name": c.name, "arguments": args}
        if problem:
            call["extra"] = {"raw_arguments": c.arguments, "arguments_error": problem}
        calls.append(call)
        ids.add(c.id)
    results = []
    for o in turn.observations:
        extra = drop_none(outcome(o))
        extra.pop("tool_call_id")
        linked = o.tool_call_id in ids
        if not linked:  # an observation of no call of this step: keep its id aside
            extra["tool_call_id"] = o.tool_call_id
        results.append(drop_none({"source_call_id": o.tool_call_id if linked else None, "content": o.content, "extra": extra}))
    u = turn.usage
    metrics = drop_none(
        {
            "prompt_tokens": u.prompt_tokens,
            "completion_tokens": u.completion_tokens,
            "cached_tokens": u.cached_tokens,
            "prompt_token_ids": turn.prompt_token_ids,
            "completion_token_ids": turn.completion_token_ids,
            "logprobs": turn.completion_logprobs,
            "extra": drop_none(
                {
                    "reasoning_tokens": u.reasoning_tokens,
                    "finish_reason": turn.finish_reason,
                    "model_latency_s": turn.model_latency_s,
                    "tool_latency_s": turn.tool_latency_s,
                    "attempts": turn.attempts,
                    "request_max_tokens": turn.request_max_tokens,
                }
            ),
        }
    )
    step: dict[str, Any] = {
        "step_id": step_id,
        "timestamp": iso(turn.started_at),
        "source": "agent",
        "model_name": model or None,
        "message": turn.assistant_content or "",
        "reasoning_content": turn.reasoning_content or None,
        "tool_calls": calls or None,
        "observation": {"results": results} if results else None,
        "metrics": metrics,
        "llm_call_count": 1,
    }
    extra = drop_none(
        {
            "turn_index": turn.turn_index,
            "error": turn.error,
            "egress": [e.model_dump(mode="json") for e in turn.egress] or None,
        }
    )
    step["extra"] = extra
    return drop_none(step)


def trajectory(ep: Episode, run: dict[str, Any], summary: Summary) -> dict[str, Any] | None:
    """The ATIF trajectory of one episode (a JSON-ready dict), or None when it has no step."""
    e = ep.record
    steps: list[dict[str, Any]] = []
    for m in e.prompt_messages:
        steps.append(_prompt_step(len(steps) + 1, m))
    for t in ep.turns:  # tasks.conversation's order; an agent step holds its tool results
        for part, item in turn_parts(t):
            if part == "assistant":
                steps.append(_agent_step(len(steps) + 1, t, e.model, summary))
            elif part == "appended":
                steps.append(_prompt_step(len(steps) + 1, item))
    if not steps:
        return None
    s = ep.score
    return {
        "schema_version": ATIF_VERSION,
        "session_id": e.run_id,
        "trajectory_id": e.episode_id,
        "agent": drop_none(
            {
                "name": "sandflow",
                "version": sandflow_version(),
                "model_name": e.model or None,
                "tool_definitions": tools_of(e.mode, e.config, episode_id=e.episode_id) or None,
                "extra": {"mode": e.mode, "config": e.config},
            }
        ),
        "steps": steps,
        "notes": (
            "sandflow episode: the first steps are the prompt messages; each agent step is "
            "one model call with its tool calls and their observations."
        ),
        "final_metrics": {
            "total_prompt_tokens": e.prompt_tokens,
            "total_completion_tokens": e.completion_tokens,
            "total_cached_tokens": e.cached_tokens,
            "total_steps": len(steps),
            "extra": {
                "reasoning_tokens": e.reasoning_tokens,
                "num_turns": e.num_turns,
                "wall_s": e.wall_s,
                "model_s": e.model_s,
                "tool_s": e.tool_s,
            },
        },
        "extra": drop_none(
            {
                **e.identity(),
                "write_id": ep.write_id,
                "dataset": run.get("dataset"),
                "dataset_hash": run.get("dataset_hash"),
                "started_at": iso(e.started_at),
                "ended_at": iso(e.ended_at),
                **verdict(ep),
                "score_reason": s.reason if s else None,
            }
        ),
    }


def export_atif(root: Path | str, run_id: str, out: Path | str, *, episode_id: str | None = None) -> Summary:
    """Write one ATIF trajectory per episode of `run_id` (or only `episode_id`) into `out`.

    Streams: episodes are read and written a batch at a time. File names come from the
    episode id (sanitised: ids are data). Raises warehouse errors that name the run.
    """
    folder = Path(out)
    summary = Summary("atif", folder)
    with RunSource(root, run_id) as src:
        src.require()
        ids = src.ids(episode_id=episode_id)
        if episode_id is not None and not ids:
            from warehouse.query import RunNotFound

            raise RunNotFound(f"run {run_id!r} has no episode {episode_id!r}")
        prepare_out(folder)
        for ep in src.episodes(ids):
            doc = trajectory(ep, src.info, summary)
            if doc is None:
                summary.skip("no prompt and no turns: ATIF needs one step")
                continue
            with atomic_open(folder, safe_name(ep.record.episode_id, ".json")) as f:
                f.write(json.dumps(doc, ensure_ascii=False))
            summary.episodes += 1
            summary.files += 1
            summary.lose(NO_COST)
        summary.extra["schema_version"] = ATIF_VERSION
        summary.extra["skipped_files"] = src.skipped_files
    return summary
