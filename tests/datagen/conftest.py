"""The data-build tests share the scripted generator and a small corpus (test_build_stages)."""

from __future__ import annotations

import flows  # noqa: F401  (Prefect settings before prefect is imported)
