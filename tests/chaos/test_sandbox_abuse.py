"""Abuse from inside the sandbox, on both backends (docker, bwrap), through real episodes.

The "model" (the scripted server) drives the abuse with ordinary tool calls, so every
case goes through the same path as a real run: the agent loop, the sandbox, the output
export (copy_out into a host folder) and the warehouse. Each case checks two things:
contained (the host is untouched: no file outside the export folder, no process left,
no host service reached, the host's disk not filled) and recorded (the episode and its
observations are in the warehouse, with the evidence, e.g. "No space left on device").
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tarfile
import threading
import time
from collections.abc import Iterator
from io import BytesIO
from pathlib import Path
from typing import Any

import pytest

from tests.chaos.conftest import bwrap_sandboxes_of, containers_of, query
from tests.scripted_model import ScriptedModel, tool_reply

pytestmark = [pytest.mark.chaos]


@pytest.fixture(params=["docker", "bwrap"])
def backend(request: pytest.FixtureRequest) -> str:
    request.getfixturevalue("sandbox_image" if request.param == "docker" else "sandbox_rootfs")
    return str(request.param)


def _abuse(
    backend: str,
    commands: list[str],
    tmp_path: Path,
    run_id: str,
    *,
    network: str = "none",
    timeout_s: float = 60,
    **limits: Any,
) -> Any:
    """One recorded episode whose model runs `commands` (one execute_bash each), then submits."""
    from sandbox.base import SandboxConfig, SandboxLimits
    from tasks.loop import Limits, run_episode
    from tasks.model import ModelConfig
    from tests.flows.conftest import tiny_tasks
    from warehouse.writer import EpisodeWriter

    lim = {"memory_mb": 512, "pids": 256, "tmp_size_mb": 64, "network": network, **limits}
    script = [tool_reply("execute_bash", {"command": c}) for c in commands]
    with (
        ScriptedModel(script, default=tool_reply("submit", {}), models=("scripted",)) as model,
        EpisodeWriter(tmp_path / "wh", durability="flush") as writer,
    ):
        result = run_episode(
            tiny_tasks(1)[0],
            ModelConfig(model="scripted", base_url=model.url),
            SandboxConfig(backend=backend, run_id=run_id, limits=SandboxLimits(**lim)),
            writer,
            run_id=run_id,
            limits=Limits(max_steps=len(commands) + 2, wall_clock_s=300, exec_timeout_s=timeout_s),
            output_dir=tmp_path / "export",
        )
    assert result.record.termination == "submitted", (result.record.termination, result.record.error)
    # Recorded: every abusive command and what it produced is in the warehouse.
    rows = query(
        tmp_path / "wh",
        f"SELECT count(*) FROM turns WHERE run_id = '{run_id}'",
    )
    assert rows == [(len(commands) + 1,)]
    # Nothing of the sandbox outlives the episode.
    assert containers_of(run_id) == [] and bwrap_sandboxes_of(run_id) == []
    return result


def _observations(result: Any) -> list[str]:
    return [o.content for t in result.turns for o in t.observations]


def _host_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


# ------------------------------------------------------------------- output export
def test_export_symlinks_to_host_paths_are_not_followed(backend: str, tmp_path: Path, test_run_id: str) -> None:
    rid = f"{test_run_id}-abuse-links-{backend}"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("host secret\n")
    out = "/testbed/output"
    result = _abuse(
        backend,
        [
            f"mkdir -p {out}/sub && cd {out} && echo 42 > answer.txt && "
            f"ln -s /etc/shadow shadow && ln -s / rootdir && ln -s {outside}/secret.txt host-secret && "
            f"ln -s ../../../../../../{tmp_path.relative_to('/')}/outside sub/up && ln answer.txt hard && ls -la",
        ],
        tmp_path,
        rid,
    )
    export = tmp_path / "export"
    files = _host_files(export)
    assert files == ["answer.txt", "hard", "sub"], files
    assert (export / "answer.txt").read_text() == "42\n"
    assert not any(p.is_symlink() for p in export.rglob("*"))
    assert sorted(p.name for p in outside.iterdir()) == ["secret.txt"]  # nothing written there
    assert result.record.answer == "42"


def test_export_of_a_huge_sparse_file_is_bounded(backend: str, tmp_path: Path, test_run_id: str) -> None:
    """A 5 GB (sparse) file in the output folder is left out, not streamed to the host."""
    rid = f"{test_run_id}-abuse-huge-{backend}"
    before = shutil.disk_usage(tmp_path).free
    _abuse(
        backend,
        ["mkdir -p /testbed/output && cd /testbed/output && echo 42 > answer.txt && truncate -s 5G huge.bin && ls -la"],
        tmp_path,
        rid,
    )
    export = tmp_path / "export"
    assert not (export / "huge.bin").exists() or (export / "huge.bin").stat().st_size < (1 << 30)
    assert (export / "answer.txt").read_text() == "42\n"
    assert before - shutil.disk_usage(tmp_path).free < (256 << 20)


def test_export_of_many_small_files_is_bounded(backend: str, test_run_id: str, tmp_path: Path) -> None:
    """Far more files than the copy limit: the export stops at the limit and says so."""
    from sandbox import SandboxConfig, SandboxLimits, open_sandbox
    from sandbox.archive import CopyLimits
    from sandbox.common import HelperSandbox

    cfg = SandboxConfig(
        backend=backend,
        run_id=f"{test_run_id}-abuse-many-{backend}",
        limits=SandboxLimits(memory_mb=512, tmp_size_mb=128),
    )
    with open_sandbox(cfg) as sb:
        r = sb.exec(
            "mkdir -p /testbed/output/many && cd /testbed/output/many && "
            "python3 -c \"[open(f'f{i}', 'w').write('x') for i in range(20000)]\" && ls | wc -l",
            timeout=120,
        )
        assert r.stdout.strip() == "20000", r
        assert isinstance(sb, HelperSandbox)  # both backends; the export limits live there
        sb.copy_limits = CopyLimits(max_bytes=1 << 20, max_files=2000)
        files = sb.copy_out("/testbed/output", tmp_path / "export")
    # Every entry counts against the cap, folders too: the folder `many` and 1,999 files.
    assert len(files) == 1999 and files.summary.dirs == 1
    assert sum(1 for _ in (tmp_path / "export").rglob("f*")) == 1999
    assert any("file-count limit" in why for _, why in files.skipped)
    assert files.summary.skipped == {"over_count": 20001 - 2000}


def test_crafted_tar_with_dotdot_and_absolute_names_stays_in_the_export(tmp_path: Path) -> None:
    """The export reader gets a hostile tar (what a compromised helper could send):
    `..` and absolute member names, a symlink then a file through it, a device."""
    from sandbox.archive import CopyLimits, safe_extract

    buf = BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:

        def add(name: str, data: bytes = b"x", kind: bytes = tarfile.REGTYPE, link: str = "") -> None:
            info = tarfile.TarInfo(name)
            info.type, info.linkname = kind, link
            info.size = len(data) if kind == tarfile.REGTYPE else 0
            tar.addfile(info, BytesIO(data) if kind == tarfile.REGTYPE else None)

        add("output", kind=tarfile.DIRTYPE)
        add("output/ok.txt", b"fine")
        add("output/../../escape.txt", b"evil")
        add("/tmp/abs-escape.txt", b"evil")
        add("output/link", kind=tarfile.SYMTYPE, link=str(tmp_path))
        add("output/link/through-link.txt", b"evil")
        add("output/dev", kind=tarfile.CHRTYPE)
    export = tmp_path / "deep" / "export"
    files = safe_extract(buf.getvalue(), export, CopyLimits())
    # The symlink is skipped, so the file "through" it lands in a real folder of that name.
    assert sorted(str(p.relative_to(export)) for p in files) == ["link/through-link.txt", "ok.txt"]
    assert _host_files(tmp_path / "deep") == ["export", "export/link", "export/link/through-link.txt", "export/ok.txt"]
    assert not any(p.is_symlink() for p in export.rglob("*"))
    assert not (tmp_path / "escape.txt").exists() and not (tmp_path / "through-link.txt").exists()
    assert not Path("/tmp/abs-escape.txt").exists()
    reasons = dict(files.skipped)
    assert set(reasons) == {"output/../../escape.txt", "/tmp/abs-escape.txt", "output/link", "output/dev"}, reasons


# --------------------------------------------------------------------- host disk
def test_filling_every_writable_place_is_bounded(backend: str, tmp_path: Path, test_run_id: str) -> None:
    """Write 1 GB into each writable place; each stops early, the host's disk keeps its space."""
    rid = f"{test_run_id}-abuse-disk-{backend}"
    before = shutil.disk_usage("/").free
    places = ["/testbed", "/tmp", "$HOME", "/dev/shm", "/var/tmp"]
    cmds = [
        f"head -c 1G /dev/zero > {p}/fill.bin; echo \"{p} rc=$? $(du -sm {p}/fill.bin 2>/dev/null | cut -f1)MB\"; rm -f {p}/fill.bin"
        for p in places
    ]
    result = _abuse(backend, cmds, tmp_path, rid, memory_mb=512, tmp_size_mb=64, timeout_s=60)
    obs = _observations(result)
    for place, text in zip(places, obs, strict=False):
        # Each write failed or was cut off; none got anywhere near 1 GB.
        # (read-only or forbidden places print no size: nothing was written there)
        mb = [int(w[:-2]) for w in text.split() if w.endswith("MB") and w[:-2].isdigit()]
        assert "rc=0" not in text and (not mb or mb[-1] <= 64 + 1), (place, text)
    assert before - shutil.disk_usage("/").free < (300 << 20), "the host's disk lost space"


# -------------------------------------------------------------- processes after close
def test_no_process_survives_close(backend: str, tmp_path: Path, test_run_id: str) -> None:
    token = f"{os.getpid() % 1000}{int(time.time()) % 1000}"
    rid = f"{test_run_id}-abuse-procs-{backend}"
    marks = [f"7{token}.1", f"7{token}.2", f"7{token}.3", f"7{token}.4"]
    _abuse(
        backend,
        [
            f"setsid sleep {marks[0]} > /dev/null 2>&1 < /dev/null &",
            f"nohup sleep {marks[1]} > /dev/null 2>&1 &",
            f"( ( sleep {marks[2]} > /dev/null 2>&1 & ) & ) ; echo double-forked",
            "python3 -c \"import os,time\nif os.fork(): os._exit(0)\nos.setsid()\n"
            f"if os.fork(): os._exit(0)\nos.execvp('sleep', ['sleep', '{marks[3]}'])\"; "
            f"sleep 0.5; ps -eo pid,args | grep 'sleep 7{token}' | grep -v grep | wc -l",
        ],
        tmp_path,
        rid,
    )
    deadline = time.monotonic() + 15
    while True:
        alive = subprocess.run(["pgrep", "-af", f"sleep 7{token}"], capture_output=True, text=True).stdout.strip()
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not alive, f"processes survived the sandbox's close: {alive}"


# ----------------------------------------------------------------------- network
@pytest.fixture
def host_service() -> Iterator[int]:
    """A TCP service on the host's 127.0.0.1 that answers 'HOST-SECRET' to anyone."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            with conn:
                conn.sendall(b"HOST-SECRET\n")

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield srv.getsockname()[1]
    stop.set()
    t.join(timeout=2)
    srv.close()


def _probe(port: int, host: str = "127.0.0.1") -> str:
    return (
        f"python3 -c \"import socket\ntry:\n s=socket.create_connection(('{host}', "
        f"{port}), timeout=3); print('GOT', s.recv(64))\nexcept OSError as e: print('BLOCKED', e)\""
    )


def _host_address() -> str | None:
    """One of the host's own non-loopback IPv4 addresses (the route to the outside)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the source address
            addr = str(s.getsockname()[0])
        except OSError:
            return None
    return None if addr.startswith("127.") else addr


def test_host_loopback_service_is_unreachable_under_network_none(
    backend: str, host_service: int, tmp_path: Path, test_run_id: str
) -> None:
    rid = f"{test_run_id}-abuse-net-none-{backend}"
    result = _abuse(backend, [_probe(host_service)], tmp_path, rid, network="none")
    text = _observations(result)[0]
    assert "BLOCKED" in text and "HOST-SECRET" not in text, text


@pytest.mark.parametrize("net_backend", ["docker", "bwrap"])
def test_host_loopback_service_is_unreachable_under_network_bridge(
    net_backend: str, host_service: int, tmp_path: Path, test_run_id: str, request: pytest.FixtureRequest
) -> None:
    request.getfixturevalue("sandbox_image" if net_backend == "docker" else "sandbox_rootfs")
    rid = f"{test_run_id}-abuse-net-bridge-{net_backend}"
    if net_backend == "docker":
        _skip_without_bridge(rid)
    probes = [_probe(host_service)]
    if net_backend == "bwrap":
        probes.append(_probe(host_service, "10.0.2.2"))  # slirp's alias of the host's loopback
    result = _abuse(net_backend, probes, tmp_path, rid, network="bridge")
    for text in _observations(result)[: len(probes)]:
        assert "HOST-SECRET" not in text and "BLOCKED" in text, text


def test_bwrap_bridge_is_a_network_that_reaches_out_but_not_other_sandboxes(
    sandbox_rootfs: Any, test_run_id: str
) -> None:
    """bwrap `bridge` (slirp4netns): a host service on a routable address answers, a peer's does not."""
    from sandbox import SandboxConfig, SandboxLimits, open_sandbox

    addr = _host_address()
    if addr is None:
        pytest.skip("NOT TRIED: this host has no non-loopback IPv4 address to reach")
    public = socket.socket()
    public.bind((addr, 0))
    public.listen(4)
    public.settimeout(10)
    port = public.getsockname()[1]

    def answer() -> None:
        try:
            conn, _ = public.accept()
        except OSError:
            return
        with conn:
            conn.sendall(b"HOST-PUBLIC\n")

    t = threading.Thread(target=answer, daemon=True)
    t.start()

    def cfg(ep: str) -> SandboxConfig:
        return SandboxConfig(
            backend="bwrap",
            run_id=f"{test_run_id}-abuse-bridge-peer",
            episode_id=ep,
            limits=SandboxLimits(memory_mb=256, network="bridge"),
        )

    try:
        with open_sandbox(cfg("a")) as a, open_sandbox(cfg("b")) as b:
            out = b.exec(_probe(port, addr), timeout=20).stdout
            assert "HOST-PUBLIC" in out, out  # a real network, not "none" under another name
            a.exec(
                "nohup python3 -c \"import socket\ns=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
                "s.bind(('0.0.0.0', 18556)); s.listen(4)\nwhile True:\n c,_=s.accept(); c.sendall(b'PEER-SECRET'); c.close()\" "
                "> /dev/null 2>&1 &"
            )
            assert "PEER-SECRET" in a.exec("sleep 1; " + _probe(18556)).stdout  # it does serve
            for host in ("127.0.0.1", "10.0.2.100", "10.0.2.2", addr):
                r = b.exec(_probe(18556, host), timeout=20)
                assert "PEER-SECRET" not in r.stdout and "BLOCKED" in r.stdout, (host, r)
    finally:
        public.close()
        t.join(timeout=5)
    assert bwrap_sandboxes_of(f"{test_run_id}-abuse-bridge-peer") == []


def _skip_without_bridge(run_id: str) -> None:
    """This case needs an engine with a bridge network; say so loudly when there is none."""
    from sandbox import SandboxConfig, SandboxLimits, open_sandbox
    from sandbox.base import SandboxError

    try:
        open_sandbox(SandboxConfig(run_id=run_id, limits=SandboxLimits(network="bridge"))).close()
    except SandboxError as exc:
        if "bridge" in str(exc):
            pytest.skip(f"NOT TRIED: this Docker engine has no bridge network ({str(exc)[-160:]})")
        raise


def test_sandboxes_cannot_reach_each_other_under_network_none(backend: str, test_run_id: str) -> None:
    """A service in one sandbox (on all its interfaces) is not reachable from another."""
    from sandbox import SandboxConfig, SandboxLimits, open_sandbox

    def cfg(ep: str) -> SandboxConfig:
        return SandboxConfig(
            backend=backend,
            run_id=f"{test_run_id}-abuse-peer-{backend}",
            episode_id=ep,
            limits=SandboxLimits(memory_mb=256, network="none"),
        )

    with open_sandbox(cfg("a")) as a, open_sandbox(cfg("b")) as b:
        a.exec(
            "nohup python3 -c \"import socket\ns=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
            "s.bind(('0.0.0.0', 18555)); s.listen(4)\nwhile True:\n c,_=s.accept(); c.sendall(b'PEER-SECRET'); c.close()\" "
            "> /dev/null 2>&1 &"
        )
        assert "PEER-SECRET" in a.exec("sleep 1; " + _probe(18555)).stdout  # it does serve
        r = b.exec(_probe(18555), timeout=20)
        assert "PEER-SECRET" not in r.stdout and "BLOCKED" in r.stdout, r
