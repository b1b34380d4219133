"""Confirming that old copies of a task are dead: the "at most one live copy" rule at work.

A :class:`~airflow_skypilot.runstate.Sweep` names a copy that may still run. :func:`step` makes
one try: ask the backend, cancel what is alive, and report whether the backend now confirms
that nothing of it runs. It never guesses: a backend that cannot be asked raises, and the sweep
stays for the next try (the operator tries at once, the trigger on every poll, a last trigger
after the task's end). Sync on purpose: the worker calls it directly, the triggerer in a thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from airflow_skypilot.backends.base import (
    Backend,
    JobHandle,
    JobState,
    JobStatus,
    job_key,
    statuses_apart,
)
from airflow_skypilot.backends.registry import backend_for_handle
from airflow_skypilot.identity import parse_job_name
from airflow_skypilot.runstate import Attempt, RunState, Sweep

_log = logging.getLogger(__name__)


def _settle(backend: Backend, handles: list[JobHandle]) -> tuple[list[JobHandle], list[str]]:
    """Cancel what is alive among ``handles``; the handles still alive after one more look,
    and how the others ended. A job the answer leaves out counts as alive: the backend did
    not speak for it ("could not ask" is never "gone"), so it is cancelled and asked again."""
    if not handles:
        return [], []

    def look(among: list[JobHandle]) -> dict[tuple[str, str], JobStatus]:
        answer = statuses_apart(backend, among)  # two jobs sharing an id: each its own
        return {key(h): answer.get(key(h)) or JobStatus(
            JobState.UNKNOWN, reason="not in the backend's answer") for h in among}

    key = job_key

    statuses = look(handles)
    alive = [h for h in handles if statuses[key(h)].up]
    ended = [statuses[key(h)].state.value for h in handles if not statuses[key(h)].up]
    if not alive:
        return [], ended
    for handle in alive:
        backend.cancel(handle)
    again = look(alive)
    still = [h for h in alive if again[key(h)].up]
    ended += [again[key(h)].state.value for h in alive if not again[key(h)].up]
    return still, ended


def step(sweep: Sweep, backend: Backend, keep: Iterable[str] = (),
         now: float | None = None, cleanup: bool = True) -> bool:
    """One try at confirming ``sweep``'s copy dead; True (and ``sweep.done_at`` set) once the
    backend says nothing of it is alive, and (``cleanup``) what it left cleaned up. ``keep``:
    job names never to cancel (the copy being watched). Raises BackendError when the backend
    cannot be asked."""
    keep = set(keep)
    if sweep.handle:
        handles = [JobHandle.from_dict(sweep.handle)]
    elif sweep.job_name:
        found = backend.find(sweep.job_name)
        handles = [found] if found is not None else []
    else:
        # only our names of exactly this prefix (another task's prefix may start with ours)
        handles = [h for h in backend.find_all(sweep.prefix) if h.job_name not in keep
                   and (parts := parse_job_name(h.job_name)) and parts.prefix == sweep.prefix]
    still, ended = _settle(backend, handles)
    if still:
        return False
    sweep.done_at = time.time() if now is None else now
    sweep.outcome = ", ".join(sorted(set(ended))) or "nothing alive there"
    if cleanup:
        clean_up(backend, handles)
    return True


def clean_up(backend: Backend, handles: Iterable[JobHandle]) -> None:
    """What dead copies left (a cancelled Kubernetes Job: no TTL ends a suspended Job)."""
    for handle in handles:
        try:
            backend.cleanup(handle)
        except Exception as exc:  # dead is dead: what is left is the backend's own to end
            _log.warning("Could not clean up after the old copy %s: %s", handle.job_name, exc)


def stop_copy(run: RunState, handle: JobHandle, why: str, *, confirm_timeout: float,
              log: logging.Logger, attempt: Attempt | None = None,
              cleanup: bool = True) -> Sweep:
    """Cancel a copy and wait (up to ``confirm_timeout`` seconds) for its backend to confirm
    it dead (``cleanup``: then clean up after it). The sweep is recorded in ``run`` either
    way: done, or pending for the trigger."""
    sweep = Sweep(connection=handle.connection, handle=handle.to_dict(), reason=why)
    run.sweeps.append(sweep)
    deadline = time.monotonic() + confirm_timeout
    error = ""
    while True:
        try:
            if step(sweep, backend_for_handle(handle), cleanup=cleanup):
                break
            error = ""  # answered: still up
        except Exception as exc:  # silent: keep trying until the deadline
            error = f"{type(exc).__name__}: {exc}"
        if time.monotonic() >= deadline:
            break
        time.sleep(min(2.0, max(0.1, deadline - time.monotonic())))
    if attempt is not None:
        attempt.confirmed_dead = sweep.done_at is not None
    if sweep.done_at is not None:
        log.info("Old copy confirmed dead: %s", sweep.describe())
    elif not error:
        # its backend says it still runs: a new copy now would be a second live one. A silent
        # backend is another matter (its place failed: the copy is stopped when it answers)
        sweep.before_next = sweep.lapses = True
        log.error("Old copy still running after its cancel; no new copy is placed until %s "
                  "confirms it dead (or for unreachable_timeout): %s", handle.connection,
                  sweep.describe())
    else:
        log.error("Old copy NOT confirmed dead (%s); it is cancelled again until %s confirms "
                  "it: %s", error, handle.connection, sweep.describe())
    return sweep


def sweep_pending(run: RunState, backend_of: Callable[[str], Backend], keep: Iterable[str],
                  log: logging.Logger, copies_only: bool = False) -> None:
    """One try at every pending sweep of ``run`` (``backend_of``: connection id -> backend);
    ``copies_only``: of known copies only, not the precautions by prefix."""
    for sweep in run.pending_copies if copies_only else run.pending_sweeps:
        try:
            backend = backend_for_handle(JobHandle.from_dict(sweep.handle)) if sweep.handle \
                else backend_of(sweep.connection)
            if step(sweep, backend, keep):
                log.warning("Old copy confirmed dead: %s", sweep.describe())
        except Exception as exc:
            log.info("Old copy on %s not confirmed yet: %s", sweep.connection, exc)
