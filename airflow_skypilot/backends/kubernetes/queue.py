"""The work ahead of a new job on a cluster, and when GPUs free up: pure readings of one probe.

Kubernetes has no queue with planned starts (its scheduler binds any pending pod that fits,
by priority then age, with no reservations), so two things are modelled from what one probe
lists:

- **Pending work ahead** (:func:`take_pending`): pods not bound yet (just created, or waiting
  for room) and our Jobs whose pods do not exist yet (a placement made moments ago: the Job
  controller has not created them) take the free room first, oldest first, where their
  selectors and tolerations let them. What they take is not free for a new job
  (``details["reserved_by_pending"]``).
- **When room frees up** (:func:`estimate`): each running pod on the candidate's nodes ends at
  its ``activeDeadlineSeconds`` at the latest; a pod of ours, else, at the median run time of
  our finished pods that ran at least as long as it has (its age). Other users' pods without
  a deadline, ours older than every finished run, and ours on clusters without enough
  finished runs have no end that can be said (our runs say nothing of other users' work: in
  the scheduling benchmark, reading them so put jobs in queues that did not move). The
  pending work ahead binds as room frees, then the new job; where the job's start depends on
  an end that cannot be said, the estimate is "unknown" (``est_start`` None, ranked after
  every known start).
"""

from __future__ import annotations

import heapq
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from airflow_skypilot.backends.kubernetes.names import GPU_RESOURCE, LABEL_JOB

#: an estimate from pod ages needs this many finished runs of ours
MIN_RUNS = 5
#: the resources a pod takes on a node
RESOURCES = (GPU_RESOURCE, "cpu", "memory", "pods")


def _epoch(text: Any) -> float | None:
    from airflow_skypilot.backends.kubernetes.cluster import epoch

    return epoch(text)


@dataclass
class PodInfo:
    """What the model needs of one pod (or one pod-to-be of a Job without pods)."""

    name: str
    namespace: str
    node: str | None  # bound to; None: pending
    requests: dict[str, float]
    created: float
    started: float | None = None
    deadline_s: float | None = None  # spec.activeDeadlineSeconds
    selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    priority: int = 0
    ours: bool = False
    job: str = ""  # our Job's name (LABEL_JOB)
    phase: str = ""
    #: pods with the same key never share a node (a required pod anti-affinity on the
    #: hostname that matches the pod's own labels: a multi-node job's ranks, one per node)
    spread: str = ""
    #: required node affinity: the nodeSelectorTerms one of which a node must match
    node_terms: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def parse(cls, pod: Mapping[str, Any]) -> PodInfo:
        from airflow_skypilot.backends.kubernetes.cluster import pod_requests

        meta, spec, status = (pod.get("metadata") or {}, pod.get("spec") or {},
                              pod.get("status") or {})
        labels = meta.get("labels") or {}
        requests = pod_requests(pod)
        requests["pods"] = 1.0
        return cls(
            name=meta.get("name", ""), namespace=meta.get("namespace", ""),
            node=spec.get("nodeName") or None, requests=requests,
            created=_epoch(meta.get("creationTimestamp")) or 0.0,
            started=_epoch(status.get("startTime")),
            deadline_s=_number(spec.get("activeDeadlineSeconds")),
            selector=dict(spec.get("nodeSelector") or {}),
            tolerations=list(spec.get("tolerations") or []),
            priority=int(_number(spec.get("priority")) or 0), ours=LABEL_JOB in labels,
            job=labels.get(LABEL_JOB, ""), phase=status.get("phase", ""),
            spread=spread_key(spec, labels), node_terms=node_terms(spec))


def node_terms(spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A pod spec's required node affinity terms ([] when none)."""
    required = (((spec.get("affinity") or {}).get("nodeAffinity") or {})
                .get("requiredDuringSchedulingIgnoredDuringExecution") or {})
    return [t for t in required.get("nodeSelectorTerms") or [] if isinstance(t, Mapping)]


def matches_term(term: Mapping[str, Any], name: str, labels: Mapping[str, str]) -> bool:
    """Does a node match one nodeSelectorTerm (its expressions and fields all hold)?"""
    for expr, value_of in [*((e, labels.get) for e in term.get("matchExpressions") or []),
                           *((e, {"metadata.name": name}.get)
                             for e in term.get("matchFields") or [])]:
        have = value_of(expr.get("key", ""))
        values = [str(v) for v in expr.get("values") or []]
        op = expr.get("operator", "")
        if op == "In" and have not in values:
            return False
        if op == "NotIn" and have in values:
            return False
        if op == "Exists" and have is None:
            return False
        if op == "DoesNotExist" and have is not None:
            return False
        if op in ("Gt", "Lt"):
            try:
                a, b = int(have or ""), int(values[0])
            except (ValueError, IndexError):
                return False
            if (op == "Gt" and not a > b) or (op == "Lt" and not a < b):
                return False
    return True


def spread_key(spec: Mapping[str, Any], labels: Mapping[str, str]) -> str:
    """The key of a required pod anti-affinity on the hostname against the pod's own labels
    ("" when it has none): the scheduler puts no two such pods on one node."""
    anti = ((spec.get("affinity") or {}).get("podAntiAffinity") or {})
    for term in anti.get("requiredDuringSchedulingIgnoredDuringExecution") or []:
        match = (term.get("labelSelector") or {}).get("matchLabels") or {}
        if term.get("topologyKey") == "kubernetes.io/hostname" and match and all(
                labels.get(k) == v for k, v in match.items()):
            return ",".join(f"{k}={v}" for k, v in sorted(match.items()))
    return ""


def _number(value: Any) -> float | None:
    try:
        return float(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def waiting_jobs(jobs: Iterable[Mapping[str, Any]], pods: Sequence[PodInfo]) -> list[PodInfo]:
    """The pods-to-be of our Jobs that have no pods yet (not finished, not cancelled): one per
    parallel pod, from the Job's template."""
    from airflow_skypilot.backends.kubernetes.cluster import pod_requests
    from airflow_skypilot.backends.kubernetes.names import ANN_CANCELLED

    with_pods = {p.job for p in pods if p.job}
    out = []
    for job in jobs:
        meta, spec, status = (job.get("metadata") or {}, job.get("spec") or {},
                              job.get("status") or {})
        name = (meta.get("labels") or {}).get(LABEL_JOB) or meta.get("name", "")
        if not name or name in with_pods or ANN_CANCELLED in (meta.get("annotations") or {}):
            continue
        conditions = {c.get("type") for c in status.get("conditions") or []
                      if c.get("status") == "True"}
        if conditions & {"Complete", "Failed", "FailureTarget", "SuccessCriteriaMet"}:
            continue
        count = int(_number(spec.get("parallelism")) or 1)
        done = int(_number(status.get("succeeded")) or 0) + int(_number(status.get("failed"))
                                                                 or 0)
        if status.get("active") or done >= int(_number(spec.get("completions")) or count):
            continue
        template = spec.get("template") or {}
        tspec = template.get("spec") or {}
        spread = spread_key(tspec, (template.get("metadata") or {}).get("labels") or {})
        requests = pod_requests(template)
        requests["pods"] = 1.0
        for i in range(count):
            out.append(PodInfo(
                name=f"{meta.get('name', '')}[{i}]", namespace=meta.get("namespace", ""),
                node=None, requests=dict(requests),
                created=_epoch(meta.get("creationTimestamp")) or 0.0,
                selector=dict(tspec.get("nodeSelector") or {}),
                tolerations=list(tspec.get("tolerations") or []),
                priority=int(_number(tspec.get("priority")) or 0), ours=True, job=name,
                phase="(no pods yet)", spread=spread, node_terms=node_terms(tspec)))
    return out


def run_times(pods: Iterable[Mapping[str, Any]]) -> list[float]:
    """How long our finished pods ran (their container's start to end), in seconds."""
    out = []
    for pod in pods:
        status = pod.get("status") or {}
        if status.get("phase") not in ("Succeeded", "Failed"):
            continue
        for cs in status.get("containerStatuses") or []:
            term = (cs.get("state") or {}).get("terminated") or {}
            start = _epoch(term.get("startedAt")) or _epoch(status.get("startTime"))
            end = _epoch(term.get("finishedAt"))
            if start and end and end > start and start > 86400:  # not an epoch-0 placeholder
                out.append(end - start)
                break
    return sorted(out)


# --- the model -------------------------------------------------------------------------------


@dataclass
class Slot:
    """One node's free room: what a pod may take, and who may land there."""

    name: str
    labels: dict[str, str]
    taints: list[dict[str, Any]]
    free: dict[str, float]
    usable: bool = True
    spread: set[str] = field(default_factory=set)  # the spread keys of pods bound here


def admits(slot: Slot, pod: PodInfo) -> bool:
    """May ``pod`` land on ``slot`` (selector, taints)? Room aside."""
    from airflow_skypilot.backends.kubernetes.cluster import tolerates

    if not slot.usable:
        return False
    if any(slot.labels.get(k) != v for k, v in pod.selector.items()):
        return False
    if pod.node_terms and not any(matches_term(t, slot.name, slot.labels)
                                  for t in pod.node_terms):
        return False
    return all(tolerates(pod.tolerations, t) for t in slot.taints
               if t.get("effect") in ("NoSchedule", "NoExecute"))


def _room(slot: Slot, need: Mapping[str, float]) -> bool:
    return all(slot.free.get(k, 0.0) + 1e-9 >= v for k, v in need.items() if k in RESOURCES)


def _take(slot: Slot, need: Mapping[str, float], sign: float = -1.0) -> None:
    for k, v in need.items():
        if k in RESOURCES:
            slot.free[k] = slot.free.get(k, 0.0) + sign * v


def _bind(slots: Sequence[Slot], pod: PodInfo) -> Slot | None:
    """Where the scheduler may put ``pod`` now (tightest GPU fit, never beside a pod it must
    stay apart from), taking its room; None."""
    fits = [s for s in slots if _room(s, pod.requests) and admits(s, pod)
            and not (pod.spread and pod.spread in s.spread)]
    if not fits:
        return None
    best = min(fits, key=lambda s: (s.free.get(GPU_RESOURCE, 0.0), s.free.get("cpu", 0.0),
                                    s.name))
    _take(best, pod.requests)
    if pod.spread:
        best.spread.add(pod.spread)
    return best


def order(pods: Iterable[PodInfo]) -> list[PodInfo]:
    """The scheduler's queue order: higher priority first, then older."""
    return sorted(pods, key=lambda p: (-p.priority, p.created, p.name))


@dataclass
class Taken:
    """What the pending work ahead took of the free room."""

    gpus: float = 0.0  # on the candidate's nodes
    pods: list[tuple[PodInfo, str]] = field(default_factory=list)  # bound now: (pod, node)
    left: list[PodInfo] = field(default_factory=list)  # still waiting after that

    @property
    def ours(self) -> list[PodInfo]:
        return [p for p, _ in self.pods if p.ours]


def take_pending(slots: Sequence[Slot], pending: Iterable[PodInfo], mine: set[str]) -> Taken:
    """Bind the pending work ahead where it fits now (changes ``slots``); GPUs taken on the
    candidate's nodes ``mine`` are counted."""
    out = Taken()
    for pod in order(pending):
        slot = _bind(slots, pod)
        if slot is None:
            out.left.append(pod)
            continue
        out.pods.append((pod, slot.name))
        if slot.name in mine:
            out.gpus += pod.requests.get(GPU_RESOURCE, 0.0)
    return out


def median_above(runs: Sequence[float], age: float) -> float | None:
    """The median run time of the finished runs longer than ``age`` (None: none were)."""
    longer = [r for r in runs if r > age]
    return statistics.median(longer) if longer else None


@dataclass(frozen=True)
class Estimate:
    start: float | None  # epoch; None: cannot be said
    basis: str  # how, or why not


def estimate(slots: Sequence[Slot], running: Iterable[PodInfo], taken: Taken,
             job: Sequence[PodInfo], runs: Sequence[float], now: float) -> Estimate:
    """When ``job`` (its pods, alike, one per node) could start on ``slots`` (free room now, after
    ``taken``: the pending work bound now, and what still waits, in queue order), as running
    pods end and the waiting work binds first. Work bound in the model ends after the median
    run of ours."""
    enough = len(runs) >= MIN_RUNS
    typical_run = statistics.median(runs) if enough else math.inf
    ends: list[tuple[float, int, str, dict[str, float]]] = []
    unknown = deadlines = 0
    names = {s.name for s in slots}
    seq = 0

    def ends_at(when: float, node: str, need: dict[str, float]) -> None:
        nonlocal seq
        if not math.isinf(when):
            seq += 1
            heapq.heappush(ends, (when, seq, node, need))

    for pod in running:
        if pod.node not in names:
            continue
        started = pod.started or pod.created or now
        end = math.inf
        if pod.deadline_s is not None:
            end = started + pod.deadline_s
            deadlines += 1
        if enough and pod.ours:  # our history speaks for our pods, not for other users'
            typical = median_above(runs, now - started)
            if typical is not None:
                end = min(end, started + typical)
        if math.isinf(end):
            unknown += 1
        ends_at(max(end, now), pod.node, pod.requests)
    for pod, node in taken.pods:
        if node in names:  # work ahead bound elsewhere (another GPU type) frees nothing here
            ends_at(now + typical_run, node, pod.requests)
    by_name = {s.name: s for s in slots}
    queue = [p for p in taken.left if any(admits(s, p) for s in slots)]
    wants = job[0].requests if job else {}
    homes = [sl for sl in slots if job and admits(sl, job[0])]
    t = now
    while True:
        left: list[PodInfo] = []
        unfit: set[tuple] = set()  # within one step room only shrinks
        for pod in queue:  # the work ahead binds first, as room frees
            key = (tuple(sorted(pod.requests.items())), tuple(sorted(pod.selector.items())),
                   repr(pod.tolerations))
            slot = None if key in unfit else _bind(slots, pod)
            if slot is None:
                unfit.add(key)
                left.append(pod)
            else:
                ends_at(t + typical_run, slot.name, pod.requests)
        queue = left
        # the job's pods are alike and go one per node (a multi-node job's anti-affinity)
        if sum(1 for sl in homes if _room(sl, wants)) >= len(job):
            break
        if not ends:
            why = []
            if not enough:
                why.append(f"{len(runs)} finished run(s) of ours on record, {MIN_RUNS} needed")
            if unknown:
                why.append(f"{unknown} running pod(s) without a deadline whose end our runs "
                           "cannot tell (another user's, or older than any of ours)")
            return Estimate(None, "; ".join(why) or "no running pod here would free room")
        t, _, node, need = heapq.heappop(ends)
        _take(by_name[node], need, +1.0)
        while ends and ends[0][0] <= t:
            _, _, node, need = heapq.heappop(ends)
            _take(by_name[node], need, +1.0)
    parts = []
    if enough:
        parts.append(f"running pods' ages against the median run of {len(runs)} finished "
                     "pods of ours")
    if deadlines:
        parts.append(f"{deadlines} pod deadline(s) (activeDeadlineSeconds)")
    return Estimate(t, "from " + " and ".join(parts) if parts else "now")
