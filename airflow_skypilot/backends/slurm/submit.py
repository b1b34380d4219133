"""A job on the cluster: its files, ``sbatch`` once per name, and cancel (how the files get
there: :mod:`~airflow_skypilot.backends.slurm.uploads`).

Every job has its own dir ``<remote_work_dir>/jobs/<job name>/`` (mode 0700) holding the task's
``setup.sh``/``run.sh`` verbatim, ``env.sh``, ``secrets.sh`` (0600, removed when the job ends),
the node wrapper ``node.sh``, the batch script ``job.sbatch``, ``handle`` (what :func:`lookup`
needs to rebuild the handle, with the time it was submitted), and, once submitted, ``job_id``.
``sbatch`` runs under ``flock`` in that dir, and only if no ``job_id`` is there yet; a job of
the same name that Slurm knows is found too. So a name is submitted at most once, and a retried
worker adopts what it submitted before.

"Could not ask" is never "no such job": a lookup that needs ``squeue`` (no ``job_id`` file)
raises BackendUnreachable when squeue did not answer, and so does an ``sbatch`` or ``scancel``
that got no answer from slurmctld in time (it may still act on the request later).

What stays: :func:`cleanup_script` removes a finished job's workdir copy, secrets and scripts
and keeps its log, ``job_id``, ``handle`` and ``exit_code`` (``find_all`` still knows the job,
with when it was submitted). A job dir whose log (or, with none, the dir itself) is older than
the connection's ``log_retention_days`` goes entirely, at the next submit, in the same SSH
command (:func:`gc_script`); never the dir of a job Slurm still has queued or running.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Mapping
from typing import Any

from airflow_skypilot.backends.base import JobHandle, Offer
from airflow_skypilot.backends.common import jobscript
from airflow_skypilot.backends.slurm.settings import BACKEND, SlurmSettings, task_sbatch_options
from airflow_skypilot.backends.slurm.shell import (
    NO_ANSWER,
    TIMED_OUT,
    abs_remote,
    bounded,
    no_answer,
    parse_int,
    parse_sections,
    rc_line,
    remote_dir_expr,
    section_rc,
)
from airflow_skypilot.backends.slurm.status import RENAMED_SLACK

# the plan of the upload (the job's files, the workdir, the file mounts) is its own module;
# callers found it here
from airflow_skypilot.backends.slurm.uploads import mount_target as mount_target
from airflow_skypilot.backends.slurm.uploads import upload_plan as upload_plan
from airflow_skypilot.exceptions import BackendError, BackendUnreachable, SubmissionError
from airflow_skypilot.spec.sbatch import CONTROL
from airflow_skypilot.spec.task import Task


def remote_job_dir(settings: SlurmSettings, job_name: str, home: str) -> str:
    """The job's dir as an absolute path (``home`` is the login node's ``$HOME``)."""
    base = abs_remote(settings.remote_work_dir, home)
    return f"{base.rstrip('/')}/jobs/{job_name}"


def _handle(conn_id: str, job_id: str, job_name: str, job_dir: str, **fields: Any) -> JobHandle:
    return JobHandle(backend=BACKEND, connection=conn_id, job_id=job_id, job_name=job_name,
                     extra={"job_dir": job_dir, "log": f"{job_dir}/slurm.log"}, **fields)


# --- adoption --------------------------------------------------------------------------------


#: a job Slurm knows by name: ``id|partition|submit time`` (epoch), in any state
_BY_NAME = "env SLURM_TIME_FORMAT=%s squeue -h -t all -u \"$USER\" -o '%i|%P|%V|%j'"


def lookup_script(settings: SlurmSettings, job_name: str) -> str:
    """``$HOME``, and the job of that name if any: its ``job_id`` and ``handle`` files, or a
    job of that name Slurm knows (submitted, but its id never recorded)."""
    jobs = remote_dir_expr(settings.remote_work_dir) + "/jobs/" + shlex.quote(job_name)
    return "\n".join([
        bounded(settings.slurm_timeout),
        'printf "@@home\\n%s\\n" "$HOME"',
        "echo @@job_id", f"cat {jobs}/job_id 2>/dev/null",
        "echo @@meta", f"cat {jobs}/handle 2>/dev/null",
        # the job_id file answers alone: slurmctld is asked only when there is none
        f"[ -s {jobs}/job_id ] || {{ echo @@queued; _t {_BY_NAME} -n {shlex.quote(job_name)}; "
        f"{rc_line('queued')}; }}",
    ])


def find_all_script(settings: SlurmSettings, prefix: str) -> str:
    """``$HOME``, every job dir named ``prefix*`` (name, job id, handle fields on one line) and
    every job of the user Slurm knows; ``@@queued_rc`` says whether squeue answered."""
    jobs = remote_dir_expr(settings.remote_work_dir) + "/jobs/"
    return "\n".join([
        bounded(settings.slurm_timeout),
        'printf "@@home\\n%s\\n" "$HOME"',
        "echo @@dirs",
        f"for d in {jobs}{shlex.quote(prefix)}*/; do",
        '  [ -d "$d" ] || continue',
        '  printf "%s\\t%s\\t%s\\n" "$(basename "$d")" "$(cat "$d/job_id" 2>/dev/null)" '
        '"$(tr "\\n" "\\t" < "$d/handle" 2>/dev/null)"',
        "done",
        "echo @@queued", f"_t {_BY_NAME}", rc_line("queued"),
    ])


def _squeue_answered(sec: dict[str, list[str]], conn_id: str, what: str) -> None:
    rc = section_rc(sec, "queued")
    if rc != 0:
        how = "did not answer in time" if rc in (124, 137) else f"failed (exit {rc})"
        raise BackendUnreachable(f"{conn_id}: squeue {how} while {what}: could not ask "
                                 "slurmctld")


def _queued(line: str) -> tuple[str, str, str, str]:
    """A :data:`_BY_NAME` line -> (job id, partition, submit time, name)."""
    job_id, partition, submitted, name = (line.split("|", 3) + ["", "", ""])[:4]
    return job_id.strip(), partition.strip(), submitted.strip(), name.strip()


def parse_find_all(out: str, settings: SlurmSettings, conn_id: str,
                   prefix: str) -> list[JobHandle]:
    """:func:`find_all_script`'s output -> the handles (raises if squeue did not answer: a
    queued job may be among the unanswered, and "could not ask" is not "none")."""
    sec = parse_sections(out)
    _squeue_answered(sec, conn_id, f"listing jobs {prefix}*")
    home = (sec.get("home") or [""])[0]
    found: dict[str, JobHandle] = {}
    for line in sec.get("dirs", []):
        name, _, rest = line.partition("\t")
        job_id, _, meta_text = rest.partition("\t")
        if not name.startswith(prefix) or not job_id.strip():
            continue  # a dir whose sbatch never ran: no job
        meta = dict(kv.split("=", 1) for kv in meta_text.split("\t") if "=" in kv)
        if meta.get("cluster", settings.cluster) != settings.cluster:
            continue  # another cluster's job in a home they share
        found[name] = _from_meta(settings, conn_id, job_id.strip(), name, meta, "", home)
    for line in sec.get("queued", []):
        job_id, partition, submitted, name = _queued(line)
        if name.startswith(prefix) and name not in found:
            found[name] = _from_meta(settings, conn_id, job_id, name,
                                     {"submitted_at": submitted}, partition, home)
    return sorted(found.values(), key=lambda h: h.job_name)


def _from_meta(settings: SlurmSettings, conn_id: str, job_id: str, job_name: str,
               meta: dict[str, str], partition: str, home: str) -> JobHandle:
    partition = meta.get("partition", partition)
    return _handle(
        conn_id, job_id, job_name, remote_job_dir(settings, job_name, home),
        location=partition, infra=settings.infra(partition),
        num_nodes=parse_int(meta.get("num_nodes", "1"), 1),
        accelerator=meta.get("accelerator") or None,
        gpus_per_node=float(meta.get("gpus_per_node", "0") or 0),
        price_per_hour=float(meta.get("price_per_hour", "0") or 0),
        submitted_at=_float(meta.get("submitted_at")) or time.time(), adopted=True)


def _float(text: str | None) -> float | None:
    try:
        return float(text) if text else None
    except ValueError:
        return None


def dir_owner(out: str, settings: SlurmSettings) -> str:
    """The other cluster whose job a looked-up job dir holds ("" when it is this cluster's,
    or holds no job): several clusters' login nodes may share one home."""
    sec = parse_sections(out)
    meta = dict(kv.split("=", 1) for kv in sec.get("meta", []) if "=" in kv)
    cluster = meta.get("cluster", "")
    has_job = bool((sec.get("job_id") or [""])[0].strip())
    return cluster if has_job and cluster and cluster != settings.cluster else ""


def parse_lookup(out: str, settings: SlurmSettings, conn_id: str,
                 job_name: str) -> tuple[JobHandle | None, str]:
    """:func:`lookup_script`'s output -> (the adopted job's handle or None, ``$HOME``). The
    ``job_id`` file answers alone; without it, only an answered squeue may say "none"."""
    sec = parse_sections(out)
    if "home" not in sec:
        raise BackendUnreachable(f"{conn_id}: the lookup of {job_name} did not run")
    home = (sec.get("home") or [""])[0]
    job_id = (sec.get("job_id") or [""])[0].strip()
    meta = dict(kv.split("=", 1) for kv in sec.get("meta", []) if "=" in kv)
    if job_id and dir_owner(out, settings):
        return None, home  # another cluster's job in a home they share: not this one's
    partition = ""
    if not job_id:
        _squeue_answered(sec, conn_id, f"looking for job {job_name}")
        named = [q for q in map(_queued, sec.get("queued", [])) if q[3] == job_name]
        if not named:
            return None, home
        job_id, partition, submitted, _ = max(named, key=lambda q: parse_int(q[0]))
        meta.setdefault("submitted_at", submitted)
    return _from_meta(settings, conn_id, job_id, job_name, meta, partition, home), home


# --- the job's files -------------------------------------------------------------------------


#: srun's arguments up to the phase: one task per node, each noting that it began (the marker
#: is written before node.sh runs, and node.sh runs only if it was). ``--overlap``: the step
#: shares the job's resources with any other step, so none can keep it from launching: not a
#: step slurmctld created after srun had given up on it (a request answered late, after a
#: pause, holds the node with nothing running: srun then waits "Requested nodes are busy"
#: until the time limit), nor one the task's own script started with srun.
#: Each node then writes its own exit code, ``exit_code.<phase>.<rank>`` (a lost node writes none).
#: A node whose run ended well waits for every node's exit code before its task ends: Slurm's
#: proctrack/cgroup kills what a task leaves behind when it ends, and SkyPilot keeps every node
#: until the job ends (a daemon a worker rank started, ``ray start`` or an MPI target, lives on
#: for the ranks still running; a failing rank ends the step, ``--kill-on-bad-exit``). A node
#: of several that could not write its own exit code ends with a failure, even after a run
#: that ended well, so the step ends: the others would wait for it until the time limit, and
#: its rank reads as one whose node was lost (infrastructure: it cannot write the job dir).
#: A rank that fails in a job of several waits a second before it ends: srun ends the step
#: at once (--kill-on-bad-exit) and drops the output it has not forwarded yet, the failing
#: rank's last lines (its traceback).
_STEP = ('--overlap --kill-on-bad-exit=1 --ntasks-per-node=1 -N "$SLURM_JOB_NUM_NODES" '
         'bash -c \'touch "$0/began.$1" || exit; bash "$0/node.sh" "$1"; c=$?; '
         'f="$0/exit_code.$1.${SLURM_NODEID:-0}"; { echo $c > "$f.tmp" && mv "$f.tmp" "$f"; } '
         '|| { echo "airflow-skypilot: could not write $f (exit code $c)" >&2; '
         'c=$((c ? c : SLURM_JOB_NUM_NODES > 1)); }; [ $c -ne 0 ] && [ "$SLURM_JOB_NUM_NODES" '
         '-gt 1 ] && sleep 1; [ $c -eq 0 ] && [ "$1" = run ] && [ -e "$f" ] && until [ "$(ls '
         '"$0" | grep -c "^exit_code\\.run\\.[0-9]*$")" -ge "$SLURM_JOB_NUM_NODES" ]; do '
         'sleep 2; done; exit $c\' "$JOB_DIR"')


def _sbatch_script(task: Task, offer: Offer, settings: SlurmSettings, job_dir: str) -> str:
    req = offer.request
    gpus = int(req.accelerator_count) if req.accelerator else 0
    gres_type = offer.details.get("gres_type", "")
    # The task's options first, then the connection's, then the backend's own: sbatch keeps
    # the last of repeated options, so neither a task nor a connection can override what comes
    # after it (both are also refused before this: spec.sbatch, SlurmBackend.unsupported).
    directives = task_sbatch_options(task) + settings.common_sbatch_args()
    directives += [f"--partition={offer.location}", f"--nodes={task.num_nodes}",
                   "--ntasks-per-node=1", "--no-requeue", "--open-mode=append"]
    if gpus:
        directives.append(f"--gres=gpu:{gres_type}:{gpus}" if gres_type
                          else f"--gres=gpu:{gpus}")
    cpus, _ = req.cpus_needed()
    if cpus:
        directives.append(f"--cpus-per-task={int(cpus + 0.999)}")
    mem, _ = req.memory_needed_gb()
    if mem:
        directives.append(f"--mem={int(mem * 1024)}M")
    elif req.memory and req.memory.endswith("x"):  # SkyPilot's GB per CPU
        directives.append(f"--mem-per-cpu={int(float(req.memory[:-1]) * 1024)}M")
    for directive in directives:
        if match := CONTROL.search(directive):
            raise SubmissionError(f"sbatch option {directive!r} contains the control character "
                                  f"{match.group()!r}: refused", retry_elsewhere=False)
    label = " --label" if task.num_nodes > 1 else ""
    jd = shlex.quote(job_dir)
    lines = ["#!/bin/bash"] + [f"#SBATCH {shlex.quote(d)}" for d in directives] + [
        "# airflow-skypilot: generated; the task's own scripts are setup.sh and run.sh.",
        f"JOB_DIR={jd}",
        'trap \'rm -f "$JOB_DIR/secrets.sh"\' EXIT',
        "# Slurm ends a job at its time limit, and scancel ends it, with SIGTERM (SIGKILL after",
        "# KillWait): the batch script never writes its exit code then. It notes `killed <when>",
        "# <the job's end time>` instead, so a job Slurm no longer lists reads as stopped (at its",
        "# time limit or by someone), never as lost. The steps run in the background (`wait` is",
        "# cut short by the signal; a foreground srun would hold the trap until it ended).",
        "END_TIME=${SLURM_JOB_END_TIME:-$(SLURM_TIME_FORMAT=%s timeout 10 squeue -h -j "
        '"$SLURM_JOB_ID" -o %e 2>/dev/null)}',
        "case $END_TIME in *[!0-9]*) END_TIME= ;; esac",
        "step=",
        "# (END_TIME is the limit as it was at the start: Slurm's EndTime is the kill's time once",
        "# it kills the job, so it cannot be read again here)",
        "on_term() {",
        '  printf "killed %s %s\\n" "$(date +%s)" "$END_TIME" > "$JOB_DIR/killed.tmp" && '
        'mv "$JOB_DIR/killed.tmp" "$JOB_DIR/killed"',
        '  [ -n "$step" ] && kill -TERM "$step" 2>/dev/null',
        "  exit 143",
        "}",
        "trap on_term TERM",
        "# A task's --export=NONE (or a list) reaches srun as SLURM_EXPORT_ENV: the steps would",
        "# get none of what this script exports (sbatch(1) says to set it to ALL here)",
        "export SLURM_EXPORT_ENV=ALL",
        "# srun no longer inherits --cpus-per-task from sbatch (Slurm 22.05): the steps, and the",
        "# task's own sruns, get the CPUs the job asked for (else one, where tasks are bound)",
        'if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then',
        '  export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"',
        "fi",
        "# SKYPILOT_NODE_IPS: each node's address (NodeAddr, resolved to an IP), in rank order",
        'ips=""; hosts=()',
        'for n in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do',
        "  a=$(scontrol show node -o \"$n\" | tr ' ' '\\n' | sed -n 's/^NodeAddr=//p')",
        '  a=${a:-$n}',
        "  case $a in *[!0-9.]*)",
        "    ip=$(getent ahostsv4 \"$a\" 2>/dev/null | awk 'NR==1{print $1}'); a=${ip:-$a} ;;",
        "  esac",
        '  ips="$ips$a"$\'\\n\'; hosts+=("$n")',
        "done",
        'export SKYPILOT_NODE_IPS="${ips%$\'\\n\'}"',
        'echo "airflow-skypilot: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST"',
        "# Each step notes on the node that it began, before the task's script. A step that",
        "# failed with no such note never ran it: srun could not launch the step (slurmctld",
        "# unreachable, a step limit). It is launched again, with doubling waits, for up to",
        "# STEP_RETRY seconds (a slurmctld restarting or failing over answers no step request",
        "# for a while); then it is an infrastructure failure, written as `nostep`. Only a step",
        "# no node began is launched again, so the task's script never runs twice.",
        f"STEP_RETRY={max(0, int(settings.step_launch_retry))}",
        "launch() {",
        "  local wait=5 deadline=$((SECONDS + STEP_RETRY))",
        "  while :; do",
        f"    srun{label} {_STEP} \"$1\" &",
        "    step=$!; wait $step; rc=$?; step=",
        '    if [ $rc -eq 0 ] || [ -e "$JOB_DIR/began.$1" ]; then return $rc; fi',
        '    sleep 2 & wait $!  # a task launched late still notes that it began',
        '    if [ -e "$JOB_DIR/began.$1" ] || [ $((SECONDS + wait)) -gt $deadline ]; then',
        "      return $rc",
        "    fi",
        '    echo "airflow-skypilot: srun could not launch the $1 step (exit $rc);'
        ' launching it again in ${wait}s" >&2',
        "    sleep $wait & wait $!; wait=$((wait * 2))",
        "  done",
        "}",
        "launch setup",
        "rc=$?; phase=setup",
        "if [ $rc -eq 0 ]; then",
        "  launch run",
        "  rc=$?; phase=run",
        'elif [ -e "$JOB_DIR/began.setup" ]; then',
        '  echo "airflow-skypilot: setup failed with exit code $rc; run skipped" >&2',
        "fi",
        "# A step ended by a TERM (143): this script's own TERM (the time",
        "# limit, a scancel, a preemption) may still be on its way from the batch step's",
        "# slurmstepd; waited for, so the trap notes the kill rather than an exit code that,",
        "# once Slurm forgets the job, reads as the program's own failure",
        'if [ $rc -eq 143 ]; then sleep 10 & wait $!; fi',
        'code=$rc',
        'if [ $rc -ne 0 ] && [ ! -e "$JOB_DIR/began.$phase" ]; then',
        '  echo "airflow-skypilot: srun could not launch the $phase step (exit $rc)" >&2',
        '  code="nostep $phase $rc"',
        "# A failed multi-node step: each rank's own exit code, `-` for a rank that wrote none",
        "# (its node lost, or killed by srun when another rank failed), `down` when Slurm has",
        "# its node down or not responding (lost). The status reads the second line.",
        'elif [ $rc -ne 0 ] && [ "${SLURM_JOB_NUM_NODES:-1}" -gt 1 ]; then',
        '  code="$code"$\'\\n\'"ranks $phase"',
        '  for ((r = 0; r < SLURM_JOB_NUM_NODES; r++)); do',
        '    c=$(cat "$JOB_DIR/exit_code.$phase.$r" 2>/dev/null)',
        '    [ -n "$c" ] || { c=-; timeout 10 scontrol show node -o "${hosts[$r]:-}" 2>/dev/null'
        " | grep -Eq 'State=[^ ]*(DOWN|NOT_RESPONDING|FAIL)' && c=down; }",
        '    code="$code $r=$c"',
        "  done",
        "fi",
        'printf "%s\\n" "$code" > "$JOB_DIR/exit_code.tmp" && '
        'mv "$JOB_DIR/exit_code.tmp" "$JOB_DIR/exit_code"',
        "exit $rc",
    ]
    return "\n".join(lines) + "\n"


def render(task: Task, offer: Offer, settings: SlurmSettings, job_name: str,
           env: Mapping[str, str], job_dir: str,
           submitted_at: float | None = None) -> dict[str, tuple[str, int]]:
    """Every file of the job: name -> (content, mode). ``submitted_at`` goes into ``handle``
    (the handle submit returns carries the same value, and so does every later lookup)."""
    req = offer.request
    info = {"cluster_name": settings.cluster, "cloud": "Slurm", "region": settings.cluster,
            "zone": offer.location}
    node_env = jobscript.skypilot_env(
        task, task_id=env.get("SKYPILOT_TASK_ID", job_name),
        num_gpus_per_node=jobscript.gpus_per_node(req.accelerator_count),
        cluster_info=info, extra=env)
    # several nodes share the job dir: each works in its own copy of the workdir, as each of
    # SkyPilot's nodes has one
    many = task.num_nodes > 1
    node = jobscript.node_script(
        job_dir=shlex.quote(job_dir), rank_var="SLURM_NODEID", has_setup=bool(task.setup),
        workdir='"$AIRFLOW_SKYPILOT_JOB_DIR/workdir.${SLURM_NODEID:-0}"' if many
        else shlex.quote(f"{job_dir}/workdir"), has_run=bool(task.run),
        copy_of='"$AIRFLOW_SKYPILOT_JOB_DIR/workdir"' if many else "")
    meta = {
        "cluster": settings.cluster, "partition": offer.location, "num_nodes": task.num_nodes,
        "accelerator": req.accelerator or "", "gpus_per_node": req.accelerator_count,
        "price_per_hour": offer.price_per_hour,
        "submitted_at": repr(time.time() if submitted_at is None else float(submitted_at)),
    }
    files = {
        "job.sbatch": (_sbatch_script(task, offer, settings, job_dir), 0o700),
        "node.sh": (node, 0o700),
        "env.sh": (jobscript.exports(node_env), 0o600),
        "setup.sh": (jobscript.user_script(task.setup) or "", 0o600),
        "run.sh": (jobscript.user_script(task.run) or "", 0o600),
        "handle": ("".join(f"{k}={v}\n" for k, v in meta.items()), 0o600),
    }
    if task.secrets:
        files["secrets.sh"] = (jobscript.exports(task.secrets), 0o600)
    return files


# --- sbatch and scancel ----------------------------------------------------------------------


def submit_script(job_dir: str, job_name: str, settings: SlurmSettings | None = None) -> str:
    """``sbatch`` under the job dir's lock, unless a ``job_id`` is already there; then (same
    command) the old job dirs past their retention go (:func:`gc_script`)."""
    s = settings or SlurmSettings(cluster="")
    args = ["sbatch", "--parsable", f"--job-name={job_name}",
            f"--output={job_dir}/slurm.log", f"--chdir={job_dir}",
            f"{job_dir}/job.sbatch"]
    submit = " ".join(shlex.quote(a) for a in args)
    lock_wait = max(1, int(s.slurm_timeout))
    no_answer = " ".join(f"-e {shlex.quote(text)}" for text in NO_ANSWER)
    return "\n".join([
        bounded(s.slurm_timeout),
        "submit() {",
        f"  cd {shlex.quote(job_dir)} || return 97",
        "  exec 9>lock",
        f"  flock -w {lock_wait} 9 || return 98",
        '  if [ -s job_id ]; then echo "@@adopted"; cat job_id; return 0; fi',
        # its notices (a site's job_submit plugin, warnings) go to stderr, apart from the id
        f"  out=$(_t {submit} 2>sbatch.err); rc=$?",
        "  cat sbatch.err >&3",
        '  if [ $rc -ne 0 ]; then printf "@@sbatch_rc\\n%s\\n" "$rc"',
        # sbatch answered no (not "no answer", a job that may exist all the same, as
        # parse_submitted tells them apart): no job will read the secrets, so they go now
        f"    case $rc in {'|'.join(map(str, TIMED_OUT))}) ;; *) grep -qiF {no_answer} "
        "sbatch.err || rm -f secrets.sh ;; esac",
        "    return 99",
        "  fi",
        # --parsable: "<id>" or "<id>;<cluster>"; anything else is not an id
        "  jid=$(printf '%s\\n' \"$out\" | sed -n 's/^\\([0-9][0-9]*\\)\\(;.*\\)\\{0,1\\}$/\\1/p'"
        " | tail -n 1)",
        '  if [ -z "$jid" ]; then printf "@@sbatch_noid\\n%s\\n" "$out"; return 96; fi',
        '  printf "%s\\n" "$jid" > job_id.tmp && mv job_id.tmp job_id',
        '  echo "@@submitted"; printf "%s\\n" "$jid"',
        "}",
        "exec 3>&2",
        "submit; status=$?",
        "exec 9>&-",
        gc_script(s, job_dir),
        "exit $status",
    ])


def gc_script(settings: SlurmSettings, keep: str) -> str:
    """Remove the job dirs (besides ``keep``) whose log, or the dir itself when it has none,
    is older than ``log_retention_days``; never one of a job Slurm still has queued or
    running (by id or by name), nor one another cluster's connection submitted (a home
    shared by several clusters), and nothing at all when squeue did not answer. One ``find``
    when nothing is that old (squeue is asked only when something is). Prints the names
    removed under ``@@gc``."""
    days = settings.log_retention_days
    if days <= 0:
        return "true"
    age = f"-mmin +{max(1, int(days * 24 * 60))}"
    jobs = remote_dir_expr(settings.remote_work_dir) + "/jobs"
    return "\n".join([
        "echo @@gc",
        # candidates: old dirs, and the dirs of old logs (a log keeps its dir's mtime still)
        f"old=$({{ find {jobs} -mindepth 1 -maxdepth 1 -type d {age} -print; "
        f"find {jobs} -mindepth 2 -maxdepth 2 -name slurm.log {age} -printf '%h\\n'; }} "
        "2>/dev/null | sort -u)",
        '[ -n "$old" ] && active=$(_t squeue -h -u "$USER" -o \'%i %j\') && '
        'printf "%s\\n" "$old" | while IFS= read -r d; do',
        f'  [ "$d" = {shlex.quote(keep)} ] && continue',
        # a home shared with other clusters: their jobs are theirs to judge (and to remove)
        '  c=$(sed -n "s/^cluster=//p" "$d/handle" 2>/dev/null)',
        f'  [ -n "$c" ] && [ "$c" != {shlex.quote(settings.cluster)} ] && continue',
        f'  [ -e "$d/slurm.log" ] && [ -z "$(find "$d/slurm.log" {age} 2>/dev/null)" ] && continue',
        '  name=$(basename "$d"); jid=$(cat "$d/job_id" 2>/dev/null)',
        '  printf "%s\\n" "$active" | awk -v i="$jid" -v n="$name" '
        "'($1 == i && i != \"\") || $2 == n { found = 1 } END { exit !found }' && continue",
        '  rm -rf -- "$d" && printf "%s\\n" "$name"',
        "done",
        "true",
    ])


def parse_submitted(rc: int, out: str, err: str, conn_id: str) -> tuple[str, bool, list[str]]:
    """:func:`submit_script`'s result -> (job id, adopted, job dirs removed). A refusal is a
    SubmissionError, to be retried elsewhere unless sbatch called the job itself invalid; an
    sbatch that got no answer from slurmctld in time, or a lock another submission of the
    name holds, is BackendUnreachable: the job may exist all the same."""
    sec = parse_sections(out)
    removed = sec.get("gc", [])
    ids = sec.get("submitted") or sec.get("adopted")
    if rc == 0 and ids:
        return ids[0].strip(), "adopted" in sec, removed
    message = (err or out).strip().splitlines()
    text = message[-1] if message else f"exit {rc}"
    sbatch_rc = section_rc(sec, "sbatch")
    if rc == 98:
        raise BackendUnreachable(f"{conn_id}: another submission of this job holds its lock")
    if rc == 96:  # sbatch said yes but printed no id we can read: the job may well exist
        said = " ".join(sec.get("sbatch_noid", []))[-300:]
        raise BackendUnreachable(f"sbatch on {conn_id} printed no job id ({said!r}): the job "
                                 "may exist all the same")
    if sbatch_rc is not None and no_answer(sbatch_rc, err):
        raise BackendUnreachable(f"sbatch on {conn_id} got no answer from slurmctld (the job "
                                 f"may exist all the same): {text}")
    retry = not any(w in text.lower() for w in ("invalid", "unrecognized", "syntax"))
    raise SubmissionError(f"sbatch on {conn_id} failed: {text}", retry_elsewhere=retry)


def submitted_handle(task: Task, offer: Offer, conn_id: str, job_id: str, job_name: str,
                     job_dir: str, adopted: bool, submitted_at: float) -> JobHandle:
    """The handle of the job just submitted (or found under the lock) for ``offer``."""
    return _handle(conn_id, job_id, job_name, job_dir, location=offer.location,
                   infra=offer.infra, num_nodes=task.num_nodes,
                   accelerator=offer.request.accelerator,
                   gpus_per_node=offer.request.accelerator_count,
                   price_per_hour=offer.price_per_hour, adopted=adopted,
                   submitted_at=submitted_at)


def cancel_script(handle: JobHandle, slurm_timeout: float = 20.0,
                  slack: float = RENAMED_SLACK) -> str:
    """``scancel`` (its exit status is the script's) and drop the job's secrets. Not a job
    that only holds our id: one by another name submitted well after ours got the id from
    Slurm again (a controller that lost its state); the rule of ``status._ours``."""
    job_dir = handle.extra.get("job_dir", "")
    jid = shlex.quote(handle.job_id)
    lines = [bounded(slurm_timeout)]
    if handle.job_name and handle.submitted_at:
        later = int(handle.submitted_at + slack)
        lines += [
            f"row=$(_t env SLURM_TIME_FORMAT=%s squeue -h -j {jid} -o '%j|%V' 2>/dev/null)",
            f"case $row in ''|{shlex.quote(handle.job_name + '|')}*) ;; *)",
            "  sub=${row##*|}",
            f'  case $sub in ""|*[!0-9]*) ;; *) if [ "$sub" -gt {later} ]; then',
            f'    echo "airflow-skypilot: id {handle.job_id} is held by another job now ($row): '
            'not cancelled"; other=1; fi ;; esac ;;',
            "esac",
        ]
    lines.append(f'rc=0; [ -n "${{other:-}}" ] || {{ _t scancel {jid} 2>&1; rc=$?; }}')
    if job_dir:
        lines.append(f"rm -f {shlex.quote(job_dir)}/secrets.sh")
    return "\n".join(lines + ["exit $rc"])


def check_cancelled(rc: int, out: str, err: str, handle: JobHandle) -> None:
    """:func:`cancel_script`'s result: nothing when the job is stopped or was gone already;
    BackendUnreachable when slurmctld did not answer (in time: it may act on it later)."""
    text = (out + err).strip()
    if rc == 0 or ("Invalid job id" in text and handle.job_id.isdigit()):
        return  # (an id that is not a number is ours that went wrong, not a job gone)
    if no_answer(rc, text):
        raise BackendUnreachable(f"scancel {handle.job_id} on {handle.connection} got no "
                                 f"answer from slurmctld: {text[-300:]}")
    raise BackendError(f"scancel {handle.job_id} on {handle.connection} failed: {text[-300:]}")


#: what :func:`cleanup_script` removes from a finished job's dir (the log and the files that
#: say which job it was stay until the retention runs out)
LEFT_BEHIND = ("workdir", "job.sbatch", "sbatch.err", "node.sh", "env.sh", "setup.sh", "run.sh",
               "exit_code.tmp", "job_id.tmp", "killed.tmp", "began.setup", "began.run")


def cleanup_script(handle: JobHandle, slurm_timeout: float = 20.0) -> str | None:
    """Remove the job's secrets at once; its workdir copy and scripts too once squeue says
    the job is no longer queued or running (never while it may still read them). The log,
    ``job_id``, ``handle`` and ``exit_code`` stay. Prints ``@@kept`` when the rest had to
    stay (squeue did not answer, or the job is still active)."""
    job_dir = handle.extra.get("job_dir")
    if not job_dir:
        return None
    jd = shlex.quote(job_dir)
    # and each rank's own exit codes (exit_code.<phase>.<rank>: folded into exit_code)
    rest = " ".join([*(f"{jd}/{shlex.quote(name)}" for name in LEFT_BEHIND),
                     f"{jd}/exit_code.*.*", f"{jd}/workdir.*"])  # a rank's own copy
    return "\n".join([
        bounded(slurm_timeout),
        f"rm -f {jd}/secrets.sh",
        # an empty answer: no longer queued or running; "Invalid job id": slurmctld forgot it
        f"st=$(_t squeue -h -j {shlex.quote(handle.job_id)} -o %i 2>&1); rc=$?; gone=",
        'if [ $rc -eq 0 ]; then [ -z "$st" ] && gone=1; '
        'else case $st in *"Invalid job id"*) gone=1 ;; esac; fi',
        f'if [ -n "$gone" ]; then rm -rf -- {rest}; else echo @@kept; fi',
    ])
