"""Looks at a waiting job that did not move are recorded too (run state, the watch XCom):
where it waited, its estimated start, the best other place and why it stayed; bounded."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest
from airflow.sdk.exceptions import TaskDeferred

from airflow_skypilot import placement, rebalance
from airflow_skypilot.backends.base import JobState, JobStatus
from airflow_skypilot.runstate import MAX_LOOKS, XCOM_WATCH, Look, RunState, add_look
from airflow_skypilot.triggers import skypilot as trig
from tests.fakes import FakeBackend, offer
from tests.unit.test_moves import _ctx, _op


def _look(at: float, best: str = "c2/q", outcome: str = "stayed", **kw) -> Look:
    return Look(first_at=at, last_at=at, place="c1/p", best=best, outcome=outcome, **kw)


def test_looks_with_one_answer_share_a_record_and_the_state_stays_small():
    state: dict = {}
    for i in range(5):
        add_look(state, _look(100 + i, est_start=1000 - i, why=f"look {i}"))
    assert state["looks_total"] == 5 and len(state["looks"]) == 1
    (rec,) = state["looks"]
    assert (rec["first_at"], rec["last_at"], rec["count"]) == (100, 104, 5)
    assert (rec["est_start"], rec["why"]) == (996, "look 4")  # the numbers of the last
    for i in range(3 * MAX_LOOKS):  # answers that alternate: one record each, the last kept
        add_look(state, _look(200 + i, best=f"c{i % 2}/q"))
    assert len(state["looks"]) == MAX_LOOKS and state["looks_total"] == 5 + 3 * MAX_LOOKS
    assert state["looks"][-1]["last_at"] == 200 + 3 * MAX_LOOKS - 1
    assert len(json.dumps(state)) < 4000


def test_run_state_carries_looks_and_loads_older_shapes():
    run = RunState()
    run.note_look(_look(1.0, why="here est. in 1h"))
    run.note_look(_look(2.0))
    again = RunState.from_dict(json.loads(json.dumps(run.to_dict())))
    assert again.looks_total == 2 and again.looks[0].count == 2
    assert RunState.from_dict({"attempts": []}).looks == []  # written before looks existed


def test_judge_says_why_a_job_stays():
    here = offer("c1", "p", nodes_free=0, est_in=3600)
    close = offer("c2", "q", nodes_free=0, est_in=3000)
    verdict = placement.judge(here, [close], "fastest")
    assert verdict.move_to is None and verdict.best.place_key == "c2/q"
    assert "c2/q est. in 50m vs here in 1h00m: saves 10m" in verdict.why
    assert placement.judge(offer("c1", "p"), [close], "fastest").why == \
        "its place can start it now"
    assert "max_moves" in placement.judge(here, [close], "fastest", moves=3).why
    assert placement.judge(here, [], "fastest").why == "no other place takes it"
    paid = offer("c2", "q", price=9.0)
    assert placement.judge(here, [paid], "cheapest").why == \
        "the other places cost more (policy cheapest)"
    free = offer("c2", "q")
    moved = placement.judge(here, [free], "fastest")
    assert moved.move_to is not None and moved.why == moved.move_to.details["move_reason"]


@pytest.fixture(autouse=True)
def _fake(c1_queues_c2_full):
    """Every test here runs over c1 (queues) and c2 (full): tests/unit/conftest.py."""


def test_the_trigger_records_its_looks_and_writes_the_watch_xcom(monkeypatch):
    from airflow.sdk.execution_time import xcom

    written: list[tuple] = []

    async def aset(key, value, **where):
        written.append((key, json.loads(json.dumps(value)), where))

    monkeypatch.setattr(xcom.XCom, "aset", aset)
    with pytest.raises(TaskDeferred) as info:
        _op().execute(_ctx())
    trigger = info.value.trigger
    assert trigger.handle["connection"] == "c1"
    FakeBackend.offers["c2"] = [offer("c2", "q", nodes_free=0, est_in=3000)]  # 10 min sooner
    trigger.task_instance = SimpleNamespace(dag_id="dag", task_id="train", run_id="r",
                                            map_index=2)

    async def watch():
        task = asyncio.create_task(anext(trigger.run()))
        await asyncio.sleep(0.4)  # several looks, every one "stays" (10 min sooner only)
        FakeBackend.jobs["1"]["status"] = JobStatus(JobState.RUNNING, started_at=time.time())
        await asyncio.sleep(0.1)
        FakeBackend.jobs["1"]["status"] = JobStatus(JobState.SUCCEEDED, exit_code=0)
        return (await asyncio.wait_for(task, 5)).payload

    event = asyncio.run(watch())
    run = RunState.from_dict(event["state"])
    assert event["status"] == "done" and run.looks_total >= 2
    (look,) = run.looks  # one answer all along: one record
    assert (look.place, look.best, look.outcome) == ("c1/p", "c2/q", "stayed")
    assert look.count == run.looks_total and look.est_start > time.time() + 3000
    assert "saves" in look.why
    # the XCom: once for the first look (a new answer), once when the job started
    assert [(k, v["state"]) for k, v, _ in written] == [(XCOM_WATCH, "pending"),
                                                         (XCOM_WATCH, "running")]
    assert written[0][2] == {"dag_id": "dag", "task_id": "train", "run_id": "r",
                             "map_index": 2}
    assert written[0][1]["looks"][0]["best"] == "c2/q" and written[0][1]["job_id"] == "1"
    assert written[1][1]["started_at"] is not None


def test_a_look_that_cannot_probe_the_jobs_place_is_recorded_as_no_look():
    with pytest.raises(TaskDeferred) as info:
        _op().execute(_ctx())
    FakeBackend.down.add("c1")
    spec = rebalance.ReconsiderSpec.from_dict(info.value.trigger.reconsider)
    from airflow_skypilot.backends.base import JobHandle

    handle = JobHandle.from_dict(info.value.trigger.handle)
    decision = rebalance.decide(spec, handle, JobStatus(JobState.PENDING))
    assert decision.move_to is None
    assert (decision.look.outcome, decision.look.why) == ("no look", "c1 could not be probed")


def test_the_worker_records_looks_when_not_deferrable():
    ctx = _ctx()
    op = _op(deferrable=False)
    FakeBackend.offers["c2"] = [offer("c2", "q", nodes_free=0, est_in=3000)]  # after placing
    calls = {"n": 0}
    real = FakeBackend.status

    def status(self, handles):
        calls["n"] += 1
        if calls["n"] > 30:
            FakeBackend.jobs["1"]["status"] = JobStatus(JobState.SUCCEEDED, exit_code=0,
                                                        started_at=1.0, ended_at=2.0)
        return real(self, handles)

    FakeBackend.status = status
    try:
        result = op.execute(ctx)
    finally:
        FakeBackend.status = real
    assert result["state"] == "succeeded"
    watch = ctx["ti"].xcom[XCOM_WATCH]
    assert watch["looks_total"] >= 1 and watch["looks"][-1]["outcome"] == "stayed"
    assert trig.WATCH_WRITE_EVERY == 300.0
