"""``SkyPilotJobSensor`` over the in-memory backend: deferred and poke mode, every outcome."""

from __future__ import annotations

import json

import pytest
from airflow.sdk.exceptions import AirflowException, AirflowFailException, TaskDeferred

from airflow_skypilot.backends import registry
from airflow_skypilot.backends.base import JobHandle, JobState, JobStatus
from airflow_skypilot.sensors import SkyPilotJobSensor
from airflow_skypilot.triggers.skypilot import SkyPilotJobTrigger
from tests.fakes import FakeBackend

LOG = "".join(f"step {i}\n" for i in range(100)) + "Traceback: boom\n"


@pytest.fixture(autouse=True)
def _fake():
    registry.register_backend(FakeBackend)
    FakeBackend.reset()
    yield
    FakeBackend.reset()


@pytest.fixture
def handle() -> JobHandle:
    FakeBackend.jobs["1"] = {"name": "sky-x-a0", "conn": "c1", "env": {}, "location": "p",
                             "status": JobStatus(JobState.RUNNING), "log": LOG}
    return JobHandle(backend="fake", connection="c1", job_id="1", job_name="sky-x-a0",
                     location="p", infra="fake/c1/p")


def _end(state: JobState, reason: str = "", exit_code: int | None = None) -> JobStatus:
    status = JobStatus(state, reason=reason, exit_code=exit_code, started_at=10.0, ended_at=70.0)
    FakeBackend.jobs["1"]["status"] = status
    return status


def _sensor(handle, **kw) -> SkyPilotJobSensor:
    return SkyPilotJobSensor(task_id="wait", handle=handle, **kw)


def _event(handle: JobHandle, status: JobStatus, tail: str = "Traceback: boom") -> dict:
    return {"status": "done", "handle": handle.to_dict(), "job_status": status.to_dict(),
            "log_tail": tail, "log_offset": len(LOG)}


# --- deferrable (the default) ------------------------------------------------------------------
def test_defers_to_the_job_trigger_with_its_settings(handle):
    sensor = _sensor(handle.to_dict(), poke_interval=3, unreachable_timeout=40,
                     stream_logs=False, timeout=600)
    assert sensor.deferrable is True
    with pytest.raises(TaskDeferred) as info:
        sensor.execute({})
    deferred = info.value
    assert isinstance(deferred.trigger, SkyPilotJobTrigger)
    assert deferred.method_name == "execute_complete" and deferred.timeout == 600
    trigger = deferred.trigger
    assert JobHandle.from_dict(trigger.handle) == handle
    assert (trigger.poll_interval, trigger.unreachable_timeout, trigger.stream_logs) == \
        (3, 40, False)
    assert trigger.state is None  # the sensor places nothing: no run state to carry


@pytest.mark.parametrize("rendered", ["json", "python"])
def test_a_rendered_handle_text_is_read(handle, rendered):
    # `{{ ti.xcom_pull(...) }}` renders a dict as JSON or, without native rendering, as repr
    text = json.dumps(handle.to_dict()) if rendered == "json" else repr(handle.to_dict())
    with pytest.raises(TaskDeferred) as info:
        _sensor(text).execute({})
    assert info.value.trigger.handle["job_id"] == "1"


def test_something_that_is_not_a_handle_fails(handle):
    with pytest.raises(AirflowException, match="must be a SkyPilot job handle"):
        _sensor({"connection": "c1"}).execute({})


def test_success_event_returns_the_result(handle):
    status = _end(JobState.SUCCEEDED, exit_code=0)
    result = _sensor(handle.to_dict()).execute_complete({}, _event(handle, status))
    assert result == {"state": "succeeded", "connection": "c1", "location": "p", "job_id": "1",
                      "started_at": 10.0, "ended_at": 70.0}


def test_user_failure_event_raises_with_the_log_tail(handle):
    status = _end(JobState.FAILED, reason="exit code 3", exit_code=3)
    with pytest.raises(AirflowException) as info:
        _sensor(handle.to_dict()).execute_complete({}, _event(handle, status))
    assert "job 1 on c1 ended: failed: exit code 3" in str(info.value)
    assert str(info.value).endswith("Last lines of its log:\nTraceback: boom")


def test_infra_failure_event_raises_and_is_not_placed_again(handle):
    status = _end(JobState.PREEMPTED, reason="spot reclaimed")
    with pytest.raises(AirflowException, match="infrastructure failure: spot reclaimed"):
        _sensor(handle.to_dict()).execute_complete({}, _event(handle, status))
    assert len(FakeBackend.jobs) == 1


@pytest.mark.parametrize("event", [None, {"status": "error", "message": "cannot watch"}])
def test_an_error_event_fails(handle, event):
    with pytest.raises(AirflowException, match="watching the job failed"):
        _sensor(handle.to_dict()).execute_complete({}, event)


# --- poke mode ---------------------------------------------------------------------------------
def test_poke_is_not_done_while_the_job_runs(handle):
    assert _sensor(handle.to_dict(), deferrable=False).poke({}) is False


def test_poke_mode_returns_the_result_as_the_deferred_sensor_does(handle):
    _end(JobState.SUCCEEDED, exit_code=0)
    sensor = _sensor(handle.to_dict(), deferrable=False, poke_interval=0.01, timeout=5)
    done = sensor.poke({})
    assert done.is_done and done.xcom_value["state"] == "succeeded"
    assert sensor.execute({}) == done.xcom_value  # what XCom gets


def test_poke_mode_user_failure_raises_with_the_log_tail(handle):
    _end(JobState.FAILED, reason="exit code 3", exit_code=3)
    # final (poking again cannot help): Airflow's poke loop then honours soft_fail as the
    # deferred sensor does (it skipped there and failed here before)
    with pytest.raises(AirflowFailException) as info:
        _sensor(handle.to_dict(), deferrable=False).poke({})
    message = str(info.value)
    assert "ended: failed: exit code 3" in message and message.endswith("Traceback: boom")
    assert "step 58" not in message and "step 61" in message  # the last 40 lines


def test_poke_mode_silence_longer_than_the_limit_fails(handle, monkeypatch):
    import airflow_skypilot.sensors.skypilot as module

    clock = [100.0]
    monkeypatch.setattr(module.time, "monotonic", lambda: clock[0])
    FakeBackend.down = {"c1"}
    sensor = _sensor(handle.to_dict(), deferrable=False, unreachable_timeout=30)
    assert sensor.poke({}) is False  # could not ask: not gone
    clock[0] += 29
    assert sensor.poke({}) is False
    clock[0] += 1
    with pytest.raises(AirflowException, match="infrastructure failure: no answer about the "
                                               "job from c1 for 30s .*down") as info:
        sensor.poke({})
    # as deferred: a silence is not an end the backend reported; a retry may find the job
    assert not isinstance(info.value, AirflowFailException)


def test_poke_mode_an_answer_ends_the_silence(handle, monkeypatch):
    import airflow_skypilot.sensors.skypilot as module

    clock = [100.0]
    monkeypatch.setattr(module.time, "monotonic", lambda: clock[0])
    sensor = _sensor(handle.to_dict(), deferrable=False, unreachable_timeout=30)
    FakeBackend.down = {"c1"}
    assert sensor.poke({}) is False
    clock[0] += 20
    FakeBackend.down = set()
    assert sensor.poke({}) is False  # answered: running
    FakeBackend.down = {"c1"}
    clock[0] += 20
    assert sensor.poke({}) is False  # silent since the answer: 0 s, not 40 s


def test_a_silence_taken_for_lost_is_retryable_an_end_the_backend_reported_is_not(handle):
    """The job may still run: a retry of the sensor finds it again once its backend answers
    (AirflowFailException skipped every retry)."""
    from airflow_skypilot.backends.base import SILENCE

    silent = JobStatus(JobState.LOST, reason="no answer about the job", raw_state=SILENCE)
    with pytest.raises(AirflowException) as info:
        _sensor(handle.to_dict())._finish(handle, silent, "")
    assert not isinstance(info.value, AirflowFailException)
    with pytest.raises(AirflowFailException):
        _sensor(handle.to_dict())._finish(handle, JobStatus(JobState.LOST, reason="gone"), "")


# --- what a job leaves behind ------------------------------------------------------------------
@pytest.fixture
def cleaned(monkeypatch) -> list[str]:
    out: list[str] = []
    monkeypatch.setattr(FakeBackend, "cleanup", lambda self, h: out.append(h.job_id),
                        raising=False)
    return out


@pytest.mark.parametrize("state", [JobState.SUCCEEDED, JobState.FAILED, JobState.PREEMPTED])
@pytest.mark.parametrize("deferrable", [True, False])
def test_every_end_the_backend_reported_cleans_up_the_job(handle, cleaned, state, deferrable):
    """Its staged secrets (Slurm's files, Kubernetes' Secrets, AWS's SSM parameters) go after
    a failure too, as after the operator's jobs; it was done after a success only."""
    status = _end(state, exit_code={JobState.SUCCEEDED: 0, JobState.FAILED: 3}.get(state))
    sensor = _sensor(handle.to_dict(), deferrable=deferrable, poke_interval=0.01, timeout=5)
    if state == JobState.SUCCEEDED:
        sensor.execute_complete({}, _event(handle, status)) if deferrable else sensor.execute({})
    else:
        with pytest.raises(AirflowFailException):
            if deferrable:
                sensor.execute_complete({}, _event(handle, status))
            else:
                sensor.execute({})
    assert cleaned == ["1"]


def test_an_infra_failure_with_part_of_the_job_still_up_is_cancelled_then_cleaned(handle,
                                                                                    cleaned):
    status = JobStatus(JobState.INFRA_FAILED, reason="node a1 lost", still_up=True)
    FakeBackend.jobs["1"]["status"] = status
    with pytest.raises(AirflowFailException, match="node a1 lost"):
        _sensor(handle.to_dict()).execute_complete({}, _event(handle, status))
    assert FakeBackend.jobs["1"]["status"].still_up is False  # the part left is stopped
    assert cleaned == ["1"]


def test_a_silence_taken_for_lost_leaves_the_job_alone(handle, cleaned):
    from airflow_skypilot.backends.base import SILENCE

    silent = JobStatus(JobState.LOST, reason="no answer about the job", raw_state=SILENCE)
    with pytest.raises(AirflowException):
        _sensor(handle.to_dict())._finish(handle, silent, "")
    assert cleaned == [] and FakeBackend.jobs["1"]["status"].state == JobState.RUNNING


# --- the job's output in poke mode -------------------------------------------------------------
def _logged(sensor, monkeypatch) -> list[str]:
    lines: list[str] = []

    class Log:
        def __getattr__(self, name):
            return lambda msg, *args, **kw: lines.append(msg % args if args else msg)

    monkeypatch.setattr(type(sensor), "log", property(lambda self: Log()))
    return lines


def test_poke_mode_streams_the_jobs_output_once(handle, monkeypatch):
    FakeBackend.jobs["1"]["log"] = "step 1\n"
    sensor = _sensor(handle.to_dict(), deferrable=False)
    lines = _logged(sensor, monkeypatch)
    assert sensor.poke({}) is False
    FakeBackend.jobs["1"]["log"] = "step 1\nstep 2\n"
    _end(JobState.SUCCEEDED, exit_code=0)
    assert sensor.poke({}).is_done
    assert [line for line in lines if "step" in line] == ["[1] step 1", "[1] step 2"]


def test_reschedule_mode_logs_the_tail_at_the_end(handle, monkeypatch):
    """Each poke is a new process there: no offset to go on from, so no streaming (it would
    repeat the log at every poke), and the end of the output is logged once."""
    sensor = _sensor(handle.to_dict(), deferrable=False, mode="reschedule")
    lines = _logged(sensor, monkeypatch)
    assert sensor.poke({}) is False
    assert not any("step" in line for line in lines)
    _end(JobState.SUCCEEDED, exit_code=0)
    assert sensor.poke({}).is_done
    assert sum("step 99" in line for line in lines) == 1


def test_stream_logs_off_logs_no_output(handle, monkeypatch):
    sensor = _sensor(handle.to_dict(), deferrable=False, stream_logs=False)
    lines = _logged(sensor, monkeypatch)
    _end(JobState.SUCCEEDED, exit_code=0)
    assert sensor.poke({}).is_done
    assert not any("step" in line for line in lines)
