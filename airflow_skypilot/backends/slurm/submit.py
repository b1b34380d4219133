"""A job on the cluster: its files, how they get there, ``sbatch`` once per name, and cancel.

Every job has its own dir ``<remote_work_dir>/jobs/<job name>/`` (mode 0700) holding the task's
``setup.sh``/``run.sh`` verbatim, ``env.sh``, ``secrets.sh`` (0600, removed when the job ends),
the node wrapper ``node.sh``, the batch script ``job.sbatch``, ``handle`` (what :func:`lookup`
needs to rebuild the handle), and, once submitted, ``job_id``. ``sbatch`` runs under ``flock``
in that dir, and only if no ``job_id`` is there yet; a queued job of the same name is found too.
So a name is submitted at most once, and a retried worker adopts what it submitted before.
"""

from __future__ import annotations

import os
import shlex
import time
from collections.abc import Mapping
from typing import Any

from airflow_skypilot.backends.base import JobHandle, Offer
from airflow_skypilot.backends.common import jobscript
from airflow_skypilot.backends.common.workdir import local_source, walk
from airflow_skypilot.backends.slurm.remote import (
    Chmod,
    MakeDirs,
    PutFile,
    UploadStep,
    WriteFile,
)
from airflow_skypilot.backends.slurm.settings import BACKEND, SlurmSettings, task_sbatch_options
from airflow_skypilot.backends.slurm.shell import (
    abs_remote,
    parse_int,
    parse_sections,
    remote_dir_expr,
)
from airflow_skypilot.exceptions import BackendUnreachable, SubmissionError
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


def lookup_script(settings: SlurmSettings, job_name: str) -> str:
    """``$HOME``, and the job of that name if any: its ``job_id`` and ``handle`` files, or a
    queued job of that name (submitted but not yet recorded)."""
    jobs = remote_dir_expr(settings.remote_work_dir) + "/jobs/" + shlex.quote(job_name)
    return "\n".join([
        'printf "@@home\\n%s\\n" "$HOME"',
        "echo @@job_id", f"cat {jobs}/job_id 2>/dev/null",
        "echo @@meta", f"cat {jobs}/handle 2>/dev/null",
        "echo @@queued", f"squeue -h -n {shlex.quote(job_name)} -u \"$USER\" -o '%i|%P'",
    ])


def find_all_script(settings: SlurmSettings, prefix: str) -> str:
    """``$HOME``, every job dir named ``prefix*`` (name, job id, handle fields on one line) and
    the user's queued jobs; ``@@squeue_rc`` says whether squeue answered."""
    jobs = remote_dir_expr(settings.remote_work_dir) + "/jobs/"
    return "\n".join([
        'printf "@@home\\n%s\\n" "$HOME"',
        "echo @@dirs",
        f"for d in {jobs}{shlex.quote(prefix)}*/; do",
        '  [ -d "$d" ] || continue',
        '  printf "%s\\t%s\\t%s\\n" "$(basename "$d")" "$(cat "$d/job_id" 2>/dev/null)" '
        '"$(tr "\\n" "\\t" < "$d/handle" 2>/dev/null)"',
        "done",
        "echo @@queued",
        "squeue -h -u \"$USER\" -o '%i|%P|%j'; rc=$?",
        'printf "@@squeue_rc\\n%s\\n" "$rc"',
    ])


def parse_find_all(out: str, settings: SlurmSettings, conn_id: str,
                   prefix: str) -> list[JobHandle]:
    """:func:`find_all_script`'s output -> the handles (raises if squeue did not answer: a
    queued job may be among the unanswered, and "could not ask" is not "none")."""
    sec = parse_sections(out)
    rc = (sec.get("squeue_rc") or ["?"])[0].strip()
    if rc != "0":
        raise BackendUnreachable(f"{conn_id}: squeue failed (exit {rc}) while listing jobs "
                                 f"{prefix}*")
    home = (sec.get("home") or [""])[0]
    found: dict[str, JobHandle] = {}
    for line in sec.get("dirs", []):
        name, _, rest = line.partition("\t")
        job_id, _, meta_text = rest.partition("\t")
        if not name.startswith(prefix) or not job_id.strip():
            continue  # a dir whose sbatch never ran: no job
        meta = dict(kv.split("=", 1) for kv in meta_text.split("\t") if "=" in kv)
        found[name] = _from_meta(settings, conn_id, job_id.strip(), name, meta, "", home)
    for line in sec.get("queued", []):
        job_id, _, rest = line.partition("|")
        partition, _, name = rest.partition("|")
        if name.startswith(prefix) and name not in found:
            found[name] = _from_meta(settings, conn_id, job_id.strip(), name, {}, partition,
                                     home)
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
        submitted_at=float(meta.get("submitted_at", time.time())), adopted=True)


def parse_lookup(out: str, settings: SlurmSettings, conn_id: str,
                 job_name: str) -> tuple[JobHandle | None, str]:
    """:func:`lookup_script`'s output -> (the adopted job's handle or None, ``$HOME``)."""
    sec = parse_sections(out)
    home = (sec.get("home") or [""])[0]
    job_id = (sec.get("job_id") or [""])[0].strip()
    partition = ""
    if not job_id and sec.get("queued"):
        job_id, _, partition = sec["queued"][0].partition("|")
    if not job_id:
        return None, home
    meta = dict(kv.split("=", 1) for kv in sec.get("meta", []) if "=" in kv)
    return _from_meta(settings, conn_id, job_id.strip(), job_name, meta, partition, home), home


# --- the job's files -------------------------------------------------------------------------


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
        "# SKYPILOT_NODE_IPS: each node's address (NodeAddr, resolved to an IP), in rank order",
        'ips=""',
        'for n in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do',
        "  a=$(scontrol show node -o \"$n\" | tr ' ' '\\n' | sed -n 's/^NodeAddr=//p')",
        '  a=${a:-$n}',
        "  case $a in *[!0-9.]*)",
        "    ip=$(getent ahostsv4 \"$a\" 2>/dev/null | awk 'NR==1{print $1}'); a=${ip:-$a} ;;",
        "  esac",
        '  ips="$ips$a"$\'\\n\'',
        "done",
        'export SKYPILOT_NODE_IPS="${ips%$\'\\n\'}"',
        'echo "airflow-skypilot: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST"',
        f"srun{label} --kill-on-bad-exit=1 --ntasks-per-node=1 "
        f'-N "$SLURM_JOB_NUM_NODES" bash "$JOB_DIR/node.sh" setup',
        "rc=$?",
        "if [ $rc -eq 0 ]; then",
        f"  srun{label} --kill-on-bad-exit=1 --ntasks-per-node=1 "
        f'-N "$SLURM_JOB_NUM_NODES" bash "$JOB_DIR/node.sh" run',
        "  rc=$?",
        "else",
        '  echo "airflow-skypilot: setup failed with exit code $rc; run skipped" >&2',
        "fi",
        'printf "%s\\n" "$rc" > "$JOB_DIR/exit_code.tmp" && '
        'mv "$JOB_DIR/exit_code.tmp" "$JOB_DIR/exit_code"',
        "exit $rc",
    ]
    return "\n".join(lines) + "\n"


def render(task: Task, offer: Offer, settings: SlurmSettings, job_name: str,
           env: Mapping[str, str], job_dir: str) -> dict[str, tuple[str, int]]:
    """Every file of the job: name -> (content, mode)."""
    req = offer.request
    info = {"cluster_name": settings.cluster, "cloud": "Slurm", "region": settings.cluster,
            "zone": offer.location}
    node_env = jobscript.skypilot_env(
        task, task_id=env.get("SKYPILOT_TASK_ID", job_name),
        num_gpus_per_node=jobscript.gpus_per_node(req.accelerator_count),
        cluster_info=info, extra=env)
    node = jobscript.node_script(job_dir=shlex.quote(job_dir),
                                 workdir=shlex.quote(f"{job_dir}/workdir"),
                                 rank_var="SLURM_NODEID", has_setup=bool(task.setup),
                                 has_run=bool(task.run))
    meta = {
        "partition": offer.location, "num_nodes": task.num_nodes,
        "accelerator": req.accelerator or "", "gpus_per_node": req.accelerator_count,
        "price_per_hour": offer.price_per_hour, "submitted_at": time.time(),
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


def _tree(local: str, remote: str) -> list[UploadStep]:
    """A local tree (what :func:`walk` says travels), parents first, file modes kept."""
    steps: list[UploadStep] = [MakeDirs(remote, 0o755)]
    for path, rel, is_dir in walk(local):
        target = f"{remote}/{rel}"
        steps.append(MakeDirs(target, 0o755) if is_dir else PutFile(path, target, keep_mode=True))
    return steps


def upload_plan(task: Task, job_dir: str, files: Mapping[str, tuple[str, int]],
                home: str) -> list[UploadStep]:
    """The job dir and its files, the local workdir into ``workdir/``, then the local file
    mounts at their targets (``~`` is ``home``)."""
    steps: list[UploadStep] = [MakeDirs(job_dir, 0o700), Chmod(job_dir, 0o700)]
    steps += [WriteFile(f"{job_dir}/{name}", content, mode)
              for name, (content, mode) in files.items()]
    steps.append(MakeDirs(f"{job_dir}/workdir", 0o700))
    if isinstance(task.workdir, str):
        steps += _tree(local_source(task, task.workdir), f"{job_dir}/workdir")
    for dst, src in task.file_mounts.items():
        if isinstance(src, str) and "://" not in src:
            local = local_source(task, src)
            target = abs_remote(dst, home)
            if os.path.isdir(local):
                steps += _tree(local, target)
            else:
                steps += [MakeDirs(os.path.dirname(target) or "/", 0o755),
                          PutFile(local, target)]
    return steps


# --- sbatch and scancel ----------------------------------------------------------------------


def submit_script(job_dir: str, job_name: str) -> str:
    """``sbatch`` under the job dir's lock, unless a ``job_id`` is already there."""
    args = ["sbatch", "--parsable", f"--job-name={job_name}",
            f"--output={job_dir}/slurm.log", f"--chdir={job_dir}",
            f"{job_dir}/job.sbatch"]
    submit = " ".join(shlex.quote(a) for a in args)
    return "\n".join([
        f"cd {shlex.quote(job_dir)} || exit 97",
        "exec 9>lock",
        "flock -w 60 9 || exit 98",
        'if [ -s job_id ]; then echo "@@adopted"; cat job_id; exit 0; fi',
        f"out=$({submit} 2>&1) || {{ echo \"$out\" >&2; exit 99; }}",
        'jid=${out%%;*}',
        'printf "%s\\n" "$jid" > job_id.tmp && mv job_id.tmp job_id',
        'echo "@@submitted"; printf "%s\\n" "$jid"',
    ])


def parse_submitted(rc: int, out: str, err: str, conn_id: str) -> tuple[str, bool]:
    """:func:`submit_script`'s result -> (job id, adopted); a refusal is a SubmissionError,
    to be retried elsewhere unless sbatch called the job itself invalid."""
    sec = parse_sections(out)
    ids = sec.get("submitted") or sec.get("adopted")
    if rc != 0 or not ids:
        message = (err or out).strip().splitlines()
        text = message[-1] if message else f"exit {rc}"
        retry = not any(w in text.lower() for w in ("invalid", "unrecognized", "syntax"))
        raise SubmissionError(f"sbatch on {conn_id} failed: {text}", retry_elsewhere=retry)
    return ids[0].strip(), "adopted" in sec


def submitted_handle(task: Task, offer: Offer, conn_id: str, job_id: str, job_name: str,
                     job_dir: str, adopted: bool) -> JobHandle:
    """The handle of the job just submitted (or found under the lock) for ``offer``."""
    return _handle(conn_id, job_id, job_name, job_dir, location=offer.location,
                   infra=offer.infra, num_nodes=task.num_nodes,
                   accelerator=offer.request.accelerator,
                   gpus_per_node=offer.request.accelerator_count,
                   price_per_hour=offer.price_per_hour, adopted=adopted)


def cancel_script(handle: JobHandle) -> str:
    """``scancel`` (its exit status is the script's) and drop the job's secrets."""
    job_dir = handle.extra.get("job_dir", "")
    script = f"scancel {shlex.quote(handle.job_id)} 2>&1; rc=$?"
    if job_dir:
        script += f"\nrm -f {shlex.quote(job_dir)}/secrets.sh"
    return script + "\nexit $rc"


def cleanup_script(handle: JobHandle) -> str | None:
    """Remove what the job left that must not stay (its secrets), if it has a job dir."""
    job_dir = handle.extra.get("job_dir")
    return f"rm -f {shlex.quote(job_dir)}/secrets.sh" if job_dir else None
