"""Harbor trials -> a sandflow run in the warehouse, scored by sandflow's verifiers
(`sandflow import harbor JOB_DIR --tasks TASKSET`).

`harbor run` (harbor 0.26) writes a job folder with one folder per trial
(harbor.models.trial.paths.TrialPaths): `result.json` (its TrialResult: task name, agent
and model, timing, the verifier's rewards, the exception), `agent/trajectory.json` (the
agent's ATIF trajectory, when the agent writes one) and `verifier/` (reward.txt /
reward.json, test-stdout.txt; a task exported by `sandflow export harbor` also keeps the
agent's answer file there as `answer.txt`). `import_harbor` takes a job folder, or one
trial folder, and records every trial as an episode of one run.

What maps to what (docs/interop.md, "Harbor trials"):

- a trial -> an episode: task = the task of the given sandflow task set that was exported
  under the trial's `task_name` (`sandflow/<task id>`), mode = `sandbox`, model = the
  agent's model (`agent_info.model_info.name`, else the agent's name), started/ended =
  the trial's `started_at` / `finished_at`;
- ATIF `system` / `user` steps before the first `agent` step -> the prompt messages;
  each `agent` step -> a turn: `message` -> the assistant text, `reasoning_content`,
  `tool_calls` (arguments as JSON text; our own export's `extra.raw_arguments` when the
  model's text was not JSON) and `observation.results` (linked by `source_call_id`; exit
  code and duration from `extra` where sandflow's export put them), `metrics` -> token
  usage, token ids and logprobs; a `user` step after an agent step -> that turn's extra
  messages;
- the answer: `verifier/answer.txt` (what the task's test.sh kept of
  /testbed/output/answer.txt); scores: sandflow's verifiers on that answer against the
  task set's ground truth; Harbor's own reward (`verifier_result.rewards.reward`, the
  in-container strict match) is kept in the episode's config (`peer.reward`) and
  compared; the run keeps the tasks it was scored against, which is what `sandflow
  compare` pairs runs by;
- termination: an exception -> `sandbox_error` (environment / Docker / build errors),
  `wall_clock` (an agent time-out) or `model_error` (any other agent failure);
  otherwise `submitted` when an answer was kept, else `max_steps`.

Not carried over: cost (Harbor's `cost_usd`; sandflow prices tokens itself), multi-step
trials (`steps/`: refused, one sentence), and a trial of an agent that writes no ATIF
trajectory has no turns (the oracle, nop: kept, with its answer and score).
Hostile input: files are opened under datasets_prep.paths' rules (no symlink leaving the
trial folder, regular files only, sizes bounded), trajectory.json is streamed step by
step with ijson (memory bounded by MAX_STEP_BYTES and MAX_DEPTH, not by the file), every
trial is read and checked before anything is written, and a bad field is one sentence
naming the file and field.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import ijson

from datasets_prep.task import Task, TaskSet
from interop.names import safe_name
from interop.peer_import import PeerFormatError, finish_import, open_in_folder, read_small_json
from interop.summary import Summary
from tasks.records import EpisodeRecord, Observation, ToolCall, TurnRecord, Usage, episode_key
from warehouse import Warehouse
from warehouse.schema import RUN_ID_RE

MAX_RESULT_BYTES = 4 << 20  # result.json / config.json of one trial
MAX_TRAJECTORY_BYTES = 4 << 30  # agent/trajectory.json as a whole (streamed)
MAX_STEP_BYTES = 16 << 20  # one ATIF step's JSON text: what is parsed at once
MAX_DEPTH = 64  # nesting of one step
MAX_ANSWER_BYTES = 1 << 20  # verifier/answer.txt (read no further)
MAX_TRIALS = 100_000
_CHUNK = 1 << 16
NO_COST = "cost (Harbor's cost_usd; sandflow prices tokens itself)"
NO_TRAJECTORY = "turns of trials whose agent wrote no ATIF trajectory (agent/trajectory.json)"


class HarborFormatError(PeerFormatError):
    """The folder is not Harbor's output, or a field is malformed (names file and field)."""


@dataclass
class Trial:
    """One trial folder, read and checked (its trajectory is streamed again to record)."""

    folder: Path
    name: str
    task: Task
    model: str
    agent: str
    reward: float | None
    error: tuple[str, str] | None  # (exception type, message)
    started: datetime
    ended: datetime | None
    answer: str | None
    has_trajectory: bool
    result: dict[str, Any] = field(repr=False, default_factory=dict)


def find_trials(folder: Path) -> list[Path]:
    """The trial folders at `folder`: itself (a folder with result.json and config.json
    whose result names a task), or its direct subfolders that are. A subfolder that is a
    symlink is refused: links are never followed out of the job folder."""
    folder = Path(folder)
    if not folder.is_dir():
        raise HarborFormatError(f"{folder} is not a folder")
    if _is_trial(folder):
        return [folder]
    trials = []
    for p in sorted(folder.iterdir()):
        if p.is_symlink() and (p / "result.json").exists():
            raise HarborFormatError(f"{p} is a symlink to {os.path.realpath(p)!r}; links are not followed: give that folder itself")
        if p.is_dir() and not p.is_symlink() and _is_trial(p):
            trials.append(p)
        if len(trials) > MAX_TRIALS:
            raise HarborFormatError(f"{folder}: more than {MAX_TRIALS} trial folders")
    if not trials:
        raise HarborFormatError(
            f"{folder} holds no Harbor trial: expected result.json and config.json in it or in its "
            "direct subfolders (as `harbor run --jobs-dir` writes)"
        )
    return trials


def _is_trial(p: Path) -> bool:
    return (p / "config.json").is_file() and (p / "result.json").is_file() and ((p / "agent").is_dir() or (p / "verifier").is_dir())


def _when(v: Any, where: str, name: str) -> datetime | None:
    if v is None:
        return None
    if not isinstance(v, str):
        raise HarborFormatError(f"{where}: {name} must be an ISO time, got {type(v).__name__}")
    try:
        t = datetime.fromisoformat(v)
    except ValueError:
        raise HarborFormatError(f"{where}: {name} {v[:60]!r} is not an ISO time") from None
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def _obj(v: Any, where: str, name: str) -> dict[str, Any]:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise HarborFormatError(f"{where}: {name} must be an object, got {type(v).__name__}")
    return v


def _reward(result: dict[str, Any], where: str) -> float | None:
    rewards = _obj(_obj(result.get("verifier_result"), where, "verifier_result").get("rewards"), where, "verifier_result.rewards")
    if not rewards:
        return None
    value = rewards.get("reward", next(iter(rewards.values())))
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise HarborFormatError(f"{where}: verifier_result.rewards must hold numbers, got {type(value).__name__}")
    return float(value)


def _answer(folder: Path) -> str | None:
    """verifier/answer.txt's head (MAX_ANSWER_BYTES), or None when the trial kept none."""
    if not (folder / "verifier" / "answer.txt").exists():
        return None
    fd, _ = open_in_folder(folder, "verifier/answer.txt", 1 << 62, "")
    with os.fdopen(fd, "rb") as f:
        return f.read(MAX_ANSWER_BYTES).decode("utf-8", "replace").strip()


def read_trial(folder: Path, tasks: dict[str, Task]) -> Trial:
    """Read and check one trial folder (nothing is written). `tasks`: the task set's tasks
    by the name `sandflow export harbor` gave them (`sandflow/<safe task id>`)."""
    where = str(folder / "result.json")
    result = read_small_json(folder, "result.json", MAX_RESULT_BYTES)
    if not isinstance(result, dict):
        raise HarborFormatError(f"{where}: expected Harbor's trial result (an object), got {type(result).__name__}")
    if result.get("step_results"):
        raise HarborFormatError(f"{where}: a multi-step trial (step_results); only single-step trials are imported")
    name = result.get("task_name")
    if not isinstance(name, str) or not name:
        raise HarborFormatError(f"{where}: task_name is missing (not a Harbor trial result)")
    task = tasks.get(name)
    if task is None:
        raise HarborFormatError(
            f"{where}: task_name {name[:80]!r} is not a task of the given task set "
            "(`sandflow export harbor` names them sandflow/<task id>): give the task set that was exported"
        )
    agent = _obj(result.get("agent_info"), where, "agent_info")
    model_info = _obj(agent.get("model_info"), where, "agent_info.model_info")
    exc = _obj(result.get("exception_info"), where, "exception_info")
    error = (str(exc.get("exception_type") or "Exception"), str(exc.get("exception_message") or "")[:2000]) if exc else None
    started = _when(result.get("started_at"), where, "started_at") or datetime.fromtimestamp((folder / "result.json").stat().st_mtime, UTC)
    has_traj = (folder / "agent" / "trajectory.json").exists()
    trial = Trial(
        folder=folder,
        name=str(result.get("trial_name") or folder.name)[:200],
        task=task,
        model=str(model_info.get("name") or agent.get("name") or "")[:200],
        agent=str(agent.get("name") or "")[:200],
        reward=_reward(result, where),
        error=error,
        started=started,
        ended=_when(result.get("finished_at"), where, "finished_at"),
        answer=_answer(folder),
        has_trajectory=has_traj,
        result=result,
    )
    return trial


class _Counted:
    """trajectory.json as ijson reads it, with one step's bytes bounded while parsing."""

    def __init__(self, fd: int, path: Path, limit: int) -> None:
        self.fd, self.path, self.limit = fd, path, limit
        self.pos = self.mark = 0
        self.step = 0

    def read(self, n: int = -1) -> bytes:
        if n == 0:  # ijson's probe for bytes or text: nothing may be consumed
            return b""
        data = os.read(self.fd, n if n > 0 else _CHUNK)
        self.pos += len(data)
        if self.pos > MAX_TRAJECTORY_BYTES:
            raise HarborFormatError(f"{self.path}: over the limit of {MAX_TRAJECTORY_BYTES} bytes")
        if self.pos - self.mark > self.limit + _CHUNK:
            raise HarborFormatError(f"{self.path}: step {self.step + 1} is over the limit of {self.limit} bytes of JSON per step")
        return data


def atif_steps(folder: Path, max_step_bytes: int = MAX_STEP_BYTES) -> Iterator[dict[str, Any]]:
    """The ATIF steps of `folder/agent/trajectory.json`, one at a time (ijson), each
    bounded in bytes and nesting; the schema_version must be an ATIF one."""
    path = folder / "agent" / "trajectory.json"
    fd, _ = open_in_folder(folder, "agent/trajectory.json", MAX_TRAJECTORY_BYTES, "trajectory.json as a whole")
    stream = _Counted(fd, path, max_step_bytes)
    try:
        builder: Any = None
        depth = 0
        for prefix, event, value in ijson.parse(stream, use_float=True, buf_size=_CHUNK):
            if prefix == "" and event not in ("start_map", "end_map", "map_key"):
                raise HarborFormatError(f"{path}: expected an ATIF trajectory (an object)")
            if prefix == "schema_version" and not (isinstance(value, str) and value.startswith("ATIF-")):
                raise HarborFormatError(f"{path}: schema_version {str(value)[:40]!r} is not an ATIF version")
            if prefix == "steps" and event not in ("start_array", "end_array"):
                raise HarborFormatError(f"{path}: steps must be a list")
            if not (prefix == "steps.item" or prefix.startswith("steps.item.")):
                continue
            if builder is None:
                if event != "start_map":
                    raise HarborFormatError(f"{path}: step {stream.step + 1} must be an object")
                builder = ijson.ObjectBuilder()
            builder.event(event, value)
            if event in ("start_map", "start_array"):
                depth += 1
                if depth > MAX_DEPTH:
                    raise HarborFormatError(f"{path}: step {stream.step + 1} is nested more than {MAX_DEPTH} levels deep")
            elif event in ("end_map", "end_array"):
                depth -= 1
            if depth == 0:
                stream.step += 1
                stream.mark = stream.pos
                yield builder.value
                builder = None
    except ijson.JSONError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise HarborFormatError(f"{path}: not valid JSON ({first}, near byte {stream.pos})") from None
    finally:
        os.close(fd)


def _text(v: Any) -> str:
    """An ATIF message: text, or content parts (their text kept, images named)."""
    if v is None:
        return ""
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        return "\n".join(str(p.get("text") or f"[{p.get('type', 'part')}]") if isinstance(p, dict) else str(p) for p in v)
    return json.dumps(v, ensure_ascii=False)


def _ints(v: Any) -> list[int] | None:
    return v if isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v) else None


def _calls(step: dict[str, Any], where: str) -> list[ToolCall]:
    raw = step.get("tool_calls") or []
    if not isinstance(raw, list):
        raise HarborFormatError(f"{where}: tool_calls must be a list")
    calls = []
    for j, c in enumerate(raw):
        if not isinstance(c, dict) or not isinstance(c.get("function_name"), str) or not c["function_name"]:
            raise HarborFormatError(f"{where}: tool call {j} has no function_name")
        extra: dict[str, Any] = c["extra"] if isinstance(c.get("extra"), dict) else {}
        args = extra.get("raw_arguments") if isinstance(extra.get("raw_arguments"), str) else json.dumps(c.get("arguments") or {}, ensure_ascii=False)
        calls.append(ToolCall(id=str(c.get("tool_call_id") or f"call_{j}")[:200], name=c["function_name"][:200], arguments=args))
    return calls


def _observations(step: dict[str, Any], calls: list[ToolCall], where: str) -> list[Observation]:
    obs = _obj(step.get("observation"), where, "observation")
    results = obs.get("results") or []
    if not isinstance(results, list):
        raise HarborFormatError(f"{where}: observation.results must be a list")
    names = {c.id: c.name for c in calls}
    out = []
    for j, r in enumerate(results):
        if not isinstance(r, dict):
            raise HarborFormatError(f"{where}: observation result {j} must be an object")
        extra: dict[str, Any] = r["extra"] if isinstance(r.get("extra"), dict) else {}
        cid = str(r.get("source_call_id") or extra.get("tool_call_id") or f"result_{j}")[:200]
        code, dur = extra.get("exit_code"), extra.get("duration_s")
        out.append(Observation(
            tool_call_id=cid, name=names.get(cid, ""), content=_text(r.get("content")),
            exit_code=code if isinstance(code, int) and not isinstance(code, bool) else None,
            duration_s=float(dur) if isinstance(dur, int | float) and dur >= 0 else 0.0,
            timed_out=extra.get("timed_out") is True, truncated=extra.get("truncated") is True,
        ))  # fmt: skip
    return out


def trial_turns(trial: Trial, run_id: str, eid: str) -> tuple[list[dict[str, Any]], list[TurnRecord]]:
    """The trial's prompt messages and turns, from its ATIF steps (none without one)."""
    prompt: list[dict[str, Any]] = []
    turns: list[TurnRecord] = []
    if not trial.has_trajectory:
        return prompt, turns
    path = trial.folder / "agent" / "trajectory.json"
    for i, step in enumerate(atif_steps(trial.folder)):
        where = f"{path}: step {i + 1}"
        source = step.get("source")
        if source not in ("system", "user", "agent"):
            raise HarborFormatError(f"{where}: source {str(source)[:40]!r} is not system, user or agent")
        if source != "agent":
            msg = {"role": source, "content": _text(step.get("message"))}
            if turns:
                turns[-1].extra_messages.append(msg)
            else:
                prompt.append(msg)
            continue
        calls = _calls(step, where)
        metrics = _obj(step.get("metrics"), where, "metrics")
        at = _when(step.get("timestamp"), where, "timestamp") or trial.started
        turns.append(TurnRecord(
            run_id=run_id, episode_id=eid, turn_index=len(turns), started_at=at,
            assistant_content=_text(step.get("message")),
            reasoning_content=step.get("reasoning_content") if isinstance(step.get("reasoning_content"), str) else None,
            tool_calls=calls, observations=_observations(step, calls, where),
            finish_reason="tool_calls" if calls else "stop",
            usage=Usage(prompt_tokens=metrics.get("prompt_tokens"), completion_tokens=metrics.get("completion_tokens"),
                        cached_tokens=metrics.get("cached_tokens")),
            prompt_token_ids=_ints(metrics.get("prompt_token_ids")),
            completion_token_ids=_ints(metrics.get("completion_token_ids")),
            completion_logprobs=metrics.get("logprobs") if isinstance(metrics.get("logprobs"), list) else None,
        ))  # fmt: skip
    return prompt, turns


def _termination(trial: Trial) -> tuple[str, str | None]:
    if trial.error is not None:
        kind, msg = trial.error
        low = kind.lower()
        text = f"{kind}: {msg}" if msg else kind
        if "timeout" in low and "agent" in low:
            return "wall_clock", text
        if any(w in low for w in ("environment", "docker", "build", "compose", "verifier")):
            return "sandbox_error", text
        return "model_error", text
    if trial.answer:
        return "submitted", None
    return "max_steps", "no answer file was kept (/testbed/output/answer.txt)"


def _episode(trial: Trial, run_id: str, sample: int) -> tuple[EpisodeRecord, list[TurnRecord]]:
    eid = episode_key(run_id, trial.task.id, "sandbox", sample)
    prompt, turns = trial_turns(trial, run_id, eid)
    term, err = _termination(trial)
    ended = trial.ended or trial.started
    ep = EpisodeRecord(
        run_id=run_id, episode_id=eid, task_id=trial.task.id, domain=trial.task.domain, mode="sandbox",
        sample_index=sample, model=trial.model, started_at=trial.started, ended_at=ended,
        termination=term, error=err,
        answer=trial.answer if term not in ("model_error", "sandbox_error") else None,
        answer_source="answer_file", prompt_messages=prompt, wall_s=max((ended - trial.started).total_seconds(), 0.0),
        config={"peer": {"tool": "harbor", "reward": trial.reward, "trial": trial.name, "agent": trial.agent,
                         "folder": str(trial.folder)}},
    )  # fmt: skip
    return ep, turns


def import_harbor(
    root: Path | str, folder: Path | str, *, tasks: TaskSet, run_id: str | None = None
) -> Summary:
    """Record the Harbor trials at `folder` (a job folder or one trial) as run `run_id`
    in the warehouse at `root`, scored by `tasks`' verifiers (the task set that
    `sandflow export harbor` wrote). Every trial, trajectory included, is read and checked
    before anything is written (HarborFormatError names the file and field)."""
    folder = Path(folder)
    by_name = {f"sandflow/{safe_name(t.id)}": t for t in tasks.tasks}
    trials = [read_trial(p, by_name) for p in find_trials(folder)]
    run_id = run_id or _default_run_id(folder)
    if not RUN_ID_RE.match(run_id):
        raise HarborFormatError(f"run id {run_id!r}: use 1-128 characters from A-Z a-z 0-9 . _ - (starting with a letter or digit)")
    samples: dict[str, int] = {}
    planned = []
    for t in trials:  # the first pass: every trajectory parsed and checked, nothing kept
        sample = samples.get(t.task.id, 0)
        samples[t.task.id] = sample + 1
        _episode(t, run_id, sample)
        planned.append((t, sample))
    wh = Warehouse(root)
    Path(root).mkdir(parents=True, exist_ok=True)
    wh.write_run(
        run_id, model=trials[0].model, image="", dataset=tasks.name, dataset_hash=tasks.content_hash,
        config={"imported_from": "harbor", "folder": str(folder), "agent": trials[0].agent},
        notes=f"imported from Harbor trials at {folder}",
    )  # fmt: skip
    wh.keep_tasks(run_id, {t.task.id: t.task for t in trials}.values(), name=tasks.name)
    summary = Summary("import harbor", folder)
    writer = wh.writer(durability="flush")
    try:
        for t, sample in planned:
            ep, turns = _episode(t, run_id, sample)
            writer.start_episode(ep.model_copy(update={"ended_at": None, "termination": None, "error": None, "answer": None}))
            for turn in turns:
                writer.record_turn(turn)
            writer.finish_episode(ep.with_totals(turns))
            summary.episodes += 1
            summary.lose(NO_COST)
            if not t.has_trajectory:
                summary.lose(NO_TRAJECTORY)
    finally:
        writer.close()
    head = f"import harbor: {len(trials)} trial(s) in {folder} -> {summary.episodes} episodes of run {run_id}"
    return finish_import(wh, run_id, summary, {t.id: t for t in tasks.tasks}, files=len(trials), head=head)


def _default_run_id(folder: Path) -> str:
    import re

    rid = "harbor-" + re.sub(r"[^A-Za-z0-9._-]", "_", Path(folder).resolve().name)
    return rid[:128] if RUN_ID_RE.match(rid[:128]) else "harbor-import"
