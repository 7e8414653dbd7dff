"""`sandflow train`: GRPO through TRL with sandflow's sandboxes as the environment (rl/train.py,
docs/train.md). Thin: the flags and settings become a TrainConfig, one library call runs
the training, a progress line per step is printed."""

from __future__ import annotations

from pathlib import Path

import typer

from sandflow.commands.prompts_option import prompts_option


def train(
    tasks: str = typer.Option(
        "smoke", "--tasks", "-t",
        help="Task set: a built-in suite, a task-set file (a `data build` output) or a table "
        "(with --mapping); every task needs a verifier.",
    ),
    mapping: str | None = typer.Option(None, "--mapping", help="Column mapping for a table (docs/datasets.md)."),
    size: int | None = typer.Option(None, "--size", min=1, help="Take this many tasks."),
    policy: str = typer.Option(
        "embedded", "--policy", "-m",
        help="'embedded' (SmolLM2-135M from its GGUF file) or a local Hugging Face model folder.",
    ),
    name: str | None = typer.Option(None, "--name", help="The training run's name (default train-<time>)."),
    output: Path = typer.Option(Path("train_output"), "--output", "-o", help="Checkpoints and the final policy."),
    warehouse: Path | None = typer.Option(
        None, "--warehouse", "-w", help="Where rollouts and steps go (env SANDFLOW_WAREHOUSE)."
    ),
    steps: int = typer.Option(4, "--steps", min=1, help="Optimizer steps."),
    prompts_per_step: int = typer.Option(2, "--prompts-per-step", min=1, help="Distinct tasks per step."),
    generations: int = typer.Option(4, "--generations", "-n", min=2, help="Rollouts per task (the group)."),
    max_completion: int = typer.Option(
        128, "--max-completion-tokens", min=8, help="Tokens per rollout, tool results included."
    ),
    max_tool_calls: int = typer.Option(8, "--max-tool-calls", min=1, help="Tool-calling turns per rollout."),
    lr: float = typer.Option(1e-5, "--lr", min=0.0, help="Learning rate."),
    beta: float = typer.Option(0.0, "--beta", min=0.0, help="KL coefficient (0: no reference model)."),
    checkpoint_every: int = typer.Option(0, "--checkpoint-every", min=0, help="Save a checkpoint every N steps."),
    resume: Path | None = typer.Option(None, "--resume", help="Go on from this checkpoint folder."),
    warmup: int = typer.Option(0, "--warmup-steps", min=0, help="SFT warm-up steps on tool-call examples first."),
    prompts: str = prompts_option("sandflow"),
    backend: str | None = typer.Option(None, "--backend", help="Sandbox backend: docker or bwrap."),
    threads: int = typer.Option(1, "--threads", min=1, help="Torch threads (1 on a shared CPU)."),
    gpu: bool = typer.Option(False, "--gpu", help="Train on the GPU torch finds (default: CPU)."),
    vllm: bool = typer.Option(False, "--vllm", help="Generate with vLLM colocated on the GPU (with --gpu)."),
    max_run_tokens: int | None = typer.Option(
        None, "--max-run-tokens", min=1, help="Stop after a step once the rollouts used this many tokens."
    ),
    max_wall: float | None = typer.Option(None, "--max-wall", min=1.0, help="Stop after a step past this many seconds."),
    seed: int = typer.Option(0, "--seed"),
    evaluate: str | None = typer.Option(
        None, "--evaluate",
        help="Then benchmark the policy GRPO started from and the trained one on this held-out task set "
        "(`sandflow bench --checkpoint`, both through the embedded server) and print `sandflow compare`.",
    ),
    evaluate_mode: str = typer.Option("sandbox", "--evaluate-mode", help="sandbox | llm | both (with --evaluate)."),
) -> None:
    """Train a policy with GRPO in sandflow's sandboxes (CPU by default): every rollout an
    episode in the warehouse, one `training_steps` row per step (docs/train.md)."""
    from pydantic import ValidationError

    from rl.train import TrainConfig, TrainInputError, check_config
    from rl.train import train as run_training
    from sandflow.config import command_settings
    from sandflow.errors import EXIT_INTERRUPTED, EXIT_USAGE, console, err_console, fail

    settings = command_settings(warehouse=warehouse, backend=backend)
    try:
        cfg = TrainConfig(
            tasks=tasks, mapping=mapping, size=size, seed=seed, policy=policy, training_run=name,
            output_dir=output, warehouse=Path(settings.warehouse), steps=steps,
            prompts_per_step=prompts_per_step, generations=generations,
            max_completion_length=max_completion, max_tool_calls=max_tool_calls,
            learning_rate=lr, beta=beta, checkpoint_every=checkpoint_every, resume=resume,
            warmup_steps=warmup, prompts=prompts, backend=settings.backend, threads=threads, gpu=gpu, vllm=vllm,
            max_run_tokens=max_run_tokens, max_wall_s=max_wall, save_initial=evaluate is not None,
        )
        check_config(cfg)  # bad input: one sentence, exit 2, before any model or sandbox
        if evaluate is not None:
            check_heldout(evaluate, evaluate_mode)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise fail(f"{'.'.join(str(x) for x in first['loc'])}: {first['msg']}", EXIT_USAGE) from None
    except TrainInputError as exc:
        raise fail(str(exc), EXIT_USAGE) from None
    if importlib_missing("trl"):
        raise fail("sandflow train needs the extra `train`: bash scripts/setup.sh --train", EXIT_USAGE)

    out = console()
    note = err_console()

    def step_line(r: object) -> None:
        from rl.train import StepRow

        assert isinstance(r, StepRow)
        fmt = lambda v, d=3: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
        out.print(
            f"step {r.step}/{cfg.steps}  reward {fmt(r.reward_mean)} ± {fmt(r.reward_std)}  "
            f"loss {fmt(r.loss, 4)}  grad {fmt(r.grad_norm, 2)}  rollouts {r.rollouts} "
            f"(dropped {r.dropped})  {r.wall_s:.1f}s (generation {r.generation_s:.1f}, "
            f"sandbox {r.sandbox_s:.1f}, reward {r.reward_s:.1f}, optimizer {r.optimizer_s:.1f}; "
            f"env {100 * r.env_share:.1f}%)",
            soft_wrap=True, highlight=False,
        )

    result = run_training(cfg, on_step=step_line, on_phase=lambda s: note.print(s, soft_wrap=True, highlight=False))
    out.print(
        f"training run {result.training_run}: {len(result.steps)} step(s), {result.stopped}; "
        f"rollouts in run {result.run_id} of {cfg.warehouse}; "
        f"sandflow sql \"SELECT * FROM training_steps WHERE training_run = '{result.training_run}'\"",
        soft_wrap=True, highlight=False,
    )
    if result.report is not None:
        out.print(f"report and curve: {result.report} (training_curve.png beside it)", soft_wrap=True, highlight=False)
    if result.final_dir is not None:
        out.print(f"final policy: {result.final_dir}", soft_wrap=True, highlight=False)
    if result.stopped == "interrupted":
        raise typer.Exit(EXIT_INTERRUPTED)
    if evaluate is not None and result.final_dir is not None:
        evaluate_policies(result.training_run, Path(cfg.output_dir), evaluate, evaluate_mode,
                          Path(settings.warehouse), max_steps=cfg.max_tool_calls + 1, backend=cfg.backend)


def check_heldout(source: str, mode: str) -> None:
    """--evaluate's task set loads and --evaluate-mode is a mode (else TrainInputError)."""
    from datasets_prep.prepare import load_taskset
    from datasets_prep.sources import SourceMissing
    from datasets_prep.suites import UnknownSuite
    from rl.train import TrainInputError

    if mode not in ("sandbox", "llm", "both"):
        raise TrainInputError(f"--evaluate-mode {mode!r}: use sandbox, llm or both")
    try:
        load_taskset(source)
    except (ValueError, OSError, UnknownSuite, SourceMissing) as exc:
        raise TrainInputError(f"--evaluate {source}: {str(exc).strip(chr(39) + chr(34))}") from None


def evaluate_policies(training_run: str, output: Path, source: str, mode: str, warehouse: Path,
                      *, max_steps: int, backend: str) -> tuple[str, str]:
    """The closed loop's last stage: `sandflow bench --checkpoint` of <output>/initial (the
    policy GRPO started from) and <output>/final on the held-out `source`, one run each in
    `warehouse`, then `sandflow compare` of the two (the nightly report's paired exact test).
    Each bench is its own process: the embedded server serves one model file per process."""
    import os
    import subprocess
    import sys

    from sandflow.errors import console

    out = console()
    env = {**os.environ, "SANDFLOW_BACKEND": backend}  # the training's sandbox backend
    runs = {label: f"{training_run}-{label}" for label in ("base", "trained")}
    for label, folder in (("base", output / "initial"), ("trained", output / "final")):
        out.print(f"evaluate: {label} policy {folder} on {source} (run {runs[label]})", soft_wrap=True, highlight=False)
        subprocess.run(
            [sys.executable, "-m", "sandflow.cli", "bench", "--suite", source, "--checkpoint", str(folder),
             "--mode", mode, "--no-rollouts", "--warehouse", str(warehouse), "--run-id", runs[label],
             "--max-steps", str(max_steps), "--series", f"{training_run}-{label}"],
            check=False, env=env,
        )  # fmt: skip
    subprocess.run([sys.executable, "-m", "sandflow.cli", "compare", runs["base"], runs["trained"],
                    "--warehouse", str(warehouse)], check=False, env=env)  # fmt: skip
    out.print(
        f"curve: {output / 'training_curve.png'} (viewer: sandflow view, /training/{training_run}); comparison: "
        f"sandflow compare {runs['base']} {runs['trained']} -w {warehouse}",
        soft_wrap=True, highlight=False,
    )
    return runs["base"], runs["trained"]


def serve_checkpoint(checkpoint: Path, base_url: str | None, prompts: str | None) -> str | None:
    """`sandflow bench --checkpoint DIR`: the trained policy converted to GGUF (rl/export_gguf.py)
    and made the embedded model of this process, under a name of its own. Returns the
    prompt set to benchmark it on: `prompts` if given, else the one it was trained on (its
    sandflow_policy.json), so it is offered the tools it learned. Not a checkpoint of the
    embedded model, or no weights: one sentence, exit 2."""
    import contextlib
    import json
    import time

    from rl.export_gguf import CheckpointError, export_gguf, trained_prompts, trained_tool_format
    from sandflow.errors import EXIT_USAGE, err_console, fail
    from tasks import local_model

    if base_url:
        raise fail("--checkpoint is served by the embedded model: drop --base-url (or SANDFLOW_BASE_URL)", EXIT_USAGE)
    if importlib_missing("gguf") or importlib_missing("safetensors"):
        raise fail("--checkpoint needs the extra `train` (gguf): bash scripts/setup.sh --train", EXIT_USAGE)
    t = time.monotonic()
    try:
        gguf = export_gguf(checkpoint)
        tool_format = trained_tool_format(checkpoint)
    except (CheckpointError, local_model.LocalModelError) as exc:
        raise fail(str(exc), EXIT_USAGE) from None
    run = checkpoint.name
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):  # no mark: the folder's name
        run = f"{json.loads((checkpoint / 'sandflow_policy.json').read_text())['training_run']}/{checkpoint.name}"
    alias = f"{local_model.DEFAULT_ALIAS}@{run}"[:200]
    local_model.configure(gguf, alias=alias, tool_format=tool_format)
    err_console().print(f"checkpoint {checkpoint} as {gguf} ({time.monotonic() - t:.1f}s), served as {alias} "
                        f"(tools in the {tool_format} format it was trained in)",
                        soft_wrap=True, highlight=False)
    return prompts if prompts is not None else trained_prompts(checkpoint)


def importlib_missing(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is None


def register(app: typer.Typer) -> None:
    app.command("train", rich_help_panel="RL")(train)
