"""Putting copies of a task on places: the operator's hands, apart from its Airflow glue.

:class:`Placer` does everything that touches backends on the worker side: it lists the jobs
earlier tries left and adopts or stops them (``identity.classify``), probes, ranks and submits
(taking the next place when one refuses or goes silent mid-submission), stops an old copy and
confirms it dead (``sweeps``), and moves a waiting copy to a place that starts it sooner. It
changes the :class:`~airflow_skypilot.runstate.RunState` it is given and logs what it does;
deferral, XCom and the task's result stay in the operator.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Mapping
from typing import Any

from airflow.sdk.exceptions import AirflowException, AirflowFailException

from airflow_skypilot import identity, placement, recovery, sweeps
from airflow_skypilot.backends.base import JobHandle, JobState, JobStatus, Offer
from airflow_skypilot.backends.registry import backend_for_handle
from airflow_skypilot.exceptions import SubmissionError
from airflow_skypilot.hooks.capacity import SkyPilotCapacityHook, fail_on_config_errors
from airflow_skypilot.ledger import PlacementLedger, hold
from airflow_skypilot.runstate import Attempt, Blocked, Look, RunState, Sweep
from airflow_skypilot.spec import Task

#: submissions refused in a row (each place then blocked) before one placement gives up
MAX_SUBMISSIONS = 8


class Placer:
    """Place, adopt, stop and move the copies of one task (see the module docstring).

    :param hook: the capacity hook over the task's connections.
    :param policy: ``fastest`` or ``cheapest``.
    :param cooldown: seconds a place that refused or failed stays blocked.
    :param confirm_timeout: seconds to wait for a stopped copy's end to be confirmed.
    :param log: where to say what happens (the task log).
    :param ledger: the deployment's placements decided moments ago (none: a ledger holding
        nothing), so concurrent placements do not all pick the same free place.
    :param silence: seconds a retry waits, before placing, for a connection that could not
        be listed for earlier tries' jobs, or a placement for the backend of a submission cut
        short without an answer (None: as long as it takes); then it places, and the
        connection is still swept.
    """

    def __init__(self, hook: SkyPilotCapacityHook, policy: str, *, cooldown: float,
                 confirm_timeout: float, log: logging.Logger,
                 ledger: PlacementLedger | None = None, silence: float | None = None,
                 launcher: str = ""):
        self.hook = hook
        #: ``SKYPILOT_USER`` (SkyPilot's: who launched the job): the task's Airflow owner
        self.launcher = launcher
        self.silence = silence
        self.ledger = ledger or PlacementLedger("")
        self.policy = policy
        self.cooldown = cooldown
        self.confirm_timeout = confirm_timeout
        self.log = log
        #: the last placement made, with its explanation table (the operator shows it)
        self.last_plan: placement.Placement | None = None
        #: every copy submitted (or adopted) through this placer, and (connection, job name)
        #: of a submission under way: what a kill must stop
        self.submitted: list[JobHandle] = []
        self.submitting: tuple[str, str] | None = None

    # --- earlier tries --------------------------------------------------------------------------
    def reconcile(self, run: RunState, run_started_at: float | None,
                  job_recovery: Mapping[str, Any] | None = None,
                  ) -> tuple[JobHandle | None, JobStatus | None]:
        """The jobs earlier tries of this task instance left: adopt one, stop the live rest.
        An adopted job's try goes on with the failovers and restarts it made before
        (``recovery.replay`` under ``job_recovery``).

        A connection that cannot be listed now gets a sweep (its live jobs of this task are
        stopped as soon as it answers). On a retry or a clear, an earlier try's job may run
        there: nothing is placed until it answers, or for ``silence`` seconds ("could not ask"
        is not "none"). Returns the adopted job and its status, if any.
        """
        found = self.hook.find_all(run.prefix)
        fail_on_config_errors(found.config_errors)
        earlier_tries = run.try_number > 1 or run.clear > 0
        for conn_id, error in found.errors.items():
            self.log.warning("Could not list the jobs of earlier tries on %s (%s): any still "
                             "running there is stopped as soon as it answers%s", conn_id, error,
                             "; nothing is placed until then" if earlier_tries else "")
            run.sweeps.append(Sweep(connection=conn_id, prefix=run.prefix,
                                    reason=f"could not be listed at the start of try "
                                           f"{run.try_number}: {error}",
                                    before_next=earlier_tries))
        pairs = [pair for jobs in found.jobs.values() for pair in jobs]
        earlier = identity.classify(pairs, prefix=run.prefix, clear=run.clear,
                                    run_started_at=run_started_at)
        for handle, why in earlier.ignore:
            self.log.info("Job %s (%s) on %s is left alone: %s", handle.job_id, handle.job_name,
                          handle.connection, why)
        for handle, why in earlier.stop:
            self.log.warning("Stopping job %s (%s) on %s: %s", handle.job_id, handle.job_name,
                             handle.connection, why)
            self.stop_copy(run, handle, why)
        run.attempt = identity.next_attempt([h for h, _ in pairs], run.clear, run.try_number,
                                            earlier.adopt)
        if earlier.adopt is None:
            return None, None
        handle = earlier.adopt
        handle.adopted = True
        self.log.info("Adopting job %s (%s) on %s, %s: an earlier run of this task submitted it",
                      handle.job_id, handle.job_name, handle.connection,
                      earlier.adopt_status.state.value)
        before = []
        for old, status in earlier.before:
            attempt = Attempt.from_handle(old)
            attempt.close(status)
            before.append(attempt)
        attempt = run.attempt  # the adopted job's, from the names found
        recovery.replay(run, before, job_recovery or {}, self.cooldown)
        # they steered the placement of the job adopted now, and named it
        run.prefer, run.avoid, run.attempt = None, None, attempt
        if before:
            self.log.info("Its try placed it after %d earlier attempt(s), which still count: %d "
                          "failover(s), %d restart(s)", len(before), run.failovers,
                          run.restarts + run.code_restarts)
        run.record(handle)
        return handle, earlier.adopt_status

    # --- placing ------------------------------------------------------------------------------
    def place(self, task: Task, run: RunState) -> JobHandle | None:
        """Probe, rank, submit; on a refused submission, block that place and take the next.

        None when nothing can take the job now (places blocked, unreachable or over budget),
        or while a copy moved away from is not yet confirmed dead (no second live copy).
        """
        if self._unconfirmed_copy(run, every=True):
            return None
        # a connection where an old copy is not confirmed dead takes no new one: its backend
        # was silent when the copy was stopped (its place failed), and may answer now, before
        # a sweep found that copy (EAGER_NEXT_REGION's block of the failed place is soft)
        held = [Blocked(f"{conn}/*", "an old copy there is not confirmed dead yet")
                for conn in sorted({w.connection for w in run.pending_copies})]
        began = time.time()
        result = self.hook.probe(task)
        fail_on_config_errors(result.config_errors)
        for conn_id, error in result.errors.items():
            self.log.warning("Connection %s skipped for this placement: %s", conn_id, error)
        for _ in range(MAX_SUBMISSIONS):
            with self.ledger.deciding() as entries:
                # what concurrent placements chose moments ago is not free, though no backend
                # shows it yet (copies: each round takes from the probe as it came)
                offers = hold([copy.deepcopy(o) for o in result.offers], entries,
                              probe_began=began, own=run.prefix)
                plan = placement.rank(offers, self.policy, ordered=task.ordered,
                                      blocked=[*run.blocked, *held],
                                      unreachable=result.errors,
                                      prefer=run.prefer, avoid=run.avoid)
                if plan.chosen is not None:
                    self.ledger.note(entries, run.prefix, plan.chosen)
            self.log.info("Placement (policy %s):\n%s\n%s", self.policy, plan.table(),
                          plan.summary)
            self.last_plan = plan
            if plan.chosen is None:
                run.last_plan = plan.summary
                if not any(r.verdict in ("blocked", "unreachable", "over budget")
                           for r in plan.rows) and plan.rows and not result.errors:
                    raise AirflowFailException(
                        "this task cannot run on any connected capacity:\n" + plan.table())
                return None
            run.places = sorted({o.place_key for o in plan.ranked})
            handle = self.submit_at(task, run, plan.chosen)
            self.ledger.submitted(run.prefix, handle is not None, handle and handle.job_name)
            if handle is not None:
                return handle
            if self._unconfirmed_copy(run):
                return None
        raise AirflowException(f"no place accepted the job after {MAX_SUBMISSIONS} submissions")

    def submit_at(self, task: Task, run: RunState, offer: Offer) -> JobHandle | None:
        """Submit the run's next copy at ``offer``; None when that place refused it or went
        silent mid-submission (then blocked for the cooldown; a job that may exist all the
        same is swept, and the next copy gets a name of its own)."""
        env = {"SKYPILOT_TASK_ID": run.task_env_id,
               "SKYPILOT_ATTEMPT": str(identity.attempt_number(run.try_number, run.attempt))}
        if self.launcher:
            env["SKYPILOT_USER"] = self.launcher
        until = time.time() + self.cooldown
        self.submitting = (offer.connection, run.job_name)
        try:
            handle = self.hook.backend(offer.connection).submit(task, offer, run.job_name, env)
        except SubmissionError as exc:
            if not exc.retry_elsewhere:
                raise AirflowException(f"submission to {offer.place_key} failed: {exc}") from exc
            self.log.warning("Submission to %s refused, trying the next place: %s",
                             offer.place_key, exc)
            run.blocked.append(Blocked(offer.place_key, f"submission refused: {exc}",
                                       until=until))
            self.submitting = None
            return None
        except Exception as exc:  # cut short: the job may exist all the same
            handle = self._after_cut_short(run, offer, exc, until)
            if handle is None:
                self.submitting = None  # swept by name from now on
                return None
        self.submitted.append(handle)  # first: a kill from now on stops it by its handle
        self.submitting = None
        run.prefer = run.avoid = None
        run.record(handle)
        self.log.info("%s %s job %s on %s (%s) as %s", "Adopted" if handle.adopted else
                      "Submitted", handle.backend, handle.job_id, handle.connection,
                      handle.location, handle.job_name)
        return handle

    def _after_cut_short(self, run: RunState, offer: Offer, exc: Exception,
                         until: float) -> JobHandle | None:
        """A submission cut short (no answer, a timeout) may have made the job: it is asked
        for before any copy goes elsewhere. Found: adopted. Answered "none": the next place
        (a sweep by name stays, in case it shows up late). Not answered: no copy is submitted
        anywhere until it does (``Sweep.before_next``), as after an unconfirmed move."""
        try:
            found = self.hook.backend(offer.connection).find(run.job_name)
            asked = None
        except Exception as ask:
            found, asked = None, ask
        if found is not None:
            self.log.warning("Submission of %s to %s was cut short (%s), but the job exists: "
                             "adopted", run.job_name, offer.place_key, exc)
            found.adopted = True
            return found
        self.log.warning("Submission of %s to %s cut short: %s; %s", run.job_name,
                         offer.place_key, exc, "no such job was made: trying the next place"
                         if asked is None else f"{offer.connection} cannot say whether the job "
                         f"was made ({asked}): no copy goes elsewhere until it answers")
        run.sweeps.append(Sweep(connection=offer.connection, job_name=run.job_name,
                                reason=f"submission cut short: {exc}",
                                before_next=asked is not None))
        run.blocked.append(Blocked(offer.place_key, f"submission cut short: {exc}",
                                   until=until))
        run.attempt += 1
        return None

    def _unconfirmed_copy(self, run: RunState, every: bool = False) -> str:
        """One more try at the sweeps of copies that must be confirmed dead before the next
        (a move's waiting copy, a submission cut short unanswered, a copy still stopping), or
        at ``every`` pending sweep (a copy confirmed dead frees its connection); what still is
        not, also the run's ``last_plan`` then (nothing is placed)."""
        if any(w.before_next or every for w in run.pending_sweeps):
            self.sweep_pending(run)
        # a connection unlisted for a retry, a submission cut short unanswered, a copy still
        # stopping: waited for long enough (a move's waiting copy, known healthy, waits until
        # it is confirmed)
        for w in run.pending_sweeps:
            if w.before_next and (not w.handle or w.lapses) and self.silence is not None and \
                    time.time() - w.since >= self.silence:
                w.before_next = False
                self.log.warning("%s has not confirmed %s dead for %.0fs: placing the job all "
                                 "the same; it is still swept", w.connection, w.what,
                                 time.time() - w.since)
        waiting = "; ".join(w.describe() for w in run.pending_sweeps if w.before_next)
        if waiting:
            run.last_plan = f"an earlier copy is not confirmed dead yet: {waiting}"
        return waiting

    # --- old copies -----------------------------------------------------------------------------
    def stop_copy(self, run: RunState, handle: JobHandle, why: str,
                  attempt: Attempt | None = None, cleanup: bool = True) -> Sweep:
        return sweeps.stop_copy(run, handle, why, confirm_timeout=self.confirm_timeout,
                                log=self.log, attempt=attempt, cleanup=cleanup)

    def sweep_pending(self, run: RunState, keep: tuple[str, ...] = ()) -> None:
        """One try at every pending sweep (the non-deferrable path's trigger work)."""
        sweeps.sweep_pending(run, self.hook.backend, keep, self.log)

    # --- moving a waiting copy --------------------------------------------------------------
    def move(self, task: Task, run: RunState, handle: JobHandle, to: Offer,
             reason: str) -> tuple[JobHandle | None, bool]:
        """Move the waiting copy ``handle`` to ``to``: only if it still waits and ``to``, probed
        again just now, still takes it as well as promised; the waiting copy is cancelled and
        its end confirmed (else swept, as an old copy at a failover is) before the new one is
        submitted. The place left stays blocked for the cooldown: no back and forth.

        Returns (the copy to watch next, moved?): the same copy when it stays, the new one, or
        None when ``to`` refused it or the waiting copy could not be confirmed dead (the caller
        places it again from scratch, which waits for that confirmation)."""
        backend = backend_for_handle(handle)

        def refused(why: str) -> tuple[JobHandle, bool]:
            now = time.time()
            run.note_look(Look(first_at=now, last_at=now, place=f"{handle.connection}/"
                               f"{handle.location}", best=to.place_key,
                               best_price_per_hour=to.price_per_hour,
                               outcome="move refused", why=why))
            return handle, False

        # the target first (a probe takes seconds), then whether the copy still waits, right
        # before the cancel: a copy that started meanwhile is not cancelled
        # under "cheapest", or a wait too short to pay for (``paid_move_min_wait``), a move
        # never costs more than the place it leaves (spot prices move)
        capped = self.policy == "cheapest" or to.details.get("no_costlier")
        fresh = self._still_good(task, run, to,
                                 max_price=handle.price_per_hour if capped else None)
        if fresh is None:
            return refused(f"{to.place_key}, probed again, no longer takes it as it did")
        try:
            status = backend.status([handle]).get(handle.job_id)
        except Exception as exc:  # could not ask: do not move what may have started
            self.ledger.submitted(run.prefix, False)
            self.log.warning("Not moving job %s: %s could not be asked (%s)", handle.job_id,
                             handle.connection, exc)
            return refused(f"{handle.connection} could not be asked about the job: {exc}")
        if status is None or status.state != JobState.PENDING:
            self.ledger.submitted(run.prefix, False)
            state = status.state.value if status else "unknown"
            self.log.info("Not moving job %s: it is %s now", handle.job_id, state)
            return refused(f"the job is {state} now")
        why = f"moved to {fresh.place_key}: {reason}"
        # cleaned up once its start is read below (a deleted Kubernetes Job has none)
        sweep = self.stop_copy(run, handle, why, cleanup=False)
        ended = run.close(handle, JobStatus(JobState.CANCELLED, reason=why))
        ended.state, ended.confirmed_dead = "moved", sweep.done_at is not None
        if sweep.done_at is not None:
            try:  # only to say so: it was cancelled and is confirmed dead either way
                after = backend.status([handle]).get(handle.job_id)
            except Exception:
                after = None
            if after is not None and after.started_at:
                ended.started_at = after.started_at
                self.log.warning("Job %s had started just before it was cancelled for the "
                                 "move", handle.job_id)
            sweeps.clean_up(backend, [handle])
        left = Blocked(ended.place, "moved away from it", until=time.time() + self.cooldown)
        run.blocked.append(left)
        run.moves += 1
        run.attempt += 1
        if sweep.done_at is None:
            # the waiting copy was healthy: a new one now could make two live copies if it
            # starts before its backend answers; none is submitted until it is confirmed dead
            sweep.before_next, sweep.lapses = True, False  # healthy: it may start any time
            self.ledger.submitted(run.prefix, False)
            self.log.warning("Job %s: the move to %s waits until the copy on %s is confirmed "
                             "dead", handle.job_id, fresh.place_key, handle.connection)
            return None, True
        self.log.warning("Job %s %s", handle.job_id, why)
        moved = self.submit_at(task, run, fresh)
        self.ledger.submitted(run.prefix, moved is not None, moved and moved.job_name)
        if moved is None:  # the target refused it: the place left may take it back at once
            run.blocked.remove(left)
        return moved, True

    def _still_good(self, task: Task, run: RunState, to: Offer, *,
                    max_price: float | None = None) -> Offer | None:
        """``to`` as probed again now, if it still takes the job as well as promised (other
        jobs may have moved or been placed there since the look that chose it: what the
        ledger holds counts too). A good answer is noted in the ledger."""
        began = time.time()
        try:
            offers = self.hook.backend(to.connection).probe(task)
        except Exception as exc:
            self.log.warning("Not moving: %s could not be probed again (%s)", to.connection,
                             exc)
            return None
        with self.ledger.deciding() as entries:
            hold(offers, entries, probe_began=began, own=run.prefix)
            fresh = placement.as_promised(to, offers, max_price=max_price)
            if fresh is None:
                self.log.info("Not moving: %s no longer takes the job as it did", to.place_key)
                return None
            self.ledger.note(entries, run.prefix, fresh)
        fresh.details.setdefault("move_reason", to.details.get("move_reason", ""))
        return fresh
