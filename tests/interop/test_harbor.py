"""`sandflow export harbor`: Harbor task directories read back by harbor 0.26's own task
loader and models (in its venv), and their environment and verifier run for real on
sandflow's image with the Docker engine: built from the local base image (no registry),
the oracle's solve.sh, then tests/test.sh writes the reward Harbor reads."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.flows.conftest import write_tasks
from tests.interop.conftest import run_cli, tasks

HARBOR_READ = r"""
import json, sys
from pathlib import Path
from harbor.models.task.task import Task
out = {}
for d in sorted(p for p in Path(sys.argv[1]).iterdir() if p.is_dir()):
    t = Task(d)
    cfg = t.config
    out[d.name] = {
        "valid": Task.is_valid_dir(d), "name": t.name, "instruction": t.instruction,
        "schema": cfg.schema_version, "sandflow": cfg.metadata.get("sandflow"),
        "network": cfg.environment.network_mode.value, "workdir": cfg.environment.workdir,
        "dockerfile": (t.paths.environment_dir / "Dockerfile").is_file(),
        "test": str(t.paths.discovered_test_path.relative_to(d)) if t.paths.discovered_test_path else None,
        "solve": str(t.paths.discovered_solve_path.relative_to(d)) if t.paths.discovered_solve_path else None,
    }
print(json.dumps(out))
"""


def test_export_is_read_by_harbors_task_loader(harbor_python: Path, tmp_path: Path) -> None:
    source = write_tasks(tmp_path / "tiny.parquet", tasks(3))
    r = run_cli("export", "harbor", str(source), "--out", str(tmp_path / "suite"))
    assert r.exit_code == 0, r.output
    assert "harbor: 3 tasks -> 22 files in" in r.output
    read = subprocess.run([str(harbor_python), "-c", HARBOR_READ, str(tmp_path / "suite")],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert read.returncode == 0, read.stderr[-3000:]
    got = json.loads(read.stdout)
    assert sorted(got) == ["t0", "t1", "t2"]
    for name, t in got.items():
        assert t["valid"] and t["name"] == f"sandflow/{name}" and t["schema"] == "1.4"
        assert f"Task {name}: what is 6 * 7?" in t["instruction"] and "/testbed/output" in t["instruction"]
        assert t["sandflow"]["task_id"] == name and t["sandflow"]["verifier"] == "exact"
        assert (t["network"], t["workdir"], t["dockerfile"]) == ("no-network", "/testbed", True)
        assert (t["test"], t["solve"]) == ("tests/test.sh", "solution/solve.sh")
    # harbor's own static checks: nothing but the one by design (the verifier reads the
    # answer file in the agent's sandbox, as sandflow's verifier does)
    lint = subprocess.run(
        [str(harbor_python.parent / "harbor"), "lint", *(str(tmp_path / "suite" / n) for n in got),
         "--ignore", "shared-verifier", "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert lint.returncode == 0 and json.loads(lint.stdout) == [], lint.stdout + lint.stderr


@pytest.mark.docker
def test_exported_environment_and_verifier_run_on_sandflows_image(tmp_path: Path) -> None:
    """What Harbor's docker environment does with a task, done with the engine: build
    environment/, run the agent's part (the oracle, or nothing), upload tests/, run test.sh."""
    import docker

    source = write_tasks(tmp_path / "tiny.parquet", tasks(1))
    assert run_cli("export", "harbor", str(source), "--out", str(tmp_path / "suite")).exit_code == 0
    task = tmp_path / "suite" / "t0"
    client = docker.from_env()
    image, _ = client.images.build(path=str(task / "environment"), rm=True)
    try:
        for agent, reward in (("bash /solution/solve.sh", "1"), ("true", "0")):
            out = client.containers.run(
                image.id, ["bash", "-c", f"cat /testbed/documents/notes.txt && {agent} && bash /tests/test.sh "
                                         "&& cat /logs/verifier/reward.txt"],
                volumes={str(task / "tests"): {"bind": "/tests", "mode": "ro"},
                         str(task / "solution"): {"bind": "/solution", "mode": "ro"}},
                network_mode="none", remove=True,
            ).decode()  # fmt: skip
            assert out.splitlines()[0] == "note 0"  # the task's input file, where sandflow puts it
            assert out.strip().splitlines()[-1] == reward
    finally:
        client.images.remove(image.id, force=True)


def test_export_refuses_a_task_set_without_ground_truth(tmp_path: Path) -> None:
    from datasets_prep.task import Task

    bare = Task(id="no-truth", domain="instruct_follow", problem_statement="Write a haiku.", qa_type="instruction")
    source = write_tasks(tmp_path / "bare.parquet", [bare])
    r = run_cli("export", "harbor", str(source), "--out", str(tmp_path / "suite"))
    assert r.exit_code == 2
    assert "task 'no-truth' has no ground truth" in r.output
    assert not (tmp_path / "suite").exists()  # nothing written


def test_export_network_mode_is_chosen_and_checked(tmp_path: Path) -> None:
    """`--network public` for Harbor's docker environment offline (its no-network sidecar
    comes from Docker Hub: docs/interop.md); anything else is one sentence, exit 2."""
    source = write_tasks(tmp_path / "tiny.parquet", tasks(1))
    r = run_cli("export", "harbor", str(source), "--network", "public", "--out", str(tmp_path / "pub"))
    assert r.exit_code == 0, r.output
    assert 'network_mode = "public"' in (tmp_path / "pub" / "t0" / "task.toml").read_text()
    r = run_cli("export", "harbor", str(source), "--network", "bridge", "--out", str(tmp_path / "bad"))
    assert r.exit_code == 2
    assert "network 'bridge' is not one of no-network, public" in r.output
    assert not (tmp_path / "bad").exists()
