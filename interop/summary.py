"""What an export (or import) carried over, and what it could not: one line for the user."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Summary:
    """Counts of one export/import. `not_carried` maps what was lost (a sentence naming the
    field and why) to how many episodes it concerned; `skipped` maps a reason to how many
    episodes were left out entirely."""

    format: str
    out: Path
    episodes: int = 0
    files: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    not_carried: Counter[str] = field(default_factory=Counter)
    extra: dict[str, Any] = field(default_factory=dict)
    head: str | None = None  # the line's start, when "N episodes -> N files in OUT" is not it

    def lose(self, what: str, n: int = 1) -> None:
        self.not_carried[what] += n

    def skip(self, why: str, n: int = 1) -> None:
        self.skipped[why] += n

    def line(self) -> str:
        """One line: what was written, what was left out, what could not be carried."""
        text = self.head or f"{self.format}: {self.episodes} episodes -> {self.files} files in {self.out}"
        if self.skipped:
            text += "; skipped: " + ", ".join(f"{n} ({why})" for why, n in sorted(self.skipped.items()))
        if self.not_carried:
            text += "; not carried over: " + ", ".join(
                f"{what} ({n} episodes)" for what, n in sorted(self.not_carried.items())
            )
        else:
            text += "; everything carried over"
        return text

    def as_dict(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "out": str(self.out),
            "episodes": self.episodes,
            "files": self.files,
            "skipped": dict(self.skipped),
            "not_carried": dict(self.not_carried),
            **self.extra,
        }
