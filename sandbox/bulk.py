"""A fork's bulk side channel (docker): its bytes skip the engine's attach proxy.

Why: a docker sandbox's helper speaks over the container's stdin/stdout, which the engine
relays through its attach stream (container pipe -> shim -> fifo -> dockerd -> our socket,
and back for a child). A fork moves the parent's writable places (10 MB in the benchmark)
up from the parent and down into each child: measured at 09:25 on a quiet machine, the
parent's export 48 ms over attach vs 29 ms over bwrap's pipes, a child's write 41 vs
25 ms, the whole fork 86-112 vs 37 ms.

How: each docker sandbox gets a folder of the host's (`BulkDir`: mode 0700, owned by the
user running sandflow, never the sandbox user's uid) bind-mounted read-only at
`MOUNT` when it is created. For one fork request the host listens on a unix socket with a
random name in it (`BulkDir.listen`), names it in the request, and the helper, uid 0 with
CAP_SETUID, connects with the folder owner's fs ids (sandbox/_helper.py, bulk_connect).
The sandbox user (another uid, no capability) can neither enter the folder nor connect.
Only the bulk bytes change road: whatever comes over the socket is read with the same
bounds as the attach stream (sandbox/protocol.py), and each child still checks every
member. Off without privilege separation (the helper is then the sandbox user's uid)
and for a remote engine (its bind mounts are another host's folders); a helper that
cannot connect (an engine in another mount namespace, rootless) says so and the fork goes
over the attach stream as before.

Any folder length: a unix socket's address holds at most 107 bytes (`sun_path`), and a
cluster's TMPDIR (/scratch/slurm/job-123456/...) can pass that with the folder and the
socket's name added. So the host binds through a descriptor of the folder
(`/proc/self/fd/N/<name>`, `bind_in`): the name is resolved in the folder we opened,
whatever its path. The container side is short already (MOUNT + a 37-byte name).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import stat
import tempfile

from sandbox.procs import pid_alive
from sandbox.protocol import recv_some

MOUNT = "/.sandflow-bulk"  # sandbox/_helper.py BULK_DIR
ACCEPT_S = 10.0  # the helper connects before it says so: the connection is already queued


class SocketTransport:
    """One accepted bulk connection, as a Transport (send/recv/diagnostics/close)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def send(self, data: bytes) -> None:
        self.sock.settimeout(60.0)
        self.sock.sendall(data)

    def recv(self, timeout: float) -> bytes:
        return recv_some(self.sock, timeout, "the fork's bulk connection closed")

    def diagnostics(self) -> str:
        return "the fork's bulk connection closed"

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


class Listener:
    """A socket the helper may connect to once; its file is gone once accepted or closed."""

    def __init__(self, owner: BulkDir) -> None:
        self.owner = owner
        self.name = secrets.token_hex(16) + ".sock"
        self.path = os.path.join(owner.path, self.name)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            bind_in(self.sock, owner.path, self.name)
            os.chmod(self.path, 0o600)
            self.sock.listen(1)
        except BaseException:
            self.close()
            raise

    def accept(self) -> SocketTransport:
        """The helper's connection (it connected before saying so); OSError if none."""
        try:
            self.sock.settimeout(ACCEPT_S)
            conn, _ = self.sock.accept()
        finally:
            self.close()
        self.owner.taken += 1
        return SocketTransport(conn)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        with contextlib.suppress(OSError):
            self.sock.close()


class BulkDir:
    """The per-sandbox host folder bind-mounted at MOUNT (one per sandbox: a helper never
    reaches another sandbox's sockets)."""

    def __init__(self, base: str | None = None) -> None:
        # mkdtemp: mode 0700, owned by us. Named with our pid: sandbox.reaper removes an
        # owner's leftovers (a kill -9 leaves an empty folder) by that prefix, in `base`
        # (None: base_dir(), which the reaper is told).
        self.path = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=base or base_dir())
        self.enabled = True  # False once a helper could not connect: not offered again
        self.taken = 0  # side channels the helper took (tests: a fork really used one)

    @property
    def bind(self) -> str:
        return f"{self.path}:{MOUNT}:ro"

    def listen(self) -> Listener | None:
        if not self.enabled:
            return None
        try:
            return Listener(self)
        except OSError:
            self.enabled = False
            return None

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


PREFIX = "sandflow-bulk-"


def base_dir() -> str:
    """Where BulkDir folders are made by default (TMPDIR, else /tmp): the reaper and
    `sandbox gc` sweep the same place."""
    return tempfile.gettempdir()


def bind_in(sock: socket.socket, folder: str, name: str) -> None:
    """Bind the unix socket `sock` to `folder/name`, however long `folder`'s path is.

    The name is resolved through a descriptor of the folder (`/proc/self/fd/N/name`,
    Linux): ~55 bytes whatever the folder, and the socket lands in the folder opened
    (O_NOFOLLOW: never through a symlink put in its place). Without /proc, the plain path
    (which then must fit in 107 bytes; OSError if not)."""
    fd = os.open(folder, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if os.path.isdir("/proc/self/fd"):
            sock.bind(f"/proc/self/fd/{fd}/{name}")
        else:
            sock.bind(os.path.join(folder, name))
    finally:
        os.close(fd)


def remove_leftovers(pid: int, base: str | None = None) -> None:
    """The bulk folders of a process that is gone (sandbox.reaper, after a kill -9), in
    `base` (None: base_dir(); the reaper is handed its owner's)."""
    base = base or base_dir()
    with contextlib.suppress(OSError):
        for name in os.listdir(base):
            if name.startswith(f"{PREFIX}{pid}-"):
                shutil.rmtree(os.path.join(base, name), ignore_errors=True)


def orphaned(base: str | None = None) -> list[str]:
    """Our bulk folders in `base` (None: base_dir()) whose owner process is gone (its pid
    is in the name): what `sandflow sandbox gc` removes when the owner and its watchdog
    both died (a reboot's /tmp survives on some hosts; a kill of both). Only folders of
    our uid, never through a symlink; an owner pid that still runs (or was reused) keeps
    its folder."""
    base = base or base_dir()
    try:
        names = os.listdir(base)
    except OSError:
        return []
    found = []
    for name in names:
        pid = name[len(PREFIX) :].split("-", 1)[0] if name.startswith(PREFIX) else ""
        if not pid.isdigit() or _runs(int(pid)):
            continue
        path = os.path.join(base, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
            found.append(path)
    return sorted(found)


_runs = pid_alive  # EPERM (another user's process) counts as running
