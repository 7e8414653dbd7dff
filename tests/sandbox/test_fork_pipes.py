"""The fork by pipes (sandbox/fork.py, fork_by_pipes), on both backends: GNU tar in the
parent writes straight into GNU tar in the child over a pipe whose ends the host passes to
the helpers (bwrap: over each helper's control socket; docker: over its side channel).

What the parent sends is hostile: the tests below play a subverted parent (the test holds
the pipe's write end the child's tar reads) and check that a forged archive writes
nothing outside the child's writable places nor through a symlink it planted, that an
archive bigger than the child's places fills them and no more, that a silent or endless
stream ends at the deadline, and that the child stays usable after each. The host holds
no byte of the archive (its relay is never called) and the control socket that carries
the pipe ends is out of the sandbox user's reach.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import tarfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from sandbox import SandboxConfig, SandboxLimits, open_sandbox
from sandbox import fork as fork_mod
from sandbox.archive import CopyLimits
from sandbox.fork import ForkError
from tests.sandbox.test_fork import _tar

SHAPE = r"""
mkdir -p /testbed/src/deep/er /testbed/src/two /home/sandbox/.cfg /tmp/t && cd /testbed/src
for i in $(seq 200); do head -c $((i * 37)) /dev/urandom > /testbed/src/f$i; done
echo cfg > /home/sandbox/.cfg/x; ln -s f1 /testbed/src/link; ln /testbed/src/f2 /testbed/src/hard
printf x > "/tmp/t/$(printf 'new\nline')"; echo s > /testbed/src/deep/er/locked; mkfifo /tmp/t/fifo
echo 2 > two/x; touch -d '2001-02-03 04:05:06' . deep deep/er two /home/sandbox/.cfg /tmp/t
chmod 000 /testbed/src/deep/er/locked; chmod 500 /testbed/src/deep/er; chmod 000 /testbed/src/deep
export CARRIED=yes; umask 027; (exit 4)
"""
LOOK = (
    "cd /; stat -c '%n %a %s %h %Y' testbed/src/f1 testbed/src/f200 testbed/src/hard "
    "home/sandbox/.cfg/x; stat -c '%n %a' testbed/src/deep; "
    "find /testbed /home/sandbox /tmp ! -type p ! -type d -printf '%p %m %y %s\\n' -o -type d -printf '%p %m\\n' "
    "| sort | md5sum; "
    # folders' times: the walk names a folder's contents after its siblings
    "find /testbed /home/sandbox /tmp -mindepth 1 -type d -printf '%p %TY\\n' | sort; "
    "readlink /testbed/src/link"
)


def _maker(backend: str, test_run_id: str) -> Iterator[Callable[..., Any]]:
    opened: list[Any] = []

    def open_one(episode: str, tmp_size_mb: int = 64) -> Any:
        limits = SandboxLimits(memory_mb=512, pids=128, tmp_size_mb=tmp_size_mb)
        sb = open_sandbox(
            SandboxConfig(backend=backend, run_id=test_run_id, episode_id=episode, limits=limits)
        )
        opened.append(sb)
        return sb

    yield open_one
    for sb in opened:
        sb.close()


@pytest.fixture(params=["bwrap", "docker"])
def make(request: pytest.FixtureRequest, test_run_id: str) -> Iterator[Callable[..., Any]]:
    request.getfixturevalue("sandbox_rootfs" if request.param == "bwrap" else "sandbox_image")
    yield from _maker(request.param, test_run_id)


@pytest.fixture
def make_bwrap(sandbox_rootfs: str, test_run_id: str) -> Iterator[Callable[..., Any]]:
    yield from _maker("bwrap", test_run_id)


def _no_relay(*_: object) -> None:
    raise AssertionError("the fork's bytes went through the host")


def test_a_fork_goes_by_pipes_and_equals_its_parent(
    make: Callable[..., Any], monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    parent = make("pipes-parent")
    assert parent.ctl is not None or parent.bulk.enabled
    assert parent.exec(SHAPE).exit_code == 4
    monkeypatch.setattr(fork_mod, "stream_files", _no_relay)
    given = make("pipes-given")
    children = parent.fork(1, children=[given]) + parent.fork(1)
    request.addfinalizer(children[1].close)  # the one the fork opened
    want = parent.exec(LOOK)
    assert "testbed/src/deep 0\n" in want.stdout, want
    assert "/testbed/src/deep 2001\n/testbed/src/two 2001\n" in want.stdout, want
    for child in children:
        assert child.exec("echo $?").stdout == "4\n"
        assert child.exec("pwd; umask; echo $CARRIED").stdout == "/testbed/src\n0027\nyes\n"
        assert child.exec(LOOK).stdout == want.stdout
        assert child.fork_info.skipped.get("special") == 1  # the fifo
        assert child.fork_info.entries > 200
    # the parent's locked entries are locked again, and nothing of the fork runs on
    assert parent.exec(LOOK).stdout == want.stdout
    assert "tar" not in parent.exec("ps -eo args").stdout


def test_the_control_socket_is_out_of_the_sandbox_users_reach(
    make_bwrap: Callable[..., Any],
) -> None:
    sb = make_bwrap("pipes-ctl")
    r = sb.exec(
        "ls /proc/1/fd 2>&1 | head -1; for p in /proc/[0-9]*; do ls -l $p/fd 2>/dev/null; done "
        "| grep -c socket"
    )
    assert "Permission denied" in r.stdout and r.stdout.endswith("\n0\n"), r.stdout


def _as_parent(child: Any, feed: Callable[[int], None], max_seconds: float = 30.0) -> dict:
    """Play a subverted parent: the child's fork_recv gets a pipe whose write end `feed`
    writes (and closes, or keeps open); then the child's account (fork_wait)."""
    r, w = os.pipe()
    msg = {"op": "fork_recv", "token": secrets.token_hex(8), "max_seconds": max_seconds}
    try:
        started = fork_mod._answer(fork_mod._send_with_fds(child, msg, [r]), time.monotonic() + 10)
        os.close(r)
        r = -1
        assert started.get("ok") is True, started
        feed(w)
        end, _ = child._helper_call({"op": "fork_wait", "side": "recv"})
        return end
    finally:
        for fd in (r, w):
            if fd >= 0:
                with contextlib.suppress(OSError):  # the feed closed it
                    os.close(fd)


def _write(blob: bytes) -> Callable[[int], None]:
    def feed(w: int) -> None:
        try:
            for at in range(0, len(blob), 1 << 16):
                os.write(w, blob[at : at + (1 << 16)])
        except BrokenPipeError:  # the child's tar gave up early
            pass
        os.close(w)

    return feed


LEAKS = "for p in /home/sandbox/x /etc/x /x /tmp/x /testbed/x; do [ -e $p ] && echo LEAK $p; done"


@pytest.mark.parametrize(
    ("members", "refused"),
    [
        ([("testbed/l", b"", "sym:/home/sandbox"), ("testbed/l/x", b"owned", "")], True),
        ([("testbed/l", b"", "sym:../home/sandbox"), ("testbed/l/x", b"owned", "")], True),
        ([("testbed/../home/sandbox/x", b"owned", "")], True),
        ([("/home/sandbox/x", b"owned", "")], True),
        ([("etc/x", b"owned", "")], True),
        ([("x", b"owned", "")], True),
        ([("testbed/h", b"", "hard:etc/passwd")], True),
        (
            [
                ("testbed/d", b"", "dir"),
                ("testbed/d", b"", "sym:/home/sandbox"),
                ("testbed/d/x", b"owned", ""),
            ],
            True,
        ),  # fmt: skip
        ([("testbed/dev", b"", "chr")], True),
    ],
    ids=[
        "through-abs-symlink",
        "through-rel-symlink",
        "dotdot",
        "absolute",
        "outside",
        "top-level",
        "hardlink-out",
        "dir-to-symlink",
        "device",
    ],  # fmt: skip
)
def test_a_child_writes_nothing_a_forged_archive_aims_outside(
    members: list, refused: bool, make: Callable[..., Any]
) -> None:
    child = make("pipes-forged")
    end = _as_parent(child, _write(_tar(*members)))
    assert (end.get("ok") is not True) == refused, end
    r = child.exec(
        LEAKS + "; ls /testbed/d 2>/dev/null; ls -l /testbed/h 2>/dev/null; ls /dev | wc -l"
    )
    assert "LEAK" not in r.stdout, r.stdout
    assert "passwd" not in r.stdout
    assert child.exec("echo alive").stdout == "alive\n"  # the channel stays in step
    assert child.reset() == []  # and a pool's reset still proves it clean


def test_an_archive_bigger_than_the_childs_places_fills_them_and_no_more(
    make: Callable[..., Any],
) -> None:
    child = make("pipes-big", tmp_size_mb=16)
    big = tarfile.TarInfo("testbed/big")
    big.size = 64 << 20
    head = big.tobuf(tarfile.GNU_FORMAT)

    def feed(w: int) -> None:
        try:
            os.write(w, head)
            zeros = bytes(1 << 16)
            for _ in range(big.size // len(zeros)):
                os.write(w, zeros)
        except BrokenPipeError:
            pass
        os.close(w)

    end = _as_parent(child, feed)
    assert end.get("ok") is not True, end
    assert "No space left" in str(end.get("error")) or "Wrote only" in str(end.get("error"))
    used = int(child.exec("du -sk /testbed | cut -f1").stdout)
    assert used <= 16 * 1024, used
    assert child.reset() == []


@pytest.mark.parametrize("kind", ["silent", "endless"])
def test_a_silent_or_endless_stream_ends_at_the_deadline(
    kind: str, make: Callable[..., Any]
) -> None:
    child = make("pipes-stall")
    held: list[int] = []

    def feed(w: int) -> None:
        held.append(w)  # kept open: the child's tar never sees the end
        if kind == "endless":  # members that keep overwriting one small file
            one = _tar(("testbed/again", b"x" * 100, ""))[:1024]  # no end of archive
            os.set_blocking(w, False)
            try:
                for _ in range(2000):
                    os.write(w, one)
            except BlockingIOError:
                pass

    t0 = time.monotonic()
    end = _as_parent(child, feed, max_seconds=1.5)
    assert end.get("ok") is not True and "time limit" in str(end.get("error")), end
    assert time.monotonic() - t0 < 15
    assert child.exec("echo alive").stdout == "alive\n"
    assert child.reset() == []


def test_over_a_bound_the_pipes_fork_stops_and_given_children_are_wiped(
    make: Callable[..., Any],
) -> None:
    parent = make("pipes-bound")
    parent.exec("head -c 3000000 /dev/zero > /tmp/big; mkdir /testbed/m; touch /testbed/m/{1..80}")
    given = make("pipes-bound-given")
    parent.copy_limits = CopyLimits(max_files=50)
    with pytest.raises(ForkError, match="50 entries"):
        parent.fork(1, children=[given])
    parent.copy_limits = CopyLimits(max_bytes=1 << 20)
    with pytest.raises(ForkError, match="1048576 bytes"):
        parent.fork(1, children=[given])
    assert not given.closed
    assert given.exec("ls -A /testbed /tmp | grep -v : | wc -w").stdout == "0\n"
    parent.copy_limits = CopyLimits()
    (child,) = parent.fork(1, children=[given])
    assert child.exec("stat -c %s /tmp/big; ls /testbed/m | wc -l").stdout == "3000000\n80\n"


def test_a_stale_pipe_end_is_dropped_and_the_next_fork_works(
    make_bwrap: Callable[..., Any],
) -> None:
    parent, child = make_bwrap("pipes-stale-parent"), make_bwrap("pipes-stale-child")
    parent.exec("echo v > /testbed/v")
    r, w = os.pipe()
    socket.send_fds(child.ctl, [b"0123456789abcdef"], [r])  # a request that never came
    os.close(r)
    os.close(w)
    (c,) = parent.fork(1, children=[child])
    assert c.exec("cat /testbed/v").stdout == "v\n"


def test_a_member_under_no_place_is_skipped_beside_real_ones(make: Callable[..., Any]) -> None:
    """An archive with every place of the child (so tar's member names all match) and
    members outside them: those are not extracted, the rest is."""
    child = make("pipes-mixed")
    places = child.exec(  # the helper's wipe_roots(): the places the sandbox user can write
        "for d in /testbed /home/sandbox /tmp /dev/shm /dev/mqueue /var/tmp /run /run/lock; "
        "do [ -d $d ] && [ -w $d ] && echo ${d#/}; done"
    )
    members = [(p, b"", "dir") for p in places.stdout.split()]
    members += [("etc/x", b"owned", ""), ("x", b"owned", ""), ("proc/x", b"owned", "")]
    members += [("testbed/ok", b"fine", "")]
    end = _as_parent(child, _write(_tar(*members)))
    assert end.get("ok") is True, end
    assert child.exec("cat /testbed/ok").stdout == "fine"
    r = child.exec(LEAKS + "; [ -e /proc/x ] && echo LEAK /proc/x; true")
    assert "LEAK" not in r.stdout, r.stdout
