"""The capacity-probing hook: ask every connection, at once, what it can offer now.

Each connection is probed in its own daemon thread with a deadline. A backend that cannot be
reached, or does not answer in time, is reported and skipped; it never fails the probe alone
(a hung login node must not hold the whole placement, nor the process's exit). A connection
whose previous call is still running in its thread is not called again ("still probing"):
threads of a hung connection do not pile up, each on the backend object later calls share.
A connection that can never work (not defined, a type no backend serves) is reported apart,
as a configuration error of that call: waiting for it would wait for ever.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from airflow.sdk import BaseHook

from airflow_skypilot.backends.base import (
    Backend,
    CapacityRow,
    JobHandle,
    JobState,
    JobStatus,
    Offer,
    job_key,
    statuses_apart,
)
from airflow_skypilot.backends.registry import backend_for_connection
from airflow_skypilot.exceptions import ConfigurationError
from airflow_skypilot.spec.task import Task

T = TypeVar("T")
#: what one connection gave in one call: value, error text, seconds, a configuration error?
_Outcome = tuple[Any, "str | None", float, bool]


@dataclass
class ProbeResult:
    """Offers from every connection that answered; errors from those that did not."""

    offers: list[Offer] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)  # could not ask: skipped this time
    config_errors: dict[str, str] = field(default_factory=dict)  # never works: fail the task
    seconds: dict[str, float] = field(default_factory=dict)


@dataclass
class FoundJobs:
    """Jobs under a name prefix on every connection that answered, each with its status."""

    jobs: dict[str, list[tuple[JobHandle, JobStatus]]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    config_errors: dict[str, str] = field(default_factory=dict)


class SkyPilotCapacityHook(BaseHook):
    """Probe live capacity across Slurm, Kubernetes and AWS connections concurrently.

    :param connections: Airflow connection ids; their connection types pick the backends.
    :param timeout: seconds each connection gets before it is reported as unreachable.
    """

    hook_name = "SkyPilot capacity"

    def __init__(self, connections: Iterable[str], timeout: float = 60.0,
                 backend_factory: Callable[[str], Backend] | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.connections = list(dict.fromkeys(connections))
        self.timeout = timeout
        self._factory = backend_factory or backend_for_connection
        self._backends: dict[str, Backend] = {}
        #: a connection's probe thread still running (it timed out in an earlier call) and
        #: when it started: no second probe of that connection (and backend) while it runs
        self._running: dict[str, tuple[threading.Thread, float]] = {}
        self._running_lock = threading.Lock()

    def backend(self, conn_id: str) -> Backend:
        if conn_id not in self._backends:
            self._backends[conn_id] = self._factory(conn_id)
        return self._backends[conn_id]

    def probe(self, task: Task) -> ProbeResult:
        """Offers for ``task`` from every connection (concurrently, each with the timeout)."""
        results = self._each(lambda b: b.probe(task))
        out = ProbeResult()
        for conn_id, (value, error, seconds, config) in results.items():
            out.seconds[conn_id] = seconds
            if config:
                out.config_errors[conn_id] = error or ""
            elif error is not None:
                out.errors[conn_id] = error
                self.log.warning("Connection %s skipped: %s", conn_id, error)
            else:
                out.offers.extend(value)
        return out

    def find_all(self, prefix: str) -> FoundJobs:
        """The jobs named ``prefix...`` on every connection, with their statuses: the jobs
        earlier tries of a task left (one listing and one batched status per connection)."""
        def listing(backend: Backend) -> list[tuple[JobHandle, JobStatus]]:
            handles = backend.find_all(prefix)
            statuses = statuses_apart(backend, handles)  # two jobs may share an id
            return [(h, statuses.get(job_key(h)) or JobStatus(JobState.UNKNOWN))
                    for h in handles]

        out = FoundJobs()
        for conn_id, (value, error, _, config) in self._each(listing).items():
            if config:
                out.config_errors[conn_id] = error or ""
            elif error is not None:
                out.errors[conn_id] = error
            else:
                out.jobs[conn_id] = value
        return out

    def capacity(self) -> list[CapacityRow]:
        """``show-gpus`` rows from every connection; an unreachable one gives an error row."""
        rows: list[CapacityRow] = []
        for conn_id, (value, error, _, _) in self._each(lambda b: b.capacity()).items():
            if error is not None:
                rows.append(CapacityRow(connection=conn_id, location="", accelerator=None,
                                        error=error))
            else:
                rows.extend(value)
        return rows

    def _each(self, call: Callable[[Backend], T]) -> dict[str, _Outcome]:
        """``call`` on each connection's backend in its own thread, for at most the timeout.

        Every outcome belongs to this call only: a configuration error found now is reported
        now (not by later calls), and a thread that answers after its deadline changes nothing.
        A connection whose thread from an earlier call is still running is not probed again
        (its backend object is busy; threads would pile up): it is reported as still probing.
        """
        results: dict[str, _Outcome] = {}
        lock = threading.Lock()

        def work(conn_id: str) -> None:
            start = time.monotonic()
            try:
                value = call(self.backend(conn_id))
                outcome: _Outcome = (value, None, 0.0, False)
            except BaseException as exc:  # any failure of one backend (even
                # a CancelledError or SystemExit of its own) is reported, not raised
                outcome = (None, _error_text(exc), 0.0, isinstance(exc, ConfigurationError))
            finally:
                with self._running_lock:
                    if self._running.get(conn_id, (None,))[0] is threading.current_thread():
                        del self._running[conn_id]
            with lock:
                results.setdefault(conn_id, (outcome[0], outcome[1],
                                             time.monotonic() - start, outcome[3]))

        threads: dict[str, threading.Thread] = {}
        now = time.monotonic()
        with self._running_lock:
            for conn_id in self.connections:
                busy = self._running.get(conn_id)
                if busy is not None and busy[0].is_alive():
                    results[conn_id] = (None, f"still probing since {now - busy[1]:.0f}s",
                                        0.0, False)
                    continue
                thread = threading.Thread(target=work, args=(conn_id,), daemon=True,
                                          name=f"probe-{conn_id}")
                self._running[conn_id] = (thread, now)
                threads[conn_id] = thread
        for t in threads.values():
            t.start()
        deadline = time.monotonic() + self.timeout
        for conn_id, thread in threads.items():
            thread.join(max(0.0, deadline - time.monotonic()))
            with lock:
                if conn_id not in results:
                    results[conn_id] = (None, f"no answer within {self.timeout:g}s",
                                        self.timeout, False)
        return {c: results[c] for c in self.connections}


def fail_on_config_errors(errors: dict[str, str]) -> None:
    """Misconfigured connections fail the task (no retry): waiting cannot help them."""
    if errors:
        from airflow.sdk.exceptions import AirflowFailException

        raise AirflowFailException("misconfigured connections (fix them or leave them out of "
                                   "connections=):\n" + "\n".join(
                                       f"  {c}: {e}" for c, e in errors.items()))


def _error_text(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__
