"""What both backends share: the helper session, file transfer, lifetime, close().

A backend only has to start a sandbox whose PID 1 is the helper, hand over a byte
transport to it, move tar streams in and out, and destroy it. Everything the caller
sees (ExecResult, file semantics, limits, errors) is implemented once, here, so the
docker and bubblewrap backends behave the same and pass the same test suite.
"""

from __future__ import annotations

import contextlib
import logging
import posixpath
import socket
import tarfile
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from pydantic import ValidationError

from sandbox import egress, registry
from sandbox.archive import (
    REASONS,
    SKIPPED_SAMPLE,
    CopyLimits,
    ExportedFiles,
    file_tar,
    read_single_file,
    safe_extract,
    tree_tar,
)
from sandbox.backends import Capabilities, capabilities
from sandbox.base import ExecResult, SandboxClosed, SandboxConfig, SandboxError, SandboxExpired
from sandbox.image import SANDBOX_UID as IMAGE_UID
from sandbox.protocol import (
    BulkOffer,
    HelperClient,
    ProtocolError,
    SandboxExpiredSignal,
    StreamReply,
    Transport,
    header_limit,
)
from sandbox.usage import ResourceUsage

if TYPE_CHECKING:
    from sandbox.fork import ForkInfo

T = TypeVar("T")
log = logging.getLogger("sandflow.sandbox")

# Host-side slack on top of a command's own timeout: the helper needs up to ~2 s to kill a
# process tree and restart a stuck shell; past this, the sandbox itself is broken.
HOST_SLACK_S = 15.0
START_TIMEOUT_S = 60.0
FILE_OP_TIMEOUT_S = 120.0
STREAM_SLACK_S = 60.0  # on top of an export's own time bound: the host writing what arrives
TAR_OVERHEAD = 8192  # per archive entry: header blocks, a pax record for a long name, padding
HOME = "/home/sandbox"
SANDBOX_UID = IMAGE_UID  # no host account (sandbox/image.py says why)
SANDBOX_GID = IMAGE_UID
# The helper runs as uid 0 with only these (and no-new-privileges): enough to start the
# shell as the sandbox user, kill its processes, and empty its children's bounding set.
HELPER_CAPS = ("SETUID", "SETGID", "KILL", "SETPCAP")


def privsep() -> bool:
    """Run the helper as uid 0, apart from the sandbox user (the default; read at each start).

    HostSettings.privsep off (SANDFLOW_SANDBOX_PRIVSEP=0 in the application) runs it as the
    sandbox user (for engines that refuse a root user): then only its non-dumpable mark
    keeps its channel out of the user's reach.
    """
    from sandbox import settings

    return settings.current().privsep


_ERRORS: dict[str, type[OSError]] = {
    "FileNotFoundError": FileNotFoundError,
    "NotADirectoryError": NotADirectoryError,
    "IsADirectoryError": IsADirectoryError,
    "PermissionError": PermissionError,
    "FileExistsError": FileExistsError,
}


_RENAMEABLE = (*_ERRORS.values(), OSError, ValueError)


def file_error(message: str, path: str) -> OSError:
    """The helper's error as the matching OSError subclass, naming the sandbox path."""
    kind, _, detail = message.partition(": ")
    if "Read-only file system" in message:
        return PermissionError(f"{path}: read-only in the sandbox ({detail or message})")
    if kind == "PermissionError":
        return PermissionError(
            f"{path}: permission denied: the sandbox user may not access it ({detail or message})"
        )
    return _ERRORS.get(kind, OSError)(f"{path}: {detail or message}")


class HelperSandbox(ABC):
    """A sandbox driven through the in-sandbox helper (see sandbox/_helper.py)."""

    backend = "base"

    def __init__(self, config: SandboxConfig) -> None:
        self.config = config
        self.copy_limits = CopyLimits()
        self._client: HelperClient | None = None
        self._closed = False
        self._expired = False
        self._close_lock = threading.RLock()  # re-entrant: a signal handler may close too
        self._expires_at = (
            time.monotonic() + config.limits.wall_clock_s if config.limits.wall_clock_s else None
        )
        self.start_s = 0.0
        self._usage_base: ResourceUsage | None = None  # counters when this episode began
        # network allowlist/open: the proxy, this sandbox's address as the proxy sees it, and
        # where the next read of its log starts (the backend sets them as it starts)
        self.egress: egress.Endpoint | None = None
        self.egress_address = ""
        self._egress_cursor: egress.LogCursor | None = None
        # requests that ended before this are an earlier owner of the address
        self._created_at = time.time()

    @property
    def capabilities(self) -> Capabilities:
        """What this sandbox's backend can do (sandbox/backends.py): ask this, not the name."""
        return capabilities(self.backend)

    # ------------------------------------------------------------------ egress
    def egress_records(self, since: float, until: float | None = None) -> list[egress.EgressRecord]:
        """This sandbox's requests through the egress proxy that ended in [since, until)
        (epoch seconds), and on docker the direct connections its firewall refused, each with
        the rule behind its decision; [] without an egress policy."""
        if self.egress is None or not self.egress_address:
            return []
        since = max(since, self._created_at)
        policy = egress.policy_of(self.config.limits)
        window = egress.Window(self.egress_address, since, until, self._egress_cursor)
        return egress.records_for(self.egress, policy, window)

    def egress_settle(self) -> bool:
        """Return once the proxy has logged every request that ended before this call, so a
        read whose `until` is taken after it misses none (a bounded wait: False when the
        proxy did not show it in time). True at once without an egress policy."""
        if self.egress is None or not self.egress_address:
            return True
        return egress.settle(self.egress)

    # ------------------------------------------------------------------ backend hooks
    @property
    @abstractmethod
    def name(self) -> str:
        """A short id for messages (container id, bwrap instance id)."""

    @abstractmethod
    def _destroy(self) -> None:
        """Remove the sandbox for good (idempotent, fast, never raises)."""

    @abstractmethod
    def _put_tar(self, dest_dir: str, data: bytes) -> None:
        """Extract an archive into an existing-or-created directory in the sandbox."""

    def _check_alive(self) -> None:  # noqa: B027 - an optional hook, not abstract
        """Raise SandboxError when the backend already knows the sandbox is gone."""

    def _oom_counter(self) -> int | None:
        """The sandbox's OOM-kill count when the host can see it (else the helper reports)."""
        return None

    def _usage_now(self) -> ResourceUsage:
        """The sandbox's cgroup counters since it started (sandbox/usage.py); the backend's
        own hook: unknown unless it overrides this."""
        return ResourceUsage()

    def resource_usage(self) -> ResourceUsage:
        """CPU-seconds and peak memory of this episode (since `begin_episode` for a pooled
        sandbox); None fields: the backend cannot tell. Never raises."""
        try:
            return self._usage_now().since(self._usage_base)
        except Exception:  # a gone container or cgroup: unknown, not an episode failure
            return ResourceUsage()

    # ------------------------------------------------------------------ helpers
    def _new_client(self, transport: Transport) -> HelperClient:
        """The protocol client, its header bound derived from this sandbox's output cap."""
        return HelperClient(
            transport, self.name, max_header=header_limit(self.config.limits.output_cap_bytes)
        )

    def _boot(self, client: HelperClient) -> None:
        """Wait for the helper's ready line; registers the sandbox for cleanup."""
        self._client = client
        try:
            client.boot(START_TIMEOUT_S)
        except BaseException:
            self.kill()
            raise

    def _check_open(self) -> HelperClient:
        if self._expired:
            raise SandboxExpired(
                f"sandbox {self.name} reached its wall-clock limit of "
                f"{self.config.limits.wall_clock_s}s and was removed"
            )
        if self._closed or self._client is None:
            raise SandboxClosed(f"sandbox {self.name} is closed")
        if self._expires_at is not None and time.monotonic() >= self._expires_at:
            self._expire()
        return self._client

    def _expire(self) -> None:
        self._expired = True
        self.kill()
        raise SandboxExpired(
            f"sandbox {self.name} reached its wall-clock limit of "
            f"{self.config.limits.wall_clock_s}s and was removed"
        )

    def _abs(self, path: str) -> str:
        if not path or "\0" in path:
            raise ValueError(f"invalid sandbox path {path!r}")
        return posixpath.normpath(posixpath.join(self.config.workdir, path))

    # ------------------------------------------------------------------ exec
    def exec(self, command: str, timeout: float | None = None) -> ExecResult:
        """Run `command` in the session shell; a failing command is a result, not an error."""
        client = self._check_open()
        limits = self.config.limits
        timeout = limits.exec_timeout_s if timeout is None else timeout
        if timeout <= 0:
            raise ValueError(f"exec timeout must be > 0 seconds, got {timeout}")
        if "\0" in command:
            return ExecResult(
                stderr="sandflow: the command contains a NUL byte, which a shell cannot run\n",
                exit_code=2,
            )
        lifetime_cut = False
        if self._expires_at is not None:
            left = self._expires_at - time.monotonic()
            if left < timeout:
                timeout, lifetime_cut = max(left, 0.01), True
        msg = {"op": "exec", "cmd": command, "timeout": timeout, "cap": limits.output_cap_bytes}
        self._check_alive()
        oom_before = self._oom_counter()
        try:
            header, _ = client.request(msg, timeout=timeout + HOST_SLACK_S)
        except SandboxExpiredSignal:
            self._expire()
            raise AssertionError("unreachable") from None
        except TimeoutError:
            self.kill()
            raise SandboxError(
                f"sandbox {self.name}: no answer {timeout + HOST_SLACK_S:.0f}s after a command "
                f"with a {timeout:.0f}s timeout; the sandbox was removed"
            ) from None
        except SandboxError:
            self.kill()
            raise
        if not header.get("id") or "exit_code" not in header:
            raise SandboxError(f"sandbox {self.name}: helper error: {header.get('error')}")
        try:
            result = ExecResult.model_validate(
                {k: v for k, v in header.items() if k in ExecResult.model_fields}
            )
        except ValidationError as e:
            self.kill()
            raise ProtocolError(
                f"sandbox {self.name}: protocol violation: an exec result with invalid fields "
                f"({e.error_count()} errors, first at {e.errors()[0]['loc']}); the sandbox was removed"
            ) from None
        if oom_before is not None and not result.oom_killed:
            after = self._oom_counter()
            result.oom_killed = after is not None and after > oom_before
        if lifetime_cut and result.timed_out:
            self._expired = True
            self.kill()
            result.stderr += f"[sandflow: the sandbox's wall-clock limit of {limits.wall_clock_s}s was reached]\n"
        return result

    # ------------------------------------------------------------------ files
    def write_file(self, path: str, data: bytes | str) -> None:
        """Write bytes (str: UTF-8) to `path`, creating parent folders; any size, any bytes."""
        self._check_open()
        full = self._abs(path)
        if full == "/" or path.endswith("/"):
            raise ValueError(f"write_file: {path!r} names a folder, not a file")
        blob = data.encode() if isinstance(data, str) else bytes(data)
        root = self._tar_root(full)
        rel = posixpath.relpath(full, root)
        parts = rel.split("/")
        parents = ["/".join(parts[: i + 1]) for i in range(len(parts) - 1)]
        self._put_tar(root, file_tar(rel, blob, parents=parents))

    def read_file(self, path: str) -> bytes:
        """The bytes of a regular file (symlinks are resolved inside the sandbox).

        Errors name the path asked for and, through a symlink, the file it led to:
        `PermissionError: /testbed/link -> /root/secret: permission denied ...`.
        """
        self._check_open()
        first = full = self._abs(path)
        limits = self.copy_limits
        for _ in range(8):
            reply = self._get_stream(full, limits, single=True)
            try:
                with self._consuming(reply, full):
                    content, link = read_single_file(reply, full, limits.max_bytes)
            except (OSError, ValueError) as e:
                if full == first or type(e) not in _RENAMEABLE:
                    raise
                detail = str(e).removeprefix(full + ": ").removeprefix(f"read_file: {full}")
                raise type(e)(f"{first} -> {full}: {detail.lstrip(': ')}") from None
            if content is not None:
                return content
            full = posixpath.normpath(posixpath.join(posixpath.dirname(full), link or ""))
        raise ValueError(f"read_file: too many levels of symlinks at {path}")

    def copy_in(self, host_dir: Path | str, dest: str) -> None:
        """Copy a host folder's files into `dest` (created); host symlinks are skipped."""
        self._check_open()
        full = self._abs(dest)
        root = self._tar_root(full)
        blob, skipped = tree_tar(Path(host_dir), posixpath.relpath(full, root), self.copy_limits)
        if skipped:
            names = ", ".join(f"{name} ({why})" for name, why in skipped[:5])
            log.warning("copy_in %s: %d entries skipped, e.g. %s", host_dir, len(skipped), names)
        self._put_tar(root, blob)

    def copy_out(self, src: str, host_dir: Path | str) -> ExportedFiles:
        """Copy a sandbox folder's regular files into `host_dir` and nowhere else.

        Symlinks, hard links, devices, fifos and unsafe names are skipped; every entry
        counts against `self.copy_limits.max_files`, bytes against `max_bytes`, and the
        walk in the sandbox stops after `max_seconds`. The archive streams through (neither
        side holds it). The returned list's `.summary` accounts for everything left out
        (counts per reason, a few names each) and is logged as ONE warning; `.skipped`
        keeps the first (name, why) pairs.
        """
        self._check_open()
        full = self._abs(src)
        limits = self.copy_limits
        reply = self._get_stream(full, limits, single=False)
        with self._consuming(reply, full):
            files = safe_extract(reply, host_dir, limits)
        summary = files.summary
        summary.merge_helper((reply.final or {}).get("summary"))
        for reason, names in summary.examples.items():  # what the sandbox side left out
            if reason in _HELPER_REASONS:
                for name in names:
                    if len(files.skipped) < SKIPPED_SAMPLE:
                        files.skipped.append((name, _helper_reason(reason, limits)))
        if summary.skipped:
            log.warning("copy_out %s: %s", src, summary.describe(limits))
        return files

    def _get_stream(self, path: str, limits: CopyLimits, *, single: bool) -> StreamReply:
        """Ask the helper for a streamed archive of `path`, within `limits`."""
        client = self._check_open()
        entries = 1 if single else limits.max_files + 1  # + the folder itself
        msg = {
            "op": "get",
            "path": path,
            "max_bytes": limits.max_bytes,
            "max_entries": entries,
            "max_seconds": limits.max_seconds,
            "single": single,
        }
        max_total = limits.max_bytes + (entries + 2) * TAR_OVERHEAD
        deadline_s = limits.max_seconds + STREAM_SLACK_S
        return client.stream(msg, max_total=max_total, deadline_s=deadline_s)

    @contextlib.contextmanager
    def _consuming(self, reply: StreamReply, path: str) -> Iterator[None]:
        """Around the code reading `reply`: the channel is left in step, or the sandbox goes.

        The final header decides: an error from the helper becomes the matching OSError.
        A malformed archive or a broken channel removes the sandbox at once (nothing more is
        read from it). An error of the host's own (disk full while writing) reads the rest
        of the stream first, so the sandbox stays usable.
        """
        try:
            yield
        except (tarfile.TarError, EOFError) as e:
            final = reply.final
            if final is not None and not final.get("ok"):
                raise file_error(str(final.get("error")), path) from None
            reply.abandon()
            self.kill()
            raise ProtocolError(
                f"sandbox {self.name}: protocol violation: a malformed archive of {path} ({e}); "
                "nothing more was read and the sandbox was removed"
            ) from None
        except (SandboxError, TimeoutError, SandboxExpiredSignal) as e:
            self._broken(reply, e)
        except BaseException:
            self._finish(reply)
            raise
        self._finish(reply)
        final = reply.final or {}
        if not final.get("ok"):
            raise file_error(str(final.get("error")), path)

    def _finish(self, reply: StreamReply) -> None:
        """Read `reply` to its final header; a broken channel removes the sandbox."""
        try:
            reply.finish()
        except (SandboxError, TimeoutError, SandboxExpiredSignal) as e:
            self._broken(reply, e)

    def _broken(self, reply: StreamReply, why: BaseException) -> NoReturn:
        """The channel failed mid-answer: release it, remove the sandbox, raise why."""
        reply.abandon()
        if isinstance(why, SandboxExpiredSignal):
            self._expire()
        self.kill()
        if isinstance(why, TimeoutError):
            raise SandboxError(f"sandbox {self.name}: file transfer stalled; removed") from None
        raise why

    def _helper_put(self, dest_dir: str, data: bytes) -> None:
        """Extract through the helper (it writes as the sandbox user, sees every mount)."""
        header, _ = self._helper_call({"op": "put", "dest": dest_dir}, data)
        if not header.get("ok"):
            raise file_error(str(header.get("error")), dest_dir)

    def _helper_call(self, msg: dict, payload: bytes = b"") -> tuple[dict, bytes]:
        client = self._check_open()
        return self._guarded(lambda: client.request(msg, payload, timeout=FILE_OP_TIMEOUT_S))

    def _guarded(self, call: Callable[[], T]) -> T:
        """`call()` on the helper's channel: an expired lifetime, a stall or a broken
        channel removes the sandbox (SandboxExpired, SandboxError)."""
        try:
            return call()
        except SandboxExpiredSignal:
            self._expire()
            raise AssertionError("unreachable") from None
        except TimeoutError:
            self.kill()
            raise SandboxError(f"sandbox {self.name}: file transfer stalled; removed") from None
        except SandboxError:
            self.kill()
            raise

    def _tar_root(self, full: str) -> str:
        """Where to extract: the workdir (or home, /tmp) when `full` is under it, else `/`."""
        for root in (self.config.workdir, HOME, "/tmp"):
            if full == root:
                return posixpath.dirname(root)
            if full.startswith(root.rstrip("/") + "/"):
                return root
        return "/"

    # ------------------------------------------------------------------ reuse (sandbox/pool.py)
    def reset(self) -> list[str]:
        """Return the sandbox to its boot state and say what could not be proven (empty: clean).

        The helper kills every process but itself, wipes every writable place as the
        sandbox user, removes IPC objects, starts a new shell and compares the result with
        the snapshot it took at boot. Whatever it answers is bounded here (it came out of a
        sandbox); a broken channel removes the sandbox and is reported as a failure.
        """
        if self._closed or self._expired:
            return ["the sandbox is closed"]
        check_net = self.config.limits.network != "host"  # the host's sockets are not ours
        try:
            header, _ = self._helper_call({"op": "reset", "check_net": check_net})
        except (SandboxError, OSError) as e:
            return [f"reset failed: {str(e)[:200]}"]
        failed = header.get("failed")
        if header.get("ok") is True and failed == []:
            return []
        if not isinstance(failed, list) or not failed:
            return ["the helper's reset answer was malformed"]
        return [str(item)[:200] for item in failed[:10]]

    def begin_episode(self, config: SandboxConfig, ping: bool = True) -> None:
        """Hand a pooled sandbox to the next episode: its ids, its own wall clock.

        `config` must match the pool's key (same image, limits but the wall clock, workdir,
        env); the pool checks that before calling. One round trip re-arms the helper's own
        lifetime; it is skipped when neither this episode nor the last had one and `ping`
        is False (the pool's sandbox answered its reset moments ago).
        """
        self._check_alive()
        wall = config.limits.wall_clock_s
        armed = getattr(self, "_helper_lifetime", bool(self.config.limits.wall_clock_s))
        self.config = config
        self._expired = False
        self._expires_at = time.monotonic() + wall if wall else None
        try:
            self._usage_base = self._usage_now()
        except Exception:
            self._usage_base = None
        if ping or wall or armed:
            self._helper_call({"op": "lifetime", "s": wall + 5.0 if wall else 0})
        self._helper_lifetime = bool(wall)

    # ------------------------------------------------------------------ fork (sandbox/fork.py)
    fork_info: ForkInfo | None = None  # set on a sandbox made by fork(): whose, what was left
    # a side channel a fork's bytes may take instead of the helper's stdin/stdout
    # (docker: sandbox/bulk.py); None: the helper's channel carries them
    bulk: BulkOffer | None = None
    # a socket to the helper that carries a fork's pipe ends (bwrap: sandbox/fork.py,
    # "fork by pipes"); None: the fork's bytes go through the host
    ctl: socket.socket | None = None

    def fork(self, n: int = 1, *, children: list[HelperSandbox] | None = None) -> list[Any]:
        """n new sandboxes whose writable places and shell state equal this one's now;
        running processes are not carried (each child's `fork_info` names them). `children`:
        fresh or reset sandboxes of the same config to fork into (no start cost)."""
        from sandbox.fork import fork_sandbox

        return fork_sandbox(self, n, children=children)

    # ------------------------------------------------------------------ lifecycle
    def kill(self) -> None:
        """Remove the sandbox now; safe from signal handlers and other threads."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        registry.unregister(self)
        try:
            self._destroy()
        except Exception as e:  # noqa: BLE001 - removal is best effort; gc is the backstop
            log.warning("sandbox %s: removal failed: %s", self.name, e)

    def close(self) -> None:
        """Remove the sandbox (idempotent)."""
        self.kill()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> HelperSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            with contextlib.suppress(Exception):  # interpreter shutdown: best effort
                self.kill()


_HELPER_REASONS = ("over_count", "over_size", "special", "time_limit", "unreadable", "changed")


def _helper_reason(reason: str, limits: CopyLimits) -> str:
    """The words for a reason the sandbox side reported (ExportedFiles.skipped)."""
    if reason == "over_count":
        return f"not sent: over the file-count limit of {limits.max_files}"
    if reason == "over_size":
        return f"not sent: over the size limit of {limits.max_bytes} bytes"
    if reason == "time_limit":
        return f"not sent: the export's time limit of {limits.max_seconds:g}s ran out"
    return REASONS.get(reason, reason)
