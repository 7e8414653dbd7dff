"""llm-in-sandbox 0.2.0 output folders -> a sandflow run in the warehouse, scored by
sandflow's verifiers.

The peer's `benchmark` command writes one folder per run
(`<timestamp>_<task>_<model>_<LLMinSandbox|vanillaLLM>/`): `results.json` (its config
and summary), `trajectory.json` (problem id -> problem statement, steps, reward,
answer, ground truth) and `logs/<problem id>.txt` (the console log; an error line when
the problem failed). `import_peer` takes one such folder, or a folder holding several
(direct children: a sandbox run and a vanilla-LLM run of the same tasks become the two
modes of one run), and records them as episodes, so they answer SQL, open in the
viewer and pair with a sandflow run of the same tasks in `sandflow compare`.

What maps to what (docs/interop.md):

- a problem -> an episode: task id = problem id, mode = `sandbox` (LLMinSandbox) or
  `llm` (vanillaLLM), model = the peer's `llm_name`, answer = its `agent_answer`
  (read from answer.txt by the peer), prompt = the problem statement as the user message;
- a step -> a turn: `thought` -> the assistant text, `reasoning_content`, `action`
  (function + parameters) -> one tool call (`call_<n>`), `observation` -> its result
  (the exit code parsed from the peer's "Exit code: N" line), `exec_time` -> duration;
  a vanilla-LLM problem -> one turn whose text is the answer;
- termination: `submitted` when the last action is `submit` (LLM mode: when it
  answered), an error in its log -> `sandbox_error` (Docker/container named) or
  `model_error` (infrastructure, not graded), otherwise `max_steps`;
- scores: sandflow's verifiers on the answer (the task's own verifier when a sandflow
  task set is given with `tasks`, else chosen from the peer's task name as domain); the
  run keeps the tasks it was scored against (`Warehouse.keep_tasks`), which is what
  `sandflow compare` pairs runs by;
  the peer's own reward is kept in the episode's config (`peer.reward`).

Not carried over (the peer does not record them): token counts, timestamps per step
(the folder name's timestamp is the start), the system prompt (not in its output).
Hostile input: every file is read under the path rules of the rest of sandflow
(datasets_prep.paths): no symlink that leaves the output folder is followed (a
`trajectory.json` or `results.json` linked to a host file is refused, naming where it
leads), only regular files are opened, and what was opened is checked to be inside.
`trajectory.json` is parsed as a stream, one problem at a time (ijson), so memory is
bounded by the largest problem (`max_problem_bytes` of JSON text and MAX_DEPTH levels of
nesting, refused past either), not by the file: the whole file as one `json.loads` took 6.6x its size (a 402 MB trajectory
peaked at 2.65 GB). It is read twice (checked whole before anything is written, then
recorded), and what is kept between the passes is only the tasks (statement and ground
truth per problem) and the problem ids. A problem id names a log file only when it is a
plain file name inside `logs/` (a symlinked log is never opened), and every bad field is
one sentence naming the file, problem and field.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import ijson

from analysis.scoring import score_episodes
from datasets_prep.paths import UnsafePathError, folder_to_walk, open_regular, resolve_inside
from datasets_prep.task import Task, TaskSet
from datasets_prep.verifiers import VerifierError
from interop.names import safe_name
from interop.summary import Summary
from tasks.records import EpisodeRecord, Observation, ToolCall, TurnRecord, episode_key
from warehouse import Warehouse
from warehouse.rundata import RunData
from warehouse.schema import RUN_ID_RE

MAX_TRAJECTORY_BYTES = 16 << 30  # trajectory.json as a whole (streamed: this bounds time, not memory)
MAX_PROBLEM_BYTES = 16 << 20  # one problem's JSON text: what is ever parsed at once (worst 24x in memory)
MAX_DEPTH = 100  # nesting of one problem's JSON (the peer writes 4-5 levels)
MAX_RESULTS_BYTES = 1 << 20
_CHUNK = 1 << 16  # bytes per read of trajectory.json
MAX_LOG_BYTES = 64 << 10  # only the head of a problem's log is read (its error line)
MODES = {"llm-in-sandbox": "sandbox", "llm": "llm"}
_EXIT = re.compile(r"^Exit code: (-?\d+)")
_STAMP = re.compile(r"^(\d{8}_\d{6})_")
NOT_RECORDED = "token counts (the peer records none)"
NO_SYSTEM_PROMPT = "system prompt (not in the peer's output)"


class PeerFormatError(ValueError):
    """The folder is not the peer's output, or a field is malformed (names file and field)."""


@dataclass
class PeerRun:
    """One peer output folder, read and checked: `problems` holds each problem's
    statement and ground truth only; `items()` streams the full problems again."""

    folder: Path
    mode: str
    config: dict[str, Any]
    task: str
    started: datetime
    problems: dict[str, dict[str, Any]]
    stat: os.stat_result
    max_problem_bytes: int = MAX_PROBLEM_BYTES

    def items(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """The problems in full, one at a time, from the same (unchanged) file."""
        for pid, item in _problems(self.folder, self.max_problem_bytes, expect=self.stat):
            if pid not in self.problems:
                raise PeerFormatError(f"{self.folder / 'trajectory.json'}: changed while it was being imported")
            yield pid, item


def open_in_folder(folder: Path, name: str, limit: int, what: str) -> tuple[int, os.stat_result]:
    """An fd of the regular file `folder/name`, under the path rules of datasets_prep.paths
    (no symlink out of `folder`, only a regular file, the opened file checked to be
    inside), and its stat; refused when over `limit` bytes (`what` names the bound)."""
    path = folder / name
    try:
        real_root = folder_to_walk(folder, "the peer's output folder")
        target = resolve_inside(real_root, name)
        st = os.stat(target)
        if st.st_size > limit:
            raise PeerFormatError(f"{path}: {st.st_size} bytes is over the limit of {limit} bytes ({what})")
        return open_regular(target, root=real_root, expect=st), st
    except FileNotFoundError:
        raise PeerFormatError(f"{path}: missing") from None
    except UnsafePathError as exc:
        raise PeerFormatError(f"{path}: {exc}") from None
    except OSError as exc:
        raise PeerFormatError(f"{path}: cannot read ({exc.strerror})") from None


def read_small_json(folder: Path, name: str, limit: int) -> Any:
    """A small JSON file of the folder (results.json), read whole under `limit`."""
    fd, st = open_in_folder(folder, name, limit, "the most read whole")
    with os.fdopen(fd, "rb") as f:
        data = f.read(st.st_size + 1)  # its size (bounded above), not a limit-sized buffer
        if len(data) > st.st_size:  # it grew after the check: read on, still bounded
            data += f.read(limit + 1 - len(data))
    if len(data) > limit:
        raise PeerFormatError(f"{folder / name}: over the limit of {limit} bytes (it grew while being read)")
    try:
        return json.loads(data)
    except ValueError as exc:
        raise PeerFormatError(f"{folder / name}: not valid JSON ({exc})") from None
    except RecursionError:
        raise PeerFormatError(f"{folder / name}: nested too deeply to be read") from None


class _Stream:
    """trajectory.json as ijson reads it: bytes counted, the file's bound and the current
    problem's bound enforced while parsing (before that problem is built), so a problem
    larger than `per_problem` costs at most that many bytes of parsing."""

    def __init__(self, fd: int, path: Path, total: int, per_problem: int, chunk: int) -> None:
        self.fd, self.path, self.total, self.per_problem, self.chunk = fd, path, total, per_problem, chunk
        self.pos = self.mark = 0
        self.problem = 0  # problems read so far
        self.last: str | None = None  # the last problem's id
        self.first = True

    def read(self, n: int = -1) -> bytes:
        if n == 0:
            return b""
        data = os.read(self.fd, n if n > 0 else self.chunk)
        if self.first and data.strip():
            self.first = False
            if data.lstrip()[:1] != b"{":
                raise PeerFormatError(f"{self.path}: expected an object of problem id -> result")
        self.pos += len(data)
        if self.pos > self.total:
            raise PeerFormatError(f"{self.path}: over the limit of {self.total} bytes (it grew while being read)")
        if self.pos - self.mark > self.per_problem + self.chunk:
            after = f" (after {self.last!r})" if self.last is not None else ""
            raise PeerFormatError(
                f"{self.path}: problem {self.problem + 1}{after} is over the limit of {self.per_problem} bytes "
                "of JSON per problem (what is parsed at once; raise it with --max-problem-bytes)"
            )
        return data

    def done(self, pid: str) -> None:
        self.mark, self.problem, self.last = self.pos, self.problem + 1, pid


def _problems(folder: Path, max_problem_bytes: int, expect: os.stat_result | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
    """(problem id, its object) from `folder/trajectory.json`, one at a time, each checked.
    `expect`: the file's stat from the first pass (a file swapped between passes is refused)."""
    path = folder / "trajectory.json"
    fd, st = open_in_folder(folder, "trajectory.json", MAX_TRAJECTORY_BYTES, "trajectory.json as a whole")
    try:
        if expect is not None and (st.st_ino, st.st_size, st.st_mtime_ns) != (expect.st_ino, expect.st_size, expect.st_mtime_ns):
            raise PeerFormatError(f"{path}: changed while it was being imported")
        chunk = min(_CHUNK, max(max_problem_bytes // 4, 1024))  # a problem is measured to within one read
        stream = _Stream(fd, path, MAX_TRAJECTORY_BYTES, max_problem_bytes, chunk)
        seen: set[str] = set()
        try:
            for pid, item in _top_items(stream, chunk):
                stream.done(pid)
                if pid in seen:
                    raise PeerFormatError(f"{path}: problem {pid!r} appears twice")
                seen.add(pid)
                _check_problem(f"{path}: problem {pid!r}", item)
                yield pid, item
        except ijson.JSONError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise PeerFormatError(f"{path}: not valid JSON ({first}, near byte {stream.pos})") from None
    finally:
        os.close(fd)


def _top_items(stream: _Stream, chunk: int) -> Iterator[tuple[str, Any]]:
    """(key, value) of the top-level object, each value built from the parser's events
    with its nesting bounded (MAX_DEPTH): ijson's own item builder took gigabytes on a
    4 MB `[[[[...` and was killed; here such a problem is one sentence."""
    events = ijson.basic_parse(stream, use_float=True, buf_size=chunk)
    for ev, key in events:
        if ev == "end_map":
            return
        if ev != "map_key":
            continue  # the top-level start_map (anything else was refused by _Stream)
        builder, depth = ijson.ObjectBuilder(), 0
        for ev, value in events:
            builder.event(ev, value)
            if ev in ("start_map", "start_array"):
                depth += 1
                if depth > MAX_DEPTH:
                    raise PeerFormatError(
                        f"{stream.path}: problem {stream.problem + 1} ({key!r}) is nested more than {MAX_DEPTH} levels deep"
                    )
            elif ev in ("end_map", "end_array"):
                depth -= 1
            if depth == 0:
                break
        yield key, builder.value


def _check_problem(where: str, item: Any) -> None:
    if not isinstance(item, dict):
        raise PeerFormatError(f"{where}: expected an object, got {type(item).__name__}")
    _str(item.get("problem_statement"), where, "problem_statement")
    _str(item.get("agent_answer"), where, "agent_answer")
    steps = item.get("trajectory") or []
    if not isinstance(steps, list) or not all(isinstance(s, dict) for s in steps):
        raise PeerFormatError(f"{where}: trajectory must be a list of step objects")
    reward = item.get("reward")
    if reward is not None and not isinstance(reward, int | float):
        raise PeerFormatError(f"{where}: reward must be a number, got {type(reward).__name__}")
    for i, step in enumerate(steps):  # what is written as JSON text must be writable
        action = step.get("action")
        for field, value in (("action", action), ("observation", step.get("observation"))):
            if value is not None and not isinstance(value, str):
                try:
                    json.dumps(value)
                except (RecursionError, ValueError, TypeError) as exc:
                    why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
                    raise PeerFormatError(f"{where}: step {i} {field} cannot be recorded ({why})") from None


def _str(v: Any, where: str, field: str, *, required: bool = False) -> str:
    if v is None and not required:
        return ""
    if not isinstance(v, str):
        raise PeerFormatError(f"{where}: {field} must be text, got {type(v).__name__}")
    return v


def find_runs(folder: Path) -> list[Path]:
    """The peer output folders at `folder`: itself, or its direct children that are.
    A child that is a symlink to a peer output folder is refused (naming where it
    leads): a link is never followed out of, or twice into, the folder."""
    folder = Path(folder)
    if not folder.is_dir():
        raise PeerFormatError(f"{folder} is not a folder")
    if (folder / "trajectory.json").is_file() or (folder / "trajectory.json").is_symlink():
        return [folder]
    runs = []
    for p in sorted(folder.iterdir()):
        if not (p / "trajectory.json").is_file():
            continue
        if p.is_symlink():
            raise PeerFormatError(
                f"{p} is a symlink to {os.path.realpath(p)!r}; links are not followed: "
                "give that folder itself, or copy it in"
            )
        if p.is_dir():
            runs.append(p)
    if not runs:
        raise PeerFormatError(
            f"{folder} holds no llm-in-sandbox output: expected trajectory.json and results.json "
            "in it or in its direct subfolders (as `llm-in-sandbox benchmark --output_dir` writes)"
        )
    return runs


def read_run(folder: Path, *, max_problem_bytes: int = MAX_PROBLEM_BYTES) -> PeerRun:
    """Read and check one output folder (nothing is written): results.json whole,
    trajectory.json streamed problem by problem; keeps the problem ids and, for
    building tasks, each problem's statement and ground truth."""
    res = read_small_json(folder, "results.json", MAX_RESULTS_BYTES)
    if not isinstance(res, dict) or not isinstance(res.get("config"), dict):
        raise PeerFormatError(f"{folder / 'results.json'}: without its `config` object")
    config = res["config"]
    mode = MODES.get(str(config.get("mode", "llm-in-sandbox")))
    if mode is None:
        raise PeerFormatError(f"{folder / 'results.json'}: config.mode {config.get('mode')!r} is not one of {', '.join(MODES)}")
    heads: dict[str, dict[str, Any]] = {}
    for pid, item in _problems(folder, max_problem_bytes):
        heads[pid] = {"problem_statement": item.get("problem_statement"), "ground_truth": item.get("ground_truth")}
    fd, stat = open_in_folder(folder, "trajectory.json", MAX_TRAJECTORY_BYTES, "trajectory.json as a whole")
    os.close(fd)
    m = _STAMP.match(folder.name)
    try:
        started = datetime.strptime(m.group(1), "%Y%m%d_%H%M%S").replace(tzinfo=UTC) if m else None
    except ValueError:
        started = None
    if started is None:
        started = datetime.fromtimestamp(stat.st_mtime, UTC)
    return PeerRun(folder, mode, config, str(res.get("task") or "peer"), started, heads, stat, max_problem_bytes)


def _log_error(folder: Path, pid: str) -> str | None:
    """The ERROR line of logs/<pid>.txt; only a plain name inside logs/ is opened, never a
    symlink (O_NOFOLLOW), and only a regular file proven to be inside the folder."""
    if safe_name(pid) != pid:
        return None
    try:
        real_root = folder_to_walk(folder, "the peer's output folder")
        path = resolve_inside(real_root, f"logs/{pid}.txt")
        if path.parent != Path(real_root) / "logs":
            return None
        fd = open_regular(Path(real_root) / "logs" / f"{pid}.txt", root=real_root)
    except (UnsafePathError, OSError):
        return None
    with os.fdopen(fd, "rb") as f:
        head = f.read(MAX_LOG_BYTES).decode("utf-8", "replace")
    for line in head.splitlines()[:3]:
        if line.startswith("ERROR: "):
            return line[len("ERROR: ") :]
    return None


def _turns(run_id: str, eid: str, steps: list[dict[str, Any]], t0: datetime) -> list[TurnRecord]:
    turns, at = [], t0
    for i, s in enumerate(steps):
        action = s.get("action")
        raw_meta = s.get("metadata")
        meta: dict[str, Any] = raw_meta if isinstance(raw_meta, dict) else {}
        raw_dur = meta.get("exec_time")
        dur = float(raw_dur) if isinstance(raw_dur, int | float) and raw_dur >= 0 else 0.0
        calls, obs = [], []
        thought = s.get("thought") if isinstance(s.get("thought"), str) else ""
        if isinstance(action, dict) and isinstance(action.get("function"), str):
            params = action.get("parameters")
            cid = f"call_{i}"
            calls.append(ToolCall(id=cid, name=action["function"], arguments=json.dumps(params if params is not None else {}, ensure_ascii=False)))
            raw_obs = s.get("observation")
            content: str = raw_obs if isinstance(raw_obs, str) else json.dumps(raw_obs)
            m = _EXIT.match(content)
            obs.append(Observation(tool_call_id=cid, name=action["function"], content=content, exit_code=int(m.group(1)) if m else None, duration_s=dur))
        elif action:  # a free-text action: kept as the assistant's text
            thought = (thought + "\n" if thought else "") + (action if isinstance(action, str) else json.dumps(action))
        turns.append(
            TurnRecord(
                run_id=run_id,
                episode_id=eid,
                turn_index=i,
                started_at=at,
                assistant_content=thought,
                reasoning_content=(s.get("reasoning_content") or None) if isinstance(s.get("reasoning_content"), str) else None,
                tool_calls=calls,
                observations=obs,
                finish_reason="tool_calls" if calls else "stop",
                tool_latency_s=dur,
            )
        )
        at += timedelta(seconds=dur)
    return turns


def _termination(run: PeerRun, steps: list[dict[str, Any]], error: str | None) -> tuple[str, str | None]:
    if error is not None:
        low = error.lower()
        return ("sandbox_error" if "docker" in low or "container" in low else "model_error"), error
    if run.mode == "llm":
        return "submitted", None
    last = steps[-1].get("action") if steps else None
    if isinstance(last, dict) and last.get("function") == "submit":
        return "submitted", None
    return "max_steps", f"no submit within {len(steps)} steps"


def default_run_id(folder: Path) -> str:
    rid = "peer-" + re.sub(r"[^A-Za-z0-9._-]", "_", Path(folder).resolve().name)
    return rid[:128] if RUN_ID_RE.match(rid[:128]) else "peer-import"


def import_peer(
    root: Path | str,
    folder: Path | str,
    *,
    run_id: str | None = None,
    tasks: TaskSet | None = None,
    max_problem_bytes: int = MAX_PROBLEM_BYTES,
) -> Summary:
    """Record the peer's output at `folder` as run `run_id` in the warehouse at `root`.

    Every folder is read and checked before anything is written (PeerFormatError names
    the file, problem and field). `tasks`: the sandflow task set the peer ran (its
    verifiers score the answers and its content hash lets `sandflow compare` pair the
    run with a sandflow run of it); without it, tasks are built from the peer's rows.
    `max_problem_bytes`: the most JSON text of one problem that is parsed (memory is
    bounded by it, not by the file's size).
    """
    folder = Path(folder)
    runs = [read_run(p, max_problem_bytes=max_problem_bytes) for p in find_runs(folder)]
    run_id = run_id or default_run_id(folder)
    if not RUN_ID_RE.match(run_id):
        raise PeerFormatError(f"run id {run_id!r}: use 1-128 characters from A-Z a-z 0-9 . _ - (starting with a letter or digit)")
    known = {t.id: t for t in tasks.tasks} if tasks else {}
    if known:
        missing = sorted({pid for r in runs for pid in r.problems if pid not in known})
        if missing:
            raise PeerFormatError(
                f"{len(missing)} problem(s) of the peer's output are not in the task set, e.g. {missing[0]!r}"
            )
    built: dict[str, Task] = {}
    for run in runs:
        for pid, item in run.problems.items():
            if pid in known or pid in built:
                continue
            try:
                built[pid] = Task(
                    id=pid,
                    domain=run.task,
                    problem_statement=item.get("problem_statement") or pid,
                    ground_truth=item.get("ground_truth"),
                )
            except ValueError as exc:
                lines = str(exc).splitlines()
                raise PeerFormatError(
                    f"{run.folder / 'trajectory.json'}: problem {pid!r} is not a usable task: "
                    + (lines[0] if lines else type(exc).__name__)
                ) from None
    summary = Summary("import llm-in-sandbox", folder)
    wh = Warehouse(root)
    Path(root).mkdir(parents=True, exist_ok=True)
    first = runs[0]
    wh.write_run(
        run_id,
        model=str(first.config.get("llm_name") or ""),
        image=str(first.config.get("docker_image") or ""),
        dataset=(tasks.name if tasks else first.task),
        dataset_hash=tasks.content_hash if tasks else None,
        config={"imported_from": "llm-in-sandbox 0.2.0", "folders": [str(r.folder) for r in runs], "peer_config": first.config},
        notes=f"imported from llm-in-sandbox output at {folder}",
    )
    used = {pid: known.get(pid) or built[pid] for r in runs for pid in r.problems}
    wh.keep_tasks(run_id, used.values(), name=tasks.name if tasks else first.task)  # what compare pairs by
    writer = wh.writer(durability="flush")  # a bulk import: finish_run ends it
    samples: dict[tuple[str, str], int] = {}
    try:
        for run in runs:
            for pid, item in run.items():
                task = known.get(pid) or built[pid]
                sample = samples.get((pid, run.mode), 0)
                samples[(pid, run.mode)] = sample + 1
                eid = episode_key(run_id, pid, run.mode, sample)
                steps = list(item.get("trajectory") or [])
                turns = _turns(run_id, eid, steps, run.started)
                answer = item.get("agent_answer") or ""
                if run.mode == "llm":
                    turns = [TurnRecord(run_id=run_id, episode_id=eid, turn_index=0, started_at=run.started, assistant_content=answer, finish_reason="stop")]
                term, err = _termination(run, steps, _log_error(run.folder, pid))
                ep = EpisodeRecord(
                    run_id=run_id,
                    episode_id=eid,
                    task_id=pid,
                    domain=task.domain,
                    mode=run.mode,
                    sample_index=sample,
                    model=str(run.config.get("llm_name") or ""),
                    started_at=run.started,
                    prompt_messages=[{"role": "user", "content": item.get("problem_statement") or ""}],
                    config={"peer": {"reward": item.get("reward"), "folder": str(run.folder), "mode": run.config.get("mode")}},
                )
                writer.start_episode(ep)
                for t in turns:
                    writer.record_turn(t)
                tool_s = sum(t.tool_latency_s for t in turns)
                writer.finish_episode(
                    ep.model_copy(
                        update={
                            "ended_at": run.started + timedelta(seconds=tool_s),
                            "termination": term,
                            "error": err,
                            "answer": answer if term not in ("model_error", "sandbox_error") else None,
                            "answer_source": "reply" if run.mode == "llm" else "answer_file",
                            "wall_s": tool_s,
                        }
                    ).with_totals(turns)
                )
                summary.episodes += 1
                summary.lose(NOT_RECORDED)
                if run.mode == "sandbox":
                    summary.lose(NO_SYSTEM_PROMPT)
    finally:
        writer.close()
    head = f"import llm-in-sandbox: {len(runs)} folder(s) in {folder} -> {summary.episodes} episodes of run {run_id}"
    return finish_import(wh, run_id, summary, known or built, files=len(runs), head=head)


def finish_import(wh: Warehouse, run_id: str, summary: Summary, tasks: dict[str, Task], *, files: int, head: str) -> Summary:
    """The end of every import of another tool's episodes (this module's, interop.atif_import's):
    the run finished, the summary's head, every answer scored by sandflow's verifiers."""
    wh.finish_run(run_id, status="finished")
    summary.files = files
    summary.head = head
    _score(wh, run_id, tasks, summary)
    summary.extra["run_id"] = run_id
    return summary


def _score(wh: Warehouse, run_id: str, tasks: dict[str, Task], summary: Summary) -> None:
    """Score every answer with sandflow's verifiers; compare with the peer's own reward."""
    data = wh.load_run(run_id, with_turns=False)
    rows, problems = [], []
    agree = disagree = 0
    for e in data.episodes:
        one = RunData(run_id=run_id, episodes=[e], attempts={e.episode_id: data.attempts[e.episode_id]})
        try:
            got, probs = score_episodes(one, tasks, None)
        except VerifierError as exc:
            problems.append(f"episode {e.episode_id}: {exc}")  # the reward's error names the task
            continue
        rows += got
        problems += probs
        peer = (e.config.get("peer") or {}).get("reward")
        if got and isinstance(peer, int | float):
            if (got[0]["score"] >= 1.0) == (peer >= 1.0):
                agree += 1
            else:
                disagree += 1
    if rows:
        wh.write_scores(rows)
    summary.extra.update(scored=len(rows), scoring_problems=problems[:20], agree_with_peer=agree, disagree_with_peer=disagree)
