"""What one cluster can offer a task (the "clouds" side): offers and ``show-gpus`` rows.

From one :class:`~.cluster.ClusterView`: the nodes a candidate may use (spot nodes for
``use_spot``, the connection's ``node_selector``, then the GPU type by the trusted node
labels: of the labels that name it, the one whose nodes start the job soonest), then the
shared node-pool rule (:func:`~airflow_skypilot.backends.common.fit.fit_pool`) for shape and
free room. The node selector and tolerations chosen here travel in ``offer.details`` to the
Job's manifest, so the pods land where the capacity was counted. Pure: no I/O.

Free room is what is left for a *new* job: pods not bound yet and our Jobs whose pods do not
exist yet (placements made moments ago) take it first (:func:`.queue.take_pending`,
``details["reserved_by_pending"]``). A full cluster gets a start estimate from the running
pods' ages and deadlines (:func:`.queue.estimate`); where nothing can be said, ``est_start``
stays None and ``details["estimate"]`` is ``"unknown"`` (ranked after every known start). A
CPU-only candidate whose free nodes all have GPUs is marked ``details["gpu_place"]``.

A candidate whose nodes carry taints its pods do not tolerate (the connection's tolerations,
the GPU one, the task's pod_config's) so that too few nodes are left for it does not fit: its
pods would stay Pending for ever. Only taints a person set count (:func:`barring_taints`):
Kubernetes' own (``node.kubernetes.io/*``: NotReady, unreachable...) and the autoscalers' come
and go, and a cordoned node is uncordoned; such nodes are only not free now.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from airflow_skypilot.backends.base import CapacityRow, Offer
from airflow_skypilot.backends.common.fit import PoolNode, fit_pool, hourly_price, shape
from airflow_skypilot.backends.kubernetes.cluster import (
    GPU_LABELS,
    GPU_TOLERATION,
    SPOT_LABELS,
    ClusterView,
    NodeView,
    tolerates,
)
from airflow_skypilot.backends.kubernetes.names import GPU_RESOURCE
from airflow_skypilot.backends.kubernetes.queue import (
    PodInfo,
    Slot,
    estimate,
    matches_term,
    node_terms,
    take_pending,
)
from airflow_skypilot.backends.kubernetes.settings import KubernetesSettings
from airflow_skypilot.spec import accelerators as acc
from airflow_skypilot.spec import fields
from airflow_skypilot.spec.task import ResourceRequest, Task


def applies(req: ResourceRequest, settings: KubernetesSettings) -> bool:
    """Does the candidate's ``infra`` filter allow this connection?"""
    return fields.infra_matches(req.infra, settings.infra)


def pool_node(node: NodeView, tolerations: list[dict[str, Any]]) -> PoolNode:
    """A node as the shared fit rule sees it (one more pod needs a free pod slot)."""
    return PoolNode(name=node.name, cpus=node.cpus, cpus_free=node.free("cpu"),
                    memory_gb=node.memory_gb, memory_free_gb=node.free("memory") / 2**30,
                    gpus=node.gpus, gpus_free=node.free(GPU_RESOURCE),
                    usable=not node.why_unusable(tolerations), has_room=node.free("pods") >= 1)


#: taints that come and go without anyone's hand: Kubernetes' own (not ready, unreachable,
#: pressure, unschedulable...), the cloud provider's until a node is set up, the autoscalers'
#: on a node they remove
_PASSING_TAINTS = ("node.kubernetes.io/", "node.cloudprovider.kubernetes.io/",
                   "ToBeDeletedByClusterAutoscaler", "karpenter.sh/")


def barring_taints(node: NodeView, tolerations: list[dict[str, Any]]) -> list[str]:
    """The taints (``key=value:effect``) that keep pods with ``tolerations`` off ``node`` until
    someone changes the node or the tolerations (not Kubernetes' own, which pass)."""
    return [f"{t.get('key')}={t.get('value') or ''}:{t.get('effect')}" for t in node.taints
            if t.get("effect") in ("NoSchedule", "NoExecute")
            and not str(t.get("key") or "").startswith(_PASSING_TAINTS)
            and not tolerates(tolerations, t)]


@dataclass
class NodeChoice:
    """The nodes a candidate may use, and how its pods are sent there: the node selector and
    tolerations it adds to the connection's (they travel in ``offer.details``)."""

    nodes: list[NodeView] = field(default_factory=list)
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    accelerator: str | None = None  # canonical name of the GPU type chosen
    reason: str = ""  # why there are none
    #: the (label, value) that chose the GPU nodes, and the others naming the same GPU type
    label: tuple[str, str] | None = None
    others: list[tuple[str, str]] = field(default_factory=list)


def choose_nodes(settings: KubernetesSettings, req: ResourceRequest, gpus: int,
                 nodes: list[NodeView], label: tuple[str, str] | None = None) -> NodeChoice:
    """Spot nodes for ``use_spot`` (the spot label most of them share), the connection's
    ``node_selector``, then for GPUs the type label most matching nodes share (``label``:
    that one; the others naming the same type go in ``others``)."""
    s = settings
    selector: dict[str, str] = {}
    extra_tols: list[dict[str, Any]] = []  # what this request adds to the connection's
    if req.use_spot:
        nodes = [n for n in nodes if n.spot_label()]
        if not nodes:
            keys = ", ".join(k for k, _ in SPOT_LABELS)
            return NodeChoice(reason=f"use_spot: no spot nodes in {s.context} "
                                     f"(none labelled {keys})")
        labels = [n.spot_label() for n in nodes]
        key, value = max(labels, key=labels.count)  # type: ignore[arg-type]
        nodes = [n for n in nodes if n.spot_label() == (key, value)]
        selector[key] = value
        extra_tols.append({"key": key, "operator": "Exists"})
    if s.node_selector:
        nodes = [n for n in nodes if all(n.labels.get(k) == v
                                         for k, v in s.node_selector.items())]
    if not gpus:
        if not nodes:
            return NodeChoice(reason=f"no nodes in {s.context} match the connection's "
                                     f"node_selector {s.node_selector}")
        return NodeChoice(nodes, selector, extra_tols)
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
        return NodeChoice(reason=f"no {req.accelerator} nodes in {s.context}"
                                 f" (has: {', '.join(have) or 'no GPU nodes'})")
    if label is None or label not in matches:
        label = max(matches, key=lambda kv: (len(matches[kv]), -GPU_LABELS.index(kv[0])))
    key, value = label
    selector[key] = value
    return NodeChoice(matches[label], selector, extra_tols, acc.canonical_from_label(value),
                      label=label, others=[kv for kv in matches if kv != label])


def offer(conn_id: str, backend: str, settings: KubernetesSettings, task: Task,
          req: ResourceRequest, view: ClusterView, *, unsupported: str,
          bundle_error: str, label: tuple[str, str] | None = None) -> Offer:
    """Candidate ``req`` of ``task`` on this cluster. ``unsupported`` and ``bundle_error``
    are the facade's verdicts on the task ("" when none): either makes it not fit. Its GPU
    type under several node labels (``NVIDIA-H100-80GB-HBM3``, ``NVIDIA-H100-PCIe``): the
    offer on the nodes of the one that starts it soonest (free now, then most free; ``label``:
    that one's)."""
    s = settings
    gpus, _, _ = shape(req)
    offer = Offer(connection=conn_id, backend=backend, location=s.location,
                  infra=s.infra, request=req, num_nodes=task.num_nodes,
                  accelerator=req.accelerator, gpus_per_node=req.accelerator_count,
                  pending_jobs=view.pending, probed_at=view.now, spot=req.use_spot,
                  details={"context": s.context, "namespace": s.namespace},
                  jobs_seen=view.jobs_seen)
    if view.note:
        offer.details["note"] = view.note

    def no(reason: str) -> Offer:
        offer.fits, offer.reason = False, reason
        return offer

    if unsupported:
        return no(unsupported)
    if refusal := s.pod_config_refusal(task):
        return no(refusal)
    if bundle_error:
        return no(f"workdir/file_mounts: {bundle_error}")
    offer.price_per_hour = hourly_price(task.num_nodes, gpus, s.price_per_gpu_hour,
                                        s.price_per_node_hour)
    if not view.nodes and not view.pods_known and view.note:
        if gpus:
            return no(f"cannot see the cluster's GPUs: {view.note}")
        return offer  # CPU only: fits by shape, nothing known about free capacity
    choice = choose_nodes(s, req, gpus, view.nodes, label)
    if choice.reason:
        return no(choice.reason)
    if label is None and choice.others:
        tries = [_offer_on(kv, conn_id, backend, s, task, req, view, unsupported=unsupported,
                           bundle_error=bundle_error) for kv in [choice.label, *choice.others]]
        return min(enumerate(tries), key=lambda io: _soonest(*io))[1]
    if choice.accelerator:
        offer.accelerator = choice.accelerator
    nodes = choice.nodes
    # the task's own pod_config may narrow the nodes further (its pods carry that selector)
    task_selector = _pod_config_selector(task)
    if task_selector:
        nodes = [n for n in nodes if all(n.labels.get(k) == v for k, v in task_selector.items())]
        if not nodes:
            return no(f"no {'GPU ' if gpus else ''}nodes in {s.context} match the task's "
                      f"config.kubernetes.pod_config nodeSelector {task_selector}")
    # and its required node affinity; its tolerations (appended to ours in the manifest) let
    # its pods onto nodes tainted for them
    terms = node_terms(_pod_config_spec(task))
    if terms:
        nodes = [n for n in nodes if any(matches_term(t, n.name, n.labels) for t in terms)]
        if not nodes:
            return no(f"no {'GPU ' if gpus else ''}nodes in {s.context} match the task's "
                      "config.kubernetes.pod_config required node affinity")
    tolerations = s.tolerations + choice.tolerations + _pod_config_tolerations(task)
    fit = fit_pool([pool_node(n, tolerations) for n in nodes], req, task.num_nodes, s.context)
    offer.nodes_total = fit.nodes_total
    offer.details.update({"node_selector": choice.node_selector,
                          "tolerations": choice.tolerations, "gpus_per_node": gpus})
    if gpus:
        offer.gpus_total = fit.gpus_total
    if fit.reason:
        return no(fit.reason)
    barred = {n.name: b for n in nodes if (b := barring_taints(n, tolerations))}
    if barred:
        open_fit = fit_pool([pool_node(n, tolerations) for n in nodes if n.name not in barred],
                            req, task.num_nodes, s.context)
        if open_fit.reason:
            return no(_barred_reason(barred, len(nodes), open_fit.reason))
    unusable = {n.name: r for n in nodes if (r := n.why_unusable(tolerations))}
    if unusable:
        offer.details["nodes_unusable"] = unusable
    if not view.pods_known:
        offer.details["free"] = "unknown"
        offer.details["estimate"] = "unknown"
        offer.notes.append("free room and start unknown: pods may not be listed")
        return offer
    # the work ahead (pods not bound yet, our Jobs without pods yet) takes free room first
    slots = [Slot(n.name, n.labels, n.taints,
                  {k: n.free(k) for k in (GPU_RESOURCE, "cpu", "memory", "pods")},
                  usable=n.ready and not n.unschedulable) for n in view.nodes]
    by_name = {sl.name: sl for sl in slots}
    for pod in view.pods:  # a rank bound already keeps its job's other ranks off its node
        if pod.node in by_name and pod.spread:
            by_name[pod.node].spread.add(pod.spread)
    mine = {n.name for n in nodes}
    pending = [p for p in view.pods if p.node is None] + (view.waiting or [])
    taken = take_pending(slots, pending, mine)
    pool = [_after(n, by_name[n.name], tolerations) for n in nodes]
    after = fit_pool(pool, req, task.num_nodes, s.context)
    if gpus:
        offer.gpus_free = after.gpus_free
        offer.details["gpus_idle"] = fit.gpus_free
    offer.nodes_free = after.nodes_free
    ahead = [p for p, _ in taken.pods]
    offer.details["pending_ours"] = sum(p.ours for p in pending)
    if ahead and (taken.gpus or after.nodes_free < fit.nodes_free):
        offer.details["reserved_by_pending"] = int(taken.gpus)
        offer.details["held_for"] = [p.name for p in ahead][:20]
        what = f"{int(taken.gpus)} free {offer.accelerator}" if taken.gpus else "free room"
        mine_text = f", {len(taken.ours)} of them ours" if taken.ours else ""
        offer.notes.append(f"{what} taken by {len(ahead)} pod(s) pending ahead{mine_text}")
    if not gpus:
        takers = [pn for pn in pool if _takes(pn, req)]
        gpu_nodes = {n.name for n in nodes if n.gpus > 0}
        offer.details["gpu_place"] = all(pn.name in gpu_nodes for pn in (takers or pool))
        if offer.details["gpu_place"]:
            offer.notes.append("CPU-only on GPU nodes")
    if offer.nodes_free >= task.num_nodes:
        offer.est_start = view.now
        return offer
    _, cpus, mem_gb = shape(req)
    need = {GPU_RESOURCE: float(gpus), "cpu": cpus, "memory": mem_gb * 2**30, "pods": 1.0}
    selector = {**task_selector, **s.node_selector, **choice.node_selector}
    job = [PodInfo(name=f"new[{i}]", namespace=s.namespace, node=None, requests=dict(need),
                   created=view.now, selector=selector, tolerations=tolerations,
                   node_terms=terms)
           for i in range(task.num_nodes)]
    running = [p for p in view.pods if p.node]
    est = estimate([sl for sl in slots if sl.name in mine], running, taken, job,
                   view.runs or [], view.now)
    if est.start is None:
        offer.details["estimate"] = "unknown"
        offer.details["estimate_why"] = est.basis
        offer.notes.append(f"start unknown: {est.basis}")
    else:
        offer.est_start = max(est.start, view.now)
        offer.details["estimate"] = est.basis
        offer.notes.append(f"est. {est.basis}")
    return offer


def _barred_reason(barred: dict[str, list[str]], total: int, open_reason: str) -> str:
    """Why the job cannot run once the nodes with taints it does not tolerate (``barred``:
    node -> those taints) are out of the ``total`` matching ones (``open_reason``: the fit
    rule's answer on the rest)."""
    taints = ", ".join(sorted({t for ts in barred.values() for t in ts}))
    names = sorted(barred)
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    where = f"every matching node ({shown})" if len(barred) == total \
        else f"{len(barred)} of {total} matching nodes ({shown})"
    out = (f"taint {taints} on {where}, not tolerated (the connection's tolerations do not "
           "cover it): its pods would stay Pending")
    return out if len(barred) == total else f"{out}; the other nodes: {open_reason}"


def _offer_on(label: tuple[str, str] | None, *args: Any, **kwargs: Any) -> Offer:
    """:func:`offer` on the GPU nodes of one ``label`` (named so inside it, where ``offer`` is
    the offer being made)."""
    return offer(*args, label=label, **kwargs)


def _soonest(index: int, offer: Offer) -> tuple:
    """Which offer of several starts the job soonest: fitting, free now or the soonest
    estimate (an unknown one last), the most free GPUs, then the first."""
    return (not offer.fits, offer.est_start is None, offer.est_start or 0.0,
            -(offer.gpus_free or 0), index)


def _pod_config_spec(task: Task) -> Mapping[str, Any]:
    """``config.kubernetes.pod_config.spec`` ({} when none)."""
    pod_config = (task.config.get("kubernetes") or {}).get("pod_config") or {}
    spec = pod_config.get("spec") if isinstance(pod_config, Mapping) else None
    return spec if isinstance(spec, Mapping) else {}


def _pod_config_selector(task: Task) -> dict[str, str]:
    """``config.kubernetes.pod_config.spec.nodeSelector`` ({} when none)."""
    selector = _pod_config_spec(task).get("nodeSelector")
    return {str(k): str(v) for k, v in selector.items()} if isinstance(selector, Mapping) \
        else {}


def _pod_config_tolerations(task: Task) -> list[dict[str, Any]]:
    """``config.kubernetes.pod_config.spec.tolerations`` ([] when none)."""
    tolerations = _pod_config_spec(task).get("tolerations")
    return [dict(t) for t in tolerations if isinstance(t, Mapping)] \
        if isinstance(tolerations, list) else []


def _after(node: NodeView, slot: Slot, tolerations: list[dict[str, Any]]) -> PoolNode:
    """A node as the fit rule sees it once the work ahead took its share (``slot``)."""
    return PoolNode(name=node.name, cpus=node.cpus, cpus_free=slot.free.get("cpu", 0.0),
                    memory_gb=node.memory_gb,
                    memory_free_gb=slot.free.get("memory", 0.0) / 2**30, gpus=node.gpus,
                    gpus_free=slot.free.get(GPU_RESOURCE, 0.0),
                    usable=not node.why_unusable(tolerations),
                    has_room=slot.free.get("pods", 0.0) >= 1)


def _takes(node: PoolNode, req: ResourceRequest) -> bool:
    gpus, cpus, mem = shape(req)
    return node.usable and node.has_room and node.gpus_free >= gpus \
        and node.cpus_free >= cpus and node.memory_free_gb >= mem


def capacity_rows(conn_id: str, settings: KubernetesSettings,
                  view: ClusterView) -> list[CapacityRow]:
    """``show-gpus``: one row per GPU type (and one for CPU-only nodes)."""
    s = settings
    if not view.nodes and view.note:
        return [CapacityRow(connection=conn_id, location=s.location, accelerator=None,
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
            rows.append(CapacityRow(connection=conn_id, location=s.location,
                                    accelerator=None, pending=view.pending,
                                    price_per_hour=s.price_per_node_hour, details=details))
            continue
        rows.append(CapacityRow(
            connection=conn_id, location=s.location, accelerator=accel,
            total=sum(n.gpus for n in nodes),
            free=int(sum(n.free(GPU_RESOURCE) for n in usable))
            if view.pods_known else None,
            pending=view.pending, price_per_hour=s.price_per_gpu_hour, details=details))
    return rows
