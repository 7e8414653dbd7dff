"""Runs -> Inspect AI eval logs (`.eval`), one per task set and mode.

The `.eval` format is a zip: `header.json` (the EvalLog without samples: spec, plan,
results, stats), `samples/<id>_epoch_<n>.json` (one EvalSample each),
`summaries.json` (the sample list `inspect view` shows) and `_journal/start.json`.
It is written here as plain JSON into a zip, so inspect-ai is not a dependency of
sandflow; the tests read every log back with `inspect_ai.log.read_eval_log`.

Streaming: samples go into the zip one at a time; summaries are spooled to a temporary
file and copied in at the end; results and usage are running sums. What maps to what:

- a sample is an episode: id = task id, epoch = sample index + 1 (repeated samples of
  a task are Inspect's epochs), input = the prompt's user message, target = the ground
  truth recorded with the score;
- messages: the prompt, then each turn's assistant message (reasoning as a reasoning
  part, tool calls with their parsed arguments; text that is not a JSON object becomes
  `{}` with `parse_error` naming it and holding the raw text), each observation as a
  tool message (time-outs and tool errors as its `error`; exit code, OOM kill,
  truncation and duration in its `metadata`), then messages appended after the tools;
- scores: the current score under its verifier's name (value, answer, reason as
  explanation, passed in metadata); results: accuracy and its standard error per
  verifier; model_usage: prompt / completion / cached / reasoning tokens;
- infrastructure failures (model_error, sandbox_error, interrupted) become the sample's
  `error`; max_steps / wall_clock / context_exhausted its `limit` (turn / time /
  context) when the episode's config names the limit.

Not carried over: token ids and logprobs (Inspect keeps logprobs per choice of one
generation, not per turn; the ATIF and Hugging Face exports carry them), egress
requests; the summary counts the episodes concerned.
"""

from __future__ import annotations

import hashlib
import json
import math
import tempfile
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from interop.common import iso, outcome, parse_arguments, sandflow_version, text_of
from interop.names import atomic_open, prepare_out, safe_name
from interop.source import Episode, RunSource, quote
from interop.summary import Summary
from tasks.records import TurnRecord

LOG_VERSION = 2  # EvalLog.version inspect-ai 0.3.x writes and reads
_STOP = {"stop": "stop", "tool_calls": "tool_calls", "length": "max_tokens", "content_filter": "content_filter"}
_LIMITS = {"max_steps": ("turn", "max_steps"), "wall_clock": ("time", "wall_clock_s"), "context_exhausted": ("context", "context_tokens")}
NO_TOKEN_IDS = "token ids and logprobs (Inspect has no per-turn place for them)"
NO_EGRESS = "egress requests"


def _assistant(t: TurnRecord, model: str) -> dict[str, Any]:
    content: Any = t.assistant_content or ""
    if t.reasoning_content:
        content = [{"type": "reasoning", "reasoning": t.reasoning_content}, {"type": "text", "text": content}]
    msg: dict[str, Any] = {"role": "assistant", "content": content, "source": "generate", "model": model}
    calls = []
    for c in t.tool_calls:
        args, problem = parse_arguments(c.arguments)
        call: dict[str, Any] = {"id": c.id, "function": c.name, "arguments": args, "type": "function"}
        if problem:
            call["parse_error"] = f"{problem}: {c.arguments}"
        calls.append(call)
    if calls:
        msg["tool_calls"] = calls
    return msg


def _tool(o: Any) -> dict[str, Any]:
    msg: dict[str, Any] = {
        "role": "tool",
        "content": o.content,
        "tool_call_id": o.tool_call_id,
        "function": o.name,
        "metadata": {k: v for k, v in outcome(o).items() if k not in ("tool_call_id", "name", "error")},
    }
    if o.timed_out:
        msg["error"] = {"type": "timeout", "message": o.error or "the command timed out"}
    elif o.error:
        kind = "parsing" if "JSON" in o.error or "input" in o.error else "unknown"
        msg["error"] = {"type": kind, "message": o.error}
    return msg


def _plain(m: dict[str, Any]) -> dict[str, Any]:
    role = str(m.get("role") or "user")
    if role not in ("system", "user", "assistant"):
        return {"role": "user", "content": text_of(m.get("content")), "metadata": {"role": role}}
    return {"role": role, "content": text_of(m.get("content"))}


def messages(ep: Episode) -> list[dict[str, Any]]:
    e = ep.record
    out = [_plain(m) for m in e.prompt_messages]
    for t in ep.turns:
        out.append(_assistant(t, e.model))
        out.extend(_tool(o) for o in t.observations)
        out.extend(_plain(m) for m in t.extra_messages)
    return out


def _usage(e: Any) -> dict[str, Any]:
    return {
        "input_tokens": e.prompt_tokens,
        "output_tokens": e.completion_tokens,
        "total_tokens": e.prompt_tokens + e.completion_tokens,
        "input_tokens_cache_read": e.cached_tokens,
        "reasoning_tokens": e.reasoning_tokens,
    }


def _input(ep: Episode) -> str:
    users = [m for m in ep.record.prompt_messages if m.get("role") == "user"]
    return text_of(users[-1].get("content")) if users else ""


def sample(ep: Episode, summary: Summary) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the EvalSample, its EvalSampleSummary) of one episode, as JSON-ready dicts."""
    e = ep.record
    msgs = messages(ep)
    last = next((m for m in reversed(msgs) if m["role"] == "assistant"), None)
    finish = ep.turns[-1].finish_reason if ep.turns else None
    output: dict[str, Any] = {"model": e.model, "choices": [], "completion": e.answer or ""}
    if last is not None:
        output["choices"] = [{"message": last, "stop_reason": _STOP.get(finish or "", "unknown")}]
    output["usage"] = _usage(e)
    scores = None
    if ep.score is not None:
        s = ep.score
        scores = {
            s.verifier: {
                "value": s.score,
                "answer": e.answer,
                "explanation": s.reason,
                "metadata": {"passed": s.passed, "verifier": s.verifier},
            }
        }
    metadata = {**e.identity(), "termination": e.termination, "answer_source": e.answer_source}
    common: dict[str, Any] = {
        "id": e.task_id,
        "epoch": e.sample_index + 1,
        "input": _input(ep),
        "target": ep.ground_truth or "",
        "metadata": metadata,
        "model_usage": {e.model: _usage(e)},
        "started_at": iso(e.started_at),
        "completed_at": iso(e.ended_at),
        "total_time": e.wall_s,
        "working_time": e.model_s + e.tool_s,
    }
    if scores:
        common["scores"] = scores
    full: dict[str, Any] = {**common, "messages": msgs, "output": output, "turn_count": len(ep.turns)}
    short: dict[str, Any] = {**common, "completed": True, "message_count": len(msgs), "turn_count": len(ep.turns)}
    if e.is_infra_failure:
        msg = e.error or f"episode ended with {e.termination}"
        full["error"] = {"message": msg, "traceback": "", "traceback_ansi": ""}
        short["error"] = msg
    limit = _LIMITS.get(e.termination or "")
    if limit:
        value = (e.config.get("limits") or {}).get(limit[1])
        if isinstance(value, int | float):
            full["limit"] = {"type": limit[0], "limit": float(value), "reason": e.error}
            short["limit"] = limit[0]
    if any(t.prompt_token_ids or t.completion_token_ids or t.completion_logprobs for t in ep.turns):
        summary.lose(NO_TOKEN_IDS)
    if any(t.egress for t in ep.turns):
        summary.lose(NO_EGRESS)
    return full, short


@dataclass
class _Tally:
    """Running sums for one log's results and stats (nothing per sample is kept)."""

    total: int = 0
    completed: int = 0
    scores: dict[str, list[float]] = field(default_factory=dict)  # verifier -> [n, sum, sumsq]
    usage: dict[str, dict[str, int]] = field(default_factory=dict)
    started: datetime | None = None
    ended: datetime | None = None

    def add(self, ep: Episode) -> None:
        e = ep.record
        self.total += 1
        self.completed += 0 if e.is_infra_failure else 1
        if ep.score is not None:
            acc = self.scores.setdefault(ep.score.verifier, [0.0, 0.0, 0.0])
            acc[0] += 1
            acc[1] += ep.score.score
            acc[2] += ep.score.score**2
        u = self.usage.setdefault(e.model, {})
        for k, v in _usage(e).items():
            u[k] = u.get(k, 0) + v
        if e.started_at and (self.started is None or e.started_at < self.started):
            self.started = e.started_at
        if e.ended_at and (self.ended is None or e.ended_at > self.ended):
            self.ended = e.ended_at

    def results(self) -> dict[str, Any]:
        out = []
        for name, (n, s, sq) in sorted(self.scores.items()):
            mean = s / n
            var = max(sq / n - mean**2, 0.0) * n / (n - 1) if n > 1 else 0.0
            out.append(
                {
                    "name": name,
                    "scorer": name,
                    "scored_samples": int(n),
                    "unscored_samples": self.total - int(n),
                    "params": {},
                    "metrics": {
                        "accuracy": {"name": "accuracy", "value": mean, "params": {}},
                        "stderr": {"name": "stderr", "value": math.sqrt(var / n), "params": {}},
                    },
                }
            )
        return {"total_samples": self.total, "completed_samples": self.completed, "scores": out}


def _spec(run: dict[str, Any], run_id: str, mode: str, model: str, samples: int) -> dict[str, Any]:
    dataset = run.get("dataset") or "tasks"
    task = f"{Path(str(dataset)).stem or 'tasks'}-{mode}"
    created = run.get("started_at") or datetime.now(UTC)
    ident = hashlib.sha256(f"{run_id}\x1f{mode}".encode()).hexdigest()[:22]
    run_meta = {
        k: (iso(v) if isinstance(v, datetime) else v)
        for k, v in run.items()
        if k in ("run_id", "dataset", "dataset_hash", "model", "image", "image_id", "series", "status", "sandflow_version")
    }
    return {
        "eval_id": ident,
        "run_id": run_id,
        "created": iso(created) if isinstance(created, datetime) else str(created),
        "task": task,
        "task_id": hashlib.sha256(f"{run.get('dataset_hash')}\x1f{mode}".encode()).hexdigest()[:22],
        "task_version": 0,
        "task_attribs": {},
        "task_args": {"mode": mode},
        "task_args_passed": {},
        "solver_args_passed": {},
        "tags": ["sandflow", mode],
        "dataset": {"name": str(dataset), "samples": samples},
        "model": model,
        "model_generate_config": {},
        "model_args": {},
        "config": {},
        "packages": {"sandflow": sandflow_version()},
        "metadata": {"sandflow_run": run_meta, "mode": mode},
    }


def _write_log(folder: Path, name: str, spec: dict[str, Any], mode: str, episodes: Iterable[Episode], summary: Summary) -> int:
    tally = _Tally()
    plan = {"name": "plan", "steps": [{"solver": f"sandflow_{mode}", "params": {}}], "config": {}}
    with (
        atomic_open(folder, name, "wb") as f,
        tempfile.TemporaryFile("w+", encoding="utf-8") as spool,
        zipfile.ZipFile(f, "w", compression=zipfile.ZIP_DEFLATED) as zf,
    ):
        zf.writestr("_journal/start.json", json.dumps({"version": LOG_VERSION, "eval": spec, "plan": plan}))
        members: set[str] = set()
        for ep in episodes:
            full, short = sample(ep, summary)
            member = f"samples/{safe_name(ep.record.task_id)}_epoch_{full['epoch']}.json"
            if member in members:  # the same (task, sample) twice: never overwrite one
                summary.skip("a second episode of the same task and sample index")
                continue
            members.add(member)
            zf.writestr(member, json.dumps(full, ensure_ascii=False))
            spool.write(("," if tally.total else "") + json.dumps(short, ensure_ascii=False))
            tally.add(ep)
            summary.episodes += 1
        spool.seek(0)
        with zf.open("summaries.json", "w") as out:
            out.write(b"[")
            while chunk := spool.read(1 << 20):
                out.write(chunk.encode("utf-8"))
            out.write(b"]")
        spec["dataset"]["samples"] = tally.total
        stats = {
            "started_at": iso(tally.started) or "",
            "completed_at": iso(tally.ended) or "",
            "model_usage": tally.usage,
        }
        header = {
            "version": LOG_VERSION,
            "status": "success",
            "eval": spec,
            "plan": plan,
            "results": tally.results(),
            "stats": stats,
            "invalidated": False,
            "tags": [],
            "metadata": {},
        }
        zf.writestr("header.json", json.dumps(header, ensure_ascii=False))
    return tally.total


def export_inspect(root: Path | str, run_id: str, out: Path | str) -> Summary:
    """Write `<run>_<mode>.eval` per mode of `run_id` into `out` (a run has one task set)."""
    folder = Path(out)
    summary = Summary("inspect", folder)
    logs: list[str] = []
    with RunSource(root, run_id) as src:
        src.require()
        prepare_out(folder)
        for mode in src.modes():
            ids = src.ids(mode=mode)
            models = [r[0] for r in src.q.rows(f"SELECT DISTINCT model FROM episodes WHERE mode = {quote(mode)}")]
            model = models[0] if len(models) == 1 else str(src.info.get("model") or "mixed")
            name = safe_name(f"{run_id}_{mode}", ".eval")
            spec = _spec(src.info, run_id, mode, model, len(ids))
            _write_log(folder, name, spec, mode, src.episodes(ids), summary)
            logs.append(name)
            summary.files += 1
        summary.extra["logs"] = logs
        summary.extra["skipped_files"] = src.skipped_files
    return summary
