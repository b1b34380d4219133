"""What a cluster has: its nodes, what the pods on them reserve, and who may go where.

One probe is one node list and one cluster-wide pod list (non-terminal pods, by field
selector): GPUs per node from ``status.allocatable``, GPU type from node labels, minus what the
pods bound to each node request. Cordoned, NotReady and tainted (not tolerated) nodes have no
capacity (:meth:`NodeView.why_unusable`). Where pods may not be listed (HTTP 403), free
capacity is unknown, not zero (:attr:`ClusterView.pods_known`).

Two more lists of the connection's namespace, for :mod:`.queue`: our Jobs (those whose pods
do not exist yet are work ahead of a new job) and our pods (the finished ones say how long
our jobs run). Either may be refused (403): the view then just knows less.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from typing import Any

from airflow_skypilot.backends.kubernetes.client import KubeApiError, KubeClient
from airflow_skypilot.backends.kubernetes.names import GPU_RESOURCE, LABEL_JOB
from airflow_skypilot.backends.kubernetes.queue import PodInfo, run_times, waiting_jobs
from airflow_skypilot.spec import accelerators as acc

#: node labels that name the GPU type, in the order they are trusted
GPU_LABELS = (
    "skypilot.co/accelerator",
    "cloud.google.com/gke-accelerator",
    "karpenter.k8s.aws/instance-gpu-name",
    "nvidia.com/gpu.product",
    "gpu.nvidia.com/class",
)
#: node labels (and values, case-insensitive) that mark spot / preemptible capacity
SPOT_LABELS = (
    ("cloud.google.com/gke-spot", "true"),
    ("cloud.google.com/gke-preemptible", "true"),
    ("eks.amazonaws.com/capacityType", "spot"),
    ("karpenter.sh/capacity-type", "spot"),
    ("kubernetes.azure.com/scalesetpriority", "spot"),
    ("node.kubernetes.io/lifecycle", "spot"),
)
#: what a GPU job adds to the tolerations: GPU nodes are often tainted with the resource
GPU_TOLERATION = {"key": GPU_RESOURCE, "operator": "Exists"}
#: pod phases: the field selector of pods that still hold their node, and the end phases
NON_TERMINAL = "status.phase!=Succeeded,status.phase!=Failed"
TERMINAL = ("Succeeded", "Failed")


def quantity(value: Any) -> float:
    """A Kubernetes quantity (``500m``, ``16Gi``, ``8``) as a float; bad text is 0."""
    from kubernetes.utils import parse_quantity

    try:
        return float(parse_quantity(value))
    except (ValueError, TypeError, ArithmeticError):
        return 0.0


def epoch(text: str | None) -> float | None:
    """An API timestamp (RFC 3339) as epoch seconds; None when absent or unreadable."""
    if not text:
        return None
    return _epoch(str(text))


@lru_cache(maxsize=8192)  # a probe reads the same stamps again (pods' starts, our runs)
def _epoch(text: str) -> float | None:
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _container_requests(container: Mapping[str, Any]) -> dict[str, float]:
    resources = container.get("resources") or {}
    values = dict(resources.get("limits") or {})
    values.update(resources.get("requests") or {})  # unset requests default to the limits
    return {k: quantity(v) for k, v in values.items()}


def pod_requests(pod: Mapping[str, Any]) -> dict[str, float]:
    """What the scheduler reserves for a pod: its containers' sum with its native sidecars
    (init containers with ``restartPolicy: Always``, which run beside them), or an init
    container (with the sidecars started before it) if that is more, plus overhead."""
    spec = pod.get("spec") or {}
    total: dict[str, float] = {}
    for container in spec.get("containers") or []:
        for key, value in _container_requests(container).items():
            total[key] = total.get(key, 0.0) + value
    sidecars: dict[str, float] = {}
    peak: dict[str, float] = {}
    for container in spec.get("initContainers") or []:
        for key, value in _container_requests(container).items():
            if container.get("restartPolicy") == "Always":
                sidecars[key] = sidecars.get(key, 0.0) + value
            else:
                peak[key] = max(peak.get(key, 0.0), value + sidecars.get(key, 0.0))
    for key, value in sidecars.items():
        total[key] = total.get(key, 0.0) + value
    for key, value in peak.items():
        total[key] = max(total.get(key, 0.0), value)
    for key, value in (spec.get("overhead") or {}).items():
        total[key] = total.get(key, 0.0) + quantity(value)
    return total


def tolerates(tolerations: list[Mapping[str, Any]], taint: Mapping[str, Any]) -> bool:
    """Does one of ``tolerations`` let a pod onto a node with ``taint``?"""
    for tol in tolerations:
        if tol.get("effect") and tol.get("effect") != taint.get("effect"):
            continue
        key = tol.get("key") or ""
        if tol.get("operator", "Equal") == "Exists":
            if not key or key == taint.get("key"):
                return True
        elif key == taint.get("key") and (tol.get("value") or "") == (taint.get("value") or ""):
            return True
    return False


@dataclass
class NodeView:
    """One node's capacity and what is already reserved on it."""

    name: str
    labels: dict[str, str]
    ready: bool
    not_ready_since: float | None
    unschedulable: bool
    taints: list[dict[str, Any]]
    cpus: float
    memory_gb: float
    gpus: int
    pods: int
    used: dict[str, float] = field(default_factory=dict)

    @classmethod
    def parse(cls, node: Mapping[str, Any]) -> NodeView:
        meta, spec, status = node.get("metadata") or {}, node.get("spec") or {}, \
            node.get("status") or {}
        alloc = status.get("allocatable") or {}
        ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), {})
        ok = ready.get("status") == "True"
        return cls(
            name=meta.get("name", ""), labels=dict(meta.get("labels") or {}), ready=ok,
            not_ready_since=None if ok else epoch(ready.get("lastTransitionTime")) or 0.0,
            unschedulable=bool(spec.get("unschedulable")), taints=list(spec.get("taints") or []),
            cpus=quantity(alloc.get("cpu", 0)), memory_gb=quantity(alloc.get("memory", 0)) / 2**30,
            gpus=int(quantity(alloc.get(GPU_RESOURCE, 0))),
            pods=int(quantity(alloc.get("pods", 110))) or 110)

    def why_unusable(self, tolerations: list[Mapping[str, Any]]) -> str:
        """Why a pod with ``tolerations`` cannot go here ("" when it can)."""
        if not self.ready:
            return "NotReady"
        if self.unschedulable:
            return "cordoned"
        for taint in self.taints:
            if taint.get("effect") in ("NoSchedule", "NoExecute") and not tolerates(
                    tolerations, taint):
                return f"taint {taint.get('key')}={taint.get('value', '')}:{taint.get('effect')}"
        return ""

    def gpu_labels(self) -> list[tuple[str, str]]:
        """The (label, value) pairs that name the GPU type, most trusted first."""
        return [(k, self.labels[k]) for k in GPU_LABELS if self.labels.get(k)]

    @property
    def accelerator(self) -> str | None:
        """Canonical GPU name (first trusted label), ``gpu`` if unlabelled, None: no GPUs."""
        if self.gpus <= 0:
            return None
        labels = self.gpu_labels()
        return acc.canonical_from_label(labels[0][1]) if labels else "gpu"

    def spot_label(self) -> tuple[str, str] | None:
        """The label that marks this node as spot capacity, if one does."""
        for key, value in SPOT_LABELS:
            if str(self.labels.get(key, "")).lower() == value:
                return key, self.labels[key]
        return None

    def free(self, resource: str) -> float:
        """What is left of ``cpu``, ``memory`` (bytes), GPUs or ``pods`` (slots)."""
        total = {"cpu": self.cpus, "memory": self.memory_gb * 2**30,
                 GPU_RESOURCE: float(self.gpus), "pods": float(self.pods)}[resource]
        return max(0.0, total - self.used.get(resource, 0.0))


@dataclass
class ClusterView:
    """One probe: the nodes, and (when pods may be listed) what is reserved and pending."""

    nodes: list[NodeView]
    pods_known: bool
    pending: int | None
    note: str = ""
    now: float = field(default_factory=time.time)
    #: the non-terminal pods (bound and pending), as :mod:`.queue` reads them
    pods: list[PodInfo] = field(default_factory=list)
    #: pods-to-be of our Jobs that have no pods yet (None: our Jobs could not be listed)
    waiting: list[PodInfo] | None = None
    #: how long our finished pods ran, seconds, sorted (None: could not be listed)
    runs: list[float] | None = None
    #: our Jobs whose room this view counts (a pod of theirs in the pod list, or waiting for
    #: one): ``Offer.jobs_seen`` (None: the pods or our Jobs could not be listed)
    jobs_seen: frozenset[str] | None = None


def cluster_view(nodes: list[Mapping[str, Any]], pods: list[Mapping[str, Any]] | None,
                 namespace: str, note: str = "", *,
                 jobs: list[Mapping[str, Any]] | None = None,
                 own_pods: list[Mapping[str, Any]] | None = None) -> ClusterView:
    """The nodes with what the pods bound to them reserve; ``pods`` None: not listable.
    ``pending`` counts the Pending pods of ``namespace`` (the queue our jobs join). ``jobs``
    and ``own_pods``: our Jobs and pods in ``namespace`` (None: not listed)."""
    views = [NodeView.parse(n) for n in nodes]
    by_name = {v.name: v for v in views}
    pending = None
    infos: list[PodInfo] = []
    if pods is not None:
        pending = 0
        for pod in pods:
            phase = (pod.get("status") or {}).get("phase")
            if phase in TERMINAL:
                continue
            infos.append(PodInfo.parse(pod))
            meta = pod.get("metadata") or {}
            if phase == "Pending" and meta.get("namespace") == namespace:
                pending += 1
            node = by_name.get((pod.get("spec") or {}).get("nodeName") or "")
            if node is None:
                continue
            for key, value in pod_requests(pod).items():
                node.used[key] = node.used.get(key, 0.0) + value
            node.used["pods"] = node.used.get("pods", 0.0) + 1
    ours = [p for p in own_pods or [] if LABEL_JOB in ((p.get("metadata") or {}).get("labels")
                                                          or {})]
    live = infos + [PodInfo.parse(p) for p in ours
                    if (p.get("status") or {}).get("phase") not in TERMINAL]
    waiting = None if jobs is None else waiting_jobs(
        [j for j in jobs if LABEL_JOB in ((j.get("metadata") or {}).get("labels") or {})], live)
    # a Job whose pod came after the pod list (it is in `live` only) is in neither count
    seen = None if waiting is None or pods is None else frozenset(
        {p.job for p in infos if p.job} | {w.job for w in waiting if w.job})
    return ClusterView(
        nodes=views, pods_known=pods is not None, pending=pending, note=note, pods=infos,
        waiting=waiting, runs=None if own_pods is None else run_times(ours), jobs_seen=seen)


def read(client: KubeClient, namespace: str) -> ClusterView:
    """One node list and one pod list (all namespaces, non-terminal pods); our Jobs and our
    pods in ``namespace``."""
    core, _ = client.apis()
    try:
        nodes = client.call(core.list_node).get("items") or []
    except KubeApiError as exc:
        if exc.status != 403:
            raise
        return ClusterView(nodes=[], pods_known=False, pending=None,
                           note=f"nodes may not be listed: {exc}")
    pods: list[dict[str, Any]] | None
    note = ""
    try:
        pods = client.call(core.list_pod_for_all_namespaces,
                           field_selector=NON_TERMINAL).get("items") or []
    except KubeApiError as exc:
        if exc.status == 400:  # a server that refuses the selector: filter here
            pods = client.call(core.list_pod_for_all_namespaces).get("items") or []
        elif exc.status == 403:
            pods = None
            note = (f"pods may not be listed ({exc}): free capacity is unknown, not zero")
        else:
            raise
    _, batch = client.apis()
    jobs: list[dict[str, Any]] | None = None
    own_pods: list[dict[str, Any]] | None = None
    try:
        jobs = client.call(batch.list_namespaced_job, namespace,
                           label_selector=LABEL_JOB).get("items") or []
    except KubeApiError:
        pass  # our Jobs without pods are then not counted ahead
    try:
        own_pods = client.call(core.list_namespaced_pod, namespace,
                               label_selector=LABEL_JOB).get("items") or []
    except KubeApiError:
        pass  # no run times of ours: no estimate from pod ages
    view = cluster_view(nodes, pods, namespace, note, jobs=jobs, own_pods=own_pods)
    if pods is None:
        try:
            mine = client.call(core.list_namespaced_pod, namespace,
                               field_selector="status.phase=Pending").get("items") or []
            view.pending = len(mine)
        except KubeApiError:
            pass
    return view
