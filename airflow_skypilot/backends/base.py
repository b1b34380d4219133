"""The protocol every backend implements, and the plain types that cross it.

A backend is one kind of place a job can run (a Slurm cluster over SSH, a Kubernetes cluster,
an AWS account). Each is one module behind :class:`Backend`; the operator, trigger and placement
only see :class:`Offer`, :class:`JobHandle` and :class:`JobStatus`, so adding a backend never
touches them. Handles and statuses are JSON-serialisable: they travel through triggers and XCom.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar

from airflow.utils.log.logging_mixin import LoggingMixin

from airflow_skypilot.backends.common.features import Feature, unsupported_reason
from airflow_skypilot.backends.common.logs import join_logs
from airflow_skypilot.spec.task import ResourceRequest, request_from_json

if TYPE_CHECKING:
    from airflow_skypilot.spec.task import Task


class JobState(str, Enum):
    """Where a job is. The infra/user split follows SkyPilot: allocation gone -> infra."""

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"  # the user's program exited non-zero; the allocation was fine
    PREEMPTED = "preempted"  # spot reclaimed, or preempted by a higher priority job
    INFRA_FAILED = "infra_failed"  # node failure, boot failure, eviction, node lost
    CANCELLED = "cancelled"
    LOST = "lost"  # the backend positively no longer knows the job, or was silent for long
    UNKNOWN = "unknown"  # the backend could not be asked: the job may well still run

    @property
    def terminal(self) -> bool:
        return self not in (JobState.PENDING, JobState.RUNNING, JobState.UNKNOWN)

    @property
    def infra_failure(self) -> bool:
        """Failures of the place, not of the program: the job should be placed again."""
        return self in (JobState.PREEMPTED, JobState.INFRA_FAILED, JobState.LOST)


#: ``raw_state`` of a LOST concluded from silence (no backend said the job ended)
SILENCE = "(no answer)"
#: bytes of a job's output read for the tail quoted when it fails
TAIL_BYTES = 32768
#: reads the default :meth:`Backend.read_tail` follows (a longer log: the end of that part)
DEFAULT_TAIL_READS = 8


def tail_text(ends: list[tuple[int, bytes, bool]], max_bytes: int = TAIL_BYTES) -> str:
    """The end of a job's text (as :meth:`Backend.read_log` gives it) from the ends of its
    ranks' logs: ``(rank, the end of its log, whether that is all of it)``, rank order (a
    job of one node, or whose text is still rank 0's alone, has one). At most ``max_bytes``
    bytes, whole lines when the start was cut, never half a UTF-8 character.

    The other ranks follow rank 0 in the text, each line prefixed, so the end of the text is
    the last rank's end, then the one before... A rank read only in part ends what is before
    it: the ranks before it would not join up with it.
    """
    kept: list[tuple[int, bytes]] = []
    cut = False
    for rank, data, whole in reversed(ends):
        kept.insert(0, (rank, data))
        if not whole:
            cut = True
            break
    if kept and kept[0][0] != 0:  # no rank 0 in it: no unprefixed part
        kept.insert(0, (0, b""))
    data = join_logs(kept, True)
    if len(data) > max_bytes:  # cut inside a line unless the byte before the cut ends one
        data, cut = data[-max_bytes:], data[-max_bytes - 1] != ord("\n")
    newline = data.find(b"\n")
    if cut and 0 <= newline < len(data) - 1:  # a line cut at its start is not shown
        data = data[newline + 1:]
    while data and data[0] & 0xC0 == 0x80:  # a character cut at the start
        data = data[1:]
    return data.decode("utf-8", "replace")


@dataclass
class JobStatus:
    """One observation of a job."""

    state: JobState
    reason: str = ""
    exit_code: int | None = None
    started_at: float | None = None
    ended_at: float | None = None
    nodes: list[str] = field(default_factory=list)
    raw_state: str = ""
    #: a pending job's own estimated start (epoch seconds), where the backend knows it
    est_start: float | None = None
    #: an ended job whose allocation is still (partly) up (AWS: a rank's instance still
    #: running beside a lost one; Kubernetes: a pod that has not ended): stopping it still
    #: takes a cancel
    still_up: bool = False
    #: every failed rank's exit code, where the backend reads them all (``exit_code`` is the
    #: one the reason names): SkyPilot restarts when any is in ``recover_on_exit_codes``
    exit_codes: list[int] = field(default_factory=list)

    @property
    def up(self) -> bool:
        """Anything of it still up: not ended, or ended with part of its allocation running."""
        return not self.state.terminal or self.still_up

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["state"] = self.state.value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> JobStatus:
        data = dict(data)
        data["state"] = JobState(data["state"])
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})

    @classmethod
    def silent(cls, connection: str, seconds: float, why: str) -> JobStatus:
        """LOST concluded from ``seconds`` without an answer (``unreachable_timeout``): no
        backend said the job ended, so a retry may still find it (``raw_state`` SILENCE)."""
        return cls(JobState.LOST, raw_state=SILENCE, reason=(
            f"no answer about the job from {connection} for {seconds:.0f}s "
            f"(unreachable_timeout): {why}"))


@dataclass
class JobHandle:
    """Everything needed to find a submitted job again, from any process."""

    backend: str
    connection: str
    job_id: str
    job_name: str
    location: str
    infra: str
    num_nodes: int = 1
    accelerator: str | None = None
    gpus_per_node: float = 0
    price_per_hour: float = 0.0
    submitted_at: float = field(default_factory=time.time)
    adopted: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        """Unique across backends: ``connection:job_id``."""
        return f"{self.connection}:{self.job_id}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> JobHandle:
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


def id_rounds(handles: Iterable[JobHandle]) -> list[list[JobHandle]]:
    """``handles`` (one per job id and name) in rounds of distinct job ids: a status answer
    is keyed by job id, and two jobs may share one (Slurm gives an id again after a state
    loss: an old job's handle and the new job's), each to be asked in a request of its own."""
    rounds: list[list[JobHandle]] = []
    for handle in {(h.job_id, h.job_name): h for h in handles}.values():
        free = next((r for r in rounds if all(h.job_id != handle.job_id for h in r)), None)
        if free is None:
            rounds.append(free := [])
        free.append(handle)
    return rounds


def job_key(handle: JobHandle) -> tuple[str, str]:
    """What tells two jobs apart where a status answer's job id may not (see id_rounds)."""
    return handle.job_id, handle.job_name


def statuses_apart(backend: Backend, handles: Iterable[JobHandle]
                   ) -> dict[tuple[str, str], JobStatus]:
    """``backend.status`` of ``handles``, by :func:`job_key`: one request, or one per
    :func:`id_rounds` round when jobs share an id. A job the backend left out is left out."""
    out: dict[tuple[str, str], JobStatus] = {}
    for group in id_rounds(handles):
        answer = backend.status(group)
        out.update({job_key(h): answer[h.job_id] for h in group if h.job_id in answer})
    return out


async def astatuses_apart(backend: Backend, handles: Iterable[JobHandle]
                          ) -> dict[tuple[str, str], JobStatus]:
    """:func:`statuses_apart` with ``backend.astatus``."""
    out: dict[tuple[str, str], JobStatus] = {}
    for group in id_rounds(handles):
        answer = await backend.astatus(group)
        out.update({job_key(h): answer[h.job_id] for h in group if h.job_id in answer})
    return out


@dataclass
class Offer:
    """One candidate resource request at one location of one connection, with live capacity.

    ``nodes_free`` is how many nodes could take one node's share of the job right now: free
    for a *new* job, so what the jobs ahead of it will take first (backfill reservations, jobs
    and pods submitted moments ago, instances still launching) is not counted free.
    ``est_start`` is when the backend expects the job could start (epoch seconds). ``None``
    means unknown, and that is deliberate: ranking puts an unknown start after every known
    one (``placement._key``: ``math.inf``), the table shows "unknown", and
    ``details["estimate"]`` says ``"unknown"`` (or how the estimate was made). ``fits`` is
    False when the job can never run here (shape, type, limits), and then ``reason`` says why.

    ``details`` keys the backends share: ``estimate`` (how ``est_start`` was made, or
    ``"unknown"``), ``reserved_by_pending`` (GPUs, or vCPUs on AWS, that work submitted ahead
    of this job will take first), ``gpu_place`` (a CPU-only candidate whose place would be GPU
    nodes), ``gpus_wasted`` (GPUs billed but not asked for: a larger instance). ``notes`` are
    short phrases for the placement table's "why" column, in the backend's words.
    """

    connection: str
    backend: str
    location: str
    infra: str
    request: ResourceRequest
    num_nodes: int = 1
    fits: bool = True
    reason: str = ""
    accelerator: str | None = None
    gpus_per_node: float = 0
    gpus_total: int | None = None
    gpus_free: int | None = None
    nodes_total: int | None = None
    nodes_free: int | None = None
    pending_jobs: int | None = None
    est_start: float | None = None
    price_per_hour: float = 0.0
    spot: bool = False
    instance_type: str | None = None
    details: dict[str, Any] = field(default_factory=dict)
    probed_at: float = field(default_factory=time.time)
    #: the place keys of other places whose capacity overlaps this one's (Slurm partitions
    #: sharing nodes): a placement made moments ago there takes room here too (``ledger.hold``)
    shares_capacity_with: list[str] = field(default_factory=list)
    #: phrases for the placement table's "why": how the estimate was made, idle GPUs held
    #: for jobs ahead, the GPUs a larger instance wastes...
    notes: list[str] = field(default_factory=list)
    #: names of the connection's live jobs (of its user) that the probe listed before it read
    #: the capacity: a placement made moments ago whose job is among them is already in that
    #: capacity (``ledger.hold``). None: the backend lists none. Not serialized.
    jobs_seen: frozenset[str] | None = field(default=None, repr=False, compare=False)

    @property
    def free_now(self) -> bool:
        """Can the whole job start now (every node's share is free)?"""
        if not self.fits:
            return False
        if self.nodes_free is not None:
            return self.nodes_free >= self.num_nodes
        return self.est_start is not None and self.est_start <= self.probed_at + 5

    @property
    def wait_seconds(self) -> float | None:
        if self.free_now:
            return 0.0
        if self.est_start is None:
            return None
        return max(0.0, self.est_start - self.probed_at)

    @property
    def place_key(self) -> str:
        """Where a failure is remembered: ``connection/location``."""
        return f"{self.connection}/{self.location}"

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        del out["jobs_seen"]
        out["request"] = {"index": self.request.index, **self.request.to_json()}
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Offer:
        data = dict(data)
        data["request"] = request_from_json(data["request"])
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


@dataclass
class CapacityRow:
    """One row of ``show-gpus``: (connection, location, accelerator) with live counts."""

    connection: str
    location: str
    accelerator: str | None
    total: int | None = None
    free: int | None = None
    pending: int | None = None
    price_per_hour: float | None = None
    error: str | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "connection": self.connection, "location": self.location,
            "accelerator": self.accelerator, "total": self.total, "free": self.free,
            "pending": self.pending, "price_per_hour": self.price_per_hour,
        }
        if self.error is not None:
            out["error"] = self.error
        if self.details:
            out["details"] = self.details
        return out


class Backend(LoggingMixin, ABC):
    """One kind of place to run jobs. Sync methods run in the worker; ``astatus`` and
    ``aread_log`` run in the triggerer's event loop and must not block it."""

    #: short name used in handles and infra strings: ``slurm``, ``kubernetes``, ``aws``
    name: ClassVar[str]
    #: Airflow connection types served by this backend
    conn_types: ClassVar[tuple[str, ...]] = ()
    #: task features this backend cannot provide, each with the reason shown in the placement
    #: table (cf. SkyPilot's ``_CLOUD_UNSUPPORTED_FEATURES``)
    unsupported_features: ClassVar[Mapping[Feature, str]] = {}

    def __init__(self, conn_id: str):
        super().__init__()
        self.conn_id = conn_id

    def unsupported(self, task: Task, req: ResourceRequest) -> str:
        """Why this backend can never run candidate ``req`` ("" when it might): the declared
        unsupported features. Backends extend it only for checks no feature expresses."""
        return unsupported_reason(self.unsupported_features, task, req)

    # --- placement ------------------------------------------------------------------------
    @abstractmethod
    def probe(self, task: Task) -> list[Offer]:
        """Offers for every candidate of ``task`` at every location, from live capacity.

        One round trip per connection where the backend allows it. Raises
        :class:`~airflow_skypilot.exceptions.BackendUnreachable` when the backend cannot be
        reached; offers that cannot fit come back with ``fits=False`` and a reason.
        """

    @abstractmethod
    def capacity(self) -> list[CapacityRow]:
        """Live GPU capacity per location and accelerator (``show-gpus``)."""

    # --- jobs -----------------------------------------------------------------------------
    @abstractmethod
    def submit(self, task: Task, offer: Offer, job_name: str, env: Mapping[str, str]) -> JobHandle:
        """Submit ``task`` at ``offer``. Idempotent: an existing job named ``job_name`` is
        adopted (``handle.adopted``), never submitted twice."""

    @abstractmethod
    def find(self, job_name: str) -> JobHandle | None:
        """The job submitted earlier under ``job_name``, if the backend still knows it."""

    @abstractmethod
    def find_all(self, prefix: str) -> list[JobHandle]:
        """Every job of this connection whose name starts with ``prefix`` that the backend
        still knows (running or finished), each with its original ``submitted_at``.

        One request (or one per location) however many jobs: every new try of a task lists
        the jobs of the tries before it this way (``identity.classify``). Raises
        BackendUnreachable when the backend cannot be asked: "could not ask" is never "none".
        """

    @abstractmethod
    def cancel(self, handle: JobHandle) -> None:
        """Stop the job and release everything it holds (its secrets too). Safe to call twice.
        The job then reads ``CANCELLED`` (not ``LOST``: that is an infrastructure failure)."""

    async def aprepare(self) -> None:
        """Read the Airflow connection off the event loop, once, before the first poll.

        Backends read their connection with the sync SDK call. In the triggerer that call must
        not run on the event loop thread (only a trigger's own task may block on it there, and
        only through greenback), so the shared poller calls this first: in a worker thread the
        SDK reaches the triggerer's supervisor the normal way.
        """
        import asyncio

        if hasattr(type(self), "settings"):
            await asyncio.to_thread(getattr, self, "settings")

    @abstractmethod
    async def astatus(self, handles: list[JobHandle]) -> dict[str, JobStatus]:
        """Status of many jobs on this connection in one request; keyed by ``handle.job_id``.

        ``LOST`` only on the backend's positive word: the query succeeded and the job is in
        neither its answer nor its records of finished jobs. A job the query could not speak
        for is ``UNKNOWN``. A success has exit code 0; a terminal status carries when the job
        ended as the backend recorded it (the same on every poll). Raises BackendUnreachable
        when the backend cannot be asked at all (the caller measures how long it stays
        silent)."""

    def status(self, handles: list[JobHandle]) -> dict[str, JobStatus]:
        """Sync wrapper of :meth:`astatus` for the worker side, callable from any thread: one
        without an event loop (the worker, a thread of ``asyncio.to_thread`` such as the
        triggerer's sweeps) runs it on a loop of its own; a thread whose loop is running (a
        sync call from a coroutine) waits for it on a helper thread's loop instead of failing.
        Each call has a fresh loop: a backend that keeps loop-bound clients between calls
        overrides this."""
        import asyncio

        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.astatus(handles))
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="backend-status") as pool:
            return pool.submit(asyncio.run, self.astatus(handles)).result()

    @abstractmethod
    def read_log(self, handle: JobHandle, offset: int = 0) -> tuple[str, int]:
        """Job output from byte ``offset``; returns (text, next offset)."""

    async def aread_log(self, handle: JobHandle, offset: int = 0) -> tuple[str, int]:
        import asyncio

        return await asyncio.to_thread(self.read_log, handle, offset)

    def read_tail(self, handle: JobHandle, max_bytes: int = TAIL_BYTES) -> str:
        """The end of the job's output (at most ``max_bytes`` bytes, whole lines where its
        start is cut): what a failure quotes. Reading from an offset cannot give it: a read
        returns at most its limit (about 1 MiB) from there, and a job not streamed has no
        offset near its end. Backends override it to read only the end; this default reads
        the first :data:`DEFAULT_TAIL_READS` reads' worth and keeps the end of that."""
        data, offset = b"", 0
        for _ in range(DEFAULT_TAIL_READS):
            text, nxt = self.read_log(handle, offset)
            if nxt == offset:
                break
            data, offset = (data + text.encode())[-(max_bytes + 1):], nxt
        return tail_text([(0, data, len(data) <= max_bytes)], max_bytes)

    async def aread_tail(self, handle: JobHandle, max_bytes: int = TAIL_BYTES) -> str:
        """:meth:`read_tail` for the triggerer, off its event loop."""
        import asyncio

        return await asyncio.to_thread(self.read_tail, handle, max_bytes)

    async def aread_logs(self, requests: list[tuple[JobHandle, int]]
                              ) -> dict[str, tuple[str, int]]:
        """New output of many jobs on this connection, keyed by job id. The triggerer calls it
        once per poll for every job it streams; backends that can answer for all jobs in one
        request (one SSH command, one S3 listing) should override it."""
        out = {}
        for handle, offset in requests:
            out[handle.job_id] = await self.aread_log(handle, offset)
        return out

    def cleanup(self, handle: JobHandle) -> None:
        """Remove what the job left behind (staged secrets, objects). Default: nothing."""
        return None

