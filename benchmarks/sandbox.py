"""Sandbox speed against the docker SDK's own floors, measured in the same run.

    .venv/bin/python benchmarks/sandbox.py [--exec-n 300] [--start-n 15] [--file-n 5] [--no-bwrap]

Figures (p50s, interleaved so machine load hits floor and ours alike):
  exec      our exec("true") round trip         vs  SDK exec_run("true")          target <= 0.05x
  exec with background   the same with two background processes left running (a server
            and a watcher)                      vs  our exec alone                target <= 2x
  start     open_sandbox() until the shell answers vs SDK containers.run(detach)  target <= 1.3x
  close     our close() (kill + remove)             absolute (SDK remove(force) shown) target < 0.2 s
  acquire   a sandbox from the warm pool (sandbox/pool.py)  absolute  target <= 0.01 s
            (reset_p50_s: the background reset that readies a used one, shown)
  file      write_file + read_file of 10 MB       vs  raw put_archive + get_archive target <= 1.5x
            (the floor on a plain container's own filesystem: the archive API cannot see
            a sandbox's tmpfs mounts)
The bubblewrap backend's start/exec/close are reported alongside (no target), and gVisor's
start/exec (docker with `runtime="runsc"`) when the engine has that runtime.
The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import os
import statistics
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sandbox import SandboxConfig, SandboxLimits, open_sandbox  # noqa: E402
from sandbox.engine import docker_client  # noqa: E402
from sandbox.image import DEFAULT_SPEC  # noqa: E402

RUN_ID = "bench-sandbox"
FILE_MB = 10


def p50(xs: list[float]) -> float:
    return statistics.median(xs)


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def config(backend: str = "docker") -> SandboxConfig:
    return SandboxConfig(
        backend=backend,
        run_id=RUN_ID,
        episode_id="bench",
        limits=SandboxLimits(memory_mb=1024, tmp_size_mb=256),
    )


def bench_start_close(client: Any, n: int) -> dict[str, float]:
    """Interleave SDK containers.run with our open_sandbox; our close timed on its own."""
    floor, ours, close, rm_floor = [], [], [], []
    labels = {"sandflow.bench": "floor"}  # not a sandflow sandbox label: gc never sees it
    for i in range(n + 1):
        t = time.perf_counter()
        c = client.containers.run(
            DEFAULT_SPEC.tag, ["sleep", "infinity"], detach=True, labels=labels, network_mode="none"
        )
        d_floor = time.perf_counter() - t
        d_rm = timed(functools.partial(c.remove, force=True))
        t = time.perf_counter()
        sb = open_sandbox(config())
        d_ours = time.perf_counter() - t
        d_close = timed(sb.close)
        if i:  # the first round warms caches
            floor.append(d_floor)
            ours.append(d_ours)
            close.append(d_close)
            rm_floor.append(d_rm)
    return {
        "run_p50_s": p50(floor),
        "start_p50_s": p50(ours),
        "close_p50_s": p50(close),
        "sdk_remove_p50_s": p50(rm_floor),
    }


def bench_acquire(n: int) -> dict[str, float]:
    """The warm pool (sandbox/pool.py): acquire with an idle sandbox ready, and the reset
    that gets a used one ready again (in the background, off the episode's path)."""
    from sandbox.pool import PoolSettings, SandboxPool

    cfg = config()
    pool = SandboxPool(cfg, PoolSettings())
    acquire, reset = [], []
    try:
        pool.prewarm(2, timeout=300)
        for _ in range(n):
            deadline = time.monotonic() + 60
            while pool.idle < 1 and time.monotonic() < deadline:
                time.sleep(0.001)
            t = time.perf_counter()
            sb = pool.acquire(cfg)
            acquire.append(time.perf_counter() - t)
            sb.exec("cd /tmp && echo x > f && export A=1 && (sleep 100 &)")
            sb.close()
        box = open_sandbox(config())
        try:
            for _ in range(min(n, 20)):
                box.exec("cd /tmp && echo x > f && export A=1 && (sleep 100 &)")
                reset.append(timed(box.reset))  # type: ignore[attr-defined]
        finally:
            box.close()
    finally:
        pool.close()
    return {"acquire_p50_s": p50(acquire), "reset_p50_s": p50(reset)}


def bench_exec(client: Any, n: int) -> dict[str, float]:
    c = client.containers.run(
        DEFAULT_SPEC.tag,
        ["sleep", "infinity"],
        detach=True,
        labels={"sandflow.bench": "floor"},
        network_mode="none",
    )
    sb = open_sandbox(config())
    busy = open_sandbox(config())  # a server and a watcher left running, as episodes do
    try:
        assert busy.exec("sleep infinity & sleep infinity & true").exit_code == 0
        floor, ours, with_bg = [], [], []
        sdk_n = max(20, n // 10)  # exec_run is ~60 ms each: fewer samples suffice
        for _ in range(5):
            c.exec_run("true")
            sb.exec("true")
            busy.exec("true")
        for i in range(n):
            if i < sdk_n:
                floor.append(timed(lambda: c.exec_run("true")))
            ours.append(timed(lambda: sb.exec("true")))
            if i < n // 3:
                with_bg.append(timed(lambda: busy.exec("true")))
        return {
            "sdk_exec_p50_s": p50(floor),
            "exec_p50_s": p50(ours),
            "exec_background_p50_s": p50(with_bg),
        }
    finally:
        sb.close()
        busy.close()
        c.remove(force=True)


def bench_files(client: Any, n: int) -> dict[str, float]:
    """10 MB of random bytes: ours (write_file + read_file through the helper) vs the
    engine's own archive API (put_archive + get_archive) on a plain container's filesystem."""
    data = os.urandom(FILE_MB * 1024 * 1024)
    sb = open_sandbox(config())
    c = client.containers.run(
        DEFAULT_SPEC.tag,
        ["sleep", "infinity"],
        detach=True,
        labels={"sandflow.bench": "floor"},
        network_mode="none",
    )
    api, cid = client.api, c.id

    def raw() -> None:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:") as tar:
            info = tarfile.TarInfo("raw.bin")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        api.put_archive(cid, "/tmp", buf.getvalue())
        stream, _ = api.get_archive(cid, "/tmp/raw.bin")
        with tarfile.open(fileobj=io.BytesIO(b"".join(stream)), mode="r:") as tar:
            f = tar.extractfile("raw.bin")
            assert f is not None and len(f.read()) == len(data)

    def ours() -> None:
        sb.write_file("/testbed/ours.bin", data)
        assert len(sb.read_file("/testbed/ours.bin")) == len(data)

    try:
        raw()
        ours()
        floor = []
        mine = []
        for _ in range(n):
            floor.append(timed(raw))
            mine.append(timed(ours))
        return {"raw_archive_roundtrip_p50_s": p50(floor), "file_roundtrip_p50_s": p50(mine)}
    finally:
        sb.close()
        c.remove(force=True)


def bench_bwrap(n_start: int, n_exec: int) -> dict[str, float]:
    starts, closes, execs = [], [], []
    for i in range(n_start + 1):
        t = time.perf_counter()
        sb = open_sandbox(config("bwrap"))
        d = time.perf_counter() - t
        if i == 0:
            for _ in range(n_exec):
                execs.append(timed(functools.partial(sb.exec, "true")))
        c = timed(sb.close)
        if i:
            starts.append(d)
            closes.append(c)
    return {
        "bwrap_start_p50_s": p50(starts),
        "bwrap_exec_p50_s": p50(execs),
        "bwrap_close_p50_s": p50(closes),
    }


def bench_gvisor(client: Any, n_start: int, n_exec: int) -> dict[str, float]:
    """gVisor (`runtime="runsc"`, docs/sandbox.md): start and exec p50s, when the engine has
    the runtime (else nothing: the keys are left out of the JSON line)."""
    if "runsc" not in (client.info().get("Runtimes") or {}):
        return {}
    cfg = config("docker").model_copy(update={"runtime": "runsc", "episode_id": "gvisor"})
    starts, execs = [], []
    for i in range(n_start):
        t = time.perf_counter()
        sb = open_sandbox(cfg)
        starts.append(time.perf_counter() - t)
        if i == 0:
            for _ in range(n_exec):
                execs.append(timed(functools.partial(sb.exec, "true")))
        sb.close()
    return {"gvisor_start_p50_s": p50(starts), "gvisor_exec_p50_s": p50(execs)}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--exec-n", type=int, default=300, help="exec samples (ours); SDK gets n/10")
    ap.add_argument("--start-n", type=int, default=15, help="start/close samples")
    ap.add_argument("--file-n", type=int, default=5, help="10 MB round trips")
    ap.add_argument("--acquire-n", type=int, default=50, help="warm-pool acquisitions")
    ap.add_argument("--no-bwrap", action="store_true", help="skip the bubblewrap figures")
    ap.add_argument("--no-gvisor", action="store_true", help="skip the gVisor (runsc) figures")
    args = ap.parse_args()
    from sandflow.host import apply_host_settings

    apply_host_settings()  # SANDFLOW_* settings, handed to the libraries as the CLI does

    from rich.console import Console
    from rich.table import Table

    console = Console(stderr=True, width=max(110, Console(stderr=True).width))
    client = docker_client()
    size = int(client.api.inspect_image(DEFAULT_SPEC.tag).get("Size", 0))
    fig: dict[str, float | int | bool | str] = {
        "benchmark": "sandbox",
        "image": DEFAULT_SPEC.tag,
    }
    with console.status("exec round trips ..."):
        fig.update(bench_exec(client, args.exec_n))
    with console.status("start / close ..."):
        fig.update(bench_start_close(client, args.start_n))
    with console.status("warm pool: acquire / reset ..."):
        fig.update(bench_acquire(args.acquire_n))
    with console.status(f"{FILE_MB} MB file round trips ..."):
        fig.update(bench_files(client, args.file_n))
    if not args.no_bwrap:
        with console.status("bubblewrap ..."):
            fig.update(bench_bwrap(min(args.start_n, 10), min(args.exec_n, 200)))
    if not args.no_gvisor:
        with console.status("gVisor (runsc) ..."):
            fig.update(bench_gvisor(client, min(args.start_n, 5), min(args.exec_n, 100)))

    fig["exec_p50_ratio"] = fig["exec_p50_s"] / fig["sdk_exec_p50_s"]  # type: ignore[operator]
    fig["exec_background_ratio"] = fig["exec_background_p50_s"] / fig["exec_p50_s"]  # type: ignore[operator]
    fig["start_ratio"] = fig["start_p50_s"] / fig["run_p50_s"]  # type: ignore[operator]
    fig["file_roundtrip_ratio"] = fig["file_roundtrip_p50_s"] / fig["raw_archive_roundtrip_p50_s"]  # type: ignore[operator]
    fig["close_vs_sdk_remove"] = fig["close_p50_s"] / fig["sdk_remove_p50_s"]  # type: ignore[operator]
    fig["image_size_bytes"] = size
    checks = {
        "exec_p50_ratio": (fig["exec_p50_ratio"], 0.05),
        "exec_background_ratio": (fig["exec_background_ratio"], 2.0),
        "start_ratio": (fig["start_ratio"], 1.3),
        "close_p50_s": (fig["close_p50_s"], 0.2),
        "file_roundtrip_ratio": (fig["file_roundtrip_ratio"], 1.5),
        "acquire_p50_s": (fig["acquire_p50_s"], 0.01),
    }
    fig["pass"] = all(v <= t for v, t in checks.values())  # type: ignore[operator]

    table = Table(title="sandbox vs docker SDK floors (p50, same run)")
    for col in ("figure", "ours", "floor", "ratio / value", "target", "ok"):
        table.add_column(col)

    def ms(key: str) -> str:
        return f"{float(fig[key]) * 1000:.1f} ms"

    rows = [
        (
            "exec('true')",
            ms("exec_p50_s"),
            "exec_run " + ms("sdk_exec_p50_s"),
            "exec_p50_ratio",
            "<= 0.05x",
        ),
        (
            "exec('true'), 2 in background",
            ms("exec_background_p50_s"),
            "exec alone " + ms("exec_p50_s"),
            "exec_background_ratio",
            "<= 2x",
        ),
        ("start", ms("start_p50_s"), "containers.run " + ms("run_p50_s"), "start_ratio", "<= 1.3x"),
        (
            "close",
            ms("close_p50_s"),
            "remove(force) " + ms("sdk_remove_p50_s"),
            "close_p50_s",
            "< 0.2 s",
        ),
        (
            f"{FILE_MB} MB write+read",
            ms("file_roundtrip_p50_s"),
            "put/get_archive " + ms("raw_archive_roundtrip_p50_s"),
            "file_roundtrip_ratio",
            "<= 1.5x",
        ),
        (
            "acquire (warm pool)",
            ms("acquire_p50_s"),
            "start " + ms("start_p50_s"),
            "acquire_p50_s",
            "<= 0.01 s",
        ),
    ]
    for name, ours, floor, key, target in rows:
        value, limit = checks[key]
        table.add_row(
            name,
            ours,
            floor,
            f"{float(value):.3f}",
            target,
            "[green]yes[/green]" if float(value) <= float(limit) else "[red]no[/red]",
        )
    if not args.no_bwrap:
        table.add_row(
            "bwrap start / exec / close",
            f"{ms('bwrap_start_p50_s')} / {ms('bwrap_exec_p50_s')} / {ms('bwrap_close_p50_s')}",
            "-",
            "-",
            "-",
            "-",
        )
    if fig.get("gvisor_start_p50_s") is not None:
        table.add_row(
            "gVisor start / exec",
            f"{ms('gvisor_start_p50_s')} / {ms('gvisor_exec_p50_s')}",
            "runc " + ms("start_p50_s") + " / " + ms("exec_p50_s"),
            "-",
            "-",
            "-",
        )
    table.add_row("image size", f"{size / 1e9:.2f} GB", "-", "-", "-", "-")
    console.print(table)
    print(json.dumps({k: (round(v, 6) if isinstance(v, float) else v) for k, v in fig.items()}))


if __name__ == "__main__":
    main()
