#!/usr/bin/env bash
# A second Docker engine beside the first, standing in for a second host (issue #26).
#
#   bash scripts/engine2.sh start    start it (idempotent), load the sandbox image into it
#                                    from the first engine, print its DOCKER_HOST
#   bash scripts/engine2.sh stop     stop it and remove everything `start` made (its data
#                                    root is deleted in the background: ~1 min for 1.4 GB
#                                    here; SANDFLOW_ENGINE2_WAIT=1 waits for it)
#   bash scripts/engine2.sh halt     stop only its daemon (a host's engine going down);
#                                    data and image stay, `start` brings it back in seconds
#   bash scripts/engine2.sh crash    kill -9 its daemon (a crash: the sandboxes' connections
#                                    break at once; `start` brings it back and clears them)
#   bash scripts/engine2.sh status   exit 0 and print its DOCKER_HOST when it answers
#
# Everything it owns lives under one directory ($SANDFLOW_ENGINE2_DIR, default
# /var/tmp/sandflow-engine2): the socket, data root, exec root, pid file, log and its own
# daemon.json. Its own bridge ($SANDFLOW_ENGINE2_BRIDGE, default sfengine2) on its own
# subnet ($SANDFLOW_ENGINE2_SUBNET, default 10.213.255.1/24; user networks from
# 10.214.0.0/16), its own containerd (namespace sandflow-engine2), its own cgroup parent,
# and NO iptables rules (--iptables=false --ip-masq=false --ip-forward=false): the first
# engine owns the DOCKER chains and this one never touches them, so its containers have
# no outbound NAT (sandboxes run with network `none` by default; docs/pipeline.md says what
# an egress policy needs on a real second host). The first engine is never restarted or
# touched: the image is copied with `docker save | docker load`, no registry.
# Needs root (dockerd does). Exit 2 on bad usage.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
DIR=${SANDFLOW_ENGINE2_DIR:-/var/tmp/sandflow-engine2}
BRIDGE=${SANDFLOW_ENGINE2_BRIDGE:-sfengine2}
SUBNET=${SANDFLOW_ENGINE2_SUBNET:-10.213.255.1/24}
POOL=${SANDFLOW_ENGINE2_POOL:-10.214.0.0/16}
SOCK="$DIR/docker.sock"
HOST="unix://$SOCK"
PIDFILE="$DIR/dockerd.pid"
LOG="$DIR/dockerd.log"
NS=sandflow-engine2

# colour only on a terminal (logs, cron and CI get plain text), and never with NO_COLOR
if [ -t 2 ] && [ -z "${NO_COLOR:-}" ]; then _c=$'\033[1;34m' _r=$'\033[0m'; else _c= _r=; fi
say() { printf '%s[engine2]%s %s\n' "$_c" "$_r" "$*" >&2; }
die() { printf '\033[1;31m[engine2] %s\033[0m\n' "$1" >&2; exit "${2:-1}"; }
usage() { die "usage: bash scripts/engine2.sh start|stop|halt|crash|status" 2; }
first() { docker -H "${FIRST_DOCKER_HOST:-unix:///var/run/docker.sock}" "$@"; }
second() { docker -H "$HOST" "$@"; }
answers() { [ -S "$SOCK" ] && timeout 10 docker -H "$HOST" version --format '{{.Server.Version}}' >/dev/null 2>&1; }
pid_alive() { [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; }

[ $# = 1 ] || usage
case "$DIR" in /*) ;; *) die "SANDFLOW_ENGINE2_DIR=$DIR must be an absolute path" 2 ;; esac
[ ${#BRIDGE} -le 15 ] || die "SANDFLOW_ENGINE2_BRIDGE=$BRIDGE is longer than 15 characters (a Linux interface name)" 2

image_tag() {  # the tag sandbox/image.py names (stdlib only: the system Python will do)
  local py=python3
  [ -x "$ROOT/.venv/bin/python" ] && py="$ROOT/.venv/bin/python"
  PYTHONPATH="$ROOT" "$py" -c 'from sandbox.image import DEFAULT_SPEC; print(DEFAULT_SPEC.tag)'
}

subnet_taken() {  # a route of another interface overlapping our subnet's network
  local net=${SUBNET%/*}; net=${net%.*}
  ip -4 route show | grep -v " dev $BRIDGE " | grep -q "^${net}\." && return 0
  ip -4 route get "${SUBNET%/*}" 2>/dev/null | grep -q " dev docker0\| dev br-" && return 0
  return 1
}

start() {
  [ "$(id -u)" = 0 ] || die "starting a Docker engine needs root: sudo bash scripts/engine2.sh start"
  command -v dockerd >/dev/null || die "dockerd is not installed: run sudo bash scripts/setup.sh first"
  if answers; then
    say "already running: DOCKER_HOST=$HOST"
  else
    if pid_alive; then die "dockerd $(cat "$PIDFILE") of $DIR runs but does not answer on $SOCK; run: bash scripts/engine2.sh stop"; fi
    mkdir -p "$DIR/data" "$DIR/exec"
    # 1. Its bridge. dockerd takes a bridge that is not docker0 only when it exists.
    if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
      subnet_taken && die "subnet $SUBNET overlaps a route of this machine (ip -4 route); set SANDFLOW_ENGINE2_SUBNET" 2
      ip link add name "$BRIDGE" type bridge
      ip addr add "$SUBNET" dev "$BRIDGE"
      ip link set "$BRIDGE" up
    fi
    # 2. Its own config file: /etc/docker/daemon.json belongs to the first engine (its
    #    runtimes, e.g. gVisor's runsc, are copied so both engines offer the same ones).
    python3 - "$DIR/daemon.json" "$BRIDGE" "$POOL" "$DIR/key.json" <<'PY'
import json, sys
out, bridge, pool, key = sys.argv[1:]
cfg = {}
try:
    with open("/etc/docker/daemon.json") as f:
        first = json.load(f)
    if "runtimes" in first:
        cfg["runtimes"] = first["runtimes"]
except (OSError, ValueError):
    pass
cfg.update({
    "bridge": bridge,
    "iptables": False, "ip-masq": False, "ip-forward": False, "ip6tables": False,
    "default-address-pools": [{"base": pool, "size": 24}],
    "storage-driver": "overlay2",
    "deprecated-key-path": key,  # its own engine ID (/etc/docker/key.json is the first's)
    "log-driver": "json-file",
    "shutdown-timeout": 5,  # halt: its sandboxes need no grace (they are killed anyway)
})
with open(out, "w") as f:
    json.dump(cfg, f, indent=1)
PY
    # A crashed dockerd's containerd can keep a pid file a new one trusts (scripts/setup.sh)
    rm -f "$DIR/exec/containerd/containerd.pid"
    # Docker 20.10, restarted on a data root whose network store holds its "bridge" network
    # and with default-address-pools set, deletes the HOST's docker0 (removeDefaultBridgeInterface
    # names docker0, whatever --bridge says): the first engine then cannot start a bridge
    # container. Its network store is rebuilt at start instead (it holds no network we keep).
    rm -rf "$DIR/data/network"
    say "starting dockerd (log: $LOG)"
    # setsid: its own session, so a terminal's Ctrl+C or a test session's end never reaches it
    setsid dockerd \
      --config-file "$DIR/daemon.json" \
      --host "$HOST" \
      --data-root "$DIR/data" \
      --exec-root "$DIR/exec" \
      --pidfile "$PIDFILE" \
      --containerd-namespace "$NS" \
      --containerd-plugins-namespace "$NS-plugins" \
      --cgroup-parent "/$NS" \
      >>"$LOG" 2>&1 </dev/null &
    for _ in $(seq 1 60); do answers && break; sleep 0.5; done
    answers || { tail -n 20 "$LOG" >&2; die "the second dockerd did not answer on $SOCK within 30 s (log: $LOG)"; }
    say "dockerd $(cat "$PIDFILE") answers: DOCKER_HOST=$HOST"
  fi
  # 3. The sandbox image, from the first engine (same tag, same id; no registry)
  local tag; tag=$(image_tag)
  local want; want=$(first image inspect --format '{{.Id}}' "$tag" 2>/dev/null) \
    || die "the sandbox image $tag is not on the first engine: run sandflow image build (or scripts/setup.sh)"
  if [ "$(second image inspect --format '{{.Id}}' "$tag" 2>/dev/null)" != "$want" ]; then
    local t=$SECONDS
    say "loading $tag into it from the first engine (docker save | docker load)"
    first save "$tag" | second load >/dev/null
    [ "$(second image inspect --format '{{.Id}}' "$tag" 2>/dev/null)" = "$want" ] || die "docker load did not give $tag the id $want"
    say "image loaded in $((SECONDS - t)) s"
  fi
  echo "$HOST"
}

halt() {  # its daemon only (SIGTERM, then SIGKILL after 30 s); its containers die with it
  [ "$(id -u)" = 0 ] || die "stopping the second engine needs root: sudo bash scripts/engine2.sh $1"
  if pid_alive; then
    local pid; pid=$(cat "$PIDFILE")
    # only our dockerd: the pid file must name a dockerd serving our socket
    if tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q -- "--host $HOST"; then
      if [ "$1" = stop ]; then  # its containers first (dockerd would wait 10 s for each)
        local ids; ids=$(timeout 20 docker -H "$HOST" ps -aq 2>/dev/null || true)
        [ -z "$ids" ] || timeout 60 docker -H "$HOST" rm -f $ids >/dev/null 2>&1 || true
      fi
      kill -TERM "$pid" 2>/dev/null || true
      for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
      if kill -0 "$pid" 2>/dev/null; then
        say "dockerd $pid did not stop in 30 s: SIGKILL"; kill -KILL "$pid" 2>/dev/null || true; sleep 1
      fi
    else
      say "pid file $PIDFILE names $pid, which is not our dockerd: left alone"
    fi
  fi
  return 0
}

crash() {  # kill -9 of dockerd alone (its containerd dies with it: parent-death signal)
  [ "$(id -u)" = 0 ] || die "killing the second engine needs root"
  pid_alive || die "no dockerd of $DIR runs"
  local pid; pid=$(cat "$PIDFILE")
  tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q -- "--host $HOST" || die "pid file $PIDFILE names $pid, which is not our dockerd"
  kill -KILL "$pid"
  for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
}

stop() {
  [ -e "$DIR" ] || ip link show "$BRIDGE" >/dev/null 2>&1 || { say "nothing to stop ($DIR absent)"; return 0; }
  halt stop
  # Its supervised containerd and shims, if a SIGKILL left them (by pid, only ours: they
  # name our exec root or our containerd namespace)
  local p
  for p in $(pgrep -x containerd 2>/dev/null) $(pgrep -f "containerd-shim.*-namespace $NS( |$)" 2>/dev/null); do
    if tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | grep -q -- "$DIR/exec\|-namespace $NS "; then kill -KILL "$p" 2>/dev/null || true; fi
  done
  # Mounts under our directory (overlay layers, netns and shm bind mounts), deepest first
  local m
  for m in $(awk -v d="$DIR/" 'index($2, d) == 1 {print $2}' /proc/self/mounts | sort -r); do
    umount -l "$m" 2>/dev/null || true
  done
  # Its cgroups (empty once its containers are gone)
  local c
  for c in /sys/fs/cgroup/*/"$NS" /sys/fs/cgroup/"$NS"; do
    [ -d "$c" ] || continue
    find "$c" -depth -type d -exec rmdir {} \; 2>/dev/null || true
  done
  if ip link show "$BRIDGE" >/dev/null 2>&1; then ip link delete "$BRIDGE" type bridge 2>/dev/null || true; fi
  # Deleting the data root's ~1.4 GB of small files takes about a minute here (ext4 with
  # discard): it is renamed at once and deleted in the background, unless asked to wait
  # (SANDFLOW_ENGINE2_WAIT=1).
  local trash="$DIR.removing.$$"
  mv "$DIR" "$trash" || die "could not move $DIR away (still mounted? see /proc/self/mounts)"
  if [ "${SANDFLOW_ENGINE2_WAIT:-0}" = 1 ]; then
    rm -rf --one-file-system "$trash"
  else
    setsid nohup rm -rf --one-file-system "$trash" >/dev/null 2>&1 </dev/null &
  fi
  say "stopped; removed bridge $BRIDGE and $DIR (its files are being deleted: $trash)"
}

case "$1" in
  start) start ;;
  stop) stop ;;
  crash) crash; say "killed -9 (bash scripts/engine2.sh start brings it back)" ;;
  halt) halt halt; say "halted (data kept: bash scripts/engine2.sh start brings it back)" ;;
  status) answers || die "no second engine answers on $SOCK" 1; echo "$HOST" ;;
  *) usage ;;
esac
