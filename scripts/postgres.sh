#!/usr/bin/env bash
# A PostgreSQL server of sandflow's own, as the database of a Prefect server
# (docs/pipeline.md, "A Prefect server on PostgreSQL"). Never started by default:
# `bash scripts/setup.sh --postgres` installs Debian's package and runs `start`.
#
#   bash scripts/postgres.sh start    # create (first time) and start; idempotent
#   bash scripts/postgres.sh url      # the connection URL for PREFECT_API_DATABASE_CONNECTION_URL
#   bash scripts/postgres.sh status   # running or not, where, which port
#   bash scripts/postgres.sh stop     # stop it and remove everything start made
#   bash scripts/postgres.sh stop --keep-data   # stop it, keep the data for the next start
#
# Not Debian's cluster (/var/lib/postgresql, port 5432, left alone): one data directory
# of ours, $SANDFLOW_PG_DIR (as root /var/lib/sandflow/postgres: the server runs as the
# `postgres` account, which cannot enter /root; otherwise
# ${XDG_STATE_HOME:-~/.local/state}/sandflow/postgres), listening on 127.0.0.1 only, port
# $SANDFLOW_PG_PORT (default 25432), a Unix socket only inside that directory, one role
# `sandflow` with a random password (scram-sha-256; the URL with it is in <dir>/url, mode
# 0600), one database `prefect`. `stop` removes only a directory that `start` marked as
# sandflow's.
set -euo pipefail

is_root() { [ "$(id -u)" = 0 ]; }
die() { printf '[postgres] %s\n' "$*" >&2; exit 1; }
say() { printf '[postgres] %s\n' "$*"; }

if is_root; then
  DIR=${SANDFLOW_PG_DIR:-/var/lib/sandflow/postgres}
  RUN_AS=postgres
else
  DIR=${SANDFLOW_PG_DIR:-${XDG_STATE_HOME:-$HOME/.local/state}/sandflow/postgres}
  RUN_AS=$(id -un)
fi
PORT=${SANDFLOW_PG_PORT:-25432}
DB=prefect
ROLE=sandflow
MARK="$DIR/.sandflow-postgres"

pg_bin() {  # the newest installed server's bin directory (Debian: /usr/lib/postgresql/N/bin)
  local d
  d=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
  [ -n "$d" ] && [ -x "$d/initdb" ] || die "no PostgreSQL server installed: run \`bash scripts/setup.sh --postgres\` (Debian package postgresql)"
  echo "$d"
}
as_pg() {  # run a command as the server's account, from a directory it may enter
  if is_root; then (cd / && runuser -u "$RUN_AS" -- "$@"); else (cd / && "$@"); fi
}
running() { [ -f "$DIR/data/PG_VERSION" ] && as_pg "$(pg_bin)/pg_ctl" status -D "$DIR/data" >/dev/null 2>&1; }
password() { sed -n 's|^postgresql+asyncpg://[^:]*:\([^@]*\)@.*|\1|p' "$DIR/url"; }
sql() {  # sql DATABASE STATEMENT: as our role, over 127.0.0.1
  PGPASSWORD=$(password) "$(pg_bin)/psql" -X -q -v ON_ERROR_STOP=1 -tA \
    "host=127.0.0.1 port=$(cat "$DIR/port") user=$ROLE dbname=$1" -c "$2"
}

init() {  # a new data directory, once
  [ -f "$DIR/url" ] && return 0
  if [ -e "$DIR" ] && [ ! -f "$MARK" ] && [ -n "$(ls -A "$DIR" 2>/dev/null)" ]; then
    die "$DIR exists and was not made by this script: set SANDFLOW_PG_DIR to another directory"
  fi
  local bin; bin=$(pg_bin)
  is_root && ! id "$RUN_AS" >/dev/null 2>&1 && die "the account $RUN_AS (made by Debian's postgresql package) is missing"
  rm -rf "$DIR"
  mkdir -p "$DIR"
  touch "$MARK"
  is_root && chown -R "$RUN_AS:" "$DIR"
  chmod 700 "$DIR"
  local pw; pw=$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')  # hex: safe in a URL
  as_pg sh -c "umask 077 && printf '%s\n' '$pw' > '$DIR/.pw'"
  as_pg "$bin/initdb" -D "$DIR/data" -U "$ROLE" --pwfile="$DIR/.pw" -A scram-sha-256 -E UTF8 --no-locale \
    >"$DIR/initdb.log" 2>&1 || { cat "$DIR/initdb.log" >&2; die "initdb failed (log: $DIR/initdb.log)"; }
  rm -f "$DIR/.pw"
  as_pg mkdir -p "$DIR/run"
  as_pg sh -c "cat >> '$DIR/data/postgresql.conf'" <<EOF
# sandflow (scripts/postgres.sh): loopback only, our own socket directory
listen_addresses = '127.0.0.1'
port = $PORT
unix_socket_directories = '$DIR/run'
unix_socket_permissions = 0700
EOF
  as_pg sh -c "cat > '$DIR/data/pg_hba.conf'" <<'EOF'
# sandflow (scripts/postgres.sh): password (scram-sha-256) on the socket and on 127.0.0.1 only
local all all scram-sha-256
host  all all 127.0.0.1/32 scram-sha-256
EOF
  echo "$PORT" > "$DIR/port"
  (umask 077 && echo "postgresql+asyncpg://$ROLE:$pw@127.0.0.1:$PORT/$DB" > "$DIR/url")
}

start() {
  init
  local bin; bin=$(pg_bin)
  if ! running; then
    as_pg "$bin/pg_ctl" start -w -t 60 -D "$DIR/data" -l "$DIR/postgres.log" >/dev/null \
      || { tail -n 15 "$DIR/postgres.log" >&2 || true
           die "PostgreSQL did not start (log: $DIR/postgres.log; port $(cat "$DIR/port") in use? set SANDFLOW_PG_PORT before the first start)"; }
  fi
  if [ -z "$(sql postgres "SELECT 1 FROM pg_database WHERE datname = '$DB'")" ]; then
    sql postgres "CREATE DATABASE $DB"
  fi
  say "running on 127.0.0.1:$(cat "$DIR/port"), data in $DIR/data; URL: bash scripts/postgres.sh url"
}

stop() {
  local keep=${1:-}
  [ -e "$DIR" ] || { say "nothing to stop: $DIR does not exist"; return 0; }
  [ -f "$MARK" ] || die "$DIR was not made by this script: not touching it"
  if running; then as_pg "$(pg_bin)/pg_ctl" stop -w -t 60 -m fast -D "$DIR/data" >/dev/null; fi
  if [ "$keep" = --keep-data ]; then say "stopped; data kept in $DIR"; return 0; fi
  rm -rf "$DIR"
  rmdir --ignore-fail-on-non-empty "$(dirname "$DIR")" 2>/dev/null || true
  say "stopped and removed $DIR"
}

case "${1:-}" in
  start) start ;;
  stop) stop "${2:-}" ;;
  url) [ -f "$DIR/url" ] || die "not set up: run \`bash scripts/postgres.sh start\` (or scripts/setup.sh --postgres)"; cat "$DIR/url" ;;
  status)
    if running; then say "running on 127.0.0.1:$(cat "$DIR/port"), data in $DIR/data"
    else say "not running (directory: $DIR)"; exit 3; fi ;;
  *) echo "usage: bash scripts/postgres.sh start|stop [--keep-data]|url|status" >&2; exit 2 ;;
esac
