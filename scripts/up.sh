#!/usr/bin/env bash
# The main job on a fresh machine: set everything up, then run the nightly benchmark
# on the built-in smoke suite with the embedded local model (Prefect ephemeral mode).
# Extra arguments go to `sandflow bench` (e.g. `bash scripts/up.sh --base-url http://... --model M`).
set -euo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
bash scripts/setup.sh
rc=0
.venv/bin/sandflow bench "$@" || rc=$?
s=$(( $(date +%s) - T0 ))
if [ -t 1 ] && [ -z "${NO_COLOR:-}" ]; then _c=$'\033[1;34m' _r=$'\033[0m'; else _c= _r=; fi
printf '%s[up]%s set-up and benchmark took %dm%02ds (exit %d)\n' "$_c" "$_r" $((s / 60)) $((s % 60)) "$rc"
exit "$rc"
