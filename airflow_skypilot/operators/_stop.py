"""How the operator stops its jobs when Airflow stops the task without asking it.

Two ways a task ends without ``execute`` or ``execute_complete`` seeing it through:

* **Killed in the worker** (marked failed or success in the UI, a timeout while it runs in the
  worker): Airflow's SIGTERM handler calls ``on_kill``. The task may be anywhere: placing,
  moving a waiting copy (its old copy cancelled, the new one submitted moments ago), failing
  over. Every copy this process submitted or was acting on is cancelled, and the old copies
  still to be confirmed dead get one more try: with no retry left, nobody else would.
* **Resumed only to fail** (the deferral timed out, the trigger crashed): Airflow schedules the
  task with ``next_method="__fail__"`` and the base class raises without calling
  ``execute_complete`` or ``on_kill``: the job whose handle is in XCom is cancelled first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from airflow.sdk.bases.operator import TRIGGER_FAIL_REPR

from airflow_skypilot import sweeps
from airflow_skypilot.backends.base import JobHandle
from airflow_skypilot.backends.registry import backend_for_connection, backend_for_handle
from airflow_skypilot.runstate import XCOM_HANDLE, XCOM_SWEEPS, RunState, Sweep

if TYPE_CHECKING:
    from airflow.sdk import Context


class StopsItsJobs:
    """Mixin of the operator (before ``BaseOperator`` in its bases)."""

    #: the job being watched or acted on; the run state of this execution (set as it goes)
    _handle: JobHandle | None = None
    _run_state: RunState | None = None

    def resume_execution(self, next_method: str, next_kwargs: dict[str, Any] | None,
                         context: Context) -> Any:
        """Also stop the job when Airflow resumes the task only to fail it (a retry would
        start a second one beside it). The handle is in XCom (pushed before deferring)."""
        if next_method == TRIGGER_FAIL_REPR:
            self._cancel_unwatched_job(context, (next_kwargs or {}).get("error", "unknown"))
        return super().resume_execution(next_method, next_kwargs, context)  # type: ignore[misc]

    def _note_sweeps(self, context: Context, run: RunState) -> None:
        """Before a deferral: the old copies still to confirm dead, where the resume of a
        deferral that timed out (it gets no state back) finds them (known copies only: a
        sweep by prefix would find the job being watched too)."""
        self._push(context, XCOM_SWEEPS, [w.to_dict() for w in run.pending_copies])

    def _pull(self, context: Context, key: str) -> Any:
        ti = context["ti"]
        try:
            return ti.xcom_pull(task_ids=ti.task_id, key=key, map_indexes=ti.map_index)
        except Exception as exc:
            self.log.warning("Could not read XCom %s to stop the task's jobs: %s", key, exc)
            return None

    def _cancel_unwatched_job(self, context: Context, why: Any) -> None:
        # old copies (never the job being watched): stopped whatever cancel_on_kill says, as
        # on_kill does: they should be dead already (at most one live copy)
        noted = RunState(sweeps=[Sweep.from_dict(d) for d in self._pull(context, XCOM_SWEEPS)
                                 or ()])
        self._stop_old_copies(noted, backend_for_connection, True,
                              f"The deferral ended ({why})")
        if not self.cancel_on_kill:
            return
        raw = self._pull(context, XCOM_HANDLE)
        if not raw:
            return
        handle = JobHandle.from_dict(raw)
        self._handle = handle
        self.log.warning("The deferral ended without the job's end (%s): cancelling %s job %s "
                         "on %s", why, handle.backend, handle.job_id, handle.connection)
        try:
            backend = backend_for_handle(handle)
            backend.cancel(handle)
            backend.cleanup(handle)
        except Exception as exc:
            self.log.warning("Could not cancel %s job %s on %s: %s; a retry of the task "
                             "stops it when it lists its earlier jobs", handle.backend,
                             handle.job_id, handle.connection, exc)

    def _live_handles(self) -> list[JobHandle]:
        """The copies this execution watched, acted on or submitted, not known to have ended
        (a copy moved away from and not confirmed dead is a pending sweep instead)."""
        placer = self.__dict__.get("_placer")  # a cached_property: only if one was made
        seen = [self._handle, *(placer.submitted if placer is not None else ())]
        if placer is not None and placer.submitting:  # killed mid-submission: it may exist
            conn_id, job_name = placer.submitting
            try:
                seen.append(placer.hook.backend(conn_id).find(job_name))
            except Exception as exc:
                self.log.warning("Could not ask %s for job %s, submitted as the task was "
                                 "killed: %s; stop it by hand if it runs", conn_id, job_name,
                                 exc)
        run = self._run_state
        ended = {(a.connection, a.job_id) for a in (run.attempts if run else ())
                 if a.ended_at is not None}
        out: dict[tuple[str, str], JobHandle] = {}
        for handle in seen:
            if handle is not None and (handle.connection, handle.job_id) not in ended:
                out.setdefault((handle.connection, handle.job_id), handle)
        return list(out.values())

    def on_kill(self) -> None:
        """Cancel the task's jobs when it is killed while running in the worker (the old
        copies still to confirm dead are stopped whatever ``cancel_on_kill`` says)."""
        run, placer = self._run_state, self.__dict__.get("_placer")
        live = self._live_handles() if self.cancel_on_kill else []
        copies = run.pending_copies if run is not None else []
        if live or copies:  # said first: Airflow's SIGKILL may cut what follows short
            self.log.warning("Task killed: stopping %s%s", ", ".join(
                f"{h.backend} job {h.job_id} on {h.connection}" for h in live) or "no job",
                "; old copies:" + run.sweeps_text() if copies and run else "")
        for handle in live:
            try:
                backend_for_handle(handle).cancel(handle)
            except Exception as exc:
                self.log.warning("Could not cancel job %s: %s", handle.job_id, exc)
        if run is not None and placer is not None:
            self._stop_old_copies(run, placer.hook.backend, not self.cancel_on_kill,
                                  "Task killed")

    def _stop_old_copies(self, run: RunState, backend_of: Any, copies_only: bool,
                         when: str) -> None:
        """One more try at ``run``'s old copies still to confirm dead (with no retry left,
        nobody else would stop them); what is left is logged, to be stopped by hand.
        ``copies_only``: not the precautions by prefix (they would find the watched job)."""
        if not run.pending_copies:
            return
        sweeps.sweep_pending(run, backend_of, (), self.log, copies_only=copies_only)
        if run.pending_copies:
            self.log.error("%s; old copies not confirmed dead, stop them by hand:%s", when,
                           run.sweeps_text())
