#!/usr/bin/env bash
# slurm-cluster: one small Slurm cluster in one container (docker/slurm.Dockerfile).
#
# It runs slurmctld, one slurmd per fake node and sshd (the cluster's login node) under this
# script as a tiny supervisor, configured only by environment variables:
#
#   SLURM_CLUSTER_NAME       cluster name (ClusterName=), e.g. alpha                (required)
#   SLURM_NODES              node names, space or comma separated, e.g. "a1 a2"     (required)
#   SLURM_GPU_TYPE           GRES type of the fake GPUs on every node, e.g. a100
#   SLURM_GPUS_PER_NODE      fake GPUs per node (0: no GPUs)                         (default 0)
#   SLURM_CPUS_PER_NODE      CPUs each node claims                                  (default 8)
#   SLURM_MEMORY_MB          memory each node claims, MB                        (default 16000)
#   SLURM_PARTITIONS         "name=node,node name=node ...", e.g. "batch=a1,a2 short=a2"
#                                                                                    (required)
#   SLURM_DEFAULT_PARTITION  the default partition                (default: the first listed)
#   SLURM_PARTITION_MAXTIME  "name=minutes ...", e.g. "short=10"      (default: all UNLIMITED)
#   SLURM_FIRST_JOB_ID       FirstJobId=                                            (default 1)
#   SSH_PUBLIC_DIR           shared volume: client.pub in, hostkeys/<cluster>.pub out
#                                                                       (default /keys/public)
#   SCRATCH_DIR              shared scratch mount, made world-writable (sticky)     (optional)
#
# Commands (the image's ENTRYPOINT is this script, installed as /usr/local/bin/slurm-cluster):
#   run                  render the config, start everything, supervise (the default CMD)
#   render DIR           only write slurm.conf and gres.conf into DIR (used by the tests)
#   keygen               create the Airflow side's SSH client key (the one-shot ssh-keys service)
#   health               exit 0 when the cluster is up and its login node listens (healthcheck)
#   status               nodes, partitions and jobs
#   kill-node NODE       SIGKILL a node's slurmd and its job steps, as if the machine died
#   start-node NODE      start a node's slurmd again and return the node to service
#   drain-node NODE [REASON] / resume-node NODE
#
# What it learned from tests/sandbox/slurm.py (Slurm 22.05 from Debian bookworm):
# fake GPUs need gres.conf `File=` entries (symlinks to /dev/null) or the node is INVAL;
# proctrack/linuxproc + task/none work without cgroups; SlurmdParameters=config_overrides lets
# the fake nodes claim more CPUs and memory than the container has; slurmctld state is wiped on
# every start; `scontrol ping` must say "is UP" (slurmctld exits 0 even on a fatal config).
set -euo pipefail

readonly CONF_DIR=/etc/slurm
readonly TEMPLATE_DIR="${SLURM_TEMPLATE_DIR:-/usr/local/share/slurm-cluster}"
readonly STATE_DIR=/var/spool/slurmctld
readonly SPOOL_DIR=/var/spool/slurmd
readonly RUN_DIR=/run/slurm
readonly LOG_DIR=/var/log/slurm
readonly FAKE_GPU_DIR="${SLURM_FAKE_GPU_DIR:-/var/lib/slurm-fake-gpus}"
readonly LOGIN_DIR=/var/lib/login-node          # persistent volume: the login node's host key
readonly HOST_KEY="${LOGIN_DIR}/ssh_host_ed25519_key"
readonly READY_FILE=/run/slurm-cluster.ready
readonly CTLD_PORT=6817
readonly FIRST_SLURMD_PORT=6818
readonly NODE_ENV=SKYPILOT_DOCKER_NODE          # each slurmd carries its node in its environment
readonly SSH_PUBLIC_DIR="${SSH_PUBLIC_DIR:-/keys/public}"
readonly LOGIN_USER="${LOGIN_USER:-skyuser}"

log() { printf 'slurm-cluster[%s]: %s\n' "${SLURM_CLUSTER_NAME:-?}" "$*" >&2; }
die() { log "error: $*"; exit 2; }

# --------------------------------------------------------------------------- configuration

NODES=()
PARTITION_NAMES=()
declare -A PARTITION_NODES=()
declare -A PARTITION_MAXTIME=()
DEFAULT_PARTITION=""
declare -A NAMES=()         # pid -> daemon name, for the daemons this script started
declare -A NODE_OF_PID=()   # pid -> node, for the slurmd children
GPUS=0
GPU_TYPE=""
CPUS=8
MEMORY_MB=16000
FIRST_JOB_ID=1

is_uint() { [[ "$1" =~ ^[0-9]+$ ]]; }
is_name() { [[ "$1" =~ ^[a-z][a-z0-9_-]*$ ]]; }

load_config() {
    local name="${SLURM_CLUSTER_NAME:-}" entry part nodes node minutes
    is_name "$name" || die "SLURM_CLUSTER_NAME must be a lowercase name, got '${name}'"
    read -r -a NODES <<<"${SLURM_NODES//,/ }"
    [ "${#NODES[@]}" -gt 0 ] || die "SLURM_NODES is empty"
    for node in "${NODES[@]}"; do
        is_name "$node" || die "bad node name '${node}' in SLURM_NODES"
    done
    GPUS="${SLURM_GPUS_PER_NODE:-0}"
    GPU_TYPE="${SLURM_GPU_TYPE:-}"
    CPUS="${SLURM_CPUS_PER_NODE:-8}"
    MEMORY_MB="${SLURM_MEMORY_MB:-16000}"
    FIRST_JOB_ID="${SLURM_FIRST_JOB_ID:-1}"
    for value in "$GPUS" "$CPUS" "$MEMORY_MB" "$FIRST_JOB_ID"; do
        is_uint "$value" || die "expected a whole number, got '${value}'"
    done
    if [ "$GPUS" -gt 0 ]; then
        is_name "$GPU_TYPE" || die "SLURM_GPU_TYPE must be set (e.g. a100) when there are GPUs"
    fi
    for entry in ${SLURM_PARTITIONS:-}; do
        part="${entry%%=*}"
        nodes="${entry#*=}"
        if [ "$part" = "$entry" ] || [ -z "$nodes" ]; then
            die "bad SLURM_PARTITIONS entry '${entry}' (expected name=node,node)"
        fi
        is_name "$part" || die "bad partition name '${part}'"
        for node in ${nodes//,/ }; do
            in_nodes "$node" || die "partition ${part} names node '${node}' not in SLURM_NODES"
        done
        PARTITION_NAMES+=("$part")
        PARTITION_NODES["$part"]="$nodes"
        PARTITION_MAXTIME["$part"]=UNLIMITED
    done
    [ "${#PARTITION_NAMES[@]}" -gt 0 ] || die "SLURM_PARTITIONS is empty"
    for entry in ${SLURM_PARTITION_MAXTIME:-}; do
        part="${entry%%=*}"
        minutes="${entry#*=}"
        [ -n "${PARTITION_NODES[$part]:-}" ] || die "SLURM_PARTITION_MAXTIME names '${part}'"
        is_uint "$minutes" || die "bad time limit '${minutes}' for partition ${part}"
        PARTITION_MAXTIME["$part"]="$minutes"
    done
    DEFAULT_PARTITION="${SLURM_DEFAULT_PARTITION:-${PARTITION_NAMES[0]}}"
    [ -n "${PARTITION_NODES[$DEFAULT_PARTITION]:-}" ] \
        || die "SLURM_DEFAULT_PARTITION '${DEFAULT_PARTITION}' is not a partition"
}

in_nodes() {
    local node
    for node in "${NODES[@]}"; do
        [ "$node" = "$1" ] && return 0
    done
    return 1
}

# Every fake node has its own loopback address, so SKYPILOT_NODE_IPS lists distinct IPs.
node_addr() { printf '127.0.1.%s\n' "$(($1 + 1))"; }

render() {
    local out="$1" host="${SLURM_CONTROL_HOST:-$(hostname -s)}" i node gres nodes_text=""
    local parts_text="" part default gres_text="AutoDetect=off"$'\n' conf
    [ -f "${TEMPLATE_DIR}/slurm.conf.template" ] || die "no ${TEMPLATE_DIR}/slurm.conf.template"
    mkdir -p "$out"
    for i in "${!NODES[@]}"; do
        node="${NODES[$i]}"
        gres=""
        if [ "$GPUS" -gt 0 ]; then
            gres=" Gres=gpu:${GPU_TYPE}:${GPUS}"
            gres_text+="NodeName=${node} Name=gpu Type=${GPU_TYPE}"
            gres_text+=" File=${FAKE_GPU_DIR}/${node}/nvidia[0-$((GPUS - 1))]"$'\n'
        fi
        nodes_text+="NodeName=${node} NodeHostname=${host} NodeAddr=$(node_addr "$i")"
        nodes_text+=" Port=$((FIRST_SLURMD_PORT + i)) CPUs=${CPUS} RealMemory=${MEMORY_MB}"
        nodes_text+="${gres} State=UNKNOWN"$'\n'
    done
    for part in "${PARTITION_NAMES[@]}"; do
        default=NO
        [ "$part" = "$DEFAULT_PARTITION" ] && default=YES
        parts_text+="PartitionName=${part} Nodes=${PARTITION_NODES[$part]} Default=${default}"
        parts_text+=" MaxTime=${PARTITION_MAXTIME[$part]} State=UP"$'\n'
    done
    conf="$(<"${TEMPLATE_DIR}/slurm.conf.template")"
    conf="${conf//@CLUSTER_NAME@/${SLURM_CLUSTER_NAME}}"
    conf="${conf//@CONTROL_HOST@/${host}}"
    conf="${conf//@CTLD_PORT@/${CTLD_PORT}}"
    conf="${conf//@FIRST_JOB_ID@/${FIRST_JOB_ID}}"
    conf="${conf//@NODES@/${nodes_text%$'\n'}}"
    conf="${conf//@PARTITIONS@/${parts_text%$'\n'}}"
    printf '%s\n' "$conf" >"${out}/slurm.conf"
    printf '%s' "$gres_text" >"${out}/gres.conf"
    chmod 0644 "${out}/slurm.conf" "${out}/gres.conf"
}

# --------------------------------------------------------------------------- processes

proc_comm() { cat "/proc/$1/comm" 2>/dev/null || true; }

# Pids of live processes named $1 (slurmd or slurmstepd) of node $2: those whose environment has
# SKYPILOT_DOCKER_NODE=$2, or that hold the node's slurmd log open. slurmstepd inherits slurmd's
# environment but overwrites it with its process title ("slurmstepd: [1006.batch]"), so a job
# step is found by its log file (SlurmdLogFile=/var/log/slurm/slurmd-%n.log in slurm.conf).
pids_of_node() {
    local comm="$1" node="$2" dir pid fd
    for dir in /proc/[0-9]*; do
        pid="${dir#/proc/}"
        [ "$(proc_comm "$pid")" = "$comm" ] || continue
        if tr '\0' '\n' <"${dir}/environ" 2>/dev/null | grep -qx "${NODE_ENV}=${node}"; then
            printf '%s\n' "$pid"
            continue
        fi
        for fd in "${dir}"/fd/*; do
            if [ "$(readlink "$fd" 2>/dev/null)" = "${LOG_DIR}/slurmd-${node}.log" ]; then
                printf '%s\n' "$pid"
                break
            fi
        done
    done
}

# All live descendants of the given pids.
descendants() {
    local table
    table="$(ps -e -o pid= -o ppid=)"
    awk -v roots="$*" '
        { kids[$2] = kids[$2] " " $1 }
        END {
            n = split(roots, stack, " ")
            while (n > 0) {
                p = stack[n--]
                m = split(kids[p], c, " ")
                for (i = 1; i <= m; i++) { print c[i]; stack[++n] = c[i] }
            }
        }' <<<"$table"
}

kill_pids() {
    local sig="$1" pid
    shift
    for pid in "$@"; do
        kill "-${sig}" "$pid" 2>/dev/null || true
    done
}

wait_until() {  # SECONDS DESCRIPTION COMMAND...: poll COMMAND once a second
    local seconds="$1" what="$2" deadline
    shift 2
    deadline=$((SECONDS + seconds))
    until "$@"; do
        if [ "$SECONDS" -ge "$deadline" ]; then
            log "timed out after ${seconds}s waiting for ${what}"
            return 1
        fi
        sleep 1
    done
}

# Like wait_until, but gives up at once when the daemon PID that should get there has died.
wait_daemon() {  # SECONDS PID DESCRIPTION COMMAND...
    local seconds="$1" pid="$2" what="$3" deadline
    shift 3
    deadline=$((SECONDS + seconds))
    until "$@"; do
        if ! kill -0 "$pid" 2>/dev/null; then
            log "${NAMES[$pid]:-pid ${pid}} exited while waiting for ${what}"
            return 1
        fi
        if [ "$SECONDS" -ge "$deadline" ]; then
            log "timed out after ${seconds}s waiting for ${what}"
            return 1
        fi
        sleep 1
    done
}

munge_works() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

ctld_up() { scontrol ping 2>/dev/null | grep -q ' is UP'; }

# A listening socket on port 22 (state 0A), read from /proc rather than by connecting: every
# probe connection would make sshd log two lines, every 5 s from the healthcheck.
sshd_listens() {
    grep -qE '^ *[0-9]+: [0-9A-F]+:0016 [0-9A-F]+:0000 0A ' /proc/net/tcp /proc/net/tcp6 2>/dev/null
}

node_state() { scontrol show node -o "$1" 2>/dev/null | tr ' ' '\n' | sed -n 's/^State=//p'; }

node_responds() {
    local state
    state="$(node_state "$1")"
    [ -n "$state" ] && [[ "$state" != *NOT_RESPONDING* ]] && [[ "$state" != *'*'* ]]
}

all_nodes_idle() {
    local node state
    for node in "${NODES[@]}"; do
        state="$(node_state "$node")"
        [ "$state" = IDLE ] || return 1
    done
}

tail_logs() {
    local file
    for file in "${LOG_DIR}"/*.log; do
        [ -f "$file" ] || continue
        log "--- last lines of ${file}"
        tail -n 15 "$file" >&2 || true
    done
}

# --------------------------------------------------------------------------- start-up

prepare() {
    local i node j
    rm -rf "$STATE_DIR" "$SPOOL_DIR" "$RUN_DIR" "$FAKE_GPU_DIR" "$READY_FILE"
    install -d -m 0755 "$CONF_DIR" "$STATE_DIR" "$SPOOL_DIR" "$RUN_DIR" "$LOG_DIR" "$FAKE_GPU_DIR"
    render "$CONF_DIR"
    for i in "${!NODES[@]}"; do
        node="${NODES[$i]}"
        install -d -m 0755 "${SPOOL_DIR}/${node}" "${FAKE_GPU_DIR}/${node}"
        for ((j = 0; j < GPUS; j++)); do
            ln -s /dev/null "${FAKE_GPU_DIR}/${node}/nvidia${j}"
        done
    done
    # No slurmdbd: finished jobs are kept in a jobcomp file that `sacct -c` reads as any user.
    install -m 0644 -o "$LOGIN_USER" -g "$LOGIN_USER" /dev/null "${LOG_DIR}/jobcomp.txt"
    if [ -n "${SCRATCH_DIR:-}" ]; then
        install -d "$SCRATCH_DIR"
        chmod 1777 "$SCRATCH_DIR"
    fi
}

start_munge() {
    install -d -o munge -g munge -m 0700 /etc/munge /var/lib/munge /var/log/munge
    rm -rf /run/munge   # a restarted container keeps /run: no stale socket or pid file
    install -d -o munge -g munge -m 0755 /run/munge
    if [ ! -s /etc/munge/munge.key ]; then
        mungekey --create --keyfile=/etc/munge/munge.key
    fi
    chown munge:munge /etc/munge/munge.key
    chmod 0600 /etc/munge/munge.key
    setpriv --reuid=munge --regid=munge --init-groups /usr/sbin/munged --foreground &
    NAMES[$!]=munged
    wait_daemon 30 "$!" munged munge_works || fail_start
}

start_slurmctld() {
    slurmctld -D -f "${CONF_DIR}/slurm.conf" &
    NAMES[$!]=slurmctld
    wait_daemon 60 "$!" "slurmctld to answer scontrol ping" ctld_up || fail_start
}

start_slurmd_child() {
    local node="$1"
    env "${NODE_ENV}=${node}" slurmd -D -f "${CONF_DIR}/slurm.conf" -N "$node" &
    NAMES[$!]="slurmd ${node}"
    NODE_OF_PID[$!]="$node"
}

start_sshd() {
    local home
    install -d -m 0700 "$LOGIN_DIR"
    if [ ! -s "$HOST_KEY" ]; then
        ssh-keygen -q -t ed25519 -N '' -C "login@${SLURM_CLUSTER_NAME}" -f "$HOST_KEY"
    fi
    chmod 0600 "$HOST_KEY"
    wait_until 60 "${SSH_PUBLIC_DIR}/client.pub (written by the ssh-keys service)" \
        test -s "${SSH_PUBLIC_DIR}/client.pub" || fail_start
    home="$(getent passwd "$LOGIN_USER" | cut -d: -f6)"
    [ -n "$home" ] || die "login user ${LOGIN_USER} does not exist"
    install -d -m 0755 -o "$LOGIN_USER" -g "$LOGIN_USER" "$home"
    install -d -m 0700 -o "$LOGIN_USER" -g "$LOGIN_USER" "${home}/.ssh"
    install -m 0600 -o "$LOGIN_USER" -g "$LOGIN_USER" "${SSH_PUBLIC_DIR}/client.pub" \
        "${home}/.ssh/authorized_keys"
    install -d -m 0755 /run/sshd
    /usr/sbin/sshd -D -e &
    NAMES[$!]=sshd
    wait_daemon 30 "$!" "sshd to listen on port 22" sshd_listens || fail_start
}

publish_host_key() {
    local dir="${SSH_PUBLIC_DIR}/hostkeys"
    install -d -m 0755 "$dir"
    install -m 0644 "${HOST_KEY}.pub" "${dir}/.${SLURM_CLUSTER_NAME}.pub.tmp"
    mv -f "${dir}/.${SLURM_CLUSTER_NAME}.pub.tmp" "${dir}/${SLURM_CLUSTER_NAME}.pub"
}

shutdown() {
    local pids=("${!NAMES[@]}") steps=() node
    log "stopping"
    rm -f "$READY_FILE"
    if ctld_up; then
        scancel --full --quiet --user="$LOGIN_USER" 2>/dev/null || true
    fi
    for node in "${NODES[@]}"; do
        mapfile -t -O "${#pids[@]}" pids < <(pids_of_node slurmd "$node")
        mapfile -t -O "${#steps[@]}" steps < <(pids_of_node slurmstepd "$node")
    done
    kill_pids TERM "${pids[@]}" "${steps[@]}"
    wait_until 10 "daemons to stop" no_pids_alive "${pids[@]}" "${steps[@]}" || true
    kill_pids KILL "${pids[@]}" "${steps[@]}"
}

# A start-up step failed: show the logs, stop what was started, exit (restart: unless-stopped
# then tries again).
fail_start() {
    tail_logs
    shutdown
    exit 1
}

no_pids_alive() {
    local pid
    for pid in "$@"; do
        kill -0 "$pid" 2>/dev/null && return 1
    done
    return 0
}

run() {
    local i pid rc node
    load_config
    log "starting: nodes ${NODES[*]}, $GPUS x ${GPU_TYPE:-no GPU} each, partitions" \
        "${PARTITION_NAMES[*]} (default ${DEFAULT_PARTITION})"
    trap 'shutdown; exit 0' TERM INT
    prepare
    rm -f "${SSH_PUBLIC_DIR}/hostkeys/${SLURM_CLUSTER_NAME}.pub"
    start_munge
    start_slurmctld
    for i in "${!NODES[@]}"; do
        start_slurmd_child "${NODES[$i]}"
    done
    start_sshd
    wait_until 90 "nodes ${NODES[*]} to be IDLE" all_nodes_idle || fail_start
    publish_host_key
    touch "$READY_FILE"
    log "ready: login node ssh ${LOGIN_USER}@$(hostname -s):22, host key" \
        "$(cut -d' ' -f1-2 "${HOST_KEY}.pub")"
    sinfo >&2 || true
    while true; do
        pid=""
        rc=0
        wait -n -p pid || rc=$?
        if [ -z "$pid" ]; then
            [ "$rc" -eq 127 ] && { log "no daemons left"; exit 1; }
            continue
        fi
        if [ -n "${NODE_OF_PID[$pid]:-}" ]; then
            node="${NODE_OF_PID[$pid]}"
            unset "NODE_OF_PID[$pid]" "NAMES[$pid]"
            log "slurmd of node ${node} exited (status ${rc}): Slurm will mark ${node} DOWN;" \
                "'slurm-cluster start-node ${node}' brings it back"
            continue
        fi
        log "${NAMES[$pid]:-pid ${pid}} exited (status ${rc}); stopping the cluster"
        unset "NAMES[$pid]"
        tail_logs
        shutdown
        exit 1
    done
}

# --------------------------------------------------------------------------- other commands

keygen() {
    local client_dir="${SSH_CLIENT_DIR:-/keys/client}" uid="${AIRFLOW_UID:-50000}"
    is_uint "$uid" || die "AIRFLOW_UID must be a number, got '${uid}'"
    install -d -m 0755 "$client_dir" "$SSH_PUBLIC_DIR" "${SSH_PUBLIC_DIR}/hostkeys"
    if [ ! -s "${client_dir}/id_ed25519" ] || [ ! -s "${client_dir}/id_ed25519.pub" ]; then
        rm -f "${client_dir}/id_ed25519" "${client_dir}/id_ed25519.pub"
        ssh-keygen -q -t ed25519 -N '' -C "airflow@airflow-skypilot" -f "${client_dir}/id_ed25519"
        log "created the Airflow SSH client key"
    fi
    # Readable by the Airflow user (uid AIRFLOW_UID) only; the login nodes get the public half.
    chown "${uid}:0" "${client_dir}/id_ed25519" "${client_dir}/id_ed25519.pub"
    chmod 0600 "${client_dir}/id_ed25519"
    chmod 0644 "${client_dir}/id_ed25519.pub"
    install -m 0644 "${client_dir}/id_ed25519.pub" "${SSH_PUBLIC_DIR}/.client.pub.tmp"
    mv -f "${SSH_PUBLIC_DIR}/.client.pub.tmp" "${SSH_PUBLIC_DIR}/client.pub"
    log "client key $(ssh-keygen -l -f "${client_dir}/id_ed25519.pub")"
}

health() {
    [ -f "$READY_FILE" ] && ctld_up && sshd_listens
}

kill_node() {
    local node="$1" pids=() steps=() kids=()
    load_config
    in_nodes "$node" || die "no node '${node}' in this cluster (${NODES[*]})"
    mapfile -t pids < <(pids_of_node slurmd "$node")
    kill_pids KILL "${pids[@]}"
    # Two passes: a job step may have been forking while we looked.
    for _ in 1 2; do
        mapfile -t steps < <(pids_of_node slurmstepd "$node")
        if [ "${#steps[@]}" -gt 0 ]; then
            mapfile -t kids < <(descendants "${steps[@]}")
            kill_pids KILL "${steps[@]}" "${kids[@]}"
        fi
        sleep 0.2
    done
    log "node ${node}: slurmd and its job steps killed (pids ${pids[*]:-none});" \
        "Slurm marks it DOWN within ~20 s"
}

start_node() {
    local node="$1"
    load_config
    in_nodes "$node" || die "no node '${node}' in this cluster (${NODES[*]})"
    if [ -n "$(pids_of_node slurmd "$node")" ]; then
        log "slurmd of ${node} is already running"
    else
        install -d -m 0755 "${SPOOL_DIR}/${node}"
        env "${NODE_ENV}=${node}" slurmd -f "${CONF_DIR}/slurm.conf" -N "$node"
    fi
    wait_until 60 "node ${node} to register" node_responds "$node" || exit 1
    case "$(node_state "$node")" in
        *DOWN* | *DRAIN* | *FAIL*)
            scontrol update NodeName="$node" State=RESUME || true
            ;;
    esac
    log "node ${node}: $(node_state "$node")"
}

status() {
    sinfo -N -o '%N %P %T %G' || true
    squeue -o '%i %j %u %P %T %R' || true
}

main() {
    local command="${1:-run}"
    [ "$#" -gt 0 ] && shift
    case "$command" in
        run) run ;;
        render)
            [ "$#" -eq 1 ] || die "usage: slurm-cluster render DIR"
            load_config
            render "$1"
            ;;
        keygen) keygen ;;
        health) health ;;
        status) status ;;
        kill-node)
            [ "$#" -eq 1 ] || die "usage: slurm-cluster kill-node NODE"
            kill_node "$1"
            ;;
        start-node)
            [ "$#" -eq 1 ] || die "usage: slurm-cluster start-node NODE"
            start_node "$1"
            ;;
        drain-node)
            [ "$#" -ge 1 ] || die "usage: slurm-cluster drain-node NODE [REASON]"
            scontrol update NodeName="$1" State=DRAIN Reason="${2:-drained by hand}"
            ;;
        resume-node)
            [ "$#" -eq 1 ] || die "usage: slurm-cluster resume-node NODE"
            scontrol update NodeName="$1" State=RESUME
            ;;
        *) exec "$command" "$@" ;;
    esac
}

main "$@"
