"""Handles, statuses and offers survive JSON (they travel through triggers and XCom)."""

from __future__ import annotations

import json

import pytest

from airflow_skypilot.backends import registry
from airflow_skypilot.backends.base import JobHandle, JobState, JobStatus, Offer
from airflow_skypilot.exceptions import ConfigurationError
from tests.fakes import FakeBackend, offer


def test_handle_round_trips_through_json():
    h = JobHandle(backend="slurm", connection="slurm_alpha", job_id="42", job_name="sky-x",
                  location="batch", infra="slurm/alpha/batch", num_nodes=2, accelerator="A100",
                  gpus_per_node=4, extra={"log": "/home/u/x.log"})
    again = JobHandle.from_dict(json.loads(json.dumps(h.to_dict())))
    assert again == h
    assert again.key == "slurm_alpha:42"


def test_status_round_trips_through_json():
    s = JobStatus(JobState.FAILED, reason="exit 3", exit_code=3, nodes=["a1"])
    assert JobStatus.from_dict(json.loads(json.dumps(s.to_dict()))) == s


def test_offer_round_trips_through_json():
    o = offer("alpha", "batch", est_in=60, price=1.5, index=2)
    o.jobs_seen = frozenset({"sky-x-a0"})  # the probe's listing stays out of XCom
    assert "jobs_seen" not in o.to_dict()
    again = Offer.from_dict(json.loads(json.dumps(o.to_dict())))
    assert again.request.index == 2 and again.price_per_hour == 1.5
    assert again.request.accelerator == "A100"


@pytest.mark.parametrize(("state", "terminal", "infra"), [
    (JobState.PENDING, False, False), (JobState.RUNNING, False, False),
    (JobState.SUCCEEDED, True, False), (JobState.FAILED, True, False),
    (JobState.PREEMPTED, True, True), (JobState.INFRA_FAILED, True, True),
    (JobState.LOST, True, True), (JobState.CANCELLED, True, False),
])
def test_state_classes(state, terminal, infra):
    assert state.terminal is terminal
    assert state.infra_failure is infra


def test_registry_maps_connection_types_to_backends():
    assert registry.backend_name_for_conn_type("ssh") == "slurm"
    assert registry.backend_name_for_conn_type("slurm") == "slurm"
    assert registry.backend_name_for_conn_type("kubernetes") == "kubernetes"
    assert registry.backend_name_for_conn_type("aws") == "aws"
    with pytest.raises(ConfigurationError, match="which no backend serves"):
        registry.backend_name_for_conn_type("ftp")


def test_register_a_new_backend_without_touching_the_rest():
    registry.register_backend(FakeBackend)
    backend = registry.backend_for_connection("c1", conn_type="fake")
    assert isinstance(backend, FakeBackend) and backend.conn_id == "c1"


class _LoopBound(FakeBackend):
    """astatus that records the thread and loop it ran on."""

    seen: list[tuple[str, int]] = []

    async def astatus(self, handles):
        import asyncio
        import threading

        type(self).seen.append((threading.current_thread().name,
                                id(asyncio.get_running_loop())))
        await asyncio.sleep(0)
        return {h.job_id: JobStatus(JobState.RUNNING) for h in handles}


def test_the_sync_status_works_from_any_thread_with_or_without_a_running_loop():
    import asyncio
    import threading

    handle = JobHandle(backend="fake", connection="c", job_id="1", job_name="n", location="l",
                       infra="fake/l")
    backend = _LoopBound("c")
    _LoopBound.seen = []
    want = {"1": JobStatus(JobState.RUNNING)}
    assert backend.status([handle]) == want  # a worker: no loop in this thread

    results: list = []
    worker = threading.Thread(target=lambda: results.append(backend.status([handle])))
    worker.start()
    worker.join(10)
    assert results == [want]  # a plain thread with no loop

    async def triggerer() -> tuple:
        in_thread = await asyncio.to_thread(backend.status, [handle])  # the sweeps' way
        on_loop = backend.status([handle])  # a sync call right on the running loop
        return in_thread, on_loop, id(asyncio.get_running_loop())

    in_thread, on_loop, main_loop = asyncio.run(triggerer())
    assert in_thread == on_loop == want
    assert len(_LoopBound.seen) == 4
    assert main_loop not in {loop for _, loop in _LoopBound.seen[2:]}  # never blocked on it
