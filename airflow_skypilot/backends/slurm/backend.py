"""Slurm clusters over SSH: the :class:`SlurmBackend` facade.

A Slurm cluster is an Airflow connection (type ``slurm``, or a plain ``ssh``) to its login node,
with extras (:mod:`.settings`). Each protocol call is one or two SSH round trips, built and read
by the modules this class delegates to:

probe / capacity
    one command (:mod:`.cluster`), read into offers and ``show-gpus`` rows (:mod:`.offers`).
submit / find / cancel / cleanup
    the job's files over SFTP, then ``sbatch`` under ``flock``; a job dir that already has a
    job id, or a job of the same name Slurm knows, is adopted: never two jobs for one name
    (:mod:`.submit`). The same command removes job dirs past ``log_retention_days``.
poll / status
    one command for all watched jobs (:mod:`.status`); squeue that did not answer is
    "could not ask" (UNKNOWN), never "gone".
read_log / aread_logs / read_tail
    byte offsets into each job's ``slurm.log``, many jobs per command; a failure's tail from
    the file's end (:mod:`.logs`).

The SSH side (paramiko in the worker, asyncssh in the triggerer) is :mod:`.remote`. Every
Slurm command runs under ``timeout`` (``slurm_timeout``, default 20 s) and every SSH command
has its own limit (``command_timeout``, default 60 s, raised where a script runs several Slurm
commands), so a paused slurmctld or a hung login node is BackendUnreachable in bounded time.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping

from airflow_skypilot.backends.base import Backend, CapacityRow, JobHandle, JobStatus, Offer
from airflow_skypilot.backends.common.features import Feature
from airflow_skypilot.backends.slurm import logs, offers
from airflow_skypilot.backends.slurm import status as jobstatus
from airflow_skypilot.backends.slurm import submit as jobs
from airflow_skypilot.backends.slurm.cluster import (
    ClusterState,
    parse_cluster,
    probe_failed,
    probe_script,
)
from airflow_skypilot.backends.slurm.remote import SSHRunner, aload_asyncssh
from airflow_skypilot.backends.slurm.settings import (
    BACKEND,
    SlurmSettings,
    task_conflicts,
    task_sbatch_options,
)
from airflow_skypilot.exceptions import BackendError, BackendUnreachable, SubmissionError
from airflow_skypilot.spec.task import ResourceRequest, Task

_ONLY_LOCAL_FILES = "only local files can be copied to a Slurm cluster"


class SlurmBackend(Backend):
    """A Slurm cluster behind an SSH login node."""

    name = BACKEND
    conn_types = ("slurm", "ssh")
    unsupported_features = {
        Feature.SPOT: "Slurm has no spot capacity",
        Feature.INSTANCE_TYPE: "a cloud VM type, not a Slurm resource",
        Feature.DOCKER_IMAGE: "needs a container runtime on the cluster; this backend runs "
                              "jobs directly on the nodes",
        Feature.FRACTIONAL_GPUS: "Slurm allocates whole GPUs",
        Feature.GIT_WORKDIR: "a git workdir is not cloned on Slurm; use a local workdir",
        Feature.STORAGE_MOUNTS: _ONLY_LOCAL_FILES,
        Feature.S3_MOUNTS: _ONLY_LOCAL_FILES,
        Feature.OTHER_BUCKET_MOUNTS: _ONLY_LOCAL_FILES,
        Feature.VOLUMES: "volumes are Kubernetes volumes; a Slurm cluster has none",
    }

    def __init__(self, conn_id: str, settings: SlurmSettings | None = None):
        super().__init__(conn_id)
        self._settings = settings
        self._remote: SSHRunner | None = None

    # --- connection --------------------------------------------------------------------------
    @property
    def settings(self) -> SlurmSettings:
        """The connection's extras, read once (in the triggerer: off its loop, by aprepare)."""
        if self._settings is None:
            self._settings = SlurmSettings.from_connection(self.conn_id)
        return self._settings

    @property
    def remote(self) -> SSHRunner:
        """The login node (connects on first use)."""
        if self._remote is None:
            s = self.settings
            self._remote = SSHRunner(self.conn_id, s.command_timeout, s.upload_timeout)
        return self._remote

    def close(self) -> None:
        if self._remote is not None:
            self._remote.close()

    async def aprepare(self) -> None:
        await super().aprepare()
        await aload_asyncssh()

    async def aclose(self) -> None:
        if self._remote is not None:
            await self._remote.aclose()

    # --- placement ---------------------------------------------------------------------------
    def unsupported(self, task: Task, req: ResourceRequest) -> str:
        """The declared features, and the task's sbatch options this connection owns."""
        return super().unsupported(task, req) or task_conflicts(task, self.settings)

    def _budget(self, slurm_commands: int) -> float:
        """The SSH command limit of a script that runs ``slurm_commands`` bounded Slurm
        commands one after the other."""
        s = self.settings
        return max(s.command_timeout, slurm_commands * s.slurm_timeout + 15)

    def _history_file(self) -> str:
        """Where the login node keeps the finished jobs' history (one file per cluster: a home
        may be shared by several clusters' login nodes)."""
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", self.settings.cluster)
        return f"{self.settings.remote_work_dir.rstrip('/')}/probe-history-{name}"

    def cluster_state(self, task: Task | None = None) -> ClusterState:
        """Probe the cluster (with Slurm's start estimate for ``task``'s shapes, with its own
        sbatch options, if given)."""
        s = self.settings
        shapes = offers.probe_shapes(task, s) if task else []
        task_args = task_sbatch_options(task) if task else []
        # sinfo, sinfo, squeue, and the history's two sacct at worst (test-only not counted)
        rc, out, err = self.remote.run(
            probe_script(s.common_sbatch_args(), s.partitions, shapes, s.slurm_timeout,
                         task_args=task_args,
                         history_file=self._history_file() if task else None),
            self._budget(5))
        if "@@nodes" not in out:
            raise BackendError(f"{self.conn_id}: probe failed (exit {rc}): {err.strip()[-300:]}")
        if failed := probe_failed(out):
            raise BackendUnreachable(f"{self.conn_id}: {failed}: {err.strip()[-300:]}")
        return parse_cluster(out)

    def probe(self, task: Task) -> list[Offer]:
        return offers.offers(task, self.cluster_state(task), self.settings, self.conn_id,
                             self.unsupported)

    def capacity(self) -> list[CapacityRow]:
        return offers.capacity_rows(self.cluster_state(), self.settings, self.conn_id)

    # --- jobs --------------------------------------------------------------------------------
    def _lookup(self, job_name: str) -> tuple[JobHandle | None, str, str]:
        """(the job of that name, ``$HOME``, the other cluster whose job its dir holds)."""
        _, out, _ = self.remote.run(jobs.lookup_script(self.settings, job_name),
                                    self._budget(1))
        handle, home = jobs.parse_lookup(out, self.settings, self.conn_id, job_name)
        return handle, home, jobs.dir_owner(out, self.settings)

    def find(self, job_name: str) -> JobHandle | None:
        return self._lookup(job_name)[0]

    def find_all(self, prefix: str) -> list[JobHandle]:
        _, out, _ = self.remote.run(jobs.find_all_script(self.settings, prefix),
                                    self._budget(1))
        return jobs.parse_find_all(out, self.settings, self.conn_id, prefix)

    def submit(self, task: Task, offer: Offer, job_name: str,
               env: Mapping[str, str]) -> JobHandle:
        existing, home, owner = self._lookup(job_name)
        if owner:
            raise SubmissionError(f"{self.conn_id}: the job dir of {job_name} holds a job of "
                                  f"cluster {owner} (a home both share)", retry_elsewhere=True)
        if existing is not None:
            self.log.info("Adopting Slurm job %s (%s) on %s: it was submitted before",
                          existing.job_id, job_name, self.conn_id)
            return existing
        if why := self.unsupported(task, offer.request):
            raise SubmissionError(why, retry_elsewhere=True)
        if not home:
            raise SubmissionError(f"{self.conn_id}: could not learn the remote $HOME")
        s = self.settings
        job_dir = jobs.remote_job_dir(s, job_name, home)
        submitted_at = time.time()
        files = jobs.render(task, offer, s, job_name, env, job_dir, submitted_at)
        self.remote.upload(jobs.upload_plan(task, job_dir, files, home), job_dir)
        # the lock, sbatch and the clean-up's squeue: three bounded Slurm waits
        rc, out, err = self.remote.run(jobs.submit_script(job_dir, job_name, s),
                                       self._budget(3))
        job_id, adopted, removed = jobs.parse_submitted(rc, out, err, self.conn_id)
        if notices := [line for line in err.splitlines() if line.startswith("sbatch:")]:
            self.log.warning("sbatch on %s said: %s", self.conn_id, " | ".join(notices)[-500:])
        if removed:
            self.log.info("Removed %d job dir(s) on %s older than %g days: %s", len(removed),
                          self.conn_id, s.log_retention_days, ", ".join(removed))
        self.log.info("Submitted Slurm job %s (%s) to %s partition %s", job_id, job_name,
                      self.conn_id, offer.location)
        return jobs.submitted_handle(task, offer, self.conn_id, job_id, job_name, job_dir,
                                     adopted, submitted_at)

    def cancel(self, handle: JobHandle) -> None:
        script = jobs.cancel_script(handle, self.settings.slurm_timeout,
                                    jobstatus.renamed_slack(self.settings.upload_timeout))
        rc, out, err = self.remote.run(script, self._budget(2))  # squeue, then scancel
        jobs.check_cancelled(rc, out, err, handle)
        self.log.info("Cancelled Slurm job %s on %s", handle.job_id, self.conn_id)

    def cleanup(self, handle: JobHandle) -> None:
        """Drop the job's secrets; its workdir copy and scripts too once Slurm no longer has
        it queued or running (its log stays for ``log_retention_days``)."""
        if script := jobs.cleanup_script(handle, self.settings.slurm_timeout):
            _, out, _ = self.remote.run(script, self._budget(1))
            if "@@kept" in out:
                self.log.info("Kept the files of Slurm job %s on %s (it may still run); "
                              "they go with its dir after %g days", handle.job_id,
                              self.conn_id, self.settings.log_retention_days)

    # --- status ------------------------------------------------------------------------------
    def _status_script(self, handles: list[JobHandle]) -> str:
        return jobstatus.status_script(handles, self.settings.slurm_timeout,
                                       history_file=self._history_file())

    def _statuses(self, out: str, err: str, handles: list[JobHandle]) -> dict[str, JobStatus]:
        if jobstatus.ANSWERED not in out:
            raise BackendUnreachable(f"{self.conn_id}: status query failed: {err.strip()[-200:]}")
        return jobstatus.parse_status(out, handles,
                                      jobstatus.renamed_slack(self.settings.upload_timeout))

    async def astatus(self, handles: list[JobHandle]) -> dict[str, JobStatus]:
        if not handles:
            return {}
        rc, out, err = await self.remote.arun(self._status_script(handles), self._budget(2))
        return self._statuses(out, err, handles)

    def status(self, handles: list[JobHandle]) -> dict[str, JobStatus]:
        if not handles:
            return {}
        rc, out, err = self.remote.run(self._status_script(handles), self._budget(2))
        return self._statuses(out, err, handles)

    # --- logs --------------------------------------------------------------------------------
    def read_log(self, handle: JobHandle, offset: int = 0,
                 limit: int = logs.READ_LIMIT) -> tuple[str, int]:
        rc, out, err = self.remote.run(logs.log_script(handle, offset, limit))
        return logs.split_log(out, offset)

    async def aread_log(self, handle: JobHandle, offset: int = 0,
                             limit: int = logs.READ_LIMIT) -> tuple[str, int]:
        rc, out, err = await self.remote.arun(logs.log_script(handle, offset, limit))
        return logs.split_log(out, offset)

    async def aread_logs(self, requests: list[tuple[JobHandle, int]],
                              limit: int = logs.BATCH_READ_LIMIT) -> dict[str, tuple[str, int]]:
        """New output of every streamed job in one SSH command (base64-framed per job)."""
        if not requests:
            return {}
        rc, out, err = await self.remote.arun(logs.logs_script(requests, limit))
        return logs.split_logs(out, requests)

    def read_tail(self, handle: JobHandle, max_bytes: int = logs.TAIL_BYTES) -> str:
        rc, out, err = self.remote.run(logs.tail_script(handle, max_bytes))
        return logs.split_tail(out, max_bytes)

    async def aread_tail(self, handle: JobHandle, max_bytes: int = logs.TAIL_BYTES) -> str:
        rc, out, err = await self.remote.arun(logs.tail_script(handle, max_bytes))
        return logs.split_tail(out, max_bytes)
