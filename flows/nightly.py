"""The nightly benchmark as ONE flow: prepare -> run (both modes) -> score -> usage ->
tokens -> rollouts -> report. Each step is a subflow, so the Prefect UI shows them
as one tree and a failed step is visible by name. Re-running with the same run id
resumes the run step (finished episodes are skipped) and redoes the cheap steps.

`benchmark_flow(spec)` is what `sandflow bench` runs: the command builds the RunSpec.
`nightly_flow` and `rl_data_flow` are the deployments of prefect.yaml: a scheduler fills
their flat parameters (the knobs a schedule may set; None: the run part's default,
tasks/spec.py), which they turn into the same RunSpec once (tasks.spec.build_run_spec).
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from analysis.report import DEFAULT_VIEWER_URL
from datasets_prep.verifiers import JudgeEndpoint
from flows.prepare import prepare_flow
from flows.report import report_flow
from flows.rollouts import rollouts_flow
from flows.run import make_task_runner, run_flow
from flows.score import score_flow
from flows.tokens import tokens_flow
from flows.usage import usage_flow
from tasks.defaults import RL_TEMPERATURE
from tasks.spec import RunSpec, build_run_spec
from warehouse import DEFAULT_ROOT


def _run(spec: RunSpec, task_runner: str, dask_address: str | None) -> tuple[dict[str, Any], dict[str, Any], str]:
    """prepare + run; returns both summaries and the prepared task-set file."""
    warehouse = spec.recording.warehouse or DEFAULT_ROOT
    prep = prepare_flow(source=spec.task_set, warehouse=warehouse)
    runner = make_task_runner(task_runner, spec.fanout.concurrency, dask_address)
    run = run_flow.with_options(task_runner=runner)(
        spec.replace(task_set=prep["task_set"], warehouse=warehouse)
    )
    return prep, run, prep["task_set"]


def benchmark(
    spec: RunSpec,
    task_runner: str = "thread",
    dask_address: str | None = None,
    verifier: str | None = None,
    judge: JudgeEndpoint | None = None,
    max_seq_tokens: int | None = None,
    rollouts: bool = True,
    fail_on_regression: bool = False,
    alpha: float = 0.05,
    viewer_url: str | None = DEFAULT_VIEWER_URL,
    max_cost_increase: float | None = None,
) -> dict[str, Any]:
    """The benchmark's steps (inside a flow); returns every step's summary.

    The run joins the series `spec.recording.series` of its task set and model; the report compares
    it with the series' previous run. With `fail_on_regression`, a significant drop
    (Holm-adjusted p < `alpha`), or a rise of cost per task above `max_cost_increase` %
    (docs/cost.md), fails the flow run with RegressionFound once the report is written.
    """
    prep, run, _ = _run(spec, task_runner, dask_address)
    rid, warehouse = run["run_id"], run["warehouse"]
    out: dict[str, Any] = {"prepare": prep, "run": run}
    # score and export with the tasks the run recorded (warehouse.tasksets), not a reload
    out["score"] = score_flow(run_id=rid, warehouse=warehouse, verifier=verifier, judge=judge)
    out["usage"] = usage_flow(run_id=rid, warehouse=warehouse)
    out["tokens"] = tokens_flow(run_id=rid, warehouse=warehouse)
    if rollouts:
        out["rollouts"] = rollouts_flow(run_id=rid, warehouse=warehouse, max_seq_tokens=max_seq_tokens)
    out["report"] = report_flow(
        run_id=rid, warehouse=warehouse, alpha=alpha, viewer_url=viewer_url,
        max_cost_increase=max_cost_increase,
    )
    if fail_on_regression and out["report"].get("regression"):
        from analysis.nightly_report import RegressionFound

        raise RegressionFound(f"run {rid}: {out['report']['regression']}", out)
    return out


def _check_priced(spec: RunSpec) -> None:
    """A deployment's --max-cost needs a price for its model: refused before any work
    (engine.budget.check_priced, RunConfigError naming both)."""
    if spec.endpoint.model:
        from engine.budget import check_priced

        check_priced(spec)


def _deployment_name() -> str | None:
    """The Prefect deployment running this flow (its name is the series), if any."""
    from prefect.runtime import deployment

    name = deployment.name
    return str(name) if name else None


# The flow `sandflow bench` runs is `benchmark` itself: one signature, one body.
benchmark_flow = flow(
    name="sandflow-nightly", log_prints=False,
    description="Benchmark a model on a task source end to end (`sandflow bench`).",
)(benchmark)


@flow(name="sandflow-nightly", log_prints=False)
def nightly_flow(
    source: str = "smoke",
    model: str | None = None,
    base_url: str | None = None,
    mode: str | None = None,
    samples: int | None = None,
    concurrency: int | None = None,
    max_sandboxes: int | None = None,
    max_model_calls: int | None = None,
    max_steps: int | None = None,
    temperature: float | None = None,
    max_tokens: int | None = None,
    wall_clock_s: float | None = None,
    warehouse: str = DEFAULT_ROOT,
    run_id: str | None = None,
    task_runner: str = "thread",
    dask_address: str | None = None,
    network: str | None = None,
    verifier: str | None = None,
    max_seq_tokens: int | None = None,
    rollouts: bool = True,
    request_timeout_s: float | None = None,
    series: str | None = None,
    fail_on_regression: bool = False,
    alpha: float = 0.05,
    viewer_url: str | None = DEFAULT_VIEWER_URL,  # the report's links into `sandflow view`
    wait_for_lock: bool | float = False,  # another process runs run_id: wait (not refuse)
    max_cost_increase: float | None = None,  # % rise of cost per task that fails (docs/cost.md)
    prices: dict[str, Any] | None = None,  # tasks.pricing table: the run records it (run_cost)
    max_cost_usd: float | None = None,  # the run's budget (engine.budget; needs `prices`)
    max_run_tokens: int | None = None,  # the run's token budget
) -> dict[str, Any]:
    """The nightly deployment: benchmark a model on a task source end to end. The run joins
    the series `series` (default: the deployment's name; ad hoc without one)."""
    spec = build_run_spec(
        task_set=source,
        model=model,
        base_url=base_url,
        mode=mode,
        samples=samples,
        concurrency=concurrency,
        max_sandboxes=max_sandboxes,
        max_model_calls=max_model_calls,
        max_steps=max_steps,
        temperature=temperature,
        max_tokens=max_tokens,
        wall_clock_s=wall_clock_s,
        warehouse=warehouse,
        run_id=run_id,
        network=network,
        request_timeout_s=request_timeout_s,
        series=series or _deployment_name(),
        wait_for_lock=wait_for_lock,
        prices=prices,
        max_cost_usd=max_cost_usd,
        max_run_tokens=max_run_tokens,
    )
    _check_priced(spec)
    return benchmark(
        spec,
        task_runner=task_runner,
        dask_address=dask_address,
        verifier=verifier,
        max_seq_tokens=max_seq_tokens,
        rollouts=rollouts,
        fail_on_regression=fail_on_regression,
        alpha=alpha,
        viewer_url=viewer_url,
        max_cost_increase=max_cost_increase,
    )


@flow(name="sandflow-rl-data", log_prints=False)
def rl_data_flow(
    source: str = "smoke",
    model: str | None = None,
    base_url: str | None = None,
    samples: int = 8,  # k samples per task: the group of RLOO/GRPO advantages
    concurrency: int | None = None,
    max_sandboxes: int | None = None,
    max_model_calls: int | None = None,
    max_steps: int | None = None,
    temperature: float = RL_TEMPERATURE,
    max_tokens: int | None = None,
    warehouse: str = DEFAULT_ROOT,
    run_id: str | None = None,
    task_runner: str = "thread",
    dask_address: str | None = None,
    max_seq_tokens: int | None = 32768,
    logprobs: bool = False,
    return_token_ids: bool = False,
    prices: dict[str, Any] | None = None,
    max_cost_usd: float | None = None,
    max_run_tokens: int | None = None,
) -> dict[str, Any]:
    """LLM-in-Sandbox-RL data: sandbox mode, k samples per task at temperature 1.0,
    scored, exported with group advantages (RLOO, as the paper; GRPO beside it)."""
    spec = build_run_spec(
        task_set=source,
        model=model,
        base_url=base_url,
        mode="sandbox",
        samples=samples,
        concurrency=concurrency,
        max_sandboxes=max_sandboxes,
        max_model_calls=max_model_calls,
        max_steps=max_steps,
        temperature=temperature,
        max_tokens=max_tokens,
        warehouse=warehouse,
        run_id=run_id,
        logprobs=logprobs,
        return_token_ids=return_token_ids,
        prices=prices,
        max_cost_usd=max_cost_usd,
        max_run_tokens=max_run_tokens,
    )
    _check_priced(spec)
    prep, run, _ = _run(spec, task_runner, dask_address)
    rid = run["run_id"]
    score = score_flow(run_id=rid, warehouse=warehouse)  # the tasks the run recorded
    export = rollouts_flow(run_id=rid, warehouse=warehouse, max_seq_tokens=max_seq_tokens)
    return {"prepare": prep, "run": run, "score": score, "rollouts": export}
