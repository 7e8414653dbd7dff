"""Replay a recorded episode up to turn K in a fresh sandbox, then let a model go on.

"What would this other model do from turn 7 of that failed episode?" needs the sandbox as
it was before turn 7. It is rebuilt, not restored: a fresh sandbox gets the task's inputs,
then every recorded tool call of turns 0..K-1 runs again, in order, under the same
per-turn bounds the loop applies (tasks.loop.TurnBudget) and the parent's own limits
(its recorded config). Each result is checked against the recorded observation; then the
model continues from the *recorded* messages (what the parent's model saw), so siblings
branched at the same turn share one prefix. The new episode records the parent's turns
0..K-1 as its own, then its own turns, with its lineage (parent, branch turn K, kind
"replay"; warehouse view `episode_tree`).

What counts as the same observation (the rule, docs/rl.md "Replay"):
  compared exactly: exit code, timed out, OOM-killed, the tool error (e.g. "unknown tool");
  compared after masking: the text (`VARYING` below, applied to both sides: durations,
  clock times and dates, epoch seconds within a day of when that side ran, process ids,
  mktemp / tempfile names, memory addresses in object reprs), plus any patterns the
  caller adds. Each mask needs the shape *and* the context its rule names: a bare `0x...`
  value, 12 hex digits, a 10-digit number far from the side's clock, `process N` or an
  integer followed by ` s` is data, compared (a sandbox's host name is `sandbox` on both
  backends: nothing to mask);
  never compared: duration_s (wall time).
A divergence names the turn and the call and shows a bounded unified diff of the masked
text. By default a replay that diverges stops before any model call and records nothing
(`ReplayDiverged`); `allow_divergence` goes on and keeps the divergences in the
episode's config ("replay" entry).

Data read back from the warehouse came from a sandbox once: every text shown from it is
clipped (`DIFF_LINES`, `LINE_CHARS`), and at most `MAX_DIVERGENCES` are kept.
"""

from __future__ import annotations

import contextlib
import difflib
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from datasets_prep.task import Task
from sandbox.base import Sandbox, SandboxConfig, SandboxError
from tasks.conversation import episode_messages
from tasks.episode import End
from tasks.loop import (
    CancelCheck,
    EpisodePrefix,
    EpisodeResult,
    EventHook,
    Limits,
    TurnBudget,
    load_task_prompts,
    place_inputs,
    run_episode,
)
from tasks.model import ModelClient, ModelConfig
from tasks.opening import open_sandbox, sandbox_config
from tasks.records import EpisodeRecord, Observation, Recorder, TurnRecord, episode_key
from tasks.tools import ToolBox

DIFF_LINES = 20  # lines of one divergence's diff shown
LINE_CHARS = 200  # characters of one shown line
MAX_DIVERGENCES = 50  # divergences kept (the rest counted)

# What legitimately differs between two runs of the same command, masked on both sides
# before the text is compared. Order matters (a date line before its clock time).
_MONTHS = "Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec"
_DAYS = "Mon|Tue|Wed|Thu|Fri|Sat|Sun"
VARYING: tuple[tuple[str, str, str], ...] = (
    # `date`: "Thu Nov 26 06:30:18 UTC 2026"
    ("date", rf"\b(?:{_DAYS}) (?:{_MONTHS}) +\d{{1,2}} \d{{2}}:\d{{2}}:\d{{2}}(?: \w+)? \d{{4}}\b", "<DATE>"),
    # ISO and log timestamps: 2026-11-26T06:30:18.123Z, 2026-11-26 06:30
    ("timestamp", r"\b\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?", "<TIME>"),
    ("clock", r"\b\d{1,2}:\d{2}:\d{2}(?:\.\d+)?\b", "<TIME>"),
    # `time`: "real 0m0.003s"; "took 1.5 s", "12ms", "3s", "12 ms", "3 seconds"; an integer
    # then " s" is not one ("42 s" is data: a count and a unit letter, or a random value)
    ("duration", r"\b\d+m\d+(?:\.\d+)?s\b", "<DURATION>"),
    ("duration", r"\b\d+(?:\.\d+)?(?:ns|us|µs|ms|s|secs?|seconds?|min|minutes?)\b", "<DURATION>"),
    ("duration", r"\b\d+\.\d+ (?:ns|us|µs|ms|s|secs?|seconds?|min|minutes?)\b", "<DURATION>"),
    ("duration", r"\b\d+ (?:ns|us|µs|ms|secs?|seconds?|min|minutes?)\b", "<DURATION>"),
    # process ids: "pid 42", "PID=42", "pid: 42", "[1] 4242" (a background job), /proc/42
    ("pid", r"(?i)\b(pid)(\s*[:=#]?\s*)\d+", r"\1\2<PID>"),
    ("pid", r"(?m)^\[\d+\]\s+\d+\s*$", "[<JOB>] <PID>"),
    ("pid", r"/proc/\d+", "/proc/<PID>"),
    # temporary names: mktemp's tmp.XXXXXXXXXX, Python's tempfile tmpXXXXXXXX
    ("tempname", r"\btmp\.[A-Za-z0-9]{10}\b", "tmp.<TMP>"),
    ("tempname", r"\btmp[a-z0-9_]{8}\b", "tmp<TMP>"),
    # an object repr's address: "<Foo object at 0x7f3a2b1c0d10>", "<function f at 0x...>"
    ("address", r"(?<=\bat )0x[0-9a-fA-F]{6,16}\b(?=>)", "0x<ADDR>"),
)
_COMPILED = tuple((kind, re.compile(rx), sub) for kind, rx, sub in VARYING)

# Epoch seconds (`date +%s`, time.time(), `stat -c %Y`): a 10-digit number is one only
# within EPOCH_WINDOW_S of the clock of the side that printed it (the recorded turn's start,
# the replayed call's), so a random 10-digit value is compared, not masked.
EPOCH_WINDOW_S = 86_400.0
_EPOCH = re.compile(r"(?<![\d.])\d{10}(?:\.\d+)?(?!\d)")

# Refusals the loop gives instead of running a call (tasks.loop): never run again either.
_NOT_RUN = ("not executed after submit", "over the tool-call limit", "over the observation budget")


class ReplayError(ValueError):
    """The replay cannot start as asked (bad turn, wrong task, a failed sandbox); the
    message says which episode, turn or field."""


@dataclass(frozen=True)
class Divergence:
    """One recorded observation the replay did not reproduce."""

    turn_index: int
    call_index: int
    tool: str
    what: str  # output | exit_code | timed_out | oom_killed | error
    recorded: str
    replayed: str
    diff: str = ""  # output: a unified diff of the masked texts, bounded

    def describe(self) -> str:
        where = f"turn {self.turn_index}, call {self.call_index} ({_clip(self.tool, 60)})"
        if self.what == "output":
            return f"{where}: the output differs (- recorded, + replayed):\n{self.diff}"
        return f"{where}: {self.what} recorded {self.recorded}, replayed {self.replayed}"

    def as_dict(self) -> dict[str, Any]:
        return {"turn_index": self.turn_index, "call_index": self.call_index, "tool": self.tool,
                "what": self.what, "recorded": self.recorded, "replayed": self.replayed,
                "diff": self.diff}  # fmt: skip


@dataclass
class ReplayCheck:
    """What re-running the prefix found: the divergences (at most MAX_DIVERGENCES kept,
    `total` counts them all) and how many calls ran again."""

    calls: int = 0
    divergences: list[Divergence] = field(default_factory=list)
    total: int = 0

    def add(self, d: Divergence) -> None:
        self.total += 1
        if len(self.divergences) < MAX_DIVERGENCES:
            self.divergences.append(d)

    def describe(self, limit: int = 5) -> str:
        shown = "\n".join(d.describe() for d in self.divergences[:limit])
        more = self.total - min(limit, len(self.divergences))
        return shown + (f"\n... and {more} more divergence(s)" if more > 0 else "")


class ReplayDiverged(Exception):
    """The rebuilt state is not the recorded one; nothing was recorded."""

    def __init__(self, check: ReplayCheck) -> None:
        self.check = check
        super().__init__(f"the replay diverged {check.total} time(s):\n{check.describe()}")


@dataclass
class ReplayResult:
    result: EpisodeResult
    check: ReplayCheck


# ------------------------------------------------------------------ the comparison
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _clip(text: str, n: int = LINE_CHARS) -> str:
    """One shown line: at most `n` characters, control characters (a terminal's escape
    sequences from sandbox output) shown as \\xNN, never sent raw."""
    text = text if len(text) <= n else text[: n - 3] + "..."
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def mask(text: str, extra: Sequence[re.Pattern[str]] = (), at: float | None = None) -> str:
    """`text` with what legitimately varies (VARYING, epoch seconds within EPOCH_WINDOW_S of
    `at`, the printing side's clock (default: now), then `extra`) replaced by placeholders."""
    now = time.time() if at is None else at
    text = _EPOCH.sub(lambda m: "<EPOCH>" if abs(float(m.group()) - now) <= EPOCH_WINDOW_S else m.group(), text)
    for _, rx, sub in _COMPILED:
        text = rx.sub(sub, text)
    for rx in extra:
        text = rx.sub("<IGNORED>", text)
    return text


def compile_ignore(patterns: Sequence[str]) -> list[re.Pattern[str]]:
    """The caller's extra patterns; ReplayError naming the one that is not a regex."""
    out = []
    for p in patterns:
        try:
            out.append(re.compile(p))
        except re.error as exc:
            raise ReplayError(f"ignore pattern {p!r} is not a regular expression: {exc}") from None
    return out


def _diff(recorded: str, replayed: str) -> str:
    lines = list(difflib.unified_diff(
        recorded.splitlines(), replayed.splitlines(), "recorded", "replayed", lineterm="", n=1,
    ))[2:]  # fmt: skip
    shown = [_clip(x) for x in lines[:DIFF_LINES]]
    if len(lines) > DIFF_LINES:
        shown.append(f"... {len(lines) - DIFF_LINES} more diff line(s)")
    return "\n".join(shown) or "(only whitespace at the ends of lines differs)"


def compare(
    turn_index: int, call_index: int, recorded: Observation, replayed: Observation,
    extra: Sequence[re.Pattern[str]] = (), *,
    recorded_at: float | None = None, replayed_at: float | None = None,
) -> list[Divergence]:
    """The ways `replayed` differs from `recorded` (empty: the same, by the rule above);
    `recorded_at` / `replayed_at` are each side's clock (epoch seconds; default now)."""
    out = []
    tool = recorded.name
    for what in ("exit_code", "timed_out", "oom_killed", "error"):
        a, b = getattr(recorded, what), getattr(replayed, what)
        if a != b:
            out.append(Divergence(turn_index, call_index, tool, what, _clip(repr(a)), _clip(repr(b))))
    a_text, b_text = mask(recorded.content, extra, recorded_at), mask(replayed.content, extra, replayed_at)
    if a_text != b_text:
        out.append(Divergence(
            turn_index, call_index, tool, "output", _clip(a_text), _clip(b_text), _diff(a_text, b_text),
        ))  # fmt: skip
    return out


# ------------------------------------------------------------------ re-running the prefix
def check_prefix(parent: EpisodeRecord, turns: Sequence[TurnRecord], until_turn: int) -> list[TurnRecord]:
    """The parent's turns 0..until_turn-1, in order; ReplayError when they cannot be replayed."""
    where = f"episode {parent.run_id}/{parent.episode_id}"
    if parent.mode != "sandbox":
        raise ReplayError(f"{where} ran in {parent.mode} mode: only sandbox episodes replay")
    ordered = sorted(turns, key=lambda t: t.turn_index)
    if [t.turn_index for t in ordered] != list(range(len(ordered))):
        raise ReplayError(f"{where}: its recorded turns are not 0..{len(ordered) - 1} (a gap)")
    if not 0 <= until_turn <= len(ordered):
        raise ReplayError(
            f"--until-turn {until_turn} is out of range for {where}: it has {len(ordered)} "
            f"turn(s), so use 0..{len(ordered)}"
        )
    prefix = ordered[:until_turn]
    for t in prefix:
        if any(c.name == "submit" for c in t.tool_calls):
            raise ReplayError(
                f"{where} submitted at turn {t.turn_index}: --until-turn must be at most "
                f"{t.turn_index} (nothing follows a submit)"
            )
        if len(t.observations) < len(t.tool_calls):
            raise ReplayError(
                f"{where}: turn {t.turn_index} did not finish its tool calls (the episode ended "
                f"there); --until-turn must be at most {t.turn_index}"
            )
    return prefix


def replay_calls(
    sandbox: Sandbox, turns: Sequence[TurnRecord], limits: Limits,
    extra: Sequence[re.Pattern[str]] = (),
) -> ReplayCheck:
    """Run every recorded tool call of `turns` again in `sandbox`, as the loop ran them,
    and compare each result with the recorded one. SandboxError propagates."""
    check = ReplayCheck()
    toolbox = ToolBox(sandbox, limits.max_observation_chars)
    timeout = limits.exec_timeout_s or sandbox.config.limits.exec_timeout_s
    for turn in turns:
        budget = TurnBudget(limits, len(turn.tool_calls))
        started = turn.started_at
        recorded_at = (started if started.tzinfo else started.replace(tzinfo=UTC)).timestamp()
        for i, (call, recorded) in enumerate(zip(turn.tool_calls, turn.observations, strict=False)):
            refusal = budget.refusal()
            if refusal is not None or recorded.error in _NOT_RUN:
                error, content = refusal or (recorded.error, recorded.content)
                obs = Observation(tool_call_id=call.id, name=call.name, error=error, content=content)
            else:
                obs = toolbox.call(call, timeout).observation
                budget.charge(obs)
                check.calls += 1
            for d in compare(turn.turn_index, i, recorded, obs, extra,
                             recorded_at=recorded_at, replayed_at=time.time()):  # fmt: skip
                check.add(d)
    return check


def parent_limits(parent: EpisodeRecord, fallback: Limits) -> Limits:
    """The limits the parent ran under (its recorded config), for the bounds that shaped its
    observations; `fallback` when the config does not hold them."""
    try:
        return Limits.model_validate(parent.config.get("limits") or {})
    except ValueError:
        return fallback


# ------------------------------------------------------------------ the episode
def replay_episode(
    task: Task,
    parent: EpisodeRecord,
    parent_turns: Sequence[TurnRecord],
    until_turn: int,
    model_cfg: ModelConfig,
    sandbox_cfg: SandboxConfig | None = None,
    recorder: Recorder | None = None,
    *,
    run_id: str,
    sample_index: int = 0,
    limits: Limits | None = None,
    ignore: Sequence[str] = (),
    allow_divergence: bool = False,
    output_dir: Path | str | None = None,
    prompt_dir: str | None = None,
    on_event: EventHook | None = None,
    cancel: CancelCheck | None = None,
    client: ModelClient | None = None,
) -> ReplayResult:
    """Rebuild `parent`'s state before turn `until_turn` in a fresh sandbox, then run the
    rest of the episode with `model_cfg`, recorded as a new episode of `run_id`.

    Raises ReplayError (bad input, or the sandbox failed while replaying) and
    ReplayDiverged (unless `allow_divergence`) before any model call or record.
    """
    if task.id != parent.task_id:
        raise ReplayError(f"task {task.id!r} is not the episode's task {parent.task_id!r}")
    limits = limits or Limits()
    extra = compile_ignore(ignore)
    prefix_turns = check_prefix(parent, parent_turns, until_turn)
    stub = EpisodeRecord(
        run_id=run_id, episode_id=episode_key(run_id, task.id, "sandbox", sample_index),
        task_id=task.id, domain=task.domain, mode="sandbox", model=model_cfg.model,
        started_at=datetime.now(UTC),
    )  # fmt: skip
    try:
        sandbox = open_sandbox(sandbox_config(sandbox_cfg, stub, task))
    except End as end:
        raise ReplayError(end.error or "could not open the sandbox") from None
    try:
        try:
            place_inputs(sandbox, load_task_prompts(task, prompt_dir), task)
            check = replay_calls(sandbox, prefix_turns, parent_limits(parent, limits), extra)
        except SandboxError as exc:
            raise ReplayError(f"the sandbox failed while replaying {parent.episode_id}: {exc}") from None
        if check.total and not allow_divergence:
            raise ReplayDiverged(check)
        prefix = EpisodePrefix(
            prompt_messages=[dict(m) for m in parent.prompt_messages],
            messages=episode_messages(parent, prefix_turns, wire=True),  # as the loop sent them
            turns=list(prefix_turns),
            lineage={
                "parent_run_id": parent.run_id, "parent_episode_id": parent.episode_id,
                "branch_turn": until_turn, "branch_kind": "replay",
            },
            config={"replay": {
                "parent": f"{parent.run_id}/{parent.episode_id}", "until_turn": until_turn,
                "calls": check.calls, "divergences": check.total,
                "divergence_details": [d.as_dict() for d in check.divergences[:10]],
                "ignore": list(ignore),
            }},
        )  # fmt: skip
        result = run_episode(
            task, model_cfg, sandbox_cfg, recorder, mode="sandbox", sample_index=sample_index,
            run_id=run_id, limits=limits, sandbox=sandbox, client=client, output_dir=output_dir,
            prompt_dir=prompt_dir, on_event=on_event, cancel=cancel, prefix=prefix,
        )  # fmt: skip
    finally:
        with contextlib.suppress(Exception):
            sandbox.close()
    return ReplayResult(result, check)
