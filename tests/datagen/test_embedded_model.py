"""The whole build with the embedded model (SmolLM2-135M via llama-cpp-python): a small real
corpus -> synth through the local server -> clean -> calibrate in the sandbox -> export.
A 135M model writes few questions that pass the checks; what must hold is the path: every
stage runs, tokens are counted, every funnel is consistent, the card and files exist; and
the generator's replies come through structured output (a json_schema grammar on the
embedded server), so every reply that was not cut by max_tokens parses."""

from __future__ import annotations

import json

import pytest

from datagen.build import STAGES, Build
from flows.data import data_build_flow
from tasks.spec import RunSpec
from tests.conftest import TEST_RUN_PREFIX
from tests.datagen.corpus_files import BEES, PARIS
from warehouse import Warehouse


@pytest.mark.slow
@pytest.mark.model
@pytest.mark.docker
@pytest.mark.usefixtures("prefect_harness", "sandbox_image")
def test_the_embedded_model_builds_end_to_end(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "paris.txt").write_text(PARIS + "\n")
    (corpus / "bees.txt").write_text(BEES + "\n")
    wh = tmp_path / "wh"
    spec = RunSpec(warehouse=str(wh), max_steps=3, max_tokens=256, concurrency=1, wall_clock_s=300)
    bid = f"{TEST_RUN_PREFIX}data-embedded"
    out = data_build_flow(str(corpus), str(tmp_path / "out"), spec, questions=3, samples=1,
                          synth_max_tokens=256, build_id=bid)
    st = out["stages"]
    assert [s for s in st] == list(STAGES)
    assert st["synth"]["items_in"] == 6 and st["synth"]["info"]["calls"] == 6
    assert st["synth"]["dropped"].get("model_error", 0) == 0, st["synth"]["dropped"]
    assert st["synth"]["info"]["structured_output"] == "json_schema"  # `auto` on the embedded model
    # a grammar-constrained reply is JSON unless max_tokens cut it (a 135M model rambles
    # inside a string): every reply that stopped before the bound parses
    replies = [json.loads(x) for x in (tmp_path / "out" / "cache" / "synth.jsonl").read_text().splitlines()]
    assert len(replies) == 6
    for r in replies:
        if r["completion_tokens"] < 256:
            json.loads(r["content"])
    assert st["synth"]["info"]["prompt_tokens"] > 0 and st["synth"]["info"]["completion_tokens"] > 0
    assert all(s["consistent"] for s in st.values())
    b = Build(tmp_path / "out", build_id=bid)
    assert b.path("train.parquet").is_file() and b.path("README.md").is_file()
    with Warehouse(wh).query() as q:
        rows = q.rows(f"SELECT stage, consistent FROM data_funnel WHERE build_id = '{bid}'")
    assert [r[0] for r in rows] == list(STAGES) and all(r[1] for r in rows)
