"""THE contract between a row and a `Task`, both ways (issue #23: "RL rows <-> Task: one module").

Writing: `task_rows(tasks, prompt_fn)` gives the rows verl and rllm read for
LLM-in-Sandbox-RL style training (`data_source, prompt, ability, reward_model {style,
ground_truth}, extra_info`), with the whole task in `extra_info`: its LLM-in-Sandbox-RL
environment builds the episode and its reward from there alone. `row_schema()` is their
Arrow schema.

Reading: `task_from_row(row)` takes any row a task comes in as:
- a whole verl/SkyRL row (its `extra_info` is read; `reward_model.ground_truth` /
  `reward_spec.ground_truth` fill a missing ground truth, `ability` a missing domain),
- the `extra_info` dict (or its JSON text) alone,
- a row of a task table: the peer's (llm-in-sandbox: id, domain, problem_statement,
  ground_truth, input_files, qa_type; other columns kept in `metadata["extra"]`) or ours
  (`json_fields=True`: ground truth and metadata stored as JSON text),
- a `Task`.

Ground truth in a row: structured ground truths are text in the row formats other tools
read. ONE rule maps them back (`ground_truth_from_text`): a JSON object is the mapping
(a quantity, an IFBench spec), a JSON array of strings is the list of accepted answers
(verifiers read a list as "any of these answers"), anything else is the text itself.
`ground_truth_text` writes lists as arrays of strings so the rule reads them back, and our
RL rows also carry `extra_info.ground_truth_json` (the exact JSON value), which wins when
present: a list stays a list, a number a number, through every round trip.

LLM-in-Sandbox-RL's reward (`lis_rl_ground_truth`): its rllm environment scores a row with
llm-in-sandbox's `instruct_pretrain` reward, `compute_score(answer, extra_info["ground_truth"],
**the rest of extra_info)`, which routes on `extra_info["domain"]` (LIS_RL_ROUTES) and
reads the ground truth as plain text: a quantity's JSON text, or a list's, scored 0 for
every correct answer (issue #36). So `extra_info.ground_truth` is the text that route
scores (a quantity's number, or "number unit" where the route compares strings; a list's
first accepted answer; letters "A, C"), `reward_model.ground_truth` keeps sandflow's own
text and `extra_info.ground_truth_json` the exact value: sandflow reads a row back from
those, in that order. A ground truth no route can score (a mapping that is neither a
quantity nor an instruction spec, an empty list) is refused: `task_rows` leaves the row
out and names it in `refused`.

A row that cannot make a task raises `RowError` (a TaskValidationError) naming the row and
the field.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Mapping
from decimal import Decimal
from typing import Any

from datasets_prep.task import (
    GroundTruthError,
    Task,
    TaskValidationError,
    decode_maybe_bytes,
    make_task,
)

TASK_FIELDS = frozenset(Task.model_fields)
RL_ROW_KEYS = frozenset({"data_source", "prompt", "ability", "reward_model", "reward_spec", "extra_info"})
# extra_info keys that belong to the row, not to the task (never copied into metadata).
RL_INFO_KEYS = frozenset({"index", "split", "task_id", "ground_truth_json"})

PromptFn = Callable[[Task], list[dict[str, Any]]]


class RowError(TaskValidationError):
    """The row does not describe a task (the message names the row and the field)."""


# ------------------------------------------------------------------ ground truth
def ground_truth_text(gt: Any) -> str:
    """A ground truth as text: text as it is; a list as a JSON array of its items' text
    (read back as a list by `ground_truth_from_text`); anything else as JSON."""
    if isinstance(gt, str):
        return gt
    if isinstance(gt, list | tuple) and all(isinstance(g, str | int | float) and not isinstance(g, bool) for g in gt):
        return json.dumps([str(g) for g in gt], ensure_ascii=False)
    return json.dumps(gt, ensure_ascii=False, default=str)


def ground_truth_from_text(value: Any) -> Any:
    """The one rule (module docstring): a JSON object -> the mapping, a JSON array of
    strings -> the list of accepted answers, any other value unchanged."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if not (text.startswith("{") and text.endswith("}")) and not (text.startswith("[") and text.endswith("]")):
        return value
    try:
        decoded = json.loads(text)
    except json.JSONDecodeError:
        return value
    if isinstance(decoded, dict):
        return decoded
    if isinstance(decoded, list) and decoded and all(isinstance(g, str) for g in decoded):
        return decoded
    return value


# ------------------------------------------------------------------- input files
def _decoded(value: Any) -> Any:
    """A field that may come as JSON text: the decoded value (None for no text at all);
    other values unchanged. Raises json.JSONDecodeError for text that is not JSON."""
    if isinstance(value, str):
        return json.loads(value) if value.strip() else None
    return value


def input_files_from(value: Any, where: str) -> dict[str, str | bytes]:
    """Input files in the shapes they take in the wild: a mapping name -> text/bytes (HF's
    null-padded structs: None entries skipped), its JSON text, a list of records
    {name, text | data | content}, or a pyarrow map's (name, content) pairs."""
    try:
        value = _decoded(value)
    except json.JSONDecodeError as e:
        raise RowError(f"{where}: input_files: text is not a JSON object of name -> content ({e.msg})") from None
    if value is None:
        return {}
    pairs: list[tuple[Any, Any]] = []
    if isinstance(value, Mapping):
        pairs = [(k, decode_maybe_bytes(v)) for k, v in value.items() if v is not None]
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            if isinstance(item, tuple | list) and len(item) == 2:  # pyarrow map
                pairs.append((item[0], item[1]))
                continue
            if not isinstance(item, Mapping) or "name" not in item:
                raise RowError(f"{where}: input_files[{i}]: expected a record with 'name' and 'text'/'data'")
            content = item.get("data") if item.get("data") is not None else item.get("text", item.get("content"))
            if content is None:
                raise RowError(f"{where}: input_files[{i}] ({item['name']!r}): no content")
            pairs.append((item["name"], content))
    else:
        raise RowError(f"{where}: input_files: expected a mapping of file name -> text, got {type(value).__name__}")
    out: dict[str, str | bytes] = {}
    for name, content in pairs:
        if not isinstance(content, str | bytes):
            raise RowError(f"{where}: input file {str(name)!r} must be text, got {type(content).__name__}")
        out[str(name)] = content
    return out


def input_files_json(files: Mapping[str, str | bytes]) -> str:
    """Input files as the JSON object of name -> text the RL rows carry."""
    out = {n: (c.decode("utf-8", "replace") if isinstance(c, bytes) else c) for n, c in files.items()}
    return json.dumps(out, ensure_ascii=False)


def metadata_from(value: Any) -> dict[str, Any]:
    """Metadata as rows carry it: a mapping, its JSON text, free text ({"text": ...}),
    or another value ({"value": ...})."""
    try:
        decoded = _decoded(value)
    except json.JSONDecodeError:
        return {"text": value}
    if decoded is None:
        return {}
    value = decoded
    if isinstance(value, Mapping):
        return dict(value)
    return {"value": value}


# --------------------------------------------------- LLM-in-Sandbox-RL's reward
# The domains llm-in-sandbox 0.2.0's `instruct_pretrain` reward routes (on the domain's
# prefix, lower-cased) and how each scores the answer against the ground-truth text; any
# other domain fails its assertion, and the training step with it.
LIS_RL_ROUTES: dict[str, str] = {
    "math": "math-verify",  # \\boxed{gt} against the answer: numbers, expressions, units ignored
    "physics": "math-verify",
    "chem": "exact",  # the whole answer equal (case folded), else one extracted letter
    "biomed": "exact",
    "instruct_follow": "ifbench",  # JSON {instruction_id_list, kwargs}; needs an IFBench checkout
    "instruct_pretrain": "by-qa-type",  # choice letters, else math-verify then ROUGE-L
    "long_context": "by-qa-type",
}
LIS_RL_DEFAULT_DOMAIN = "instruct_pretrain"  # the route of context-based questions
_ASKS_UNIT = re.compile(r"\bwith (?:its|the|a|their) units?\b|\binclud\w* (?:the |its )?units?\b", re.I)
_CHOICE_LETTERS = re.compile(r"^\s*[A-Z](\s*,\s*[A-Z])+\s*$")


def lis_rl_route(domain: str | None) -> str | None:
    """How LLM-in-Sandbox-RL's reward scores rows of `domain` (None: it has no route)."""
    d = (domain or "").lower()
    return next((how for prefix, how in LIS_RL_ROUTES.items() if d.startswith(prefix)), None)


def _number_text(x: float | int) -> str:
    """A number as plain decimal text ("0.00001", not "1e-05": a LaTeX parser reads it)."""
    if isinstance(x, int):
        return str(x)
    text = format(Decimal(repr(float(x))), "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def lis_rl_ground_truth(task: Task) -> tuple[str | None, str]:
    """(the ground-truth text LLM-in-Sandbox-RL's reward scores this task's correct answer
    right with, a note) or (None, why no text can be). The note names what the text loses
    ("" when nothing): the reward compares exactly, so a quantity's tolerance and a list's
    other accepted answers stay with sandflow's verifier (ground_truth_json)."""
    gt, route = task.ground_truth, lis_rl_route(task.domain)
    if route is None:  # no route: the text as it is (the export names the domain)
        return ground_truth_text(gt), ""
    note = ""
    if isinstance(gt, list | tuple):
        items = [g for g in gt if isinstance(g, str | int | float) and not isinstance(g, bool)]
        if not items or len(items) != len(gt):
            return None, f"a list ground truth of {len(gt)} item(s) that are not all text or numbers"
        gt, note = items[0], (f"only the first of {len(items)} accepted answers" if len(items) > 1 else "")
    if isinstance(gt, dict):
        if route == "ifbench" and isinstance(gt.get("instruction_id_list"), list):
            return json.dumps(gt, ensure_ascii=False), note
        value = gt.get("value")
        if not _is_number(value) or route == "ifbench":
            keys = ", ".join(sorted(map(str, gt))) or "no keys"
            return None, f"a mapping ground truth ({keys}) that its {route} reward cannot read"
        unit = str(gt.get("unit") or "").strip()
        text = _number_text(float(value) if isinstance(value, float) else int(value or 0))
        if route == "exact" and unit and _ASKS_UNIT.search(task.problem_statement):
            text = f"{text} {unit}"  # compared as a string: the form the prompt asks for
        tol = [k for k in ("rel_tol", "abs_tol") if gt.get(k)]
        return text, "; ".join(filter(None, [note, f"exact value only ({tol[0]} not applied)" if tol else ""]))
    if _is_number(gt):
        return _number_text(gt), note
    if isinstance(gt, str):
        if (task.qa_type or "").lower() in ("multi_choice", "multiple_choice") and _CHOICE_LETTERS.match(gt):
            gt = ", ".join(x.strip() for x in gt.split(","))  # "A, C": its examples' form
        return gt, note
    return None, f"a {type(gt).__name__} ground truth"


# ---------------------------------------------------------------------- writing
def peer_row(task: Task) -> dict[str, Any]:
    """The row llm-in-sandbox reads (id, domain, problem_statement, ground_truth as text,
    input_files as name -> text, qa_type); `task_from_row` reads it back."""
    return {
        "id": task.id,
        "domain": task.domain,
        "problem_statement": task.problem_statement,
        "ground_truth": ground_truth_text(task.ground_truth),
        "input_files": {
            k: (v if isinstance(v, str) else v.decode("utf-8", "replace")) for k, v in task.input_files.items()
        },
        "qa_type": task.qa_type,
    }


def task_rows(
    tasks: Iterable[Task], prompt_fn: PromptFn, *, source: str = "sandflow", split: str = "train",
    refused: list[tuple[str, str]] | None = None,
) -> list[dict[str, Any]]:
    """verl/rllm rows. `prompt_fn(task)` gives the chat messages the policy starts from.
    A task whose ground truth LLM-in-Sandbox-RL's reward cannot score (lis_rl_ground_truth)
    has no row; `refused` gets (task id, why) for each."""
    rows: list[dict[str, Any]] = []
    for t in tasks:
        lis_rl, why = lis_rl_ground_truth(t)
        if lis_rl is None:
            if refused is not None:
                refused.append((t.id, why))
            continue
        i = len(rows)
        messages = [{"role": str(m.get("role")), "content": str(m.get("content") or "")} for m in prompt_fn(t)]
        gt = ground_truth_text(t.ground_truth)
        rows.append(
            {
                "data_source": f"{source}/{t.domain}",
                "prompt": messages,
                "ability": t.domain,
                "reward_model": {"style": "rule", "ground_truth": gt},
                "extra_info": {
                    "index": i,
                    "split": split,
                    "task_id": t.id,
                    "domain": t.domain,
                    "qa_type": t.qa_type,
                    "verifier": t.verifier,
                    "input_files": input_files_json(t.input_files),
                    "metadata": json.dumps(t.metadata, ensure_ascii=False, default=str),
                    "id": t.id,
                    "problem_statement": t.problem_statement,
                    "ground_truth": lis_rl,  # what LLM-in-Sandbox-RL's reward scores
                    "ground_truth_json": json.dumps(t.ground_truth, ensure_ascii=False, default=str),
                },
            }
        )
    return rows


def row_schema() -> Any:
    """The Arrow schema of `task_rows` (stable types even for empty or sparse sets)."""
    import pyarrow as pa

    text = pa.string()
    info = [
        pa.field("index", pa.int64()),
        pa.field("split", text),
        pa.field("task_id", text),
        pa.field("domain", text),
        pa.field("qa_type", text),
        pa.field("verifier", text),
        pa.field("input_files", text),  # JSON object name -> text
        pa.field("metadata", text),  # JSON
        # The whole task, as LLM-in-Sandbox-RL's rllm environment reads it from extra_info
        # (its `prompt` is a placeholder there).
        pa.field("id", text),
        pa.field("problem_statement", text),
        pa.field("ground_truth", text),  # the text LLM-in-Sandbox-RL's reward scores
        pa.field("ground_truth_json", text),  # the exact value, for task_from_row
    ]
    return pa.schema(
        [
            pa.field("data_source", text),
            pa.field("prompt", pa.list_(pa.struct([pa.field("role", text), pa.field("content", text)]))),
            pa.field("ability", text),
            pa.field("reward_model", pa.struct([pa.field("style", text), pa.field("ground_truth", text)])),
            pa.field("extra_info", pa.struct(info)),
        ]
    )


# ---------------------------------------------------------------------- reading
def _json_object(value: Any, where: str, field: str) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise RowError(f"{where}: {field} is not a JSON object ({exc.msg})") from None


def _text(value: Any, where: str, field: str) -> Any:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as e:
            raise RowError(
                f"{where}: {field}: not valid UTF-8 (byte 0x{value[e.start]:02x} at offset {e.start})"
            ) from None
    return str(value) if isinstance(value, int) and not isinstance(value, bool) and field == "id" else value


def _ground_truth(row: Mapping[str, Any], info: Mapping[str, Any], where: str, json_fields: bool) -> Any:
    if info.get("ground_truth_json") is not None:
        try:
            return json.loads(info["ground_truth_json"])
        except (TypeError, json.JSONDecodeError) as exc:
            raise RowError(f"{where}: ground_truth_json is not JSON ({exc})") from None
    gt = None
    for key in ("reward_model", "reward_spec"):  # a trainer row's own copy: sandflow's text (our
        spec = row.get(key)  # extra_info.ground_truth is the LIS-RL reward's, which may lose detail)
        if isinstance(spec, Mapping) and spec.get("ground_truth") is not None:
            gt = spec["ground_truth"]
            break
    if gt is None:
        gt = info.get("ground_truth")
    gt = _text(gt, where, "ground_truth")
    if json_fields and isinstance(gt, str):
        try:
            return json.loads(gt)
        except json.JSONDecodeError as e:
            raise RowError(f"{where}: ground_truth: invalid JSON ({e.msg})") from None
    return ground_truth_from_text(gt)


def task_from_row(
    row: Task | Mapping[str, Any] | str, *, where: str = "row", json_fields: bool = False
) -> Task:
    """The task a row describes (see the module docstring for the shapes accepted).
    `json_fields`: ground_truth and metadata are JSON text (our task-set Parquet)."""
    if isinstance(row, Task):
        return row
    row = _json_object(row, where, "the row")
    if not isinstance(row, Mapping):
        raise RowError(f"{where}: a row is a mapping (or a Task), got {type(row).__name__}")
    rl_row = "extra_info" in row
    info = _json_object(row.get("extra_info"), where, "extra_info") if rl_row else row
    if not isinstance(info, Mapping):
        raise RowError(f"{where}: extra_info must be a mapping, got {type(info).__name__}")
    task_id = _text(info.get("id") if info.get("id") not in (None, "") else info.get("task_id"), where, "id")
    if task_id not in (None, ""):
        where = f"{where} (id {task_id!r})"
    fields: dict[str, Any] = {"id": task_id}
    for f in ("domain", "problem_statement", "qa_type", "verifier"):
        if info.get(f) is not None:
            fields[f] = _text(info[f], where, f)
    if not fields.get("domain") and rl_row and row.get("ability"):
        fields["domain"] = row["ability"]
    if rl_row:  # a trainer's row: every field of the contract must be there and not empty
        missing = [f for f in ("id", "domain", "problem_statement") if fields.get(f) in (None, "")]
        if missing:
            raise RowError(
                f"{where}: field(s) {', '.join(missing)} missing or empty in extra_info (the "
                "LLM-in-Sandbox-RL row contract: id, problem_statement, ground_truth, domain, "
                "input_files, qa_type)"
            )
    else:  # a table's row: its columns (an empty value is named by the task's validation)
        missing = [f for f in ("id", "domain", "problem_statement") if f not in info and not (f == "id" and "task_id" in info)]
        if missing:
            raise RowError(f"{where}: missing column(s) {', '.join(missing)}")
        if fields["id"] is None:
            del fields["id"]
    fields["ground_truth"] = _ground_truth(row, info, where, json_fields)
    fields["input_files"] = input_files_from(info.get("input_files"), where)
    meta = info.get("metadata")
    if json_fields and isinstance(meta, str):
        meta = _json_object(meta, where, "metadata")
    meta = metadata_from(meta)
    extra = {k: v for k, v in info.items() if k not in TASK_FIELDS | RL_INFO_KEYS | RL_ROW_KEYS and v is not None}
    if extra:
        meta.setdefault("extra", {}).update(json.loads(json.dumps(extra, default=str)))
    fields["metadata"] = meta
    fields["verifier"] = fields.get("verifier") or "auto"
    try:
        return make_task(fields, where)
    except GroundTruthError:  # also a VerifierError: callers tell the two apart
        raise
    except TaskValidationError as exc:
        raise RowError(str(exc)) from None


__all__ = [
    "RowError",
    "peer_row",
    "ground_truth_text",
    "ground_truth_from_text",
    "input_files_from",
    "input_files_json",
    "metadata_from",
    "task_rows",
    "row_schema",
    "LIS_RL_ROUTES",
    "LIS_RL_DEFAULT_DOMAIN",
    "lis_rl_route",
    "lis_rl_ground_truth",
    "task_from_row",
]
