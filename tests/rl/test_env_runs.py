"""The step-wise environment's warehouse run: `running` while its process lives, ended
when it ends (rl/envruns.py).

Readers call a `running` run whose lock is free `interrupted` (abandoned). The env's run
used to be recorded `running` and never held nor ended: it read abandoned while the
trainer was alive, and after it exited cleanly. Now the process holds the run's lock from
its first episode and records the end at exit (or `finish_runs()`); a kill -9 leaves it
reading `interrupted`; a second process on the same run_id is refused before it writes.

Real Docker, a real warehouse; the policy's turns are written by the test (or the child
trainer process) as a trainer would generate them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from rl.env import SandboxEnv
from rl.envruns import finish_runs, open_env_run
from tests.rl.conftest import WRITE_ANSWER, containers_of, math_task, new_run_id, sandbox_cfg

REPO = Path(__file__).resolve().parents[2]

# A trainer process: one env episode of run RID in warehouse WH, then (by MODE) it exits
# normally, leaves a second episode running, raises, or holds its episode until killed.
TRAINER = """
import json, sys, time
from rl.env import SandboxEnv
from tests.rl.conftest import WRITE_ANSWER, math_task, sandbox_cfg

mode, wh, rid = sys.argv[1:4]

def hermes(name, args):
    return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"

env = SandboxEnv(sandbox=sandbox_cfg(), warehouse=wh, run_id=rid, durability="flush")
env.reset(math_task())
print("episode", env.episode.record.episode_id, flush=True)
if mode == "hold":
    time.sleep(600)
env.step(hermes("execute_bash", WRITE_ANSWER))
assert env.step(hermes("submit", {})).reward == 1.0
if mode == "left":
    SandboxEnv(sandbox=sandbox_cfg(), warehouse=wh, run_id=rid).reset(math_task("second"))
if mode == "crash":
    raise RuntimeError("the trainer broke")
"""


def hermes(name: str, args: dict[str, Any]) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"


def solve(env: SandboxEnv) -> None:
    env.step(hermes("execute_bash", WRITE_ANSWER))
    out = env.step(hermes("submit", {}))
    assert out.done and out.reward == 1.0


def trainer(tmp_path: Path, mode: str, wh: Path, rid: str) -> subprocess.Popen[str]:
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, str(script), mode, str(wh), rid],
        env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=open(tmp_path / f"{mode}.err", "w"),
        text=True,
    )  # fmt: skip


def runs_view(wh: Path, rid: str) -> list[tuple[Any, ...]]:
    from warehouse.query import connect

    with connect(wh) as q:
        return q.rows(f"SELECT status, abandoned FROM runs WHERE run_id = '{rid}'")


def info_of(wh: Path, rid: str) -> dict[str, Any]:
    """The run's row as readers see it (Warehouse.run_info)."""
    from warehouse import Warehouse

    info = Warehouse(wh).run_info(rid)
    assert info is not None, f"run {rid} has no row"
    return info


def is_held(wh: Path, rid: str) -> bool | None:
    from warehouse.layout import Layout
    from warehouse.runlock import is_held

    return is_held(Layout(wh), rid)


@pytest.mark.usefixtures("sandbox_image")
def test_an_env_run_reads_running_while_its_process_lives_and_finish_runs_ends_it(
    tmp_path: Path,
) -> None:
    """Two envs of one process share the run and its one lock. While they live the run
    reads `running` (run_info and the `runs` view, not abandoned); `finish_runs` ends it
    `interrupted` naming the episode still running, `finished` once none is, and frees
    the lock; an env used after it opens the run again."""
    from warehouse import Warehouse

    wh, rid = tmp_path / "wh", new_run_id("envrun-live")
    a = SandboxEnv(sandbox=sandbox_cfg(), warehouse=wh, run_id=rid, durability="flush")
    b = SandboxEnv(sandbox=sandbox_cfg(), warehouse=wh, run_id=rid, durability="flush")
    try:
        a.reset(math_task())
        assert info_of(wh, rid)["status"] == "running"
        assert runs_view(wh, rid) == [("running", False)] and is_held(wh, rid) is True
        b.reset(math_task("second"))
        solve(a)
        assert info_of(wh, rid)["status"] == "running"

        assert finish_runs(rid) == {rid: "interrupted"}  # b's episode is still running
        info = info_of(wh, rid)
        assert info["status"] == "interrupted" and info["ended_at"] is not None
        assert info["notes"] == (
            "rl step-wise environment; 1 episode(s) were still running when the run ended"
        )
        assert is_held(wh, rid) is False and runs_view(wh, rid) == [("interrupted", False)]
        b.close()

        a.reset(math_task())  # the run goes on: held and `running` again
        assert info_of(wh, rid)["status"] == "running" and is_held(wh, rid) is True
        solve(a)
        assert finish_runs(rid) == {rid: "finished"} and finish_runs(rid) == {}
        info = info_of(wh, rid)
        assert (info["status"], info["notes"]) == ("finished", "rl step-wise environment")
        assert is_held(wh, rid) is False
        assert len(Warehouse(wh).episodes(rid)) == 3
    finally:
        a.close()
        b.close()
        finish_runs(rid)


def test_threads_opening_one_run_take_its_lock_once(tmp_path: Path) -> None:
    """Envs of one process used from many threads: the run is opened (locked, recorded)
    once, never refused by its own process."""

    wh, rid = tmp_path / "wh", new_run_id("envrun-threads")
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def open_it() -> None:
        start.wait()
        try:
            open_env_run(wh, rid, notes="rl step-wise environment")
        except BaseException as exc:  # noqa: BLE001 - the test reports every one
            errors.append(exc)

    threads = [threading.Thread(target=open_it) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert errors == []
        assert info_of(wh, rid)["status"] == "running" and is_held(wh, rid) is True
    finally:
        assert finish_runs(rid) == {rid: "finished"}


def test_a_run_whose_warehouse_was_deleted_is_not_made_again(tmp_path: Path) -> None:
    """A trainer (or a benchmark) that removes its temporary warehouse before exiting:
    ending its run at exit writes nothing (no folder made again)."""
    import shutil

    wh, rid = tmp_path / "wh", new_run_id("envrun-gone")
    open_env_run(wh, rid, notes="rl step-wise environment")
    shutil.rmtree(wh)
    assert finish_runs(rid) == {rid: "finished"}
    assert not wh.exists()


@pytest.mark.slow  # a trainer process per case (~5 s each)
@pytest.mark.usefixtures("sandbox_image")
@pytest.mark.parametrize(
    ("mode", "status", "note"),
    [
        ("ok", "finished", None),
        ("left", "interrupted", "1 episode(s) were still running when the run ended"),
        ("crash", "interrupted", "the process ended with an uncaught RuntimeError"),
    ],
)
def test_a_trainer_process_that_exits_ends_its_env_run(
    tmp_path: Path, mode: str, status: str, note: str | None
) -> None:
    """A trainer that runs one env episode and exits normally leaves its run `finished`;
    one that exits with an episode still running, or by an uncaught exception, leaves it
    `interrupted` saying so (never `running`, never abandoned)."""
    from warehouse import Warehouse

    wh, rid = tmp_path / "wh", new_run_id(f"envrun-{mode}")
    proc = trainer(tmp_path, mode, wh, rid)
    out, _ = proc.communicate(timeout=240)
    err = (tmp_path / f"{mode}.err").read_text()
    assert proc.returncode == (1 if mode == "crash" else 0), err
    assert out.startswith("episode "), err
    info = info_of(wh, rid)
    assert info["status"] == status and info["ended_at"] is not None
    assert info["notes"] == "; ".join(["rl step-wise environment", *([note] if note else [])])
    assert runs_view(wh, rid) == [(status, False)]
    episodes = Warehouse(wh).episodes(rid).to_pylist()
    assert [e["termination"] for e in episodes if e["task_id"] == "six-times-seven"] == ["submitted"]
    left = [o.task_id for o in Warehouse(wh).orphans(rid)]  # its turns: recoverable
    assert left == (["second"] if mode == "left" else [])
    assert containers_of(rid) == []


@pytest.mark.slow  # two trainer processes (~5 s each)
@pytest.mark.usefixtures("sandbox_image")
def test_a_trainer_that_writes_the_run_again_later_overwrites_nothing(tmp_path: Path) -> None:
    """Sample indices are counted per process: a second trainer on the same explicit
    run_id, after the first ended, starts after the samples the run holds (its episode
    keys would be the first one's otherwise, and replace them). An orphan's sample counts
    as taken too."""
    from warehouse import Warehouse

    wh, rid = tmp_path / "wh", new_run_id("envrun-again")
    for mode in ("left", "ok"):
        proc = trainer(tmp_path, mode, wh, rid)
        _, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, (tmp_path / f"{mode}.err").read_text()
    rows = Warehouse(wh).episodes(rid).to_pylist()
    samples = sorted(e["sample_index"] for e in rows if e["task_id"] == "six-times-seven")
    assert samples == [0, 1], rows
    assert len({e["episode_id"] for e in rows}) == len(rows) == 2
    (orphan,) = Warehouse(wh).orphans(rid)  # the first trainer's second episode, kept
    assert (orphan.task_id, orphan.sample_index) == ("second", 0)
    assert info_of(wh, rid)["status"] == "finished"


@pytest.mark.slow  # a trainer process, a refused second writer, kill -9 (~8 s)
@pytest.mark.usefixtures("sandbox_image")
def test_a_second_process_is_refused_and_a_killed_trainer_reads_interrupted(
    tmp_path: Path,
) -> None:
    """A trainer process holds its env run mid-episode: readers see `running`; this test's
    process, an env on the same explicit run_id, is refused by reset() with one sentence
    naming the holder and what to do, before opening a sandbox or writing anything. Then
    kill -9 of the trainer: the kernel frees the lock, the stored row still says
    `running`, and readers show `interrupted` (abandoned)."""
    from engine import RunLockedError
    from warehouse import Warehouse
    from warehouse.runlock import ABANDONED_NOTE

    wh, rid = tmp_path / "wh", new_run_id("envrun-kill9")
    proc = trainer(tmp_path, "hold", wh, rid)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert line.startswith("episode "), (tmp_path / "hold.err").read_text()
        before = info_of(wh, rid)
        assert before["status"] == "running"
        assert runs_view(wh, rid) == [("running", False)]

        env = SandboxEnv(sandbox=sandbox_cfg(), warehouse=wh, run_id=rid)
        with pytest.raises(RunLockedError) as refused:
            env.reset(math_task("mine"))
        msg = str(refused.value)
        assert msg.startswith(f"run {rid} is being written by pid {proc.pid} on "), msg
        assert msg.endswith(
            "give each process its own run_id (the default, rl.env.default_run_id, does)"
        ), msg
        assert ". " not in msg and "\n" not in msg, msg  # one sentence
        assert env.episode is None and len(containers_of(rid)) == 1  # the trainer's only
        assert Warehouse(wh).run_info(rid) == before  # nothing written
        kept = Warehouse(wh).run_tasks(rid)
        assert kept is not None and [t.id for t in kept] == ["six-times-seven"]

        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        info = info_of(wh, rid)
        assert info["status"] == "interrupted" and ABANDONED_NOTE in info["notes"]
        assert runs_view(wh, rid) == [("interrupted", True)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        from sandbox import gc as G
        from sandbox.engine import docker_client

        G.collect(docker_client(), run_prefix=rid)  # what the killed trainer left
