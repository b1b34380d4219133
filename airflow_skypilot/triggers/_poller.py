"""The shared poller behind the job triggers: one per (event loop, backend, connection).

However many jobs are watched on one connection, it asks that backend once per poll interval
about all of them (one ``squeue``, one pod list, one ``describe_instances``) and hands each
subscribed trigger its job's status and new output through a queue of its own. A failed poll
is a :class:`PollError` for every watcher (never "gone"), and the next poll goes through a
backend made anew; a round that fails in our own code does not end the loop.
"""

from __future__ import annotations

import asyncio
import weakref
from dataclasses import dataclass

from airflow_skypilot.backends.base import (
    Backend,
    JobHandle,
    JobState,
    JobStatus,
    astatuses_apart,
    job_key,
)
from airflow_skypilot.backends.registry import backend_for_handle


@dataclass
class PollError:
    """A poll of the whole connection failed (the job itself may be fine)."""

    message: str


@dataclass
class PollResult:
    """One job's status at this poll, and its output since the last one."""

    status: JobStatus
    log: str = ""
    log_offset: int = 0


@dataclass
class _Sub:
    handle: JobHandle
    queue: asyncio.Queue
    stream_logs: bool
    offset: int
    interval: float = 0.0


class SharedPoller:
    """Polls one connection for every job subscribed to it, once per interval: one status
    request for all jobs, and one log request for all jobs whose output is streamed. The
    interval is the shortest of the jobs watched now (a job with a short one that ended no
    longer sets the pace of the others)."""

    def __init__(self, backend: Backend, interval: float):
        self.backend = backend
        self.interval = self._default = interval
        self._subs: list[_Sub] = []
        self._task: asyncio.Task | None = None
        self._prepared = False
        self._last_round = 0.0  # when the loop last started or ended a round (loop time)
        #: requests sent (tests and the benchmark check: one per interval, whatever the count)
        self.status_polls = 0
        self.log_polls = 0

    def subscribe(self, handle: JobHandle, interval: float, stream_logs: bool = True,
                  offset: int = 0) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue()
        self._subs.append(_Sub(handle, queue, stream_logs, offset, interval))
        self._pace()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._arun_loop())
        return queue

    def _pace(self) -> None:
        """The interval: the shortest of the jobs watched now."""
        self.interval = min((s.interval for s in self._subs), default=self._default)

    def unsubscribe(self, queue: asyncio.Queue) -> None:
        self._subs = [s for s in self._subs if s.queue is not queue]
        self._pace()
        if not self._subs and self._task is not None:
            self._task.cancel()
            self._task = None

    async def arestart(self, handle: JobHandle, quiet_for: float) -> str:
        """A watcher waited ``quiet_for`` seconds, far past the interval, for a result: the
        loop ended, or is stuck in a backend call past its own bounds. Start it again (a stuck
        one, with no round ended for ``quiet_for``, cancelled and its backend made anew; the
        other watchers of a loop just started find it running); what was done, for the log."""
        if not self._subs:
            return ""
        why = "the poll loop had stopped"
        if self._task is not None and not self._task.done():
            if asyncio.get_running_loop().time() - self._last_round < quiet_for:
                return ""
            why = "the poll loop was stuck"
            self._task.cancel()
            self._task = None
            await self._arenew(handle)
        self._task = asyncio.get_running_loop().create_task(self._arun_loop())
        return f"{why}: started again"

    async def _arun_loop(self) -> None:
        try:
            loop = asyncio.get_running_loop()
            self._last_round = loop.time()
            while self._subs:
                started = loop.time()
                try:
                    await self._apoll_once()
                except Exception as exc:  # a bug in one round must not end every watch
                    for sub in list(self._subs):
                        sub.queue.put_nowait(PollError(f"{type(exc).__name__}: {exc}"))
                self._last_round = loop.time()
                # a fixed rate: the poll's own duration is not added to the interval
                await asyncio.sleep(max(0.0, self.interval - (loop.time() - started)))
        finally:
            # a job subscribed again after this loop was cancelled: the loop started for it
            # uses the same backend, which is not closed under it
            if not self._subs:
                await _aclose(self.backend)

    async def _apoll_once(self) -> None:
        subs = list(self._subs)
        self.status_polls += 1
        try:
            if not self._prepared:
                await self.backend.aprepare()
                self._prepared = True
            # one request, unless two jobs share an id
            statuses = await astatuses_apart(self.backend, (s.handle for s in subs))
        except Exception as exc:  # reported to every watcher; the loop goes on
            error = PollError(f"{type(exc).__name__}: {exc}")
            for sub in subs:
                sub.queue.put_nowait(error)
            await self._arenew(subs[0].handle)
            return
        logs = await self._alogs([s for s in subs if s.stream_logs])
        for sub in subs:
            # a backend that does not speak for a job has not said it is gone
            status = statuses.get(job_key(sub.handle)) or JobStatus(
                JobState.UNKNOWN, reason="not in the backend's answer")
            text, offset = logs.get((job_key(sub.handle), sub.offset), ("", sub.offset))
            sub.offset = offset
            sub.queue.put_nowait(PollResult(status, text, offset))

    async def _alogs(self, subs: list[_Sub]
                     ) -> dict[tuple[tuple[str, str], int], tuple[str, int]]:
        """Each streamed job's new output from each offset its watchers are at, by
        :func:`job_key`: one request for all jobs, and one more for each further offset of a
        job two triggers watch (the operator's and a sensor's: each has shown its own part of
        the output) and for each further job sharing an id (an answer is keyed by job id:
        after a Slurm state loss, one job's output would be streamed as the other's)."""
        out: dict[tuple[tuple[str, str], int], tuple[str, int]] = {}
        wanted = {(job_key(s.handle), s.offset): s.handle for s in subs}
        while wanted:
            batch: dict[str, tuple[tuple[tuple[str, str], int], JobHandle, int]] = {}
            for (key, offset), handle in wanted.items():
                batch.setdefault(handle.job_id, ((key, offset), handle, offset))
            self.log_polls += 1
            try:
                got = await self.backend.aread_logs([(h, o) for _, h, o in batch.values()])
            except Exception:  # output is a convenience; the status is what matters
                got = {}
            for job_id, (wanted_key, _, _) in batch.items():
                if job_id in got:
                    out[wanted_key] = got[job_id]
                del wanted[wanted_key]
        return out

    async def _arenew(self, handle: JobHandle) -> None:
        """After a failed poll the next one goes through a backend made anew, the connection
        read again: a cached client of rotated credentials (an expired token, Vault's dynamic
        AWS keys) would fail for ever, and every job watched here be taken for lost, cancelled
        and placed again by the operator, whose own backend reads the new ones."""
        try:
            fresh = backend_for_handle(handle)
        except Exception:  # the connection cannot be read now: the old backend tries again
            return
        old, self.backend, self._prepared = self.backend, fresh, False
        await _aclose(old)


async def _aclose(backend: Backend) -> None:
    """Release a backend's async connections, if it holds any."""
    close = getattr(backend, "aclose", None)
    if close is not None:
        try:
            await close()
        except Exception:  # closing a broken connection: nothing left to release
            pass


_POLLERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[str, str], SharedPoller]]
_POLLERS = weakref.WeakKeyDictionary()


def shared_poller(handle: JobHandle, interval: float) -> SharedPoller:
    """The poller for this handle's connection in the running event loop (created on demand)."""
    loop = asyncio.get_running_loop()
    pollers = _POLLERS.setdefault(loop, {})
    key = (handle.backend, handle.connection)
    if key not in pollers:
        pollers[key] = SharedPoller(backend_for_handle(handle), interval)
    return pollers[key]


def pollers_in_this_loop() -> dict[tuple[str, str], SharedPoller]:
    return _POLLERS.get(asyncio.get_running_loop(), {})
