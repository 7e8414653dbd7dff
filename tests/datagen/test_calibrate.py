"""Calibrate and export with real episodes: the base policy (a scripted model over HTTP)
runs k=2 samples per candidate in real Docker sandboxes through the run engine as a
library (datagen.calibrate.engine_policy: no Prefect), the verifiers score them, tasks
outside the band are dropped by reason, and the SFT set holds the passing trajectories."""

from __future__ import annotations

import json
from collections import Counter

import pyarrow.parquet as pq
import pytest

from datagen.build import Build
from datagen.calibrate import Band, engine_policy
from datasets_prep.io import read_taskset
from tasks.model import ModelConfig
from tasks.spec import RunSpec
from tests.conftest import TEST_RUN_PREFIX
from tests.datagen.test_build_stages import F_BEES, F_GLACIER, F_PARIS, M1, S1, corpus, generator  # noqa: F401
from tests.scripted_model import ScriptedModel, tool_reply
from warehouse import Warehouse

# question -> (right answer, wrong answer, how often right: "alternate" | "always" | "never")
POLICY = {
    S1["question"]: ("A", "B", "alternate"),
    M1["question"]: ("A, B", "C", "always"),
    F_PARIS["question"]: ("1607", "1492", "never"),
    F_BEES["question"]: ("the waggle dance", "by smell", "alternate"),
    F_GLACIER["question"]: ("firn", "rock", "never"),
}


def make_policy():
    seen: Counter[str] = Counter()

    def policy(body: dict, index: int):
        msgs = body["messages"]
        if any(m.get("role") == "assistant" for m in msgs):
            return tool_reply("submit", {})
        prompt = next(m["content"] for m in msgs if m["role"] == "user")
        question = next(q for q in POLICY if q in prompt)
        right, wrong, how = POLICY[question]
        seen[question] += 1
        ok = how == "always" or (how == "alternate" and seen[question] % 2 == 1)
        answer = right if ok else wrong
        return tool_reply("execute_bash", {"command": f"cat /testbed/documents/*; echo '{answer}' > /testbed/output/answer.txt"})

    return policy


@pytest.mark.docker
@pytest.mark.usefixtures("sandbox_image")
def test_calibration_keeps_the_band_and_export_writes_rows_sft_and_card(tmp_path, corpus):  # noqa: F811
    wh = tmp_path / "wh"
    b = Build(tmp_path / "out", warehouse=wh, build_id=f"{TEST_RUN_PREFIX}data-cal")
    with ScriptedModel(default=generator, models=("scripted",)) as gen:
        b.ingest(str(corpus))
        b.synth(ModelConfig(model="scripted", base_url=gen.url, temperature=0.0), n=3)
        b.clean()
    assert len(read_taskset(b.path("clean.parquet"))) == 5  # no decontamination set here
    with ScriptedModel(default=make_policy(), models=("policy",)) as pol:
        spec = RunSpec(model="policy", base_url=pol.url, warehouse=str(wh), concurrency=1, max_steps=4,
                       wall_clock_s=120)
        cal = b.calibrate(engine_policy(spec, wh), samples=2, band=Band(), policy_model="policy")
        assert (cal.items_in, cal.items_out) == (5, 2)
        assert cal.dropped == {"all_pass": 1, "all_fail": 2}
        episodes = len([r for r in pol.requests if not any(m["role"] == "assistant" for m in r["messages"])])
        assert episodes == 10
        # the same stage again: reused, no episode
        n = len(pol.requests)
        assert b.calibrate(engine_policy(spec, wh), samples=2, policy_model="policy").reused
        assert len(pol.requests) == n

    kept = read_taskset(b.path("calibrated.parquet"))
    assert {t.metadata["question"] for t in kept.tasks} == {S1["question"], F_BEES["question"]}
    assert all(t.metadata["calibration"]["pass_rate"] == 0.5 for t in kept.tasks)

    warehouse = Warehouse(wh)
    ex = b.export(runs=warehouse.load_run)
    rows = pq.read_table(b.path("train.parquet")).to_pylist()
    assert sorted(r["extra_info"]["task_id"] for r in rows) == sorted(t.id for t in kept.tasks)
    sft = [json.loads(line) for line in b.path("sft.jsonl").read_text().splitlines()]
    assert len(sft) == 2 == ex.info["sft_rows"]  # one passing sample of each kept task
    row = sft[0]
    assert [t["function"]["name"] for t in row["tools"]] == ["execute_bash", "str_replace_editor", "submit"]
    roles = [m["role"] for m in row["messages"]]
    assert roles[:2] == ["system", "user"] and "tool" in roles
    call = next(m for m in row["messages"] if m.get("tool_calls"))["tool_calls"][0]
    assert call["function"]["name"] == "execute_bash" and isinstance(call["function"]["arguments"], dict)
    card = b.path("README.md").read_text()
    assert "| calibrate | 5 | 2 | 3 | all_fail=2, all_pass=1 |" in card
    assert cal.info["calibration_run"] in card

    with warehouse.query() as q:
        prov = q.rows("SELECT task_id, status, calibration_run, samples, passes, pass_rate, last_stage "
                      "FROM task_provenance")
        funnel = q.rows("SELECT stage, items_in, items_out, consistent FROM data_funnel")
    by_task = {r[0]: r for r in prov}
    for t in kept.tasks:
        assert by_task[t.id][1:] == ("kept", cal.info["calibration_run"], 2, 1, 0.5, "export")
    assert funnel[-2:] == [("calibrate", 5, 2, True), ("export", 2, 2, True)]
