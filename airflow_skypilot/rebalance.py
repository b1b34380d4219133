"""Looking again at a job that waits in a queue: should it move to a place that starts sooner?

The trigger watching a pending job asks :func:`adecide` every ``interval`` seconds. It probes
the connections again (only the places where the task fit when it was placed: the shape does
not change), takes the job's own place as just re-probed as ``current`` (with the job's own
start estimate where the backend gives one), and leaves the decision to the pure
``placement.reconsider``. The trigger never submits: a move is an event, and the operator
cancels the waiting copy, confirms it never started, and submits at the new place.

Every look is recorded, moved or not: :func:`adecide` answers with a :class:`Decision`, whose
``look`` (a :class:`~airflow_skypilot.runstate.Look`: where the job waits, its estimated start,
the best other place and why it stayed) goes into the run state's last looks and the
``skypilot_watch`` XCom, for the job page.

Probes are shared: every waiting job of one shape on one connection, in one triggerer, reads one
probe per ``interval`` (the cache below), as status polls are shared per connection. A probe
blocks (a Slurm login node may take minutes to answer), so it runs in this module's own small
pool of threads, never the event loop's default executor, which the triggerer needs for every
trigger (logging, ``on_kill``, the sweeps); the looks that come while a probe is under way await
it on their event loop and hold no thread.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from airflow_skypilot import placement
from airflow_skypilot.backends.base import JobHandle, JobStatus, Offer
from airflow_skypilot.runstate import Blocked, Look
from airflow_skypilot.spec.task import Task


@dataclass
class ReconsiderSpec:
    """What the trigger needs to reconsider a waiting job (plain JSON, no secrets)."""

    connections: list[str]
    task: dict[str, Any]  # Task.capacity_view()
    policy: str = "fastest"
    places: list[str] = field(default_factory=list)  # where the task fit at placement
    interval: float = 60.0
    moves: int = 0
    max_moves: int = placement.MAX_MOVES
    paid_min_wait: float = placement.PAID_MOVE_MIN_WAIT_S
    blocked: list[dict[str, Any]] = field(default_factory=list)
    probe_timeout: float = 60.0
    waiting_since: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ReconsiderSpec:
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


_lock = threading.Lock()
#: (connection, shape key) -> (probed at, offers or the error): one probe per interval
_cache: dict[tuple[str, str], tuple[float, Any]] = {}
#: probes under way: the looks that come meanwhile, on any event loop, await them instead of
#: probing again
_inflight: dict[tuple[str, str], Future] = {}
#: threads probing at once, all connections and shapes together (each holds one probe)
PROBE_THREADS = 8
_pool: ThreadPoolExecutor | None = None


def _probe_pool() -> ThreadPoolExecutor:
    """The probes' own threads (made at the first probe): a slow connection fills these, not
    the default executor of the event loop."""
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(PROBE_THREADS, thread_name_prefix="skypilot-probe")
        return _pool


def _forget_after_fork() -> None:
    """A forked child has none of the parent's threads: it makes its own pool and probes."""
    global _lock, _pool
    _lock, _pool = threading.Lock(), None
    _inflight.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


def _probe_now(conn_id: str, task: Task, k: tuple[str, str]) -> Any:
    """One probe, in a thread of the pool: the offers, or the error (returned, not raised)."""
    from airflow_skypilot.backends.registry import backend_for_connection

    try:
        offers: Any = backend_for_connection(conn_id).probe(task)
    except Exception as exc:  # cached too: N waiting jobs do not retry a dead backend N times
        offers = exc
    except BaseException:
        with _lock:
            _inflight.pop(k, None)
        raise
    with _lock:
        _cache[k] = (time.monotonic(), offers)
        _inflight.pop(k, None)
    return offers


def _forget(k: tuple[str, str], done: Future) -> None:
    """A probe that never ran (cancelled) is no longer under way."""
    with _lock:
        if _inflight.get(k) is done:
            del _inflight[k]


def _on_loop(running: Future) -> asyncio.Future:
    """A future of the running event loop that settles with the probe under way: awaiting it
    holds no thread, and a look that gives up (its timeout) leaves the probe to the others."""
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()

    def settle(done: Future) -> None:
        if waiter.done():  # the look gave up meanwhile
            return
        if done.cancelled():  # never ran (the pool shut down)
            waiter.set_exception(RuntimeError("the probe was cancelled"))
        elif done.exception() is not None:
            waiter.set_exception(done.exception())
        else:
            waiter.set_result(done.result())

    def wake(done: Future) -> None:
        try:
            loop.call_soon_threadsafe(settle, done)
        except RuntimeError:  # that event loop is closed: no look waits there any more
            pass

    running.add_done_callback(wake)
    return waiter


async def _probe(conn_id: str, task: Task, key: str, max_age: float) -> list[Offer]:
    """The offers of ``conn_id`` for the task: from the cache when younger than ``max_age``,
    else from the probe under way for it, else from a new probe in the pool."""
    k = (conn_id, key)
    pool = _probe_pool()
    running: Future | None = None
    with _lock:  # submitted under the lock: the probe cannot end before it is under way here
        hit = _cache.get(k)
        if hit is None or time.monotonic() - hit[0] >= max_age:
            running = _inflight.get(k)
            if running is None:
                running = _inflight[k] = pool.submit(_probe_now, conn_id, task, k)
                running.add_done_callback(lambda done: _forget(k, done))
    offers = hit[1] if running is None else await _on_loop(running)
    if isinstance(offers, Exception):
        raise offers
    return offers


def _current(offers: list[Offer], handle: JobHandle, status: JobStatus) -> Offer | None:
    """The job's own place as just re-probed, with the job's own estimate when known."""
    at_place = [o for o in offers if o.place_key == f"{handle.connection}/{handle.location}"]
    same_acc = [o for o in at_place
                if (o.accelerator or "").upper() == (handle.accelerator or "").upper()]
    # two candidates of one accelerator (A100:8, else A100:4) share a place: the job's count
    here = [o for o in same_acc if o.gpus_per_node == handle.gpus_per_node
            and o.num_nodes == handle.num_nodes] or same_acc or at_place
    if not here:
        return None
    current = min(here, key=lambda o: o.request.index)
    if status.est_start is not None:
        # the queue position of this very job, not of a new job of its shape
        current = replace(current, est_start=status.est_start,
                          nodes_free=0 if current.nodes_free is not None else None)
    return current


@dataclass
class Decision:
    """A look at a waiting job: where to move it (None: it stays) and what the look saw."""

    move_to: Offer | None
    look: Look


def look_of(verdict: placement.Reconsideration, current: Offer | None, handle: JobHandle,
            at: float) -> Look:
    """The record of one look (see :class:`~airflow_skypilot.runstate.Look`)."""
    best = verdict.move_to or verdict.best
    return Look(
        first_at=at, last_at=at, place=f"{handle.connection}/{handle.location}",
        est_start=current.est_start if current is not None else None,
        price_per_hour=current.price_per_hour if current is not None else None,
        best=best.place_key if best is not None else "",
        best_start=(at if best.free_now else best.est_start) if best is not None else None,
        best_price_per_hour=best.price_per_hour if best is not None else None,
        outcome="moved" if verdict.move_to is not None else "stayed", why=verdict.why)


async def adecide(spec: ReconsiderSpec, handle: JobHandle, status: JobStatus) -> Decision:
    """Whether to move the waiting job (see ``placement.judge``), and the look's record.
    Connections that cannot be asked now are left out of this round."""
    at = time.time()
    if spec.moves >= spec.max_moves:
        return Decision(None, look_of(placement.Reconsideration(
            None, None, f"moved {spec.moves} time(s) already (max_moves {spec.max_moves})"),
            None, handle, at))
    task = Task.from_capacity_view(spec.task)
    key = hashlib.sha256(json.dumps(spec.task, sort_keys=True).encode()).hexdigest()[:16]
    calls = [asyncio.wait_for(_probe(c, task, key, spec.interval / 2), spec.probe_timeout)
             for c in spec.connections]
    results = await asyncio.gather(*calls, return_exceptions=True)
    offers = [o for r in results if isinstance(r, list) for o in r]
    current = _current(offers, handle, status)
    if current is None:
        failed = [c for c, r in zip(spec.connections, results, strict=True)
                  if not isinstance(r, list)]
        why = (f"{handle.connection} could not be probed" if handle.connection in failed
               else f"{handle.connection}/{handle.location} was not in the probe")
        look = look_of(placement.Reconsideration(None, None, why), None, handle, at)
        look.outcome = "no look"
        return Decision(None, look)
    places = set(spec.places)
    others = [o for o in offers if o.place_key in places]
    verdict = placement.judge(
        current, others, spec.policy, ordered=bool(spec.task.get("ordered")),
        blocked=[Blocked.from_dict(b) for b in spec.blocked],
        waited_s=max(0.0, time.time() - spec.waiting_since), moves=spec.moves,
        max_moves=spec.max_moves, paid_min_wait=spec.paid_min_wait)
    return Decision(verdict.move_to, look_of(verdict, current, handle, at))


def decide(spec: ReconsiderSpec, handle: JobHandle, status: JobStatus) -> Decision:
    """:func:`adecide` from the worker (no event loop running there)."""
    return asyncio.run(adecide(spec, handle, status))
