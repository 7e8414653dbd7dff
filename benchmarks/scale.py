"""How many warm sandboxes one machine holds, every one answering, and what each costs.

    .venv/bin/python benchmarks/scale.py [--backend docker|bwrap|both] [--target 512]
        [--step 64] [--min-available-gb 4] [--exec-n 300]

For each backend: a SandboxPool (sandbox/pool.py) is grown in steps of `--step` through
its paced creation (token bucket + back-off, the same path an RL batch of 512 takes) until
`--target` sandboxes are alive or the host's available memory would drop under
`--min-available-gb` (other people share the machine: it stops early rather than push it
into swap or OOM). After each step every sandbox must answer `exec("true")`.

Figures (one JSON line per backend, then ONE JSON line with both):
  live_sandboxes        the most alive at once, every one answering        goal >= 512
  exec_p50_ms_at_max    exec('true') round trip, all of them alive           goal <= 5
  exec_p50_ms_alone     the same with a single sandbox (floor, same run)
  exec_ratio_at_max     at_max / alone
  mem_mb_per_sandbox    host MemAvailable drop per idle live sandbox (engine, shims,
                        netns holders included)
  create_per_s          sandboxes created per second while growing (paced)
  failed                creations given up + sandboxes that did not answer   goal 0
  leaked                sandboxes of this run still present 60 s after the drain  goal 0
It always cleans up: the pool drains on exit, Ctrl+C and SIGTERM (the registry's
handlers), and a final `gc` by this run's label removes anything left (counted as leaked).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sandbox import SandboxConfig, SandboxLimits, registry  # noqa: E402
from sandbox import gc as sandbox_gc  # noqa: E402
from sandbox.pool import PoolSettings, SandboxPool  # noqa: E402

RUN_ID = "bench-scale"


def mem_available_mb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def process_table() -> tuple[dict[int, int], dict[int, str]]:
    """{pid: ppid} and {pid: cmdline} of every process on the host."""
    parent, cmd = {}, {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_bytes()
            raw = Path(f"/proc/{name}/cmdline").read_bytes()
        except OSError:
            continue
        parent[int(name)] = int(stat[stat.rfind(b")") + 2 :].split()[1])
        cmd[int(name)] = raw.replace(b"\0", b" ").decode("utf-8", "replace")
    return parent, cmd


def pss_mb(pids: set[int]) -> float:
    """Proportional set size of `pids` (shared pages split among their users), in MB."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
                    break
        except OSError:
            continue
    return total / 1024


def tree(roots: set[int], parent: dict[int, int]) -> set[int]:
    """`roots` and all their descendants."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parent.items():
        children.setdefault(ppid, []).append(pid)
    out, stack = set(), list(roots)
    while stack:
        pid = stack.pop()
        if pid in out:
            continue
        out.add(pid)
        stack += children.get(pid, [])
    return out


def engine_pids(cmd: dict[int, str]) -> set[int]:
    """dockerd and containerd (their growth counts against the sandboxes)."""
    return {
        pid
        for pid, c in cmd.items()
        if c.split(" ")[0].rsplit("/", 1)[-1] in ("dockerd", "containerd")
    }


def sandbox_pids(backend: str, leases: list[Any]) -> set[int]:
    """Every host process that exists for these sandboxes: shims, holders, helpers, shells."""
    import os as _os

    parent, cmd = process_table()
    if backend == "bwrap":
        return tree({lease.proc.pid for lease in leases}, parent)
    from sandbox import netns
    from sandbox.engine import docker_client

    ids = {lease.container_id for lease in leases}
    holders = sandbox_gc.docker_sandboxes(docker_client(), netns.HOLDER_RUN_ID)
    ids |= {h.id for h in holders if h.labels.get("sandflow.pid") == str(_os.getpid())}
    shims = {
        pid
        for pid, c in cmd.items()
        if "containerd-shim" in c and any(f"-id {cid}" in c for cid in ids)
    }
    return tree(shims, parent)


def raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def config(backend: str) -> SandboxConfig:
    # small but real limits: an idle sandbox's cost does not depend on them
    return SandboxConfig(
        backend=backend,
        run_id=f"{RUN_ID}-{backend}",
        episode_id="scale",
        limits=SandboxLimits(memory_mb=256, pids=64, cpus=1.0, tmp_size_mb=64),
    )


def leftovers(backend: str) -> list[Any]:
    """This run's sandboxes still present, and (docker) this process's netns holders."""
    import os

    from sandbox import netns
    from sandbox.engine import docker_client

    run_id = f"{RUN_ID}-{backend}"
    client = docker_client() if backend == "docker" else None
    left = [i for i in sandbox_gc.list_all(client, run_id) if i.run_id == run_id]
    if client is not None:
        holders = sandbox_gc.docker_sandboxes(client, netns.HOLDER_RUN_ID)
        left += [h for h in holders if h.labels.get("sandflow.pid") == str(os.getpid())]
    return left


def all_answer(boxes: list[Any]) -> int:
    """How many of `boxes` fail to answer exec('true') (asked 8 at a time)."""

    def ask(box: Any) -> bool:
        try:
            return bool(box.exec("true", timeout=30).exit_code == 0)
        except Exception:  # noqa: BLE001 - counted as not answering
            return False

    with ThreadPoolExecutor(8) as ex:
        return sum(not ok for ok in ex.map(ask, boxes))


def try_acquire(pool: SandboxPool, cfg: SandboxConfig) -> Any:
    """A new lease, or None when its creation failed every retry (counted by the pool)."""
    try:
        return pool.acquire(cfg, timeout=900)
    except Exception as e:  # noqa: BLE001 - reported in the figures
        print(f"  acquire failed: {e}", flush=True)
        return None


def exec_p50_ms(boxes: list[Any], n: int) -> float:
    times = []
    for i in range(n):
        box = boxes[i % len(boxes)]
        t = time.perf_counter()
        box.exec("true")
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def run(backend: str, target: int, step: int, floor_mb: float, exec_n: int) -> dict[str, Any]:
    cfg = config(backend)
    settings = PoolSettings(
        max_idle=target, create_concurrency=4, create_rate=4, create_rate_max=24
    )
    pool = SandboxPool(cfg, settings)
    leases: list[Any] = []
    fig: dict[str, Any] = {"benchmark": "scale", "backend": backend, "target": target}
    try:
        base_mb = mem_available_mb()
        engine_base_mb = pss_mb(engine_pids(process_table()[1]))
        one = pool.acquire(cfg)
        leases.append(one)
        fig["exec_p50_ms_alone"] = round(exec_p50_ms([one], exec_n), 3)
        one_mb = mem_available_mb()
        not_answering = 0
        t_grow = time.perf_counter()
        live = 1
        while live < target:
            want = min(target, live + step)
            avail = mem_available_mb()
            # the next step's cost, from what the live ones take (PSS, doubled for the kernel's
            # share: page tables, namespaces, cgroups): MemAvailable alone moves with others' work
            per = max(20.0, 2 * pss_mb(sandbox_pids(backend, leases)) / live)
            if avail - per * (want - live) < floor_mb:
                fig["stopped"] = f"memory: {avail:.0f} MB available, floor {floor_mb:.0f} MB"
                break
            # the leases hold every sandbox (none idle): acquire grows the pool, paced
            with ThreadPoolExecutor(16) as ex:
                got = list(ex.map(lambda _: try_acquire(pool, cfg), range(want - live)))
            leases += [g for g in got if g is not None]
            live = len(leases)
            bad = all_answer(leases)
            not_answering = max(not_answering, bad)
            print(
                f"  {backend}: {live} live, {bad} not answering, "
                f"{mem_available_mb():.0f} MB available, load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
            if bad or None in got:
                fig["stopped"] = f"{bad} sandboxes did not answer, {got.count(None)} not created"
                break
        grow_s = time.perf_counter() - t_grow
        time.sleep(2)  # let the engine settle before reading memory
        at_max_mb = mem_available_mb()
        fig["live_sandboxes"] = live - not_answering
        fig["exec_p50_ms_at_max"] = round(exec_p50_ms(leases, exec_n), 3)
        fig["exec_ratio_at_max"] = round(fig["exec_p50_ms_at_max"] / fig["exec_p50_ms_alone"], 3)
        own_mb = pss_mb(sandbox_pids(backend, leases))
        engine_mb = pss_mb(engine_pids(process_table()[1])) - engine_base_mb
        fig["mem_mb_per_sandbox"] = round((own_mb + max(0.0, engine_mb)) / live, 2)
        fig["mem_mb_engine_growth"] = round(engine_mb, 1)
        # the whole host's view: noisy when others use the machine, kernel memory included
        fig["mem_mb_per_sandbox_meminfo"] = round((base_mb - at_max_mb) / live, 1)
        fig["mem_mb_first_sandbox_meminfo"] = round(base_mb - one_mb, 1)
        fig["create_per_s"] = round((live - 1) / grow_s, 2) if live > 1 else 0.0
        fig["failed"] = pool.stats.creations_given_up + not_answering
        fig["create_retries"] = pool.stats.create_failures
    finally:
        for lease in leases:
            lease.kill()
        pool.close()
        from sandbox import netns

        netns.shutdown()  # the idle network-namespace holders the sandboxes joined
    deadline = time.monotonic() + 60
    while leftovers(backend) and time.monotonic() < deadline:
        time.sleep(1)
    left = leftovers(backend)
    fig["leaked"] = len(left)
    if left:  # the backstop: never leave them behind
        from sandbox.engine import docker_client

        client = docker_client() if backend == "docker" else None
        sandbox_gc.collect(client, everything=True, run_prefix=f"{RUN_ID}-{backend}")
    return fig


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--backend", choices=["docker", "bwrap", "both"], default="both")
    ap.add_argument("--target", type=int, default=512)
    ap.add_argument("--step", type=int, default=64)
    ap.add_argument("--min-available-gb", type=float, default=4.0)
    ap.add_argument("--exec-n", type=int, default=300)
    args = ap.parse_args()
    from sandflow.host import apply_host_settings

    apply_host_settings()  # SANDFLOW_* settings, handed to the libraries as the CLI does
    raise_fd_limit()
    registry.install_signal_handlers()  # Ctrl+C / SIGTERM: every sandbox removed first
    backends = ["docker", "bwrap"] if args.backend == "both" else [args.backend]
    out: dict[str, Any] = {"benchmark": "scale", "target": args.target}
    for backend in backends:
        fig = run(backend, args.target, args.step, args.min_available_gb * 1024, args.exec_n)
        print(json.dumps(fig), flush=True)
        for key, value in fig.items():
            if key not in ("benchmark", "target"):
                out[f"{backend}_{key}"] = value
    first = backends[0]
    for key in ("live_sandboxes", "exec_p50_ms_at_max", "mem_mb_per_sandbox", "failed", "leaked"):
        out[key] = out.get(f"{first}_{key}")
    out["pass"] = all(
        out.get(f"{b}_live_sandboxes", 0) >= 512
        and out.get(f"{b}_exec_p50_ms_at_max", 1e9) <= 5
        and out.get(f"{b}_failed") == 0
        and out.get(f"{b}_leaked") == 0
        for b in backends
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
