#!/usr/bin/env bash
# The test command: set up what is missing, check the architecture, then run the whole suite.
# Leading set-up options go to scripts/setup.sh (`--postgres`: the tests of a real Prefect
# server on PostgreSQL get their database server; `--ray`: the test of --task-runner ray gets
# prefect-ray; `--train`: the training tests get TRL and torch (CPU); CI asks for all three, elsewhere those tests are skipped, saying how to get them);
# the rest go to pytest (e.g. `bash scripts/test.sh -m "not slow" -x`,
# `bash scripts/test.sh --postgres --ray --train -q`).
# The suite runs on SANDFLOW_TEST_WORKERS (default 3) pytest-xdist workers: most tests wait
# on sandboxes, servers and subprocesses, so a few workers fit on 2 cores; tests that share
# a big fixture or the machine run on one worker (tests/conftest.py, "pytest-xdist").
# `-n 0` (or any -n of yours) runs it your way.
set -euo pipefail
cd "$(dirname "$0")/.."
SETUP=(--test)
while [ $# -gt 0 ]; do
  case "$1" in
    --postgres|--ray|--train) SETUP+=("$1"); shift ;;
    *) break ;;
  esac
done
bash scripts/setup.sh "${SETUP[@]}"
# The layering contracts of pyproject.toml ([tool.importlinter]): an import against the
# architecture (a library reading the settings, a circle, Prefect outside flows/) fails here.
.venv/bin/lint-imports
WORKERS=()
case " $* " in
  *" -n"*|*" --numprocesses"*|*"no:xdist"*) ;;
  *) WORKERS=(-n "${SANDFLOW_TEST_WORKERS:-3}" --dist loadgroup) ;;
esac
exec .venv/bin/python -m pytest "${WORKERS[@]}" "$@"
