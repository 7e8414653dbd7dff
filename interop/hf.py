"""Runs and RL sets -> Hugging Face dataset folders (Parquet + a dataset card).

`datasets.load_dataset(DIR)` reads the folder offline: the card's YAML header names the
configs and the Parquet files of each split; the rest of the card is the schema, the
counts and the provenance (run, model, task set and its content hash, image, sandflow
version, export time).

- A run: one row per episode, one split per mode (`sandbox`, `llm`): the chat messages
  (tasks.conversation's row shape, the struct of the RL trajectories: role, content,
  reasoning, tool calls, tool call id, name), each tool result's exit code / time-out / OOM kill / truncation /
  error / duration, the verdict (score, passed, verifier, ground truth), termination,
  answer, per-turn token counts, completion token ids and logprobs where recorded.
  Not carried: per-turn prompt token ids (they grow with the square of the turns; the
  token-level rollouts, `sandflow flows rollouts`, rebuild them exactly) and egress
  requests; the summary counts the episodes concerned.
- An RL set (the folder `sandflow flows rollouts` writes): each of taskset / trajectories
  / tokens becomes a config with a `train` split, copied as is, batch by batch.

Both stream: rows are written `BATCH` at a time, never the whole run in memory.
`push_to_hub` uploads a folder with the hub client, only when called.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from analysis.trajectory import MESSAGE
from interop.common import iso, outcome, sandflow_version, verdict
from interop.names import inside, prepare_out, write_text
from interop.source import Episode, RunSource, batch_size
from interop.summary import Summary
from tasks.conversation import episode_messages
from warehouse.fields import OBSERVATION

RL_TABLES = ("trajectories", "taskset", "tokens")  # the default config first
DIGEST_CHARS = 16  # hex digits of a data file's SHA-256 in its name (publish)
NO_PROMPT_IDS = "per-turn prompt token ids (the token-level rollouts rebuild them)"
NO_EGRESS = "egress requests"

# the warehouse's observation struct without the text (that is in `messages`)
_RESULT = pa.struct([f for f in OBSERVATION if f.name != "content"])
_TS = pa.timestamp("us", tz="UTC")

# column -> (type, what it holds): the card's schema table is written from this
EPISODE_COLUMNS: dict[str, tuple[pa.DataType, str]] = {
    "run_id": (pa.string(), "sandflow run"),
    "episode_id": (pa.string(), "stable id of (run, task, mode, sample)"),
    "task_id": (pa.string(), "task of the task set"),
    "domain": (pa.string(), "math, chem, physics, long_context, instruct_follow, ..."),
    "mode": (pa.string(), "sandbox (tools in a container) or llm (one call, no tools)"),
    "sample_index": (pa.int32(), "which sample of the task (0-based)"),
    "model": (pa.string(), "model name as sent to the endpoint"),
    "started_at": (_TS, "episode start (UTC)"),
    "ended_at": (_TS, "episode end (UTC)"),
    "termination": (pa.string(), "submitted, max_steps, context_exhausted, wall_clock, model_error, sandbox_error, interrupted"),
    "infra_failure": (pa.bool_(), "model_error / sandbox_error / interrupted: not the model's answer, never graded"),
    "error": (pa.string(), "why the episode ended early, if it did"),
    "answer": (pa.string(), "the final answer"),
    "answer_source": (pa.string(), "answer_file, submit_argument, last_message or reply"),
    "score": (pa.float64(), "current score (NULL: not scored)"),
    "passed": (pa.bool_(), "score >= 1"),
    "verifier": (pa.string(), "verifier that gave the score"),
    "ground_truth": (pa.string(), "ground truth recorded with the score"),
    "messages": (pa.list_(MESSAGE), "the conversation: prompt, assistant turns with tool calls, tool results"),
    "tool_results": (pa.list_(_RESULT), "each tool call's outcome, in order"),
    "num_turns": (pa.int32(), "model calls"),
    "num_tool_calls": (pa.int32(), "tool calls over all turns"),
    "prompt_tokens": (pa.int64(), "sum over turns"),
    "completion_tokens": (pa.int64(), "sum over turns"),
    "cached_tokens": (pa.int64(), "sum over turns"),
    "reasoning_tokens": (pa.int64(), "sum over turns"),
    "turn_prompt_tokens": (pa.list_(pa.int64()), "prompt tokens of each turn"),
    "turn_completion_tokens": (pa.list_(pa.int64()), "completion tokens of each turn"),
    "completion_token_ids": (pa.list_(pa.list_(pa.int32())), "each turn's completion ids as the server returned them (NULL: not requested)"),
    "completion_logprobs": (pa.list_(pa.list_(pa.float64())), "each turn's completion logprobs (NULL: not requested)"),
    "wall_s": (pa.float64(), "episode wall time"),
    "model_s": (pa.float64(), "time in model calls"),
    "tool_s": (pa.float64(), "time in tools"),
}
EPISODE_SCHEMA = pa.schema([pa.field(k, t) for k, (t, _doc) in EPISODE_COLUMNS.items()])


class HubError(RuntimeError):
    """The upload failed; the message names the repository and the hub's reason."""


class RLSetError(ValueError):
    """The folder is not an RL set (names the folder and what it lacks)."""


def episode_row(ep: Episode, summary: Summary) -> dict[str, Any]:
    e, turns = ep.record, ep.turns
    has_ids = any(t.completion_token_ids is not None for t in turns)
    has_lps = any(t.completion_logprobs is not None for t in turns)
    if any(t.prompt_token_ids for t in turns):
        summary.lose(NO_PROMPT_IDS)
    if any(t.egress for t in turns):
        summary.lose(NO_EGRESS)
    return {
        **e.identity(),
        "model": e.model,
        "started_at": e.started_at,
        "ended_at": e.ended_at,
        **verdict(ep),
        "ground_truth": ep.ground_truth,
        "messages": episode_messages(e, turns),
        "tool_results": [outcome(o) for t in turns for o in t.observations],
        "num_turns": len(turns),
        "num_tool_calls": sum(len(t.tool_calls) for t in turns),
        "prompt_tokens": e.prompt_tokens,
        "completion_tokens": e.completion_tokens,
        "cached_tokens": e.cached_tokens,
        "reasoning_tokens": e.reasoning_tokens,
        "turn_prompt_tokens": [t.usage.prompt_tokens for t in turns],
        "turn_completion_tokens": [t.usage.completion_tokens for t in turns],
        "completion_token_ids": [t.completion_token_ids or [] for t in turns] if has_ids else None,
        "completion_logprobs": [t.completion_logprobs or [] for t in turns] if has_lps else None,
        "wall_s": e.wall_s,
        "model_s": e.model_s,
        "tool_s": e.tool_s,
    }


def publish(tmp: Path, folder: Path, stem: str) -> str:
    """Rename the written file `tmp` to `<stem>-<hash of its bytes>.parquet` in `folder`;
    the new name.

    `datasets` keys its cache by the dataset folder's *name* and the card's data-file
    paths as written (not their absolute paths, sizes or times): two exports in
    `/a/x` and `/b/x` that both said `data/sandbox.parquet` shared one cache entry, and
    the second `load_dataset` returned the first's rows. With the content in the name,
    two different exports never name the same file, and equal names mean equal bytes."""
    digest = hashlib.sha256()
    with tmp.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    name = f"{stem}-{digest.hexdigest()[:DIGEST_CHARS]}.parquet"
    tmp.replace(inside(folder, name))
    return name


def drop_stale(folder: Path, stem: str, keep: str) -> None:
    """Remove the data files an earlier export of `stem` left in `folder` (`<stem>.parquet`
    or `<stem>-<hash>.parquet`, never anything else), once the card names `keep`."""
    pattern = re.compile(rf"{re.escape(stem)}(-[0-9a-f]{{{DIGEST_CHARS}}})?\.parquet")
    for p in folder.iterdir():
        if p.name != keep and pattern.fullmatch(p.name) and (p.is_file() or p.is_symlink()):
            p.unlink(missing_ok=True)


def _yaml_str(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)  # a JSON string is a valid YAML scalar


def _card(title: str, configs: list[tuple[str, list[tuple[str, str]]]], body: str) -> str:
    """README.md: YAML configs (config -> [(split, path)]) and the markdown body."""
    lines = ["---", "configs:"]
    for i, (name, splits) in enumerate(configs):
        lines.append(f"- config_name: {_yaml_str(name)}")
        if i == 0 and name != "default" and len(configs) > 1:
            lines.append("  default: true")
        lines.append("  data_files:")
        for split, path in splits:
            lines += [f"  - split: {_yaml_str(split)}", f"    path: {_yaml_str(path)}"]
    lines += ["tags:", "- sandflow", "- llm-in-sandbox", "---", "", f"# {title}", "", body]
    return "\n".join(lines) + "\n"


def _md(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def export_hf_run(root: Path | str, run_id: str, out: Path | str) -> Summary:
    """One run -> a dataset folder: data/<mode>-<hash>.parquet per mode, README.md."""
    folder = Path(out)
    summary = Summary("hf", folder)
    counts: dict[str, Counter[str]] = {}
    with RunSource(root, run_id) as src:
        src.require()
        prepare_out(folder)
        data = prepare_out(inside(folder, "data"))
        splits = []
        written: list[tuple[Path, str, str]] = []
        for mode in src.modes():
            if not mode.isidentifier():
                summary.skip(f"mode {mode!r} is not a valid split name")
                continue
            c = counts.setdefault(mode, Counter())
            tmp = inside(data, f".tmp-{mode}.parquet")
            with pq.ParquetWriter(tmp, EPISODE_SCHEMA, compression="zstd") as w:
                rows: list[dict[str, Any]] = []
                for ep in src.episodes(src.ids(mode=mode)):
                    rows.append(episode_row(ep, summary))
                    c["episodes"] += 1
                    c["infra_failures"] += ep.record.is_infra_failure
                    if ep.score is not None:
                        c["scored"] += 1
                        c["passed"] += bool(ep.score.passed)
                    if len(rows) >= batch_size():
                        w.write_table(pa.Table.from_pylist(rows, schema=EPISODE_SCHEMA))
                        rows = []
                if rows:
                    w.write_table(pa.Table.from_pylist(rows, schema=EPISODE_SCHEMA))
            name = publish(tmp, data, mode)
            written.append((data, mode, name))
            splits.append((mode, f"data/{name}"))
            summary.episodes += c["episodes"]
            summary.files += 1
        info = src.info
        summary.extra["skipped_files"] = src.skipped_files
    body = _run_card_body(run_id, info, counts)
    write_text(folder, "README.md", _card(f"sandflow run {run_id}", [("default", splits)], body))
    for where, stem, name in written:  # the card names the new files: earlier exports' go
        drop_stale(where, stem, name)
    summary.files += 1
    summary.extra["splits"] = {m: dict(c) for m, c in counts.items()}
    return summary


def _run_card_body(run_id: str, info: dict[str, Any], counts: dict[str, Counter[str]]) -> str:
    prov = [
        ("run", run_id),
        ("model", info.get("model")),
        ("task set", info.get("dataset")),
        ("task set content hash", info.get("dataset_hash")),
        ("sandbox image", info.get("image")),
        ("image id", info.get("image_id")),
        ("series", info.get("series")),
        ("run started", iso(info.get("started_at"))),
        ("run status", info.get("status")),
        ("recorded by sandflow", info.get("sandflow_version")),
        ("exported by sandflow", sandflow_version()),
        ("exported at", iso(datetime.now(UTC))),
    ]
    out = ["Episodes of one sandflow run (LLM-in-Sandbox): one row per episode, one split per mode.", ""]
    out += ["## Provenance", "", "| | |", "| --- | --- |"]
    out += [f"| {k} | {_md(v)} |" for k, v in prov if v is not None]
    out += ["", "## Counts", "", "| split | episodes | infra failures | scored | passed | accuracy |", "| --- | --- | --- | --- | --- | --- |"]
    for mode, c in counts.items():
        acc = f"{c['passed'] / c['scored']:.4f}" if c["scored"] else "n/a"
        out.append(f"| {mode} | {c['episodes']} | {c['infra_failures']} | {c['scored']} | {c['passed']} | {acc} |")
    out += ["", "## Schema", "", "| column | type | meaning |", "| --- | --- | --- |"]
    out += [f"| {k} | {_md(t)} | {_md(doc)} |" for k, (t, doc) in EPISODE_COLUMNS.items()]
    out += [
        "",
        "Infrastructure failures are kept (with `infra_failure = true`) but were never graded: "
        "leave them out of accuracy. Per-turn prompt token ids are not included; "
        "`sandflow flows rollouts` exports token-level rows.",
    ]
    return "\n".join(out)


def is_rlset(path: Path | str) -> bool:
    p = Path(path)
    return p.is_dir() and any((p / f"{t}.parquet").is_file() for t in RL_TABLES)


def export_hf_rlset(source: Path | str, out: Path | str) -> Summary:
    """An RL set folder (taskset/trajectories/tokens.parquet) -> a dataset folder with one
    config per table, each a `train` split, copied batch by batch."""
    src = Path(source)
    if not is_rlset(src):
        raise RLSetError(
            f"{src} is not an RL set: expected a folder with "
            + ", ".join(f"{t}.parquet" for t in RL_TABLES)
            + " (as `sandflow flows rollouts` writes)"
        )
    folder = prepare_out(Path(out))
    if folder.resolve() == src.resolve():
        raise RLSetError(f"output folder {folder} is the RL set itself: choose another --out")
    summary = Summary("hf", folder)
    configs: list[tuple[str, list[tuple[str, str]]]] = []
    tables: list[tuple[str, int, pa.Schema]] = []
    runs: set[str] = set()
    written: list[tuple[Path, str, str]] = []
    for name in RL_TABLES:
        path = src / f"{name}.parquet"
        if not path.is_file():
            continue
        try:
            pf = pq.ParquetFile(path)
        except (pa.ArrowInvalid, OSError) as exc:
            raise RLSetError(f"{path}: not a readable Parquet file ({exc})") from None
        sub = prepare_out(inside(prepare_out(folder / "data"), name))
        tmp = inside(sub, ".tmp-train.parquet")
        with pq.ParquetWriter(tmp, pf.schema_arrow, compression="zstd") as w:
            for batch in pf.iter_batches(batch_size=batch_size() * 4):
                w.write_batch(batch)
                if "run_id" in batch.schema.names:
                    runs.update(v for v in batch.column("run_id").to_pylist() if v)
        file = publish(tmp, sub, "train")
        written.append((sub, "train", file))
        n = pf.metadata.num_rows
        configs.append((name, [("train", f"data/{name}/{file}")]))
        tables.append((name, n, pf.schema_arrow))
        summary.files += 1
        if name == "trajectories":
            summary.episodes = n
    body = ["Training data built by sandflow from LLM-in-Sandbox runs (`sandflow flows rollouts`).", ""]
    body += ["## Provenance", "", "| | |", "| --- | --- |", f"| source folder | {_md(src.resolve())} |"]
    body += [f"| runs | {_md(', '.join(sorted(runs)) or 'n/a')} |", f"| exported by sandflow | {sandflow_version()} |", f"| exported at | {iso(datetime.now(UTC))} |"]
    body += ["", "## Counts", "", "| config | rows |", "| --- | --- |"] + [f"| {n} | {rows} |" for n, rows, _s in tables]
    for n, _rows, schema in tables:
        body += ["", f"## Schema: {n}", "", "| column | type |", "| --- | --- |"]
        body += [f"| {f.name} | {_md(f.type)} |" for f in schema]
    write_text(folder, "README.md", _card("sandflow RL set", configs, "\n".join(body)))
    for where, stem, file in written:
        drop_stale(where, stem, file)
    summary.files += 1
    summary.extra["configs"] = {n: rows for n, rows, _s in tables}
    return summary


def push_to_hub(folder: Path | str, repo: str, *, private: bool = True, token: str | None = None) -> str:
    """Upload a dataset folder to the hub repository `repo` (created if missing); the URL.

    Only called when asked (`--push`); the hub client reads its token from its own
    configuration (HF_TOKEN, `huggingface-cli login`) unless one is handed in."""
    try:
        from huggingface_hub import HfApi

        api = HfApi(token=token)
        api.create_repo(repo, repo_type="dataset", private=private, exist_ok=True)
        # data files are named by their content: the repository's older ones go with this upload
        info = api.upload_folder(folder_path=str(folder), repo_id=repo, repo_type="dataset", delete_patterns=["data/*.parquet"])
    except Exception as exc:  # the hub client raises many kinds; one sentence for the user
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise HubError(f"upload of {folder} to hub dataset {repo!r} failed: {first}") from None
    return str(getattr(info, "commit_url", None) or f"https://huggingface.co/datasets/{repo}")
