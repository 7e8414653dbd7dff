"""Replay (issue #25): `sandflow run --replay RUN/EPISODE --until-turn K` rebuilds a recorded
episode's sandbox by re-running its tool calls in a fresh one, checks every observation
against the recording, and lets another model go on from the recorded messages.

Real parts: the Docker engine, the warehouse (Parquet + DuckDB), the scripted model over
real HTTP, the CLI through typer's runner. The parent's commands leave state of every kind
a replay must rebuild (a file, an exported variable, the working directory) and print
what legitimately varies (a mktemp name, the date, a pid, `time`'s durations)."""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sandflow.cli import app
from tasks.records import Observation
from tasks.replay import Divergence, compare, mask
from tests.scripted_model import ScriptedModel, text_reply, tool_reply
from warehouse import Warehouse

runner = CliRunner()

# The parent: state of each kind, and output that varies from run to run.
PARENT = [
    tool_reply("execute_bash", {"command": (
        "mkdir -p /testbed/work && cd /testbed/work && cp ../documents/numbers.txt . && "
        "export FOO=bar && echo x=1 > state.txt && mktemp && date && echo pid $$ && "
        "python3 -c 'import time; print(time.time())'"
    )}, content="Setting up."),  # fmt: skip
    tool_reply("execute_bash", {"command": "cat state.txt numbers.txt; echo $FOO; pwd; time true"}),
    text_reply("Thinking."),  # no tool call: the loop's nudge follows
    tool_reply("execute_bash", {"command": "echo x=2 > state.txt && cat state.txt"}),
    tool_reply("submit", {}),
]


def _flat(text: str) -> str:
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", text).split())


def _record_parent(model: ScriptedModel, tmp_path: Path, script: list | None = None) -> tuple[Path, str, str]:
    """A parent recorded as runs record episodes: its task kept with the run (a task's
    files are part of the state), every turn in the warehouse."""
    from datasets_prep.task import make_task
    from tasks.loop import Limits, run_episode
    from tests.tasks.conftest import fast_model, sandbox_config

    task = make_task({"id": "count", "domain": "math", "problem_statement": "Count the numbers.",
                      "ground_truth": "3", "input_files": {"numbers.txt": "1 2 3\n"}}, "test")  # fmt: skip
    model.models = ["scripted", "other-model"]  # the replay continues with another model
    model.push(*(PARENT if script is None else script))
    wh = tmp_path / "wh"
    store = Warehouse(wh)
    run_id = f"parent-{uuid.uuid4().hex[:8]}"
    store.write_run(run_id, model="scripted", status="running")
    store.keep_tasks(run_id, [task])
    with store.writer(durability="flush") as w:
        result = run_episode(task, fast_model(model), sandbox_config(), w, run_id=run_id,
                             limits=Limits(max_steps=8))  # fmt: skip
    store.finish_run(run_id, status="finished")
    assert result.record.termination == "submitted", result.record
    return wh, run_id, result.record.episode_id


def _record_parent_cli(model: ScriptedModel, tmp_path: Path, script: list) -> tuple[Path, str, str]:
    """A parent recorded by `sandflow run -q ... -i DIR --warehouse` (an ad-hoc task: no
    ground truth; the run keeps it for a replay)."""
    inputs = tmp_path / "in"
    inputs.mkdir(exist_ok=True)
    (inputs / "numbers.txt").write_text("1 2 3\n")
    model.models = ["scripted", "other-model"]
    model.push(*script)
    wh = tmp_path / "wh"
    res = runner.invoke(app, ["run", "-q", "Count the numbers", "-u", model.url, "-i", str(inputs),
                              "-o", str(tmp_path / "runs"), "--warehouse", str(wh), "--quiet"])  # fmt: skip
    assert res.exit_code == 0, res.output
    (ep,) = Warehouse(wh).episodes().to_pylist()
    return wh, ep["run_id"], ep["episode_id"]


def _replay(model: ScriptedModel, wh: Path, source: str, k: int, *more: str):  # type: ignore[no-untyped-def]
    return runner.invoke(app, ["run", "--replay", source, "--until-turn", str(k), "-u", model.url,
                               "-m", "other-model", "-o", str(wh.parent / "replays"),
                               "--warehouse", str(wh), "--quiet", *more])  # fmt: skip


@pytest.mark.docker
def test_replay_rebuilds_the_state_and_a_new_model_goes_on(
    scripted_model: ScriptedModel, tmp_path: Path
) -> None:
    wh, run_id, parent_id = _record_parent(scripted_model, tmp_path)
    parent_requests = list(scripted_model.requests)
    scripted_model.requests.clear()
    scripted_model.push(
        tool_reply("execute_bash", {"command": "cat state.txt; echo FOO=$FOO; pwd"}),
        tool_reply("submit", {"answer": "3"}),
    )
    res = _replay(scripted_model, wh, f"{run_id}/{parent_id}", 3)
    assert res.exit_code == 0, res.output
    assert "replayed 2 tool call(s) of turns < 3" in _flat(res.output) and "0 divergence(s)" in res.output

    # the model goes on from the recorded messages: turn 3's request of the parent, exactly
    first = scripted_model.requests[0]
    assert first["model"] == "other-model"
    assert first["messages"] == parent_requests[3]["messages"]
    # the state was rebuilt: the file, the exported variable, the working directory
    second = scripted_model.requests[1]["messages"][-1]["content"]
    assert "x=1" in second and "FOO=bar" in second and "/testbed/work" in second

    store = Warehouse(wh)
    eps = {e["episode_id"]: e for e in store.episodes().to_pylist()}
    (child,) = [e for e in eps.values() if e["episode_id"] != parent_id]
    assert (child["parent_run_id"], child["parent_episode_id"], child["branch_turn"], child["branch_kind"]) == (
        run_id, parent_id, 3, "replay")
    assert child["model"] == "other-model" and child["answer"] == "3" and child["num_turns"] == 5
    turns = store.turns(child["run_id"]).to_pylist()
    assert [t["turn_index"] for t in turns] == [0, 1, 2, 3, 4]
    parent_turns = store.turns(run_id).to_pylist()
    assert [t["assistant_content"] for t in turns[:3]] == [t["assistant_content"] for t in parent_turns[:3]]
    with store.query() as q:
        tree = q.rows(
            "SELECT episode_id, root_episode_id, depth, branch_turn, branch_kind, children "
            "FROM episode_tree ORDER BY depth"
        )
    assert tree == [(parent_id, parent_id, 0, None, None, 1), (child["episode_id"], parent_id, 1, 3, "replay", 0)]


@pytest.mark.docker
def test_a_planted_divergence_is_caught_and_nothing_is_recorded(
    scripted_model: ScriptedModel, tmp_path: Path
) -> None:
    planted = [
        tool_reply("execute_bash", {"command": "cat documents/numbers.txt; head -c 6 /dev/urandom | od -An -tx1"}),
        tool_reply("submit", {}),
    ]
    wh, run_id, parent_id = _record_parent_cli(scripted_model, tmp_path, planted)
    scripted_model.requests.clear()
    res = _replay(scripted_model, wh, f"{run_id}/{parent_id}", 1)
    assert res.exit_code == 1, res.output
    out = _flat(res.output)
    assert "the replay diverged 1 time(s)" in out
    assert "turn 0, call 0 (execute_bash): the output differs (- recorded, + replayed)" in out
    lines = res.output.splitlines()
    assert len([x for x in lines if re.fullmatch(r"-( [0-9a-f]{2}){6}", x)]) == 1  # recorded
    assert len([x for x in lines if re.fullmatch(r"\+( [0-9a-f]{2}){6}", x)]) == 1  # replayed
    assert scripted_model.requests == []  # stopped before any model call
    assert len(Warehouse(wh).episodes().to_pylist()) == 1  # no replay episode recorded
    from warehouse.query import connect

    with connect(wh) as q:  # the replay's own run ended `failed` (engine.run.RunHandle)
        assert q.rows(f"SELECT status, notes FROM runs WHERE run_id != '{run_id}'") == [
            ("failed", "1 episodes failed")
        ]

    # the caller's rule masks it: then it goes on
    scripted_model.push(tool_reply("submit", {}))
    res = _replay(scripted_model, wh, f"{run_id}/{parent_id}", 1, "--replay-ignore", r"( [0-9a-f]{2}){6}")
    assert res.exit_code == 0, res.output
    assert "0 divergence(s)" in res.output


def test_bad_replay_input_is_one_sentence(scripted_model: ScriptedModel, tmp_path: Path) -> None:
    wh = tmp_path / "wh"
    res = runner.invoke(app, ["run", "--replay", "no-slash", "--until-turn", "1", "--warehouse", str(wh)])
    assert res.exit_code == 2 and "is not RUN/EPISODE" in _flat(res.output)
    res = runner.invoke(app, ["run", "--replay", "r/e", "--warehouse", str(wh)])
    assert res.exit_code == 2 and "--replay needs --until-turn K" in _flat(res.output)
    res = runner.invoke(app, ["run", "--replay", "r/e", "--until-turn", "1", "-q", "x"])
    assert res.exit_code == 2 and "drop --query" in _flat(res.output)
    res = runner.invoke(app, ["run", "--until-turn", "1", "-q", "x"])
    assert res.exit_code == 2 and "go with --replay" in _flat(res.output)
    res = runner.invoke(app, ["run", "--replay", "r1/e1", "--until-turn", "1", "-u", scripted_model.url,
                              "--warehouse", str(wh)])  # fmt: skip
    assert res.exit_code == 2 and "has no episode e1 in run r1" in _flat(res.output)


def test_the_rule_masks_what_varies_and_nothing_else() -> None:
    # each side's epoch seconds are near its own clock (the recorded turn's, the replay's)
    t_a, t_b = 1795000000.0, 1795990000.0
    a = ("/tmp/tmp.AbCdEf1234\nThu Nov 26 06:30:18 UTC 2026\npid 4242\n1795000100.123\n"
         "real\t0m0.003s\ntook 12ms\ntook 2.5 s\n<object at 0x7f3a2b1c0d10>\n[1] 977\n")
    b = ("/tmp/tmp.ZzYyXx9876\nFri Nov 27 17:01:02 UTC 2026\npid 17\n1795989999.9\n"
         "real\t0m1.250s\ntook 3ms\ntook 0.7 s\n<object at 0x55aa00112233>\n[1] 12\n")
    assert mask(a, at=t_a) == mask(b, at=t_b)
    same = Observation(tool_call_id="c", name="execute_bash", content=a, exit_code=0, duration_s=0.1)
    assert compare(0, 0, same, same.model_copy(update={"content": b, "duration_s": 9.0}),
                   recorded_at=t_a, replayed_at=t_b) == []  # fmt: skip
    # a file's content, a count, an exit code: never masked
    for content, code in ((a.replace("pid 4242", "pid 4242 extra"), 0), (a, 1)):
        (d,) = compare(2, 1, same, same.model_copy(update={"content": content, "exit_code": code}),
                       recorded_at=t_a, replayed_at=t_a)  # fmt: skip
        assert isinstance(d, Divergence) and d.turn_index == 2 and d.call_index == 1
    long_a = "\n".join(f"line {i}" for i in range(500))
    (d,) = compare(0, 0, same.model_copy(update={"content": long_a}),
                   same.model_copy(update={"content": long_a.replace("line", "LINE")}))
    assert len(d.describe().splitlines()) <= 23  # bounded: 20 diff lines and a count
    # sandbox output is hostile: a terminal escape sequence is shown, never sent raw
    (d,) = compare(0, 0, same, same.model_copy(update={"content": "\x1b]0;pwned\x07\n"}))
    assert "\x1b" not in d.describe() and "\\x1b]0;pwned\\x07" in d.describe()


# Random values shaped like what the rule masks, without the context the rule names: data.
RANDOM_SHAPES = {
    "a bare 0x value": "print(hex(r.getrandbits(40) | 1 << 39))",
    "12 hex digits": "print(r.getrandbits(48).to_bytes(6, \"big\").hex())",
    "a 10-digit number": "print(r.randint(1_600_000_000, 1_999_999_999))",
    "process N": "print(\"process\", r.randint(10**6, 10**9))",
    "N s": "print(r.randint(10**6, 10**9), \"s\")",
}


def test_random_values_shaped_like_what_varies_are_not_masked() -> None:
    now = 1795000000.0
    for what, pair in {
        "a bare 0x value": ("0xa3f29c1b7d", "0x9b01c2d3e4"),
        "12 hex digits": ("3f2a9c1b7d4e", "0123456789ab"),
        "a 10-digit number": ("1712345678", "1887654321"),  # far from either side's clock
        "process N": ("process 4242", "process 17"),
        "N s": ("4242 s", "17 s"),
    }.items():
        assert mask(pair[0], at=now) != mask(pair[1], at=now), what


@pytest.mark.docker
def test_a_replay_compares_random_values_of_every_masked_shape(scripted_model: ScriptedModel) -> None:
    """A parent printing one random value of each shape per turn: the replay in a fresh
    docker sandbox finds every one of them different (before: all five passed as equal)."""
    from datasets_prep.task import make_task
    from tasks.loop import Limits, run_episode
    from tasks.records import NullRecorder
    from tasks.replay import ReplayDiverged, replay_episode
    from tests.tasks.conftest import fast_model, sandbox_config

    task = make_task({"id": "shapes", "domain": "math", "problem_statement": "Print things.",
                      "ground_truth": "3", "input_files": {}}, "test")  # fmt: skip
    script = [tool_reply("execute_bash", {"command": f"python3 -c 'import random as r; {code}'"})
              for code in RANDOM_SHAPES.values()]  # fmt: skip
    assert all("'" not in code for code in RANDOM_SHAPES.values())  # one shell word each
    scripted_model.push(*script, tool_reply("submit", {}))
    parent = run_episode(task, fast_model(scripted_model), sandbox_config(), NullRecorder(),
                         run_id="shapes-parent", limits=Limits(max_steps=8))  # fmt: skip
    assert parent.record.termination == "submitted", parent.record
    with pytest.raises(ReplayDiverged) as err:
        replay_episode(task, parent.record, parent.turns, len(script), fast_model(scripted_model),
                       sandbox_config(), NullRecorder(), run_id="shapes-replay")  # fmt: skip
    check = err.value.check
    assert sorted(d.turn_index for d in check.divergences) == list(range(len(script))), check.describe()


@pytest.mark.bwrap
def test_replay_on_bwrap_through_the_library(scripted_model: ScriptedModel, sandbox_rootfs: str) -> None:
    """The same rebuild on the bubblewrap backend, through tasks.replay directly: no
    divergence, the state rebuilt, the continuation recorded with its lineage."""
    from datasets_prep.task import make_task
    from tasks.loop import Limits, run_episode
    from tasks.records import NullRecorder
    from tasks.replay import replay_episode
    from tests.tasks.conftest import fast_model, sandbox_config

    task = make_task({"id": "count", "domain": "math", "problem_statement": "Count the numbers.",
                      "ground_truth": "3", "input_files": {"numbers.txt": "1 2 3\n"}}, "test")  # fmt: skip
    sb = sandbox_config().model_copy(update={"backend": "bwrap"})
    scripted_model.push(*PARENT)
    parent = run_episode(task, fast_model(scripted_model), sb, NullRecorder(), run_id="bw-parent",
                         limits=Limits(max_steps=8))  # fmt: skip
    assert parent.record.termination == "submitted", parent.record
    scripted_model.push(tool_reply("execute_bash", {"command": "cat state.txt; echo FOO=$FOO; pwd"}),
                        tool_reply("submit", {}))  # fmt: skip
    rec = NullRecorder()
    played = replay_episode(task, parent.record, parent.turns, 3, fast_model(scripted_model), sb, rec,
                            run_id="bw-replay")  # fmt: skip
    assert played.check.total == 0 and played.check.calls == 2, played.check.describe()
    out = played.result.turns[3].observations[0].content
    assert "x=1" in out and "FOO=bar" in out and "/testbed/work" in out
    (ep,) = rec.episodes
    assert (ep.parent_episode_id, ep.branch_turn, ep.branch_kind) == (parent.record.episode_id, 3, "replay")
    assert [t.turn_index for t in rec.turns] == [0, 1, 2, 3, 4] and ep.config["replay"]["divergences"] == 0
