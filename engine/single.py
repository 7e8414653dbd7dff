"""One interactive episode (`sandflow run`): a folder of files, a live view, a record.

The same engine as a run, for one task: the endpoint (or the embedded model, started
and stopped here) checked by the one preflight, the episode under the run's cancel
token, its records in <folder>/records.jsonl (and in a warehouse when asked, as a run of
its own whose status never stays `running`), the sandbox's output folder copied to
<folder>/files/, and trajectory.json (tasks.trajectory) at the end.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from datasets_prep.task import Task
from engine.cancel import CancelToken
from engine.run import preflight_model
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
    with endpoint(spec.to_model_config()) as cfg:
        cfg = preflight_model(cfg, model_given=model_given)
        folder.mkdir(parents=True, exist_ok=True)
        if on_ready is not None:
            on_ready(cfg)
        with JournalRecorder(folder / "records.jsonl") as journal:
            recorder, finish = _with_warehouse(journal, spec.warehouse, run_id, cfg, task)
            status = "interrupted"
            check = None
            try:
                if replay is not None:
                    from tasks.replay import ReplayDiverged, ReplayError, replay_episode

                    try:
                        played = replay_episode(
                            task, replay.parent, replay.turns, replay.until_turn, cfg,
                            spec.to_sandbox_config(run_id), recorder, run_id=run_id,
                            limits=spec.to_limits(), ignore=replay.ignore,
                            allow_divergence=replay.allow_divergence, output_dir=files,
                            prompt_dir=spec.prompt_dir, on_event=on_event, cancel=cancel,
                        )  # fmt: skip
                    except (ReplayDiverged, ReplayError):
                        status = "failed"
                        raise
                    result, check = played.result, played.check
                else:
                    result = run_episode(
                        task, cfg, spec.to_sandbox_config(run_id), recorder, mode=spec.mode,  # type: ignore[arg-type]
                        run_id=run_id, limits=spec.to_limits(),
                        output_dir=files if spec.mode == "sandbox" else None,
                        on_event=on_event, prompt_dir=spec.prompt_dir, cancel=cancel,
                    )  # fmt: skip
                status = "failed" if result.record.is_infra_failure else "finished"
                if result.record.termination == "interrupted":
                    status = "interrupted"
            finally:
                finish(status)
    write_trajectory(folder / "trajectory.json", result, task.problem_statement)
    rec = result.record
    if spec.mode == "llm" and rec.answer is not None:
        files.mkdir(parents=True, exist_ok=True)
        (files / "answer.txt").write_text(rec.answer + "\n", encoding="utf-8")
    return SingleResult(result, folder, cfg, check)


def _with_warehouse(
    journal: Any, root: str | None, run_id: str, cfg: ModelConfig, task: Task
) -> tuple[Any, Callable[[str], None]]:
    """The recorder: the journal, plus the warehouse (a run of its own) when asked. The run
    names the hash of the one task it ran, so `sandflow compare` never pairs it with a run
    of other tasks (an ad-hoc query has no ground truth: there is no task file to keep)."""
    if root is None:
        return journal, lambda status: None
    from datasets_prep.task import TaskSet
    from tasks.journal import TeeRecorder
    from warehouse import Warehouse

    wh = Warehouse(root)
    # Held like a run's (warehouse/runlock.py): if this process dies, readers see the run
    # interrupted instead of `running` forever.
    lock = wh.hold_run(run_id)
    lock.__enter__()
    wh.write_run(run_id, model=cfg.model, dataset="adhoc", status="running",
                 dataset_hash=TaskSet.model_construct(tasks=[task]).content_hash,
                 config={"form": "single", "model": cfg.public_dict()})  # fmt: skip
    if task.ground_truth is None:  # `sandflow run --query`: its files are the state a replay rebuilds
        wh.keep_adhoc_task(run_id, task)
    else:  # a replay's: its parent's task
        wh.keep_tasks(run_id, [task], name="single")
    writer = wh.writer()

    def finish(status: str) -> None:
        try:
            writer.close()
        finally:
            try:
                wh.finish_run(run_id, status=status)
            finally:
                lock.__exit__(None, None, None)

    return TeeRecorder(journal, writer), finish
