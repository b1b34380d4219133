"""Scheduling benchmark: a burst of GPU jobs over loaded clusters, placed by each strategy.

``python benchmarks/scheduling.py [--quick] [--seeds 0,1,2] [--wide N] [--json FILE]``

A discrete-event simulator of two Slurm clusters (priority order with backfill planned over time
limits, every pending job reserving its slot; real jobs end before their limits), a Kubernetes
cluster (greedy scheduler, no reservations) and an AWS region (instances billed per second, one
vCPU quota), each loaded by other users' jobs.
A burst of jobs arrives over 30 minutes (some as sweeps: mapped tasks that place at the same
moment) and every strategy places the same trace on the same background, side by side.

What is real and what is simulated:

- The simulator produces the *inputs* of the real probe code, not offers of its own: the
  ``sinfo``/``squeue``/``sbatch --test-only`` output a Slurm login node would print (parsed by
  ``slurm.cluster.parse_cluster``, turned into offers by ``slurm.offers.offers``), the node and pod
  JSON a Kubernetes API returns (``kubernetes.cluster.cluster_view`` then
  ``kubernetes.offers.offer``), and an AWS region's instance types, quota and use
  (``aws.catalog.suitable_types`` then ``aws.offers.offers_for``, as ``probe_region`` does).
- Placement is the project's own: ``placement.rank`` at every placement (with the run's
  ``Blocked`` places after a refused launch), and while a job waits, every ``reprobe_interval``,
  ``rebalance._current`` (the job's place as re-probed, with its own estimate when the backend
  gives one) and ``placement.reconsider``; a move then costs what ``Placer.move`` does (the
  operator resumes, checks the copy still waits, cancels it, confirms, submits at the new place).
  Probes while waiting are shared per (connection, shape) for half an interval, as
  ``rebalance._probe`` shares them.
- What the backends do (Step 8: idle GPUs held for the jobs ahead, test-only discounted by
  how jobs end, a pending job's own start, pod-age estimates, exactly the GPUs asked for on
  AWS) is the real code reading what the simulator prints; a knob (:class:`Knobs`) can
  withhold the input that behaviour reads (the old probe's output: Step 7's backends) or set
  the connection's setting (the AWS extra ``larger_instances``), and the knobs for what no
  backend does (a backfill-aware test-only, a Kubernetes job's own slot) are applied where
  that code would apply them.
- The placement ledger is the real one: each placement and each move's re-probe of its target
  takes from its offers what ``ledger.hold`` says the entries hold (entries as ``Placer``
  writes them, stamped when submitted, lapsing after ``ledger.TTL``).

SkyPilot's rule is modelled as DESIGN.md describes it: try the places that fit by shape, cheapest
first (SkyPilot's optimizer; on-prem is free), submit, and fail over after a pending timeout
(10 s Kubernetes, 2 min Slurm); AWS launches when the quota has room (exact GPU counts, as
SkyPilot's catalog matches them), else the next place; after the last place, back off as its
managed jobs do, then start again.

``benchmarks/README.md`` has one run's tables and what they say.
"""

from __future__ import annotations

import argparse
import ast
import bisect
import copy
import heapq
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from airflow_skypilot import ledger, placement, rebalance  # noqa: E402
from airflow_skypilot.backends.aws import offers as aws_offers  # noqa: E402
from airflow_skypilot.backends.aws.catalog import (  # noqa: E402
    InstanceTypeInfo,
    on_demand_price,
    suitable_types,
)
from airflow_skypilot.backends.aws.quotas import QUOTA_CODES, QuotaView  # noqa: E402
from airflow_skypilot.backends.aws.settings import AwsSettings  # noqa: E402
from airflow_skypilot.backends.base import JobHandle, JobState, JobStatus, Offer  # noqa: E402
from airflow_skypilot.backends.kubernetes import offers as k8s_offers  # noqa: E402
from airflow_skypilot.backends.kubernetes.cluster import cluster_view  # noqa: E402
from airflow_skypilot.backends.kubernetes.names import LABEL_JOB  # noqa: E402
from airflow_skypilot.backends.kubernetes.settings import KubernetesSettings  # noqa: E402
from airflow_skypilot.backends.slurm import offers as slurm_offers  # noqa: E402
from airflow_skypilot.backends.slurm.cluster import parse_cluster  # noqa: E402
from airflow_skypilot.backends.slurm.queue import history_ratio  # noqa: E402
from airflow_skypilot.backends.slurm.settings import SlurmSettings  # noqa: E402
from airflow_skypilot.runstate import Blocked  # noqa: E402
from airflow_skypilot.spec import load_task  # noqa: E402
from airflow_skypilot.spec.task import Task  # noqa: E402

#: simulated time 0 (the burst's first moment) as epoch seconds, for offers and estimates
EPOCH = 1_800_000_000.0
H = 3600.0


# --- knobs and scenario ------------------------------------------------------------------------


@dataclass(frozen=True)
class Knobs:
    """What the backends and the operator could do differently; the defaults are the code now.

    Real (the project's code decides; the knob only withholds its input, or sets the
    connection's setting, to compare):

    ``slurm_estimate``: ``backfill`` (the code now): the probe prints the running jobs (nodes,
      GPUs, planned end) beside the pending ones, and ``slurm.backfill.backfill_start`` finds
      the hole backfill's plan leaves for the job's own time limit, taken when sooner than
      test-only's answer; both discounted by the finished jobs' median elapsed/limit
      (``slurm.queue.history_ratio``); ``discounted``: no running jobs listed (test-only,
      discounted: the code before 2026-12-01); ``testonly``: no history either (Step 7).
    ``slurm_free``: ``held`` (the code now): the probe prints each pending job's request,
      planned start and nodes (squeue ``%b %S %Y``) and ``slurm.queue.hold`` keeps idle GPUs
      that the jobs ahead will take before the new job ends from being "free now"; ``idle``:
      the Step 7 probe's pending lines (id, partition, nodes, reason only): idle is free.
    ``own_estimate``: ``queue`` (the code now, Slurm): a waiting job's status carries its
      squeue StartTime (backfill's slot), discounted as the estimates are; ``none``: no
      ``JobStatus.est_start`` (Step 7). What-if: ``queue+k8s``: a Kubernetes job's own slot
      too (no backend gives it).
    ``k8s_estimate``: ``pod-ages`` (the code now): the pod JSON carries start times and our
      finished pods, and ``kubernetes.queue.estimate`` plays the scheduler forward (median run
      of ours that ran as long; deadlines); ``none``: our finished pods not listed (Step 7:
      no estimate when full).
    ``aws_types``: ``exact`` (the code now): the AWS connection's default, exactly the GPU
      count asked for (``aws.offers.offers_for``; SkyPilot's match); ``exact-first``: the
      connection's extra ``larger_instances: true``, a larger type (the fewest GPUs, billed
      whole) where no exact one is offered (Step 7's behaviour here, for no A100 type has fewer
      than 8).
    ``herd_avoid``: ``True`` (the code now): the placement ledger (``ledger.hold`` on every
      placement's offers and on a move's re-probe of its target); ``False``: no ledger (the
      backends count only what they show: a sweep's members that place at the same moment
      see none of each other).

    ``max_moves``: bound on moves per job for the ``+moves`` strategies (placement.MAX_MOVES).

    Diagnostic (no backend can do it): ``oracle``: every on-prem start estimate the placement
    code reads (a Slurm or Kubernetes offer's start and free-now, a waiting job's own start)
    is the start the simulator would give the job if submitted now, the place played forward
    with the jobs present (real run times, the scheduler's own order; later arrivals unknown).
    What-if: ``aws_keep_large``: an AWS offer of an instance with fewer GPUs than the largest
    type is not free now (start unknown) when its launch would leave room in the vCPU quota
    for fewer instances of the largest GPU count (the fewest vCPUs among them) than now: a
    small job does not break up the quota an 8-GPU job needs (no backend does it).
    What-if: ``paid_priority``: a look that would move a waiting job to a paid place free now
    lets another waiting job have that room first when the room cannot take both and the
    other saves more wait per second of the room (its estimated wait left over its time limit,
    from its last look: what waiting jobs' looks would publish in the ledger; no backend or
    ledger does it). ``paid_priority_place``: a new placement too (its wait saved: the best
    unpaid place's estimated wait).
    What-if: ``event_looks``: ``""`` (off); ``aws``: when one of the deployment's own AWS
    instances ends (its quota room freed, known to the deployment), every waiting job of ours
    looks again ``EVENT_LOOK_S`` after (the trigger watching the ledger for a release the
    operator writes, then its usual look), that connection probed afresh, not only every
    ``reprobe_interval``; ``all``: also when one of ours ends on-prem or a move cancels its
    waiting copy (no trigger does it).
    What-if: ``joint_looks``: ``""`` (off), else the looks due at one moment form a round:
    each reads the ledger (``ledger.hold``, as a placement does; the trigger's look does not
    now) and a look that decides a move notes its target there at once (a refused or dropped
    move drops the note), so the later looks of the round see the room taken and pick the
    next-best place; the round's order: ``wait`` (the longest estimated wait left where it
    waits first; unknown: first), ``rate`` (that wait per GPU-second of its time limit),
    ``gpus`` (the largest job first, then ``wait``), ``ledger`` (the order they are due: the
    ledger only). No trigger or ledger does it. With ``event_looks``, every waiting job
    looks in the release's round: the room freed goes by the round's order.
    ``paid_min_wait``: the operator's ``paid_move_min_wait`` (``placement.reconsider``'s
    ``paid_min_wait``; default ``placement.PAID_MOVE_MIN_WAIT_S``, built since 2026-12-03;
    0: off, the code before): a look does not move a job to a costlier place while the
    estimated wait where it waits is under this many seconds.
    """

    slurm_estimate: str = "backfill"
    slurm_free: str = "held"
    own_estimate: str = "queue"
    k8s_estimate: str = "pod-ages"
    aws_types: str = "exact"
    herd_avoid: bool = True
    max_moves: int = placement.MAX_MOVES
    oracle: bool = False
    aws_keep_large: bool = False
    paid_priority: bool = False
    paid_priority_place: bool = False
    event_looks: str = ""
    joint_looks: str = ""
    paid_min_wait: float = placement.PAID_MOVE_MIN_WAIT_S

    def label(self) -> str:
        base = Knobs()
        diff = [f"{k}={v}" for k, v in asdict(self).items() if getattr(base, k) != v]
        return ", ".join(diff) or "the code now"


#: ``Knobs.event_looks``: seconds from one of our jobs' release to the waiting jobs' looks
EVENT_LOOK_S = 5.0

#: the backends of Step 7 (before this step's changes): the inputs they read
STEP7 = Knobs(slurm_estimate="testonly", slurm_free="idle", own_estimate="none",
              k8s_estimate="none", aws_types="exact-first", herd_avoid=False)
#: every improvement at once, the what-ifs too
ALL_KNOBS = Knobs(own_estimate="queue+k8s")


@dataclass(frozen=True)
class Scenario:
    """The burst and the clusters (times in seconds unless named otherwise)."""

    jobs: int = 40
    arrival_window: float = 30 * 60
    #: mapped tasks that arrive (and place) at the same moment: sizes of the sweeps
    sweeps: tuple[int, ...] = (6, 6)
    #: a sweep's members start placing this many seconds apart (separate workers; 0: at once)
    sweep_stagger_s: float = 0.0
    gpu_counts: tuple[int, ...] = (1, 2, 4, 8)
    gpu_weights: tuple[float, ...] = (0.3, 0.3, 0.25, 0.15)
    limit_min: float = 10 * 60
    limit_max: float = 120 * 60
    #: a job runs limit x U(lo, hi)
    run_share: tuple[float, float] = (0.2, 1.0)
    # clusters: (nodes, GPUs per node)
    alpha: tuple[int, int] = (8, 8)  # slurm_alpha: A100
    beta: tuple[int, int] = (4, 8)  # slurm_beta: H100
    k8s: tuple[int, int] = (4, 8)  # k8s: A100
    #: at time 0 (others' jobs): Slurm nodes filled with running jobs until no job of the
    #: background mix fits, and this many jobs pending (submitted in the two hours before)...
    queue_alpha: int = 6
    queue_beta: int = 4
    #: ...the Kubernetes cluster this busy, nothing pending
    k8s_busy: float = 0.9
    #: after time 0: others' jobs keep coming at this offered GPU utilisation
    load_slurm: float = 0.85
    load_k8s: float = 0.75
    #: background jobs' time limits, log-uniform (hours); run limit x run_share
    bg_limit_h: tuple[float, float] = (0.5, 12.0)
    bg_gpu_weights: tuple[float, ...] = (0.35, 0.25, 0.2, 0.2)
    #: Kubernetes background pods' run times, log-uniform (hours)
    bg_k8s_h: tuple[float, float] = (0.25, 8.0)
    #: finished jobs each cluster remembers (``sacct``; pods' run times on Kubernetes)
    history: int = 300
    # AWS: P-class on-demand vCPU quota and the vCPUs others already use
    aws_quota_vcpus: float = 384
    aws_others_vcpus: float = 96
    aws_boot: tuple[float, float] = (90.0, 240.0)  # the real launch-to-running delay
    # the operator's timings
    reprobe_interval: float = 60.0
    probe_s: float = 2.0  # all connections at once
    submit_s: float = 1.0
    resume_s: float = 10.0  # a trigger's event until the operator runs again
    cancel_s: float = 5.0  # cancel + confirm the waiting copy
    block_cooldown: float = 600.0
    # SkyPilot's rule
    sky_timeout_slurm: float = 120.0
    sky_timeout_k8s: float = 10.0
    sky_attempt_s: float = 5.0  # per attempt (its own provisioning steps)
    #: after a round over every place fails, managed jobs back off before the next round
    #: (sky/jobs/recovery_strategy.py: RETRY_INIT_GAP_SECONDS 60, growing 1.6x, at most 5x)
    sky_backoff: tuple[float, float, float] = (60.0, 1.6, 5.0)
    sky_order: tuple[str, ...] = ("k8s", "slurm_alpha", "slurm_beta", "aws")
    # fastest+race: copies on this many on-prem queues at most
    race_width: int = 3
    #: the backends whose queues hold racing copies (a start gate is needed on each)
    race_backends: tuple[str, ...] = ("slurm", "kubernetes")
    #: seconds from a racing copy's start to its gate opening: the trigger's poll sees it
    #: (5 s on average), the operator resumes (10 s), stops the others and opens the gate
    #: (Slurm: a file over SSH, 1 s; Kubernetes: a pod annotation the kubelet's downward-API
    #: refresh shows within its sync period, ~45 s more)
    race_gate_open: tuple[tuple[str, float], ...] = (("slurm", 16.0), ("kubernetes", 60.0))
    #: our earlier runs on the Kubernetes cluster, which its estimate reads: "ours" (the
    #: burst's own job mix) or "others" (drawn as the other users' pods: runs before
    #: 2026-12-01's fifth gave the estimate that distribution, which no deployment has)
    k8s_history: str = "ours"


# --- the trace -----------------------------------------------------------------------------------


@dataclass
class JobSpec:
    """One burst job: what it asks and how long it really runs."""

    id: int
    arrival: float
    gpus: int
    limit: float
    actual: float
    sweep: int | None
    boot: float  # AWS launch-to-running, should it go there


@dataclass
class BgSpec:
    cluster: str
    arrival: float
    gpus: int
    limit: float | None
    actual: float


def make_trace(sc: Scenario, seed: int) -> tuple[list[JobSpec], list[BgSpec]]:
    rnd = random.Random(seed)
    jobs: list[JobSpec] = []
    i = 0

    def spec(arrival: float, sweep: int | None, gpus: int | None = None,
             limit: float | None = None) -> JobSpec:
        nonlocal i
        g = gpus or rnd.choices(sc.gpu_counts, sc.gpu_weights)[0]
        lim = limit or rnd.uniform(sc.limit_min, sc.limit_max)
        job = JobSpec(id=i, arrival=arrival, gpus=g, limit=lim,
                      actual=lim * rnd.uniform(*sc.run_share), sweep=sweep,
                      boot=rnd.uniform(*sc.aws_boot))
        i += 1
        return job

    for s, size in enumerate(sc.sweeps):
        at = rnd.uniform(0, sc.arrival_window)
        g = rnd.choices(sc.gpu_counts, sc.gpu_weights)[0]
        lim = rnd.uniform(sc.limit_min, sc.limit_max)
        jobs += [spec(at + k * sc.sweep_stagger_s, s, g, lim)  # one shape, one limit
                 for k in range(size)]
    singles = sc.jobs - len(jobs)
    jobs += [spec(rnd.uniform(0, sc.arrival_window), None) for _ in range(singles)]
    jobs.sort(key=lambda j: (j.arrival, j.id))
    horizon = 48 * H
    bg: list[BgSpec] = []

    def stream(cluster: str, gpus_total: int, load: float, slurm: bool) -> None:
        lo, hi = sc.bg_limit_h if slurm else sc.bg_k8s_h
        mean_run = (hi - lo) / math.log(hi / lo) * H  # log-uniform mean
        if slurm:
            mean_run *= sum(sc.run_share) / 2
        mean_gpus = sum(c * w for c, w in zip(sc.gpu_counts, sc.bg_gpu_weights, strict=True))
        rate = load * gpus_total / (mean_gpus * mean_run)
        t = 0.0
        while t < horizon:
            t += rnd.expovariate(rate)
            g = rnd.choices(sc.gpu_counts, sc.bg_gpu_weights)[0]
            length = math.exp(rnd.uniform(math.log(lo), math.log(hi))) * H
            if slurm:
                bg.append(BgSpec(cluster, t, g, length, length * rnd.uniform(*sc.run_share)))
            else:
                bg.append(BgSpec(cluster, t, g, None, length))

    stream("slurm_alpha", sc.alpha[0] * sc.alpha[1], sc.load_slurm, True)
    stream("slurm_beta", sc.beta[0] * sc.beta[1], sc.load_slurm, True)
    stream("k8s", sc.k8s[0] * sc.k8s[1], sc.load_k8s, False)
    bg.sort(key=lambda b: b.arrival)
    return jobs, bg


def task_for(job: JobSpec) -> Task:
    """The job's task YAML: any of A100:n or H100:n (as dags/tasks/train.yaml)."""
    name = f"sweep{job.sweep}" if job.sweep is not None else f"job{job.id}"  # mapped: one name
    return load_task({"name": name,
                      "resources": {"accelerators": {"A100": job.gpus, "H100": job.gpus}},
                      "config": {"slurm": {"sbatch_options": {
                          "time": math.ceil(job.limit / 60)}}},
                      "run": "python train.py"})


# --- backend-side jobs and estimates -----------------------------------------------------------


@dataclass(eq=False)
class BJob:
    """A job as a backend sees it (ours or another user's)."""

    seq: int
    gpus: int
    limit: float | None
    actual: float
    submit: float
    owner: Any = None  # the burst Job, or None for background
    start: float | None = None
    node: int | None = None
    state: str = "pending"  # pending | running | done | cancelled
    est_wait: float | None = None  # the wait its offer promised (None: unknown)
    place: str = ""  # a racing copy's connection
    free_now: bool = False  # its offer said it could start now


class History:
    """Observed run times (or actual/limit ratios) of finished jobs: means, conditional means."""

    def __init__(self) -> None:
        self.vals: list[float] = []
        self._sums: list[float] | None = None

    def add(self, v: float) -> None:
        bisect.insort(self.vals, v)
        self._sums = None

    def _prefix(self) -> list[float]:
        if self._sums is None:
            s, out = 0.0, [0.0]
            for v in self.vals:
                s += v
                out.append(s)
            self._sums = out
        return self._sums

    def mean_above(self, x: float, default: float) -> float:
        """E[v | v > x]: the expected total of a job that has run for ``x`` already."""
        if not self.vals:
            return max(default, x)
        i = bisect.bisect_right(self.vals, x)
        n = len(self.vals) - i
        if n == 0:
            return x * 1.1 + 1e-9
        sums = self._prefix()
        return (sums[-1] - sums[i]) / n

    def median_above(self, x: float, default: float) -> float:
        """The median total of a job that has run for ``x`` already."""
        i = bisect.bisect_right(self.vals, x)
        rest = self.vals[i:]
        if not rest:
            return max(default, x * 1.1 + 1e-9) if not self.vals else x * 1.1 + 1e-9
        return rest[len(rest) // 2]

    def mean(self, default: float) -> float:
        return self.mean_above(-math.inf, default)


def _best_fit(free: list[int], g: int, skip: int | None = None) -> int | None:
    best = None
    for n, f in enumerate(free):
        if f >= g and n != skip and (best is None or f < free[best]):
            best = n
    return best


@dataclass
class Plan:
    """A queue played forward in priority order, no backfill: each job's start, and what the
    nodes hold from then on (for a new job's start)."""

    starts: dict[int, float]
    t: float
    free: list[int]
    ends: list[tuple[float, int, int]]  # heap of (end, node, gpus)


def fifo_plan(now: float, caps: list[int], running: list[tuple[float, int, int]],
              queue: list[tuple[int, int, float]]) -> Plan:
    """``running``: (predicted end, node, gpus); ``queue``: (key, gpus, duration) in order."""
    free = list(caps)
    for _end, node, g in running:
        free[node] -= g
    heap = list(running)
    heapq.heapify(heap)
    t = now
    starts: dict[int, float] = {}
    for key, g, dur in queue:
        if g > max(caps):
            continue
        while True:
            while heap and heap[0][0] <= t:
                _, node, gg = heapq.heappop(heap)
                free[node] += gg
            n = _best_fit(free, g)
            if n is not None or not heap:
                break
            t = heap[0][0]
        if n is None:
            continue
        free[n] -= g
        heapq.heappush(heap, (t + dur, n, g))
        starts[key] = t
    return Plan(starts, t, free, heap)


def after_plan(plan: Plan, g: int) -> float:
    """A new job of ``g`` GPUs after every job of the plan (no backfill)."""
    free, heap, t = list(plan.free), list(plan.ends), plan.t
    while True:
        while heap and heap[0][0] <= t:
            _, node, gg = heapq.heappop(heap)
            free[node] += gg
        if _best_fit(free, g) is not None or not heap:
            return t
        t = heap[0][0]


# --- the oracle (a diagnostic: ``Knobs.oracle``) -------------------------------------------------


def oracle_slurm(place: Any, t: float, extra: BJob | None, targets: set[int]
                 ) -> dict[int, float]:
    """When each pending job (and ``extra``, appended last) starts if nothing else arrives: the
    place's backfill (plans at time limits, ``SlurmPlace.schedule``) played forward over the
    running jobs' real ends. Stops once every job of ``targets`` has started."""
    run = [copy.copy(j) for j in place.running]
    pend = [copy.copy(j) for j in place.pending] + ([extra] if extra is not None else [])
    out: dict[int, float] = {}
    now = t
    while True:
        profile = Profile(now, place.caps, run)
        for bj in list(pend):
            slot = profile.earliest(bj.gpus, bj.limit or 0.0, now)
            if slot is None:
                continue
            when, node = slot
            profile.take(node, when, bj.limit or 0.0, bj.gpus)
            if when <= now:
                pend.remove(bj)
                bj.node, bj.start = node, now
                run.append(bj)
                out[bj.seq] = now
        later = [j.start + j.actual for j in run if j.start + j.actual > now]
        if targets <= out.keys() or not pend or not later:
            return out
        now = min(later)
        run = [j for j in run if j.start + j.actual > now]


def bind_greedily(free: list[int], ends: list[tuple[float, int, int]], waiting: list[BJob],
                  t: float, run_time: Callable[[BJob], float],
                  done: Callable[[dict[int, float]], bool]) -> dict[int, float]:
    """The Kubernetes scheduler played forward from ``t`` (``K8sPlace.schedule``: any waiting
    pod that fits binds, oldest first; no reservations): ``free`` GPUs per node, ``ends`` the
    running pods' (end, node, GPUs), a bound pod running ``run_time(pod)``. When each pod of
    ``waiting`` binds, until all have or ``done(so far)``."""
    heapq.heapify(ends)
    out: dict[int, float] = {}
    now = t
    while waiting:
        for j in list(waiting):
            n = _best_fit(free, j.gpus)
            if n is not None:
                free[n] -= j.gpus
                heapq.heappush(ends, (now + run_time(j), n, j.gpus))
                out[j.seq] = now
                waiting.remove(j)
        if not waiting or not ends or done(out):
            break
        now = ends[0][0]
        while ends and ends[0][0] <= now:
            _, n, g = heapq.heappop(ends)
            free[n] += g
    return out


def oracle_k8s(place: Any, t: float, extra: BJob | None, targets: set[int]) -> dict[int, float]:
    """The same for the Kubernetes scheduler over the running pods' real ends."""
    return bind_greedily([c - u for c, u in zip(place.caps, place.used, strict=True)],
                         [(j.start + j.actual, j.node, j.gpus) for j in place.running],
                         list(place.pending) + ([extra] if extra is not None else []), t,
                         lambda j: j.actual, lambda out: targets <= out.keys())


def oracle_offers(offers: list[Offer], t: float, start_of: Callable[[int], float | None]
                  ) -> list[Offer]:
    """``offers`` with the oracle's start (``start_of(gpus)``, simulated seconds) in place of
    the backend's estimate and free room."""
    for o in offers:
        if not o.fits:
            continue
        g = int(math.ceil(o.gpus_per_node * o.num_nodes))
        start = start_of(g)
        o.details["estimate"] = "oracle"
        if start is None:
            o.est_start, o.nodes_free = None, 0
        elif start <= t + 1e-6:
            o.est_start = EPOCH + t
            o.nodes_free = max(o.nodes_free or 0, o.num_nodes)
            o.gpus_free = max(o.gpus_free or 0, g)
        else:
            o.est_start, o.nodes_free = EPOCH + start, 0
    return offers


# --- places --------------------------------------------------------------------------------------


class Place:
    """A simulated connection: holds jobs, schedules them, answers probes like the backend."""

    conn: str
    onprem = True

    def __init__(self) -> None:
        self.version = 0  # bumps on every change: probes and plans are cached per version
        self._cache: dict[Any, Any] = {}

    def changed(self) -> None:
        self.version += 1
        self._cache.clear()

    def cached(self, key: Any, make: Callable[[], Any]) -> Any:
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]


class Profile:
    """Free GPUs per node over time, as Slurm's backfill plans it: a step function per node
    (``[(from time, free GPUs), ...]``) built from the running jobs' time limits, with the
    reservations of the pending jobs subtracted."""

    def __init__(self, t: float, caps: list[int], running: list[BJob]):
        self.t = t
        deltas: list[dict[float, int]] = [{} for _ in caps]
        for j in running:
            end = max((j.start or t) + (j.limit or 0.0), t + 1.0)
            deltas[j.node][end] = deltas[j.node].get(end, 0) + j.gpus
        self.steps: list[list[list[float]]] = []
        for n, cap in enumerate(caps):
            free = cap - sum(j.gpus for j in running if j.node == n)
            steps = [[t, free]]
            for when in sorted(deltas[n]):
                free += deltas[n][when]
                steps.append([when, free])
            self.steps.append(steps)

    def copy(self) -> Profile:
        out = object.__new__(Profile)
        out.t = self.t
        out.steps = [[list(s) for s in steps] for steps in self.steps]
        return out

    @staticmethod
    def _earliest(steps: list[list[float]], g: int, dur: float, t: float) -> float | None:
        n = len(steps)
        i = 0
        while i < n:
            start = max(steps[i][0], t)
            if steps[i][1] < g or (i + 1 < n and steps[i + 1][0] <= start):
                i += 1
                continue
            j = i + 1
            while j < n and steps[j][0] < start + dur:
                if steps[j][1] < g:
                    break
                j += 1
            else:
                return start
            i = j + 1
        return None

    def earliest(self, g: int, dur: float, t: float) -> tuple[float, int] | None:
        """(start, node) of the earliest slot of ``g`` GPUs for ``dur`` seconds from ``t``,
        best fit among the nodes free then."""
        best: tuple[float, float, int] | None = None
        for n, steps in enumerate(self.steps):
            start = self._earliest(steps, g, dur, t)
            if start is None:
                continue
            free = next(f for w, f in reversed(steps) if w <= start)
            if best is None or (start, free) < best[:2]:
                best = (start, free, n)
        return None if best is None else (best[0], best[2])

    def take(self, node: int, start: float, dur: float, g: int) -> None:
        steps = self.steps[node]
        for when in (start, start + dur):
            i = bisect.bisect_right([s[0] for s in steps], when) - 1
            if steps[i][0] != when:
                steps.insert(i + 1, [when, steps[i][1]])
        for step in steps:
            if start <= step[0] < start + dur:
                step[1] -= g


class SlurmPlace(Place):
    """One partition ``gpu`` of 8-GPU nodes, scheduled as Slurm's backfill does: pending jobs
    in priority order (submit time), each starts now if it fits beside the reservations of the
    jobs before it, else gets the earliest slot its time limit fits (conservative backfill;
    ``squeue --start`` shows that slot). Plans use time limits; jobs end sooner."""

    def __init__(self, conn: str, gres: str, nodes: int, per_node: int, knobs: Knobs):
        super().__init__()
        self.conn, self.gres, self.knobs = conn, gres, knobs
        self.caps = [per_node] * nodes
        self.used = [0] * nodes
        self.pending: list[BJob] = []
        self.running: list[BJob] = []
        self.ratios = History()
        self.recent: list[float] = []  # the same ratios in the order the jobs ended
        self.settings = SlurmSettings.from_extra(conn, {"cluster": conn.split("_")[-1]})
        #: pending job -> (its planned start, the node): squeue's %S and %Y
        self.reserved: dict[int, tuple[float, int]] = {}

    @property
    def total(self) -> int:
        return sum(self.caps)

    @property
    def busy(self) -> int:
        return sum(self.used)

    def submit(self, bj: BJob, t: float) -> bool:
        self.pending.append(bj)
        self.changed()
        return True

    def cancel(self, bj: BJob, t: float) -> None:
        if bj in self.pending:
            self.pending.remove(bj)
            bj.state = "cancelled"
            self.changed()

    def finish(self, bj: BJob, t: float) -> None:
        self.running.remove(bj)
        self.used[bj.node] -= bj.gpus
        bj.state = "done"
        if bj.limit:
            self.ratios.add(bj.actual / bj.limit)
            self.recent.append(bj.actual / bj.limit)
        self.changed()

    def _start(self, bj: BJob, node: int, t: float, started: list[BJob]) -> None:
        self.pending.remove(bj)
        self.used[node] += bj.gpus
        bj.node, bj.start, bj.state = node, t, "running"
        self.running.append(bj)
        started.append(bj)

    def schedule(self, t: float) -> list[BJob]:
        started: list[BJob] = []
        profile = Profile(t, self.caps, self.running)
        self.reserved = {}
        for bj in list(self.pending):
            slot = profile.earliest(bj.gpus, bj.limit or 0.0, t)
            if slot is None:
                continue
            when, node = slot
            profile.take(node, when, bj.limit or 0.0, bj.gpus)
            if when <= t:
                self._start(bj, node, t, started)
            else:
                self.reserved[bj.seq] = (when, node)
        if started:
            self.changed()
        return started

    # estimates -----------------------------------------------------------------------------
    def history_lines(self) -> list[str]:
        """What the probe's history section prints: the finished jobs' elapsed|limit|state
        (the most recent 500, as the probe keeps them)."""
        return self.cached("history", lambda: [f"{int(r * 3600)}|3600|COMPLETED"
                                               for r in self.recent[-500:]])

    def discount(self) -> float | None:
        """The real discount of the cluster's history (``slurm.queue.history_ratio``)."""
        if self.knobs.slurm_estimate == "testonly":
            return None
        return self.cached("discount", lambda: history_ratio(self.history_lines()).ratio)

    def fifo(self, t: float) -> Plan:
        """The queue played in priority order at time limits, no backfill (``testonly``)."""
        def make() -> Plan:
            running = [(max((j.start or t) + (j.limit or 0.0), t + 1.0), j.node, j.gpus)
                       for j in self.running]
            return fifo_plan(t, self.caps, running, [(j.seq, j.gpus, j.limit or 0.0)
                                                     for j in self.pending])

        return self.cached(("fifo", t), make)

    def new_job_start(self, t: float, g: int, limit: float) -> float:
        """What the probe's ``sbatch --test-only`` answers for a new job, by the model (the
        real code discounts it)."""
        return after_plan(self.fifo(t), g)

    def own_start(self, bj: BJob, t: float) -> float | None:
        """A waiting job's status ``est_start``: squeue's StartTime (its slot in the backfill
        plan), discounted as ``slurm.status.parse_status`` does."""
        if self.knobs.oracle and bj.state == "pending":
            return self.oracle_own(t).get(bj.seq)
        if self.knobs.own_estimate == "none" or bj.state != "pending":
            return None
        planned = self.reserved.get(bj.seq)
        if planned is None:
            return None
        when = max(planned[0], t)
        ratio = self.discount()
        return when if ratio is None else t + (when - t) * ratio

    def oracle_own(self, t: float) -> dict[int, float]:
        """``Knobs.oracle``: when each of our pending jobs really starts (no later arrivals)."""
        ours = {j.seq for j in self.pending if j.owner is not None}
        return self.cached(("oracle-own", t), lambda: oracle_slurm(self, t, None, ours))

    def oracle_new(self, t: float, g: int, limit: float) -> float | None:
        """``Knobs.oracle``: when a new job of ``g`` GPUs and ``limit`` submitted now starts."""
        return self.cached(("oracle-new", t, g, limit), lambda: oracle_slurm(
            self, t, BJob(-1, g, limit, 0.0, t), {-1}).get(-1))

    # the probe ------------------------------------------------------------------------------
    def offers(self, task: Task, t: float, limit: float) -> list[Offer]:
        shapes = slurm_offers.probe_shapes(task, self.settings)
        key = ("state", t, tuple(shapes), limit)
        state = self.cached(key, lambda: parse_cluster(self._probe_text(t, shapes, limit)))
        out = slurm_offers.offers(task, state, self.settings, self.conn, lambda _t, _r: "")
        if self.knobs.oracle:
            oracle_offers(out, t, lambda g: self.oracle_new(t, g, limit))
        return out

    def _probe_text(self, t: float, shapes: list[tuple[int, int, int, int]], limit: float
                    ) -> str:
        """What the probe script prints on the login node (``slurm/cluster.py``)."""
        queued: list[tuple[BJob, float | None, int | None]] = [
            (j, *self.reserved.get(j.seq, (None, None))) for j in self.pending]
        lines = ["@@now", str(int(EPOCH + t)), "@@home", "/home/u", "@@user", "sky", "@@nodes"]
        for n, (cap, u) in enumerate(zip(self.caps, self.used, strict=True)):
            state = "idle" if u == 0 else "allocated" if u >= cap else "mixed"
            cpus = 64
            alloc = min(cpus, 8 * u)
            lines.append(f"{self.conn}-n{n}|gpu|{state}|{alloc}/{cpus - alloc}/0/{cpus}|512000|"
                         f"{64000 * u}|gpu:{self.gres}:{cap}(S:0-1)|gpu:{self.gres}:{u}(IDX:0)|"
                         f"10.0.0.{n}|")
        lines += ["@@partitions", "gpu|up|2-00:00:00|n/a", "@@pending"]

        def tail(j: BJob) -> str:  # squeue -O's last fields: GPUs per node only, what in all
            return f"N/A|N/A|1|cpu={8 * j.gpus},mem={64000 * j.gpus}M,node=1|"

        for prio, (j, when, node) in enumerate(reversed(queued)):
            if self.knobs.slurm_free == "idle":  # Step 7 read the count only: hold nothing
                lines.append(f"{j.seq}|gpu|1|Dependency")
                continue
            start = "N/A" if when is None else str(int(EPOCH + when))
            sched = "(null)" if node is None else f"{self.conn}-n{node}"
            user = "sky" if j.owner is not None else "other"
            lines.append(f"{j.seq}|gpu|1|Resources|gres:gpu:{self.gres}:{j.gpus}|{8 * j.gpus}|"
                         f"{64000 * j.gpus}M|{start}|{sched}|{user}|{prio}|"
                         f"{math.ceil((j.limit or 0) / 60) or 'UNLIMITED'}|{tail(j)}")
        if self.knobs.slurm_estimate == "backfill":
            lines.append("@@running")
            for j in self.running:
                end = "N/A" if not j.limit else str(int(EPOCH + (j.start or t) + j.limit))
                lines.append(f"{j.seq}|{self.conn}-n{j.node}|gres:gpu:{self.gres}:{j.gpus}|{end}|"
                             f"{8 * j.gpus}|{64000 * j.gpus}M|{tail(j)}")
            lines += ["@@running_rc", "0"]
        if self.knobs.slurm_estimate != "testonly":
            lines += ["@@history", *self.history_lines(), "@@history_rc", "0"]
        lines.append("@@testonly")
        for gpus, nodes, cpus, mem in shapes:
            if gpus <= max(self.caps):
                when = self.new_job_start(t, gpus, limit)
                lines.append(f"gpu|{self.gres}|{gpus}|{nodes}|{cpus}|{mem}|{int(EPOCH + when)}")
        return "\n".join(lines)


class K8sPlace(Place):
    """Nodes of 8 GPUs; the scheduler binds any pending pod that fits, oldest first (no
    reservations: a big pod can be passed by small ones for ever)."""

    def __init__(self, conn: str, nodes: int, per_node: int, knobs: Knobs):
        super().__init__()
        self.conn, self.knobs = conn, knobs
        self.caps = [per_node] * nodes
        self.used = [0] * nodes
        self.pending: list[BJob] = []
        self.running: list[BJob] = []
        self.durations = History()
        self.settings = KubernetesSettings.from_extra(conn, {"cluster_context": conn})
        self.node_json = [{
            "metadata": {"name": f"gpu-{n}", "labels": {"skypilot.co/accelerator": "a100"}},
            "spec": {},
            "status": {"allocatable": {"cpu": "96", "memory": "1024Gi",
                                       "nvidia.com/gpu": str(per_node), "pods": "110"},
                       "conditions": [{"type": "Ready", "status": "True"}]},
        } for n in range(nodes)]

    total = SlurmPlace.total
    busy = SlurmPlace.busy
    submit = SlurmPlace.submit
    cancel = SlurmPlace.cancel
    _start = SlurmPlace._start

    def finish(self, bj: BJob, t: float) -> None:
        self.running.remove(bj)
        self.used[bj.node] -= bj.gpus
        bj.state = "done"
        if bj.owner is not None:  # our finished pods: what the real estimate reads
            self.durations.add(bj.actual)
        self.changed()

    def schedule(self, t: float) -> list[BJob]:
        started: list[BJob] = []
        for bj in list(self.pending):
            n = _best_fit([c - u for c, u in zip(self.caps, self.used, strict=True)], bj.gpus)
            if n is not None:
                self._start(bj, n, t, started)
        if started:
            self.changed()
        return started

    def greedy(self, t: float, pending: list[BJob], new: int | None = None) -> dict[int, float]:
        """The ``pod-ages`` estimate: the scheduler played forward, each pod's GPUs freed when
        its age says (the mean run time of finished pods that ran at least as long), pending
        pods bound greedily in order as GPUs free up (no reservations). When each pending
        pod binds; ``new``: a new pod of that many GPUs after them (key -1)."""
        mean = self.durations.median_above(0.0, H)
        ends = [(max(j.start + self.durations.median_above(t - j.start, H), t + 1.0), j.node,
                 j.gpus) for j in self.running]
        waiting = list(pending)
        if new is not None:
            waiting.append(BJob(-1, new, None, 0.0, t))
        return bind_greedily([c - u for c, u in zip(self.caps, self.used, strict=True)], ends,
                             waiting, t, lambda j: mean,
                             lambda out: new is not None and -1 in out)

    def own_start(self, bj: BJob, t: float) -> float | None:
        """What-if (``own_estimate=queue+k8s``): a waiting pod's own slot (no backend says)."""
        if self.knobs.oracle and bj.state == "pending":
            ours = {j.seq for j in self.pending if j.owner is not None}
            return self.cached(("oracle-own", t),
                               lambda: oracle_k8s(self, t, None, ours)).get(bj.seq)
        if self.knobs.k8s_estimate != "pod-ages" or self.knobs.own_estimate != "queue+k8s" \
                or bj.state != "pending":
            return None
        return self.cached(("own", t), lambda: self.greedy(t, self.pending)).get(bj.seq)

    def offers(self, task: Task, t: float, limit: float) -> list[Offer]:
        view = self.cached(("view", t), lambda: self._view(t))
        out = []
        for req in task.candidates:
            if not k8s_offers.applies(req, self.settings):
                continue
            out.append(k8s_offers.offer(self.conn, "kubernetes", self.settings, task, req, view,
                                        unsupported="", bundle_error=""))
        if self.knobs.oracle:
            oracle_offers(out, t, lambda g: self.cached(("oracle-new", t, g), lambda: oracle_k8s(
                self, t, BJob(-1, g, None, 0.0, t), {-1}).get(-1)))
        return out

    def _view(self, t: float) -> Any:
        """What the node list, the pod list and our namespace's lists give
        ``kubernetes.cluster.cluster_view``."""
        pods = [self._pod(j, f"gpu-{j.node}", "Running") for j in self.running]
        pods += [self._pod(j, None, "Pending") for j in self.pending]
        view = cluster_view(self.node_json, pods, "default", jobs=[])
        view.now = EPOCH + t
        if self.knobs.k8s_estimate != "none":  # Step 7 did not list our finished pods
            # what ``kubernetes.queue.run_times`` reads off our finished pods' containers
            # (set here, not printed as 300 pod documents per probe: the simulator's speed)
            view.runs = self.durations.vals
        return view

    @staticmethod
    def _pod(j: BJob, node: str | None, phase: str) -> dict[str, Any]:
        spec: dict[str, Any] = {"containers": [{"resources": {"requests": {
            "nvidia.com/gpu": str(j.gpus), "cpu": "8"}}}]}
        if node:
            spec["nodeName"] = node
        ns = "default" if j.owner is not None else "research"
        meta: dict[str, Any] = {"name": f"p{j.seq}", "namespace": ns,
                                "creationTimestamp": _rfc3339(EPOCH + j.submit)}
        if ns == "default":
            meta["labels"] = {LABEL_JOB: f"p{j.seq}"}
        status: dict[str, Any] = {"phase": phase}
        if phase == "Running" and j.start is not None:
            status["startTime"] = _rfc3339(EPOCH + j.start)
        return {"metadata": meta, "spec": spec, "status": status}


def _rfc3339(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


#: the instance types the simulated region offers (vCPUs, memory GB, GPU, GPUs); prices from the
#: shipped catalog (p5.4xlarge: the real code's per-GPU estimate from p5.48xlarge)
AWS_TYPES = {
    "p4d.24xlarge": InstanceTypeInfo("p4d.24xlarge", 96, 1152, gpu="A100", gpu_label="A100",
                                     gpus=8, gpu_memory_gb=40),
    "p5.48xlarge": InstanceTypeInfo("p5.48xlarge", 192, 2048, gpu="H100", gpu_label="H100",
                                    gpus=8, gpu_memory_gb=80),
    "p5.4xlarge": InstanceTypeInfo("p5.4xlarge", 16, 256, gpu="H100", gpu_label="H100", gpus=1,
                                   gpu_memory_gb=80),
}


_AWS_SETTINGS: dict[bool, AwsSettings] = {}


class AwsPlace(Place):
    """One region, two AZs; the P-class on-demand vCPU quota is shared with others' instances.
    A launch the quota cannot take is refused (VcpuLimitExceeded)."""

    onprem = False

    def __init__(self, conn: str, sc: Scenario, knobs: Knobs):
        super().__init__()
        self.conn, self.sc, self.knobs = conn, sc, knobs
        self.instances: list[tuple[BJob, InstanceTypeInfo]] = []
        self.spot = {(n, az): round(on_demand_price({}, "us-east-1", i, AWS_TYPES)[0] * 0.45, 4)
                     for n, i in AWS_TYPES.items() for az in ("us-east-1a", "us-east-1b")}

    total = 0
    busy = 0

    @property
    def settings(self) -> AwsSettings:
        """The connection's extra: ``larger_instances: true`` for ``aws_types=exact-first`` (read
        from the knobs each time: a run's places are copies of the warmed ones, knobs set after)."""
        larger = self.knobs.aws_types == "exact-first"
        if larger not in _AWS_SETTINGS:
            _AWS_SETTINGS[larger] = AwsSettings.from_extra(
                {"regions": ["us-east-1"], "larger_instances": larger})
        return _AWS_SETTINGS[larger]

    def used_vcpus(self) -> float:
        return self.sc.aws_others_vcpus + sum(i.vcpus for _, i in self.instances)

    def types(self, req: Any) -> tuple[list[InstanceTypeInfo], str]:
        """The suitable types, as ``probe_region`` lists them; which of them a candidate gets
        (exactly its GPU count, or a larger one with ``larger_instances``) is ``offers_for``'s."""
        return suitable_types(AWS_TYPES, req, cpu_families=self.settings.cpu_families,
                              price_of=lambda n: on_demand_price(
                                  self.settings.prices, "us-east-1", AWS_TYPES[n], AWS_TYPES)[0])

    def offers(self, task: Task, t: float, limit: float) -> list[Offer]:
        state = aws_offers.RegionState(
            region="us-east-1", catalog=AWS_TYPES,
            offered={n: {"us-east-1a", "us-east-1b"} for n in AWS_TYPES},
            spot_prices=self.spot,
            quotas={("p", False): QuotaView("p", False, QUOTA_CODES[("p", False)],
                                            self.sc.aws_quota_vcpus,
                                            self.used_vcpus())},
            subnet_azs=None, now=EPOCH + t)
        out = []
        for req in task.candidates:
            if not aws_offers.regions_for(self.settings, req):
                continue
            types, why = self.types(req)
            out += aws_offers.offers_for(self.conn, self.settings, task, req, state, types, why)
        out = aws_offers.share_quotas(out)  # as ``probe_region``: the AZs draw on one quota
        if self.knobs.aws_keep_large:
            self.keep_large(out)
        return out

    def keep_large(self, offers: list[Offer]) -> None:
        """``Knobs.aws_keep_large``: what the proposed change in ``aws/offers.py`` would do."""
        most = max(i.gpus for i in AWS_TYPES.values())
        big = min(i.vcpus for i in AWS_TYPES.values() if i.gpus == most)
        room = self.sc.aws_quota_vcpus - self.used_vcpus()
        for o in offers:
            info = AWS_TYPES.get(o.instance_type or "")
            if not o.fits or not o.free_now or info is None or info.gpus >= most:
                continue
            if (room - info.vcpus) // big < room // big:
                o.nodes_free, o.est_start = 0, None
                o.details["estimate"] = "unknown"
                o.notes.append(f"quota kept for a {most}-GPU instance")

    def launch(self, bj: BJob, itype: str, t: float) -> bool:
        info = AWS_TYPES[itype]
        if self.used_vcpus() + info.vcpus > self.sc.aws_quota_vcpus:
            return False
        self.instances.append((bj, info))
        self.changed()
        return True

    def terminate(self, bj: BJob) -> None:
        self.instances = [(b, i) for b, i in self.instances if b is not bj]
        self.changed()


# --- the simulation ------------------------------------------------------------------------------


@dataclass(eq=False)
class Job:
    """A burst job as the operator (or SkyPilot) drives it."""

    spec: JobSpec
    task: Task
    copy: BJob | None = None
    where: str = ""  # connection of the current copy
    offer: Offer | None = None
    places: list[str] = field(default_factory=list)
    blocked: list[Blocked] = field(default_factory=list)
    moves: int = 0
    refused: int = 0
    start: float | None = None
    end: float | None = None
    cost: float = 0.0
    gpu_h_billed: float = 0.0
    sky_i: int = 0
    log: list[tuple[float, str]] = field(default_factory=list)
    sky_places: list[Offer] = field(default_factory=list)
    sky_waited: bool = False
    copies: list[BJob] = field(default_factory=list)  # racing copies
    won: BJob | None = None  # the racing copy whose gate is being opened
    raced: list[str] = field(default_factory=list)
    left: set[str] = field(default_factory=set)  # places it moved away from
    trigger_gen: int = 0
    #: its wait left as its last look (or its submission) estimated it, and when
    look_wait: float | None = None
    look_t: float = 0.0
    #: a look decided a move that ``_move`` has not done yet (``event_looks``/``joint_looks``)
    in_move: bool = False


@dataclass
class Result:
    strategy: str
    seed: int
    knobs: str
    waits: list[float]
    mean_wait_min: float
    sweeps_wait_min: float  # mean wait of the sweeps' jobs
    singles_wait_min: float  # ... and of the others
    p95_wait_min: float
    makespan_h: float
    cloud_usd: float
    cloud_gpu_h_billed: float
    cloud_gpu_h_used: float
    idle_share: float
    moves: int
    refused: int  # submissions a place refused (the quota went meanwhile)
    moves_back: int  # moves to a place the job had moved away from
    moves_paid_short: int  # moves to a costlier place though the wait here was < 10 min
    on_aws: int
    #: copies queued on an estimate that started in < half of it (the issue measured 45%)
    est_early: float | None
    #: median of real wait / estimated wait of those copies
    est_ratio: float | None
    #: on-prem offers that said "free now" after which the job waited over 5 minutes there
    false_free: float | None

    def row(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("waits")
        return out


STRATEGIES = ("fastest", "fastest+moves", "fastest+race", "fastest+race+moves", "cheapest",
              "cheapest+moves", "one-cluster", "skypilot")


def new_places(sc: Scenario, knobs: Knobs) -> dict[str, Any]:
    return {
        "slurm_alpha": SlurmPlace("slurm_alpha", "a100", *sc.alpha, knobs),
        "slurm_beta": SlurmPlace("slurm_beta", "h100", *sc.beta, knobs),
        "k8s": K8sPlace("k8s", *sc.k8s, knobs),
        "aws": AwsPlace("aws", sc, knobs),
    }


_WARM: dict[tuple[Scenario, int], tuple[list[JobSpec], list[BgSpec], dict[str, Any]]] = {}
#: sequence numbers of the run start above the initial jobs'
_SEQ0 = 10**7


def draw_bg(sc: Scenario, rnd: random.Random, slurm: bool) -> tuple[int, float | None, float]:
    """(GPUs, time limit or None, run time) of one of others' jobs."""
    g = rnd.choices(sc.gpu_counts, sc.bg_gpu_weights)[0]
    lo, hi = sc.bg_limit_h if slurm else sc.bg_k8s_h
    length = math.exp(rnd.uniform(math.log(lo), math.log(hi))) * H
    if slurm:
        return g, length, length * rnd.uniform(*sc.run_share)
    return g, None, length


def warm(sc: Scenario, seed: int) -> tuple[list[JobSpec], list[BgSpec], dict[str, Any]]:
    """The burst, others' jobs still to come, and the clusters at time 0 (loaded as the
    scenario says; the same for every strategy: built once per seed)."""
    key = (sc, seed)
    if key not in _WARM:
        specs, bg = make_trace(sc, seed)
        rnd = random.Random(seed * 7919 + 1)
        places = new_places(sc, Knobs())
        seq = 0
        for name, queue in (("slurm_alpha", sc.queue_alpha), ("slurm_beta", sc.queue_beta),
                            ("k8s", 0)):
            place = places[name]
            slurm = name != "k8s"
            target = place.total * (1.0 if slurm else sc.k8s_busy)
            misses = 0
            while misses < 30:
                g, lim, act = draw_bg(sc, rnd, slurm)
                free = [c - u for c, u in zip(place.caps, place.used, strict=True)]
                n = _best_fit(free, g)
                if n is None or place.busy + g > target:
                    misses += 1
                    continue
                seq += 1
                elapsed = rnd.uniform(0, act)
                place.running.append(BJob(seq, g, lim, act, -elapsed, start=-elapsed, node=n,
                                          state="running"))
                place.used[n] += g
            for _ in range(queue):
                g, lim, act = draw_bg(sc, rnd, slurm)
                seq += 1
                place.pending.append(BJob(seq, g, lim, act, -rnd.uniform(0, 2 * H)))
            place.pending.sort(key=lambda j: j.submit)
            for _ in range(sc.history):
                _, lim, act = draw_bg(sc, rnd, slurm)
                if slurm:
                    place.ratios.add(act / lim)
                    place.recent.append(act / lim)
                elif sc.k8s_history == "others":
                    place.durations.add(act)
                else:  # our earlier jobs, as the burst's
                    place.durations.add(rnd.uniform(sc.limit_min, sc.limit_max)
                                        * rnd.uniform(*sc.run_share))
            place.schedule(0.0)
        _WARM[key] = (specs, bg, places)
    return _WARM[key]


class Sim:
    def __init__(self, sc: Scenario, knobs: Knobs, strategy: str, seed: int):
        self.sc, self.knobs, self.strategy, self.seed = sc, knobs, strategy, seed
        specs, self.bg, places = warm(sc, seed)
        self.specs = specs
        self.places = copy.deepcopy(places)
        for place in self.places.values():
            place.knobs = knobs
            place.changed()
        self.policy = "cheapest" if strategy.startswith("cheapest") else "fastest"
        self.moving = strategy.endswith("+moves")
        self.events: list[tuple[float, int, int, Callable[[], None]]] = []
        self.seq = _SEQ0
        self.t = 0.0
        self.jobs = [Job(s, task_for(s)) for s in self.specs]
        self.waiting = 0  # burst jobs arrived and not started
        self.done = 0
        #: the placement ledger's entries (``ledger.PlacementLedger``'s file, shared by all)
        self.entries: list[dict[str, Any]] = []
        self.probe_cache: dict[tuple[str, int], tuple[float, list[Offer]]] = {}
        self.idle_area = 0.0
        self.total_area = 0.0
        self.last_t = self.t
        #: on-prem offers that said "free now": how long the job then waited there
        self.free_calls: list[float] = []
        #: queued on an estimate: (estimated wait, real wait there) of copies that started
        self.calib: list[tuple[float, float]] = []
        self.onprem = [p for p in self.places.values() if p.onprem]
        self.back = 0
        self.paid_short = 0
        #: ``joint_looks``: the looks due now, run together by ``_round``
        self.round: list[tuple[Job, BJob, int]] = []
        self.result: Result | None = None  # set by ``compare``

    # events ---------------------------------------------------------------------------------
    def at(self, t: float, fn: Callable[[], None], prio: int = 1) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, prio, self.seq, fn))

    def _advance(self, t: float) -> None:
        if self.waiting > 0 and t > self.last_t:
            dt = t - self.last_t
            total = sum(p.total for p in self.onprem)
            busy = sum(p.busy for p in self.onprem)
            self.idle_area += (total - busy) * dt
            self.total_area += total * dt
        self.last_t = self.t = t

    def run(self) -> Result:
        for place in self.places.values():
            for bj in getattr(place, "running", []):
                self.at(bj.start + bj.actual, lambda bj=bj, p=place: self._end(p, bj), prio=0)
        for b in self.bg:
            self.at(b.arrival, lambda b=b: self._bg_arrival(b), prio=0)
        by_time: dict[float, list[Job]] = {}
        for j in self.jobs:
            by_time.setdefault(j.spec.arrival, []).append(j)
        for when, group in by_time.items():
            self.at(when, lambda g=group: self._arrive(g), prio=2)
        while self.events and self.done < len(self.jobs):
            t, _, _, fn = heapq.heappop(self.events)
            self._advance(t)
            fn()
        return self._result()

    def _bg_arrival(self, b: BgSpec) -> None:
        place = self.places[b.cluster]
        self.seq += 1
        place.submit(BJob(self.seq, b.gpus, b.limit, b.actual, self.t), self.t)
        self._schedule(place)

    def _schedule(self, place: Any) -> None:
        for bj in place.schedule(self.t):
            if bj.owner is not None and bj.owner.copies:
                # the winner's code starts when its gate opens; a later starter waits at its
                # gate until stopped
                gate = dict(self.sc.race_gate_open).get(
                    "kubernetes" if isinstance(place, K8sPlace) else "slurm", 0.0)
                first = bj.owner.start is None and bj.owner.won is None
                self.at(self.t + (gate if first else 0.0) + bj.actual,
                        lambda bj=bj, p=place: self._end(p, bj), prio=0)
                self._race_start(bj.owner, bj, place, gate if first else 0.0)
                continue
            self.at(self.t + bj.actual, lambda bj=bj, p=place: self._end(p, bj), prio=0)
            if bj.owner is not None:
                self._started(bj.owner, self.t)
                waited = self.t - bj.submit
                if bj.free_now:
                    self.free_calls.append(waited)
                elif bj.est_wait is not None:
                    self.calib.append((bj.est_wait, waited))

    def _end(self, place: Any, bj: BJob) -> None:
        if bj.state != "running":  # a racing copy stopped at its start gate
            return
        place.finish(bj, self.t)
        if bj.owner is not None:
            self._finished(bj.owner)
        self._schedule(place)
        if bj.owner is not None:
            self._released(place.conn)

    def _started(self, job: Job, t: float) -> None:
        job.log.append((t, f"started on {job.where}"))
        if job.start is None:
            job.start = t
            self.waiting -= 1

    def _finished(self, job: Job) -> None:
        job.end = self.t
        self.done += 1

    # probes -----------------------------------------------------------------------------------
    def _offers(self, job: Job, conns: list[str] | None = None, shared: bool = False
                ) -> list[Offer]:
        """Every connection's offers for the job's task, from the simulated probe inputs.
        ``shared``: a trigger's look while waiting, which shares a probe per (connection,
        shape) for half the reprobe interval (``rebalance._probe``)."""
        out = []
        for conn in conns or list(self.places):
            place = self.places[conn]
            key = (conn, job.task.name)  # rebalance's key: the task's capacity view
            if shared:
                hit = self.probe_cache.get(key)
                if hit is not None and self.t - hit[0] < self.sc.reprobe_interval / 2:
                    out += hit[1]
                    continue
            offers = place.offers(job.task, self.t, job.spec.limit)
            if shared:
                self.probe_cache[key] = (self.t, offers)
            out += offers
        return out

    # the operator ---------------------------------------------------------------------------
    def _arrive(self, group: list[Job]) -> None:
        self.waiting += len(group)
        if self.strategy == "skypilot":
            for job in group:
                self._sky_next(job, first=True)
            return
        conns = ["slurm_alpha"] if self.strategy == "one-cluster" else None
        # concurrent placements: every one probed before any submitted (with the ledger, each
        # ranks under the lock after the ones before it noted their choice)
        snapshot = [(job, self._offers(job, conns)) for job in group]
        for job, offers in snapshot:
            self._decide(job, offers, conns)

    def _decide(self, job: Job, offers: list[Offer], conns: list[str] | None) -> None:
        """``Placer.place`` (the probe began now): take what the ledger holds, rank, note the
        chosen in the ledger, submit; a refused place is blocked and the job placed anew."""
        now = EPOCH + self.t
        plan = placement.rank(self._hold(job, offers), self.policy, ordered=job.task.ordered,
                              blocked=job.blocked, now=now)
        if plan.chosen is not None and self.knobs.paid_priority_place and plan.chosen.free_now \
                and plan.chosen.price_per_hour > 0:
            unpaid = [o for o in plan.ranked if o.price_per_hour == 0]
            if unpaid:
                job.look_wait, job.look_t = unpaid[0].wait_seconds, self.t
                if self._defer_paid(job, unpaid[0], plan.chosen):
                    plan = placement.rank([o for o in self._hold(job, offers)
                                           if o.price_per_hour == 0], self.policy,
                                          ordered=job.task.ordered, blocked=job.blocked, now=now)
        if plan.chosen is None:  # nothing viable now: look again after the reprobe interval
            self.at(self.t + self.sc.reprobe_interval, lambda: self._replace(job, conns))
            return
        job.places = sorted({o.place_key for o in plan.ranked})
        if self._race(job, plan):
            return
        self._note(job, plan.chosen)
        self._submit_later(job, plan.chosen, self.sc.probe_s + self.sc.submit_s,
                           lambda: self._replace(job, conns))

    def _race(self, job: Job, plan: placement.Placement) -> bool:
        """``fastest+race``: nothing can start the job now; queue a copy at each on-prem
        place it fits (``race_backends``; best ranked first, ``race_width`` at most); the
        first to start wins,
        the others are cancelled, or stopped at their start gate if they started meanwhile."""
        if not self.strategy.startswith("fastest+race") or plan.chosen.free_now:
            return False
        seen: set[str] = set()
        racers = []
        for o in plan.ranked:
            if o.backend in self.sc.race_backends and o.place_key not in seen:
                seen.add(o.place_key)
                racers.append(o)
        racers = racers[:self.sc.race_width]
        if len(racers) < 2:
            return False
        job.copies = []
        job.raced = [o.place_key for o in racers]
        for o in racers:
            self.at(self.t + self.sc.probe_s + self.sc.submit_s,
                    lambda o=o: self._race_submit(job, o))
        if self.strategy == "fastest+race+moves":
            self.at(self.t + self.sc.reprobe_interval, lambda: self._race_look(job, racers[0]))
        return True

    def _race_look(self, job: Job, first: Offer) -> None:
        """While every copy waits: a place that can start the job now (and races no copy)
        wins, as ``reconsider`` says; queues are covered by the race."""
        if (job.start is not None or job.won is not None or not job.copies
                or job.moves >= self.knobs.max_moves):
            return
        offers = self._offers(job, shared=True)
        bj = job.copies[0]
        handle = JobHandle(backend=first.backend, connection=first.connection,
                           job_id=str(bj.seq), job_name=f"job{job.spec.id}",
                           location=first.location, infra=first.infra,
                           accelerator=first.accelerator)
        own = self.places[first.connection].own_start(bj, self.t)
        status = JobStatus(JobState.PENDING, est_start=None if own is None else EPOCH + own)
        current = rebalance._current(offers, handle, status)
        to = None
        if current is not None:
            others = [o for o in offers if o.place_key in set(job.places)
                      and o.place_key not in job.raced]
            to = placement.reconsider(current, others, self.policy, blocked=job.blocked,
                                      moves=job.moves, max_moves=self.knobs.max_moves,
                                      now=EPOCH + self.t)
        if to is None or not to.free_now:
            self.at(self.t + self.sc.reprobe_interval, lambda: self._race_look(job, first))
            return
        job.log.append((self.t, f"race: move to {to.place_key}"))

        def move() -> None:
            if job.start is not None or job.won is not None:
                return
            fresh = self._still_good(job, to)
            if fresh is None:
                self.at(self.t + self.sc.reprobe_interval, lambda: self._race_look(job, first))
                return
            self._count_move(job, current, fresh)
            for c in job.copies:
                if c.state == "pending":
                    self.places[c.place].cancel(c, self.t)
                    self._schedule(self.places[c.place])
            job.copies = []
            job.moves += 1
            self._submit_later(job, fresh, self.sc.cancel_s + self.sc.submit_s,
                               lambda: self._replace(job, None))

        self.at(self.t + self.sc.resume_s, move)

    def _race_submit(self, job: Job, offer: Offer) -> None:
        if job.start is not None or job.won is not None:
            return
        self.seq += 1
        bj = BJob(self.seq, job.spec.gpus, job.spec.limit, job.spec.actual, self.t, owner=job,
                  free_now=offer.free_now, est_wait=offer.wait_seconds)
        bj.place = offer.connection
        job.copies.append(bj)
        job.log.append((self.t, f"race copy at {offer.place_key} est={offer.wait_seconds}"))
        place = self.places[offer.connection]
        place.submit(bj, self.t)
        self._schedule(place)

    def _race_start(self, job: Job, bj: BJob, place: Any, gate: float) -> None:
        if job.start is None and job.won is None:  # the winner: the others are stopped,
            job.won = bj  # then its gate opens
            job.where = place.conn

            def opened() -> None:
                self._race_stop(job, bj)
                self._started(job, self.t)

            self.at(self.t + gate, opened)
        # a later starter waits at its gate until the operator stops it

    def _race_stop(self, job: Job, winner: BJob) -> None:
        for bj in job.copies:
            if bj is winner or bj.state in ("done", "cancelled", "stopped"):
                continue
            place = self.places[bj.place]
            if bj.state == "pending":
                place.cancel(bj, self.t)
            else:  # it started meanwhile: its gate never opened; release its GPUs
                place.running.remove(bj)
                place.used[bj.node] -= bj.gpus
                bj.state = "stopped"
                place.changed()
            self._schedule(place)

    def _replace(self, job: Job, conns: list[str] | None) -> None:
        self._decide(job, self._offers(job, conns), conns)

    # the placement ledger (``airflow_skypilot.ledger``, as ``Placer`` uses it) -----------------
    def _hold(self, job: Job, offers: list[Offer], began: float | None = None) -> list[Offer]:
        """Copies of ``offers`` (of a probe begun now, or at ``began``) with what the live
        entries hold taken (``ledger.hold``, as ``Placer.place`` and ``Placer._still_good``
        call it)."""
        if not self.knobs.herd_avoid:
            return offers
        now = EPOCH + self.t  # ``PlacementLedger.deciding``: entries past the TTL lapse
        self.entries[:] = [e for e in self.entries if now - e["at"] < ledger.TTL]
        if not self.entries:
            return offers
        copies = []
        for o in offers:  # what ``hold`` changes, copied (``Placer`` deep-copies)
            c = copy.copy(o)
            c.details, c.notes = dict(o.details), list(o.notes)
            copies.append(c)
        return ledger.hold(copies, self.entries, own=_copy_name(job),
                           probe_began=now if began is None else EPOCH + began)

    def _note(self, job: Job, offer: Offer) -> None:
        """``PlacementLedger.note``: the job's copy goes to ``offer``'s place (simulated time)."""
        if self.knobs.herd_avoid:
            _NOTER.note(self.entries, _copy_name(job), offer)
            self.entries[-1]["at"] = EPOCH + self.t

    def _submitted(self, job: Job, ok: bool) -> None:
        """``PlacementLedger.submitted``: stamp the entry, or drop it when the place refused."""
        name = _copy_name(job)
        if ok:
            for e in self.entries:
                if e["copy"] == name:
                    e["submitted"] = EPOCH + self.t
        else:
            self.entries[:] = [e for e in self.entries if e["copy"] != name]

    def _submit_later(self, job: Job, offer: Offer, delay: float,
                      refused: Callable[[], None]) -> None:
        def land() -> None:
            ok = self._submit(job, offer)
            self._submitted(job, ok)
            if not ok:
                job.refused += 1
                job.blocked.append(Blocked(offer.place_key, "launch refused: vCPU quota",
                                           at=EPOCH + self.t,
                                           until=EPOCH + self.t + self.sc.block_cooldown))
                refused()

        self.at(self.t + delay, land)

    def _submit(self, job: Job, offer: Offer) -> bool:
        place = self.places[offer.connection]
        self.seq += 1
        bj = BJob(self.seq, job.spec.gpus, job.spec.limit, job.spec.actual, self.t, owner=job)
        if isinstance(place, AwsPlace):
            if not place.launch(bj, offer.instance_type, self.t):
                return False
            info = AWS_TYPES[offer.instance_type]
            bj.state, bj.start = "booting", self.t
            job.log.append((self.t, f"launch {offer.instance_type} ${offer.price_per_hour}"))
            job.copy, job.where, job.offer = bj, offer.connection, offer

            def running() -> None:
                bj.state = "running"
                self._started(job, self.t)
                self.at(self.t + job.spec.actual, ended, prio=0)

            def ended() -> None:
                place.terminate(bj)
                billed = (self.t - bj.submit) / H
                job.cost += billed * offer.price_per_hour
                job.gpu_h_billed += billed * info.gpus
                bj.state = "done"
                self._finished(job)
                self._released(place.conn)

            self.at(self.t + job.spec.boot, running, prio=0)
            return True
        if self.strategy != "skypilot":  # it submits on no estimate
            bj.free_now, bj.est_wait = offer.free_now, offer.wait_seconds
            job.look_wait, job.look_t = offer.wait_seconds, self.t
        place.submit(bj, self.t)
        job.log.append((self.t, f"submit {offer.place_key} {offer.accelerator} "
                                f"free={offer.free_now} est={offer.wait_seconds}"))
        job.copy, job.where, job.offer = bj, offer.connection, offer
        self._schedule(place)
        if bj.state == "pending":
            if self.strategy == "skypilot":
                timeout = self.sc.sky_timeout_k8s if offer.connection == "k8s" \
                    else self.sc.sky_timeout_slurm
                self.at(self.t + timeout, lambda: self._sky_timeout(job, bj))
            elif self.moving:
                job.trigger_gen += 1
                gen = job.trigger_gen
                self.at(self.t + self.sc.reprobe_interval, lambda: self._look(job, bj, gen))
        return True

    def _released(self, conn: str) -> None:
        """``event_looks``: one of our jobs left ``conn`` (ended, or cancelled by a move):
        every waiting job of ours looks again shortly, ``conn`` probed afresh."""
        if not self.moving or self.knobs.event_looks not in ("aws", "all") \
                or self.knobs.event_looks == "aws" and conn != "aws":
            return
        for key in [k for k in self.probe_cache if k[0] == conn]:
            del self.probe_cache[key]
        for job in self.jobs:
            bj = job.copy
            if job.start is not None or job.in_move or bj is None or bj.state != "pending" \
                    or job.moves >= self.knobs.max_moves or job.copies:
                continue
            job.trigger_gen += 1
            gen = job.trigger_gen
            self.at(self.t + EVENT_LOOK_S,
                    lambda job=job, bj=bj, gen=gen: self._look(job, bj, gen))

    def _look(self, job: Job, bj: BJob, gen: int) -> None:
        """The trigger's look at a waiting job (``rebalance.adecide``)."""
        if bj.state != "pending" or gen != job.trigger_gen or job.moves >= self.knobs.max_moves:
            return
        if self.knobs.joint_looks:
            if not self.round:
                self.at(self.t, self._round, prio=5)  # after every look due now
            self.round.append((job, bj, gen))
            return
        place = self.places[job.where]
        offers = self._offers(job, shared=True)
        handle = JobHandle(backend=job.offer.backend, connection=job.where, job_id=str(bj.seq),
                           job_name=f"job{job.spec.id}", location=job.offer.location,
                           infra=job.offer.infra, accelerator=job.offer.accelerator)
        own = place.own_start(bj, self.t)
        status = JobStatus(JobState.PENDING, est_start=None if own is None else EPOCH + own)
        current = rebalance._current(offers, handle, status)
        to = None
        if current is not None:
            job.look_wait, job.look_t = current.wait_seconds, self.t
            others = [o for o in offers if o.place_key in set(job.places)]
            to = placement.reconsider(current, others, self.policy, ordered=job.task.ordered,
                                      blocked=job.blocked, waited_s=self.t - job.spec.arrival,
                                      moves=job.moves, max_moves=self.knobs.max_moves,
                                      now=EPOCH + self.t,
                                      paid_min_wait=self.knobs.paid_min_wait)
            if to is not None and self.knobs.paid_priority and self._defer_paid(job, current, to):
                to = None
        if to is None:
            self.at(self.t + self.sc.reprobe_interval, lambda: self._look(job, bj, gen))
            return
        job.log.append((self.t, f"reconsider -> {to.place_key}: "
                                f"{to.details.get('move_reason')}"))
        job.in_move = True
        self.at(self.t + self.sc.resume_s, lambda: self._move(job, bj, current, to, gen))

    def _look_input(self, job: Job, bj: BJob) -> tuple[list[Offer], Offer | None]:
        """A look's offers (the shared probe, less what the ledger holds) and the job's own
        place as re-probed (``joint_looks``)."""
        offers = []
        for conn in self.places:
            hit = self.probe_cache.get((conn, job.task.name))
            began = hit[0] if hit is not None and \
                self.t - hit[0] < self.sc.reprobe_interval / 2 else self.t
            got = self._offers(job, [conn], shared=True)
            offers += self._hold(job, got, began)
        handle = JobHandle(backend=job.offer.backend, connection=job.where, job_id=str(bj.seq),
                           job_name=f"job{job.spec.id}", location=job.offer.location,
                           infra=job.offer.infra, accelerator=job.offer.accelerator)
        own = self.places[job.where].own_start(bj, self.t)
        status = JobStatus(JobState.PENDING, est_start=None if own is None else EPOCH + own)
        return offers, rebalance._current(offers, handle, status)

    def _round(self) -> None:
        """``joint_looks``: the looks due now, in the round's order, each under the ledger;
        a move decided notes its target at once."""
        items, self.round = self.round, []
        looks = []
        for job, bj, gen in items:
            if bj.state != "pending" or gen != job.trigger_gen \
                    or job.moves >= self.knobs.max_moves:
                continue
            offers, current = self._look_input(job, bj)
            left = math.inf if current is None or current.wait_seconds is None \
                else current.wait_seconds
            key = {"wait": (-left,), "rate": (-left / (job.spec.gpus * job.spec.limit),),
                   "gpus": (-job.spec.gpus, -left)}.get(self.knobs.joint_looks, ())
            looks.append((key, len(looks), job, bj, gen))
        looks.sort(key=lambda x: x[:2])
        for _, _, job, bj, gen in looks:
            offers, current = self._look_input(job, bj)  # the round's earlier notes held
            to = None
            if current is not None:
                job.look_wait, job.look_t = current.wait_seconds, self.t
                others = [o for o in offers if o.place_key in set(job.places)]
                to = placement.reconsider(current, others, self.policy,
                                          ordered=job.task.ordered, blocked=job.blocked,
                                          waited_s=self.t - job.spec.arrival, moves=job.moves,
                                          max_moves=self.knobs.max_moves, now=EPOCH + self.t,
                                          paid_min_wait=self.knobs.paid_min_wait)
            if to is None:
                self.at(self.t + self.sc.reprobe_interval,
                        lambda job=job, bj=bj, gen=gen: self._look(job, bj, gen))
                continue
            job.log.append((self.t, f"reconsider -> {to.place_key}: "
                                    f"{to.details.get('move_reason')}"))
            self._note(job, to)
            job.in_move = True
            self.at(self.t + self.sc.resume_s,
                    lambda job=job, bj=bj, current=current, to=to, gen=gen:
                    self._move(job, bj, current, to, gen))

    def _drop_note(self, job: Job) -> None:
        """``joint_looks``: a move decided by a look and not made: its note goes."""
        if self.knobs.joint_looks:
            name = _copy_name(job)
            self.entries[:] = [e for e in self.entries
                               if e["copy"] != name or e.get("submitted") is not None]

    def _gain_rate(self, job: Job) -> float:
        """``paid_priority``: the wait a job would save per second of a paid place's room."""
        left = 2 * H if job.look_wait is None else max(0.0, job.look_wait
                                                        - (self.t - job.look_t))
        return left / job.spec.limit

    def _defer_paid(self, job: Job, current: Offer, to: Offer) -> bool:
        """``paid_priority``: whether ``job`` leaves the paid room ``to`` to another waiting
        job that saves more wait per second of it (the room cannot take both)."""
        if not to.free_now or to.price_per_hour <= current.price_per_hour \
                or not isinstance(self.places[to.connection], AwsPlace):
            return False
        aws = self.places[to.connection]
        after = self.sc.aws_quota_vcpus - aws.used_vcpus() - AWS_TYPES[to.instance_type].vcpus
        mine = self._gain_rate(job)
        for k in self.jobs:
            if k is job or k.start is not None or k.copy is None or k.copy.state != "pending" \
                    or k.moves >= self.knobs.max_moves \
                    or not any(p.startswith(f"{to.connection}/") for p in k.places):
                continue
            need = min((i.vcpus for i in AWS_TYPES.values() if i.gpus == k.spec.gpus),
                       default=None)
            if need is None or need <= after:
                continue  # no AWS type for it, or the room takes both
            if self._gain_rate(k) > mine:
                job.log.append((self.t, f"paid room left to job{k.spec.id}"))
                return True
        return False

    def _count_move(self, job: Job, current: Offer, to: Offer) -> None:
        if to.place_key in job.left:
            self.back += 1  # back to a place it left
        job.left.add(current.place_key)
        wait_here = current.wait_seconds
        if to.price_per_hour > current.price_per_hour and wait_here is not None \
                and wait_here < 600:
            self.paid_short += 1  # to a paid place though its queue said < 10 min

    def _move(self, job: Job, bj: BJob, current: Offer, to: Offer, gen: int) -> None:
        """``Placer.move``: only a copy that still waits, and only if ``to``, probed again,
        still takes it as promised; cancel, confirm, block the place left for the cooldown (no
        back and forth), submit there; a refused submission places the job anew."""
        job.in_move = False
        if bj.state != "pending":  # it started meanwhile: it stays
            self._drop_note(job)
            return
        fresh = self._still_good(job, to)
        if fresh is None:  # the trigger keeps watching the copy where it is
            self._drop_note(job)
            self.at(self.t + self.sc.reprobe_interval, lambda: self._look(job, bj, gen))
            return
        self._count_move(job, current, fresh)
        self.places[job.where].cancel(bj, self.t)
        self._schedule(self.places[job.where])
        self._released(job.where)
        job.blocked.append(Blocked(current.place_key, "moved away from it", at=EPOCH + self.t,
                                   until=EPOCH + self.t + self.sc.block_cooldown))
        job.moves += 1
        self._submit_later(job, fresh, self.sc.cancel_s + self.sc.submit_s,
                           lambda: self._replace(job, None))

    def _still_good(self, job: Job, to: Offer) -> Offer | None:
        """``Placer._still_good``: ``to``'s connection probed afresh, less what the ledger
        holds; ``to``'s place if it still takes the job as promised (noted in the ledger)."""
        offers = self._hold(job, self.places[to.connection].offers(job.task, self.t,
                                                                   job.spec.limit))
        fresh = placement.as_promised(to, offers)
        if fresh is None:
            job.log.append((self.t, f"move to {to.place_key} refused: no longer as promised"))
            return None
        self._note(job, fresh)
        fresh.details.setdefault("move_reason", to.details.get("move_reason", ""))
        return fresh

    # SkyPilot's rule ------------------------------------------------------------------------
    def _sky_places(self, job: Job) -> list[Offer]:
        """The places that fit by shape, in SkyPilot's order: cheapest, then its cloud order;
        AWS with the exact GPU count (its catalog's matching, whatever our connection's
        ``larger_instances``), one AZ."""
        offers = [o for o in self._offers(job) if o.fits]
        exact_aws = []
        for o in offers:
            if o.backend != "aws":
                exact_aws.append(o)
            elif AWS_TYPES[o.instance_type].gpus == o.request.accelerator_count \
                    and o.location.endswith("a"):
                exact_aws.append(o)
        order = {c: i for i, c in enumerate(self.sc.sky_order)}
        return sorted(exact_aws, key=lambda o: (o.price_per_hour, order[o.connection]))

    def _sky_next(self, job: Job, first: bool = False) -> None:
        if first:  # where it fits by shape does not change
            job.sky_places = self._sky_places(job)
        places = job.sky_places
        if not places:
            return
        if job.sky_i and job.sky_i % len(places) == 0 and not job.sky_waited:
            first, factor, most = self.sc.sky_backoff  # a whole round failed: back off
            rounds = job.sky_i // len(places)
            gap = min(first * factor ** (rounds - 1), first * most)
            job.sky_waited = True
            self.at(self.t + gap, lambda: self._sky_next(job))
            return
        job.sky_waited = False
        offer = places[job.sky_i % len(places)]
        job.sky_i += 1
        if offer.backend == "aws" and not self._aws_room(offer):
            self.at(self.t + self.sc.sky_attempt_s, lambda: self._sky_next(job))
            return

        def land() -> None:
            if not self._submit(job, offer):  # the quota went meanwhile
                self._sky_next(job)

        self.at(self.t + self.sc.sky_attempt_s + self.sc.submit_s, land)

    def _aws_room(self, offer: Offer) -> bool:
        aws = self.places["aws"]
        return aws.used_vcpus() + AWS_TYPES[offer.instance_type].vcpus <= self.sc.aws_quota_vcpus

    def _sky_timeout(self, job: Job, bj: BJob) -> None:
        if bj.state != "pending":
            return
        self.places[job.where].cancel(bj, self.t)
        self._schedule(self.places[job.where])
        self._sky_next(job)

    # results --------------------------------------------------------------------------------
    def _result(self) -> Result:
        waits = [(j.start - j.spec.arrival) / 60 for j in self.jobs]
        waits_sorted = sorted(waits)
        p95 = waits_sorted[min(len(waits) - 1, math.ceil(0.95 * len(waits)) - 1)]
        first = min(j.spec.arrival for j in self.jobs)
        makespan = (max(j.end for j in self.jobs) - first) / H
        used = sum(j.spec.gpus * j.spec.actual / H for j in self.jobs if j.where == "aws")
        calib = [(e, w) for e, w in self.calib if e > 0]
        early = sum(w < e / 2 for e, w in calib) / len(calib) if calib else None
        ratio = statistics.median(w / e for e, w in calib) if calib else None
        false_free = sum(w > 300 for w in self.free_calls) / len(self.free_calls) \
            if self.free_calls else None
        return Result(
            strategy=self.strategy, seed=self.seed, knobs=self.knobs.label(), waits=waits,
            mean_wait_min=statistics.fmean(waits), p95_wait_min=p95, makespan_h=makespan,
            sweeps_wait_min=statistics.fmean([w for w, j in zip(waits, self.jobs, strict=True)
                                              if j.spec.sweep is not None] or [math.nan]),
            singles_wait_min=statistics.fmean([w for w, j in zip(waits, self.jobs, strict=True)
                                               if j.spec.sweep is None] or [math.nan]),
            cloud_usd=sum(j.cost for j in self.jobs),
            cloud_gpu_h_billed=sum(j.gpu_h_billed for j in self.jobs), cloud_gpu_h_used=used,
            idle_share=self.idle_area / self.total_area if self.total_area else 0.0,
            moves=sum(j.moves for j in self.jobs),
            refused=sum(j.refused for j in self.jobs), moves_back=self.back,
            moves_paid_short=self.paid_short,
            on_aws=sum(j.where == "aws" for j in self.jobs), est_early=early, est_ratio=ratio,
            false_free=false_free)


def _copy_name(job: Job) -> str:
    """The ledger's ``copy`` (``RunState.prefix``: one live copy per task instance)."""
    return f"job{job.spec.id}"


#: ``PlacementLedger.note`` writes the entries' shape (a ledger without a file: no lock, no I/O)
_NOTER = ledger.PlacementLedger("")


def simulate(strategy: str, seed: int, knobs: Knobs = Knobs(),
             sc: Scenario = Scenario()) -> Result:
    return Sim(sc, knobs, strategy, seed).run()


# --- the report ----------------------------------------------------------------------------------


@dataclass
class Summary:
    """One strategy under one configuration, over the seeds."""

    label: str
    results: list[Result]

    def vals(self, key: str) -> list[float]:
        return [getattr(r, key) for r in self.results if getattr(r, key) is not None]

    def mean(self, key: str) -> float:
        vals = self.vals(key)
        return statistics.fmean(vals) if vals else math.nan

    def spread(self, key: str, fmt: str = ".0f") -> str:
        vals = self.vals(key)
        if not vals:
            return "-"
        return f"{statistics.fmean(vals):{fmt}} ({min(vals):{fmt}}-{max(vals):{fmt}})"

    def ratio(self, other: Summary, key: str = "mean_wait_min") -> tuple[float, float, float]:
        """mean of ours / mean of theirs, and the per-seed range of the ratio."""
        per_seed = [a / b for a, b in zip(self.vals(key), other.vals(key), strict=True) if b]
        return (self.mean(key) / other.mean(key) if other.mean(key) else math.nan,
                min(per_seed, default=math.nan), max(per_seed, default=math.nan))


def run_many(strategies: list[str], seeds: list[int], knobs: Knobs = Knobs(),
             sc: Scenario = Scenario()) -> dict[str, Summary]:
    return {s: Summary(s, [simulate(s, seed, knobs, sc) for seed in seeds]) for s in strategies}


def _ratio_text(r: tuple[float, float, float], digits: int = 2) -> str:
    return f"{r[0]:.{digits}f}x ({r[1]:.2f}-{r[2]:.2f})"


def strategy_table(runs: dict[str, Summary]) -> str:
    sky, one = runs.get("skypilot"), runs.get("one-cluster")
    lines = ["| strategy | mean wait (min) | sweeps' jobs / single jobs | p95 wait (min) | "
             "makespan (h) | cloud $ | "
             "cloud GPU-h billed / used | on-prem GPUs idle while jobs wait | moves | "
             "wait vs SkyPilot's rule | wait vs one cluster | $ vs SkyPilot's rule |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in runs.items():
        cloud_sky = sky.mean("cloud_usd") if sky else math.nan
        dollars = s.mean("cloud_usd") / cloud_sky if cloud_sky else math.nan
        lines.append(
            f"| {name} | {s.spread('mean_wait_min')} | {s.mean('sweeps_wait_min'):.0f} / "
            f"{s.mean('singles_wait_min'):.0f} | {s.spread('p95_wait_min')} | "
            f"{s.spread('makespan_h', '.1f')} | {s.spread('cloud_usd')} | "
            f"{s.mean('cloud_gpu_h_billed'):.0f} / {s.mean('cloud_gpu_h_used'):.0f} | "
            f"{100 * s.mean('idle_share'):.0f}% ({100 * min(s.vals('idle_share')):.0f}-"
            f"{100 * max(s.vals('idle_share')):.0f}) | {s.mean('moves'):.0f} | "
            f"{_ratio_text(s.ratio(sky)) if sky else '-'} | "
            f"{_ratio_text(s.ratio(one)) if one else '-'} | "
            f"{dollars:.2f}x |")
    return "\n".join(lines)


def knob_table(rows: list[tuple[str, Summary]], sky: Summary) -> str:
    lines = ["| fastest+moves with | mean wait (min) | vs SkyPilot's rule | cloud $ | "
             "idle while waiting | moves | of which back to a place left | refused "
             "submissions | queued copies started in < half their estimate | real / "
             "estimated wait (median) | \"free now\" that then waited > 5 min |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, s in rows:
        lines.append(
            f"| {label} | {s.spread('mean_wait_min')} | {_ratio_text(s.ratio(sky))} | "
            f"{s.spread('cloud_usd')} | {100 * s.mean('idle_share'):.0f}% | "
            f"{s.mean('moves'):.0f} | {s.mean('moves_back'):.1f} | {s.mean('refused'):.1f} | "
            f"{100 * s.mean('est_early'):.0f}% | {s.mean('est_ratio'):.2f} | "
            f"{100 * s.mean('false_free'):.0f}% |")
    return "\n".join(lines)


def verdict(best: Summary, sky: Summary, one: Summary) -> list[str]:
    wait_sky = best.ratio(sky)
    wait_one = best.ratio(one)
    spend = best.mean("cloud_usd") / sky.mean("cloud_usd")
    idle = best.mean("idle_share")
    ok = lambda b: "met" if b else "MISSED"  # noqa: E731
    return [
        f"- mean wait <= 0.7x SkyPilot's rule: {wait_sky[0]:.3f}x -> {ok(wait_sky[0] <= 0.7)}"
        + ("" if wait_sky[0] <= 0.7 else f" (by {wait_sky[0] - 0.7:.2f}x; "
           f"{best.mean('mean_wait_min') - 0.7 * sky.mean('mean_wait_min'):.1f} min a job)"),
        f"- at no more cloud spend: {spend:.3f}x SkyPilot's -> {ok(spend <= 1.0)}",
        f"- mean wait <= 0.3x one cluster: {wait_one[0]:.2f}x -> {ok(wait_one[0] <= 0.3)}",
        f"- on-prem GPUs idle while jobs wait < 10%: {100 * idle:.1f}% -> {ok(idle < 0.1)}",
    ]


def variant_table(seeds: list[int], sc: Scenario) -> str:
    """The same comparison on other bursts and clusters (each against SkyPilot's rule on the
    same variant)."""
    variants = (
        ("as above", sc),
        ("no sweeps (40 single jobs)", replace(sc, sweeps=())),
        ("a sweep's members place 5 s apart (separate workers)",
         replace(sc, sweep_stagger_s=5.0)),
        ("lighter load (short queues, K8s 75% busy, 0.75/0.65 after)",
         replace(sc, queue_alpha=2, queue_beta=1, k8s_busy=0.75, load_slurm=0.75,
                 load_k8s=0.65)),
        ("AWS quota 768 vCPUs", replace(sc, aws_quota_vcpus=768)),
        ("AWS quota 192 vCPUs", replace(sc, aws_quota_vcpus=192)),
        ("SkyPilot's rule tries Slurm before Kubernetes",
         replace(sc, sky_order=("slurm_alpha", "slurm_beta", "k8s", "aws"))),
        ("the Kubernetes estimate reads the other users' run times (before the fifth run)",
         replace(sc, k8s_history="others")),
    )
    lines = ["| variant | SkyPilot's rule: wait, $ | fastest (the code now): wait, vs SkyPilot | "
             "fastest+moves (the code now): wait, $, vs SkyPilot | fastest+moves (every "
             "what-if): wait, $, vs SkyPilot |", "|---|---|---|---|---|"]
    for label, scn in variants:
        sky = Summary("skypilot", [simulate("skypilot", seed, Knobs(), scn) for seed in seeds])
        fast = Summary("fastest", [simulate("fastest", seed, Knobs(), scn) for seed in seeds])
        now = Summary("fastest+moves", [simulate("fastest+moves", seed, Knobs(), scn)
                                        for seed in seeds])
        best = Summary("fastest+moves", [simulate("fastest+moves", seed, ALL_KNOBS, scn)
                                         for seed in seeds])
        lines.append(f"| {label} | {sky.mean('mean_wait_min'):.0f} min, "
                     f"${sky.mean('cloud_usd'):.0f} | {fast.mean('mean_wait_min'):.0f} min, "
                     f"{_ratio_text(fast.ratio(sky))} | {now.mean('mean_wait_min'):.0f} min, "
                     f"${now.mean('cloud_usd'):.0f}, {_ratio_text(now.ratio(sky))} | "
                     f"{best.mean('mean_wait_min'):.0f} min, "
                     f"${best.mean('cloud_usd'):.0f}, {_ratio_text(best.ratio(sky))} |")
    return "\n".join(lines)


#: the real behaviours (each can be withheld to see what it is worth), the connection settings
#: (row label, knob, value) and the what-ifs
REAL_KNOBS = ("slurm_estimate", "slurm_free", "own_estimate", "k8s_estimate", "herd_avoid")
SETTINGS = (("with larger_instances: true", "aws_types", "exact-first"),
            ("with paid_move_min_wait=0 (before 2026-12-03)", "paid_min_wait", 0.0))
WHAT_IFS = (("own_estimate", "queue+k8s"),)


def knob_variants(quick: bool) -> list[tuple[str, Knobs]]:
    now = Knobs()
    rows = [("the code now", now), ("Step 7's backends", STEP7)]
    if not quick:
        rows += [(f"without {f} ({getattr(STEP7, f)})", replace(now, **{f: getattr(STEP7, f)}))
                 for f in REAL_KNOBS]
        rows.append(("without the running jobs' list (slurm_estimate=discounted)",
                     replace(now, slurm_estimate="discounted")))
    rows += [(label, replace(now, **{f: v})) for label, f, v in SETTINGS]
    rows += [(f"+ {f}={v}", replace(now, **{f: v})) for f, v in WHAT_IFS]
    if len(WHAT_IFS) > 1:
        rows.append(("every what-if", ALL_KNOBS))
        if not quick:
            rows += [(f"every what-if but {f}", replace(ALL_KNOBS, **{f: getattr(now, f)}))
                     for f, _ in WHAT_IFS]
    return rows


def before_after_table(step7: dict[str, Summary], now: dict[str, Summary],
                       sky: Summary) -> str:
    lines = ["| strategy | Step 7's backends: wait, vs SkyPilot's rule, $ vs | the code now: "
             "wait, vs SkyPilot's rule, $ vs |", "|---|---|---|"]
    for name in step7:
        cells = []
        for runs in (step7, now):
            r = runs[name]
            cells.append(f"{r.mean('mean_wait_min'):.0f} min, {_ratio_text(r.ratio(sky))}, "
                         f"{r.mean('cloud_usd') / sky.mean('cloud_usd'):.2f}x")
        lines.append(f"| {name} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


#: the strategies run again on many seeds (one seed's burst swings the ratios by +-0.15x)
WIDE_STRATEGIES = ("fastest", "fastest+moves", "fastest+race", "fastest+race+moves",
                   "one-cluster", "skypilot")


def report(seeds: list[int], quick: bool, sc: Scenario = Scenario(),
           wide_seeds: list[int] | None = None) -> tuple[str, dict]:
    t0 = time.perf_counter()
    out: list[str] = []
    raw: dict[str, Any] = {"seeds": seeds, "scenario": asdict(sc), "runs": {}}
    strategies = list(STRATEGIES)
    knobbed = [s for s in strategies if s not in ("one-cluster", "skypilot")]
    now = run_many(strategies, seeds, Knobs(), sc)
    sky, one = now["skypilot"], now["one-cluster"]
    step7 = run_many(knobbed, seeds, STEP7, sc)
    full = run_many(knobbed, seeds, ALL_KNOBS, sc)
    full = {**full, "one-cluster": one, "skypilot": sky}
    out.append(f"### Strategies, the code now (seeds {seeds[0]}-{seeds[-1]}: mean (min-max))\n")
    out.append(strategy_table(now))
    out.append("\n### Before and after: Step 7's backends and the code now\n")
    out.append(before_after_table(step7, {k: now[k] for k in knobbed}, sky))
    out.append(f"\n### Strategies with every what-if on ({ALL_KNOBS.label()})\n")
    out.append("SkyPilot's rule and one cluster are the runs above.\n")
    out.append(strategy_table(full))
    rows = []
    for label, knobs in knob_variants(quick):
        s = now["fastest+moves"] if label == "the code now" else \
            step7["fastest+moves"] if label == "Step 7's backends" else \
            full["fastest+moves"] if label == "every what-if" else \
            Summary("fastest+moves", [simulate("fastest+moves", seed, knobs, sc)
                                      for seed in seeds])
        rows.append((label, s))
    out.append("\n### What each behaviour is worth (fastest+moves)\n")
    out.append(knob_table(rows, sky))
    sens: list[tuple[str, Summary]] = []
    if not quick:
        for label, k, scn, share in (
                ("the code now, reprobe every 30 s", Knobs(),
                 replace(sc, reprobe_interval=30), None),
                ("the code now, reprobe every 120 s", Knobs(),
                 replace(sc, reprobe_interval=120), None),
                ("the code now, max_moves=1", replace(Knobs(), max_moves=1), sc, None),
                ("the code now, max_moves=6", replace(Knobs(), max_moves=6), sc, None),
                ("the code now, MOVE_GAIN_SHARE=0.25", Knobs(), sc, 0.25),
                ("every what-if, MOVE_GAIN_SHARE=0.25", ALL_KNOBS, sc, 0.25)):
            saved = placement.MOVE_GAIN_SHARE
            placement.MOVE_GAIN_SHARE = share if share is not None else saved
            try:
                sens.append((label, Summary("fastest+moves", [
                    simulate("fastest+moves", seed, k, scn) for seed in seeds])))
            finally:
                placement.MOVE_GAIN_SHARE = saved
        out.append("\n### Operator settings (fastest+moves)\n")
        out.append(knob_table(sens, sky))
        out.append("\n### Scenario variants\n")
        out.append(variant_table(seeds, sc))
    for label, runs in (("the code now", now), ("Step 7's backends", step7)):
        fast = runs["fastest"]
        out.append(f"\nCalibration, fastest with {label}: {100 * fast.mean('est_early'):.0f}% "
                   "of the copies queued on an estimate started in less than half of it (the "
                   f"issue measured 45%); median real/estimated wait "
                   f"{fast.mean('est_ratio'):.2f}; {100 * fast.mean('false_free'):.0f}% of "
                   "on-prem \"free now\" offers were followed by a wait over 5 minutes there.")
    wide: dict[str, Summary] = {}
    if wide_seeds:
        wide = run_many(WIDE_STRATEGIES, wide_seeds, Knobs(), sc)
        wide["fastest+race+moves, Slurm queues only"] = Summary("fastest+race+moves", [
            simulate("fastest+race+moves", seed, Knobs(), replace(sc, race_backends=("slurm",)))
            for seed in wide_seeds])
        out.append(f"\n### Across {len(wide_seeds)} seeds ({wide_seeds[0]}-{wide_seeds[-1]}), "
                   "the code now\n")
        out.append(strategy_table(wide))
    best_now = min(("fastest+moves", "fastest+race+moves", "fastest+race"),
                   key=lambda n: now[n].mean("mean_wait_min"))
    best_full = min(("fastest+moves", "fastest+race+moves", "fastest+race"),
                    key=lambda n: full[n].mean("mean_wait_min"))
    out.append("\n### Targets\n")
    for name, runs in (("fastest+moves, Step 7's backends", step7["fastest+moves"]),
                       ("fastest+moves, the code now", now["fastest+moves"]),
                       (f"{best_now}, the code now (best)", now[best_now]),
                       (f"{best_full}, every what-if (best)", full[best_full])):
        out.append(f"{name}:")
        out += verdict(runs, sky, one)
    for name in ("fastest+moves", "fastest+race+moves"):
        if name in wide:
            out.append(f"{name}, the code now, {len(wide_seeds)} seeds:")
            out += verdict(wide[name], wide["skypilot"], wide["one-cluster"])
    # the issue's burst as it describes it: 40 mixed GPU jobs, none of them a sweep's
    single = replace(sc, sweeps=())
    for group in (seeds, wide_seeds or []):
        if not group:
            continue
        runs = run_many(["fastest+moves", "skypilot", "one-cluster"], group, Knobs(), single)
        out.append(f"fastest+moves, the code now, the issue's burst (40 single jobs, no "
                   f"sweeps), seeds {group[0]}-{group[-1]}:")
        out += verdict(runs["fastest+moves"], runs["skypilot"], runs["one-cluster"])
        raw["runs"][f"single_jobs_{len(group)}"] = {
            k: [r.row() for r in v.results] for k, v in runs.items()}
    elapsed = time.perf_counter() - t0
    out.append(f"\n({len(seeds)} seeds, {elapsed:.0f} s)")
    for name, runs in (("now", now), ("step7", step7), ("every_what_if", full)):
        raw["runs"][name] = {k: [r.row() for r in v.results] for k, v in runs.items()}
    raw["runs"]["knobs"] = {label: [r.row() for r in s.results] for label, s in rows + sens}
    raw["runs"]["wide"] = {k: [r.row() for r in v.results] for k, v in wide.items()}
    return "\n".join(out), raw


def summary_rows(quick: bool) -> list[tuple[str, str, str]]:
    """Rows for ``benchmarks/run.py``'s table."""
    seeds = [0, 1] if quick else [0, 1, 2, 3, 4]
    now = run_many(["fastest", "fastest+moves", "one-cluster", "skypilot"], seeds)
    sky, one = now["skypilot"], now["one-cluster"]
    rows = []
    for label, s in (("fastest, the code now", now["fastest"]),
                     ("fastest+moves, the code now", now["fastest+moves"])):
        r = s.ratio(sky)
        rows.append((f"scheduling: {label}, mean wait vs SkyPilot's rule",
                     f"{r[0]:.2f}x ({s.mean('mean_wait_min'):.0f} vs "
                     f"{sky.mean('mean_wait_min'):.0f} min), vs one cluster "
                     f"{s.ratio(one)[0]:.2f}x",
                     f"seeds {seeds[0]}-{seeds[-1]}: {r[1]:.2f}-{r[2]:.2f}x; cloud $ "
                     f"{s.mean('cloud_usd') / sky.mean('cloud_usd'):.2f}x; idle "
                     f"{100 * s.mean('idle_share'):.0f}%"))
    return rows


def _parse_value(text: str) -> Any:
    """A number, True/False, a tuple (``sweeps=()``, ``gpu_counts=(1,2)``), else the text."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    if text.startswith("("):
        value = ast.literal_eval(text)
        return value if isinstance(value, tuple) else (value,)
    return {"True": True, "False": False}.get(text, text)


def _assignments(items: list[str] | None) -> dict[str, Any]:
    return {k: _parse_value(v) for k, _, v in (i.partition("=") for i in items or [])}


def compare(strategies: list[str], seeds: list[int], knobs: Knobs, sc: Scenario,
            breakdown: bool = False) -> str:
    """``--only``: the named strategies (under ``knobs``) against SkyPilot's rule (the default
    knobs) on ``seeds``: mean wait, its ratio, cloud $ and its ratio; ``--breakdown``: each
    strategy's mean wait by job class and by the place the job started."""
    sims: dict[str, list[Sim]] = {}
    for name in ["skypilot", *[n for n in strategies if n != "skypilot"]]:
        sims[name] = []
        for seed in seeds:
            sim = Sim(sc, Knobs() if name in ("skypilot", "one-cluster") else knobs, name, seed)
            sim.result = sim.run()
            sims[name].append(sim)
    runs = {n: Summary(n, [sim.result for sim in v]) for n, v in sims.items()}
    sky = runs["skypilot"]
    one = runs.get("one-cluster")
    lines = [f"seeds {seeds[0]}-{seeds[-1]} ({len(seeds)}), knobs: {knobs.label()}",
             "| strategy | mean wait (min) | sweeps / singles | p95 wait (min) | "
             "vs SkyPilot's rule | vs one cluster | cloud $ | $ vs SkyPilot's | "
             "on-prem GPUs idle while jobs wait | moves | queued copies started in < half "
             "their estimate | real / estimated wait (median) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for n, r in runs.items():
        lines.append(f"| {n} | {r.mean('mean_wait_min'):.2f} | {r.mean('sweeps_wait_min'):.1f} "
                     f"/ {r.mean('singles_wait_min'):.1f} | {r.mean('p95_wait_min'):.0f} | "
                     f"{_ratio_text(r.ratio(sky), 3)} | "
                     f"{_ratio_text(r.ratio(one), 3) if one else '-'} | "
                     f"{r.mean('cloud_usd'):.0f} | "
                     f"{r.mean('cloud_usd') / sky.mean('cloud_usd'):.3f}x | "
                     f"{100 * r.mean('idle_share'):.1f}% | "
                     f"{r.mean('moves'):.1f} | {100 * r.mean('est_early'):.0f}% | "
                     f"{r.mean('est_ratio'):.2f} |")
    if breakdown:
        total = len(seeds) * sc.jobs
        for n, v in sims.items():
            classes: dict[str, list[float]] = {}
            for sim in v:
                for j in sim.jobs:
                    w = (j.start - j.spec.arrival) / 60
                    kind = "sweep" if j.spec.sweep is not None else "single"
                    for key in (f"{kind} {j.spec.gpus} GPU", f"{kind} (all)",
                                f"{j.spec.gpus} GPU (all)", f"started on {j.where}",
                                f"{j.spec.gpus} GPU on {j.where}"):
                        classes.setdefault(key, []).append(w)
            lines.append(f"\n{n}: class | jobs | mean wait (min) | share of the mean (min)")
            for key in sorted(classes):
                ws = classes[key]
                lines.append(f"| {key} | {len(ws)} | {statistics.fmean(ws):.1f} | "
                             f"{sum(ws) / total:.2f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 seeds, fewer knob rows")
    parser.add_argument("--seeds", help="comma-separated seeds (default 0-4; --quick 0,1)")
    parser.add_argument("--wide", type=int, default=None,
                        help="also run the main strategies on seeds 0..N-1 (default 40; "
                             "--quick 0: none)")
    parser.add_argument("--json", help="write every run's numbers to this file")
    parser.add_argument("--only", help="only these strategies (comma-separated), against "
                        "SkyPilot's rule: a short table")
    parser.add_argument("--knob", action="append", help="with --only: a Knobs field, k=v")
    parser.add_argument("--scenario", action="append",
                        help="with --only: a Scenario field, k=v")
    parser.add_argument("--breakdown", action="store_true",
                        help="with --only: the mean wait by job class and where jobs started")
    args = parser.parse_args()
    if args.only:
        seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else [0, 1, 2, 3, 4]
        print(compare(args.only.split(","), seeds, Knobs(**_assignments(args.knob)),
                      Scenario(**_assignments(args.scenario)), args.breakdown))
        return 0
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else \
        [0, 1] if args.quick else [0, 1, 2, 3, 4]
    wide = args.wide if args.wide is not None else 0 if args.quick else 40
    text, raw = report(seeds, args.quick, wide_seeds=list(range(wide)))
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(raw, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
