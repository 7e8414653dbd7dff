"""User-mode NAT for bubblewrap sandboxes with network policy "bridge" (slirp4netns).

bubblewrap has no bridge: without `--unshare-net` a sandbox shares the host's network
namespace, so every service on the host's 127.0.0.1 answers it. With "bridge" the
sandbox therefore gets its own network namespace (like "none"), and slirp4netns,
attached to that namespace by the sandbox's pid, gives it a tap device whose traffic
leaves through ordinary sockets of this process's user: outbound connections work like
Docker's bridge (10.0.2.100, gateway 10.0.2.2, DNS 10.0.2.3), while
`--disable-host-loopback` refuses the one path slirp would open to the host's loopback
(10.0.2.2 -> 127.0.0.1). Each sandbox has its own slirp and namespace, so sandboxes
cannot reach each other. slirp4netns runs sandboxed itself (own mount namespace, no
capabilities, seccomp) and exits when its exit pipe closes: when the sandbox is closed,
or when this process dies (kill -9 included), since only this process holds the pipe.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import shutil
import subprocess
import tempfile
import time

from sandbox.base import SandboxError

SLIRP = "slirp4netns"
TAP = "tap0"
RESOLV_CONF = b"nameserver 10.0.2.3\n"  # slirp's built-in DNS forwarder
READY_TIMEOUT_S = 20.0
NS_GET_USERNS = 0xB701  # ioctl(2) on a namespace fd: the user namespace that owns it
TUN = "/dev/net/tun"


def readable(fds: list[int], timeout: float) -> list[int]:
    """The fds of `fds` ready to read (or at EOF) within `timeout` seconds.

    poll, not select: select cannot watch an fd above 1023, and a process holding a few
    hundred sandboxes (three pipes each) has fds far above that.
    """
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    return [fd for fd, _ in poller.poll(max(0.0, timeout) * 1000)]


def slirp_available() -> str | None:
    """Why network="bridge" cannot run on the bwrap backend here, or None when it can."""
    if shutil.which(SLIRP) is None:
        return (
            "bwrap network policy 'bridge' needs slirp4netns (user-mode NAT in the sandbox's own "
            "network namespace): `apt-get install -y slirp4netns` (or scripts/setup.sh); or use "
            "network 'none', or the docker backend"
        )
    if os.geteuid() != 0 and not os.access(TUN, os.R_OK | os.W_OK):
        return (
            f"bwrap network policy 'bridge' as a normal user needs read/write access to {TUN} "
            "(slirp4netns opens its tap device there), which this user lacks; run as root, "
            "make the device 0666 as most distributions do, or use network 'none'"
        )
    return None


class UserNat:
    """One slirp4netns process serving one sandbox's network namespace."""

    def __init__(self, target_pid: int, name: str) -> None:
        self.name = name
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (lives as long as slirp: its error text)
        keep: list[int] = []
        userns: list[str] = []
        if os.geteuid() != 0:
            # Unprivileged bwrap creates the network namespace in one user namespace and runs
            # the sandbox in another: join the one that owns the network namespace.
            net = os.open(f"/proc/{target_pid}/ns/net", os.O_RDONLY)
            try:
                owner = fcntl.ioctl(net, NS_GET_USERNS)
            finally:
                os.close(net)
            keep.append(owner)
            userns = [f"--userns-path=/proc/self/fd/{owner}"]
        ready_r, ready_w = os.pipe()
        exit_r, self._exit_w = os.pipe()
        argv = [
            SLIRP,
            "--configure",
            "--mtu=65520",
            "--disable-host-loopback",
            "--enable-sandbox",
            "--enable-seccomp",
            f"--ready-fd={ready_w}",
            f"--exit-fd={exit_r}",
            *userns,
            str(target_pid),
            TAP,
        ]
        try:
            self.proc: subprocess.Popen[bytes] | None = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=self.log,
                stderr=self.log,
                pass_fds=(ready_w, exit_r, *keep),
                env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
                start_new_session=True,  # Ctrl+C to our process group must not cut the network first
            )
        except OSError as e:
            for fd in (ready_r, ready_w, exit_r, self._exit_w, *keep):
                os.close(fd)
            self.log.close()
            raise SandboxError(f"sandbox {name}: cannot start slirp4netns: {e}") from None
        for fd in (ready_w, exit_r, *keep):
            os.close(fd)
        try:
            self._wait_ready(ready_r)
        except BaseException:
            self.close()
            raise
        finally:
            os.close(ready_r)

    def _wait_ready(self, ready_r: int) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            r = readable([ready_r], 0.2)
            if r and os.read(ready_r, 1) == b"1":
                return
            if self.proc.poll() is not None:
                break
        raise SandboxError(
            f"sandbox {self.name}: slirp4netns did not bring up the network of network policy "
            f"'bridge' within {READY_TIMEOUT_S:.0f} s (status {self.proc.poll()}): {self.output()[-500:]}"
        )

    def output(self) -> str:
        with contextlib.suppress(OSError, ValueError):
            self.log.seek(0)
            return self.log.read().decode("utf-8", "replace")
        return ""

    def close(self) -> None:
        """Close the exit pipe (slirp exits on that event); kill it if it lingers."""
        if self._exit_w >= 0:
            with contextlib.suppress(OSError):
                os.close(self._exit_w)
            self._exit_w = -1
        proc, self.proc = self.proc, None
        if proc is not None:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5)
        with contextlib.suppress(OSError):
            self.log.close()


def read_child_pid(info_r: int, proc: subprocess.Popen[bytes], timeout: float = 20.0) -> int:
    """The sandbox's pid from bwrap's --info-fd JSON (written once its namespaces exist)."""
    import json

    buf = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = readable([info_r], 0.2)
        if r:
            chunk = os.read(info_r, 4096)
            buf += chunk
            with contextlib.suppress(ValueError):
                return int(json.loads(buf)["child-pid"])
            if not chunk:
                break
        elif proc.poll() is not None:
            break
    raise SandboxError(
        f"bwrap did not report its sandbox's pid (status {proc.poll()}, info {buf[:200]!r}); "
        "cannot attach its network (policy 'bridge', 'allowlist' or 'open')"
    )
