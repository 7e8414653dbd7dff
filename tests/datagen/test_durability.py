"""What a build keeps across a kill -9 and what it shares with other builds (issue #37):

- every paid reply of synthesis is on disk before the next call counts it done: a real
  `kill -9` of the synthesizing process, sent by the model server when it receives
  request K, leaves exactly the K-1 replies it sent in the cache, and the resume asks only
  the slots that had none (a write buffer of 16 lost them all, and they were paid twice);
- two builds whose folders share a name get two build ids, so a shared warehouse keeps
  both funnels.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from datagen.build import Build
from tasks.model import ModelConfig
from tests.datagen.corpus_files import BEES, GLACIER, PARIS
from tests.scripted_model import ScriptedModel, text_reply
from warehouse import Warehouse

REPO = Path(__file__).resolve().parents[2]
ANSWER = {"question": "How do honey bees communicate the direction of food?", "answer": "the waggle dance",
          "evidence": "Honey bees communicate the direction of food with the waggle dance."}
SYNTH = """
import sys
from datagen.build import Build
from tasks.model import ModelConfig
cfg = ModelConfig(model="scripted", base_url=sys.argv[2], temperature=0.0, max_retries=0)
Build(sys.argv[1]).synth(cfg, n=4, types=["free_form"], concurrency=1)
print("finished")  # never reached: the process is killed mid-stage
"""


def _corpus(root: Path) -> Path:
    root.mkdir()
    for i, text in enumerate((PARIS, GLACIER, BEES, PARIS + " Told again.", GLACIER + " Again.")):
        (root / f"doc{i}.txt").write_text(text + "\n")
    return root


def test_a_kill_9_during_synthesis_loses_no_paid_reply(tmp_path):
    out = tmp_path / "out"
    Build(out).ingest(str(_corpus(tmp_path / "corpus")))
    total, kill_at = 5 * 4, 10  # 20 slots; the 10th request is answered by a kill -9
    proc: dict[str, subprocess.Popen] = {}
    started = threading.Event()

    def reply(body: dict, index: int):
        if index == kill_at - 1 and "p" in proc:
            started.wait(10)
            os.kill(proc["p"].pid, signal.SIGKILL)  # the client is gone before this reply
            proc["p"].wait(30)
        return text_reply(json.dumps(ANSWER))

    with ScriptedModel(default=reply, models=("scripted",)) as model:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        proc["p"] = subprocess.Popen([sys.executable, "-c", SYNTH, str(out), model.url], cwd=REPO, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        started.set()
        _, err = proc["p"].communicate(timeout=300)
        assert proc["p"].returncode == -signal.SIGKILL, err[-2000:]
        asked_before = len(model.requests)
        assert asked_before == kill_at

        lines = (out / "cache" / "synth.jsonl").read_text().splitlines()
        # every reply the killed process received (requests 1..K-1) is on disk
        assert len(lines) == kill_at - 1 and all(json.loads(ln)["content"] for ln in lines)

        # the resume asks only the slots without a reply: each paid reply is paid once
        cfg = ModelConfig(model="scripted", base_url=model.url, temperature=0.0, max_retries=0)
        rep = Build(out).synth(cfg, n=4, types=["free_form"], concurrency=1)
        assert len(model.requests) - asked_before == total - (kill_at - 1)
        assert rep.info["cache_hits"] == kill_at - 1 and rep.items_in == total


def test_a_reply_line_cut_by_a_crash_does_not_swallow_the_next_reply(tmp_path):
    from datagen.synth import ReplyCache

    path = tmp_path / "synth.jsonl"
    path.write_text(json.dumps({"key": "a", "content": "x"}) + "\n" + '{"key": "b", "cont')  # cut mid-line
    cache = ReplyCache(path)
    cache.put({"key": "c", "content": "y"})
    cache.close()
    again = ReplyCache(path)
    assert again.get("a") and again.get("c") and again.get("b") is None


def test_two_builds_in_folders_of_the_same_name_keep_their_own_funnels(tmp_path):
    wh = tmp_path / "wh"
    a, b = tmp_path / "a" / "rl_data", tmp_path / "b" / "rl_data"
    corpus_a = _corpus(tmp_path / "corpus_a")
    corpus_b = tmp_path / "corpus_b"
    corpus_b.mkdir()
    (corpus_b / "one.txt").write_text(BEES + "\n")
    ba, bb = Build(a, warehouse=wh), Build(b, warehouse=wh)
    assert ba.build_id != bb.build_id
    assert ba.build_id.startswith("data-rl_data-") and bb.build_id.startswith("data-rl_data-")
    ba.ingest(str(corpus_a))
    bb.ingest(str(corpus_b))
    assert Build(a).build_id == ba.build_id  # recorded in the folder: the same build next time
    with Warehouse(wh).query() as q:
        rows = q.rows("SELECT build_id, items_in FROM data_funnel WHERE stage = 'ingest' ORDER BY items_in")
    assert rows == [(bb.build_id, 1), (ba.build_id, 5)]


def test_one_explicit_build_id_for_two_folders_is_refused_naming_both(tmp_path):
    """`--build-id x` given to two builds in one warehouse: the second would replace the
    first's funnel and provenance; it is refused before any stage runs. The same folder
    again, or the folder moved (its build.json keeps the id), goes on."""
    from datagen.build import BuildError

    wh = tmp_path / "wh"
    a, b = tmp_path / "a" / "rl_data", tmp_path / "b" / "rl_data"
    Build(a, warehouse=wh, build_id="shared")
    Build(a, warehouse=wh, build_id="shared")  # a re-run of the same folder
    with pytest.raises(BuildError, match=r"build id 'shared' already belongs to .*a/rl_data in this warehouse; give .*b/rl_data its own --build-id"):
        Build(b, warehouse=wh, build_id="shared")
    assert not (b / "build.json").exists()  # nothing of the refused build written
    moved = tmp_path / "c" / "rl_data"
    moved.parent.mkdir()
    a.rename(moved)
    assert Build(moved, warehouse=wh).build_id == "shared"  # the same build in a new place
