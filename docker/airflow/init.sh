#!/usr/bin/env bash
# The compose service "init": one-shot set-up of the Airflow side, run as root (for chown) by
# the official image's /entrypoint, after postgres and both Slurm clusters are healthy.
#   1. ownership of the shared volumes for the Airflow user (AIRFLOW_UID:0): logs, scratch and
#      the Celery workers' shared placement ledger ([skypilot] placement_ledger)
#   2. secrets generated once into the auth volume: fernet key, JWT secret, API secret key
#      (the other services read them through AIRFLOW__..._CMD, see docker-compose.yml)
#   3. airflow db migrate
#   4. the UI login: SimpleAuthManager's passwords file
#   5. the Slurm connections, host keys pinned, imported (slurm_connections.py)
#   6. a live check over SSH: every connection answers `airflow-skypilot show-gpus`
set -euo pipefail

log() { printf 'init: %s\n' "$*" >&2; }

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
airflow_uid="${AIRFLOW_UID:-50000}"
auth_dir="${AIRFLOW_AUTH_DIR:-/opt/airflow/auth}"
logs_dir="${AIRFLOW_LOGS_DIR:-/opt/airflow/logs}"
scratch_dir="${SKYPILOT_SCRATCH_DIR:-}"
ledger="${AIRFLOW__SKYPILOT__PLACEMENT_LEDGER:-}"
users="${AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS:-admin:admin}"
admin_user="${users%%:*}"     # the first USER:ROLE of SimpleAuthManager's users
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

if [ "$(id -u)" -ne 0 ]; then
    log "must run as root (compose: user \"0:0\") to fix the volumes' ownership"
    exit 1
fi

# 1. volumes ------------------------------------------------------------------------------------
install -d -m 0700 -o "$airflow_uid" -g 0 "$auth_dir"
install -d -m 0775 -o "$airflow_uid" -g 0 "$logs_dir"
find "$logs_dir" ! -user "$airflow_uid" -exec chown "${airflow_uid}:0" {} +
if [ -n "$scratch_dir" ]; then
    # The example DAGs create one folder per run here; jobs on either cluster write into it.
    install -d "$scratch_dir"
    chown "${airflow_uid}:0" "$scratch_dir"
    chmod 1777 "$scratch_dir"
fi
if [ -n "$ledger" ]; then
    # Both workers create, lock and rewrite the ledger file here (mode 0600, as AIRFLOW_UID):
    # a fresh volume's mount point is root's.
    ledger_dir="$(dirname "$ledger")"
    install -d -m 0770 -o "$airflow_uid" -g 0 "$ledger_dir"
    find "$ledger_dir" ! -user "$airflow_uid" -exec chown "${airflow_uid}:0" {} +
fi

# 2. secrets ------------------------------------------------------------------------------------
new_secret() {  # FILE PYTHON-EXPRESSION: written once, kept across restarts
    local file="${auth_dir}/$1"
    if [ ! -s "$file" ]; then
        (umask 077 && python -c "import sys; sys.stdout.write($2)" >"${file}.tmp")
        mv -f "${file}.tmp" "$file"
        log "generated ${file}"
    fi
    chown "${airflow_uid}:0" "$file"
    chmod 0600 "$file"
}
new_secret fernet_key "__import__('cryptography.fernet').fernet.Fernet.generate_key().decode()"
new_secret jwt_secret "__import__('secrets').token_urlsafe(48)"
new_secret api_secret_key "__import__('secrets').token_urlsafe(48)"
export AIRFLOW__CORE__FERNET_KEY_CMD="cat ${auth_dir}/fernet_key"
export AIRFLOW__API_AUTH__JWT_SECRET_CMD="cat ${auth_dir}/jwt_secret"
export AIRFLOW__API__SECRET_KEY_CMD="cat ${auth_dir}/api_secret_key"

# 3. database -----------------------------------------------------------------------------------
log "airflow db migrate"
airflow db migrate

# 4. UI login -----------------------------------------------------------------------------------
passwords="${AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE:-${auth_dir}/passwords.json}"
ADMIN_USER="$admin_user" ADMIN_PASSWORD="${AIRFLOW_ADMIN_PASSWORD:-admin}" \
    python -c 'import json, os, sys
json.dump({os.environ["ADMIN_USER"]: os.environ["ADMIN_PASSWORD"]}, sys.stdout)' \
    >"${passwords}.tmp"
mv -f "${passwords}.tmp" "$passwords"
chown "${airflow_uid}:0" "$passwords"
chmod 0600 "$passwords"
log "UI login: ${admin_user} (password from AIRFLOW_ADMIN_PASSWORD, default 'admin')"

# 5. connections --------------------------------------------------------------------------------
python "${here}/slurm_connections.py" write "${work}/connections.json"
airflow connections import --overwrite "${work}/connections.json"
python "${here}/slurm_connections.py" ids "${work}/ids"
mapfile -t conn_ids <"${work}/ids"
for conn_id in "${conn_ids[@]}"; do
    airflow connections get "$conn_id" -o json >/dev/null \
        || { log "connection ${conn_id} was not imported"; exit 1; }
done
# [skypilot] connections (what the DAGs use by default) must name only connections made here.
IFS=',' read -r -a defaults <<<"${AIRFLOW__SKYPILOT__CONNECTIONS:-}"
for conn_id in "${defaults[@]}"; do
    conn_id="${conn_id// /}"
    [ -z "$conn_id" ] && continue
    if ! printf '%s\n' "${conn_ids[@]}" | grep -qx -- "$conn_id"; then
        log "[skypilot] connections names ${conn_id}, which SKYPILOT_SLURM_CONNECTIONS lacks"
        exit 1
    fi
done

# 6. live check ---------------------------------------------------------------------------------
conn_args=()
for conn_id in "${conn_ids[@]}"; do
    conn_args+=(--conn "$conn_id")
done
# Outside a task the task SDK reads connections from the metadata DB only in a "server" context.
for attempt in 1 2 3 4 5; do
    if _AIRFLOW_PROCESS_CONTEXT=server python -m airflow_skypilot.cli show-gpus \
            "${conn_args[@]}" --json >"${work}/capacity.json" \
        && python "${here}/slurm_connections.py" check-capacity "${work}/capacity.json"; then
        log "done: connections ${conn_ids[*]} answer over SSH with pinned host keys"
        exit 0
    fi
    log "capacity check failed (attempt ${attempt}/5); retrying in 5 s"
    sleep 5
done
log "the Slurm clusters do not answer over SSH; see the errors above and" \
    "'docker compose logs slurm-alpha slurm-beta'"
exit 1
