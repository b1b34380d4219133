"""When Slurm's backfill could start a new job: the hole in its plan, read from one probe.

``sbatch --test-only`` on Slurm 22.05 answers as if the job were last in a FIFO queue (see
:mod:`.queue`): "in 60 minutes" for a 10-minute job that backfill then starts at once beside a
reservation. Backfill itself plans by time limits: a running job holds its GPUs, CPUs and
memory until its planned end (``squeue %e``: start + time limit), a pending job ahead holds
those of the nodes it is planned on (``%Y``) from its planned start (``%S``) for its time
limit; a new job starts at the earliest time its own time limit fits on enough nodes beside all
of that, without delaying anyone's plan. :func:`backfill_start` finds that time; the offer
takes it when it is sooner than test-only's, and discounts it alike (both are built from time
limits).

Where the plan cannot be read whole, the answer is None (test-only stays the estimate): a
runnable pending job without a planned start or planned nodes (just submitted, or beyond
backfill's look-ahead), or that asks its GPUs per job or per task over several nodes (how
Slurm will split them is not said), or a job array's tasks after its first (squeue shows the
first one's plan only), in a partition that shares a node with ours; GPUs, CPUs
or memory in use that the running jobs listed do not account for (a job on several nodes with
GPUs per job); a job without a time limit. A job's GPUs asked per job (``--gpus``) or per task
on one node are its node's; its memory is ``tres-alloc``'s (``--mem-per-cpu`` and
``DefMemPerCPU`` jobs included). Reservations (``scontrol show res``) take their nodes whole
through their window.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from airflow_skypilot.backends.slurm.queue import (
    PendingJob,
    Reservation,
    expand_hostlist,
    job_gpus,
    node_memory_mb,
    tres_gpus,
    whole_gpus,
)

#: the starts a multi-node job is tried at, at most (beyond: no estimate; test-only's)
MAX_TIMES = 100


@dataclass(frozen=True)
class Need:
    """One node's share of a job: GPUs of the type asked for, CPUs, memory (MB)."""

    gpus: int
    cpus: int
    mem_mb: int

    def __add__(self, other: Need) -> Need:
        return Need(self.gpus + other.gpus, self.cpus + other.cpus, self.mem_mb + other.mem_mb)

    def within(self, capacity: Need) -> bool:
        return (self.gpus <= capacity.gpus and self.cpus <= capacity.cpus
                and self.mem_mb <= capacity.mem_mb)


NOTHING = Need(0, 0, 0)


#: the probe's running jobs: ``squeue -t RUNNING,COMPLETING -O`` with these fields, each
#: ending in ``|`` (the first six are ``-o '%i|%N|%b|%e|%C|%m'``, which older probes printed)
RUNNING_FIELDS = ("JobID", "NodeList", "tres-per-node", "EndTime", "NumCPUs", "MinMemory",
                  "tres-per-job", "tres-per-task", "NumTasks", "tres-alloc")


@dataclass(frozen=True)
class RunningJob:
    """One running job, as the probe lists it (:data:`RUNNING_FIELDS`)."""

    job_id: str
    nodes: tuple[str, ...]
    gpus: dict[str, int]  # per node, by GRES type ("" untyped)
    end: float  # planned end (start + time limit), epoch; math.inf: none
    cpus: int = 0  # in all
    mem_mb: int = 0  # per node

    @property
    def cpus_per_node(self) -> int:
        return math.ceil(self.cpus / max(1, len(self.nodes)))


def parse_running(line: str) -> RunningJob | None:
    """One line of :data:`RUNNING_FIELDS` (``EndTime`` with ``SLURM_TIME_FORMAT=%s``; older,
    shorter lines: what they say). GPUs a job on several nodes asked per job or per task are
    not placed on any node (Slurm split them, squeue does not say how): the plan then finds GPUs
    in use that no job accounts for, and gives up. Memory per node: ``tres-alloc``'s over the
    nodes where it is there (``MinMemory`` is per CPU for a ``--mem-per-cpu`` job)."""
    parts = [p.strip() for p in line.split("|")]
    if len(parts) < 4 or not parts[0]:
        return None
    parts += [""] * (len(RUNNING_FIELDS) - len(parts))
    job_id, nodes_text, tres, end, cpus, mem, per_job, per_task, tasks, alloc = \
        parts[:len(RUNNING_FIELDS)]
    when = float(end) if end.isdigit() and int(end) > 0 else math.inf
    nodes = tuple(expand_hostlist(nodes_text))
    per_node = tres_gpus(tres)
    gpus, guessed = job_gpus(per_node, whole_gpus(per_job, per_task, tasks), len(nodes) or 1)
    return RunningJob(job_id, nodes, per_node if guessed else gpus, when,
                      int(cpus) if cpus.isdigit() else 0,
                      node_memory_mb(alloc, mem, len(nodes)))


#: (from, until, what) on one node
_Busy = tuple[float, float, Need]


def _gpus_of(gpus: dict[str, int], gres_type: str) -> int:
    """A job's GPUs of ``gres_type`` per node: the typed ones, and untyped ones (any type)."""
    return gpus.get(gres_type, 0) + gpus.get("", 0) if gres_type else sum(gpus.values())


def _fits(busy: list[_Busy], capacity: Need, want: Need, t: float, limit: float) -> bool:
    """``want`` free on the node through [t, t + limit)."""
    end = t + limit
    for p in [t] + [lo for lo, _, _ in busy if t < lo < end]:
        used = want
        for lo, hi, what in busy:
            if lo <= p < hi:
                used = used + what
        if not used.within(capacity):
            return False
    return True


def _earliest(busy: list[_Busy], capacity: Need, want: Need, limit: float,
              now: float) -> float | None:
    """The earliest start on one node: now, or when one of its jobs' plans ends."""
    for t in sorted({now} | {hi for _, hi, _ in busy if now < hi < math.inf}):
        if _fits(busy, capacity, want, t, limit):
            return t
    return None


def backfill_start(capacity: Mapping[str, Need], used: Mapping[str, Need],
                   running: Sequence[RunningJob], pending: Iterable[PendingJob], *,
                   partitions: set[str], now: float, gres_type: str, want: Need,
                   num_nodes: int, time_limit_s: float | None,
                   reservations: Iterable[Reservation] = ()) -> float | None:
    """The earliest time (epoch, >= ``now``) at which ``num_nodes`` of the ``capacity`` nodes
    (the usable nodes of the partition -> what they have; ``used``: what is in use now;
    ``partitions``: every partition those nodes are in) each have ``want`` free for
    ``time_limit_s`` beside the running jobs' and the pending jobs' plans and outside the
    ``reservations``; None when the plan cannot be read whole (module docstring) or nothing
    fits."""
    if time_limit_s is None or math.isinf(time_limit_s):
        return None
    busy: dict[str, list[_Busy]] = {n: [] for n in capacity}
    for job in running:
        share = Need(_gpus_of(job.gpus, gres_type), job.cpus_per_node, job.mem_mb)
        for n in job.nodes:
            if n in busy:  # one past its end (completing) still holds them a moment
                busy[n].append((now, max(job.end, now + 1), share))
    for n, in_use in used.items():
        accounted = sum((what for *_, what in busy.get(n, ())), NOTHING)
        if n in busy and not in_use.within(accounted):
            return None  # in use, and no running job listed says by whom until when
    for resv in reservations:  # the whole node, from its start to its end
        for n in (n for n in resv.nodes if n in busy):
            busy[n].append((max(resv.start, now), resv.end, capacity[n]))
    for job in pending:
        if not job.runnable:
            continue
        if (job.start is None or not job.sched_nodes or job.time_limit_s is None
                or job.gpus_guessed or job.array_more):
            if set(job.partitions) & partitions:
                return None  # ahead of us on our nodes, and where, how much or until when
                # not planned (GPUs per job over several nodes: how Slurm splits them; an
                # array's other tasks, whose plans squeue does not show)
            continue
        start = max(job.start, now)
        share = Need(_gpus_of(job.gpus, gres_type), job.cpus_per_node, job.mem_mb)
        for n in (n for n in job.sched_nodes if n in busy):
            busy[n].append((start, start + job.time_limit_s, share))
    earliest = {n: t for n in capacity
                if (t := _earliest(busy[n], capacity[n], want, time_limit_s, now)) is not None}
    if num_nodes == 1:
        return min(earliest.values(), default=None)
    # several nodes at once: a start where one of them can first start (conservative: a later
    # common start is missed, never an earlier one invented), nodes whose own earliest is later
    # left out, each count stopped as soon as it is enough
    for t in sorted(set(earliest.values()))[:MAX_TIMES]:
        fitting = 0
        for n, first in earliest.items():
            if first <= t and _fits(busy[n], capacity[n], want, t, time_limit_s):
                fitting += 1
                if fitting >= num_nodes:
                    return t
    return None
