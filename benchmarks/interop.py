"""The exporters stream: their memory does not grow with the run; and how fast they go.

A warehouse of --episodes episodes (4 turns each, realistic records, compacted) and one
of a quarter of that; each exporter (atif, inspect, hf) runs over both with tracemalloc
on. Figures: the exporter's peak Python memory on the large run over the small one
(`*_peak_growth`: ~1.0 when it streams, ~4 when it holds the run), against the floor of
`Warehouse.load_run` (the whole run in memory, what a non-streaming exporter starts
from) on the large run; and episodes per second without tracemalloc against the floor
of `load_run` + one `json.dumps` per episode. Target: peak growth <= 1.5.

Memory is what Python allocates (tracemalloc): Arrow's and DuckDB's buffers are outside
it, and both are bounded per batch (interop/source.py).

Run:  .venv/bin/python benchmarks/interop.py [--episodes 2000] [--batch 256]
Ends with ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RUN = "bench-interop"


def build(root: Path, n: int) -> None:
    from tests.warehouse.factory import make_episode, record
    from warehouse import Warehouse

    wh = Warehouse(root)
    wh.write_run(RUN, model="scripted-model", dataset="bench")
    w = wh.writer(durability="flush")
    for i in range(n):
        ep, turns = make_episode(RUN, f"t{i:06d}", turns=4, sample=0)
        record(w, ep, turns)
    w.close()
    wh.finish_run(RUN)
    wh.compact(RUN)


def peak(fn: Callable[[], Any]) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=256, help="episodes per read batch (interop.source.BATCH)")
    args = ap.parse_args()
    import interop.source as source
    from interop.atif import export_atif
    from interop.hf import export_hf_run
    from interop.inspect_log import export_inspect
    from warehouse import Warehouse

    source.BATCH = args.batch
    work = Path(tempfile.mkdtemp(prefix="sandflow-interop-bench-"))
    small, large = work / "small", work / "large"
    try:
        t0 = time.perf_counter()
        build(small, max(args.episodes // 4, 1))
        build(large, args.episodes)
        print(f"[interop-bench] built warehouses in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
        out: dict[str, Any] = {"benchmark": "interop", "episodes": args.episodes, "batch": args.batch}
        floor_peak = peak(lambda: Warehouse(large).load_run(RUN))
        t0 = time.perf_counter()
        data = Warehouse(large).load_run(RUN)
        for e in data.episodes:
            json.dumps({"e": e.model_dump(mode="json"), "t": [t.model_dump(mode="json") for t in data.turns_of(e.episode_id)]})
        floor_rate = args.episodes / (time.perf_counter() - t0)
        del data
        out["load_run_peak_mib"] = round(floor_peak / 2**20, 2)
        out["floor_episodes_per_s"] = round(floor_rate, 1)
        for name, fn in (("atif", export_atif), ("inspect", export_inspect), ("hf", export_hf_run)):
            dest = work / f"out-{name}"
            peaks = []
            for root in (small, large):
                shutil.rmtree(dest, ignore_errors=True)
                peaks.append(peak(lambda root=root, fn=fn, dest=dest: fn(root, RUN, dest)))
            shutil.rmtree(dest, ignore_errors=True)
            t0 = time.perf_counter()
            fn(large, RUN, dest)
            rate = args.episodes / (time.perf_counter() - t0)
            out[f"{name}_peak_mib"] = round(peaks[1] / 2**20, 2)
            out[f"{name}_peak_growth"] = round(peaks[1] / peaks[0], 3)
            out[f"{name}_peak_vs_load_run"] = round(peaks[1] / floor_peak, 3)
            out[f"{name}_episodes_per_s"] = round(rate, 1)
            out[f"{name}_vs_floor"] = round(rate / floor_rate, 3)
            print(
                f"[interop-bench] {name}: peak {peaks[1] / 2**20:.1f} MiB on {args.episodes} episodes, "
                f"x{peaks[1] / peaks[0]:.2f} of the quarter run (load_run: {floor_peak / 2**20:.1f} MiB); "
                f"{rate:.0f} episodes/s ({rate / floor_rate:.2f}x load_run + json.dumps)",
                file=sys.stderr,
            )
        out["target_peak_growth"] = 1.5
        out["pass"] = all(out[f"{n}_peak_growth"] <= 1.5 for n in ("atif", "inspect", "hf"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
