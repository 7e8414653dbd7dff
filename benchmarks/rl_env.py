"""Benchmark: sandflow as an RL environment (rl/).

1. `step_overhead`: the step-wise environment's own cost per step, tool time excluded.
   A SandboxEnv on a real sandbox takes raw-text turns (one Hermes `<tool_call>` running
   `true`, with token ids and logprobs as a trainer passes them); per step, the time in
   `env.step` minus the tool's own time (the turn's tool_latency_s) is what the
   environment adds: parsing the turn, the loop's bookkeeping, recording the turn in the
   warehouse. Floor in the same run: a bare `sandbox.exec("true")` (what the tool itself
   costs, for scale). Target: step_overhead_p50_ms <= 5.
2. `concurrent_episodes`: the rollout server (in-process uvicorn, real HTTP) runs one
   batch of C episodes against an instant scripted model whose first reply waits until
   all C episodes have their sandbox open and have asked (a barrier), so all C are held
   at once; each then runs one command and submits. Levels C = 16, 32, ... are tried in
   order until one fails (an episode failed, or not all C were active together).
   `concurrent_episodes` is the largest level that held. Target: >= 256.

    .venv/bin/python benchmarks/rl_env.py [--steps 200] [--levels 16,32,64,128,256]
                                          [--backend docker|bwrap] [--barrier-s 240]

Ends with ONE JSON line (see benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from datasets_prep.task import Task  # noqa: E402
from rl.env import SandboxEnv  # noqa: E402
from rl.recording import RolloutTags  # noqa: E402
from sandbox.base import SandboxConfig, SandboxLimits  # noqa: E402
from tasks.loop import Limits  # noqa: E402
from tests.scripted_model import Fault, Reply, ScriptedModel, ToyTokenizer, tool_reply  # noqa: E402

TARGET_STEP_MS = 5.0
TARGET_CONCURRENT = 256
CALL = '<tool_call>\n{"name": "execute_bash", "arguments": {"command": "true"}}\n</tool_call>'


def _task(i: int = 0) -> Task:
    return Task(
        id=f"bench-{i}",
        domain="math",
        problem_statement="What is 6 * 7? Write only the number.",
        ground_truth="42",
        qa_type="exact",
        verifier="exact",
    )


def _p(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def step_overhead(steps: int, sandbox: SandboxConfig, root: Path) -> dict[str, Any]:
    tok = ToyTokenizer()
    env = SandboxEnv(
        sandbox=sandbox,
        limits=Limits(max_steps=steps + 5, wall_clock_s=3600),
        warehouse=root,
        tags=RolloutTags(training_run="bench", step=0, policy_version="v0"),
        durability="turn",
    )
    history = env.reset(_task())
    assert env.episode is not None and env.episode.sandbox is not None
    box = env.episode.sandbox
    floor = []
    for _ in range(50):
        t0 = time.perf_counter()
        box.exec("true")
        floor.append(time.perf_counter() - t0)
    total, tools = [], []
    for _ in range(steps):
        prompt = tok.render(history)
        completion = tok.completion(CALL, [])
        lps = [tok.logprob(t, i) for i, t in enumerate(completion)]
        t0 = time.perf_counter()
        out = env.step(CALL, prompt_token_ids=prompt, completion_token_ids=completion, logprobs=lps)
        total.append(time.perf_counter() - t0)
        tools.append(env.episode.turns[-1].tool_latency_s)
        history = [*history, {"role": "assistant", "content": CALL}, *out.observations]
        if out.done:
            raise RuntimeError(f"the benchmark episode ended early: {out.info}")
    env.close()
    own = env.step_overhead_s
    return {
        "step_overhead_p50_ms": round(_p(own, 0.5) * 1000, 3),
        "step_overhead_p90_ms": round(_p(own, 0.9) * 1000, 3),
        "step_total_p50_ms": round(_p(total, 0.5) * 1000, 3),
        "tool_p50_ms": round(_p(tools, 0.5) * 1000, 3),
        "exec_floor_p50_ms": round(_p(floor, 0.5) * 1000, 3),
        "steps": steps,
        "token_ids_status": env.episode.record.token_ids_status,
    }


def _serve(max_concurrency: int, sandbox: SandboxConfig) -> tuple[Any, threading.Thread, str]:
    import uvicorn

    from rl.server import ServerConfig, create_app

    cfg = ServerConfig(
        warehouse=None,
        max_concurrency=max_concurrency,
        sandbox=sandbox,
        limits=Limits(max_steps=5, wall_clock_s=1800),
    )
    srv = uvicorn.Server(
        uvicorn.Config(create_app(cfg), host="127.0.0.1", port=0, log_level="warning")
    )
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.02)
    port = srv.servers[0].sockets[0].getsockname()[1]
    return srv, thread, f"http://127.0.0.1:{port}"


def one_level(c: int, sandbox: SandboxConfig, barrier_s: float) -> dict[str, Any]:
    from rl.client import RolloutClient

    barrier = threading.Barrier(c, timeout=barrier_s)
    first_seen = threading.Event()
    released: list[float] = []

    def policy(body: dict, index: int) -> Reply | Fault:
        turns = sum(1 for m in body["messages"] if m.get("role") == "assistant")
        if turns == 0:
            first_seen.set()
            try:
                if barrier.wait() == 0:
                    released.append(time.monotonic())
            except threading.BrokenBarrierError:
                pass  # some episode never got this far: the level fails on peak < c
            return tool_reply("execute_bash", {"command": "echo 42 > /testbed/output/answer.txt"})
        return tool_reply("submit", {})

    srv, thread, url = _serve(c, sandbox)
    t0 = time.monotonic()
    try:
        with ScriptedModel(default=policy) as model, RolloutClient(url) as client:
            result = client.rollouts(
                {
                    "tasks": [_task(i).model_dump() for i in range(c // 8 or 1)],
                    "n": 8 if c >= 8 else c,
                    "endpoint": {"base_url": model.url, "model": "scripted", "max_retries": 0},
                    "sampling": {"logprobs": False, "return_token_ids": False},
                    "episode_attempts": 1,
                }
            )
    finally:
        srv.should_exit = True
        thread.join(120)
    s = result.summary
    failed = s.get("failed", 0) + s.get("cancelled", 0)
    rewards = [t["reward"] for t in result.trajectories]
    return {
        "level": c,
        "episodes": s.get("episodes"),
        "peak_concurrent": s.get("peak_concurrent"),
        "failed": failed,
        "all_rewarded": all(r == 1.0 for r in rewards) and len(rewards) == c,
        "all_active_after_s": round(released[0] - t0, 2) if released else None,
        "wall_s": round(time.monotonic() - t0, 2),
        "errors": _errors(result.trajectories),
    }


def _errors(trajectories: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every episode that did not end rewarded, grouped by status, termination and error
    text (whole, so a rare failure can be told apart in the JSON line), most frequent first."""
    counts = Counter(
        (t.get("status"), t.get("termination"), t.get("error") or "")
        for t in trajectories
        if t.get("status") != "ok" or t.get("reward") != 1.0 or t.get("error")
    )
    return [
        {"status": s, "termination": term, "error": err, "count": n}
        for (s, term, err), n in counts.most_common()
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--levels", default="16,32,64,128,256")
    ap.add_argument("--backend", choices=("docker", "bwrap"), default="docker")
    ap.add_argument("--barrier-s", type=float, default=240.0, help="wait for all C episodes this long")
    ap.add_argument("--memory-mb", type=int, default=256, help="per sandbox (the bound, not a reservation)")
    args = ap.parse_args()
    from sandflow.host import apply_host_settings

    apply_host_settings()  # SANDFLOW_* settings, handed to the libraries as the CLI does
    sandbox = SandboxConfig(
        backend=args.backend,
        run_id="bench-rl",
        limits=SandboxLimits(network="none", memory_mb=args.memory_mb),
    )
    with tempfile.TemporaryDirectory(prefix="sandflow-bench-rl-") as tmp:
        step = step_overhead(args.steps, sandbox, Path(tmp))
    print(
        f"step-wise env: own cost per step p50 {step['step_overhead_p50_ms']:.2f} ms "
        f"(p90 {step['step_overhead_p90_ms']:.2f}); the tool itself p50 {step['tool_p50_ms']:.2f} ms, "
        f"bare exec floor {step['exec_floor_p50_ms']:.2f} ms; target <= {TARGET_STEP_MS} ms"
    )
    levels = [int(x) for x in args.levels.split(",") if x.strip()]
    held, failed_total, results = 0, 0, []
    for c in levels:
        r = one_level(c, sandbox, args.barrier_s)
        results.append(r)
        ok = r["failed"] == 0 and r["peak_concurrent"] == c and r["all_rewarded"]
        failed_total += r["failed"]
        print(
            f"rollout server, {c:4d} episodes at once: {'held' if ok else 'FAILED'} "
            f"(peak {r['peak_concurrent']}, failed {r['failed']}, all active after "
            f"{r['all_active_after_s']} s, batch {r['wall_s']} s)"
        )
        for e in r["errors"]:
            print(f"  {e['count']} x {e['status']} {e['termination']}: {e['error']}")
        if not ok:
            break
        held = c
    figures = {
        "benchmark": "rl_env",
        "backend": args.backend,
        **step,
        "concurrent_episodes": held,
        "failed": failed_total,
        "levels": results,
        "step_target_ms": TARGET_STEP_MS,
        "concurrent_target": TARGET_CONCURRENT,
        "pass": step["step_overhead_p50_ms"] <= TARGET_STEP_MS
        and held >= TARGET_CONCURRENT
        and failed_total == 0,
    }
    from sandbox import netns

    netns.shutdown()  # the idle network-namespace holders go now, not one by one at exit
    print(json.dumps(figures, separators=(",", ":")))


if __name__ == "__main__":
    main()
