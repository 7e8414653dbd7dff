"""bwrap sandboxes on copy-on-write btrfs volumes (sandbox/volumes.py): what differs from
tmpfs places. The fork battery itself runs on volumes in tests/sandbox/test_fork.py (its
`bwrap-volumes` parameter); here: the quota, the refused btrfs ioctls, a reset after a
snapshot, and that no subvolume or mount outlives its sandbox (closed, or its owner killed).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sandbox import SandboxConfig, open_sandbox
from sandbox import settings as sandbox_settings
from tests.sandbox.conftest import config_maker
from tests.sandbox.test_fork import SHAPE
from tests.sandbox.test_pool_reset import PROBES
from tests.sandbox.test_pool_reset import _observe as observe_every_probe

pytestmark = pytest.mark.bwrap


@pytest.fixture(scope="module")
def volumes_config(
    sandbox_rootfs: str, bwrap_volumes: Path, test_run_id: str
) -> Iterator[Callable[..., SandboxConfig]]:
    """Configs of bwrap sandboxes whose places are volumes of this session's btrfs."""
    previous = sandbox_settings.configure(bwrap_volumes=bwrap_volumes)
    try:
        yield config_maker("bwrap", test_run_id)
    finally:
        sandbox_settings.configure(previous)


def _open(config: SandboxConfig) -> Any:
    """open_sandbox() typed as what it returns here (a BwrapSandbox)."""
    return open_sandbox(config)


def test_a_snapshot_child_writes_at_most_its_limit(
    volumes_config: Callable[..., SandboxConfig],
) -> None:
    """A child shares its parent's blocks and may write its own limit on top (three
    places of tmp_size_mb): past it, EDQUOT, and the parent is untouched."""
    with _open(volumes_config("fork-quota", tmp_size_mb=16)) as parent:
        assert parent.exec("head -c 20000000 /dev/zero > /testbed/big").exit_code == 0
        (child,) = parent.fork(1)
        with child:
            r = child.exec(
                "head -c 80000000 /dev/zero > /tmp/more; echo rc=$?; stat -c %s /tmp/more"
            )
            assert "rc=1" in r.stdout and "Disk quota exceeded" in r.stderr, r
            assert int(r.stdout.split()[-1]) <= 3 * 16 << 20
            assert child.exec("stat -c %s /testbed/big").stdout == "20000000\n"
        assert parent.exec("ls /tmp").stdout == ""


def test_a_sandbox_on_volumes_cannot_make_subvolumes_nor_clone_blocks(
    volumes_config: Callable[..., SandboxConfig],
) -> None:
    """btrfs's ioctls are refused by the seccomp filter: no subvolume the host would have
    to find, no reflink its quota would not count (cp falls back to copying)."""
    create = (
        "import fcntl, os; fd = os.open('/testbed', os.O_RDONLY); "
        "b = bytearray(4096); b[56:59] = b'sub'; "
        "fcntl.ioctl(fd, (1 << 30) | (4096 << 16) | (0x94 << 8) | 24, b)"
    )
    with _open(volumes_config("fork-ioctl")) as box:
        r = box.exec(f'python3 -c "{create}"; ls /testbed')
        assert "Operation not supported" in r.stderr and "sub" not in r.stdout, r
        r = box.exec(
            "echo hi > /tmp/a; cp --reflink=always /tmp/a /tmp/b; cp /tmp/a /tmp/c; cat /tmp/c"
        )
        assert "Operation not supported" in r.stderr and r.stdout == "hi\n", r


def test_a_pooled_child_forked_into_again_and_closed_leaves_no_volume(
    volumes_config: Callable[..., SandboxConfig],
) -> None:
    """A child reset by a pool and forked into again shows the new snapshot; every
    subvolume and mount of a closed sandbox is gone."""
    parent = _open(volumes_config("fork-again"))
    child = _open(volumes_config("fork-again-child"))
    store = parent.volumes
    try:
        parent.exec("echo one > /testbed/v")
        parent.fork(1, children=[child])
        assert child.exec("cat /testbed/v").stdout == "one\n"
        assert child.reset() == []
        assert child.exec("ls -A /testbed /tmp /home/sandbox | grep -v :").stdout.strip() == ""
        parent.exec("echo two > /testbed/v")
        parent.fork(1, children=[child])
        assert child.exec("cat /testbed/v").stdout == "two\n"
        assert store.names(child.id) == [child.id, f"{child.id}.f2"]  # f1 went at once
    finally:
        ids = [parent.id, child.id]
        parent.close()
        child.close()
    left = [n for i in ids for n in store.names(i)]
    assert left == []
    mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    assert [m for m in mounts if any(f"{store.root}/{i}/" in m for i in ids)] == []


def test_a_child_on_volumes_reset_after_its_fork_equals_a_fresh_sandbox(
    volumes_config: Callable[..., SandboxConfig],
) -> None:
    """The pool's promise holds for a child shown a snapshot: after a dirty episode and
    a reset, every probe of the reset battery sees a fresh sandbox."""
    from tests.sandbox.test_pool_reset import DIRTY

    with _open(volumes_config("fork-fresh-probe")) as fresh:
        expected = observe_every_probe(fresh)
    with _open(volumes_config("fork-reset-parent")) as parent, _open(
        volumes_config("fork-reset-child")
    ) as child:
        assert parent.exec(SHAPE, timeout=60).exit_code == 3
        parent.fork(1, children=[child])
        assert child.exec(DIRTY, timeout=60).exit_code == 0
        assert child.reset() == []
        after = observe_every_probe(child)
        # but df: the places' filesystem is shared by every sandbox on the volumes, so its
        # free space moves with all of them (docs/sandbox.md, "Copy-on-write")
        differ = [p for p in PROBES if after[p] != expected[p] and p != "writable_places_space"]
        assert differ == [], "\n".join(f"{p}:\n{after[p]}\n--- fresh:\n{expected[p]}" for p in differ)


_VOLUMES_OWNER = """
import sys, time
sys.path.insert(0, {repo!r})
from sandbox import SandboxConfig, open_sandbox, settings
settings.configure(bwrap_volumes={root!r})
cfg = SandboxConfig(backend="bwrap", run_id={run_id!r})
parent = open_sandbox(cfg)
parent.exec("echo x > /testbed/x")
(child,) = parent.fork(1)
print(parent.id, child.id, flush=True)
time.sleep(120)
"""


def test_the_volumes_of_a_killed_owner_are_removed(
    volumes_config: Callable[..., SandboxConfig], bwrap_volumes: Path, test_run_id: str
) -> None:
    """kill -9 of the process that made the sandboxes: its reaper removes them, their
    subvolumes and the snapshot's mounts."""
    import signal
    import subprocess
    import sys
    import time

    from sandbox import volumes
    from tests.sandbox.test_pool_reset import REPO

    run_id = f"{test_run_id}-volkill"
    code = _VOLUMES_OWNER.format(repo=REPO, root=str(bwrap_volumes), run_id=run_id)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    store = volumes.for_root(bwrap_volumes)
    try:
        assert proc.stdout is not None
        ids = proc.stdout.readline().split()
        assert len(ids) == 2, "the owner did not fork"
        assert store.names(ids[1]) == [ids[1], f"{ids[1]}.f1"]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 60
        while any(store.names(i) for i in ids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [n for i in ids for n in store.names(i)] == []
        mounts = Path("/proc/self/mountinfo").read_text()
        assert not any(f"{bwrap_volumes}/{i}/" in mounts for i in ids)
    finally:
        if proc.poll() is None:
            proc.kill()




def test_a_root_that_is_not_btrfs_is_one_sentence(sandbox_rootfs: str, tmp_path: Path) -> None:
    from sandbox.base import SandboxConfig, SandboxError

    previous = sandbox_settings.configure(bwrap_volumes=tmp_path)
    try:
        with pytest.raises(SandboxError, match="not a btrfs filesystem .*setup.sh --volumes"):
            open_sandbox(SandboxConfig(backend="bwrap"))
        sandbox_settings.configure(bwrap_volumes=tmp_path / "missing")
        with pytest.raises(SandboxError, match="No such file or directory"):
            open_sandbox(SandboxConfig(backend="bwrap"))
    finally:
        sandbox_settings.configure(previous)


def test_a_parent_holding_files_outside_its_volume_forks_by_pipes(
    volumes_config: Callable[..., SandboxConfig],
) -> None:
    """/dev/shm (a tmpfs of its own, issue #37) or a /var/tmp an image makes writable: a
    snapshot would not carry what they hold, so the fork goes by pipes."""
    with _open(volumes_config("fork-outside")) as parent:
        parent.exec("echo outside > /dev/shm/o; echo inside > /testbed/i")
        (child,) = parent.fork(1)
        with child:
            assert child.fork_info is not None and child.fork_info.method == "pipes"
            assert child.exec("cat /dev/shm/o /testbed/i").stdout == "outside\ninside\n"
        parent.exec("rm /dev/shm/o")
        (child,) = parent.fork(1)
        with child:
            assert child.fork_info is not None and child.fork_info.method == "snapshot"
