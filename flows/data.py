"""RL data from raw text as Prefect flows: ingest, synth, clean, calibrate, export, build.

Each stage is its own flow (re-runnable alone: `sandflow data ingest|synth|clean|
calibrate|export`), and `data_build_flow` runs them in order as subflows; the work is
datagen.build.Build's (one output folder, stages keyed by content hashes, every item
recorded in the warehouse's data_items). Progress goes through engine/progress.py like a
run's episodes: synthesis reports each question slot, calibration each episode.

Calibration runs the base policy through the run engine as a library call
(datagen.calibrate.engine_policy: engine.run, then each task's verifier; resumable by
run id): the calibrate flow only hands it the spec and the warehouse.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow

from datagen.budget import BudgetExhausted, BuildBudget
from datagen.build import Build, BuildError
from datagen.calibrate import Band, PolicyRunner, engine_policy
from datagen.questions import TYPES
from datagen.synth import SlotOutcome, resolve_structured
from datasets_prep.rows import LIS_RL_DEFAULT_DOMAIN
from engine import progress
from tasks.defaults import DEFAULT_REQUEST_TIMEOUT_S, DEFAULT_TEMPERATURE, SYNTH_MAX_TOKENS
from tasks.model import ModelConfig, api_key_from_env
from tasks.pricing import load_prices
from tasks.spec import RunSpec, build_run_spec
from warehouse import DEFAULT_ROOT, Warehouse
from warehouse.rundata import RunData


def base_policy(spec: RunSpec) -> PolicyRunner:
    """The base policy of `spec` through the run engine, recorded in the spec's warehouse
    (a calibration run stopped by the build's budget: BudgetExhausted, nothing graded)."""
    return engine_policy(spec, spec.recording.warehouse or DEFAULT_ROOT)


def _synth_progress(total: int, build_id: str) -> Any:
    progress.planned(total=total, skipped=0, run_id=build_id)

    def on(o: SlotOutcome) -> None:
        progress.finished(o.slot_id, ok=o.kept, termination=o.reason or "kept")

    return on


@flow(name="sandflow-data-ingest", log_prints=False)
def data_ingest_flow(corpus: str, out: str, warehouse: str = DEFAULT_ROOT, text_column: str = "text",
                     piece_tokens: int = 1024, max_doc_bytes: int | None = None,
                     limit: int | None = None, build_id: str | None = None) -> dict[str, Any]:
    b = Build(out, warehouse=warehouse, build_id=build_id)
    return b.ingest(corpus, text_column=text_column, piece_tokens=piece_tokens,
                    max_doc_bytes=max_doc_bytes, limit=limit).as_dict()


@flow(name="sandflow-data-synth", log_prints=False)
def data_synth_flow(out: str, warehouse: str = DEFAULT_ROOT, model: str | None = None,
                    base_url: str | None = None, questions: int = 3, types: list[str] | None = None,
                    structured: str = "auto", concurrency: int = 4, template: str | None = None,
                    temperature: float = DEFAULT_TEMPERATURE, max_tokens: int = SYNTH_MAX_TOKENS,
                    domain: str = LIS_RL_DEFAULT_DOMAIN, request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S, build_id: str | None = None,
                    max_cost_usd: float | None = None, max_run_tokens: int | None = None,
                    prices: dict[str, Any] | None = None) -> dict[str, Any]:
    """Questions from the pieces; no base_url: the embedded model, started for the stage.
    With a budget (datagen.budget; `prices` a tasks.pricing table), the build's paid replies
    count; spent: BudgetExhausted. The result's `budget` says what synthesis spent in all."""
    from tasks.local_model import endpoint
    from tasks.model import preflight

    b = Build(out, warehouse=warehouse, build_id=build_id)
    types = list(types or TYPES)
    pieces = len(b.pieces())
    cfg = ModelConfig(model=model or "default", base_url=base_url, api_key=api_key_from_env(),
                      temperature=temperature, max_tokens=max_tokens, request_timeout_s=request_timeout_s)
    structured = resolve_structured(structured, embedded=not base_url)
    if not base_url:  # the embedded server answers one request at a time: queue here
        concurrency = 1
    budget = BuildBudget(max_cost_usd, max_run_tokens,
                         load_prices(prices or None).lookup(cfg.model, base_url))
    if max_cost_usd is not None and budget.price is None:
        raise BuildError(f"--max-cost {max_cost_usd:g}: the price table has no price for model "
                              f"{cfg.model!r} (at {base_url}); add it with --prices (docs/cost.md)")
    with endpoint(cfg) as live:
        live = preflight(live, model_given=bool(model) or not base_url)
        report = b.synth(live, n=questions, types=types, structured=structured, concurrency=concurrency,
                         template=template, domain=domain,
                         progress=_synth_progress(pieces * questions, b.build_id),
                         budget=budget if budget.active else None).as_dict()
    if budget.active:
        report["budget"] = budget.summary()
    return report


@flow(name="sandflow-data-clean", log_prints=False)
def data_clean_flow(out: str, warehouse: str = DEFAULT_ROOT, decontaminate: list[str] | None = None,
                    ngram: int = 13, threshold: float = 0.8, build_id: str | None = None) -> dict[str, Any]:
    b = Build(out, warehouse=warehouse, build_id=build_id)
    return b.clean(decontaminate=decontaminate or [], ngram=ngram, threshold=threshold).as_dict()


@flow(name="sandflow-data-calibrate", log_prints=False)
def data_calibrate_flow(out: str, spec: RunSpec, samples: int = 4, band: str = "auto",
                        pass_score: float = 1.0, build_id: str | None = None) -> dict[str, Any]:
    """The base policy (spec: model, sandbox, limits, warehouse) k times per candidate."""
    b = Build(out, warehouse=spec.recording.warehouse or DEFAULT_ROOT, build_id=build_id)
    return b.calibrate(base_policy(spec), samples=samples, band=Band.parse(band), pass_score=pass_score,
                       policy_model=spec.endpoint.model or "(embedded)").as_dict()


@flow(name="sandflow-data-export", log_prints=False)
def data_export_flow(out: str, warehouse: str = DEFAULT_ROOT, pass_score: float = 1.0,
                     build_id: str | None = None) -> dict[str, Any]:
    wh = Warehouse(warehouse)
    b = Build(out, warehouse=warehouse, build_id=build_id)

    def runs(run_id: str) -> RunData:
        return wh.load_run(run_id)

    return b.export(runs=runs, pass_score=pass_score).as_dict()


def _calibration_budget(spec: RunSpec, synth: dict[str, Any]) -> RunSpec:
    """The calibration run's budget: what synthesis left of the build's (datagen.budget).
    Nothing left: the build stops here (BudgetExhausted)."""
    spent = synth.get("budget")
    if not spent:
        return spec
    b = BuildBudget(spec.budget.max_cost_usd, spec.budget.max_run_tokens, spent_tokens=int(spent["spent_tokens"]),
                    spent_usd=float(spent.get("spent_usd") or 0.0))
    reason = b.exceeded()
    if reason is not None:
        raise BudgetExhausted(f"the build stopped before calibration: {reason}. Resume with a "
                              "higher budget: the same command and --out")
    usd, tokens = b.left()
    return spec.replace(max_cost_usd=usd, max_run_tokens=tokens)


@flow(name="sandflow-data-build", log_prints=False)
def data_build_flow(corpus: str, out: str, spec: RunSpec, questions: int = 3,
                    types: list[str] | None = None, structured: str = "auto",
                    synth_concurrency: int = 4, template: str | None = None,
                    synth_temperature: float = DEFAULT_TEMPERATURE, synth_max_tokens: int = SYNTH_MAX_TOKENS,
                    text_column: str = "text", piece_tokens: int = 1024, limit: int | None = None,
                    decontaminate: list[str] | None = None, samples: int = 4, band: str = "auto",
                    domain: str = LIS_RL_DEFAULT_DOMAIN, calibrate: bool = True,
                    build_id: str | None = None) -> dict[str, Any]:
    """corpus -> pieces -> questions -> clean -> calibrated -> train/SFT/card, in `out`.
    The generator is the spec's endpoint (the same model writes and, as the base policy,
    calibrates; pass another spec to data_calibrate_flow for a different policy).
    `calibrate=False` exports the clean candidates without a pass-rate band."""
    wh = spec.recording.warehouse or DEFAULT_ROOT
    stages: dict[str, Any] = {}
    stages["ingest"] = data_ingest_flow(corpus, out, wh, text_column=text_column, piece_tokens=piece_tokens,
                                        limit=limit, build_id=build_id)
    stages["synth"] = data_synth_flow(out, wh, model=spec.endpoint.model, base_url=spec.endpoint.base_url, questions=questions,
                                      types=types, structured=structured, concurrency=synth_concurrency,
                                      template=template, temperature=synth_temperature,
                                      max_tokens=synth_max_tokens, domain=domain, build_id=build_id,
                                      request_timeout_s=spec.endpoint.request_timeout_s,
                                      max_cost_usd=spec.budget.max_cost_usd, max_run_tokens=spec.budget.max_run_tokens,
                                      prices=spec.budget.prices)
    stages["clean"] = data_clean_flow(out, wh, decontaminate=decontaminate, build_id=build_id)
    if calibrate:
        stages["calibrate"] = data_calibrate_flow(out, _calibration_budget(spec, stages["synth"]),
                                                  samples=samples, band=band, build_id=build_id)
    else:
        Build(out, warehouse=wh, build_id=build_id).skip_calibration()
    stages["export"] = data_export_flow(out, wh, build_id=build_id)
    return {"out": str(Path(out)), "build_id": Build(out, build_id=build_id).build_id, "stages": stages}


@flow(name="sandflow-data-build", log_prints=False)
def data_build_job(
    corpus: str,
    out: str,
    warehouse: str = DEFAULT_ROOT,
    model: str | None = None,
    base_url: str | None = None,
    questions: int = 3,
    samples: int = 4,
    band: str = "auto",
    decontaminate: list[str] | None = None,
    concurrency: int = 4,
    max_steps: int | None = None,
    max_tokens: int = SYNTH_MAX_TOKENS,
    calibrate: bool = True,
    build_id: str | None = None,
    prices: dict[str, Any] | None = None,
    max_cost_usd: float | None = None,
    max_run_tokens: int | None = None,
) -> dict[str, Any]:
    """The deployment's entry (prefect.yaml `data-build`): plain parameters (Prefect stores
    them; the endpoint's key comes from the worker's SANDFLOW_API_KEY, never from here).
    `max_cost_usd` / `max_run_tokens`: the build's budget (datagen.budget), priced by `prices`."""
    spec = build_run_spec(model=model, base_url=base_url, warehouse=warehouse, mode="sandbox",
                          concurrency=concurrency, max_steps=max_steps, max_tokens=max_tokens,
                          prices=prices, max_cost_usd=max_cost_usd, max_run_tokens=max_run_tokens)
    return data_build_flow(corpus, out, spec, questions=questions, synth_concurrency=concurrency,
                           synth_max_tokens=max_tokens, decontaminate=decontaminate, samples=samples,
                           band=band, calibrate=calibrate, build_id=build_id)
