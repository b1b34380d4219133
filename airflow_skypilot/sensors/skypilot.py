"""``SkyPilotJobSensor``: wait for a job submitted with ``wait_for_completion=False``.

Same trigger, same outcome rules as the operator: success returns the result (in poke mode
too); a failure of the user's code fails with the log tail; an infrastructure failure fails with
its reason (the sensor did not submit the job, so it does not place it again). Whatever the end
the backend reported, the job's leftovers go as after the operator's jobs: what of it is still
up (an infrastructure failure, part of an allocation) is cancelled, then its staged secrets and
files are cleaned up (its log stays). A silence taken for lost touches nothing: the job may run.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseSensorOperator, PokeReturnValue
from airflow.sdk.configuration import conf
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from airflow_skypilot import polling
from airflow_skypilot.backends.base import SILENCE, JobHandle, JobState, JobStatus
from airflow_skypilot.backends.registry import backend_for_handle
from airflow_skypilot.operators._args import as_mapping, check
from airflow_skypilot.operators.skypilot import default_deferrable
from airflow_skypilot.runstate import Attempt
from airflow_skypilot.triggers.skypilot import DEFAULT_UNREACHABLE_TIMEOUT, SkyPilotJobTrigger

if TYPE_CHECKING:
    from airflow.sdk import Context


class SkyPilotJobSensor(BaseSensorOperator):
    """Wait for a SkyPilot job to finish.

    :param handle: the job handle (dict or its JSON), usually
        ``"{{ ti.xcom_pull(task_ids='submit') }}"``; templated.
    :param deferrable: wait in the triggerer (default on, like the operator).
    :param stream_logs: copy the job's output into the task log.
    :param unreachable_timeout: seconds the job's backend may stay silent before the job
        counts as lost (default ``[skypilot] unreachable_timeout``). In ``reschedule`` mode
        each poke is a new process and silence is not carried over: the sensor's own
        ``timeout`` bounds the wait.
    """

    template_fields: Sequence[str] = ("handle",)

    def __init__(self, *, handle: Mapping[str, Any] | str, deferrable: bool | None = None,
                 stream_logs: bool = True, unreachable_timeout: float | None = None,
                 **kwargs: Any) -> None:
        kwargs.setdefault("poke_interval", 10.0)
        super().__init__(**kwargs)
        self.handle = handle
        self.deferrable = default_deferrable() if deferrable is None else deferrable
        check({"unreachable_timeout": unreachable_timeout})
        self.stream_logs = stream_logs
        self.unreachable_timeout = unreachable_timeout
        self._silent_since: float | None = None
        self._log_offset = 0  # poke mode: how much of the job's output the log has

    @property
    def _silence(self) -> float:
        if self.unreachable_timeout is not None:
            return float(self.unreachable_timeout)
        return conf.getfloat("skypilot", "unreachable_timeout",
                             fallback=DEFAULT_UNREACHABLE_TIMEOUT)

    def _handle(self) -> JobHandle:
        data = as_mapping(self.handle)  # a dict rendered by Jinja as JSON or Python text
        if not isinstance(data, Mapping) or "job_id" not in data:
            raise AirflowException(f"handle must be a SkyPilot job handle; got {self.handle!r}")
        return JobHandle.from_dict(data)

    def execute(self, context: Context) -> Any:
        if not self.deferrable:
            return super().execute(context)
        handle = self._handle()
        self.defer(trigger=SkyPilotJobTrigger(handle.to_dict(), poll_interval=self.poke_interval,
                                              unreachable_timeout=self._silence,
                                              stream_logs=self.stream_logs,
                                              # it watches a job it does not own: clearing or
                                              # marking the sensor leaves the job alone
                                              cancel_on_kill=False),
                   method_name="execute_complete",
                   timeout=None if self.timeout is None else self.timeout)

    def poke(self, context: Context) -> bool | PokeReturnValue:
        handle = self._handle()
        backend = backend_for_handle(handle)
        try:
            status = backend.status([handle]).get(handle.job_id) or JobStatus(
                JobState.UNKNOWN, reason="not in the backend's answer")
        except Exception as exc:
            status = JobStatus(JobState.UNKNOWN, reason=f"{type(exc).__name__}: {exc}")
        if status.state == JobState.UNKNOWN:  # could not ask: not gone, unless silent for long
            now = time.monotonic()
            self._silent_since = self._silent_since or now
            self.log.warning("No answer about job %s on %s for %.0fs: %s", handle.job_id,
                             handle.connection, now - self._silent_since, status.reason)
            if now - self._silent_since < self._silence:
                return False
            # a retry may find the job (not final), and its log is not asked of a backend
            # silent this long (an SSH read would wait out its own timeout first)
            status = JobStatus.silent(handle.connection, now - self._silent_since,
                                      status.reason)
            return PokeReturnValue(is_done=True, xcom_value=self._finish(handle, status, ""))
        self._silent_since = None
        # a poke in "reschedule" mode is a new process each time: no offset to go on from, so
        # its output is the tail logged at the end
        streaming = self.stream_logs and self.mode != "reschedule"
        if streaming:
            self._log_offset = polling.stream(backend, handle, self._log_offset, self.log)
        if not status.state.terminal:
            return False
        tail = polling.tail(backend, handle)  # its end, however long (it was not streamed)
        if self.stream_logs and not streaming and status.state == JobState.SUCCEEDED:
            self.log.info("Last lines of the log of job %s:\n%s", handle.job_id, tail)
        return PokeReturnValue(is_done=True, xcom_value=self._finish(handle, status, tail))

    def execute_complete(self, context: Context, event: dict[str, Any] | None = None) -> Any:
        if not event or event.get("status") == "error":
            raise AirflowException(f"watching the job failed: {(event or {}).get('message')}")
        return self._finish(JobHandle.from_dict(event["handle"]),
                            JobStatus.from_dict(event["job_status"]), event.get("log_tail", ""))

    def _finish(self, handle: JobHandle, status: JobStatus, tail: str) -> dict[str, Any]:
        """The result when the job succeeded; raises otherwise. Leftovers of a reported end
        are cleaned up first."""
        if status.raw_state != SILENCE:
            self._clean_up(handle, status)
        if status.state == JobState.SUCCEEDED:
            self.log.info("Job %s on %s succeeded", handle.job_id, handle.connection)
            attempt = Attempt.from_handle(handle)
            attempt.close(status)
            return {"state": attempt.state, "connection": attempt.connection,
                    "location": attempt.location, "job_id": attempt.job_id,
                    "started_at": attempt.started_at, "ended_at": attempt.ended_at}
        kind = "infrastructure failure" if status.state.infra_failure else status.state.value
        # an end the backend reported is final (poking again cannot help; soft_fail skips it
        # alike, poked or deferred); a silence taken for lost is not: a retry may find the job
        final = AirflowException if status.raw_state == SILENCE else AirflowFailException
        raise final(f"job {handle.job_id} on {handle.connection} ended: {kind}"
                               f"{': ' + status.reason if status.reason else ''}\n"
                               f"Last lines of its log:\n{tail}")

    def _clean_up(self, handle: JobHandle, status: JobStatus) -> None:
        """Best effort, as the operator's: a failed cleanup is logged, the outcome stands."""
        backend = backend_for_handle(handle)
        if status.state.infra_failure or status.still_up:
            try:
                backend.cancel(handle)
            except Exception as exc:
                self.log.warning("Could not cancel what is left of job %s on %s: %s",
                                 handle.job_id, handle.connection, exc)
        try:
            backend.cleanup(handle)
        except Exception as exc:
            self.log.warning("Cleanup of job %s failed: %s", handle.job_id, exc)
