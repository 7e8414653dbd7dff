"""Fork a live sandbox (issue #25): the reset battery turned around, on both backends,
and on bwrap with copy-on-write volumes (sandbox/volumes.py: a fork is a btrfs snapshot).

A parent is shaped (files in every writable place, locked folders, links, odd names,
variables, functions, aliases, traps, options, umask, ulimits, cwd, $?) and forked. Every
probe of the reset battery that a fork carries must observe in each child what it observes
in the parent, and something else than in a fresh sandbox (so the probe can fail). Then
the children are changed: their siblings and the parent must not see it. Processes are not
carried and the child says so; the limits hold against what the sandbox wrote.
"""

from __future__ import annotations

import io
import tarfile
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from sandbox import SandboxConfig, open_sandbox, registry
from sandbox import settings as sandbox_settings
from sandbox.archive import CopyLimits
from sandbox.fork import ForkError
from tests.sandbox.conftest import BACKENDS, config_maker
from tests.sandbox.test_pool_reset import PROBES

VOLUMES = "bwrap-volumes"  # bwrap, its places on btrfs volumes: forks are snapshots


@pytest.fixture(scope="module", params=[*BACKENDS, VOLUMES])
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "docker":
        request.getfixturevalue("sandbox_image")
        yield "docker"
        return
    request.getfixturevalue("sandbox_rootfs")
    if request.param != VOLUMES:
        yield "bwrap"
        return
    previous = sandbox_settings.configure(bwrap_volumes=request.getfixturevalue("bwrap_volumes"))
    try:
        yield "bwrap"
    finally:
        sandbox_settings.configure(previous)


@pytest.fixture(scope="module")
def make_config(backend: str, test_run_id: str) -> Callable[..., SandboxConfig]:
    return config_maker(backend, test_run_id)


def _on_volumes(sb: Any) -> bool:
    return getattr(sb, "volumes", None) is not None


# the probes whose subject a fork carries (docs/sandbox.md, "Fork")
CARRIED = (
    "cwd",
    "environment",
    "shell_variables",
    "shell_functions_aliases_traps",
    "shell_options",
    "umask",
    "rlimits",
    "writable_places_tree",
)

SHAPE = r"""
mkdir -p /testbed/src/pkg /home/sandbox/.cache/x /tmp/deep /testbed/locked/in
for i in $(seq 40); do printf 'line %s\n' $i > /testbed/src/pkg/m$i.py; done
head -c 300000 /dev/urandom > /testbed/blob.bin; chmod 755 /testbed/src/pkg/m1.py
d=/tmp/deep; for i in $(seq 30); do d=$d/dddddddddd; done; mkdir -p $d && touch $d/leaf
echo inner > /testbed/locked/in/f; echo s > /testbed/nope; chmod 000 /testbed/nope; chmod 500 /testbed/locked/in; chmod 000 /testbed/locked
echo 'echo hi' > /home/sandbox/.bashrc; echo cmd >> /home/sandbox/.bash_history
ln -s /etc/passwd /testbed/link; ln -s src/pkg /testbed/rel; ln /testbed/blob.bin /testbed/hard
printf x > /tmp/$'we\nird name'; : > /tmp/.hidden; printf 'x%.0s' $(seq 5000) > /tmp/spaced\ name
@SHM@
[ -w /var/tmp ] && echo v > /var/tmp/left
cd /testbed/src && export LEFT=1 PATH=/testbed/bin:$PATH MULTI=$'a\nb' && unset LANG
plain='not exported'; declare -a arr=(1 'two words' 3); declare -A map=([k]=v); declare -i n=41
f() { echo "f:$1"; }; g() { f "$@"; }; export -f g; alias ll='ls -l'
set -o noclobber; shopt -s extglob; trap 'echo bye' EXIT; umask 077; ulimit -S -n 100
ulimit -H -c 0
(exit 3)
"""


SHM_LINE = "head -c 100000 /dev/zero > /dev/shm/blob"
SHAPE = SHAPE.replace("@SHM@", SHM_LINE)


def _open(config: SandboxConfig) -> Any:
    """open_sandbox() typed as what it returns here (a HelperSandbox: fork, reset, copy_limits)."""
    return open_sandbox(config)


def _observe(sb: object) -> dict[str, str]:
    out = {}
    for name in CARRIED:
        r = sb.exec(PROBES[name], timeout=30)  # type: ignore[attr-defined]
        out[name] = f"{r.exit_code}\n{r.stdout}\n{r.stderr}"
    return out


@pytest.fixture
def shaped(make_config: Callable[..., SandboxConfig]):
    opened: list = []
    parent = _open(make_config("fork-parent"))
    opened.append(parent)
    script = SHAPE
    if _on_volumes(parent):  # /dev/shm is outside the volume: a parent holding something
        # there forks by pipes (test_volumes.py); this battery is the snapshot's
        script = SHAPE.replace(SHM_LINE, "")
    r = parent.exec(script, timeout=60)
    assert r.exit_code == 3, r.stderr
    yield parent, opened
    for sb in opened:
        sb.close()


def test_each_child_sees_every_trace_the_parent_leaves(
    shaped: tuple, make_config: Callable[..., SandboxConfig]
) -> None:
    parent, opened = shaped
    with _open(make_config("fork-fresh")) as fresh:
        expected_fresh = _observe(fresh)
    status = parent.exec("echo $?").stdout  # the shaping's last status, kept by the probe
    assert status == "3\n"
    before = _observe(parent)
    same_as_fresh = [p for p in CARRIED if before[p] == expected_fresh[p]]
    assert same_as_fresh == [], f"the shaping left no trace for these probes: {same_as_fresh}"
    children = parent.fork(2)
    opened += children
    assert children[0].name != children[1].name != parent.name
    if parent.backend == "docker":  # its bytes took the side channel (sandbox/bulk.py)
        assert parent.bulk.taken == 1 and [c.bulk.taken for c in children] == [1, 1]
    method = "snapshot" if _on_volumes(parent) else "pipes"
    assert [c.fork_info.method for c in children] == [method, method]
    for child in children:
        assert child.exec("echo $?").stdout == "0\n"  # as in the parent: its last `echo $?`
        seen = _observe(child)
        missed = [p for p in CARRIED if seen[p] != before[p]]
        assert missed == [], f"the child differs from its parent on: {missed}\n" + "\n".join(
            f"--- {p}\nparent: {before[p][:1500]}\nchild:  {seen[p][:1500]}" for p in missed
        )
        assert child.read_file("/testbed/blob.bin") == parent.read_file("/testbed/blob.bin")
        r = child.exec(
            'g 1; alias ll; echo "$MULTI"; '
            "echo ${arr[1]} ${map[k]} $((n+1)) $plain; stat -c %h /testbed/hard"
        )
        assert r.stdout.startswith("f:1\nalias ll='ls -l'\n"), r
        assert "a\nb\ntwo words v 42 not exported\n2\n" in r.stdout, r
    assert _observe(parent) == before, "the fork changed its parent"


def test_what_a_child_changes_its_siblings_and_parent_do_not_see(shaped: tuple) -> None:
    parent, opened = shaped
    children = parent.fork(2)
    opened += children
    a, b = children
    change = (
        "echo new > /testbed/src/new; rm /testbed/blob.bin; export LEFT=2 ONLY=a; "
        "f() { echo changed; }; umask 022; cd /tmp; echo more >> /testbed/hard; "
        "chmod 700 /testbed/locked; ulimit -S -n 50; mkfifo /tmp/p"
    )
    assert a.exec(change).exit_code == 0
    after_parent = parent.exec("echo $?").stdout
    assert after_parent == "3\n"
    look = (
        "ls /testbed/src/new /testbed/blob.bin 2>&1; echo $LEFT ${ONLY:-unset}; f x; umask; "
        "pwd; cat /testbed/hard | wc -c; stat -c %a /testbed/locked; ulimit -S -n; ls /tmp/p 2>&1"
    )
    seen = {name: sb.exec(look).stdout for name, sb in (("b", b), ("parent", parent))}
    assert seen["b"] == seen["parent"], seen
    text = seen["b"]
    assert "No such file" in text and "/testbed/blob.bin\n" in text
    assert "1 unset\nf:x\n0077\n/testbed/src\n300000\n0\n100\n" in text, text
    # and the other way round: what the parent does now, no child sees
    parent.exec("echo later > /tmp/later; export LATE=1")
    for child in children:
        assert child.exec("cat /tmp/later 2>&1; echo ${LATE:-none}").stdout.endswith("none\n")


def test_running_processes_are_not_carried_and_the_child_is_told(
    make_config: Callable[..., SandboxConfig],
) -> None:
    with _open(make_config("fork-procs")) as parent:
        parent.exec("sleep 1000 & (setsid sleep 999 &); echo started")
        (child,) = parent.fork(1)
        with child:
            info = child.fork_info
            assert info is not None and info.process_count == 2, info
            assert any("sleep 1000" in p for p in info.processes_not_carried), info
            assert "2 running processes were not carried over" in info.notice
            procs = child.exec(PROBES["processes"]).stdout
            assert "sleep" not in procs, procs
            assert "sleep 1000" in parent.exec("ps -eo args").stdout  # the parent keeps them
        (again,) = parent.fork(1)
        with again:
            assert again.fork_info is not None and again.fork_info.process_count == 2


def test_a_fork_copies_at_most_the_limit_and_leaves_no_child(
    make_config: Callable[..., SandboxConfig],
) -> None:
    with _open(make_config("fork-limits")) as parent:
        if _on_volumes(parent):
            pytest.skip("a snapshot copies nothing: tests/sandbox/test_volumes.py tests its quota")
        parent.exec(
            "head -c 2000000 /dev/zero > /tmp/big; mkdir /testbed/m; "
            "for i in $(seq 60); do : > /testbed/m/$i; done"
        )
        live = {id(s) for s in registry.live()}
        parent.copy_limits = CopyLimits(max_bytes=1 << 20)
        with pytest.raises(ForkError, match="more than a fork copies \\(1048576 bytes"):
            parent.fork(2)
        parent.copy_limits = CopyLimits(max_files=50)
        with pytest.raises(ForkError, match="50 entries"):
            parent.fork(1)
        assert {id(s) for s in registry.live()} == live, "a failed fork left a child open"
        # a given child (a pool's) got part of the stream before the bound was seen: the
        # fork fails and the child is wiped back to fresh, still usable
        with _open(make_config("fork-given")) as given:
            parent.copy_limits = CopyLimits(max_bytes=1 << 20)
            with pytest.raises(ForkError, match="more than a fork copies"):
                parent.fork(1, children=[given])
            assert not given.closed
            assert given.exec("ls /testbed/m /tmp/big 2>&1 | head -2").stdout.count("No such") == 2
        parent.copy_limits = CopyLimits()
        (child,) = parent.fork(1)
        with child:
            assert (
                child.exec("stat -c %s /tmp/big; ls /testbed/m | wc -l").stdout == "2000000\n60\n"
            )


def _tar(*members: tuple[str, bytes, str]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:", format=tarfile.PAX_FORMAT) as tar:
        for name, data, link in members:
            info = tarfile.TarInfo(name)
            if link.startswith("sym:"):
                info.type, info.linkname = tarfile.SYMTYPE, link[4:]
            elif link.startswith("hard:"):
                info.type, info.linkname = tarfile.LNKTYPE, link[5:]
            elif link == "dir":
                info.type, info.mode = tarfile.DIRTYPE, 0o755
            elif link == "chr":  # /dev/null's numbers
                info.type, info.devmajor, info.devminor = tarfile.CHRTYPE, 1, 3
            else:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if info.isfile() else None)
    return buf.getvalue()


@pytest.mark.parametrize(
    ("members", "why"),
    [
        ([("testbed/l", b"", "sym:/home/sandbox"), ("testbed/l/x", b"owned", "")], "is not one"),
        ([("testbed/../home/sandbox/x", b"owned", "")], "refusing fork member"),
        ([("etc/x", b"owned", "")], "outside every writable place"),
        ([("testbed/h", b"", "hard:etc/passwd")], "a link to nothing"),
        ([("testbed/d", b"", "dir"), ("testbed/d", b"", "sym:/home/sandbox")], "is a folder"),
    ],
    ids=["through-symlink", "dotdot", "outside", "hardlink-out", "dir-to-symlink"],
)
def test_a_child_refuses_a_forged_fork_archive(
    members: list, why: str, make_config: Callable[..., SandboxConfig]
) -> None:
    """What the parent wrote is hostile: a child writes nothing outside its places, and
    never through a symlink the archive planted."""
    with _open(make_config("fork-forged")) as child:
        blob = _tar(*members)
        # over the helper's channel, and over docker's side channel (sandbox/bulk.py)
        for bulk in [None, child.bulk] if child.bulk is not None else [None]:
            taken = bulk.taken if bulk is not None else 0
            upload = child._client.upload({"op": "fork_put"}, bulk=bulk)
            for at in range(0, len(blob), 700):  # chunks that cut headers, as the pipe may
                upload.send(blob[at : at + 700])
            header = upload.end(timeout=30)
            assert header.get("ok") is not True and why in str(header.get("error")), header
            assert bulk is None or bulk.taken == taken + 1, "the side channel was not taken"
            r = child.exec("for p in /home/sandbox/x /etc/x; do [ -e $p ] && echo LEAK $p; done")
            assert "LEAK" not in r.stdout, r.stdout
            assert child.exec("echo alive").stdout == "alive\n"  # the channel stays in step


def test_a_message_queue_is_counted_not_carried(make_config: Callable[..., SandboxConfig]) -> None:
    """A POSIX message queue (in /dev/mqueue) cannot be made by writing a file: every road
    leaves it out and counts it (it used to fail the fork: tar could not write it)."""
    with _open(make_config("fork-mqueue")) as parent:
        parent.exec(": > /dev/mqueue/q; echo kept > /testbed/a")
        (child,) = parent.fork(1)
        with child:
            assert child.fork_info is not None
            assert child.fork_info.skipped.get("message_queues") == 1, child.fork_info
            assert child.exec("cat /testbed/a; ls /dev/mqueue").stdout == "kept\n"


SPARSE = (  # 200 MiB apparent, one 4-byte block of data in its middle
    "truncate -s 200M /tmp/sparse && printf data | "
    "dd of=/tmp/sparse bs=1 seek=$((100 << 20)) conv=notrunc status=none"
)


@pytest.mark.parametrize("road", ["pipes", "host"])
def test_a_sparse_file_stays_sparse_in_every_child(
    make_config: Callable[..., SandboxConfig], road: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue #37: a sparse file under the fork's bound became its apparent size of real
    memory (tmpfs) in each child. Now its holes stay holes on every road: by pipes GNU tar
    --sparse (and the bound counts the bytes a file holds, so a fork bound of 64 MB takes a
    200 MB file holding 4 KB), through the host the child skips the zeros the relay sends."""
    from sandbox import fork as fork_mod

    with _open(make_config("fork-sparse")) as parent:
        if road == "host":
            if _on_volumes(parent):
                pytest.skip("a fork on volumes is a snapshot: no road through the host")
            monkeypatch.setattr(fork_mod, "_takes_pipes", lambda box: False)
        else:
            parent.copy_limits = CopyLimits(max_bytes=64 << 20)  # under the apparent size
        r = parent.exec(SPARSE)
        assert r.exit_code == 0, r.stderr
        children = parent.fork(2)
        for child in children:
            with child:
                method = "snapshot" if _on_volumes(parent) else road
                assert child.fork_info is not None and child.fork_info.method == method
                r = child.exec(
                    "stat -c '%s %b %B' /tmp/sparse; "
                    "dd if=/tmp/sparse bs=1 skip=$((100 << 20)) count=4 status=none; echo; "
                    "cmp -s -n 4096 /tmp/sparse /dev/zero && echo zeros"
                )
                size, blocks, unit = r.stdout.split("\n")[0].split()
                assert int(size) == 200 << 20, r.stdout
                assert int(blocks) * int(unit) <= 1 << 20, f"the child holds it whole: {r.stdout}"
                assert r.stdout.split("\n")[1:3] == ["data", "zeros"], r.stdout
