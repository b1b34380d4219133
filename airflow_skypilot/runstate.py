"""One operator run's state, typed: what travels through defer kwargs, the trigger and XCom.

:class:`RunState` is the operator's memory across deferrals (attempt number, attempts so far,
blocked places, failover and restart counters); :class:`Attempt` is one submitted job of it,
the record that the result, the log messages and the UI all show. The operator builds and
advances them, the trigger carries the state (opaque) and hands it back in its event, the sensor
reports its job as an :class:`Attempt`, and the UI plugin reads attempts from XCom and from a
deferred task's ``next_kwargs``.

``to_dict`` gives plain JSON. ``from_dict`` takes any earlier shape: missing keys get their
defaults and unknown keys are ignored, so state written by an older release (a task deferred
across an upgrade, an old run's XCom) still loads. This module uses the standard library only:
the UI plugin imports it in every Airflow process that loads plugins.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from airflow_skypilot.backends.base import JobHandle, JobStatus, Offer

#: the operator's XCom keys besides its return value: the job handle and the placement table
XCOM_HANDLE = "skypilot_handle"
XCOM_PLACEMENT = "skypilot_placement"
#: what the watch of the job saw: its state (pending, running) and the looks at it while it
#: waited (written by the trigger, or the worker when not deferrable; see ``watch_record``)
XCOM_WATCH = "skypilot_watch"
#: the old copies still to confirm dead at the last deferral: what a deferral's timeout, whose
#: resume gets no state back, still has to stop
XCOM_SWEEPS = "skypilot_sweeps"
#: looks at a waiting job kept in the run state (consecutive looks with one answer share one)
MAX_LOOKS = 8
#: one attempt as ``execute_complete``'s result lists it (README: ``attempts: [...]``)
RESULT_ATTEMPT_FIELDS = ("connection", "location", "job_id", "state", "reason", "exit_code",
                         "submitted_at", "started_at", "ended_at", "adopted", "confirmed_dead",
                         "gpus", "price_per_hour")
#: one attempt as the UI shows it (from the result, or from a deferred task's state)
UI_ATTEMPT_FIELDS = ("connection", "location", "job_id", "job_name", "state", "reason",
                     "exit_code", "submitted_at", "started_at", "ended_at", "adopted", "gpus",
                     "price_per_hour", "infra_failure", "confirmed_dead")


def _known(cls: type, data: Mapping[str, Any]) -> dict[str, Any]:
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in data.items() if k in names}


@dataclass(frozen=True)
class Blocked:
    """A place that failed during this run: ``connection/location`` (``connection/*``: all).

    A block lapses at ``until`` (``[skypilot] block_cooldown`` after the failure): a node comes
    back, a quota frees up, and a run that outlives the outage may go there again. A ``soft``
    one holds only while another place takes the job (EAGER_NEXT_REGION: SkyPilot launches
    elsewhere first, then retries everywhere; with nowhere else, the failed place at once).
    """

    place: str
    reason: str
    at: float = field(default_factory=time.time)
    until: float | None = None  # None: for the rest of the run
    soft: bool = False

    def active(self, now: float | None = None) -> bool:
        return self.until is None or (time.time() if now is None else now) < self.until

    def covers(self, offer: Offer) -> bool:
        """``conn/*`` covers the connection; ``conn/us-east-1/*`` every location under it."""
        conn, _, loc = self.place.partition("/")
        if conn != offer.connection:
            return False
        if loc.endswith("/*"):
            return offer.location.startswith(loc[:-1])
        return loc in ("*", offer.location)

    def describe(self) -> str:
        until = "" if self.until is None else \
            f", until {time.strftime('%H:%M', time.gmtime(self.until))}"
        return (f"blocked: {self.reason} at {time.strftime('%H:%M', time.gmtime(self.at))}{until}"
                + ("; taken when nothing else is" if self.soft else ""))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Blocked:
        return cls(place=data["place"], reason=data.get("reason", ""),
                   at=data.get("at") or time.time(), until=data.get("until"),
                   soft=bool(data.get("soft")))


@dataclass
class Sweep:
    """A copy of this task that may still run where its backend could not be asked.

    Made when an old copy could not be confirmed dead (its backend silent at a failover), when
    a submission was cut short (the job may exist), or when a connection could not be listed
    for the jobs of earlier tries. Whoever runs next (the operator, the trigger watching the
    new job, or a last trigger after the task's end) keeps cancelling until the backend answers
    that nothing of it is alive: a specific ``handle``, a ``job_name``, or every job under
    ``prefix`` but the one being watched.
    """

    connection: str
    reason: str
    handle: dict[str, Any] | None = None
    job_name: str = ""
    prefix: str = ""
    since: float = field(default_factory=time.time)
    done_at: float | None = None
    outcome: str = ""  # how it ended: "confirmed dead", "cancelled", "nothing there"...
    #: no new copy is submitted while this one is pending: a move's waiting copy whose
    #: cancel was not confirmed (it was healthy: it may start meanwhile), or a copy whose
    #: backend answers that it, or part of it, still runs
    before_next: bool = False
    #: ``before_next`` lapses after the operator's ``unreachable_timeout`` (a copy still
    #: stopping: a node's processes that do not die); a move's waiting copy's never does
    lapses: bool = False

    @property
    def what(self) -> str:
        if self.handle:
            return f"job {self.handle.get('job_id')} ({self.handle.get('job_name')})"
        return f"job {self.job_name}" if self.job_name else f"jobs {self.prefix}*"

    def describe(self) -> str:
        if self.done_at:
            state = f"confirmed at {time.strftime('%H:%M:%S', time.gmtime(self.done_at))}: " \
                f"{self.outcome}"
        else:
            state = "NOT confirmed dead" if self.handle or self.job_name else "not checked"
        return f"{self.connection} {self.what}: {self.reason}; {state}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Sweep:
        return cls(**_known(cls, data))


@dataclass
class Attempt:
    """One submitted job of a run, from submission to its end."""

    connection: str = ""
    location: str = ""
    infra: str = ""
    backend: str = ""
    job_id: str = ""
    job_name: str = ""
    state: str = "pending"  # a JobState value, or "moved" (a waiting copy moved elsewhere)
    reason: str = ""
    exit_code: int | None = None
    exit_codes: list[int] = field(default_factory=list)  # every failed rank's, where known
    submitted_at: float | None = None
    started_at: float | None = None
    ended_at: float | None = None
    gpus: float = 0  # GPUs of the whole job (per node x nodes)
    price_per_hour: float = 0.0
    adopted: bool = False  # an earlier run of this try (or an earlier try) submitted it
    infra_failure: bool = False  # ended because the place failed, not the program
    #: for a copy that had to be stopped (its place failed): True once its backend confirmed
    #: it dead, False while that could not be confirmed (a sweep keeps trying), None: n/a
    confirmed_dead: bool | None = None

    @property
    def place(self) -> str:
        """Where a failure is remembered (``placement.Offer.place_key``)."""
        return f"{self.connection}/{self.location}"

    @classmethod
    def from_handle(cls, handle: JobHandle) -> Attempt:
        return cls(connection=handle.connection, location=handle.location, infra=handle.infra,
                   backend=handle.backend, job_id=handle.job_id, job_name=handle.job_name,
                   submitted_at=handle.submitted_at,
                   gpus=handle.gpus_per_node * handle.num_nodes,
                   price_per_hour=handle.price_per_hour, adopted=handle.adopted)

    def is_job(self, handle: JobHandle) -> bool:
        return self.job_id == handle.job_id and self.connection == handle.connection

    def close(self, status: JobStatus, now: float | None = None) -> None:
        """Record how the job ended."""
        self.state = status.state.value
        self.reason = status.reason
        self.exit_code = status.exit_code
        self.exit_codes = list(status.exit_codes)
        self.started_at = status.started_at
        self.ended_at = status.ended_at or (time.time() if now is None else now)
        self.infra_failure = bool(status.state.infra_failure)

    def hours(self, now: float | None = None) -> float:
        """Wall-clock hours on the allocation (from the start, else from the submission); a
        queued copy moved away before it started held none (an instance launching did)."""
        if self.state == "moved" and not self.started_at and self.backend != "aws":
            return 0.0
        start = self.started_at or self.submitted_at
        if not start:
            return 0.0
        end = self.ended_at or (time.time() if now is None else now)
        return max(0.0, (end - start) / 3600)

    def describe(self) -> str:
        return (f"{self.connection}/{self.location} job {self.job_id}: {self.state} "
                f"{self.reason or ''}")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "place": self.place}

    def to_result(self) -> dict[str, Any]:
        """This attempt as the operator's result lists it."""
        data = self.to_dict()
        return {k: data[k] for k in RESULT_ATTEMPT_FIELDS}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Attempt:
        return cls(**_known(cls, data))

    @staticmethod
    def ui_view(data: Mapping[str, Any]) -> dict[str, Any]:
        """An attempt as the UI shows it, from any shape XCom holds (absent fields: None)."""
        return {k: data.get(k) for k in UI_ATTEMPT_FIELDS}


@dataclass
class Look:
    """Looks again at a job waiting in a queue (``rebalance``): where it waited, its
    estimated start there, the best other place and why it stayed (or moved).

    Consecutive looks with the same answer (same place, outcome and best other place) share
    one record: ``count`` of them from ``first_at`` to ``last_at``, the numbers of the last.
    A run state keeps the last :data:`MAX_LOOKS` records and counts them all (``looks_total``),
    so it stays small however long a job waits: it travels in trigger kwargs.
    """

    first_at: float = 0.0
    last_at: float = 0.0
    count: int = 1
    place: str = ""  # connection/location where it waits
    est_start: float | None = None  # its estimated start there (epoch; None: unknown)
    price_per_hour: float | None = None
    best: str = ""  # the best other place (connection/location), "" if none could take it
    best_start: float | None = None  # when that place could start it (epoch; now if free)
    best_price_per_hour: float | None = None
    outcome: str = "stayed"  # stayed | moved | no look (the place could not be probed)
    why: str = ""

    def same_answer(self, other: Look) -> bool:
        return (self.place, self.outcome, self.best) == (other.place, other.outcome, other.best)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Look:
        return cls(**_known(cls, data))


def add_look(state: dict[str, Any], look: Look) -> dict[str, Any]:
    """Record ``look`` in a run state's dict (in place: the trigger holds the state as its
    dict): merged into the last record when it gives the same answer, else appended, the
    oldest records dropped past :data:`MAX_LOOKS`. Returns the record it went into."""
    looks = state.setdefault("looks", [])
    state["looks_total"] = int(state.get("looks_total") or 0) + 1
    last = Look.from_dict(looks[-1]) if looks and isinstance(looks[-1], Mapping) else None
    if last is not None and last.same_answer(look):
        merged = Look(**{**look.to_dict(), "first_at": last.first_at,
                         "count": last.count + look.count})
        looks[-1] = merged.to_dict()
        return looks[-1]
    looks.append(look.to_dict())
    del looks[:-MAX_LOOKS]
    return looks[-1]


def watch_record(state: Mapping[str, Any] | None, handle: Mapping[str, Any], job_state: str,
                 seen_at: float, started_at: float | None = None,
                 est_start: float | None = None, log_offset: int = 0) -> dict[str, Any]:
    """The ``skypilot_watch`` XCom: the watched job, the state it was last seen in and since
    when, the looks at it while it waited (from the run state), and the bytes of its output
    streamed into the task log."""
    state = state or {}
    return {"job_id": handle.get("job_id"), "connection": handle.get("connection"),
            "location": handle.get("location"), "state": job_state, "seen_at": seen_at,
            "started_at": started_at, "est_start": est_start,
            "looks_total": int(state.get("looks_total") or 0),
            "looks": list(state.get("looks") or []), "log_offset": log_offset}


@dataclass
class RunState:
    """Where a run stands between deferrals; the failover rule (``recovery``) advances it."""

    prefix: str = ""  # every job name of this task instance starts with it (identity.py)
    task_env_id: str = ""  # SKYPILOT_TASK_ID: the same for every try and failover
    clear: int = 0  # the DagRun's clear number when this try started
    try_number: int = 1
    attempt: int = 0  # number of the attempt being placed or watched
    attempts: list[Attempt] = field(default_factory=list)
    blocked: list[Blocked] = field(default_factory=list)
    failovers: int = 0  # placements again after infrastructure failures
    moves: int = 0  # waiting copies moved to a place that could start them sooner
    restarts: int = 0  # restarts counted against max_restarts_on_errors
    code_restarts: int = 0  # restarts for recover_on_exit_codes
    prefer: str | None = None  # the place to try first on the next placement
    avoid: str | None = None  # the place (or ``conn/region/*``) to try last on it
    log_offset: int = 0  # bytes of the current job's log already shown
    started_at: float = field(default_factory=time.time)
    waiting_since: float | None = None  # first time nothing could take the job
    last_plan: str = ""  # the summary of the last placement that chose nothing
    sweeps: list[Sweep] = field(default_factory=list)  # copies still to confirm dead
    places: list[str] = field(default_factory=list)  # where the task fit at the last placement
    #: ``@task.skypilot``: a digest of the task its function returned at this try's first call
    #: (it is called again after a deferral; a different answer is reported)
    spec_digest: str = ""
    #: the last looks at a waiting job (:class:`Look`; at most :data:`MAX_LOOKS` records)
    looks: list[Look] = field(default_factory=list)
    looks_total: int = 0  # every look, the merged and dropped ones too

    def note_look(self, look: Look) -> None:
        """Record a look (see :func:`add_look`)."""
        data = {"looks": [x.to_dict() for x in self.looks], "looks_total": self.looks_total}
        add_look(data, look)
        self.looks = [Look.from_dict(x) for x in data["looks"]]
        self.looks_total = data["looks_total"]

    @property
    def job_name(self) -> str:
        """The deterministic name of the attempt being placed (``identity.TaskKey``)."""
        return f"{self.prefix}c{self.clear}-t{self.try_number}-a{self.attempt}"

    @property
    def pending_sweeps(self) -> list[Sweep]:
        return [s for s in self.sweeps if s.done_at is None]

    @property
    def pending_copies(self) -> list[Sweep]:
        """Pending sweeps of a known copy (a job, or a job name that may exist), as opposed to
        a precaution (a connection that could not be listed for earlier tries' jobs)."""
        return [s for s in self.pending_sweeps if s.handle or s.job_name]

    def record(self, handle: JobHandle) -> Attempt:
        """A job was submitted (or adopted): a new attempt, its log read from the start."""
        attempt = Attempt.from_handle(handle)
        self.attempts.append(attempt)
        self.log_offset = 0
        return attempt

    def close(self, handle: JobHandle, status: JobStatus, now: float | None = None) -> Attempt:
        """The job ended: its attempt (recorded now if this state never saw it), closed."""
        attempt = next((a for a in reversed(self.attempts) if a.is_job(handle)), None)
        if attempt is None:
            attempt = self.record(handle)
        attempt.close(status, now)
        return attempt

    def sweeps_text(self) -> str:
        """Every old copy and whether it was confirmed dead ("" when there were none)."""
        if not self.sweeps:
            return ""
        return "\nOld copies:\n" + "\n".join(f"  {w.describe()}" for w in self.sweeps)

    def attempts_text(self) -> str:
        return "\n".join(f"  attempt {i + 1}: {a.describe()}"
                         for i, a in enumerate(self.attempts))

    def result(self, final: Attempt, now: float | None = None) -> dict[str, Any]:
        """The operator's return value (README): where it ran, every attempt, GPU-hours, cost."""
        now = time.time() if now is None else now
        gpu_hours = sum(a.hours(now) * (a.gpus or 0) for a in self.attempts)
        cost = sum(a.hours(now) * (a.price_per_hour or 0) for a in self.attempts)
        return {
            "state": "succeeded",
            "connection": final.connection,
            "location": final.location,
            "infra": final.infra,
            "backend": final.backend,
            "job_id": final.job_id,
            "job_name": final.job_name,
            "task_id": self.task_env_id,
            "attempts": [a.to_result() for a in self.attempts],
            "old_copies": [{"connection": w.connection, "what": w.what, "reason": w.reason,
                            "confirmed_dead": w.done_at is not None,
                            "outcome": w.outcome or ("" if w.handle or w.job_name
                                                     else "not checked")}
                           for w in self.sweeps],
            "gpu_hours": round(gpu_hours, 6),
            "cost": round(cost, 6),
        }

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["attempts"] = [a.to_dict() for a in self.attempts]
        data["blocked"] = [b.to_dict() for b in self.blocked]
        data["sweeps"] = [w.to_dict() for w in self.sweeps]
        data["looks"] = [x.to_dict() for x in self.looks]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> RunState:
        data = dict(data or {})
        attempts: Sequence[Any] = data.pop("attempts", None) or []
        blocked: Sequence[Any] = data.pop("blocked", None) or []
        sweeps: Sequence[Any] = data.pop("sweeps", None) or []
        looks: Sequence[Any] = data.pop("looks", None) or []
        state = cls(**_known(cls, data))
        state.looks = [Look.from_dict(x) for x in looks if isinstance(x, Mapping)]
        state.sweeps = [Sweep.from_dict(w) for w in sweeps
                        if isinstance(w, Mapping) and w.get("connection")]
        state.attempts = [Attempt.from_dict(a) for a in attempts if isinstance(a, Mapping)]
        state.blocked = [Blocked.from_dict(b) for b in blocked
                         if isinstance(b, Mapping) and b.get("place")]
        return state


#: the result's fields an asset event's extra carries (``asset_extra``)
ASSET_EXTRA_FIELDS = ("state", "connection", "location", "infra", "backend", "job_id",
                      "job_name", "gpu_hours", "cost")


def asset_extra(result: Mapping[str, Any]) -> dict[str, Any]:
    """Where and how a task's job ran, for the asset events of its outlets: from the operator's
    result (or, not waiting for the job, its handle). ``skypilot_task_id`` is the job's
    ``SKYPILOT_TASK_ID`` (its checkpoint key); ``attempts``, how many jobs it took."""
    extra = {k: result[k] for k in ASSET_EXTRA_FIELDS if result.get(k) is not None}
    if result.get("task_id"):
        extra["skypilot_task_id"] = result["task_id"]
    if isinstance(result.get("attempts"), list):
        extra["attempts"] = len(result["attempts"])
        extra["places"] = [f"{a.get('connection')}/{a.get('location')}"
                           for a in result["attempts"] if isinstance(a, Mapping)]
    return extra
