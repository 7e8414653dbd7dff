"""The egress proxy of the `allowlist` / `open` network policies on the bwrap backend.

A bwrap sandbox has its own network namespace with nothing in it but `lo`: no interface,
no route, no resolver. The only way out is a listening socket on the sandbox's own
127.0.0.1:PROXY_PORT that this process created *inside that namespace* (as root a
short-lived thread enters it with setns, binds, and leaves; as a normal user a short child
process joins the user namespace that owns it, binds, and hands the socket back; either way
the socket stays where it was made).
Connections the sandbox opens to it are accepted here, on the host side, and relayed to the
policy's squid, which listens on the host's 127.0.0.1 only (another network namespace:
unreachable from the sandbox's own 127.0.0.1). Each relayed connection leaves from a source
address reserved for this sandbox in 127.77.0.0/16, so squid's log attributes every request
to its sandbox; the sandbox cannot choose or forge it.

Why this and not a veth into a bridge with firewall rules (docker's layout): nothing to
route, so nothing to filter; no firewall rule, no interface, no in-sandbox process. The
listener belongs to no process of the sandbox, so its user can neither kill nor replace it
(the port is below 1024 and already bound; the relay is in another pid namespace). Squid
still decides everything, after resolution (sandbox/netpolicy.py), as on docker.

Why a relay of our own (a selector loop in one thread per process, not socat or a process
per sandbox): it dies with its owner (kill -9 included, the kernel closes every socket), so
nothing outlives the sandbox; one thread serves every sandbox of the process; it never
parses a byte (squid does), and what a sandbox can make it hold is bounded: at most
MAX_CONNS connections per sandbox (the listener pauses at the cap), one upstream connection
per accepted one, at most CHUNK bytes buffered per direction, nothing read from a side
whose previous chunk has not been delivered.

Shared, not per sandbox: one squid per (policy, hosts) on the host's 127.0.0.1, for every
bwrap sandbox of that policy in every process of the user (an flock in its state folder;
like docker's, it outlives the process; `teardown` stops it). Root's proxies live in the
shared state folder; a normal user's in one of its own (`state_root`).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import fcntl
import logging
import os
import queue
import random
import selectors
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sandbox import egress, settings
from sandbox.base import SandboxError
from sandbox.netpolicy import parse_hosts

log = logging.getLogger("sandflow.sandbox.bwrap_egress")

PROXY_PORT = 808  # in the sandbox's namespace: below 1024, so its user can never bind it
SOURCE_PREFIX = "127.77."  # relayed connections leave from 127.77.X.Y (one per live sandbox)
# the port whose bind reserves a source address host-wide (below 1024 only root may bind;
# users' reservations need not meet root's: each user's proxies are its own)
RESERVE_PORT = 1 if os.geteuid() == 0 else 1808
RETRY_S = 1.0  # a listener whose accept failed (no fd left) waits this long before the next
MAX_CONNS = 32  # concurrent relayed connections per sandbox
CHUNK = 128 << 10  # bytes held per direction of a connection
CLONE_NEWNET = 0x40000000
IP_FREEBIND = 15  # bind 127.0.0.1 before bwrap has brought the namespace's lo up


def unavailable() -> str | None:
    """Why the bwrap backend cannot run the egress proxy here, or None."""
    if shutil.which("squid") is None:
        return (
            "the egress proxy needs Debian's squid on PATH: `apt-get install -y squid` (or "
            "scripts/setup.sh; a normal user may need /usr/sbin on PATH)"
        )
    return None


def state_root() -> Path:
    """Where the proxies' state lives: the shared folder for root (or the egress_dir setting,
    SANDFLOW_EGRESS_DIR), else one of this user's own (the shared one belongs to root)."""
    if os.geteuid() == 0 or settings.current().egress_dir is not None:
        return egress.state_root()
    root = egress.state_root()
    return root.with_name(f"{root.name}-{os.geteuid()}")


def ensure(policy: Any, hosts: dict[str, str] | None = None) -> egress.Endpoint:
    """The host-loopback squid of `policy`, started on first use (an flock makes concurrent
    starters wait for one another). `hosts` is a hosts file for its resolver (tests)."""
    why = unavailable()
    if why:
        raise SandboxError(f"network policy {policy.mode!r}: {why}")
    ep_dir = state_root() / ("lo-" + egress.state_key(policy, hosts))
    try:
        ep_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SandboxError(
            f"network policy {policy.mode!r}: cannot create the egress proxy's folder {ep_dir}: "
            f"{e} (set SANDFLOW_EGRESS_DIR to a folder of yours)"
        ) from None
    port_file = ep_dir / "port"
    with open(ep_dir / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        port = 0
        with contextlib.suppress(OSError, ValueError):
            port = int(port_file.read_text().strip())
        if not port or not _squid_running(ep_dir):
            for attempt in range(3):  # a free port can be taken between our look and squid's bind
                port = _free_port()
                port_file.write_text(str(port))
                try:
                    egress.start_squid(policy, ep_dir, "127.0.0.1", port, hosts)
                    break
                except SandboxError:
                    egress.stop_squid(ep_dir)
                    if attempt == 2:
                        raise
    return egress.Endpoint("host-loopback", "127.0.0.1", port, ep_dir)


def _squid_running(ep_dir: Path) -> bool:
    """The squid of `ep_dir` runs: its pid file names a live process that is that squid (not
    a process that got the pid of one that died: requests would then go nowhere)."""
    try:
        pid = int((ep_dir / "squid.pid").read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return False
    return b"squid" in cmdline and str(ep_dir / "squid.conf").encode() in cmdline


def endpoint_for(limits: Any) -> egress.Endpoint:
    """The shared proxy for a bwrap sandbox with these limits, started on first use."""
    return ensure(egress.policy_of(limits), parse_hosts(limits.egress_hosts) or None)


def teardown(endpoint: egress.Endpoint) -> None:
    """Stop the proxy (its sandboxes should be gone: their relayed connections end with it)."""
    egress.stop_squid(endpoint.state_dir)


def sandbox_env(endpoint: egress.Endpoint) -> dict[str, str]:
    """What makes pip, apt, curl and urllib use the proxy: its address *inside* the sandbox."""
    return dataclasses.replace(endpoint, gateway="127.0.0.1", port=PROXY_PORT).sandbox_env()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ----------------------------------------------------------------------------- the tap


def reserve_source() -> tuple[str, socket.socket]:
    """A source address in 127.77.0.0/16 no other live sandbox of this host holds, and the
    socket whose bind holds it (released when it closes, or when the process dies)."""
    rng = random.SystemRandom()
    for _ in range(500):
        addr = f"{SOURCE_PREFIX}{rng.randrange(256)}.{rng.randrange(1, 255)}"
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.bind((addr, RESERVE_PORT))
            return addr, s
        except OSError as e:
            s.close()
            if e.errno != errno.EADDRINUSE:
                raise SandboxError(f"cannot reserve an egress source address: {e}") from None
    raise SandboxError("cannot reserve an egress source address: 127.77.0.0/16 is all in use")


_LIBC: Any = None


def listener_in_netns(pid: int, port: int = PROXY_PORT) -> socket.socket:
    """A TCP listener on 127.0.0.1:`port` inside the network namespace of process `pid`.

    As root a fresh thread enters the namespace (setns affects only the calling thread),
    creates and binds the socket, and ends; the socket keeps the namespace it was created
    in. As a normal user the namespace belongs to the user namespace unprivileged bubblewrap
    made, which only a single-threaded process may enter: a short child process joins both
    (as slirp4netns does), binds, and hands the socket back over a socketpair. Refuses a
    namespace that is this process's own (the relay must never listen on the host).
    """
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
    path = f"/proc/{pid}/ns/net"
    try:
        if os.stat(path).st_ino == os.stat("/proc/self/ns/net").st_ino:
            raise SandboxError(f"process {pid} shares the host's network namespace: no relay there")
    except OSError as e:
        raise SandboxError(f"the sandbox's network namespace is gone ({e})") from None
    if os.geteuid() != 0:
        return _listener_from_child(pid, port)
    out: dict[str, Any] = {}

    def enter_and_bind() -> None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                if _LIBC.setns(fd, CLONE_NEWNET) != 0:
                    e = ctypes.get_errno()
                    raise OSError(e, f"setns into {path}: {os.strerror(e)}")
            finally:
                os.close(fd)
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.setsockopt(socket.IPPROTO_IP, IP_FREEBIND, 1)
                s.bind(("127.0.0.1", port))
                s.listen(64)
                s.setblocking(False)
            except BaseException:
                s.close()
                raise
            out["sock"] = s
        except BaseException as e:  # reported to the caller's thread
            out["error"] = e

    t = threading.Thread(target=enter_and_bind, name="sandflow-egress-netns", daemon=True)
    t.start()
    t.join()
    if "error" in out:
        raise SandboxError(f"cannot open the egress relay in the sandbox: {out['error']}")
    sock: socket.socket = out["sock"]
    return sock


# Run by `python3 -I -S` as a child: joins the user namespace owning the target's network
# namespace, then that namespace; binds; sends the socket back (SCM_RIGHTS) and exits.
_CHILD = """
import ctypes, fcntl, os, socket, sys
pid, port, back = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
libc = ctypes.CDLL(None, use_errno=True)
net = os.open("/proc/%d/ns/net" % pid, os.O_RDONLY)
owner = fcntl.ioctl(net, 0xB701)
for fd, kind in ((owner, 0x10000000), (net, 0x40000000)):
    if libc.setns(fd, kind) != 0:
        e = ctypes.get_errno()
        sys.exit("setns: " + os.strerror(e))
s = socket.socket()
s.setsockopt(socket.IPPROTO_IP, 15, 1)
s.bind(("127.0.0.1", port))
s.listen(64)
socket.send_fds(socket.socket(fileno=back), [b"ok"], [s.fileno()])
"""


def _listener_from_child(pid: int, port: int) -> socket.socket:
    # stdlib only (Python >= 3.9): any python3 will do when ours is not this user's to run
    python = sys.executable if os.access(sys.executable, os.X_OK) else shutil.which("python3")
    if not python:
        raise SandboxError("cannot open the egress relay in the sandbox: no python3 to run")
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with ours:
            try:
                proc = subprocess.run(
                    [python, "-I", "-S", "-c", _CHILD, str(pid), str(port)]
                    + [str(theirs.fileno())],
                    pass_fds=(theirs.fileno(),),
                    capture_output=True,
                    text=True,
                    timeout=20,
                    env={"PATH": "/usr/bin:/bin"},
                )
            finally:
                theirs.close()
            if proc.returncode != 0:
                raise SandboxError(
                    "cannot open the egress relay in the sandbox (entering its namespaces as "
                    f"this user failed): {proc.stderr.strip()[-300:]}"
                )
            ours.settimeout(5)
            _, fds, _, _ = socket.recv_fds(ours, 16, 1)
    except (OSError, subprocess.SubprocessError) as e:
        raise SandboxError(f"cannot open the egress relay in the sandbox: {e}") from None
    if len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise SandboxError("cannot open the egress relay in the sandbox: no socket came back")
    sock = socket.socket(fileno=fds[0])
    sock.setblocking(False)
    return sock


@dataclass(eq=False)
class Tap:
    """One sandbox's way out: its in-namespace listener, its source address, its connections."""

    name: str
    listener: socket.socket
    source: str
    upstream: tuple[str, int]
    reservation: socket.socket
    conns: set[_Conn] = field(default_factory=set)
    paused: bool = False  # at MAX_CONNS: the listener is not watched until one ends
    retry_at: float = 0.0  # paused after a failure to accept (out of fds): watched again then
    closed: bool = False
    accepted: int = 0  # totals, for diagnostics and tests
    refused_at_cap: int = 0

    def close(self, timeout: float = 5.0) -> None:
        """Close the listener and every relayed connection (squid logs each as it ends)."""
        if self.closed:
            return
        done = threading.Event()
        try:
            RELAY.submit(("remove", self, done))
        except RuntimeError:  # interpreter shutdown: no thread to run it; the exit closes all
            done.set()
        if not done.wait(timeout):
            log.warning("egress relay of %s: not closed within %.0f s", self.name, timeout)
        self.reservation.close()


def open_tap(pid: int, endpoint: egress.Endpoint, name: str) -> Tap:
    """Relay the sandbox (process `pid`'s network namespace) to `endpoint`'s squid."""
    source, reservation = reserve_source()
    try:
        listener = listener_in_netns(pid)
    except BaseException:
        reservation.close()
        raise
    tap = Tap(name, listener, source, (endpoint.gateway, endpoint.port), reservation)
    RELAY.submit(("add", tap, None))
    return tap


# ----------------------------------------------------------------------------- the relay


class _Conn:
    """One relayed connection: `down` from the sandbox, `up` to squid."""

    __slots__ = (
        "tap",
        "down",
        "up",
        "connected",
        "to_up",
        "to_down",
        "down_eof",
        "up_eof",
        "up_shut",
        "down_shut",
        "events",
    )

    def __init__(self, tap: Tap, down: socket.socket, up: socket.socket) -> None:
        self.tap, self.down, self.up = tap, down, up
        self.connected = False
        self.to_up = memoryview(b"")
        self.to_down = memoryview(b"")
        self.down_eof = self.up_eof = False  # the side sent FIN
        self.up_shut = self.down_shut = False  # we passed the FIN on
        self.events: dict[socket.socket, int] = {down: 0, up: 0}


class _Relay:
    """One thread per process moving bytes between sandboxes' listeners and squid."""

    def __init__(self) -> None:
        self.sel: selectors.BaseSelector | None = None
        self.inbox: queue.SimpleQueue[tuple[str, Tap, threading.Event | None]] = queue.SimpleQueue()
        self.lock = threading.RLock()  # re-entrant: a signal handler may close a sandbox
        self.wake_r: socket.socket | None = None
        self.wake_w: socket.socket | None = None
        self.thread: threading.Thread | None = None
        self.taps: set[Tap] = set()  # open taps (the relay thread's own)

    def submit(self, cmd: tuple[str, Tap, threading.Event | None]) -> None:
        with self.lock:
            if self.thread is None or not self.thread.is_alive():
                self.sel = selectors.DefaultSelector()
                self.wake_r, self.wake_w = socket.socketpair()
                self.wake_r.setblocking(False)
                self.wake_w.setblocking(False)
                self.sel.register(self.wake_r, selectors.EVENT_READ, None)
                self.thread = threading.Thread(target=self._loop, name="sandflow-egress-relay")
                self.thread.daemon = True
                self.thread.start()
            self.inbox.put(cmd)
            assert self.wake_w is not None
            with contextlib.suppress(BlockingIOError):
                self.wake_w.send(b"x")

    # -- loop

    def _loop(self) -> None:
        sel, wake = self.sel, self.wake_r
        assert sel is not None and wake is not None
        while True:
            starved = [t for t in self.taps if t.retry_at]
            timeout = (
                max(0.0, min(t.retry_at for t in starved) - time.monotonic()) if starved else None
            )
            for key, mask in sel.select(timeout):
                try:
                    if key.data is None:
                        with contextlib.suppress(BlockingIOError):
                            wake.recv(4096)
                        self._commands(sel)
                    elif isinstance(key.data, Tap):
                        self._accept(sel, key.data)
                    else:
                        self._io(sel, key.data, key.fileobj, mask)  # type: ignore[arg-type]
                except Exception:  # noqa: BLE001 - one bad connection must not end the relay
                    log.exception("egress relay: unexpected error (connection dropped)")
                    if isinstance(key.data, _Conn):
                        self._close(sel, key.data)
            now = time.monotonic()
            for tap in starved:
                if tap.retry_at and tap.retry_at <= now:
                    tap.retry_at = 0.0
                    self._resume(sel, tap)

    def _commands(self, sel: selectors.BaseSelector) -> None:
        while True:
            try:
                op, tap, done = self.inbox.get_nowait()
            except queue.Empty:
                return
            if op == "add":
                sel.register(tap.listener, selectors.EVENT_READ, tap)
                self.taps.add(tap)
            elif op == "remove":
                self.taps.discard(tap)
                if not tap.closed:
                    tap.closed = True
                    if not tap.paused:
                        sel.unregister(tap.listener)
                    tap.listener.close()
                    for conn in list(tap.conns):
                        self._close(sel, conn)
                if done is not None:
                    done.set()

    def _accept(self, sel: selectors.BaseSelector, tap: Tap) -> None:
        if tap.closed:
            return
        for _ in range(16):  # a few per turn, so one sandbox cannot hold the loop
            if len(tap.conns) >= MAX_CONNS:
                self._pause(sel, tap)
                return
            try:
                down, _ = tap.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of fds (EMFILE, ENFILE) or memory: back off, not spin
                self._starve(sel, tap, f"accept failed: {e}")
                return
            try:
                up = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            except OSError as e:
                down.close()
                self._starve(sel, tap, f"no socket to the proxy: {e}")
                return
            down.setblocking(False)
            up.setblocking(False)
            for s in (down, up):  # no Nagle delay of our own: the endpoints chose their writes
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                up.bind((tap.source, 0))
                err = up.connect_ex(tap.upstream)
                if err not in (0, errno.EINPROGRESS):
                    raise OSError(err, os.strerror(err))
            except OSError as e:
                log.warning("egress relay of %s: cannot reach the proxy: %s", tap.name, e)
                down.close()
                up.close()
                continue
            conn = _Conn(tap, down, up)
            tap.conns.add(conn)
            tap.accepted += 1
            self._update(sel, conn)

    def _io(self, sel: selectors.BaseSelector, conn: _Conn, sock: socket.socket, mask: int) -> None:
        if conn not in conn.tap.conns:  # closed earlier in this same round of events
            return
        try:
            if sock is conn.up:
                if not conn.connected and mask & selectors.EVENT_WRITE:
                    err = conn.up.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                    if err:
                        raise OSError(err, os.strerror(err))
                    conn.connected = True
                if mask & selectors.EVENT_READ:
                    self._read(conn, from_up=True)
            elif mask & selectors.EVENT_READ:
                self._read(conn, from_up=False)
            self._flush(conn)
        except OSError:  # a reset, a broken pipe: the connection is over for both sides
            self._close(sel, conn)
            return
        if conn.down_eof and conn.up_eof and not conn.to_up and not conn.to_down:
            self._close(sel, conn)
        else:
            self._update(sel, conn)

    def _read(self, conn: _Conn, from_up: bool) -> None:
        src = conn.up if from_up else conn.down
        try:
            data = src.recv(CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        if from_up:
            if data:
                conn.to_down = memoryview(data)
            else:
                conn.up_eof = True
        elif data:
            conn.to_up = memoryview(data)
        else:
            conn.down_eof = True

    def _flush(self, conn: _Conn) -> None:
        """Send what is pending each way; pass a FIN on once its side's data is all sent."""
        if conn.connected and conn.to_up:
            with contextlib.suppress(BlockingIOError, InterruptedError):
                conn.to_up = conn.to_up[conn.up.send(conn.to_up) :]
        if conn.to_down:
            with contextlib.suppress(BlockingIOError, InterruptedError):
                conn.to_down = conn.to_down[conn.down.send(conn.to_down) :]
        if conn.connected and conn.down_eof and not conn.to_up and not conn.up_shut:
            conn.up.shutdown(socket.SHUT_WR)
            conn.up_shut = True
        if conn.up_eof and not conn.to_down and not conn.down_shut:
            conn.down.shutdown(socket.SHUT_WR)
            conn.down_shut = True

    def _update(self, sel: selectors.BaseSelector, conn: _Conn) -> None:
        """Watch each side for what can move now: read only when the other way is clear."""
        want_down = 0
        if not conn.down_eof and not conn.to_up:
            want_down |= selectors.EVENT_READ
        if conn.to_down:
            want_down |= selectors.EVENT_WRITE
        want_up = 0
        if not conn.connected:
            want_up = selectors.EVENT_WRITE
        else:
            if not conn.up_eof and not conn.to_down:
                want_up |= selectors.EVENT_READ
            if conn.to_up:
                want_up |= selectors.EVENT_WRITE
        for sock, want in ((conn.down, want_down), (conn.up, want_up)):
            have = conn.events[sock]
            if want == have:
                continue
            if not have:
                sel.register(sock, want, conn)
            elif not want:
                sel.unregister(sock)
            else:
                sel.modify(sock, want, conn)
            conn.events[sock] = want

    def _close(self, sel: selectors.BaseSelector, conn: _Conn) -> None:
        for sock in (conn.down, conn.up):
            if conn.events.get(sock):
                with contextlib.suppress(KeyError, ValueError):
                    sel.unregister(sock)
            conn.events[sock] = 0
            sock.close()
        conn.tap.conns.discard(conn)
        if not conn.tap.retry_at:
            self._resume(sel, conn.tap)

    def _pause(self, sel: selectors.BaseSelector, tap: Tap) -> None:
        if not tap.paused and not tap.closed:
            sel.unregister(tap.listener)
            tap.paused = True

    def _resume(self, sel: selectors.BaseSelector, tap: Tap) -> None:
        if tap.paused and not tap.closed and len(tap.conns) < MAX_CONNS:
            sel.register(tap.listener, selectors.EVENT_READ, tap)
            tap.paused = False

    def _starve(self, sel: selectors.BaseSelector, tap: Tap, why: str) -> None:
        """The listener stays readable while accept fails: unwatch it for RETRY_S, so the
        loop does not spin (and logs once per pause, not once per attempt)."""
        log.warning("egress relay of %s: %s; retrying in %.0f s", tap.name, why, RETRY_S)
        self._pause(sel, tap)
        tap.retry_at = time.monotonic() + RETRY_S


RELAY = _Relay()
