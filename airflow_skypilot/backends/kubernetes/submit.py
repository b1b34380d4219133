"""A job's objects on the cluster: create, adopt, start, delete (the "provision" side).

Submission is a suspended ``batch/v1`` Job first, then its ConfigMap, Secrets (the task's
secrets, its workdir and file mounts) and (several nodes) headless Service, all owned by the
Job (:func:`start`), then the Job is resumed. The Job is created first so that its name is
taken once: a Job of that name already there is adopted, never created twice, and one a crash
left suspended is finished by whoever adopts it. These functions return what happened; the
facade decides what to log.

Cancel (:func:`cancel`) keeps the Job as the record of what happened: it marks it
(:data:`~airflow_skypilot.backends.kubernetes.names.ANN_CANCELLED`) and suspends it, so no pod
is started again, deletes its pods (the program gets SIGTERM and its grace period) and its
Secret, ConfigMap and Service; the Job then reads CANCELLED (not LOST, which is an
infrastructure failure) until :func:`cleanup` deletes it. A cancelled Job is never resumed by
an adoption. Whether the job had ended before is decided when it is cancelled (a Job verdict,
or a pod that failed by itself: then it is not marked), not by comparing our clock with the
API server's timestamps.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from airflow_skypilot.backends.base import JobHandle
from airflow_skypilot.backends.kubernetes.bundle import Bundle, BundleTooLarge, bundle
from airflow_skypilot.backends.kubernetes.client import KubeApiError, KubeClient
from airflow_skypilot.backends.kubernetes.cluster import TERMINAL, epoch
from airflow_skypilot.backends.kubernetes.manifests import too_large
from airflow_skypilot.backends.kubernetes.names import (
    ANN_CANCELLED,
    ANN_PREFIX,
    LABEL_JOB,
    bundle_name,
    configmap_name,
    pod_hostname,
    secret_name,
    service_name,
)
from airflow_skypilot.backends.kubernetes.settings import KubernetesSettings
from airflow_skypilot.backends.kubernetes.status import pods_of
from airflow_skypilot.exceptions import BackendUnreachable, SubmissionError
from airflow_skypilot.spec.task import Task

#: the Job conditions that are a verdict
FINISHED = {"Complete", "Failed", "FailureTarget", "SuccessCriteriaMet"}


def get_job(client: KubeClient, namespace: str, job_name: str) -> dict[str, Any] | None:
    """The Job named ``job_name``, or None."""
    _, batch = client.apis()
    try:
        return client.call(batch.read_namespaced_job, job_name, namespace)
    except KubeApiError as exc:
        if exc.status == 404:
            return None
        raise


def list_jobs(client: KubeClient, namespace: str, prefix: str) -> list[dict[str, Any]]:
    """Our Jobs in ``namespace`` whose name starts with ``prefix`` (one list request)."""
    _, batch = client.apis()
    listed = client.call(batch.list_namespaced_job, namespace, label_selector=LABEL_JOB)
    return [job for job in listed.get("items") or []
            if str((job.get("metadata") or {}).get("name", "")).startswith(prefix)
            and ((job.get("metadata") or {}).get("labels") or {}).get(LABEL_JOB)]


def handle_of(job: Mapping[str, Any], *, backend: str, conn_id: str,
              settings: KubernetesSettings, adopted: bool) -> JobHandle:
    """The handle of a Job we created (its annotations say the rest)."""
    meta, spec = job.get("metadata") or {}, job.get("spec") or {}
    ann = meta.get("annotations") or {}
    ns = meta.get("namespace") or settings.namespace

    def a(key: str, default: str = "") -> str:
        return str(ann.get(ANN_PREFIX + key, default))

    return JobHandle(
        backend=backend, connection=conn_id, job_id=meta["name"],
        job_name=meta["name"], location=a("location", f"{settings.context}/{ns}"),
        infra=a("infra", settings.infra),
        num_nodes=int(spec.get("completions") or 1), accelerator=a("accelerator") or None,
        gpus_per_node=float(a("gpus-per-node", "0") or 0),
        price_per_hour=float(a("price-per-hour", "0") or 0),
        submitted_at=epoch(meta.get("creationTimestamp")) or time.time(), adopted=adopted,
        extra={"namespace": ns, "context": settings.context, "uid": meta.get("uid"),
               "spot": a("spot") == "true"})


def needs_finishing(job: Mapping[str, Any]) -> bool:
    """A Job we created that is still suspended: its submission stopped half way (a Job
    suspended by our cancel is not: it stays stopped)."""
    ann = (job.get("metadata") or {}).get("annotations") or {}
    return bool((job.get("spec") or {}).get("suspend")) and \
        ann.get(ANN_PREFIX + "managed") == "true" and ANN_CANCELLED not in ann


def is_cancelled(job: Mapping[str, Any] | None) -> bool:
    """Did our cancel mark this Job?"""
    return ANN_CANCELLED in (((job or {}).get("metadata") or {}).get("annotations") or {})


def has_verdict(job: Mapping[str, Any]) -> bool:
    """Has the Job ended (a Complete or Failed condition)?"""
    return bool({c.get("type") for c in (job.get("status") or {}).get("conditions") or []
                 if c.get("status") == "True"} & FINISHED)


def check_name(task: Task, job_name: str) -> None:
    """Every rank's pod host name must be a DNS label."""
    if task.num_nodes > 1 and len(pod_hostname(job_name, task.num_nodes - 1)) > 63:
        raise SubmissionError(f"job name {job_name!r} is too long for the pod host names "
                              f"of {task.num_nodes} ranks (63 characters at most)")


def files_of(task: Task, limit: int, *, retry_elsewhere: bool = False) -> Bundle:
    """The task's workdir and file mounts for its bundle Secret, or a SubmissionError."""
    try:
        return bundle(task, limit)
    except (BundleTooLarge, OSError) as exc:
        raise SubmissionError(f"workdir/file_mounts: {exc}",
                              retry_elsewhere=retry_elsewhere) from exc


def check_sizes(dependents: list[dict[str, Any]]) -> None:
    """Every ConfigMap/Secret of the job fits the API server's 1 MiB (scripts, envs, secrets,
    files: all of it), checked before the Job is created; else a SubmissionError."""
    if why := too_large(dependents):
        raise SubmissionError(why, retry_elsewhere=True)


def create_job(client: KubeClient, settings: KubernetesSettings,
               manifest: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
    """Create the (suspended) Job: (the Job, True), or (the Job, False) when a concurrent
    attempt created it first (adopt it)."""
    job_name = manifest["metadata"]["name"]
    _, batch = client.apis()
    try:
        return client.call(batch.create_namespaced_job, settings.namespace, manifest), True
    except KubeApiError as exc:
        if exc.status == 409:  # created by a concurrent attempt: adopt it
            job = get_job(client, settings.namespace, job_name)
            if job is not None:
                return job, False
        if isinstance(exc, BackendUnreachable):  # no answer: the Job may exist all the same
            raise
        raise SubmissionError(f"creating Job {job_name} in {settings.location} failed: {exc}",
                              retry_elsewhere=True) from exc


def start(client: KubeClient, namespace: str, job_name: str,
          dependents: list[dict[str, Any]]) -> None:
    """Create the Job's dependents (those already there are kept), then resume the Job.
    Raises BackendError: then the caller deletes what was made (:func:`delete_all`)."""
    core, batch = client.apis()
    create = {"ConfigMap": core.create_namespaced_config_map,
              "Secret": core.create_namespaced_secret,
              "Service": core.create_namespaced_service}
    for obj in dependents:
        try:
            client.call(create[obj["kind"]], namespace, obj)
        except KubeApiError as exc:
            if exc.status != 409:
                raise
    client.call(batch.patch_namespaced_job, job_name, namespace,
                [{"op": "replace", "path": "/spec/suspend", "value": False}])


def _delete(client: KubeClient, objects: list[tuple[str, Any, str]], namespace: str,
            body: Mapping[str, Any] | None = None) -> list[str]:
    """Delete ``objects`` (kind, delete call, name); the kinds that were there."""
    gone = []
    for what, fn, name in objects:
        try:
            client.call(fn, name, namespace, body=dict(body or {}))
            gone.append(what)
        except KubeApiError as exc:
            if exc.status != 404:
                raise
    return gone


def _dependents(client: KubeClient, job_name: str) -> list[tuple[str, Any, str]]:
    core, _ = client.apis()
    return [("Service", core.delete_namespaced_service, service_name(job_name)),
            ("Secret", core.delete_namespaced_secret, secret_name(job_name)),
            ("Secret", core.delete_namespaced_secret, bundle_name(job_name)),
            ("ConfigMap", core.delete_namespaced_config_map, configmap_name(job_name))]


def delete_all(client: KubeClient, job_name: str, namespace: str) -> list[str]:
    """Delete the Job and its dependents (foreground); the kinds that were there."""
    _, batch = client.apis()
    return _delete(client, [("Job", batch.delete_namespaced_job, job_name),
                            *_dependents(client, job_name)],
                   namespace, {"propagationPolicy": "Foreground"})


def _rfc3339(when: float) -> str:
    return datetime.fromtimestamp(when, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _ended_on_its_own(pods: list[Mapping[str, Any]] | None) -> bool:
    """Has a pod already failed by itself (not one being deleted)? Then the job has ended
    before the cancel, and the Job controller's verdict follows."""
    return any((p.get("status") or {}).get("phase") == "Failed"
               and not (p.get("metadata") or {}).get("deletionTimestamp") for p in pods or [])


def cancel(client: KubeClient, namespace: str, job_name: str,
           now: float | None = None) -> list[str]:
    """Stop the job and release what it holds, keeping its Job as the record (see the module
    docstring); safe twice. A job that had already ended (a Job verdict, a pod that failed by
    itself) is not marked: it keeps what happened to it. Returns what was done, for the log."""
    core, batch = client.apis()
    done: list[str] = []
    job = get_job(client, namespace, job_name)
    pods: list[Mapping[str, Any]] | None = None
    try:  # the Job gone (deleted with its pods orphaned, or not yet collected): pods by label
        found = client.call(core.list_namespaced_pod, namespace,
                            label_selector=f"{LABEL_JOB}={job_name}")
        pods = pods_of(job_name, found.get("items") or [],
                       job["metadata"].get("uid") if job is not None else None)
    except KubeApiError as exc:
        if exc.status != 403:
            raise
        done.append("pods may not be listed: the Job controller deletes them")
    if job is not None and not (has_verdict(job) or is_cancelled(job)
                                or _ended_on_its_own(pods)):
        ann = (job.get("metadata") or {}).get("annotations")
        when = _rfc3339(time.time() if now is None else now)
        mark = ({"op": "add", "path": "/metadata/annotations/" +
                 ANN_CANCELLED.replace("~", "~0").replace("/", "~1"), "value": when}
                if ann is not None else
                {"op": "add", "path": "/metadata/annotations", "value": {ANN_CANCELLED: when}})
        try:
            # suspended, the Job controller starts no pod again (and deletes the active ones)
            client.call(batch.patch_namespaced_job, job_name, namespace,
                        [mark, {"op": "replace", "path": "/spec/suspend", "value": True}])
            done.append("marked cancelled and suspended")
        except KubeApiError as exc:
            if isinstance(exc, BackendUnreachable):  # not an answer: nothing is known
                raise
            if exc.status == 404:  # gone meanwhile: its pods and dependents may be left
                job = None
            else:  # may not be patched: stop it the only other way (it then reads LOST)
                return [f"could not mark it ({exc})",
                        "deleted " + (", ".join(delete_all(client, job_name, namespace))
                                      or "nothing")]
    running = [p for p in pods or [] if (p.get("status") or {}).get("phase") not in TERMINAL
               and not (p.get("metadata") or {}).get("deletionTimestamp")]
    if stopped := _delete(client, [("pod", core.delete_namespaced_pod, p["metadata"]["name"])
                                   for p in running], namespace):
        done.append(f"deleted {len(stopped)} pod(s)")
    if gone := _delete(client, _dependents(client, job_name), namespace):
        done.append("deleted " + ", ".join(gone))
    return done


def cleanup(client: KubeClient, namespace: str, job_name: str) -> list[str] | None:
    """Drop the Secrets at once (the task's secrets, its workdir and file mounts); a Job we
    cancelled, or with a pod that has not ended (one stuck on a bad image, so it holds no
    GPUs), is deleted too: then the kinds deleted are returned (else None). Ended Jobs stay
    for their logs (TTL)."""
    core, _ = client.apis()
    job = get_job(client, namespace, job_name)
    if job is not None and is_cancelled(job):
        return delete_all(client, job_name, namespace)
    if job is not None:
        running = not has_verdict(job)
        if running:  # no verdict yet: do its pods still run (or wait, e.g. on an image)?
            try:
                found = client.call(core.list_namespaced_pod, namespace,
                                    label_selector=f"{LABEL_JOB}={job_name}")
                pods = pods_of(job_name, found.get("items") or [], job["metadata"].get("uid"))
                running = any((p.get("status") or {}).get("phase") not in TERMINAL
                              for p in pods)
            except KubeApiError:  # cannot see the pods: stop it to be safe
                pass
        if running:
            return delete_all(client, job_name, namespace)
    for name in (secret_name(job_name), bundle_name(job_name)):
        try:
            client.call(core.delete_namespaced_secret, name, namespace)
        except KubeApiError as exc:
            if exc.status != 404:
                raise
    return None
