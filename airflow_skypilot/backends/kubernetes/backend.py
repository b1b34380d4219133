"""Kubernetes clusters, on the cncf-kubernetes provider's ``KubernetesHook`` (sync, the worker)
and ``AsyncKubernetesHook`` (the triggerer's event loop).

:class:`KubernetesBackend` is the facade: it reads the connection once
(:mod:`.settings`), holds the client (:mod:`.client`) and the pods seen by the last poll, and
delegates each concern to one module, passing both in:

probe / capacity
    :mod:`.cluster` (one node list and one cluster-wide pod list) and :mod:`.offers` (which
    nodes a candidate may use, the shared node-pool fit rule, prices).
submit / find / cancel / cleanup
    :mod:`.manifests` (the Job, ConfigMap, Secret, Service; :mod:`.bundle` for the workdir)
    and :mod:`.submit` (suspended Job, then its dependents, then resume; adopt, never twice;
    cancel marks and suspends the Job, which reads CANCELLED until cleanup deletes it).
status / poll
    :mod:`.status`: one Job list and one pod list per namespace (and one node list) per poll,
    for every watched job; the same mapping sync and async.
logs
    :mod:`.logs`: rank 0 while the job runs, then the other ranks. The triggerer's batched read
    reuses the pod list of the poll just before it, so it costs one log request per job. A
    failure's tail asks the pods for their last lines only.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

from airflow_skypilot.backends.base import (
    Backend,
    CapacityRow,
    JobHandle,
    JobStatus,
    Offer,
)
from airflow_skypilot.backends.common.features import Feature
from airflow_skypilot.backends.kubernetes import (
    bundle,
    cluster,
    logs,
    manifests,
    offers,
    status,
    submit,
)
from airflow_skypilot.backends.kubernetes.client import KubeApiError, KubeClient, import_clients
from airflow_skypilot.backends.kubernetes.names import GPU_RESOURCE
from airflow_skypilot.backends.kubernetes.settings import KubernetesSettings
from airflow_skypilot.exceptions import BackendError, BackendUnreachable, SubmissionError
from airflow_skypilot.spec.task import ResourceRequest, Task

#: how long the pods seen by a poll stand in for a pod list of a log read
SEEN_MAX_AGE = 5.0


class KubernetesBackend(Backend):
    """One namespace of one Kubernetes cluster (context)."""

    name = "kubernetes"
    conn_types = ("kubernetes",)
    unsupported_features = {
        Feature.INSTANCE_TYPE: "a cloud VM type, not a Kubernetes resource",
        Feature.MACHINE_IMAGE: "not a container image: write image_id: docker:<image> (a bare "
                               "image is a container image only on a candidate with infra: "
                               "kubernetes, as in SkyPilot)",
        Feature.FRACTIONAL_GPUS: f"Kubernetes allocates whole GPUs ({GPU_RESOURCE} is an "
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
        self.client = KubeClient(conn_id, lambda: self.settings.request_timeout)
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

    def close(self) -> None:
        self.client.close()

    async def aclose(self) -> None:
        """Nothing is held between polls: each opens and closes its own client session."""
        return None

    async def aprepare(self) -> None:
        await super().aprepare()
        # the generated async client takes about a second to import: not on the triggerer's loop
        await asyncio.to_thread(import_clients)

    # --- placement ---------------------------------------------------------------------------
    def cluster_view(self) -> cluster.ClusterView:
        """One node list and one pod list (all namespaces, non-terminal pods)."""
        return cluster.read(self.client, self.settings.namespace)

    def probe(self, task: Task) -> list[Offer]:
        reqs = [r for r in task.candidates if offers.applies(r, self.settings)]
        if not reqs:
            return []
        view = self.cluster_view()
        bundle_error = bundle.check(task, self.settings.bundle_limit)
        return [self._offer(task, r, view, bundle_error) for r in reqs]

    def _offer(self, task: Task, req: ResourceRequest, view: cluster.ClusterView,
               bundle_error: str) -> Offer:
        return offers.offer(self.conn_id, self.name, self.settings, task, req, view,
                            unsupported=self.unsupported(task, req), bundle_error=bundle_error)

    def capacity(self) -> list[CapacityRow]:
        return offers.capacity_rows(self.conn_id, self.settings, self.cluster_view())

    # --- jobs --------------------------------------------------------------------------------
    def job_manifest(self, task: Task, offer: Offer, job_name: str,
                     env: Mapping[str, str]) -> dict[str, Any]:
        """The Job for ``task`` at ``offer`` (created suspended; see :meth:`_finish`)."""
        return manifests.job_for(self.settings, task, offer, job_name, env)

    def dependents(self, task: Task, offer: Offer, job_name: str, env: Mapping[str, str],
                   files: bundle.Bundle, owner: Mapping[str, Any] | None) -> list[dict[str, Any]]:
        """The ConfigMap, Secret and (several nodes) Service of the Job ``owner``."""
        return manifests.dependents_for(self.settings, task, offer, job_name, env, files, owner)

    def _handle(self, job: Mapping[str, Any], adopted: bool) -> JobHandle:
        return submit.handle_of(job, backend=self.name, conn_id=self.conn_id,
                                settings=self.settings, adopted=adopted)

    def find(self, job_name: str) -> JobHandle | None:
        job = submit.get_job(self.client, self.settings.namespace, job_name)
        return self._handle(job, adopted=True) if job is not None else None

    def find_all(self, prefix: str) -> list[JobHandle]:
        return [self._handle(job, adopted=True)
                for job in submit.list_jobs(self.client, self.settings.namespace, prefix)]

    def unsupported(self, task: Task, req: ResourceRequest) -> str:
        """The features this backend lacks, then the task's labels and annotations
        (``resources.labels``, ``config.kubernetes.custom_metadata``) that are not valid
        Kubernetes ones: the candidate does not fit, and nothing is submitted."""
        return super().unsupported(task, req) or manifests.metadata_refusal(task, req)

    def submit(self, task: Task, offer: Offer, job_name: str,
               env: Mapping[str, str]) -> JobHandle:
        s = self.settings
        existing = submit.get_job(self.client, s.namespace, job_name)
        if existing is not None:
            return self._adopt(existing, task, offer, job_name, env)
        if why := self.unsupported(task, offer.request):
            raise SubmissionError(why, retry_elsewhere=True)
        submit.check_name(task, job_name)
        files = submit.files_of(task, s.bundle_limit, retry_elsewhere=True)
        manifest = self.job_manifest(task, offer, job_name, env)
        # all of what goes in the ConfigMap and Secrets, measured before anything is created
        submit.check_sizes(self.dependents(task, offer, job_name, env, files, None))
        job, created = submit.create_job(self.client, s, manifest)
        if not created:
            return self._adopt(job, task, offer, job_name, env)
        self._finish(job, task, offer, job_name, env, files)
        self.log.info("Submitted Kubernetes Job %s to %s (%s)", job_name, s.location,
                      self.conn_id)
        return self._handle(job, adopted=False)

    def _adopt(self, job: dict[str, Any], task: Task, offer: Offer, job_name: str,
               env: Mapping[str, str]) -> JobHandle:
        self.log.info("Adopting Kubernetes Job %s in %s: it was submitted before", job_name,
                      self.settings.location)
        if submit.needs_finishing(job):  # a submission that stopped half way: files missing?
            files = submit.files_of(task, self.settings.bundle_limit)
            self._finish(job, task, offer, job_name, env, files)
        return self._handle(job, adopted=True)

    def _finish(self, job: dict[str, Any], task: Task, offer: Offer, job_name: str,
                env: Mapping[str, str], files: bundle.Bundle) -> None:
        """Create the Job's dependents (owned by it), then let it start."""
        ns = self.settings.namespace
        try:
            submit.start(self.client, ns, job_name,
                         self.dependents(task, offer, job_name, env, files, job))
        except BackendError as exc:
            self.log.warning("Submission of %s failed half way; deleting the Job: %s",
                             job_name, exc)
            try:
                submit.delete_all(self.client, job_name, ns)
                deleted = True
            except BackendError:
                deleted = False
            what = (f"creating the files of Job {job_name} in {self.settings.location} failed: "
                    f"{exc}")
            if isinstance(exc, BackendUnreachable) or not deleted:
                # the start may have landed (its answer lost), or the Job may still be there:
                # "could not ask" is not "not there" (the placer sweeps the job by its name)
                raise BackendUnreachable(what + ("" if deleted else "; the Job could not be "
                                                 "deleted")) from exc
            raise SubmissionError(what) from exc

    def _namespace(self, handle: JobHandle) -> str:
        return handle.extra.get("namespace") or self.settings.namespace

    def cancel(self, handle: JobHandle) -> None:
        """Mark the Job cancelled and suspend it, delete its pods, Secret, ConfigMap and
        Service; the Job stays (it reads CANCELLED) until :meth:`cleanup`."""
        ns = self._namespace(handle)
        done = submit.cancel(self.client, ns, handle.job_name)
        self.log.info("Cancelled Kubernetes Job %s in %s/%s (%s)", handle.job_name,
                      self.settings.context, ns, "; ".join(done) or "nothing left to stop")

    def cleanup(self, handle: JobHandle) -> None:
        """Drop the Secrets at once (secrets, workdir and file mounts); a cancelled Job, or
        one with a pod that has not ended (one stuck on a bad image: it holds GPUs), is
        deleted. Ended Jobs stay for their logs (TTL)."""
        gone = submit.cleanup(self.client, self._namespace(handle), handle.job_name)
        if gone is not None:
            self.log.info("Deleted %s of Kubernetes Job %s", ", ".join(gone) or "nothing",
                          handle.job_name)

    # --- status ------------------------------------------------------------------------------
    async def astatus(self, handles: list[JobHandle]) -> dict[str, JobStatus]:
        """One Job list and one pod list per namespace, and one node list, for all handles."""
        if not handles:
            return {}
        groups = status.by_namespace(handles, self.settings.namespace)
        with_nodes = not self._nodes_forbidden
        results = await status.alist_all(self.client, groups, with_nodes)
        return self._statuses(groups, results, with_nodes)

    def status(self, handles: list[JobHandle]) -> dict[str, JobStatus]:
        """The worker's :meth:`astatus`: the same requests on the sync client."""
        if not handles:
            return {}
        groups = status.by_namespace(handles, self.settings.namespace)
        with_nodes = not self._nodes_forbidden
        results = status.list_all(self.client, groups, with_nodes)
        return self._statuses(groups, results, with_nodes)

    def _statuses(self, groups: dict[str, list[JobHandle]], results: list[Any],
                  with_nodes: bool) -> dict[str, JobStatus]:
        nodes = None
        if with_nodes:
            nodes, error = status.take_nodes(results)
            if isinstance(error, KubeApiError) and error.status == 403:
                self._nodes_forbidden = True
            elif error is not None:
                self.log.debug("Node list failed (node checks skipped): %s", error)
        listed, failed = status.listed(self.conn_id, groups, results)
        for ns, error in failed.items():
            self.log.warning("Could not list the Jobs of namespace %s on %s: %s", ns,
                             self.conn_id, error)
        out, seen = status.statuses({ns: hs for ns, hs in groups.items() if ns in listed},
                                    listed, nodes, self.settings)
        out.update(status.unlisted(groups, failed))
        now = time.monotonic()
        # a stale entry is never used again: drop it (the triggerer's backend lives for long)
        self._seen = {name: (at, pods) for name, (at, pods) in self._seen.items()
                      if now - at <= SEEN_MAX_AGE}
        self._seen.update((name, (now, pods)) for name, pods in seen.items())
        return out

    # --- logs --------------------------------------------------------------------------------
    def _cached_pods(self, handle: JobHandle) -> list[dict[str, Any]] | None:
        seen = self._seen.get(handle.job_name)
        if seen is not None and time.monotonic() - seen[0] <= SEEN_MAX_AGE:
            return seen[1]
        return None

    def read_log(self, handle: JobHandle, offset: int = 0) -> tuple[str, int]:
        return logs.read(self.client, self._namespace(handle), handle, offset,
                         self._cached_pods(handle))

    async def aread_log(self, handle: JobHandle, offset: int = 0) -> tuple[str, int]:
        """As :meth:`read_log`; the pods come from the last poll when it was just now."""
        return (await self.aread_logs([(handle, offset)]))[handle.job_id]

    def read_tail(self, handle: JobHandle, max_bytes: int = logs.TAIL_BYTES) -> str:
        """The end of the job's output: the last lines of the pods it needs (:mod:`.logs`)."""
        return logs.read_tail(self.client, self._namespace(handle), handle, max_bytes,
                              self._cached_pods(handle))

    async def aread_tail(self, handle: JobHandle, max_bytes: int = logs.TAIL_BYTES) -> str:
        return await logs.aread_tail(self.client, self._namespace(handle), handle, max_bytes,
                                     self._cached_pods(handle))

    async def aread_logs(self, requests: list[tuple[JobHandle, int]]
                              ) -> dict[str, tuple[str, int]]:
        """New output of many jobs in one client session: the pods come from the last poll
        (else one pod list per namespace for all of them), then the logs, a few at a time
        (Kubernetes has no API for the logs of many pods at once)."""
        if not requests:
            return {}
        cached = {h.job_id: pods for h, _ in requests
                  if (pods := self._cached_pods(h)) is not None}
        return await logs.aread_many(self.client, requests, cached, self.settings.namespace)
