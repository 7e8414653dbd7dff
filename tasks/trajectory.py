"""trajectory.json: one episode as a file a person (or the peer's tools) can read.

The peer's shape (`problem_statement`, `steps` of thought / actions / observations) plus
the full records: the append-only `messages` and the episode's record as `metadata`.
Written by `sandflow run` (through engine.single) next to records.jsonl.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tasks.loop import EpisodeResult


def trajectory_dict(result: EpisodeResult, query: str) -> dict[str, Any]:
    """The trajectory of `result` (the episode that answered `query`) as plain JSON data."""
    steps = []
    for t in result.turns:
        steps.append(
            {
                "thought": t.assistant_content or "",
                "reasoning_content": t.reasoning_content or "",
                "actions": [c.model_dump() for c in t.tool_calls],
                "observations": [o.model_dump() for o in t.observations],
                "metadata": {
                    "step": t.turn_index + 1,
                    "model_latency_s": t.model_latency_s,
                    "tool_latency_s": t.tool_latency_s,
                    "usage": t.usage.model_dump(),
                    "finish_reason": t.finish_reason,
                },
            }
        )
    return {
        "problem_statement": query,
        "steps": steps,
        "messages": result.messages,
        "metadata": result.record.model_dump(mode="json"),
    }


def write_trajectory(path: Path, result: EpisodeResult, query: str) -> Path:
    """Write trajectory.json (UTF-8, indented) and return its path."""
    path.write_text(
        json.dumps(trajectory_dict(result, query), indent=2, ensure_ascii=False, default=str),
        encoding="utf-8",
    )
    return path
