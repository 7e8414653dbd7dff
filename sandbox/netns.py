"""Reused network namespaces for docker sandboxes whose network policy is "none".

Why: with `network_mode="none"` the engine still builds a fresh network namespace for every
container and the kernel tears it down again on removal; measured here that is ~0.1 s of
CPU per sandbox, about 40% of a whole create-start-remove cycle on 2 cores. A sandbox that
joins the namespace of a long-lived "holder" container (`network_mode="container:<id>"`)
skips both. The namespace of a "none" holder has nothing in it but `lo`.

Isolation rules, enforced here:
- one live sandbox per holder at a time (two live sandboxes never share a namespace);
- a holder goes back to the free list only after its sandbox's container was removed
  without doubt (its processes are dead, so its sockets and listeners are closed); on any
  doubt (a removal error, a 409, a sandbox that never started) the holder is discarded;
- pools are per process (reset in a forked child) and per engine address and image.

What a reused namespace can carry from one sandbox to the next is only kernel state that
outlives the processes: TCP TIME_WAIT entries on `lo` (visible in /proc/net/tcp, and a
port in TIME_WAIT refuses a listener that binds without SO_REUSEADDR for ~60 s). No
sandbox can change the namespace's configuration (no CAP_NET_ADMIN). docs/sandbox.md
says why that is acceptable, and `SANDFLOW_NETNS_REUSE=0` turns reuse off.

Holders never leak: each is labelled like a sandbox (run id `HOLDER_RUN_ID`, owner pid and
start time) so `sandflow sandbox gc` removes it once its owner is gone; its PID 1 is `cat`
on the container's stdin with StdinOnce + AutoRemove, so it ends and removes itself when
this process's attach connection drops (even on kill -9); idle holders are removed after
`IDLE_S`, at interpreter exit and on SIGINT/SIGTERM (through sandbox.registry).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from sandbox import labels as L
from sandbox import registry, settings
from sandbox.base import SandboxConfig, SandboxError
from sandbox.deadline import bounded
from sandbox.image import SANDBOX_UID

log = logging.getLogger("sandflow.sandbox")

HOLDER_RUN_ID = "sandflow-netns-holder"
ROLE = "sandflow.role"
IDLE_S = 30.0  # an idle holder is removed after this long
MAX_AGE_S = 3600.0  # a holder is retired (not reused) once this old
HOLDER_TTL_S = 6 * 3600  # gc's backstop label; holders retire long before
HOLDER_ARGV = ["cat"]  # idles on stdin; exits on EOF (our connection dropped)
# In no host passwd, and not the sandboxes' uid (a sandbox joins the holder's network
# namespace, never its processes): image.SANDBOX_UID + 1.
HOLDER_UID = SANDBOX_UID + 1


def enabled(network: str) -> bool:
    """Reuse applies to policy "none" unless HostSettings.netns_reuse is off
    (SANDFLOW_NETNS_REUSE=0 in the application)."""
    return network == "none" and settings.current().netns_reuse


@dataclass
class Holder:
    """One holder container and the attach socket that keeps it alive."""

    id: str
    sock: Any
    pool: HolderPool
    born: float = field(default_factory=time.monotonic)
    idle_since: float = 0.0

    @property
    def network_mode(self) -> str:
        return f"container:{self.id}"


class HolderPool:
    """Holders of one engine and image: a free list that grows on demand."""

    def __init__(self, api: Any, image: str) -> None:
        self.api = api
        self.image = image
        self._free: list[Holder] = []
        self._busy: dict[str, Holder] = {}
        self._lock = threading.RLock()  # re-entrant: the signal handler may release/shutdown

    # ------------------------------------------------------------------ leases
    def acquire(self, fresh: bool = False) -> Holder:
        """A holder for exactly one sandbox: the most recently freed one, or a new one."""
        with self._lock:
            holder = self._free.pop() if self._free and not fresh else None
            if holder is not None:
                self._busy[holder.id] = holder
                return holder
        holder = self._create()
        with self._lock:
            self._busy[holder.id] = holder
        return holder

    def release(self, holder: Holder) -> None:
        """Back to the free list: call only once the sandbox's container is surely removed."""
        with self._lock:
            if self._busy.pop(holder.id, None) is None:
                return  # already discarded (shutdown)
            keep = time.monotonic() - holder.born < MAX_AGE_S
            if keep:
                holder.idle_since = time.monotonic()
                self._free.append(holder)
        if keep:
            _reaper_wake()  # outside our lock: the reaper takes _LOCK, then ours
        else:
            self._remove(holder)

    def discard(self, holder: Holder) -> None:
        """Never reuse `holder`: remove it (its namespace may still hold a sandbox's state)."""
        with self._lock:
            self._busy.pop(holder.id, None)
            with contextlib.suppress(ValueError):
                self._free.remove(holder)
        self._remove(holder)

    def prune(self) -> int:
        """Discard idle holders that are no longer running (after one was found dead, e.g.
        the engine restarted: the others likely went with it). Returns how many."""
        with self._lock:
            idle = list(self._free)
        dead = [h for h in idle if not self.alive(h)]
        for h in dead:
            self.discard(h)
        return len(dead)

    def alive(self, holder: Holder) -> bool:
        import docker.errors

        try:
            info = bounded("inspect_container", lambda: self.api.inspect_container(holder.id))
        except (docker.errors.APIError, SandboxError):
            return False
        state = info.get("State") or {}
        return bool(state.get("Running")) and not state.get("Restarting")

    # ------------------------------------------------------------------ upkeep
    def reap(self, idle_s: float) -> int:
        """Remove holders idle for longer than `idle_s`; returns how many."""
        now = time.monotonic()
        with self._lock:
            old = [h for h in self._free if now - h.idle_since >= idle_s]
            self._free = [h for h in self._free if h not in old]
        for h in old:
            self._remove(h)
        return len(old)

    def shutdown(self) -> int:
        """Remove every idle holder now (busy ones go when their sandbox closes)."""
        return self.reap(-1.0)

    def counts(self) -> tuple[int, int]:
        """(idle, busy) holders."""
        with self._lock:
            return len(self._free), len(self._busy)

    # ------------------------------------------------------------------ engine calls
    def _labels(self) -> dict[str, str]:
        config = SandboxConfig(run_id=HOLDER_RUN_ID, episode_id="-", ttl_s=HOLDER_TTL_S)
        labels = L.make_labels(config, "docker")
        labels[ROLE] = "netns-holder"
        return labels

    def _create(self) -> Holder:
        """Start a holder: `cat` as HOLDER_UID (no host account, not the sandboxes' uid),
        nothing writable, no caps, tiny limits."""
        import docker.errors
        from docker.types import LogConfig

        host_config = self.api.create_host_config(
            auto_remove=True,
            read_only=True,
            network_mode="none",
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            pids_limit=8,
            mem_limit="32m",
            memswap_limit="32m",
            nano_cpus=int(0.05 * 1e9),
            log_config=LogConfig(type=LogConfig.types.NONE),
        )
        try:
            created = bounded(
                "create_container",
                lambda: self.api.create_container(
                    self.image,
                    HOLDER_ARGV,
                    user=f"{HOLDER_UID}:{HOLDER_UID}",
                    hostname="sandbox",  # a sandbox that joins this namespace gets this hostname
                    labels=self._labels(),
                    stdin_open=True,
                    detach=False,  # with stdin_open: StdinOnce, so our disconnect ends it
                    host_config=host_config,
                ),
                late=lambda c: self.api.remove_container(c["Id"], force=True),
            )
        except docker.errors.APIError as e:
            raise SandboxError(f"cannot create a network-namespace holder from {self.image}: {e}") from None
        cid = created["Id"]
        sock = None
        try:
            sock = bounded(
                "attach_socket",
                lambda: self.api.attach_socket(cid, params={"stdin": 1, "stream": 1}),
                late=lambda s: s.close(),
            )
            bounded("start", lambda: self.api.start(cid))
        except BaseException as e:
            holder = Holder(cid, sock, self)
            self._remove(holder)
            if isinstance(e, docker.errors.APIError):
                raise SandboxError(f"cannot start a network-namespace holder: {e}") from None
            raise
        return Holder(cid, sock, self)

    def _remove(self, holder: Holder) -> None:
        import docker.errors

        try:
            bounded("remove_container", lambda: self.api.remove_container(holder.id, force=True))
        except docker.errors.NotFound:
            pass
        except Exception as e:  # noqa: BLE001 - closing stdin below ends it anyway; gc is the backstop
            log.warning("netns holder %s: removal failed: %s", holder.id[:12], e)
        for s in (getattr(holder.sock, "_sock", None), holder.sock):
            if s is not None:
                with contextlib.suppress(Exception):
                    s.close()


# ----------------------------------------------------------------------------- pools

_LOCK = threading.RLock()
_POOLS: dict[tuple[str, str], HolderPool] = {}
_REAPER: threading.Thread | None = None
_WANTED = False  # a holder went idle since the reaper last looked


def _engine_key(api: Any) -> str:
    """Which engine `api` talks to. base_url alone is not enough: every unix socket's client
    has base_url http+docker://localhost, so two engines on two sockets would share holders
    (and a sandbox on one would be told to join a container of the other)."""
    try:
        adapter = api.get_adapter(api.base_url)
    except Exception:  # noqa: BLE001 - no adapter: base_url is all we know
        adapter = None
    where = getattr(adapter, "socket_path", None) or getattr(adapter, "base_url", None) or ""
    return f"{api.base_url}|{where}"


def pool_for(api: Any, image: str) -> HolderPool:
    """The pool of this process for the engine behind `api` and `image`."""
    key = (_engine_key(api), image)
    with _LOCK:
        pool = _POOLS.get(key)
        if pool is None:
            pool = _POOLS[key] = HolderPool(api, image)
            registry.add_cleanup(shutdown)
        return pool


def pools() -> list[HolderPool]:
    with _LOCK:
        return list(_POOLS.values())


def shutdown() -> int:
    """Remove every idle holder of this process (atexit, signals, tests' leak check)."""
    return sum(p.shutdown() for p in pools())


def _reaper_wake() -> None:
    global _REAPER, _WANTED
    with _LOCK:
        _WANTED = True
        if _REAPER is None or not _REAPER.is_alive():
            _REAPER = threading.Thread(target=_reap_loop, name="sandflow-netns-reaper", daemon=True)
            _REAPER.start()


def _reap_loop() -> None:
    """Remove idle holders now and then; ends when no pool has an idle holder left."""
    global _REAPER, _WANTED
    while True:
        time.sleep(max(IDLE_S / 3, 0.05))
        idle = 0
        for p in pools():
            try:
                p.reap(IDLE_S)
            except Exception as e:  # noqa: BLE001 - never die with holders to look after
                log.warning("netns holder reaper: %s", e)
            idle += p.counts()[0]
        with _LOCK:
            if not idle and not _WANTED:
                _REAPER = None
                return
            _WANTED = False


def _forget_in_child() -> None:
    """A forked child must not hand out its parent's holders (they are in use there)."""
    global _LOCK, _REAPER
    _LOCK = threading.RLock()
    _POOLS.clear()
    _REAPER = None


os.register_at_fork(after_in_child=_forget_in_child)
