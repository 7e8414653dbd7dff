"""The bubblewrap backend: no daemon, the same root filesystem, the same helper as PID 1.

For clusters where Docker is not allowed. `bwrap` builds fresh namespaces (pid, ipc,
uts, net unless the policy is "host", mount) over the image's root filesystem mounted
read-only (sandbox.image.rootfs_path()), with sized tmpfs mounts for /testbed, /tmp and
/home/sandbox, and runs the helper as the sandbox's PID 1 (`--as-pid-1`). The helper's
stdin/stdout are our pipes; `--die-with-parent` ends the sandbox with this process.

Network: "none" is an empty namespace (its own loopback only); "bridge" is an own
namespace too, with user-mode NAT by slirp4netns (sandbox.bwrap_net): outbound traffic
works, the host's 127.0.0.1 services and other sandboxes do not answer; "host" shares
the host's network namespace (everything on the host's loopback answers: opt-in only);
"allowlist" / "open" is the empty namespace plus one listener on its 127.0.0.1 that relays
to the policy's shared egress proxy (sandbox.bwrap_egress), bound before the helper runs
(as root or as a normal user).

Identity: as root, `setpriv` leaves the helper (PID 1) uid 0 with only CAP_SETUID,
CAP_SETGID, CAP_KILL and CAP_SETPCAP and no_new_privs; every process it starts runs as uid
1000 with no capability and an empty bounding set (sandbox/_helper.py: the sandbox user
cannot reach the helper's pipes). As a normal user, an unprivileged user namespace maps
the caller to uid 1000 (`--unshare-user --uid 1000`): one uid for all, so only the
helper's non-dumpable mark keeps its pipes out of reach.

Limits: as root on a cgroup v1 host, each sandbox gets its own memory (+swap), pids and
cpu cgroup, so they are enforced like docker's. Without cgroups the helper applies
rlimits instead (address space for memory, RLIMIT_NPROC for processes: per-uid, so
shared between all sandboxes of the same user), and cpus is not enforced.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import time
from pathlib import Path

from sandbox import bwrap_egress, egress, reaper, registry, seccomp, volumes
from sandbox.base import SandboxConfig, SandboxError
from sandbox.bwrap_net import RESOLV_CONF, UserNat, read_child_pid, readable, slirp_available
from sandbox.common import HELPER_CAPS, HOME, SANDBOX_GID, SANDBOX_UID, HelperSandbox, privsep
from sandbox.gc import write_bwrap_state
from sandbox.labels import make_labels
from sandbox.protocol import BOOT_ARGV, TransportClosed
from sandbox.settings import current as host_settings
from sandbox.usage import ResourceUsage, from_cgroup_v1

CGROUP_ROOT = Path("/sys/fs/cgroup")
CGROUP_PARENT = "sandflow"


class PipeTransport:
    """The helper's stdin/stdout as pipes of the bwrap process."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdin and proc.stdout and proc.stderr
        self.proc = proc
        self.w = proc.stdin.fileno()
        self.r = proc.stdout.fileno()
        self.e = proc.stderr.fileno()
        self.err = bytearray()
        os.set_blocking(self.r, False)
        os.set_blocking(self.e, False)

    def send(self, data: bytes) -> None:
        view = memoryview(data)
        try:
            while view:
                n = os.write(self.w, view)
                view = view[n:]
        except (BrokenPipeError, OSError) as e:
            raise TransportClosed(str(e)) from None

    def recv(self, timeout: float) -> bytes:
        deadline = time.monotonic() + timeout
        while True:
            left = max(0.0, deadline - time.monotonic())
            r = readable([self.r, self.e], left)
            if self.e in r:
                try:
                    chunk = os.read(self.e, 65536)
                except BlockingIOError:
                    chunk = b""
                self.err += chunk
                del self.err[:-4096]
            if self.r in r:
                try:
                    chunk = os.read(self.r, 1 << 20)
                except BlockingIOError:
                    continue
                if not chunk:
                    raise TransportClosed("helper stdout closed")
                return chunk
            if not r or time.monotonic() >= deadline:
                return b""

    def diagnostics(self) -> str:
        return self.err.decode("utf-8", "replace")

    def close(self) -> None:
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                if f:
                    f.close()
            except OSError:
                pass


class Cgroups:
    """One cgroup v1 directory per controller for one sandbox (root only)."""

    CONTROLLERS = ("memory", "pids", "cpu")

    def __init__(self, name: str) -> None:
        self.dirs = {c: CGROUP_ROOT / c / CGROUP_PARENT / name for c in self.CONTROLLERS}
        # CPU accounting (sandbox/usage.py) where cpuacct is a hierarchy of its own; when it
        # is mounted with cpu ("cpu,cpuacct"), the cpu directory has its files already.
        acct = CGROUP_ROOT / "cpuacct"
        if (acct / "cgroup.procs").exists() and acct.resolve() != (CGROUP_ROOT / "cpu").resolve():
            self.dirs["cpuacct"] = acct / CGROUP_PARENT / name

    @staticmethod
    def available() -> bool:
        return os.geteuid() == 0 and all(
            (CGROUP_ROOT / c / "cgroup.procs").exists() for c in Cgroups.CONTROLLERS
        )

    def create(self, memory_mb: int, pids: int, cpus: float) -> None:
        for d in self.dirs.values():
            d.mkdir(parents=True, exist_ok=True)
        mem = self.dirs["memory"]
        (mem / "memory.limit_in_bytes").write_text(str(memory_mb << 20))
        swap = mem / "memory.memsw.limit_in_bytes"
        if swap.exists():
            swap.write_text(str(memory_mb << 20))
        (self.dirs["pids"] / "pids.max").write_text(str(pids))
        cpu = self.dirs["cpu"]
        period = int((cpu / "cpu.cfs_period_us").read_text())
        (cpu / "cpu.cfs_quota_us").write_text(str(int(cpus * period)))

    @property
    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs.values()]

    def usage(self) -> ResourceUsage:
        acct = self.dirs.get("cpuacct", self.dirs["cpu"])
        return from_cgroup_v1(acct, self.dirs["memory"])

    @property
    def oom_file(self) -> Path:
        return self.dirs["memory"] / "memory.oom_control"

    def remove(self) -> None:
        """Kill what is left inside, then remove the directories (they must be empty)."""
        procs = self.dirs["pids"] / "cgroup.procs"
        for _ in range(100):
            try:
                pids = [int(p) for p in procs.read_text().split()]
            except OSError:
                pids = []
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, 9)
            gone = True
            for d in self.dirs.values():
                try:
                    d.rmdir()
                except FileNotFoundError:
                    pass
                except OSError:
                    gone = False
            if gone:
                return
            time.sleep(0.01)


def bwrap_available() -> str | None:
    """Why the bwrap backend cannot run here, or None when it can."""
    if shutil.which("bwrap") is None:
        return "bubblewrap is not installed: `apt-get install -y bubblewrap` (or scripts/setup.sh)"
    return None


class BwrapSandbox(HelperSandbox):
    backend = "bwrap"

    def __init__(self, config: SandboxConfig) -> None:
        super().__init__(config)
        network = config.limits.network
        why = bwrap_available() or (slirp_available() if network == "bridge" else None)
        if not why and network in ("allowlist", "open"):
            why = bwrap_egress.unavailable()
            why = f"network policy {network!r}: {why}" if why else None
        if why:
            raise SandboxError(why)
        self.tap: bwrap_egress.Tap | None = None
        if network in ("allowlist", "open"):
            self.egress = bwrap_egress.endpoint_for(config.limits)
            self._egress_cursor = egress.LogCursor.at_end(self.egress)
        self._created_at = time.time()  # a source address is reused once its sandbox is gone
        self.rootfs = _rootfs_for(config.image)
        if not (self.rootfs / config.workdir.lstrip("/")).is_dir():
            raise SandboxError(
                f"workdir {config.workdir!r} does not exist in the root filesystem {self.rootfs} "
                "(bubblewrap cannot create mount points on a read-only root); use /testbed "
                "or a folder the image has"
            )
        self.id = f"{_slug(config.run_id)}-{secrets.token_hex(4)}"
        self.labels = make_labels(config, self.backend)
        self.cgroups: Cgroups | None = Cgroups(self.id) if Cgroups.available() else None
        self.proc: subprocess.Popen[bytes] | None = None
        self.ctl: socket.socket | None = None  # the helper's control socket (a fork's pipes)
        self.ctl_fd_inside = -1
        self.nat: UserNat | None = None
        self.state_file: Path | None = None
        # copy-on-write places (sandbox/volumes.py): the subvolume shown at them now
        self.volumes: volumes.Volumes | None = None
        self.volume = ""
        self._forks_in = 0
        self._stale_volumes: list[str] = []
        if (root := host_settings().bwrap_volumes) is not None:
            try:
                self.volumes = volumes.for_root(root)
            except volumes.VolumesUnavailable as e:
                raise SandboxError(str(e)) from None
        t0 = time.perf_counter()
        reaper.ensure_started(docker=False)  # a kill -9 of ours leaves no cgroup nor state file
        self._start()
        self.start_s = time.perf_counter() - t0

    @property
    def name(self) -> str:
        return f"bwrap-{self.id}"

    def _argv(
        self,
        info_fd: int | None = None,
        resolv_fd: int | None = None,
        block_fd: int | None = None,
        seccomp_fd: int | None = None,
    ) -> list[str]:
        """bwrap's command line; with "bridge", the fds for its pid report and resolv.conf;
        with an egress policy, the pid report and the fd bwrap waits on before the helper;
        `seccomp_fd` holds the syscall filter (sandbox/seccomp.py) bwrap loads last."""
        lim = self.config.limits
        size = str(lim.tmp_size_mb << 20)
        argv = ["bwrap", "--die-with-parent", "--as-pid-1", "--new-session"]
        if seccomp_fd is not None:
            argv += ["--seccomp", str(seccomp_fd)]
        argv += ["--unshare-ipc", "--unshare-pid", "--unshare-uts", "--unshare-cgroup-try"]
        if lim.network != "host":
            argv += ["--unshare-net"]
        if info_fd is not None:
            argv += ["--info-fd", str(info_fd)]
        if block_fd is not None:
            argv += ["--block-fd", str(block_fd)]
        root = os.geteuid() == 0
        if not root:
            argv += ["--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_GID)]
        argv += ["--hostname", "sandbox", "--ro-bind", str(self.rootfs), "/"]
        argv += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/run"]
        argv += _PROC_MASKS
        # the IPC namespace's POSIX message queues, visible (as with docker) so a pooled
        # sandbox's reset can remove them (sandbox/pool.py)
        argv += ["--mqueue", "/dev/mqueue"]
        # POSIX shared memory (multiprocessing's locks and shared_memory, joblib, a torch
        # DataLoader): as docker's, a 1777 tmpfs of shm_size_mb (bwrap's /dev has only
        # a root-owned folder there)
        argv += ["--perms", "1777", "--size", str(lim.shm_size_mb << 20), "--tmpfs", "/dev/shm"]
        if self.volumes is not None:  # the box's own subvolume (bwrap adds nosuid, nodev)
            top = self.volumes.path(self.id)
            for place, path in zip(volumes.PLACES, self._place_paths(), strict=True):
                argv += ["--bind", str(top / place), path]
        else:
            for path in self._place_paths():
                argv += ["--perms", "1777", "--size", size, "--tmpfs", path]
        if resolv_fd is not None:
            argv += ["--perms", "0444", "--ro-bind-data", str(resolv_fd), "/etc/resolv.conf"]
        elif lim.network == "host" and Path("/etc/resolv.conf").exists():
            argv += ["--ro-bind", "/etc/resolv.conf", "/etc/resolv.conf"]
        argv += ["--clearenv", "--chdir", self.config.workdir]
        for k, v in self._environment().items():
            argv += ["--setenv", k, v]
        argv += ["--"]
        if root and privsep():
            # The helper stays uid 0 with four capabilities (the bounding set caps what an
            # exec as root gets); it starts everything else as the sandbox user, capless.
            caps = ",".join("+" + c.lower() for c in HELPER_CAPS)
            argv += [
                "/usr/bin/setpriv",
                "--clear-groups",
                "--inh-caps=-all",
                f"--bounding-set=-all,{caps}",
                "--no-new-privs",
            ]
        elif root:
            argv += [
                "/usr/bin/setpriv",
                f"--reuid={SANDBOX_UID}",
                f"--regid={SANDBOX_GID}",
                "--clear-groups",
                "--inh-caps=-all",
                "--bounding-set=-all",
                "--no-new-privs",
            ]
        return argv + BOOT_ARGV

    def _place_paths(self) -> tuple[str, str, str]:
        return ("/tmp", self.config.workdir, HOME)  # in the order of volumes.PLACES

    def _volume_limit(self) -> int:
        """What a volume may write: as much as the three tmpfs places would hold."""
        return len(volumes.PLACES) * (self.config.limits.tmp_size_mb << 20)

    def take_snapshot_of(self, parent: BwrapSandbox) -> None:
        """Show a snapshot of `parent`'s places at this sandbox's (a fork: sandbox/fork.py).
        The subvolume shown before is removed once nothing holds it."""
        assert self.volumes is not None and parent.volumes is self.volumes
        self._forks_in += 1
        name = f"{self.id}.f{self._forks_in}"
        self.volumes.snapshot(parent.volume, name, self._volume_limit())
        try:
            self.volumes.mount_over(name, self.id)
        except BaseException:
            self.volumes.unmount(self.id)
            self.volumes.delete(name)
            raise
        if self.volume != self.id:
            self._stale_volumes.append(self.volume)
        self.volume = name
        self._drop_stale_volumes()

    def reset(self) -> list[str]:
        """The pool's reset; a child shown a snapshot gets its own (empty) subvolume back
        first, so the reset wipes nothing the fork brought: its cost does not grow with
        what the parent held."""
        if self.volumes is not None and self.volume != self.id and not self.closed:
            if not self.volumes.unmount(self.id):
                return [f"reset: the snapshot over {self.name}'s places could not be detached"]
            self._stale_volumes.append(self.volume)
            self.volume = self.id
        failed = super().reset()
        self._drop_stale_volumes()
        return failed

    def _drop_stale_volumes(self) -> None:
        """Delete the snapshots this sandbox no longer shows (kept while still held)."""
        if self.volumes is not None:
            self._stale_volumes = [v for v in self._stale_volumes if not self.volumes.delete(v)]

    def _environment(self) -> dict[str, str]:
        from sandbox.image import image_env

        lim = self.config.limits
        env = {**image_env(), **self.config.env, "HOME": HOME, "USER": "sandbox"}
        env["SANDFLOW_WORKDIR"] = self.config.workdir
        env["SANDFLOW_PIDS_LIMIT"] = str(lim.pids)
        env["SANDFLOW_UID"], env["SANDFLOW_GID"] = str(SANDBOX_UID), str(SANDBOX_GID)
        if lim.wall_clock_s:
            env["SANDFLOW_LIFETIME_S"] = str(lim.wall_clock_s + 5.0)
        if self.cgroups is None:
            env["SANDFLOW_RLIMITS"] = f"AS={lim.memory_mb << 20},NPROC={lim.pids}"
        if self.egress is not None:
            env.update(bwrap_egress.sandbox_env(self.egress))
        if self.ctl_fd_inside >= 0:
            env["SANDFLOW_CTL_FD"] = str(self.ctl_fd_inside)
        if self.volumes is not None:
            env["SANDFLOW_SHARED_FS_PLACES"] = ":".join(self._place_paths())
        return env

    def _start(self) -> None:
        lim = self.config.limits
        if self.cgroups is not None:
            try:
                self.cgroups.create(lim.memory_mb, lim.pids, lim.cpus)
            except OSError as e:
                self.cgroups.remove()
                raise SandboxError(f"cannot set up cgroups for {self.name}: {e}") from None
        if self.volumes is not None:
            try:
                self.volumes.create(self.id, self._volume_limit())
            except OSError as e:
                if self.cgroups is not None:
                    self.cgroups.remove()
                raise SandboxError(f"cannot make the volume of {self.name}: {e}") from None
            self.volume = self.id
        try:
            filter_r = seccomp.program_fd()
        except seccomp.SeccompUnavailable as e:
            if self.cgroups is not None:
                self.cgroups.remove()
            if self.volumes is not None:
                self.volumes.remove_box(self.id)
            raise SandboxError(str(e)) from None
        # the helper's control socket: a fork's pipe ends are passed over it (sandbox/fork.py)
        self.ctl, ctl_box = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.ctl_fd_inside = ctl_box.detach()
        fds: list[int] = [filter_r, self.ctl_fd_inside]  # ours to close once bwrap has them
        info_r = block_w = -1
        if self.egress is not None:
            # bwrap reports the sandbox's pid, then waits on block_r (after its namespaces and
            # loopback exist, before the helper runs): the relay's listener is in place before
            # any process of the sandbox, and in the helper's boot snapshot of sockets.
            info_r, info_w = os.pipe()
            block_r, block_w = os.pipe()
            fds += [info_w, block_r]
            argv = self._argv(info_w, block_fd=block_r, seccomp_fd=filter_r)
        elif lim.network == "bridge":
            info_r, info_w = os.pipe()
            resolv_r, resolv_w = os.pipe()
            os.write(resolv_w, RESOLV_CONF)  # far below a pipe's buffer: bwrap reads it to EOF
            os.close(resolv_w)
            fds += [info_w, resolv_r]
            argv = self._argv(info_w, resolv_r, seccomp_fd=filter_r)
        else:
            argv = self._argv(seccomp_fd=filter_r)
        if self.cgroups is not None:
            # Join the cgroups *before* exec'ing bwrap, so every sandbox process starts inside.
            join = 'for f in "$@"; do [ "$f" = -- ] && break; echo $$ > "$f"; shift; done; shift; exec "$@"'
            argv = ["/bin/sh", "-c", join, "sh", *self.cgroups.procs_files, "--", *argv]
        registry.register(self)
        try:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},  # never the host's environment
                start_new_session=True,
                pass_fds=fds,
            )
            for fd in fds:
                os.close(fd)
            fds = []
            self.transport = PipeTransport(self.proc)
            cgroup_dirs = [str(d) for d in self.cgroups.dirs.values()] if self.cgroups else []
            self.state_file = write_bwrap_state(
                self.id, self.proc.pid, self.labels, cgroup_dirs,
                volumes=str(self.volumes.root) if self.volumes is not None else None,
            )  # fmt: skip
            child = read_child_pid(info_r, self.proc) if info_r >= 0 else None
            if self.egress is not None and child is not None:
                self.tap = bwrap_egress.open_tap(child, self.egress, self.name)
                self.egress_address = self.tap.source
                os.write(block_w, b"1")
                child = None  # no slirp: the relay is this sandbox's only way out
        except BaseException:
            self.kill()  # before block_w closes: a sandbox without its relay never runs
            raise
        finally:
            for fd in [*fds, info_r, block_w]:
                if fd >= 0:
                    os.close(fd)
        self._boot(self._new_client(self.transport))
        if child is not None:
            # Only after boot: bwrap sets up the sandbox's loopback before it execs the helper,
            # and slirp4netns --configure brings lo up too; racing it made bwrap fail under load
            # ("loopback: Failed RTM_NEWADDR"). No command of the sandbox has run yet.
            try:
                self.nat = UserNat(child, self.name)
            except BaseException:
                self.kill()
                raise

    def _destroy(self) -> None:
        proc = self.proc
        if proc is not None:
            with contextlib.suppress(OSError):
                proc.kill()  # bwrap dies; --die-with-parent kills PID 1, the kernel the rest
            self.transport.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        if self.nat is not None:
            self.nat.close()
        if self.tap is not None:
            self.tap.close()
        if self.ctl is not None:
            self.ctl.close()
        if self.cgroups is not None:
            self.cgroups.remove()
        if self.volumes is not None and self.volume and not self.volumes.remove_box(self.id, 1.0):
            return  # the state file stays: gc removes what is left (sandbox/gc.py)
        if self.state_file is not None:
            self.state_file.unlink(missing_ok=True)

    def _check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            code = self.proc.returncode
            self.kill()
            raise SandboxError(
                f"sandbox {self.name}: the bwrap process exited (status {code}); the sandbox died"
                + (
                    f"; helper said: {self.transport.diagnostics()[-500:]}"
                    if self.transport.diagnostics()
                    else ""
                )
            )

    def _usage_now(self) -> ResourceUsage:
        return self.cgroups.usage() if self.cgroups is not None else ResourceUsage()

    def _oom_counter(self) -> int | None:
        if self.cgroups is None:
            return None
        try:
            for line in self.cgroups.oom_file.read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            return None
        return None

    def _put_tar(self, dest_dir: str, data: bytes) -> None:
        self._helper_put(dest_dir, data)



# What Docker masks in /proc, where this kernel has it: /proc/keys lists the descriptions
# of every key the caller's uid may view, /proc/timer_list other processes' timers.
_PROC_MASKS = [
    arg
    for name in ("keys", "key-users", "kcore", "timer_list", "sched_debug", "latency_stats")
    if Path(f"/proc/{name}").is_file()
    for arg in ("--ro-bind", "/dev/null", f"/proc/{name}")
]


def _slug(s: str) -> str:
    keep = "".join(c if c.isalnum() or c in "-_." else "-" for c in s)
    return keep[:40] or "run"


def _rootfs_for(image: str | None) -> Path:
    """The rootfs directory: an explicit path in config.image, else the default spec's."""
    from sandbox.image import DEFAULT_SPEC, rootfs_path

    path = Path(image) if image and image.startswith("/") else rootfs_path(DEFAULT_SPEC)
    if not (path / "usr" / "bin" / "python3").exists():
        raise SandboxError(
            f"The sandbox root filesystem is missing at {path}. Build it with "
            "`sandflow image build` (as root; it debootstraps Debian packages)."
        )
    return path
