"""`sandflow export hf`: a run and an RL set become dataset folders that
`datasets.load_dataset(DIR)` loads offline, with the warehouse's rows and a card."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tasks.conversation import episode_messages
from tests.interop.conftest import RealRun, peer_folder, peer_problem, run_cli

pytestmark = pytest.mark.usefixtures("prefect_harness")


def test_run_as_dataset(real_run: RealRun, run_data: Any, tmp_path: Path) -> None:
    from datasets import load_dataset

    out = tmp_path / "ds"
    res = run_cli("export", "hf", real_run.run_id, "--out", str(out), "-w", str(real_run.warehouse))
    assert res.exit_code == 0, res.output
    assert "hf: 6 episodes -> 3 files" in res.output and "not carried over: per-turn prompt token ids" in res.output
    ds = load_dataset(str(out), cache_dir=str(tmp_path / "cache"))
    assert sorted(ds) == ["llm", "sandbox"]
    by_id = {e.episode_id: e for e in run_data.episodes}
    for split in ds.values():
        assert len(split) == 3
        for row in split:
            ep = by_id[row["episode_id"]]
            turns = run_data.turns_of(ep.episode_id)
            assert row["mode"] == ep.mode and row["task_id"] == ep.task_id
            assert row["messages"] == episode_messages(ep, turns)
            assert row["num_tool_calls"] == sum(len(t.tool_calls) for t in turns)
            assert [r["exit_code"] for r in row["tool_results"]] == [o.exit_code for t in turns for o in t.observations]
            assert row["score"] == run_data.scores[ep.episode_id].score and row["ground_truth"] == "42"
            assert (row["prompt_tokens"], row["completion_tokens"]) == (ep.prompt_tokens, ep.completion_tokens)
            assert row["turn_completion_tokens"] == [t.usage.completion_tokens for t in turns]
            assert row["completion_token_ids"] == [t.completion_token_ids for t in turns]
            assert row["completion_logprobs"] == [t.completion_logprobs for t in turns]
    card = (out / "README.md").read_text()
    assert card.startswith("---\nconfigs:") and real_run.run_id in card
    assert "| sandbox | 3 | 0 | 3 | 2 | 0.6667 |" in card  # counts: t1's answer was wrong
    assert "| completion_logprobs |" in card and "task set content hash" in card


def test_rl_set_as_dataset(real_run: RealRun, tmp_path: Path) -> None:
    from datasets import load_dataset

    from flows.rollouts import rollouts_flow

    rl = tmp_path / "rl"
    made = rollouts_flow(run_id=real_run.run_id, warehouse=str(real_run.warehouse), out_dir=str(rl))
    out = tmp_path / "ds"
    res = run_cli("export", "hf", str(rl), "--out", str(out))
    assert res.exit_code == 0, res.output
    default = load_dataset(str(out), split="train", cache_dir=str(tmp_path / "cache"))  # the default config: trajectories
    assert len(default) == made["exported"] == 6 and "loss_mask" in default.column_names
    tokens = load_dataset(str(out), "tokens", split="train", cache_dir=str(tmp_path / "cache"))
    assert len(tokens) == made["token_rows"] > 0
    taskset = load_dataset(str(out), "taskset", split="train", cache_dir=str(tmp_path / "cache"))
    assert len(taskset) == 3
    card = (out / "README.md").read_text()
    assert real_run.run_id in card and "## Schema: tokens" in card


def test_bad_sources_and_offline_push(real_run: RealRun, tmp_path: Path) -> None:
    res = run_cli("export", "hf", str(tmp_path), "--out", str(tmp_path / "o"))
    assert res.exit_code == 2 and "is a folder but not an RL set" in res.output
    (tmp_path / "fake").mkdir()
    (tmp_path / "fake" / "trajectories.parquet").write_text("not parquet")
    res = run_cli("export", "hf", str(tmp_path / "fake"), "--out", str(tmp_path / "o"))
    assert res.exit_code == 2 and "trajectories.parquet: not a readable Parquet file" in res.output
    res = run_cli("export", "hf", "no-such-run", "--out", str(tmp_path / "o"), "-w", str(real_run.warehouse))
    assert res.exit_code == 2 and "no-such-run" in res.output
    # --push calls the hub client, and only then: offline (the suite's HF_HUB_OFFLINE=1) it
    # fails in one sentence after the folder was written
    out = tmp_path / "ds"
    res = run_cli("export", "hf", real_run.run_id, "--out", str(out), "-w", str(real_run.warehouse), "--push", "me/sandflow-test")
    assert res.exit_code == 1, res.output
    assert "upload of" in res.output and "'me/sandflow-test' failed" in res.output and "Traceback" not in res.output
    assert (out / "README.md").is_file()



_LOAD_ONE = """
import json, sys
from datasets import load_dataset
ds = load_dataset(sys.argv[1], cache_dir=sys.argv[2])
print(json.dumps({split: sorted(ds[split]["task_id"]) for split in ds}))
"""


def test_exports_in_folders_of_the_same_name_never_share_a_cache_entry(tmp_path: Path) -> None:
    """`datasets` keys its cache by the folder's name and the card's data-file paths as
    written (not their absolute paths or contents): two exports at a/x and b/x that both
    named `data/sandbox.parquet` shared one entry, and the second load returned the
    first's rows. Two runs of the same id in two warehouses, exported to a/x and b/x,
    loaded with the real package in one process, and in two processes sharing a cache."""
    import json
    import subprocess
    import sys

    from datasets import load_dataset

    want = {}
    for name, tasks in (("a", ["p0", "p1", "p2"]), ("b", ["q0", "q1"])):
        folder = peer_folder(tmp_path / name / "peer", {t: peer_problem() for t in tasks})
        wh = tmp_path / name / "wh"
        res = run_cli("import", "llm-in-sandbox", str(folder), "--run-id", "same-run", "-w", str(wh))
        assert res.exit_code == 0, res.output
        res = run_cli("export", "hf", "same-run", "--out", str(tmp_path / name / "x"), "-w", str(wh))
        assert res.exit_code == 0, res.output
        want[name] = tasks
    cache = tmp_path / "cache"
    for name in ("a", "b"):  # one process
        got = load_dataset(str(tmp_path / name / "x"), cache_dir=str(cache))
        assert sorted(got["sandbox"]["task_id"]) == want[name], name
    shared = tmp_path / "shared-cache"
    for name in ("a", "b"):  # a process each, one cache folder
        r = subprocess.run([sys.executable, "-c", _LOAD_ONE, str(tmp_path / name / "x"), str(shared)], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        assert json.loads(r.stdout.strip().splitlines()[-1])["sandbox"] == want[name], name


def test_a_new_export_into_the_same_folder_replaces_the_old_files(tmp_path: Path) -> None:
    """Exported twice into one folder with other rows: the card names the new files, the
    old data files are gone, and a load in the same cache reads the new rows."""
    from datasets import load_dataset

    out, cache = tmp_path / "x", tmp_path / "cache"
    for i, tasks in enumerate((["p0", "p1"], ["p0", "p1", "p2"])):
        folder = peer_folder(tmp_path / f"peer{i}", {t: peer_problem() for t in tasks})
        res = run_cli("import", "llm-in-sandbox", str(folder), "--run-id", f"r{i}", "-w", str(tmp_path / "wh"))
        assert res.exit_code == 0, res.output
        res = run_cli("export", "hf", f"r{i}", "--out", str(out), "-w", str(tmp_path / "wh"))
        assert res.exit_code == 0, res.output
        files = sorted(p.name for p in (out / "data").iterdir())
        assert len(files) == 1 and files[0].startswith("sandbox-"), files
        assert f"data/{files[0]}" in (out / "README.md").read_text()
        assert sorted(load_dataset(str(out), cache_dir=str(cache))["sandbox"]["task_id"]) == tasks
