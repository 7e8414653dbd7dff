"""The helper's channel (PID 1's stdin/stdout) is out of the sandbox's reach, and the host
bounds whatever comes over it. Both backends; both protection layers on their own.

From inside: a script run as the sandbox user tries every way toward the helper it can
think of (its /proc files, ptrace, pidfd_getfd, process_vm_writev, signals, inherited
fds, /dev/tty, abstract sockets) and, wherever a write goes through, forges the frames
that used to replace the output export. The host must still export the real answer.

From a subverted helper: the real container/bwrap transport carries a hostile PID 1 (a
forged 3.5 GB `len`, garbage without a newline, a frame for another request, ...). The
host must end each with a clear SandboxError naming the violation, allocate nothing the
sandbox declared, and remove the sandbox at once.
"""

from __future__ import annotations

import json
import os
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sandbox import SandboxConfig, SandboxLimits, open_sandbox
from sandbox.base import SandboxError
from tests.chaos.conftest import bwrap_sandboxes_of, containers_of

pytestmark = [pytest.mark.chaos]


@pytest.fixture(params=["docker", "bwrap"])
def backend(request: pytest.FixtureRequest) -> str:
    request.getfixturevalue("sandbox_image" if request.param == "docker" else "sandbox_rootfs")
    return str(request.param)


@pytest.fixture(params=["privsep", "nondumpable-only"])
def layer(request: pytest.FixtureRequest, host_settings: Any) -> str:
    """Both layers (the default), or the non-dumpable mark alone (helper = sandbox uid;
    SANDFLOW_SANDBOX_PRIVSEP=0, handed in by the application)."""
    if request.param == "nondumpable-only":
        host_settings(privsep=False)
    return str(request.param)


def _config(backend: str, run_id: str, env: dict[str, str] | None = None) -> SandboxConfig:
    limits = SandboxLimits(memory_mb=512, pids=256, tmp_size_mb=64)
    return SandboxConfig(backend=backend, run_id=run_id, limits=limits, env=env or {})


# A forged answer to the export the host will ask for next: a header for a plausible
# request id, then a tar replacing answer.txt. Written wherever a write goes through.
_ATTACK = r"""
import ctypes, errno, json, os, signal, socket, struct

FORGED = b"".join(
    json.dumps({"id": i, "ok": True, "len": 3_500_000_000, "summary": {}}).encode() + b"\n"
    for i in range(1, 64)
) + b"\x00" * 1024
libc = ctypes.CDLL(None, use_errno=True)
out = {}

def attempt(name, fn):
    try:
        res = fn()
        out[name] = "OK " + repr(res)[:80]
    except OSError as e:
        out[name] = "refused " + (errno.errorcode.get(e.errno, str(e.errno)))
    except Exception as e:
        out[name] = "refused " + type(e).__name__

def sys_ok(name, rc):
    if rc == -1:
        raise OSError(ctypes.get_errno(), name)
    return rc

def write(path):
    fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    try:
        return os.write(fd, FORGED)
    finally:
        os.close(fd)

def read(path):
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        return len(os.read(fd, 4096))
    finally:
        os.close(fd)

for n in (0, 1, 2):
    attempt(f"write /proc/1/fd/{n}", lambda n=n: write(f"/proc/1/fd/{n}"))
    attempt(f"write /proc/1/task/1/fd/{n}", lambda n=n: write(f"/proc/1/task/1/fd/{n}"))
    attempt(f"read /proc/1/fd/{n}", lambda n=n: read(f"/proc/1/fd/{n}"))
for d in ("fd", "fdinfo", "task/1/fd", "map_files", "root/"):
    attempt(f"list /proc/1/{d}", lambda d=d: os.listdir(f"/proc/1/{d}"))
for f in ("mem", "environ", "task/1/mem", "syscall", "stack", "auxv", "personality"):
    attempt(f"read /proc/1/{f}", lambda f=f: read(f"/proc/1/{f}"))
for f in ("fdinfo/1", "task/1/fdinfo/1"):
    attempt(f"read /proc/1/{f}", lambda f=f: read(f"/proc/1/{f}"))
for link in ("root", "cwd", "exe", "fd/1", "ns/pid"):
    attempt(f"readlink /proc/1/{link}", lambda link=link: os.readlink(f"/proc/1/{link}"))
attempt("ptrace attach 1", lambda: sys_ok("ptrace", libc.ptrace(16, 1, 0, 0)))
attempt("ptrace seize 1", lambda: sys_ok("ptrace", libc.ptrace(0x4206, 1, 0, 0)))
def getfd(n):
    pidfd = os.pidfd_open(1)
    try:
        return sys_ok("pidfd_getfd", libc.syscall(438, pidfd, n, 0))
    finally:
        os.close(pidfd)
for n in (0, 1):
    attempt(f"pidfd_getfd 1 {n}", lambda n=n: getfd(n))
class IOV(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
buf = ctypes.create_string_buffer(b"x" * 8)
local, remote = IOV(ctypes.addressof(buf), 8), IOV(0x400000, 8)
attempt("process_vm_writev 1", lambda: sys_ok("pvw", libc.syscall(311, 1, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)))
attempt("write /dev/tty", lambda: write("/dev/tty"))
attempt("write /dev/console", lambda: write("/dev/console"))
for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGSTOP, signal.SIGPIPE, signal.SIGKILL):
    attempt(f"kill 1 {sig.name}", lambda sig=sig: os.kill(1, sig))
# Abstract unix sockets: the helper listens on none; connect to every name listed anyway.
names = []
with open("/proc/net/unix") as f:
    for line in f.read().splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 8 and parts[7].startswith("@"):
            names.append(parts[7])
out["abstract sockets"] = names
for name in names:
    def connect(name=name):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect("\0" + name[1:])
        return s.send(FORGED)
    attempt(f"connect {name}", connect)
# Inherited fds: every fd of every process we can see, pipes named by inode.
held = {}
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            held.setdefault(os.readlink(f"/proc/{pid}/fd/{fd}"), []).append(f"{pid}:{fd}")
    except OSError:
        pass
out["held"] = held
out["me"] = os.getpid()
print(json.dumps(out))
"""


def _channel_links(sb: Any) -> set[str]:
    """The helper's stdin/stdout as the host sees them ("pipe:[inode]")."""
    import os

    if sb.backend == "docker":
        pid = sb.api.inspect_container(sb.container_id)["State"]["Pid"]
        return {os.readlink(f"/proc/{pid}/fd/{n}") for n in (0, 1)}
    return {os.readlink(f"/proc/self/fd/{f.fileno()}") for f in (sb.proc.stdin, sb.proc.stdout)}


def _refused(outcome: str) -> bool:
    return outcome.startswith("refused")


def test_sandbox_user_cannot_reach_the_helpers_channel(
    backend: str, layer: str, tmp_path: Path, test_run_id: str
) -> None:
    run_id = f"{test_run_id}-channel-{backend}-{layer}"
    with open_sandbox(_config(backend, run_id)) as sb:
        guard = sb._client.guard  # type: ignore[attr-defined]
        assert guard["dumpable"] == 0 and guard["privsep"] is (layer == "privsep"), guard
        sb.exec("mkdir -p /testbed/output && echo 42 > /testbed/output/answer.txt")
        sb.write_file("/tmp/attack.py", _ATTACK)
        r = sb.exec("python3 /tmp/attack.py", timeout=60)
        assert r.exit_code == 0, r.stderr
        found = json.loads(r.stdout)
        tried = {k: v for k, v in found.items() if isinstance(v, str)}
        reached = {k: v for k, v in tried.items() if not _refused(v) and not k.startswith("kill")}
        assert reached == {}, f"the sandbox reached the helper: {reached}"
        assert len(tried) >= 40, sorted(tried)
        # Signals: with privilege separation none is even delivered; with one uid the kernel
        # drops them (PID 1 of its namespace, no handler). Either way the helper is alive.
        if layer == "privsep":
            assert all(_refused(v) for k, v in tried.items() if k.startswith("kill")), tried
        assert found["abstract sockets"] == []
        # No process of the sandbox holds any end of the helper's channel (seen from the host).
        channel = _channel_links(sb)
        assert channel and all(link.startswith("pipe:") for link in channel), channel
        assert not channel & set(found["held"]), (channel, found["held"])
        # The channel is intact: the real answer is exported, the session goes on.
        files = sb.copy_out("/testbed/output", tmp_path / "export")
        assert [p.name for p in files] == ["answer.txt"]
        assert (tmp_path / "export" / "answer.txt").read_text() == "42\n"
        assert sb.exec("echo alive").stdout == "alive\n"
        assert sb.read_file("/testbed/output/answer.txt") == b"42\n"


def test_the_shells_own_pipes_carry_no_protocol(
    backend: str, tmp_path: Path, test_run_id: str
) -> None:
    """Forged frames written to the command's own stdout/stderr are only its output."""
    run_id = f"{test_run_id}-ownpipes-{backend}"
    with open_sandbox(_config(backend, run_id)) as sb:
        sb.exec("mkdir -p /testbed/output && echo 42 > /testbed/output/answer.txt")
        forged = '{"id": 3, "ok": true, "len": 3500000000}'
        r = sb.exec(
            f"for fd in /proc/$$/fd/*; do printf '%s\\n' '{forged}' > $fd; done 2>/dev/null; "
            f"printf '%s\\n' '{forged}' >&2; echo done"
        )
        assert "done" in r.stdout
        files = sb.copy_out("/testbed/output", tmp_path / "export")
        assert [p.name for p in files] == ["answer.txt"]
        assert (tmp_path / "export" / "answer.txt").read_text() == "42\n"


# ------------------------------------------------------------------ a subverted helper
# A PID 1 that speaks the protocol's first line and then whatever `mode` says: what a
# compromised helper could send. The transport (docker attach / bwrap pipes) is real.
_HOSTILE = r"""
import json, os, sys
MODE = os.environ.get("HOSTILE_MODE", "")
out = sys.stdout.buffer
def send(obj, payload=b""):
    out.write(json.dumps(obj).encode() + b"\n" + payload)
    out.flush()
send({"ready": True, "pid": 1, "boot": 0, "privsep": True, "dumpable": 0, "uid": 0})
line = sys.stdin.buffer.readline()
rid = json.loads(line)["id"]
if MODE == "huge_len":
    send({"id": rid, "exit_code": 0, "len": 3_500_000_000})
    while True:
        out.write(b"\xaa" * (1 << 20)); out.flush()
elif MODE == "garbage":
    while True:
        out.write(b"\xaa" * (1 << 16)); out.flush()
elif MODE == "random":
    while True:
        out.write(os.urandom(1 << 16)); out.flush()
elif MODE == "wrong_id":
    send({"id": rid + 7, "exit_code": 0, "stdout": "forged"})
elif MODE == "not_json":
    out.write(b"{this is not json\n"); out.flush()
elif MODE == "bad_fields":
    send({"id": rid, "exit_code": "zero", "stdout": {"a": 1}})
elif MODE == "negative_len":
    send({"id": rid, "exit_code": 0, "len": -5})
elif MODE == "big_frame":
    send({"id": rid, "data": 1, "len": 64 << 20})
elif MODE == "endless_frames":
    while True:
        send({"id": rid, "data": 1, "len": 1 << 20}, b"\0" * (1 << 20))
elif MODE == "pax_bomb":
    import tarfile
    info = tarfile.TarInfo("././@PaxHeader")
    info.type = tarfile.XHDTYPE
    info.size = 3_500_000_000
    header = info.tobuf(tarfile.USTAR_FORMAT)
    send({"id": rid, "data": 1, "len": len(header)}, header)
    while True:
        send({"id": rid, "data": 1, "len": 1 << 20}, b"7" * (1 << 20))
import time
time.sleep(3600)
"""

_CASES = {
    "huge_len": ("exec", "a payload of 3500000000 bytes where at most 0"),
    "garbage": ("exec", "header line"),
    "random": ("exec", "not JSON"),
    "wrong_id": ("exec", "while 1 was in flight"),
    "not_json": ("exec", "not JSON"),
    "bad_fields": ("exec", "invalid fields"),
    "negative_len": ("exec", "not a count"),
    "big_frame": ("export", "at most 1048576 may follow"),
    "endless_frames": ("export", "more than"),
    "pax_bomb": ("export", "metadata header of 3500000000 bytes"),
}


@pytest.fixture
def hostile_helper(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    import sandbox.protocol as P

    src = _HOSTILE.encode()
    monkeypatch.setattr(P, "boot_payload", lambda tag: b"src %d\n" % len(src) + src)
    yield


@pytest.mark.parametrize("mode", sorted(_CASES))
def test_a_subverted_helper_cannot_make_the_host_allocate_or_stall(
    backend: str,
    mode: str,
    hostile_helper: None,
    tmp_path: Path,
    test_run_id: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from sandbox.archive import CopyLimits

    run_id = f"{test_run_id}-hostile-{backend}-{mode}"
    what, words = _CASES[mode]
    sb = open_sandbox(_config(backend, run_id, env={"HOSTILE_MODE": mode}))
    try:
        sb.copy_limits = CopyLimits(max_bytes=8 << 20, max_files=100)  # type: ignore[attr-defined]
        tracemalloc.start()
        try:
            with pytest.raises(SandboxError) as err:
                if what == "exec":
                    sb.exec("echo hi", timeout=30)
                else:
                    sb.copy_out("/testbed", tmp_path / "export")
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert words in str(err.value), str(err.value)
        assert "protocol violation" in str(err.value) or mode == "pax_bomb", str(err.value)
        assert peak < 64 << 20, f"the host allocated {peak >> 20} MB for {mode}"
        assert getattr(sb, "closed")  # noqa: B009 - removed at once, not waited on
        assert "removal failed" not in caplog.text  # the engine was not left waiting on it
        assert containers_of(run_id) == [] and bwrap_sandboxes_of(run_id) == []
    finally:
        sb.close()


def test_the_helper_reads_nothing_for_the_sandbox_it_could_not_read_itself(
    backend: str, layer: str, tmp_path: Path, test_run_id: str
) -> None:
    """The host reads files on the model's behalf (the editor's `view`, the answer file):
    pointed at PID 1's own /proc files, directly or through symlinks, it gets nothing."""
    marker = "sandflow-helper-env-" + os.urandom(4).hex()
    run_id = f"{test_run_id}-deputy-{backend}-{layer}"
    with open_sandbox(_config(backend, run_id, env={"DEPUTY_MARKER": marker})) as sb:
        targets = ["/proc/1/environ", "/proc/1/mem", "/proc/1/fd/1", "/proc/self/environ"]
        links = " && ".join(f"ln -s {t} /testbed/output/l{i}" for i, t in enumerate(targets))
        sb.exec(f"mkdir -p /testbed/output && {links} && echo 42 > /testbed/output/answer.txt")
        for path in targets + [f"/testbed/output/l{i}" for i in range(len(targets))]:
            try:
                data = sb.read_file(path)
            except (OSError, ValueError) as e:
                assert marker not in str(e)
                continue
            assert marker.encode() not in data, path  # /proc/self: the reader, not PID 1
            assert path.endswith(("self/environ", "l3")), f"{path} was readable: {data[:80]!r}"
        files = sb.copy_out("/testbed/output", tmp_path / "export")
        assert [p.name for p in files] == ["answer.txt"]
        assert files.summary.skipped == {"symlink": 4}
        assert sb.exec("echo alive").stdout == "alive\n"
