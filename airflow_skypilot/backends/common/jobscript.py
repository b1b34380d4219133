"""What every backend runs on each node: the task's setup, then its run, with SkyPilot's env.

The user's ``setup`` and ``run`` are shipped verbatim as their own files, after SkyPilot's
prologue (:data:`PROLOGUE`), and executed as SkyPilot executes them, with ``bash -i``;
nothing the user wrote is ever pasted into a quoted shell string. Env values are quoted
with :func:`shlex.quote` (which keeps spaces, quotes, ``$(...)`` and newlines byte for byte).
Secrets go into a separate file that only the job's user can read, never into the job script.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import shlex
from collections.abc import Mapping

from airflow_skypilot.spec.checks import INTERNAL_PREFIX, RESERVED_ENV_NAMES
from airflow_skypilot.spec.task import Task

_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def exports(env: Mapping[str, str]) -> str:
    """``export K='v'`` lines; keys are checked, values quoted for bash."""
    lines = []
    for key, value in env.items():
        if not _NAME_RE.match(key):
            raise ValueError(f"not a valid environment variable name: {key!r}")
        lines.append(f"export {key}={shlex.quote(str(value))}")
    return "\n".join(lines) + ("\n" if lines else "")


def node_word(text: str, secrets: Mapping[str, str], ref: str = '"${{{}}}"') -> str:
    """``text`` as one bash word, each secret value in it written as a reference to the secret
    (``ref`` with its name: ``"${NAME}"`` where the job's env holds it), expanded on the node,
    never in a generated script in clear. SkyPilot fills secrets into file_mounts
    (``s3://team-${KEY}/data``), so a mount's path or URI may hold one."""
    names = {value: name for name, value in secrets.items() if value}
    if not names:
        return shlex.quote(text)
    pattern = re.compile("|".join(re.escape(v) for v in sorted(names, key=len, reverse=True)))
    parts, pos = [], 0
    for match in pattern.finditer(text):
        if match.start() > pos:
            parts.append(shlex.quote(text[pos:match.start()]))
        parts.append(ref.format(names[match.group(0)]))
        pos = match.end()
    if pos < len(text) or not parts:
        parts.append(shlex.quote(text[pos:]))
    return "".join(parts)


def gpus_per_node(count: float) -> int:
    """SkyPilot exports the ceiling of the (possibly fractional) accelerator count."""
    return int(math.ceil(count)) if count else 0


def skypilot_env(task: Task, *, task_id: str, num_gpus_per_node: int, cluster_info: dict,
                 extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The env every node's run gets, before the per-node rank and node IPs.

    Order of precedence (later wins): the task's envs, the caller's extras, SkyPilot's own
    variables. The task's envs named like SkyPilot's variables are dropped (the loader warned):
    the node scripts set some of them after ``env.sh`` is read, and a task's value must not
    replace them either. Secrets are kept apart (see :func:`exports` and the backends); the
    loader refuses secrets of those names.
    """
    env: dict[str, str] = {k: v for k, v in task.envs.items()
                           if k not in RESERVED_ENV_NAMES and not k.startswith(INTERNAL_PREFIX)}
    env.update(extra or {})
    if task.secrets:  # names only: node.sh masks these variables' values in the job's output
        env["AIRFLOW_SKYPILOT_SECRET_NAMES"] = " ".join(sorted(task.secrets))
    env.update({
        "SKYPILOT_TASK_ID": task_id,
        "SKYPILOT_NUM_NODES": str(task.num_nodes),
        "SKYPILOT_NUM_GPUS_PER_NODE": str(num_gpus_per_node),
        "SKYPILOT_CLUSTER_INFO": json.dumps(cluster_info, sort_keys=True),
    })
    return env


def node_script(*, job_dir: str, workdir: str, rank_var: str, ips_var: str = "",
                has_setup: bool, has_run: bool, copy_of: str = "") -> str:
    """The script each node runs as ``node.sh setup|run``.

    ``rank_var`` names the variable holding this node's rank (e.g. ``SLURM_NODEID``,
    ``JOB_COMPLETION_INDEX``); ``ips_var``, if given, names a variable with the node IPs.
    ``job_dir`` and ``workdir`` are shell words (already quoted or ``"$VAR"`` forms).
    ``copy_of``: the workdir starts as a copy of that folder, made on the node's first call
    (the nodes of a multi-node job on one shared file system: SkyPilot's have a workdir each,
    and a setup such as ``[ -d repo ] || git clone ...`` or ``uv venv`` in it would race).
    """
    lines = [
        "#!/bin/bash",
        "# airflow-skypilot: one node's setup or run (generated; the task's own scripts are",
        "# setup.sh and run.sh beside this file).",
        # its own variables are AIRFLOW_SKYPILOT_* (no env or secret may take the prefix):
        # the task's envs and secrets are sourced into this shell, whatever their names
        f"AIRFLOW_SKYPILOT_JOB_DIR={job_dir}",
        '. "$AIRFLOW_SKYPILOT_JOB_DIR/env.sh"',
        'if [ -r "$AIRFLOW_SKYPILOT_JOB_DIR/secrets.sh" ]; then '
        '. "$AIRFLOW_SKYPILOT_JOB_DIR/secrets.sh"; fi',
        f'export SKYPILOT_NODE_RANK="${{{rank_var}:-0}}"',
    ]
    if ips_var:
        lines.append(f'export SKYPILOT_NODE_IPS="${{{ips_var}}}"')
    if copy_of:
        lines += [
            f"if [ ! -d {workdir} ]; then",
            f'  rm -rf {workdir}.part && cp -a --reflink=auto {copy_of} {workdir}.part &&'
            f" mv {workdir}.part {workdir} ||",
            '    { echo "airflow-skypilot: could not copy the workdir for this node" >&2;'
            " exit 1; }",
            "fi",
        ]
    lines += [
        f"mkdir -p {workdir} && cd {workdir} || exit 1",
        # for the prologue, which reads them again after the user's ~/.bashrc
        'export AIRFLOW_SKYPILOT_JOB_DIR AIRFLOW_SKYPILOT_WORKDIR="$PWD"',
        'case "$1" in',
        "  setup)",
        '    export SKYPILOT_SETUP_NODE_RANK="$SKYPILOT_NODE_RANK"',
        '    export SKYPILOT_SETUP_NODE_IPS="$SKYPILOT_NODE_IPS"',
        '    export SKYPILOT_SETUP_NUM_GPUS_PER_NODE="$SKYPILOT_NUM_GPUS_PER_NODE"',
        "    export AIRFLOW_SKYPILOT_STEP=setup",
        '    AIRFLOW_SKYPILOT_SCRIPT="$AIRFLOW_SKYPILOT_JOB_DIR/setup.sh" ;;' if has_setup
        else "    exit 0 ;;",
        "  run)",  # its own STEP, not one the environment brought: the run keeps its GPUs
        "    export AIRFLOW_SKYPILOT_STEP=run",
        '    AIRFLOW_SKYPILOT_SCRIPT="$AIRFLOW_SKYPILOT_JOB_DIR/run.sh" ;;' if has_run
        else "    exit 0 ;;",
        '  *) echo "node.sh: expected setup or run, got $1" >&2; exit 2 ;;',
        "esac",
        'if [ ! -r "$AIRFLOW_SKYPILOT_SCRIPT" ]; then',
        '  echo "airflow-skypilot: $AIRFLOW_SKYPILOT_SCRIPT cannot be read" >&2; exit 127',
        "fi",
        "# As SkyPilot runs it: `bash -i` (the prologue reads ~/.bashrc, --norc: once, with its",
        "# errors shown); the notes of job control that fails without a terminal go nowhere (fd 3",
        "# is the stderr the prologue takes back: the stdout, one stream, as SkyPilot's).",
        "# Secret values never reach the job's log in clear: every line of output is filtered.",
        "# A TERM to every process stops the program, not this script nor the filter: on a pod",
        "# (main.sh passes its TERM on and waits) what the program writes as it stops is masked",
        "# and kept, and its status is the step's. (On Slurm and AWS the step's own wrapper ends",
        "# at the TERM: what is left is killed, or loses its reader.)",
        # (one stream keeps the lines' order: a pod's stdout and stderr are read apart. The
        # filter passes each line as it comes: mawk, Debian's awk, reads a pipe in blocks
        # whatever fflush() does, unless -W interactive; gawk and busybox read lines. Not
        # mawk 1.3.3's -W interactive (Debian 10): it cuts lines at 4 KiB, and a secret across
        # the cut would pass unmasked. </dev/null: the one true awk reads "version" as a
        # program, from stdin)
        'if [ -z "${AIRFLOW_SKYPILOT_SECRET_NAMES:-}" ]; then '
        'exec bash --norc -i "$AIRFLOW_SKYPILOT_SCRIPT" 3>&1 2>/dev/null; fi',
        "AIRFLOW_SKYPILOT_AWK=(awk)",
        'case $(awk -W version 2>&1 </dev/null) in "mawk 1.3.3"*) ;;',
        "  mawk*) AIRFLOW_SKYPILOT_AWK=(awk -W interactive) ;; esac",
        # (the trap runs once the pipeline has ended; PIPESTATUS outlives it. The filter
        # ends when the last writer of its input has gone)
        "trap : TERM",
        'bash --norc -i "$AIRFLOW_SKYPILOT_SCRIPT" 3>&1 2>/dev/null '
        "| { trap '' TERM; exec \"${AIRFLOW_SKYPILOT_AWK[@]}\" "
        '-v names="$AIRFLOW_SKYPILOT_SECRET_NAMES" \\',
        f"  {shlex.quote(_MASK_AWK)}; }}",
        'exit "${PIPESTATUS[0]}"',
    ]
    return "\n".join(lines) + "\n"


def sky_workdir_link(workdir: str, note: str) -> str:
    """Bash making ``~/sky_workdir``, SkyPilot's workdir (its tasks ``cd ~/sky_workdir``), a
    link to the job's ``workdir`` (a bash word), on a node that runs one job (Kubernetes,
    AWS), before anything is unpacked: a mount under ``~/sky_workdir/`` lands in the workdir
    too. A link already there is replaced, and so is an empty directory (an image's); anything
    else is kept, and ``note`` (a command taking a message) says so. Nothing to do when it is
    the workdir already (a HOME of ``/`` on Kubernetes)."""
    return (f'W=~/sky_workdir; if [ ! "$W" -ef {workdir} ]; then\n'
            f'  {{ [ ! -e "$W" ] || [ -L "$W" ] || rmdir "$W" 2>/dev/null; }} &&\n'
            f'    ln -sfn {workdir} "$W" 2>/dev/null ||\n'
            f'    {note} "$W kept: not a link nor an empty directory, or no link could be made;'
            f' the workdir is "{workdir}\n'
            'fi')


#: awk program: replace each secret's value (each line of it, if it has several) by ``***``.
#: Values shorter than 4 characters are left alone, as Airflow's own masker does.
_MASK_AWK = r"""BEGIN {
  n = split(names, ns, " ")
  for (i = 1; i <= n; i++) {
    k = split(ENVIRON[ns[i]], parts, "\n")
    for (j = 1; j <= k; j++) if (length(parts[j]) >= 4) { m++; s[m] = parts[j] }
  }
}
{
  line = $0
  for (i = 1; i <= m; i++) {
    out = ""
    while ((p = index(line, s[i])) > 0) {
      out = out substr(line, 1, p - 1) "***"; line = substr(line, p + length(s[i]))
    }
    line = out line
  }
  print line; fflush()
}"""


#: What SkyPilot puts before every setup and run (``sky/skylet/log_lib.py``
#: ``make_task_bash_script``; it runs the script with ``bash -i``): the user's ``~/.bashrc``
#: (``conda init``, module loads, the exports a setup appends to it, which SkyPilot's docs
#: suggest for handing values to run), conda's shell function, ``PYTHONUNBUFFERED``, the workdir,
#: then the task's envs (over whatever the ``.bashrc`` set). And what its images give that a
#: bare one may not: ``sudo`` for root where none is installed. Then, our own: an interactive
#: shell ignores SIGTERM, so a TERM (scancel, a time limit) would let the script go on to its
#: next command; it would expand ``!`` in strings and write the user's history file; a
#: ``.bashrc`` that ``exec``\ s another shell or exits (a login shell switch, common on HPC
#: clusters) would end the job "successfully" without running it: while it is read, ``exec``
#: and ``exit`` only say so (the TERM trap's ``exit`` is the builtin: a TERM while a slow
#: ``.bashrc`` is read still ends the script); and root's ``rm``/``cp``/``mv -i`` aliases
#: (RHEL's) would answer their own prompt "no" and do nothing. A setup runs without
#: ``CUDA_VISIBLE_DEVICES`` (SkyPilot runs ``unset CUDA_VISIBLE_DEVICES; <setup>`` after this
#: prologue, ``sky/backends/task_codegen.py``, so a setup may set it for itself; on Slurm the
#: setup runs in the job's GPU step, where Slurm sets it).
PROLOGUE = """\
# airflow-skypilot: SkyPilot's prologue of every setup and run; the task's script follows it.
if { true >&3; } 2>/dev/null; then exec 2>&3 3>&-; fi
set +m +o history +H
trap 'builtin exit 143' TERM
if [ -e "${AIRFLOW_SKYPILOT_TERM_MARK:-/nonexistent}" ]; then builtin exit 143; fi
if [ -f ~/.bashrc ]; then
  exec() { echo "airflow-skypilot: ~/.bashrc: exec $* skipped" >&2; }
  exit() { echo "airflow-skypilot: ~/.bashrc: exit $* skipped" >&2; }
  source ~/.bashrc
  unset -f exec exit
fi
unalias rm cp mv 2>/dev/null
unset HISTFILE
set -a
. "$(conda info --base 2> /dev/null)/etc/profile.d/conda.sh" > /dev/null 2>&1 || true
set +a
export PYTHONUNBUFFERED=1
if [ "$(id -u 2>/dev/null)" = 0 ] && ! command -v sudo > /dev/null 2>&1; then
  sudo() {  # root already: run the command, its options dropped
    while [ $# -gt 0 ]; do
      case $1 in
        -[ughpCDrtUT]) shift; [ $# -gt 0 ] && shift ;;
        --) shift; break ;;
        -*) shift ;;
        *) break ;;
      esac
    done
    case ${1:-} in *=*) env "$@" ;; *) "$@" ;; esac
  }
  export -f sudo
fi
. "$AIRFLOW_SKYPILOT_JOB_DIR/env.sh"
if [ -r "$AIRFLOW_SKYPILOT_JOB_DIR/secrets.sh" ]; then . "$AIRFLOW_SKYPILOT_JOB_DIR/secrets.sh"; fi
cd "$AIRFLOW_SKYPILOT_WORKDIR" || exit 1
if [ "${AIRFLOW_SKYPILOT_STEP:-}" = setup ]; then unset CUDA_VISIBLE_DEVICES; fi
# --- the task's script ---
"""


def user_script(body: str | None) -> str | None:
    """The task's setup/run as its own file: :data:`PROLOGUE`, then the user's text verbatim."""
    if body is None:
        return None
    return PROLOGUE + (body if body.endswith("\n") else body + "\n")


def job_name(dag_id: str, task_id: str, run_id: str, try_number: int, attempt: int = 0,
             prefix: str = "sky") -> str:
    """Deterministic, short (<= 63 chars), DNS-1123-safe job name for one attempt of one try.

    The same (dag, task, run, try, attempt) always gives the same name, which is what lets a
    restarted worker find and adopt the job it already submitted.
    """
    digest = hashlib.sha256(f"{dag_id}\0{task_id}\0{run_id}\0{try_number}".encode()).hexdigest()
    slug = re.sub(r"[^a-z0-9]+", "-", f"{dag_id}-{task_id}".lower()).strip("-")[:32].strip("-")
    return f"{prefix}-{slug}-{digest[:10]}-t{try_number}-a{attempt}"


def task_id_for(dag_id: str, task_id: str, run_id: str) -> str:
    """``SKYPILOT_TASK_ID``: the same for every try and failover of one task in one DAG run,
    so a training script can use it as its checkpoint key."""
    safe_run = re.sub(r"[^A-Za-z0-9_.-]+", "_", run_id)
    return f"sky-airflow_{dag_id}_{task_id}_{safe_run}"
