"""An SFT warm-up on tool-call examples, so that a tiny policy's GRPO groups have a spread.

The raw SmolLM2-135M never calls a tool: every rollout scores 0, no group has a reward
spread and GRPO has no gradient. A few supervised steps on short conversations in the
episode's own format (the same prompts, the same tool schemas rendered by the same chat
template, observations as the tool layer writes them) teach it to call `execute_bash` and
to submit as the prompt set's tools ask: `submit(answer=...)` with the small prompts, the
answer file and then `submit` with the paper's. The examples are made up here (arithmetic and files of their own),
never taken from the training tasks: the warm-up teaches the format, not the answers.
Only the assistant's tokens are trained.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from datasets_prep.task import Task
from sandbox.base import ExecResult
from tasks.loop import load_task_prompts
from tasks.prompts import load_prompts
from tasks.tool_schemas import submit_takes_answer
from tasks.tools import format_exec


def _call(name: str, **arguments: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def examples(n: int, prompt_dir: str | None = None, seed: int = 0) -> list[list[dict[str, Any]]]:
    """n conversations: the task's first messages, a shell call and its output, submit."""
    rng = random.Random(f"warmup:{seed}")
    out = []
    for i in range(n):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        if i % 2 == 0:
            op = rng.choice(["+", "*", "-"])
            value = str(eval(f"{a}{op}{b}"))  # noqa: S307 - two integers and an operator
            task = Task(id=f"warmup-{i}", domain="math", problem_statement=f"What is {a} {op} {b}?",
                        ground_truth=value, verifier="exact")
            command = f"python3 -c 'print({a} {op} {b})'"
        else:
            value = str(a * 100 + b)
            name = rng.choice(["number.txt", "value.txt", "data.txt"])
            task = Task(id=f"warmup-{i}", domain="general",
                        problem_statement=f"What number is written in the file {name}?",
                        ground_truth=value, verifier="exact", input_files={name: f"{value}\n"})
            command = f"cat /testbed/documents/{name}"
        prompts = load_task_prompts(task, prompt_dir)
        messages: list[dict[str, Any]] = list(prompts.sandbox_messages(task))
        observation = format_exec(ExecResult(stdout=value + "\n", exit_code=0), None)
        messages += [
            {"role": "assistant", "content": "", "tool_calls": [_call("execute_bash", command=command)]},
            {"role": "tool", "name": "execute_bash", "content": observation},
        ]
        if submit_takes_answer(prompts.tools):  # the answer in the call
            messages.append({"role": "assistant", "content": "", "tool_calls": [_call("submit", answer=value)]})
        else:  # the paper's contract: the answer file, then submit
            write = f"echo {value} > {prompts.answer_path}"
            messages += [
                {"role": "assistant", "content": "", "tool_calls": [_call("execute_bash", command=write)]},
                {"role": "tool", "name": "execute_bash", "content": format_exec(ExecResult(exit_code=0), None)},
                {"role": "assistant", "content": "", "tool_calls": [_call("submit")]},
            ]
        messages.append({"role": "tool", "name": "submit", "content": "Submitted."})
        out.append(messages)
    return out


def _ids_and_mask(tok: Any, messages: list[dict[str, Any]], tools: list[Any]) -> tuple[list[int], list[int]]:
    def render(msgs: list[dict[str, Any]], gen: bool) -> list[int]:
        enc = tok.apply_chat_template(msgs, tools=tools, tokenize=True, add_generation_prompt=gen)
        return list(enc["input_ids"] if hasattr(enc, "keys") else enc)

    full = render(messages, False)
    mask = [0] * len(full)
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start, end = len(render(messages[:k], True)), len(render(messages[: k + 1], False))
        for j in range(start, min(end, len(full))):
            mask[j] = 1
    return full, mask


def warm_up(
    model: Any,
    tok: Any,
    tasks: Sequence[Task] = (),
    *,
    steps: int = 8,
    lr: float = 5e-5,
    threads: int = 1,
    seed: int = 0,
    prompt_dir: str | None = None,
) -> list[float]:
    """`steps` AdamW steps, one made-up conversation each; returns the losses."""
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    tools = load_prompts("general", prompt_dir).tools  # what training renders (rl/train.py)
    convs = examples(steps, prompt_dir, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    losses = []
    for messages in convs:
        ids, mask = _ids_and_mask(tok, messages, tools)
        x = torch.tensor([ids])
        labels = torch.tensor([[t if m else -100 for t, m in zip(ids, mask, strict=True)]])
        loss = model(input_ids=x, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    del tasks  # the warm-up never sees the training tasks (only their format)
    return losses
