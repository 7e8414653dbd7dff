"""Loaders: local files of every supported kind, HF saved datasets, offline hub."""

from __future__ import annotations

import csv
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from datasets_prep.loaders import SourceError, load_rows, parse_hf_source

ROWS = [
    {"question": "What is 2+2?", "answer": "4", "context": "Arithmetic."},
    {"question": "Capital of France?", "answer": "Paris", "context": "Geography."},
]


def test_jsonl_json_parquet_csv(tmp_path):
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS) + "\n\n", encoding="utf-8")
    (tmp_path / "a.json").write_text(json.dumps(ROWS), encoding="utf-8")
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "a.parquet")
    with open(tmp_path / "a.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(ROWS[0]))
        w.writeheader()
        w.writerows(ROWS)
    for name in ("a.jsonl", "a.json", "a.parquet", "a.csv"):
        assert load_rows(str(tmp_path / name)) == ROWS, name
    assert load_rows(str(tmp_path / "a.jsonl"), limit=1) == ROWS[:1]


def test_csv_ragged_row_names_line(tmp_path):
    p = tmp_path / "r.csv"
    p.write_text("question,answer\nq1,a1\nq2,a2,extra\n", encoding="utf-8")
    with pytest.raises(SourceError, match="line 3: more fields"):
        load_rows(str(p))


def test_csv_non_utf8_names_line(tmp_path):
    p = tmp_path / "l.csv"
    p.write_bytes(b"question,answer\nq1,a1\nq2,caf\xe9\n")
    with pytest.raises(SourceError, match="line 3: not valid UTF-8"):
        load_rows(str(p))


def test_invalid_json_line(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text('{"a": 1}\n{"a": \n', encoding="utf-8")
    with pytest.raises(SourceError, match="line 2: invalid JSON"):
        load_rows(str(p))


def test_missing_and_unsupported(tmp_path):
    with pytest.raises(SourceError, match="no such file, and not a built-in suite"):
        load_rows(str(tmp_path / "nope.jsonl"))
    (tmp_path / "x.xlsx").write_bytes(b"PK")
    with pytest.raises(SourceError, match="unsupported file type '.xlsx'"):
        load_rows(str(tmp_path / "x.xlsx"))


def test_saved_hf_dataset_dir(tmp_path):
    import datasets

    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    assert load_rows(str(tmp_path / "saved")) == ROWS


def test_parse_hf_source():
    assert parse_hf_source("hf:openai/gsm8k:main@test") == ("openai/gsm8k", "main", "test")
    assert parse_hf_source("hf:squad") == ("squad", None, "train")
    with pytest.raises(SourceError):
        parse_hf_source("hf:")


def test_offline_hub_fails_at_once_with_a_sentence(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", os.path.join(os.environ.get("TMPDIR", "/tmp"), "sandflow-empty-hf-home"))
    with pytest.raises(SourceError) as e:
        load_rows("hf:sandflow-nonexistent/dataset-xyz:cfg@test")
    msg = str(e.value)
    assert "not reachable" in msg and "local HF cache" in msg and "sandflow-nonexistent/dataset-xyz" in msg


def test_an_unreachable_hub_goes_offline_without_changing_the_environment(monkeypatch):
    """#23: the loader once set HF_HUB_OFFLINE / HF_DATASETS_OFFLINE in os.environ; now it
    sets the libraries' own flags and the process environment stays as it was."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: refused at once
    monkeypatch.setenv("HF_HOME", os.path.join(os.environ.get("TMPDIR", "/tmp"), "sandflow-empty-hf-home"))
    before = dict(os.environ)
    with pytest.raises(SourceError, match="offline mode"):
        load_rows("hf:sandflow-nonexistent/dataset-xyz:cfg@test")
    assert dict(os.environ) == before


def test_json_document_with_data_list(tmp_path):
    p = tmp_path / "doc.json"
    p.write_text(json.dumps({"version": 1, "data": ROWS}, indent=2), encoding="utf-8")
    assert load_rows(str(p)) == ROWS
    q = tmp_path / "obj.json"
    q.write_text(json.dumps({"version": 1, "meta": {"a": 1}}, indent=2), encoding="utf-8")
    with pytest.raises(SourceError, match="holds one JSON object"):
        load_rows(str(q))
