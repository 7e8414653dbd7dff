"""`sandflow import llm-in-sandbox`: the real peer's output folders become a scored run.

The slow test runs the real peer package (llm-in-sandbox 0.2.0, installed as
benchmarks/peer.py installs it) against the scripted model on the same three tasks as
the session's sandflow run, in both of its modes, imports both folders as one run, and
checks episodes, turns, tool calls and scores against the peer's own files, then pairs
the run with the sandflow run in `sandflow compare`. The others feed the importer
hand-made folders in the peer's format: malformed fields, hostile problem ids, limits.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.interop.conftest import RealRun, answer_of, peer_folder, peer_problem, run_cli, tasks
from tests.scripted_model import Reply, ScriptedModel, text_reply, tool_reply

pytestmark = pytest.mark.usefixtures("prefect_harness")


def peer_solver(body: dict, index: int) -> Reply:
    """The peer's loop: look, write /testbed/answer.txt (its demo config's output dir), submit."""
    answer = answer_of(body)
    if not body.get("tools"):
        return text_reply(answer)
    done = sum(1 for m in body.get("messages", []) if m.get("role") == "assistant")
    steps = [
        ("execute_bash", {"command": "ls /testbed"}),
        ("execute_bash", {"command": f"echo {answer} > /testbed/answer.txt"}),
        ("submit", {}),
    ]
    name, args = steps[min(done, 2)]
    return tool_reply(name, args)


def _run_peer(work: Path) -> Path:
    """The peer from the suite's venv of it (tests/venvs.py "peer", built by the set-up),
    on a task folder of this session's own (another checkout's session may share the venv)."""
    import shutil

    import docker

    from benchmarks.peer import PEER_IMAGE, PEER_TASK, install_peer_task
    from sandbox.image import DEFAULT_SPEC
    from tests.venvs import venv

    docker.from_env().images.get(DEFAULT_SPEC.tag).tag(*PEER_IMAGE.split(":"))  # as the benchmark does
    py = venv("peer")
    exe, task = py.parent / "llm-in-sandbox", f"{PEER_TASK}_{os.getpid()}"
    rows = [{k: t.model_dump()[k] for k in ("id", "domain", "problem_statement", "ground_truth", "input_files")} for t in tasks()]
    folder = install_peer_task(py.parent.parent, rows, work, task)
    env = dict(os.environ, LITELLM_LOCAL_MODEL_COST_MAP="True", OPENAI_API_KEY="sk-none")
    try:
        with ScriptedModel(default=peer_solver, models=("scripted",)) as model:
            for mode in ("llm-in-sandbox", "llm"):
                cmd = [str(exe), "benchmark", "--task", task, "--llm_name", "openai/scripted", "--llm_base_url", model.url,
                       "--num_workers", "2", "--max_steps", "6", "--output_dir", str(work / "out"), "--temperature", "0.0", "--mode", mode]  # fmt: skip
                r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
                assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return work / "out"


@pytest.mark.slow
def test_real_peer_output_becomes_a_scored_run(real_run: RealRun, tmp_path: Path) -> None:
    out = _run_peer(tmp_path)
    folders = sorted(p for p in out.iterdir() if p.is_dir())
    assert len(folders) == 2  # <stamp>_sandflow_peer_openai_scripted_{LLMinSandbox,vanillaLLM}
    rid = "peer-import-test"
    res = run_cli("import", "llm-in-sandbox", str(out), "--tasks", str(real_run.task_set), "--run-id", rid, "-w", str(real_run.warehouse))
    assert res.exit_code == 0, res.output
    assert f"import llm-in-sandbox: 2 folder(s) in {out} -> 6 episodes of run {rid}" in res.output
    assert "not carried over: system prompt (not in the peer's output) (3 episodes), token counts (the peer records none) (6 episodes)" in res.output
    assert f"run {rid}: 6 scored by sandflow's verifiers (6 agree with the peer's reward, 0 differ)" in res.output

    from warehouse import Warehouse

    data = Warehouse(real_run.warehouse).load_run(rid)
    assert sorted((e.task_id, e.mode) for e in data.episodes) == sorted((f"t{i}", m) for i in range(3) for m in ("sandbox", "llm"))
    sandbox_folder = next(f for f in folders if f.name.endswith("LLMinSandbox"))
    peer = json.loads((sandbox_folder / "trajectory.json").read_text())
    for e in data.episodes:
        turns = data.turns_of(e.episode_id)
        assert e.answer == ("41" if e.task_id == "t1" else "42")
        assert data.scores[e.episode_id].score == (0.0 if e.task_id == "t1" else 1.0)
        assert e.termination == "submitted" and e.model == "openai/scripted"
        if e.mode == "llm":
            assert len(turns) == 1 and turns[0].assistant_content == e.answer
            continue
        steps = peer[e.task_id]["trajectory"]
        assert len(turns) == len(steps) == 3
        for t, s in zip(turns, steps, strict=True):
            assert [c.name for c in t.tool_calls] == [s["action"]["function"]]
            assert json.loads(t.tool_calls[0].arguments) == s["action"]["parameters"]
            assert [o.content for o in t.observations] == [s["observation"]]
        assert turns[0].observations[0].exit_code == 0  # parsed from the peer's "Exit code: 0"
        assert e.prompt_messages == [{"role": "user", "content": peer[e.task_id]["problem_statement"]}]
    # the same tasks, paired with the sandflow run task by task (same task set hash)
    res = run_cli("compare", real_run.run_id, rid, "-w", str(real_run.warehouse), "--json")
    assert res.exit_code == 0, res.output
    rows = json.loads(res.output)["rows"]
    math = [r for r in rows if r["domain"] == "math"]
    assert sorted(r["mode"] for r in math) == ["llm", "sandbox"]
    for r in math:  # every task paired, both sides 2 of 3 right (t1 wrong in both)
        assert (r["tasks"], r["unmatched"], r["before"], r["after"], r["down"], r["up"]) == (3, 0, 66.7, 66.7, 0, 0), r


# ------------------------------------------------------------------ hand-made peer folders
def test_malformed_peer_output_is_refused_before_any_work(tmp_path: Path) -> None:
    wh = tmp_path / "wh"
    folder = peer_folder(tmp_path, {"p0": peer_problem(), "p1": peer_problem(reward="high")})
    res = run_cli("import", "llm-in-sandbox", str(folder), "-w", str(wh))
    assert res.exit_code == 2, res.output
    assert "problem 'p1': reward must be a number, got str" in res.output and "Traceback" not in res.output
    assert not wh.exists()  # nothing written
    (folder / "trajectory.json").write_text('{"p0": {"trajectory": [1, ')
    res = run_cli("import", "llm-in-sandbox", str(folder), "-w", str(wh))
    assert res.exit_code == 2 and "trajectory.json: not valid JSON" in res.output
    (folder / "trajectory.json").write_text("[1, 2]")
    res = run_cli("import", "llm-in-sandbox", str(folder), "-w", str(wh))
    assert res.exit_code == 2 and "trajectory.json: expected an object of problem id -> result" in res.output
    res = run_cli("import", "llm-in-sandbox", str(tmp_path / "wh-nothing"), "-w", str(wh))
    assert res.exit_code == 2 and "is not a folder" in res.output
    (tmp_path / "empty").mkdir()
    res = run_cli("import", "llm-in-sandbox", str(tmp_path / "empty"), "-w", str(wh))
    assert res.exit_code == 2 and "holds no llm-in-sandbox output" in res.output


def test_size_limit_is_checked_before_reading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import interop.peer_import as peer_import

    folder = peer_folder(tmp_path, {"p0": peer_problem()})
    monkeypatch.setattr(peer_import, "MAX_TRAJECTORY_BYTES", 100)
    res = run_cli("import", "llm-in-sandbox", str(folder), "-w", str(tmp_path / "wh"))
    assert res.exit_code == 2 and "is over the limit of 100 bytes" in res.output


def test_hostile_problem_ids_never_reach_outside_files(tmp_path: Path) -> None:
    """A problem id names its log file: only a plain name inside logs/ is ever opened, so
    `../x` or a symlinked log cannot make the importer read another file (here: one whose
    ERROR line would turn the episode into an infrastructure failure)."""
    outside = tmp_path / "outside.txt"
    outside.write_text("Problem ID: x\nERROR: read from outside the folder\n")
    folder = peer_folder(tmp_path, {"../../outside": peer_problem(), "p/../../outside": peer_problem(), "plink": peer_problem(), "perr": peer_problem(answer="")})
    (folder / "logs" / "plink.txt").symlink_to(outside)
    (folder / "logs" / "perr.txt").write_text("Problem ID: perr\nERROR: litellm.APIConnectionError: refused\nGround Truth: 42\n")
    wh = tmp_path / "wh"
    res = run_cli("import", "llm-in-sandbox", str(folder), "--run-id", "hostile", "-w", str(wh))
    assert res.exit_code == 0, res.output
    from warehouse import Warehouse

    data = Warehouse(wh).load_run("hostile")
    by_task = {e.task_id: e for e in data.episodes}
    for pid in ("../../outside", "p/../../outside", "plink"):
        assert by_task[pid].termination == "submitted" and by_task[pid].error is None
        assert data.scores[by_task[pid].episode_id].score == 1.0
    assert by_task["perr"].termination == "model_error" and "APIConnectionError" in (by_task["perr"].error or "")
    assert by_task["perr"].episode_id not in data.scores  # infrastructure: never graded
    # the hostile ids export to files inside the output folder only
    out = tmp_path / "atif"
    res = run_cli("export", "atif", "hostile", "-o", str(out), "-w", str(wh))
    assert res.exit_code == 0, res.output
    assert len(list(out.iterdir())) == 4 and not (tmp_path / "outside.json").exists()
    res = run_cli("export", "inspect", "hostile", "-o", str(tmp_path / "logs"), "-w", str(wh))
    assert res.exit_code == 0, res.output
    from inspect_ai.log import read_eval_log

    log = read_eval_log(str(tmp_path / "logs" / "hostile_sandbox.eval"))
    assert sorted(s.id for s in log.samples) == sorted(by_task)


# ------------------------------------------------------------------ host files stay outside
def test_links_out_of_the_folder_are_refused_not_followed(tmp_path: Path) -> None:
    """`trajectory.json -> /etc/passwd`, a `results.json` linked to a file outside (whose
    text went into runs.config), a run folder that is a symlink to one outside: each is
    refused in one sentence naming where it leads, before anything is written. A link
    that stays inside the folder is read, as everywhere in sandflow."""
    wh = tmp_path / "wh"
    folder = peer_folder(tmp_path / "a", {"p0": peer_problem()})
    (folder / "trajectory.json").unlink()
    (folder / "trajectory.json").symlink_to("/etc/passwd")
    res = run_cli("import", "llm-in-sandbox", str(folder), "-w", str(wh))
    assert res.exit_code == 2, res.output
    assert "trajectory.json" in res.output and "leads to '/etc/passwd'" in res.output and "outside" in res.output
    assert not wh.exists()

    outside = tmp_path / "secret-results.json"
    outside.write_text(json.dumps({"config": {"mode": "llm-in-sandbox", "llm_name": "SECRET-FROM-OUTSIDE"}, "task": "math"}))
    folder = peer_folder(tmp_path / "b", {"p0": peer_problem()})
    (folder / "results.json").unlink()
    (folder / "results.json").symlink_to(outside)
    res = run_cli("import", "llm-in-sandbox", str(folder), "-w", str(wh))
    assert res.exit_code == 2, res.output
    assert "results.json" in res.output and str(outside) in res.output and "SECRET" not in res.output
    assert not wh.exists()

    elsewhere = peer_folder(tmp_path / "elsewhere", {"p0": peer_problem()})
    parent = tmp_path / "c"
    parent.mkdir()
    (parent / "20261126_000000_math_x_LLMinSandbox").symlink_to(elsewhere)
    res = run_cli("import", "llm-in-sandbox", str(parent), "-w", str(wh))
    assert res.exit_code == 2, res.output
    assert "is a symlink to" in res.output and str(elsewhere) in res.output
    assert not wh.exists()

    # inside the folder, a link is read as the file it names
    folder = peer_folder(tmp_path / "d", {"p0": peer_problem(), "p1": peer_problem(answer="41")})
    (folder / "data").mkdir()
    (folder / "trajectory.json").rename(folder / "data" / "t.json")
    (folder / "trajectory.json").symlink_to("data/t.json")
    res = run_cli("import", "llm-in-sandbox", str(folder), "--run-id", "linked-inside", "-w", str(wh))
    assert res.exit_code == 0, res.output
    assert "-> 2 episodes of run linked-inside" in res.output


def _big_problem(n_steps: int, obs_bytes: int) -> dict[str, Any]:
    step = {"thought": "look", "action": {"function": "execute_bash", "parameters": {"command": "cat big"}}, "observation": "x" * obs_bytes, "metadata": {"exec_time": 0.1}}
    return {**peer_problem(), "trajectory": [step] * n_steps + peer_problem()["trajectory"]}


def test_a_problem_over_the_parse_bound_is_refused_while_parsing(tmp_path: Path) -> None:
    """One problem of ~40 KB of JSON against a bound of 16 KB (set through the parameter,
    as `--max-problem-bytes` does): refused naming the problem's place and the bound,
    nothing written; the same file imports under a bound it fits."""
    folder = peer_folder(tmp_path, {"p0": peer_problem(), "p1": _big_problem(10, 4000), "p2": peer_problem()})
    wh = tmp_path / "wh"
    res = run_cli("import", "llm-in-sandbox", str(folder), "--max-problem-bytes", "16384", "-w", str(wh))
    assert res.exit_code == 2, res.output
    assert "problem 2 (after 'p0') is over the limit of 16384 bytes of JSON per problem" in res.output
    assert "--max-problem-bytes" in res.output and not wh.exists()
    res = run_cli("import", "llm-in-sandbox", str(folder), "--max-problem-bytes", "65536", "--run-id", "fits", "-w", str(wh))
    assert res.exit_code == 0 and "-> 3 episodes of run fits" in res.output, res.output


def test_a_problem_nested_too_deep_is_refused_while_parsing(tmp_path: Path) -> None:
    """`[[[[...` 5,000 levels deep in one problem's step (10 KB): one sentence naming
    the problem and the depth bound, nothing written (ijson's own builder took gigabytes
    on 4 MB of it and was killed; `json.loads` raised RecursionError, a traceback)."""
    folder = peer_folder(tmp_path, {"p0": peer_problem()})
    deep = b"[" * 5_000 + b"]" * 5_000
    (folder / "trajectory.json").write_bytes(b'{"p0": {"problem_statement": "x", "trajectory": [{"action": ' + deep + b"}]}}")
    wh = tmp_path / "wh"
    res = run_cli("import", "llm-in-sandbox", str(folder), "-w", str(wh))
    assert res.exit_code == 2, res.output
    assert "problem 1 ('p0') is nested more than 100 levels deep" in res.output and "Traceback" not in res.output
    assert not wh.exists()


def test_parsing_memory_is_bounded_by_a_problem_not_by_the_file(tmp_path: Path) -> None:
    """A 6 MB trajectory of 150 problems of ~40 KB: checking it (the whole first pass)
    allocates at most a few problems' worth of Python objects, not the file's (one
    `json.loads` of the file allocated more than the file's size); importing it holds
    one problem at a time as well."""
    import tracemalloc

    from interop.peer_import import import_peer, read_run

    warm = peer_folder(tmp_path / "warm", {"p0": _big_problem(10, 4000)})  # modules imported once,
    import_peer(tmp_path / "warm-wh", warm, run_id="warm")  # so their memory is not counted
    problems = {f"p{i}": _big_problem(10, 4000) for i in range(150)}
    folder = peer_folder(tmp_path / "big", problems)
    size = (folder / "trajectory.json").stat().st_size
    assert size > 6_000_000
    tracemalloc.start()
    try:
        run = read_run(folder)
        _cur, peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        summary = import_peer(tmp_path / "wh", folder, run_id="big")
        _cur, import_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(run.problems) == 150 and summary.episodes == 150
    assert peak < size / 10, (peak, size)  # measured: 0.32 MB for the 6.3 MB file (json.loads: 13.9 MB)
    assert import_peak < size / 2, (import_peak, size)
