"""A data build's budget (issue #28, datagen/budget.py): the synthesis stage's model calls
count; reached, the build stops cleanly (exit 1, one sentence), the same budget again
asks nothing (the build's reply cache is its record of what it paid), and a higher one
finishes it. Scripted generator with known usage, real Prefect, warehouse and files."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from sandflow.cli import app
from tests.datagen.test_build_stages import corpus, eval_set, generator  # noqa: F401 (fixtures)
from tests.scripted_model import ScriptedModel

runner = CliRunner(env={"COLUMNS": "300"})
# every reply: 1,000 prompt + 200 completion tokens = $0.0045 at $2.50 / $10 per million
PRICES = {"scripted": {"input": 2.5, "output": 10.0}}


def priced_generator(body: dict, index: int):
    reply = generator(body, index)
    reply.usage = {"prompt_tokens": 1000, "completion_tokens": 200, "total_tokens": 1200}
    return reply


@pytest.fixture
def gen():
    with ScriptedModel(default=priced_generator, models=("scripted",)) as server:
        yield server


@pytest.mark.usefixtures("prefect_harness")
def test_synthesis_stops_on_the_budget_and_a_higher_one_finishes(tmp_path, gen, corpus, eval_set):  # noqa: F811
    out = tmp_path / "out"
    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps(PRICES))

    def build(*budget: str):
        return runner.invoke(app, ["data", "build", str(corpus), "--out", str(out), "--warehouse",
                                   str(tmp_path / "wh"), "--base-url", gen.url, "--model", "scripted",
                                   "--decontaminate-against", eval_set, "--no-calibrate", "-c", "1", "--build-id", "budget-build",
                                   "--prices", str(prices), *budget])  # fmt: skip

    # 15 slots, one call at a time: 4 replies cost $0.018, the 5th $0.0225 >= $0.02
    res = build("--max-cost", "0.02")
    assert res.exit_code == 1, res.output
    said = " ".join(res.output.split())
    assert "synth stopped on the build's budget: the build's cost budget (--max-cost 0.02 USD) is spent: " \
        "0.0225 USD over 6000 tokens; 10 of 15 question slots not asked" in said, said
    assert "Traceback" not in res.output and len(gen.requests) == 5
    assert not (out / "stages" / "synth.json").exists() and not (out / "train.parquet").exists()

    # the same budget again: what the build paid is counted from its reply cache: no call
    res = build("--max-cost", "0.02")
    assert res.exit_code == 1 and len(gen.requests) == 5, res.output

    # a higher budget finishes it: the 5 paid replies reused, the 10 others asked
    res = build("--max-cost", "1", "--max-run-tokens", "100000")
    assert res.exit_code == 0, res.output
    assert len(gen.requests) == 15
    stages = json.loads(runner.invoke(app, ["data", "funnel", "--out", str(out), "--json"]).output)
    synth = next(s for s in stages if s["stage"] == "synth")
    assert (synth["items_in"], synth["items_out"], synth["consistent"]) == (15, 7, True)
    assert "budget_exhausted" not in synth["dropped"]
    assert (synth["info"]["calls"], synth["info"]["cache_hits"]) == (10, 5)
    assert (out / "train.parquet").exists()


def test_a_cost_budget_without_a_price_is_exit_2_before_any_call(tmp_path, gen, corpus):  # noqa: F811
    res = runner.invoke(app, ["data", "build", str(corpus), "--out", str(tmp_path / "out"), "--warehouse",
                              str(tmp_path / "wh"), "--base-url", gen.url, "--model", "scripted",
                              "--no-calibrate", "--max-cost", "1"])  # fmt: skip
    assert res.exit_code == 2, res.output
    assert "no price for model 'scripted'" in " ".join(res.output.split()) and gen.requests == []


def test_calibration_gets_what_synthesis_left() -> None:
    from datagen.budget import BudgetExhausted
    from flows.data import _calibration_budget
    from tasks.spec import RunSpec

    spec = RunSpec(model="scripted", max_cost_usd=1.0, max_run_tokens=100_000, prices=PRICES)
    left = _calibration_budget(spec, {"budget": {"spent_tokens": 15 * 1200, "spent_usd": 15 * 0.0045}})
    assert left.budget.max_cost_usd == pytest.approx(1.0 - 0.0675) and left.budget.max_run_tokens == 100_000 - 18_000
    assert _calibration_budget(spec, {}) is spec  # no budget report: the spec's own
    with pytest.raises(BudgetExhausted, match="before calibration"):
        _calibration_budget(spec, {"budget": {"spent_tokens": 100_000, "spent_usd": 0.5}})
