"""The node-pool fit rule: can a pool of nodes (a Slurm partition, a Kubernetes cluster's
nodes of one GPU type) ever take one node's share of the job, and how many can take it now.

Backends that see individual nodes describe each as a :class:`PoolNode` (only nodes with the
requested GPU type, when one is asked for) and get the same verdicts and the same reasons in the
placement table. Whether the pool is the right one (GPU type, partition, selectors, spot) is
the backend's business; this is only shape and free room.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from airflow_skypilot.spec.task import ResourceRequest


@dataclass(frozen=True)
class PoolNode:
    """One node as the fit rule sees it: totals, what is free now, and whether it takes jobs."""

    name: str
    cpus: float
    cpus_free: float
    memory_gb: float
    memory_free_gb: float
    gpus: float = 0  # of the requested type
    gpus_free: float = 0
    usable: bool = True  # up and schedulable for this job (not down, drained, tainted...)
    has_room: bool = True  # room for one more job besides CPUs/memory/GPUs (e.g. pod slots)


@dataclass(frozen=True)
class PoolFit:
    """The verdict: ``reason`` is "" when the job fits the pool's shape at all."""

    reason: str
    nodes_total: int
    nodes_free: int = 0
    gpus_total: int | None = None
    gpus_free: int | None = None


def shape(req: ResourceRequest) -> tuple[int, float, float]:
    """(whole GPUs, CPUs, GB of memory) one node of the job needs; 0 where not asked.

    SkyPilot's ``memory: 4x`` (GB per CPU) becomes GB once the CPUs are known."""
    gpus = int(req.accelerator_count) if req.accelerator else 0
    cpus, _ = req.cpus_needed()
    mem, _ = req.memory_needed_gb()
    if req.memory and req.memory.endswith("x") and cpus:
        mem = float(req.memory[:-1]) * cpus
    return gpus, float(cpus or 0.0), float(mem or 0.0)


def fit_pool(nodes: Sequence[PoolNode], req: ResourceRequest, num_nodes: int, where: str, *,
             min_cpus: float = 0.0) -> PoolFit:
    """Fit ``num_nodes`` nodes of shape ``req`` into ``nodes``.

    ``where`` names the pool in reasons ("batch", "ctx/ns"). ``min_cpus`` is what a job takes
    when it asks for no CPUs (Slurm allocates at least one).
    """
    gpus, cpus, mem = shape(req)
    total = len(nodes)
    gpus_total = int(sum(n.gpus for n in nodes)) if gpus else None
    gpus_free = int(sum(n.gpus_free for n in nodes if n.usable)) if gpus else None

    def no(reason: str) -> PoolFit:
        return PoolFit(reason, total, 0, gpus_total, gpus_free)

    if not nodes:
        return no(f"no nodes in {where}" + (f" with {req.accelerator}" if gpus else ""))
    if gpus and gpus > max(n.gpus for n in nodes):
        return no(f"needs {gpus} {req.accelerator} per node; nodes in {where} have at most "
                  f"{max(n.gpus for n in nodes):g}")
    if num_nodes > total:
        return no(f"needs {num_nodes} nodes; {where} has {total}"
                  + (f" with {req.accelerator}" if gpus else ""))
    if cpus and cpus > max(n.cpus for n in nodes):
        return no(f"needs {req.cpus} CPUs per node; nodes in {where} have at most "
                  f"{max(n.cpus for n in nodes):g}")
    if mem and mem > max(n.memory_gb for n in nodes):
        asked = f"{mem:g} ({req.memory})" if str(req.memory).endswith("x") else req.memory
        return no(f"needs {asked} GB per node; nodes in {where} have at most "
                  f"{max(n.memory_gb for n in nodes):.3g} GB")
    need_cpus = max(cpus, min_cpus)
    free = sum(1 for n in nodes if n.usable and n.has_room and n.gpus_free >= gpus
               and n.cpus_free >= need_cpus and n.memory_free_gb >= mem)
    return PoolFit("", total, free, gpus_total, gpus_free)


def hourly_price(num_nodes: int, gpus_per_node: float, per_gpu_hour: float,
                 per_node_hour: float) -> float:
    """What a job costs per hour on a place priced per GPU and per node (connection extras)."""
    return num_nodes * (gpus_per_node * per_gpu_hour + per_node_hour)
