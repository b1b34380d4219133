"""Where a job is: its Job and pods read as a :class:`~airflow_skypilot.backends.base.JobStatus`.

One Job list and one pod list per namespace (and one node list) per poll, for every watched
job; the same requests and the same mapping sync (:func:`list_all`, the worker) and async
(:func:`alist_all`, the triggerer's event loop).

The mapping (:func:`job_status`) follows SkyPilot: a pod that lost its allocation (eviction,
preemption, node lost or NotReady past a grace, ``DisruptionTarget``) is infrastructure, and
so is a pod's failure beside a peer still running on a NotReady node, whatever the grace (the
allocation lost decides before an exit code); a
container exit code is the user's, but not one the cluster's TERM caused (a container
``main.sh`` ended after a stop says so in its termination message, see :mod:`.entry`: a
``kubectl delete pod`` has no ``DisruptionTarget``), save at the pod's own deadline; an image
or container config error lasting past ``image_error_grace`` fails the job with a clear
message and is not failed over (it would fail on any cluster).

Our own cancel is read from the Job: :func:`~airflow_skypilot.backends.kubernetes.submit.cancel`
marks it (:data:`~airflow_skypilot.backends.kubernetes.names.ANN_CANCELLED`) and keeps it until
cleanup, so it reads CANCELLED, not LOST. A Job someone else deletes reads CANCELLED while a
poll still sees it being deleted (as another user's ``scancel`` reads on Slurm); once it is
absent from a list that succeeded it is LOST: the backend can no longer tell a deletion from
its TTL running out before we looked, or its namespace lost.
Terminal states carry the time the job ended as the cluster recorded it (completion, a pod's
end, the Failed condition, the cancel mark), so every poll reports the same ``ended_at``.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from airflow_skypilot.backends.base import JobHandle, JobState, JobStatus
from airflow_skypilot.backends.kubernetes.client import KubeApiError, KubeClient
from airflow_skypilot.backends.kubernetes.cluster import TERMINAL, NodeView, epoch
from airflow_skypilot.backends.kubernetes.entry import STOPPED_EXIT, STOPPED_NOTE
from airflow_skypilot.backends.kubernetes.names import (
    ANN_CANCELLED,
    ANN_PENDING_TIMEOUT,
    ANN_PREFIX,
    CONTAINER,
    INDEX_KEY,
    LABEL_JOB,
)
from airflow_skypilot.backends.kubernetes.settings import KubernetesSettings
from airflow_skypilot.exceptions import BackendError, BackendUnreachable

#: pod ``status.reason`` values that mean the pod's allocation was taken away
DISRUPTION_REASONS = {"Evicted", "Preempting", "NodeLost", "NodeShutdown", "Shutdown",
                      "Terminated", "UnexpectedAdmissionError"}
#: waiting reasons that fail on any cluster (after a grace period, as they may clear)
IMAGE_ERRORS = {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull",
                "ImageInspectError", "RegistryUnavailable"}
CONFIG_ERRORS = {"CreateContainerConfigError", "CreateContainerError"}
#: a Job we created suspended and never resumed this long after: its submitter died
SUSPENDED_TOO_LONG = 120.0


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
    stopped: str = ""  # main.sh's termination message after the cluster's TERM
    deadline: bool = False  # stopped at its own activeDeadlineSeconds: the task's time limit
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
        index = (meta.get("labels") or {}).get(INDEX_KEY) or \
            (meta.get("annotations") or {}).get(INDEX_KEY) or "0"
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
        view.deadline = reason == "DeadlineExceeded"
        if not view.disruption and (reason in DISRUPTION_REASONS or reason.startswith("OutOf")):
            view.disruption = f"pod {view.name}: {reason}" + (
                f" ({status['message']})" if status.get("message") else "")
            view.preempted = reason == "Preempting"
        sched = conds.get("PodScheduled") or {}
        if sched.get("status") == "False":
            view.unschedulable = sched.get("message") or sched.get("reason") or "unschedulable"
        for cs in status.get("containerStatuses") or []:
            state = cs.get("state") or {}
            if cs.get("name") == CONTAINER or len(status.get("containerStatuses")) == 1:
                view.image = images.get(cs.get("name"), cs.get("image", ""))
            if "terminated" in state:
                term = state["terminated"] or {}
                code = term.get("exitCode")
                view.term_reason = term.get("reason") or ""
                view.finished = epoch(term.get("finishedAt")) or view.finished
                view.started = epoch(term.get("startedAt")) or view.started
                if code is not None and (view.exit_code in (None, 0)):
                    view.exit_code = int(code)
                message = str(term.get("message") or "")
                if cs.get("name") == CONTAINER and message.startswith(STOPPED_NOTE):
                    view.stopped = message.strip()
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
        if (meta.get("labels") or {}).get(LABEL_JOB) != job_name:
            continue
        owners = [r.get("uid") for r in meta.get("ownerReferences") or []]
        if uid and owners and uid not in owners:
            continue
        out.append(pod)
    return out


def own_pending_timeout(meta: Mapping[str, Any], default: float | None) -> float | None:
    """The Job's own pending timeout (its task's ``config.kubernetes.provision_timeout``, see
    :data:`~.names.ANN_PENDING_TIMEOUT`; negative: wait) over the connection's ``default``."""
    raw = (meta.get("annotations") or {}).get(ANN_PENDING_TIMEOUT)
    try:
        value = float(raw) if raw is not None else None
    except (TypeError, ValueError):
        return default
    if value is None:
        return default
    return None if value < 0 else value


def _verdict_pod(failed_cond: Mapping[str, Any] | None) -> tuple[str, int | None]:
    """The pod and the exit code a Job's failure names ("Container main for pod ns/X failed
    with exit code N matching FailJob rule ..."): "" and None for what it does not name."""
    message = (failed_cond or {}).get("message", "") or ""
    pod = re.search(r"for pod [^/\s]+/(\S+) failed", message)
    code = re.search(r"exit code (\d+)", message)
    return (pod.group(1) if pod else ""), (int(code.group(1)) if code else None)


def job_status(job: Mapping[str, Any] | None, pods: list[Mapping[str, Any]] | None, *,
               num_nodes: int, spot: bool = False, nodes: Mapping[str, NodeView] | None = None,
               now: float | None = None, image_error_grace: float = 60.0,
               node_not_ready_grace: float = 120.0, pending_timeout: float | None = None,
               namespace: str = "") -> JobStatus:
    """One job's state from its Job object and pods (SkyPilot's rule: the allocation is gone
    -> infrastructure; the allocation was fine and the program exited non-zero -> user).

    ``pods`` None: they may not be listed; the Job's own status and conditions decide.
    An ended job whose pods still run (a rank beside a failed or preempted one; pods within
    their grace period after a cancel; pods the Job's deletion left behind) is ``still_up``:
    its user code may still run, so it is not dead until they end.
    """
    now = time.time() if now is None else now
    pods_known = pods is not None
    views = sorted((PodView.parse(p) for p in pods or []), key=lambda v: (v.rank, v.created))
    # a pod whose Node object is gone is gone with it (PodGC deletes it); one on a NotReady
    # node may still run its code (a partition): not confirmed ended
    running = [v for v in views if v.phase not in TERMINAL
               and not (nodes is not None and v.node and v.node not in nodes)]
    if job is None:
        return JobStatus(JobState.LOST, reason=f"the Job no longer exists in namespace "
                                               f"{namespace or '?'}" + (
                                                   f"; {len(running)} of its pods still run"
                                                   if running else ""),
                         raw_state="(gone)", still_up=bool(running))
    meta, status = job.get("metadata") or {}, job.get("status") or {}
    up = bool(running) if pods_known else bool(status.get("active") or status.get("terminating"))
    latest: dict[int, PodView] = {}
    for v in views:
        latest[v.rank] = v
    started = [v.started for v in views if v.started] or [epoch(status.get("startTime"))]
    started_at = min((s for s in started if s), default=None)
    finished = [v.finished for v in views if v.finished]
    conds = {c.get("type"): c for c in status.get("conditions") or []
             if c.get("status") == "True"}
    failed_cond = conds.get("Failed") or conds.get("FailureTarget")
    verdict = failed_cond or conds.get("Complete") or conds.get("SuccessCriteriaMet")
    pending_timeout = own_pending_timeout(meta, pending_timeout)
    cancelled_raw = (meta.get("annotations") or {}).get(ANN_CANCELLED)
    cancelled_at = epoch(cancelled_raw) if cancelled_raw else None
    if cancelled_raw and cancelled_at is None:  # a mark we cannot read is still a mark
        cancelled_at = epoch(meta.get("creationTimestamp")) or 0.0
    # when it ended, as the cluster recorded it: the same answer on every poll (the Job's own
    # record first: it outlives the pods)
    ended_at = (epoch(status.get("completionTime"))
                or epoch((verdict or {}).get("lastTransitionTime"))
                or (max(finished) if finished else None)
                or cancelled_at or epoch(meta.get("deletionTimestamp")))
    nodes_used = [latest[r].node for r in sorted(latest) if latest[r].node]
    phases = ",".join(f"{r}:{latest[r].phase}" for r in sorted(latest))

    def out(state: JobState, reason: str = "", exit_code: int | None = None,
            raw: str = "", ended: float | None = None,
            codes: list[int] | None = None) -> JobStatus:
        return JobStatus(state, reason=reason, exit_code=exit_code, started_at=started_at,
                         ended_at=(ended or ended_at or now) if state.terminal else None,
                         nodes=nodes_used, raw_state=raw or phases or "no pods",
                         exit_codes=list(codes or []), still_up=state.terminal and up)

    def infra(reason: str, preempted: bool = False, ended: float | None = None,
              codes: list[int] | None = None) -> JobStatus:
        state = JobState.PREEMPTED if preempted or spot else JobState.INFRA_FAILED
        return out(state, reason, ended=ended, codes=codes)

    if "Complete" in conds or "SuccessCriteriaMet" in conds:
        return out(JobState.SUCCEEDED, exit_code=0, raw="Complete")
    if cancelled_at is not None:
        # our cancel (it marks only a Job that had not ended): what the pods and the Job
        # controller did after it (pods killed, counted as failed, the Job failed) is its doing
        return out(JobState.CANCELLED, f"cancelled (the Job is marked {ANN_CANCELLED}="
                                       f"{cancelled_raw})", raw="Cancelled", ended=cancelled_at)
    if meta.get("deletionTimestamp") and failed_cond is None:
        return out(JobState.CANCELLED, "the Job was deleted", raw="Deleting")
    # 1. the allocation was taken away: eviction, preemption, node lost
    disrupted = [v for v in views if v.disruption]
    if disrupted:
        first = min(disrupted, key=lambda v: v.finished or v.created)
        return infra(first.disruption, first.preempted, first.finished)
    # a peer's failure beside a pod whose node is NotReady: the allocation lost decides before
    # an exit code (the peer's collective broke with it), however briefly the node is NotReady
    # (the grace only keeps a healthy running job from failing for a blip)
    peers_failed = [v for v in views if v.phase == "Failed" and v.exit_code not in (None, 0)]
    if nodes is not None:
        for v in views:
            if v.phase in TERMINAL or not v.node:
                continue
            node = nodes.get(v.node)
            if node is None:
                return infra(f"node {v.node} of pod {v.name} no longer exists")
            since = None if node.not_ready_since is None else now - node.not_ready_since
            if node.ready or not (peers_failed or (
                    since is not None and since >= node_not_ready_grace)):
                continue
            what = f"node {v.node} of pod {v.name} " + (
                f"has been NotReady for {int(since)}s" if since is not None else "is NotReady")
            if not peers_failed:
                return infra(what)
            first = min(peers_failed, key=lambda p: (p.finished or now, p.rank))
            return infra(f"{what}, beside pod {first.name}'s failure (exit code "
                         f"{first.exit_code}): the allocation was lost, not the program",
                         ended=first.finished,
                         codes=sorted({p.exit_code for p in peers_failed if p.exit_code}))
    # 2. the user's program failed (pods the controller is deleting are victims, not causes;
    # so are pods the cluster stopped, but at their own deadline: the task's time limit)
    failed = [v for v in peers_failed if not v.deleting and (not v.stopped or v.deadline)]
    if failed:
        first = min(failed, key=lambda v: (v.finished or now, v.rank))
        extra = " (out of memory: OOMKilled)" if first.term_reason == "OOMKilled" else \
            " (time limit: the pod's activeDeadlineSeconds)" if first.deadline else ""
        where = f" on rank {first.rank}" if num_nodes > 1 else ""
        return out(JobState.FAILED, f"exit code {first.exit_code}{where}{extra}",
                   first.exit_code, ended=first.finished,  # the first failure, not the kills
                   codes=sorted({int(v.exit_code) for v in failed}))
    # 2b. the cluster stopped a pod while the job ran, with no disruption recorded (a pod
    # deleted by hand): main.sh, TERMed, said so (its exit code is its own, not the program's)
    stopped = [v for v in views if v.stopped and not v.deadline]
    deadline_job = (failed_cond or {}).get("reason") == "DeadlineExceeded"
    verdict_pod, verdict_code = _verdict_pod(failed_cond)
    # ...unless the Job's verdict blames another pod, gone since, for a code of its own: a
    # rank that failed, and the ranks the controller then stopped (rule 3 reads its code)
    blames_other = bool(verdict_pod) and verdict_code not in (None, STOPPED_EXIT) and \
        all(v.name != verdict_pod for v in stopped)
    if stopped and not deadline_job and not blames_other:
        first = min(stopped, key=lambda v: (v.finished or now, v.rank))
        return infra(f"pod {first.name} was stopped while the job ran ({first.stopped})",
                     ended=first.finished)
    # 3. the Job's own verdict, which outlives its pods
    if failed_cond is not None:
        reason, message = failed_cond.get("reason", ""), failed_cond.get("message", "")
        raw = f"Failed:{reason}"
        if "DisruptionTarget" in message:
            return infra(f"the Job failed: {message}")
        if verdict_code == STOPPED_EXIT and verdict_pod and pods_known and \
                all(v.name != verdict_pod for v in views):
            # its pod ended as main.sh ends a stopped container and is gone: deleted (a pod
            # that fails on its own stays until its Job goes), its termination message with
            # it. (Not a 143 or 137: a program's own TERM or OOM kill gives them too)
            return infra(f"the Job failed: {message}; the pod is gone: it was deleted while "
                         f"the job ran", ended=ended_at)
        if verdict_code is not None:
            return out(JobState.FAILED, f"exit code {verdict_code}", verdict_code, raw)
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
        return out(JobState.SUCCEEDED, exit_code=0)
    if any(v.phase == "Running" for v in latest.values()):
        return out(JobState.RUNNING)
    if not pending_reason:
        waiting = [v for v in latest.values() if v.phase == "Pending"]
        if (job.get("spec") or {}).get("suspend"):
            age = now - (epoch(meta.get("creationTimestamp")) or now)
            if (meta.get("annotations") or {}).get(ANN_PREFIX + "managed") == "true" and \
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


# --- one poll for many jobs -------------------------------------------------------------------

#: per namespace, its Jobs and its pods (None: pods may not be listed)
Listed = dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]] | None]]


def by_namespace(handles: list[JobHandle], default: str) -> dict[str, list[JobHandle]]:
    """The handles grouped by the namespace their Job is in."""
    groups: dict[str, list[JobHandle]] = {}
    for h in handles:
        groups.setdefault(h.extra.get("namespace") or default, []).append(h)
    return groups


def list_all(client: KubeClient, groups: Mapping[str, list[JobHandle]],
             with_nodes: bool) -> list[Any]:
    """Per namespace its Jobs and its pods, then (``with_nodes``) the nodes, on the sync
    client; an error is returned in its place, as :func:`alist_all` gathers them."""
    core, batch = client.apis()
    calls: list[Callable[[], Any]] = []
    for ns in groups:
        calls.append(lambda ns=ns: client.call(batch.list_namespaced_job, ns,
                                               label_selector=LABEL_JOB))
        calls.append(lambda ns=ns: client.call(core.list_namespaced_pod, ns,
                                               label_selector=LABEL_JOB))
    if with_nodes:
        calls.append(lambda: client.call(core.list_node))
    results: list[Any] = []
    for call in calls:
        try:
            results.append(call())
        except BackendUnreachable as exc:  # the next would wait for the same silence
            return results + [exc] * (len(calls) - len(results))
        except BackendError as exc:  # judged by listed(), as alist_all's gathered errors are
            results.append(exc)
    return results


async def alist_all(client: KubeClient, groups: Mapping[str, list[JobHandle]],
                    with_nodes: bool) -> list[Any]:
    """:func:`list_all` on the async client, all requests at once in one session."""
    try:
        async with client.asession() as (core, batch):
            calls = []
            for ns in groups:
                calls.append(client.acall(batch.list_namespaced_job, ns,
                                          label_selector=LABEL_JOB))
                calls.append(client.acall(core.list_namespaced_pod, ns,
                                          label_selector=LABEL_JOB))
            if with_nodes:
                calls.append(client.acall(core.list_node))
            results = await asyncio.gather(*calls, return_exceptions=True)
    except BackendError:
        raise
    except Exception as exc:  # configuration could not be loaded, session errors
        raise BackendUnreachable(f"{client.conn_id}: {type(exc).__name__}: {exc}") from exc
    return list(results)


def take_nodes(results: list[Any]) -> tuple[list[dict[str, Any]] | None, BaseException | None]:
    """Pop the node list off the end of ``results``: (nodes, or None and why not)."""
    node_result = results.pop()
    if isinstance(node_result, BaseException):
        return None, node_result
    return node_result.get("items") or [], None


def listed(conn_id: str, groups: Mapping[str, list[JobHandle]], results: list[Any]
           ) -> tuple[Listed, dict[str, BackendError]]:
    """Each namespace's Jobs and pods from ``results``, and the namespaces that could not be
    listed (a failed Job list, or a failed pod list but HTTP 403: then the Job's own status
    has to do), with why. A namespace that fails says nothing about the others' jobs (one
    whose RBAC changed must not make every job of the connection look lost); raises only
    when none could be listed."""
    out: Listed = {}
    failed: dict[str, BackendError] = {}
    for i, ns in enumerate(groups):
        jobs, pods = results[2 * i], results[2 * i + 1]
        if isinstance(pods, KubeApiError) and pods.status == 403:
            pods = None  # the Job's own status has to do
        error = next((r for r in (jobs, pods) if isinstance(r, BaseException)), None)
        if error is not None:
            failed[ns] = error if isinstance(error, BackendError) else \
                BackendUnreachable(f"{conn_id}: {error}")
            continue
        out[ns] = (jobs.get("items") or [], None if pods is None else pods.get("items") or [])
    if failed and not out:
        error = next(iter(failed.values()))
        raise error
    return out, failed


def unlisted(groups: Mapping[str, list[JobHandle]], failed: Mapping[str, BackendError]
             ) -> dict[str, JobStatus]:
    """The jobs of namespaces that could not be listed: no answer about them (never "gone")."""
    return {h.job_id: JobStatus(JobState.UNKNOWN,
                                reason=f"namespace {ns} could not be listed: {error}")
            for ns, error in failed.items() for h in groups[ns]}


def statuses(groups: Mapping[str, list[JobHandle]], listed: Listed,
             nodes: list[dict[str, Any]] | None, settings: KubernetesSettings
             ) -> tuple[dict[str, JobStatus], dict[str, list[dict[str, Any]]]]:
    """Every handle's status, keyed by job id, and the pods seen of each job (by job name:
    log reads reuse them)."""
    s = settings
    node_views = {n.name: n for n in map(NodeView.parse, nodes)} if nodes is not None \
        else None
    now = time.time()
    out: dict[str, JobStatus] = {}
    seen: dict[str, list[dict[str, Any]]] = {}
    for ns, handles in groups.items():
        jobs, pods = listed[ns]
        by_name = {j["metadata"]["name"]: j for j in jobs}
        for h in handles:
            job = by_name.get(h.job_name)
            uid = (job or {}).get("metadata", {}).get("uid")
            mine = pods_of(h.job_name, pods, uid) if pods is not None else None
            if mine is not None:
                seen[h.job_name] = list(mine)
            out[h.job_id] = job_status(
                job, mine, num_nodes=h.num_nodes, spot=bool(h.extra.get("spot")),
                nodes=node_views, now=now, image_error_grace=s.image_error_grace,
                node_not_ready_grace=s.node_not_ready_grace,
                pending_timeout=s.pending_timeout, namespace=ns)
    return out, seen
