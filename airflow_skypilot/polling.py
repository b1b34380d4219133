"""Watching a job from the worker: the non-deferrable path's twin of the trigger.

The same rules as :class:`~airflow_skypilot.triggers.skypilot.SkyPilotJobTrigger`: a job the
backend cannot speak for is UNKNOWN, waited out until ``silence`` seconds without an answer,
then LOST; its output is streamed into the task log as it comes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from airflow_skypilot.backends.base import Backend, JobHandle, JobState, JobStatus
from airflow_skypilot.exceptions import BackendError
from airflow_skypilot.triggers.skypilot import last_lines


def stream(backend: Backend, handle: JobHandle, offset: int, log: logging.Logger) -> int:
    """Log the job's new output; the next offset."""
    try:
        text, offset = backend.read_log(handle, offset)
    except Exception as exc:  # output is a convenience; the status is what matters
        log.debug("Could not read the log of %s: %s", handle.key, exc)
        return offset
    for line in text.splitlines():
        log.info("[%s] %s", handle.job_id, line)
    return offset


def tail(backend: Backend, handle: JobHandle) -> str:
    """The last lines of the job's output (quoted when the job failed), streamed or not."""
    try:
        return last_lines(backend.read_tail(handle))
    except Exception as exc:
        return f"(log unavailable: {exc})"


def until_done(backend: Backend, handle: JobHandle, *, poll_interval: float, silence: float,
               offset: int, stream_logs: bool, log: logging.Logger,
               between: Callable[[JobStatus], None] = lambda status: None
               ) -> tuple[JobStatus, str, int]:
    """Poll until the job ends: its status, log tail and log offset. ``between`` runs after
    every poll of a live job, with its status (the operator's sweeps and looks at a waiting
    job; it may raise to stop watching)."""
    silent_since: float | None = None
    while True:
        try:
            status = backend.status([handle]).get(handle.job_id) or JobStatus(
                JobState.UNKNOWN, reason="not in the backend's answer")
        except BackendError as exc:
            status = JobStatus(JobState.UNKNOWN, reason=f"{type(exc).__name__}: {exc}")
        if status.state == JobState.UNKNOWN:
            silent_since = silent_since or time.monotonic()
            silent = time.monotonic() - silent_since
            log.warning("No answer about job %s on %s for %.0fs: %s", handle.job_id,
                        handle.connection, silent, status.reason)
            if silent < silence:
                time.sleep(poll_interval)
                continue
            return JobStatus.silent(handle.connection, silent, status.reason), "", offset
        silent_since = None
        if stream_logs:
            offset = stream(backend, handle, offset, log)
        if status.state.terminal:
            return status, tail(backend, handle), offset
        between(status)
        time.sleep(poll_interval)
