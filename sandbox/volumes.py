"""Copy-on-write writable places for bwrap sandboxes: btrfs subvolumes, a fork is a snapshot.

Why: a fork by tar writes every file of the parent again, and creating a file costs the
kernel ~15 us here whatever its size (1,000 files: 15 ms before anything else). A btrfs
snapshot of the parent's subvolume takes ~2 ms whatever it holds, and the child shares
the parent's blocks until either writes them.

Layout under the root (a btrfs mount the host owns; docs/sandbox.md, "Copy-on-write"):

    <root>/<box id>/            the sandbox's own subvolume, made when it starts
        tmp/ work/ home/        its places (1777, root's), bound to /tmp, the workdir, home
    <root>/<box id>.f<n>/       a snapshot a fork mounted over that box's places

bwrap binds the three folders of the box's own subvolume. The root is a shared mount and
bwrap made every mount it copied a slave of the host's, so a mount the host puts on
`<root>/<box id>/tmp` later shows at the running sandbox's /tmp: that is how a child
(started or pooled) gets its parent's snapshot without a restart.

Limits: btrfs simple quotas (squota). Each subvolume may write at most its limit of new
data; what a snapshot shares with its parent stays counted to the parent (the host holds
those blocks once). The sandbox cannot make, snapshot or delete subvolumes (its seccomp
filter refuses btrfs ioctls), and the host only ever names subvolumes by sandbox ids: it
never walks what a sandbox wrote.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import os
import re
import secrets
import stat
import struct
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

PLACES = ("tmp", "work", "home")  # folders of a volume, bound to /tmp, the workdir, home
BTRFS_MAGIC = 0x9123683E
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,200}$")


def _ioc(direction: int, nr: int, size: int) -> int:
    return (direction << 30) | (size << 16) | (0x94 << 8) | nr


_SNAP_CREATE_V2 = _ioc(1, 23, 4096)
_SUBVOL_CREATE_V2 = _ioc(1, 24, 4096)
_SNAP_DESTROY = _ioc(1, 15, 4096)
_QUOTA_CTL = _ioc(3, 40, 16)
_FS_INFO = _ioc(2, 31, 1024)
_QUOTA_ENABLE_SIMPLE = 4
_SUBVOL_QGROUP_INHERIT = 1 << 2
_INHERIT_SET_LIMITS = 1 << 0
_LIMIT_MAX_RFER_EXCL = 3

MS_BIND, MS_REMOUNT, MS_NOSUID, MS_NODEV, MS_SHARED = 4096, 32, 2, 4, 1 << 20
MNT_DETACH = 2


_HOW = (
    " (make one with `sudo bash scripts/setup.sh --volumes`, docs/sandbox.md "
    '"Copy-on-write places"; or leave bwrap_volumes unset for tmpfs places)'
)


class VolumesUnavailable(RuntimeError):
    """The root cannot hold sandboxes' volumes (not btrfs, not root, no quotas)."""


class _Limit(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_uint64) for n in ("flags", "max_rfer", "max_excl", "rsv_rfer", "rsv_excl")
    ]


class _Inherit(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("flags", "num_qgroups", "num_ref", "num_excl")] + [
        ("lim", _Limit)
    ]


_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mount.argtypes = [
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_ulong,
    ctypes.c_void_p,
]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


def _check(ret: int, what: str) -> None:
    if ret != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def _vol_args(name: str, src_fd: int, limit_bytes: int) -> tuple[bytearray, _Inherit]:
    """struct btrfs_ioctl_vol_args_v2 (4,096 bytes) with a quota limit inherited by the
    new subvolume (the _Inherit must outlive the ioctl: the kernel reads it by address)."""
    inherit = _Inherit(flags=_INHERIT_SET_LIMITS)
    inherit.lim.flags = _LIMIT_MAX_RFER_EXCL
    inherit.lim.max_rfer = inherit.lim.max_excl = limit_bytes
    args = bytearray(4096)
    struct.pack_into(
        "qQQQQ", args, 0, src_fd, 0, _SUBVOL_QGROUP_INHERIT,
        ctypes.sizeof(inherit), ctypes.addressof(inherit),
    )  # fmt: skip
    raw = name.encode()
    args[56 : 56 + len(raw)] = raw
    return args, inherit


def _valid(name: str) -> str:
    if not _NAME.match(name) or ".." in name:
        raise ValueError(f"volume name {name!r}: letters, digits, '_', '.', '-' only")
    return name


def _mountinfo() -> list[list[str]]:
    with open("/proc/self/mountinfo") as f:
        return [line.split() for line in f]


class Volumes:
    """The subvolumes under one btrfs root. Made per root once (`for_root`)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._fd = -1
        self._prepare()

    # ------------------------------------------------------------------ the root
    def _prepare(self) -> None:
        root = self.root
        if os.geteuid() != 0:
            raise VolumesUnavailable(
                f"bwrap volumes at {root}: need root (btrfs snapshots and mounts); leave "
                "bwrap_volumes unset to keep tmpfs places"
            )
        try:
            fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as e:
            raise VolumesUnavailable(f"bwrap volumes at {root}: {e.strerror}{_HOW}") from None
        self._fd = fd
        try:
            info = bytearray(1024)
            fcntl.ioctl(fd, _FS_INFO, info)
        except OSError:
            raise VolumesUnavailable(f"bwrap volumes at {root}: not a btrfs filesystem{_HOW}") from None
        mine = [m for m in _mountinfo() if m[4] == str(root)]
        if not mine or mine[-1][mine[-1].index("-") + 1] != "btrfs":
            raise VolumesUnavailable(f"bwrap volumes at {root}: not where a btrfs is mounted{_HOW}")
        if not any(f.startswith("shared:") for f in mine[-1][6 : mine[-1].index("-")]):
            # the mounts a fork puts on a box's places reach its sandbox only through a
            # shared root (bwrap makes the sandbox's copies slaves of it)
            _check(
                _libc.mount(None, str(root).encode(), None, MS_SHARED, None), f"make {root} shared"
            )
        fsid = bytes(info[16:32]).hex()
        uuid = f"{fsid[:8]}-{fsid[8:12]}-{fsid[12:16]}-{fsid[16:20]}-{fsid[20:]}"
        mode = Path(f"/sys/fs/btrfs/{uuid}/qgroups/mode")
        if not mode.exists():
            try:
                fcntl.ioctl(fd, _QUOTA_CTL, bytearray(struct.pack("QQ", _QUOTA_ENABLE_SIMPLE, 0)))
            except OSError as e:
                raise VolumesUnavailable(
                    f"bwrap volumes at {root}: cannot enable btrfs simple quotas "
                    f"({e.strerror}; needs Linux 6.7+): sandboxes could fill the disk"
                ) from None
        os.chmod(root, 0o700)  # the host's: sandboxes see only the folders bound in

    # ------------------------------------------------------------------ subvolumes
    def path(self, name: str) -> Path:
        return self.root / _valid(name)

    def create(self, name: str, limit_bytes: int) -> Path:
        """A new subvolume with its three places (1777, root's), writing at most limit_bytes."""
        args, inherit = _vol_args(_valid(name), 0, limit_bytes)
        fcntl.ioctl(self._fd, _SUBVOL_CREATE_V2, args)
        del inherit
        top = self.root / name
        for place in PLACES:
            (top / place).mkdir()
            os.chmod(top / place, 0o1777)
        return top

    def snapshot(self, source: str, name: str, limit_bytes: int) -> Path:
        """`name`: the subvolume `source` now, sharing its blocks (what `source` buffered
        is written first: the snapshot has it)."""
        src = os.open(self.path(source), os.O_RDONLY | os.O_DIRECTORY)
        try:
            args, inherit = _vol_args(_valid(name), src, limit_bytes)
            fcntl.ioctl(self._fd, _SNAP_CREATE_V2, args)
            del inherit
        finally:
            os.close(src)
        return self.root / name

    def delete(self, name: str) -> bool:
        """Remove a subvolume (the cleaner frees its blocks later); False while it is
        still mounted somewhere (e.g. a process of a dying sandbox holds it)."""
        args = bytearray(4096)
        raw = _valid(name).encode()
        args[8 : 8 + len(raw)] = raw
        try:
            fcntl.ioctl(self._fd, _SNAP_DESTROY, args)
        except FileNotFoundError:
            return True
        except OSError as e:
            if e.errno in (errno.EBUSY, errno.ENOTEMPTY, errno.EPERM):
                return False
            raise
        return True

    def names(self, box_id: str) -> list[str]:
        """The subvolumes of one box: its own and the snapshots mounted over it."""
        prefix = _valid(box_id)
        with os.scandir(self.root) as it:
            return sorted(
                e.name for e in it if e.name == prefix or e.name.startswith(prefix + ".f")
            )

    # ------------------------------------------------------------------ mounts
    def mount_over(self, volume: str, box_id: str) -> None:
        """Show `volume`'s places at box `box_id`'s (in its running sandbox too): what was
        mounted there before is detached first (its processes keep what they hold open)."""
        self.unmount(box_id)
        src, dst = self.path(volume), self.path(box_id)
        for place in PLACES:
            s, d = str(src / place).encode(), str(dst / place).encode()
            _check(_libc.mount(s, d, None, MS_BIND, None), f"bind {volume}/{place}")
            flags = MS_BIND | MS_REMOUNT | MS_NOSUID | MS_NODEV
            _check(_libc.mount(None, d, None, flags, None), f"remount {box_id}/{place}")

    def unmount(self, box_id: str) -> bool:
        """Detach every mount on box `box_id`'s places (from the sandbox too). True when
        each place shows the box's own subvolume again (a subvolume has a device number
        of its own, so a snapshot's folder mounted there has another)."""
        top = self.path(box_id)
        for place in PLACES:
            target = str(top / place).encode()
            for _ in range(64):  # mounts stacked there, if any (never more than one of ours)
                if _libc.umount2(target, MNT_DETACH) != 0:
                    break
        try:
            own = os.stat(top).st_dev
            return all(os.stat(top / place).st_dev == own for place in PLACES)
        except OSError:
            return False

    def remove_box(self, box_id: str, within_s: float = 0.0) -> bool:
        """Everything of one box (its sandbox is gone): the mounts, then its subvolumes.
        Tried again for `within_s` while a dying sandbox's last processes still hold them."""
        deadline = time.monotonic() + within_s
        while True:
            self.unmount(box_id)
            if all([self.delete(n) for n in self.names(box_id)]):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)


_lock = threading.Lock()
_made: dict[Path, Volumes] = {}


def for_root(root: Path) -> Volumes:
    """The Volumes of `root`, checked and prepared once per process."""
    root = Path(os.path.abspath(root))
    with _lock:
        if root not in _made:
            _made[root] = Volumes(root)
        return _made[root]


def make_filesystem(image: Path, mountpoint: Path, size_gb: int) -> None:
    """A btrfs filesystem in a sparse file (on /dev/shm it lives in memory, as tmpfs places
    do), loop-mounted at `mountpoint`, shared, with simple quotas: what `scripts/setup.sh
    --volumes` makes. Does nothing when `mountpoint` already holds one. nodatacow: blocks
    are written in place unless a snapshot shares them (then copied once), and carry no
    checksum (memory is not a failing disk): 1,000 small files are made ~15% faster."""
    mountpoint.mkdir(parents=True, exist_ok=True)
    if any(m[4] == str(mountpoint) for m in _mountinfo()):
        for_root(mountpoint)
        return
    if not image.exists():
        with open(image, "wb") as f:
            f.truncate(size_gb << 30)
        os.chmod(image, stat.S_IRUSR | stat.S_IWUSR)
        subprocess.run(["mkfs.btrfs", "-q", "-f", str(image)], check=True, capture_output=True)
    subprocess.run(
        ["mount", "-o", "loop,discard=async,noatime,nodatacow", str(image), str(mountpoint)],
        check=True,
        capture_output=True,
    )
    for_root(mountpoint)


@contextlib.contextmanager
def scratch_filesystem(size_gb: int = 4, prefix: str = "sandflow-volumes") -> Iterator[Path]:
    """A btrfs filesystem for a while (a test session, a benchmark): a sparse file on
    /dev/shm mounted in a new temporary folder; unmounted and deleted at the end."""
    image = Path(f"/dev/shm/{prefix}-{os.getpid()}-{secrets.token_hex(3)}.img")
    mount = Path(tempfile.mkdtemp(prefix=f"{prefix}-"))
    try:
        make_filesystem(image, mount, size_gb)
        yield mount
    finally:
        with _lock:
            _made.pop(mount, None)
        subprocess.run(["umount", "-l", str(mount)], check=False, capture_output=True)
        image.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            mount.rmdir()


def main(argv: list[str] | None = None) -> int:
    """`python -m sandbox.volumes IMAGE MOUNTPOINT [SIZE_GB]` (scripts/setup.sh --volumes)."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) not in (2, 3):
        print("usage: python -m sandbox.volumes IMAGE MOUNTPOINT [SIZE_GB]", file=sys.stderr)
        return 2
    try:
        make_filesystem(Path(args[0]), Path(args[1]), int(args[2]) if len(args) == 3 else 16)
    except (OSError, subprocess.CalledProcessError, VolumesUnavailable) as e:
        detail = getattr(e, "stderr", b"") or b""
        print(f"sandbox.volumes: {e} {detail.decode(errors='replace').strip()}", file=sys.stderr)
        return 1
    print(f"bwrap volumes ready at {args[1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
