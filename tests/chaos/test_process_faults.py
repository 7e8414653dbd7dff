"""The flow process dies or is stopped mid-run; the same run id resumes it.

A real `sandflow flows run` process (its own Prefect ephemeral server, real Docker
sandboxes, the scripted model over HTTP in this test process) is hurt from outside:

- SIGKILL (the OOM killer, `kill -9`): nothing runs on the way out. Afterwards the
  journals of the episodes in flight are orphans holding their turns; `sandbox gc`
  removes the containers by label; resume records every episode exactly once and the
  journaled turns stay readable (recovered journals, `partial_turns`).
- SIGINT (Ctrl+C, to the whole process group as a terminal sends it) and SIGTERM (to
  the flow process, as a supervisor sends it): the process stops by itself, removes its
  containers, and the episodes in flight are recorded as 'interrupted'; resume completes.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.chaos.conftest import (
    CliRun,
    chaos_run_id,
    containers_of,
    gc_run,
    query,
    wait_for,
)
from tests.flows.conftest import tiny_tasks, write_tasks
from tests.scripted_model import ScriptedModel

pytestmark = [pytest.mark.chaos, pytest.mark.usefixtures("sandbox_image")]

N_TASKS = 6  # sandbox mode: 6 episodes of 4 turns, 2 at a time


def _run_args(ts: Path, wh: Path, rid: str, model: ScriptedModel) -> list[str]:
    return [
        "flows", "run", str(ts), "--base-url", model.url, "--model", "scripted",
        "--mode", "sandbox", "--concurrency", "2", "--max-steps", "6",
        "--wall-clock", "120", "--warehouse", str(wh), "--run-id", rid,
    ]  # fmt: skip


def _journals(wh: Path, rid: str) -> list[Path]:
    from warehouse.layout import Layout

    return Layout(wh).journal_files(rid)


def _committed(wh: Path, rid: str) -> list[Path]:
    from warehouse.layout import Layout

    return Layout(wh).partition_files("episodes", rid)


def _mid_run(wh: Path, rid: str) -> bool:
    """At least one episode committed and one in flight with a journaled turn."""
    if not _committed(wh, rid):
        return False
    for j in _journals(wh, rid):
        try:
            if 2 <= j.read_text().count("\n") <= 4:  # header + 1..3 of the 4 turns
                return True
        except FileNotFoundError:
            continue
    return False


def _resume_and_check(start_cli, ts: Path, wh: Path, rid: str, model: ScriptedModel) -> None:
    """Run the same run id again; every episode recorded exactly once, 4 turns each."""
    resumed: CliRun = start_cli(*_run_args(ts, wh, rid, model))
    rc = resumed.wait(timeout=300)
    assert rc == 0, resumed.output[-3000:]
    assert "0 failed" in resumed.output, resumed.output[-3000:]
    rows = query(wh, f"SELECT count(*), count(DISTINCT episode_id) FROM episodes WHERE run_id = '{rid}'")
    assert rows == [(N_TASKS, N_TASKS)]
    terms = query(wh, f"SELECT termination, count(*) FROM episodes WHERE run_id = '{rid}' GROUP BY 1")
    assert terms == [("submitted", N_TASKS)], terms
    dup = query(
        wh,
        f"SELECT episode_id, count(*) FROM _raw_episodes WHERE run_id = '{rid}' GROUP BY 1 HAVING count(*) > 1",
    )
    assert dup == [], f"an episode was stored twice: {dup}"
    turns = query(
        wh,
        f"SELECT episode_id, count(*), count(DISTINCT turn_index), max(turn_index) FROM turns "
        f"WHERE run_id = '{rid}' GROUP BY 1",
    )
    assert len(turns) == N_TASKS and all(t[1:] == (4, 4, 3) for t in turns), turns
    assert containers_of(rid) == [], "a container of the run survived the resume"
    assert _journals(wh, rid) == [], "live journals left after a completed run"


@pytest.mark.slow
def test_sigkill_mid_run_then_resume(tmp_path: Path, slow_model: ScriptedModel, start_cli) -> None:
    from warehouse.journal import read_journal
    from warehouse.layout import Layout
    from warehouse.recovery import find_orphans

    ts = write_tasks(tmp_path / "tiny.parquet", tiny_tasks(N_TASKS))
    wh = tmp_path / "wh"
    rid = chaos_run_id("kill9")
    run = start_cli(*_run_args(ts, wh, rid, slow_model))
    wait_for(lambda: _mid_run(wh, rid) or run.proc.poll() is not None, 240, "the run to be mid-way")
    assert run.proc.poll() is None, f"the run ended before it could be killed:\n{run.output[-3000:]}"
    os.kill(run.proc.pid, signal.SIGKILL)  # the flow process only, as the OOM killer does
    run.proc.wait(timeout=30)
    run.kill_group()  # its Prefect server child would otherwise linger

    # What kill -9 left: committed episodes, orphaned journals with turns, containers.
    committed_before = len(_committed(wh, rid))
    assert 1 <= committed_before < N_TASKS
    orphans = find_orphans(Layout(wh), rid)
    assert orphans, "no orphaned journal after kill -9 mid-episode"
    journaled = {
        (o.episode_id, t.turn_index, t.assistant_content, t.started_at)
        for o in orphans
        for t in read_journal(o.path).turns
    }
    assert journaled, "the orphaned journals hold no turn"
    partial = query(wh, "SELECT episode_id, turn_index, journal_state FROM partial_turns", run_id=rid)
    assert {(e, i) for e, i, _ in partial} >= {(e, i) for e, i, _, _ in journaled}
    assert {s for _, _, s in partial} == {"orphaned"}

    # No container survives: the sandbox's PID 1 ends when its owner's connection drops,
    # and `sandbox gc` removes what is left by label (owner pid gone).
    gc_run(rid)
    wait_for(lambda: containers_of(rid) == [], 30, "the killed run's containers to be gone")

    _resume_and_check(start_cli, ts, wh, rid, slow_model)
    # Nothing journaled was lost: the turns of the killed attempts are kept in the
    # recovered journals (the partial_turns view), beside the re-run's final records.
    recovered = query(
        wh,
        "SELECT episode_id, turn_index, journal_state FROM partial_turns WHERE journal_state = 'recovered'",
        run_id=rid,
    )
    assert {(e, i) for e, i, _ in recovered} >= {(e, i) for e, i, _, _ in journaled}


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_clean_stop_marks_partial_episodes_then_resume(
    tmp_path: Path, slow_model: ScriptedModel, start_cli, sig: int, cli_prefect_home: Path
) -> None:
    ts = write_tasks(tmp_path / "tiny.parquet", tiny_tasks(N_TASKS))
    wh = tmp_path / "wh"
    rid = chaos_run_id(signal.Signals(sig).name.lower())
    run = start_cli(*_run_args(ts, wh, rid, slow_model))
    wait_for(lambda: _mid_run(wh, rid) or run.proc.poll() is not None, 240, "the run to be mid-way")
    assert run.proc.poll() is None, f"the run ended before it could be stopped:\n{run.output[-3000:]}"
    if sig == signal.SIGINT:
        os.killpg(run.proc.pid, sig)  # Ctrl+C: the terminal signals the whole foreground group
    else:
        os.kill(run.proc.pid, sig)  # a supervisor (systemd, k8s) signals the main process
    rc = run.wait(timeout=90)
    out = run.output
    assert rc != 0, f"the stopped run claims success:\n{out[-3000:]}"
    assert "Traceback" not in out, f"a stop should not end in a traceback:\n{out[-3000:]}"
    # Prefect's ephemeral server, terminated mid-flush, logs its services' cancellation as
    # tracebacks (seen in CI): its output goes to its own log, never into the run's.
    server_log = cli_prefect_home / "sandflow-ephemeral-server.log"
    assert f"ephemeral Prefect server for pid {run.proc.pid}" in server_log.read_text(errors="replace")

    # Clean stop: no container of the run is left, without any gc.
    wait_for(lambda: containers_of(rid) == [], 30, "the stopped run's containers to be gone")
    # Partial episodes are marked: the episodes in flight were recorded as 'interrupted'.
    from warehouse.layout import Layout
    from warehouse.recovery import find_orphans

    assert find_orphans(Layout(wh), rid) == [], "a clean stop left journals unrecorded"
    marked = query(
        wh, f"SELECT episode_id, termination, num_turns FROM episodes WHERE run_id = '{rid}' AND termination != 'submitted'"
    )
    assert marked, "no partial episode was recorded"
    assert {t for _, t, _ in marked} == {"interrupted"}, marked
    # Only the episodes in flight (2 at a time) are marked; queued ones never started.
    assert len(marked) <= 2, marked
    # (an episode interrupted before its first turn ended has no turn to keep)

    _resume_and_check(start_cli, ts, wh, rid, slow_model)
