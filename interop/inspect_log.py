"""Runs -> Inspect AI eval logs (`.eval`), one per task set and mode.

The `.eval` format is a zip: `header.json` (the EvalLog without samples: spec, plan,
results, stats), `samples/<id>_epoch_<n>.json` (one EvalSample each),
`summaries.json` (the sample list `inspect view` shows) and `_journal/start.json`.
It is written here as plain JSON into a zip, so inspect-ai is not a dependency of
sandflow; the tests read every log back with each public reader of inspect-ai's log API.

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
- ids: every message has one (`<episode id>-m<n>`), every event (`-e<n>`), the sample
  (`-s`); the header lists the task ids (`dataset.sample_ids`) and the epochs, which
  `read_eval_log_samples` walks; a grid that lacks a (task, epoch) is `cancelled`;
- events: a model event per turn (its input as references into the sample's message
  pool, `events_data`: the messages before its reply, never a copy per turn), a tool
  event per tool call, a score event: what `events_df`, `messages_df` and the
  transcript of `inspect view` read;
- scores: the current score under the run's scorer `sandflow` and under its verifier's
  name (value, answer, reason as explanation, passed in metadata); results: first the
  run's accuracy over every scored sample (the headline: the log list and `evals_df`
  show it), then accuracy and its standard error per verifier; model_usage: prompt /
  completion / cached / reasoning tokens;
- infrastructure failures (model_error, sandbox_error, interrupted) become the sample's
  `error`; max_steps / wall_clock / context_exhausted its `limit` (turn / time /
  context) when the episode's config names the limit.

Not carried over: token ids and logprobs (Inspect's logprobs name each token's text;
sandflow records token ids; the ATIF and Hugging Face exports carry them), egress
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
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from interop.common import iso, outcome, parse_arguments, sandflow_version, text_of
from interop.names import atomic_open, prepare_out, safe_name
from interop.source import Episode, RunSource, quote
from interop.summary import Summary
from tasks.conversation import tools_of, turn_parts
from tasks.records import EpisodeRecord, TurnRecord

LOG_VERSION = 2  # EvalLog.version inspect-ai 0.3.x writes and reads
_STOP = {"stop": "stop", "tool_calls": "tool_calls", "length": "max_tokens", "content_filter": "content_filter"}
RUN_SCORER = "sandflow"  # every scored sample's verdict, whatever verifier gave it: the headline
_LIMITS = {"max_steps": ("turn", "max_steps"), "wall_clock": ("time", "wall_clock_s"), "context_exhausted": ("context", "context_tokens")}
NO_TOKEN_IDS = "token ids and logprobs (Inspect's logprobs name token texts, not ids)"
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


def message_id(episode_id: str, index: int) -> str:
    """A message's id: stable (the same export twice gives the same ids) and unique in
    the log (episode ids are), as `messages_df` and the events' `message_id` need."""
    return f"{episode_id}-m{index}"


def messages(ep: Episode) -> tuple[list[dict[str, Any]], list[int]]:
    """The sample's messages, each with its id, and for each turn the index of its
    assistant message (the turn's model input is every message before it)."""
    e = ep.record
    out = [_plain(m) for m in e.prompt_messages]
    starts: list[int] = []
    for t in ep.turns:  # tasks.conversation's order
        starts.append(len(out))
        for part, item in turn_parts(t):
            out.append(_assistant(item, e.model) if part == "assistant" else _tool(item) if part == "tool" else _plain(item))
    for i, m in enumerate(out):
        m["id"] = message_id(e.episode_id, i)
    return out, starts


def _tool_infos(e: EpisodeRecord) -> list[dict[str, Any]]:
    """The tools the model was offered, as Inspect's ToolInfo (sandbox mode: the three)."""
    return [{k: f["function"].get(k) for k in ("name", "description", "parameters")}
            for f in tools_of(e.mode, e.config, episode_id=e.episode_id)]


def _at(t0: datetime | None, seconds: float) -> str | None:
    return iso(t0 + timedelta(seconds=seconds)) if t0 is not None else None


def events(ep: Episode, msgs: list[dict[str, Any]], starts: list[int], score: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The sample's transcript as Inspect events: a model event per turn (its input as
    references into the sample's message pool, `events_data`, not a copy per turn), a
    tool event per tool call, a score event for the verdict."""
    e = ep.record
    out: list[dict[str, Any]] = []
    tools = _tool_infos(e)
    elapsed = 0.0  # working time since the episode's start

    def new(kind: str, at: datetime | None, **fields: Any) -> dict[str, Any]:
        ev = {"event": kind, "uuid": f"{e.episode_id}-e{len(out)}", "timestamp": iso(at) or iso(e.started_at), "working_start": elapsed, **fields}
        out.append(ev)
        return ev

    for t, start in zip(ep.turns, starts, strict=True):
        msg = msgs[start]
        u = t.usage
        usage = {
            "input_tokens": u.prompt_tokens or 0,
            "output_tokens": u.completion_tokens or 0,
            "total_tokens": (u.prompt_tokens or 0) + (u.completion_tokens or 0),
            "input_tokens_cache_read": u.cached_tokens,
            "reasoning_tokens": u.reasoning_tokens,
        }
        new(
            "model",
            t.started_at,
            model=e.model,
            input=[],
            input_refs=[[0, start]] if start else [],
            tools=tools,
            tool_choice="auto" if tools else "none",
            config={"max_tokens": t.request_max_tokens} if t.request_max_tokens else {},
            output={
                "model": e.model,
                "choices": [{"message": msg, "stop_reason": _STOP.get(t.finish_reason or "", "unknown")}],
                "usage": usage,
                "time": t.model_latency_s,
            },
            retries=max(t.attempts - 1, 0),
            error=t.error,
            completed=_at(t.started_at, t.model_latency_s),
            working_time=t.model_latency_s,
        )
        elapsed += t.model_latency_s
        calls = {c["id"]: c for c in msg.get("tool_calls") or []}
        tool_msgs = {m.get("tool_call_id"): m for m in msgs[start + 1 : start + 1 + len(t.observations)]}
        at = t.started_at + timedelta(seconds=t.model_latency_s)
        for o in t.observations:
            call = calls.get(o.tool_call_id) or {"arguments": {}}
            tm = tool_msgs.get(o.tool_call_id) or {}
            ev = new(
                "tool",
                at,
                type="function",
                id=o.tool_call_id,
                function=o.name,
                arguments=call.get("arguments") or {},
                result=o.content,
                completed=_at(at, o.duration_s or 0.0),
                working_time=o.duration_s or 0.0,
                message_id=tm.get("id"),
            )
            if "error" in tm:
                ev["error"] = tm["error"]
            at += timedelta(seconds=o.duration_s or 0.0)
            elapsed += o.duration_s or 0.0
    if score is not None:
        verifier, value = next(iter(score.items()))
        new("score", e.ended_at, score=value, target=ep.ground_truth or "", scorer=verifier, intermediate=False)
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
    msgs, starts = messages(ep)
    last = next((m for m in reversed(msgs) if m["role"] == "assistant"), None)
    finish = ep.turns[-1].finish_reason if ep.turns else None
    output: dict[str, Any] = {"model": e.model, "choices": [], "completion": e.answer or ""}
    if last is not None:
        output["choices"] = [{"message": last, "stop_reason": _STOP.get(finish or "", "unknown")}]
    output["usage"] = _usage(e)
    scores = own = None
    if ep.score is not None:
        s = ep.score
        verdict = {
            "value": s.score,
            "answer": e.answer,
            "explanation": s.reason,
            "metadata": {"passed": s.passed, "verifier": s.verifier},
        }
        # under the run's scorer (every scored sample: the headline) and its verifier's
        scores = {s.verifier: verdict} if s.verifier == RUN_SCORER else {RUN_SCORER: verdict, s.verifier: dict(verdict)}
        own = {s.verifier: verdict}
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
    full: dict[str, Any] = {
        **common,
        "messages": msgs,
        "output": output,
        "turn_count": len(ep.turns),
        "uuid": f"{e.episode_id}-s",
        "events": events(ep, msgs, starts, own),
        "events_data": {"messages": msgs, "calls": []},
    }
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
    """Running sums for one log's results and stats (per sample only its task id, once)."""

    total: int = 0
    completed: int = 0
    scores: dict[str, list[float]] = field(default_factory=dict)  # scorer -> [n, sum, sumsq]
    usage: dict[str, dict[str, int]] = field(default_factory=dict)
    started: datetime | None = None
    ended: datetime | None = None
    sample_ids: dict[str, None] = field(default_factory=dict)  # task ids in order, once each
    epochs: int = 0

    def add(self, ep: Episode) -> None:
        e = ep.record
        self.total += 1
        self.completed += 0 if e.is_infra_failure else 1
        self.sample_ids.setdefault(e.task_id, None)
        self.epochs = max(self.epochs, e.sample_index + 1)
        if ep.score is not None:
            for name in dict.fromkeys((RUN_SCORER, ep.score.verifier)):
                acc = self.scores.setdefault(name, [0.0, 0.0, 0.0])
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

    @property
    def complete(self) -> bool:
        """Every task has every epoch (what Inspect's "success" promises its readers)."""
        return self.total == len(self.sample_ids) * self.epochs

    def results(self) -> dict[str, Any]:
        """Inspect's results: the run's accuracy over every scored sample first (the
        headline that `inspect view`'s log list and `evals_df` show), then one entry per
        verifier over the samples it scored."""
        out = []
        names = sorted(self.scores, key=lambda n: (n != RUN_SCORER, n))
        for name in names:
            n, s, sq = self.scores[name]
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
        results: dict[str, Any] = {"total_samples": self.total, "completed_samples": self.completed, "scores": out}
        if RUN_SCORER in self.scores:
            results["headline"] = {"scorer": RUN_SCORER, "score": RUN_SCORER, "metric": "accuracy"}
        return results


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
        spec["dataset"]["samples"] = len(tally.sample_ids)
        spec["dataset"]["sample_ids"] = list(tally.sample_ids)
        spec["config"]["epochs"] = max(tally.epochs, 1)
        stats = {
            "started_at": iso(tally.started) or "",
            "completed_at": iso(tally.ended) or "",
            "model_usage": tally.usage,
        }
        header: dict[str, Any] = {
            "version": LOG_VERSION,
            "status": "success" if tally.complete else "cancelled",
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
