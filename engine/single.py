"""One interactive episode (`sandflow run`): a folder of files, a live view, a record.

The same engine as a run, for one task: the endpoint (or the embedded model, started
and stopped here) checked by the one preflight (engine.run.preflight_model), the episode
under the run's cancel token, its run through the engine's one path (engine.run.open_run:
the run's lock, its record `running`, its end by the engine's rules: `finished`, `failed`
for an infrastructure failure or a replay that could not be rebuilt, `interrupted`),
its records in <folder>/records.jsonl (and in the warehouse when asked), the sandbox's
output folder copied to <folder>/files/, and trajectory.json (tasks.trajectory) at the end.

The episode runs in the caller's thread, not through an executor: the live view draws
from its events and Ctrl+C lands inside it (recorded `interrupted`, then re-raised).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from datasets_prep.task import Task
from engine.cancel import CancelToken
from engine.plan import EpisodeSpec
from engine.retry import EpisodeCancelled, InfraFailure
from engine.run import RunHandle, open_run, preflight_model
from tasks.loop import EpisodeResult, EventHook, run_episode
from tasks.model import ModelConfig
from tasks.spec import RunSpec
from tasks.trajectory import write_trajectory

if TYPE_CHECKING:
    from engine.replay import ReplayPlan
    from tasks.replay import ReplayCheck


@dataclass
class SingleResult:
    result: EpisodeResult
    folder: Path
    model: ModelConfig  # what served it (the embedded model's address and name included)
    replay: ReplayCheck | None = None  # a replay's check of the rebuilt prefix

    def summary(self) -> str:
        """One line: how it ended, turns, time, tokens, the answer (cut at 80), the folder."""
        rec = self.result.record
        answer = (rec.answer or "").replace("\n", " ")
        answer = answer if len(answer) <= 80 else answer[:77] + "..."
        return (
            f"{rec.termination} after {rec.num_turns} turn(s) in {rec.wall_s:.1f}s "
            f"({rec.prompt_tokens} prompt + {rec.completion_tokens} completion tokens); "
            f"answer: {answer or '-'}; saved to {self.folder}"
        )


def new_stamp() -> str:
    """A UTC time to the millisecond: the folder's name, and in the run and task ids."""
    return datetime.now(UTC).strftime("%Y%m%d-%H%M%S-%f")[:-3]


def adhoc_task(query: str, domain: str, files: dict[str, str | bytes], stamp: str) -> Task:
    """An ad-hoc query as a task. It has no ground truth; every other check of a task holds
    (names, sizes, UTF-8, no secret of the environment in the query or the files):
    datasets_prep.task.TaskValidationError names what is wrong."""
    from datasets_prep.task import make_task

    row = {"id": f"adhoc-{stamp}", "domain": domain, "problem_statement": query,
           "ground_truth": None, "input_files": files}  # fmt: skip
    return make_task(row, "--query/--input-dir", adhoc=True)


def run_single(
    task: Task,
    spec: RunSpec,
    folder: Path,
    *,
    run_id: str,
    model_given: bool,
    on_event: EventHook | None = None,
    on_ready: Callable[[ModelConfig], object] | None = None,
    cancel: CancelToken | None = None,
    replay: ReplayPlan | None = None,
) -> SingleResult:
    """Run `task` once as `spec` says (mode, model, limits, sandbox), recorded in `folder`.

    Raises engine.RunConfigError (unreachable endpoint, unserved model name) before any
    sandbox starts or any file is written; tasks.local_model.LocalModelError when the
    embedded model cannot start; KeyboardInterrupt after recording the episode as
    interrupted (partial records stay in the folder).

    replay (engine.replay.plan_replay): rebuild that episode's state to its turn and go on
    from there (tasks.replay.replay_episode); ReplayError / ReplayDiverged propagate (the
    run is recorded `failed`, with no episode).
    """
    from tasks.journal import JournalRecorder
    from tasks.local_model import endpoint

    files = folder / "files"
    token = cancel or CancelToken()
    # constructed, not validated: an ad-hoc query's task has no ground truth
    ep = EpisodeSpec.model_construct(run_id=run_id, task=task, mode=spec.mode, sample_index=0)
    with endpoint(spec.to_model_config()) as cfg:
        cfg = preflight_model(cfg, model_given=model_given)
        folder.mkdir(parents=True, exist_ok=True)
        if on_ready is not None:
            on_ready(cfg)
        with JournalRecorder(folder / "records.jsonl") as journal, _run(journal, spec.recording.warehouse, ep, cfg, token) as (recorder, run):
            check = None
            if replay is not None:
                from tasks.replay import ReplayDiverged, ReplayError, replay_episode

                try:
                    played = replay_episode(
                        task, replay.parent, replay.turns, replay.until_turn, cfg,
                        spec.to_sandbox_config(run_id), recorder, run_id=run_id,
                        limits=spec.to_limits(), ignore=replay.ignore,
                        allow_divergence=replay.allow_divergence, output_dir=files,
                        prompt_dir=spec.prompt_dir, on_event=on_event, cancel=token,
                    )  # fmt: skip
                except (ReplayDiverged, ReplayError) as exc:
                    run.ran_here([(ep, exc)])  # the run `failed`, with no episode
                    raise
                result, check = played.result, played.check
            else:
                result = run_episode(
                    task, cfg, spec.to_sandbox_config(run_id), recorder, mode=spec.mode,  # type: ignore[arg-type]
                    run_id=run_id, limits=spec.to_limits(),
                    output_dir=files if spec.mode == "sandbox" else None,
                    on_event=on_event, prompt_dir=spec.prompt_dir, cancel=token,
                )  # fmt: skip
            run.ran_here([(ep, _as_finished(result, ep, token))])
    write_trajectory(folder / "trajectory.json", result, task.problem_statement)
    rec = result.record
    if spec.mode == "llm" and rec.answer is not None:
        files.mkdir(parents=True, exist_ok=True)
        (files / "answer.txt").write_text(rec.answer + "\n", encoding="utf-8")
    return SingleResult(result, folder, cfg, check)


def _as_finished(result: EpisodeResult, ep: EpisodeSpec, token: CancelToken) -> Any:
    """The episode as the engine counts one (engine.run.RunHandle): interrupted (Ctrl+C
    removed its sandbox, or its token was cancelled) is a cancelled run, an infrastructure
    failure a failed one, anything else the model's own result."""
    rec = result.record
    if rec.termination == "interrupted":
        token.cancel(rec.error or "the episode was interrupted")
        return EpisodeCancelled(f"episode {ep.key} stopped: {token.reason}")
    if rec.is_infra_failure:
        return InfraFailure(f"{ep.label}: {rec.termination}", result, run_id=ep.run_id)
    return result


@contextlib.contextmanager
def _run(
    journal: Any, root: str | None, ep: EpisodeSpec, cfg: ModelConfig, token: CancelToken
) -> Iterator[tuple[Any, RunHandle]]:
    """The episode's run through the engine (engine.run.open_run: no lock and no record
    without a warehouse) and its recorder: the journal, plus the warehouse when asked. The
    run names the hash of the one task it ran, so `sandflow compare` never pairs it with a
    run of other tasks (an ad-hoc query has no ground truth: there is no task file to keep)."""
    wh = None
    if root is not None:
        from warehouse import Warehouse

        wh = Warehouse(root)
    # Held like a run's (warehouse/runlock.py): if this process dies, readers see the run
    # interrupted instead of `running` forever.
    with open_run(wh, ep.run_id, token) as run:
        if wh is None:
            yield journal, run
            return
        from datasets_prep.task import TaskSet
        from tasks.journal import TeeRecorder

        task = ep.task
        run.record(model=cfg.model, dataset="adhoc",
                   dataset_hash=TaskSet.model_construct(tasks=[task]).content_hash,
                   config={"form": "single", "model": cfg.public_dict()})  # fmt: skip
        if task.ground_truth is None:  # `sandflow run --query`: its files are the state a replay rebuilds
            wh.keep_adhoc_task(ep.run_id, task)
        else:  # a replay's: its parent's task
            wh.keep_tasks(ep.run_id, [task], name="single")
        writer = wh.writer()
        try:
            yield TeeRecorder(journal, writer), run
        finally:
            writer.close()  # before the run's end is recorded (open_run)
