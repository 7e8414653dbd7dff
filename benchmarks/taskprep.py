"""Benchmark: how fast task sets are prepared and answers are scored, against floors
measured in the same run.

1. prepare: a (context, question, answer) table -> converted, validated tasks ->
   atomic Parquet, against the floor of pyarrow writing the same raw rows (zstd).
2. read: reading that task set back (with full validation and the content-hash
   check) against pyarrow reading the raw file.
3. math scoring: `score(task, answer)` (extraction, math-verify, result) against
   the floor of calling math-verify's parse+verify directly on the same pairs.
4. suite builds: seconds to build `smoke` and `all --size 50` (no floor: absolute).

Run:  .venv/bin/python benchmarks/taskprep.py [--rows 400] [--answers 200]
Ends with ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

# The repo's packages first: benchmarks/warehouse.py must not shadow the warehouse package.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _corpus(n: int, chars: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu", "nu", "xi", "omicron", "pi"]
    rows = []
    for i in range(n):
        paras: list[str] = []
        total = 0
        while total < chars:
            p = " ".join(rng.choice(words) for _ in range(rng.randint(40, 120))) + "."
            if rng.random() < 0.1:
                p = f"# Section {len(paras)}\n\n" + p
            paras.append(p)
            total += len(p) + 2
        rows.append({"context": "\n\n".join(paras), "question": f"Question {i}: which word comes first?",
                     "answer": rng.choice(words)})
    return rows


def bench_prepare(rows: list[dict], tmp: Path) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from datasets_prep.convert import convert_rows
    from datasets_prep.io import read_taskset, write_taskset
    from datasets_prep.task import TaskSet

    pq.write_table(pa.Table.from_pylist(rows[:5]), tmp / "warmup.parquet", compression="zstd")
    t0 = time.perf_counter()
    pq.write_table(pa.Table.from_pylist(rows), tmp / "floor.parquet", compression="zstd")
    floor_write = time.perf_counter() - t0

    t0 = time.perf_counter()
    ts = TaskSet.build(convert_rows(rows, max_chars=8000, id_prefix="bench"), name="bench")
    write_taskset(ts, tmp / "ours.parquet")
    ours_write = time.perf_counter() - t0

    t0 = time.perf_counter()
    pq.read_table(tmp / "floor.parquet").to_pylist()
    floor_read = time.perf_counter() - t0
    t0 = time.perf_counter()
    back = read_taskset(tmp / "ours.parquet")
    ours_read = time.perf_counter() - t0
    assert back.content_hash == ts.content_hash
    mb = sum(len(r["context"]) for r in rows) / 1e6
    return {
        "prepare_rows": len(rows), "prepare_mb": round(mb, 1),
        "prepare_files": sum(len(t.input_files) for t in ts),
        "prepare_s": round(ours_write, 3), "prepare_floor_s": round(floor_write, 3),
        "prepare_ratio": round(ours_write / floor_write, 2),
        "read_s": round(ours_read, 3), "read_floor_s": round(floor_read, 3),
        "read_ratio": round(ours_read / floor_read, 2),
    }


def bench_math(n: int) -> dict:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    from datasets_prep.task import Task
    from datasets_prep.verifiers import score

    def make_pairs(seed: int) -> list[tuple[str, str, bool]]:
        # distinct expressions per run: math-verify caches parses, so reusing them would flatter the 2nd run
        rng = random.Random(seed)
        pairs = []
        for _ in range(n):
            a, b = rng.randint(1, 500), rng.randint(2, 500)
            right = rng.random() < 0.5
            pairs.append((f"\\frac{{{a}}}{{{b}}}", f"The answer is \\boxed{{{a / b if right else a / b + 1:.6f}}}", right))
        return pairs

    warm = make_pairs(0)[:10]
    for gt, ans, _ in warm:  # imports and sympy warm-up, outside both timings
        verify(parse("\\boxed{" + gt + "}"), parse(ans))
    floor_pairs, pairs = make_pairs(1), make_pairs(2)
    t0 = time.perf_counter()
    floor_ok = 0
    for gt, ans, right in floor_pairs:
        g = parse("\\boxed{" + gt + "}", extraction_config=[LatexExtractionConfig()])
        p = parse(ans, extraction_config=[ExprExtractionConfig(), LatexExtractionConfig()])
        floor_ok += bool(verify(g, p)) == right
    floor = time.perf_counter() - t0
    tasks = [Task(id=f"m{i}", domain="math", problem_statement="q", ground_truth=gt, qa_type="math")
             for i, (gt, _, _) in enumerate(pairs)]
    t0 = time.perf_counter()
    ours_ok = sum((score(t, ans).score == 1) == right for t, (_, ans, right) in zip(tasks, pairs, strict=True))
    ours = time.perf_counter() - t0
    return {
        "math_answers": n, "math_per_s": round(n / ours, 1), "math_floor_per_s": round(n / floor, 1),
        "math_ratio": round(ours / floor, 2), "math_verdicts_correct": round(ours_ok / n, 3),
        "math_floor_verdicts_correct": round(floor_ok / n, 3),
    }


def bench_suites() -> dict:
    from datasets_prep.suites import build_suite

    t0 = time.perf_counter()
    build_suite("smoke", seed=0)
    smoke = time.perf_counter() - t0
    t0 = time.perf_counter()
    build_suite("all", seed=0, size=50)
    all50 = time.perf_counter() - t0
    return {"smoke_build_s": round(smoke, 2), "all50_build_s": round(all50, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=400)
    ap.add_argument("--context-chars", type=int, default=20_000)
    ap.add_argument("--answers", type=int, default=200)
    args = ap.parse_args()
    from sandflow.host import apply_host_settings

    apply_host_settings()  # SANDFLOW_* settings, handed to the libraries as the CLI does
    out: dict = {"benchmark": "taskprep"}
    with tempfile.TemporaryDirectory() as d:
        rows = _corpus(args.rows, args.context_chars)
        out.update(bench_prepare(rows, Path(d)))
    print(f"prepare: {out['prepare_rows']} rows / {out['prepare_mb']} MB -> {out['prepare_files']} files in "
          f"{out['prepare_s']} s; floor (raw pyarrow write) {out['prepare_floor_s']} s; ratio {out['prepare_ratio']}x")
    print(f"read:    {out['read_s']} s; floor (raw pyarrow read) {out['read_floor_s']} s; ratio {out['read_ratio']}x")
    out.update(bench_math(args.answers))
    print(f"math:    {out['math_per_s']} answers/s; floor (math-verify direct) {out['math_floor_per_s']}/s; "
          f"ratio {out['math_ratio']}x; correct verdicts {out['math_verdicts_correct']:.1%} (floor {out['math_floor_verdicts_correct']:.1%})")
    out.update(bench_suites())
    print(f"suites:  smoke {out['smoke_build_s']} s, all(50) {out['all50_build_s']} s")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
