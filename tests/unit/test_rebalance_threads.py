"""The looks at waiting jobs share one probe per connection and shape without taking threads of
the event loop's default executor, which the triggerer needs for every trigger (logging,
``on_kill``, the sweeps): only the probe itself holds a thread, one of rebalance's own."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from airflow_skypilot import rebalance
from airflow_skypilot.backends.base import JobHandle, JobState, JobStatus
from tests.fakes import FakeBackend
from tests.unit.test_moves import load_task

#: more looks than any default executor has threads (at most 32)
LOOKS = 50


@pytest.fixture
def slow_probe(c1_queues_c2_full, monkeypatch):
    """c1's probe hangs until the test lets it answer; the threads that probed are noted."""
    gate = threading.Event()
    threads: list[str] = []
    real = FakeBackend.probe

    def probe(self, task):
        threads.append(threading.current_thread().name)
        gate.wait(20)
        return real(self, task)

    monkeypatch.setattr(FakeBackend, "probe", probe)
    yield gate, threads
    gate.set()


def _spec(**kw) -> rebalance.ReconsiderSpec:
    task = load_task({"resources": {"accelerators": "A100:1"}, "run": "x"})
    return rebalance.ReconsiderSpec(connections=["c1"], task=task.capacity_view(),
                                    places=["c1/p"], **{"interval": 60.0, **kw})


def _handle(i: int) -> JobHandle:
    return JobHandle(backend="fake", connection="c1", job_id=str(i), job_name=f"j{i}",
                     location="p", infra="fake/c1/p")


async def _no_op_wait() -> float:
    """How long a no-op waits for a thread of the default executor (structlog's ``ainfo``,
    ``on_kill``'s lookups and cancel take one)."""
    start = time.monotonic()
    await asyncio.wait_for(asyncio.to_thread(lambda: None), 2.0)
    return time.monotonic() - start


def test_looks_waiting_on_a_slow_probe_leave_the_default_executor_free(slow_probe):
    gate, threads = slow_probe
    spec = _spec(probe_timeout=30)

    async def main():
        looks = [asyncio.create_task(rebalance.adecide(spec, _handle(i),
                                                       JobStatus(JobState.PENDING)))
                 for i in range(LOOKS)]
        try:
            await asyncio.sleep(0.3)  # every look has begun; the probe hangs
            waited = [await _no_op_wait() for _ in range(3)]
        finally:
            gate.set()
        return waited, await asyncio.wait_for(asyncio.gather(*looks), 10)

    waited, decisions = asyncio.run(main())
    assert max(waited) < 0.5  # it waited for the probe (seconds) before
    assert len(threads) == 1 and threads[0].startswith("skypilot-probe")
    assert all(d.look.place == "c1/p" and d.look.outcome != "no look" for d in decisions)


def test_a_look_that_gives_up_on_a_probe_leaves_it_to_the_others_and_the_cache(slow_probe):
    gate, threads = slow_probe

    async def main():
        patient = asyncio.create_task(rebalance.adecide(
            _spec(probe_timeout=30), _handle(1), JobStatus(JobState.PENDING)))
        hasty = await rebalance.adecide(_spec(probe_timeout=0.2), _handle(2),
                                        JobStatus(JobState.PENDING))
        gate.set()
        return hasty, await asyncio.wait_for(patient, 10)

    hasty, patient = asyncio.run(main())
    assert hasty.look.outcome == "no look" and "could not be probed" in hasty.look.why
    assert patient.look.outcome != "no look"
    # the probe's answer is kept for the next looks of the interval
    later = rebalance.decide(_spec(), _handle(3), JobStatus(JobState.PENDING))
    assert later.look.outcome != "no look" and len(threads) == 1


def test_looks_on_several_event_loops_share_the_probe_under_way(slow_probe):
    gate, threads = slow_probe
    decisions: list[rebalance.Decision] = []

    def look(i: int) -> None:
        decisions.append(rebalance.decide(_spec(), _handle(i), JobStatus(JobState.PENDING)))

    lookers = [threading.Thread(target=look, args=(i,)) for i in range(4)]
    for t in lookers:
        t.start()
    time.sleep(0.3)
    gate.set()
    for t in lookers:
        t.join(10)
    assert len(decisions) == 4 and all(d.look.outcome != "no look" for d in decisions)
    assert len(threads) == 1


def test_a_failed_probe_is_shared_too(c1_queues_c2_full, monkeypatch):
    calls = []

    def probe(self, task):
        calls.append(self.conn_id)
        time.sleep(0.2)
        raise ConnectionError("login node down")

    monkeypatch.setattr(FakeBackend, "probe", probe)

    async def main():
        return await asyncio.gather(*[rebalance.adecide(_spec(), _handle(i),
                                                        JobStatus(JobState.PENDING))
                                      for i in range(LOOKS)])

    decisions = asyncio.run(main())
    assert calls == ["c1"]
    assert all(d.look.outcome == "no look" for d in decisions)
