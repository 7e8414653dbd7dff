"""A sandflow task set as a Harbor task suite (`sandflow export harbor TASKSET --out DIR`).

One Harbor task directory per task (harbor 0.26's layout, `harbor.models.task.Task`):

    DIR/<task>/instruction.md           sandflow's prompt: the system message, then the task
    DIR/<task>/task.toml                schema 1.4: name, timeouts, resources, no network
                                        (or `public`: `network`);
                                        [metadata.sandflow]: task id, domain, qa_type, verifier,
                                        task set name and hash, the task's content hash
    DIR/<task>/environment/Dockerfile   FROM sandflow's one image (a local image: no registry),
                                        the task's input files copied to /testbed/documents
    DIR/<task>/environment/documents/   those files
    DIR/<task>/tests/test.sh            keeps the answer (/testbed/output/answer.txt) in
                                        /logs/verifier/answer.txt and writes reward.txt
    DIR/<task>/tests/check.py           a stdlib check: the answer equals the ground truth or
    DIR/<task>/tests/ground_truth.json  one of the accepted answers (trimmed, case-folded)
    DIR/<task>/solution/solve.sh        the oracle: writes the ground truth as the answer

The in-container reward is that strict match; sandflow's verifier (math equivalence,
numeric tolerance, choices, ROUGE, instruction checkers) is the score of record, computed
when trials are read back (the kept answer). docs/interop.md, "Harbor tasks".
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from datasets_prep.task import Task, TaskSet
from interop.names import OutputPathError, inside, prepare_out, safe_name, write_text
from interop.summary import Summary

SCHEMA_VERSION = "1.4"
ANSWER = "/testbed/output/answer.txt"

TEST_SH = """#!/bin/bash
# sandflow's answer file, kept for sandflow's verifier; reward.txt: check.py's strict match
mkdir -p /logs/verifier
if [ -f {answer} ]; then cp {answer} /logs/verifier/answer.txt; else : > /logs/verifier/answer.txt; fi
python3 /tests/check.py /logs/verifier/answer.txt /tests/ground_truth.json > /logs/verifier/reward.txt \\
  || echo 0 > /logs/verifier/reward.txt
"""

CHECK_PY = '''"""1 when the answer equals the ground truth or one of the accepted answers (trimmed,
case-folded), else 0. sandflow's own verifier scores the kept answer on import."""
import json, sys
answer = open(sys.argv[1], encoding="utf-8", errors="replace").read(1_000_000).strip().casefold()
truth = json.load(open(sys.argv[2], encoding="utf-8"))
accepted = truth if isinstance(truth, list) else [truth]
print(1 if any(answer == (a if isinstance(a, str) else json.dumps(a)).strip().casefold() for a in accepted) else 0)
'''


def _toml_str(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)  # a TOML basic string is JSON's string syntax


NETWORK_MODES = ("no-network", "public")


def _task_toml(task: Task, ts: TaskSet, name: str, verifier: str, limits: dict[str, Any], network: str) -> str:
    meta = {
        "task_id": task.id,
        "domain": task.domain,
        "qa_type": task.qa_type or "",
        "verifier": verifier,
        "task_set": ts.name or "",
        "task_set_hash": ts.content_hash if hasattr(ts, "content_hash") else "",
        "content_hash": task.content_hash,
    }
    lines = [
        f'schema_version = "{SCHEMA_VERSION}"',
        "",
        "[task]",
        f"name = {_toml_str('sandflow/' + name)}",
        f"description = {_toml_str(f'sandflow task {task.id} ({task.domain})')}",
        'keywords = ["sandflow", ' + _toml_str(task.domain) + "]",
        "",
        "[metadata.sandflow]",
        *(f"{k} = {_toml_str(str(v))}" for k, v in meta.items()),
        "",
        "[verifier]",
        "timeout_sec = 120.0",
        "",
        "[agent]",
        f"timeout_sec = {float(limits.get('wall_clock_s', 1800.0))}",
        "",
        "[environment]",
        "build_timeout_sec = 600.0",
        f"cpus = {limits.get('cpus', 1)}",
        f"memory_mb = {int(limits.get('memory_mb', 2048))}",
        f'network_mode = "{network}"',
        'workdir = "/testbed"',
        "",
    ]
    return "\n".join(lines)


def _write_inputs(env_dir: Path, task: Task) -> int:
    """The task's input files under environment/documents/ (names are relative, checked)."""
    docs = env_dir / "documents"
    root = docs.resolve()
    for rel, data in task.input_files.items():
        target = (docs / rel).resolve()
        if not target.is_relative_to(root) or target == root:
            raise OutputPathError(f"task {task.id!r}: input file name {rel!r} leaves its folder")
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(data, bytes):
            target.write_bytes(data)
        else:
            target.write_text(data, encoding="utf-8")
    return len(task.input_files)


def export_harbor(
    ts: TaskSet, out: Path | str, *, image: str, limits: dict[str, Any] | None = None, network: str = "no-network"
) -> Summary:
    """Write `ts` as Harbor task directories under `out` (see the module doc). Every task
    is checked first (a task its verifier cannot score is a VerifierError naming it), so
    nothing is written for a task set that cannot reward. `network`: the tasks'
    network_mode, `no-network` (sandflow's default; Harbor's docker environment enforces
    it with its egress-control sidecar, built from images on Docker Hub) or `public`."""
    if network not in NETWORK_MODES:
        raise ValueError(f"network {network!r} is not one of {', '.join(NETWORK_MODES)}")
    from analysis.rollouts import sandbox_prompt
    from datasets_prep.task import check_scorable

    limits = limits or {}
    verifiers = [check_scorable(t) for t in ts.tasks]  # before anything is written
    root = prepare_out(Path(out))
    summary = Summary(format="harbor", out=root)
    for task, verifier in zip(ts.tasks, verifiers, strict=True):
        name = safe_name(task.id)
        tdir = inside(root, name)
        for sub in ("environment", "tests", "solution"):
            (tdir / sub).mkdir(parents=True, exist_ok=True)
        messages = sandbox_prompt(task)
        instruction = "\n\n".join(str(m["content"]) for m in messages if m.get("content"))
        write_text(tdir, "instruction.md", instruction.rstrip() + "\n")
        write_text(tdir, "task.toml", _task_toml(task, ts, name, verifier, limits, network))
        n_inputs = _write_inputs(tdir / "environment", task)
        dockerfile = [f"FROM {image}", "RUN mkdir -p /testbed/documents /testbed/output"]
        if n_inputs:
            dockerfile.append("COPY documents/ /testbed/documents/")
        dockerfile.append("WORKDIR /testbed")
        write_text(tdir / "environment", "Dockerfile", "\n".join(dockerfile) + "\n")
        write_text(tdir / "tests", "test.sh", TEST_SH.format(answer=ANSWER))
        write_text(tdir / "tests", "check.py", CHECK_PY)
        write_text(tdir / "tests", "ground_truth.json", json.dumps(task.ground_truth, ensure_ascii=False) + "\n")
        truth = task.ground_truth[0] if isinstance(task.ground_truth, list) and task.ground_truth else task.ground_truth
        text = truth if isinstance(truth, str) else json.dumps(truth, ensure_ascii=False)
        write_text(tdir / "solution", "solve.sh",
                   f"#!/bin/bash\nmkdir -p /testbed/output\nprintf %s {shlex.quote(text)} > {ANSWER}\n")  # fmt: skip
        for script in (tdir / "tests" / "test.sh", tdir / "solution" / "solve.sh"):
            script.chmod(0o755)
        summary.episodes += 1
        summary.files += 7 + n_inputs
    summary.head = f"harbor: {summary.episodes} tasks -> {summary.files} files in {root}"
    summary.lose("sandflow's verifier inside the container (reward.txt is a strict match; the kept answer is rescored by sandflow)", summary.episodes)
    summary.lose("the tool set (a Harbor agent brings its own tools)", summary.episodes)
    return summary
