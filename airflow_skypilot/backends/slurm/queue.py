"""The queue ahead of a new job, and how jobs really end: pure readings of one probe.

Measured on Slurm 22.05 (the sandbox), which decides what is truthful here:

- ``sbatch --test-only`` does not say whether a job would start *now*: it answered "now" for a
  job over the partition's MaxTime (which then pends for ever, reason PartitionTimeLimit), "in
  12 minutes" for a 1-GPU job that Slurm then started at once (the pending job ahead had
  ``--begin``, which backfill does not hold nodes for), and "in 60 minutes" for a 10-minute job
  that backfill started at once beside a 2-node reservation. It stays the start *estimate*.
- ``squeue -t PENDING`` with ``%S`` (StartTime: backfill's planned start) and ``%Y``
  (SchedNodes: the nodes it plans to use) does say it: idle GPUs on a node that a pending job
  plans to take before a new job would end (its start <= now + the new job's time limit) are
  held for it, and Slurm does not start the new job there (:func:`hold`). A pending job
  without a plan that fits the idle nodes now (just submitted, not yet scheduled: a placement
  made moments ago) takes them at the next scheduling pass: held too. Jobs pending for other
  reasons (BeginTime, Dependency, held, limits) hold nothing.
- How jobs end: finished jobs' elapsed time over their time limit (``sacct``, or ``sacct -c``
  where only jobcomp exists); its median discounts test-only's estimate, which is built from
  time limits (:func:`history_ratio`).

A job's request is read whole: GPUs per node, per job (``--gpus``) or per task, and memory in
all (``tres-alloc``: squeue's ``%m`` alone is per CPU on a ``DefMemPerCPU`` cluster and does
not say so). GPUs per job over several nodes are assumed split evenly (Slurm does not say).

Priorities are not compared: every pending job counts as ahead of a new one (FIFO, Slurm's
default ``priority/basic``). A pending job's share of a node it plans to use is held from the
node's idle resources now, even where part of it will come from a running job that ends before
it starts: conservative (a job may be told "held" where it would fit).
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace

from airflow_skypilot.backends.slurm.shell import parse_int

#: pending reasons of jobs that wait only for resources or priority: they hold what they plan
RUNNABLE_REASONS = frozenset({"Resources", "Priority", "None", "", "(null)"})
#: finished states that are not how a job's own run ends (the place failed under it)
_NOT_AN_END = ("NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "REQUEUE", "RUNNING", "PENDING",
               "REVOKED", "RESIZING", "SUSPENDED")
#: a discount needs this many finished jobs; it stays within these bounds
HISTORY_MIN_JOBS = 20
HISTORY_FLOOR = 0.1
HISTORY_CEILING = 1.0

#: one GPU item of a TRES/GRES list: ``gres:gpu:a100:4``, ``gres/gpu:h100=2``, ``gpu:4``,
#: ``gres:gpu:2080ti:2`` (a type may start with a digit: 2080ti, 1g.5gb)...
_TRES_GPU = re.compile(r"^(?:gres[:/])?gpu(?::(?P<type>[^:=,]+))?[:=](?P<count>\d+)$")
#: ... and without a count (``--gres=gpu``, ``--gres=gpu:a100``: one; a bare number is a count)
_TRES_GPU_ONE = re.compile(r"^(?:gres[:/])?gpu(?::(?P<type>[^:=,]+))?$")


def duration_s(text: str | None) -> float | None:
    """A Slurm time (``30``, ``1:00:00``, ``2-12``, ``1-00:00:00``, ``UNLIMITED``) in seconds;
    ``math.inf`` for unlimited; None when not given or unreadable (``n/a``, ``NONE``)."""
    text = (text or "").strip().lower()
    if not text or text in ("n/a", "none", "(null)", "partition_limit"):
        return None
    if text in ("unlimited", "infinite"):
        return math.inf
    days = 0
    if "-" in text:
        d, _, text = text.partition("-")
        if not d.isdigit():
            return None
        days = int(d)
        parts = text.split(":") if text else ["0"]
        # days-hours[:minutes[:seconds]]
        try:
            nums = [int(p) for p in parts]
        except ValueError:
            return None
        nums += [0] * (3 - len(nums))
        hours, minutes, seconds = nums[:3]
    else:
        try:
            nums = [int(p) for p in text.split(":")]
        except ValueError:
            return None
        if len(nums) == 1:  # minutes
            hours, minutes, seconds = 0, nums[0], 0
        elif len(nums) == 2:  # minutes:seconds
            hours, minutes, seconds = 0, nums[0], nums[1]
        elif len(nums) == 3:
            hours, minutes, seconds = nums
        else:
            return None
    return float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)


def duration_text(seconds: float) -> str:
    """Seconds as ``2h00m`` / ``10m`` / ``unlimited``."""
    if math.isinf(seconds):
        return "unlimited"
    minutes = int(round(seconds / 60))
    if minutes < 60:
        return f"{minutes}m"
    return f"{minutes // 60}h{minutes % 60:02d}m"


def expand_hostlist(text: str) -> list[str]:
    """A Slurm host list (``a[1-3,5],b01``, ``r[1-2]-n[01-02]``) as node names."""
    text = (text or "").strip()
    if not text or text in ("(null)", "N/A", "None"):
        return []
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [name for item in items if item for name in _expand_one(item)]


def _expand_one(item: str) -> list[str]:
    match = re.search(r"\[([^\]]+)\]", item)
    if not match:
        return [item]
    pre, post = item[:match.start()], item[match.end():]
    out: list[str] = []
    for part in match.group(1).split(","):
        lo, _, hi = part.partition("-")
        if not hi:
            values = [lo]
        elif lo.isdigit() and hi.isdigit():
            values = [f"{n:0{len(lo)}d}" for n in range(int(lo), int(hi) + 1)]
        else:
            continue
        for value in values:
            out += _expand_one(pre + value + post)
    return out


def tres_gpus(text: str) -> dict[str, int]:
    """GPUs from squeue's ``tres-per-*`` (``gres:gpu:a100:4``; newer Slurm ``gres/gpu:a100=4``;
    untyped ``gres:gpu:4`` as type ""; ``gres:gpu`` with no count, as ``--gres=gpu`` shows:
    one). Other GRES (``gpumem``...) are not GPUs."""
    out: dict[str, int] = {}
    for item in re.split(r"[,;]", text or ""):
        match = _TRES_GPU.match(item.strip()) or _TRES_GPU_ONE.match(item.strip())
        if match:
            gtype = match.group("type") or ""
            out[gtype] = out.get(gtype, 0) + int(match.groupdict().get("count") or 1)
    return out


def whole_gpus(per_job: str, per_task: str, tasks: str) -> dict[str, int]:
    """The GPUs a job asks per job (``--gpus``) and per task (``--gpus-per-task`` x its
    tasks), in all."""
    whole = tres_gpus(per_job)
    count = parse_int(tasks, 1)
    for gtype, n in tres_gpus(per_task).items():
        whole[gtype] = whole.get(gtype, 0) + n * max(1, count)
    return whole


def job_gpus(per_node: dict[str, int], whole: dict[str, int], nodes: int
             ) -> tuple[dict[str, int], bool]:
    """A job's GPUs per node: those it asks per node (``tres-per-node``) and ``whole`` (per job
    or task, in all) split over ``nodes``, and whether that is a guess: over several nodes
    Slurm splits them as it likes; an even split is assumed then (rounded up)."""
    gpus = dict(per_node)
    for gtype, n in whole.items():
        gpus[gtype] = gpus.get(gtype, 0) + math.ceil(n / max(1, nodes))
    return gpus, bool(whole) and nodes > 1


def node_memory_mb(alloc: str, min_memory: str, nodes: int) -> int:
    """A job's memory per node, in MB: the memory of squeue's ``tres-alloc`` (``cpu=3,
    mem=4500M,node=1``: what a running job was given, what a pending one asks, in all nodes)
    over its ``nodes``; where that is not there, ``MinMemory`` (``%m``), which is per CPU for a
    ``--mem-per-cpu`` job (and for every job on a cluster with ``DefMemPerCPU``) and does not
    say so."""
    match = re.search(r"(?:^|,)mem=([^,]+)", alloc or "")
    total = memory_mb(match.group(1)) if match else 0
    return math.ceil(total / max(1, nodes)) if total else memory_mb(min_memory)


def memory_mb(text: str) -> int:
    """squeue's ``%m`` (``1000M``, ``4G``, ``0``) in MB; 0 when unreadable."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]?)[Bc]?", (text or "").strip())
    if not match:
        return 0
    scale = {"K": 1 / 1024, "": 1, "M": 1, "G": 1024, "T": 1024 * 1024}[match.group(2)]
    return int(float(match.group(1)) * scale)


@dataclass
class PendingJob:
    """One pending job, as ``squeue -t PENDING`` shows it."""

    job_id: str
    partitions: list[str]
    nodes: int
    reason: str
    gpus: dict[str, int]  # per node, by GRES type ("" untyped)
    cpus: int  # in all
    mem_mb: int  # per node
    start: float | None  # backfill's planned start (epoch)
    sched_nodes: list[str]
    user: str = ""
    priority: int = 0
    time_limit_s: float | None = None
    #: its GPUs per node are a guess (asked per job or per task, over several nodes)
    gpus_guessed: bool = False
    #: the GPUs it asks per job or per task, in all (``--gpus``...; {}: per node only)...
    gpus_whole: dict[str, int] = field(default_factory=dict)
    #: ...and per node (``tres-per-node``): ``gpus`` is both, the first split over its nodes
    gpus_node: dict[str, int] = field(default_factory=dict)
    #: the other tasks of a job array the line stands for (squeue shows a pending array as
    #: one line, with the plan of its first task): each takes what fits it at the next pass
    array_more: int = 0

    @property
    def runnable(self) -> bool:
        return self.reason in RUNNABLE_REASONS

    @property
    def cpus_per_node(self) -> int:
        return max(1, math.ceil(self.cpus / max(1, self.nodes)))


#: the probe's pending jobs: ``squeue -t PENDING -O`` with these fields, each ending in ``|``
#: (the first twelve are ``-o '%i|%P|%D|%r|%b|%C|%m|%S|%Y|%u|%Q|%l'``, which older probes printed)
PENDING_FIELDS = ("JobID", "Partition", "NumNodes", "Reason", "tres-per-node", "NumCPUs",
                  "MinMemory", "StartTime", "SchedNodes", "UserName", "PriorityLong",
                  "TimeLimit", "tres-per-job", "tres-per-task", "NumTasks", "tres-alloc",
                  "ArrayTaskID")


def parse_pending(line: str) -> PendingJob | None:
    """One line of :data:`PENDING_FIELDS` (shorter, older lines: what they say). Memory per
    node is ``tres-alloc``'s over the nodes where it is there, else ``MinMemory``."""
    parts = [p.strip() for p in line.split("|")]
    if len(parts) < 2 or not parts[0]:
        return None
    parts += [""] * (len(PENDING_FIELDS) - len(parts))
    (job_id, parts_text, nodes_text, reason, tres, cpus, mem, start, sched, user, prio, limit,
     per_job, per_task, tasks, alloc, array) = parts[:len(PENDING_FIELDS)]
    try:
        when: float | None = float(start) if start.isdigit() and int(start) > 0 else None
    except ValueError:
        when = None
    nodes = max(1, parse_int(nodes_text, 1))
    sched_nodes = expand_hostlist(sched)
    per_node, whole = tres_gpus(tres), whole_gpus(per_job, per_task, tasks)
    # NumNodes is the least it may take: a --gpus job planned on more nodes splits over them
    gpus, guessed = job_gpus(per_node, whole, max(nodes, len(sched_nodes)))
    return PendingJob(
        job_id=job_id, partitions=[p for p in parts_text.split(",") if p],
        nodes=nodes, reason=reason, gpus=gpus, cpus=parse_int(cpus, 1),
        mem_mb=node_memory_mb(alloc, mem, nodes), start=when,
        sched_nodes=sched_nodes, user=user, priority=parse_int(prio, 0),
        time_limit_s=duration_s(limit), gpus_guessed=guessed, gpus_whole=whole,
        gpus_node=per_node, array_more=max(0, array_tasks(array) - 1))


def array_tasks(text: str) -> int:
    """How many tasks of a job array one squeue line stands for (``ArrayTaskID``: ``0-9``,
    ``1,3,5-11:2``, ``0-99%4``: at most 4 at once); 1 for a job that is not an array."""
    text = (text or "").strip()
    spec, _, throttle = text.partition("%")
    count = 0
    for part in spec.split(","):
        rng, _, step = part.partition(":")
        lo, _, hi = rng.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()) or (step and not step.isdigit()):
            continue
        count += (int(hi) - int(lo)) // max(1, int(step or 1)) + 1 if hi else 1
    if throttle.isdigit() and int(throttle) > 0:
        count = min(count, int(throttle))
    return max(1, count)


@dataclass(frozen=True)
class Reservation:
    """One advanced reservation (maintenance, a group's block), as ``scontrol show res -o``
    lists it. A job that does not ask for it (``--reservation``) cannot run on its nodes from
    its start to its end: Slurm neither starts a job there that would still run at the start,
    nor plans one inside it. Its nodes are counted whole, whatever its flags (one of some cores
    only, a MAGNETIC one the login user may use): conservative. A repeating one (DAILY,
    WEEKLY...) lists only its next window: it is taken as never ending."""

    name: str
    active: bool
    start: float  # epoch
    end: float  # epoch; math.inf: no end, or it repeats
    nodes: tuple[str, ...]


_REPEATS = ("HOURLY", "DAILY", "WEEKDAY", "WEEKEND", "WEEKLY")


def parse_reservation(line: str) -> Reservation | None:
    """One line of ``SLURM_TIME_FORMAT=%s scontrol show res -o`` (``Key=value`` words; "No
    reservations in the system" when there are none)."""
    fields = dict(w.split("=", 1) for w in line.split() if "=" in w)
    name, start = fields.get("ReservationName", ""), fields.get("StartTime", "")
    if not name:
        return None
    end = fields.get("EndTime", "")
    flags = set(fields.get("Flags", "").upper().split(","))
    if not start.isdigit():  # a time it does not give as epoch: held from now on, for ever
        start, end = "0", ""
    return Reservation(name, fields.get("State", "").upper() == "ACTIVE", float(start),
                       float(end) if end.isdigit() and not flags & set(_REPEATS) else math.inf,
                       tuple(expand_hostlist(fields.get("Nodes", ""))))


@dataclass
class Room:
    """What one node has idle now: GPUs by GRES type, CPUs, memory (MB)."""

    gpus: dict[str, int]
    cpus: int
    mem_mb: int


@dataclass
class Held:
    """What pending jobs ahead take of a partition's idle resources before a new job."""

    room: dict[str, Room]  # node -> what is left for a new job
    gpus: int = 0  # idle GPUs of the asked type held (on the partition's nodes)
    jobs: list[str] = field(default_factory=list)  # the pending jobs that hold them
    ours: list[str] = field(default_factory=list)  # ...of them, the connection user's
    #: reservations that hold nodes of the partition (the job would still run at their start)
    reservations: list[str] = field(default_factory=list)
    reserved_gpus: int = 0  # idle GPUs of the asked type on those nodes


def _gpu_take(room: Room, want: dict[str, int]) -> dict[str, int]:
    """What ``want`` (GPUs per type, "" any type) takes of ``room`` (capped at what is idle)."""
    taken: dict[str, int] = {}
    for gtype, count in want.items():
        types = [gtype] if gtype else sorted(room.gpus)
        for t in types:
            if count <= 0:
                break
            got = min(count, room.gpus.get(t, 0))
            if got:
                taken[t] = taken.get(t, 0) + got
                count -= got
    return taken


def _fits(room: Room, job: PendingJob) -> bool:
    for gtype, count in job.gpus.items():
        have = room.gpus.get(gtype, 0) if gtype else sum(room.gpus.values())
        if have < count:
            return False
    return room.cpus >= job.cpus_per_node and room.mem_mb >= job.mem_mb


def _hold_whole(rooms: dict[str, Room], node: str, gres_type: str) -> int:
    """Take all of ``node``'s idle room; the idle GPUs of ``gres_type`` it had."""
    gpus = rooms[node].gpus.get(gres_type, 0)
    rooms[node] = Room({t: 0 for t in rooms[node].gpus}, 0, 0)
    return gpus


#: more nodes than it asks, at most, that a job asking GPUs per job is tried on (Slurm takes
#: as few as hold them)
SPREAD_MAX = 8


def _place_now(rooms: dict[str, Room], where: Iterable[str], job: PendingJob
               ) -> tuple[list[str], PendingJob]:
    """Where a pending job without a plan starts now, if anywhere: the fewest nodes that fit
    it (best fit by GPUs), and the job as it takes them (GPUs asked per job split over them);
    ([], job) when none."""
    order = sorted(where, key=lambda n: (sum(rooms[n].gpus.values()), rooms[n].cpus, n))
    top = job.nodes + (SPREAD_MAX if job.gpus_whole else 0)
    for count in range(job.nodes, min(top, max(job.nodes, len(order))) + 1):
        share = replace(job, nodes=count, gpus=job_gpus(job.gpus_node, job.gpus_whole,
                                                         count)[0]) if job.gpus_whole else job
        fit = [n for n in order if _fits(rooms[n], share)]
        if len(fit) >= count:
            return fit[:count], share
    return [], job


def hold(rooms: dict[str, Room], partition_nodes: Iterable[str],
         pending: Sequence[PendingJob], node_partitions: dict[str, list[str]], *, now: float,
         time_limit_s: float | None, gres_type: str, user: str = "",
         planned: Iterable[str] = (), reservations: Iterable[Reservation] = ()) -> Held:
    """Take from ``rooms`` (every usable node's idle resources) what the pending jobs ahead
    will take before a new job of ``time_limit_s`` (None or inf: unlimited) would end, in
    priority order. ``partition_nodes``: the partition the new job asks for (held GPUs are
    counted there); ``gres_type``: the GPU type it asks for. ``planned`` nodes (Slurm's
    PLANNED state) that no pending job names as its planned nodes are held whole: backfill
    plans a job there that squeue did not show (another Slurm's ``%Y``), when, unknown.
    The nodes of ``reservations`` that start before the new job would end are held whole."""
    rooms = {n: Room(dict(r.gpus), r.cpus, r.mem_mb) for n, r in rooms.items()}
    mine = set(partition_nodes)
    limit = math.inf if time_limit_s is None else time_limit_s
    out = Held(room=rooms)
    for resv in reservations:
        if resv.start > now + limit or resv.end <= now:
            continue  # the new job would have ended by then; it is over
        held_here = [n for n in resv.nodes if n in rooms]
        for n in held_here:
            gpus = _hold_whole(rooms, n, gres_type)
            if n in mine:
                out.reserved_gpus += gpus
        if set(held_here) & mine:
            out.reservations.append(resv.name)
    named = {n for j in pending for n in j.sched_nodes}
    for n in sorted(set(planned) - named):
        if n in rooms:
            gpus = _hold_whole(rooms, n, gres_type)
            if n in mine:
                out.gpus += gpus
                out.jobs.append(f"(planned on {n})")
    # nodes with a CPU left, per partition: where a job without a plan may still start now
    # (on a busy cluster, few: thousands of pending jobs do not each scan every node)
    open_in: dict[str, list[str]] = {}
    for n, parts in node_partitions.items():
        if n in rooms and rooms[n].cpus > 0:
            for part in parts:
                open_in.setdefault(part, []).append(n)
    unfit: set[tuple] = set()
    for job in _tasks(sorted(pending, key=lambda j: (-j.priority,
                                                     parse_int(j.job_id.split("_")[0], 0)))):
        if not job.runnable:
            continue
        if job.start is not None and job.start > now + limit:
            continue  # it starts after the new job would have ended: backfill fits them both
        if job.sched_nodes:
            chosen = [n for n in job.sched_nodes if n in rooms]
        elif job.start is not None and job.start > now + 5:
            continue  # planned for later, on nodes Slurm does not name: cannot say which
        else:  # no plan yet: it takes what fits it now, if anything (best fit by GPUs)
            shape = (tuple(job.partitions), tuple(sorted(job.gpus.items())),
                     job.cpus_per_node, job.mem_mb, job.nodes)
            if shape in unfit:
                continue  # rooms only shrink: what did not fit an earlier job does not now
            where = {n for part in job.partitions for n in open_in.get(part, ())}
            chosen, job = _place_now(rooms, where, job)
            if not chosen:
                unfit.add(shape)
                continue
        held_here = 0
        for n in chosen:
            room = rooms[n]
            taken = _gpu_take(room, job.gpus)
            for t, got in taken.items():
                room.gpus[t] -= got
                if n in mine and t == gres_type:
                    held_here += got
            room.cpus = max(0, room.cpus - job.cpus_per_node)
            room.mem_mb = max(0, room.mem_mb - job.mem_mb)
        if chosen and set(chosen) & mine:
            if job.job_id not in out.jobs:  # an array's tasks: once
                out.jobs.append(job.job_id)
                if user and job.user == user:
                    out.ours.append(job.job_id)
            out.gpus += held_here
    return out


#: an array's other tasks that take room in the model, at most (a cluster with room for more
#: of them runs them at once; bounded so a probe stays quick)
ARRAY_TASKS_MAX = 256


def _tasks(pending: Iterable[PendingJob]) -> Iterator[PendingJob]:
    """The pending jobs in order, each array's other tasks after it, without a plan."""
    for job in pending:
        yield job
        if job.array_more and job.runnable:
            rest = replace(job, start=None, sched_nodes=[], array_more=0)
            for _ in range(min(job.array_more, ARRAY_TASKS_MAX)):
                yield rest


@dataclass(frozen=True)
class Discount:
    """How jobs really end on a cluster: the median elapsed/limit of recent finished jobs."""

    ratio: float | None  # None: not enough history
    jobs: int
    median: float | None = None  # before the floor/ceiling

    def describe(self) -> str:
        if self.ratio is None:
            return (f"not discounted: {self.jobs} finished job(s) with a time limit on record, "
                    f"{HISTORY_MIN_JOBS} needed")
        return (f"x{self.ratio:.2f}: recent jobs end at a median {self.median:.0%} of their "
                f"time limit ({self.jobs} jobs)")


def history_ratio(lines: Iterable[str], *, min_jobs: int = HISTORY_MIN_JOBS,
                  floor: float = HISTORY_FLOOR, ceiling: float = HISTORY_CEILING) -> Discount:
    """``elapsed seconds|limit seconds|state`` lines -> the median ratio, floored and capped;
    None when fewer than ``min_jobs`` jobs ended on their own (not NODE_FAIL, PREEMPTED...)."""
    ratios = []
    for line in lines:
        first, _, rest = line.partition("|")
        second, _, state = rest.partition("|")
        try:
            elapsed, limit = float(first), float(second)
        except ValueError:
            continue
        if elapsed <= 0 or limit <= 0 or state.lstrip().upper().startswith(_NOT_AN_END):
            continue
        ratios.append(min(1.0, elapsed / limit))
    if len(ratios) < min_jobs:
        return Discount(None, len(ratios))
    median = statistics.median(ratios)
    return Discount(min(ceiling, max(floor, median)), len(ratios), median)
