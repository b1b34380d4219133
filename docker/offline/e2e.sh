#!/usr/bin/env bash
# End to end, on one machine without an image registry: build every image (build.sh), bring the
# compose stack up and wait until it is healthy (both triggerers heartbeating, both Celery
# workers answering), run the example DAG `train_pipeline` through Airflow's REST API, SIGKILL
# the triggerer that holds `train`'s trigger and wait until the other one takes it over, kill the
# node its `train` job runs on once the job has checkpointed a few epochs, and check that the DAG
# run succeeds after a failover to the other cluster that resumed from the checkpoint (2 attempts
# in train's result, "resuming from epoch" in its log) with every task run by a Celery worker.
# Then `down -v`, always, even on failure. See docker/README.md.
#
#   bash docker/offline/e2e.sh            # as root (build.sh runs debootstrap)
#
# Variables:
#   E2E_BUILD=0           skip build.sh (the images exist)
#   E2E_EPOCHS=120        train's epochs (one a second)
#   E2E_KILL_AT=15        kill the node once the checkpoint reaches this epoch
#   E2E_KILL_TRIGGERER=1  SIGKILL the triggerer holding train's trigger first (0: do not)
#   E2E_PROJECT           compose project name (airflow-skypilot-e2e)
#   AIRFLOW_PORT          the UI/API port published on 127.0.0.1 (18080)
#   E2E_LOG_DIR           where every service's log is saved at the end
#                         (default: a new /var/tmp/docker-e2e-logs.XXXXXX)
#   E2E_BRIDGE            the compose network's bridge (br-skypilot-e2e, at most 15 chars)
#   E2E_FORWARD_RULE=auto allow forwarding within that bridge (iptables -I FORWARD -i BR -o BR
#                         -j ACCEPT, deleted at the end) when the host's FORWARD policy is DROP
#                         and the daemon manages no iptables rules; 0: never
#   DOCKERD_DIR           if no Docker daemon answers: start dockerd with its own state here
#                         (default /var/tmp/airflow-skypilot-dockerd, kept for the next run's
#                         images) and stop it at the end
# Uses Compose v2 (`docker compose`) if present, else Compose v1 (`docker-compose`) on a copy
# of the compose file without its top-level `name:` (which v1 rejects).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
project="${E2E_PROJECT:-airflow-skypilot-e2e}"
epochs="${E2E_EPOCHS:-120}"
kill_at="${E2E_KILL_AT:-15}"
export AIRFLOW_PORT="${AIRFLOW_PORT:-18080}"
export POSTGRES_IMAGE="${POSTGRES_IMAGE:-airflow-skypilot/postgres:offline}"
export REDIS_IMAGE="${REDIS_IMAGE:-airflow-skypilot/redis:offline}"
api="http://127.0.0.1:${AIRFLOW_PORT}"
# (not /tmp/airflow-skypilot-*: on the project's build machines something deletes those mid-run)
log_dir="${E2E_LOG_DIR:-$(mktemp -d /var/tmp/docker-e2e-logs.XXXXXX)}"
mkdir -p "$log_dir"
t0=$SECONDS

say() { printf 'e2e [%4ds] %s\n' "$((SECONDS - t0))" "$*"; }
die() { say "FAILED: $*" >&2; exit 1; }
for tool in docker curl jq; do
    command -v "$tool" >/dev/null || die "$tool is not installed"
done

# A Docker daemon: the one configured, or one started here with its own state.
dockerd_pid=""
if ! docker info >/dev/null 2>&1; then
    command -v dockerd >/dev/null || die "no Docker daemon answers and dockerd is not installed"
    dd="${DOCKERD_DIR:-/var/tmp/airflow-skypilot-dockerd}"
    mkdir -p "$dd"
    say "no Docker daemon answers: starting dockerd with its state in $dd"
    dockerd --data-root "$dd/data" --exec-root "$dd/exec" --pidfile "$dd/pid" \
        --host "unix://$dd/sock" --bridge=none --iptables=false --ip6tables=false \
        >"$dd/log" 2>&1 &
    dockerd_pid=$!
    export DOCKER_HOST="unix://$dd/sock"
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
    docker info >/dev/null 2>&1 || die "dockerd did not start (see $dd/log)"
fi

# The compose file, plus an override that names the network's bridge (for the rule below).
# Both sit in docker/: the file's paths (build contexts, ../dags) are relative to its folder.
bridge="${E2E_BRIDGE:-br-skypilot-e2e}"
override="$(mktemp "$repo/docker/.e2e-override.XXXXXX.yml")"
compose_copy=""
forward_rule=()
printf 'networks:\n  default:\n    driver_opts:\n      com.docker.network.bridge.name: %s\n' \
    "$bridge" >"$override"
if docker compose version >/dev/null 2>&1; then
    compose=(docker compose -p "$project" -f "$repo/docker/docker-compose.yml" -f "$override")
else
    command -v docker-compose >/dev/null || die "neither docker compose nor docker-compose"
    compose_copy="$(mktemp "$repo/docker/.e2e-compose.XXXXXX.yml")"
    grep -v '^name:' "$repo/docker/docker-compose.yml" >"$compose_copy"
    compose=(docker-compose -p "$project" -f "$compose_copy" -f "$override")
fi
dc() { "${compose[@]}" "$@"; }

finish() {
    local rc=$?
    set +e
    mkdir -p "$log_dir"
    say "saving every service's log to $log_dir"
    dc ps >"$log_dir/ps.txt" 2>&1
    for service in $(dc config --services 2>/dev/null); do
        dc logs --no-color "$service" >"$log_dir/$service.log" 2>&1
    done
    say "tearing down: ${compose[*]} down -v"
    local out
    out="$(dc down -v --remove-orphans 2>&1)" || printf '%s\n' "$out" >&2
    rm -f "$override" "$compose_copy"
    if [ "${#forward_rule[@]}" -gt 0 ]; then
        say "removing iptables FORWARD ${forward_rule[*]}"
        iptables -D FORWARD "${forward_rule[@]}"
    fi
    if [ -n "$dockerd_pid" ]; then
        say "stopping the dockerd started here (pid $dockerd_pid)"
        kill "$dockerd_pid" && wait "$dockerd_pid"
    fi
    if [ "$rc" -eq 0 ]; then say "PASSED in $((SECONDS - t0)) s"; else say "FAILED (exit $rc)"; fi
    exit "$rc"
}
trap finish EXIT
trap 'exit 130' INT TERM

# Containers on the bridge talk to each other through the host's FORWARD chain when the kernel
# hands bridged packets to iptables (br_netfilter). A daemon started with --iptables=false adds
# no rule of its own, so a FORWARD policy of DROP cuts every connection between containers
# (names still resolve; `init` hangs in `airflow db migrate`, connecting to postgres). Then one
# rule for this bridge only, removed at the end.
if [ "${E2E_FORWARD_RULE:-auto}" != 0 ] && command -v iptables >/dev/null \
    && iptables -S FORWARD 2>/dev/null | grep -qx -- '-P FORWARD DROP' \
    && ! iptables -C FORWARD -i "$bridge" -o "$bridge" -j ACCEPT 2>/dev/null; then
    forward_rule=(-i "$bridge" -o "$bridge" -j ACCEPT)
    iptables -I FORWARD "${forward_rule[@]}"
    say "host FORWARD policy is DROP: added iptables -I FORWARD ${forward_rule[*]}"
fi

if [ "${E2E_BUILD:-1}" != 0 ]; then
    say "building the images: bash docker/offline/build.sh"
    start=$SECONDS
    bash "$here/build.sh"
    say "images built in $((SECONDS - start)) s"
fi

# --- up, healthy ------------------------------------------------------------------------------
say "up: ${compose[*]} up -d --no-build (POSTGRES_IMAGE=$POSTGRES_IMAGE, REDIS_IMAGE=$REDIS_IMAGE, port $AIRFLOW_PORT)"
start=$SECONDS
# (up waits for init to complete: bounded, in case a connection hangs)
timeout "${E2E_UP_TIMEOUT:-900}" "${compose[@]}" up -d --no-build || die "up failed or timed out"
long_running=(postgres redis slurm-alpha slurm-beta api-server scheduler dag-processor
    worker-1 worker-2 triggerer-1 triggerer-2)
workers=(worker-1 worker-2)
health() {  # SERVICE: its container's health (or state when it has no healthcheck)
    local id
    id="$(dc ps -q "$1" 2>/dev/null)"
    [ -n "$id" ] || { echo missing; return; }
    docker inspect -f '{{if .State.Health}}{{.State.Health.Status}}{{else}}{{.State.Status}}{{end}}' "$id"
}
deadline=$((SECONDS + ${E2E_UP_TIMEOUT:-900}))
while :; do
    waiting=()
    for service in "${long_running[@]}"; do
        [ "$(health "$service")" = healthy ] || waiting+=("$service")
    done
    [ "${#waiting[@]}" -eq 0 ] && break
    init_id="$(dc ps -q init 2>/dev/null)"
    if [ -n "$init_id" ] \
        && [ "$(docker inspect -f '{{.State.Status}}' "$init_id")" = exited ] \
        && [ "$(docker inspect -f '{{.State.ExitCode}}' "$init_id")" != 0 ]; then
        dc logs --no-color --tail 40 init
        die "init failed"
    fi
    [ "$SECONDS" -lt "$deadline" ] || { dc ps; die "not healthy in time: ${waiting[*]}"; }
    sleep 5
done
say "every service healthy $((SECONDS - start)) s after up"
dc logs --no-color init | grep -E 'slurm_(alpha|beta):|init: done' || true

# --- the REST API -----------------------------------------------------------------------------
token="$(curl -sf -X POST "$api/auth/token" -H 'Content-Type: application/json' \
    -d "{\"username\": \"admin\", \"password\": \"${AIRFLOW_ADMIN_PASSWORD:-admin}\"}" \
    | jq -r .access_token)" || die "no token from $api/auth/token"
rest() {  # METHOD PATH [JSON]
    local args=(-sf -X "$1" "$api/api/v2$2" -H "Authorization: Bearer $token")
    [ "$#" -gt 2 ] && args+=(-H 'Content-Type: application/json' -d "$3")
    curl "${args[@]}"
}
urlq() { jq -rn --arg s "$1" '$s|@uri'; }
short() { local h="$1"; echo "${h%%.*}"; }   # a host name without its domain: the service name

# Both triggerers heartbeat (alive TriggererJobs in the database), both workers answer Celery.
alive_triggerers() {
    rest GET "/jobs?job_type=TriggererJob&is_alive=true&limit=100" \
        | jq -r '.jobs[] | "\(.id) \(.hostname)"'
}
triggerers="$(alive_triggerers)"
for t in triggerer-1 triggerer-2; do
    awk -v t="$t" '{ sub(/\..*/, "", $2) } $2 == t { found = 1 } END { exit !found }' \
        <<<"$triggerers" || die "no alive TriggererJob on $t: $(tr '\n' ' ' <<<"$triggerers")"
done
say "triggerers alive (job id, host): $(tr '\n' ' ' <<<"$triggerers")"
for w in "${workers[@]}"; do
    # shellcheck disable=SC2016  # $HOSTNAME is the worker's, expanded in its shell
    out="$(dc exec -T "$w" sh -c 'celery --app airflow.providers.celery.executors.celery_executor.app inspect ping -d "celery@$HOSTNAME"' 2>&1)" \
        || die "$w does not answer a Celery ping: $(tail -3 <<<"$out")"
    [[ "$out" == *pong* ]] || die "$w: no pong in: $(tail -3 <<<"$out")"
done
say "Celery workers answer a ping: ${workers[*]}"

deadline=$((SECONDS + 300))
until rest GET /dags/train_pipeline >/dev/null 2>&1; do
    [ "$SECONDS" -lt "$deadline" ] || die "train_pipeline was not parsed in time"
    sleep 5
done
rest PATCH /dags/train_pipeline '{"is_paused": false}' >/dev/null
run_id="$(rest POST /dags/train_pipeline/dagRuns \
    "{\"logical_date\": null, \"conf\": {\"epochs\": $epochs}}" | jq -r .dag_run_id)"
if [ -z "$run_id" ] || [ "$run_id" = null ]; then die "the DAG run was not created"; fi
run="/dags/train_pipeline/dagRuns/$(urlq "$run_id")"
say "triggered train_pipeline through the REST API: run $run_id, conf {\"epochs\": $epochs}"
run_start=$SECONDS

ti_state() { rest GET "$run/taskInstances/$1" | jq -r '.state // "none"'; }
# The train job: wait until Slurm runs it, then until its checkpoint reaches E2E_KILL_AT.
deadline=$((SECONDS + 600))
cluster="" node="" job=""
while [ -z "$node" ]; do
    state="$(ti_state train)"
    case "$state" in failed | upstream_failed | success) die "train ended ($state) before the kill" ;; esac
    for c in alpha beta; do
        # the job names are sky-<dag>-<task>-<digest>-t<try>-a<attempt>
        line="$(dc exec -T "slurm-$c" squeue -h -t RUNNING -o '%i %j %N' 2>/dev/null \
            | awk '$2 ~ /^sky-train-pipeline-train-/' | head -1)"
        if [ -n "$line" ]; then
            read -r job _ node <<<"$line"
            cluster="$c"
            say "train is $state; its job $job runs on slurm-$c, node $node: $line"
            break
        fi
    done
    [ -n "$node" ] && break
    [ "$SECONDS" -lt "$deadline" ] || die "no train job ran in time (train: $state)"
    sleep 3
done
# The triggerer holding train's trigger: SIGKILL it (a machine lost) and wait until the other one
# takes the trigger over (once the dead one's heartbeat is older than
# [triggerer] triggerer_health_check_threshold, 30 s).
killed_triggerer=""
if [ "${E2E_KILL_TRIGGERER:-1}" != 0 ]; then
    trigger_job() { rest GET "$run/taskInstances/train" | jq -r '.trigger.triggerer_id // empty'; }
    job_host() {
        rest GET "/jobs?job_type=TriggererJob&limit=100" \
            | jq -r --argjson id "$1" '.jobs[] | select(.id == $id) | .hostname'
    }
    deadline=$((SECONDS + 120))
    until holder="$(trigger_job)" && [ -n "$holder" ]; do
        [ "$SECONDS" -lt "$deadline" ] || die "train's trigger was not assigned to a triggerer"
        sleep 2
    done
    killed_triggerer="$(short "$(job_host "$holder")")"
    case "$killed_triggerer" in triggerer-1 | triggerer-2) ;;
        *) die "train's trigger is held by job $holder on '$killed_triggerer'" ;; esac
    say "train's trigger is held by $killed_triggerer (job $holder): SIGKILL it"
    dc kill -s SIGKILL "$killed_triggerer" >/dev/null 2>&1 || die "could not kill $killed_triggerer"
    kill_trig_time=$SECONDS
    deadline=$((SECONDS + 180))
    while :; do
        now="$(trigger_job || true)"
        if [ -n "$now" ] && [ "$now" != "$holder" ]; then break; fi
        [ "$SECONDS" -lt "$deadline" ] || die "no other triggerer took train's trigger over"
        sleep 2
    done
    taker="$(short "$(job_host "$now")")"
    [ "$taker" != "$killed_triggerer" ] \
        || say "(docker restarted $killed_triggerer, whose new job $now took it over)"
    say "train's trigger taken over by $taker (job $now) $((SECONDS - kill_trig_time)) s after the kill;" \
        "$killed_triggerer is $(docker inspect -f '{{.State.Status}}' "$(dc ps -q "$killed_triggerer")")"
fi

ckpt_epoch() {
    dc exec -T worker-1 sh -c "cat /tmp/airflow-skypilot-demo/*/ckpt/*.ckpt 2>/dev/null" \
        | tail -1 | tr -dc 0-9
}
deadline=$((SECONDS + 300))
until [ "$(ckpt_epoch || true)" -ge "$kill_at" ] 2>/dev/null; do
    [ "$SECONDS" -lt "$deadline" ] || die "the checkpoint did not reach epoch $kill_at"
    sleep 2
done
killed_epoch="$(ckpt_epoch)"
say "checkpoint at epoch $killed_epoch, killing the node: slurm-cluster kill-node $node on slurm-$cluster"
dc exec -T "slurm-$cluster" slurm-cluster kill-node "$node"
kill_time=$SECONDS

# --- the end of the run -----------------------------------------------------------------------
deadline=$((SECONDS + ${E2E_RUN_TIMEOUT:-900}))
while :; do
    state="$(rest GET "$run" | jq -r .state)"
    case "$state" in success | failed) break ;; esac
    [ "$SECONDS" -lt "$deadline" ] || die "the DAG run is still $state"
    sleep 5
done
say "DAG run $state: $((SECONDS - run_start)) s after the trigger, $((SECONDS - kill_time)) s after the kill"
rest GET "$run/taskInstances" >"$log_dir/task-instances.json"
jq -r '.task_instances[] | "  \(.task_id): \(.state), try \(.try_number), \(.duration // 0 | floor) s, on \(.hostname)"' \
    "$log_dir/task-instances.json"
say "slurm-$cluster after the kill:"
dc exec -T "slurm-$cluster" slurm-cluster status 2>&1 | sed 's/^/  /' || true
[ "$state" = success ] || die "the DAG run failed"

result="$(rest GET "$run/taskInstances/train/xcomEntries/return_value" | jq -c '.value')"
printf '%s\n' "$result" >"$log_dir/train-result.json"
attempts="$(jq -r 'if type == "string" then fromjson else . end | .attempts | length' <<<"$result")"
say "train's result: $attempts attempts:"
jq -r 'if type == "string" then fromjson else . end
    | .attempts[] | "  \(.connection) \(.location // "") job \(.job_id): \(.state)"
        + (if (.reason // "") != "" then " (\(.reason))" else "" end)' \
    <<<"$result" || true
jq -r 'if type == "string" then fromjson else . end
    | "  final: \(.connection) job \(.job_id)"' <<<"$result" || true
try="$(rest GET "$run/taskInstances/train" | jq -r .try_number)"
rest GET "$run/taskInstances/train/logs/$try?full_content=true" >"$log_dir/train-task.json" \
    || die "could not read train's log"
jq -r '.content[]? | if type == "object" then (.event // tostring) else tostring end' \
    "$log_dir/train-task.json" >"$log_dir/train-task.log"
say "train's log ($(wc -l <"$log_dir/train-task.log") lines), the failover in it:"
grep -E 'Submitted|ended:|moving elsewhere|resuming from epoch|epoch 120/' "$log_dir/train-task.log" \
    | cut -c1-160 | sed 's/^/  /' || true
resumed="$(grep -o 'resuming from epoch [0-9]*' "$log_dir/train-task.log" | head -1 || true)"
[ "$attempts" -ge 2 ] || die "train has $attempts attempt(s): no failover"
[ -n "$resumed" ] || die "the new job did not resume from the checkpoint (see $log_dir/train-task.log)"
# every task ran on a Celery worker
while read -r task host; do
    case "$(short "$host")" in worker-1 | worker-2) ;; *) die "$task ran on '$host', not a Celery worker" ;; esac
done < <(jq -r '.task_instances[] | "\(.task_id) \(.hostname)"' "$log_dir/task-instances.json")
say "every task ran on a Celery worker: $(jq -r '[.task_instances[] | "\(.task_id)@\(.hostname)"] | join(" ")' \
    "$log_dir/task-instances.json")"
if [ -n "$killed_triggerer" ]; then
    say "the scheduler's health after losing $killed_triggerer: $(curl -sf "$api/api/v2/monitor/health" \
        | jq -c '{scheduler: .scheduler.status, triggerer: .triggerer.status}')"
fi
say "failover seen: node $node of $cluster killed (checkpoint at epoch $killed_epoch), $resumed"
