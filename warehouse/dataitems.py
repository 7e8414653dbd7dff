"""RL data builds in the warehouse: one batch file per stage execution (`data_items`).

A stage (datagen/, flows/data.py) hands every item it saw, kept or dropped with its
reason; a re-run of the stage writes a new batch and the views read the newest batch of
each (build, stage), so re-running replaces, never adds. `in = out + dropped` holds by
construction: each item is one row with `kept` true or false.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from datasets_prep.secrets import scrub
from warehouse.convert import write_batch
from warehouse.layout import Layout
from warehouse.schema import check_run_id

STAGES = ("ingest", "synth", "clean", "calibrate", "export")
MARKER = ""  # the item_id of a batch's marker row (warehouse/data_views.py leaves it out)


OWNER = "_output.json"  # in a build's data_items partition: the folder the build id belongs to


def claim_build(layout: Layout, build_id: str, output: Path, *, moved: bool = False) -> None:
    """Bind `build_id` to its output folder in this warehouse. A second folder under the
    same id (two `--build-id x` builds) would silently replace the first's funnel and
    provenance: it is refused, naming both folders (issue #37). `moved`: the folder itself
    records this id (its build.json), so it is the same build in a new place: the binding
    follows it."""
    check_run_id(build_id)
    where = str(Path(output).expanduser().resolve())
    part = layout.part_dir("data_items", build_id)
    part.mkdir(parents=True, exist_ok=True)
    owner = part / OWNER
    try:
        fd = os.open(owner, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        try:
            held = json.loads(owner.read_text(encoding="utf-8")).get("output")
        except (OSError, ValueError, AttributeError):
            held = None
        if held is not None and held != where and not moved:
            raise ValueError(
                f"build id {build_id!r} already belongs to {held} in this warehouse; give "
                f"{where} its own --build-id (or leave it out: the default is unique per folder)"
            ) from None
        if held == where:
            return
        tmp = part / f".{OWNER}.{os.getpid()}"
        tmp.write_text(json.dumps({"output": where}) + "\n", encoding="utf-8")
        os.replace(tmp, owner)
        return
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(json.dumps({"output": where}) + "\n")


def write_data_items(
    layout: Layout, build_id: str, stage: str, items: Iterable[Mapping[str, Any]], *, stage_key: str | None = None
) -> Path:
    """Store one stage's items of one build. Every batch also holds one marker row
    (`item_id` '', kept, never counted): a stage that saw nothing still shows in the funnel
    with 0 in, and its re-run still replaces the earlier batch."""
    check_run_id(build_id)
    if stage not in STAGES:
        raise ValueError(f"data stage {stage!r}: use one of {', '.join(STAGES)}")

    def prepare(i: int, item: Mapping[str, Any]) -> Mapping[str, Any]:
        if not item.get("item_id"):
            raise ValueError(f"data_items row {i}: item_id is empty")
        return {**item, "detail": scrub(str(item["detail"]))} if item.get("detail") else item

    return write_batch(
        layout,
        "data_items",
        build_id,
        items,
        stamp={"stage": stage, "stage_order": STAGES.index(stage), "stage_key": stage_key},
        prepare=prepare,
        also=[{"item_id": MARKER, "kept": True, "detail": "stage marker"}],
    )
