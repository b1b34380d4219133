"""The trigger and its shared poller: batched polls, tolerance of transient errors, events."""

from __future__ import annotations

import asyncio
import json

import pytest

from airflow_skypilot.backends import registry
from airflow_skypilot.backends.base import JobHandle, JobState, JobStatus
from airflow_skypilot.triggers import skypilot as trig
from airflow_skypilot.triggers.skypilot import (
    SkyPilotJobTrigger,
    SkyPilotSweepTrigger,
    SkyPilotWaitTrigger,
)
from tests.fakes import FakeBackend


@pytest.fixture(autouse=True)
def _fake():
    registry.register_backend(FakeBackend)
    FakeBackend.reset()
    FakeBackend.polls = 0
    yield
    FakeBackend.reset()


def _job(job_id: str, state=JobState.RUNNING, log: str = "") -> JobHandle:
    FakeBackend.jobs[job_id] = {"name": f"n{job_id}", "conn": "c1", "status": JobStatus(state),
                                "location": "p", "log": log, "env": {}}
    return JobHandle(backend="fake", connection="c1", job_id=job_id, job_name=f"n{job_id}",
                     location="p", infra="fake/c1/p")


def test_serialize_round_trips():
    t = SkyPilotJobTrigger({"backend": "fake", "job_id": "1"}, poll_interval=3,
                           unreachable_timeout=20, log_offset=7, stream_logs=False,
                           cancel_on_kill=False, state={"attempt": 1})
    path, kwargs = t.serialize()
    assert path == "airflow_skypilot.triggers.skypilot.SkyPilotJobTrigger"
    again = SkyPilotJobTrigger(**kwargs)
    assert again.serialize() == (path, kwargs)
    w = SkyPilotWaitTrigger(5, state={"x": 1})
    assert SkyPilotWaitTrigger(**w.serialize()[1]).serialize() == w.serialize()
    sweep = SkyPilotSweepTrigger(60, interval=2, state={"sweeps": []})
    assert SkyPilotSweepTrigger(**sweep.serialize()[1]).serialize() == sweep.serialize()


async def _first_event(trigger):
    async for event in trigger.run():
        return event.payload
    return None


async def test_fires_on_terminal_state_with_log_tail_and_state():
    handle = _job("1", log="epoch 1\nepoch 2\ndone\n")

    async def finish():
        await asyncio.sleep(0.15)
        FakeBackend.jobs["1"]["status"] = JobStatus(JobState.FAILED, reason="exit 2",
                                                    exit_code=2)

    t = SkyPilotJobTrigger(handle.to_dict(), poll_interval=0.05, state={"attempt": 0})
    event, _ = await asyncio.gather(_first_event(t), finish())
    assert event["status"] == "done"
    assert JobStatus.from_dict(event["job_status"]).exit_code == 2
    assert event["log_tail"].endswith("done")
    assert event["state"] == {"attempt": 0}
    assert event["log_offset"] == len("epoch 1\nepoch 2\ndone\n")


async def test_fifty_jobs_one_status_request_per_interval():
    handles = [_job(str(i)) for i in range(50)]
    triggers = [SkyPilotJobTrigger(h.to_dict(), poll_interval=0.1) for h in handles]
    tasks = [asyncio.create_task(_first_event(t)) for t in triggers]
    await asyncio.sleep(0.55)
    poller = trig.pollers_in_this_loop()[("fake", "c1")]
    assert 4 <= poller.status_polls <= 7  # ~one per interval, not fifty
    assert poller.log_polls == poller.status_polls
    assert FakeBackend.polls == poller.status_polls
    for job in FakeBackend.jobs.values():
        job["status"] = JobStatus(JobState.SUCCEEDED)
    events = await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert {e["job_status"]["state"] for e in events} == {"succeeded"}
    assert poller._task is None, "the poll loop stops when nobody watches"


async def test_transient_errors_are_tolerated_then_lost():
    handle = _job("1")
    FakeBackend.down = {"c1"}

    async def recover():
        await asyncio.sleep(0.12)
        FakeBackend.down = set()
        FakeBackend.jobs["1"]["status"] = JobStatus(JobState.SUCCEEDED)

    t = SkyPilotJobTrigger(handle.to_dict(), poll_interval=0.05, unreachable_timeout=5)
    event, _ = await asyncio.gather(_first_event(t), recover())
    assert event["job_status"]["state"] == "succeeded"

    handle = _job("2")
    FakeBackend.down = {"c1"}
    t = SkyPilotJobTrigger(handle.to_dict(), poll_interval=0.02, unreachable_timeout=0.2)
    started = asyncio.get_running_loop().time()
    event = await asyncio.wait_for(_first_event(t), 5)
    status = JobStatus.from_dict(event["job_status"])
    assert status.state == JobState.LOST
    assert asyncio.get_running_loop().time() - started >= 0.2, "lost only after the silence"
    assert "no answer about the job from c1 for 0s (unreachable_timeout)" in status.reason


async def test_bad_handle_is_an_error_event_not_a_crash():
    t = SkyPilotJobTrigger({"backend": "nope", "job_id": "1"}, poll_interval=0.01)
    event = await _first_event(t)
    assert event["status"] == "error" and "cannot watch the job" in event["message"]


async def test_on_kill_cancels_unless_told_not_to():
    handle = _job("1")
    await SkyPilotJobTrigger(handle.to_dict(), cancel_on_kill=False).on_kill()
    assert FakeBackend.jobs["1"]["status"].state == JobState.RUNNING
    await SkyPilotJobTrigger(handle.to_dict()).on_kill()
    assert FakeBackend.jobs["1"]["status"].state == JobState.CANCELLED


class _TI:
    """What the triggerer sets as a trigger's ``task_instance`` (the fields on_kill reads)."""

    def __init__(self, map_index: int = -1):
        self.dag_id, self.task_id, self.run_id, self.map_index = "d", "t", "r", map_index


@pytest.mark.parametrize("map_index, key", [(-1, "t"), (3, "t_3")])
@pytest.mark.parametrize("state, cancelled", [
    ("deferred", False),  # the trigger moved to another triggerer: it watches the job now
    ("failed", True), ("success", True), (None, True),  # marked or cleared by a user
])
async def test_on_kill_leaves_the_job_of_a_task_still_deferred(monkeypatch, map_index, key,
                                                                state, cancelled):
    from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

    asked = []

    def get_task_states(**kw):
        asked.append(kw)
        return {"r": {key: state}}

    monkeypatch.setattr(RuntimeTaskInstance, "get_task_states", staticmethod(get_task_states))
    handle = _job("1")
    trigger = SkyPilotJobTrigger(handle.to_dict())
    trigger.task_instance = _TI(map_index)
    await trigger.on_kill()
    assert asked == [{"dag_id": "d", "map_index": map_index, "task_ids": ["t"],
                      "run_ids": ["r"]}]
    assert (FakeBackend.jobs["1"]["status"].state == JobState.CANCELLED) is cancelled


async def test_on_kill_cancels_when_the_task_state_cannot_be_read(monkeypatch):
    from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

    def get_task_states(**kw):
        raise RuntimeError("no supervisor")

    monkeypatch.setattr(RuntimeTaskInstance, "get_task_states", staticmethod(get_task_states))
    handle = _job("1")
    trigger = SkyPilotJobTrigger(handle.to_dict())
    trigger.task_instance = _TI()
    await trigger.on_kill()
    assert FakeBackend.jobs["1"]["status"].state == JobState.CANCELLED


async def test_wait_trigger_hands_back_the_state():
    event = await _first_event(SkyPilotWaitTrigger(0.01, state={"phase": "waiting"}))
    assert event == {"status": "reprobe", "state": {"phase": "waiting"}}


class _SettingsBackend(FakeBackend):
    """Records which thread reads the connection (the SDK call may not run on the loop)."""

    name = "fake_settings"
    reads: list[int] = []

    @property
    def settings(self):
        import threading

        self.reads.append(threading.get_ident())
        return {}


async def test_the_connection_is_read_once_and_off_the_event_loop():
    import threading

    registry.register_backend(_SettingsBackend)
    _SettingsBackend.reads = []
    handles = []
    for i in range(3):
        h = _job(str(i))
        h.backend = "fake_settings"
        handles.append(h)
    triggers = [SkyPilotJobTrigger(h.to_dict(), poll_interval=0.05) for h in handles]
    tasks = [asyncio.create_task(_first_event(t)) for t in triggers]
    await asyncio.sleep(0.2)
    for job in FakeBackend.jobs.values():
        job["status"] = JobStatus(JobState.SUCCEEDED)
    events = await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert {e["job_status"]["state"] for e in events} == {"succeeded"}
    assert len(_SettingsBackend.reads) == 1, "one read for the connection's shared poller"
    assert _SettingsBackend.reads[0] != threading.get_ident(), "read on the event loop thread"


async def test_a_connection_that_cannot_be_read_is_a_poll_error_not_a_crash(monkeypatch):
    async def missing(self):
        raise RuntimeError("The conn_id `c1` isn't defined")

    monkeypatch.setattr(FakeBackend, "aprepare", missing)
    t = SkyPilotJobTrigger(_job("1").to_dict(), poll_interval=0.01, unreachable_timeout=0.05)
    event = await asyncio.wait_for(_first_event(t), 5)
    status = JobStatus.from_dict(event["job_status"])
    assert status.state == JobState.LOST and "isn't defined" in status.reason


def test_a_run_state_travels_as_its_dict():
    import json

    from airflow_skypilot.runstate import RunState

    run = RunState(prefix="sky-x", task_env_id="t", attempt=2, started_at=1.0)
    for trigger in (SkyPilotJobTrigger({"backend": "fake", "job_id": "1"}, state=run),
                    SkyPilotWaitTrigger(1, state=run)):
        kwargs = trigger.serialize()[1]
        assert kwargs["state"] == run.to_dict()
        assert RunState.from_dict(json.loads(json.dumps(kwargs["state"]))) == run


async def test_a_short_interval_that_ended_no_longer_sets_the_pollers_pace():
    fast, slow = _job("1"), _job("2")
    quick = asyncio.create_task(_first_event(SkyPilotJobTrigger(fast.to_dict(),
                                                                poll_interval=0.05)))
    await asyncio.sleep(0.1)
    poller = trig.pollers_in_this_loop()[("fake", "c1")]
    assert poller.interval == 0.05
    FakeBackend.jobs["1"]["status"] = JobStatus(JobState.SUCCEEDED)
    await asyncio.wait_for(quick, 5)
    waiting = asyncio.create_task(_first_event(SkyPilotJobTrigger(slow.to_dict(),
                                                                  poll_interval=60)))
    await asyncio.sleep(0.3)
    assert poller.interval == 60  # was 0.05 for as long as the triggerer lived
    polls = poller.status_polls
    await asyncio.sleep(0.3)
    assert poller.status_polls == polls
    waiting.cancel()


class _RotatedBackend(FakeBackend):
    """Each instance holds the credentials it read when made: after a rotation the old ones
    are refused for ever, a backend made anew reads the new ones."""

    name = "fake_rotated"
    generation = 0

    def __init__(self, conn_id: str):
        super().__init__(conn_id)
        self.credentials = _RotatedBackend.generation

    async def astatus(self, handles):
        if self.credentials != _RotatedBackend.generation:
            raise RuntimeError("AuthFailure: the security token included is expired")
        return await super().astatus(handles)


async def _watched_to_success(backend_cls, meanwhile, timeout=5.0, **trigger_kwargs):
    """Watch job 1 on ``backend_cls`` while ``meanwhile()`` runs, after which the job
    succeeds: the trigger's event."""
    registry.register_backend(backend_cls)
    handle = _job("1")
    handle.backend = backend_cls.name
    t = SkyPilotJobTrigger(handle.to_dict(), **trigger_kwargs)

    async def then_succeed():
        await meanwhile()
        FakeBackend.jobs["1"]["status"] = JobStatus(JobState.SUCCEEDED)

    event, _ = await asyncio.wait_for(asyncio.gather(_first_event(t), then_succeed()), timeout)
    return event


async def test_rotated_credentials_are_read_again_not_taken_for_a_lost_job():
    """A cached client of expired credentials failed every poll: every job on the connection
    was taken for lost, then cancelled and placed again by the operator."""
    _RotatedBackend.generation = 0

    async def rotate():
        await asyncio.sleep(0.1)
        _RotatedBackend.generation += 1
        await asyncio.sleep(0.2)

    event = await _watched_to_success(_RotatedBackend, rotate, poll_interval=0.02,
                                      unreachable_timeout=0.5)
    assert event["job_status"]["state"] == "succeeded"


def test_a_trigger_serialized_by_another_release_still_loads():
    """Airflow fails a trigger whose kwargs its class refuses, and the task's resume cancels
    the job: an upgrade must not kill the jobs in flight."""
    t = SkyPilotJobTrigger({"job_id": "1"}, poll_interval=10.0, max_unreachable=6,
                           added_later=True)
    assert t.unreachable_timeout == 60.0  # six failed polls, as it meant
    assert SkyPilotWaitTrigger(5, added_later=1).seconds == 5
    assert SkyPilotSweepTrigger(5, added_later=1).timeout == 5


async def test_on_kill_without_cancel_on_kill_still_stops_old_copies():
    """cancel_on_kill=False keeps the watched job, not an old copy waiting to be confirmed
    dead: nothing else would stop it."""
    from airflow_skypilot.runstate import RunState, Sweep

    watched, old = _job("1"), _job("2")
    run = RunState(prefix="n")
    run.sweeps.append(Sweep(connection="c1", handle=old.to_dict(), reason="moved away"))
    await SkyPilotJobTrigger(watched.to_dict(), cancel_on_kill=False, state=run).on_kill()
    assert FakeBackend.jobs["1"]["status"].state == JobState.RUNNING
    assert FakeBackend.jobs["2"]["status"].state == JobState.CANCELLED


class _Said:
    """A trigger's log, kept (where Airflow's own log goes depends on who set it up first)."""

    def __init__(self):
        self.lines: list[str] = []

    def __getattr__(self, level):
        return lambda msg, *args, **_: self.lines.append(f"{level}: {msg % args}")


async def test_on_kill_stops_old_copies_and_asks_again_when_the_cancel_fails(monkeypatch):
    """The watched job's backend silent as the task is killed: the cancel raised, the old
    copy waiting to be confirmed dead on another connection was never tried, and nothing
    else would stop either (a task marked failed has no later try). Now the old copy is
    stopped at once, the cancel is asked again and goes through once the backend answers;
    one that never answers is named in the log."""
    from airflow_skypilot.runstate import RunState, Sweep

    monkeypatch.setattr(trig, "ON_KILL_RETRY_WAIT", 0.05)
    watched, old = _job("1"), _job("2")
    FakeBackend.jobs["2"]["conn"] = "c2"
    old = JobHandle.from_dict({**old.to_dict(), "connection": "c2"})
    run = RunState(prefix="n")
    run.sweeps.append(Sweep(connection="c2", handle=old.to_dict(), reason="moved away"))
    FakeBackend.down = {"c1"}

    async def back_up():
        await asyncio.sleep(0.2)
        assert FakeBackend.jobs["2"]["status"].state == JobState.CANCELLED  # not waiting on c1
        FakeBackend.down = set()

    await asyncio.gather(SkyPilotJobTrigger(watched.to_dict(), state=run).on_kill(), back_up())
    assert FakeBackend.jobs["1"]["status"].state == JobState.CANCELLED
    assert FakeBackend.jobs["2"].get("cleaned")  # the cancelled copy's leftovers too

    monkeypatch.setattr(trig, "ON_KILL_CANCEL_BUDGET", 0.3)
    third = _job("3")
    FakeBackend.down = {"c1"}
    killed = SkyPilotJobTrigger(third.to_dict())
    killed._log = said = _Said()
    await killed.on_kill()
    assert FakeBackend.jobs["3"]["status"].state == JobState.RUNNING
    assert any(line.startswith("error: Job 3 on c1 NOT cancelled as the task was killed "
                               "(BackendUnreachable: c1 is down)") for line in said.lines), \
        said.lines


class _BrokenRoundBackend(FakeBackend):
    """A backend whose answer the poll round cannot digest, for a while: the round raises
    outside the backend call (before, the poll loop died, and its watchers waited for ever)."""

    name = "fake_broken_round"
    broken = True

    async def astatus(self, handles):
        if _BrokenRoundBackend.broken:
            return None  # not a dict: the round's own code fails on it
        return await super().astatus(handles)


async def test_a_poll_round_that_fails_is_a_silence_and_the_loop_goes_on():
    _BrokenRoundBackend.broken = True

    async def mend():
        await asyncio.sleep(0.2)
        _BrokenRoundBackend.broken = False

    event = await _watched_to_success(_BrokenRoundBackend, mend, poll_interval=0.02,
                                      unreachable_timeout=30)
    assert event["job_status"]["state"] == "succeeded"


async def test_a_watcher_starts_a_stopped_poll_loop_again(monkeypatch):
    """A poll loop that ended while jobs were still watched (killed by anything): the
    watcher's wait for a result is bounded, counts as a silence, and starts the loop again."""
    monkeypatch.setattr(trig, "POLL_RESULT_GRACE", 0.2)
    handle = _job("1")
    t = SkyPilotJobTrigger(handle.to_dict(), poll_interval=0.02, unreachable_timeout=30)
    watch = asyncio.create_task(_first_event(t))
    await asyncio.sleep(0.1)
    poller = trig.pollers_in_this_loop()[("fake", "c1")]
    poller._task.cancel()  # the loop dies; nobody unsubscribed
    await asyncio.sleep(0.05)
    assert poller._task.done()
    polls = poller.status_polls
    FakeBackend.jobs["1"]["status"] = JobStatus(JobState.SUCCEEDED)
    event = await asyncio.wait_for(watch, 5)
    assert event["job_status"]["state"] == "succeeded"
    assert poller.status_polls > polls, "answered by a poll loop started again"


class _ClosingBackend(FakeBackend):
    name = "fake_closing"
    closed = 0

    async def aclose(self):
        _ClosingBackend.closed += 1


async def test_a_loop_ending_does_not_close_the_backend_a_new_watcher_polls_with():
    """The last watcher leaves (the loop is cancelled) and a new one subscribes before the
    cancelled loop has unwound: the backend the new loop polls with stays open."""
    _ClosingBackend.closed = 0
    first, second = _job("1"), _job("2")
    poller = trig.SharedPoller(_ClosingBackend("c1"), 0.02)
    q1 = poller.subscribe(first, 0.02)
    await asyncio.wait_for(q1.get(), 5)
    poller.unsubscribe(q1)
    q2 = poller.subscribe(second, 0.02)
    for _ in range(3):
        assert isinstance(await asyncio.wait_for(q2.get(), 5), trig.PollResult)
    assert _ClosingBackend.closed == 0, "closed under the loop that polls with it"
    poller.unsubscribe(q2)
    await asyncio.sleep(0.05)
    assert _ClosingBackend.closed == 1  # closed once nobody watches


async def test_a_trigger_started_again_goes_on_where_the_stopped_one_streamed_to(monkeypatch):
    """A triggerer that stops (a deploy, a crash) hands the trigger to another one with the
    deferral's kwargs: before, every line since the deferral was logged again (a long run's
    whole output). The watch XCom carries how far the output was streamed."""
    from types import SimpleNamespace

    from airflow.sdk.execution_time import xcom

    store: dict[str, object] = {}

    async def aset(key, value, **where):
        store[key] = json.loads(json.dumps(value))

    async def aget_one(*, key, **where):
        return store.get(key)

    monkeypatch.setattr(xcom.XCom, "aset", aset)
    monkeypatch.setattr(xcom.XCom, "aget_one", aget_one)
    monkeypatch.setattr(trig, "WATCH_WRITE_EVERY", 0.0)
    ti = SimpleNamespace(dag_id="d", task_id="t", run_id="r", map_index=-1)
    handle = _job("1", log="epoch 1\nepoch 2\n")
    first = SkyPilotJobTrigger(handle.to_dict(), poll_interval=0.02)
    first.task_instance = ti
    lines: dict[int, list[str]] = {1: [], 2: []}

    def recorder(n: int) -> SimpleNamespace:  # the trigger's logger: what reaches the task log
        return SimpleNamespace(info=lambda msg, *a: lines[n].append(msg % a),
                               warning=lambda *a: None, debug=lambda *a: None)

    first._log = recorder(1)
    watch = asyncio.create_task(_first_event(first))
    await asyncio.sleep(0.3)
    watch.cancel()  # the triggerer dies
    assert store[trig.XCOM_WATCH]["log_offset"] == len("epoch 1\nepoch 2\n")
    FakeBackend.jobs["1"]["log"] += "epoch 3\n"
    again = SkyPilotJobTrigger(**first.serialize()[1])  # what the other triggerer loads
    assert again.log_offset == 0
    again.task_instance = ti
    again._log = recorder(2)
    finish = asyncio.get_running_loop().call_later(
        0.2, lambda: FakeBackend.jobs["1"].update(status=JobStatus(JobState.SUCCEEDED)))
    event = await asyncio.wait_for(_first_event(again), 5)
    finish.cancel()
    assert [line for line in lines[1] if line.startswith("[1]")] == ["[1] epoch 1",
                                                                      "[1] epoch 2"]
    assert [line for line in lines[2] if line.startswith("[1]")] == ["[1] epoch 3"]
    assert event["log_offset"] == len("epoch 1\nepoch 2\nepoch 3\n")
    # another job's record (a failover's, the job before) is not this job's offset
    store[trig.XCOM_WATCH] = {**store[trig.XCOM_WATCH], "job_id": "0"}
    other = SkyPilotJobTrigger(handle.to_dict(), poll_interval=0.02)
    other.task_instance = ti
    await other._astart_offset(JobHandle.from_dict(handle.to_dict()))
    assert other._offset == 0


async def test_two_triggers_on_one_job_each_get_the_output_from_their_own_offset():
    """The operator's trigger and a sensor's watch the same job in one triggerer: one log
    offset per job made one of them log lines twice or miss some."""
    handle = _job("1", log="a\nb\n")
    operator = SkyPilotJobTrigger(handle.to_dict(), poll_interval=0.02, log_offset=2)
    sensor = SkyPilotJobTrigger(handle.to_dict(), poll_interval=0.02, log_offset=0)
    seen: dict[str, list[str]] = {"operator": [], "sensor": []}
    for name, t in (("operator", operator), ("sensor", sensor)):
        t._log = type("L", (), {"info": lambda self, msg, *a, n=name: seen[n].append(msg % a),
                                "warning": lambda *a: None, "debug": lambda *a: None})()

    async def more_then_end():
        await asyncio.sleep(0.15)
        FakeBackend.jobs["1"]["log"] += "c\n"
        await asyncio.sleep(0.15)
        FakeBackend.jobs["1"]["status"] = JobStatus(JobState.SUCCEEDED)

    events = await asyncio.wait_for(asyncio.gather(
        _first_event(operator), _first_event(sensor), more_then_end()), 5)
    assert [e["log_offset"] for e in events[:2]] == [6, 6]
    assert [x for x in seen["operator"] if x.startswith("[1]")] == ["[1] b", "[1] c"]
    assert [x for x in seen["sensor"] if x.startswith("[1]")] == ["[1] a", "[1] b", "[1] c"]
    poller = trig.pollers_in_this_loop()[("fake", "c1")]
    # one request while the two are at different offsets, then one once they are together
    assert poller.log_polls <= 2 * poller.status_polls


class _HangingBackend(FakeBackend):
    """The second status call never returns (a call past every bound of its own)."""

    name = "fake_hanging"
    calls = 0

    async def astatus(self, handles):
        _HangingBackend.calls += 1
        if _HangingBackend.calls == 2:
            await asyncio.Event().wait()
        return await super().astatus(handles)


async def test_a_poll_loop_stuck_in_a_backend_call_is_started_again(monkeypatch):
    """Before, only a loop that had ended was started again: one stuck in a call left its
    watchers without answers until the job counted as lost."""
    monkeypatch.setattr(trig, "POLL_RESULT_GRACE", 0.3)
    _HangingBackend.calls = 0
    event = await _watched_to_success(_HangingBackend, lambda: asyncio.sleep(0.3), timeout=10,
                                      poll_interval=0.05, unreachable_timeout=30)
    assert event["job_status"]["state"] == "succeeded"
    assert _HangingBackend.calls >= 3


class _SharedIdBackend(FakeBackend):
    """Slurm after a state loss: job id 1000 is an old job's (gone: lost) and a new job's
    (running); the answer is keyed by id, the job named in the request decides."""

    name = "fake_shared_id"
    asked: list[list[str]] = []

    async def astatus(self, handles):
        _SharedIdBackend.asked.append([h.job_name for h in handles])
        return {h.job_id: JobStatus(JobState.RUNNING if h.job_name == "new" else JobState.LOST)
                for h in handles}


async def test_two_jobs_sharing_an_id_each_get_their_own_status():
    """Both watched by one triggerer: the poll sent one handle per id and gave its answer to
    both (the new job read lost, and was placed again while it ran; or the old job read the
    new one's RUNNING). Now a job sharing an id with another is asked in a request of its
    own, and each watcher gets its job's answer."""
    registry.register_backend(_SharedIdBackend)
    _SharedIdBackend.asked = []
    old, new = (JobHandle(backend="fake_shared_id", connection="c1", job_id="1000",
                          job_name=name, location="p", infra="fake/c1/p")
                for name in ("old", "new"))
    watch_new = asyncio.create_task(_first_event(SkyPilotJobTrigger(
        new.to_dict(), poll_interval=0.01, unreachable_timeout=60)))
    event = await asyncio.wait_for(_first_event(SkyPilotJobTrigger(
        old.to_dict(), poll_interval=0.01, unreachable_timeout=60)), 5)
    assert event["job_status"]["state"] == "lost"
    assert not watch_new.done()  # the new job runs on, watched
    watch_new.cancel()
    assert ["old"] in _SharedIdBackend.asked and ["new"] in _SharedIdBackend.asked


class _SharedIdLogBackend(_SharedIdBackend):
    """The same two jobs under id 1000, each with its own output; a log answer is keyed by
    id, the job named in the request decides."""

    name = "fake_shared_id_logs"
    log_asked: list[list[str]] = []

    async def aread_logs(self, requests):
        _SharedIdLogBackend.log_asked.append([h.job_name for h, _ in requests])
        return {h.job_id: (f"output of {h.job_name}\n", offset + 1) for h, offset in requests}


async def test_two_jobs_sharing_an_id_each_stream_their_own_output():
    """Statuses were asked apart, logs not: one request per id, its answer given to both
    watchers, so one job's output was streamed as the other's."""
    from airflow_skypilot.triggers._poller import SharedPoller

    _SharedIdLogBackend.log_asked = []
    old, new = (JobHandle(backend="fake_shared_id_logs", connection="c1", job_id="1000",
                          job_name=name, location="p", infra="fake/c1/p")
                for name in ("old", "new"))
    poller = SharedPoller(_SharedIdLogBackend("c1"), 0.01)
    queues = {h.job_name: poller.subscribe(h, 0.01) for h in (old, new)}
    try:
        got = {name: await asyncio.wait_for(q.get(), 5) for name, q in queues.items()}
    finally:
        for q in queues.values():
            poller.unsubscribe(q)
    assert got["old"].log == "output of old\n" and got["new"].log == "output of new\n"
    assert got["old"].status.state == JobState.LOST
    assert got["new"].status.state == JobState.RUNNING
    assert sorted(map(sorted, _SharedIdLogBackend.log_asked[:2])) == [["new"], ["old"]]
