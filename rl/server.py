"""The rollout server: whole episodes as a service for an on-policy trainer.

    POST /v1/rollouts   RolloutRequest (JSON) -> NDJSON stream of events, one per line:
                        start, trajectory (each as it ends), group (advantages once a
                        task's samples are in), done; or error (then the stream ends)
    GET  /v1/health     {"status": "ok", "active_batches": N, "active_episodes": N}

Bound to 127.0.0.1 by default (`sandflow rl serve --host` to change it). Episodes of all
batches share one bound (`max_concurrency`: sandboxes and model calls at once) and one
worker thread per slot. A trainer that disconnects cancels its batch: no new episode
starts, running ones stop and their sandboxes are removed (rl.batch). Every batch is a
warehouse run through the engine's one path (engine.run.open_run, as `engine.run` takes
it): its lock, held while the batch streams, its record `running`, its fan-out, and its
end by the engine's rules (finished / failed / interrupted / budget_exhausted), compacted
when it ran to its end. A server killed mid-batch leaves the run reading `interrupted`,
and a second writer of the run id is refused (409).
A batch's budget (the request's `budget`, or the server's default) stops it cleanly:
rl.batch and docs/cost.md.

The endpoint's API key, when the trainer sends one, is used for the model calls only:
it is never written to the warehouse, the logs or the stream.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field, ValidationError

from datasets_prep.rows import RowError
from engine.plan import RunLockedError
from rl.batch import Batch, Budget, RolloutRequest
from sandbox.base import SandboxConfig
from tasks.loop import Limits
from warehouse import DEFAULT_ROOT


class ServerConfig(BaseModel):
    """What the application hands the server (sandflow rl serve reads the settings)."""

    warehouse: Path | None = Field(Path(DEFAULT_ROOT), description="None: record nothing")
    max_concurrency: int = Field(64, ge=1, le=4096, description="episodes at once, all batches")
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    limits: Limits = Field(default_factory=Limits)
    durability: str = "turn"
    compact: bool = True
    prompt_dir: str | None = None
    # tasks.pricing.PriceTable as JSON: prices each batch's tokens (recorded in its run:
    # `run_cost`) and its cost budget; {}: none (cost unknown, --max-cost refused)
    prices: dict[str, Any] = Field(default_factory=dict)
    budget: Budget | None = Field(None, description="each batch's budget when its request sets none")


def create_app(config: ServerConfig | None = None) -> FastAPI:
    """The FastAPI app (run it with uvicorn; `serve()` does both)."""
    cfg = config or ServerConfig()
    state: dict[str, Any] = {"batches": set()}

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        state["executor"] = ThreadPoolExecutor(
            max_workers=cfg.max_concurrency, thread_name_prefix="rollout"
        )
        # episodes running at once over every batch (a tree's siblings run on threads of
        # their own: the pool's size alone no longer bounds them; rl.slots)
        state["slots"] = threading.BoundedSemaphore(cfg.max_concurrency)
        state["recorder"], state["warehouse"] = _recorder(cfg)
        try:
            yield
        finally:
            open_batches = list(state["batches"])
            for batch in open_batches:
                batch.cancel("the rollout server stopped")
            state["executor"].shutdown(wait=True, cancel_futures=True)
            for batch in open_batches:  # streams cut before their own bookkeeping ran
                batch.end(cfg.compact)
            with contextlib.suppress(Exception):
                state["recorder"].close()

    app = FastAPI(title="sandflow rollout server", lifespan=lifespan)
    app.state.rollout_batches = state["batches"]  # serve() cancels them on Ctrl+C / SIGTERM

    @app.get("/v1/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "active_batches": len(state["batches"]),
            "active_episodes": sum(b.active for b in state["batches"]),
            "max_concurrency": cfg.max_concurrency,
        }

    @app.post("/v1/rollouts", response_model=None)
    async def rollouts(request: Request) -> Any:
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse({"error": "the request body is not JSON"}, status_code=400)
        try:
            req = RolloutRequest.model_validate(body)
            batch = Batch(
                req,
                recorder=state["recorder"],
                executor=state["executor"],
                sandbox=cfg.sandbox,
                server_slots=state["slots"],
                default_limits=cfg.limits,
                warehouse=state["warehouse"],
                prompt_dir=cfg.prompt_dir,
                prices=cfg.prices,
                default_budget=cfg.budget,
            )
        except ValidationError as exc:
            return JSONResponse({"error": _validation_message(exc)}, status_code=422)
        except (RowError, ValueError) as exc:
            return JSONResponse({"error": str(exc)}, status_code=422)
        if any(b.run_id == batch.run_id for b in state["batches"]):
            return JSONResponse(
                {"error": f"run {batch.run_id!r} is already being rolled out: give another run_id"},
                status_code=409,
            )
        try:
            await anyio.to_thread.run_sync(batch.begin)
        except RunLockedError as exc:  # another process writes this run id (names it)
            return JSONResponse({"error": str(exc)}, status_code=409)
        except Exception as exc:  # nothing has started: the trainer can retry
            return JSONResponse(
                {"error": f"recording run {batch.run_id!r} in the warehouse failed: {exc}"},
                status_code=503,
            )
        state["batches"].add(batch)
        return _BatchStream(batch, state, cfg)

    return app


class _BatchStream(StreamingResponse):
    """The NDJSON stream of one batch, whose end is handled whatever ends it.

    Why: when the trainer disconnects, Starlette cancels the task sending the stream
    while the body's async generator is suspended, and nothing closes the generator (its
    `finally` would run only when it is garbage-collected: a batch's run stayed `running`,
    found 5 times in 6 disconnects). Here the end is explicit: the body is closed, and
    the batch is cancelled and its run ended (Batch.end), shielded from the cancellation."""

    def __init__(self, batch: Batch, state: dict[str, Any], cfg: ServerConfig) -> None:
        super().__init__(_ndjson(batch), media_type="application/x-ndjson")
        self.batch, self.state, self.cfg = batch, state, cfg

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            batch = self.batch
            self.state["batches"].discard(batch)
            if not batch.done:  # the stream was cut: the batch's run ends `interrupted`
                batch.cancel()
            with anyio.CancelScope(shield=True):
                with contextlib.suppress(Exception):
                    await self.body_iterator.aclose()  # type: ignore[attr-defined]
                await anyio.to_thread.run_sync(batch.end, self.cfg.compact)


async def _ndjson(batch: Batch) -> AsyncIterator[bytes]:
    async with contextlib.aclosing(batch.events()) as events:
        async for event in events:
            yield (json.dumps(event, ensure_ascii=False, separators=(",", ":")) + "\n").encode()


def _recorder(cfg: ServerConfig) -> tuple[Any, Any]:
    if cfg.warehouse is None:
        from tasks.records import NullRecorder

        return NullRecorder(), None
    from warehouse.store import Warehouse

    wh = Warehouse(cfg.warehouse)
    return wh.writer(durability=cfg.durability), wh  # type: ignore[arg-type]


def _validation_message(exc: ValidationError) -> str:
    parts = []
    for e in exc.errors()[:5]:
        loc = ".".join(str(x) for x in e.get("loc", ())) or "body"
        parts.append(f"{loc}: {e.get('msg')}")
    return "; ".join(parts)


def serve(config: ServerConfig, host: str = "127.0.0.1", port: int = 8770) -> None:
    """Run the server in the foreground (Ctrl+C stops it and removes its sandboxes)."""
    import uvicorn

    app = create_app(config)

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            # Cancel the open batches first: their streams then end by themselves (every
            # episode reported as cancelled, then `done`) and their sandboxes are removed.
            for batch in list(app.state.rollout_batches):
                batch.cancel()
            super().handle_exit(sig, frame)

    # timeout_graceful_shutdown: a stream still open after that is cut.
    cfg = uvicorn.Config(
        app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=10
    )
    _Server(cfg).run()
