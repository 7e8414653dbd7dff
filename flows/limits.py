"""Prefect's global concurrency limits as the engine's global limit (engine/slots.py).

In one process the engine bounds live sandboxes and model calls with semaphores. Across
processes and flows (Dask workers, several runs on one host) Prefect global concurrency
limits do the same when a Prefect server is configured: `prefect gcl create
sandflow-sandboxes --limit N` (and `sandflow-model-calls`). Without a server, or without
the limit, this is a no-op (strict=False), and the in-process semaphore still holds.

When the server fails while a slot is taken (its database restarting: HTTP 500) the engine
calls that an infrastructure failure and retries the episode (engine.slots,
GlobalLimitUnavailable); a slot whose release failed is logged and comes free when its
lease (LEASE_S) runs out.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from engine.slots import MODEL_LIMIT, SANDBOX_LIMIT

__all__ = ["MODEL_LIMIT", "SANDBOX_LIMIT", "prefect_limit"]

LEASE_S = 60.0


@contextlib.contextmanager
def prefect_limit(name: str, timeout_s: float | None) -> Iterator[None]:
    """One unit of Prefect's global concurrency limit `name` (no server: nothing)."""
    if not os.environ.get("PREFECT_API_URL"):
        yield
        return
    from prefect.concurrency.sync import concurrency

    # the shortest lease the server grants (renewed while held): a slot whose release
    # failed (the server's database away for a moment) comes free within a minute, not five
    with concurrency(name, occupy=1, strict=False, timeout_seconds=timeout_s, lease_duration=LEASE_S):
        yield
