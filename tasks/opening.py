"""Opening an episode's sandbox: its config (labelled with the episode), opening one or a
fork's several, and placing the task's directories and input files in it.

A sandbox that cannot be opened, or whose inputs cannot be placed, ends the episode as
`sandbox_error` (End): infrastructure, retried, never graded.
"""

from __future__ import annotations

import contextlib
import posixpath
import shlex
import time
from typing import Any

from datasets_prep.task import Task
from sandbox.base import Sandbox, SandboxConfig, SandboxError, SandboxLimits
from tasks.episode import End, Episode
from tasks.prompts import PromptSet
from tasks.records import EpisodeRecord
from tasks.tools import ToolBox


def place_inputs(sandbox: Sandbox, prompts: PromptSet, task: Task) -> None:
    """The task's directories and input files in the sandbox; SandboxError if that fails."""
    dirs = " ".join(shlex.quote(d) for d in (prompts.working_dir, prompts.input_dir, prompts.output_dir))
    r = sandbox.exec(f"mkdir -p {dirs}", timeout=60)
    if r.exit_code != 0:
        raise SandboxError(f"mkdir of the task directories failed: {r.stderr.strip()}")
    for name, data in task.input_files.items():
        sandbox.write_file(posixpath.join(prompts.input_dir, name), data)  # parents created


def place_task_inputs(sandbox: Sandbox, prompts: PromptSet, task: Task) -> None:
    """place_inputs, ending the episode (sandbox_error) if that fails."""
    try:
        place_inputs(sandbox, prompts, task)
    except SandboxError as exc:
        raise End("sandbox_error", f"placing the task's input files failed: {exc}") from None


def sandbox_config(
    sandbox_cfg: SandboxConfig | None, record: EpisodeRecord, task: Task
) -> SandboxConfig:
    """The sandbox's config, labelled with the episode it belongs to (gc finds it by label).

    A task's `metadata["network"]` (e.g. "allowlist:pypi.org *.pythonhosted.org:443")
    overrides the run's network policy for its episodes."""
    cfg = sandbox_cfg or SandboxConfig()
    update: dict[str, Any] = {"run_id": record.run_id, "episode_id": record.episode_id}
    spec = task.metadata.get("network")
    if spec is not None:
        try:
            update["limits"] = SandboxLimits.model_validate(
                {**cfg.limits.model_dump(exclude={"network", "egress_allow"}), "network": spec}
            )
        except (ValueError, TypeError) as exc:
            raise End(
                "sandbox_error", f"task {task.id}: metadata.network {str(spec)[:200]!r}: {exc}"
            ) from None
    return cfg.model_copy(update=update)


def open_sandboxes(cfgs: list[SandboxConfig]) -> list[Sandbox]:
    """One sandbox per config (a fork's children): docker's in parallel, bwrap's in this
    thread (its --die-with-parent is the starting thread's). SandboxError if one fails
    (the others are closed)."""
    import sandbox as sandbox_pkg

    boxes: list[Sandbox] = []
    errors: list[Exception] = []
    from sandbox.backends import capabilities

    if len(cfgs) > 1 and all(capabilities(c.backend).parallel_open for c in cfgs):
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(cfgs), thread_name_prefix="sandflow-fork-open") as pool:
            futures = [pool.submit(sandbox_pkg.acquire, c) for c in cfgs]
        for f in futures:
            try:
                boxes.append(f.result())
            except Exception as exc:  # noqa: BLE001 - raised below, after the closes
                errors.append(exc)
    else:
        for c in cfgs:
            try:
                boxes.append(sandbox_pkg.acquire(c))
            except Exception as exc:  # noqa: BLE001 - raised below, after the closes
                errors.append(exc)
                break
    if not errors:
        return boxes
    for box in boxes:
        with contextlib.suppress(Exception):
            box.close()
    raise SandboxError(f"could not open a fork's sandbox: {errors[0]}") from errors[0]


def open_sandbox(cfg: SandboxConfig) -> Sandbox:
    import sandbox as sandbox_pkg

    try:
        return sandbox_pkg.acquire(cfg)  # cfg.reuse: the warm pool or a fresh sandbox
    except SandboxError as exc:
        raise End("sandbox_error", f"could not open the sandbox: {exc}") from None
    except Exception as exc:  # engine unreachable, image missing: infrastructure
        raise End("sandbox_error", f"could not open the sandbox: {type(exc).__name__}: {exc}") from None




def enter(episode: Episode, sandbox: Sandbox, *, place: bool = True) -> ToolBox:
    """Make `sandbox` the episode's: its egress recorded with the turns, the task's inputs
    placed (`place`: a new episode; a continued one's sandbox holds them already), and
    the tools on it. The wall clock starts now: it is the model's time (its calls and its
    commands), so opening the sandbox and placing the inputs (a busy engine) do not use it."""
    episode.watch_egress(sandbox)
    if place:
        place_task_inputs(sandbox, episode.prompts, episode.task)
    toolbox = ToolBox(sandbox, episode.limits.max_observation_chars)
    if episode.limits.wall_clock_s:
        episode.deadline = time.monotonic() + episode.limits.wall_clock_s
    return toolbox
