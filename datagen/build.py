"""The stages of an RL data build over one output folder, each re-runnable and recorded.

    <out>/build.json               the build id (the warehouse's run_id of its data_items)
    <out>/pieces.parquet           ingest: pieces with document id, source, offsets
    <out>/candidates.parquet       synth: checked questions as a task set (provenance in metadata)
    <out>/clean.parquet            clean: without duplicates and contaminated questions
    <out>/calibrated.parquet       calibrate: the tasks in the pass-rate band, with their rates
    <out>/train.parquet, sft.jsonl, README.md     export
    <out>/stages/<stage>.json      each stage's key, counts by reason, outputs, what it used
    <out>/cache/synth.jsonl        the generator's replies by request hash

A stage's key is a hash of its input file and its parameters. Running a stage again with
the same key reuses its output (nothing is recomputed, no model is called); with another
key it runs, and synthesis still reuses every cached reply. Every run of a stage records
its items (kept, or dropped with a reason) in the warehouse (`data_items`; views
data_funnel, data_dropped, task_provenance).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from datagen.budget import TERMINATION as BUDGET_EXHAUSTED
from datagen.budget import BudgetExhausted, BuildBudget
from datagen.calibrate import Band, PolicyRunner, pass_rates, select
from datagen.export import (
    UNSCORABLE,
    dataset_card,
    lis_rl_summary,
    sft_rows,
    write_jsonl,
    write_train,
)
from datagen.questions import TYPES
from datagen.synth import ReplyCache, SlotOutcome, Template, pieces_by_id, question_task, synthesize
from datasets_prep.corpus import Piece, ingest, reasons_count
from datasets_prep.dedup import DEFAULT_NGRAM, DEFAULT_THRESHOLD, Contamination, dedup
from datasets_prep.io import read_taskset, write_taskset
from datasets_prep.rows import LIS_RL_DEFAULT_DOMAIN
from datasets_prep.task import Task, TaskSet
from tasks.model import ModelConfig
from warehouse import Warehouse

STAGES = ("ingest", "synth", "clean", "calibrate", "export")
STAGE_INPUT = {"synth": "pieces.parquet", "clean": "candidates.parquet",
               "calibrate": "clean.parquet", "export": "calibrated.parquet"}
PIECES_SCHEMA = pa.schema([
    pa.field("piece_id", pa.string()), pa.field("doc_id", pa.string()), pa.field("source", pa.string()),
    pa.field("start", pa.int64()), pa.field("end", pa.int64()), pa.field("tokens", pa.int64()),
    pa.field("text", pa.string()),
])  # fmt: skip


class BuildError(ValueError):
    """A stage cannot run as asked (its input is missing, a parameter is wrong): one
    sentence naming the file or parameter, before any model call."""


@dataclass
class StageReport:
    stage: str
    key: str
    items_in: int
    items_out: int
    dropped: dict[str, int]
    outputs: dict[str, str] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    reused: bool = False
    finished_at: str = ""

    @property
    def consistent(self) -> bool:
        return self.items_in == self.items_out + sum(self.dropped.values())

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "consistent": self.consistent}


def _hash_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def build_id_for(out: Path) -> str:
    """A build id from the folder's name and a hash of its absolute path, safe as a warehouse
    run id. The name alone gave /x/a/rl_data and /x/b/rl_data one id, and in a shared
    warehouse the second build silently replaced the first's funnel and provenance (issue
    #37); the id is recorded in build.json, so a moved folder keeps its id."""
    where = out.expanduser().resolve()
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", where.name).strip("-._") or "build"
    digest = hashlib.sha256(str(where).encode("utf-8", "surrogateescape")).hexdigest()[:8]
    return f"data-{name[:80]}-{digest}"


class Build:
    """One output folder; every stage reads the previous stage's file in it."""

    def __init__(self, out: str | Path, *, warehouse: str | Path | None = None,
                 build_id: str | None = None) -> None:
        self.out = Path(out).expanduser()
        self.wh = Warehouse(warehouse) if warehouse is not None else None
        meta = self.out / "build.json"
        recorded = json.loads(meta.read_text()) if meta.is_file() else {}
        self.build_id = build_id or recorded.get("build_id") or build_id_for(self.out)
        from warehouse.schema import check_run_id

        try:
            check_run_id(self.build_id)
        except ValueError as e:
            raise BuildError(f"build id: {e}") from None
        if self.wh is not None:
            try:
                self.wh.claim_build(self.build_id, self.out,
                                    moved=recorded.get("build_id") == self.build_id)
            except ValueError as e:
                raise BuildError(str(e)) from None
        if recorded.get("build_id") != self.build_id:
            self.out.mkdir(parents=True, exist_ok=True)
            meta.write_text(json.dumps({"build_id": self.build_id}) + "\n")

    def path(self, name: str) -> Path:
        return self.out / name

    def stage_file(self, stage: str) -> Path:
        return self.out / "stages" / f"{stage}.json"

    def report(self, stage: str) -> StageReport | None:
        p = self.stage_file(stage)
        if not p.is_file():
            return None
        d = json.loads(p.read_text())
        d.pop("consistent", None)
        return StageReport(**d)

    def input_of(self, stage: str) -> Path:
        p = self.path(STAGE_INPUT[stage])
        if not p.is_file():
            before = STAGES[STAGES.index(stage) - 1]
            raise BuildError(f"{stage}: {str(p)!r} does not exist; run the {before} stage first "
                             f"(`sandflow data {before} ... --out {self.out}`)")
        return p

    def _reusable(self, stage: str, key: str) -> StageReport | None:
        old = self.report(stage)
        if old is None or old.key != key or not all(Path(p).exists() for p in old.outputs.values()):
            return None
        old.reused = True
        return old

    def _finish(self, report: StageReport, items: Sequence[Mapping[str, Any]]) -> StageReport:
        report.finished_at = datetime.now(UTC).isoformat(timespec="seconds")
        if len(items) != report.items_in:  # the funnel's own check: every item has one row
            raise AssertionError(f"{report.stage}: {len(items)} item rows for {report.items_in} items")
        if self.wh is not None:
            self.wh.write_data_items(self.build_id, report.stage, items, stage_key=report.key)
        p = self.stage_file(report.stage)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.tmp")
        tmp.write_text(json.dumps(report.as_dict(), indent=1, default=str) + "\n")
        tmp.replace(p)
        return report

    # ------------------------------------------------------------------------ stages
    def ingest(self, corpus: str, *, text_column: str = "text", piece_tokens: int = 1024,
               max_doc_bytes: int | None = None, limit: int | None = None,
               progress: Callable[[int], None] | None = None) -> StageReport:
        res = ingest(corpus, text_column=text_column, piece_tokens=piece_tokens,
                     max_doc_bytes=max_doc_bytes, limit=limit, progress=progress)
        self.out.mkdir(parents=True, exist_ok=True)
        out = self.path("pieces.parquet")
        table = pa.Table.from_pylist([asdict(p) for p in res.pieces], schema=PIECES_SCHEMA)
        tmp = out.with_name(".pieces.parquet.tmp")
        pq.write_table(table, tmp, compression="zstd")
        tmp.replace(out)
        key = _key("ingest", _hash_file(out))
        items = [{"item_id": d.source, "kept": True, "doc_id": d.doc_id, "source": d.source}
                 for d in res.documents]
        items += [{"item_id": r.source, "kept": False, "reason": r.reason, "detail": r.detail,
                   "source": r.source} for r in res.rejected]
        report = StageReport("ingest", key, res.seen, len(res.documents), reasons_count(res.rejected),
                             {"pieces": str(out)},
                             {"corpus": corpus, "pieces": len(res.pieces), "piece_tokens": piece_tokens,
                              "text_column": text_column, "boilerplate": res.boilerplate})
        return self._finish(report, items)

    def pieces(self) -> list[Piece]:
        table = pq.read_table(self.input_of("synth"))
        return [Piece(**r) for r in table.to_pylist()]

    def synth(self, cfg: ModelConfig, *, n: int = 3, types: Sequence[str] = TYPES,
              structured: str = "json_schema", concurrency: int = 4, template: str | None = None,
              domain: str = LIS_RL_DEFAULT_DOMAIN, progress: Callable[[SlotOutcome], None] | None = None,
              budget: BuildBudget | None = None) -> StageReport:
        """`budget` (datagen.budget): counts every reply the build's cache holds, then each
        new one; spent, the stage stops unfinished with BudgetExhausted."""
        src = self.input_of("synth")
        tpl = Template.load(template)
        key = _key("synth", _hash_file(src), cfg.model, tpl.version, n, list(types), structured,
                   cfg.temperature, cfg.top_p, cfg.max_tokens, domain)
        cache = ReplyCache(self.path("cache/synth.jsonl"))
        if budget is not None:
            budget.add_rows(cache.rows())  # what the build paid for before (resumes included)
        reused = self._reusable("synth", key)
        if reused is not None:
            cache.close()
            return reused
        pieces = self.pieces()
        res = synthesize(pieces, cfg, n=n, types=types, template=tpl, structured=structured,
                         concurrency=concurrency, cache=cache, progress=progress, budget=budget)
        stopped = sum(1 for o in res.outcomes if o.reason == BUDGET_EXHAUSTED)
        if stopped:  # not finished: no stage record, so the next run does it (cached replies free)
            raise BudgetExhausted(
                f"synth stopped on the build's budget: {budget.exceeded() if budget else ''}; "
                f"{stopped} of {len(res.outcomes)} question slots not asked. Resume with a higher "
                f"budget: the same command and --out {self.out}"
            )
        by_id = pieces_by_id(pieces)
        tasks: dict[str, Task] = {}
        items: list[dict[str, Any]] = []
        dropped: Counter[str] = Counter()
        for o in res.outcomes:
            p = by_id[o.piece_id]
            row: dict[str, Any] = {
                "item_id": o.slot_id, "kept": o.kept, "reason": o.reason, "detail": o.detail,
                "doc_id": p.doc_id, "piece_id": p.piece_id, "source": p.source,
                "span_start": p.start, "span_end": p.end, "generator_model": cfg.model,
                "prompt_version": tpl.version, "prompt_tokens": o.prompt_tokens,
                "completion_tokens": o.completion_tokens,
            }
            if o.question is not None:
                t = question_task(o.question, p, model=cfg.model, template_version=tpl.version,
                                  build_id=self.build_id, domain=domain)
                t.metadata["provenance"]["tokens"] = [o.prompt_tokens, o.completion_tokens]
                if t.id in tasks:  # the same question of the same piece: keep one task id
                    row.update(kept=False, reason="same_question", detail=f"same as {t.id}")
                else:
                    tasks[t.id] = t
                row.update(task_id=t.id, qa_type=t.qa_type)
            if not row["kept"]:
                dropped[row["reason"]] += 1
            items.append(row)
        out = self.path("candidates.parquet")
        write_taskset(TaskSet.build(tasks.values(), name=f"{self.build_id}-candidates",
                                    source=str(src)), out)
        report = StageReport(
            "synth", key, len(items), len(tasks), dict(dropped), {"candidates": str(out)},
            {"generator_model": cfg.model, "prompt_version": tpl.version, "structured_output": structured,
             "questions_per_piece": n, "types": list(types), "calls": res.calls,
             "cache_hits": res.cache_hits, "seconds": round(res.seconds, 3),
             "synth_tokens": f"{res.prompt_tokens} / {res.completion_tokens}",
             "prompt_tokens": res.prompt_tokens, "completion_tokens": res.completion_tokens},
        )
        return self._finish(report, items)

    def clean(self, *, decontaminate: Sequence[str] = (), ngram: int = DEFAULT_NGRAM,
              threshold: float = DEFAULT_THRESHOLD, near: bool = True) -> StageReport:
        from datasets_prep.prepare import load_taskset

        src = self.input_of("clean")
        ts = read_taskset(src)
        contamination = Contamination(ngram)
        set_hashes = []
        for name in decontaminate:
            try:
                ev = load_taskset(name)
            except Exception as e:
                raise BuildError(f"clean: decontamination set {name!r} cannot be loaded: {e}") from None
            contamination.add(name, (_task_text(t) for t in ev.tasks))
            set_hashes.append(ev.content_hash)
        key = _key("clean", _hash_file(src), list(decontaminate), set_hashes, ngram, threshold, near)
        reused = self._reusable("clean", key)
        if reused is not None:
            return reused
        verdicts = dedup(((t.id, _question_text(t)) for t in ts.tasks), threshold=threshold, near=near,
                         contamination=contamination)
        keep = {v.item_id for v in verdicts if v.kept}
        items = [{"item_id": v.item_id, "task_id": v.item_id, "kept": v.kept, "reason": v.reason,
                  "detail": v.detail} for v in verdicts]
        out = self.path("clean.parquet")
        write_taskset(TaskSet.build([t for t in ts.tasks if t.id in keep], name=f"{self.build_id}-clean",
                                    source=str(src)), out)
        report = StageReport("clean", key, len(verdicts), len(keep),
                             dict(Counter(str(v.reason) for v in verdicts if not v.kept)), {"clean": str(out)},
                             {"decontamination_sets": list(decontaminate), "ngram": ngram,
                              "near_dup_threshold": threshold})
        return self._finish(report, items)

    def calibrate(self, policy: PolicyRunner, *, samples: int = 4, band: Band | None = None,
                  pass_score: float = 1.0, policy_model: str = "") -> StageReport:
        band = band or Band()
        if samples < 1:
            raise BuildError(f"calibrate: samples {samples}: use at least 1")
        src = self.input_of("calibrate")
        ts = read_taskset(src)
        key = _key("calibrate", _hash_file(src), samples, str(band), pass_score, policy_model)
        reused = self._reusable("calibrate", key)
        if reused is not None:
            return reused
        run_id = f"{self.build_id}-cal-{key[:8]}"[:128]
        data = policy(str(src), run_id, samples) if len(ts) else None
        if data is None:
            run_id = ""  # nothing to calibrate: no run
        rates = pass_rates(data, [t.id for t in ts.tasks], pass_score) if data is not None else {}
        verdicts = select(rates, band)
        kept: list[Task] = []
        items = []
        for t in ts.tasks:
            pr = rates[t.id]
            reason = verdicts[t.id]
            items.append({"item_id": t.id, "task_id": t.id, "kept": reason is None, "reason": reason,
                          "calibration_run": run_id, "samples": pr.samples, "passes": pr.passes,
                          "pass_rate": pr.rate})
            if reason is None:
                meta = {**t.metadata, "calibration": {"run_id": run_id, "samples": pr.samples,
                                                      "passes": pr.passes, "pass_rate": pr.rate,
                                                      "band": str(band)}}
                kept.append(t.model_copy(update={"metadata": meta}))
        out = self.path("calibrated.parquet")
        write_taskset(TaskSet.build(kept, name=f"{self.build_id}-calibrated", source=str(src)), out)
        report = StageReport("calibrate", key, len(ts), len(kept),
                             dict(Counter(r for r in verdicts.values() if r is not None)),
                             {"calibrated": str(out)},
                             {"calibration_run": run_id, "samples": samples, "band": str(band),
                              "pass_score": pass_score, "policy_model": policy_model})
        return self._finish(report, items)

    def skip_calibration(self) -> StageReport:
        """Pass the clean candidates on uncalibrated (every item kept, no pass rates)."""
        src = self.input_of("calibrate")
        ts = read_taskset(src)
        key = _key("calibrate-skipped", _hash_file(src))
        reused = self._reusable("calibrate", key)
        if reused is not None:
            return reused
        out = self.path("calibrated.parquet")
        write_taskset(TaskSet.build(ts.tasks, name=f"{self.build_id}-calibrated", source=str(src)), out)
        items = [{"item_id": t.id, "task_id": t.id, "kept": True} for t in ts.tasks]
        report = StageReport("calibrate", key, len(ts), len(ts), {}, {"calibrated": str(out)},
                             {"band": "none: not calibrated"})
        return self._finish(report, items)

    def export(self, *, runs: Callable[[str], Any] | None = None, pass_score: float = 1.0,
               source: str = "sandflow-data") -> StageReport:
        """`runs(run_id) -> RunData` reads the calibration run back (for the SFT set).
        A task whose ground truth LLM-in-Sandbox-RL's reward cannot score is dropped here
        (`lis_rl_unscorable`, datasets_prep.rows.lis_rl_ground_truth); no task left: the
        report's `empty` says so in one sentence, and the files hold no rows."""
        src = self.input_of("export")
        ts = read_taskset(src)
        cal = self.report("calibrate")
        run_id = (cal.info.get("calibration_run") if cal else None) or ""
        key = _key("export", _hash_file(src), pass_score, source, run_id, runs is not None)
        reused = self._reusable("export", key)
        if reused is not None:
            return reused
        refused: list[tuple[str, str]] = []
        train = write_train(list(ts.tasks), self.path("train.parquet"), source, refused=refused)
        why = dict(refused)
        kept = [t for t in ts.tasks if t.id not in why]
        sft: list[dict[str, Any]] = []
        if runs is not None and run_id and kept:  # no kept task: the run may not exist
            sft = sft_rows(runs(run_id), [t.id for t in kept], pass_score)
        sft_path = write_jsonl(sft, self.path("sft.jsonl"))
        items = [{"item_id": t.id, "task_id": t.id, "kept": t.id not in why,
                  **({"reason": UNSCORABLE, "detail": why[t.id]} if t.id in why else {})} for t in ts.tasks]
        info: dict[str, Any] = {"sft_rows": len(sft), "source": source, "train_rows": len(kept),
                                "lis_rl": lis_rl_summary(kept)}
        if not kept:
            info["empty"] = self._empty_sentence(len(ts), len(refused))
        report = StageReport("export", key, len(ts), len(kept), {UNSCORABLE: len(refused)} if refused else {},
                             {"train": str(train), "sft": str(sft_path), "card": str(self.path("README.md"))},
                             info)
        self._write_card(report)
        return self._finish(report, items)

    def _empty_sentence(self, candidates: int, refused: int) -> str:
        """One sentence for a build that exported nothing: where its items went."""
        losses = []
        for st in STAGES[:-1]:
            r = self.report(st)
            if r is not None and r.dropped:
                top = ", ".join(f"{k}={v}" for k, v in sorted(r.dropped.items(), key=lambda kv: (-kv[1], kv[0]))[:3])
                losses.append(f"{st} dropped {sum(r.dropped.values())} ({top})")
        if refused:
            losses.append(f"export refused {refused} ({UNSCORABLE})")
        where = "; ".join(losses) or "the corpus gave no piece to ask about"
        return (f"the build is empty: no task survived ({where}), so train.parquet and sft.jsonl "
                f"hold no rows; see `sandflow data funnel --out {self.out}`")

    def _write_card(self, export: StageReport) -> None:
        stages = [r for s in STAGES[:-1] if (r := self.report(s)) is not None] + [export]
        info: dict[str, Any] = {}
        for r in stages:
            info.update({k: v for k, v in r.info.items() if v not in (None, "", [])})
        rows, sft = export.info["train_rows"], export.info["sft_rows"]
        files = {
            "train.parquet": (f"{rows} verl/rllm rows (LIS-RL contract; task in `extra_info`)", rows),
            "sft.jsonl": (f"{sft} passing trajectories as chat messages with tool calls and a `tools` "
                          "list (TRL SFTTrainer; LLaMA-Factory with `formatting: openai`)", sft),
            "calibrated.parquet": ("the same tasks as a sandflow task set "
                                   "(`sandflow bench --task-set calibrated.parquet`)", None),
        }
        text = dataset_card(build_id=self.build_id, stages=[s.as_dict() for s in stages], info=info,
                            files=files, empty=export.info.get("empty"), lis_rl=export.info["lis_rl"])
        self.path("README.md").write_text(text, encoding="utf-8")


def _question_text(t: Task) -> str:
    m = t.metadata
    choices = m.get("choices") or []
    return "\n".join([str(m.get("question") or t.problem_statement), *map(str, choices), str(t.ground_truth)])


def _task_text(t: Task) -> str:
    """What a task of an evaluation set is compared on: its prompt and its bare question
    (not its documents: a corpus may share a source text with a benchmark legitimately)."""
    return "\n".join([t.problem_statement, str(t.metadata.get("question") or "")])
