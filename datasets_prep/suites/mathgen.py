"""mathematics-dataset made to run here, and to give the same problems in every process.

Two kinds of shims. Compatibility: `np.object` (removed in numpy 1.24) is aliased to
`object`, and sympy's `diophantine.base_solution_linear` (moved out) is aliased to where
it lives now. Determinism: the 2019 generator draws from three generators and iterates
two hash-ordered collections, so with the same seed it gave different problems in each
Python process (issue #22: a nightly `smoke` run never paired with the previous night):

- sympy's own `random.Random` (`sympy.core.random.rng`, behind `randprime`) is seeded
  from the OS at import; `seeded()` seeds it with Python's and numpy's generators;
- `Context.pop` picks a variable name with `random.choice(list(a_set_of_letters))`:
  the set's order follows the string hash, which PYTHONHASHSEED randomises. The
  replacement chooses from the sorted letters;
- `expand_entities` shuffles `list(set(entities))`: entities hash by identity (their
  memory address). The replacement de-duplicates in the entities' own order.

Both replacements draw from `random` exactly as the originals did, so the distribution of
problems is unchanged; only the order the draw indexes into is now fixed.
"""

from __future__ import annotations

import contextlib
import importlib
import random
import warnings
from collections.abc import Iterator
from typing import Any

_APPLIED = False


def apply_shims() -> None:
    """Patch mathematics-dataset (once per process) before its modules are used."""
    global _APPLIED
    if _APPLIED:
        return
    import numpy as np

    # `import sympy.solvers.diophantine as x` would give the function of that name.
    dioph = importlib.import_module("sympy.solvers.diophantine")
    if "object" not in np.__dict__:  # removed in numpy 1.24; the generator uses dtype=np.object
        np.object = object  # type: ignore[attr-defined]
    if not hasattr(dioph, "base_solution_linear"):  # moved into the diophantine submodule
        impl = importlib.import_module("sympy.solvers.diophantine.diophantine")
        dioph.base_solution_linear = impl.base_solution_linear  # type: ignore[attr-defined]
    composition = importlib.import_module("mathematics_dataset.util.composition")
    composition.Context.pop = _ordered_pop
    setattr(composition, "expand_entities", _make_expand_entities(composition))  # noqa: B010
    _APPLIED = True


def _ordered_pop(self: Any) -> str:
    """Context.pop with the unused letters in sorted order (not the set's hash order)."""
    from mathematics_dataset.util import composition

    used = self._relation_symbols | self._self_symbols | self._child_symbols
    allowed = sorted(composition._ALLOWED_SYMBOLS - used)
    if not allowed:
        raise ValueError("Ran out of symbols")
    symbol = random.choice(allowed)
    self._self_symbols.add(symbol)
    return str(symbol)


def _make_expand_entities(composition: Any) -> Any:
    def expand_entities(context: Any, **kwargs: Any) -> tuple[str, dict[str, Any]]:
        """composition.expand_entities, with the entities de-duplicated in order."""
        kwargs = kwargs.copy()
        entities = list(context.child_entities)
        for key, maybe_entity in kwargs.items():
            if isinstance(maybe_entity, composition.Entity):
                entities.append(maybe_entity)
                kwargs[key] = maybe_entity.handle
        entities = list(dict.fromkeys(entities))  # an identity-keyed dict keeps insertion order
        random.shuffle(entities)
        descriptions = []
        for entity in entities:
            descriptions.append(entity.child_description)
            if not entity.expression_used:
                descriptions.append(entity.description)
        return " ".join(s for s in descriptions if s), kwargs

    return expand_entities


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Seed Python's, numpy's and sympy's generators; restore their states afterwards.
    Callers hold a lock: the generators are process-wide."""
    import numpy as np
    from sympy.core import random as sympy_random

    rngs = (random, sympy_random.rng, sympy_random._assumptions_rng)
    states = [r.getstate() for r in rngs]
    np_state = np.random.get_state()
    for r in rngs:
        r.seed(seed)
    np.random.seed(seed % (2**32))
    try:
        with warnings.catch_warnings():  # the 2019 generator calls randint with floats
            warnings.simplefilter("ignore", DeprecationWarning)
            yield
    finally:
        for r, state in zip(rngs, states, strict=True):
            r.setstate(state)
        np.random.set_state(np_state)
