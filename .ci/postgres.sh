#!/usr/bin/env bash
# Install PostgreSQL from Debian's packages (if missing), start a throwaway cluster on
# 127.0.0.1 and print the SQLAlchemy URL of a fresh database. Used by .ci/run.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
if ! ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1; then
  apt-get update -qq >&2
  apt-get install -y -qq postgresql >&2
fi
bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)
# A free port, so a cluster left running elsewhere on this machine cannot collide with ours.
port=${MODBENCH_PG_PORT:-$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
dir=$(mktemp -d /tmp/modbench-pg.XXXXXX)
chown postgres "$dir" 2>/dev/null || true
run() { if [ "$(id -u)" = 0 ]; then su postgres -s /bin/sh -c "$*"; else sh -c "$*"; fi; }
run "$bin/initdb -D $dir/data -U modbench --auth=trust >/dev/null"
run "$bin/pg_ctl -D $dir/data -o '-c listen_addresses=127.0.0.1 -p $port -k $dir' -l $dir/log -w start >/dev/null"
run "$bin/createdb -h 127.0.0.1 -p $port -U modbench modbench_test"
echo "$dir" > /tmp/modbench-pg.last
echo "postgresql+psycopg://modbench@127.0.0.1:$port/modbench_test"
