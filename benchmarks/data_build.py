"""Benchmark: the RL data build (datagen/, docs/data.md) against floors in the same run.

1. synth: question synthesis through sandflow (datagen.synth.synthesize: prompt template,
   structured-output body, the model client, the JSON checks, the reply cache on disk)
   against the same requests posted straight to the same scripted endpoint with one
   pooled httpx client and the same concurrency (the floor: HTTP and JSON only), and
   against sandflow's model client alone (what synthesis itself adds). The endpoint runs
   in a process of its own, as a real one does. Interleaved repeats (the order
   alternating), medians. Goal: synth_overhead_ratio <= 1.1.
2. dedup: exact + MinHash LSH near-duplicate removal (datasets_prep.dedup, rensa) over
   100,000 synthetic documents of ~60 words, 5% exact and 10% near duplicates planted.
   Goal: dedup_docs_per_s >= 5,000.
3. funnel: a small build (a folder of documents -> ingest -> synth -> clean, real
   warehouse) and the `data_funnel` view: 1 when in = out + dropped at every stage.
4. ingest: documents per second through ingest (2,000 text files; absolute).

Run:  .venv/bin/python benchmarks/data_build.py [--pieces 400] [--questions 3]
      [--concurrency 8] [--docs 100000] [--repeats 5]
(no Docker; ~1 minute). Ends with ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORDS = ["river", "bridge", "city", "glacier", "snow", "ice", "bee", "dance", "sun", "food", "copper", "iron", "wire", "current", "mountain", "valley", "forest", "ocean", "tide", "moon", "planet", "orbit", "engine", "steam", "coal", "train"]


def _text(rng: random.Random, n: int) -> str:
    sentences = []
    for _ in range(max(1, n // 12)):
        sentences.append(" ".join(rng.choice(WORDS) for _ in range(12)).capitalize() + ".")
    return " ".join(sentences)


def _reply_for(body: dict, index: int):
    """A valid question of the asked type whose evidence is the document's first sentence."""
    from tests.scripted_model import text_reply

    doc = body["messages"][1]["content"].split("<document>", 1)[1]
    first = doc.strip().split(".")[0] + "."
    words = first.split()
    qtype = (body.get("response_format") or {}).get("json_schema", {}).get("name", "free_form")
    if qtype == "free_form":
        obj = {"question": "Which word opens the document?", "answer": words[0], "evidence": first}
    else:
        obj = {"question": "Which words occur in the first sentence?",
               "options": [words[0], words[1] + " x", "zzz", "yyy"],
               "answer": "A" if qtype == "single_choice" else "A, B", "evidence": first}
    return text_reply(json.dumps(obj), usage={"prompt_tokens": 100, "completion_tokens": 40,
                                             "total_tokens": 140})


def _serve_scripted() -> None:
    """`--serve-scripted`: the synth endpoint, in a process of its own (bench_synth); it
    keeps no request (`record=False`): what it kept would only grow its own heap."""
    from tests.scripted_model import ScriptedModel, serve_until_eof

    serve_until_eof(ScriptedModel(default=_reply_for, models=("scripted",), record=False))


def bench_synth(pieces_n: int, n: int, concurrency: int, repeats: int, tmp: Path) -> dict:
    import httpx

    from datagen.synth import ReplyCache, Template, plan_slots, structured_body, synthesize
    from datasets_prep.corpus import split_pieces
    from tasks.model import ModelConfig
    from tests.scripted_model import ScriptedModelProcess

    rng = random.Random(1)
    pieces = [p for i in range(pieces_n) for p in split_pieces(f"d-{i}", f"doc{i}.txt", _text(rng, 120), 1024)]
    tpl = Template.load()
    slots = plan_slots(pieces, n, ("single_choice", "multi_choice", "free_form"))
    ours, floor, alone, kept = [], [], [], 0
    ours_cpu: list[float] = []
    floor_cpu: list[float] = []
    # the endpoint in a process of its own, as a real one is: its threads take no GIL from
    # the side measured, and its heap grows none of that side's garbage collections (in
    # this process, every allocation of the side measured second paid for scanning the
    # first side's leftovers)
    with ScriptedModelProcess([sys.executable, __file__, "--serve-scripted"]) as endpoint:
        url = endpoint.url
        cfg = ModelConfig(model="scripted", base_url=url, temperature=0.0, max_retries=0)
        bodies = [{"model": "scripted", "messages": tpl.messages(s.qtype, s.piece.text), "temperature": 0.0,
                   "max_tokens": cfg.max_tokens, **structured_body("json_schema", s.qtype)} for s in slots]

        def straight() -> float:
            client = httpx.Client(base_url=url + "/", limits=httpx.Limits(max_keepalive_connections=64))
            c0 = time.process_time()
            t0 = time.perf_counter()

            def post(body: dict) -> None:
                r = client.post("chat/completions", content=json.dumps(body).encode(),
                                headers={"Content-Type": "application/json"})
                json.loads(r.json()["choices"][0]["message"]["content"])

            with ThreadPoolExecutor(max_workers=concurrency) as pool:
                list(pool.map(post, bodies))
            dt = time.perf_counter() - t0
            floor_cpu.append(time.process_time() - c0)
            client.close()
            return dt

        straight()  # warm-ups of both (connections, imports, caches)
        synthesize(pieces[:20], cfg, n=n, concurrency=concurrency, template=tpl)
        def through_sandflow(r: int) -> int:
            cache = ReplyCache(tmp / f"cache-{r}.jsonl")
            c0 = time.process_time()
            t0 = time.perf_counter()
            res = synthesize(pieces, cfg, n=n, concurrency=concurrency, cache=cache, template=tpl)
            ours.append(time.perf_counter() - t0)
            ours_cpu.append(time.process_time() - c0)
            return sum(o.kept for o in res.outcomes)

        def client_alone() -> float:
            # the same calls through sandflow's model client only (no template, checks or
            # cache): what synthesis itself adds is synth_s over this
            from tasks.model import ModelClient

            client = ModelClient(cfg)
            calls = [(tpl.messages(s.qtype, s.piece.text), extras[s.qtype]) for s in slots]
            t0 = time.perf_counter()

            def call(c: tuple) -> None:
                json.loads(client.complete(c[0], extra_body=c[1]).content or "")

            with ThreadPoolExecutor(max_workers=concurrency) as pool:
                list(pool.map(call, calls))
            dt = time.perf_counter() - t0
            client.close()
            return dt

        extras = {t: structured_body("json_schema", t) for t in ("single_choice", "multi_choice", "free_form")}
        for r in range(repeats):
            # the order alternates: whichever runs second inherits the first one's
            # leftovers (server threads of closed connections, garbage)
            if r % 2:
                kept = through_sandflow(r)
                floor.append(straight())
            else:
                floor.append(straight())
                kept = through_sandflow(r)
            alone.append(client_alone())
    return {
        "synth_calls": len(slots),
        "synth_kept": kept,
        "synth_s": statistics.median(ours),
        "synth_floor_s": statistics.median(floor),
        "synth_overhead_ratio": statistics.median(ours) / statistics.median(floor),
        # CPU seconds of this process (client and the in-process server alike): less moved
        # by other processes' load than the wall-clock ratio
        "synth_cpu_ratio": statistics.median(ours_cpu) / statistics.median(floor_cpu[1:] or floor_cpu),
        "synth_client_s": statistics.median(alone),
        "synth_over_client_ratio": statistics.median(ours) / statistics.median(alone),
        "synth_concurrency": concurrency,
    }


def bench_dedup(docs: int) -> dict:
    from datasets_prep.dedup import dedup

    rng = random.Random(2)
    items: list[tuple[str, str]] = []
    for i in range(docs):
        roll = rng.random()
        if items and roll < 0.05:
            items.append((f"x{i}", rng.choice(items)[1]))  # exact duplicate
        elif items and roll < 0.15:
            base = rng.choice(items)[1].split()
            base[rng.randrange(len(base))] = "changed"
            items.append((f"n{i}", " ".join(base)))  # one word changed: near duplicate
        else:
            items.append((f"d{i}", " ".join(rng.choice(WORDS) + str(rng.randrange(50)) for _ in range(60))))
    t0 = time.perf_counter()
    verdicts = dedup(items)
    dt = time.perf_counter() - t0
    reasons = {r: sum(1 for v in verdicts if v.reason == r) for r in ("exact_duplicate", "near_duplicate")}
    return {"dedup_docs": docs, "dedup_s": dt, "dedup_docs_per_s": docs / dt,
            "dedup_exact_found": reasons["exact_duplicate"], "dedup_near_found": reasons["near_duplicate"]}


def bench_funnel_and_ingest(tmp: Path) -> dict:
    from datagen.build import Build
    from tasks.model import ModelConfig
    from tests.scripted_model import ScriptedModel
    from warehouse import Warehouse

    rng = random.Random(3)
    corpus = tmp / "corpus"
    corpus.mkdir()
    for i in range(2000):
        (corpus / f"doc{i:05d}.txt").write_text(_text(rng, 80) + "\n")
    (corpus / "blob.bin").write_bytes(b"\x00\x01\x02")
    (corpus / "empty.txt").write_text("\n")
    b = Build(tmp / "out", warehouse=tmp / "wh", build_id="bench-data")
    t0 = time.perf_counter()
    ing = b.ingest(str(corpus))
    ingest_s = time.perf_counter() - t0
    # a small build for the funnel: the first 50 documents' pieces are enough
    small = tmp / "small"
    small.mkdir()
    for p in sorted(corpus.iterdir())[:50]:
        (small / p.name).write_bytes(p.read_bytes())
    (small / "blob.bin").write_bytes(b"\x00\x01")
    b2 = Build(tmp / "out2", warehouse=tmp / "wh", build_id="bench-funnel")
    with ScriptedModel(default=_reply_for, models=("scripted",)) as model:
        b2.ingest(str(small))
        b2.synth(ModelConfig(model="scripted", base_url=model.url, temperature=0.0), n=3, concurrency=4)
        b2.clean()
    with Warehouse(tmp / "wh").query() as q:
        rows = q.rows("SELECT build_id, stage, items_in, items_out, dropped, consistent FROM data_funnel")
    consistent = bool(rows) and all(r[5] and r[2] == r[3] + r[4] for r in rows)
    return {"ingest_docs": ing.items_in, "ingest_s": ingest_s, "ingest_docs_per_s": ing.items_in / ingest_s,
            "funnel_rows": len(rows), "funnel_consistent": int(consistent),
            "funnel": [list(r[1:5]) for r in rows if r[0] == "bench-funnel"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pieces", type=int, default=400)
    ap.add_argument("--questions", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--docs", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--serve-scripted", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_scripted:  # the endpoint's own process (_endpoint_process)
        _serve_scripted()
        return
    out: dict = {"benchmark": "data_build"}
    with tempfile.TemporaryDirectory(prefix="sandflow-bench-data-") as d:
        tmp = Path(d)
        out.update(bench_synth(args.pieces, args.questions, args.concurrency, args.repeats, tmp))
        print(f"synth: {out['synth_calls']} calls, sandflow {out['synth_s']:.2f}s vs straight "
              f"{out['synth_floor_s']:.2f}s -> {out['synth_overhead_ratio']:.2f}x (goal <= 1.1); "
              f"CPU {out['synth_cpu_ratio']:.2f}x; over sandflow's model client alone "
              f"({out['synth_client_s']:.2f}s) {out['synth_over_client_ratio']:.2f}x")
        out.update(bench_dedup(args.docs))
        print(f"dedup: {out['dedup_docs']:,} docs in {out['dedup_s']:.2f}s -> "
              f"{out['dedup_docs_per_s']:,.0f} docs/s (goal >= 5,000); found "
              f"{out['dedup_exact_found']:,} exact, {out['dedup_near_found']:,} near")
        out.update(bench_funnel_and_ingest(tmp))
        print(f"ingest: {out['ingest_docs']:,} documents in {out['ingest_s']:.2f}s "
              f"({out['ingest_docs_per_s']:,.0f}/s); funnel consistent: {out['funnel_consistent']} "
              f"{out['funnel']}")
    out["pass"] = bool(out["synth_overhead_ratio"] <= 1.1 and out["dedup_docs_per_s"] >= 5000
                       and out["funnel_consistent"] == 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
