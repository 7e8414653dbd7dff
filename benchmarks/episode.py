"""Benchmark: the episode loop's own cost per turn, model time excluded.

A scripted OpenAI-compatible server answers instantly (10 turns of execute_bash,
then submit). Per turn (after the first, which also places the input files and is
reported apart), the overhead is the time between the ends of two consecutive turns
(after the recorder returned) minus the model call's latency as the client measured
it: what remains is the sandbox exec, building messages and records, and recording.
It is split into its parts: time inside `sandbox.exec`, time inside `record_turn`, and
the loop's own remainder. Floors measured in the same run: a bare `sandbox.exec("true")`
and a bare `record_turn` of a turn like the benchmark's.
Target: loop_overhead_p50_ms <= 10.

    .venv/bin/python benchmarks/episode.py [--episodes 5] [--turns 10] [--backend docker]
                                           [--durability turn|flush]

Ends with ONE JSON line (see benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from datasets_prep.task import Task  # noqa: E402
from sandbox.base import ExecResult, SandboxConfig, SandboxLimits  # noqa: E402
from tasks.journal import JournalRecorder  # noqa: E402
from tasks.loop import Limits, run_episode  # noqa: E402
from tasks.model import ModelClient, ModelConfig  # noqa: E402
from tasks.records import EpisodeRecord, Observation, Recorder, ToolCall, TurnRecord  # noqa: E402
from tests.scripted_model import ScriptedModel, tool_reply  # noqa: E402

TARGET_MS = 10.0


class TimedSandbox:
    """Delegates to a sandbox; adds up the time spent inside exec()."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.exec_s = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def exec(self, command: str, timeout: float | None = None) -> ExecResult:
        t0 = time.perf_counter()
        try:
            return self._inner.exec(command, timeout)
        finally:
            self.exec_s += time.perf_counter() - t0

    def take(self) -> float:
        spent, self.exec_s = self.exec_s, 0.0
        return spent


class TimedRecorder:
    """Wraps a Recorder; notes each turn's end, its exec time and its record time."""

    def __init__(self, inner: Recorder, box: TimedSandbox) -> None:
        self.inner, self.box = inner, box
        self.marks: list[tuple[float, TurnRecord, float, float]] = []
        self.start = 0.0

    def start_episode(self, episode: EpisodeRecord) -> None:
        self.inner.start_episode(episode)
        self.start = time.perf_counter()

    def record_turn(self, turn: TurnRecord) -> None:
        exec_s = self.box.take()
        t0 = time.perf_counter()
        self.inner.record_turn(turn)
        end = time.perf_counter()
        self.marks.append((end, turn, exec_s, end - t0))

    def finish_episode(self, episode: EpisodeRecord) -> None:
        self.inner.finish_episode(episode)


def make_recorder(tmp: Path, durability: str) -> tuple[Recorder, str, Any]:
    """The warehouse's writer when it has landed, else the file journal."""
    warehouse_cls = getattr(importlib.import_module("warehouse"), "Warehouse", None)
    if warehouse_cls is not None:
        writer = warehouse_cls(tmp / "warehouse").writer(durability=durability)
        return writer, f"warehouse.EpisodeWriter(durability={durability})", writer.close
    journal = JournalRecorder(tmp / "records.jsonl", fsync=durability == "turn")
    return journal, f"tasks.journal.JournalRecorder(fsync={durability == 'turn'})", journal.close


def record_floor(recorder: Recorder, n: int = 50) -> list[float]:
    """record_turn of turns shaped like the benchmark's (one call, one observation)."""
    now = datetime.now(UTC)
    ep = EpisodeRecord(run_id="bench-episode", episode_id="floor", task_id="floor",
                       domain="math", mode="sandbox", model="scripted", started_at=now)
    recorder.start_episode(ep)
    out = []
    for i in range(n):
        turn = TurnRecord(
            run_id="bench-episode", episode_id="floor", turn_index=i, started_at=now,
            tool_calls=[ToolCall(id=f"c{i}", name="execute_bash", arguments='{"command": "echo 1"}')],
            observations=[Observation(tool_call_id=f"c{i}", name="execute_bash",
                                      content="1\n[exit code: 0]", exit_code=0)],
        )
        t0 = time.perf_counter()
        recorder.record_turn(turn)
        out.append(time.perf_counter() - t0)
    ep.termination = "submitted"
    recorder.finish_episode(ep)
    return out


def p(values: list[float], q: float = 0.5) -> float:
    """Percentile in ms (q=0.5: the median)."""
    if not values:
        return float("nan")
    if q == 0.5:
        return statistics.median(values) * 1000.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000.0


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--episodes", type=int, default=5)
    ap.add_argument("--turns", type=int, default=10, help="execute_bash turns before submit")
    ap.add_argument("--backend", default="docker", choices=["docker", "bwrap"])
    ap.add_argument("--durability", default="turn", choices=["turn", "flush"],
                    help="the recorder's: 'turn' syncs every turn to disk (the pipeline's default)")
    args = ap.parse_args()
    from sandflow.host import apply_host_settings

    apply_host_settings()  # SANDFLOW_* settings, handed to the libraries as the CLI does

    from sandbox import open_sandbox

    overhead: list[float] = []
    in_exec: list[float] = []
    in_record: list[float] = []
    own: list[float] = []
    first_turn: list[float] = []
    model_lat: list[float] = []
    exec_floor: list[float] = []
    with tempfile.TemporaryDirectory(prefix="sandflow-bench-") as tmpdir, ScriptedModel() as server:
        tmp = Path(tmpdir)
        cfg = SandboxConfig(backend=args.backend, run_id="bench-episode", episode_id="bench",
                            limits=SandboxLimits(network="none"))
        model_cfg = ModelConfig(model="scripted", base_url=server.url, max_retries=0)
        client = ModelClient(model_cfg)
        recorder, recorder_name, close = make_recorder(tmp, args.durability)
        with open_sandbox(cfg) as raw_box:
            raw_box.exec("true")  # warm the shell
            for _ in range(50):
                t0 = time.perf_counter()
                raw_box.exec("true")
                exec_floor.append(time.perf_counter() - t0)
            rec_floor = record_floor(recorder)
            box = TimedSandbox(raw_box)
            for e in range(args.episodes):
                server.push(*[tool_reply("execute_bash", {"command": f"echo $(( {i} * {i} ))"})
                              for i in range(args.turns)], tool_reply("submit", {}))
                timed = TimedRecorder(recorder, box)
                task = Task(id=f"bench-{e}", domain="math", problem_statement="Square some numbers.",
                            ground_truth="81", input_files={"data.txt": "1 2 3\n"})
                result = run_episode(task, model_cfg, recorder=timed, sandbox=box,
                                     client=client, run_id="bench-episode",
                                     limits=Limits(max_steps=args.turns + 5))
                assert result.record.termination == "submitted", result.record
                prev = timed.start
                for mark, turn, exec_s, record_s in timed.marks:
                    cost = mark - prev - turn.model_latency_s
                    model_lat.append(turn.model_latency_s)
                    prev = mark
                    if turn.turn_index == 0:
                        first_turn.append(cost)
                    elif turn.tool_calls and turn.tool_calls[0].name == "execute_bash":
                        overhead.append(cost)
                        in_exec.append(exec_s)
                        in_record.append(record_s)
                        own.append(cost - exec_s - record_s)
        if close:
            close()
        client.close()

    p50 = p(overhead)
    print(f"turns measured: {len(overhead)} ({args.episodes} episodes x {args.turns - 1} bash turns after the first)")
    print(f"loop overhead per turn    p50 {p50:7.2f} ms   p90 {p(overhead, 0.9):7.2f} ms")
    print(f"  in sandbox.exec         p50 {p(in_exec):7.2f} ms   (floor: exec 'true' {p(exec_floor):.2f} ms)")
    print(f"  in record_turn          p50 {p(in_record):7.2f} ms   (floor: {p(rec_floor):.2f} ms, {recorder_name})")
    print(f"  the loop's own          p50 {p(own):7.2f} ms")
    print(f"first turn (+ inputs)     p50 {p(first_turn):7.2f} ms")
    print(f"model call (excluded)     p50 {p(model_lat):7.2f} ms")
    floors = p(exec_floor) + p(rec_floor)
    print(f"overhead / (exec + record floors) = {p50 / floors:.2f}x")
    print(f"target: p50 <= {TARGET_MS} ms -> {'PASS' if p50 <= TARGET_MS else 'FAIL'}")
    print(json.dumps({
        "benchmark": "episode",
        "loop_overhead_p50_ms": round(p50, 3),
        "loop_overhead_p90_ms": round(p(overhead, 0.9), 3),
        "exec_in_turn_p50_ms": round(p(in_exec), 3),
        "record_in_turn_p50_ms": round(p(in_record), 3),
        "loop_own_p50_ms": round(p(own), 3),
        "first_turn_overhead_p50_ms": round(p(first_turn), 3),
        "exec_floor_p50_ms": round(p(exec_floor), 3),
        "record_floor_p50_ms": round(p(rec_floor), 3),
        "overhead_over_floors": round(p50 / floors, 3),
        "model_latency_p50_ms": round(p(model_lat), 3),
        "turns": len(overhead),
        "episodes": args.episodes,
        "backend": args.backend,
        "recorder": recorder_name,
        "durability": args.durability,
        "target_ms": TARGET_MS,
        "pass": p50 <= TARGET_MS,
    }))


if __name__ == "__main__":
    main()
