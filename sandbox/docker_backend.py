"""The docker backend: one container per sandbox, the helper as its PID 1.

Start = create + attach + start + the helper's ready line (a real round trip through the
shell), which costs about what `containers.run` costs: the helper is attached over the
container's own stdin/stdout (no `docker exec` per command, no second process). With
StdinOnce + AutoRemove, the container removes itself when our connection drops, so even
`kill -9` of this process leaves nothing behind.

Filesystem: the image is mounted read-only; the writable places are sized tmpfs mounts
(/testbed, /tmp, /home/sandbox). Files cross through the helper (docker's archive API
cannot see tmpfs mounts); a per-sandbox volume would cost the engine a volume create and
remove per sandbox for nothing.

Network policy "none": the sandbox joins the namespace of a pooled holder container
instead of getting a fresh one (sandbox/netns.py says why and how isolation holds).
"""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path
from typing import Any

from sandbox import bulk, egress, netns, reaper, registry
from sandbox.base import SandboxConfig, SandboxError
from sandbox.common import HELPER_CAPS, HOME, SANDBOX_GID, SANDBOX_UID, HelperSandbox, privsep
from sandbox.deadline import bounded
from sandbox.engine import docker_client, engine_address, ensure_image
from sandbox.labels import make_labels
from sandbox.protocol import BOOT_ARGV, TransportClosed, recv_some
from sandbox.usage import ResourceUsage, cgroup_dirs, from_cgroup_dirs, from_docker_stats

STREAM_STDOUT = 1
STREAM_STDERR = 2
LIFETIME_SLACK_S = 5.0
DRAIN_S = 30.0  # the longest a removal may need the container's last output drained
MAX_FRAME = 1 << 24  # docker's attach frames carry what one read of the container's pipe got


class AttachTransport:
    """The container's stdin/stdout over docker's attach socket (8-byte frame headers)."""

    def __init__(self, sock: Any) -> None:
        self._holder = sock  # keeps the HTTP response (and so the socket) alive
        self.raw = getattr(sock, "_sock", sock)
        self.frames = bytearray()
        self.err = bytearray()

    def send(self, data: bytes) -> None:
        self.raw.settimeout(60.0)
        self.raw.sendall(data)

    def recv(self, timeout: float) -> bytes:
        chunk = recv_some(self.raw, timeout, "attach stream closed")
        if not chunk:
            return b""
        frames = self.frames
        frames += chunk
        out = bytearray()
        at = 0  # frames parsed by offset, the buffer cut once: a fork's MiB is ~30 frames
        with memoryview(frames) as view:
            while len(frames) - at >= 8:
                kind = frames[at]
                size = int.from_bytes(view[at + 4 : at + 8], "big")
                if size > MAX_FRAME or kind not in (0, STREAM_STDOUT, STREAM_STDERR):
                    raise TransportClosed(f"malformed attach frame (stream {kind}, {size} bytes)")
                if len(frames) - at < 8 + size:
                    break
                if kind == STREAM_STDOUT:
                    out += view[at + 8 : at + 8 + size]
                elif kind == STREAM_STDERR:
                    self.err += view[at + 8 : at + 8 + size]
                    del self.err[:-4096]
                at += 8 + size
        del frames[:at]
        return bytes(out)

    def diagnostics(self) -> str:
        return self.err.decode("utf-8", "replace")

    def drain_in_background(self) -> None:
        """Read and drop what the container still writes, until its stream ends.

        The engine cannot finish removing a container while its copy of the container's
        stdout into our socket is blocked, and it is when PID 1 keeps writing and nobody
        reads (a broken or subverted helper; seen: a 60 s stalled removal). The thread ends
        with the stream (the container died) or when close() shuts the socket.
        """

        def drain() -> None:
            with contextlib.suppress(Exception):
                self.raw.settimeout(DRAIN_S)
                while self.raw.recv(1 << 20):
                    pass

        threading.Thread(target=drain, name="sandflow-attach-drain", daemon=True).start()

    def close(self) -> None:
        for s in (self.raw, self._holder):
            with contextlib.suppress(Exception):
                s.close()


# The engine's default masked paths (moby's oci defaults), plus /proc/key-users: the
# kernel's key counts per uid of the whole host (the keyring itself is refused by the
# engine's seccomp profile; bwrap masks the same files, sandbox/bwrap_backend.py).
MASKED_PATHS = [
    "/proc/asound", "/proc/acpi", "/proc/kcore", "/proc/keys", "/proc/key-users",
    "/proc/latency_stats", "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug",
    "/proc/scsi", "/sys/firmware", "/sys/devices/virtual/powercap",
]  # fmt: skip


class DockerSandbox(HelperSandbox):
    backend = "docker"

    def __init__(self, config: SandboxConfig) -> None:
        super().__init__(config)
        self.client = docker_client(config.docker_host)
        self.api = self.client.api
        self.image = config.image or _default_tag()
        self.container_id = ""
        self._cgroup_for = ""  # the container whose cgroup directories are `_cgroups`
        self._cgroups: dict[str, Path] = {}
        self._holder: netns.Holder | None = None
        self.labels = make_labels(config, self.backend)
        t0 = time.perf_counter()
        ensure_image(self.client, self.image)
        reaper.ensure_started(docker=True, docker_host=config.docker_host)  # kill -9 safety
        if config.limits.network in ("allowlist", "open"):
            self.egress = egress.endpoint_for(self.api, config.limits)
            self._egress_cursor = egress.LogCursor.at_end(self.egress)
        self._start()
        self.start_s = time.perf_counter() - t0

    @property
    def name(self) -> str:
        return self.container_id[:12] or "(starting)"

    def _host_config(self, holder: netns.Holder | None) -> Any:
        from docker.types import LogConfig

        lim = self.config.limits
        size = f"size={lim.tmp_size_mb}m"
        owned = f"{size},uid={SANDBOX_UID},gid={SANDBOX_GID},mode=0755"
        config = self.api.create_host_config(
            auto_remove=True,
            read_only=True,
            network_mode=holder.network_mode if holder else self._network_mode(),
            # the engine's resolver forwards what it cannot answer to these: the proxy's
            # address, where the host firewall refuses anything but the proxy port
            dns=[self.egress.gateway] if self.egress else None,
            cap_drop=["ALL"],
            # the helper's capabilities; its children drop them
            cap_add=list(HELPER_CAPS) if self._privsep() else [],
            security_opt=["no-new-privileges"],
            nano_cpus=int(lim.cpus * 1e9),
            mem_limit=f"{lim.memory_mb}m",
            memswap_limit=f"{lim.memory_mb}m",
            pids_limit=self._host_pids(),
            # stdout is the helper's protocol stream, not a log: the default json-file driver
            # would encode and write every byte of it to disk (and halve file-read speed)
            log_config=LogConfig(type=LogConfig.types.NONE),
            runtime=self.config.runtime,  # None: the engine's default
            shm_size=lim.shm_size_mb << 20,  # /dev/shm, 1777 (the engine's default is 64 MB)
            tmpfs={
                "/tmp": f"{size},mode=1777,exec",
                HOME: f"{owned},exec",
                self.config.workdir: f"{owned},exec",
            },
            binds=[self.bulk.bind] if isinstance(self.bulk, bulk.BulkDir) else None,
        )
        config["MaskedPaths"] = MASKED_PATHS  # replaces the engine's list: keeps all of it
        return config

    def _bulk_dir(self) -> bulk.BulkDir | None:
        """A fork's side channel (sandbox/bulk.py): only with privilege separation (the
        helper is not the sandbox user's uid) and a local engine (its binds are our folders)."""
        if not self._privsep() or not engine_address(self.config.docker_host).startswith("unix://"):
            return None
        try:
            return bulk.BulkDir()
        except OSError:  # no temp folder: forks go over the attach stream
            return None

    def _usage_now(self) -> ResourceUsage:
        """The container's cgroup counters: its cgroup files when this host has them
        (sandbox/usage.py), else the engine's stats (0-1 s: its next collection tick)."""
        if not self.container_id:
            return ResourceUsage()
        if self._cgroup_for != self.container_id:
            self._cgroup_for = self.container_id
            cid = self.container_id
            try:
                pid = bounded("inspect_container", lambda: self.api.inspect_container(cid))["State"]["Pid"]
            except Exception:  # gone, or an answer without a pid: the stats API decides
                pid = 0
            self._cgroups = cgroup_dirs(pid, cid) if isinstance(pid, int) and pid > 0 else {}
        if self._cgroups:
            return from_cgroup_dirs(self._cgroups)
        cid = self.container_id
        return from_docker_stats(bounded("stats", lambda: self.api.stats(cid, stream=False, one_shot=True)))

    def _host_pids(self) -> int:
        """The engine's pids limit: the sandbox's own under runc. Under another runtime the
        cgroup also counts the runtime's host tasks: gVisor's ptrace platform took ~54 for
        itself and ~13 per process of the sandbox (measured: 50 sleeps -> 691), and its
        kernel panicked at the limit ("error initializing first thread: resource
        temporarily unavailable"): 16 per allowed process + 128. The helper still counts
        the sandbox's own processes against `limits.pids` (its runaway check)."""
        pids = self.config.limits.pids
        return pids if self.config.runtime in (None, "runc") else pids * 16 + 128

    def _privsep(self) -> bool:
        """The helper as uid 0 apart from the sandbox user: under runc (the default). Another
        runtime runs it as the sandbox user: gVisor (Debian's runsc 2022-12) does not
        implement setfsuid, which the privileged helper needs and checks (it would refuse to
        start); the channel then rests on the non-dumpable mark and the runtime's own kernel."""
        return privsep() and self.config.runtime in (None, "runc")

    def _environment(self) -> dict[str, str]:
        from sandbox.image import image_env

        lim = self.config.limits
        env = {**image_env(), **self.config.env, "HOME": HOME, "USER": "sandbox"}
        env["SANDFLOW_WORKDIR"] = self.config.workdir
        if self.egress is not None:
            env.update(self.egress.sandbox_env())
        env["SANDFLOW_PIDS_LIMIT"] = str(lim.pids)
        env["SANDFLOW_UID"], env["SANDFLOW_GID"] = str(SANDBOX_UID), str(SANDBOX_GID)
        if lim.wall_clock_s:
            env["SANDFLOW_LIFETIME_S"] = str(lim.wall_clock_s + LIFETIME_SLACK_S)
        return env

    def _start(self) -> None:
        """Create + attach + start; with a netns holder, a dead holder is replaced once."""
        # gVisor (or another runtime) brings its own network stack: no pooled runc namespace
        pooled = netns.enabled(self.config.limits.network) and not self.config.runtime
        pool = netns.pool_for(self.api, self.image) if pooled else None
        for attempt in range(2):
            self._holder = pool.acquire(fresh=attempt > 0) if pool else None
            try:
                self._create_and_start()
                break
            except _HolderGone as e:
                if attempt or pool is None:
                    raise SandboxError(
                        f"cannot start sandbox: its network-namespace holder died twice ({e})"
                    ) from None
                pool.prune()  # its idle siblings likely died with it (engine restart)
        self._boot(self._new_client(self.transport))

    def _create_and_start(self) -> None:
        import docker.errors

        holder = self._holder
        if self.bulk is None:
            self.bulk = self._bulk_dir()
        host_config = self._host_config(holder)
        try:
            created = bounded(
                "create_container",
                lambda: self.api.create_container(
                    self.image,
                    BOOT_ARGV,
                    user="0:0" if self._privsep() else f"{SANDBOX_UID}:{SANDBOX_GID}",
                    working_dir=self.config.workdir,
                    # the engine refuses a hostname with a container: network; the holder has it
                    hostname=None if holder else "sandbox",
                    environment=self._environment(),
                    labels=self.labels,
                    stdin_open=True,
                    detach=False,  # with stdin_open: StdinOnce: our disconnect ends the container
                    host_config=host_config,
                ),
                late=lambda c: self.api.remove_container(c["Id"], force=True),
            )
        except docker.errors.APIError as e:
            self._drop_bulk()
            if holder is not None and not holder.pool.alive(holder):
                self._drop_holder(removed=False)
                raise _HolderGone(str(e)) from None
            self._drop_holder(removed=True)  # nothing was created: the holder is untouched
            raise SandboxError(
                f"cannot create a sandbox container from {self.image}: {e}"
            ) from None
        except BaseException:
            self._drop_holder(removed=False)  # a late container may still join it: discard
            self._drop_bulk()
            raise
        self.container_id = created["Id"]
        registry.register(self)
        try:
            params = {"stdin": 1, "stream": 1, "stdout": 1, "stderr": 1}
            sock = bounded(
                "attach_socket",
                lambda: self.api.attach_socket(self.container_id, params=params),
                late=lambda s: AttachTransport(s).close(),
            )
            self.transport = AttachTransport(sock)
            bounded("start", lambda: self.api.start(self.container_id))
            if self.egress is not None:
                self.egress_address = egress.container_address(
                    self.api, self.container_id, self.egress.network
                )
        except BaseException as e:
            dead = isinstance(e, docker.errors.APIError) and holder is not None
            if dead and holder is not None and not holder.pool.alive(holder):
                self._abandon_start()
                raise _HolderGone(str(e)) from None
            self.kill()
            if isinstance(e, docker.errors.APIError):
                hint = ""
                if "network" in str(e) or "bridge" in str(e):
                    hint = (
                        f" (network policy {self.config.limits.network!r}: this engine cannot "
                        "provide it; use 'none' or 'host', or fix the engine's bridge)"
                    )
                raise SandboxError(f"cannot start sandbox {self.name}: {e}{hint}") from None
            raise

    def _abandon_start(self) -> None:
        """Undo a start that failed because the holder died, so _start can try again."""
        registry.unregister(self)
        with contextlib.suppress(Exception):
            self._remove_container()
        transport = getattr(self, "transport", None)
        if transport is not None:
            transport.close()
        self.container_id = ""
        self._drop_holder(removed=False)  # dead anyway: discard

    def _drop_holder(self, removed: bool) -> None:
        """Return the holder (the sandbox's container is surely gone) or discard it."""
        holder, self._holder = self._holder, None
        if holder is None:
            return
        if removed:
            holder.pool.release(holder)
        else:
            holder.pool.discard(holder)

    def _drop_bulk(self) -> None:
        """Remove the side channel's folder (after the container, or when none was made)."""
        folder, self.bulk = self.bulk, None
        if isinstance(folder, bulk.BulkDir):
            folder.remove()

    def _remove_container(self) -> None:
        """Force-remove the container; raises on anything but success or 'already gone'."""
        import docker.errors

        cid = self.container_id
        with contextlib.suppress(docker.errors.NotFound):
            bounded("remove_container", lambda: self.api.remove_container(cid, force=True))

    def _destroy(self) -> None:
        """Force-remove the container now; then its netns holder is free (or discarded)."""
        import docker.errors

        removed = False
        transport = getattr(self, "transport", None)
        if transport is not None:
            transport.drain_in_background()
        try:
            if self.container_id:
                try:
                    self._remove_container()
                    removed = True
                except docker.errors.APIError as e:
                    if e.status_code != 409:  # 409: the engine's auto-remove is already at it
                        raise
        finally:
            # any doubt that the container (and its sockets) is gone: never reuse the holder
            self._drop_holder(removed=removed)
            if transport is not None:
                transport.close()
            self._drop_bulk()

    def _network_mode(self) -> str:
        return self.egress.network if self.egress is not None else self.config.limits.network


    # files go through the helper: it runs as the sandbox user and sees every tmpfs mount
    def _put_tar(self, dest_dir: str, data: bytes) -> None:
        self._helper_put(dest_dir, data)


class _HolderGone(Exception):
    """The netns holder a sandbox was to join is no longer running."""


def _default_tag() -> str:
    from sandbox.image import DEFAULT_SPEC

    return DEFAULT_SPEC.tag
