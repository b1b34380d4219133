"""A backend that lives in memory, for tests of what sits above the backend protocol."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import replace

from airflow_skypilot.backends.base import (
    TAIL_BYTES,
    Backend,
    CapacityRow,
    JobHandle,
    JobState,
    JobStatus,
    Offer,
    tail_text,
)
from airflow_skypilot.exceptions import BackendUnreachable, SubmissionError
from airflow_skypilot.spec.task import ResourceRequest, Task


def offer(conn: str = "c1", location: str = "p", *, acc: str | None = "A100", count: float = 1,
          gpus_free: int | None = 8, gpus_total: int | None = 8, nodes_free: int | None = 1,
          num_nodes: int = 1, price: float = 0.0, est_in: float | None = None,
          fits: bool = True, reason: str = "", index: int = 0, pending: int | None = None,
          max_cost: float | None = None) -> Offer:
    """An Offer built from keyword arguments, with est_start relative to now."""
    now = time.time()
    req = ResourceRequest(index=index, accelerator=acc, accelerator_count=count if acc else 0,
                          max_hourly_cost=max_cost)
    return Offer(connection=conn, backend="fake", location=location,
                 infra=f"fake/{conn}/{location}", request=req, num_nodes=num_nodes, fits=fits,
                 reason=reason, accelerator=acc, gpus_per_node=count, gpus_total=gpus_total,
                 gpus_free=gpus_free, nodes_total=2, nodes_free=nodes_free,
                 pending_jobs=pending, est_start=None if est_in is None else now + est_in,
                 price_per_hour=price, probed_at=now)


class FakeBackend(Backend):
    """Offers what it is told; jobs go through states when told. Shared class-level state."""

    name = "fake"
    conn_types = ("fake",)
    offers: dict[str, list[Offer]] = {}
    down: set[str] = set()
    #: connections that refuse every submission (their capacity gone since the probe)
    refusing: set[str] = set()
    delay: dict[str, float] = {}
    jobs: dict[str, dict] = {}

    def probe(self, task: Task) -> list[Offer]:
        time.sleep(self.delay.get(self.conn_id, 0))
        if self.conn_id in self.down:
            raise BackendUnreachable(f"{self.conn_id} is down")
        return list(self.offers.get(self.conn_id, []))

    def capacity(self) -> list[CapacityRow]:
        if self.conn_id in self.down:
            raise BackendUnreachable(f"{self.conn_id} is down")
        return [CapacityRow(connection=self.conn_id, location=o.location,
                            accelerator=o.accelerator, total=o.gpus_total, free=o.gpus_free)
                for o in self.offers.get(self.conn_id, [])]

    def submit(self, task: Task, offer: Offer, job_name: str,
               env: Mapping[str, str]) -> JobHandle:
        self._reachable()
        if self.conn_id in self.refusing:
            raise SubmissionError("InsufficientInstanceCapacity", retry_elsewhere=True)
        existing = self.find(job_name)
        if existing:
            existing.adopted = True
            return existing
        job_id = str(len(self.jobs) + 1)
        self.jobs[job_id] = {"name": job_name, "conn": self.conn_id, "env": dict(env),
                             "status": JobStatus(JobState.PENDING), "location": offer.location,
                             "submitted_at": time.time()}
        return JobHandle(backend="fake", connection=self.conn_id, job_id=job_id,
                         job_name=job_name, location=offer.location, infra=offer.infra,
                         num_nodes=task.num_nodes, accelerator=offer.request.accelerator,
                         gpus_per_node=offer.request.accelerator_count,
                         price_per_hour=offer.price_per_hour,
                         submitted_at=self.jobs[job_id]["submitted_at"])

    def _reachable(self) -> None:
        if self.conn_id in self.down:
            raise BackendUnreachable(f"{self.conn_id} is down")

    def _handle(self, job_id: str) -> JobHandle:
        job = self.jobs[job_id]
        return JobHandle(backend="fake", connection=self.conn_id, job_id=job_id,
                         job_name=job["name"], location=job["location"], infra="fake",
                         submitted_at=job.get("submitted_at") or 0.0)

    def find(self, job_name: str) -> JobHandle | None:
        self._reachable()
        for job_id, job in self.jobs.items():
            if job["name"] == job_name and job["conn"] == self.conn_id:
                return self._handle(job_id)
        return None

    def find_all(self, prefix: str) -> list[JobHandle]:
        self._reachable()
        return [self._handle(job_id) for job_id, job in self.jobs.items()
                if job["name"].startswith(prefix) and job["conn"] == self.conn_id]

    def cancel(self, handle: JobHandle) -> None:
        self._reachable()
        job = self.jobs[handle.job_id]
        if not job["status"].state.terminal:
            job["status"] = JobStatus(JobState.CANCELLED)
        elif job["status"].still_up:  # ended, part of it still up: that part is stopped
            job["status"] = replace(job["status"], still_up=False)

    polls = 0

    async def astatus(self, handles: list[JobHandle]) -> dict[str, JobStatus]:
        type(self).polls += 1
        if self.conn_id in self.down:
            raise BackendUnreachable(f"{self.conn_id} is down")
        return {h.job_id: self.jobs[h.job_id]["status"] if h.job_id in self.jobs
                else JobStatus(JobState.LOST) for h in handles}

    async def aread_logs(self, requests):
        """Batched, as the real backends do (one request per connection)."""
        return {h.job_id: self.read_log(h, o) for h, o in requests}

    #: what one read returns at most, as the real backends' (about 1 MiB there)
    read_limit = 1 << 20

    def _log(self, handle: JobHandle) -> bytes:
        return self.jobs.get(handle.job_id, {}).get("log", "").encode()

    def read_log(self, handle: JobHandle, offset: int = 0) -> tuple[str, int]:
        """Bytes from ``offset``, at most :attr:`read_limit` of them (ASCII logs here)."""
        data = self._log(handle)[offset:offset + self.read_limit]
        return data.decode(), offset + len(data)

    def read_tail(self, handle: JobHandle, max_bytes: int = TAIL_BYTES) -> str:
        data = self._log(handle)
        return tail_text([(0, data[-(max_bytes + 1):], len(data) <= max_bytes)], max_bytes)

    def cleanup(self, handle: JobHandle) -> None:
        if self.conn_id in self.down:
            raise BackendUnreachable(f"{self.conn_id} is down")
        if handle.job_id in self.jobs:
            self.jobs[handle.job_id]["cleaned"] = True

    @classmethod
    def reset(cls) -> None:
        cls.offers, cls.down, cls.refusing, cls.delay, cls.jobs = {}, set(), set(), {}, {}


def registered() -> Iterator[type[FakeBackend]]:
    """The body of a test module's fixture: the fake backend registered, clean before and
    after the test."""
    from airflow_skypilot.backends import registry

    registry.register_backend(FakeBackend)
    FakeBackend.reset()
    yield FakeBackend
    FakeBackend.reset()
