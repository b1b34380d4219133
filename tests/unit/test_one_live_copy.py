"""At most one live copy of a task: the operator and triggers over the in-memory backend.

Each test drives one fault: a backend that cannot be asked, a submission cut short, a silent
old copy, an earlier clear or a deleted run's job, a misconfigured connection. The real clusters
go through the same faults in tests/e2e.
"""

from __future__ import annotations

import asyncio
import json
import time
from datetime import datetime, timezone
from types import SimpleNamespace

import pytest
from airflow.sdk.exceptions import AirflowFailException, TaskDeferred

from airflow_skypilot.backends import registry
from airflow_skypilot.backends.base import JobState, JobStatus
from airflow_skypilot.exceptions import BackendUnreachable
from airflow_skypilot.operators import SkyPilotOperator
from airflow_skypilot.runstate import RunState, Sweep
from airflow_skypilot.triggers.skypilot import (
    SkyPilotJobTrigger,
    SkyPilotSweepTrigger,
    SkyPilotWaitTrigger,
)
from tests.fakes import FakeBackend, offer


class TI:
    def __init__(self, try_number=1, map_index=-1, task_id="train"):
        self.dag_id, self.task_id, self.run_id = "dag", task_id, "manual__1"
        self.try_number, self.map_index, self.start_date = try_number, map_index, None
        self.xcom: dict = {}

    def xcom_push(self, key, value):
        self.xcom[key] = json.loads(json.dumps(value))


def _ctx(try_number=1, clear=0, started=None, **kw):
    dag_run = SimpleNamespace(clear_number=clear, start_date=started)
    return {"ti": TI(try_number, **kw), "dag_run": dag_run}


@pytest.fixture(autouse=True)
def _fake(monkeypatch):
    registry.register_backend(FakeBackend)
    for conn in ("c1", "c2"):
        monkeypatch.setenv(f"AIRFLOW_CONN_{conn.upper()}", json.dumps({"conn_type": "fake"}))
    monkeypatch.setenv("AIRFLOW_CONN_PG", json.dumps({"conn_type": "postgres"}))
    FakeBackend.reset()
    FakeBackend.offers = {"c1": [offer("c1", "p")], "c2": [offer("c2", "q", price=1.0)]}
    yield
    FakeBackend.reset()


def _op(**kw):
    kw.setdefault("deferrable", True)
    kw.setdefault("confirm_timeout", 0.2)
    kw.setdefault("task", {"resources": {"accelerators": "A100:1"}, "run": "train"})
    return SkyPilotOperator(task_id="train", connections=kw.pop("connections", ["c1", "c2"]),
                            **kw)


def _defer(op, ctx):
    with pytest.raises(TaskDeferred) as info:
        op.execute(ctx)
    return info.value


def _alive():
    return sorted(j["name"] for j in FakeBackend.jobs.values()
                  if not j["status"].state.terminal)


def _set(job_id, state, reason=""):
    FakeBackend.jobs[job_id]["status"] = JobStatus(state, reason=reason, started_at=10.0,
                                                   ended_at=20.0)


async def _events(trigger):
    async for event in trigger.run():
        return event.payload


# --- earlier tries, clears and runs --------------------------------------------------------------

def test_a_clear_stops_the_earlier_copy_and_submits_afresh():
    first = _defer(_op(), _ctx(try_number=1, clear=0)).trigger.handle
    second = _defer(_op(), _ctx(try_number=2, clear=1)).trigger.handle
    assert second["job_id"] != first["job_id"] and "-c1-t2-a0" in second["job_name"]
    assert FakeBackend.jobs[first["job_id"]]["status"].state == JobState.CANCELLED
    assert _alive() == [second["job_name"]]


def test_a_job_of_a_deleted_run_with_the_same_id_is_stopped_not_adopted():
    old = _defer(_op(), _ctx()).trigger.handle
    FakeBackend.jobs[old["job_id"]]["submitted_at"] = time.time() - 3600
    recreated = datetime.now(timezone.utc)  # the run of the same id started just now
    new = _defer(_op(), _ctx(started=recreated)).trigger.handle
    assert new["job_id"] != old["job_id"] and not new["adopted"]
    assert _alive() == [new["job_name"]]


def test_map_index_and_task_id_never_share_jobs():
    mapped = _defer(_op(), _ctx(map_index=1)).trigger.handle
    named = _defer(SkyPilotOperator(task_id="train-1", task={"run": "x"}, connections=["c1"],
                                    deferrable=True), _ctx(task_id="train-1")).trigger.handle
    assert mapped["job_id"] != named["job_id"] and len(_alive()) == 2


def test_a_retry_places_nothing_while_a_connection_that_may_run_an_earlier_copy_is_silent():
    """The earlier try's job is on c2, which is down when the retry starts: "could not ask" is
    not "none", so the retry waits (no copy on c1 beside it); c2 answers: the old job is
    stopped, then the job is placed."""
    FakeBackend.offers = {"c2": [offer("c2", "q")]}
    old = _defer(_op(), _ctx(try_number=1)).trigger.handle
    FakeBackend.offers = {"c1": [offer("c1", "p")], "c2": [offer("c2", "q")]}
    FakeBackend.down = {"c2"}
    waiting = _defer(_op(), _ctx(try_number=2))
    assert isinstance(waiting.trigger, SkyPilotWaitTrigger)
    assert _alive() == [old["job_name"]], "no second copy while c2 cannot be asked"
    FakeBackend.down = set()
    with pytest.raises(TaskDeferred) as placed:
        _op().execute_complete(_ctx(try_number=2), {"status": "reprobe",
                                                     "state": waiting.trigger.state})
    assert FakeBackend.jobs[old["job_id"]]["status"].state == JobState.CANCELLED
    assert _alive() == [placed.value.trigger.handle["job_name"]]


def test_a_connection_that_cannot_be_listed_at_the_start_is_swept_later():
    """The same, c2 silent past unreachable_timeout: the retry places a new copy on c1 and
    its trigger stops the old one as soon as c2 answers."""
    FakeBackend.offers = {"c2": [offer("c2", "q")]}
    old = _defer(_op(), _ctx(try_number=1)).trigger.handle
    FakeBackend.offers = {"c1": [offer("c1", "p")], "c2": [offer("c2", "q")]}
    FakeBackend.down = {"c2"}
    deferred = _defer(_op(unreachable_timeout=0), _ctx(try_number=2))
    new = deferred.trigger.handle
    assert new["connection"] == "c1"
    run = RunState.from_dict(deferred.trigger.state)
    assert [(w.connection, w.prefix) for w in run.pending_sweeps] == [("c2", run.prefix)]
    FakeBackend.down = set()
    _set(new["job_id"], JobState.RUNNING)
    trigger = deferred.trigger
    trigger.sweep_interval = trigger.poll_interval = 0.01

    async def watch():
        task = asyncio.create_task(_events(trigger))
        for _ in range(200):
            if FakeBackend.jobs[old["job_id"]]["status"].state.terminal:
                break
            await asyncio.sleep(0.01)
        _set(new["job_id"], JobState.SUCCEEDED)
        return await task

    event = asyncio.run(watch())
    assert FakeBackend.jobs[old["job_id"]]["status"].state == JobState.CANCELLED
    assert FakeBackend.jobs[new["job_id"]]["status"].state == JobState.SUCCEEDED
    done = RunState.from_dict(event["state"]).sweeps
    assert done[0].done_at and done[0].outcome == "cancelled"


# --- failover -----------------------------------------------------------------------------------

def test_a_silent_old_copy_is_kept_on_the_list_until_its_backend_answers():
    deferred = _defer(_op(), _ctx())
    old = deferred.trigger.handle
    FakeBackend.down = {"c1"}  # the login node went silent; the job may well still run
    event = {"status": "done", "handle": old, "log_tail": "", "log_offset": 0,
             "state": deferred.trigger.state,
             "job_status": JobStatus(JobState.LOST, reason="no answer for 300s").to_dict()}
    with pytest.raises(TaskDeferred) as info:
        _op().execute_complete(_ctx(), event)
    new = info.value.trigger.handle
    assert new["connection"] == "c2"
    run = RunState.from_dict(info.value.trigger.state)
    assert run.attempts[0].confirmed_dead is False
    assert [w.handle["job_id"] for w in run.pending_sweeps] == [old["job_id"]]
    assert FakeBackend.jobs[old["job_id"]]["status"].state == JobState.PENDING  # still there
    # c1 answers again while the new copy runs: the trigger cancels the old one
    FakeBackend.down = set()
    trigger = info.value.trigger
    trigger.sweep_interval = trigger.poll_interval = 0.01

    async def watch():
        task = asyncio.create_task(_events(trigger))
        for _ in range(200):
            if FakeBackend.jobs[old["job_id"]]["status"].state.terminal:
                break
            await asyncio.sleep(0.01)
        _set(new["job_id"], JobState.SUCCEEDED)
        return await task

    event = asyncio.run(watch())
    assert FakeBackend.jobs[old["job_id"]]["status"].state == JobState.CANCELLED
    result = _op().execute_complete(_ctx(), event)
    assert result["old_copies"][0]["confirmed_dead"] is True
    assert result["old_copies"][0]["outcome"] == "cancelled"


def _succeeded_beside_a_silent_old_copy():
    """c1 goes silent (the copy there read lost), the next copy on c2 succeeds: (the old
    copy's handle, the new one's, the "done" event of the new one)."""
    deferred = _defer(_op(), _ctx())
    old = deferred.trigger.handle
    FakeBackend.down = {"c1"}
    event = {"status": "done", "handle": old, "log_tail": "", "log_offset": 0,
             "state": deferred.trigger.state,
             "job_status": JobStatus(JobState.LOST, reason="silent").to_dict()}
    with pytest.raises(TaskDeferred) as info:
        _op().execute_complete(_ctx(), event)
    new = info.value.trigger.handle
    _set(new["job_id"], JobState.SUCCEEDED)
    done = {"status": "done", "handle": new, "log_tail": "", "log_offset": 0,
            "state": info.value.trigger.state,
            "job_status": FakeBackend.jobs[new["job_id"]]["status"].to_dict()}
    return old, new, done


def test_success_waits_for_an_unconfirmed_old_copy_then_reports_it():
    _old, new, done = _succeeded_beside_a_silent_old_copy()
    with pytest.raises(TaskDeferred) as last:
        _op(unreachable_timeout=0.05).execute_complete(_ctx(), done)
    sweep = last.value.trigger
    assert isinstance(sweep, SkyPilotSweepTrigger) and sweep.timeout == 0.05
    swept = asyncio.run(_events(sweep))  # c1 stays silent: gives up after the timeout
    assert swept["status"] == "swept"
    result = _op().execute_complete(_ctx(), swept)
    assert result["state"] == "succeeded" and result["job_id"] == new["job_id"]
    assert result["old_copies"][0]["confirmed_dead"] is False
    # close to execution_timeout the last sweep ends before the deferral would time out (a
    # timed-out deferral fails the task whose job succeeded)
    from datetime import timedelta

    with pytest.raises(TaskDeferred) as near:
        _op(unreachable_timeout=600, execution_timeout=timedelta(seconds=40)).execute_complete(
            _ctx(), done)
    assert near.value.trigger.timeout == 30.0 and near.value.timeout == timedelta(seconds=40)


def test_a_task_killed_while_its_old_copy_is_being_confirmed_stops_it_at_the_kill():
    """The job succeeded; an old copy's backend was silent, so a last sweep trigger runs; the
    user marks the task failed: the kill tries the old copy once more."""
    old, _new, done = _succeeded_beside_a_silent_old_copy()
    with pytest.raises(TaskDeferred) as last:
        _op(unreachable_timeout=600).execute_complete(_ctx(), done)
    assert isinstance(last.value.trigger, SkyPilotSweepTrigger) and old["job_name"] in _alive()
    FakeBackend.down = set()
    asyncio.run(last.value.trigger.on_kill())  # no task instance to ask: killed
    assert _alive() == []


def test_a_deferral_that_times_out_stops_the_old_copies_it_had_still_to_confirm(caplog):
    """c1 goes silent (its copy read lost, not confirmed dead), the job fails over to c2, then
    the deferral times out: Airflow resumes the task only to fail it, with no state. The old
    copy is still stopped (its sweep was noted in XCom at the deferral), and the c2 job."""
    from airflow.sdk.bases.operator import TRIGGER_FAIL_REPR

    first = _defer(_op(), _ctx())
    old = first.trigger.handle
    _set(old["job_id"], JobState.RUNNING)
    FakeBackend.offers = {"c1": [offer("c1", "p")], "c2": [offer("c2", "q")]}
    FakeBackend.down = {"c1"}
    ctx = _ctx()
    lost = {"status": "done", "handle": old, "log_tail": "", "log_offset": 0,
            "state": first.trigger.state,
            "job_status": JobStatus(JobState.LOST, reason="silent").to_dict()}
    with pytest.raises(TaskDeferred) as second:
        _op().execute_complete(ctx, lost)
    new = second.value.trigger.handle
    assert new["connection"] == "c2" and sorted(_alive()) == sorted(
        [old["job_name"], new["job_name"]])
    ti = ctx["ti"]
    ti.xcom_pull = lambda task_ids, key, map_indexes=None: ti.xcom.get(key)
    FakeBackend.down = set()  # c1 answers again by the time the deferral times out
    with pytest.raises(Exception, match="Trigger timeout"):
        _op().resume_execution(TRIGGER_FAIL_REPR, {"error": "Trigger timeout"}, ctx)
    assert _alive() == []


def test_a_deferral_timeout_with_cancel_on_kill_false_leaves_the_watched_job(monkeypatch):
    """A precaution by prefix (c1 not listed at the start) is not an old copy: the timeout's
    sweep would find the job being watched under the prefix and cancel it."""
    from airflow.sdk.bases.operator import TRIGGER_FAIL_REPR

    real, calls = FakeBackend.find_all, []

    def once_unlisted(self, prefix):
        if self.conn_id == "c1" and not calls:
            calls.append(prefix)
            raise BackendUnreachable("ssh: timed out")
        return real(self, prefix)

    monkeypatch.setattr(FakeBackend, "find_all", once_unlisted)
    ctx = _ctx()
    job = _defer(_op(cancel_on_kill=False), ctx).trigger.handle
    ti = ctx["ti"]
    ti.xcom_pull = lambda task_ids, key, map_indexes=None: ti.xcom.get(key)
    with pytest.raises(Exception, match="Trigger timeout"):
        _op(cancel_on_kill=False).resume_execution(TRIGGER_FAIL_REPR,
                                                   {"error": "Trigger timeout"}, ctx)
    assert calls and _alive() == [job["job_name"]]


def _cut_short_on_c1(monkeypatch, creates: bool, then_down: bool = False):
    """c1's submissions lose their answer (the job made or not); c1 then goes silent."""
    real = FakeBackend.submit

    def submit(self, task, offer_, job_name, env):
        if self.conn_id == "c1":
            if creates:
                real(self, task, offer_, job_name, env)
            if then_down:
                FakeBackend.down.add("c1")
            raise BackendUnreachable("ssh: connection reset while sbatch ran")
        return real(self, task, offer_, job_name, env)

    monkeypatch.setattr(FakeBackend, "submit", submit)


def test_a_submission_cut_short_that_made_the_job_adopts_it(monkeypatch):
    _cut_short_on_c1(monkeypatch, creates=True)
    deferred = _defer(_op(), _ctx())
    assert deferred.trigger.handle["connection"] == "c1"
    assert deferred.trigger.handle["job_name"].endswith("-a0")
    assert _alive() == [deferred.trigger.handle["job_name"]], "one copy, not a second on c2"


def test_a_submission_cut_short_that_made_nothing_tries_the_next_place(monkeypatch):
    _cut_short_on_c1(monkeypatch, creates=False)
    deferred = _defer(_op(), _ctx())
    assert deferred.trigger.handle["connection"] == "c2"
    assert deferred.trigger.handle["job_name"].endswith("-a1"), "a name of its own"
    run = RunState.from_dict(deferred.trigger.state)
    cut = run.pending_sweeps[0]  # swept by name all the same, in case it shows up late
    assert cut.connection == "c1" and cut.job_name.endswith("-a0") and not cut.before_next
    assert run.blocked[0].place == "c1/p" and run.blocked[0].until is not None


def test_a_submission_cut_short_unanswered_for_unreachable_timeout_is_placed_elsewhere(
        monkeypatch):
    """c1 never answers again (a retired cluster): after unreachable_timeout the job goes to
    c2 (the name on c1 still swept), rather than waiting for ever."""
    _cut_short_on_c1(monkeypatch, creates=True, then_down=True)
    waiting = _defer(_op(unreachable_timeout=600), _ctx())
    assert isinstance(waiting.trigger, SkyPilotWaitTrigger)
    event = {"status": "reprobe", "state": waiting.trigger.state}
    with pytest.raises(TaskDeferred) as placed:
        _op(unreachable_timeout=0).execute_complete(_ctx(), event)
    assert placed.value.trigger.handle["connection"] == "c2"
    run = RunState.from_dict(placed.value.trigger.state)
    assert [w.connection for w in run.pending_copies] == ["c1"]


def test_a_submission_cut_short_unanswered_submits_nothing_elsewhere_until_it_answers(
        monkeypatch):
    _cut_short_on_c1(monkeypatch, creates=True, then_down=True)
    deferred = _defer(_op(), _ctx())
    assert isinstance(deferred.trigger, SkyPilotWaitTrigger), "it waits: no copy on c2"
    assert _alive() == [next(j["name"] for j in FakeBackend.jobs.values())]
    run = RunState.from_dict(deferred.trigger.state)
    assert run.pending_sweeps[0].before_next and "not confirmed dead" in run.last_plan
    # c1 answers: the made job is stopped and confirmed dead, then the job is placed anew
    FakeBackend.down.clear()
    event = {"status": "reprobe", "state": deferred.trigger.state}
    with pytest.raises(TaskDeferred) as info:
        _op().execute_complete(_ctx(), event)
    assert info.value.trigger.handle["connection"] == "c2"
    assert _alive() == [info.value.trigger.handle["job_name"]]


def test_blocks_lapse_after_the_cooldown():
    deferred = _defer(_op(block_cooldown=0), _ctx())
    old = deferred.trigger.handle
    _set(old["job_id"], JobState.INFRA_FAILED, "node failure")
    FakeBackend.offers = {"c1": [offer("c1", "p")]}  # the only place: blocked for 0 s
    event = {"status": "done", "handle": old, "log_tail": "", "log_offset": 0,
             "state": deferred.trigger.state,
             "job_status": FakeBackend.jobs[old["job_id"]]["status"].to_dict()}
    with pytest.raises(TaskDeferred) as info:
        _op(block_cooldown=0).execute_complete(_ctx(), event)
    assert info.value.trigger.handle["connection"] == "c1"


def test_an_error_event_stops_the_job_before_failing():
    deferred = _defer(_op(), _ctx())
    handle = deferred.trigger.handle
    event = {"status": "error", "handle": handle, "state": deferred.trigger.state,
             "message": "trigger crashed"}
    with pytest.raises(Exception, match="trigger crashed"):
        _op().execute_complete(_ctx(), event)
    assert FakeBackend.jobs[handle["job_id"]]["status"].state == JobState.CANCELLED


# --- configuration errors ------------------------------------------------------------------------

@pytest.mark.parametrize(("conn", "text"), [
    ("pg", "'pg' has type 'postgres', which no backend serves"),
    ("not_defined_anywhere", "'not_defined_anywhere' is not defined"),
])
def test_a_misconfigured_connection_fails_at_once_naming_it(conn, text):
    with pytest.raises(AirflowFailException) as err:
        _op(connections=["c1", conn]).execute(_ctx())
    assert text in str(err.value) and "supported types" in str(err.value)
    assert FakeBackend.jobs == {}, "nothing submitted"


def test_a_wait_trigger_sweeps_too():
    run = RunState(prefix="p-")
    FakeBackend.jobs["9"] = {"name": "p-c0-t1-a0", "conn": "c1", "env": {}, "location": "p",
                             "status": JobStatus(JobState.RUNNING), "submitted_at": 1.0}
    run.sweeps.append(Sweep(connection="c1", prefix="p-", reason="test"))
    trigger = SkyPilotWaitTrigger(0.2, state=run)
    trigger.sweep_interval = 0.01
    event = asyncio.run(_events(trigger))
    assert event["status"] == "reprobe"
    assert FakeBackend.jobs["9"]["status"].state == JobState.CANCELLED
    assert RunState.from_dict(event["state"]).sweeps[0].done_at


def test_a_prefix_sweep_stops_only_names_of_exactly_its_prefix():
    """Another task's prefix may begin with ours ("p-" and "p-x-"): its job is not ours."""
    from airflow_skypilot import sweeps

    for job_id, name in (("1", "p-c0-t1-a0"), ("2", "p-x-c0-t1-a0"), ("3", "p-notes")):
        FakeBackend.jobs[job_id] = {"name": name, "conn": "c1", "env": {}, "location": "p",
                                    "status": JobStatus(JobState.RUNNING), "submitted_at": 1.0}
    sweep = Sweep(connection="c1", prefix="p-", reason="test")
    assert sweeps.step(sweep, FakeBackend("c1"))
    assert _alive() == ["p-notes", "p-x-c0-t1-a0"]


def test_a_job_trigger_never_sweeps_the_job_it_watches():
    run = RunState(prefix="p-")
    run.sweeps.append(Sweep(connection="c1", prefix="p-", reason="test"))
    FakeBackend.jobs["1"] = {"name": "p-c0-t2-a0", "conn": "c1", "env": {}, "location": "p",
                             "status": JobStatus(JobState.RUNNING), "submitted_at": 1.0}
    handle = FakeBackend("c1").find("p-c0-t2-a0")
    trigger = SkyPilotJobTrigger(handle.to_dict(), poll_interval=0.01, state=run)
    trigger.sweep_interval = 0.01

    async def watch():
        task = asyncio.create_task(_events(trigger))
        await asyncio.sleep(0.2)
        assert FakeBackend.jobs["1"]["status"].state == JobState.RUNNING
        _set("1", JobState.SUCCEEDED)
        return await task

    event = asyncio.run(watch())
    assert event["job_status"]["state"] == "succeeded"
    assert RunState.from_dict(event["state"]).sweeps[0].done_at


def test_a_connection_that_could_not_be_checked_does_not_hold_the_tasks_end():
    """Try 1 with a connection down: the run succeeds at once; the result says what it could
    not check instead of waiting out the silence limit for a copy that may not exist."""
    FakeBackend.offers = {"c1": [offer("c1", "p")]}
    FakeBackend.down = {"c2"}
    deferred = _defer(_op(), _ctx())
    handle = deferred.trigger.handle
    _set(handle["job_id"], JobState.SUCCEEDED)
    event = {"status": "done", "handle": handle, "log_tail": "", "log_offset": 0,
             "state": deferred.trigger.state,
             "job_status": FakeBackend.jobs[handle["job_id"]]["status"].to_dict()}
    result = _op().execute_complete(_ctx(), event)  # no deferral to a sweep trigger
    assert result["state"] == "succeeded"
    assert [(c["connection"], c["confirmed_dead"], c["outcome"]) for c in
            result["old_copies"]] == [("c2", False, "not checked")]


def test_an_ended_copy_with_part_of_it_still_up_is_cancelled_before_it_counts_as_dead():
    """AWS ends a 2-node job as an infra failure when one node is lost while the other still
    runs: the sweep cancels it, instead of trusting the terminal state."""
    from airflow_skypilot import sweeps
    from airflow_skypilot.spec import load_task

    task = load_task({"run": "x", "resources": {"accelerators": "A100:1"}})
    handle = FakeBackend("c1").submit(task, offer("c1"), "sky-x-t1-a0", {})
    FakeBackend.jobs[handle.job_id]["status"] = JobStatus(JobState.INFRA_FAILED, still_up=True)
    sweep = Sweep(connection="c1", handle=handle.to_dict(), reason="its place failed")
    assert sweeps.step(sweep, FakeBackend("c1"))
    after = FakeBackend.jobs[handle.job_id]["status"]
    assert (after.state, after.still_up) == (JobState.INFRA_FAILED, False)
    assert sweep.outcome == "infra_failed"


def test_a_copy_the_backends_answer_leaves_out_is_not_confirmed_dead():
    """An answer that says nothing of the job (a partial answer, a third-party backend) is
    "could not ask", as for the trigger and the sensor: the copy is cancelled and stays on
    the list until its backend speaks for it."""
    from airflow_skypilot import sweeps
    from airflow_skypilot.spec import load_task

    task = load_task({"run": "x", "resources": {"accelerators": "A100:1"}})
    handle = FakeBackend("c1").submit(task, offer("c1"), "sky-x-t1-a0", {})
    cancelled = []

    class Mute(FakeBackend):
        def status(self, handles):
            return {}

        def cancel(self, h):
            cancelled.append(h.job_id)

    sweep = Sweep(connection="c1", handle=handle.to_dict(), reason="failover")
    assert not sweeps.step(sweep, Mute("c1"))
    assert (sweep.done_at, cancelled) == (None, [handle.job_id])
    assert sweeps.step(sweep, FakeBackend("c1"))  # once it answers, it counts
    assert sweep.done_at is not None


def _still_up(job_id, state, exit_code=None):
    FakeBackend.jobs[job_id]["status"] = JobStatus(state, exit_code=exit_code, started_at=10.0,
                                                   ended_at=20.0, still_up=True)


def _done(deferred) -> dict:
    """What the trigger sends once the job it watches ended, as the fake backend has it."""
    handle = deferred.trigger.handle
    return {"status": "done", "handle": handle, "log_tail": "", "log_offset": 0,
            "state": deferred.trigger.state,
            "job_status": FakeBackend.jobs[handle["job_id"]]["status"].to_dict()}


def _restarting_op(**kw):
    return _op(task={"resources": {"accelerators": "A100:1",
                                   "job_recovery": {"max_restarts_on_errors": 1}}, "run": "t"},
               **kw)


def test_a_failed_job_with_part_of_it_still_up_is_stopped_before_its_restart():
    """Rank 0 of a 2-node job exited 1 while rank 1's machine still runs: the restart's copy
    must not start beside it (only the best-effort clean-up stopped it before)."""
    op = _restarting_op()
    ctx = _ctx()
    first = _defer(op, ctx)
    handle = first.trigger.handle
    _still_up(handle["job_id"], JobState.FAILED, exit_code=1)
    event = _done(first)
    with pytest.raises(TaskDeferred) as again:
        op.execute_complete(ctx, event, first.kwargs["state"])
    old = FakeBackend.jobs[handle["job_id"]]["status"]
    assert (old.state, old.still_up) == (JobState.FAILED, False)  # its rest was stopped
    assert again.value.trigger.handle["job_id"] != handle["job_id"]
    assert [s["outcome"] for s in again.value.trigger.state["sweeps"]] == ["failed"]


def test_a_restart_waits_while_the_backend_says_the_failed_copy_still_runs(monkeypatch):
    """The cancel does not take (pods in a long termination grace, a Slurm job COMPLETING past
    KillWait): its backend answers that part of it runs. No restart beside it until that
    ends; only a silent backend (its place failed) lets the next copy go first."""
    stuck = {"on": True}
    cancel = FakeBackend.cancel
    monkeypatch.setattr(FakeBackend, "cancel",
                        lambda self, h: None if stuck["on"] else cancel(self, h))
    op = _restarting_op(unreachable_timeout=600)
    ctx = _ctx()
    first = _defer(op, ctx)
    handle = first.trigger.handle
    _still_up(handle["job_id"], JobState.FAILED, exit_code=1)
    event = _done(first)
    with pytest.raises(TaskDeferred) as waiting:
        op.execute_complete(ctx, event, first.kwargs["state"])
    assert isinstance(waiting.value.trigger, SkyPilotWaitTrigger), "no copy beside it"
    assert len(FakeBackend.jobs) == 1
    run = RunState.from_dict(waiting.value.trigger.state)
    assert "not confirmed dead" in run.last_plan
    stuck["on"] = False  # its rest ends: confirmed dead, then the restart
    event = {"status": "reprobe", "state": waiting.value.trigger.state}
    with pytest.raises(TaskDeferred) as placed:
        _op(unreachable_timeout=600).execute_complete(_ctx(), event)
    assert placed.value.trigger.handle["job_id"] != handle["job_id"]
    assert not FakeBackend.jobs[handle["job_id"]]["status"].up
    assert _alive() == [placed.value.trigger.handle["job_name"]]


def test_a_copy_that_never_stops_holds_the_restart_for_unreachable_timeout(monkeypatch):
    monkeypatch.setattr(FakeBackend, "cancel", lambda self, h: None)  # a node that never dies
    op = _restarting_op(unreachable_timeout=0)
    ctx = _ctx()
    first = _defer(op, ctx)
    handle = first.trigger.handle
    _still_up(handle["job_id"], JobState.FAILED, exit_code=1)
    event = _done(first)
    with pytest.raises(TaskDeferred) as again:
        op.execute_complete(ctx, event, first.kwargs["state"])
    assert again.value.trigger.handle["job_id"] != handle["job_id"]  # placed all the same
    run = RunState.from_dict(again.value.trigger.state)
    assert [w.what for w in run.pending_copies] == [f"job {handle['job_id']} "
                                                     f"({handle['job_name']})"]  # still swept


def _lost_to_silence(op, ctx):
    """The job on c1 is taken for lost (c1 silent past unreachable_timeout; it still runs)."""
    first = _defer(op, ctx)
    handle = first.trigger.handle
    assert handle["connection"] == "c1"
    FakeBackend.down.add("c1")
    event = {"status": "done", "handle": handle, "log_tail": "", "log_offset": 0,
             "state": first.trigger.state,
             "job_status": JobStatus.silent("c1", 1, "ssh timeout").to_dict()}
    with pytest.raises(TaskDeferred) as after:
        op.execute_complete(ctx, event, first.kwargs["state"])
    return handle, after.value


def test_a_cluster_that_answers_again_gets_no_copy_beside_its_silent_old_one():
    """EAGER_NEXT_REGION does not block the place that failed: when c1 answers again, its old
    copy is stopped and confirmed dead before a new one goes there."""
    op = _op(connections=["c1"], unreachable_timeout=1)
    handle, waiting = _lost_to_silence(op, _ctx())
    assert isinstance(waiting.trigger, SkyPilotWaitTrigger)  # c1 silent: nowhere to go
    FakeBackend.down.discard("c1")  # answers again, before any sweeper ran
    event = {"status": "reprobe", "state": waiting.trigger.state}
    with pytest.raises(TaskDeferred) as placed:
        _op(connections=["c1"], unreachable_timeout=1).execute_complete(_ctx(), event)
    assert placed.value.trigger.handle["job_id"] != handle["job_id"]
    assert _alive() == [placed.value.trigger.handle["job_name"]]


def test_a_cluster_whose_old_copy_is_not_confirmed_dead_takes_no_new_one(monkeypatch):
    """c1 answers again but its old copy does not stop: once the wait for it lapses
    (unreachable_timeout) the job is placed on c2, where it must queue, though c1 could start
    it now (EAGER_NEXT_REGION's "tried last" does not hold c1 back then)."""
    monkeypatch.setattr(FakeBackend, "cancel", lambda self, h: None)
    FakeBackend.offers["c2"] = [offer("c2", "q", price=1.0, gpus_free=0, nodes_free=0,
                                      est_in=3600)]
    op = _op(unreachable_timeout=0.5)
    ctx = _ctx()
    first = _defer(op, ctx)
    handle = first.trigger.handle
    assert handle["connection"] == "c1"
    event = {"status": "done", "handle": handle, "log_tail": "", "log_offset": 0,
             "state": first.trigger.state,
             "job_status": JobStatus.silent("c1", 1, "ssh timeout").to_dict()}
    with pytest.raises(TaskDeferred) as waiting:  # c1 answers now: "still up", so it waits
        op.execute_complete(ctx, event, first.kwargs["state"])
    assert isinstance(waiting.value.trigger, SkyPilotWaitTrigger)
    time.sleep(0.6)
    event = {"status": "reprobe", "state": waiting.value.trigger.state}
    with pytest.raises(TaskDeferred) as placed:
        _op(unreachable_timeout=0.5).execute_complete(_ctx(), event)
    assert placed.value.trigger.handle["connection"] == "c2"
    assert FakeBackend.jobs[handle["job_id"]]["status"].up  # still swept from the trigger
    assert [w.connection for w in RunState.from_dict(placed.value.trigger.state)
            .pending_copies] == ["c1"]


def test_a_new_try_stops_an_earlier_tries_ended_job_that_is_still_partly_up():
    old = _defer(_op(), _ctx(try_number=1)).trigger.handle
    _still_up(old["job_id"], JobState.PREEMPTED)
    new = _defer(_op(), _ctx(try_number=2)).trigger.handle
    assert new["job_id"] != old["job_id"] and not new["adopted"]
    status = FakeBackend.jobs[old["job_id"]]["status"]
    assert (status.state, status.still_up) == (JobState.PREEMPTED, False)


def test_a_retry_after_another_task_of_the_run_was_cleared_adopts_its_job():
    """Airflow moves the run's clear_number when any of its tasks is cleared; only this task
    instance's clear (its max_tries) means "run it again"."""
    def ctx(try_number, clear, max_tries):
        context = _ctx(try_number, clear=clear)
        context["ti"].max_tries = max_tries
        return context

    _defer(_op(retries=2), ctx(1, 0, 2))
    FakeBackend.jobs["1"]["status"] = JobStatus(JobState.RUNNING, started_at=1.0)
    # try 1's worker died; meanwhile another task of the run was cleared (clear_number 1)
    deferred = _defer(_op(retries=2), ctx(2, 1, 2))
    assert deferred.trigger.handle["job_id"] == "1" and len(FakeBackend.jobs) == 1
    assert FakeBackend.jobs["1"]["status"].state == JobState.RUNNING
    # this task cleared (max_tries = try_number + retries): its job is stopped, a new one runs
    deferred = _defer(_op(retries=2), ctx(3, 2, 4))
    assert deferred.trigger.handle["job_id"] == "2"
    assert FakeBackend.jobs["1"]["status"].state == JobState.CANCELLED


def test_a_state_of_an_older_release_keeps_the_tasks_identity_at_a_failover():
    first = _defer(_op(), _ctx())
    old = {k: v for k, v in first.trigger.state.items() if k not in ("prefix", "task_env_id")}
    FakeBackend.jobs["1"]["status"] = JobStatus(JobState.PREEMPTED, reason="spot")
    event = {"status": "done", "handle": first.trigger.handle, "log_tail": "", "log_offset": 0,
             "job_status": FakeBackend.jobs["1"]["status"].to_dict(), "state": old}
    with pytest.raises(TaskDeferred) as info:
        _op().execute_complete(_ctx(), event, state=old)
    new = info.value.trigger.handle
    assert FakeBackend.jobs[new["job_id"]]["env"]["SKYPILOT_TASK_ID"] == \
        FakeBackend.jobs["1"]["env"]["SKYPILOT_TASK_ID"] != ""
    assert new["job_name"].startswith(FakeBackend.jobs["1"]["name"].rsplit("-c", 1)[0])


def test_a_sensor_cleared_or_marked_leaves_the_job_it_watches_alone():
    from airflow_skypilot.sensors import SkyPilotJobSensor

    handle = _op(wait_for_completion=False).execute(_ctx())
    with pytest.raises(TaskDeferred) as info:
        SkyPilotJobSensor(task_id="wait", handle=handle).execute({})
    asyncio.run(info.value.trigger.on_kill())  # the triggerer, as the user clears the sensor
    assert FakeBackend.jobs["1"]["status"].state == JobState.PENDING


class _SharedIdSync(FakeBackend):
    """Slurm after a state loss, as a sweep by prefix finds it: two of the task's copies under
    one job id, an old one that failed and a live one; the answer is keyed by id, the job
    named in the request decides."""

    name = "fake_shared_id_sync"
    state = {"sky-x-c0-t1-a2": JobState.RUNNING, "sky-x-c0-t1-a3": JobState.FAILED}
    cancelled: list[str] = []

    def status(self, handles):
        return {h.job_id: JobStatus(self.state[h.job_name]) for h in handles}

    def cancel(self, handle):
        _SharedIdSync.cancelled.append(handle.job_name)
        _SharedIdSync.state[handle.job_name] = JobState.CANCELLED


def test_a_sweep_asks_two_copies_sharing_an_id_apart_and_stops_the_live_one():
    """Asked together, the one answer for the id went to both: the live copy read failed,
    was never cancelled, and was confirmed dead (its files cleaned up under it)."""
    from airflow_skypilot.backends.base import JobHandle
    from airflow_skypilot.sweeps import step

    live, failed = (JobHandle(backend="fake_shared_id_sync", connection="c1", job_id="1000",
                              job_name=name, location="p", infra="fake/c1/p")
                    for name in ("sky-x-c0-t1-a2", "sky-x-c0-t1-a3"))
    _SharedIdSync.cancelled = []

    class _Listing(_SharedIdSync):
        def find_all(self, prefix):
            return [live, failed]

    sweep = Sweep(connection="c1", prefix="sky-x-", reason="earlier tries")
    assert step(sweep, _Listing("c1"))
    assert _SharedIdSync.cancelled == ["sky-x-c0-t1-a2"]
    assert sorted(sweep.outcome.split(", ")) == ["cancelled", "failed"]
