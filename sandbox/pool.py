"""Warm sandboxes: a pool of started sandboxes per (backend, image, limits, network, env).

Why: creating a container costs the engine ~0.16 s of CPU and ~0.13 s of start on the
critical path of every episode; an RL step runs hundreds of episodes at once. A pooled
sandbox is handed out in about a millisecond (one round trip that also sets the episode's
wall clock), and after the episode it is *reset* by its helper (sandbox/_helper.py,
op "reset"): every process but PID 1 killed, every writable place wiped as the sandbox
user, IPC objects removed, a new shell; then the helper compares the state with the
snapshot it took at boot. A sandbox whose reset cannot prove that (or that served
`max_episodes`, or is older than `max_age_s`) is destroyed and, while there is demand,
replaced.

Creation is paced (CreationPacer: a token bucket whose rate ramps up on success and
halves on failure) and bounded in concurrency, and each creation is retried with
exponential back-off (tenacity); failures are counted in `stats` and logged, and an
acquire whose creations all failed raises SandboxError naming the last error.

Nothing leaks: pooled sandboxes are ordinary sandboxes in the registry (removed at exit,
SIGINT, SIGTERM; the owner's watchdog removes them after kill -9; `sandflow sandbox gc`
finds them by label), and every pool is closed (drained) by the registry's cleanup.

    from sandbox import SandboxConfig, acquire
    with acquire(SandboxConfig(run_id="r", episode_id="e1", reuse="pool")) as sb:
        sb.exec("echo hi")                                           # close() = reset + back
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from sandbox import registry
from sandbox.base import SandboxClosed, SandboxConfig, SandboxError

log = logging.getLogger("sandflow.sandbox.pool")
PING_AFTER_S = 30.0  # idle longer than this: acquire checks it answers (one round trip)
# A waiter is served by the next sandbox to come back from its reset (5-10 ms, 30-100 ms
# on a loaded machine) rather than by a new one (0.15-2 s and ~0.2 s of engine CPU); past
# this wait it gets a creation of its own (a slow wipe, failing resets).
RESET_WAIT_S = 0.5
START_SLACK_S = 90.0  # a creation already handed to a waiter finishes within its own bounds


class PoolSettings(BaseModel):
    """How a pool creates, reuses and retires sandboxes (defaults fit a 2-core machine)."""

    max_episodes: int = Field(100, ge=1, description="episodes one sandbox serves, then replaced")
    max_age_s: float = Field(
        3600.0, gt=0, description="an idle sandbox older than this is replaced"
    )
    max_idle: int = Field(1024, ge=0, description="idle sandboxes kept; more are removed")
    create_concurrency: int = Field(4, ge=1, description="creations in flight at once")
    create_rate: float = Field(4.0, gt=0, description="creations per second at first (ramps up)")
    create_rate_max: float = Field(32.0, gt=0, description="the ramp's ceiling")
    create_rate_min: float = Field(0.5, gt=0, description="the back-off's floor")
    create_attempts: int = Field(4, ge=1, description="tries per creation before it is reported")
    acquire_timeout_s: float = Field(600.0, gt=0)


class PoolStats(BaseModel):
    created: int = 0
    create_failures: int = 0  # attempts that failed (each retried with back-off)
    creations_given_up: int = 0  # creations that failed every attempt (reported to the acquirer)
    acquired: int = 0
    reused: int = 0  # acquisitions served by a reset sandbox
    resets: int = 0
    resets_failed: int = 0
    retired: int = 0  # destroyed for max_episodes / max_age / max_idle
    destroyed: int = 0
    last_error: str = ""


class CreationPacer:
    """A token bucket whose rate adapts: +`step` per success (ramp-up), halved on failure.

    `wait()` blocks until a token is available (or `stop` is set); burst is one second's
    worth of tokens, so 512 requests at once start at `rate`/s, not all together. The
    bucket starts full: a run's first sandboxes (one per worker: 4 at the default rate)
    start together instead of 1/rate apart (0.75 s for the fourth, measured on the peer
    benchmark's cold pool).
    """

    def __init__(self, rate: float, rate_min: float, rate_max: float, step: float = 1.0) -> None:
        self.rate, self.rate_min, self.rate_max, self.step = rate, rate_min, rate_max, step
        self.tokens = max(1.0, rate)
        self.stamp = time.monotonic()
        self.lock = threading.Lock()

    def wait(self, stop: threading.Event) -> bool:
        while not stop.is_set():
            with self.lock:
                now = time.monotonic()
                burst = max(1.0, self.rate)
                self.tokens = min(burst, self.tokens + (now - self.stamp) * self.rate)
                self.stamp = now
                if self.tokens >= 1.0:
                    self.tokens -= 1.0
                    return True
                pause = (1.0 - self.tokens) / self.rate
            stop.wait(min(pause, 0.5))
        return False

    def success(self) -> None:
        with self.lock:
            self.rate = min(self.rate_max, self.rate + self.step)

    def failure(self) -> None:
        with self.lock:
            self.rate = max(self.rate_min, self.rate / 2)
            self.tokens = min(self.tokens, 0.0)


class _Slot:
    """One pooled sandbox and its history."""

    __slots__ = ("box", "born", "episodes", "leased", "ready_at")

    def __init__(self, box: Any) -> None:
        self.box = box
        self.born = self.ready_at = time.monotonic()  # ready_at: when it last answered
        self.episodes = 0
        self.leased = False


class SandboxPool:
    """Started sandboxes of one kind (`template`), handed out and taken back reset."""

    def __init__(
        self,
        template: SandboxConfig,
        settings: PoolSettings | None = None,
        opener: Callable[[SandboxConfig], Any] | None = None,
    ) -> None:
        from sandbox import open_sandbox

        self.template = template.model_copy(
            update={
                "episode_id": "pooled",
                "limits": template.limits.model_copy(update={"wall_clock_s": None}),
            }
        )
        self.key = pool_key(template)
        self.settings = settings or PoolSettings()
        self.stats = PoolStats()
        self._open = opener or open_sandbox
        self._lock = threading.Condition()
        self._idle: deque[_Slot] = deque()
        self._waiting: deque[Future[_Slot]] = deque()
        self._creating = 0  # creations queued or in flight
        self._resetting = 0  # released sandboxes being reset (each will serve a waiter)
        self._slots: set[_Slot] = set()  # sandboxes that exist (idle, leased, resetting)
        self._stop = threading.Event()
        s = self.settings
        self.pacer = CreationPacer(s.create_rate, s.create_rate_min, s.create_rate_max)
        self._creators = ThreadPoolExecutor(
            s.create_concurrency, thread_name_prefix="sandflow-pool-create"
        )
        self._resetters = ThreadPoolExecutor(2, thread_name_prefix="sandflow-pool-reset")
        _ALIVE.add(self)
        registry.add_cleanup(_close_alive)  # once: exit, SIGINT, SIGTERM drain every pool

    # ------------------------------------------------------------------ public
    @property
    def idle(self) -> int:
        with self._lock:
            return len(self._idle)

    @property
    def live(self) -> int:
        with self._lock:
            return len(self._slots)

    def prewarm(self, n: int, wait: bool = True, timeout: float | None = None) -> int:
        """Create sandboxes until `n` are idle (paced); returns how many are idle."""
        with self._lock:
            missing = n - len(self._idle) - self._creating
            for _ in range(max(0, missing)):
                self._spawn()
        if wait:
            deadline = time.monotonic() + (timeout or self.settings.acquire_timeout_s)
            with self._lock:
                while len(self._idle) < n and self._creating and not self._stop.is_set():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._lock.wait(min(1.0, left))
        return self.idle

    def acquire(self, config: SandboxConfig, timeout: float | None = None) -> PooledSandbox:
        """A started sandbox for `config`'s episode: an idle one at once, else a new one."""
        if pool_key(config) != self.key:
            raise ValueError(
                "this config belongs to another pool (image, limits, env or backend differ)"
            )
        deadline = time.monotonic() + (timeout or self.settings.acquire_timeout_s)
        while True:
            slot = self._take(deadline, config.run_id)
            try:
                ping = time.monotonic() - slot.ready_at > PING_AFTER_S
                slot.box.begin_episode(config, ping=ping)
            except Exception as e:  # noqa: BLE001 - died while idle: next one
                log.info("pooled sandbox %s unusable (%s); taking another", slot.box.name, e)
                self._destroy(slot)
                continue
            with self._lock:
                self.stats.acquired += 1
                self.stats.reused += slot.episodes > 0
                slot.leased = True
            return PooledSandbox(self, slot, config)

    def close(self) -> None:
        """Drain: stop creating, remove every idle sandbox; leased ones go when released."""
        if self._stop.is_set():
            return
        self._stop.set()
        with self._lock:
            idle, self._idle = list(self._idle), deque()
            waiting, self._waiting = list(self._waiting), deque()
            self._lock.notify_all()
        for fut in waiting:
            with contextlib.suppress(Exception):
                fut.set_exception(SandboxClosed("the sandbox pool was closed"))
        for slot in idle:
            self._destroy(slot)
        self._creators.shutdown(wait=False, cancel_futures=True)
        self._resetters.shutdown(wait=False, cancel_futures=True)
        _ALIVE.discard(self)
        with self._lock:  # resets cancelled or under way: theirs too (leased: at release)
            rest = [slot for slot in self._slots if not slot.leased]
        for slot in rest:
            self._destroy(slot)
        _forget(self)

    # ------------------------------------------------------------------ internals
    def _take(self, deadline: float, run_id: str | None = None) -> _Slot:
        fut: Future[_Slot] | None = None
        stale: list[_Slot] = []  # removed outside the lock (an engine call)
        try:
            with self._lock:
                if self._stop.is_set():
                    raise SandboxClosed("the sandbox pool is closed")
                while self._idle:
                    slot = self._idle.popleft()
                    if self._expired(slot):
                        stale.append(slot)
                        continue
                    return slot
                fut = Future()
                self._waiting.append(fut)
                if self._creating + self._resetting < len(self._waiting):
                    self._spawn(run_id)
        finally:
            for slot in stale:
                self._retire_later(slot)
        try:
            return fut.result(timeout=max(0.0, min(RESET_WAIT_S, deadline - time.monotonic())))
        except TimeoutError:
            with self._lock:  # the resets it counted on are slow: a creation of its own
                if fut in self._waiting and self._creating < len(self._waiting):
                    self._spawn(run_id)
        try:
            return fut.result(timeout=max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            with self._lock:
                queued = fut in self._waiting
                if queued:
                    self._waiting.remove(fut)
            if not queued:  # a creator took it off the queue just now: its answer is on the way
                with contextlib.suppress(Exception):
                    return fut.result(timeout=START_SLACK_S)
            raise SandboxError(
                f"no sandbox within the acquire timeout ({self.stats.creations_given_up} creations "
                f"failed; last error: {self.stats.last_error or 'none'})"
            ) from None

    def _expired(self, slot: _Slot) -> bool:
        return (
            slot.box.closed
            or slot.episodes >= self.settings.max_episodes
            or time.monotonic() - slot.born > self.settings.max_age_s
        )

    def _pause(self, seconds: float) -> None:
        """tenacity's back-off sleep, cut short when the pool closes."""
        self._stop.wait(seconds)

    def _spawn(self, run_id: str | None = None) -> None:
        """Queue one paced creation (caller holds the lock), labelled with the run that
        asked for it (`run_id`; the pool's first run's otherwise): a long-lived pool (the
        rollout server's, across batches) must not label every sandbox with its first
        batch's run id, or `sandflow sandbox gc --run-id` misses them."""
        self._creating += 1
        try:
            self._creators.submit(self._create, run_id)
        except RuntimeError:  # shut down
            self._creating -= 1

    def _create(self, run_id: str | None = None) -> None:
        from tenacity import (
            RetryError,
            Retrying,
            retry_if_exception_type,
            stop_after_attempt,
            wait_exponential,
        )

        slot: _Slot | None = None
        error: BaseException | None = None
        try:
            retrying = Retrying(
                stop=stop_after_attempt(self.settings.create_attempts),
                wait=wait_exponential(multiplier=0.5, max=10),
                retry=retry_if_exception_type(SandboxError),
                reraise=True,
                sleep=self._pause,
            )
            for attempt in retrying:
                with attempt:
                    if not self.pacer.wait(self._stop):
                        return
                    try:
                        box = self._open(
                            self.template.model_copy(update={"run_id": run_id})
                            if run_id and run_id != self.template.run_id
                            else self.template
                        )
                    except SandboxError as e:
                        self.pacer.failure()
                        with self._lock:
                            self.stats.create_failures += 1
                            self.stats.last_error = str(e)[:500]
                        log.warning("sandbox pool: creation failed (retrying with back-off): %s", e)
                        raise
                    self.pacer.success()
                    slot = _Slot(box)
        except (SandboxError, RetryError) as e:
            error = e
        except Exception as e:  # noqa: BLE001 - reported to whoever waits
            error = e
        finally:
            with self._lock:
                self._creating -= 1
        if slot is None:
            if error is None:
                return
            with self._lock:
                self.stats.creations_given_up += 1
                self.stats.last_error = str(error)[:500]
                fut = self._waiting.popleft() if self._waiting else None
            log.error(
                "sandbox pool: a creation failed %d times: %s", self.settings.create_attempts, error
            )
            if fut is not None:
                fut.set_exception(SandboxError(f"cannot create a pooled sandbox: {error}"))
            return
        with self._lock:
            self._slots.add(slot)
            self.stats.created += 1
        self._offer(slot)

    def _offer(self, slot: _Slot) -> None:
        """A ready sandbox: to the first waiter, else idle (or removed when too many idle)."""
        with self._lock:
            if self._stop.is_set():
                fut = None
                keep = False
            else:
                fut = self._waiting.popleft() if self._waiting else None
                keep = fut is None and len(self._idle) < self.settings.max_idle
                if keep:
                    self._idle.append(slot)
                    self._lock.notify_all()
        if fut is not None:
            fut.set_result(slot)
        elif not keep:
            self._destroy(slot, retired=True)

    def _release(self, slot: _Slot) -> None:
        """An episode is over: reset in the background, then offer (or destroy + replace)."""
        slot.episodes += 1
        slot.leased = False
        slot.box.config = self.template  # no longer the episode's (the registry shows it)
        if self._stop.is_set() or slot.box.closed:
            self._destroy(slot)
            return
        with self._lock:
            self._resetting += 1
        try:
            self._resetters.submit(self._reset, slot)
        except RuntimeError:
            self._reset_over()
            self._destroy(slot)

    def _reset_over(self) -> None:
        with self._lock:
            self._resetting -= 1

    def _reset(self, slot: _Slot) -> None:
        if self._expired(slot):
            self._reset_over()
            self._retire_later(slot)
            return
        try:
            failed = slot.box.reset()
        finally:
            self._reset_over()
        if self._stop.is_set():  # closed while it was reset (close removes it): no report
            self._destroy(slot)
            return
        with self._lock:
            self.stats.resets += 1
            self.stats.resets_failed += bool(failed)
        if failed:
            log.warning(
                "sandbox %s: reset not proven (%s); destroyed and replaced",
                slot.box.name,
                "; ".join(failed),
            )
            self._destroy(slot)
            self._replace()
            return
        slot.ready_at = time.monotonic()
        self._offer(slot)

    def _retire_later(self, slot: _Slot) -> None:
        self._destroy(slot, retired=True)
        self._replace()

    def _replace(self) -> None:
        with self._lock:
            if not self._stop.is_set() and self._creating + self._resetting < len(self._waiting):
                self._spawn()

    def _destroy(self, slot: _Slot, retired: bool = False) -> None:
        with contextlib.suppress(Exception):
            slot.box.kill()
        with self._lock:
            if slot not in self._slots:
                return
            self._slots.discard(slot)
            self.stats.destroyed += 1
            self.stats.retired += retired


class PooledSandbox:
    """One episode's lease of a pooled sandbox: the Sandbox interface; close() gives it back.

    After close() the lease is dead (the sandbox serves the next episode): every call
    raises SandboxClosed. kill() removes the sandbox for good.
    """

    def __init__(self, pool: SandboxPool, slot: _Slot, config: SandboxConfig) -> None:
        self._pool = pool
        self._slot: _Slot | None = slot
        self.config = config
        self.pooled_episodes = slot.episodes  # episodes this sandbox served before this one

    def _box(self) -> Any:
        slot = self._slot
        if slot is None:
            raise SandboxClosed("this pooled sandbox was given back (close() was called)")
        return slot.box

    def exec(self, command: str, timeout: float | None = None) -> Any:
        return self._box().exec(command, timeout)

    def read_file(self, path: str) -> bytes:
        return bytes(self._box().read_file(path))

    def write_file(self, path: str, data: bytes | str) -> None:
        self._box().write_file(path, data)

    def copy_in(self, host_dir: Path | str, dest: str) -> None:
        self._box().copy_in(host_dir, dest)

    def copy_out(self, src: str, host_dir: Path | str) -> Any:
        return self._box().copy_out(src, host_dir)

    @property
    def copy_limits(self) -> Any:
        return self._box().copy_limits

    @copy_limits.setter
    def copy_limits(self, value: Any) -> None:
        self._box().copy_limits = value

    @property
    def closed(self) -> bool:
        return self._slot is None or bool(self._slot.box.closed)

    def fork(self, n: int = 1, *, children: list[Any] | None = None) -> list[Any]:
        """The leased sandbox's fork (sandbox/fork.py); `children` may be leases too (a
        fork into warm sandboxes). Returns the sandboxes written (not leases)."""
        inner = [c._box() if isinstance(c, PooledSandbox) else c for c in children or []]
        return list(self._box().fork(n, children=inner if children is not None else None))

    def __getattr__(self, name: str) -> Any:  # name, backend, container_id, killed_by_signal...
        slot = self.__dict__.get("_slot")
        if name.startswith("_") or slot is None:
            raise AttributeError(name)
        return getattr(slot.box, name)

    def close(self) -> None:
        """Give the sandbox back (reset happens in the background); idempotent."""
        slot, self._slot = self._slot, None
        if slot is not None:
            self._pool._release(slot)

    def kill(self) -> None:
        """Remove the sandbox for good (not reused)."""
        slot = self._slot
        if slot is not None:
            slot.box.kill()
        self.close()

    def __enter__(self) -> PooledSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------- pools of this process

_POOLS: dict[tuple[Any, ...], SandboxPool] = {}
_ALIVE: weakref.WeakSet[SandboxPool] = weakref.WeakSet()  # every open pool, pool_for's or not


def _close_alive() -> None:
    for pool in list(_ALIVE):
        pool.close()


_POOLS_LOCK = threading.Lock()


def pool_key(config: SandboxConfig) -> tuple[Any, ...]:
    """What makes two sandboxes interchangeable: all but the episode's ids and wall clock."""
    limits = config.limits.model_dump(exclude={"wall_clock_s"})
    return (
        config.backend,
        config.image,
        tuple(sorted(limits.items())),
        config.workdir,
        tuple(sorted(config.env.items())),
        config.docker_host,
        config.runtime,
    )


def pool_for(config: SandboxConfig, settings: PoolSettings | None = None) -> SandboxPool:
    """This process's pool for `config`'s kind of sandbox (created on first use)."""
    key = pool_key(config)
    with _POOLS_LOCK:
        pool = _POOLS.get(key)
        if pool is None:
            if settings is None:
                settings = PoolSettings(max_episodes=config.max_episodes_per_sandbox)
            pool = _POOLS[key] = SandboxPool(config, settings)
        return pool


def _forget(pool: SandboxPool) -> None:
    with _POOLS_LOCK:
        if _POOLS.get(pool.key) is pool:
            del _POOLS[pool.key]


def pools() -> list[SandboxPool]:
    with _POOLS_LOCK:
        return list(_POOLS.values())


def close_all() -> None:
    """Drain every pool of this process (tests, and the end of a run)."""
    for pool in pools():
        pool.close()
