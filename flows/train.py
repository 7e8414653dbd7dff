"""The training flow: GRPO through TRL with sandflow's sandboxes as the environment.

    train_flow(TrainConfig(...).model_dump(mode="json"))  # or prefect.yaml's `train`

One Prefect flow run per training run; the work is rl.train.train (the library the CLI's
`sandflow train` calls too). Each optimizer step is logged by the flow's logger and, at the
end, the steps become a table artifact (the `training_steps` view holds the same rows).
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger

from flows import artifacts


@flow(name="sandflow-train", log_prints=False)
def train_flow(config: dict[str, Any]) -> dict[str, Any]:
    """`config`: rl.train.TrainConfig's fields (plain values, as Prefect stores them)."""
    from rl.train import StepRow, TrainConfig, train

    cfg = TrainConfig.model_validate(config)
    log = get_run_logger()

    def on_step(r: StepRow) -> None:
        log.info(
            "step %d/%d reward %s loss %s grad %s rollouts %d (dropped %d) %.1fs env %.1f%%",
            r.step, cfg.steps, r.reward_mean, r.loss, r.grad_norm, r.rollouts, r.dropped,
            r.wall_s, 100 * r.env_share,
        )

    result = train(cfg, on_step=on_step, on_phase=log.info)
    rows = [
        {"step": r.step, "reward_mean": r.reward_mean, "loss": r.loss, "grad_norm": r.grad_norm,
         "rollouts": r.rollouts, "dropped": r.dropped, "wall_s": round(r.wall_s, 2),
         "env_share": round(r.env_share, 4)}
        for r in result.steps
    ]
    if rows:
        artifacts.table(rows, artifacts.artifact_key("train", result.training_run), "training steps")
    return {
        "training_run": result.training_run,
        "run_id": result.run_id,
        "steps": len(result.steps),
        "stopped": result.stopped,
        "final_dir": str(result.final_dir) if result.final_dir else None,
        "weights_changed": result.weights_changed,
        "dropped": result.dropped,
    }
