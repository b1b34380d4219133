"""Where watched jobs are: one command for all of a connection's jobs, and its parser.

The status script asks ``squeue -t all -u $USER`` (jobs still in the queue or just finished),
``sacct`` where accounting exists, and each job's ``exit_code`` file (written by the job itself)
for jobs that already left the queue. Slurm states map to ours by SkyPilot's rule: the
allocation is gone (node failure, preemption) -> infra; the program exited non-zero -> user.
A job none of the three knows is ``LOST``, but only on an answer that came back: a script that
did not run (no ``@@squeue`` section) is "could not ask", never "gone".
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Sequence

from airflow_skypilot.backends.base import JobHandle, JobState, JobStatus
from airflow_skypilot.backends.slurm.shell import parse_int, parse_sections

#: squeue/sacct state -> our state (SkyPilot's rule: the allocation is gone -> infra)
STATE_MAP: dict[str, JobState] = {
    "PENDING": JobState.PENDING,
    "CONFIGURING": JobState.PENDING,
    "REQUEUED": JobState.PENDING,
    "REQUEUE_HOLD": JobState.PENDING,
    "REQUEUE_FED": JobState.PENDING,
    "RESV_DEL_HOLD": JobState.PENDING,
    "SUSPENDED": JobState.RUNNING,
    "RUNNING": JobState.RUNNING,
    "COMPLETING": JobState.RUNNING,
    "STAGE_OUT": JobState.RUNNING,
    "SIGNALING": JobState.RUNNING,
    "RESIZING": JobState.RUNNING,
    "COMPLETED": JobState.SUCCEEDED,
    "FAILED": JobState.FAILED,
    "OUT_OF_MEMORY": JobState.FAILED,
    "TIMEOUT": JobState.FAILED,
    "DEADLINE": JobState.FAILED,
    "SPECIAL_EXIT": JobState.FAILED,
    "NODE_FAIL": JobState.INFRA_FAILED,
    "BOOT_FAIL": JobState.INFRA_FAILED,
    "PREEMPTED": JobState.PREEMPTED,
    "REVOKED": JobState.LOST,
    "CANCELLED": JobState.CANCELLED,
    "STOPPED": JobState.RUNNING,
}

#: the section whose presence proves the status script ran
ANSWERED = "@@squeue"


def status_script(handles: Sequence[JobHandle]) -> str:
    """One script that reports on every job of ``handles``."""
    ids = ",".join(shlex.quote(h.job_id) for h in handles)
    lines = [
        "echo @@squeue",
        "squeue -h -t all -u \"$USER\" -o '%i|%j|%T|%r|%N|%S|%e'",
        "echo @@sacct",
        f"sacct -n -P -X -j {ids} -o JobIDRaw,State,ExitCode,Start,End 2>/dev/null || true",
        "echo @@exits",
    ]
    for h in handles:
        job_dir = h.extra.get("job_dir")
        if job_dir:
            lines.append(f"[ -f {shlex.quote(job_dir)}/exit_code ] && printf '%s|%s\\n' "
                         f"{shlex.quote(h.job_id)} \"$(cat {shlex.quote(job_dir)}/exit_code)\"")
    lines.append("true")
    return "\n".join(lines)


def parse_status(output: str, handles: Sequence[JobHandle]) -> dict[str, JobStatus]:
    """The status script's output -> a JobStatus per watched job id."""
    sec = parse_sections(output)
    queue: dict[str, list[str]] = {}
    for line in sec.get("squeue", []):
        parts = line.split("|")
        if len(parts) >= 6:
            queue[parts[0].strip()] = [p.strip() for p in parts]
    accounted: dict[str, list[str]] = {}
    for line in sec.get("sacct", []):
        parts = line.split("|")
        if len(parts) >= 3 and "." not in parts[0]:
            accounted[parts[0].strip()] = [p.strip() for p in parts]
    exits: dict[str, str] = {}
    for line in sec.get("exits", []):
        job_id, _, code = line.partition("|")
        exits[job_id.strip()] = code.strip()
    out: dict[str, JobStatus] = {}
    for handle in handles:
        jid = handle.job_id
        code_text = exits.get(jid, "")
        exit_code = parse_int(code_text, None) if code_text else None  # type: ignore[arg-type]
        if jid in queue:
            # id|name|state|reason|nodes|start|end
            _, _, raw, reason, nodes, start, end = (queue[jid] + [""] * 7)[:7]
            out[jid] = _status_from(raw, reason, exit_code, nodes, start, end)
        elif jid in accounted:
            _, raw, code, *_ = accounted[jid] + ["", "", ""]
            sacct_code = parse_int(code.split(":")[0], None) if code else None  # type: ignore[arg-type]
            out[jid] = _status_from(raw.split()[0], "", exit_code if exit_code is not None
                                    else sacct_code, "", "", "")
        elif exit_code is not None:
            state = JobState.SUCCEEDED if exit_code == 0 else JobState.FAILED
            out[jid] = JobStatus(state, reason="" if exit_code == 0 else f"exit code {exit_code}",
                                 exit_code=exit_code, raw_state="(exit file)")
        else:
            out[jid] = JobStatus(JobState.LOST, reason="job is no longer known to Slurm and left "
                                                      "no exit code", raw_state="(vanished)")
    return out


def _epoch(text: str) -> float | None:
    if not text or text in ("N/A", "Unknown", "None"):
        return None
    try:
        return time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def _status_from(raw: str, reason: str, exit_code: int | None, nodes: str, start: str,
                 end: str) -> JobStatus:
    raw = raw.upper().split()[0] if raw else "UNKNOWN"
    raw = raw.rstrip("+")
    state = STATE_MAP.get(raw, JobState.LOST)
    if raw == "CANCELLED" and reason.lower().startswith("node"):
        state = JobState.INFRA_FAILED
    text = {
        "TIMEOUT": "time limit reached", "OUT_OF_MEMORY": "out of memory",
        "NODE_FAIL": "node failure", "BOOT_FAIL": "node failed to boot",
        "PREEMPTED": "preempted", "CANCELLED": "cancelled",
    }.get(raw, "")
    if state == JobState.PENDING and reason and reason not in ("None", "(null)"):
        text = reason
    if state == JobState.FAILED and not text:
        text = f"exit code {exit_code}" if exit_code is not None else "failed"
    if state == JobState.SUCCEEDED and exit_code not in (None, 0):
        state, text = JobState.FAILED, f"exit code {exit_code}"
    return JobStatus(state, reason=text, exit_code=exit_code,
                     started_at=_epoch(start), ended_at=_epoch(end) if state.terminal else None,
                     nodes=[n for n in nodes.split(",") if n and n != "(null)"] if nodes else [],
                     raw_state=raw)
