"""A docker fork's side channel (sandbox/bulk.py): its bytes skip the engine's attach proxy.

The channel must be out of the sandbox user's reach (it could forge what a parent sends or
read what a child gets), bounded like the attach stream against a subverted helper, off
without privilege separation, and a helper that cannot reach it must fork as before.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sandbox import SandboxConfig, SandboxLimits, open_sandbox
from sandbox import fork as fork_mod
from sandbox.archive import CopyLimits
from sandbox.base import SandboxError
from sandbox.bulk import MOUNT, BulkDir, remove_leftovers
from sandbox.common import SANDBOX_UID

SHAPE = (
    "mkdir -p /testbed/d && for i in $(seq 50); do head -c 3000 /dev/urandom > /testbed/d/$i; "
    "done; echo kept > /tmp/t; export FORKED=yes; cd /testbed/d"
)
LOOK = "cd /testbed/d && cat * | md5sum; cat /tmp/t; echo $FORKED; pwd"


@pytest.fixture
def config(sandbox_image: str, test_run_id: str) -> Iterator[Any]:
    def make(episode: str, **env: str) -> SandboxConfig:
        limits = SandboxLimits(memory_mb=512, pids=128, tmp_size_mb=64)
        return SandboxConfig(
            backend="docker", run_id=test_run_id, episode_id=episode, limits=limits, env=env
        )

    yield make


def _open(config: SandboxConfig) -> Any:
    return open_sandbox(config)


# Run as the sandbox user, told the live socket's name (as if it had leaked): every way
# toward the side channel it can think of, each write a forged fork frame.
_ATTACK = r"""
import errno, json, os, socket, sys
name = sys.argv[1]
FORGED = json.dumps({"id": 1, "data": 1, "len": 3_500_000_000}).encode() + b"\n"
out = {}
def attempt(what, fn):
    try:
        out[what] = "OK " + repr(fn())[:80]
    except OSError as e:
        out[what] = "refused " + errno.errorcode.get(e.errno, str(e.errno))
def connect(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(2)
    s.connect(path)
    return s.send(FORGED)
def create(path):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.close(fd)
for base in ("/.sandflow-bulk", "/proc/1/root/.sandflow-bulk", "/proc/self/root/.sandflow-bulk"):
    attempt(f"list {base}", lambda b=base: os.listdir(b))
    attempt(f"stat {base}/{name}", lambda b=base: os.stat(f"{b}/{name}").st_mode)
    attempt(f"connect {base}/{name}", lambda b=base: connect(f"{b}/{name}"))
    attempt(f"open {base}/{name}", lambda b=base: os.open(f"{b}/{name}", os.O_RDWR))
    attempt(f"create {base}/x", lambda b=base: create(f"{b}/x"))
    attempt(f"unlink {base}/{name}", lambda b=base: os.unlink(f"{b}/{name}"))
    attempt(f"bind {base}/mine", lambda b=base: socket.socket(socket.AF_UNIX).bind(f"{b}/mine"))
attempt("chmod /.sandflow-bulk", lambda: os.chmod("/.sandflow-bulk", 0o777))
print(json.dumps(out))
"""


def test_the_sandbox_user_cannot_reach_the_side_channel_and_a_fork_takes_it(config: Any) -> None:
    with _open(config("bulk-parent")) as parent, _open(config("bulk-child")) as child:
        assert isinstance(parent.bulk, BulkDir) and isinstance(child.bulk, BulkDir)
        st = os.stat(parent.bulk.path)
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid() != SANDBOX_UID
        assert parent.exec(f"grep -c ' {MOUNT} ' /proc/self/mountinfo").stdout == "1\n"
        listener = parent.bulk.listen()
        assert listener is not None
        try:
            parent.write_file("/tmp/attack.py", _ATTACK)
            r = parent.exec(f"python3 /tmp/attack.py {listener.name}", timeout=60)
            assert r.exit_code == 0, r.stderr
            tried = json.loads(r.stdout)
            assert len(tried) == 22, tried
            reached = {k: v for k, v in tried.items() if not v.startswith("refused")}
            assert reached == {}, f"the sandbox user reached the side channel: {reached}"
            # nothing is queued on the host's socket: no connection got through
            listener.sock.settimeout(0.5)
            with pytest.raises(TimeoutError):
                listener.sock.accept()
        finally:
            listener.close()
        assert os.listdir(parent.bulk.path) == [], "a socket file was left"
        # a fork takes it, both ways, and carries the files and the shell
        assert parent.exec(SHAPE).exit_code == 0
        parent.fork(1, children=[child])
        assert parent.bulk.taken == 1 and child.bulk.taken == 1
        assert child.exec(LOOK).stdout == parent.exec(LOOK).stdout
        (fresh,) = parent.fork(1)
        with fresh:
            assert fresh.bulk is not None and fresh.bulk.taken == 1
            assert fresh.exec(LOOK).stdout == parent.exec(LOOK).stdout
        folder = child.bulk.path
    assert not os.path.exists(folder), "the side channel's folder outlived its sandbox"


def test_without_privilege_separation_there_is_no_side_channel(
    config: Any, host_settings: Any
) -> None:
    """The helper is then the sandbox user's uid: anything it can reach, the user can."""
    host_settings(privsep=False)
    with _open(config("bulk-off")) as parent, _open(config("bulk-off-child")) as child:
        assert parent.bulk is None and child.bulk is None
        assert parent.exec(f"ls -d {MOUNT} 2>&1").exit_code != 0
        assert parent.exec(SHAPE).exit_code == 0
        parent.fork(1, children=[child])
        assert child.exec(LOOK).stdout == parent.exec(LOOK).stdout


def test_a_helper_that_cannot_reach_the_side_channel_forks_over_the_attach_stream(
    config: Any, tmp_path: Any
) -> None:
    """An engine whose binds are not our folders (another mount namespace, rootless): the
    helper finds no socket, says so, and the fork goes the old way."""
    with _open(config("bulk-miss")) as parent, _open(config("bulk-miss-child")) as child:
        assert parent.exec(SHAPE).exit_code == 0
        mounted = {}
        for sb in (parent, child):  # the host now listens where no container looks
            moved = tmp_path / sb.name
            moved.mkdir(mode=0o700)
            mounted[sb.name], sb.bulk.path = sb.bulk.path, str(moved)
        try:
            parent.fork(1, children=[child])
            assert child.exec(LOOK).stdout == parent.exec(LOOK).stdout
            assert parent.bulk.taken == child.bulk.taken == 0
            assert not parent.bulk.enabled and not child.bulk.enabled  # not offered again
            assert parent.bulk.listen() is None
            assert child.reset() == []
            parent.fork(1, children=[child])
            assert child.exec(LOOK).stdout == parent.exec(LOOK).stdout
        finally:
            for sb in (parent, child):
                sb.bulk.path = mounted[sb.name]


def _long_folder(under: Path) -> Path:
    """A folder whose socket paths pass the 107 bytes of a unix socket's address (a
    cluster's TMPDIR such as /scratch/slurm/job-123456/...)."""
    long = under / ("t" * 70)
    long.mkdir()
    assert len(os.fsencode(long)) + len("/sandflow-bulk-1-abcdefgh/") + 37 > 107
    return long


def test_the_side_channel_listens_in_a_folder_of_any_length(tmp_path: Path) -> None:
    """The host binds through a descriptor of the folder: its path's length does not matter;
    the socket is in the folder, 0600, and a connection through it reaches the listener."""
    base = _long_folder(tmp_path)
    folder = BulkDir(base=str(base))
    try:
        assert os.path.dirname(folder.path) == str(base)
        listener = folder.listen()
        assert listener is not None and folder.enabled
        st = os.stat(listener.path)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        assert len(os.fsencode(listener.path)) > 107
        # the helper's side, from the host: a connection by the socket's own file
        fd = os.open(folder.path, os.O_PATH | os.O_DIRECTORY)
        helper = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            helper.connect(f"/proc/self/fd/{fd}/{listener.name}")
            side = listener.accept()
            helper.sendall(b"frame")
            assert side.recv(5.0) == b"frame"
            side.send(b"back")
            assert helper.recv(16) == b"back"
            side.close()
        finally:
            helper.close()
            os.close(fd)
        assert folder.taken == 1 and os.listdir(folder.path) == []
    finally:
        folder.remove()
    # the reaper's sweep of a dead owner's folders looks where they were made
    left = BulkDir(base=str(base))
    remove_leftovers(os.getpid(), str(base))
    assert not os.path.exists(left.path)


_LONG_TMPDIR_FORK = r"""
import json, sys
from sandbox import SandboxConfig, SandboxLimits, open_sandbox
from sandbox import fork as fork_mod
run_id, shape, look = sys.argv[1:4]
def cfg(episode):
    limits = SandboxLimits(memory_mb=512, pids=128, tmp_size_mb=64)
    return SandboxConfig(backend="docker", run_id=run_id, episode_id=episode, limits=limits)
with open_sandbox(cfg("long-parent")) as parent, open_sandbox(cfg("long-child")) as child:
    assert parent.exec(shape).exit_code == 0
    parent.fork(1, children=[child])
    print(json.dumps({
        "folders": [parent.bulk.path, child.bulk.path],
        "taken": [parent.bulk.taken, child.bulk.taken],
        "same": child.exec(look).stdout == parent.exec(look).stdout,
    }))
"""


@pytest.mark.usefixtures("sandbox_image")
def test_a_fork_takes_the_side_channel_under_a_long_tmpdir(test_run_id: str, tmp_path: Path) -> None:
    """A process whose TMPDIR is long (its folders are made there): the fork still goes
    over the side channel, both ways, not over the attach stream."""
    tmpdir = _long_folder(tmp_path)
    repo = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "TMPDIR": str(tmpdir), "PYTHONPATH": repo}
    r = subprocess.run(
        [sys.executable, "-c", _LONG_TMPDIR_FORK, f"{test_run_id}-longtmp", SHAPE, LOOK],
        capture_output=True, text=True, timeout=300, cwd=repo, env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert all(os.path.dirname(f) == str(tmpdir) for f in out["folders"]), out
    assert out["taken"] == [1, 1] and out["same"], out
    assert os.listdir(tmpdir) == [], "a side channel's folder outlived its sandbox"


# A subverted parent helper: answers the shell dump, then on the fork's export takes the
# side channel (it runs as uid 0, as the real helper) and sends what `mode` says over it.
_HOSTILE = r"""
import json, os, socket, sys
MODE = os.environ.get("HOSTILE_MODE", "")
out = sys.stdout.buffer
def send(f, obj, payload=b""):
    f.write(json.dumps(obj).encode() + b"\n" + payload)
    f.flush()
send(out, {"ready": True, "pid": 1, "boot": 0, "privsep": True, "dumpable": 0, "uid": 0})
while True:
    req = json.loads(sys.stdin.buffer.readline())
    rid = req["id"]
    if req.get("op") != "fork_get":
        send(out, {"id": rid, "exit_code": 0, "stdout": "#@script\n", "stderr": ""})
        continue
    s = socket.socket(socket.AF_UNIX)
    s.connect("/.sandflow-bulk/" + req["bulk"])
    side = s.makefile("wb")
    send(out, {"id": rid, "bulk": 1})
    if MODE == "huge_len":
        send(side, {"id": rid, "data": 1, "len": 3_500_000_000})
        while True:
            side.write(b"\xaa" * (1 << 20)); side.flush()
    elif MODE == "garbage":
        while True:
            side.write(b"\xaa" * (1 << 16)); side.flush()
    elif MODE == "endless_frames":
        while True:
            send(side, {"id": rid, "data": 1, "len": 1 << 20}, b"\0" * (1 << 20))
    elif MODE == "wrong_id":
        send(side, {"id": rid + 7, "ok": True, "summary": {}})
    elif MODE == "second_switch":
        send(side, {"id": rid, "bulk": 1})
    elif MODE == "stdout_after_switch":
        send(out, {"id": rid, "ok": True, "summary": {}})
        import time; time.sleep(3600)
    import time; time.sleep(3600)
"""

_CASES = {
    "huge_len": "a payload of 3500000000 bytes where at most 1048576",
    "garbage": "header line",
    "endless_frames": "more than",
    "wrong_id": "was in flight",
    "second_switch": "an unexpected side channel message",
    # the helper went quiet on the side channel: the stream's idle bound ends it
    "stdout_after_switch": "stalled",
    # the fork by pipes (the default road): the parent's helper answers the offer with junk
    "pipes_junk": "an unexpected answer to a side channel offer",
}


@pytest.mark.parametrize("mode", sorted(_CASES))
def test_a_subverted_parent_on_the_side_channel_is_bounded(
    mode: str, config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sandbox.protocol as P

    if mode == "stdout_after_switch":
        monkeypatch.setattr(P, "STREAM_IDLE_S", 3.0)
    if mode != "pipes_junk":  # the side channel's stream (fork_get), not the pipes' road
        monkeypatch.setattr(fork_mod, "_takes_pipes", lambda box: False)
    with _open(config("bulk-given")) as child:
        child.exec("echo before > /tmp/mine")
        src = _HOSTILE.encode()
        with monkeypatch.context() as m:
            m.setattr(P, "boot_payload", lambda tag: b"src %d\n" % len(src) + src)
            parent = _open(config("bulk-hostile", HOSTILE_MODE=mode))
        try:
            parent.copy_limits = CopyLimits(max_bytes=8 << 20, max_files=100)
            tracemalloc.start()
            try:
                with pytest.raises(SandboxError) as err:
                    parent.fork(1, children=[child])
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            assert _CASES[mode] in str(err.value), str(err.value)
            assert peak < 64 << 20, f"the host allocated {peak >> 20} MB for {mode}"
            assert parent.closed, "a parent that broke its channel must be removed"
            # the given child got nothing usable: it was wiped back to fresh and still works
            assert not child.closed
            assert child.exec("cat /tmp/mine 2>&1; echo alive").stdout.endswith("alive\n")
            assert "before" not in child.exec("cat /tmp/mine 2>&1").stdout
        finally:
            parent.close()


def test_gc_removes_the_side_channel_folders_of_dead_processes_only(tmp_path: Path) -> None:
    """Owner and watchdog both gone (kill -9 of both, a /tmp that outlived a reboot): `sandbox
    gc` removes the folders named with a pid that no longer runs; a live owner's folder,
    another name, and a symlink named like one (its target) stay."""
    from sandbox import gc as G

    base = _long_folder(tmp_path)
    repo = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": repo, "TMPDIR": str(base)}
    made = subprocess.run(  # a real leftover: its owner made it and is gone
        [sys.executable, "-c", "from sandbox.bulk import BulkDir; print(BulkDir().path)"],
        capture_output=True, text=True, timeout=60, cwd=repo, env=env, check=True,
    ).stdout.strip()  # fmt: skip
    dead = Path(made)
    assert dead.parent == base and dead.is_dir()
    live_dir = BulkDir(base=str(base))  # ours: this process runs
    live = Path(live_dir.path)
    other = base / "sandflow-bulkish-1-x"
    other.mkdir()
    target = tmp_path / "target"
    target.mkdir()
    link = base / f"sandflow-bulk-{dead.name.split('-')[2]}-link"
    link.symlink_to(target)
    # the command, without an engine and with --dry-run: names it, removes nothing
    r = subprocess.run(
        [sys.executable, "-m", "sandflow.cli", "sandbox", "gc", "--dry-run",
         "--docker-host", f"unix://{tmp_path}/no-engine.sock"],
        capture_output=True, text=True, timeout=120, cwd=repo, env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "would remove 1 fork side channel folder(s) of dead processes" in r.stdout, r.stdout
    assert f"  {dead}\n" in r.stdout and dead.exists()
    assert G.collect_bulk(base=str(base)) == [str(dead)]
    assert not dead.exists()
    assert live.is_dir() and other.is_dir() and link.is_symlink() and target.is_dir()
    live_dir.remove()
