"""Episodes running at once: the rollout server's bound and a batch's own, as one object.

A running episode holds a sandbox it drives and makes at most one model call at a time,
so bounding running episodes bounds both. The server has one bound over all its batches
(`--max-concurrency`, a semaphore shared by them); a request's `max_concurrency` is its
batch's share. Before trees ran their siblings concurrently, the server's thread pool
was the bound (one episode per worker thread); a tree's siblings run on threads of their
own, so every running episode now holds a slot of both bounds, whatever thread runs it.

`take` blocks (a job about to start: it holds nothing, so waiting cannot deadlock) and
gives up when the batch is cancelled; `try_take` never blocks (a tree at a branch point
holds a slot already: a sibling that gets none waits for one of its own tree's workers,
rl.tree). Always the batch's bound first, then the server's: one order, no lock cycle.
"""

from __future__ import annotations

import threading

from engine.cancel import CancelToken
from engine.retry import EpisodeCancelled


class Slots:
    """One batch's slots: `take`/`try_take` then `give`; `active` and `peak` are the
    batch's running episodes now and at most."""

    def __init__(self, server: threading.Semaphore | None, batch_limit: int | None) -> None:
        self.server = server
        self.batch = threading.BoundedSemaphore(batch_limit) if batch_limit else None
        self.active = 0
        self.peak = 0
        self._lock = threading.Lock()

    def _got(self) -> None:
        with self._lock:
            self.active += 1
            self.peak = max(self.peak, self.active)

    def try_take(self) -> bool:
        """A slot of both bounds now, or False (nothing held)."""
        if self.batch is not None and not self.batch.acquire(blocking=False):
            return False
        if self.server is not None and not self.server.acquire(blocking=False):
            if self.batch is not None:
                self.batch.release()
            return False
        self._got()
        return True

    def take(self, cancel: CancelToken, what: str) -> None:
        """Wait for a slot of both bounds; EpisodeCancelled (nothing held) once `cancel` is set."""
        for sem in (self.batch, self.server):
            if sem is None:
                continue
            while not sem.acquire(timeout=0.2):
                if cancel.is_set():
                    if sem is self.server and self.batch is not None:
                        self.batch.release()
                    raise EpisodeCancelled(f"{what} not started: {cancel.reason}")
        self._got()

    def give(self) -> None:
        with self._lock:
            self.active -= 1
        if self.server is not None:
            self.server.release()
        if self.batch is not None:
            self.batch.release()
