"""--max-model-calls: a bounded number of model calls at once across a process's episodes,
and an episode waiting for a slot still ends by its wall clock (as an infrastructure
failure naming the slots, retried and re-run on resume, never graded)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

from datasets_prep.task import Task
from engine.slots import shared_client, slot
from tasks.loop import Limits, run_episode
from tests.scripted_model import ScriptedModel, text_reply
from tests.tasks.conftest import fast_model


@contextlib.contextmanager
def another_episode_holds_the_slot(release: threading.Event) -> Iterator[None]:
    """The only model-call slot, held by another thread (an episode's call in flight)
    until `release` is set (or 10 s pass)."""
    held = threading.Event()

    def holder() -> None:
        with slot("model", 1):
            held.set()
            release.wait(10)

    t = threading.Thread(target=holder)
    t.start()
    held.wait(5)
    try:
        yield
    finally:
        release.set()
        t.join()


def test_calls_beyond_the_bound_wait_for_a_slot(scripted_model: ScriptedModel) -> None:
    client = shared_client(fast_model(scripted_model), max_calls=1)
    scripted_model.push(text_reply("first"), text_reply("second"))
    release = threading.Event()
    with another_episode_holds_the_slot(release):
        threading.Timer(0.3, release.set).start()
        t0 = time.monotonic()
        reply = client.complete([{"role": "user", "content": "hi"}], timeout_s=5)
    assert reply.content == "first" and time.monotonic() - t0 >= 0.25  # it waited its turn


def test_an_episode_waiting_for_a_slot_ends_by_its_wall_clock(
    scripted_model: ScriptedModel,
) -> None:
    cfg = fast_model(scripted_model)
    client = shared_client(cfg, max_calls=1)
    task = Task(id="t", domain="math", problem_statement="2+2?", ground_truth="4")
    with another_episode_holds_the_slot(threading.Event()):  # a call that does not end in time
        t0 = time.monotonic()
        result = run_episode(
            task, cfg, mode="llm", client=client, run_id="pytest-slots",
            limits=Limits(wall_clock_s=1.0),
        )  # fmt: skip
        waited = time.monotonic() - t0
    rec = result.record
    assert waited < 4, waited  # not until the holder let go
    assert rec.termination == "model_error", (rec.termination, rec.error)
    assert "model-call slot (--max-model-calls 1)" in (rec.error or "")
    assert "wall clock" in (rec.error or "")
    assert scripted_model.requests == []  # no call was made past the bound
