"""`sandflow bench` (the main job) and `sandflow flows ...` (each pipeline step on its own):
the commands of the flows/ library. Each command resolves the settings into values (a
RunSpec for a run, a warehouse root, a judge endpoint) and hands them to one flow.

Everything runs in Prefect's ephemeral mode unless PREFECT_API_URL names a server:
no server to start, the same flows show up in a real server's UI when one is set.
Prefect is imported inside the commands (after flows/prefect_env.py has set its
settings), so `sandflow --help` stays fast.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import typer

from sandflow.commands.durability_option import (
    DurabilityChoice,
    durability_option,
    durability_value,
)
from sandflow.commands.network_option import network_option
from sandflow.commands.prompts_option import prompt_dir_of, prompts_option
from sandflow.console import short
from sandflow.errors import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_REGRESSION,
    EXIT_USAGE,
    console,
    fail,
)
from tasks.defaults import DEFAULT_MAX_STEPS, DEFAULT_WALL_CLOCK_S, EMBEDDED_MODEL_MAX_STEPS

flows_app = typer.Typer(
    help=(
        "Run the pipeline's steps one by one: prepare -> run -> score -> usage -> tokens -> "
        "rollouts -> report. Every step after `run` reads the warehouse, so it can be re-run "
        "(e.g. re-score with another verifier) without re-running episodes. "
        "`sandflow flows run --run-id R` resumes an interrupted run."
    ),
    no_args_is_help=True,
    rich_markup_mode="rich",
)

# ----------------------------------------------------------------------- shared options
_WAREHOUSE = typer.Option(
    None, "--warehouse", "-w", help="Warehouse root (default: SANDFLOW_WAREHOUSE or ./warehouse_data)."
)  # the text names the default; the value is warehouse.DEFAULT_ROOT, via Settings
_RUN_ID = typer.Option(..., "--run-id", "-r", help="The run to work on (printed by `run` and `bench`).")
_PRICES = typer.Option(
    None,
    "--prices",
    help="Price table: a JSON file or JSON text of model -> USD per million tokens "
    '(e.g. \'{"gpt-4o": {"input": 2.5, "cached_input": 1.25, "output": 10}}\'); the run records '
    "it and `run_cost` prices its tokens (default: SANDFLOW_PRICES or [prices] in sandflow.toml; "
    "none: cost unknown). docs/cost.md.",
)

_SAMPLES = typer.Option(1, "--samples", "-k", min=1, help="Samples per task and mode.")
_MAX_SANDBOXES = typer.Option(
    None, "--max-sandboxes", min=1, help="Live sandboxes at once (default: --concurrency)."
)
_MAX_MODEL_CALLS = typer.Option(
    None, "--max-model-calls", min=1, help="Concurrent model calls (default: unbounded)."
)
_WALL_CLOCK = typer.Option(
    DEFAULT_WALL_CLOCK_S, "--wall-clock", help="Seconds per episode, model and tools together."
)
_RESUME = typer.Option(
    None, "--run-id", "-r", help="Resume this run (finished episodes are skipped), or name a new one."
)
_TASK_RUNNER = typer.Option(
    "thread",
    "--task-runner",
    help="thread (one process) | dask (a cluster) | ray (a local Ray, or RAY_ADDRESS; extra `ray`).",
)
_DASK_ADDRESS = typer.Option(None, "--dask-address", help="tcp://host:8786 of a Dask scheduler.")
_VERBOSE = typer.Option(False, "--verbose", "-v", help="Show Prefect's own logs.")

_MAX_COST = typer.Option(
    None,
    "--max-cost",
    min=0.0,
    help="The run's budget in USD (needs a price for the model: --prices): once its recorded "
    "and running turns cost this much, no episode starts and running ones stop at their next "
    "turn as budget_exhausted (not graded; resume with a higher budget finishes the run).",
)
_MAX_RUN_TOKENS = typer.Option(
    None,
    "--max-run-tokens",
    min=1,
    help="The run's budget in tokens (prompt + completion over all its turns, resumes "
    "included); reached: as --max-cost.",
)


def _budget_priced(spec: Any) -> Any:
    """--max-cost needs a price for the model: exit 2, one sentence, before any work (a
    model not named yet, the embedded one, is checked by the engine once it is known)."""
    from engine.budget import check_priced
    from engine.plan import RunConfigError

    if spec.endpoint.model:
        try:
            check_priced(spec)
        except RunConfigError as exc:
            raise fail(str(exc), EXIT_USAGE) from None
    return spec


def _exit_if_budget_spent(run: dict[str, Any]) -> None:
    """A run its budget stopped never ends with exit 0: one sentence naming the budget
    and what was spent, exit 1 (EXIT_FAILED)."""
    if run.get("status") != "budget_exhausted":
        return
    b = run.get("budget") or {}
    raise fail(
        f"run {run['run_id']} stopped on its budget: {run.get('cancel_reason')}; "
        f"{run.get('cancelled', 0)} episodes stopped or not run (spent {b.get('spent_tokens')} tokens"
        + (f", {b['spent_usd']:.4f} USD" if b.get("spent_usd") is not None else "")
        + f"). Resume with a higher budget: --run-id {run['run_id']}",
        EXIT_FAILED,
    )


def _settings(**overrides: Any) -> Any:
    from pydantic import ValidationError

    from sandflow.config import load_settings

    try:
        return load_settings(**overrides)
    except ValidationError as exc:  # a bad SANDFLOW_* variable or sandflow.toml entry
        err = exc.errors()[0]
        name = ".".join(map(str, err["loc"]))
        msg = str(err["msg"]).removeprefix("Value error, ")
        _fail(f"invalid setting {name} (SANDFLOW_{name.upper()} or sandflow.toml): {msg}")


def _run_spec(s: Any, **flags: Any) -> Any:
    """The RunSpec of `bench` and `flows run`: the settings' values, then the command's flags."""
    from sandflow.config import run_spec

    return run_spec(s, **flags)


def _given(s: Any, **told: Any) -> set[str]:
    """The names of `told` the user set (a flag, or max_tokens in env or config): what the
    embedded model's smaller defaults must not override."""
    given = {k for k, v in told.items() if v is not None}
    if "SANDFLOW_MAX_TOKENS" in os.environ or "max_tokens" in s.model_fields_set:
        given.add("max_tokens")
    return given


def _run_settings(
    model: str | None, base_url: str | None, warehouse: str | None, network: str | None,
    durability: DurabilityChoice | None, prices: str | None,
) -> Any:  # fmt: skip
    """The settings of `bench` and `flows run` (their shared flags over env and config)."""
    return _settings(
        model=model, base_url=base_url, warehouse=warehouse, network=network,
        durability=durability_value(durability), prices=_prices(prices),
    )  # fmt: skip


def _step(target: str, verbose: bool, warehouse: str | None, **kwargs: Any) -> Any:
    """One pipeline step of `sandflow flows`: the flow `target` ("module:name", imported
    once Prefect's settings are in place) on the warehouse the settings name."""
    import importlib

    _quiet_prefect(verbose)
    module, name = target.split(":")
    flow_fn = getattr(importlib.import_module(module), name)
    return _guard(flow_fn, warehouse=str(_settings(warehouse=warehouse).warehouse), **kwargs)


def _launch(flow_fn: Any, runner: str, dask: str | None, /, **kwargs: Any) -> Any:
    """Run `flow_fn(**kwargs)` under the progress bars, its errors and Ctrl+C reported
    (`runner`, `dask`: --task-runner and --dask-address, for _with_prefect_api)."""
    from sandflow.commands.progress import RichEpisodeProgress

    with RichEpisodeProgress("episodes", console=_console()):
        return _guard(_with_prefect_api(runner, dask, flow_fn), **kwargs)


def _quiet_prefect(verbose: bool) -> None:
    """Prefect's INFO logs would scroll over the progress bars; keep warnings and errors."""
    if not verbose:
        os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    from flows import prefect_env

    prefect_env.apply()
    prefect_env.detach_ephemeral_server()
    if not verbose:
        # A failed flow or episode is reported by us in one sentence (and episodes in the
        # run summary); Prefect's engine would add a traceback per failure on top.
        import logging

        import prefect.main  # noqa: F401  (configures logging first, so the levels below stick)

        for name in ("prefect.flow_runs", "prefect.task_runs"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def _isolate_from_terminal_signals() -> None:
    """Run this command again in its own session, forwarding Ctrl+C to it alone.

    A terminal's Ctrl+C goes to the whole foreground process group: it would kill
    Prefect's ephemeral API server and the embedded model server (our children) at
    once, while the episodes still need them to stop cleanly. In its own session the
    command gets exactly one SIGINT per Ctrl+C and shuts down in order: in-flight
    episodes end at their next turn (recorded `interrupted`, sandboxes closed), then the
    servers stop. A third Ctrl+C kills it (sandboxes then remove themselves when their
    connection drops; `sandflow sandbox gc` cleans up the rest).
    """
    if os.environ.get("SANDFLOW_ISOLATED") or not sys.stdin.isatty():
        return
    env = dict(os.environ, SANDFLOW_ISOLATED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "sandflow.cli", *sys.argv[1:]], env=env, start_new_session=True
    )
    forward = lambda signum, frame: proc.send_signal(signal.SIGINT)  # noqa: E731
    signal.signal(signal.SIGTERM, forward)
    interrupts = 0
    while True:
        try:
            raise typer.Exit(proc.wait())
        except KeyboardInterrupt:
            interrupts += 1
            proc.send_signal(signal.SIGINT if interrupts < 3 else signal.SIGKILL)


def _console() -> Any:
    return console()


def _prices(flag: str | None) -> Any:
    """--prices checked before any work: a bad table is exit 2 naming what is wrong."""
    from sandflow.config import flag_prices

    try:
        return flag_prices(flag)
    except ValueError as exc:
        raise fail(str(exc), EXIT_USAGE) from None


def _fail(msg: str) -> None:
    """A pipeline step could not run: exit 1 (sandflow/errors.py)."""
    raise fail(msg, EXIT_FAILED)


def _table(rows: list[dict[str, Any]], title: str) -> Any:
    from rich.table import Table

    t = Table(title=title, title_justify="left", show_lines=False)
    if not rows:
        t.add_column("(no rows)")
        return t
    for c in rows[0]:
        t.add_column(str(c), justify="left" if c in ("domain", "mode", "termination", "capability") else "right")
    for r in rows:
        t.add_row(*[_cell(r.get(c)) for c in rows[0]])
    return t


def _cell(v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:,.3f}".rstrip("0").rstrip(".")
    return str(v)


_USER_ERRORS: tuple[type[BaseException], ...] = ()
REGRESSION_EXIT = EXIT_REGRESSION  # `bench --fail-on-regression` found a significant drop (1: an error)


def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors that are the user's input or environment: one sentence, no traceback."""
    from analysis.rollouts import RolloutError
    from datasets_prep.io import TaskSetIOError
    from datasets_prep.loaders import SourceError
    from datasets_prep.sources import SourceMissing
    from datasets_prep.suites import UnknownSuite
    from datasets_prep.task import TaskValidationError
    from datasets_prep.verifiers import VerifierError
    from engine.plan import RunConfigError
    from flows.score import ScoreError
    from warehouse import WarehouseError

    errs: list[type[BaseException]] = [
        RunConfigError,
        WarehouseError,
        SourceError,
        SourceMissing,
        UnknownSuite,
        VerifierError,
        RolloutError,
        ScoreError,
        TaskSetIOError,
        TaskValidationError,
        FileNotFoundError,
    ]
    try:
        from tasks.local_model import LocalModelError

        errs.append(LocalModelError)
    except ImportError:
        pass
    return tuple(errs)


def _term_as_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _guard(fn: Any, *args: Any, **kwargs: Any) -> Any:
    import signal
    import threading

    # SIGTERM (systemd, k8s, `kill`) stops a run the way Ctrl+C does: in-flight episodes
    # recorded as interrupted, sandboxes closed. Without this, the episodes in flight ran
    # on to their end after SIGTERM (found by tests/chaos: SIGTERM mid-run).
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _term_as_interrupt)
    try:
        return fn(*args, **kwargs)
    except _user_errors() as exc:
        _fail(str(exc))
    except KeyboardInterrupt:
        _console().print(
            "[yellow]interrupted.[/] Finished episodes are in the warehouse; re-run with the same "
            "--run-id to resume."
        )
        raise typer.Exit(EXIT_INTERRUPTED) from None
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _with_prefect_api(task_runner: str, dask_address: str | None, fn: Any) -> Any:
    """`fn` run with a temporary Prefect server when Dask would otherwise go ephemeral
    (flows/prefect_server.py); inside _guard, so its errors and Ctrl+C are reported as such."""

    def run(**kwargs: Any) -> Any:
        from flows.prefect_server import api_for_task_runner

        with api_for_task_runner(task_runner, dask_address) as url:
            if url:
                _console().print(f"[dim]no PREFECT_API_URL: a temporary Prefect server at {url} serves this {task_runner} run[/]")
            return fn(**kwargs)

    return run


def _print_compaction(console: Any, comp: dict[str, Any] | None) -> None:
    if not comp:
        return
    if comp.get("error"):
        console.print(f"[yellow]compaction failed[/] ({comp['error']}); `sandflow warehouse compact` retries it")
        return
    per_table = comp.get("files_before") or {}
    parts = ", ".join(f"{t} {n}" for t, n in per_table.items())
    line = f"[dim]compacted {sum(per_table.values())} files ({parts}) in {comp.get('seconds', 0):.2f}s"
    if comp.get("pending_deletes"):
        line += f"; {comp['pending_deletes']} merged files kept for an open reader"
    console.print(line + "[/]")


def _runner(kind: str, concurrency: int, dask_address: str | None) -> Any:
    from engine.plan import RunConfigError
    from flows.run import make_task_runner

    if kind == "dask" and not dask_address:
        _console().print("[dim]--task-runner dask without --dask-address: a local Dask cluster is started[/]")
    try:
        return make_task_runner(kind, concurrency, dask_address)
    except RunConfigError as e:  # an unknown runner, or the extra `ray` not installed: bad input
        raise fail(str(e)) from None


_WAIT = typer.Option(
    False,
    "--wait",
    help="If another process is running this --run-id, wait for it to end instead of "
    "refusing (one run id has one writer).",
)


def _check_run_free(warehouse: str, run_id: str | None, wait: bool) -> None:
    """Before Prefect starts: refuse at once (or say that we wait) when another process
    holds this run id. The engine takes the lock for real (engine.run.hold_run)."""
    if not run_id:
        return
    from warehouse.layout import Layout
    from warehouse.runlock import RunLock, refusal, shared_lock_warning

    layout = Layout(warehouse)
    try:
        lock_dir = RunLock(layout, run_id).path.parent
    except ValueError:
        return  # an invalid run id: the run flow says what is wrong with it
    warning = shared_lock_warning(lock_dir) if lock_dir.exists() else None
    if warning:
        _console().print(f"[yellow]warning:[/] {warning}")
    taken = refusal(layout, run_id)
    if taken is None:
        return
    if not wait:
        _fail(str(taken))
    who = taken.holder.describe() if taken.holder else "another process"
    _console().print(
        f"[yellow]waiting:[/] run {run_id} is being run by {who}; this one starts when it "
        "ends (Ctrl+C stops waiting)."
    )


def _sql_hints(run_id: str, warehouse: str) -> list[str]:
    from warehouse import DEFAULT_ROOT

    w = "" if warehouse in (DEFAULT_ROOT, str(Path(DEFAULT_ROOT))) else f" --warehouse {warehouse}"
    return [
        f"sandflow sql{w} \"SELECT domain, mode, episodes, accuracy, avg_turns, avg_tokens FROM accuracy WHERE run_id = '{run_id}'\"",
        f"sandflow sql{w} \"SELECT domain, mode, capability, rate FROM capability_usage WHERE run_id = '{run_id}' ORDER BY rate DESC\"",
        f"sandflow sql{w} \"SELECT tool, command, duration_s, exit_code FROM tool_calls WHERE run_id = '{run_id}' ORDER BY duration_s DESC LIMIT 10\"",
    ]


# ------------------------------------------------------------------------------ bench
_CHECKPOINT = typer.Option(
    None, "--checkpoint",
    help="A policy `sandflow train` wrote (e.g. train_output/final): converted to GGUF and "
    "served by the embedded model under its own name (docs/train.md).",
)


def bench(
    source: str = typer.Option(
        "smoke", "--suite", "--source", "-s", help="Built-in suite name, a hub dataset, or a task-set file."
    ),
    model: str = typer.Option(None, "--model", "-m", help="Model name (default: SANDFLOW_MODEL; the embedded model)."),
    base_url: str = typer.Option(
        None, "--base-url", help="OpenAI-compatible endpoint (default: SANDFLOW_BASE_URL; none starts the embedded model)."
    ),
    mode: str = typer.Option("both", "--mode", help="sandbox | llm | both (the paper compares both)."),
    samples: int = _SAMPLES,
    concurrency: int = typer.Option(
        None, "--concurrency", "-c", min=1,
        help="Episodes at once (task runner workers; default 4, 1 with the embedded model).",
    ),
    max_sandboxes: int = _MAX_SANDBOXES,
    max_model_calls: int = _MAX_MODEL_CALLS,
    max_steps: int = typer.Option(
        None, "--max-steps", min=1,
        help=f"Turns per sandbox episode (default {DEFAULT_MAX_STEPS}; {EMBEDDED_MODEL_MAX_STEPS} with the embedded model).",
    ),
    max_tokens: int = typer.Option(
        None, "--max-tokens", min=1,
        help="Completion tokens per call (default SANDFLOW_MAX_TOKENS or 2048; 256 with the embedded model).",
    ),
    wall_clock_s: float = _WALL_CLOCK,
    network: str = network_option(),
    warehouse: str = _WAREHOUSE,
    durability: DurabilityChoice | None = durability_option(),
    run_id: str = _RESUME,
    task_runner: str = _TASK_RUNNER,
    dask_address: str = _DASK_ADDRESS,
    verifier: str = typer.Option(None, "--verifier", help="Score with this verifier instead of each task's own."),
    rollouts: bool = typer.Option(True, "--rollouts/--no-rollouts", help="Also export RL data."),
    series: str = typer.Option(
        None, "--series",
        help="Name of the series this run continues (default: the Prefect deployment's name; ad hoc). "
        "The report compares the run with the previous run of its series (same task set and model).",
    ),
    fail_on_regression: bool = typer.Option(
        False, "--fail-on-regression",
        help=f"Exit with code {REGRESSION_EXIT} (and fail the Prefect flow run) when accuracy dropped "
        "significantly since the previous run of the series (Holm-adjusted exact test, --alpha).",
    ),
    alpha: float = typer.Option(0.05, "--alpha", min=0.0001, max=0.5, help="Significance level of the nightly comparison."),
    max_cost_increase: float = typer.Option(
        None, "--max-cost-increase", min=0.0, max=1e6,
        help="With --fail-on-regression: a rise of the cost per task above this percent since the "
        "previous run of the series is a regression too (tasks priced in both runs; docs/cost.md).",
    ),
    wait: bool = _WAIT,
    prices: str = _PRICES,
    max_cost: float = _MAX_COST,
    max_run_tokens: int = _MAX_RUN_TOKENS,
    checkpoint: Path = _CHECKPOINT,
    prompts: str | None = prompts_option(),
    verbose: bool = _VERBOSE,
) -> None:
    """The nightly benchmark, now: prepare -> run (both modes) -> score -> usage -> tokens
    -> rollouts -> report, as one Prefect flow in ephemeral mode (no server needed).

    With no endpoint configured, the embedded SmolLM2 model is started for the run and
    stopped after it. Ends with where the report is and SQL to try.

    [bold]Examples[/]
      sandflow bench
      sandflow bench --base-url http://gpu:8000/v1 --model Qwen3-Coder --samples 3 -c 8
      sandflow bench --run-id smoke-20260101-020000-ab12     # resume
      sandflow bench --task-runner dask --dask-address tcp://10.0.0.5:8786
      sandflow bench --series nightly-qwen --fail-on-regression   # alert on a real drop
      sandflow bench --network 'allowlist:pypi.org *.pythonhosted.org:443'   # pip works, nothing else
    """
    _isolate_from_terminal_signals()
    _quiet_prefect(verbose)
    from analysis.nightly_report import RegressionFound
    from engine.plan import embedded_model_defaults
    from flows.nightly import benchmark_flow

    s = _run_settings(model, base_url, warehouse, network, durability, prices)
    if checkpoint is not None:  # the trained policy as the embedded model (docs/train.md)
        from sandflow.commands.train import serve_checkpoint

        prompts = serve_checkpoint(checkpoint, s.base_url, prompts)
    if task_runner not in ("thread", "dask", "ray"):
        _fail(f"--task-runner {task_runner!r}: use thread, dask or ray")
    given = _given(s, max_steps=max_steps, concurrency=concurrency, max_tokens=max_tokens)
    spec = embedded_model_defaults(
        _run_spec(
            s, task_set=source, mode=mode, samples=samples, concurrency=concurrency,
            max_sandboxes=max_sandboxes, max_model_calls=max_model_calls, max_steps=max_steps,
            max_tokens=max_tokens, wall_clock_s=wall_clock_s, run_id=run_id, series=series,
            wait_for_lock=wait, max_cost_usd=max_cost, max_run_tokens=max_run_tokens,
            prompt_dir=prompt_dir_of(prompts),
        ),
        given,
    )  # fmt: skip
    _console().print(
        f"[bold]sandflow bench[/] source=[cyan]{source}[/] mode={mode} samples={samples} "
        f"concurrency={spec.fanout.concurrency} max_steps={spec.limits.max_steps} model=[cyan]{s.model or '(embedded)'}[/] "
        f"endpoint={s.base_url or '(embedded, started now)'} warehouse={s.warehouse}"
        + (f" prompts={prompts}" if prompts else "")
    )
    _check_run_free(str(s.warehouse), run_id, wait)
    _budget_priced(spec)
    regression: RegressionFound | None = None
    try:
        result = _launch(
            benchmark_flow, task_runner, dask_address, spec=spec, task_runner=task_runner,
            dask_address=dask_address, verifier=verifier,
            judge=s.judge_endpoint() if verifier == "judge" else None, rollouts=rollouts,
            fail_on_regression=fail_on_regression, alpha=alpha,
            max_cost_increase=max_cost_increase,
        )  # fmt: skip
    except RegressionFound as exc:  # the report is written; say so, then exit non-zero
        regression, result = exc, exc.summary
    _print_bench(result, str(s.warehouse))
    _exit_if_budget_spent(result["run"])
    if regression is not None:
        _console().print(f"[bold red]regression:[/] {regression}", highlight=False)
        raise typer.Exit(REGRESSION_EXIT)
    _exit_if_any_failed(result["run"])


def _print_changes(console: Any, report: dict[str, Any]) -> None:
    """The report's "Changes since the previous run", as a table (significant rows only)."""
    prev = report.get("previous_run_id")
    if not prev:
        console.print("[dim]first run of its series: no previous run to compare with[/]")
        return
    sig = [r for r in report.get("changes", []) if r["significant"]]
    if not sig:
        console.print(f"changes since [cyan]{prev}[/]: none significant (every difference within noise)")
        return
    console.print(_table(sig, f"Significant changes since {prev} (points; Holm-adjusted)"))


def escape(text: str) -> str:
    from rich.markup import escape as rich_escape

    return rich_escape(text)


def _exit_if_all_failed(run: dict[str, Any]) -> None:
    """A run whose episodes all failed (after their retries) never ends with exit 0:
    one sentence naming how many and the first failure, exit 1 (EXIT_FAILED)."""
    if not run.get("ran") or run.get("succeeded") or not run.get("failed"):
        return
    first = (run.get("failures") or ["?"])[0]
    raise fail(
        f"run {run['run_id']}: all {run['failed']} episodes failed (first: {first}); nothing was "
        f"recorded as a model result. Fix the cause, then resume with --run-id {run['run_id']}",
        EXIT_FAILED,
    )


def _exit_if_any_failed(run: dict[str, Any]) -> None:
    """A run with failed episodes (after their retries) never ends with exit 0, whatever
    the others did: one sentence naming how many and the first failure, exit 1
    (EXIT_FAILED). Called after the results are shown."""
    if not run.get("failed"):
        return
    first = (run.get("failures") or ["?"])[0]
    total = run.get("ran") or int(run.get("succeeded") or 0) + int(run["failed"])
    raise fail(
        f"run {run['run_id']}: {run['failed']} of {total} episodes failed after their retries "
        f"(first: {first}); the run is recorded as failed. Resume with --run-id {run['run_id']} "
        "to run them again",
        EXIT_FAILED,
    )


def _print_bench(result: dict[str, Any], warehouse: str) -> None:
    console = _console()
    run = result["run"]
    rid = run["run_id"]
    console.print(
        f"\n[bold green]run {rid}[/]: {run['succeeded']} episodes recorded, {run['failed']} failed, "
        f"{run['skipped']} skipped (done before), {run['elapsed_s']:.1f}s, "
        f"{(run['episodes_per_s'] or 0):.2f} episodes/s"
    )
    for f in run.get("failures", [])[:5]:
        console.print(f"  [red]failed[/] {escape(f)}", soft_wrap=True, highlight=False)
    _exit_if_all_failed(run)
    report = result["report"]  # the report's own numbers (flows/report.py)
    console.print(_table(report["accuracy"], "Accuracy (%) by domain x mode"))
    console.print(_table(report["usage"], "Capability usage (% of sandbox turns)"))
    if report["token_ratio"] is not None:
        console.print(f"sandbox/LLM tokens per task: [bold]{report['token_ratio']:.2f}x[/]")
    if "rollouts" in result:
        r = result["rollouts"]
        console.print(f"RL data: [cyan]{r['out_dir']}[/] ({r['exported']} trajectories, {r['token_rows']} token rows)")
    _print_changes(console, result["report"])
    console.print(f"\n[bold]Report:[/] [cyan]{result['report']['html']}[/]  (Markdown: {result['report']['markdown']})")
    console.print("[bold]Try:[/]")
    for q in _sql_hints(rid, warehouse):
        console.print(f"  {q}", soft_wrap=True, highlight=False, markup=False)


# ------------------------------------------------------------------------ flows ...
@flows_app.command("prepare")
def cmd_prepare(
    source: str = typer.Argument("smoke", help="Suite name, hub dataset (hf:name[:config][:split]), or file."),
    out: str = typer.Option(None, "--out", "-o", help="Task-set file to write (default: <warehouse>/tasksets/)."),
    limit: int = typer.Option(None, "--limit", help="At most this many tasks."),
    seed: int = typer.Option(None, "--seed", help="Seed for sources that sample."),
    mapping: str = typer.Option(
        None,
        "--mapping",
        help="Treat SOURCE as a (context, question, answer[, choices]) table: role=column,... "
        "(as `sandflow tasks prepare --mapping`).",
    ),
    warehouse: str = _WAREHOUSE,
    verbose: bool = _VERBOSE,
) -> None:
    """A source -> a task-set file (named by its content hash)."""
    r = _step("flows.prepare:prepare_flow", verbose, warehouse, source=source, out=out, limit=limit,
              seed=seed, mapping=mapping)  # fmt: skip
    c = _console()
    c.print(f"[green]{r['tasks']} tasks[/] -> {r['task_set']} (hash {short(c, r['hash'], 12)})")


@flows_app.command("run")
def cmd_run(
    task_set: str = typer.Argument("smoke", help="Task-set file or suite name."),
    model: str = typer.Option(None, "--model", "-m", help="Model name (default: SANDFLOW_MODEL)."),
    base_url: str = typer.Option(None, "--base-url", help="OpenAI-compatible endpoint; none: the embedded model."),
    mode: str = typer.Option("both", "--mode", help="sandbox | llm | both."),
    samples: int = _SAMPLES,
    concurrency: int = typer.Option(4, "--concurrency", "-c", min=1),
    max_sandboxes: int = _MAX_SANDBOXES,
    max_model_calls: int = _MAX_MODEL_CALLS,
    max_steps: int = typer.Option(DEFAULT_MAX_STEPS, "--max-steps", min=1),
    wall_clock_s: float = _WALL_CLOCK,
    network: str = network_option(),
    retries: int = typer.Option(2, "--retries", min=0, help="Retries of an episode after an infrastructure failure."),
    warehouse: str = _WAREHOUSE,
    durability: DurabilityChoice | None = durability_option(),
    run_id: str = _RESUME,
    task_runner: str = _TASK_RUNNER,
    dask_address: str = _DASK_ADDRESS,
    logprobs: bool = typer.Option(False, "--logprobs", help="Record completion logprobs (RL)."),
    token_ids: bool = typer.Option(False, "--token-ids", help="Record exact token ids (vLLM; RL)."),
    compact: bool = typer.Option(
        True, "--compact/--no-compact", help="Merge the run's per-episode files at its end (fast SQL)."
    ),
    wait: bool = _WAIT,
    prices: str = _PRICES,
    max_cost: float = _MAX_COST,
    max_run_tokens: int = _MAX_RUN_TOKENS,
    verbose: bool = _VERBOSE,
) -> None:
    """Run episodes (resumable): a task set x a model x mode x samples.

    One process per run id: a second `run --run-id R` while R runs is refused with the
    holder's pid, host and start time (or waits for it with --wait).
    """
    _isolate_from_terminal_signals()
    _quiet_prefect(verbose)
    from flows.run import run_flow

    s = _run_settings(model, base_url, warehouse, network, durability, prices)
    _check_run_free(str(s.warehouse), run_id, wait)
    spec = _run_spec(
        s, task_set=task_set, mode=mode, samples=samples, concurrency=concurrency,
        max_sandboxes=max_sandboxes, max_model_calls=max_model_calls, max_steps=max_steps,
        wall_clock_s=wall_clock_s, run_id=run_id, retries=retries, logprobs=logprobs,
        return_token_ids=token_ids, compact=compact, wait_for_lock=wait, max_cost_usd=max_cost,
        max_run_tokens=max_run_tokens,
    )  # fmt: skip
    _budget_priced(spec)
    runner = _runner(task_runner, concurrency, dask_address)
    r = _launch(run_flow.with_options(task_runner=runner), task_runner, dask_address, spec=spec)
    c = _console()
    c.print(
        f"[bold green]{r['run_id']}[/]: {r['succeeded']} recorded, {r['failed']} failed, {r['skipped']} skipped; "
        f"{r['elapsed_s']:.1f}s, {(r['episodes_per_s'] or 0):.2f} episodes/s; terminations {r['terminations']}"
    )
    for f in r["failures"][:10]:
        c.print(f"  [red]failed[/] {escape(f)}", soft_wrap=True, highlight=False)
    _print_compaction(c, r.get("compaction"))
    if task_runner in ("dask", "ray"):
        c.print(f"episodes ran in worker pids {r['worker_pids']}", highlight=False)
    _exit_if_all_failed(r)
    _exit_if_budget_spent(r)
    c.print(f"next: sandflow flows score --run-id {r['run_id']}")
    _exit_if_any_failed(r)


@flows_app.command("score")
def cmd_score(
    run_id: str = _RUN_ID,
    task_set: str = typer.Option(None, "--task-set", help="Default: the set the run recorded."),
    verifier: str = typer.Option(None, "--verifier", help="Re-score with this verifier (stored beside others)."),
    warehouse: str = _WAREHOUSE,
    verbose: bool = _VERBOSE,
) -> None:
    """Score a run's recorded answers (no episode is re-run)."""
    judge = _settings(warehouse=warehouse).judge_endpoint() if verifier == "judge" else None
    r = _step("flows.score:score_flow", verbose, warehouse, run_id=run_id, task_set=task_set,
              verifier=verifier, judge=judge)  # fmt: skip
    mean = "—" if r["mean_score"] is None else f"{r['mean_score']:.3f}"
    _console().print(f"scored {r['scored']} episodes of {run_id} ({r['verifier']}): mean {mean}")
    for p in r["problems"]:
        _console().print(f"  [yellow]{p}[/]")


@flows_app.command("usage")
def cmd_usage(
    run_id: str = typer.Option(None, "--run-id", "-r", help="The run to label."),
    rules: bool = typer.Option(False, "--rules", help="Print the labelling rules table and exit."),
    warehouse: str = _WAREHOUSE,
    verbose: bool = _VERBOSE,
) -> None:
    """Label each turn computation / file management / external resource / none; print rates."""
    if rules:
        from analysis.usage_rules import rules_table

        _console().print(_table(rules_table(), "Usage rules (first match wins per simple command)"))
        return
    if not run_id:
        _fail("--run-id is required (or --rules to print the rules)")
    r = _step("flows.usage:usage_flow", verbose, warehouse, run_id=run_id)
    _console().print(_table(r["rates"], f"Capability usage of {run_id} (% of sandbox turns)"))


@flows_app.command("tokens")
def cmd_tokens(run_id: str = _RUN_ID, warehouse: str = _WAREHOUSE, verbose: bool = _VERBOSE) -> None:
    """Tokens per episode by domain x mode, and the sandbox/LLM ratio."""
    r = _step("flows.tokens:tokens_flow", verbose, warehouse, run_id=run_id)
    _console().print(_table(r["summary"], f"Tokens of {run_id} (mean per episode)"))


@flows_app.command("rollouts")
def cmd_rollouts(
    run_id: str = _RUN_ID,
    out_dir: str = typer.Option(None, "--out", "-o", help="Default: <warehouse>/exports/<run_id>."),
    task_set: str = typer.Option(None, "--task-set"),
    max_seq_tokens: int = typer.Option(None, "--max-seq-tokens", help="Over-length limit of a whole trajectory."),
    overlong: str = typer.Option("drop", "--overlong", help="drop | mask (loss mask zeroed) | keep (flag only)."),
    verifier: str = typer.Option(None, "--verifier", help="Rewards from this verifier's scores."),
    warehouse: str = _WAREHOUSE,
    verbose: bool = _VERBOSE,
) -> None:
    """Export RL data: verl task rows, chat trajectories with advantages, token rows."""
    r = _step("flows.rollouts:rollouts_flow", verbose, warehouse, run_id=run_id, out_dir=out_dir,
              task_set=task_set, max_seq_tokens=max_seq_tokens, overlong=overlong, verifier=verifier)  # fmt: skip
    _console().print_json(json.dumps(r, default=str))


@flows_app.command("report")
def cmd_report(
    run_id: str = _RUN_ID,
    out_dir: str = typer.Option(None, "--out", "-o", help="Default: <warehouse>/reports/<run_id>."),
    warehouse: str = _WAREHOUSE,
    verbose: bool = _VERBOSE,
    viewer_url: str = typer.Option(
        "http://127.0.0.1:8765", "--viewer-url", envvar="SANDFLOW_VIEWER_URL",
        help="Base URL of `sandflow view`: the tables link to their episodes there ('' for none).",
    ),
) -> None:  # fmt: skip
    """Write report.html (self-contained, plots inline) and report.md; publish artifacts."""
    r = _step("flows.report:report_flow", verbose, warehouse, run_id=run_id, out_dir=out_dir,
              viewer_url=viewer_url)  # fmt: skip
    _console().print(f"report: [cyan]{r['html']}[/]\nmarkdown: {r['markdown']}")


def register(app: typer.Typer) -> None:
    """Add this room's commands to the main app."""
    app.command("bench")(bench)
    app.add_typer(flows_app, name="flows")
