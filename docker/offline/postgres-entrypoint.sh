#!/usr/bin/env bash
# First start: initdb with POSTGRES_USER's password, create POSTGRES_DB. Then the postmaster,
# as the postgres user, listening on every address of the container (the compose network).
set -euo pipefail
: "${POSTGRES_USER:?}" "${POSTGRES_PASSWORD:?}" "${POSTGRES_DB:?}"
as_postgres() { setpriv --reuid=postgres --regid=postgres --init-groups "$@"; }
install -d -o postgres -g postgres -m 0700 "$PGDATA"
install -d -o postgres -g postgres -m 2775 /var/run/postgresql
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    pwfile="$(mktemp)"
    printf '%s\n' "$POSTGRES_PASSWORD" >"$pwfile"
    chown postgres "$pwfile"
    as_postgres initdb -D "$PGDATA" -U "$POSTGRES_USER" --pwfile="$pwfile" -E UTF8 \
        --locale=C.UTF-8 --auth-local=trust --auth-host=scram-sha-256 >/dev/null
    rm -f "$pwfile"
    echo "host all all all scram-sha-256" >>"$PGDATA/pg_hba.conf"
    as_postgres pg_ctl -D "$PGDATA" -o "-c listen_addresses=''" -w start >/dev/null
    as_postgres psql -q -v ON_ERROR_STOP=1 -U "$POSTGRES_USER" -d postgres \
        -c "CREATE DATABASE \"$POSTGRES_DB\""
    as_postgres pg_ctl -D "$PGDATA" -m fast -w stop >/dev/null
fi
exec setpriv --reuid=postgres --regid=postgres --init-groups \
    postgres -D "$PGDATA" -c listen_addresses='*'
