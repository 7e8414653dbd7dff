"""A minimal Harbor agent for the `harbor run` test, loaded by harbor itself
(`harbor run --agent tests.interop.harbor_agent:ToolLoopAgent`) in harbor's venv.

Harbor's own model-driven agents cannot run on this offline machine: terminus-2 needs
tmux and asciinema in the container (it installs them with apt or builds tmux from
source: no network), and the installed agents (claude-code, codex, mini-swe-agent...)
download themselves into the container. This one is the smallest honest stand-in: it
asks an OpenAI-compatible endpoint (`--ae OPENAI_BASE_URL=...`, the scripted model) for
tool calls, runs `execute_bash` through Harbor's environment (`environment.exec`: the
docker environment's `docker compose exec`), stops at `submit`, and writes its ATIF
trajectory with harbor's own models to agent/trajectory.json, where Harbor's agents do.
It imports only harbor and the standard library (it runs in harbor's process).
"""

from __future__ import annotations

import json
import urllib.request
from datetime import UTC, datetime
from typing import Any

from harbor.agents.base import BaseAgent
from harbor.environments.base import BaseEnvironment
from harbor.models.agent.context import AgentContext
from harbor.models.trajectories import (
    Agent,
    FinalMetrics,
    Metrics,
    Observation,
    ObservationResult,
    Step,
    ToolCall,
    Trajectory,
)

TOOLS = [
    {"type": "function", "function": {"name": "execute_bash", "description": "Run a bash command.",
     "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}},
    {"type": "function", "function": {"name": "submit", "description": "Finish.", "parameters": {"type": "object", "properties": {}}}},
]  # fmt: skip
MAX_TURNS = 8


def _now() -> str:
    return datetime.now(UTC).isoformat()


class ToolLoopAgent(BaseAgent):
    @staticmethod
    def name() -> str:
        return "sandflow-test-tool-loop"

    def version(self) -> str:
        return "0.1.0"

    async def setup(self, environment: BaseEnvironment) -> None:
        return None

    def _chat(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        base = self._get_env("OPENAI_BASE_URL")
        assert base, "set --ae OPENAI_BASE_URL=http://127.0.0.1:PORT/v1"
        body = json.dumps({"model": self.model_name or "scripted", "messages": messages, "tools": TOOLS}).encode()
        req = urllib.request.Request(f"{base}/chat/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:  # noqa: S310 (127.0.0.1 only)
            return json.loads(r.read())

    async def run(self, instruction: str, environment: BaseEnvironment, context: AgentContext) -> None:
        messages: list[dict[str, Any]] = [{"role": "user", "content": instruction}]
        steps = [Step(step_id=1, timestamp=_now(), source="user", message=instruction)]
        prompt = completion = 0
        for _ in range(MAX_TURNS):
            reply = self._chat(messages)
            msg = reply["choices"][0]["message"]
            usage = reply.get("usage") or {}
            prompt += usage.get("prompt_tokens", 0)
            completion += usage.get("completion_tokens", 0)
            messages.append({k: v for k, v in msg.items() if k in ("role", "content", "tool_calls")})
            calls, results, done = [], [], False
            for c in msg.get("tool_calls") or []:
                name, raw = c["function"]["name"], c["function"]["arguments"]
                args = json.loads(raw) if raw else {}
                calls.append(ToolCall(tool_call_id=c["id"], function_name=name, arguments=args))
                if name == "submit":
                    done, out, code = True, "submitted", 0
                else:
                    res = await environment.exec(args["command"], timeout_sec=60)
                    out, code = (res.stdout or "") + (res.stderr or ""), res.return_code
                results.append(ObservationResult(source_call_id=c["id"], content=out, extra={"exit_code": code}))
                messages.append({"role": "tool", "tool_call_id": c["id"], "content": out})
            steps.append(Step(
                step_id=len(steps) + 1, timestamp=_now(), source="agent", model_name=self.model_name,
                message=msg.get("content") or "", reasoning_content=msg.get("reasoning_content"),
                tool_calls=calls or None, observation=Observation(results=results) if results else None,
                metrics=Metrics(prompt_tokens=usage.get("prompt_tokens"), completion_tokens=usage.get("completion_tokens")),
            ))  # fmt: skip
            if done or not calls:
                break
        traj = Trajectory(
            schema_version="ATIF-v1.8", session_id=str(self.logs_dir.parent.name),
            agent=Agent(name=self.name(), version=self.version(), model_name=self.model_name),
            steps=steps,
            final_metrics=FinalMetrics(total_prompt_tokens=prompt, total_completion_tokens=completion, total_steps=len(steps)),
        )  # fmt: skip
        (self.logs_dir / "trajectory.json").write_text(json.dumps(traj.to_json_dict(), indent=2))
        context.n_input_tokens, context.n_output_tokens = prompt, completion
