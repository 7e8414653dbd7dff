#!/usr/bin/env bash
# The test command: set up what is missing, check the architecture, then run the whole suite.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -m "not slow" -x`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
# The layering contracts of pyproject.toml ([tool.importlinter]): an import against the
# architecture (a library reading the settings, a circle, Prefect outside flows/) fails here.
.venv/bin/lint-imports
exec .venv/bin/python -m pytest "$@"
