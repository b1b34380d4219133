"""What an EC2 instance of a job runs: the bootstrap user-data and the job's payload.

The user-data is a short bash script (no user text in it: names, numbers and S3 paths only,
each quoted with :func:`shlex.quote`) followed by the payload, a base64 ``tar.gz`` of the job's
files: ``env.sh`` (the SkyPilot env, quoted), the task's ``setup.sh``/``run.sh`` verbatim, the
shared ``node.sh`` wrapper, the local workdir and file mounts. A payload with files of the
user's (workdir, file mounts: they may hold credentials, and user-data is readable with
``ec2:DescribeInstanceAttribute``), or one that does not fit in EC2's 16 KB of user-data, is
staged in S3 and fetched by the instance with its own credentials; only then the bootstrap is
all the user-data holds.

Secrets are never in either: they are SSM SecureString parameters (values ``b64:<base64>``,
so any byte, and the empty string, survive SSM and the CLI's text output), read on the
instance with ``aws ssm get-parameters --with-decryption`` into a 0600 ``secrets.sh`` that is
removed when the job ends.

On the instance (bash, curl, base64, tar, the AWS CLI; all on the Deep Learning AMIs):
IMDSv2 gives the rank (``ami-launch-index``, stable: EC2 numbers one RunInstances call's
instances 0..N-1), the private IP and the reservation; a multi-node job lists its reservation's
instances with ``aws ec2 describe-instances`` (by the job tag) for ``SKYPILOT_NODE_IPS`` in rank
order. Setup runs on every node, then (after an S3 barrier, as SkyPilot waits for every node's
setup) run. The log goes to ``<job prefix>rank-<r>/log`` every few seconds and once more at the
end, *before* ``rank-<r>/exit_code``: when the marker is there, the log is complete. A spot
interruption notice writes ``rank-<r>/preempted``. Finally ``shutdown -h now`` (the instance's
shutdown behaviour is terminate). Anything unexpected ends in ``rank-<r>/bootstrap_error``.

A node whose run ended well stays up (``run_done``) until every node's has, or another node
ended otherwise: as on SkyPilot, whose nodes live until the job ends, a daemon a worker rank
started (``ray start``, an MPI target) lives on for the ranks still running.

Setup and run each end once their output is closed by every process holding it, as SkyPilot's
(``log_lib.run_with_log`` reads the output until EOF, then waits for the process): ``node.sh``
writes through a pipe to a ``cat`` appending to the log, and the step is over when both have
ended. A writer the script left in the background (``(sleep 8; echo late) &``) keeps the step
going and its lines reach the log; written straight to the log file, the step ended with the
script's shell and the ``shutdown`` killed the writer. The exit code is the script's
(``PIPESTATUS``), not the pipe's; output the secret mask filters (``node.sh``'s awk) passes
through the same pipe. A process that never closes the output keeps the job running, as on
SkyPilot; a cancel terminates the instances whatever still runs there, and a TERM to the
bootstrap (an OS shutdown) still ends it at once (its EXIT trap reports and powers off).

The bootstrap's ``umask 077`` keeps its own files private; setup and run get the usual 022
(files a job makes are 0644, as on SkyPilot's nodes).

Before the file mounts go in place, ``~/sky_workdir`` (SkyPilot's workdir) becomes a link to the
job's workdir, the cwd of setup and run, unless something other than a link or an empty
directory is there (kept, with a note in the log). A relative mount destination is under the
workdir, as SkyPilot's is under ``~/sky_workdir``.
"""

from __future__ import annotations

import base64
import gzip
import io
import os
import shlex
import tarfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from airflow_skypilot.backends.common import jobscript
from airflow_skypilot.backends.common.workdir import local_source, mount_word, walk
from airflow_skypilot.spec.task import Task

#: EC2's limit on raw user-data; we keep a margin below it.
USER_DATA_LIMIT = 16 * 1024
USER_DATA_BUDGET = USER_DATA_LIMIT - 512
#: the variables the bootstrap hands ``node.sh`` (see jobscript.node_script)
RANK_VAR = "AIRFLOW_SKYPILOT_RANK"
IPS_VAR = "AIRFLOW_SKYPILOT_IPS"


@dataclass
class Payload:
    """The job's files as one tar.gz."""

    data: bytes
    files: list[str] = field(default_factory=list)

    @property
    def b64(self) -> str:
        return base64.b64encode(self.data).decode()

    @property
    def has_user_files(self) -> bool:
        """Does it carry files of the user's (workdir, file_mounts)? They may hold
        credentials (``~/.kaggle/kaggle.json``): never in user-data, which anyone allowed
        ``ec2:DescribeInstanceAttribute`` reads."""
        return any(name.startswith(("workdir/", "mounts/")) for name in self.files)


def _add(tar: tarfile.TarFile, name: str, content: str | bytes, mode: int = 0o600) -> None:
    raw = content.encode() if isinstance(content, str) else content
    info = tarfile.TarInfo(name)
    info.size = len(raw)
    info.mode = mode
    info.mtime = 0  # reproducible: the same job renders the same bytes
    tar.addfile(info, io.BytesIO(raw))


def _owner_free(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def _add_tree(tar: tarfile.TarFile, local: str, arcname: str) -> None:
    """What travels of the tree ``local`` (:func:`~airflow_skypilot.backends.common.workdir.walk`)
    under ``arcname``, in tar's own order (depth first, by name): the same tree packs the same
    bytes. ``local`` given as a link is the folder it points to, as SkyPilot resolves a source
    before its rsync (kept as a link, the members under it would not unpack)."""
    tar.add(os.path.realpath(local), arcname=arcname, recursive=False, filter=_owner_free)
    for path, rel, _ in sorted(walk(local), key=lambda entry: entry[1].split(os.sep)):
        tar.add(path, arcname=f"{arcname}/{rel}", recursive=False, filter=_owner_free)


#: how mounts.sh names a secret filled into a mount (it runs in the job dir, secrets.sh there)
SECRET_REF = '"$(. ./secrets.sh && printf %s "${{{}}}")"'


def mounts_script(task: Task) -> tuple[str, list[tuple[str, str]]]:
    """``mounts.sh`` (copies file_mounts into place on the node) and the local sources to pack
    as (local path, name in the payload). ``s3://`` sources are fetched with the AWS CLI."""
    lines = ["#!/bin/bash", "# airflow-skypilot: put file_mounts in place (generated)", "set -e",
             'cd "$JOB_DIR"']
    local: list[tuple[str, str]] = []

    def word(text: str) -> str:
        # a secret filled into a mount is read from secrets.sh where it is used, in a subshell:
        # sourced here, a secret named HOME or PATH would replace this script's own
        return jobscript.node_word(text, task.secrets, SECRET_REF)

    for i, (dst, src) in enumerate(sorted(task.file_mounts.items())):
        # the workdir is run's cwd, as SkyPilot's ~/sky_workdir is
        target_word = mount_word(dst, home='"$HOME"', workdir='"$JOB_DIR"/workdir', word=word)
        if isinstance(src, str) and src.startswith("s3://"):
            quoted = word(src)
            lines.append(f"mkdir -p \"$(dirname {target_word})\"")
            lines.append(f"aws s3 cp --only-show-errors {quoted} {target_word} 2>/dev/null || "
                         f"aws s3 sync --only-show-errors {quoted} {target_word}")
            continue
        path = local_source(task, src)
        name = f"mounts/{i}"
        local.append((path, name))
        lines.append(f"mkdir -p \"$(dirname {target_word})\"")
        # --remove-destination: a link already there (the workdir's) is replaced, as rsync
        # replaces it; a plain cp writes through it, into whatever it points to
        if os.path.isdir(path):
            lines.append(f"mkdir -p {target_word} && "
                         f"cp -a --remove-destination {name}/. {target_word}/")
        else:
            lines.append(f"cp -a --remove-destination {name} {target_word}")
    return "\n".join(lines) + "\n", local


def render_payload(task: Task, node_env: Mapping[str, str]) -> Payload:
    """The job's files (no secrets) as a reproducible tar.gz."""
    buf = io.BytesIO()
    names: list[str] = []
    # gzip's own header carries a timestamp; mtime=0 keeps two renders a second apart equal
    with gzip.GzipFile(fileobj=buf, mode="wb", compresslevel=9, mtime=0) as gz, \
            tarfile.open(fileobj=gz, mode="w") as tar:
        node = jobscript.node_script(job_dir='"$JOB_DIR"',
                                     workdir='"$AIRFLOW_SKYPILOT_JOB_DIR/workdir"',
                                     rank_var=RANK_VAR, ips_var=IPS_VAR,
                                     has_setup=bool(task.setup), has_run=bool(task.run))
        members = {
            "node.sh": (node, 0o700),
            "env.sh": (jobscript.exports(node_env), 0o600),
            "setup.sh": (jobscript.user_script(task.setup) or "", 0o600),
            "run.sh": (jobscript.user_script(task.run) or "", 0o600),
        }
        if task.file_mounts:
            script, local = mounts_script(task)
            members["mounts.sh"] = (script, 0o700)
        else:
            local = []
        for name, (content, mode) in members.items():
            _add(tar, name, content, mode)
            names.append(name)
        workdir = local_source(task, task.workdir) if isinstance(task.workdir, str) else None
        if workdir:
            _add_tree(tar, workdir, "workdir")
            names.append("workdir/")
        for path, name in local:
            if os.path.isdir(path):
                _add_tree(tar, path, name)
            else:  # a source given as a link: the file it points to, as SkyPilot sends it
                tar.add(os.path.realpath(path), arcname=name)
            names.append(name)
    return Payload(buf.getvalue(), names)


@dataclass
class Bootstrap:
    """Everything the bootstrap script needs to know (no secret values)."""

    job_name: str
    region: str
    s3_job_uri: str  # s3://bucket/prefix/<job>/ (trailing slash)
    num_nodes: int
    spot: bool
    tag_key: str
    secret_params: list[str] = field(default_factory=list)  # full SSM names; basename = env var
    payload_b64: str | None = None  # inline payload, or
    payload_uri: str | None = None  # s3:// of the staged payload
    log_interval: int = 10
    spot_interval: int = 5
    barrier_interval: int = 2
    peer_timeout: int = 300


_SCRIPT = r"""
IMDS="${AWS_EC2_METADATA_SERVICE_ENDPOINT:-http://169.254.169.254}"
: "${HOME:=/root}"
export HOME
JOB_DIR="$HOME/.airflow-skypilot/$JOB"
export JOB_DIR
mkdir -p "$JOB_DIR/workdir" && cd "$JOB_DIR" || exit 1
rm -f "$JOB_DIR/stop"
LOG="$JOB_DIR/node.log"
exec >>"$LOG" 2>&1
RANK_DIR=rank-0
BG=()

say() { printf 'airflow-skypilot: %s\n' "$*"; }
token() { curl -sf -m 5 -X PUT "$IMDS/latest/api/token" \
  -H "X-aws-ec2-metadata-token-ttl-seconds: 21600"; }
md() { curl -sf -m 5 -H "X-aws-ec2-metadata-token: $TOKEN" "$IMDS/latest/meta-data/$1"; }
mark() {  # name content: a marker object under this node's prefix
  printf '%s\n' "$2" | aws s3 cp --only-show-errors - "$S3$RANK_DIR/$1"
}
sync_log() {  # ship the log if it grew (a copy: the log keeps growing while it uploads)
  local size tmp="$LOG.up.$BASHPID" rc
  size=$(stat -c %s "$LOG" 2>/dev/null || echo 0)
  [ "$size" = "${SYNCED:-}" ] && return 0
  cp "$LOG" "$tmp" && aws s3 cp --only-show-errors "$tmp" "$S3$RANK_DIR/log"
  rc=$?
  rm -f "$tmp"
  [ $rc -eq 0 ] && SYNCED=$size
  return $rc
}
nap() {  # sleep $1 seconds unless the job is finishing
  local i
  for ((i = 0; i < $1; i++)); do [ -e "$JOB_DIR/stop" ] && return 1; sleep 1; done
}
finish() {  # marker content: last log, then the marker, then power off
  trap - EXIT
  touch "$JOB_DIR/stop"
  [ ${#BG[@]} -gt 0 ] && wait "${BG[@]}" 2>/dev/null
  rm -f "$JOB_DIR/secrets.sh"
  say "$1: $2"
  sync_log || say "could not upload the log"
  mark "$1" "$2" || say "could not write the $1 marker"
  shutdown -h now
  exit 0
}
trap 'finish bootstrap_error "the bootstrap exited unexpectedly (line $LINENO)"' EXIT

TOKEN=""
for _ in $(seq 1 30); do TOKEN=$(token) && break; sleep 1; done
[ -n "$TOKEN" ] || finish bootstrap_error "instance metadata (IMDS) unreachable"
RANK=$(md ami-launch-index) || finish bootstrap_error "no ami-launch-index in IMDS"
MY_IP=$(md local-ipv4) || finish bootstrap_error "no local-ipv4 in IMDS"
IID=$(md instance-id)
RES=$(md reservation-id)
RANK_DIR="rank-$RANK"
say "job $JOB rank $RANK of $NUM_NODES on $IID ($MY_IP)"

( while nap "$LOG_INTERVAL"; do sync_log; done ) &
BG+=($!)
if [ "$SPOT" = 1 ]; then
  (
    while nap "$SPOT_INTERVAL"; do
      t=$(token) || continue
      if notice=$(curl -sf -m 5 -H "X-aws-ec2-metadata-token: $t" \
          "$IMDS/latest/meta-data/spot/instance-action"); then
        say "spot interruption notice: $notice"
        mark preempted "$notice"
        sync_log
        exit 0
      fi
    done
  ) &
  BG+=($!)
fi

if [ -n "$PAYLOAD_URI" ]; then
  aws s3 cp --only-show-errors "$PAYLOAD_URI" payload.tgz \
    || finish bootstrap_error "cannot fetch the job payload from $PAYLOAD_URI"
else
  payload > payload.tgz
fi
tar -xzf payload.tgz -C "$JOB_DIR" || finish bootstrap_error "cannot unpack the job payload"
rm -f payload.tgz

if [ ${#SECRET_PARAMS[@]} -gt 0 ]; then
  : > "$JOB_DIR/secrets.sh"
  for ((i = 0; i < ${#SECRET_PARAMS[@]}; i += 10)); do
    out=$(aws ssm get-parameters --with-decryption --names "${SECRET_PARAMS[@]:i:10}" \
          --query 'Parameters[].[Name,Value]' --output text) \
      || finish bootstrap_error "cannot read the job's secrets from SSM Parameter Store"
    while IFS=$'\t' read -r name b64; do
      [ -n "$name" ] || continue
      value=$(printf '%s' "${b64#b64:}" | base64 -d; printf x)
      printf 'export %s=%q\n' "${name##*/}" "${value%x}" >> "$JOB_DIR/secrets.sh"
    done <<< "$out"
  done
  [ "$(grep -c '^export ' "$JOB_DIR/secrets.sh")" -eq ${#SECRET_PARAMS[@]} ] \
    || finish bootstrap_error "some of the job's secrets are missing in SSM Parameter Store"
fi

IPS=$MY_IP
if [ "$NUM_NODES" -gt 1 ]; then
  IPS=""
  for _ in $(seq 1 $((PEER_TIMEOUT / 5 + 1))); do
    IPS=$(aws ec2 describe-instances \
      --filters "Name=tag:$TAG_KEY,Values=$JOB" "Name=instance-state-name,Values=pending,running" \
      --query "Reservations[?ReservationId=='$RES'].Instances[].[AmiLaunchIndex,PrivateIpAddress]" \
      --output text | sort -n | awk '$2 != "None" && $2 != "" {print $2}')
    [ "$(printf '%s\n' "$IPS" | grep -c .)" -eq "$NUM_NODES" ] && break
    IPS=""
    sleep 5
  done
  [ -n "$IPS" ] \
    || finish bootstrap_error "cannot list the job's $NUM_NODES nodes (ec2:DescribeInstances)"
fi
export AIRFLOW_SKYPILOT_RANK="$RANK" AIRFLOW_SKYPILOT_IPS="$IPS"

{sky_workdir_link}
if [ -x "$JOB_DIR/mounts.sh" ]; then
  bash "$JOB_DIR/mounts.sh" || finish bootstrap_error "file_mounts failed"
fi

step() {  # setup|run: node.sh's exit code, once every writer of its output closed it
  (umask 022; exec bash "$JOB_DIR/node.sh" "$1") 2>&1 | cat
  set -- "$1" "${PIPESTATUS[@]}"
  # a log pipe that broke is the node's failure, not the job's code: its cat killed (a
  # signal), or failing (a full disk) when the job died of the broken pipe (SIGPIPE, 141);
  # a job that ended of itself keeps its code though the log could not take all of it
  [ "$3" -eq 0 ] || { [ "$3" -lt 128 ] && [ "$2" -ne 141 ]; } ||
    finish bootstrap_error "the $1 step's output could not be logged (exit $3)"
  return "$2"
}
say "setup"
step setup
rc=$?
[ $rc -eq 0 ] || { say "setup failed with exit code $rc; run skipped"; finish exit_code "$rc"; }

barrier() {  # marker: 0 once every node wrote it, 1 when another node ended first, 2: unwritten
  local listing
  mark "$1" 0 || return 2
  while :; do
    if listing=$(aws s3 ls --recursive "$S3"); then
      [ "$(grep -c "/$1\$" <<< "$listing")" -ge "$NUM_NODES" ] && return 0
      grep -Eq '/rank-[0-9]+/(exit_code|bootstrap_error|aborted)$' <<< "$listing" && return 1
    fi
    sleep "$BARRIER_INTERVAL"
  done
}
if [ "$NUM_NODES" -gt 1 ]; then
  barrier setup_done
  case $? in
    1) finish aborted "another node failed before run; run not started" ;;
    2) finish bootstrap_error "cannot write to $S3" ;;
  esac
fi

say "run"
step run
rc=$?
[ $rc -ne 0 ] || [ "$NUM_NODES" -eq 1 ] || barrier run_done || :
finish exit_code "$rc"
"""
_SCRIPT = _SCRIPT.replace("{sky_workdir_link}",
                          jobscript.sky_workdir_link('"$JOB_DIR/workdir"', note="say"))


def render_user_data(boot: Bootstrap) -> str:
    """The bootstrap script (see the module docstring), with the payload inline if given."""
    q = shlex.quote
    head = [
        "#!/bin/bash",
        f"# airflow-skypilot: one node of job {boot.job_name} (generated). It runs the job's",
        "# setup and run from the payload below, ships the log and exit code to S3 and powers",
        "# the instance off. No secret is in this script: they are read from SSM.",
        "set -u",
        "umask 077",
        f"export AWS_DEFAULT_REGION={q(boot.region)} AWS_REGION={q(boot.region)}",
        f"JOB={q(boot.job_name)}",
        f"S3={q(boot.s3_job_uri)}",
        f"NUM_NODES={int(boot.num_nodes)}",
        f"SPOT={1 if boot.spot else 0}",
        f"TAG_KEY={q(boot.tag_key)}",
        f"LOG_INTERVAL={int(boot.log_interval)}",
        f"SPOT_INTERVAL={int(boot.spot_interval)}",
        f"BARRIER_INTERVAL={int(boot.barrier_interval)}",
        f"PEER_TIMEOUT={int(boot.peer_timeout)}",
        f"SECRET_PARAMS=({' '.join(q(p) for p in boot.secret_params)})",
        f"PAYLOAD_URI={q(boot.payload_uri or '')}",
    ]
    if boot.payload_b64:
        head += ["payload() {", "  base64 -d <<'AIRFLOW_SKYPILOT_PAYLOAD'",
                 *_wrap(boot.payload_b64), "AIRFLOW_SKYPILOT_PAYLOAD", "}"]
    else:
        head += ["payload() { return 1; }"]
    return "\n".join(head) + _SCRIPT


def _wrap(text: str, width: int = 76) -> Iterable[str]:
    for i in range(0, len(text), width):
        yield text[i:i + width]


def user_data_size(text: str) -> int:
    return len(text.encode())


__all__ = ["Bootstrap", "Payload", "render_payload", "render_user_data", "USER_DATA_LIMIT",
           "USER_DATA_BUDGET"]
