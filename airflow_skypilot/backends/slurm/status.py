"""Where watched jobs are: one command for all of a connection's jobs, and its parser.

The status script asks ``squeue -t all -u $USER`` (jobs still in the queue or just finished;
a pending job's StartTime, backfill's plan for it, is its own estimated start,
``JobStatus.est_start``, discounted by the finished jobs' history the last probe kept, as the
probe's estimates are),
``sacct`` where accounting exists, and each job's ``exit_code`` file (written by the job itself)
for jobs that already left the queue. Slurm states map to ours by SkyPilot's rule: the
allocation is gone (node failure, preemption) -> infra; the program exited non-zero -> user;
a job whose ``exit_code`` says ``nostep`` (srun could not launch a step, so the task's script
of that step never began: slurmctld unreachable, a step limit) -> infra. A failed multi-node
job's ``ranks`` line (what each rank wrote) decides how it failed, whether squeue (FAILED, or
COMPLETING after the exit file), sacct or only the file still knows it: a rank's node down ->
infra, else the user's, with every failed rank's code (``JobStatus.exit_codes``).

Who is authoritative for what ("could not ask" is never "gone"):

- ``squeue`` (slurmctld's memory) alone says whether a job is still alive, and only when it
  exited 0: a failed, killed or timed-out squeue (slurmctld down, paused, overloaded) answers
  nothing, and its partial output is not read.
- ``sacct`` (slurmdbd) and the ``exit_code`` file only tell how a job that left the queue
  ended; sacct counts only when it exited 0 (clusters without accounting make it fail).
- A job that none of them knows is ``LOST`` only when squeue answered. When squeue did not,
  such a job is ``UNKNOWN``; a script that did not run at all (no ``@@squeue_rc``) is
  BackendUnreachable for every job.

Every Slurm command runs under ``timeout`` (:func:`~.shell.bounded`). Times are asked for as
epoch seconds (``SLURM_TIME_FORMAT=%s``: squeue and sacct print the cluster's local time
otherwise); a cluster that prints a date anyway is read with the UTC offset its ``date +%z``
gave in the same command.
"""

from __future__ import annotations

import calendar
import shlex
import time
from collections.abc import Sequence
from dataclasses import replace

from airflow_skypilot.backends.base import JobHandle, JobState, JobStatus
from airflow_skypilot.backends.slurm.queue import history_ratio
from airflow_skypilot.backends.slurm.shell import (
    bounded,
    parse_int,
    parse_sections,
    rc_line,
    remote_dir_expr,
    section_rc,
)

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

#: the section whose presence proves the status script ran to its end
ANSWERED = "@@exits"
#: Slurm's time stamps as epoch seconds (squeue %S/%e, sacct Start/End)
EPOCH_TIMES = "env SLURM_TIME_FORMAT=%s"
#: seconds past a job's own upload and sbatch within which Slurm's submit time may fall (the
#: worker's and the controller's clocks differ; a flock wait)
RENAMED_SLACK = 600.0


def renamed_slack(upload_timeout: float) -> float:
    """How long after a handle's ``submitted_at`` (taken before the upload) a job by another
    name under its id may have been submitted and still be ours."""
    return upload_timeout + RENAMED_SLACK


def status_script(handles: Sequence[JobHandle], slurm_timeout: float = 20.0,
                  history_file: str | None = None) -> str:
    """One script that reports on every job of ``handles`` (and, from ``history_file``, the
    finished jobs' history the last probe kept: no ``sacct`` for it here)."""
    ids = ",".join(shlex.quote(h.job_id) for h in handles)
    lines = [
        bounded(slurm_timeout),
        'printf "@@tz\\n%s\\n" "$(date +%z)"',
        'printf "@@now\\n%s\\n" "$(date +%s)"',
        "echo @@squeue",
        f"_t {EPOCH_TIMES} squeue -h -t all -u \"$USER\" -o '%i|%j|%T|%r|%N|%S|%e|%V'",
        rc_line("squeue"),
        "echo @@sacct",
        # -D: every job that held an id (Slurm gives one again), ours picked by _ours
        f"_t {EPOCH_TIMES} sacct -n -P -X -D -j {ids} "
        "-o JobIDRaw,State,ExitCode,Start,End,Submit,JobName 2>/dev/null",
        rc_line("sacct"),
        "echo @@exits",
    ]
    for h in handles:
        job_dir = h.extra.get("job_dir")
        if job_dir:  # its exit code, else its note that a signal stopped it (submit.py)
            jd, jid = shlex.quote(job_dir), shlex.quote(h.job_id)
            # (its lines joined: a failed multi-node job's second says what each rank wrote)
            lines.append(f"if [ -f {jd}/exit_code ]; then printf '%s|%s\\n' {jid} "
                         f"\"$(tr '\\n' ' ' < {jd}/exit_code)\"; elif [ -f {jd}/killed ]; then "
                         f"printf '%s|%s\\n' {jid} \"$(cat {jd}/killed)\"; fi")
    if history_file:
        lines += ["echo @@history", f"cat {remote_dir_expr(history_file)} 2>/dev/null"]
    lines.append("true")
    return "\n".join(lines)


def parse_status(output: str, handles: Sequence[JobHandle],
                 slack: float = RENAMED_SLACK) -> dict[str, JobStatus]:
    """The status script's output -> a JobStatus per watched job id (see the module's rules
    of who is authoritative). ``slack``: see :func:`_ours`."""
    sec = parse_sections(output)
    offset = _utc_offset((sec.get("tz") or [""])[0])
    now = epoch((sec.get("now") or [""])[0])
    squeue_rc = section_rc(sec, "squeue")
    answered = squeue_rc == 0
    # id -> [(row, name, submit time)]
    queue: dict[str, list[tuple[list[str], str, str]]] = {}
    for line in sec.get("squeue", []) if answered else []:
        parts = [p.strip() for p in line.split("|")]
        if len(parts) >= 6:  # id|name|state|reason|nodes|start|end|submit
            queue.setdefault(parts[0], []).append(
                (parts[:7], parts[1], parts[7] if len(parts) > 7 else ""))
    accounted: dict[str, list[tuple[list[str], str, str]]] = {}
    for line in sec.get("sacct", []) if section_rc(sec, "sacct") == 0 else []:
        parts = line.split("|")
        if len(parts) >= 3 and "." not in parts[0]:  # id|state|code|start|end|submit|name
            accounted.setdefault(parts[0].strip(), []).append((
                [p.strip() for p in parts[:5]], "|".join(parts[6:]).strip(),
                parts[5].strip() if len(parts) > 5 else ""))
    history = sec.get("history")
    discount = history_ratio(history) if history else None
    exits: dict[str, str] = {}
    for line in sec.get("exits", []):
        job_id, _, code = line.partition("|")
        if job_id.strip():
            exits[job_id.strip()] = code.strip()
    out: dict[str, JobStatus] = {}
    for handle in handles:
        jid = handle.job_id
        code_text, _, ranks = exits.get(jid, "").partition(" ranks ")
        killed = code_text.split() if code_text.startswith("killed") else None
        if killed:  # "killed <epoch> [<end time>]": not an exit code
            code_text = ""
        nostep = code_text.split() if code_text.startswith("nostep") else None
        if nostep:  # "nostep <phase> <srun's exit code>": the job script's own verdict
            code_text = nostep[-1]
        exit_code = parse_int(code_text, None) if code_text else None  # type: ignore[arg-type]
        listed = _ours(handle, queue.get(jid, []), offset, slack)
        booked = _ours(handle, accounted.get(jid, []), offset, slack)
        if listed is not None:
            # id|name|state|reason|nodes|start|end
            _, _, raw, reason, nodes, start, end = (listed + [""] * 7)[:7]
            out[jid] = _status_from(raw, reason, exit_code, nodes, start, end, offset, now)
            est = out[jid].est_start
            if est is not None and now is not None and discount and discount.ratio:
                # Slurm plans from time limits: discounted as the probe's estimates are
                out[jid].est_start = now + (est - now) * discount.ratio
        elif booked is not None:
            _, raw, code, start, end = (booked + [""] * 5)[:5]
            sacct_code = parse_int(code.split(":")[0], None) if code else None  # type: ignore[arg-type]
            out[jid] = _status_from(raw, "", exit_code if exit_code is not None
                                    else sacct_code, "", start, end, offset)
        elif exit_code and ranks:
            out[jid] = _ranks_status(ranks.split(), exit_code)
        elif exit_code is not None:
            state = JobState.SUCCEEDED if exit_code == 0 else JobState.FAILED
            out[jid] = JobStatus(state, reason="" if exit_code == 0 else f"exit code {exit_code}",
                                 exit_code=exit_code, raw_state="(exit file)")
        elif killed and answered:  # squeue says it is gone: its steps too (not COMPLETING)
            out[jid] = _killed(killed)
        elif answered:
            out[jid] = JobStatus(JobState.LOST, reason="job is no longer known to Slurm and left "
                                                      "no exit code", raw_state="(vanished)")
        else:
            why = "timed out" if squeue_rc in (124, 137) else f"failed (exit {squeue_rc})"
            out[jid] = JobStatus(JobState.UNKNOWN, reason=f"squeue {why}: slurmctld did not "
                                                          "answer", raw_state="(no answer)")
        if exit_code and ranks and out[jid].state == JobState.FAILED \
                and out[jid].raw_state == "FAILED":
            # squeue or sacct still lists the failed job (FAILED, or COMPLETING after its exit
            # file): what each rank wrote decides as it would once Slurm forgets the job (a
            # rank's node down -> infra; every failed rank's code, not srun's one)
            ranked = _ranks_status(ranks.split(), exit_code)
            out[jid] = replace(out[jid], state=ranked.state, reason=ranked.reason,
                               exit_code=ranked.exit_code, exit_codes=ranked.exit_codes)
        if nostep and out[jid].state == JobState.FAILED:
            out[jid] = replace(out[jid], state=JobState.INFRA_FAILED, reason=(
                f"srun could not launch the job's {nostep[1]} step (exit {exit_code}): the "
                f"task's {nostep[1]} never began"))
    return out


def _ours(handle: JobHandle, found: list[tuple[list[str], str, str]], offset: float | None,
          slack: float) -> list[str] | None:
    """The squeue or sacct row under ``handle``'s id that is ``handle``'s job, if any. Slurm
    gives an id again (a controller that lost its state, MaxJobId wrapping): a job under our
    id, by another name and submitted more than ``slack`` seconds after ``submitted_at``, is
    another's, not ours to watch, adopt or judge. Within it, one by another name is ours,
    renamed (a site's job_submit plugin, an ``scontrol update``); ``submitted_at`` is the
    worker's clock before the upload and sbatch (see :func:`renamed_slack`)."""
    for row, name, _ in found:
        if not handle.job_name or name == handle.job_name:
            return row
    for row, _, submit_text in found:
        submit = epoch(submit_text, offset) if submit_text else None
        if not handle.submitted_at or submit is None or submit <= handle.submitted_at + slack:
            return row
    return None


def _ranks_status(words: list[str], exit_code: int) -> JobStatus:
    """A failed multi-node job, by what each rank wrote (the job script's
    ``ranks <phase> <rank>=<code>|-|down ...``). A rank whose node Slurm has down, or any rank
    without a code of its own when no rank failed of its own, lost its node: infrastructure
    (as SkyPilot, and Slurm's NODE_FAIL while it listed the job). A rank without a code beside
    one that failed of its own, its node up, was killed by srun (``--kill-on-bad-exit``) for
    that failure: the user's, with every failed rank's code."""
    phase = words[0] if words else "run"
    ranks = dict(w.split("=", 1) for w in words[1:] if "=" in w)
    failed = sorted((parse_int(r), int(c)) for r, c in ranks.items() if c.isdigit() and int(c))
    down = sorted(parse_int(r) for r, c in ranks.items() if c == "down")
    missing = sorted(parse_int(r) for r, c in ranks.items() if c == "-")
    lost = down or ([] if failed else missing)
    if lost:
        how = "its node is down in Slurm" if down else "its node was lost"
        return JobStatus(JobState.INFRA_FAILED, reason=(
            f"rank {lost[0]} wrote no exit code of its own in the {phase} step: {how}"),
            exit_code=exit_code, exit_codes=[c for _, c in failed], raw_state="(exit file)")
    if not failed:
        return JobStatus(JobState.FAILED, reason=f"exit code {exit_code}",
                         exit_code=exit_code, raw_state="(exit file)")
    # the rank that failed of its own, not one srun then stopped (TERM, KILL: 143, 137) while
    # its node.sh went on to write that code
    rank, code = next(((r, c) for r, c in failed if c not in (137, 143)), failed[0])
    return JobStatus(JobState.FAILED, reason=f"exit code {code} on rank {rank}", exit_code=code,
                     exit_codes=[c for _, c in failed], raw_state="(exit file)")


def _killed(note: list[str]) -> JobStatus:
    """A job Slurm no longer knows whose batch script noted ``killed <epoch> [<end time>]``
    (SIGTERM). At or past its end time it hit its time limit: the user's failure, as Slurm's
    TIMEOUT (it was read LOST and placed again, to hit the limit again). Before it, the signal
    was a preemption, its node shutting down or a scancel, which Slurm no longer tells apart:
    LOST, as before, so a preempted job is placed again (a scancel by someone is too)."""
    at = epoch(note[1]) if len(note) > 1 else None
    end = epoch(note[2]) if len(note) > 2 else None
    if at is not None and end is not None and at >= end:
        return JobStatus(JobState.FAILED, reason="time limit reached (the job was stopped at "
                         "its time limit)", raw_state="TIMEOUT", ended_at=at)
    return JobStatus(JobState.LOST, reason="the job was stopped by a signal before its time "
                     "limit (preempted, its node shut down, or scancel) and Slurm no longer "
                     "knows it", raw_state="(killed)", ended_at=at)


def _utc_offset(text: str) -> float | None:
    """``date +%z`` (``+0530``) -> seconds east of UTC; None when it is not one."""
    text = text.strip()
    if len(text) != 5 or text[0] not in "+-" or not text[1:].isdigit():
        return None
    seconds = int(text[1:3]) * 3600 + int(text[3:5]) * 60
    return float(seconds if text[0] == "+" else -seconds)


def epoch(text: str, utc_offset: float | None = None) -> float | None:
    """A Slurm time stamp -> epoch seconds: digits (``SLURM_TIME_FORMAT=%s``) as they are; a
    date (the cluster's local time) with the cluster's ``utc_offset``, else this host's zone."""
    text = (text or "").strip()
    if not text or text in ("N/A", "Unknown", "None", "0"):
        return None
    if text.isdigit():
        return float(text)
    try:
        parsed = time.strptime(text, "%Y-%m-%dT%H:%M:%S")
    except ValueError:
        return None
    if utc_offset is None:
        return time.mktime(parsed)
    return float(calendar.timegm(parsed)) - utc_offset


#: a pending job's StartTime this far in the past is stale (a requeued job's last start)
_STALE_START_S = 300.0

# A pending job's reason (squeue %r: slurmctld's own description when it set one, else the
# reason's name; Slurm's list is src/common/job_state_reason.c). Most clear by themselves
# (Resources, Priority, Dependency, BeginTime, Licenses, ReqNodeNotAvail and NodeDown (a node
# comes back), Reservation, the Grp*/MaxPerUser/MaxPerAccount limits (other jobs end),
# PartitionNodeLimit (can mean nodes DOWN), Cleaning, Prolog, SchedDefer): PENDING, and the
# rebalancer may still move the job. PartitionDown/PartitionInactive stay PENDING too: an
# admin's maintenance that ends by itself as far as a job can tell, and a down partition
# gets no offer, so the rebalancer moves the job when another place can start it.
# The ones below never clear without someone changing the job or the cluster: the place will
# not run it, so it is an infrastructure failure (the operator cancels the queued copy, which
# may otherwise start when someone releases it, and places the job elsewhere). JobHeldUser
# (and the descriptions Slurm gives user holds: "job requeued in held state", a requeue-hold
# someone asked for) is not ours to judge: the cluster's user (the account the job runs as)
# held it on purpose (``scontrol hold``/``uhold``, a task's own ``--hold``), and releases it:
# it stays PENDING with that reason shown.
#: slurmctld's descriptions of a hold it put on the job itself (job_mgr.c): the batch
#: launch failed (a node's Prolog failed: the node is drained, the job requeued and held)
_PLACE_HELD_DESCRIPTIONS = ("launch failed requeued held",
                            "user env retrieval failed requeued held")
#: reason names (job_state_reason.c) of a job the place will never start as it is
_PLACE_REFUSED_REASONS = frozenset({
    "JobHeldAdmin",  # held by an administrator (or by Slurm itself): no end of its own
    "JobHoldMaxRequeue",  # requeued (launch failures) past max_batch_requeue, then held
    "BadConstraints",  # slurmctld holds it (priority 0): no node can ever satisfy it
    "Constraints",  # (newer Slurm's name of the same)
    "JobLaunchFailure", "SystemFailure",  # the batch launch failed on the node
    "PartitionTimeLimit",  # its time limit exceeds the partition's: fixed config
    "InvalidAccount", "InvalidQOS",  # the connection's account/QOS is not valid here
    "AccountNotAllowed", "QOSNotAllowed",  # the partition refuses the account/QOS
    "ReservationDeleted", "ReservationInvalid",  # the reservation it names is gone
    "DependencyNeverSatisfied",  # (a task's own --dependency: never, says Slurm)
    "MaxMemPerLimit",  # more memory per node/CPU than the partition's maximum
})


def _never_starts(reason: str) -> bool:
    """Whether a pending job's reason says the place will never start it by itself (see
    the rules above); the per-job maxima (``QOSMaxCpuPerJobLimit``, ``AssocMaxNodePerJob``,
    ``QOSMinGRES``...) compare the job's own request with a fixed limit, so never clear."""
    text = reason.strip()
    if text.lower() in _PLACE_HELD_DESCRIPTIONS:
        return True
    name = text.split(",")[0].split()[0] if text else ""
    if name in _PLACE_REFUSED_REASONS:
        return True
    if name.startswith(("QOSMax", "AssocMax")) and "PerJob" in name \
            and "PerJobs" not in name:
        return True
    return name.startswith("QOSMin")


def _status_from(raw: str, reason: str, exit_code: int | None, nodes: str, start: str,
                 end: str, utc_offset: float | None = None,
                 now: float | None = None) -> JobStatus:
    words = raw.upper().split()
    if not words:  # sacct can print an empty State: the job is known, its state is not
        return JobStatus(JobState.UNKNOWN, reason="Slurm gave no state for the job",
                         exit_code=exit_code, raw_state="")
    raw = words[0].rstrip("+")
    # a state this module does not know (a newer Slurm) says the job exists: not "gone"
    state = STATE_MAP.get(raw, JobState.UNKNOWN)
    node_trouble = any(w in reason.lower() for w in ("node", "launch", "boot", "prolog"))
    if raw == "COMPLETING" and exit_code is not None and (exit_code == 0 or not node_trouble):
        # the batch script wrote its exit code as its last act: what is left is Slurm's
        # clean-up (which can take a minute when slurmctld was away), not the program. Not
        # when Slurm's reason is a node's (NodeDown...): a node failing under a multi-node job
        # makes srun exit non-zero too, and the job ends as NODE_FAIL (infra) after it
        raw = "COMPLETED" if exit_code == 0 else "FAILED"
        state = STATE_MAP[raw]
    if raw == "CANCELLED" and reason.lower().startswith("node"):
        state = JobState.INFRA_FAILED
    text = {
        "TIMEOUT": "time limit reached", "OUT_OF_MEMORY": "out of memory",
        "NODE_FAIL": "node failure", "BOOT_FAIL": "node failed to boot",
        "PREEMPTED": "preempted", "CANCELLED": "cancelled",
    }.get(raw, "")
    if state == JobState.PENDING and reason and reason not in ("None", "(null)"):
        text = reason
    held = state == JobState.PENDING and _never_starts(reason)
    if held:
        # still queued, so it may start when someone releases it: stopping it takes a cancel
        state, text = JobState.INFRA_FAILED, f"Slurm will not start the job here: {reason}"
    if state == JobState.FAILED and not text:
        text = f"exit code {exit_code}" if exit_code is not None else "failed"
    if state == JobState.SUCCEEDED and exit_code not in (None, 0):
        state, text = JobState.FAILED, f"exit code {exit_code}"
    if state == JobState.UNKNOWN:
        text = f"unknown Slurm state {raw}"
    est_start = None
    if state == JobState.PENDING:
        # squeue's StartTime of a pending job: when backfill plans to start it (its own
        # place in the queue, the same time ``squeue --start`` shows); none when unplanned
        est_start = epoch(start, utc_offset)
        if est_start is not None and now is not None:
            est_start = None if est_start < now - _STALE_START_S else max(est_start, now)
    return JobStatus(state, reason=text, exit_code=exit_code, est_start=est_start,
                     started_at=epoch(start, utc_offset) if state != JobState.PENDING else None,
                     ended_at=epoch(end, utc_offset) if state.terminal else None,
                     nodes=[n for n in nodes.split(",") if n and n != "(null)"] if nodes else [],
                     raw_state=raw, still_up=held)
