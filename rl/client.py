"""A small client for the rollout server (rl.server).

    from rl.client import RolloutClient
    with RolloutClient("http://127.0.0.1:8770") as client:
        for event in client.stream(request):           # NDJSON events as they come
            ...
        result = client.rollouts(request)              # or all of it, advantages merged
        for t in result.trajectories: t["reward"], t["advantage_rloo"], t["response_ids"]
        # tree rollouts (request["branching"]): t["branch_advantages"], result.branch_points

Leaving `stream` early (break, an exception, Ctrl+C) closes the connection, which
cancels the batch's remaining episodes on the server and removes their sandboxes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from datasets_prep.closing import ClosedOnExit


class RolloutServerError(RuntimeError):
    """The server refused the request or broke the stream (the message says why)."""


@dataclass
class RolloutResult:
    run_id: str | None = None
    trajectories: list[dict[str, Any]] = field(default_factory=list)
    groups: list[dict[str, Any]] = field(default_factory=list)
    branch_points: list[dict[str, Any]] = field(default_factory=list)  # tree rollouts (rl.tree)
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> list[dict[str, Any]]:
        """Trajectories a trainer can learn from: finished, rewarded, advantages set."""
        return [
            t for t in self.trajectories if t.get("status") == "ok" and t.get("reward") is not None
        ]


class RolloutClient(ClosedOnExit):
    def __init__(self, url: str = "http://127.0.0.1:8770", timeout_s: float | None = None) -> None:
        self.url = url.rstrip("/")
        # No read timeout by default: a batch streams for as long as its episodes run.
        self._http = httpx.Client(timeout=httpx.Timeout(30.0, read=timeout_s))

    def close(self) -> None:
        self._http.close()

    def health(self) -> dict[str, Any]:
        r = self._http.get(f"{self.url}/v1/health")
        r.raise_for_status()
        return dict(r.json())

    def stream(self, request: Mapping[str, Any] | Any) -> Iterator[dict[str, Any]]:
        """POST the request; yield each event (start, trajectory, group, branch_point, done)."""
        body = _body(request)
        with self._http.stream("POST", f"{self.url}/v1/rollouts", json=body) as resp:
            if resp.status_code != 200:
                resp.read()
                try:
                    data = resp.json()
                    why = data.get("error") or data.get("detail")
                except ValueError:
                    why = resp.text[:500]
                raise RolloutServerError(
                    f"the rollout server refused the request ({resp.status_code}): {why}"
                )
            for line in resp.iter_lines():
                if not line.strip():
                    continue
                event = json.loads(line)
                if event.get("type") == "error":
                    raise RolloutServerError(str(event.get("error")))
                yield event

    def rollouts(self, request: Mapping[str, Any] | Any) -> RolloutResult:
        """The whole batch, each trajectory with its group's advantages merged in."""
        result = RolloutResult()
        by_id: dict[str, dict[str, Any]] = {}
        for event in self.stream(request):
            kind = event.get("type")
            if kind == "start":
                result.run_id = event.get("run_id")
            elif kind == "trajectory":
                event.setdefault("advantage_grpo", None)
                event.setdefault("advantage_rloo", None)
                result.trajectories.append(event)
                by_id[event["episode_id"]] = event
            elif kind == "group":
                result.groups.append(event)
                for i, ep in enumerate(event.get("episode_ids", [])):
                    if ep in by_id:
                        by_id[ep]["advantage_grpo"] = event["advantage_grpo"][i]
                        by_id[ep]["advantage_rloo"] = event["advantage_rloo"][i]
            elif kind == "branch_point":  # each leaf gets its sibling's advantage there
                result.branch_points.append(event)
                for i, leaves in enumerate(event.get("leaves", [])):
                    for ep in leaves:
                        if ep in by_id:
                            by_id[ep].setdefault("branch_advantages", []).append(
                                {
                                    "parent_episode_id": event["parent_episode_id"],
                                    "branch_turn": event["branch_turn"],
                                    "advantage_grpo": event["advantage_grpo"][i],
                                    "advantage_rloo": event["advantage_rloo"][i],
                                }
                            )
            elif kind == "done":
                result.summary = event
        if not result.summary:
            raise RolloutServerError("the stream ended before the batch was done")
        return result


def _body(request: Mapping[str, Any] | Any) -> dict[str, Any]:
    """A RolloutRequest or a dict -> JSON body (the endpoint's API key included, as sent)."""
    if hasattr(request, "model_dump"):
        body = request.model_dump(mode="json", exclude_none=True)
        key = getattr(getattr(request, "endpoint", None), "api_key", None)
        if key is not None:
            body["endpoint"]["api_key"] = key.get_secret_value()
        return dict(body)
    return dict(request)
