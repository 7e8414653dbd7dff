"""Viewer benchmark: `sandflow view` over a warehouse of a million turns.

What it does (see benchmarks/README.md, section "viewer"):

1. A warehouse of N turns (default 1,000,000: 10,000 episodes x 100 turns of ~2 KB real
   text) recorded through the real `warehouse.EpisodeWriter` by benchmarks/warehouse.py's
   generator, with a run row, one score per episode and one usage label per turn (as the
   score and usage flows write them). `--warehouse PATH` reuses one (built there if missing).
2. The real server: `sandflow view --warehouse ... --port P` as a subprocess; every page
   is fetched over HTTP like a browser would: the runs list, a run's first page of
   episodes (plain and filtered by domain + score + usage), an episode's first page of
   turns, two episodes side by side, two runs compared, and a SQL box query. Each page
   is fetched once cold (its first request) and then R times (p50).
3. Floors in the same run: DuckDB reading the same rows straight from the Parquet files
   (no views, no HTTP, no HTML): the first 50 episodes of the run, and one episode's
   first 50 turns.

Measured on the per-episode files (a run in progress) and again after `compact(run_id)`
(a finished run). Ends with one JSON line; `first_page_s` is the slowest cold first page
of the compacted warehouse (the target: under a second).

4. Uncompacted at scale: a second warehouse of 20,000 episodes (10 turns each) left in
   per-episode files, as a run killed before its end compaction, `flows run --no-compact`
   or a long RL session leaves it (40,000 Parquet files). Measured: `sandflow view`'s start
   to its first answer (the first open builds the run's digests, warehouse/digest.py), the
   slowest cold first page, `sandflow sql` counting the turns (the whole command, a fresh
   process) and a later session's open. Target: first page and the count under 2 s.
   `--uncompacted-only` runs just this part.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.warehouse import (  # noqa: E402
    DOMAINS,
    RUN,
    build_episode,
    ingest_worker,
    load_corpus,
    split,
)

RUN_B = "bench-b"  # a second, small run: the same tasks, for the two-run comparisons
CAPS = ("computation", "file_management", "external_resource", "none")
log = lambda *x: print(*x, file=sys.stderr, flush=True)  # noqa: E731


# ---- the warehouse ------------------------------------------------------------------
def build(root: Path, turns: int, tpe: int, workers: int, turn_bytes: int, work: Path) -> None:
    """Record the episodes as the agent loop would, then scores and usage labels."""
    from tasks.records import episode_key
    from warehouse import EpisodeWriter, Warehouse
    from warehouse.schema import check_run_id

    check_run_id(RUN)
    n_eps = max(1, turns // tpe)
    corpus = load_corpus()
    corpus_path = work / "corpus.txt"
    corpus_path.write_text(corpus, encoding="utf-8")
    wh = Warehouse(root)
    wh.write_run(RUN, model="bench-model", dataset="bench", config={"temperature": 0.7})
    t = time.perf_counter()
    ctx = mp.get_context("spawn")
    with ctx.Pool(workers) as pool:
        pool.map(
            ingest_worker,
            [
                (str(root), str(corpus_path), ks, tpe, turn_bytes, "flush", 0)
                for ks in split(list(range(n_eps)), workers)
            ],
        )
    log(f"recorded {n_eps} episodes x {tpe} turns in {time.perf_counter() - t:.0f}s")
    wh.finish_run(RUN)
    # a second, small run over the first tasks (other answers), for comparisons
    wh.write_run(RUN_B, model="bench-model-b", dataset="bench")
    w = EpisodeWriter(root, durability="flush")
    for k in range(min(n_eps, 48)):
        ep, recs = build_episode(corpus, k, min(tpe, 20), turn_bytes)
        eid = episode_key(RUN_B, ep.task_id, ep.mode, 0)
        ep = ep.model_copy(update={"run_id": RUN_B, "episode_id": eid, "answer": f"b{k}"})
        recs = [r.model_copy(update={"run_id": RUN_B, "episode_id": ep.episode_id}) for r in recs]
        w.start_episode(ep.model_copy(update={"termination": None, "ended_at": None}))
        for r in recs:
            w.record_turn(r)
        w.finish_episode(ep)
    w.close()
    wh.finish_run(RUN_B)
    for run in (RUN, RUN_B):
        eps = wh.episodes(run).select(["episode_id", "domain", "num_turns"]).to_pylist()
        for d in DOMAINS:
            mine = [e for e in eps if e["domain"] == d]
            wh.write_scores(
                [
                    {
                        "run_id": run,
                        "episode_id": e["episode_id"],
                        "verifier": "exact",
                        "score": float(int(e["episode_id"][:6], 16) % 3 == 0),
                        "reason": "exact match"
                        if int(e["episode_id"][:6], 16) % 3 == 0
                        else "differs",
                    }
                    for e in mine
                ]
            )
            wh.write_usage(
                [
                    {
                        "run_id": run,
                        "episode_id": e["episode_id"],
                        "turn_index": i,
                        "call_index": 0,
                        "capability": CAPS[(int(e["episode_id"][:4], 16) + i) % len(CAPS)],
                        "tool": "execute_bash",
                        "detail": "grep -n ...",
                    }
                    for e in mine
                    for i in range(e["num_turns"])
                ]
            )
    log(f"warehouse ready at {root}")


# ---- the server, over HTTP ------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(url: str) -> tuple[float, int, str]:
    import httpx

    t = time.perf_counter()
    r = httpx.get(url, timeout=300, follow_redirects=False)
    return time.perf_counter() - t, r.status_code, r.text


def pick_episodes(root: Path) -> tuple[str, str, int]:
    """Two episodes of one task in the middle of the run (sandbox and llm mode), and the
    run's episode count."""
    import duckdb

    con = duckdb.connect()
    files = str(root / "episodes" / f"run_id={RUN}" / "*.parquet")
    (task,) = con.execute(
        f"SELECT task_id FROM read_parquet('{files}') ORDER BY task_id LIMIT 1 OFFSET "
        f"(SELECT count(*) // 2 FROM read_parquet('{files}'))"
    ).fetchone()  # type: ignore[misc]
    rows: dict[str, str] = {
        str(m): str(e)
        for m, e in con.execute(
            f"SELECT mode, episode_id FROM read_parquet('{files}') WHERE task_id = ?", [task]
        ).fetchall()
    }
    ((n,),) = con.execute(f"SELECT count(*) FROM read_parquet('{files}')").fetchall()
    return rows["sandbox"], rows.get("llm", rows["sandbox"]), int(n)


PAGES = {
    # name: (path, a marker the page must contain)
    "runs": ("/", 'data-testid="runs"'),
    "episodes": (f"/runs/{RUN}", 'data-testid="episodes"'),
    "episodes_filtered": (
        f"/runs/{RUN}?domain=math&score=correct&usage=computation",
        'data-testid="episodes"',
    ),
    "episodes_last_page": (f"/runs/{RUN}?page={{last}}", 'data-testid="episodes"'),
    "episode": (f"/runs/{RUN}/episodes/{{a}}", 'data-testid="turns"'),
    "episode_turns_50": (f"/runs/{RUN}/episodes/{{a}}?start=50", 'data-testid="turns"'),
    "side_by_side": (f"/compare?a={RUN}/{{a}}&b={RUN}/{{b}}", 'data-testid="side-by-side"'),
    "compare_runs": (f"/compare-runs?a={RUN}&b={RUN_B}", 'data-testid="pairs"'),
    "sql": ("/sql?q=SELECT+*+FROM+accuracy", 'data-testid="sql-result"'),
}
FIRST_PAGES = ("runs", "episodes", "episode")  # what a user opens first, in that order


def measure_server(root: Path, runs: int) -> dict[str, float]:
    """Start `sandflow view`, fetch every page cold once, then `runs` rounds of every page
    and of the floors, interleaved (so machine load hits both alike): p50 of each."""
    a, b, n_eps = pick_episodes(root)
    last = max(0, (n_eps - 1) // 50)
    floors = Floors(root, a)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-c", "from sandflow.cli import main; main()", "view",
           "--warehouse", str(root), "--port", str(port)]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out: dict[str, float] = {}
    urls = {name: (base + path.format(a=a, b=b, last=last), m) for name, (path, m) in PAGES.items()}
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"sandflow view exited: {proc.stdout.read().decode()[-2000:]}")  # type: ignore[union-attr]
            try:
                _, code, _ = get(base + "/healthz")
                if code == 200:
                    break
            except Exception:
                time.sleep(0.1)
        out["ready_s"] = time.perf_counter() - t0
        for name, (url, marker) in urls.items():
            s, code, text = get(url)
            if code != 200 or marker not in text:
                raise SystemExit(f"{name}: HTTP {code}, marker {marker!r} missing: {text[:500]}")
            out[f"{name}_cold_s"] = s
        floors.run()  # the floors' own first (cold) reads
        times: dict[str, list[float]] = {}
        for _ in range(runs):
            for name, (url, _) in urls.items():
                times.setdefault(f"{name}_p50_s", []).append(get(url)[0])
            for name, t in floors.run().items():
                times.setdefault(f"{name}_p50_s", []).append(t)
        out.update({k: statistics.median(v) for k, v in times.items()})
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return out


# ---- floors: DuckDB straight on the files -------------------------------------------------
class Floors:
    """The same rows as the episodes page and the episode page, read by DuckDB straight
    from the Parquet files: no views, no HTTP, no HTML."""

    def __init__(self, root: Path, episode_id: str) -> None:
        import duckdb

        self.con = duckdb.connect()
        eps = str(root / "episodes" / f"run_id={RUN}" / "*.parquet")
        tdir = root / "turns" / f"run_id={RUN}"
        own = sorted(tdir.glob(f"{episode_id}.*.parquet"))
        turns = [str(own[-1])] if own else [str(p) for p in tdir.glob("compacted-*.parquet")]
        self.queries = {
            "floor_episodes": (
                "SELECT episode_id, task_id, domain, mode, termination, num_turns, answer "
                f"FROM read_parquet('{eps}') ORDER BY task_id, mode LIMIT 50",
                [],
            ),
            "floor_turns": (
                "SELECT turn_index, assistant_content, tool_calls, observations, prompt_tokens "
                f"FROM read_parquet({turns}) WHERE episode_id = ? ORDER BY turn_index LIMIT 25",
                [episode_id],
            ),
        }

    def run(self) -> dict[str, float]:
        out = {}
        for name, (sql, params) in self.queries.items():
            t = time.perf_counter()
            self.con.execute(sql, params).fetchall()
            out[name] = time.perf_counter() - t
        return out


def sql_cli_s(root: Path, sql: str) -> tuple[float, str]:
    """`sandflow sql SQL` as a user runs it: a fresh process, imports included."""
    cmd = [sys.executable, "-c", "from sandflow.cli import main; main()", "sql", sql,
           "--warehouse", str(root), "--format", "csv"]  # fmt: skip
    t = time.perf_counter()
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    s = time.perf_counter() - t
    if out.returncode != 0:
        raise SystemExit(f"sandflow sql failed: {out.stderr[-2000:]}")
    return s, out.stdout.strip().splitlines()[-1]


def connect_s(root: Path) -> float:
    """Opening a query session (`warehouse.query.connect`) in a fresh process, imports excluded."""
    code = (
        "import sys, time; from warehouse.query import connect; t = time.perf_counter(); "
        "q = connect(sys.argv[1]); print(time.perf_counter() - t); q.close()"
    )
    out = subprocess.run([sys.executable, "-c", code, str(root)], cwd=ROOT, capture_output=True,
                         text=True, timeout=1800, check=True)  # fmt: skip
    return float(out.stdout.strip().splitlines()[-1])


UNCOMPACTED_TARGET_S = 2.0


def measure_uncompacted(root: Path, runs: int) -> dict[str, object]:
    """The 20,000-episode warehouse left in per-episode files (see the module doc, 4.)."""
    log("[uncompacted 20k] measuring ...")
    shutil.rmtree(root / "_cache", ignore_errors=True)  # a cold first open builds the digests
    files = sum(1 for p in root.rglob("*.parquet") if "_cache" not in p.parts)
    figs = measure_server(root, runs)
    first_page = max(figs[f"{p}_cold_s"] for p in FIRST_PAGES)
    sqls = [sql_cli_s(root, "SELECT count(*) AS n FROM turns") for _ in range(3)]
    count = sqls[0][1]
    sql_s = statistics.median(s for s, _ in sqls)
    out: dict[str, object] = {
        "uncompacted_files": files,
        "uncompacted_open_s": round(figs["ready_s"], 3),  # first open: builds the digests
        "uncompacted_reopen_s": round(connect_s(root), 3),
        "uncompacted_first_page_s": round(first_page, 3),
        "uncompacted_sql_s": round(sql_s, 3),
        "uncompacted_sql_first_s": round(sqls[0][0], 3),
        "uncompacted_turns": int(count),
        "uncompacted_pages": {k: round(v, 4) for k, v in figs.items()},
        "uncompacted_target_s": UNCOMPACTED_TARGET_S,
    }
    out["uncompacted_target_met"] = max(first_page, sql_s) <= UNCOMPACTED_TARGET_S
    for k, v in out.items():
        if k != "uncompacted_pages":
            log(f"  {k}: {v}")
    return out


def uncompacted_phase(a: argparse.Namespace, work: Path) -> dict[str, object]:
    root = a.uncompacted_warehouse or work / "uncompacted"
    if not (root / "episodes").is_dir():
        n = a.uncompacted_episodes * a.uncompacted_turns_per_episode
        log(f"building {a.uncompacted_episodes:,} episodes (uncompacted) at {root} ...")
        build(root, n, a.uncompacted_turns_per_episode, a.workers, a.turn_bytes, work)
    return measure_uncompacted(root, a.runs)


def compacted(root: Path) -> bool:
    return (root / "turns" / f"run_id={RUN}" / "_compaction.json").exists()


def measure(root: Path, runs: int, label: str) -> dict[str, float]:
    log(f"[{label}] measuring pages over HTTP ...")
    figs = measure_server(root, runs)
    figs["first_page_s"] = max(figs[f"{p}_cold_s"] for p in FIRST_PAGES)
    for k, v in figs.items():
        log(f"  {label} {k}: {v:.3f}")
    return figs


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--turns", type=int, default=1_000_000, help="turn rows (default 1,000,000)")
    ap.add_argument("--turns-per-episode", type=int, default=100)
    ap.add_argument("--turn-bytes", type=int, default=2048)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5, help="warm fetches per page (p50)")
    ap.add_argument(
        "--warehouse", type=Path, default=None,
        help="use this warehouse (built there first if missing; kept); compaction is measured on a hard-linked copy",
    )  # fmt: skip
    ap.add_argument("--uncompacted-episodes", type=int, default=20_000)
    ap.add_argument("--uncompacted-turns-per-episode", type=int, default=10)
    ap.add_argument(
        "--uncompacted-warehouse", type=Path, default=None,
        help="use this warehouse for the uncompacted part (built there first if missing; kept)",
    )  # fmt: skip
    ap.add_argument(
        "--uncompacted-only", action="store_true", help="measure only the uncompacted part"
    )
    a = ap.parse_args()
    from warehouse import Warehouse

    work = Path(tempfile.mkdtemp(prefix="sandflow-bench-viewer-"))
    if a.uncompacted_only:
        try:
            print(json.dumps({"benchmark": "viewer", **uncompacted_phase(a, work)}))
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return
    try:
        root = a.warehouse or work / "warehouse"
        if not (root / "episodes").is_dir():
            log(f"building {a.turns:,} turns at {root} ...")
            build(root, a.turns, a.turns_per_episode, a.workers, a.turn_bytes, work)
        result: dict[str, object] = {"benchmark": "viewer"}
        figs_c: dict[str, float]
        if compacted(root):
            figs_c = measure(root, a.runs, "compacted")
        else:
            result["uncompacted"] = {
                k: round(v, 4) for k, v in measure(root, a.runs, "per-episode files").items()
            }
            copy = work / "compacted"
            subprocess.run(["cp", "-al", str(root), str(copy)], check=True)
            t = time.perf_counter()
            for run in (RUN, RUN_B):
                Warehouse(copy).compact(run)
            log(f"compacted in {time.perf_counter() - t:.0f}s")
            figs_c = measure(copy, a.runs, "compacted")
        n = sum(1 for _ in (root / "turns").rglob("*.parquet"))
        result.update(
            turns_files=n,
            **{k: round(v, 4) for k, v in figs_c.items()},
            episode_vs_floor=round(
                figs_c["episode_p50_s"] / max(figs_c["floor_turns_p50_s"], 1e-9), 2
            ),
            episodes_vs_floor=round(
                figs_c["episodes_p50_s"] / max(figs_c["floor_episodes_p50_s"], 1e-9), 2
            ),
            first_page_target_s=1.0,
            first_page_target_met=figs_c["first_page_s"] <= 1.0,
        )
        if a.uncompacted_episodes > 0:
            result.update(uncompacted_phase(a, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__" and "--build-only" in sys.argv:
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--warehouse", type=Path, required=True)
    ap.add_argument("--turns", type=int, default=1_000_000)
    a = ap.parse_args()
    a.warehouse.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="sandflow-bench-viewer-"))
    build(a.warehouse, a.turns, 100, 2, 2048, tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    sys.exit(0)
elif __name__ == "__main__":
    main()
