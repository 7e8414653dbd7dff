"""`sandflow rl serve`: the rollout server an on-policy trainer drives (rl/, docs/rl.md).

The application reads the settings (flags > SANDFLOW_* > sandflow.toml) and hands the
values to rl.server; the library never reads them itself.
"""

from __future__ import annotations

from pathlib import Path

import typer

from sandflow.commands.durability_option import (
    DurabilityChoice,
    durability_option,
    durability_value,
)
from tasks.defaults import DEFAULT_MAX_STEPS, DEFAULT_WALL_CLOCK_S

rl_app = typer.Typer(
    name="rl",
    help=(
        "sandflow as the environment of an on-policy RL trainer. Two forms: the step-wise "
        "environment in the trainer's process (python: rl.SandboxEnv, SkyRL: rl.skyrl), and "
        "the rollout server below (whole episodes, streamed back token-exact). docs/rl.md."
    ),
    no_args_is_help=True,
)


@rl_app.command("serve")
def serve(
    host: str = typer.Option(
        "127.0.0.1",
        "--host",
        help="Interface to bind; anything but loopback exposes the sandboxes.",
    ),
    port: int = typer.Option(
        8770, "--port", "-p", min=1, max=65535, help="TCP port (sandflow view uses 8765)."
    ),
    max_concurrency: int = typer.Option(
        64,
        "--max-concurrency",
        "-c",
        min=1,
        max=4096,
        help="Episodes at once over all batches (each holds a sandbox and a worker thread).",
    ),
    warehouse: Path | None = typer.Option(
        None,
        "--warehouse",
        "-w",
        help="Where every rollout is recorded (env SANDFLOW_WAREHOUSE; default warehouse_data).",
    ),
    no_record: bool = typer.Option(False, "--no-record", help="Record nothing (benchmarks only)."),
    durability: DurabilityChoice | None = durability_option(),
    backend: str | None = typer.Option(None, "--backend", help="Sandbox backend: docker or bwrap."),
    max_steps: int = typer.Option(
        DEFAULT_MAX_STEPS,
        "--max-steps",
        min=1,
        help="Default turns per episode (a request may set its own limits).",
    ),
    wall_clock: float = typer.Option(
        DEFAULT_WALL_CLOCK_S, "--wall-clock", min=1.0, help="Default seconds per episode."
    ),
    exec_timeout: float | None = typer.Option(
        None, "--exec-timeout", min=1.0, help="Seconds per shell command."
    ),
    no_compact: bool = typer.Option(
        False, "--no-compact", help="Do not compact each batch's run at its end."
    ),
    prices: str | None = typer.Option(
        None,
        "--prices",
        help="Price table (JSON file or text; default SANDFLOW_PRICES or [prices] in "
        "sandflow.toml): each batch's run records it, `run_cost` prices its tokens. docs/cost.md.",
    ),
    max_cost: float | None = typer.Option(
        None,
        "--max-cost",
        min=0.0,
        help="Each batch's budget in USD unless its request sets `budget` (needs a price for "
        "the model): reached, the batch stops cleanly (budget_exhausted; docs/cost.md).",
    ),
    max_run_tokens: int | None = typer.Option(
        None,
        "--max-run-tokens",
        min=1,
        help="Each batch's budget in tokens (prompt + completion) unless its request sets `budget`.",
    ),
) -> None:
    """Serve rollouts: POST /v1/rollouts with tasks x n, the trainer's endpoint and sampling;
    trajectories stream back as NDJSON as each episode ends (docs/rl.md)."""
    from rl.batch import Budget
    from rl.server import ServerConfig
    from rl.server import serve as run_server
    from sandflow.config import command_settings, flag_prices, run_spec
    from sandflow.errors import EXIT_USAGE, fail

    try:
        table = flag_prices(prices)
    except ValueError as exc:
        raise fail(str(exc), EXIT_USAGE, label="Error") from None
    settings = command_settings(
        warehouse=warehouse, backend=backend, durability=durability_value(durability),
        **({"prices": table} if table is not None else {}),
    )
    # The episodes' sandbox and limits, built the one way every command builds them.
    spec = run_spec(
        settings,
        # RL runs hundreds of short episodes against a local policy: warm sandboxes
        # (reset between episodes) unless SANDFLOW_SANDBOX_REUSE=fresh
        sandbox_reuse=settings.sandbox_reuse or "pool",
        max_steps=max_steps,
        wall_clock_s=wall_clock,
        exec_timeout_s=exec_timeout,
    )
    cfg = ServerConfig(
        warehouse=None if no_record else Path(settings.warehouse),
        max_concurrency=max_concurrency,
        sandbox=spec.to_sandbox_config(),
        limits=spec.to_limits(),
        compact=not no_compact,
        durability=settings.durability,
        prices=settings.prices.public_dict(),
        budget=Budget(max_cost_usd=max_cost, max_run_tokens=max_run_tokens)
        if max_cost is not None or max_run_tokens is not None
        else None,
    )
    where = "nothing (--no-record)" if cfg.warehouse is None else str(cfg.warehouse)
    typer.echo(
        f"sandflow rollout server on http://{host}:{port}/v1/rollouts "
        f"(at most {max_concurrency} episodes at once; recording to {where}); Ctrl+C stops it"
    )
    run_server(cfg, host=host, port=port)


@rl_app.command("openenv")
def openenv(
    tasks: str = typer.Option(..., "--tasks", "-t", help="The task set sessions reset to by task_id: a suite, a task-set file or a table."),
    host: str = typer.Option("127.0.0.1", "--host", help="Interface to bind; anything but loopback exposes the sandboxes."),
    port: int = typer.Option(8771, "--port", "-p", min=0, max=65535, help="TCP port (the rollout server uses 8770)."),
    max_sessions: int = typer.Option(16, "--max-sessions", min=1, max=1024, help="OpenEnv sessions at once (each holds a sandbox)."),
    warehouse: Path | None = typer.Option(None, "--warehouse", "-w", help="Where every episode is recorded (env SANDFLOW_WAREHOUSE; default warehouse_data)."),
    run_id: str | None = typer.Option(None, "--run-id", help="The warehouse run of every session (default: openenv-env-<pid>-<hex>)."),
    backend: str | None = typer.Option(None, "--backend", help="Sandbox backend: docker or bwrap."),
    max_steps: int = typer.Option(DEFAULT_MAX_STEPS, "--max-steps", min=1, max=1000, help="Tool-calling turns per episode."),
    wall_clock: float = typer.Option(DEFAULT_WALL_CLOCK_S, "--wall-clock", min=1, help="Seconds per episode."),
) -> None:
    """Serve sandflow's sandbox as an OpenEnv environment (openenv-core; `pip install
    sandflow[openenv]`): reset(task_id=...) -> step({"tool", "arguments"}) ... -> the
    verifier's reward when done (docs/rl.md, "OpenEnv")."""
    from sandflow.errors import EXIT_USAGE, fail

    try:
        from rl.openenv_server import ServerConfig, create_app
        from rl.openenv_server import serve as run_server
    except ModuleNotFoundError as exc:
        raise fail(
            f"sandflow rl openenv needs openenv-core ({exc}): pip install 'sandflow[openenv]'",
            EXIT_USAGE, label="Error",
        ) from None  # fmt: skip
    from analysis.trajectory import RewardError
    from datasets_prep.prepare import load_taskset
    from rl.env import default_run_id
    from rl.recording import RolloutTags
    from sandflow.config import command_settings, run_spec

    settings = command_settings(warehouse=warehouse, backend=backend)
    try:
        ts = load_taskset(tasks)
    except (ValueError, OSError) as exc:
        raise fail(str(exc), EXIT_USAGE, label="Error") from None
    # a fresh sandbox per session, as OpenEnv sessions have always had
    spec = run_spec(settings, sandbox_reuse="fresh", max_steps=max_steps, wall_clock_s=wall_clock)
    cfg = ServerConfig(
        tasks={t.id: t for t in ts.tasks},
        warehouse=Path(settings.warehouse),
        run_id=run_id or default_run_id(RolloutTags(training_run="openenv")),
        sandbox=spec.to_sandbox_config(),
        limits=spec.to_limits(),
        max_sessions=max_sessions,
    )
    try:
        create_app(cfg)  # refuses a task set that cannot reward, before binding
    except RewardError as exc:
        raise fail(str(exc), EXIT_USAGE, label="Error") from None
    typer.echo(
        f"sandflow OpenEnv server on http://{host}:{port} (ws /ws; {len(cfg.tasks)} tasks; "
        f"run {cfg.run_id} in {cfg.warehouse}); Ctrl+C stops it",
    )
    run_server(cfg, host=host, port=port)


def register(app: typer.Typer) -> None:
    app.add_typer(rl_app, name="rl", rich_help_panel="RL")
