"""Forking a live sandbox (issue #25) against the sandbox's own copy of the same files.

    .venv/bin/python benchmarks/fork.py [--rounds 15] [--fresh-rounds 5] [--no-bwrap]
                                        [--no-volumes | --volumes PATH]
                                        [--no-replay | --replay-only] [--no-tree | --tree-only]
                                        [--tree-at-once N]

The parent holds 10 MB in 1,000 files (100 folders) plus a shaped shell (exported and
plain variables, arrays, functions, aliases, options, umask, ulimits, cwd). Figures (p50s):
  fork        parent.fork(1, children=[c]) into a started sandbox (a pool's reset one)
              goal <= 50 ms (docker), <= 20 ms (bwrap); bwrap twice: with its tmpfs
              places (fork by pipes: `_bwrap`) and with copy-on-write btrfs volumes
              (fork by snapshot: `_bwrap_volumes`; sandbox/volumes.py), on a btrfs the
              benchmark makes on /dev/shm (root and mkfs.btrfs; --volumes PATH: one
              already mounted, e.g. `scripts/setup.sh --volumes`'s)
  fork_fresh  parent.fork(1): the child's start included (no goal; start is benchmarks/sandbox.py's)
  floor       `cp -a` of the same places inside the parent (the copy the kernel alone does)
  extract     GNU tar -x of the same files from an archive already made, inside the parent,
              timed inside (no round trip): what making the child's files alone costs,
              the part of a fork no streaming saves (fork_floor_extract_p50_ms)
  replay      a deterministic recorded episode (8 turns of state-building commands whose
              output holds what legitimately varies: dates, temp names, pids, timings)
              replayed to its last turn by `sandflow run --replay`'s library path:
              replay_divergences goal 0 (replay_figures(), its own function)
  tree        leaves per second of a width-4 tree branched at mid-episode (rollout server,
              request.branching) over 4 independent episodes of the same length, scripted
              model, one episode at a time: tree_speedup goal >= 1.5 (tree_figures());
              --tree-at-once N: the tree again with N episodes at once (siblings together)
The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sandbox import SandboxConfig, SandboxLimits, open_sandbox  # noqa: E402
from sandbox import settings as sandbox_settings  # noqa: E402
from sandbox import volumes as sandbox_volumes  # noqa: E402

SHAPE = r"""
for d in $(seq 100); do mkdir -p /testbed/pkg$d
  for f in $(seq 10); do head -c 10240 /dev/urandom > /testbed/pkg$d/m$f.py; done
done
cd /testbed/pkg7 && export PROJECT=demo PATH=/testbed/bin:$PATH && umask 027
build_dir=/tmp/out; declare -a targets=(a b c); f() { echo "$@"; }; alias t='pytest -q'
set -o pipefail; shopt -s globstar; ulimit -S -n 512; true
"""
GOAL_MS = {"docker": 50.0, "bwrap": 20.0, "bwrap_volumes": 20.0}
# the files made from an archive at hand, as a fork's child does (umask 0, -p, 64 KiB
# records), timed inside the sandbox: nanoseconds on stdout
EXTRACT = (
    "mkdir /tmp/x && s=$(date +%s%N) && (umask 0; tar -x -p -b 128 --no-same-owner "
    "--delay-directory-restore -f /tmp/floor.tar -C /tmp/x) && e=$(date +%s%N) && "
    "rm -rf /tmp/x && echo $((e - s))"
)


def _open(config: SandboxConfig) -> Any:
    """open_sandbox() typed as what it returns here (a HelperSandbox: fork, reset, copy_limits)."""
    return open_sandbox(config)


def p50(xs: list[float]) -> float:
    return statistics.median(xs) * 1000.0


@contextlib.contextmanager
def _volumes(path: str | None) -> Iterator[Path]:
    """bwrap sandboxes opened meanwhile keep their places on btrfs volumes at `path` (or
    on a scratch btrfs made for the benchmark)."""
    with contextlib.ExitStack() as stack:
        root = Path(path) if path else stack.enter_context(sandbox_volumes.scratch_filesystem(4))
        previous = sandbox_settings.configure(bwrap_volumes=root)
        stack.callback(sandbox_settings.configure, previous)
        yield root


def bench(backend: str, rounds: int, fresh_rounds: int) -> dict[str, Any]:
    config = SandboxConfig(
        backend=backend,
        run_id="bench-fork",
        limits=SandboxLimits(memory_mb=1024, tmp_size_mb=256),
    )
    with _open(config) as parent, _open(config) as child:
        r = parent.exec(SHAPE, timeout=120)
        assert r.exit_code == 0, r.stderr
        check = parent.exec("du -sb /testbed | cut -f1; find /testbed -type f | wc -l").stdout
        forks: list[float] = []
        floors: list[float] = []
        for _ in range(rounds):
            assert child.reset() == [], "the child's reset failed"
            t0 = time.perf_counter()
            parent.fork(1, children=[child])
            forks.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            parent.exec("cp -a /testbed /tmp/copy && rm -rf /tmp/copy")
            floors.append(time.perf_counter() - t0)
        seen = child.exec("du -sb /testbed | cut -f1; find /testbed -type f | wc -l").stdout
        assert seen == check, (seen, check)
        parent.exec("tar -c -b 128 -f /tmp/floor.tar -C / testbed")
        extracts = []
        for _ in range(rounds):
            r = parent.exec(EXTRACT)
            assert r.exit_code == 0, r.stderr
            extracts.append(int(r.stdout) / 1e9)
        parent.exec("rm -f /tmp/floor.tar")
        fresh: list[float] = []
        for _ in range(fresh_rounds):
            t0 = time.perf_counter()
            (c,) = parent.fork(1)
            fresh.append(time.perf_counter() - t0)
            c.close()
    size, files = check.split()
    return {
        "p50_ms": p50(forks),
        "fresh_p50_ms": p50(fresh),
        "floor_p50_ms": p50(floors),
        "extract_p50_ms": p50(extracts),
        "bytes": int(size),
        "files": int(files),
    }


# ---------------------------------------------------------------- replay (tasks/replay.py)
REPLAY_STEPS = [
    "mkdir -p /testbed/work && cd /testbed/work && export RUN=demo && umask 027",
    "seq 1 2000 > numbers.txt && wc -l numbers.txt && mktemp",
    "python3 -c 'import time; t=time.time(); print(sum(range(10**6)), t)' && date",
    "echo pid $$ && ls -la --time-style=+%s . | awk '{print $1, $NF}'",
    "f() { echo got:$1; }; f $RUN; printf 'a\\nb\\n' > two.txt; cat -n two.txt",
    "time (sort -r numbers.txt | head -3)",
    "python3 -c 'import tempfile; print(tempfile.mkdtemp())' | sed 's/[0-9a-z_]*$/X/'; pwd",
    "sha256sum numbers.txt two.txt && echo $RUN && umask",
]


def replay_figures(backend: str = "docker") -> dict[str, Any]:
    """Record a deterministic 9-turn episode (scripted model over real HTTP, a sandbox of
    `backend`, a real warehouse), then replay its 8 tool turns in a fresh sandbox and count
    divergences. Keys get the suffix `_bwrap` for that backend."""
    import tempfile

    from datasets_prep.task import make_task
    from engine.replay import plan_replay
    from tasks.loop import Limits, run_episode
    from tasks.model import ModelConfig
    from tasks.records import NullRecorder
    from tasks.replay import replay_episode
    from tests.scripted_model import ScriptedModel, tool_reply
    from warehouse import Warehouse

    task = make_task({"id": "replay-bench", "domain": "math", "problem_statement": "Build it.",
                      "ground_truth": "1", "input_files": {"seed.txt": "7\n"}}, "bench")  # fmt: skip
    sb = SandboxConfig(backend=backend, run_id="bench-replay", limits=SandboxLimits(network="none"))
    with tempfile.TemporaryDirectory(prefix="sandflow-bench-") as tmp, ScriptedModel() as server:
        cfg = ModelConfig(model="scripted", base_url=server.url, max_retries=1)
        server.push(*[tool_reply("execute_bash", {"command": c}) for c in REPLAY_STEPS],
                    tool_reply("submit", {}))  # fmt: skip
        wh = Warehouse(tmp)
        wh.write_run("bench-parent", model="scripted", status="running")
        wh.keep_tasks("bench-parent", [task])
        t0 = time.perf_counter()
        with wh.writer(durability="flush") as w:
            parent = run_episode(task, cfg, sb, w, run_id="bench-parent", limits=Limits(max_steps=12))
        parent_s = time.perf_counter() - t0
        assert parent.record.termination == "submitted", parent.record
        k = len(REPLAY_STEPS)
        plan = plan_replay(tmp, f"bench-parent/{parent.record.episode_id}", k)
        server.push(tool_reply("submit", {}))
        t0 = time.perf_counter()
        played = replay_episode(plan.task, plan.parent, plan.turns, k, cfg, sb, NullRecorder(),
                                run_id="bench-replay", allow_divergence=True)  # fmt: skip
        replay_s = time.perf_counter() - t0
    check = played.check
    for d in check.divergences:
        print(d.describe())
    print(f"{backend:6} replay {k} turns, {check.calls} calls re-run in {replay_s:.2f} s (the parent took "
          f"{parent_s:.2f} s): {check.total} divergence(s) (goal 0)")
    sfx = "" if backend == "docker" else f"_{backend}"
    return {f"replay_divergences{sfx}": check.total, f"replay_calls{sfx}": check.calls,
            f"replay_turns{sfx}": k, f"replay_s{sfx}": replay_s, f"replay_parent_s{sfx}": parent_s,
            f"replay_pass{sfx}": check.total == 0}


TREE_TURNS = 11  # tool turns per leaf, then submit: 12 turns; the tree branches at turn 6
TREE_WIDTH = 4
TREE_THINK_S = 0.15  # the scripted model's time per reply (a real policy takes seconds)
TREE_STEP = "python3 -c 'print(sum(i*i for i in range(200000)))' >> /testbed/work.log"


def tree_figures(at_once: int = 0) -> dict[str, Any]:
    """Leaves per second of a width-4 tree branched at mid-episode against 4 independent
    episodes of the same length: one rollout server (real HTTP, Docker with its warm pool,
    a warehouse), the scripted model, one episode at a time (what a saturated server
    sees). Independent, tree, independent, tree: the better of each pair counts (the
    pool warm for both). `at_once` > 1: then the tree twice more with that many episodes
    allowed at once (its siblings run together): `tree_at_once_speedup` over the tree
    run one episode at a time."""
    import tempfile
    import threading

    import uvicorn

    from rl.client import RolloutClient
    from rl.server import ServerConfig, create_app
    from tasks.loop import Limits
    from tests.scripted_model import Reply, ScriptedModel, tool_reply

    def policy(body: dict, index: int) -> Reply:
        done = sum(1 for m in body["messages"] if m.get("role") == "assistant")
        if done < TREE_TURNS:
            reply = tool_reply("execute_bash", {"command": TREE_STEP}, content=f"Step {done}.")
        else:
            reply = tool_reply("submit", {"answer": "1"})
        reply.delay_s = TREE_THINK_S
        return reply

    task = {"id": "tree-bench", "domain": "math", "problem_statement": "Work, then answer 1.",
            "ground_truth": "1", "verifier": "exact", "qa_type": "exact"}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="sandflow-bench-") as tmp, ScriptedModel(
        default=policy
    ) as model:
        cfg = ServerConfig(
            warehouse=Path(tmp), max_concurrency=max(1, at_once), durability="flush",
            sandbox=SandboxConfig(run_id="bench-tree", reuse="pool",
                                  limits=SandboxLimits(network="none")),
            limits=Limits(max_steps=TREE_TURNS + 2, wall_clock_s=600),
        )  # fmt: skip
        srv = uvicorn.Server(uvicorn.Config(create_app(cfg), host="127.0.0.1", port=0,
                                            log_level="warning"))  # fmt: skip
        thread = threading.Thread(target=srv.run, daemon=True)
        thread.start()
        while not srv.started:
            time.sleep(0.02)
        url = f"http://127.0.0.1:{srv.servers[0].sockets[0].getsockname()[1]}"
        base = {"tasks": [task], "endpoint": {"base_url": model.url, "model": "scripted"},
                "sampling": {"max_tokens": 64}, "max_concurrency": 1}  # fmt: skip
        branching = {"width": TREE_WIDTH, "at_turns": [(TREE_TURNS + 1) // 2]}
        walls = {}
        with RolloutClient(url) as client:
            plain, tree = ("independent", {"n": TREE_WIDTH}), ("tree", {"n": 1, "branching": branching})
            runs = [plain, tree, plain, tree]
            if at_once > 1:
                runs += [("tree_at_once", {"n": 1, "branching": branching, "max_concurrency": at_once})] * 2
            for i, (name, extra) in enumerate(runs):
                t0 = time.perf_counter()
                r = client.rollouts({**base, **extra, "run_id": f"bench-tree-{name}-{i}"})
                walls[name] = min(walls.get(name, 1e9), time.perf_counter() - t0)
                assert r.summary["ok"] == TREE_WIDTH, r.summary
                assert all(t["num_turns"] == TREE_TURNS + 1 for t in r.trajectories)
        srv.should_exit = True
        thread.join(30)
    lps = {k: TREE_WIDTH / v for k, v in walls.items()}
    speedup = lps["tree"] / lps["independent"]
    print(f"tree    width {TREE_WIDTH} branched at turn {(TREE_TURNS + 1) // 2} of {TREE_TURNS + 1}: "
          f"{lps['tree']:.3f} leaves/s vs {lps['independent']:.3f} for {TREE_WIDTH} independent "
          f"episodes: tree_speedup {speedup:.2f}x (goal >= 1.5)")  # fmt: skip
    out = {"tree_speedup": speedup, "tree_leaves_per_s": lps["tree"],
           "independent_leaves_per_s": lps["independent"], "tree_pass": speedup >= 1.5}  # fmt: skip
    if at_once > 1:
        at = lps["tree_at_once"] / lps["tree"]
        print(f"tree    the same tree with {at_once} episodes at once (siblings together): "
              f"{lps['tree_at_once']:.3f} leaves/s, {at:.2f}x the tree run one at a time")  # fmt: skip
        out |= {"tree_at_once": at_once, "tree_at_once_leaves_per_s": lps["tree_at_once"],
                "tree_at_once_speedup": at}  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--fresh-rounds", type=int, default=5)
    ap.add_argument("--no-bwrap", action="store_true")
    ap.add_argument("--no-volumes", action="store_true", help="skip bwrap on btrfs volumes")
    ap.add_argument("--volumes", metavar="PATH", help="a btrfs mount for bwrap's volumes")
    ap.add_argument("--no-replay", action="store_true", help="skip the replay figures")
    ap.add_argument("--replay-only", action="store_true", help="only the replay figures")
    ap.add_argument("--no-tree", action="store_true", help="skip the tree figure")
    ap.add_argument("--tree-only", action="store_true", help="only the tree figure")
    ap.add_argument("--tree-at-once", type=int, default=0, metavar="N",
                    help="also run the tree with N episodes allowed at once (its siblings together)")
    args = ap.parse_args()
    fig: dict[str, Any] = {"benchmark": "fork"}
    only = args.replay_only or args.tree_only
    backends: tuple[str, ...] = () if only else ("docker",) if args.no_bwrap else ("docker", "bwrap")
    can_volumes = os.geteuid() == 0 and (args.volumes or shutil.which("mkfs.btrfs"))
    if "bwrap" in backends and not args.no_volumes:
        if can_volumes:
            backends += ("bwrap_volumes",)
        else:
            print("bwrap volumes: skipped (needs root and mkfs.btrfs: apt-get install btrfs-progs)")
    for backend in backends:
        with _volumes(args.volumes) if backend == "bwrap_volumes" else contextlib.nullcontext():
            r = bench(backend.split("_")[0], args.rounds, args.fresh_rounds)
        sfx = "" if backend == "docker" else f"_{backend}"
        fig[f"fork_p50_ms{sfx}"] = r["p50_ms"]
        fig[f"fork_fresh_p50_ms{sfx}"] = r["fresh_p50_ms"]
        fig[f"fork_floor_cp_p50_ms{sfx}"] = r["floor_p50_ms"]
        fig[f"fork_over_floor{sfx}"] = r["p50_ms"] / r["floor_p50_ms"]
        fig[f"fork_floor_extract_p50_ms{sfx}"] = r["extract_p50_ms"]
        fig[f"fork_goal_ms{sfx}"] = GOAL_MS[backend]
        fig[f"fork_pass{sfx}"] = r["p50_ms"] <= GOAL_MS[backend]
        fig["bytes"], fig["files"] = r["bytes"], r["files"]
        print(
            f"{backend:13} fork {r['p50_ms']:7.1f} ms (goal <= {GOAL_MS[backend]:.0f})  "
            f"with the child's start {r['fresh_p50_ms']:7.1f} ms  "
            f"floor cp -a {r['floor_p50_ms']:6.1f} ms  ratio {r['p50_ms'] / r['floor_p50_ms']:.2f}x  "
            f"extract alone {r['extract_p50_ms']:6.1f} ms  "
            f"({r['bytes']} bytes, {r['files']} files)"
        )
    if not (args.no_replay or args.tree_only):
        for backend in ("docker",) if args.no_bwrap else ("docker", "bwrap"):
            fig.update(replay_figures(backend))
    if not (args.no_tree or args.replay_only):
        fig.update(tree_figures(args.tree_at_once))
    print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in fig.items()}))


if __name__ == "__main__":
    main()
