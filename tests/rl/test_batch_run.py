"""A rollout batch's run goes through the engine's one path (engine.run.open_run, the
piece `engine.run` uses): its lock and record from `begin`, its fan-out through
RunHandle.fan_out, its end by the engine's rules from `end`. Real sandboxes, a real
warehouse, HTTP to the scripted policy; the fault is an executor that breaks after the
first episode it hands back (as a lost Dask scheduler or a bug would)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from engine import RunLockedError
from engine.executors import Executor, Finished, Work
from engine.run import hold_run
from rl.batch import Batch, RolloutRequest
from tasks.loop import Limits
from tests.rl.conftest import containers_of, new_run_id, sandbox_cfg
from tests.rl.test_server import answering, request
from tests.scripted_model import ScriptedModel

pytestmark = pytest.mark.usefixtures("sandbox_image")


class BreaksAfterOne:
    """The engine's executor, until the first episode it hands back: then it raises."""

    def __init__(self, inner: Executor) -> None:
        self.inner = inner

    @property
    def in_process(self) -> bool:
        return True

    def map(self, work: Work) -> Iterator[Finished]:
        results = self.inner.map(work)
        try:
            yield next(results)
            raise RuntimeError("the executor lost its workers")
        finally:
            results.close()  # type: ignore[attr-defined]


@contextlib.contextmanager
def begun_batch(tmp_path: Path, tag: str, n: int) -> Iterator[tuple[Any, Batch, ScriptedModel]]:
    """A batch of `n` samples of the math task, one at a time, begun (its run taken) in a
    real warehouse: (the warehouse, the batch, the scripted policy)."""
    from warehouse import Warehouse

    wh = Warehouse(tmp_path / "wh")
    pool = ThreadPoolExecutor(4)
    try:
        with ScriptedModel(default=answering(itertools.repeat("42")), models=("scripted",)) as model:
            req = RolloutRequest.model_validate(request(model, new_run_id(tag), n=n, max_concurrency=1))
            batch = Batch(req, recorder=wh.writer(durability="flush"), executor=pool, sandbox=sandbox_cfg(),
                          default_limits=Limits(max_steps=6, wall_clock_s=120), warehouse=wh)  # fmt: skip
            batch.begin()
            yield wh, batch, model
    finally:
        pool.shutdown(wait=True)


async def _all(batch: Batch) -> list[dict[str, Any]]:
    return [event async for event in batch.events()]


def test_a_batch_whose_executor_breaks_mid_way_ends_with_an_error_and_its_run_interrupted(
    tmp_path: Path,
) -> None:
    with begun_batch(tmp_path, "batch-broken", n=3) as (wh, batch, model):
        rid = batch.run_id
        # the engine's run: recorded `running`, its lock held (a second writer is refused)
        assert wh.run_info(rid)["status"] == "running"
        with pytest.raises(RunLockedError, match=rid), hold_run(wh, rid):
            pass
        batch.executor = BreaksAfterOne(batch.executor)  # type: ignore[assignment]
        events = asyncio.run(_all(batch))
        assert batch.end() == "interrupted"
        assert len(model.requests) == 2  # the one episode that ran: its two turns
    # the stream: the episode that ended, then the error (no `done`: the batch did not end)
    assert [e["type"] for e in events] == ["start", "trajectory", "error"]
    assert events[1]["status"] == "ok" and events[1]["reward"] == 1.0
    assert events[2]["error"] == "RuntimeError: the executor lost its workers"
    info = wh.run_info(rid)
    assert info["status"] == "interrupted" and info["ended_at"] is not None
    assert info["notes"] == "cancelled: the run was interrupted"
    with hold_run(wh, rid):  # released: the same step runs again
        pass
    assert batch.end() is None  # once: a second end (the server stopping) changes nothing
    assert wh.run_info(rid)["status"] == "interrupted"
    assert containers_of(rid) == []


def test_a_batch_that_runs_to_its_end_is_finished_and_compacted(tmp_path: Path) -> None:
    with begun_batch(tmp_path, "batch-done", n=2) as (wh, batch, _):
        rid = batch.run_id
        events = asyncio.run(_all(batch))
        assert batch.end() == "finished"
    assert [e["type"] for e in events] == ["start", "trajectory", "trajectory", "group", "done"]
    assert events[-1]["ok"] == 2
    info = wh.run_info(rid)
    assert info["status"] == "finished" and info["notes"] == "rl rollout server batch"
    config = json.loads(info["config"]) if isinstance(info["config"], str) else info["config"]
    assert config["form"] == "server" and config["n"] == 2
    # compacted at its end (engine.run.compact_after_run): the two episodes in one file
    assert len(wh.layout.partition_files("episodes", rid)) == 1
    with hold_run(wh, rid):
        pass
