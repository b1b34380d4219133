"""Placement is not a one-time guess: a job waiting in a queue moves when another place starts
it clearly sooner. The trigger looks (read-only), the operator moves; over the in-memory
backend. The real clusters go through it in tests/e2e."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest
from airflow.sdk.exceptions import TaskDeferred

from airflow_skypilot import rebalance
from airflow_skypilot.backends.base import JobState, JobStatus
from airflow_skypilot.operators import SkyPilotOperator
from airflow_skypilot.runstate import RunState
from airflow_skypilot.spec import load_task
from airflow_skypilot.spec.task import Task
from tests.fakes import FakeBackend, offer


class TI:
    def __init__(self):
        self.dag_id, self.task_id, self.run_id = "dag", "train", "manual__1"
        self.try_number, self.map_index, self.start_date = 1, -1, None
        self.xcom: dict = {}

    def xcom_push(self, key, value):
        self.xcom[key] = json.loads(json.dumps(value))


def _ctx():
    return {"ti": TI(), "dag_run": SimpleNamespace(clear_number=0, start_date=None)}


pytestmark = pytest.mark.usefixtures("c1_queues_c2_full")


def _op(**kw):
    kw.setdefault("deferrable", True)
    kw.setdefault("confirm_timeout", 0.2)
    kw.setdefault("reprobe_interval", 0.05)
    kw.setdefault("poll_interval", 0.01)
    return SkyPilotOperator(task_id="train", task={"resources": {"accelerators": "A100:1"},
                                                   "run": "train"},
                            connections=["c1", "c2"], **kw)


async def _first(trigger):
    async for event in trigger.run():
        return event.payload


def _waiting_on_c1():
    with pytest.raises(TaskDeferred) as info:
        _op().execute(_ctx())
    deferred = info.value
    assert deferred.trigger.handle["connection"] == "c1"
    return deferred


def test_the_trigger_looks_again_and_asks_to_move_when_another_place_frees_up():
    deferred = _waiting_on_c1()
    spec = deferred.trigger.reconsider
    assert spec["places"] == ["c1/p", "c2/q"] and "secrets" not in json.dumps(spec)
    FakeBackend.offers["c2"] = [offer("c2", "q")]  # c2 frees up while the job waits on c1
    event = asyncio.run(asyncio.wait_for(_first(deferred.trigger), 5))
    assert event["status"] == "move" and event["to"]["connection"] == "c2"
    assert event["reason"].endswith("c2/q can start it now; here est. in 1h00m")
    assert FakeBackend.jobs["1"]["status"].state == JobState.PENDING, "the trigger only asks"


def test_the_operator_cancels_the_waiting_copy_and_submits_at_the_new_place():
    deferred = _waiting_on_c1()
    FakeBackend.offers["c2"] = [offer("c2", "q")]
    event = asyncio.run(asyncio.wait_for(_first(deferred.trigger), 5))
    with pytest.raises(TaskDeferred) as info:
        _op().execute_complete(_ctx(), event)
    new = info.value.trigger.handle
    assert new["connection"] == "c2" and new["job_name"].endswith("-a1")
    assert FakeBackend.jobs["1"]["status"].state == JobState.CANCELLED
    assert FakeBackend.jobs["1"]["env"]["SKYPILOT_TASK_ID"] == \
        FakeBackend.jobs["2"]["env"]["SKYPILOT_TASK_ID"]
    run = RunState.from_dict(info.value.trigger.state)
    assert run.moves == 1 and [a.state for a in run.attempts] == ["moved", "pending"]
    assert run.attempts[0].reason.startswith("moved to c2/q: ")
    FakeBackend.jobs["2"]["status"] = JobStatus(JobState.SUCCEEDED, exit_code=0,
                                                started_at=10.0, ended_at=20.0)
    done = {"status": "done", "handle": new, "log_tail": "", "log_offset": 0,
            "state": info.value.trigger.state,
            "job_status": FakeBackend.jobs["2"]["status"].to_dict()}
    result = _op().execute_complete(_ctx(), done)
    assert [(a["connection"], a["state"]) for a in result["attempts"]] == [
        ("c1", "moved"), ("c2", "succeeded")]
    assert result["old_copies"][0]["confirmed_dead"] is True


def test_a_copy_that_started_meanwhile_is_not_moved():
    deferred = _waiting_on_c1()
    FakeBackend.offers["c2"] = [offer("c2", "q")]
    event = asyncio.run(asyncio.wait_for(_first(deferred.trigger), 5))
    FakeBackend.jobs["1"]["status"] = JobStatus(JobState.RUNNING, started_at=time.time())
    with pytest.raises(TaskDeferred) as info:
        _op().execute_complete(_ctx(), event)
    assert info.value.trigger.handle["job_id"] == "1" and len(FakeBackend.jobs) == 1
    assert FakeBackend.jobs["1"]["status"].state == JobState.RUNNING


def test_no_move_without_a_clear_margin_or_with_moves_off():
    deferred = _waiting_on_c1()
    FakeBackend.offers["c2"] = [offer("c2", "q", nodes_free=0, est_in=3000)]  # 10 min sooner
    trigger = deferred.trigger

    async def watch():
        task = asyncio.create_task(_first(trigger))
        await asyncio.sleep(0.3)  # several looks
        FakeBackend.jobs["1"]["status"] = JobStatus(JobState.SUCCEEDED, exit_code=0)
        return await asyncio.wait_for(task, 5)

    assert asyncio.run(watch())["status"] == "done"
    FakeBackend.jobs.clear()
    with pytest.raises(TaskDeferred) as info:
        _op(max_moves=0).execute(_ctx())
    assert info.value.trigger.reconsider is None


@pytest.mark.parametrize(("paid_move_min_wait", "moves"), [(None, False), (0, True)])
def test_a_short_wait_is_not_paid_away_unless_the_setting_is_off(paid_move_min_wait, moves):
    """c1 estimates the start in 20 minutes; a paid place frees up: by default (30 min) the
    job stays where it waits; with ``paid_move_min_wait=0`` it moves."""
    FakeBackend.offers["c1"] = [offer("c1", "p", nodes_free=0, est_in=1200)]
    kw = {} if paid_move_min_wait is None else {"paid_move_min_wait": paid_move_min_wait}
    with pytest.raises(TaskDeferred) as info:
        _op(**kw).execute(_ctx())
    trigger = info.value.trigger
    assert trigger.reconsider["paid_min_wait"] == (1800 if paid_move_min_wait is None else 0)
    FakeBackend.offers["c2"] = [offer("c2", "q", price=3.0)]  # a paid place frees up

    async def watch():
        task = asyncio.create_task(_first(trigger))
        await asyncio.sleep(0.3)  # several looks
        if not task.done():
            FakeBackend.jobs["1"]["status"] = JobStatus(JobState.SUCCEEDED, exit_code=0)
        return await asyncio.wait_for(task, 5)

    event = asyncio.run(watch())
    assert event["status"] == ("move" if moves else "done")
    if moves:
        assert event["to"]["connection"] == "c2" and event["reason"].endswith("$3/h vs $0/h")


def test_the_worker_moves_a_waiting_job_too_when_not_deferrable(monkeypatch):
    FakeBackend.offers["c1"] = [offer("c1", "p", nodes_free=0, est_in=3600)]
    real = FakeBackend.astatus
    polls = [0]

    async def astatus(self, handles):
        polls[0] += 1
        if polls[0] == 3:  # c2 frees up while the job waits on c1
            FakeBackend.offers["c2"] = [offer("c2", "q")]
        for h in handles:
            job = FakeBackend.jobs[h.job_id]
            if job["conn"] == "c2" and not job["status"].state.terminal:
                job["status"] = JobStatus(JobState.SUCCEEDED, exit_code=0)
        return await real(self, handles)

    monkeypatch.setattr(FakeBackend, "astatus", astatus)
    result = _op(deferrable=False).execute(_ctx())
    assert [(a["connection"], a["state"]) for a in result["attempts"]] == [
        ("c1", "moved"), ("c2", "succeeded")]
    assert FakeBackend.jobs["1"]["status"].state == JobState.CANCELLED


def test_the_capacity_view_carries_no_secrets_envs_or_scripts():
    task = load_task({"name": "t", "num_nodes": 2, "envs": {"E": "v"},
                      "secrets": {"S": "hunter2"}, "run": "echo $S",
                      "resources": {"accelerators": {"A100": 1, "H100": 1}, "cpus": "4+"},
                      "config": {"slurm": {"sbatch_options": {"exclusive": True}}}})
    view = task.capacity_view()
    text = json.dumps(view)
    assert "hunter2" not in text and "echo" not in text and '"E"' not in text
    again = Task.from_capacity_view(json.loads(text))
    assert again.num_nodes == 2 and not again.secrets and not again.envs
    assert [(c.accelerator, c.cpus) for c in again.candidates] == \
        [(c.accelerator, c.cpus) for c in task.candidates]
    assert again.config == {"slurm": {"sbatch_options": {"exclusive": True}}}


def test_no_move_when_the_target_is_taken_before_the_move(monkeypatch):
    """Several waiting jobs may pick one free place in one look: the move probes the target
    again and stays where it is when the place is gone."""
    deferred = _waiting_on_c1()
    FakeBackend.offers["c2"] = [offer("c2", "q")]
    event = asyncio.run(asyncio.wait_for(_first(deferred.trigger), 5))
    FakeBackend.offers["c2"] = [offer("c2", "q", nodes_free=0, est_in=None)]  # taken meanwhile
    with pytest.raises(TaskDeferred) as info:
        _op().execute_complete(_ctx(), event)
    assert info.value.trigger.handle["job_id"] == "1" and len(FakeBackend.jobs) == 1
    assert FakeBackend.jobs["1"]["status"].state == JobState.PENDING


def test_the_place_left_is_blocked_so_the_job_does_not_move_back():
    deferred = _waiting_on_c1()
    FakeBackend.offers["c2"] = [offer("c2", "q")]
    event = asyncio.run(asyncio.wait_for(_first(deferred.trigger), 5))
    with pytest.raises(TaskDeferred) as info:
        _op().execute_complete(_ctx(), event)
    spec = rebalance.ReconsiderSpec.from_dict(info.value.trigger.reconsider)
    assert [b["place"] for b in spec.blocked] == ["c1/p"] and spec.moves == 1
    # c2 turns out slow and c1 frees up: the job stays on c2 for the cooldown
    FakeBackend.jobs["2"]["status"] = JobStatus(JobState.PENDING)
    FakeBackend.offers = {"c1": [offer("c1", "p")],
                          "c2": [offer("c2", "q", nodes_free=0, est_in=7200)]}
    rebalance._cache.clear()
    trigger = info.value.trigger

    async def watch():
        task = asyncio.create_task(_first(trigger))
        await asyncio.sleep(0.3)
        FakeBackend.jobs["2"]["status"] = JobStatus(JobState.SUCCEEDED, exit_code=0)
        return await asyncio.wait_for(task, 5)

    assert asyncio.run(watch())["status"] == "done"


def _live_jobs():
    return sorted(k for k, j in FakeBackend.jobs.items() if not j["status"].state.terminal)


def _a_move_whose_cancel_goes_unanswered(monkeypatch):
    """A job waits on c1, c2 frees up, and c1's login node stops answering as the move's
    cancel is sent: (the operator's deferral after it, the real cancel to put back)."""
    deferred = _waiting_on_c1()
    FakeBackend.offers["c2"] = [offer("c2", "q")]
    event = asyncio.run(asyncio.wait_for(_first(deferred.trigger), 5))
    real_cancel = FakeBackend.cancel

    def cancel(self, handle):
        if self.conn_id == "c1":
            FakeBackend.down.add("c1")
        return real_cancel(self, handle)

    monkeypatch.setattr(FakeBackend, "cancel", cancel)
    with pytest.raises(TaskDeferred) as info:
        _op().execute_complete(_ctx(), event)
    return info, real_cancel


def test_a_move_whose_cancel_is_not_confirmed_submits_nothing_until_it_is(monkeypatch):
    """The waiting copy was healthy: if its backend goes silent at the cancel, a new copy now
    could start beside it. None is submitted until the old one is confirmed dead."""
    from airflow_skypilot.triggers.skypilot import SkyPilotWaitTrigger

    info, real_cancel = _a_move_whose_cancel_goes_unanswered(monkeypatch)
    assert isinstance(info.value.trigger, SkyPilotWaitTrigger)
    assert list(FakeBackend.jobs) == ["1"] and _live_jobs() == ["1"]
    run = RunState.from_dict(info.value.trigger.state)
    assert [(a.state, a.confirmed_dead) for a in run.attempts] == [("moved", False)]
    assert [w.before_next for w in run.pending_sweeps] == [True]
    assert "not confirmed dead yet" in run.last_plan
    # still silent at the next probe: still nothing submitted
    reprobe = asyncio.run(asyncio.wait_for(_first(info.value.trigger), 5))
    with pytest.raises(TaskDeferred) as again:
        _op().execute_complete(_ctx(), reprobe)
    assert isinstance(again.value.trigger, SkyPilotWaitTrigger) and list(FakeBackend.jobs) == ["1"]
    # c1 answers: the wait's sweep cancels the old copy, then the job is placed on c2
    FakeBackend.down.discard("c1")
    monkeypatch.setattr(FakeBackend, "cancel", real_cancel)
    reprobe = asyncio.run(asyncio.wait_for(_first(again.value.trigger), 5))
    assert FakeBackend.jobs["1"]["status"].state == JobState.CANCELLED
    with pytest.raises(TaskDeferred) as placed:
        _op().execute_complete(_ctx(), reprobe)
    assert placed.value.trigger.handle["connection"] == "c2" and _live_jobs() == ["2"]


def test_a_status_blip_after_a_confirmed_cancel_does_not_fail_the_move(monkeypatch):
    from airflow_skypilot.placer import Placer

    deferred = _waiting_on_c1()
    FakeBackend.offers["c2"] = [offer("c2", "q")]
    event = asyncio.run(asyncio.wait_for(_first(deferred.trigger), 5))
    real_stop = Placer.stop_copy

    def stop_copy(self, *args, **kwargs):  # confirmed dead, then c1 blips
        sweep = real_stop(self, *args, **kwargs)
        FakeBackend.down.add("c1")
        return sweep

    monkeypatch.setattr(Placer, "stop_copy", stop_copy)
    with pytest.raises(TaskDeferred) as info:
        _op().execute_complete(_ctx(), event)
    assert info.value.trigger.handle["connection"] == "c2" and _live_jobs() == ["2"]


def test_a_copy_that_starts_while_the_target_is_probed_again_is_not_cancelled(monkeypatch):
    deferred = _waiting_on_c1()
    FakeBackend.offers["c2"] = [offer("c2", "q")]
    event = asyncio.run(asyncio.wait_for(_first(deferred.trigger), 5))
    real_probe = FakeBackend.probe

    def probe(self, task):  # the probe of the target takes a while: job 1 starts meanwhile
        if self.conn_id == "c2":
            FakeBackend.jobs["1"]["status"] = JobStatus(JobState.RUNNING, started_at=time.time())
        return real_probe(self, task)

    monkeypatch.setattr(FakeBackend, "probe", probe)
    with pytest.raises(TaskDeferred) as info:
        _op().execute_complete(_ctx(), event)
    assert info.value.trigger.handle["job_id"] == "1" and list(FakeBackend.jobs) == ["1"]
    assert FakeBackend.jobs["1"]["status"].state == JobState.RUNNING


def test_a_moved_copy_that_never_started_costs_nothing():
    from airflow_skypilot.runstate import Attempt

    queued = Attempt(connection="c1", backend="slurm", state="moved", submitted_at=1000.0,
                     ended_at=8200.0, gpus=1, price_per_hour=2.0)
    assert queued.hours() == 0.0  # two hours in a queue hold no GPU
    launching = Attempt(connection="a", backend="aws", state="moved", submitted_at=1000.0,
                        ended_at=1600.0, gpus=1, price_per_hour=2.0)
    assert launching.hours() == pytest.approx(600 / 3600)  # an instance bills from launch


def test_looks_that_overlap_a_probe_under_way_wait_for_it_instead_of_probing_again(
        monkeypatch):
    from airflow_skypilot.backends.base import JobHandle

    calls = []
    real = FakeBackend.probe

    def slow_probe(self, task):
        calls.append(self.conn_id)
        time.sleep(0.3)
        return real(self, task)

    monkeypatch.setattr(FakeBackend, "probe", slow_probe)
    task = load_task({"resources": {"accelerators": "A100:1"}, "run": "x"})
    spec = rebalance.ReconsiderSpec(connections=["c1"], task=task.capacity_view(),
                                    places=["c1/p"], interval=60)
    handles = [JobHandle(backend="fake", connection="c1", job_id=str(i), job_name=f"j{i}",
                         location="p", infra="x") for i in range(12)]

    async def looks():
        return await asyncio.gather(*[rebalance.adecide(spec, h, JobStatus(JobState.PENDING))
                                      for h in handles])

    decisions = asyncio.run(looks())
    assert calls == ["c1"]  # one probe for twelve looks (six before: one per pool thread)
    assert all(d.look.place == "c1/p" for d in decisions)


def test_a_task_killed_while_its_move_waits_for_the_old_copy_stops_it_at_the_kill(monkeypatch):
    """The move's cancel was not confirmed and the task waits; the user marks it failed: the
    wait trigger's kill tries the old copy once more (no later try would sweep it)."""
    from airflow_skypilot.triggers.skypilot import SkyPilotWaitTrigger

    info, real_cancel = _a_move_whose_cancel_goes_unanswered(monkeypatch)
    waiting = info.value.trigger
    assert isinstance(waiting, SkyPilotWaitTrigger) and _live_jobs() == ["1"]
    FakeBackend.down.discard("c1")
    monkeypatch.setattr(FakeBackend, "cancel", real_cancel)
    asyncio.run(waiting.on_kill())  # no task instance to ask: killed, as the user asked
    assert _live_jobs() == [] and FakeBackend.jobs["1"]["status"].state == JobState.CANCELLED


def test_a_move_the_target_refuses_queues_the_job_where_it_was_at_once():
    """The waiting copy is cancelled, then the target refuses the submission (capacity gone):
    the place left is not blocked for the cooldown, the job queues there again at once."""
    deferred = _waiting_on_c1()
    FakeBackend.offers["c2"] = [offer("c2", "q")]
    event = asyncio.run(asyncio.wait_for(_first(deferred.trigger), 5))
    FakeBackend.refusing.add("c2")
    with pytest.raises(TaskDeferred) as info:
        _op().execute_complete(_ctx(), event)
    handle = info.value.trigger.handle
    assert handle is not None and handle["connection"] == "c1" and _live_jobs() == ["2"]
    run = RunState.from_dict(info.value.trigger.state)
    assert [b.place for b in run.blocked] == ["c2/q"] and run.moves == 1


def _a_move_whose_target_rose_once_probed_again(est_in: float, **op_kw) -> tuple[dict, dict]:
    """The job waits on c1 (``est_in``); c2 frees up at c1's price and the look asks to move;
    probed again, c2's (spot) price ticked up 4.5%, within a move's 5% margin. The move event
    and the handle the operator then watches."""
    FakeBackend.offers = {"c1": [offer("c1", "p", nodes_free=0, est_in=est_in, price=2.0)],
                          "c2": [offer("c2", "q", nodes_free=0, est_in=None, price=2.0)]}
    with pytest.raises(TaskDeferred) as info:
        _op(**op_kw).execute(_ctx())
    assert info.value.trigger.handle["connection"] == "c1"
    FakeBackend.offers["c2"] = [offer("c2", "q", price=2.0)]
    event = asyncio.run(asyncio.wait_for(_first(info.value.trigger), 5))
    assert event["status"] == "move"
    FakeBackend.offers["c2"] = [offer("c2", "q", price=2.09)]
    with pytest.raises(TaskDeferred) as after:
        _op(**op_kw).execute_complete(_ctx(), event)
    return event, after.value.trigger.handle


def test_under_cheapest_a_move_whose_target_costs_more_than_here_once_probed_again_stays():
    """The look chose a place at this one's price; probed again, it costs more: "cheapest"
    never moves to a costlier place."""
    _, handle = _a_move_whose_target_rose_once_probed_again(3600, policy="cheapest")
    assert handle["job_id"] == "1" and _live_jobs() == ["1"]


def test_a_move_made_for_a_short_wait_at_no_more_cost_stays_so_once_probed_again():
    """Under fastest, a job 20 minutes from its start may move only to a place that costs no
    more (``paid_move_min_wait``); probed again, the target costs more: the move is called
    off, as under cheapest."""
    event, handle = _a_move_whose_target_rose_once_probed_again(1200)
    assert event["to"]["details"]["no_costlier"] is True
    assert handle["job_id"] == "1" and _live_jobs() == ["1"]
    # a long wait here: the same price rise is within the move's margin, the job moves
    FakeBackend.jobs.clear()
    event, handle = _a_move_whose_target_rose_once_probed_again(3600)
    assert "no_costlier" not in event["to"]["details"]
    assert handle["connection"] == "c2"


class _Killed(BaseException):
    """What Airflow's SIGTERM handler raises in the task after calling ``on_kill``."""


@pytest.mark.parametrize("at", ["the target's probe", "the submission at the target"])
def test_a_task_killed_while_it_moves_its_job_leaves_no_copy_running(monkeypatch, at):
    """Each resume is a fresh operator: a kill during a move (the target probed again, or
    the new copy just submitted) stops the waiting copy and the new one alike."""
    deferred = _waiting_on_c1()
    FakeBackend.offers["c2"] = [offer("c2", "q")]
    event = asyncio.run(asyncio.wait_for(_first(deferred.trigger), 5))
    worker = _op()
    real_probe, real_submit = FakeBackend.probe, FakeBackend.submit

    def probe(self, task):
        if self.conn_id == "c2" and at == "the target's probe":
            worker.on_kill()
            raise _Killed()
        return real_probe(self, task)

    def submit(self, task, offer_, job_name, env):
        handle = real_submit(self, task, offer_, job_name, env)
        if at == "the submission at the target":  # made, its answer not yet back
            worker.on_kill()
            raise _Killed()
        return handle

    monkeypatch.setattr(FakeBackend, "probe", probe)
    monkeypatch.setattr(FakeBackend, "submit", submit)
    with pytest.raises(_Killed):
        worker.execute_complete(_ctx(), event)
    assert _live_jobs() == []
    assert len(FakeBackend.jobs) == (1 if at == "the target's probe" else 2)


def test_a_moves_waiting_copy_that_answers_alive_holds_the_next_copy_for_ever(monkeypatch):
    """Its cancel does not take and c1 says it still waits: it may start any time, so the
    wait for it never lapses (a copy still stopping after a failure lapses after
    unreachable_timeout; this one is healthy)."""
    from airflow_skypilot.triggers.skypilot import SkyPilotWaitTrigger

    deferred = _waiting_on_c1()
    FakeBackend.offers["c2"] = [offer("c2", "q")]
    event = asyncio.run(asyncio.wait_for(_first(deferred.trigger), 5))
    monkeypatch.setattr(FakeBackend, "cancel", lambda self, h: None)
    with pytest.raises(TaskDeferred) as info:
        _op(unreachable_timeout=0).execute_complete(_ctx(), event)
    assert isinstance(info.value.trigger, SkyPilotWaitTrigger)
    run = RunState.from_dict(info.value.trigger.state)
    assert [(w.before_next, w.lapses) for w in run.pending_sweeps] == [(True, False)]
    with pytest.raises(TaskDeferred) as again:  # unreachable_timeout 0 is long past
        _op(unreachable_timeout=0).execute_complete(
            _ctx(), {"status": "reprobe", "state": info.value.trigger.state})
    assert isinstance(again.value.trigger, SkyPilotWaitTrigger) and _live_jobs() == ["1"]


def test_a_task_killed_in_the_worker_stops_the_old_copies_still_to_confirm(monkeypatch):
    """A move's cancel went unanswered (the old copy to confirm); the task resumes to place
    again, still cannot confirm it, and is killed: the kill tries the old copy once more (with
    no retry left nobody else would)."""
    from airflow_skypilot.placer import Placer

    info, real_cancel = _a_move_whose_cancel_goes_unanswered(monkeypatch)
    monkeypatch.setattr(FakeBackend, "cancel", real_cancel)
    worker = _op()
    real_unconfirmed = Placer._unconfirmed_copy

    def unconfirmed(self, run, **kwargs):
        waiting = real_unconfirmed(self, run, **kwargs)  # c1 silent: still to confirm
        assert waiting and _live_jobs() == ["1"]
        FakeBackend.down.discard("c1")  # it answers again as the user kills the task
        worker.on_kill()
        raise _Killed()

    monkeypatch.setattr(Placer, "_unconfirmed_copy", unconfirmed)
    with pytest.raises(_Killed):
        worker.execute_complete(_ctx(), {"status": "reprobe",
                                         "state": info.value.trigger.state})
    assert _live_jobs() == [] and FakeBackend.jobs["1"]["status"].state == JobState.CANCELLED


def test_a_moved_copy_is_cleaned_up_once_its_start_is_read(monkeypatch):
    """A cancelled Kubernetes Job stays (suspended, no TTL) until cleanup: the move cleans up
    after its old copy, but only after reading whether it had started (a deleted Job has no
    start: the copy's time, and cost, would be lost)."""
    deferred = _waiting_on_c1()
    FakeBackend.offers["c2"] = [offer("c2", "q")]
    event = asyncio.run(asyncio.wait_for(_first(deferred.trigger), 5))

    def cancel(self, handle):  # it had started just before the cancel
        FakeBackend.jobs[handle.job_id]["status"] = JobStatus(JobState.CANCELLED,
                                                              started_at=123.0)

    def cleanup(self, handle):  # as Kubernetes deletes a cancelled Job: gone from then on
        FakeBackend.jobs.pop(handle.job_id, None)

    monkeypatch.setattr(FakeBackend, "cancel", cancel)
    monkeypatch.setattr(FakeBackend, "cleanup", cleanup)
    with pytest.raises(TaskDeferred) as info:
        _op().execute_complete(_ctx(), event)
    run = RunState.from_dict(info.value.trigger.state)
    assert run.attempts[0].state == "moved" and run.attempts[0].started_at == 123.0
    assert [j["name"][-2:] for j in FakeBackend.jobs.values()] == ["a1"]  # a0 cleaned up
