"""Kubernetes clusters, on the cncf-kubernetes provider's ``KubernetesHook`` (sync, the worker)
and ``AsyncKubernetesHook`` (the triggerer's event loop).

A cluster is an Airflow ``kubernetes`` connection (kubeconfig path or content, context,
in-cluster, namespace: the provider's own extras) with ours (see :class:`KubernetesSettings`).
One connection is one place: ``<context>/<namespace>``, infra ``kubernetes/<context>``.

probe
    one node list and one cluster-wide pod list (non-terminal pods, by field selector): GPUs
    per node from ``status.allocatable``, GPU type from node labels, minus what the pods
    bound to each node request. Cordoned, NotReady and tainted (not tolerated) nodes have no
    capacity. Where pods may not be listed (HTTP 403), free capacity is unknown, not zero.
submit
    a suspended ``batch/v1`` Job, then its ConfigMap (scripts, envs, small workdir), Secret
    (``secrets``, loaded by ``envFrom``) and, for several nodes, a headless Service, all
    owned by the Job; then the Job is resumed. A Job of that name already there is adopted
    (and finished if a crash left it suspended), never created twice.
status
    one Job list and one pod list per namespace (and one node list) per poll, for every
    watched job; the same mapping, sync in :meth:`KubernetesBackend.status`, async in
    :meth:`KubernetesBackend.poll`.
logs
    rank 0's pod log while the job runs; once every pod has ended the other ranks follow,
    each line prefixed ``(rank N) ``. Offsets are bytes into that text, which only ever grows.
    The triggerer's batched read reuses the pod list of the poll just before it, so it costs
    one log request per job and nothing more (Kubernetes cannot return many pods' logs).

Failures: a pod that lost its allocation (eviction, preemption, node lost or NotReady past a
grace, ``DisruptionTarget``) is infrastructure; a container exit code is the user's; an image
or container config error lasting past ``image_error_grace`` fails the job with a clear message
and is not failed over (it would fail on any cluster).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from airflow_skypilot.backends import _k8s_manifests as m
from airflow_skypilot.backends.base import (
    Backend,
    CapacityRow,
    JobHandle,
    JobState,
    JobStatus,
    Offer,
)
from airflow_skypilot.backends.common import jobscript
from airflow_skypilot.backends.common.features import Feature
from airflow_skypilot.exceptions import BackendError, BackendUnreachable, SubmissionError
from airflow_skypilot.spec import accelerators as acc
from airflow_skypilot.spec import fields
from airflow_skypilot.spec.task import ResourceRequest, Task

log = logging.getLogger(__name__)

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
GPU_TOLERATION = {"key": m.GPU_RESOURCE, "operator": "Exists"}
NON_TERMINAL = "status.phase!=Succeeded,status.phase!=Failed"
TERMINAL = ("Succeeded", "Failed")

#: pod ``status.reason`` values that mean the pod's allocation was taken away
DISRUPTION_REASONS = {"Evicted", "Preempting", "NodeLost", "NodeShutdown", "Shutdown",
                      "Terminated", "UnexpectedAdmissionError"}
#: waiting reasons that fail on any cluster (after a grace period, as they may clear)
IMAGE_ERRORS = {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull",
                "ImageInspectError", "RegistryUnavailable"}
CONFIG_ERRORS = {"CreateContainerConfigError", "CreateContainerError"}
LOG_CHUNK = 1 << 20
#: a Job we created suspended and never resumed this long after: its submitter died
SUSPENDED_TOO_LONG = 120.0


class KubeApiError(BackendError):
    """The API server answered with an error status."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


@dataclass
class KubernetesSettings:
    """What a Kubernetes connection's extras may say, beyond the provider's own.

    ``image`` is the container image of tasks without ``image_id: docker:...`` (default
    ``python:3.11-slim``: small, and has bash, base64 and tar, which the pod's entry script
    needs; GPU tasks name a CUDA image). ``node_selector`` and ``tolerations`` (dict / list,
    or JSON text) apply to every job; ``image_error_grace`` is how long an image pull or
    container config error may last before the job fails; ``node_not_ready_grace`` how long
    a job's node may be NotReady before the job counts as lost to the infrastructure;
    ``pending_timeout`` (default: none, wait) how long a pod may stay unschedulable before
    the job is placed elsewhere (the capacity seen at placement is gone).
    """

    context: str
    namespace: str = "default"
    image: str = "python:3.11-slim"
    service_account: str | None = None
    price_per_gpu_hour: float = 0.0
    price_per_node_hour: float = 0.0
    priority_class: str | None = None
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    image_error_grace: float = 60.0
    node_not_ready_grace: float = 120.0
    pending_timeout: float | None = None
    ttl_seconds_after_finished: int | None = 86400
    cluster_domain: str = "cluster.local"
    bundle_limit: int = m.DEFAULT_BUNDLE_LIMIT
    request_timeout: float = 30.0

    @classmethod
    def from_extra(cls, conn_id: str, extra: Mapping[str, Any]) -> KubernetesSettings:
        def get(name: str) -> Any:
            value = extra.get(name)
            if value in (None, ""):
                value = extra.get(f"extra__kubernetes__{name}")
            return None if value in (None, "") else value

        def structured(name: str, kind: type) -> Any:
            value = get(name)
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError:
                    raise ValueError(f"connection {conn_id}: extra {name!r} is not valid "
                                     f"JSON") from None
            if value is None:
                return kind()
            if not isinstance(value, kind):
                raise ValueError(f"connection {conn_id}: extra {name!r} must be a "
                                 f"{kind.__name__}")
            return value

        def num(name: str, default: float) -> float:
            value = get(name)
            return default if value is None else float(value)

        ttl = get("ttl_seconds_after_finished")
        return cls(
            context=str(get("cluster_context") or conn_id),
            namespace=str(get("namespace") or "default"),
            image=str(get("image") or "python:3.11-slim"),
            service_account=get("service_account"),
            price_per_gpu_hour=num("price_per_gpu_hour", 0.0),
            price_per_node_hour=num("price_per_node_hour", 0.0),
            priority_class=get("priority_class"),
            node_selector={str(k): str(v) for k, v in structured("node_selector", dict).items()},
            tolerations=list(structured("tolerations", list)),
            image_error_grace=num("image_error_grace", 60.0),
            node_not_ready_grace=num("node_not_ready_grace", 120.0),
            pending_timeout=float(get("pending_timeout")) if get("pending_timeout") is not None
            else None,
            ttl_seconds_after_finished=None if str(ttl).lower() in ("none", "-1", "off")
            else int(ttl) if ttl is not None else 86400,
            cluster_domain=str(get("cluster_domain") or "cluster.local"),
            bundle_limit=int(num("bundle_limit", m.DEFAULT_BUNDLE_LIMIT)),
            request_timeout=num("request_timeout", 30.0),
        )

    @property
    def location(self) -> str:
        return f"{self.context}/{self.namespace}"

    @property
    def infra(self) -> str:
        return f"kubernetes/{self.context}"


# --- parsing (pure) -------------------------------------------------------------------------


def quantity(value: Any) -> float:
    """A Kubernetes quantity (``500m``, ``16Gi``, ``8``) as a float; bad text is 0."""
    from kubernetes.utils import parse_quantity

    try:
        return float(parse_quantity(value))
    except (ValueError, TypeError, ArithmeticError):
        return 0.0


def epoch(text: str | None) -> float | None:
    if not text:
        return None
    try:
        return datetime.fromisoformat(str(text).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _container_requests(container: Mapping[str, Any]) -> dict[str, float]:
    resources = container.get("resources") or {}
    values = dict(resources.get("limits") or {})
    values.update(resources.get("requests") or {})  # unset requests default to the limits
    return {k: quantity(v) for k, v in values.items()}


def pod_requests(pod: Mapping[str, Any]) -> dict[str, float]:
    """What the scheduler reserves for a pod: its containers' sum, or its largest init
    container if that is more, plus overhead."""
    spec = pod.get("spec") or {}
    total: dict[str, float] = {}
    for container in spec.get("containers") or []:
        for key, value in _container_requests(container).items():
            total[key] = total.get(key, 0.0) + value
    for container in spec.get("initContainers") or []:
        for key, value in _container_requests(container).items():
            total[key] = max(total.get(key, 0.0), value)
    for key, value in (spec.get("overhead") or {}).items():
        total[key] = total.get(key, 0.0) + quantity(value)
    return total


def tolerates(tolerations: list[Mapping[str, Any]], taint: Mapping[str, Any]) -> bool:
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
            gpus=int(quantity(alloc.get(m.GPU_RESOURCE, 0))),
            pods=int(quantity(alloc.get("pods", 110))) or 110)

    def why_unusable(self, tolerations: list[Mapping[str, Any]]) -> str:
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
        return [(k, self.labels[k]) for k in GPU_LABELS if self.labels.get(k)]

    @property
    def accelerator(self) -> str | None:
        """Canonical GPU name (first trusted label), ``gpu`` if unlabelled, None: no GPUs."""
        if self.gpus <= 0:
            return None
        labels = self.gpu_labels()
        return acc.canonical_from_label(labels[0][1]) if labels else "gpu"

    def spot_label(self) -> tuple[str, str] | None:
        for key, value in SPOT_LABELS:
            if str(self.labels.get(key, "")).lower() == value:
                return key, self.labels[key]
        return None

    def free(self, resource: str) -> float:
        total = {"cpu": self.cpus, "memory": self.memory_gb * 2**30,
                 m.GPU_RESOURCE: float(self.gpus), "pods": float(self.pods)}[resource]
        return max(0.0, total - self.used.get(resource, 0.0))

    def fits(self, gpus: int, cpus: float, memory_gb: float) -> bool:
        return (self.free(m.GPU_RESOURCE) >= gpus and self.free("cpu") >= cpus
                and self.free("memory") >= memory_gb * 2**30 and self.free("pods") >= 1)


@dataclass
class ClusterView:
    """One probe: the nodes, and (when pods may be listed) what is reserved and pending."""

    nodes: list[NodeView]
    pods_known: bool
    pending: int | None
    note: str = ""
    now: float = field(default_factory=time.time)


def cluster_view(nodes: list[Mapping[str, Any]], pods: list[Mapping[str, Any]] | None,
                 namespace: str, note: str = "") -> ClusterView:
    views = [NodeView.parse(n) for n in nodes]
    by_name = {v.name: v for v in views}
    pending = None
    if pods is not None:
        pending = 0
        for pod in pods:
            phase = (pod.get("status") or {}).get("phase")
            if phase in TERMINAL:
                continue
            meta = pod.get("metadata") or {}
            if phase == "Pending" and meta.get("namespace") == namespace:
                pending += 1
            node = by_name.get((pod.get("spec") or {}).get("nodeName") or "")
            if node is None:
                continue
            for key, value in pod_requests(pod).items():
                node.used[key] = node.used.get(key, 0.0) + value
            node.used["pods"] = node.used.get("pods", 0.0) + 1
    return ClusterView(nodes=views, pods_known=pods is not None, pending=pending, note=note)


def _shape_of(req: ResourceRequest) -> tuple[int, float, float]:
    gpus = int(req.accelerator_count) if req.accelerator else 0
    cpus, _ = req.cpus_needed()
    mem, _ = req.memory_needed_gb()
    return gpus, float(cpus or 0.0), float(mem or 0.0)


# --- job status (pure) ----------------------------------------------------------------------


@dataclass
class PodView:
    """What one pod says about the job."""

    name: str
    rank: int
    phase: str
    node: str
    created: float
    deleting: bool
    disruption: str = ""
    preempted: bool = False
    exit_code: int | None = None
    term_reason: str = ""
    waiting_reason: str = ""
    waiting_message: str = ""
    unschedulable: str = ""
    started: float | None = None
    finished: float | None = None
    image: str = ""

    @classmethod
    def parse(cls, pod: Mapping[str, Any]) -> PodView:
        meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, \
            pod.get("status") or {}
        index = (meta.get("labels") or {}).get(m.INDEX_KEY) or \
            (meta.get("annotations") or {}).get(m.INDEX_KEY) or "0"
        view = cls(name=meta.get("name", ""), rank=int(index) if str(index).isdigit() else 0,
                   phase=status.get("phase") or "Pending", node=spec.get("nodeName") or "",
                   created=epoch(meta.get("creationTimestamp")) or time.time(),
                   deleting=bool(meta.get("deletionTimestamp")),
                   started=epoch(status.get("startTime")))
        images = {c.get("name"): c.get("image", "") for c in spec.get("containers") or []}
        conds = {c.get("type"): c for c in status.get("conditions") or []}
        target = conds.get("DisruptionTarget") or {}
        if target.get("status") == "True":
            view.disruption = (f"pod {view.name} was disrupted: {target.get('reason', '')}"
                               + (f" ({target['message']})" if target.get("message") else ""))
            view.preempted = "preempt" in str(target.get("reason", "")).lower()
        reason = status.get("reason") or ""
        if not view.disruption and (reason in DISRUPTION_REASONS or reason.startswith("OutOf")):
            view.disruption = f"pod {view.name}: {reason}" + (
                f" ({status['message']})" if status.get("message") else "")
            view.preempted = reason == "Preempting"
        sched = conds.get("PodScheduled") or {}
        if sched.get("status") == "False":
            view.unschedulable = sched.get("message") or sched.get("reason") or "unschedulable"
        for cs in status.get("containerStatuses") or []:
            state = cs.get("state") or {}
            if cs.get("name") == m.CONTAINER or len(status.get("containerStatuses")) == 1:
                view.image = images.get(cs.get("name"), cs.get("image", ""))
            if "terminated" in state:
                term = state["terminated"] or {}
                code = term.get("exitCode")
                view.term_reason = term.get("reason") or ""
                view.finished = epoch(term.get("finishedAt")) or view.finished
                view.started = epoch(term.get("startedAt")) or view.started
                if code is not None and (view.exit_code in (None, 0)):
                    view.exit_code = int(code)
                if view.term_reason == "ContainerStatusUnknown" and not view.disruption:
                    view.disruption = (f"pod {view.name}: its container was lost with node "
                                       f"{view.node or '?'}")
            elif "waiting" in state:
                waiting = state["waiting"] or {}
                if waiting.get("reason") in IMAGE_ERRORS | CONFIG_ERRORS or \
                        not view.waiting_reason:
                    view.waiting_reason = waiting.get("reason") or ""
                    view.waiting_message = waiting.get("message") or ""
            elif "running" in state:
                view.started = epoch((state["running"] or {}).get("startedAt")) or view.started
        return view


def pods_of(job_name: str, pods: list[Mapping[str, Any]],
            uid: str | None = None) -> list[Mapping[str, Any]]:
    """The job's pods (our label; owned by the Job with ``uid`` when it is known)."""
    out = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        if (meta.get("labels") or {}).get(m.LABEL_JOB) != job_name:
            continue
        owners = [r.get("uid") for r in meta.get("ownerReferences") or []]
        if uid and owners and uid not in owners:
            continue
        out.append(pod)
    return out


def job_status(job: Mapping[str, Any] | None, pods: list[Mapping[str, Any]] | None, *,
               num_nodes: int, spot: bool = False, nodes: Mapping[str, NodeView] | None = None,
               now: float | None = None, image_error_grace: float = 60.0,
               node_not_ready_grace: float = 120.0, pending_timeout: float | None = None,
               namespace: str = "") -> JobStatus:
    """One job's state from its Job object and pods (SkyPilot's rule: the allocation is gone
    -> infrastructure; the allocation was fine and the program exited non-zero -> user).

    ``pods`` None: they may not be listed; the Job's own status and conditions decide.
    """
    now = time.time() if now is None else now
    pods_known = pods is not None
    pods = pods or []
    if job is None:
        return JobStatus(JobState.LOST, reason=f"the Job no longer exists in namespace "
                                               f"{namespace or '?'}", raw_state="(gone)")
    meta, status = job.get("metadata") or {}, job.get("status") or {}
    views = sorted((PodView.parse(p) for p in pods), key=lambda v: (v.rank, v.created))
    latest: dict[int, PodView] = {}
    for v in views:
        latest[v.rank] = v
    started = [v.started for v in views if v.started] or [epoch(status.get("startTime"))]
    started_at = min((s for s in started if s), default=None)
    finished = [v.finished for v in views if v.finished]
    ended_at = epoch(status.get("completionTime")) or (max(finished) if finished else None)
    nodes_used = [latest[r].node for r in sorted(latest) if latest[r].node]
    conds = {c.get("type"): c for c in status.get("conditions") or []
             if c.get("status") == "True"}
    phases = ",".join(f"{r}:{latest[r].phase}" for r in sorted(latest))

    def out(state: JobState, reason: str = "", exit_code: int | None = None,
            raw: str = "") -> JobStatus:
        return JobStatus(state, reason=reason, exit_code=exit_code, started_at=started_at,
                         ended_at=(ended_at or now) if state.terminal else None,
                         nodes=nodes_used, raw_state=raw or phases or "no pods")

    def infra(reason: str, preempted: bool = False) -> JobStatus:
        state = JobState.PREEMPTED if preempted or spot else JobState.INFRA_FAILED
        return out(state, reason)

    if "Complete" in conds or "SuccessCriteriaMet" in conds:
        return out(JobState.SUCCEEDED, raw="Complete")
    failed_cond = conds.get("Failed") or conds.get("FailureTarget")
    if meta.get("deletionTimestamp") and failed_cond is None:
        return out(JobState.CANCELLED, "the Job was deleted", raw="Deleting")
    # 1. the allocation was taken away: eviction, preemption, node lost
    disrupted = [v for v in views if v.disruption]
    if disrupted:
        first = min(disrupted, key=lambda v: v.finished or v.created)
        return infra(first.disruption, first.preempted)
    if nodes is not None:
        for v in views:
            if v.phase in TERMINAL or not v.node:
                continue
            node = nodes.get(v.node)
            if node is None:
                return infra(f"node {v.node} of pod {v.name} no longer exists")
            if not node.ready and node.not_ready_since is not None and \
                    now - node.not_ready_since >= node_not_ready_grace:
                return infra(f"node {v.node} of pod {v.name} has been NotReady for "
                             f"{int(now - node.not_ready_since)}s")
    # 2. the user's program failed (pods the controller is deleting are victims, not causes)
    failed = [v for v in views if v.phase == "Failed" and v.exit_code not in (None, 0)
              and not v.deleting]
    if failed:
        first = min(failed, key=lambda v: (v.finished or now, v.rank))
        extra = " (out of memory: OOMKilled)" if first.term_reason == "OOMKilled" else ""
        where = f" on rank {first.rank}" if num_nodes > 1 else ""
        return out(JobState.FAILED, f"exit code {first.exit_code}{where}{extra}",
                   first.exit_code)
    # 3. the Job's own verdict, which outlives its pods
    if failed_cond is not None:
        reason, message = failed_cond.get("reason", ""), failed_cond.get("message", "")
        raw = f"Failed:{reason}"
        if "DisruptionTarget" in message:
            return infra(f"the Job failed: {message}")
        code = re.search(r"exit code (\d+)", message)
        if code:
            return out(JobState.FAILED, f"exit code {code.group(1)}", int(code.group(1)), raw)
        if reason == "DeadlineExceeded":
            return out(JobState.FAILED, "time limit reached (activeDeadlineSeconds)", raw=raw)
        if not pods_known:  # no evidence either way: do not fail over blindly
            return out(JobState.FAILED, f"the Job failed ({reason}: {message}); its pods may "
                                        f"not be listed to tell why", raw=raw)
        return infra(f"the Job failed ({reason}: {message}) and no pod shows a user error")
    if not pods_known:
        if int(status.get("ready") or 0) > 0:
            return out(JobState.RUNNING, raw="ready (pods may not be listed)")
        return out(JobState.PENDING, f"{int(status.get('active') or 0)} active pod(s), none "
                                     f"ready yet (pods may not be listed)", raw="active")
    # 4. pods deleted under a running Job, or gone without a trace
    deleting = [v for v in views if v.deleting]
    if deleting:
        return infra(f"pod {deleting[0].name} was deleted while the job ran")
    if not views and int(status.get("failed") or 0) > 0:
        return infra("the job's pod vanished (deleted or evicted) before it finished")
    # 5. errors that would happen on any cluster: fail, do not fail over
    pending_reason = ""
    for v in views:
        if v.waiting_reason in IMAGE_ERRORS | CONFIG_ERRORS:
            age = now - v.created
            what = (f"image {v.image!r} cannot be used" if v.waiting_reason in IMAGE_ERRORS
                    else "the container cannot be created")
            text = f"{what}: {v.waiting_reason}: {v.waiting_message}".rstrip(": ")
            if age >= image_error_grace:
                return out(JobState.FAILED, f"{text} (for {int(age)}s; it would fail on any "
                                            f"cluster, so it is not placed elsewhere)",
                           raw=f"{v.phase}:{v.waiting_reason}")
            pending_reason = f"{text} (fails in {int(image_error_grace - age)}s unless it clears)"
    # 6. done, running, or waiting
    done = {r for r, v in latest.items() if v.phase == "Succeeded"}
    if len(done) >= num_nodes:
        return out(JobState.SUCCEEDED)
    if any(v.phase == "Running" for v in latest.values()):
        return out(JobState.RUNNING)
    if not pending_reason:
        waiting = [v for v in latest.values() if v.phase == "Pending"]
        if (job.get("spec") or {}).get("suspend"):
            age = now - (epoch(meta.get("creationTimestamp")) or now)
            if (meta.get("annotations") or {}).get(m.ANN_PREFIX + "managed") == "true" and \
                    age > SUSPENDED_TOO_LONG:
                return out(JobState.LOST, f"the submission stopped before the job's files "
                                          f"were created (suspended for {int(age)}s)",
                           raw="Suspended")
            pending_reason = "the Job is suspended (its files are being created)"
        elif not views:
            pending_reason = "waiting for the Job controller to create pods"
        elif any(v.unschedulable for v in waiting):
            stuck = min((v for v in waiting if v.unschedulable), key=lambda v: v.created)
            pending_reason = stuck.unschedulable
            if pending_timeout is not None and now - stuck.created >= pending_timeout:
                return infra(f"pod {stuck.name} could not be scheduled for "
                             f"{int(now - stuck.created)}s: {stuck.unschedulable}")
        elif waiting:
            pending_reason = waiting[0].waiting_reason or "pending"
    return out(JobState.PENDING, pending_reason)


# --- logs (pure) ----------------------------------------------------------------------------


def log_plan(pods: list[Mapping[str, Any]], num_nodes: int) -> tuple[list[PodView], bool]:
    """The pods whose logs make up the job's output (newest per rank, rank order) and whether
    every rank has ended (then the text is final)."""
    latest: dict[int, PodView] = {}
    for v in sorted((PodView.parse(p) for p in pods), key=lambda v: v.created):
        latest[v.rank] = v
    plan = [latest[r] for r in sorted(latest)]
    final = len(plan) >= num_nodes and all(v.phase in TERMINAL for v in plan)
    return plan, final


def join_logs(logs: list[tuple[int, bytes]], final: bool) -> bytes:
    """Rank 0's log; when ``final``, the other ranks after it, each line prefixed."""
    if not logs:
        return b""
    data = logs[0][1]
    if final and len(logs) > 1:
        parts = [data if not data or data.endswith(b"\n") else data + b"\n"]
        for rank, text in logs[1:]:
            prefix = f"(rank {rank}) ".encode()
            parts += [prefix + line for line in text.splitlines(keepends=True)]
            if parts[-1] and not parts[-1].endswith(b"\n"):
                parts[-1] += b"\n"
        data = b"".join(parts)
    return data


def slice_log(data: bytes, offset: int, final: bool, limit: int = LOG_CHUNK) -> tuple[str, int]:
    """Text from byte ``offset``: whole lines only until the log is final, at most ``limit``
    bytes (a line longer than that comes in pieces); never half a UTF-8 character."""
    if offset >= len(data):
        return "", offset
    end = min(len(data), offset + limit)
    if not final or end < len(data):
        cut = data.rfind(b"\n", offset, end)
        if cut >= 0:
            end = cut + 1
        elif end - offset < limit:
            end = offset  # a partial line: wait for its end
    while offset < end < len(data) and (data[end] & 0xC0) == 0x80:
        end -= 1
    return data[offset:end].decode("utf-8", "replace"), end


# --- the backend ----------------------------------------------------------------------------


def _import_clients() -> None:
    import kubernetes.utils
    import kubernetes_asyncio.client
    import kubernetes_asyncio.config  # noqa: F401
    from airflow.providers.cncf.kubernetes.hooks import kubernetes  # noqa: F401


class KubernetesBackend(Backend):
    """One namespace of one Kubernetes cluster (context)."""

    name = "kubernetes"
    conn_types = ("kubernetes",)
    unsupported_features = {
        Feature.INSTANCE_TYPE: "a cloud VM type, not a Kubernetes resource",
        Feature.FRACTIONAL_GPUS: f"Kubernetes allocates whole GPUs ({m.GPU_RESOURCE} is an "
                                 "integer)",
        Feature.GIT_WORKDIR: "a git workdir is not cloned on Kubernetes; use a local workdir",
        Feature.STORAGE_MOUNTS: "storage mounts are not supported on Kubernetes here",
        Feature.S3_MOUNTS: "bucket sources are not copied to Kubernetes here",
        Feature.OTHER_BUCKET_MOUNTS: "bucket sources are not copied to Kubernetes here",
        Feature.INLINE_VOLUMES: "give the name of a PersistentVolumeClaim",
    }

    def __init__(self, conn_id: str, settings: KubernetesSettings | None = None):
        super().__init__(conn_id)
        self._settings = settings
        self._hook: Any = None
        self._ahook: Any = None
        self._nodes_forbidden = False
        #: pods seen by the last poll, per job name (log reads reuse them: no extra listing)
        self._seen: dict[str, tuple[float, list[dict[str, Any]]]] = {}

    # --- connection --------------------------------------------------------------------------
    @property
    def settings(self) -> KubernetesSettings:
        if self._settings is None:
            from airflow_skypilot.compat import get_connection

            conn = get_connection(self.conn_id)
            self._settings = KubernetesSettings.from_extra(self.conn_id, conn.extra_dejson or {})
        return self._settings

    def _sync_hook(self) -> Any:
        if self._hook is None:
            from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook
            from kubernetes import client

            # Our own Configuration: the hook would otherwise load a kubeconfig into the
            # process-wide default, which concurrent probes of other connections share. (The
            # provider loads in-cluster config into the default only: that one is shared.)
            hook = KubernetesHook(conn_id=self.conn_id)
            extras = hook.conn_extras or {}
            if not _truthy(extras.get("in_cluster") or
                           extras.get("extra__kubernetes__in_cluster")):
                hook.client_configuration = client.Configuration()
            self._hook = hook
        return self._hook

    def _apis(self) -> tuple[Any, Any]:
        try:
            hook = self._sync_hook()
            return hook.core_v1_client, hook.batch_v1_client
        except Exception as exc:  # bad kubeconfig, missing context, no in-cluster env
            self._hook = None
            raise BackendUnreachable(f"{self.conn_id}: cannot load the Kubernetes "
                                     f"configuration: {type(exc).__name__}: {exc}") from exc

    def _async_hook(self) -> Any:
        if self._ahook is None:
            from airflow.providers.cncf.kubernetes.hooks.kubernetes import AsyncKubernetesHook

            self._ahook = AsyncKubernetesHook(conn_id=self.conn_id)
        return self._ahook

    def close(self) -> None:
        hook, self._hook = self._hook, None
        if hook is not None and "api_client" in vars(hook):
            try:
                hook.api_client.close()
            except Exception:  # a broken pool is gone either way
                pass

    async def aclose(self) -> None:
        """Nothing is held between polls: each opens and closes its own client session."""
        return None

    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """One API call on the sync client, JSON in and out; errors as our exceptions."""
        from kubernetes.client.exceptions import ApiException

        try:
            resp = fn(*args, _preload_content=False,
                      _request_timeout=self.settings.request_timeout, **kwargs)
            body = resp.data
        except ApiException as exc:
            raise _api_error(self.conn_id, exc.status, exc.body or exc.reason) from None
        except Exception as exc:  # urllib3 connection errors, timeouts
            raise BackendUnreachable(f"{self.conn_id}: Kubernetes API unreachable: "
                                     f"{type(exc).__name__}: {exc}") from exc
        return json.loads(body) if body else {}

    async def _acall(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """One API call on the async client (raw response: we check the status ourselves)."""
        from kubernetes_asyncio.client.exceptions import ApiException

        try:
            resp = await fn(*args, _preload_content=False,
                            _request_timeout=self.settings.request_timeout, **kwargs)
            try:
                body = await resp.read()
                status = resp.status
            finally:
                resp.release()
        except ApiException as exc:
            raise _api_error(self.conn_id, exc.status, exc.body or exc.reason) from None
        except Exception as exc:  # aiohttp errors, timeouts
            raise BackendUnreachable(f"{self.conn_id}: Kubernetes API unreachable: "
                                     f"{type(exc).__name__}: {exc}") from exc
        if not 200 <= status < 300:
            raise _api_error(self.conn_id, status, body)
        return json.loads(body) if body else {}

    # --- placement ---------------------------------------------------------------------------
    def cluster_view(self) -> ClusterView:
        """One node list and one pod list (all namespaces, non-terminal pods)."""
        core, _ = self._apis()
        ns = self.settings.namespace
        try:
            nodes = self._call(core.list_node).get("items") or []
        except KubeApiError as exc:
            if exc.status != 403:
                raise
            return ClusterView(nodes=[], pods_known=False, pending=None,
                               note=f"nodes may not be listed: {exc}")
        pods: list[dict[str, Any]] | None
        note = ""
        try:
            pods = self._call(core.list_pod_for_all_namespaces,
                              field_selector=NON_TERMINAL).get("items") or []
        except KubeApiError as exc:
            if exc.status == 400:  # a server that refuses the selector: filter here
                pods = self._call(core.list_pod_for_all_namespaces).get("items") or []
            elif exc.status == 403:
                pods = None
                note = (f"pods may not be listed ({exc}): free capacity is unknown, not zero")
            else:
                raise
        view = cluster_view(nodes, pods, ns, note)
        if pods is None:
            try:
                mine = self._call(core.list_namespaced_pod, ns,
                                  field_selector="status.phase=Pending").get("items") or []
                view.pending = len(mine)
            except KubeApiError:
                pass
        return view

    def _applies(self, req: ResourceRequest) -> bool:
        return fields.infra_matches(req.infra, self.settings.infra)

    def probe(self, task: Task) -> list[Offer]:
        reqs = [r for r in task.candidates if self._applies(r)]
        if not reqs:
            return []
        view = self.cluster_view()
        bundle_error = ""
        if task.workdir or task.file_mounts:
            try:
                m.bundle(task, self.settings.bundle_limit)
            except m.BundleTooLarge as exc:
                bundle_error = str(exc)
            except OSError as exc:
                bundle_error = f"cannot read the workdir or file_mounts: {exc}"
        return [self._offer(task, r, view, bundle_error) for r in reqs]

    def _offer(self, task: Task, req: ResourceRequest, view: ClusterView,
               bundle_error: str) -> Offer:
        s = self.settings
        gpus, cpus, mem = _shape_of(req)
        offer = Offer(connection=self.conn_id, backend=self.name, location=s.location,
                      infra=s.infra, request=req, num_nodes=task.num_nodes,
                      accelerator=req.accelerator, gpus_per_node=req.accelerator_count,
                      pending_jobs=view.pending, probed_at=view.now, spot=req.use_spot,
                      details={"context": s.context, "namespace": s.namespace})
        if view.note:
            offer.details["note"] = view.note

        def no(reason: str) -> Offer:
            offer.fits, offer.reason = False, reason
            return offer

        if why := self.unsupported(task, req):
            return no(why)
        if bundle_error:
            return no(f"workdir/file_mounts: {bundle_error}")
        offer.price_per_hour = task.num_nodes * (gpus * s.price_per_gpu_hour
                                                 + s.price_per_node_hour)
        if not view.nodes and not view.pods_known and view.note:
            if gpus:
                return no(f"cannot see the cluster's GPUs: {view.note}")
            return offer  # CPU only: fits by shape, nothing known about free capacity
        nodes = view.nodes
        selector: dict[str, str] = {}
        extra_tols: list[dict[str, Any]] = []  # what this request adds to the connection's
        if req.use_spot:
            nodes = [n for n in nodes if n.spot_label()]
            if not nodes:
                keys = ", ".join(k for k, _ in SPOT_LABELS)
                return no(f"use_spot: no spot nodes in {s.context} (none labelled {keys})")
            labels = [n.spot_label() for n in nodes]
            key, value = max(labels, key=labels.count)  # type: ignore[arg-type]
            nodes = [n for n in nodes if n.spot_label() == (key, value)]
            selector[key] = value
            extra_tols.append({"key": key, "operator": "Exists"})
        if s.node_selector:
            nodes = [n for n in nodes if all(n.labels.get(k) == v
                                             for k, v in s.node_selector.items())]
        if gpus:
            extra_tols.append(dict(GPU_TOLERATION))
            matches: dict[tuple[str, str], list[NodeView]] = {}
            for n in nodes:
                if n.gpus <= 0:
                    continue
                for key, value in n.gpu_labels():
                    if acc.same_accelerator(req.accelerator or "", value):
                        matches.setdefault((key, value), []).append(n)
            if not matches:
                have = sorted({f"{n.accelerator} x{n.gpus}" for n in nodes if n.gpus > 0})
                return no(f"no {req.accelerator} nodes in {s.context}"
                          f" (has: {', '.join(have) or 'no GPU nodes'})")
            (key, value), nodes = max(matches.items(), key=lambda kv: (
                len(kv[1]), -GPU_LABELS.index(kv[0][0])))
            selector[key] = value
            offer.accelerator = acc.canonical_from_label(value)
            most = max(n.gpus for n in nodes)
            if gpus > most:
                return no(f"needs {gpus} {req.accelerator} per node; nodes in {s.context} have "
                          f"at most {most}")
        elif not nodes:
            return no(f"no nodes in {s.context} match the connection's node_selector "
                      f"{s.node_selector}")
        offer.nodes_total = len(nodes)
        offer.details.update({"node_selector": selector, "tolerations": extra_tols,
                              "gpus_per_node": gpus})
        if gpus:
            offer.gpus_total = sum(n.gpus for n in nodes)
        if task.num_nodes > len(nodes):
            return no(f"needs {task.num_nodes} nodes; {s.context} has {len(nodes)}"
                      + (f" with {req.accelerator}" if gpus else ""))
        if cpus and cpus > max(n.cpus for n in nodes):
            return no(f"needs {req.cpus} CPUs per node; nodes in {s.context} have at most "
                      f"{max(n.cpus for n in nodes):g}")
        if mem and mem > max(n.memory_gb for n in nodes):
            return no(f"needs {req.memory} GB per node; nodes in {s.context} have at most "
                      f"{max(n.memory_gb for n in nodes):.3g} GB")
        tolerations = s.tolerations + extra_tols
        usable = [n for n in nodes if not n.why_unusable(tolerations)]
        if len(usable) < len(nodes):
            offer.details["nodes_unusable"] = {n.name: n.why_unusable(tolerations)
                                               for n in nodes if n not in usable}
        if not view.pods_known:
            offer.details["free"] = "unknown"
            return offer
        if gpus:
            offer.gpus_free = int(sum(n.free(m.GPU_RESOURCE) for n in usable))
        offer.nodes_free = sum(n.fits(gpus, cpus, mem) for n in usable)
        if offer.nodes_free >= task.num_nodes:
            offer.est_start = view.now
        return offer

    def capacity(self) -> list[CapacityRow]:
        s = self.settings
        view = self.cluster_view()
        if not view.nodes and view.note:
            return [CapacityRow(connection=self.conn_id, location=s.location, accelerator=None,
                                pending=view.pending, error=view.note)]
        rows: list[CapacityRow] = []
        tolerations = s.tolerations + [dict(GPU_TOLERATION)]
        by_type: dict[str | None, list[NodeView]] = {}
        for n in view.nodes:
            by_type.setdefault(n.accelerator, []).append(n)
        details_note = {"free": "unknown", "note": view.note} if not view.pods_known else {}
        for accel in sorted(by_type, key=lambda a: (a is None, a or "")):
            nodes = by_type[accel]
            usable = [n for n in nodes if not n.why_unusable(tolerations)]
            details = {"nodes": len(nodes), "nodes_unusable": len(nodes) - len(usable),
                       **details_note}
            if accel is None:
                details.update(cpus_total=sum(n.cpus for n in nodes))
                if view.pods_known:
                    details["cpus_free"] = sum(n.free("cpu") for n in usable)
                rows.append(CapacityRow(connection=self.conn_id, location=s.location,
                                        accelerator=None, pending=view.pending,
                                        price_per_hour=s.price_per_node_hour, details=details))
                continue
            rows.append(CapacityRow(
                connection=self.conn_id, location=s.location, accelerator=accel,
                total=sum(n.gpus for n in nodes),
                free=int(sum(n.free(m.GPU_RESOURCE) for n in usable))
                if view.pods_known else None,
                pending=view.pending, price_per_hour=s.price_per_gpu_hour, details=details))
        return rows

    # --- jobs --------------------------------------------------------------------------------
    def _get_job(self, namespace: str, job_name: str) -> dict[str, Any] | None:
        _, batch = self._apis()
        try:
            return self._call(batch.read_namespaced_job, job_name, namespace)
        except KubeApiError as exc:
            if exc.status == 404:
                return None
            raise

    def _handle(self, job: Mapping[str, Any], adopted: bool) -> JobHandle:
        meta, spec = job.get("metadata") or {}, job.get("spec") or {}
        ann = meta.get("annotations") or {}
        ns = meta.get("namespace") or self.settings.namespace

        def a(key: str, default: str = "") -> str:
            return str(ann.get(m.ANN_PREFIX + key, default))

        return JobHandle(
            backend=self.name, connection=self.conn_id, job_id=meta["name"],
            job_name=meta["name"], location=a("location", f"{self.settings.context}/{ns}"),
            infra=a("infra", self.settings.infra),
            num_nodes=int(spec.get("completions") or 1), accelerator=a("accelerator") or None,
            gpus_per_node=float(a("gpus-per-node", "0") or 0),
            price_per_hour=float(a("price-per-hour", "0") or 0),
            submitted_at=epoch(meta.get("creationTimestamp")) or time.time(), adopted=adopted,
            extra={"namespace": ns, "context": self.settings.context, "uid": meta.get("uid"),
                   "spot": a("spot") == "true"})

    def find(self, job_name: str) -> JobHandle | None:
        job = self._get_job(self.settings.namespace, job_name)
        return self._handle(job, adopted=True) if job is not None else None

    def submit(self, task: Task, offer: Offer, job_name: str,
               env: Mapping[str, str]) -> JobHandle:
        s = self.settings
        ns = s.namespace
        existing = self._get_job(ns, job_name)
        if existing is not None:
            return self._adopt(existing, task, offer, job_name, env)
        if why := self.unsupported(task, offer.request):
            raise SubmissionError(why, retry_elsewhere=True)
        if task.num_nodes > 1 and len(m.pod_hostname(job_name, task.num_nodes - 1)) > 63:
            raise SubmissionError(f"job name {job_name!r} is too long for the pod host names "
                                  f"of {task.num_nodes} ranks (63 characters at most)")
        try:
            files = m.bundle(task, s.bundle_limit)
        except (m.BundleTooLarge, OSError) as exc:
            raise SubmissionError(f"workdir/file_mounts: {exc}", retry_elsewhere=True) from exc
        manifest = self.job_manifest(task, offer, job_name, env)
        _, batch = self._apis()
        try:
            job = self._call(batch.create_namespaced_job, ns, manifest)
        except KubeApiError as exc:
            if exc.status == 409:  # created by a concurrent attempt: adopt it
                job = self._get_job(ns, job_name)
                if job is not None:
                    return self._adopt(job, task, offer, job_name, env)
            raise SubmissionError(f"creating Job {job_name} in {s.location} failed: {exc}",
                                  retry_elsewhere=True) from exc
        self._finish(job, task, offer, job_name, env, files)
        log.info("Submitted Kubernetes Job %s to %s (%s)", job_name, s.location, self.conn_id)
        return self._handle(job, adopted=False)

    def _adopt(self, job: dict[str, Any], task: Task, offer: Offer, job_name: str,
               env: Mapping[str, str]) -> JobHandle:
        log.info("Adopting Kubernetes Job %s in %s: it was submitted before", job_name,
                 self.settings.location)
        ann = (job.get("metadata") or {}).get("annotations") or {}
        if (job.get("spec") or {}).get("suspend") and \
                ann.get(m.ANN_PREFIX + "managed") == "true":
            # a submission that stopped half way: its files may be missing
            try:
                files = m.bundle(task, self.settings.bundle_limit)
            except (m.BundleTooLarge, OSError) as exc:
                raise SubmissionError(f"workdir/file_mounts: {exc}") from exc
            self._finish(job, task, offer, job_name, env, files)
        return self._handle(job, adopted=True)

    def job_manifest(self, task: Task, offer: Offer, job_name: str,
                     env: Mapping[str, str]) -> dict[str, Any]:
        """The Job for ``task`` at ``offer`` (created suspended; see :meth:`_finish`)."""
        s = self.settings
        req = offer.request
        gpus, cpus, mem = _shape_of(req)
        if req.memory and req.memory.endswith("x") and cpus:
            mem = float(req.memory[:-1]) * cpus
        node_selector = dict(s.node_selector)
        node_selector.update(offer.details.get("node_selector") or {})
        tolerations = list(s.tolerations) + list(offer.details.get("tolerations") or [])
        if gpus and not any(t.get("key") == m.GPU_RESOURCE for t in tolerations):
            tolerations.append(dict(GPU_TOLERATION))
        pod_config = ((task.config.get("kubernetes") or {}).get("pod_config") or {})
        shape = m.PodShape(
            image=req.container_image or s.image, gpus=gpus, cpus=cpus or None,
            memory_gb=mem or None, node_selector=node_selector, tolerations=tolerations,
            service_account=s.service_account, priority_class=s.priority_class,
            pvcs={str(k): str(v) for k, v in task.volumes.items()},
            pod_config=dict(pod_config) if isinstance(pod_config, Mapping) else {})
        annotations = {
            m.ANN_PREFIX + "managed": "true",
            m.ANN_PREFIX + "location": s.location,
            m.ANN_PREFIX + "infra": s.infra,
            m.ANN_PREFIX + "accelerator": offer.accelerator or req.accelerator or "",
            m.ANN_PREFIX + "gpus-per-node": str(gpus),
            m.ANN_PREFIX + "price-per-hour": f"{offer.price_per_hour:g}",
            m.ANN_PREFIX + "spot": "true" if req.use_spot else "false",
            m.ANN_PREFIX + "secret": "true" if task.secrets else "false",
            m.ANN_PREFIX + "task-id": str(env.get("SKYPILOT_TASK_ID", job_name)),
        }
        return m.job_manifest(job_name, s.namespace, task.num_nodes, shape,
                              annotations=annotations, has_secrets=bool(task.secrets),
                              ttl_seconds_after_finished=s.ttl_seconds_after_finished)

    def dependents(self, task: Task, offer: Offer, job_name: str, env: Mapping[str, str],
                   files: m.Bundle, owner: Mapping[str, Any] | None) -> list[dict[str, Any]]:
        """The ConfigMap, Secret and (several nodes) Service of the Job ``owner``."""
        s = self.settings
        req = offer.request
        info = {"cluster_name": s.context, "cloud": "Kubernetes", "region": s.context,
                "zone": s.namespace}
        node_env = jobscript.skypilot_env(
            task, task_id=env.get("SKYPILOT_TASK_ID", job_name),
            num_gpus_per_node=jobscript.gpus_per_node(req.accelerator_count
                                                      if req.accelerator else 0),
            cluster_info=info, extra=env)
        for key in task.secrets:  # secrets come from the Secret (envFrom) and win
            node_env.pop(key, None)
        data = m.files_data(task, job_name=job_name, namespace=s.namespace, node_env=node_env,
                            cluster_domain=s.cluster_domain, files=files)
        out = [m.configmap_manifest(job_name, s.namespace, data, owner)]
        if task.secrets:
            out.append(m.secret_manifest(job_name, s.namespace, task.secrets, owner))
        if task.num_nodes > 1:
            out.append(m.service_manifest(job_name, s.namespace, owner))
        return out

    def _finish(self, job: dict[str, Any], task: Task, offer: Offer, job_name: str,
                env: Mapping[str, str], files: m.Bundle) -> None:
        """Create the Job's dependents (owned by it), then let it start."""
        core, batch = self._apis()
        ns = self.settings.namespace
        create = {"ConfigMap": core.create_namespaced_config_map,
                  "Secret": core.create_namespaced_secret,
                  "Service": core.create_namespaced_service}
        try:
            for obj in self.dependents(task, offer, job_name, env, files, job):
                try:
                    self._call(create[obj["kind"]], ns, obj)
                except KubeApiError as exc:
                    if exc.status != 409:
                        raise
            self._call(batch.patch_namespaced_job, job_name, ns,
                       [{"op": "replace", "path": "/spec/suspend", "value": False}])
        except BackendError as exc:
            log.warning("Submission of %s failed half way; deleting the Job: %s", job_name, exc)
            try:
                self._delete_all(job_name, ns)
            except BackendError:
                pass
            raise SubmissionError(f"creating the files of Job {job_name} in "
                                  f"{self.settings.location} failed: {exc}") from exc

    def _delete_all(self, job_name: str, namespace: str) -> list[str]:
        core, batch = self._apis()
        body = {"propagationPolicy": "Foreground"}
        gone = []
        for what, fn, name in (
            ("Job", batch.delete_namespaced_job, job_name),
            ("Service", core.delete_namespaced_service, m.service_name(job_name)),
            ("Secret", core.delete_namespaced_secret, m.secret_name(job_name)),
            ("ConfigMap", core.delete_namespaced_config_map, m.configmap_name(job_name)),
        ):
            try:
                self._call(fn, name, namespace, body=body)
                gone.append(what)
            except KubeApiError as exc:
                if exc.status != 404:
                    raise
        return gone

    def cancel(self, handle: JobHandle) -> None:
        ns = handle.extra.get("namespace") or self.settings.namespace
        gone = self._delete_all(handle.job_name, ns)
        log.info("Cancelled Kubernetes Job %s in %s/%s (deleted: %s)", handle.job_name,
                 self.settings.context, ns, ", ".join(gone) or "nothing left")

    def cleanup(self, handle: JobHandle) -> None:
        """Drop the Secret at once; a Job with a pod that has not ended (one stuck on a bad
        image) is deleted too, so it holds no GPUs. Ended Jobs stay for their logs (TTL)."""
        ns = handle.extra.get("namespace") or self.settings.namespace
        core, _ = self._apis()
        job = self._get_job(ns, handle.job_name)
        if job is not None:
            conds = {c.get("type") for c in (job.get("status") or {}).get("conditions") or []
                     if c.get("status") == "True"}
            running = not conds & {"Complete", "Failed", "FailureTarget", "SuccessCriteriaMet"}
            if running:  # no verdict yet: do its pods still run (or wait, e.g. on an image)?
                try:
                    listed = self._call(core.list_namespaced_pod, ns,
                                        label_selector=f"{m.LABEL_JOB}={handle.job_name}")
                    pods = pods_of(handle.job_name, listed.get("items") or [],
                                   job["metadata"].get("uid"))
                    running = any((p.get("status") or {}).get("phase") not in TERMINAL
                                  for p in pods)
                except KubeApiError:  # cannot see the pods: stop it to be safe
                    pass
            if running:
                gone = self._delete_all(handle.job_name, ns)
                log.info("Deleted %s of unfinished Kubernetes Job %s", ", ".join(gone),
                         handle.job_name)
                return
        try:
            self._call(core.delete_namespaced_secret, m.secret_name(handle.job_name), ns)
        except KubeApiError as exc:
            if exc.status != 404:
                raise

    # --- status ------------------------------------------------------------------------------
    def _by_namespace(self, handles: list[JobHandle]) -> dict[str, list[JobHandle]]:
        groups: dict[str, list[JobHandle]] = {}
        for h in handles:
            groups.setdefault(h.extra.get("namespace") or self.settings.namespace, []).append(h)
        return groups

    def _map(self, groups: dict[str, list[JobHandle]],
             listed: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]] | None]],
             nodes: list[dict[str, Any]] | None) -> dict[str, JobStatus]:
        s = self.settings
        node_views = {n.name: n for n in map(NodeView.parse, nodes)} if nodes is not None \
            else None
        now = time.time()
        out: dict[str, JobStatus] = {}
        for ns, handles in groups.items():
            jobs, pods = listed[ns]
            by_name = {j["metadata"]["name"]: j for j in jobs}
            for h in handles:
                job = by_name.get(h.job_name)
                uid = (job or {}).get("metadata", {}).get("uid")
                mine = pods_of(h.job_name, pods, uid) if pods is not None else None
                if mine is not None:
                    self._seen[h.job_name] = (time.monotonic(), list(mine))
                out[h.job_id] = job_status(
                    job, mine, num_nodes=h.num_nodes, spot=bool(h.extra.get("spot")),
                    nodes=node_views, now=now, image_error_grace=s.image_error_grace,
                    node_not_ready_grace=s.node_not_ready_grace,
                    pending_timeout=s.pending_timeout, namespace=ns)
        return out

    async def aprepare(self) -> None:
        await super().aprepare()
        # the generated async client takes about a second to import: not on the triggerer's loop
        await asyncio.to_thread(_import_clients)

    async def poll(self, handles: list[JobHandle]) -> dict[str, JobStatus]:
        """One Job list and one pod list per namespace, and one node list, for all handles."""
        if not handles:
            return {}
        from kubernetes_asyncio import client as aclient

        groups = self._by_namespace(handles)
        selector = m.LABEL_JOB
        try:
            async with self._async_hook().get_conn() as api:
                core, batch = aclient.CoreV1Api(api), aclient.BatchV1Api(api)
                calls = []
                for ns in groups:
                    calls.append(self._acall(batch.list_namespaced_job, ns,
                                             label_selector=selector))
                    calls.append(self._acall(core.list_namespaced_pod, ns,
                                             label_selector=selector))
                if not self._nodes_forbidden:
                    calls.append(self._acall(core.list_node))
                results = await asyncio.gather(*calls, return_exceptions=True)
        except BackendError:
            raise
        except Exception as exc:  # configuration could not be loaded, session errors
            raise BackendUnreachable(f"{self.conn_id}: {type(exc).__name__}: {exc}") from exc
        return self._collect(groups, list(results))

    def _collect(self, groups: dict[str, list[JobHandle]],
                 results: list[Any]) -> dict[str, JobStatus]:
        nodes: list[dict[str, Any]] | None = None
        if not self._nodes_forbidden:
            node_result = results.pop()
            if isinstance(node_result, KubeApiError) and node_result.status == 403:
                self._nodes_forbidden = True
            elif isinstance(node_result, BaseException):
                log.debug("Node list failed (node checks skipped): %s", node_result)
            else:
                nodes = node_result.get("items") or []
        listed: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = {}
        for i, ns in enumerate(groups):
            jobs, pods = results[2 * i], results[2 * i + 1]
            if isinstance(pods, KubeApiError) and pods.status == 403:
                pods = None  # the Job's own status has to do
            for result in (jobs, pods):
                if isinstance(result, BaseException):
                    if isinstance(result, BackendError):
                        raise result
                    raise BackendUnreachable(f"{self.conn_id}: {result}") from result
            listed[ns] = (jobs.get("items") or [],
                          None if pods is None else pods.get("items") or [])
        return self._map(groups, listed, nodes)

    def status(self, handles: list[JobHandle]) -> dict[str, JobStatus]:
        """The worker's :meth:`poll`: the same requests on the sync client."""
        if not handles:
            return {}
        core, batch = self._apis()
        groups = self._by_namespace(handles)
        calls: list[Callable[[], Any]] = []
        for ns in groups:
            calls.append(lambda ns=ns: self._call(batch.list_namespaced_job, ns,
                                                  label_selector=m.LABEL_JOB))
            calls.append(lambda ns=ns: self._call(core.list_namespaced_pod, ns,
                                                  label_selector=m.LABEL_JOB))
        if not self._nodes_forbidden:
            calls.append(lambda: self._call(core.list_node))
        results: list[Any] = []
        for call in calls:
            try:
                results.append(call())
            except BackendError as exc:  # judged in _collect, as poll's gathered errors are
                results.append(exc)
        return self._collect(groups, results)

    # --- logs --------------------------------------------------------------------------------
    def _cached_pods(self, handle: JobHandle, max_age: float = 5.0) -> list[dict[str, Any]] | None:
        seen = self._seen.get(handle.job_name)
        if seen is not None and time.monotonic() - seen[0] <= max_age:
            return seen[1]
        return None

    def read_log(self, handle: JobHandle, offset: int = 0) -> tuple[str, int]:
        ns = handle.extra.get("namespace") or self.settings.namespace
        core, _ = self._apis()
        pods = self._cached_pods(handle)
        if pods is None:
            listed = self._call(core.list_namespaced_pod, ns,
                                label_selector=f"{m.LABEL_JOB}={handle.job_name}")
            pods = pods_of(handle.job_name, listed.get("items") or [], handle.extra.get("uid"))
        plan, final = log_plan(pods, handle.num_nodes)
        if not plan:
            return "", offset
        # rank 0 up to what this call can return: the log API reads from the start only
        first = self._pod_log(core, ns, plan[0], offset + LOG_CHUNK + 1)
        final = final and len(first) <= offset + LOG_CHUNK
        logs = [(plan[0].rank, first)]
        if final:
            logs += [(v.rank, self._pod_log(core, ns, v)) for v in plan[1:]]
        return slice_log(join_logs(logs, final), offset, final, LOG_CHUNK)

    def _pod_log(self, core: Any, ns: str, view: PodView, limit: int | None = None) -> bytes:
        from kubernetes.client.exceptions import ApiException

        if view.phase == "Pending" and not view.started:
            return b""
        kwargs: dict[str, Any] = {"limit_bytes": limit} if limit else {}
        try:  # kubernetes 36's sync client mangles logs unless the raw response is read
            resp = core.read_namespaced_pod_log(view.name, ns, container=m.CONTAINER,
                                                _preload_content=False,
                                                _request_timeout=self.settings.request_timeout,
                                                **kwargs)
            return resp.data or b""
        except ApiException as exc:  # no log yet, or its node is gone
            log.debug("No log for pod %s: %s", view.name, exc.status)
            return b""
        except Exception as exc:
            raise BackendUnreachable(f"{self.conn_id}: {type(exc).__name__}: {exc}") from exc

    async def read_log_async(self, handle: JobHandle, offset: int = 0) -> tuple[str, int]:
        """As :meth:`read_log`; the pods come from the last poll when it was just now."""
        return (await self.read_logs_async([(handle, offset)]))[handle.job_id]

    async def read_logs_async(self, requests: list[tuple[JobHandle, int]]
                              ) -> dict[str, tuple[str, int]]:
        """New output of many jobs in one client session: the pods come from the last poll
        (else one pod list per namespace for all of them), then the logs, a few at a time
        (Kubernetes has no API for the logs of many pods at once)."""
        from kubernetes_asyncio import client as aclient

        if not requests:
            return {}
        out: dict[str, tuple[str, int]] = {}
        async with self._async_hook().get_conn() as api:
            core = aclient.CoreV1Api(api)
            pods: dict[str, list[dict[str, Any]]] = {}
            missing: dict[str, list[JobHandle]] = {}
            for handle, _ in requests:
                cached = self._cached_pods(handle)
                if cached is not None:
                    pods[handle.job_id] = cached
                else:
                    ns = handle.extra.get("namespace") or self.settings.namespace
                    missing.setdefault(ns, []).append(handle)
            for ns, handles in missing.items():
                selector = (f"{m.LABEL_JOB}={handles[0].job_name}" if len(handles) == 1
                            else m.LABEL_JOB)
                listed = (await self._acall(core.list_namespaced_pod, ns,
                                            label_selector=selector)).get("items") or []
                for h in handles:
                    pods[h.job_id] = pods_of(h.job_name, listed, h.extra.get("uid"))
            limit = asyncio.Semaphore(8)

            async def one(handle: JobHandle, offset: int) -> None:
                ns = handle.extra.get("namespace") or self.settings.namespace
                plan, final = log_plan(pods[handle.job_id], handle.num_nodes)
                if not plan:
                    out[handle.job_id] = ("", offset)
                    return
                async with limit:
                    first = await self._apod_log(core, ns, plan[0], offset + LOG_CHUNK + 1)
                    final = final and len(first) <= offset + LOG_CHUNK
                    logs = [(plan[0].rank, first)]
                    if final:
                        logs += [(v.rank, await self._apod_log(core, ns, v)) for v in plan[1:]]
                out[handle.job_id] = slice_log(join_logs(logs, final), offset, final, LOG_CHUNK)

            await asyncio.gather(*(one(h, o) for h, o in requests))
        return out

    async def _apod_log(self, core: Any, ns: str, view: PodView,
                        limit: int | None = None) -> bytes:
        if view.phase == "Pending" and not view.started:
            return b""
        kwargs: dict[str, Any] = {"limit_bytes": limit} if limit else {}
        try:
            resp = await core.read_namespaced_pod_log(
                view.name, ns, container=m.CONTAINER, _preload_content=False,
                _request_timeout=self.settings.request_timeout, **kwargs)
            try:
                body = await resp.read()
                ok = 200 <= resp.status < 300
            finally:
                resp.release()
        except Exception as exc:  # no log yet, or its node is gone: nothing new to show
            log.debug("No log for pod %s: %s", view.name, exc)
            return b""
        return body if ok else b""


def _truthy(value: Any) -> bool:
    return str(value).strip().lower() in ("true", "1", "yes", "on")


def _api_error(conn_id: str, status: int | None, body: Any) -> BackendError:
    """An API error status -> KubeApiError (or BackendUnreachable: no answer, no auth)."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else str(body or "")
    try:
        message = json.loads(text).get("message") or text
    except (ValueError, AttributeError):
        message = text
    message = message.strip()[:500]
    if not status:
        return BackendUnreachable(f"{conn_id}: Kubernetes API unreachable: {message}")
    if status == 401:
        return BackendUnreachable(f"{conn_id}: Kubernetes API refused the credentials: {message}")
    return KubeApiError(status, message)


__all__ = ["KubernetesBackend", "KubernetesSettings", "job_status"]
