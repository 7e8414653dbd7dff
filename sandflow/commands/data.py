"""`sandflow data ...`: RL training data from raw text (flows/data.py, datagen/, docs/data.md).

    sandflow data build CORPUS --out DIR      ingest -> synth -> clean -> calibrate -> export
    sandflow data ingest|synth|clean|calibrate|export --out DIR     one stage alone
    sandflow data funnel --out DIR            the build's funnel, stage by stage

Settings (flags > SANDFLOW_* > sandflow.toml) are resolved here and handed to the flows.
Everything the input decides is checked before any model is called (exit 2, one
sentence naming the file, flag or row).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from sandflow.errors import EXIT_FAILED, EXIT_USAGE, console, err_console, fail
from tasks.defaults import (
    DEFAULT_MAX_STEPS,
    DEFAULT_TEMPERATURE,
    DEFAULT_WALL_CLOCK_S,
    SYNTH_MAX_TOKENS,
)

data_app = typer.Typer(
    name="data",
    help=(
        "RL training data from raw general-domain text: a folder of documents (txt, md, html, "
        "pdf), a JSONL/Parquet text column or hf:NAME -> checked LIS-RL questions -> deduplicated, "
        "decontaminated -> calibrated in the sandbox -> verl rows, SFT JSONL, dataset card. "
        "docs/data.md."
    ),
    no_args_is_help=True,
)

_OUT = typer.Option(..., "--out", "-o", help="The build's folder (every stage reads and writes here).")
_WAREHOUSE = typer.Option(None, "--warehouse", "-w", help="Warehouse root (default: SANDFLOW_WAREHOUSE or ./warehouse_data).")
_BUILD_ID = typer.Option(None, "--build-id", help="Build id in the warehouse (default: data-<folder name>-<hash of its path>, kept in build.json).")
_MODEL = typer.Option(None, "--model", "-m", help="Model name (default: SANDFLOW_MODEL; the embedded model).")
_BASE_URL = typer.Option(None, "--base-url", help="OpenAI-compatible endpoint (default: SANDFLOW_BASE_URL; none: the embedded model).")
_VERBOSE = typer.Option(False, "--verbose", "-v", help="Show Prefect's own logs.")
_DOMAIN_HELP = ("The tasks' domain. LLM-in-Sandbox-RL's reward routes instruct_pretrain (the default: "
                "context-based questions), long_context, math, physics, chem, biomed and instruct_follow; "
                "a training step on a row of any other domain fails there.")
_DOMAIN = typer.Option("instruct_pretrain", "--domain", help=_DOMAIN_HELP)
_LIMIT = typer.Option(None, "--limit", help="At most this many documents.")
_MAX_STEPS = typer.Option(DEFAULT_MAX_STEPS, "--max-steps", min=1)
_DEPRECATED_DECONTAMINATE = typer.Option(None, "--decontaminate", hidden=True,
                                         help="Deprecated name of --decontaminate-against.")
_RETIRED_D = typer.Option(None, "-d", hidden=True, help="Retired: was --decontaminate (read like a domain).")


def _bad(msg: str) -> None:
    raise fail(msg, EXIT_USAGE)


def _check_out(out: str) -> None:
    p = Path(out)
    if p.exists() and not p.is_dir():
        _bad(f"--out {out!r} is a file; give a folder for the build")


def _check_corpus(corpus: str, text_column: str, piece_tokens: int) -> None:
    from datasets_prep.corpus import CorpusError, check_source

    if piece_tokens < 16:
        _bad(f"--piece-tokens {piece_tokens}: use at least 16")
    try:
        check_source(corpus)
    except CorpusError as e:
        _bad(str(e))
    if not text_column:
        _bad("--text-column is empty")


def _types(spec: str) -> list[str]:
    from datagen.questions import TYPES

    types = [t.strip() for t in spec.split(",") if t.strip()]
    bad = [t for t in types if t not in TYPES]
    if bad or not types:
        _bad(f"--types {spec!r}: use a comma list of {', '.join(TYPES)}")
    return types


def _check_synth(structured: str, template: str | None, questions: int) -> None:
    from datagen.synth import STRUCTURED, SynthConfigError, Template

    if structured not in (*STRUCTURED, "auto"):
        _bad(f"--structured {structured!r}: use auto or one of {', '.join(STRUCTURED)}")
    if questions < 1:
        _bad(f"--questions {questions}: use at least 1")
    try:
        Template.load(template)
    except SynthConfigError as e:
        _bad(str(e))


def _check_band(band: str) -> None:
    from datagen.calibrate import Band

    try:
        Band.parse(band)
    except ValueError as e:
        _bad(f"--band: {e}")


_DECONTAMINATE_FLAG = "--decontaminate-against"
_DECONTAMINATE_HELP = ("Evaluation sets whose questions must not be in the data (a suite, a task-set "
                       "file, hf:...; repeat or comma list). Not a domain: that is --domain.")


def _decontaminate(values: list[str] | None, deprecated: list[str] | None = None,
                   retired_d: list[str] | None = None) -> list[str]:
    """Each set named must load now (a suite, a task-set file, hf:...), before any model call.
    `deprecated`: the same sets given under the old name --decontaminate (its short form -d
    read like a domain: `-d math`; issue #36), still taken, with one line saying so."""
    from datasets_prep.prepare import load_taskset

    if retired_d:  # `-d math` meant "domain math" to some readers and decontaminated silently
        _bad(f"-d {retired_d[0]!r}: -d is no longer a flag; for evaluation sets to decontaminate "
             f"against use {_DECONTAMINATE_FLAG} {retired_d[0]}, for the tasks' domain --domain")
    if deprecated:
        err_console().print(
            f"note: --decontaminate is deprecated; use {_DECONTAMINATE_FLAG} (the same sets)",
            markup=False, highlight=False, soft_wrap=True)
    names = [n.strip() for v in [*(values or []), *(deprecated or [])] for n in v.split(",") if n.strip()]
    for name in names:
        try:
            load_taskset(name)
        except Exception as e:  # the loader's own sentence names the file or suite
            _bad(f"{_DECONTAMINATE_FLAG} {name!r}: {e}")
    return names


def _settings(**overrides: Any) -> Any:
    from sandflow.commands.pipeline import _settings as settings

    return settings(**overrides)


def _prep(verbose: bool) -> None:
    from sandflow.commands.pipeline import _quiet_prefect

    _quiet_prefect(verbose)


def _guard(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run a flow: the pipeline's errors as one sentence (exit 1; input errors exit 2)."""
    from datagen.budget import BudgetExhausted
    from datagen.build import BuildError
    from datagen.synth import SynthConfigError
    from datasets_prep.corpus import CorpusError
    from sandflow.commands.pipeline import _guard as guard
    from tasks.model import ModelError

    try:
        return guard(fn, *args, **kwargs)
    except (BuildError, CorpusError, SynthConfigError) as e:
        _bad(str(e))
    except (ModelError, BudgetExhausted) as e:
        raise fail(str(e), EXIT_FAILED) from None


def _show(reports: list[dict[str, Any]], out: str, build_id: str, warehouse: str) -> None:
    from rich.table import Table

    t = Table(title=f"data build {build_id} ({out})", title_justify="left")
    # a "reused" column only when a stage was reused: a column of nothing but blanks (and a
    # blank header) was printed on every first build (issue #36, "Small")
    reused = any(r.get("reused") for r in reports)
    columns = [("stage", "left"), ("in", "right"), ("out", "right"), ("dropped", "right"),
               ("dropped by reason", "left")] + ([("reused", "left")] if reused else [])
    for c, j in columns:
        t.add_column(c, justify=j)  # type: ignore[arg-type]
    for r in reports:
        reasons = ", ".join(f"{k}={v}" for k, v in sorted(r["dropped"].items(), key=lambda kv: (-kv[1], kv[0])))
        cells = [r["stage"], str(r["items_in"]), str(r["items_out"]), str(sum(r["dropped"].values())),
                 reasons or "-"]
        t.add_row(*cells, *(["reused" if r.get("reused") else "-"] if reused else []))
    con = console()
    con.print(t)
    for r in reports:
        for name, path in r.get("outputs", {}).items():
            con.print(f"  {r['stage']}: {name} -> {path}", markup=False, highlight=False, soft_wrap=True)
    for r in reports:  # what the export says about its rows: LIS-RL's routes, an empty build
        info = r.get("info") or {}
        lis_rl = info.get("lis_rl") or {}
        routes = [f"{d} ({v['rows']} rows): " + (f"routed, {v['route']}" if v["route"] else "NO ROUTE")
                  for d, v in lis_rl.get("domains", {}).items()]
        if routes:
            con.print("LLM-in-Sandbox-RL's reward: " + "; ".join(routes), markup=False, highlight=False,
                      soft_wrap=True)
        for key in ("warning", "empty"):
            text = lis_rl.get(key) if key == "warning" else info.get(key)
            if text:
                con.print(f"{key}: {text}", markup=False, highlight=False, soft_wrap=True)
    con.print(f'SQL: sandflow sql -w {warehouse} "SELECT * FROM data_funnel WHERE build_id = \'{build_id}\'"',
            markup=False, highlight=False, soft_wrap=True)


def _run(flow_name: str, where: tuple[str, str, str], *args: Any, verbose: bool,
         progress: str | None = None, **kwargs: Any) -> dict[str, Any]:
    """Run flows.data.<flow_name> (its errors as one sentence), with a progress display
    when it reports items; `where` = (out, build id, warehouse) for the summary table."""
    import contextlib

    _prep(verbose)
    from flows import data as data_flows
    from sandflow.commands.progress import RichEpisodeProgress

    display = RichEpisodeProgress(progress, console=console()) if progress else contextlib.nullcontext()
    with display:
        r = _guard(getattr(data_flows, flow_name), *args, **kwargs)
    reports = list(r["stages"].values()) if "stages" in r else [r]
    _show(reports, *where)
    return r


def _build_id(out: str, build_id: str | None) -> str:
    from datagen.build import Build, BuildError

    try:
        return Build(out, build_id=build_id).build_id
    except BuildError as e:
        _bad(str(e))
        raise


def _stage(out: str, build_id: str | None, **overrides: Any) -> tuple[Any, str, tuple[str, str, str]]:
    """A stage's settings (flags > SANDFLOW_* > sandflow.toml), its build id and where its
    summary table points (out, build id, warehouse): every command resolves them alike,
    after its own checks of the input."""
    s = _settings(**overrides)
    bid = _build_id(out, build_id)
    return s, bid, (out, bid, str(s.warehouse))


def _spec(s: Any, **flags: Any) -> Any:
    from sandflow.commands.pipeline import _run_spec

    try:
        return _run_spec(s, **flags)
    except ValueError as e:
        _bad(str(e))


@data_app.command("ingest")
def cmd_ingest(
    corpus: str = typer.Argument(..., help="A folder of documents, a table file with a text column, or hf:NAME[:CONFIG][@SPLIT]."),
    out: str = _OUT,
    warehouse: str = _WAREHOUSE,
    text_column: str = typer.Option("text", "--text-column", help="The text column of a table corpus."),
    piece_tokens: int = typer.Option(1024, "--piece-tokens", help="Token budget of a piece (estimated at 4 characters a token)."),
    max_doc_bytes: int = typer.Option(None, "--max-doc-bytes", help="Bigger documents are counted as oversized (default: SANDFLOW_MAX_FILE_BYTES)."),
    limit: int = _LIMIT,
    build_id: str = _BUILD_ID,
    verbose: bool = _VERBOSE,
) -> None:
    """Documents -> pieces with stable ids, sources and offsets; every unusable document counted."""
    _check_out(out)
    _check_corpus(corpus, text_column, piece_tokens)
    s, bid, where = _stage(out, build_id, warehouse=warehouse)
    _run("data_ingest_flow", where, corpus, out, str(s.warehouse), verbose=verbose,
         text_column=text_column, piece_tokens=piece_tokens, max_doc_bytes=max_doc_bytes, limit=limit,
         build_id=bid)


@data_app.command("synth")
def cmd_synth(
    out: str = _OUT,
    warehouse: str = _WAREHOUSE,
    model: str = _MODEL,
    base_url: str = _BASE_URL,
    questions: int = typer.Option(3, "--questions", "-n", help="Question slots per piece (the types taken in turn)."),
    types: str = typer.Option("single_choice,multi_choice,free_form", "--types", help="Question types, in turn."),
    structured: str = typer.Option("auto", "--structured", help="auto (json_schema; none for the embedded model) | json_schema (OpenAI, vLLM, llama.cpp) | json_object (llama-cpp-python) | guided_json (vLLM) | none."),
    concurrency: int = typer.Option(4, "--concurrency", "-c", min=1, help="Generator calls at once."),
    template: str = typer.Option(None, "--template", help="A prompt template file (default: datagen/templates/questions.v1.yaml)."),
    temperature: float = typer.Option(DEFAULT_TEMPERATURE, "--temperature"),
    max_tokens: int = typer.Option(SYNTH_MAX_TOKENS, "--max-tokens", min=16),
    domain: str = _DOMAIN,
    build_id: str = _BUILD_ID,
    verbose: bool = _VERBOSE,
) -> None:
    """Pieces -> checked questions of the three LIS-RL types (the generator's JSON validated)."""
    _check_out(out)
    type_list = _types(types)
    _check_synth(structured, template, questions)
    s, bid, where = _stage(out, build_id, warehouse=warehouse, model=model, base_url=base_url)
    _run("data_synth_flow", where, out, str(s.warehouse), verbose=verbose,
         progress="questions", model=s.model, base_url=s.base_url, questions=questions, types=type_list,
         structured=structured, concurrency=concurrency, template=template, temperature=temperature,
         max_tokens=max_tokens, domain=domain, build_id=bid)


@data_app.command("clean")
def cmd_clean(
    out: str = _OUT,
    warehouse: str = _WAREHOUSE,
    decontaminate: list[str] = typer.Option(None, _DECONTAMINATE_FLAG, help=_DECONTAMINATE_HELP),
    decontaminate_old: list[str] = _DEPRECATED_DECONTAMINATE,
    retired_d: list[str] = _RETIRED_D,
    ngram: int = typer.Option(13, "--ngram", min=1, help="Word n-gram overlap that counts as contamination."),
    threshold: float = typer.Option(0.8, "--threshold", min=0.01, max=1.0, help="Near-duplicate Jaccard threshold (MinHash)."),
    build_id: str = _BUILD_ID,
    verbose: bool = _VERBOSE,
) -> None:
    """Exact and near-duplicate questions removed; questions overlapping evaluation sets removed."""
    _check_out(out)
    sets = _decontaminate(decontaminate, decontaminate_old, retired_d)
    s, bid, where = _stage(out, build_id, warehouse=warehouse)
    _run("data_clean_flow", where, out, str(s.warehouse), verbose=verbose,
         decontaminate=sets, ngram=ngram, threshold=threshold, build_id=bid)


_SAMPLES = typer.Option(4, "--samples", "-k", min=1, help="Base-policy samples per candidate.")
_BAND = typer.Option("auto", "--band", help="Pass rates kept, LOW:HIGH (e.g. 0.2:0.8); auto: drop all-pass and all-fail.")


@data_app.command("calibrate")
def cmd_calibrate(
    out: str = _OUT,
    warehouse: str = _WAREHOUSE,
    model: str = _MODEL,
    base_url: str = _BASE_URL,
    samples: int = _SAMPLES,
    band: str = _BAND,
    concurrency: int = typer.Option(4, "--concurrency", "-c", min=1, help="Episodes at once."),
    max_steps: int = _MAX_STEPS,
    max_tokens: int = typer.Option(None, "--max-tokens", min=16),
    wall_clock_s: float = typer.Option(DEFAULT_WALL_CLOCK_S, "--wall-clock", help="Seconds per episode."),
    build_id: str = _BUILD_ID,
    verbose: bool = _VERBOSE,
) -> None:
    """The base policy k times per candidate in the sandbox; tasks in the pass-rate band kept."""
    _check_out(out)
    _check_band(band)
    s, bid, where = _stage(out, build_id, warehouse=warehouse, model=model, base_url=base_url)
    spec = _spec(s, mode="sandbox", concurrency=concurrency, max_steps=max_steps, wall_clock_s=wall_clock_s,
                 **({"max_tokens": max_tokens} if max_tokens else {}))
    _run("data_calibrate_flow", where, out, spec, verbose=verbose,
         progress="episodes", samples=samples, band=band, build_id=bid)


@data_app.command("export")
def cmd_export(
    out: str = _OUT,
    warehouse: str = _WAREHOUSE,
    build_id: str = _BUILD_ID,
    verbose: bool = _VERBOSE,
) -> None:
    """verl/rllm rows, the SFT set from passing trajectories, and the dataset card."""
    _check_out(out)
    s, bid, where = _stage(out, build_id, warehouse=warehouse)
    _run("data_export_flow", where, out, str(s.warehouse), verbose=verbose,
         build_id=bid)


@data_app.command("build")
def cmd_build(
    corpus: str = typer.Argument(..., help="A folder of documents, a table file with a text column, or hf:NAME."),
    out: str = _OUT,
    warehouse: str = _WAREHOUSE,
    model: str = _MODEL,
    base_url: str = _BASE_URL,
    questions: int = typer.Option(3, "--questions", "-n", help="Question slots per piece."),
    types: str = typer.Option("single_choice,multi_choice,free_form", "--types"),
    structured: str = typer.Option("auto", "--structured", help="auto | json_schema | json_object | guided_json | none."),
    template: str = typer.Option(None, "--template", help="A prompt template file."),
    text_column: str = typer.Option("text", "--text-column"),
    piece_tokens: int = typer.Option(1024, "--piece-tokens"),
    limit: int = _LIMIT,
    decontaminate: list[str] = typer.Option(None, _DECONTAMINATE_FLAG, help=_DECONTAMINATE_HELP),
    decontaminate_old: list[str] = _DEPRECATED_DECONTAMINATE,
    retired_d: list[str] = _RETIRED_D,
    samples: int = _SAMPLES,
    band: str = _BAND,
    calibrate: bool = typer.Option(True, "--calibrate/--no-calibrate", help="Run the base policy (needs the sandbox)."),
    concurrency: int = typer.Option(4, "--concurrency", "-c", min=1, help="Generator calls and episodes at once."),
    max_steps: int = _MAX_STEPS,
    max_tokens: int = typer.Option(SYNTH_MAX_TOKENS, "--max-tokens", min=16),
    domain: str = _DOMAIN,
    build_id: str = _BUILD_ID,
    prices: str = typer.Option(
        None, "--prices",
        help="Price table (JSON file or text; default SANDFLOW_PRICES or [prices] in sandflow.toml): "
        "prices the build's model calls for --max-cost, and the calibration run's cost. docs/cost.md.",
    ),
    max_cost: float = typer.Option(
        None, "--max-cost", min=0.0,
        help="The build's budget in USD (synthesis replies + calibration turns, resumes included; "
        "needs a price for the model): reached, the build stops cleanly; the same command with a "
        "higher budget finishes it.",
    ),
    max_run_tokens: int = typer.Option(
        None, "--max-run-tokens", min=1,
        help="The build's budget in tokens (prompt + completion of synthesis and calibration); as --max-cost.",
    ),
    verbose: bool = _VERBOSE,
) -> None:
    """The whole path: corpus -> pieces -> questions -> clean -> calibrated -> train data + card.

    [bold]Examples[/]
      sandflow data build ./docs_in --out ./rl_data --base-url http://gpu:8000/v1 --model Qwen3 --decontaminate-against math
      sandflow data build corpus.jsonl --text-column body --out ./rl_data -k 8 --band 0.2:0.8
    """
    _check_out(out)
    _check_corpus(corpus, text_column, piece_tokens)
    type_list = _types(types)
    _check_synth(structured, template, questions)
    _check_band(band)
    sets = _decontaminate(decontaminate, decontaminate_old, retired_d)
    from sandflow.commands.pipeline import _budget_priced, _prices

    s, bid, where = _stage(out, build_id, warehouse=warehouse, model=model, base_url=base_url, prices=_prices(prices))
    spec = _spec(s, mode="sandbox", concurrency=concurrency, max_steps=max_steps, max_tokens=max_tokens,
                 max_cost_usd=max_cost, max_run_tokens=max_run_tokens)
    _budget_priced(spec)
    _run("data_build_flow", where, corpus, out, spec, verbose=verbose,
         progress="questions, then episodes", questions=questions, types=type_list, structured=structured,
         synth_concurrency=concurrency, template=template, synth_max_tokens=max_tokens,
         text_column=text_column, piece_tokens=piece_tokens, limit=limit, decontaminate=sets,
         samples=samples, band=band, domain=domain, calibrate=calibrate, build_id=bid)


@data_app.command("funnel")
def cmd_funnel(
    out: str = _OUT,
    as_json: bool = typer.Option(False, "--json", help="Print the stage reports as JSON."),
) -> None:
    """The funnel of a build (from its folder: each stage's counts by reason)."""
    from datagen.build import STAGES, Build

    if not Path(out).is_dir():
        _bad(f"--out {out!r} is not a build folder")
    b = Build(out)
    reports = [r.as_dict() for st in STAGES if (r := b.report(st)) is not None]
    if as_json:
        typer.echo(json.dumps(reports, indent=1, default=str))
        return
    from sandflow.config import settings_warehouse

    _show(reports, out, b.build_id, str(settings_warehouse()))


def register(app: typer.Typer) -> None:
    app.add_typer(data_app, name="data", rich_help_panel="Data")
