"""The pod's entry script ``main.sh`` (pure: text only), and how a stop reaches the task.

Kubernetes stops a container (a cancel deletes its pods; an eviction, a preemption, a
deadline, a ``kubectl delete pod``) by sending TERM to the container's first process only,
then KILL to all of it once the grace period (``terminationGracePeriodSeconds``) is over.
That first process is ``main.sh``, and as its PID namespace's init it gets no signal it does
not catch. For the task's programs to get their TERM to checkpoint on, as on Slurm
(``scancel``) and AWS (an instance's shutdown), which TERM every process:

* ``main.sh`` traps TERM first thing, and runs ``node.sh setup`` and ``node.sh run`` in the
  background and ``wait``\\ s for them: bash runs a trap only once its foreground command has
  ended, and a trap cuts ``wait`` short (it then waits again, for the step's own status).
* its trap passes the TERM on, once, to every process of the container: ``kill -1`` as the
  PID namespace's init (the kernel spares the sender), else (a pod sharing its process
  namespace; the test kubelet) to its process group. A step not started yet is not started.
  ``node.sh`` and its secret-masking filter outlive that TERM (see
  :func:`~airflow_skypilot.backends.common.jobscript.node_script`): what the program writes
  while it stops is masked and kept.
* a process that had not set its TERM handling when the TERM came (the run's interactive
  ``bash`` ignores TERM until its prologue's trap) learns of it from :data:`TERM_MARK`, a file
  the trap makes in the pod's ``/dev/shm``: the prologue ends the step with 143 when it is there.
* once stopped, ``main.sh`` does not end before every other process of the container has
  (init's end would KILL a program still writing its checkpoint), then ends with
  :data:`STOPPED_EXIT`, never 0 (a program that saves and exits 0 on TERM would make the pod,
  then the Job, succeed: a preempted training run read as done), and not a TERM's 143 (a
  program's own 143 is its failure; the Job's verdict, which outlives a deleted pod, carries
  the code). Its trap writes :data:`STOPPED_NOTE` to the container's termination message at
  once (a program that outlives the grace period is KILLed, the note stays), which
  :mod:`.status` reads as the cluster's stop, not the program's failure (a
  ``kubectl delete pod`` gives no ``DisruptionTarget``), while the pod is listed; once it is
  gone, the Job's verdict carries :data:`STOPPED_EXIT` (a run that itself exits 199 and whose
  pod is then removed reads so too; a program KILLed at the grace's end, 137, reads as its
  failure then: an OOM kill gives 137 too).
* a run that had ended before the TERM (its status written by the step's wrapper, a subshell
  that outlives the TERM) keeps its own status: the TERM is no stop. A second TERM while the
  first is passed on is ignored.
"""

from __future__ import annotations

import shlex

from airflow_skypilot.backends.common import jobscript
from airflow_skypilot.backends.kubernetes.names import node_addresses

FILES_MOUNT = "/etc/airflow-skypilot"
BUNDLE_MOUNT = "/etc/airflow-skypilot-bundle"
WORKDIR_MOUNT = "/sky_workdir"
FILES_DIR_EXPR = '"${SANDBOX_MOUNT_ROOT:-}' + FILES_MOUNT + '"'
BUNDLE_DIR_EXPR = '"${SANDBOX_MOUNT_ROOT:-}' + BUNDLE_MOUNT + '"'
#: made by main.sh's trap when the container is being stopped (the pod's own /dev/shm, a
#: memory emptyDir; the pod's name in it, should a pod_config mount a shared one there)
TERM_MARK = '"${SANDBOX_MOUNT_ROOT:-}/dev/shm/airflow-skypilot-stopping-$HOSTNAME"'
#: the container's termination message (``terminationMessagePath``'s default)
TERMINATION_LOG = '"${SANDBOX_MOUNT_ROOT:-}/dev/termination-log"'
#: how a container stopped by the cluster's TERM begins its termination message
STOPPED_NOTE = "airflow-skypilot: stopped by the cluster (TERM)"
#: its exit code then, whatever the program's own (which the message carries): no signal's
#: (128 + n, n <= 64) nor a TERM's 143, which a program's own failure gives too
STOPPED_EXIT = 199

# The stop, as functions main.sh defines before anything else. ``others``: is any other
# process of the container still up? As init: ``kill -0 -1`` (every process but init); else
# a process of our process group in /proc (a zombie's state is Z; the stat's second field,
# the command, may hold spaces and parentheses: the fields after its last ")" are read).
_STOP_FUNCTIONS = f"""\
export AIRFLOW_SKYPILOT_TERM_MARK={TERM_MARK}
AIRFLOW_SKYPILOT_STOPPING=
AIRFLOW_SKYPILOT_IN_STEP=
airflow_skypilot_stop() {{  # the container's TERM: passed on, once, to all of it
  [ -z "$AIRFLOW_SKYPILOT_STOPPING" ] || return 0  # a TERM that came as the first was handled
  # the run ended before this TERM (its wrapper wrote its status): nothing left to stop
  [ "$AIRFLOW_SKYPILOT_IN_STEP" = run ] && [ -e "$AIRFLOW_SKYPILOT_TERM_MARK.run" ] && return 0
  trap '' TERM
  AIRFLOW_SKYPILOT_STOPPING=1
  : 2>/dev/null >"$AIRFLOW_SKYPILOT_TERM_MARK"
  echo "{STOPPED_NOTE}" 2>/dev/null >{TERMINATION_LOG}
  echo "airflow-skypilot: the container is being stopped (TERM): passed on to the task" >&2
  if [ $$ = 1 ]; then kill -TERM -1; else kill -TERM 0; fi 2>/dev/null
}}
trap airflow_skypilot_stop TERM
airflow_skypilot_others() {{
  if [ $$ = 1 ]; then kill -0 -1 2>/dev/null; return; fi
  local f s
  for f in /proc/[0-9]*/stat; do
    [ "$f" = "/proc/$$/stat" ] && continue
    read -r s 2>/dev/null <"$f" || continue
    s=${{s##*) }}
    set -- $s
    [ "$3" = "$$" ] && [ "$1" != Z ] && return 0
  done
  return 1
}}
airflow_skypilot_end() {{  # the container's exit: after a stop, once the rest has ended
  trap '' TERM
  if [ -z "$AIRFLOW_SKYPILOT_STOPPING" ]; then exit "$1"; fi
  while airflow_skypilot_others; do sleep 0.5; done
  echo "{STOPPED_NOTE}; the step's exit code: $1" 2>/dev/null >{TERMINATION_LOG}
  echo "airflow-skypilot: stopped by the cluster (TERM); the step's exit code: $1" >&2
  exit {STOPPED_EXIT}
}}
airflow_skypilot_step() {{  # node.sh setup|run in the background: a TERM is passed on at once
  [ -z "$AIRFLOW_SKYPILOT_STOPPING" ] || return {STOPPED_EXIT}
  local end="$AIRFLOW_SKYPILOT_TERM_MARK.$1" pid rc= waited
  rm -f "$end"
  AIRFLOW_SKYPILOT_IN_STEP=$1
  # its wrapper outlives a TERM (a handler, not an ignore: node.sh gets TERM as it comes) and
  # writes the step's status once node.sh has ended: what the trap and this function read
  ( trap : TERM; bash "$AIRFLOW_SKYPILOT_JOB_DIR/node.sh" "$1"
    AIRFLOW_SKYPILOT_RC=$?; echo "$AIRFLOW_SKYPILOT_RC" 2>/dev/null >"$end"
    exit "$AIRFLOW_SKYPILOT_RC" ) &
  pid=$!
  # a trap cuts wait short: wait again while the wrapper is there (127: no child of ours by
  # that id any more, one another process took: done)
  wait "$pid"; waited=$?
  while [ "$waited" != 127 ] && kill -0 "$pid" 2>/dev/null; do wait "$pid"; waited=$?; done
  read -r rc 2>/dev/null <"$end"  # (none: /dev/shm not writable; wait's status then)
  return "${{rc:-$waited}}"
}}
"""


def main_script(*, job_name: str, namespace: str, num_nodes: int, cluster_domain: str,
                targets: list[tuple[str, str]]) -> str:
    """The pod's entry point: node addresses, unpack files, then setup and run via node.sh."""
    addrs = node_addresses(job_name, namespace, num_nodes, cluster_domain)
    lines = [
        "#!/bin/bash",
        f"# airflow-skypilot: entry point of every pod of job {job_name} (generated). The",
        "# task's own scripts are setup.sh and run.sh beside this file; env.sh has its envs.",
        # first of all: until the trap is set, a TERM to the container's init is lost.
        # Its own variables are AIRFLOW_SKYPILOT_* (a prefix no env or secret may take): the
        # pod's env holds the task's secrets, whatever their names
        _STOP_FUNCTIONS.rstrip("\n"),
        'AIRFLOW_SKYPILOT_ROOT="${SANDBOX_MOUNT_ROOT:-}"',
        f"AIRFLOW_SKYPILOT_JOB_DIR={FILES_DIR_EXPR}",
        f"AIRFLOW_SKYPILOT_BUNDLE_DIR={BUNDLE_DIR_EXPR}",
        f'export AIRFLOW_SKYPILOT_WORKDIR="$AIRFLOW_SKYPILOT_ROOT"{WORKDIR_MOUNT}',
    ]
    if num_nodes > 1:
        lines.append("export SKYPILOT_NODE_IPS=" + shlex.quote("\n".join(addrs)))
    else:
        lines.append('export SKYPILOT_NODE_IPS="${AIRFLOW_SKYPILOT_POD_IP:-127.0.0.1}"')
    lines += [
        'mkdir -p "$AIRFLOW_SKYPILOT_WORKDIR"',
        jobscript.sky_workdir_link('"$AIRFLOW_SKYPILOT_WORKDIR"',
                                   note=">&2 echo airflow-skypilot:"),
        "unpack() {  # bundle Secret key, target directory",
        '  mkdir -p "$2" && base64 -d "$AIRFLOW_SKYPILOT_BUNDLE_DIR/$1" | tar -xzf - -C "$2"',
        "}",
    ]
    # the workdir first, then the file mounts (a relative one is under the workdir), as
    # SkyPilot syncs them: a mount is never overwritten by the workdir. A stop during the
    # unpacking is a stop, not a failed unpack
    for key, target in targets:
        lines.append(f"unpack {shlex.quote(key)} {target} || {{ "
                     f'[ -n "$AIRFLOW_SKYPILOT_STOPPING" ] || '
                     f"echo 'airflow-skypilot: could not unpack {key}' >&2; "
                     f"airflow_skypilot_end 1; }}")
    lines += [
        f'echo "airflow-skypilot: job {job_name}, rank ${{JOB_COMPLETION_INDEX:-0}} of '
        f'{num_nodes}, pod $HOSTNAME"',
        "airflow_skypilot_step setup",
        "rc=$?",
        'if [ $rc -ne 0 ] && [ -z "$AIRFLOW_SKYPILOT_STOPPING" ]; then',
        '  echo "airflow-skypilot: setup failed with exit code $rc; run skipped" >&2',
        "fi",
        '[ $rc -eq 0 ] || airflow_skypilot_end "$rc"',
        "airflow_skypilot_step run",
        'airflow_skypilot_end "$?"',
    ]
    return "\n".join(lines) + "\n"


__all__ = ["BUNDLE_DIR_EXPR", "BUNDLE_MOUNT", "FILES_DIR_EXPR", "FILES_MOUNT", "STOPPED_EXIT",
           "STOPPED_NOTE", "TERM_MARK", "TERMINATION_LOG", "WORKDIR_MOUNT", "main_script"]
