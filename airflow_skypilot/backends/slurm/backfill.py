"""When Slurm's backfill could start a new job: the hole in its plan, read from one probe.

``sbatch --test-only`` on Slurm 22.05 answers as if the job were last in a FIFO queue (see
:mod:`.queue`): "in 60 minutes" for a 10-minute job that backfill then starts at once beside a
reservation. Backfill itself plans by time limits: a running job holds its GPUs until its
planned end (``squeue %e``: start + time limit), a pending job ahead holds the GPUs of the nodes
it is planned on (``%Y``) from its planned start (``%S``) for its time limit; a new job starts
at the earliest time its own time limit fits on enough nodes beside all of that, without
delaying anyone's plan. :func:`backfill_start` finds that time; the offer takes it when it is
sooner than test-only's, and discounts it alike (both are built from time limits).

Where the plan cannot be read whole, the answer is None (test-only stays the estimate): a
runnable pending job without a planned start or planned nodes (just submitted, or beyond
backfill's look-ahead), GPUs in use that no running job accounts for (asked with ``--gpus``,
not per node), a job without a time limit. Only GPUs are planned: CPU-only jobs, and CPUs and
memory beside the GPUs, are test-only's; a pending job that asks its GPUs per job (``--gpus``)
shows none per node and is not seen taking any (as in :func:`.queue.hold`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from airflow_skypilot.backends.slurm.queue import PendingJob, expand_hostlist, tres_gpus


@dataclass(frozen=True)
class RunningJob:
    """One running job, as ``squeue -t RUNNING -o '%i|%N|%b|%e'`` shows it."""

    job_id: str
    nodes: tuple[str, ...]
    gpus: dict[str, int]  # per node, by GRES type ("" untyped)
    end: float  # planned end (start + time limit), epoch; math.inf: none


def parse_running(line: str) -> RunningJob | None:
    """One ``%i|%N|%b|%e`` line (``%e`` with ``SLURM_TIME_FORMAT=%s``)."""
    parts = [p.strip() for p in line.split("|")]
    if len(parts) < 4 or not parts[0]:
        return None
    job_id, nodes, tres, end = parts[:4]
    when = float(end) if end.isdigit() and int(end) > 0 else math.inf
    return RunningJob(job_id, tuple(expand_hostlist(nodes)), tres_gpus(tres), when)


#: the starts a multi-node job is tried at, at most (beyond: no estimate; test-only's)
MAX_TIMES = 500
#: (from, until, GPUs) on one node
_Busy = tuple[float, float, int]


def _gpus_of(gpus: dict[str, int], gres_type: str) -> int:
    """A job's GPUs of ``gres_type`` per node: the typed ones, and untyped ones (any type)."""
    return gpus.get(gres_type, 0) + gpus.get("", 0) if gres_type else sum(gpus.values())


def _fits(busy: list[_Busy], capacity: int, want: int, t: float, limit: float) -> bool:
    """``want`` GPUs free on the node through [t, t + limit)."""
    end = t + limit
    points = [t] + [b[0] for b in busy if t < b[0] < end]
    return all(sum(g for lo, hi, g in busy if lo <= p < hi) + want <= capacity for p in points)


def backfill_start(capacity: dict[str, int], used: dict[str, int],
                   running: Sequence[RunningJob], pending: Iterable[PendingJob], *,
                   partition: str, now: float, gres_type: str, gpus: int, num_nodes: int,
                   time_limit_s: float | None) -> float | None:
    """The earliest time (epoch, >= ``now``) at which ``num_nodes`` of the ``capacity`` nodes
    (the usable nodes of ``partition`` -> GPUs of ``gres_type`` configured; ``used``: in use
    now) each have ``gpus`` free for ``time_limit_s`` beside the running jobs' and the pending
    jobs' plans; None when the plan cannot be read whole (module docstring) or nothing fits."""
    if gpus <= 0 or time_limit_s is None or math.isinf(time_limit_s):
        return None
    busy: dict[str, list[_Busy]] = {n: [] for n in capacity}
    for job in running:
        for n in job.nodes:
            if n in busy:  # one past its end (completing) still holds them a moment
                busy[n].append((now, max(job.end, now + 1), _gpus_of(job.gpus, gres_type)))
    for n, in_use in used.items():
        if n in busy and sum(g for *_, g in busy[n]) < in_use:
            return None  # GPUs in use that no running job accounts for
    for job in pending:
        if not job.runnable or not _gpus_of(job.gpus, gres_type):
            continue
        if job.start is None or not job.sched_nodes or job.time_limit_s is None:
            if partition in job.partitions:
                return None  # ahead of us, and where or until when is not planned
            continue
        start = max(job.start, now)
        for n in (n for n in job.sched_nodes if n in busy):
            busy[n].append((start, start + job.time_limit_s, _gpus_of(job.gpus, gres_type)))
    nodes = [n for n in capacity if capacity[n] >= gpus]
    if num_nodes == 1:  # each node on its own: the earliest of the nodes' earliest
        starts = [t for n in nodes
                  if (t := _earliest(busy[n], capacity[n], gpus, time_limit_s, now)) is not None]
        return min(starts, default=None)
    # several nodes at once: a start is when one of them frees (the first MAX_TIMES of those)
    times = sorted({now} | {hi for n in nodes for _, hi, _ in busy[n] if now < hi < math.inf})
    for t in times[:MAX_TIMES]:
        if sum(_fits(busy[n], capacity[n], gpus, t, time_limit_s) for n in nodes) >= num_nodes:
            return t
    return None


def _earliest(busy: list[_Busy], capacity: int, want: int, limit: float,
              now: float) -> float | None:
    """The earliest start on one node: now, or when one of its jobs' plans ends."""
    for t in sorted({now} | {hi for _, hi, _ in busy if now < hi < math.inf}):
        if _fits(busy, capacity, want, t, limit):
            return t
    return None
