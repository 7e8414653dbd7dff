"""LLM-in-Sandbox-RL's own reward, in a venv of its own (the consumer's code, never a copy).

Its rllm environment (LLMinSandboxEnv.compute_final_reward) scores a row with
llm-in-sandbox's `instruct_pretrain` reward: `compute_score(answer, entry["ground_truth"],
**the entry without ground_truth)`, where the entry is the row's `extra_info` and the
answer is /testbed/answer.txt, stripped. That reward ships in the peer package
llm-in-sandbox 0.2.0 (it needs math-verify and rouge-score beside it); its litellm import
goes to the network unless LITELLM_LOCAL_MODEL_COST_MAP=True. Installed once into
the test-venv cache (tests/venvs.py; or SANDFLOW_LIS_RL_VENV), like every consumer venv.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from tests.venvs import lis_rl_env, venv

REPO = Path(__file__).resolve().parents[2]
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


def lis_rl_python() -> Path:
    """The venv's python, created (once) with the peer's reward and its scorers."""
    return venv("lis-rl")  # tests/venvs.py (built by scripts/setup.sh --test)


def lis_rl_scores(py: Path, cases: Iterable[tuple[str, Mapping[str, Any]]], tmp: Path) -> list[dict[str, Any]]:
    """Score (answer, extra_info) pairs with LLM-in-Sandbox-RL's reward, in its venv."""
    path = tmp / "lis_rl_cases.jsonl"
    with path.open("w", encoding="utf-8") as f:
        for answer, info in cases:
            f.write(json.dumps({"answer": answer, "extra_info": dict(info)}, ensure_ascii=False) + "\n")
    r = subprocess.run([str(py), "-c", _SCORE, str(path)], capture_output=True, text=True, timeout=900, env=lis_rl_env())
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])
