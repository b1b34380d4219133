"""What a cluster can offer a task, from one probe: offers per candidate and partition, and the
``show-gpus`` rows.

The "clouds" side of the backend: no I/O here, only a :class:`ClusterState` read against the
task. A partition is a node pool: its nodes (those with the requested GPU type, when one is
asked for) go through the shared fit rule (:func:`fit_pool`, with at least one CPU, as Slurm
allocates one to every job). Slurm's own start estimate (``sbatch --test-only``) sets
``est_start`` when no node is free now; prices come from the connection's extras.
"""

from __future__ import annotations

from collections.abc import Callable

from airflow_skypilot.backends.base import CapacityRow, Offer
from airflow_skypilot.backends.common.fit import PoolNode, fit_pool, hourly_price, shape
from airflow_skypilot.backends.slurm.cluster import ClusterState, NodeInfo, Shape
from airflow_skypilot.backends.slurm.settings import BACKEND, SlurmSettings
from airflow_skypilot.spec import accelerators as acc
from airflow_skypilot.spec import fields
from airflow_skypilot.spec.task import ResourceRequest, Task

#: a start estimate further away than this is no estimate (jobs without time limits)
_HORIZON_S = 30 * 86400


def applies(req: ResourceRequest, settings: SlurmSettings) -> bool:
    """Does the candidate's infra filter allow this cluster at all?"""
    return fields.infra_matches(req.infra, settings.infra()) or (
        req.infra is not None and req.infra.startswith(f"{settings.infra()}/"))


def probe_shapes(task: Task, settings: SlurmSettings) -> list[Shape]:
    """The job shapes to ask ``sbatch --test-only`` about, one per distinct candidate."""
    shapes = set()
    for req in task.candidates:
        if not applies(req, settings):
            continue
        gpus, cpus, mem_gb = shape(req)
        shapes.add((gpus, task.num_nodes, int(cpus), int(mem_gb * 1024)))
    return sorted(shapes)


def offers(task: Task, state: ClusterState, settings: SlurmSettings, conn_id: str,
           unsupported: Callable[[Task, ResourceRequest], str]) -> list[Offer]:
    """One offer per candidate and partition the candidate's infra allows.

    ``unsupported`` says why the backend can never run a candidate ("" when it might): the
    backend's :meth:`~airflow_skypilot.backends.base.Backend.unsupported`.
    """
    out = []
    for req in task.candidates:
        if not applies(req, settings):
            continue
        why = unsupported(task, req)
        for part in sorted(state.partitions):
            if not fields.infra_matches(req.infra, settings.infra(part)):
                continue
            out.append(offer_at(task, req, part, state, settings, conn_id, why))
    return out


def _pool_node(node: NodeInfo, gres_type: str) -> PoolNode:
    return PoolNode(name=node.name, cpus=node.cpus_total, cpus_free=node.cpus_free,
                    memory_gb=node.mem_total_mb / 1024, memory_free_gb=node.mem_free_mb / 1024,
                    gpus=node.gpus.get(gres_type, 0), gpus_free=node.gpus_free(gres_type),
                    usable=node.usable)


def offer_at(task: Task, req: ResourceRequest, part: str, st: ClusterState,
             settings: SlurmSettings, conn_id: str, unsupported: str = "") -> Offer:
    """Candidate ``req`` in partition ``part``: does it fit, how much is free, when could it
    start, at what price."""
    s = settings
    info = st.partitions[part]
    nodes = st.nodes_in(part)
    offer = Offer(connection=conn_id, backend=BACKEND, location=part, infra=s.infra(part),
                  request=req, num_nodes=task.num_nodes, accelerator=req.accelerator,
                  gpus_per_node=req.accelerator_count, nodes_total=len(nodes),
                  pending_jobs=info.pending, probed_at=st.now,
                  details={"cluster": s.cluster, "partition": part})

    def no(reason: str) -> Offer:
        offer.fits, offer.reason = False, reason
        return offer

    if s.partitions and part not in s.partitions:
        return no(f"partition {part} is not allowed by connection {conn_id} "
                  f"(allowed: {', '.join(s.partitions)})")
    if not info.up:
        return no(f"partition {part} is down")
    if unsupported:
        return no(unsupported)
    gres_type = ""
    if req.accelerator:
        if not float(req.accelerator_count).is_integer():
            return no(f"{req.accelerator}:{req.accelerator_count}: Slurm allocates whole GPUs")
        types = sorted({t for n in nodes for t in n.gpus})
        matching = [t for t in types if t and acc.same_accelerator(req.accelerator, t)]
        if not matching:
            have = ", ".join(t or "untyped gpu" for t in types) or "no GPUs"
            return no(f"no {req.accelerator} in partition {part} (has: {have})")
        gres_type = matching[0]
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
    offer.nodes_free = fit.nodes_free
    offer.nodes_total = fit.nodes_total
    offer.details.update({"gres_type": gres_type, "gpus_per_node": need,
                          "usable_nodes": sum(n.usable for n in nodes)})
    start = st.starts.get((part, gres_type, need, task.num_nodes))
    if isinstance(start, float):
        if start - st.now < _HORIZON_S:
            offer.est_start = max(start, st.now)
        else:  # jobs without time limits make Slurm answer "in decades": that is unknown
            offer.details["test_only"] = "no start estimate within 30 days"
    elif isinstance(start, str) and start:
        offer.details["test_only"] = start
        if "not available" in start.lower() or "violates" in start.lower():
            return no(f"Slurm refuses this shape in {part}: {start}")
    if offer.nodes_free >= task.num_nodes:
        offer.est_start = st.now
    offer.price_per_hour = hourly_price(task.num_nodes, need, s.price_per_gpu_hour,
                                        s.price_per_node_hour)
    return offer


def capacity_rows(state: ClusterState, settings: SlurmSettings,
                  conn_id: str) -> list[CapacityRow]:
    """``show-gpus``: a row per (partition, GPU type); a partition without GPUs gets one row
    with its CPUs in ``details``."""
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
                         "nodes_down": sum(not n.usable for n in with_t)}))
    return rows
