"""What a cluster can offer a task, from one probe: offers per candidate and partition, and the
``show-gpus`` rows.

The "clouds" side of the backend: no I/O here, only a :class:`ClusterState` read against the
task. A partition is a node pool: its nodes (those with the requested GPU type, when one is
asked for) go through the shared fit rule (:func:`fit_pool`, with at least one CPU, as Slurm
allocates one to every job); a GPU type under several GRES names there is offered by the name
whose nodes start the job soonest. Prices come from the connection's extras.

- **Fit**: the task's time limit (its own ``--time``, or the connection's) over the
  partition's MaxTime does not fit: Slurm would keep it pending for ever (PartitionTimeLimit);
  nor one that would run past the end of the reservation the connection's jobs run in
  (extra ``reservation``): Slurm would start it and end it there (TIMEOUT).
- **Free now** only when Slurm would start the job now: idle resources that pending jobs
  ahead will take before the job would end (backfill's plan, or jobs just submitted that fit
  them now: placements made moments ago, ours or others') are held, not free
  (:func:`.queue.hold`; ``details["reserved_by_pending"]``).
- **Estimate** when not free now: Slurm's own (``sbatch --test-only`` with the task's and the
  connection's sbatch options), or, for a GPU candidate without options that pin it
  (``--begin``, ``--nodelist``... the task's, or the connection's ``constraint`` and its
  ``sbatch_options``: :func:`pinning`), when sooner, the hole backfill's plan leaves for the
  job's time limit (:mod:`.backfill`: test-only on 22.05 ignores backfill), discounted by
  how jobs really end on the cluster (the median elapsed/limit of its recent finished jobs,
  when there are enough: :func:`.queue.history_ratio`).
- **Pinned**: where such options may keep the job off idle nodes, test-only's "later" beside
  idle nodes is trusted even with jobs queued in the partition (the probe cannot see node
  features). The nodes ``--exclude``/``--nodelist`` (the task's or the connection's) rule out
  are not counted at all; the connection's host lists then pin nothing more.
- A CPU-only candidate on a partition whose free nodes all have GPUs is marked
  ``details["gpu_place"]`` (ranking prefers places without GPUs for it).

``Offer.notes`` say the same in the placement table's words.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from airflow_skypilot.backends.base import CapacityRow, Offer
from airflow_skypilot.backends.common.fit import PoolNode, fit_pool, hourly_price, shape
from airflow_skypilot.backends.slurm.backfill import Need, backfill_start
from airflow_skypilot.backends.slurm.cluster import ClusterState, NodeInfo, Shape
from airflow_skypilot.backends.slurm.queue import (
    Discount,
    Reservation,
    Room,
    duration_s,
    duration_text,
    expand_hostlist,
    hold,
)
from airflow_skypilot.backends.slurm.settings import (
    BACKEND,
    NEUTRAL_OPTIONS,
    SlurmSettings,
    task_constraints,
    task_sbatch_options,
    time_option,
)
from airflow_skypilot.spec import accelerators as acc
from airflow_skypilot.spec import fields, sbatch
from airflow_skypilot.spec.task import ResourceRequest, Task

#: a start estimate further away than this is no estimate (jobs without time limits)
_HORIZON_S = 30 * 86400
#: idle resources held for a job ahead: the soonest a "held" offer says it could start
HELD_MIN_WAIT_S = 60.0
#: what ``sbatch --test-only`` says when Slurm would refuse the job there
_REFUSALS = ("not available", "violates", "invalid", "exceed")
#: connection options that keep its jobs off no idle node: limits, not nodes (account, qos),
#: and the reservation, read from the reservations themselves (:func:`_for_connection`)
_CONNECTION_NEUTRAL = NEUTRAL_OPTIONS | {"account", "qos", "reservation"}


def applies(req: ResourceRequest, settings: SlurmSettings) -> bool:
    """Does the candidate's infra filter allow this cluster at all?"""
    return fields.infra_matches(req.infra, settings.infra()) or (
        req.infra is not None and req.infra.startswith(f"{settings.infra()}/"))


def probe_shapes(task: Task, settings: SlurmSettings) -> list[Shape]:
    """The job shapes to ask ``sbatch --test-only`` about, one per distinct candidate."""
    return sorted({shape_of(req, task.num_nodes) for req in task.candidates
                   if applies(req, settings)})


def shape_of(req: ResourceRequest, num_nodes: int) -> Shape:
    """The ``--test-only`` question for a candidate: (GPUs per node, nodes, CPUs, MB)."""
    gpus, cpus, mem_gb = shape(req)
    return gpus, num_nodes, int(cpus), int(mem_gb * 1024)


def offers(task: Task, state: ClusterState, settings: SlurmSettings, conn_id: str,
           unsupported: Callable[[Task, ResourceRequest], str]) -> list[Offer]:
    """One offer per candidate and partition the candidate's infra allows.

    ``unsupported`` says why the backend can never run a candidate ("" when it might): the
    backend's :meth:`~airflow_skypilot.backends.base.Backend.unsupported`.
    """
    out = []
    discount = state.discount
    state, own = _for_connection(state, settings)
    for req in task.candidates:
        if not applies(req, settings):
            continue
        why = unsupported(task, req)
        for part in sorted(state.partitions):
            if not fields.infra_matches(req.infra, settings.infra(part)):
                continue
            out.append(offer_at(task, req, part, state, settings, conn_id, why, discount,
                                own_reservation=own))
    return out


def pinning(task: Task, settings: SlurmSettings) -> list[str]:
    """The options, as given, that may keep Slurm from starting the job where resources are
    idle: the task's own (:func:`.settings.task_constraints`), then the connection's
    (``--constraint`` from extra ``constraint``, and its ``sbatch_options``: not a host list
    of ``--exclude``/``--nodelist``, whose nodes :func:`_allowed_nodes` leaves out already):
    one text per side that has any, naming whose they are."""
    try:
        options = sbatch.parse_tokens(settings.common_sbatch_args())
    except sbatch.OptionError:
        options = []
    conn = [o.given for o in options if sbatch.canonical(o.name) not in _CONNECTION_NEUTRAL
            and not _host_list(o)]
    return [f"the {whose} {' '.join(given)}" for whose, given in
            (("task's", task_constraints(task)), ("connection's", conn)) if given]


def _allowed_nodes(task: Task, settings: SlurmSettings, nodes: list[NodeInfo]
                   ) -> tuple[list[NodeInfo], str]:
    """``nodes`` without those ``--exclude`` rules out and, given ``--nodelist``, those it does
    not name (the task's options and the connection's; a file name is not read), and the
    options that ruled some out ("" when none did)."""
    try:
        options = sbatch.parse_tokens(task_sbatch_options(task) + settings.common_sbatch_args())
    except sbatch.OptionError:
        return nodes, ""
    excluded: set[str] = set()
    named: set[str] | None = None
    used = []
    for o in options:
        if not (kind := _host_list(o)):
            continue
        hosts = set(expand_hostlist(o.value or ""))
        if kind == "exclude":
            excluded |= hosts
        else:
            named = hosts if named is None else named | hosts
        used.append(o.given)
    kept = [n for n in nodes if n.name not in excluded and (named is None or n.name in named)]
    return kept, " ".join(used) if len(kept) < len(nodes) else ""


def _host_list(option: sbatch.Option) -> str:
    """``exclude`` or ``nodelist`` when ``option`` is one of them with a host list (not a file
    name), else ""."""
    kind = sbatch.canonical(option.name)
    return kind if kind in ("exclude", "nodelist") and option.value \
        and "/" not in option.value else ""


def _pool_node(node: NodeInfo, gres_type: str, room: Room | None = None) -> PoolNode:
    """A node as the fit rule sees it: what is idle, or ``room`` (what is left of it once the
    pending jobs ahead took theirs)."""
    if room is None:
        gpus_free, cpus_free, mem_free = node.gpus_free(gres_type), node.cpus_free, \
            node.mem_free_mb
    else:
        gpus_free, cpus_free, mem_free = room.gpus.get(gres_type, 0), room.cpus, room.mem_mb
    return PoolNode(name=node.name, cpus=node.cpus_total, cpus_free=cpus_free,
                    memory_gb=node.mem_total_mb / 1024, memory_free_gb=mem_free / 1024,
                    gpus=node.gpus.get(gres_type, 0), gpus_free=gpus_free,
                    usable=node.usable)


def _rooms(st: ClusterState) -> dict[str, Room]:
    return {n.name: Room(gpus={t: n.gpus_free(t) for t in n.gpus}, cpus=n.cpus_free,
                         mem_mb=n.mem_free_mb) for n in st.nodes.values() if n.usable}


def _takes(node: PoolNode, req: ResourceRequest) -> bool:
    """Could this node take one node's share of ``req`` now (Slurm's one CPU at least)?"""
    gpus, cpus, mem = shape(req)
    return node.usable and node.gpus_free >= gpus and node.cpus_free >= max(cpus, 1) \
        and node.memory_free_gb >= mem


def offer_at(task: Task, req: ResourceRequest, part: str, st: ClusterState,
             settings: SlurmSettings, conn_id: str, unsupported: str = "",
             discount: Discount | None = None,
             own_reservation: Reservation | None = None, gres: str | None = None) -> Offer:
    """Candidate ``req`` in partition ``part``: does it fit (shape, MaxTime, the end of the
    reservation its jobs run in: ``own_reservation``), is it free now (beside the pending jobs
    ahead), when could it start (Slurm's estimate, discounted by ``discount``), at what
    price. Its GPU type under several GRES names there (``h100``, ``nvidia_h100_80gb_hbm3``):
    the offer of the one that starts it soonest (free now, then most free; ``gres``: that
    one's)."""
    s = settings
    info = st.partitions[part]
    nodes, ruled_out_by = _allowed_nodes(task, s, st.nodes_in(part))
    offer = Offer(connection=conn_id, backend=BACKEND, location=part, infra=s.infra(part),
                  request=req, num_nodes=task.num_nodes, accelerator=req.accelerator,
                  gpus_per_node=req.accelerator_count, nodes_total=len(nodes),
                  pending_jobs=info.pending, probed_at=st.now,
                  shares_capacity_with=sorted({f"{conn_id}/{p}" for n in nodes
                                               for p in n.partitions if p != part}),
                  details={"cluster": s.cluster, "partition": part}, jobs_seen=st.our_jobs)

    def no(reason: str) -> Offer:
        offer.fits, offer.reason = False, reason
        return offer

    if s.partitions and part not in s.partitions:
        return no(f"partition {part} is not allowed by connection {conn_id} "
                  f"(allowed: {', '.join(s.partitions)})")
    if not info.up:
        return no(f"partition {part} is down")
    if not nodes and ruled_out_by:
        return no(f"{ruled_out_by} leaves no node of partition {part}")
    if unsupported:
        return no(unsupported)
    asked = time_option(task, s)
    asked_s = duration_s(asked) if asked else None
    max_s = info.max_time_s
    if asked_s is not None and max_s is not None and asked_s > max_s:
        return no(f"asks --time={asked} ({duration_text(asked_s)}); partition {part} allows "
                  f"at most {duration_text(max_s)} (MaxTime): Slurm would keep it pending")
    limit_s = asked_s if asked_s is not None else info.default_time_s
    if limit_s is not None:
        offer.details["time_limit"] = duration_text(limit_s)
    if own_reservation is not None and own_reservation.end < math.inf:
        # Slurm starts a job in a reservation whatever its time limit, and ends it with the
        # reservation (TIMEOUT; ResvOverRun 0 by default): measured on the sandbox
        left = own_reservation.end - max(st.now, own_reservation.start)
        ends = f"reservation {own_reservation.name} ends in {duration_text(max(0.0, left))}"
        if limit_s is not None and math.isfinite(limit_s) and limit_s > left:
            return no(f"time limit {duration_text(limit_s)}; {ends}: Slurm would end the job "
                      "then (TIMEOUT)")
        if limit_s is None or not math.isfinite(limit_s):
            offer.notes.append(f"{ends}: Slurm ends the job then")
    gres_type = ""
    if req.accelerator:
        if not float(req.accelerator_count).is_integer():
            return no(f"{req.accelerator}:{req.accelerator_count}: Slurm allocates whole GPUs")
        types = sorted({t for n in nodes for t in n.gpus})
        matching = [t for t in types if t and acc.same_accelerator(req.accelerator, t)]
        if not matching:
            have = ", ".join(t or "untyped gpu" for t in types) or "no GPUs"
            return no(f"no {req.accelerator} in partition {part} (has: {have})")
        if gres is None and len(matching) > 1:
            tries = [offer_at(task, req, part, st, settings, conn_id, unsupported, discount,
                              own_reservation, gres=t) for t in matching]
            return min(enumerate(tries), key=lambda io: _soonest(*io))[1]
        gres_type = gres if gres is not None else matching[0]
        nodes = [n for n in nodes if n.gpus.get(gres_type, 0) > 0]
        # the canonical name, as every backend's offers and capacity rows say it; submit
        # asks Slurm for the GRES type it was configured with (details["gres_type"])
        offer.accelerator = acc.canonical_from_label(gres_type)
        offer.details["gres_type"] = gres_type
    fit = fit_pool([_pool_node(n, gres_type) for n in nodes], req, task.num_nodes, part,
                   min_cpus=1)
    if req.accelerator:
        offer.gpus_total, offer.gpus_free = fit.gpus_total, fit.gpus_free
    if fit.reason:
        return no(fit.reason)
    need = shape(req)[0]
    # what the pending jobs ahead take of the idle resources before this job would end
    held = hold(_rooms(st), [n.name for n in nodes], st.pending_jobs,
                {n.name: n.partitions for n in st.nodes.values()}, now=st.now,
                time_limit_s=limit_s, gres_type=gres_type, user=st.user,
                planned=[n.name for n in st.nodes.values() if n.planned],
                reservations=st.reservations)
    pool = [_pool_node(n, gres_type, held.room.get(n.name, Room({}, 0, 0))) for n in nodes]
    after = fit_pool(pool, req, task.num_nodes, part, min_cpus=1)
    offer.nodes_free = after.nodes_free
    offer.nodes_total = fit.nodes_total
    if req.accelerator:
        offer.gpus_free = after.gpus_free
    ours = [j.job_id for j in st.pending_jobs if st.user and j.user == st.user
            and part in j.partitions]
    offer.details.update({"gres_type": gres_type, "gpus_per_node": need,
                          "usable_nodes": sum(n.usable for n in nodes),
                          "nodes_idle": fit.nodes_free, "pending_ours": len(ours)})
    if req.accelerator:
        offer.details["gpus_idle"] = fit.gpus_free
    if held.reservations:
        offer.details["held_for_reservations"] = held.reservations
        what = f"{held.reserved_gpus} idle {offer.accelerator}" if held.reserved_gpus \
            else "idle nodes"
        offer.notes.append(f"{what} held for reservation(s) {', '.join(held.reservations)} "
                           "starting before it would end")
    if held.jobs and (held.gpus or after.nodes_free < fit.nodes_free):
        offer.details.update({"reserved_by_pending": held.gpus, "held_for": held.jobs[:20]})
        what = f"{held.gpus} idle {offer.accelerator}" if held.gpus else "idle nodes"
        mine = f", {len(held.ours)} of them ours" if held.ours else ""
        offer.notes.append(f"{what} held for {len(held.jobs)} pending job(s) ahead{mine}")
    if not req.accelerator:
        takers = [p for p in pool if _takes(p, req)]
        gpu_nodes = {n.name for n in nodes if n.gpus}
        offer.details["gpu_place"] = all(p.name in gpu_nodes for p in (takers or pool))
        if offer.details["gpu_place"]:
            offer.notes.append("CPU-only on GPU nodes")
    start = st.starts.get((part, gres_type, *shape_of(req, task.num_nodes)))
    own = pinning(task, s)
    # test-only's "later" beside idle nodes is its pessimism about the queue ahead, unless
    # nothing is queued there or the task's or the connection's options (--begin,
    # --nodelist, --constraint...) explain it
    queued_here = any(part in j.partitions for j in st.pending_jobs)
    trust_later = bool(own) or not queued_here
    later = isinstance(start, float) and start > st.now + HELD_MIN_WAIT_S
    # not free now (beside the jobs ahead): when backfill's plan has a hole for it
    hole = None if own or isinstance(start, str) or offer.nodes_free >= task.num_nodes \
        else _backfill_hole(st, nodes, gres_type, req, task.num_nodes, limit_s)
    if isinstance(start, float) and start - st.now < _HORIZON_S:
        offer.details["test_only_start"] = max(start, st.now)
    if hole is not None and (not isinstance(start, float) or hole < start):
        offer.details["backfill_start"] = hole
        start = hole
        basis = "backfill's plan (squeue: the running and pending jobs' time limits)"
    else:
        basis = "sbatch --test-only"
    if isinstance(start, float):
        if start - st.now < _HORIZON_S:
            raw = max(start, st.now)
            est = raw
            if own:
                basis += f" with {'; '.join(own)}"
            elif discount is not None:  # time limits are not run times: what jobs really use
                if discount.ratio is not None:
                    est = st.now + (raw - st.now) * discount.ratio
                basis += f", {discount.describe()}"
            offer.est_start = est
            offer.details["estimate"] = basis
        else:  # jobs without time limits make Slurm answer "in decades": that is unknown
            offer.details["test_only"] = "no start estimate within 30 days"
            offer.details["estimate"] = "unknown"
    elif isinstance(start, str) and start:
        offer.details["test_only"] = start
        if any(word in start.lower() for word in _REFUSALS):
            return no(f"Slurm refuses this shape in {part}: {start}")
    if offer.nodes_free >= task.num_nodes and later and trust_later:
        offer.nodes_free = 0  # idle, but Slurm says it will not start it now
        why = "; ".join(own) if own else "nothing queued here"
        offer.notes.append(f"idle, but sbatch --test-only says later ({why})")
    if offer.nodes_free >= task.num_nodes:
        offer.est_start = st.now
    else:
        if fit.nodes_free >= task.num_nodes and offer.est_start is not None:
            # idle but held: not before the jobs ahead have taken their share
            offer.est_start = max(offer.est_start, st.now + HELD_MIN_WAIT_S)
        if "estimate" in offer.details:
            offer.notes.append(f"est. by {offer.details['estimate']}")
    offer.price_per_hour = hourly_price(task.num_nodes, need, s.price_per_gpu_hour,
                                        s.price_per_node_hour)
    return offer


def _soonest(index: int, offer: Offer) -> tuple:
    """Which offer of several starts the job soonest: fitting, free now or the soonest
    estimate (an unknown one last), the most free GPUs, then the first."""
    return (not offer.fits, offer.est_start is None, offer.est_start or 0.0,
            -(offer.gpus_free or 0), index)


def _for_connection(st: ClusterState, settings: SlurmSettings
                    ) -> tuple[ClusterState, Reservation | None]:
    """``st`` as the jobs of a connection whose jobs run in a reservation (extra
    ``reservation``) see it, and that reservation (None: no extra, or not listed): its
    ``reservations`` become what keeps them off nodes (the other reservations, every node
    outside theirs, and its own nodes until it begins; every node when it is not listed), and
    once it is active its idle nodes, which Slurm shows RESERVED to everyone, are usable for
    them. Without the extra, ``st`` as is."""
    name = settings.reservation
    if not name:
        return st, None
    blocking = [r for r in st.reservations if r.name != name]
    own = next((r for r in st.reservations if r.name == name), None)
    if own is None:
        return replace(st, reservations=blocking + [Reservation(
            f"{name} (not listed)", True, st.now, math.inf, tuple(st.nodes))]), None
    if outside := tuple(n for n in st.nodes if n not in own.nodes):
        blocking.append(Reservation(f"outside {name}", True, st.now, math.inf, outside))
    if own.start > st.now:
        blocking.append(Reservation(f"{name} until it begins", True, st.now, own.start,
                                    own.nodes))
    nodes = {n: replace(node, state=node.state.lower().replace("reserved", "idle"))
             if own.active and n in own.nodes else node for n, node in st.nodes.items()}
    return replace(st, nodes=nodes, reservations=blocking), own


def _backfill_hole(st: ClusterState, nodes: list[NodeInfo], gres_type: str, req: ResourceRequest,
                   num_nodes: int, limit_s: float | None) -> float | None:
    """:func:`.backfill.backfill_start` for one node's share of ``req`` (a GPU candidate) on
    the partition's usable ``nodes`` (None without the running jobs' list)."""
    gpus, cpus, mem_gb = shape(req)
    if st.running is None or not gpus or not gres_type:
        return None
    usable = [n for n in nodes if n.usable]
    return backfill_start(
        {n.name: Need(n.gpus.get(gres_type, 0), n.cpus_total, n.mem_total_mb) for n in usable},
        {n.name: Need(n.gpus_used.get(gres_type, 0), n.cpus_alloc, n.mem_alloc_mb)
         for n in usable},
        st.running, st.pending_jobs, partitions={p for n in usable for p in n.partitions},
        now=st.now, gres_type=gres_type,
        want=Need(int(gpus), max(1, math.ceil(cpus)), int(mem_gb * 1024)),
        num_nodes=num_nodes, time_limit_s=limit_s, reservations=st.reservations)


def capacity_rows(state: ClusterState, settings: SlurmSettings,
                  conn_id: str) -> list[CapacityRow]:
    """``show-gpus``: a row per (partition, GPU type); a partition without GPUs gets one row
    with its CPUs in ``details``. A node may be in several partitions, so each GPU row names
    its nodes with their counts (``details["gpus_by_node"]``): a connection's total counts
    each node once."""
    rows = []
    allowed = settings.partitions
    for part in sorted(state.partitions):
        if allowed and part not in allowed:
            continue
        nodes = state.nodes_in(part)
        types = sorted({t for n in nodes for t in n.gpus})
        info = state.partitions[part]
        if not types:
            rows.append(CapacityRow(
                connection=conn_id, location=part, accelerator=None,
                total=None, free=None, pending=info.pending,
                price_per_hour=settings.price_per_node_hour,
                details={"cpus_total": sum(n.cpus_total for n in nodes),
                         "cpus_free": sum(n.cpus_free for n in nodes if n.usable)}))
        for t in types:
            with_t = [n for n in nodes if t in n.gpus]
            rows.append(CapacityRow(
                connection=conn_id, location=part,
                accelerator=acc.canonical_from_label(t) if t else "gpu",
                total=sum(n.gpus[t] for n in with_t),
                free=sum(n.gpus_free(t) for n in with_t if n.usable),
                pending=info.pending, price_per_hour=settings.price_per_gpu_hour,
                details={"gres": t, "nodes": len(with_t),
                         "nodes_down": sum(not n.usable for n in with_t),
                         "gpus_by_node": {n.name: {"total": n.gpus[t],
                                                   "free": n.gpus_free(t) if n.usable else 0}
                                          for n in with_t}}))
    return rows
