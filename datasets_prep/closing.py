"""The context-manager half of a class that has a `close()`, written once.

Why: the episode journal, the warehouse's writer and query session, the rollout client
and the RL environment each wrote the same `__enter__` (return self) and `__exit__`
(close) by hand. It lives in the lowest layer, beside lazy.py, so every package above
may use it (sandbox/, a sibling of this layer, keeps its own two).
"""

from __future__ import annotations

from typing import Self


class ClosedOnExit:
    """Mixin: `with X(...) as x:` gives x itself and calls `x.close()` however the block
    ends (an exception is not swallowed)."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
