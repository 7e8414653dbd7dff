"""The tokens flow: prompt / completion tokens per episode, per domain x mode, and the
sandbox-to-LLM ratio (the paper: up to 8x fewer on long-context, 0.5-0.8x overall)."""

from __future__ import annotations

from typing import Any

from prefect import flow

from analysis import metrics
from flows import artifacts
from warehouse import DEFAULT_ROOT, Warehouse


@flow(name="sandflow-tokens", log_prints=False)
def tokens_flow(run_id: str, warehouse: str = DEFAULT_ROOT) -> dict[str, Any]:
    data = Warehouse(warehouse).load_run(run_id, with_turns=False)
    rows = metrics.episode_tokens(data)
    summary = metrics.token_summary(rows)
    ratio = metrics.sandbox_llm_ratio(rows)
    artifacts.table(summary, artifacts.artifact_key("tokens", run_id), f"Tokens of run {run_id}")
    return {"run_id": run_id, "summary": summary, "sandbox_to_llm": ratio, "episodes": len(rows)}
