"""Benchmark: a GRPO step with sandflow as TRL's environment (rl/train.py, docs/train.md).

The embedded SmolLM2-135M (from its GGUF file), optionally warmed up on tool-call examples
(rl/warmup.py), takes `--steps` GRPO steps through `SandflowGRPOTrainer` on tasks a tiny
policy sometimes solves (arithmetic and files whose number the shell finds; rewarded by
their exact verifier), every rollout an episode in a real sandbox and the warehouse.

`env_share_of_step` is the environment's share of a step's wall time: sandboxes from the
pool, tool calls, answers read, episodes recorded and verifiers, over the step (target
<= 0.10 on CPU with the default policy). Floor in the same run: the same steps with TRL's
stateless tool mode (`GRPOTrainer(tools=[...])`: plain functions answering at once, no
sandbox, no records) on the same model and settings: `floor_step_s`.

    .venv/bin/python benchmarks/train.py [--steps 2] [--warmup 8] [--backend bwrap|docker]
        [--prompts-per-step 2] [--generations 4] [--max-completion 96] [--threads 1]

Ends with ONE JSON line (benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from datasets_prep.task import Task  # noqa: E402

TARGET_ENV_SHARE = 0.10


def bench_tasks(n: int, seed: int = 0, prefix: str = "") -> list[Task]:
    """Tasks the warmed-up 135M policy sometimes solves (not the warm-up's own examples)."""
    rng = random.Random(f"bench-train:{seed}")
    tasks = []
    for i in range(n):
        a, b = rng.randint(2, 60), rng.randint(2, 60)
        if i % 2 == 0:
            tasks.append(Task(id=f"{prefix}add-{i}", domain="math", problem_statement=f"What is {a} + {b}?",
                              ground_truth=str(a + b), verifier="exact"))
        else:
            v = str(rng.randint(100, 999))
            tasks.append(Task(id=f"{prefix}file-{i}", domain="general",
                              problem_statement="What number is written in the file secret.txt?",
                              ground_truth=v, verifier="exact", input_files={"secret.txt": v + "\n"}))
    return tasks


def write_loop_tasks(out: Path, train_n: int = 16, heldout_n: int = 8) -> None:
    """The closed loop's task sets: training and held-out tasks of the same kinds, other
    numbers (no held-out problem is a training problem)."""
    from datasets_prep.io import write_taskset
    from datasets_prep.task import TaskSet

    train = bench_tasks(train_n, seed=0)
    seen = {t.problem_statement for t in train if not t.input_files} | {
        next(iter(t.input_files.values())) for t in train if t.input_files}
    heldout = [t for t in bench_tasks(heldout_n * 3, seed=1, prefix="heldout-")
               if (next(iter(t.input_files.values())) if t.input_files else t.problem_statement) not in seen]
    out.mkdir(parents=True, exist_ok=True)
    for name, tasks in (("train", train), ("heldout", heldout[:heldout_n])):
        path = write_taskset(TaskSet.build(tasks, name=f"loop-{name}", source="benchmarks/train.py"),
                             out / f"{name}.parquet")
        print(f"{path}: {len(tasks)} tasks")


# TRL's stateless tool mode: plain functions (the floor)
def execute_bash(command: str) -> str:
    """Run a bash command in the sandbox's shell; returns its output and exit code.

    Args:
        command: The command, e.g. `cat /testbed/documents/notes.txt`.
    """
    return "[exit code: 0]"


def str_replace_editor(command: str, path: str, file_text: str | None = None, old_str: str | None = None,
                       new_str: str | None = None, insert_line: int | None = None,
                       view_range: list[int] | None = None) -> str:
    """View, create or edit a file.

    Args:
        command: view, create, str_replace, insert or undo_edit.
        path: Absolute path.
        file_text: For create.
        old_str: For str_replace: the text to replace.
        new_str: For str_replace and insert.
        insert_line: For insert: after this line.
        view_range: For view: [start, end].
    """
    return "ok"


def submit(answer: str | None = None) -> str:
    """Finish the task.

    Args:
        answer: The final answer (else /testbed/output/answer.txt is read).
    """
    return "Submitted."


def _zero_reward(completions: list[Any], **kw: Any) -> list[float | None]:
    return [0.0] * len(completions)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--backend", default="bwrap", choices=["bwrap", "docker"])
    ap.add_argument("--prompts-per-step", type=int, default=2)
    ap.add_argument("--generations", type=int, default=4)
    ap.add_argument("--max-completion", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--floor-steps", type=int, default=1, help="steps of the floor (0: none)")
    ap.add_argument("--write-tasks", type=Path, default=None, metavar="DIR",
                    help="only write these tasks as DIR/train.parquet (16) and DIR/heldout.parquet (8, "
                         "other numbers), the closed loop's data (docs/train.md), and exit")
    a = ap.parse_args()
    if a.write_tasks is not None:
        write_loop_tasks(a.write_tasks)
        return

    import torch

    from rl.recording import RolloutTags
    from rl.train import TrainConfig, load_policy, make_trainer
    from rl.trl_env import RolloutSession
    from rl.warmup import warm_up
    from sandbox.base import SandboxConfig, SandboxLimits
    from sandbox.pool import pool_for
    from tasks.loop import Limits
    from tasks.prompts import PROMPT_SETS
    from warehouse.store import Warehouse

    torch.set_num_threads(a.threads)
    t = time.perf_counter()
    model, tok = load_policy()
    load_s = time.perf_counter() - t
    print(f"policy loaded in {load_s:.1f}s", flush=True)
    warm_losses: list[float] = []
    if a.warmup:
        t = time.perf_counter()
        warm_losses = warm_up(model, tok, steps=a.warmup, threads=a.threads, prompt_dir=str(PROMPT_SETS["small"]))
        print(f"warm-up: {a.warmup} steps in {time.perf_counter() - t:.1f}s, loss "
              f"{warm_losses[0]:.3f} -> {warm_losses[-1]:.3f}", flush=True)

    tmp = Path(tempfile.mkdtemp(prefix="sandflow-bench-train-"))
    tasks = bench_tasks(max(8, a.prompts_per_step * a.steps))
    cfg = TrainConfig(steps=a.steps, prompts_per_step=a.prompts_per_step, generations=a.generations,
                      max_completion_length=a.max_completion, max_tool_calls=4, learning_rate=a.lr,
                      output_dir=tmp / "out", warehouse=tmp / "wh", save_final=False, threads=a.threads)
    session = RolloutSession(
        warehouse=tmp / "wh",
        sandbox=SandboxConfig(backend=a.backend, reuse="pool", limits=SandboxLimits(network="none")),
        limits=Limits(max_steps=5, wall_clock_s=1800),
        tags=RolloutTags(training_run="bench-train"),
        policy="smollm2-135m-instruct",
        prompt_dir=PROMPT_SETS["small"],
    )
    pool_for(session.sandbox).prewarm(a.prompts_per_step * a.generations, wait=True)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = make_trainer(model, tok, session, tasks, cfg)
    try:
        trainer.train()
    finally:
        session.close()
        pool_for(session.sandbox).close()
    weights_changed = int(any(not torch.equal(before[n], p.detach()) for n, p in model.named_parameters()))
    steps = trainer.sandflow_steps
    with Warehouse(tmp / "wh").query() as q:
        view = q.sql("SELECT step, rollouts_recorded, groups, groups_with_spread, reward_mean, pass_rate "
                     "FROM training_steps ORDER BY step").fetchall()
    rollouts_recorded = sum(v[1] or 0 for v in view)
    groups = sum(v[2] or 0 for v in view)
    spread = sum(v[3] or 0 for v in view)
    step_s = [s.wall_s for s in steps]
    env_share = [s.env_share for s in steps]
    for s, v in zip(steps, view, strict=False):
        print(f"step {s.step}: {s.wall_s:.1f}s (generation {s.generation_s:.1f}, sandbox {s.sandbox_s:.2f}, "
              f"reward {s.reward_s:.2f}, optimizer {s.optimizer_s:.1f}) env {100 * s.env_share:.1f}% "
              f"reward {v[4]} pass {v[5]} groups with spread {v[3]}/{v[2]}", flush=True)

    floor_s: list[float] = []
    if a.floor_steps:
        from trl import GRPOConfig, GRPOTrainer

        rows = session.dataset_rows(tasks)
        from datasets import Dataset

        ds = Dataset.from_list([{"prompt": r["prompt"]} for r in rows])
        args = GRPOConfig(output_dir=str(tmp / "floor"), max_steps=a.floor_steps,
                          per_device_train_batch_size=a.prompts_per_step * a.generations,
                          num_generations=a.generations, max_completion_length=a.max_completion,
                          max_tool_calling_iterations=4, learning_rate=a.lr, logging_steps=1,
                          save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=0)


        from transformers import TrainerCallback

        class StepTimer(TrainerCallback):
            def on_step_begin(self, *x: Any, **k: Any) -> None:
                self.t = time.perf_counter()

            def on_step_end(self, *x: Any, **k: Any) -> None:
                floor_s.append(time.perf_counter() - self.t)

        floor = GRPOTrainer(model=model, args=args, train_dataset=ds, processing_class=tok,
                            tools=[execute_bash, str_replace_editor, submit],
                            reward_funcs=_zero_reward,
                            callbacks=[StepTimer()])
        floor.train()

    n = len(steps)
    rollouts = sum(s.rollouts for s in steps)
    result = {
        "benchmark": "train",
        "env_share_of_step": round(statistics.mean(env_share), 4) if env_share else None,
        "env_share_max": round(max(env_share), 4) if env_share else None,
        "steps": n,
        "weights_changed": weights_changed,
        "rollouts_recorded": rollouts_recorded,
        "groups": groups,
        "groups_with_spread": spread,
        "groups_with_spread_share": round(spread / groups, 3) if groups else None,
        "rollouts_per_s": round(rollouts / sum(step_s), 4) if step_s else None,
        "step_s": round(statistics.mean(step_s), 2) if step_s else None,
        "floor_step_s": round(statistics.mean(floor_s), 2) if floor_s else None,
        "step_over_floor": round(statistics.mean(step_s) / statistics.mean(floor_s), 3)
        if floor_s and step_s else None,
        "dropped": sum(s.dropped for s in steps),
        "warmup_steps": a.warmup,
        "warmup_loss": [round(warm_losses[0], 3), round(warm_losses[-1], 3)] if warm_losses else None,
        "policy_load_s": round(load_s, 1),
        "backend": a.backend,
        "threads": a.threads,
        "target_env_share": TARGET_ENV_SHARE,
        "pass": bool(env_share) and statistics.mean(env_share) <= TARGET_ENV_SHARE and weights_changed == 1,
    }
    print(f"env_share_of_step {result['env_share_of_step']} (target <= {TARGET_ENV_SHARE}); "
          f"{n} steps, weights_changed {weights_changed}, rollouts_recorded {rollouts_recorded}, "
          f"groups_with_spread {spread}/{groups}, {result['rollouts_per_s']} rollouts/s; "
          f"step {result['step_s']}s vs stateless floor {result['floor_step_s']}s")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
