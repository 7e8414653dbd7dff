"""One journal that will not convert is named (and quarantined), never the end of a
warehouse's readability (issue #37).

Before: an endpoint that reported prompt_tokens = 2^64 left a journal behind (the
episode's commit failed on it), and from then on every `sandflow sql` on the warehouse,
for every run, `--quarantine` included, failed with an OverflowError while building the
`partial_turns` view, until someone deleted the journal by hand.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from tests.warehouse.factory import make_episode, record
from warehouse import Warehouse


def _sql(root: Path, *args: str) -> Any:
    from sandflow.cli import app

    return CliRunner().invoke(app, ["sql", *args, "-w", str(root)], env={"COLUMNS": "400"})


def _orphan(wh: Warehouse, task: str, turn_update: dict[str, Any]) -> Path:
    """An episode whose writer died after one turn: its journal, with `turn_update` put
    into the turn's JSON line as an older writer (or a lying endpoint) left it."""
    ep, turns = make_episode("lies", task, turns=1)
    w = wh.writer()
    w.start_episode(ep.model_copy(update={"termination": None}))
    w.record_turn(turns[0])
    w.close()  # released without finishing: an orphan
    (journal,) = [p for p in wh.layout.journal_files("lies") if p.stem == ep.episode_id]
    lines = journal.read_text().splitlines()
    out = []
    for line in lines:
        obj = json.loads(line)
        if obj["kind"] == "turn":
            for k, v in turn_update.items():
                head, _, rest = k.partition(".")
                if rest:
                    obj["record"][head][rest] = v
                else:
                    obj["record"][head] = v
        out.append(json.dumps(obj))
    journal.write_text("\n".join(out) + "\n")
    return journal


def test_a_journal_that_will_not_convert_is_named_and_quarantined(tmp_path: Path) -> None:
    wh = Warehouse(tmp_path)
    done, turns = make_episode("other", "fine", turns=2)
    record(wh.writer(), done, turns)
    # the case: a count of 2^64 (now read as unknown: the journal converts)
    huge = _orphan(wh, "huge", {"usage.prompt_tokens": 2**64, "usage.completion_tokens": -5})
    # a value no reader bounds (max_tokens of 2^40 in an int32 column): will not convert
    bad = _orphan(wh, "bad", {"request_max_tokens": 2**40})

    r = _sql(tmp_path, "SELECT run_id, count(*) FROM turns GROUP BY ALL ORDER BY 1")
    assert r.exit_code == 0, r.output + repr(r.exception)
    assert "other" in r.output  # every other run stays readable
    assert f"{bad}: its turns do not convert to the turns table" in r.output  # named, whole
    assert "left out (use --quarantine to move it aside)" in r.output and str(huge) not in r.output

    r = _sql(tmp_path, "SELECT task_id, prompt_tokens, completion_tokens FROM partial_turns", "--format", "json")
    assert r.exit_code == 0, r.output + repr(r.exception)
    assert json.loads(r.stdout) == [{"task_id": "huge", "prompt_tokens": None, "completion_tokens": None}]

    r = _sql(tmp_path, "SELECT count(*) AS n FROM partial_turns", "--quarantine")
    assert r.exit_code == 0, r.output + repr(r.exception)
    assert not bad.exists() and huge.exists()
    moved = list((tmp_path / "_quarantine").rglob(bad.name))
    assert moved and "do not convert" in moved[0].with_name(moved[0].name + ".reason.txt").read_text()
    r = _sql(tmp_path, "SELECT count(*) AS n FROM partial_turns")
    assert r.exit_code == 0 and "do not convert" not in r.output, r.output
