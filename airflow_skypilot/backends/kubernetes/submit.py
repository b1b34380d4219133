"""A job's objects on the cluster: create, adopt, start, delete (the "provision" side).

Submission is a suspended ``batch/v1`` Job first, then its ConfigMap, Secret and (several
nodes) headless Service, all owned by the Job (:func:`start`), then the Job is resumed. The Job
is created first so that its name is taken once: a Job of that name already there is adopted,
never created twice, and one a crash left suspended is finished by whoever adopts it. These
functions return what happened; the facade decides what to log.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from airflow_skypilot.backends.base import JobHandle
from airflow_skypilot.backends.kubernetes.bundle import Bundle, BundleTooLarge, bundle
from airflow_skypilot.backends.kubernetes.client import KubeApiError, KubeClient
from airflow_skypilot.backends.kubernetes.cluster import TERMINAL, epoch
from airflow_skypilot.backends.kubernetes.names import (
    ANN_PREFIX,
    LABEL_JOB,
    configmap_name,
    pod_hostname,
    secret_name,
    service_name,
)
from airflow_skypilot.backends.kubernetes.settings import KubernetesSettings
from airflow_skypilot.backends.kubernetes.status import pods_of
from airflow_skypilot.exceptions import SubmissionError
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
    """A Job we created that is still suspended: its submission stopped half way."""
    ann = (job.get("metadata") or {}).get("annotations") or {}
    return bool((job.get("spec") or {}).get("suspend")) and \
        ann.get(ANN_PREFIX + "managed") == "true"


def check_name(task: Task, job_name: str) -> None:
    """Every rank's pod host name must be a DNS label."""
    if task.num_nodes > 1 and len(pod_hostname(job_name, task.num_nodes - 1)) > 63:
        raise SubmissionError(f"job name {job_name!r} is too long for the pod host names "
                              f"of {task.num_nodes} ranks (63 characters at most)")


def files_of(task: Task, limit: int, *, retry_elsewhere: bool = False) -> Bundle:
    """The task's workdir and file mounts for its ConfigMap, or a SubmissionError."""
    try:
        return bundle(task, limit)
    except (BundleTooLarge, OSError) as exc:
        raise SubmissionError(f"workdir/file_mounts: {exc}",
                              retry_elsewhere=retry_elsewhere) from exc


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


def delete_all(client: KubeClient, job_name: str, namespace: str) -> list[str]:
    """Delete the Job and its dependents (foreground); the kinds that were there."""
    core, batch = client.apis()
    body = {"propagationPolicy": "Foreground"}
    gone = []
    for what, fn, name in (
        ("Job", batch.delete_namespaced_job, job_name),
        ("Service", core.delete_namespaced_service, service_name(job_name)),
        ("Secret", core.delete_namespaced_secret, secret_name(job_name)),
        ("ConfigMap", core.delete_namespaced_config_map, configmap_name(job_name)),
    ):
        try:
            client.call(fn, name, namespace, body=body)
            gone.append(what)
        except KubeApiError as exc:
            if exc.status != 404:
                raise
    return gone


def cleanup(client: KubeClient, namespace: str, job_name: str) -> list[str] | None:
    """Drop the Secret at once; a Job with a pod that has not ended (one stuck on a bad
    image) is deleted too, so it holds no GPUs: then the kinds deleted are returned (else
    None). Ended Jobs stay for their logs (TTL)."""
    core, _ = client.apis()
    job = get_job(client, namespace, job_name)
    if job is not None:
        conds = {c.get("type") for c in (job.get("status") or {}).get("conditions") or []
                 if c.get("status") == "True"}
        running = not conds & FINISHED
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
    try:
        client.call(core.delete_namespaced_secret, secret_name(job_name), namespace)
    except KubeApiError as exc:
        if exc.status != 404:
            raise
    return None
