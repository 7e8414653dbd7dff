"""LLM-in-Sandbox-RL's own reward, in a venv of its own (the consumer's code, never a copy).

Its rllm environment (LLMinSandboxEnv.compute_final_reward) scores a row with
llm-in-sandbox's `instruct_pretrain` reward: `compute_score(answer, entry["ground_truth"],
**the entry without ground_truth)`, where the entry is the row's `extra_info` and the
answer is /testbed/answer.txt, stripped. That reward ships in the peer package
llm-in-sandbox 0.2.0 (it needs math-verify and rouge-score beside it); its litellm import
goes to the network unless LITELLM_LOCAL_MODEL_COST_MAP=True. Installed once into
tests/.venvs/lis-rl (or SANDFLOW_LIS_RL_VENV), as tests/interop/conftest.py does for harbor.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("llm-in-sandbox==0.2.0", "math-verify==0.9.0", "rouge-score==0.1.2")
VENV = Path(os.environ.get("SANDFLOW_LIS_RL_VENV") or REPO / "tests" / ".venvs" / "lis-rl")
_SCORE = r"""
import contextlib, io, json, sys
from llm_in_sandbox.benchmark.runner import load_reward_function
reward = load_reward_function("instruct_pretrain")  # what its rllm env calls for training
out = []
for line in open(sys.argv[1], encoding="utf-8"):
    case = json.loads(line)
    entry = case["extra_info"]
    kwargs = {k: v for k, v in entry.items() if k != "ground_truth"}
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):  # it prints (and swallows) its own errors
            score = float(reward(case["answer"].strip(), entry["ground_truth"], **kwargs))
        out.append({"score": score, "printed": printed.getvalue()[-500:]})
    except BaseException as e:  # an assertion on an unrouted domain...
        out.append({"error": f"{type(e).__name__}: {e}"[:300], "printed": printed.getvalue()[-500:]})
print(json.dumps(out))
"""


def _env() -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/root"),
            "LITELLM_LOCAL_MODEL_COST_MAP": "True"}


def lis_rl_python() -> Path:
    """The venv's python, created (once) with the peer's reward and its scorers."""
    py = VENV / "bin" / "python"
    probe = "import llm_in_sandbox.benchmark.runner, math_verify, rouge_score"
    if py.exists() and subprocess.run([str(py), "-c", probe], capture_output=True, env=_env()).returncode == 0:
        return py
    if VENV.exists():  # only ever a venv of ours: never remove anything else
        if not (VENV / "pyvenv.cfg").is_file():
            pytest.fail(f"{VENV} exists and is not a venv: set SANDFLOW_LIS_RL_VENV to a new folder")
        shutil.rmtree(VENV)
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    r = subprocess.run([str(VENV / "bin" / "pip"), "install", "-q", *PACKAGES], capture_output=True, text=True,
                       timeout=1500)
    if r.returncode != 0:
        pytest.fail(f"pip install {' '.join(PACKAGES)} failed: {(r.stderr or r.stdout)[-1500:]}")
    return py


def lis_rl_scores(py: Path, cases: Iterable[tuple[str, Mapping[str, Any]]], tmp: Path) -> list[dict[str, Any]]:
    """Score (answer, extra_info) pairs with LLM-in-Sandbox-RL's reward, in its venv."""
    path = tmp / "lis_rl_cases.jsonl"
    with path.open("w", encoding="utf-8") as f:
        for answer, info in cases:
            f.write(json.dumps({"answer": answer, "extra_info": dict(info)}, ensure_ascii=False) + "\n")
    r = subprocess.run([str(py), "-c", _SCORE, str(path)], capture_output=True, text=True, timeout=900, env=_env())
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])
