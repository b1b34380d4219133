"""The trigger that watches a submitted job (and the triggers that wait and sweep).

The trigger is read-only: it never submits. However many jobs are watched on one connection,
one shared poller (``_poller.py``) per (event loop, backend, connection) asks that backend once
per poll interval about all of them (one ``squeue``, one pod list, one
``describe_instances``) and hands each trigger its job's status. A backend that cannot be
asked is asked again: "could not ask" is never "gone", and a job is declared lost for silence
only after ``unreachable_timeout`` seconds without an answer about it. Every error becomes an event.

While they wait, the triggers also keep confirming old copies of the task dead (the run
state's pending sweeps, see ``sweeps.py``), and report what they confirmed in their event.

What the watch sees is written for the job page as the task's ``skypilot_watch`` XCom (through
the triggerer's supervisor, as any trigger's XCom): the job's start, once, and the looks at it
while it waits in a queue (every look goes into the run state's last looks; the XCom is
written when a look gives a new answer, else at most every :data:`WATCH_WRITE_EVERY` s), and
how far the job's output was streamed into the task log (at most every
:data:`WATCH_WRITE_EVERY` s while it grows): a trigger started again on another triggerer goes
on from there.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from airflow_skypilot import rebalance, sweeps
from airflow_skypilot.backends.base import (
    Backend,
    JobHandle,
    JobState,
    JobStatus,
    Offer,
)
from airflow_skypilot.backends.registry import backend_class, backend_for_handle
from airflow_skypilot.runstate import XCOM_WATCH, Look, RunState, Sweep, add_look, watch_record
from airflow_skypilot.triggers._poller import (  # noqa: F401 (pollers_in_this_loop: tests)
    PollError,
    PollResult,
    SharedPoller,
    pollers_in_this_loop,
    shared_poller,
)

LOG_TAIL_LINES = 40
#: seconds between two writes of the watch XCom for looks that changed nothing
WATCH_WRITE_EVERY = 300.0
#: seconds a trigger waits for the watch XCom when it starts (then streams from its deferral's
#: offset)
WATCH_READ_TIMEOUT = 10.0
#: seconds a job's backend may stay silent before the job counts as lost
DEFAULT_UNREACHABLE_TIMEOUT = 300.0
#: seconds the trigger's on_kill keeps asking a silent backend to cancel the watched job (within
#: Airflow's ``[triggerer] on_kill_timeout``, 30 s by default), and the wait between two asks
ON_KILL_CANCEL_BUDGET = 20.0
ON_KILL_RETRY_WAIT = 2.0
#: seconds past two poll intervals a watcher waits for a poll's result before it counts the
#: wait as a silence (longer than any backend call's own bound)
POLL_RESULT_GRACE = 180.0


def last_lines(text: str) -> str:
    """The lines a failure quotes, of the end of a job's output."""
    return "\n".join(text.splitlines()[-LOG_TAIL_LINES:])


def _ignore(trigger: Any, legacy: dict[str, Any]) -> None:
    """Arguments a trigger serialized by another release has and this one does not: ignored,
    not a TypeError (Airflow would fail the trigger, and the task's resume cancel its job)."""
    if legacy:
        trigger.log.warning("%s: ignoring arguments of another release: %s",
                            type(trigger).__name__, ", ".join(sorted(legacy)))


def _xcom_of(ti: Any) -> dict[str, Any]:
    """Where a trigger's task instance keeps its XComs (``map_index`` -1 when not mapped)."""
    map_index = getattr(ti, "map_index", -1)
    return {"dag_id": ti.dag_id, "task_id": ti.task_id, "run_id": ti.run_id,
            "map_index": -1 if map_index is None else map_index}


def _state_dict(state: RunState | dict[str, Any] | None) -> dict[str, Any] | None:
    """Triggers are serialized to JSON: a RunState travels as its dict."""
    return state.to_dict() if isinstance(state, RunState) else state


class _SweepsMixin:
    """Keep confirming the run state's old copies dead while the trigger waits.

    The sweeps live in ``self.state`` (the run state's dict), which comes back in the event:
    what was confirmed here is known to the operator when it resumes. A triggerer restart
    forgets confirmations not yet reported; sweeping again is harmless (cancel is idempotent).
    """

    state: dict[str, Any] | None
    sweep_interval: float = 10.0

    def _pending(self, copies_only: bool = False) -> list[dict[str, Any]]:
        """Sweeps not done; ``copies_only``: of known copies, not precautions (see
        ``RunState.pending_copies``)."""
        return [w for w in (self.state or {}).get("sweeps") or [] if not w.get("done_at")
                and (not copies_only or w.get("handle") or w.get("job_name"))]

    async def _asweep_once(self, keep: tuple[str, ...] = ()) -> None:
        from airflow_skypilot.backends.registry import backend_for_connection
        from airflow_skypilot.runstate import Sweep

        for data in self._pending():
            sweep = Sweep.from_dict(data)
            try:
                backend = await asyncio.to_thread(
                    lambda w=sweep: backend_for_handle(JobHandle.from_dict(w.handle))
                    if w.handle else backend_for_connection(w.connection))
                done = await asyncio.to_thread(sweeps.step, sweep, backend, keep)
            except Exception as exc:  # silent still: try again next round
                self.log.info("Old copy on %s not confirmed yet (%s): %s", sweep.connection,
                              sweep.what, exc)
                continue
            if done:
                data.update(done_at=sweep.done_at, outcome=sweep.outcome)
                self.log.warning("Old copy confirmed dead: %s", sweep.describe())

    async def _asweep_forever(self, keep: tuple[str, ...] = (),
                              copies_only: bool = False) -> None:
        while self._pending(copies_only):
            await self._asweep_once(keep)
            if self._pending(copies_only):
                await asyncio.sleep(self.sweep_interval)

    async def _atask_state(self) -> str | None:
        """The deferred task instance's state now, from Airflow (None: cannot tell)."""
        ti = getattr(self, "task_instance", None)
        if ti is None:
            return None
        try:
            from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

            states = await asyncio.to_thread(
                RuntimeTaskInstance.get_task_states, dag_id=ti.dag_id, map_index=ti.map_index,
                task_ids=[ti.task_id], run_ids=[ti.run_id])
        except Exception as exc:  # an older Airflow, no supervisor: cannot tell
            self.log.info("Could not read the state of task %s: %s", ti.task_id, exc)
            return None
        key = ti.task_id if ti.map_index is None or ti.map_index < 0 \
            else f"{ti.task_id}_{ti.map_index}"
        state = (states.get(ti.run_id) or {}).get(key)
        return str(getattr(state, "value", state)) if state is not None else None

    async def _asweep_on_kill(self, keep: tuple[str, ...] = ()) -> None:
        """The task was killed: one more try at its old copies (a move's waiting copy not
        confirmed dead among them), since no later try of it may come to sweep them; ``keep``:
        a job name never to cancel (the watched job, with ``cancel_on_kill=False``)."""
        if self._pending(copies_only=True):
            await self._asweep_once(keep)
            for data in self._pending(copies_only=True):
                self.log.error("Old copy NOT confirmed dead as the task was killed; stop it by "
                               "hand: %s", Sweep.from_dict(data).describe())


class SkyPilotJobTrigger(_SweepsMixin, BaseTrigger):
    """Fire when a job reaches a terminal state (or cannot be watched any more).

    :param handle: the job's :class:`JobHandle` as a dict.
    :param poll_interval: seconds between polls of the job's connection.
    :param unreachable_timeout: seconds without an answer about the job (its backend cannot
        be asked, or cannot say) before it counts as lost. Shorter silences are waited out.
    :param log_offset: byte offset of the job log already shown; new output is logged.
    :param stream_logs: copy the job's output into the task log while it runs.
    :param cancel_on_kill: cancel the job when a user kills the deferred task (Airflow >= 3.3).
    :param state: the operator's :class:`~airflow_skypilot.runstate.RunState` (or its dict),
        handed back in the event as a dict (``airflow dags test`` resumes with the event alone,
        so state cannot rely on the defer kwargs). The trigger reads only its pending sweeps.
    :param reconsider: a :class:`~airflow_skypilot.rebalance.ReconsiderSpec` as a dict: while
        the job waits in a queue, look again every ``interval`` seconds and fire a ``move``
        event when another place would start it clearly sooner (None: never).
    """

    def __init__(self, handle: dict[str, Any], poll_interval: float = 10.0,
                 unreachable_timeout: float = DEFAULT_UNREACHABLE_TIMEOUT, log_offset: int = 0,
                 stream_logs: bool = True, cancel_on_kill: bool = True,
                 state: RunState | dict[str, Any] | None = None,
                 reconsider: dict[str, Any] | None = None, **legacy: Any):
        super().__init__()
        if "max_unreachable" in legacy:  # before 14514ef: failed polls in a row, not seconds
            unreachable_timeout = float(legacy.pop("max_unreachable")) * poll_interval
        _ignore(self, legacy)
        self.handle = handle
        self.poll_interval = poll_interval
        self.sweep_interval = max(poll_interval, 5.0)
        self.unreachable_timeout = unreachable_timeout
        self.log_offset = log_offset
        self.stream_logs = stream_logs
        self.cancel_on_kill = cancel_on_kill
        self.state = _state_dict(state)
        self.reconsider = reconsider
        self._looks: dict[str, Any] = {}  # the looks when there is no run state (tests)
        self._written_at = 0.0
        self._offset = log_offset  # how far the output was streamed (the watch XCom's)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            "airflow_skypilot.triggers.skypilot.SkyPilotJobTrigger",
            {
                "handle": self.handle,
                "poll_interval": self.poll_interval,
                "unreachable_timeout": self.unreachable_timeout,
                "log_offset": self.log_offset,
                "stream_logs": self.stream_logs,
                "cancel_on_kill": self.cancel_on_kill,
                "state": self.state,
                "reconsider": self.reconsider,
            },
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        try:
            handle = JobHandle.from_dict(self.handle)
            spec = rebalance.ReconsiderSpec.from_dict(self.reconsider) \
                if self.reconsider else None
            # the first import of a backend module takes a moment: not on the triggerer's loop
            await asyncio.to_thread(backend_class, handle.backend)
            poller = shared_poller(handle, self.poll_interval)
        except Exception as exc:
            yield TriggerEvent({"status": "error", "handle": self.handle, "state": self.state,
                                "message": f"cannot watch the job: {type(exc).__name__}: {exc}"})
            return
        await self._astart_offset(handle)
        queue = poller.subscribe(handle, self.poll_interval, self.stream_logs, self._offset)
        sweeper = asyncio.create_task(self._asweep_forever((handle.job_name,))) \
            if self._pending() else None
        silent_since: float | None = None
        loop = asyncio.get_running_loop()
        next_look = loop.time() + (spec.interval if spec else 0.0)
        seen: JobState | None = None
        try:
            while True:
                item = await self._anext(queue, poller)
                unknown = isinstance(item, PollError) or item.status.state == JobState.UNKNOWN
                if unknown:
                    now = time.monotonic()
                    silent_since = now if silent_since is None else silent_since
                    why = item.message if isinstance(item, PollError) else item.status.reason
                    self.log.warning("No answer about job %s on %s for %.0fs (lost after %gs): %s",
                                     handle.job_id, handle.connection, now - silent_since,
                                     self.unreachable_timeout, why)
                    if now - silent_since >= self.unreachable_timeout:
                        status = JobStatus.silent(handle.connection, now - silent_since, why)
                        yield TriggerEvent(self._event(handle, status, "", self._offset))
                        return
                    continue
                silent_since = None
                for line in item.log.splitlines():
                    self.log.info("[%s] %s", handle.job_id, line)
                grew, self._offset = item.log_offset > self._offset, item.log_offset
                if item.status.state == JobState.RUNNING and (
                        seen != JobState.RUNNING
                        or grew and time.time() - self._written_at >= WATCH_WRITE_EVERY):
                    # its start, for the page; and how far its output was streamed (a
                    # triggerer restarted picks it up there, not at the deferral's offset)
                    await self._awrite_watch(handle, item.status)
                seen = item.status.state
                if spec is not None and item.status.state == JobState.PENDING \
                        and loop.time() >= next_look:
                    next_look = loop.time() + spec.interval
                    to = await self._areconsider(spec, handle, item.status)
                    if to is not None:
                        yield TriggerEvent({
                            "status": "move", "handle": handle.to_dict(), "to": to.to_dict(),
                            "reason": to.details.get("move_reason", ""),
                            "log_offset": self._offset,
                            "at": time.time(), "state": self.state})
                        return
                if item.status.state.terminal:
                    if self.stream_logs:  # output written after the final poll
                        self._offset = await self._astream(poller.backend, handle,
                                                           self._offset)
                    tail = await self._atail(poller.backend, handle)
                    yield TriggerEvent(self._event(handle, item.status, tail, self._offset))
                    return
        except Exception as exc:  # never crash the triggerer: report instead
            yield TriggerEvent({"status": "error", "handle": self.handle, "state": self.state,
                                "message": f"{type(exc).__name__}: {exc}"})
        finally:
            poller.unsubscribe(queue)
            if sweeper is not None:
                sweeper.cancel()

    async def _anext(self, queue: asyncio.Queue, poller: SharedPoller) -> PollResult | PollError:
        """The next poll's result for this job; a poller that stays quiet well past its
        interval (its loop ended, or a backend call outlived its own bound) is started again,
        and the wait counts as a silence, never as an answer."""
        wait = 2 * max(self.poll_interval, poller.interval) + POLL_RESULT_GRACE
        try:
            return await asyncio.wait_for(queue.get(), wait)
        except asyncio.TimeoutError:
            done = await poller.arestart(JobHandle.from_dict(self.handle), wait)
            return PollError(f"no poll result for {wait:.0f}s" + (f" ({done})" if done else ""))

    async def _areconsider(self, spec: rebalance.ReconsiderSpec, handle: JobHandle,
                           status: JobStatus) -> Offer | None:
        try:
            decision = await rebalance.adecide(spec, handle, status)
        except Exception as exc:  # a look that fails is a look not taken: the job stays
            self.log.warning("Could not reconsider job %s: %s", handle.job_id, exc)
            return None
        to = decision.move_to
        new = self._note_look(decision.look)
        if to is not None:
            self.log.warning("Job %s waits on %s/%s; moving it to %s: %s", handle.job_id,
                             handle.connection, handle.location, to.place_key,
                             to.details.get("move_reason", ""))
        else:
            self.log.info("Job %s waits on %s/%s and stays: %s", handle.job_id,
                          handle.connection, handle.location, decision.look.why)
            if new or time.time() - self._written_at >= WATCH_WRITE_EVERY:
                await self._awrite_watch(handle, status)
        return to

    def _note_look(self, look: Look) -> bool:
        """Record a look in the run state (the last looks travel with it); True when it is a
        new answer rather than one more of the last."""
        target = self.state if self.state is not None else self._looks
        return add_look(target, look)["count"] == 1

    async def _awrite_watch(self, handle: JobHandle, status: JobStatus) -> None:
        """The ``skypilot_watch`` XCom of the deferred task (best effort: the page's view)."""
        ti = getattr(self, "task_instance", None)
        if ti is None:
            return
        now = time.time()
        record = watch_record(self.state if self.state is not None else self._looks,
                              handle.to_dict(), status.state.value, now,
                              started_at=status.started_at, est_start=status.est_start,
                              log_offset=self._offset)
        try:
            from airflow.sdk.execution_time.xcom import XCom

            await XCom.aset(XCOM_WATCH, record, **_xcom_of(ti))
        except Exception as exc:  # the page shows less; the watch goes on
            self.log.debug("Could not write the %s XCom: %s", XCOM_WATCH, exc)
        self._written_at = now  # tried: not again at every poll

    async def _astart_offset(self, handle: JobHandle) -> None:
        """Where to stream the job's output from (``_offset``): the deferral's offset, or,
        when a trigger of this job in a triggerer that stopped wrote a later one to the watch
        XCom, that one (else a restart repeats every line since the deferral in the task log)."""
        ti = getattr(self, "task_instance", None)
        if not self.stream_logs or ti is None:
            return
        try:
            from airflow.sdk.execution_time.xcom import XCom

            record = await asyncio.wait_for(XCom.aget_one(key=XCOM_WATCH, **_xcom_of(ti)),
                                            WATCH_READ_TIMEOUT)
        except Exception as exc:  # the output may repeat; the watch goes on
            self.log.debug("Could not read the %s XCom: %s", XCOM_WATCH, exc)
            return
        if not isinstance(record, dict) or (record.get("job_id"), record.get("connection")) \
                != (handle.job_id, handle.connection):
            return
        streamed = int(record.get("log_offset") or 0)
        if streamed > self._offset:
            self.log.info("Job %s: its output up to byte %d was shown by an earlier watch of "
                          "it (a triggerer that stopped); going on from there", handle.job_id,
                          streamed)
            self._offset = streamed

    async def _astream(self, backend: Backend, handle: JobHandle, offset: int) -> int:
        try:
            text, offset = await backend.aread_log(handle, offset)
        except Exception as exc:  # logs are a convenience; the status is what matters
            self.log.debug("Could not read the log of %s: %s", handle.key, exc)
            return offset
        for line in text.splitlines():
            self.log.info("[%s] %s", handle.job_id, line)
        return offset

    async def _atail(self, backend: Backend, handle: JobHandle) -> str:
        """The end of the job's output, streamed or not: a read from the offset would give
        the start of a long log that was not streamed (the offset is still 0)."""
        try:
            return last_lines(await backend.aread_tail(handle))
        except Exception as exc:
            return f"(log unavailable: {exc})"

    def _event(self, handle: JobHandle, status: JobStatus, tail: str,
               offset: int) -> dict[str, Any]:
        return {"status": "done", "handle": handle.to_dict(), "job_status": status.to_dict(),
                "log_tail": tail, "log_offset": offset, "at": time.time(), "state": self.state}

    async def on_kill(self) -> None:
        """Airflow >= 3.3 calls this when a user kills the deferred task: cancel the job.

        Airflow 3.3 also calls it on a triggerer whose trigger was handed to another triggerer
        (its heartbeat was late: ``[triggerer] triggerer_health_check_threshold``), as if a user
        had acted (apache/airflow#73454). The task is then still deferred, and the other
        triggerer watches the job: it is left running. Only when the task's state cannot be
        read is the job cancelled regardless, as the user asked.
        """
        if not self.cancel_on_kill and not self._pending(copies_only=True):
            return
        handle = JobHandle.from_dict(self.handle)
        state = await self._atask_state()
        if state == "deferred":
            self.log.warning(
                "This triggerer lost the trigger of job %s on %s, but its task is still deferred "
                "(the trigger moved to another triggerer): the job is left running",
                handle.job_id, handle.connection)
            return
        # the watched job's cancel and one more try at the old copies still to confirm dead
        # (those whatever cancel_on_kill says: it keeps the watched job only; nothing else
        # would stop them), side by side: neither waits on the other's silent backend, and
        # both fit Airflow's [triggerer] on_kill_timeout
        jobs = [self._asweep_on_kill(() if self.cancel_on_kill else (handle.job_name,))]
        if self.cancel_on_kill:
            jobs.insert(0, self._acancel_on_kill(handle))
        for outcome in await asyncio.gather(*jobs, return_exceptions=True):
            if isinstance(outcome, Exception):
                self.log.error("Stopping the task's jobs as it was killed failed: %s: %s",
                               type(outcome).__name__, outcome)

    async def _acancel_on_kill(self, handle: JobHandle) -> None:
        """Cancel the watched job, asked again after a failure within
        :data:`ON_KILL_CANCEL_BUDGET` (a backend briefly silent: no later try comes to stop
        it); a job still not cancelled is named in the log."""
        backend = backend_for_handle(handle)
        self.log.info("Task killed while deferred: cancelling %s job %s on %s",
                      handle.backend, handle.job_id, handle.connection)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ON_KILL_CANCEL_BUDGET
        while True:
            try:
                await asyncio.wait_for(asyncio.to_thread(backend.cancel, handle),
                                       max(deadline - loop.time(), 0.1))
                return
            except Exception as exc:  # any failure is "not cancelled yet"
                error = exc
            if loop.time() + ON_KILL_RETRY_WAIT >= deadline:
                break
            await asyncio.sleep(ON_KILL_RETRY_WAIT)
        self.log.error("Job %s on %s NOT cancelled as the task was killed (%s: %s); stop it "
                       "by hand: %s job %s", handle.job_id, handle.connection,
                       type(error).__name__, error, handle.backend, handle.job_name)


class SkyPilotWaitTrigger(_SweepsMixin, BaseTrigger):
    """Sleep, then resume the operator to probe again (nothing fits anywhere right now).

    :param seconds: how long to wait.
    :param state: the operator's :class:`~airflow_skypilot.runstate.RunState` (or its dict),
        handed back in the ``reprobe`` event; its pending sweeps are worked on meanwhile.
    """

    def __init__(self, seconds: float, state: RunState | dict[str, Any] | None = None,
                 **legacy: Any):
        super().__init__()
        _ignore(self, legacy)
        self.seconds = seconds
        self.state = _state_dict(state)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("airflow_skypilot.triggers.skypilot.SkyPilotWaitTrigger",
                {"seconds": self.seconds, "state": self.state})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        sweeper = asyncio.create_task(self._asweep_forever()) if self._pending() else None
        try:
            await asyncio.sleep(self.seconds)
        finally:
            if sweeper is not None:
                sweeper.cancel()
        yield TriggerEvent({"status": "reprobe", "state": self.state})

    async def on_kill(self) -> None:
        """The task was killed while it waited (for capacity, or for a moved-away copy to be
        confirmed dead): one more try at its old copies, unless it is still deferred (the
        trigger moved to another triggerer)."""
        if self._pending(copies_only=True) and await self._atask_state() != "deferred":
            await self._asweep_on_kill()


class SkyPilotSweepTrigger(_SweepsMixin, BaseTrigger):
    """The task's job is done, but an old copy could not be confirmed dead yet: keep trying
    for up to ``timeout`` seconds, then hand back what was confirmed (``swept`` event).

    :param timeout: seconds to keep trying.
    :param interval: seconds between tries.
    :param state: the operator's run state (its dict); its pending sweeps are the work.
    """

    def __init__(self, timeout: float, interval: float = 10.0,
                 state: RunState | dict[str, Any] | None = None, **legacy: Any):
        super().__init__()
        _ignore(self, legacy)
        self.timeout = timeout
        self.sweep_interval = interval
        self.state = _state_dict(state)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("airflow_skypilot.triggers.skypilot.SkyPilotSweepTrigger",
                {"timeout": self.timeout, "interval": self.sweep_interval, "state": self.state})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        try:
            await asyncio.wait_for(self._asweep_forever(copies_only=True), self.timeout)
        except asyncio.TimeoutError:
            pass
        yield TriggerEvent({"status": "swept", "state": self.state})

    async def on_kill(self) -> None:
        """The task was killed while its old copies were being confirmed dead (its job had
        succeeded): one more try at them, unless it is still deferred (another triggerer)."""
        if self._pending(copies_only=True) and await self._atask_state() != "deferred":
            await self._asweep_on_kill()
