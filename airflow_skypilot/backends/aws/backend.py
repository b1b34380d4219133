"""The AWS backend's facade: :class:`AwsBackend`, the Backend protocol over the package's parts.

It holds the connection's settings (read once), its clients and the small caches that live as
long as the backend (quota values, AMIs, AZs that refused a type, markers read), and passes
them to the modules that do the work; it is the only part that logs.

probe
    per region, concurrently (:mod:`.offers`): instance types (:mod:`.catalog`), the AZs that
    offer them, spot prices, vCPU quotas (:mod:`.quotas`); one offer per candidate and AZ.
submit
    :mod:`.launch`: quota check, AMI, user-data (:mod:`.userdata`), secrets to SSM,
    RunInstances with AZ fallback; the handle goes to S3 (:mod:`.handles`).
status
    one ``DescribeInstances`` per region and one S3 listing per bucket for every watched job,
    whatever their number (:mod:`.status`); logs are S3 range reads (:mod:`.logs`), rank 0
    while a job runs and every rank once it has ended; a failure's tail reads their ends. The
    triggerer's log read reuses what the poll just before it listed
    (:attr:`AwsBackend.SEEN_MAX_AGE`).

S3 layout, under ``s3://<s3_bucket>/<s3_prefix><job name>/``: ``handle.json`` (written at
submit: lets a retried worker find the job even after EC2 forgot its instances),
``payload.tgz`` (when the job carries files of the user's, workdir or file mounts, or its files
do not fit in 16 KB of user-data), and per node
``rank-<r>/log``, ``rank-<r>/exit_code`` and the other markers. Logs and markers stay (give
the bucket a lifecycle rule); the payload and the SSM parameters are deleted by cleanup.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from airflow_skypilot.backends.aws import ec2, launch, logs, offers, userdata
from airflow_skypilot.backends.aws.catalog import InstanceTypeInfo, on_demand_price, region_catalog
from airflow_skypilot.backends.aws.clients import AwsClients
from airflow_skypilot.backends.aws.ec2 import InstanceView
from airflow_skypilot.backends.aws.handles import (
    HANDLE_OBJECT,
    INTENT_OBJECT,
    handle_from_instances,
    launch_intent,
    launched_handle,
    region_of,
    stored_handle,
    stored_job_names,
)
from airflow_skypilot.backends.aws.quotas import Quotas
from airflow_skypilot.backends.aws.settings import BACKEND, AwsSettings
from airflow_skypilot.backends.aws.status import (
    MarkerReader,
    Markers,
    group_by_region,
    judge_handle,
    needs_markers,
)
from airflow_skypilot.backends.base import Backend, CapacityRow, JobHandle, JobStatus, Offer
from airflow_skypilot.backends.common.features import Feature
from airflow_skypilot.exceptions import BackendError, BackendUnreachable, SubmissionError
from airflow_skypilot.spec.task import ResourceRequest, Task


class AwsBackend(Backend):
    """EC2 instances in the regions of one AWS connection."""

    #: how long what a poll saw of a job stands in for a listing of a log read
    SEEN_MAX_AGE = 5.0

    name = BACKEND
    conn_types = ("aws",)
    unsupported_features = {
        Feature.DOCKER_IMAGE: "not run on AWS by this backend (jobs run directly on the "
                              "instance's AMI: give an ami-... image_id, or use Kubernetes for "
                              "containers)",
        Feature.GIT_WORKDIR: "a git workdir is not cloned on AWS; use a local workdir",
        Feature.STORAGE_MOUNTS: "only local paths and s3:// sources work on AWS",
        Feature.OTHER_BUCKET_MOUNTS: "only local paths and s3:// sources work on AWS",
        Feature.VOLUMES: "volumes are Kubernetes volumes; EC2 instances here have none",
    }

    def unsupported(self, task: Task, req: ResourceRequest) -> str:
        why = super().unsupported(task, req)
        if not why and isinstance(req.image_id, str) and not req.image_id.startswith(
                ("ami-", "skypilot:")) and not req.container_image:
            why = f"image_id {req.image_id!r} is not an AMI id (ami-...)"
        return why

    def __init__(self, conn_id: str, settings: AwsSettings | None = None):
        super().__init__(conn_id)
        self._settings = settings
        self._clients = AwsClients(conn_id, lambda: self.settings.request_timeout)
        self._quotas = Quotas(self._clients)
        self._amis = launch.Amis(self._clients)
        self._refused = launch.RefusedAzs()
        self._markers = MarkerReader(self._clients)
        #: what the last poll saw of each job (log reads reuse it: no extra listing)
        self._seen: dict[str, tuple[float, logs.JobView]] = {}

    @property
    def settings(self) -> AwsSettings:
        if self._settings is None:
            from airflow_skypilot.compat import get_connection

            conn = get_connection(self.conn_id)
            self._settings = AwsSettings.from_extra(conn.extra_dejson or {})
        return self._settings

    def close(self) -> None:
        self._clients.close()

    async def aclose(self) -> None:
        await self._clients.aclose()

    def on_demand_price(self, region: str, info: InstanceTypeInfo,
                        catalog: Mapping[str, InstanceTypeInfo] | None = None,
                        ) -> tuple[float | None, str]:
        """The connection's ``prices``, else the shipped catalog, else an estimate from the
        catalog's per-GPU price of the same GPU (said so), else None."""
        return on_demand_price(self.settings.prices, region, info, catalog)

    # --- placement ---------------------------------------------------------------------------
    def probe(self, task: Task) -> list[Offer]:
        s = self.settings
        now = time.time()
        found: list[Offer] = []
        wanted: dict[str, list[ResourceRequest]] = {}
        everywhere = ",".join(s.regions)
        for req in task.candidates:
            if req.cloud not in (None, "aws"):
                continue  # another cloud's candidate: not ours to explain
            regions = offers.regions_for(s, req)
            if not regions:
                found.append(offers.no_fit(self.conn_id, s, task, req, everywhere, (
                    f"infra {req.infra} names no region of connection {self.conn_id} "
                    f"({everywhere})"), now))
                continue
            if why := self.unsupported(task, req):
                found.append(offers.no_fit(self.conn_id, s, task, req, everywhere, why, now))
                continue
            for region in regions:
                wanted.setdefault(region, []).append(req)
        if not wanted:
            return found
        with ThreadPoolExecutor(max_workers=len(wanted),
                                thread_name_prefix=f"aws-probe-{self.conn_id}") as pool:
            futures = {r: pool.submit(self._probe_region, task, r, reqs, now)
                       for r, reqs in wanted.items()}
            errors = []
            for region, future in futures.items():
                try:
                    found.extend(future.result())
                except BackendError as exc:
                    errors.append((region, exc))
        if errors and len(errors) == len(wanted):
            raise errors[0][1]
        for region, exc in errors:  # one region down: say so, keep the others
            for req in wanted[region]:
                found.append(offers.no_fit(self.conn_id, s, task, req, region,
                                           f"region unreachable: {exc}", now))
        return found

    def _probe_region(self, task: Task, region: str, reqs: list[ResourceRequest],
                      now: float) -> list[Offer]:
        return offers.probe_region(self._clients, self._quotas, self.settings, task, region,
                                   reqs, now)

    def capacity(self) -> list[CapacityRow]:
        s = self.settings
        rows: list[CapacityRow] = []
        with ThreadPoolExecutor(max_workers=len(s.regions)) as pool:
            futures = {r: pool.submit(offers.capacity_rows, self._clients, self._quotas, s, r)
                       for r in s.regions}
            for region, future in futures.items():
                try:
                    rows.extend(future.result())
                except BackendError as exc:
                    rows.append(CapacityRow(connection=self.conn_id, location=region,
                                            accelerator=None, error=str(exc)))
        if rows and all(r.error for r in rows):
            raise BackendUnreachable(rows[0].error or "unreachable")
        return rows

    # --- jobs --------------------------------------------------------------------------------
    def find(self, job_name: str) -> JobHandle | None:
        stored = stored_handle(self._clients, self.settings, job_name)
        if stored is not None:
            return stored
        for region in self.settings.regions:
            found = ec2.by_job(ec2.of_connection(
                ec2.describe_jobs(self._clients, region, [job_name]), self.conn_id))
            if found.get(job_name):
                return handle_from_instances(
                    self.conn_id, self.settings, job_name, region,
                    ec2.newest_reservation(found[job_name]))
        self._not_in_doubt(job_name)
        return None

    def _not_in_doubt(self, job_name: str) -> None:
        """Raise while a launch of ``job_name`` whose answer was lost may still have instances
        EC2 does not list yet (DescribeInstances is eventually consistent): "none listed" is
        "none" only ``launch_grace`` seconds after it was begun. Then nothing was launched,
        and what the launch left for its instances goes: its secrets in SSM above all (kept
        while in doubt: the instances read them at boot), the staged payload, the intent."""
        intent = launch_intent(self._clients, self.settings, job_name)
        if intent is None:
            return
        began, region = intent
        if time.time() - began < self.settings.launch_grace:
            raise BackendUnreachable(
                f"{self.conn_id}: a launch of {job_name} began {time.time() - began:.0f}s ago "
                "and no instance of it is listed yet; it may still show up")
        self._remove(job_name, [region] if region else self.settings.regions,
                     (launch.PAYLOAD_OBJECT, INTENT_OBJECT))
        self.log.info("A launch of %s on %s got no answer and made no instance: its secrets "
                      "and objects are removed", job_name, self.conn_id)

    def find_all(self, prefix: str) -> list[JobHandle]:
        found: dict[str, JobHandle] = {}
        for region in self.settings.regions:
            jobs = ec2.by_job(ec2.of_connection(
                ec2.describe_jobs(self._clients, region, [prefix + "*"]), self.conn_id))
            for name, insts in jobs.items():
                if name.startswith(prefix):
                    found[name] = handle_from_instances(self.conn_id, self.settings, name,
                                                        region, ec2.newest_reservation(insts))
        for name in stored_job_names(self._clients, self.settings, prefix):
            if name.startswith(prefix):  # the stored handle knows more than the tags
                stored = stored_handle(self._clients, self.settings, name)
                if stored is not None:
                    found[name] = stored
                elif name not in found:
                    self._not_in_doubt(name)
        return sorted(found.values(), key=lambda h: h.job_name)

    def submit(self, task: Task, offer: Offer, job_name: str,
               env: Mapping[str, str]) -> JobHandle:
        s = self.settings
        existing = self.find(job_name)
        if existing is not None:
            self.log.info("Adopting AWS job %s on %s: its instances were launched before (%s)",
                          job_name, self.conn_id,
                          ", ".join(existing.extra.get("instance_ids", [])))
            return existing
        req = offer.request
        if why := self.unsupported(task, req):
            raise SubmissionError(why, retry_elsewhere=True)
        if not s.s3_bucket:
            raise SubmissionError(f"connection {self.conn_id} has no s3_bucket extra (needed for "
                                  "job logs and exit codes)", retry_elsewhere=True)
        region = offer.details.get("region") or offer.location.split("/")[0]
        first_az = offer.details.get("az") or offer.location.split("/")[-1]
        itype = offer.instance_type or offer.details.get("instance_type")
        if not itype:
            raise SubmissionError(f"offer {offer.place_key} names no instance type",
                                  retry_elsewhere=True)
        catalog = region_catalog(self._clients, region, s.cpu_families, [itype])
        info = catalog.get(itype)
        if info is None:
            raise SubmissionError(f"unknown instance type {itype} in {region}")
        spot = req.use_spot
        launch.check_quota(self._quotas, s, region, info, spot, task.num_nodes, catalog)
        azs = launch.launch_azs(self._clients, s, region, itype, first_az, req)
        if not azs:
            raise SubmissionError(f"no AZ of {region} that offers {itype} matches infra "
                                  f"{req.infra}", retry_elsewhere=True)
        fresh = [az for az in azs if not self._refused.recent(region, az, itype, spot)]
        if not fresh:
            raise SubmissionError(
                f"EC2 refused {itype}{' (spot)' if spot else ''} in every AZ of {region}"
                f"{f' that infra {req.infra} allows' if req.infra else ''} within the last "
                f"{launch.REFUSED_TTL:g}s: "
                + "; ".join(self._refused.why(region, az, itype, spot) for az in azs),
                retry_elsewhere=True)
        ami, root_device = self._amis.choose(s, region, info, req)
        reservation, az, staged, meta = self._launch(task, req, offer, job_name, env, info,
                                                     region, first_az, fresh, ami, root_device)
        handle = launched_handle(self.conn_id, s, job_name, region, az, itype, reservation,
                                 meta, spot)
        handle.extra["payload_staged"] = staged
        try:
            launch.s3_put(self._clients, s, s.job_prefix(job_name) + HANDLE_OBJECT,
                          json.dumps(handle.to_dict()).encode())
        except BackendError as exc:  # find() falls back to the instance tags
            self.log.warning("Could not store the handle of %s in S3: %s", job_name, exc)
        self.log.info("Launched %d x %s%s for %s in %s (%s)", task.num_nodes, itype,
                      " (spot)" if spot else "", job_name, handle.location,
                      ", ".join(handle.extra["instance_ids"]))
        return handle

    def _launch(self, task: Task, req: ResourceRequest, offer: Offer, job_name: str,
                env: Mapping[str, str], info: InstanceTypeInfo, region: str, first_az: str,
                azs: list[str], ami: str, root_device: str,
                ) -> tuple[dict, str, bool, dict[str, Any]]:
        """User-data, secrets and RunInstances: (reservation, AZ, payload staged, meta tag).
        On a failure the secrets and a staged payload are removed again, unless RunInstances
        got no answer (:class:`~.launch.LaunchInDoubt`: its instances may need them)."""
        s = self.settings
        payload, boot = launch.prepare_user_data(s, task, req, info, job_name, region,
                                                 first_az, env)
        script = userdata.render_user_data(boot)
        staged_key = s.job_prefix(job_name) + launch.PAYLOAD_OBJECT
        intent_key = s.job_prefix(job_name) + INTENT_OBJECT
        staged = False
        try:
            if boot.payload_uri or \
                    userdata.user_data_size(script) > userdata.USER_DATA_BUDGET:
                launch.s3_put(self._clients, s, staged_key, payload.data)
                staged = True
                boot.payload_b64, boot.payload_uri = None, f"s3://{s.s3_bucket}/{staged_key}"
                script = userdata.render_user_data(boot)
            launch.put_secrets(self._clients, s, region, job_name, task.secrets)
            meta = launch.job_meta(task, req, offer.price_per_hour)
            params = launch.launch_params(s, self.conn_id, task, req, job_name, info, ami,
                                          root_device, script, meta)
            launch.s3_put(self._clients, s, intent_key,
                          json.dumps({"at": time.time(), "region": region}).encode())
            reservation, az, refusals = launch.run_instances(
                self._clients, s, self._refused, region, info.name, req.use_spot, azs, params)
            for refusal in refusals:
                self.log.warning("RunInstances of %d x %s refused: %s", task.num_nodes,
                                 info.name, refusal)
            if reservation is None:  # every AZ refused: nothing was launched
                launch.s3_delete(self._clients, s, intent_key)
                raise SubmissionError(
                    f"launch of {task.num_nodes} x {info.name}"
                    f"{' (spot)' if req.use_spot else ''} in {region} failed: "
                    + "; ".join(refusals), retry_elsewhere=True)
            if refusals:
                self.log.info("Launched in %s after: %s", az, "; ".join(refusals))
        except launch.LaunchInDoubt:
            # its instances may run and will read the secrets (and the payload) at boot: a
            # later find() adopts them; the cancel or cleanup of that job removes them
            raise
        except BaseException:
            try:
                launch.delete_secrets(self._clients, s, region, job_name)
            except BackendError as exc:  # keep the launch error; this one is only logged
                self.log.warning("Could not delete the secrets of %s: %s", job_name, exc)
            if staged and (error := launch.s3_delete(self._clients, s, staged_key)):
                self.log.warning("%s", error)
            raise
        return reservation, az, staged, meta

    def cancel(self, handle: JobHandle) -> None:
        ids = self._terminate(handle, cancelled=True)
        self._forget(handle)
        self.log.info("Cancelled AWS job %s on %s%s", handle.job_name, self.conn_id,
                      f": terminated {', '.join(ids)}" if ids
                      else " (no instance of it on this connection was left)")

    def cleanup(self, handle: JobHandle) -> None:
        # tagged as ours: a later status of a failed job still reads its exit code, not a
        # node "gone without an exit code of its own"
        ids = self._terminate(handle, cancelled=True)
        if ids:
            self.log.info("Terminated instances left by %s: %s", handle.job_name, ", ".join(ids))
        self._forget(handle)

    def _terminate(self, handle: JobHandle, cancelled: bool) -> list[str]:
        """Terminate what EC2 shows is this job's (its name and connection tags); instance ids
        of the handle that are another's, or not shown, are refused and said so."""
        ids, untagged, refused, unseen, foreign = launch.terminate(
            self._clients, region_of(handle), handle.job_name, self.conn_id,
            handle.extra.get("instance_ids", []), cancelled)
        if untagged:
            self.log.debug("Could not tag %s cancelled: %s", ids, untagged)
        if unseen and time.time() - (handle.submitted_at or 0) < self.settings.launch_grace:
            # launched moments ago and not listed yet: nothing says they are not running
            raise BackendUnreachable(
                f"{self.conn_id}: {handle.job_name} was launched moments ago and EC2 does not "
                f"show {', '.join(unseen)} yet: not terminated")
        if refused:
            self.log.warning("Did not terminate instances of the handle of %s on %s that EC2 "
                             "does not show as this job's: %s", handle.job_name, self.conn_id,
                             "; ".join(refused))
        if foreign:  # the handle's own instances, of this job, run on: not cancelled
            raise BackendError(
                f"{self.conn_id}: {', '.join(foreign)} of {handle.job_name} (named by its "
                "handle) were launched through another connection to this account and still "
                "run: not terminated; cancel it through that connection")
        return ids

    def _forget(self, handle: JobHandle) -> None:
        # a handle rebuilt from the tags does not know: deleting what is not there is harmless
        staged = handle.extra.get("payload_staged", True) and self.settings.s3_bucket
        self._remove(handle.job_name, [region_of(handle)],
                     (launch.PAYLOAD_OBJECT,) if staged else ())

    def _remove(self, job_name: str, regions: list[str], objects: tuple[str, ...]) -> None:
        """What a job's instances read at boot: its secrets in SSM (in ``regions``) and its
        ``objects`` under its S3 prefix (a failed delete is logged: the bucket's lifecycle
        rule ends it)."""
        s = self.settings
        for where in regions:
            launch.delete_secrets(self._clients, s, where, job_name)
        for key in objects:
            if error := launch.s3_delete(self._clients, s, s.job_prefix(job_name) + key):
                self.log.warning("%s", error)

    # --- status ------------------------------------------------------------------------------
    async def astatus(self, handles: list[JobHandle]) -> dict[str, JobStatus]:
        """One DescribeInstances per region, then one S3 listing per bucket for the markers
        of every job with a started instance (none when no instance has started)."""
        if not handles:
            return {}
        s = self.settings
        groups = group_by_region(handles)
        try:
            pages = await asyncio.gather(*(ec2.adescribe_jobs(self._clients, region, names)
                                           for region, names in groups.items()))
            instances = ec2.by_job(i for page in pages for i in page)
            listed = [h for h in handles if needs_markers(instances.get(h.job_name, []))]
            markers = await self._markers.aread_many(s, listed) if listed else {}
        except BackendError:
            raise
        except Exception as exc:
            raise self._clients.error(exc, "status poll") from exc
        return self._judge(handles, instances, markers)

    def status(self, handles: list[JobHandle]) -> dict[str, JobStatus]:
        """The same as :meth:`astatus`, with boto3 from the worker."""
        if not handles:
            return {}
        raw = []
        for region, names in group_by_region(handles).items():
            raw += ec2.describe_jobs(self._clients, region, names)
        instances = ec2.by_job(raw)
        listed = [h for h in handles if needs_markers(instances.get(h.job_name, []))]
        markers = self._markers.read_many(self.settings, listed) if listed else {}
        return self._judge(handles, instances, markers)

    def _judge(self, handles: list[JobHandle], instances: dict[str, list[InstanceView]],
               markers: dict[str, Markers]) -> dict[str, JobStatus]:
        now = time.monotonic()
        self._seen = {name: seen for name, seen in self._seen.items()
                      if now - seen[0] <= self.SEEN_MAX_AGE}
        out = {}
        for h in handles:
            insts = instances.get(h.job_name, [])
            found = markers.get(h.job_name) or Markers()  # none listed: no instance started
            out[h.job_id] = judge_handle(h, insts, found, self.settings.launch_grace)
            self._seen[h.job_name] = (now, logs.JobView(found, logs.instances_gone(h, insts)))
        return out

    # --- logs --------------------------------------------------------------------------------
    def _view(self, handle: JobHandle) -> logs.JobView | None:
        seen = self._seen.get(handle.job_name)
        if seen is not None and time.monotonic() - seen[0] <= self.SEEN_MAX_AGE:
            return seen[1]
        return None

    def _log_view(self, handle: JobHandle) -> logs.JobView | None:
        """What a log read knows of the job: the last poll's view, else (several nodes: is
        their text final?) a fresh one."""
        view = self._view(handle)
        if view is None and handle.num_nodes > 1:
            view = self._fresh_view(handle)
        return view

    async def _alog_view(self, handle: JobHandle) -> logs.JobView | None:
        view = self._view(handle)
        if view is None and handle.num_nodes > 1:
            view = await self._afresh_view(handle)
        return view

    def read_log(self, handle: JobHandle, offset: int = 0,
                 limit: int = logs.LOG_LIMIT) -> tuple[str, int]:
        """The job's output from byte ``offset`` (:mod:`.logs`: rank 0 while it runs, then
        every rank)."""
        return logs.read_log(self._clients, self.settings, handle, offset, limit,
                             self._log_view(handle))

    async def aread_log(self, handle: JobHandle, offset: int = 0,
                             limit: int = logs.LOG_LIMIT) -> tuple[str, int]:
        return await logs.aread_log(self._clients, self.settings, handle, offset, limit,
                                    await self._alog_view(handle))

    def read_tail(self, handle: JobHandle, max_bytes: int = logs.TAIL_BYTES) -> str:
        """The end of the job's output: suffix ranges of its ranks' logs (:mod:`.logs`)."""
        return logs.read_tail(self._clients, self.settings, handle, max_bytes,
                              self._log_view(handle))

    async def aread_tail(self, handle: JobHandle, max_bytes: int = logs.TAIL_BYTES) -> str:
        return await logs.aread_tail(self._clients, self.settings, handle, max_bytes,
                                     await self._alog_view(handle))

    def _fresh_view(self, handle: JobHandle) -> logs.JobView:
        """The instances first, then the listing: a job whose instances are gone has written
        everything it will by then, so the listing shows its final logs."""
        insts = ec2.by_job(ec2.describe_jobs(self._clients, region_of(handle),
                                             [handle.job_name])).get(handle.job_name, [])
        found = self._markers.read_many(self.settings, [handle])[handle.job_name]
        return self._saw(handle, logs.JobView(found, logs.instances_gone(handle, insts)))

    def _saw(self, handle: JobHandle, view: logs.JobView) -> logs.JobView:
        self._seen[handle.job_name] = (time.monotonic(), view)
        return view

    async def _afresh_view(self, handle: JobHandle) -> logs.JobView:
        try:
            raw = await ec2.adescribe_jobs(self._clients, region_of(handle), [handle.job_name])
            insts = ec2.by_job(raw).get(handle.job_name, [])
            found = (await self._markers.aread_many(self.settings, [handle]))[handle.job_name]
        except BackendError:
            raise
        except Exception as exc:
            raise self._clients.error(exc, f"reading the state of {handle.job_name}") from exc
        return self._saw(handle, logs.JobView(found, logs.instances_gone(handle, insts)))
