"""The exporters stream: their peak memory barely grows with the run (a run five times
larger, read in batches of 8 episodes: under twice the peak; what grows is the list of
episode ids, ~0.3 KB per episode), unlike reading the run whole (`Warehouse.load_run`,
five times the peak). Speed is measured by benchmarks/interop.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.interop import RUN, build
from benchmarks.interop import peak as _peak


def _build(root: Path, n: int) -> Path:
    build(root, n)
    return root


@pytest.mark.slow
def test_peak_memory_does_not_grow_with_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import interop.source as source
    from interop.atif import export_atif
    from interop.hf import export_hf_run
    from interop.inspect_log import export_inspect
    from warehouse import Warehouse

    monkeypatch.setattr(source, "BATCH", 8)
    small, large = _build(tmp_path / "small", 40), _build(tmp_path / "large", 200)
    whole = [_peak(lambda r=r: Warehouse(r).load_run(RUN)) for r in (small, large)]
    assert whole[1] > 3 * whole[0]  # reading the run whole grows with it (the measure works)
    for fn in (export_atif, export_inspect, export_hf_run):
        for r in (small, large):  # imports and each warehouse's first open out of the measure
            fn(r, RUN, tmp_path / f"warm-{r.name}")
        peaks = [_peak(lambda r=r, fn=fn: fn(r, RUN, tmp_path / f"out-{fn.__name__}-{r.name}")) for r in (small, large)]
        assert peaks[1] < 2 * peaks[0], (fn.__name__, peaks)
        assert peaks[1] < whole[1] / 2, (fn.__name__, peaks, whole)
    assert len(list((tmp_path / "out-export_atif-large").glob("*.json"))) == 200
