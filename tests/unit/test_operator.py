"""The operator's decisions (placement, failover, restarts, adoption) over an in-memory backend.

The real flow against real clusters is in tests/e2e; here every branch is driven directly.
"""

from __future__ import annotations

import json

import pytest
from airflow.sdk.exceptions import AirflowException, AirflowFailException, TaskDeferred

from airflow_skypilot.backends import registry
from airflow_skypilot.backends.base import JobState, JobStatus
from airflow_skypilot.operators import SkyPilotOperator
from airflow_skypilot.operators.skypilot import XCOM_HANDLE, XCOM_PLACEMENT
from airflow_skypilot.triggers.skypilot import SkyPilotJobTrigger, SkyPilotWaitTrigger
from tests.fakes import FakeBackend, offer


class TI:
    def __init__(self, try_number=1):
        self.dag_id, self.task_id, self.run_id = "dag", "train", "manual__1"
        self.try_number, self.map_index, self.start_date = try_number, -1, None
        self.xcom: dict = {}

    def xcom_push(self, key, value):
        self.xcom[key] = json.loads(json.dumps(value))  # what XCom can store


@pytest.fixture(autouse=True)
def _fake(monkeypatch):
    registry.register_backend(FakeBackend)
    for conn in ("c1", "c2"):
        monkeypatch.setenv(f"AIRFLOW_CONN_{conn.upper()}", json.dumps({"conn_type": "fake"}))
    FakeBackend.reset()
    FakeBackend.offers = {"c1": [offer("c1", "p")], "c2": [offer("c2", "q", price=1.0)]}
    yield
    FakeBackend.reset()


def _op(recovery=None, **kw):
    task = {"resources": {"accelerators": "A100:1"}, "run": "train"}
    if recovery is not None:
        task["resources"]["job_recovery"] = recovery
    kw.setdefault("deferrable", True)
    return SkyPilotOperator(task_id="train", task=task, connections=["c1", "c2"], **kw)


def _start(op, ti=None):
    ti = ti or TI()
    with pytest.raises(TaskDeferred) as info:
        op.execute({"ti": ti})
    return info.value, ti


def _end(job_id, state, exit_code=None, reason=""):
    FakeBackend.jobs[job_id]["status"] = JobStatus(state, reason=reason, exit_code=exit_code,
                                                   started_at=1000.0, ended_at=4600.0)


def _event(deferred, state, exit_code=None, reason="", drop_kwargs=False):
    """What the trigger would send once the job ended."""
    trigger = deferred.trigger
    handle = trigger.handle
    _end(handle["job_id"], state, exit_code, reason)
    event = {"status": "done", "handle": handle,
             "job_status": FakeBackend.jobs[handle["job_id"]]["status"].to_dict(),
             "log_tail": "Traceback: boom", "log_offset": 0, "state": trigger.state}
    return event, (None if drop_kwargs else deferred.kwargs["state"])


def test_execute_places_submits_pushes_and_defers():
    deferred, ti = _start(_op())
    assert isinstance(deferred.trigger, SkyPilotJobTrigger)
    assert deferred.method_name == "execute_complete"
    handle = deferred.trigger.handle
    assert handle["connection"] == "c1"  # free and $0/h beats $1/h
    assert handle["job_name"].startswith("sky-dag-train-") and handle["job_name"].endswith(
        "-c0-t1-a0")
    job = FakeBackend.jobs[handle["job_id"]]
    assert job["env"]["SKYPILOT_TASK_ID"].startswith("sky-airflow_dag_train_manual__1_")
    assert job["env"]["SKYPILOT_ATTEMPT"] == "1000"
    assert job["env"]["SKYPILOT_USER"] == "airflow"  # the task's owner (Airflow's default)
    assert ti.xcom[XCOM_HANDLE]["job_id"] == handle["job_id"]
    assert ti.xcom[XCOM_PLACEMENT]["chosen"]["connection"] == "c1"


def test_invalid_task_fails_before_anything_is_submitted():
    op = SkyPilotOperator(task_id="t", task={"resurces": {}}, connections=["c1"])
    with pytest.raises(AirflowFailException, match="did you mean 'resources'"):
        op.execute({"ti": TI()})
    assert FakeBackend.jobs == {}


def test_missing_secret_fails_before_submission():
    op = SkyPilotOperator(task_id="t", task={"secrets": {"TOKEN": None}}, connections=["c1"])
    with pytest.raises(AirflowFailException, match="secrets.TOKEN: has no value"):
        op.execute({"ti": TI()})
    assert FakeBackend.jobs == {}


def test_success_returns_result_with_attempts_gpu_hours_and_cost():
    FakeBackend.offers = {"c2": [offer("c2", "q", price=2.0)]}
    deferred, ti = _start(_op())
    event, state = _event(deferred, JobState.SUCCEEDED)
    result = _op().execute_complete({"ti": ti}, event, state)
    assert result["state"] == "succeeded" and result["connection"] == "c2"
    assert [a["state"] for a in result["attempts"]] == ["succeeded"]
    assert result["gpu_hours"] == 1.0 and result["cost"] == 2.0
    assert json.loads(json.dumps(result)) == result


def test_state_survives_when_the_resume_drops_the_defer_kwargs():
    deferred, ti = _start(_op())
    event, _ = _event(deferred, JobState.SUCCEEDED, drop_kwargs=True)
    assert _op().execute_complete({"ti": ti}, event)["attempts"][0]["job_id"] == "1"


def test_infra_failure_fails_over_with_the_same_task_id():
    deferred, ti = _start(_op())
    first = deferred.trigger.handle
    event, state = _event(deferred, JobState.INFRA_FAILED, reason="node failure")
    with pytest.raises(TaskDeferred) as info:
        _op().execute_complete({"ti": ti}, event, state)
    second = info.value.trigger.handle
    assert (first["connection"], second["connection"]) == ("c1", "c2")
    assert second["job_name"].endswith("-a1")
    envs = [FakeBackend.jobs[h["job_id"]]["env"]["SKYPILOT_TASK_ID"] for h in (first, second)]
    assert envs[0] == envs[1]
    new_state = info.value.kwargs["state"]
    # EAGER_NEXT_REGION: the failed cluster is tried last, not blocked (SkyPilot blocks it for
    # one launch, then retries everywhere)
    assert [(b["place"], b["soft"]) for b in new_state["blocked"]] == [("c1/p", True)]
    assert new_state["failovers"] == 1
    event, state = _event(info.value, JobState.SUCCEEDED)
    result = _op().execute_complete({"ti": ti}, event, state)
    assert [(a["connection"], a["state"]) for a in result["attempts"]] == [
        ("c1", "infra_failed"), ("c2", "succeeded")]


def test_failover_strategy_tries_the_same_place_first():
    deferred, ti = _start(_op("FAILOVER"))
    event, state = _event(deferred, JobState.PREEMPTED, reason="preempted")
    with pytest.raises(TaskDeferred) as again:
        _op("FAILOVER").execute_complete({"ti": ti}, event, state)
    assert again.value.trigger.handle["connection"] == "c1"
    event, state = _event(again.value, JobState.PREEMPTED, reason="preempted")
    with pytest.raises(TaskDeferred) as third:
        _op("FAILOVER").execute_complete({"ti": ti}, event, state)
    assert third.value.trigger.handle["connection"] == "c2"  # failed twice there: moved


def test_gives_up_after_max_failovers():
    FakeBackend.offers = {"c1": [offer("c1", "p"), offer("c1", "r")]}
    deferred, ti = _start(_op(max_failovers=1))
    event, state = _event(deferred, JobState.LOST, reason="vanished")
    with pytest.raises(TaskDeferred) as info:
        _op(max_failovers=1).execute_complete({"ti": ti}, event, state)
    event, state = _event(info.value, JobState.LOST, reason="vanished again")
    with pytest.raises(AirflowException, match=r"gave up \(max_failovers=1\)"):
        _op(max_failovers=1).execute_complete({"ti": ti}, event, state)


def test_user_failure_is_not_failed_over_and_shows_the_log_tail():
    deferred, ti = _start(_op())
    event, state = _event(deferred, JobState.FAILED, exit_code=1, reason="exit code 1")
    with pytest.raises(AirflowException) as info:
        _op().execute_complete({"ti": ti}, event, state)
    assert "max_restarts_on_errors is 0" in str(info.value)
    assert "Traceback: boom" in str(info.value)
    assert len(FakeBackend.jobs) == 1


def test_max_restarts_on_errors_restarts_that_many_times():
    recovery = {"max_restarts_on_errors": 1}
    deferred, ti = _start(_op(recovery))
    event, state = _event(deferred, JobState.FAILED, exit_code=1)
    with pytest.raises(TaskDeferred) as info:
        _op(recovery).execute_complete({"ti": ti}, event, state)
    # SkyPilot's default strategy recovers the restart elsewhere first (c1 is not blocked)
    assert info.value.trigger.handle["connection"] == "c2"
    event, state = _event(info.value, JobState.FAILED, exit_code=1)
    with pytest.raises(AirflowException, match=r"failed after 1 restart"):
        _op(recovery).execute_complete({"ti": ti}, event, state)
    assert len(FakeBackend.jobs) == 2


def test_recover_on_exit_codes_does_not_count_against_restarts():
    recovery = {"recover_on_exit_codes": [33]}
    deferred, ti = _start(_op(recovery, max_failovers=2))
    for _ in range(2):
        event, state = _event(deferred, JobState.FAILED, exit_code=33)
        with pytest.raises(TaskDeferred) as info:
            _op(recovery, max_failovers=2).execute_complete({"ti": ti}, event, state)
        deferred = info.value
    event, state = _event(deferred, JobState.FAILED, exit_code=33)
    with pytest.raises(AirflowException, match="already restarted 2 times"):
        _op(recovery, max_failovers=2).execute_complete({"ti": ti}, event, state)


def test_cancelled_outside_airflow_is_not_placed_again():
    deferred, ti = _start(_op())
    event, state = _event(deferred, JobState.CANCELLED, reason="cancelled")
    with pytest.raises(AirflowException, match="ended cancelled"):
        _op().execute_complete({"ti": ti}, event, state)
    assert len(FakeBackend.jobs) == 1


def test_nothing_can_ever_fit_fails_at_once():
    FakeBackend.offers = {"c1": [offer("c1", fits=False, reason="no A100 here")]}
    with pytest.raises(AirflowFailException, match="cannot run on any connected capacity"):
        _op().execute({"ti": TI()})


def test_nothing_free_because_unreachable_waits_and_probes_again():
    FakeBackend.offers = {"c2": [offer("c2", "q")]}
    FakeBackend.down = {"c1", "c2"}
    deferred, ti = _start(_op(reprobe_interval=5))
    assert isinstance(deferred.trigger, SkyPilotWaitTrigger)
    assert deferred.trigger.seconds == 5
    FakeBackend.down = set()
    wait_event = {"status": "reprobe", "state": deferred.trigger.state}
    with pytest.raises(TaskDeferred) as info:
        _op().execute_complete({"ti": ti}, wait_event, deferred.kwargs["state"])
    assert info.value.trigger.handle["connection"] == "c2"


def test_execute_twice_for_the_same_try_adopts_the_first_job():
    first, ti = _start(_op())
    second, _ = _start(_op(), ti)
    assert second.trigger.handle["job_id"] == first.trigger.handle["job_id"]
    assert second.trigger.handle["adopted"] is True
    assert len(FakeBackend.jobs) == 1


def test_a_new_try_adopts_the_live_job_of_the_try_before():
    """The worker died after submitting; Airflow retried the task: one job, not two."""
    first, _ = _start(_op(), TI(try_number=1))
    second, _ = _start(_op(), TI(try_number=2))
    assert second.trigger.handle["job_id"] == first.trigger.handle["job_id"]
    assert second.trigger.handle["adopted"] and len(FakeBackend.jobs) == 1
    assert second.kwargs["state"]["attempts"][0]["adopted"]


def test_a_new_try_that_adopts_a_restarted_job_goes_on_with_its_restarts():
    """Try 1's job failed and was restarted (max_restarts_on_errors: 1); the worker died. Try 2
    adopts the restart: the restart made counts, so its failure is the end, not a third run
    of the user code; the attempts show the first job too."""
    recovery = {"max_restarts_on_errors": 1}
    deferred, ti = _start(_op(recovery))
    event, state = _event(deferred, JobState.FAILED, exit_code=1)
    with pytest.raises(TaskDeferred) as info:
        _op(recovery).execute_complete({"ti": ti}, event, state)
    restart = info.value.trigger.handle
    second, ti2 = _start(_op(recovery), TI(try_number=2))  # the worker died; Airflow retried
    assert second.trigger.handle["job_id"] == restart["job_id"]
    state = second.kwargs["state"]
    assert state["restarts"] == 1
    assert [(a["job_id"], a["state"]) for a in state["attempts"]] == \
        [(deferred.trigger.handle["job_id"], "failed"), (restart["job_id"], "pending")]
    assert state["attempt"] == 1  # the adopted job's (…-t1-a1): the replay names nothing
    event, state = _event(second, JobState.FAILED, exit_code=1)
    with pytest.raises(AirflowException, match=r"failed after 1 restart"):
        _op(recovery).execute_complete({"ti": ti2}, event, state)
    assert len(FakeBackend.jobs) == 2


def test_a_new_try_that_adopts_a_failed_over_job_goes_on_with_its_failovers():
    FakeBackend.offers = {"c1": [offer("c1", "p"), offer("c1", "r")]}
    deferred, ti = _start(_op(max_failovers=1))
    event, state = _event(deferred, JobState.LOST, reason="vanished")
    with pytest.raises(TaskDeferred):
        _op(max_failovers=1).execute_complete({"ti": ti}, event, state)
    second, ti2 = _start(_op(max_failovers=1), TI(try_number=2))
    state = second.kwargs["state"]
    assert state["failovers"] == 1
    assert state["avoid"] is None  # it steered the placement of the job adopted
    event, state = _event(second, JobState.LOST, reason="vanished again")
    with pytest.raises(AirflowException, match=r"gave up \(max_failovers=1\)"):
        _op(max_failovers=1).execute_complete({"ti": ti2}, event, state)
    assert len(FakeBackend.jobs) == 2


def test_a_new_try_after_the_earlier_job_failed_submits_under_its_own_name():
    first, ti = _start(_op(), TI(try_number=1))
    _end(first.trigger.handle["job_id"], JobState.FAILED, exit_code=1)
    second, _ = _start(_op(), TI(try_number=2))
    assert second.trigger.handle["job_id"] != first.trigger.handle["job_id"]
    assert second.trigger.handle["job_name"].endswith("-c0-t2-a0")
    assert FakeBackend.jobs["2"]["env"]["SKYPILOT_ATTEMPT"] == "2000"


def test_a_succeeded_job_of_an_earlier_try_is_the_result():
    """The job finished while no worker watched it: adopt its success, submit nothing."""
    first, _ = _start(_op(), TI(try_number=1))
    _end(first.trigger.handle["job_id"], JobState.SUCCEEDED, exit_code=0)
    result = _op().execute({"ti": TI(try_number=2)})
    assert result["state"] == "succeeded" and result["job_id"] == first.trigger.handle["job_id"]
    assert len(FakeBackend.jobs) == 1


def test_refused_submission_moves_to_the_next_place():
    FakeBackend.refusing.add("c1")
    deferred, _ = _start(_op())
    assert deferred.trigger.handle["connection"] == "c2"
    assert deferred.kwargs["state"]["blocked"][0]["place"] == "c1/p"


def test_not_waiting_returns_the_handle():
    ti = TI()
    handle = _op(wait_for_completion=False).execute({"ti": ti})
    assert handle["job_id"] == "1" and ti.xcom[XCOM_HANDLE] == handle


def test_on_kill_cancels_the_job():
    op = _op(deferrable=False, wait_for_completion=False)
    op.execute({"ti": TI()})
    op.on_kill()
    assert FakeBackend.jobs["1"]["status"].state == JobState.CANCELLED


def test_non_deferrable_polls_in_the_worker():
    op = _op(deferrable=False, poll_interval=0.01)
    FakeBackend.offers = {"c1": [offer("c1", "p")]}
    real_poll = FakeBackend.astatus

    async def astatus(self, handles):
        _end(handles[0].job_id, JobState.SUCCEEDED)
        return await real_poll(self, handles)

    FakeBackend.astatus = astatus
    try:
        result = op.execute({"ti": TI()})
    finally:
        FakeBackend.astatus = real_poll
    assert result["state"] == "succeeded"


def test_connections_default_from_config(monkeypatch):
    monkeypatch.setenv("AIRFLOW__SKYPILOT__CONNECTIONS", "c2")
    op = SkyPilotOperator(task_id="t", task={"run": "x"})
    FakeBackend.offers = {"c2": [offer("c2", "q", acc=None)]}
    with pytest.raises(TaskDeferred) as info:
        op.execute({"ti": TI()})
    assert info.value.trigger.handle["connection"] == "c2"


def test_deferrable_is_the_default():
    assert SkyPilotOperator(task_id="t", task={"run": "x"}).deferrable is True


def test_bad_policy_is_refused():
    with pytest.raises(ValueError, match="policy must be one of"):
        SkyPilotOperator(task_id="t", task={"run": "x"}, policy="random")


class _PullTI(TI):
    def xcom_pull(self, task_ids=None, key="return_value", map_indexes=None):
        assert (task_ids, map_indexes) == (self.task_id, self.map_index)
        return self.xcom.get(key)


@pytest.mark.parametrize("error, raised", [("Trigger/execution timeout", "TaskDeferralTimeout"),
                                           ("Trigger failure", "TaskDeferralError")])
def test_resumed_only_to_fail_cancels_the_job(error, raised):
    from airflow.models.trigger import TriggerFailureReason

    reason = {"Trigger/execution timeout": TriggerFailureReason.TRIGGER_TIMEOUT,
              "Trigger failure": TriggerFailureReason.TRIGGER_FAILURE}[error]
    deferred, ti = _start(_op(), _PullTI())
    job_id = deferred.trigger.handle["job_id"]
    assert not FakeBackend.jobs[job_id]["status"].state.terminal
    with pytest.raises(Exception) as info:
        _op().resume_execution("__fail__", {"error": reason}, {"ti": ti})
    assert type(info.value).__name__ == raised  # Airflow's own failure, unchanged
    assert FakeBackend.jobs[job_id]["status"].state == JobState.CANCELLED


def test_resumed_only_to_fail_keeps_the_job_when_told_to():
    from airflow.models.trigger import TriggerFailureReason

    deferred, ti = _start(_op(cancel_on_kill=False), _PullTI())
    job_id = deferred.trigger.handle["job_id"]
    with pytest.raises(Exception) as info:
        _op(cancel_on_kill=False).resume_execution(
            "__fail__", {"error": TriggerFailureReason.TRIGGER_TIMEOUT}, {"ti": ti})
    assert type(info.value).__name__ == "TaskDeferralTimeout"
    assert not FakeBackend.jobs[job_id]["status"].state.terminal


def test_non_deferrable_waits_for_capacity_in_a_loop_not_by_recursion(monkeypatch):
    """~494 rounds of "nothing fits" used to end in RecursionError (about 8 h at 60 s)."""
    import threading
    import time as real_time
    from types import SimpleNamespace

    from airflow_skypilot.operators import skypilot as module

    rounds = 1000
    FakeBackend.down = {"c1", "c2"}
    probes, lock = [0], threading.Lock()
    real_probe, real_poll = FakeBackend.probe, FakeBackend.astatus

    def probe(self, task):
        with lock:
            probes[0] += 1
            if probes[0] == 2 * rounds + 1:  # the first probe after `rounds` empty rounds
                FakeBackend.down = set()
        return real_probe(self, task)

    async def astatus(self, handles):
        _end(handles[0].job_id, JobState.SUCCEEDED)
        return await real_poll(self, handles)

    sleeps: list[float] = []
    monkeypatch.setattr(FakeBackend, "probe", probe)
    monkeypatch.setattr(FakeBackend, "astatus", astatus)
    monkeypatch.setattr(module, "time", SimpleNamespace(time=real_time.time,
                                                        sleep=sleeps.append))
    ti = TI()
    result = _op(deferrable=False, reprobe_interval=0.01, poll_interval=0.01).execute({"ti": ti})
    assert result["state"] == "succeeded" and result["connection"] == "c1"
    assert len(result["attempts"]) == 1 and len(FakeBackend.jobs) == 1
    assert sleeps.count(0.01) == rounds  # one wait per empty round, in the worker
    assert ti.xcom[XCOM_HANDLE]["job_id"] == result["job_id"]


def test_non_deferrable_fails_over_in_the_worker(monkeypatch):
    from types import SimpleNamespace

    from airflow_skypilot.operators import skypilot as module

    real_poll = FakeBackend.astatus
    ends = {"1": (JobState.INFRA_FAILED, "node failure"), "2": (JobState.SUCCEEDED, "")}

    async def astatus(self, handles):
        for handle in handles:
            if not FakeBackend.jobs[handle.job_id]["status"].state.terminal:
                state, reason = ends[handle.job_id]
                _end(handle.job_id, state, reason=reason)
        return await real_poll(self, handles)

    monkeypatch.setattr(FakeBackend, "astatus", astatus)
    monkeypatch.setattr(module, "time", SimpleNamespace(time=__import__("time").time,
                                                        sleep=lambda s: None))
    result = _op(deferrable=False, poll_interval=0.01).execute({"ti": TI()})
    assert [(a["connection"], a["state"], a["confirmed_dead"]) for a in result["attempts"]] \
        == [("c1", "infra_failed", True), ("c2", "succeeded", None)]
    name = FakeBackend.jobs["1"]["name"]
    assert result["old_copies"] == [{
        "connection": "c1", "what": f"job 1 ({name})", "reason": "infra_failed: node failure",
        "confirmed_dead": True, "outcome": "infra_failed"}]


def test_template_fields_are_kept_as_given_and_read_at_execute(tmp_path):
    from pathlib import Path

    path = Path(tmp_path) / "t.yaml"
    path.write_text("resources: {accelerators: A100:1}\nrun: train\n")
    op = SkyPilotOperator(task_id="t", task=path, connections="c1, c2", envs=None,
                          policy="{{ params.policy }}")
    assert op.task is path and op.envs is None and op.secrets is None
    assert op.connections == "c1, c2" and op.policy == "{{ params.policy }}"
    op.policy = "cheapest"  # as rendered
    deferred, _ = _start(op)
    assert deferred.trigger.handle["connection"] == "c1"


def test_a_rendered_policy_is_checked_before_anything_is_submitted():
    op = _op(policy="{{ params.policy }}")
    op.policy = "random"  # as rendered
    with pytest.raises(AirflowFailException, match="policy must be one of"):
        op.execute({"ti": TI()})
    assert FakeBackend.jobs == {}


def test_envs_that_are_not_a_mapping_after_rendering_fail():
    op = _op(envs="{{ params.envs }}")
    op.envs = "A=1"  # rendered, but not into a mapping
    with pytest.raises(AirflowFailException, match="envs must be a mapping"):
        op.execute({"ti": TI()})


def test_the_task_template_field_survives_dag_serialization():
    from airflow.sdk import DAG
    from airflow.serialization.serialized_objects import DagSerialization

    with DAG("serialized", schedule=None) as dag:
        SkyPilotOperator(task_id="t", task="tasks/x.yaml", connections=["c1"],
                         envs={"A": "{{ ds }}"})
        SkyPilotOperator.partial(task_id="m", connections=["c1"]).expand(
            task=["a.yaml", "b.yaml"])
    again = DagSerialization.from_dict(DagSerialization.to_dict(dag))
    op = again.get_task("t")
    assert op.task == "tasks/x.yaml" and op.envs == {"A": "{{ ds }}"}
    assert tuple(op.template_fields) == SkyPilotOperator.template_fields
    assert again.get_task("m").template_fields == op.template_fields


def test_the_fail_signal_is_airflows_own():
    from airflow.sdk.bases import operator as sdk_operator

    from airflow_skypilot.operators import _stop as module

    assert module.TRIGGER_FAIL_REPR is sdk_operator.TRIGGER_FAIL_REPR


def test_state_survives_airflows_own_serialization_of_the_deferral():
    """What the task runner does with the deferral (serde, JSON in the DB), and back."""
    from airflow.sdk.serde import deserialize, serialize

    def through_airflow(value):
        return deserialize(json.loads(json.dumps(serialize(value))))

    deferred, ti = _start(_op())
    path, trigger_kwargs = deferred.trigger.serialize()
    trigger = SkyPilotJobTrigger(**through_airflow(trigger_kwargs))
    assert trigger.serialize() == (path, trigger_kwargs)
    event, _ = _event(deferred, JobState.INFRA_FAILED, reason="node failure")
    next_kwargs = through_airflow(deferred.kwargs)
    with pytest.raises(TaskDeferred) as info:
        _op().execute_complete({"ti": ti}, through_airflow(event), **next_kwargs)
    assert info.value.trigger.handle["connection"] == "c2"


@pytest.mark.parametrize("arg, value", [("poll_interval", -1), ("poll_interval", 0),
                                        ("probe_timeout", -1), ("reprobe_interval", -5),
                                        ("max_failovers", -1), ("max_moves", -1),
                                        ("paid_move_min_wait", -1),
                                        ("confirm_timeout", -0.5), ("unreachable_timeout", -1),
                                        ("policy", "quickest"), ("poll_interval", "soon")])
def test_an_argument_out_of_range_fails_when_the_dag_is_parsed_naming_it(arg, value):
    with pytest.raises(ValueError, match=arg):
        _op(**{arg: value})


def test_probe_timeout_0_is_the_configured_default_as_before():
    assert _op(probe_timeout=0)._hook().timeout == 60.0


def test_a_templated_policy_is_checked_after_rendering_a_templated_number_at_once():
    """``policy`` is a template field; the numbers are not (a Jinja string in one was kept
    as it was written, and failed the task when it ran)."""
    op = _op(policy="{{ params.policy }}")
    assert op.policy == "{{ params.policy }}"
    with pytest.raises(ValueError, match="poll_interval is not a template field"):
        _op(poll_interval="{{ params.every }}")


def test_a_number_a_subclass_templates_is_checked_once_rendered():
    class Templated(SkyPilotOperator):
        template_fields = (*SkyPilotOperator.template_fields, "confirm_timeout")

    op = Templated(task_id="t", task={"run": "x"}, connections=["c1"],
                   confirm_timeout="{{ params.c }}")
    op.render_template_fields({"params": {"c": "-5"}})
    with pytest.raises(AirflowFailException, match="confirm_timeout must be a number >= 0"):
        op.load({})


def test_a_task_given_as_a_dict_is_not_rendered_inside_but_inline_yaml_text_is():
    from airflow.sdk.definitions.context import Context

    go = "docker ps --format '{{.Names}}'; kubectl get pods -o go-template='{{range .items}}'"
    op = SkyPilotOperator(task_id="t", task={"run": go}, connections=["c1"],
                          envs={"DAY": "{{ ds }}"})
    op.render_template_fields(Context(ds="2026-12-01"))  # raised TemplateSyntaxError before
    assert op.task == {"run": go} and op.envs == {"DAY": "2026-12-01"}
    text = SkyPilotOperator(task_id="u", task="run: echo {{ ds }}", connections=["c1"])
    text.render_template_fields(Context(ds="2026-12-01"))
    assert text.task == "run: echo 2026-12-01"


@pytest.mark.parametrize("rendered", ['{"A": "1", "T": "s3cr3t"}', "{'A': '1', 'T': 's3cr3t'}"])
def test_envs_and_secrets_rendered_as_text_are_read_back(rendered):
    op = _op(envs=rendered, secrets=rendered.replace("A", "B").replace('"1"', '"2"')
             .replace("'1'", "'2'"))
    task = op.load()
    assert task.envs["A"] == "1" and task.secrets["T"] == "s3cr3t"


@pytest.mark.parametrize("given, ids", [
    ("{{ params.conns }}", ["c1", "c2"]),  # a list's Python repr, as Jinja renders it
    ('["c1", "c2"]', ["c1", "c2"]),
    ("c1, c2", ["c1", "c2"]),
    ("c1", ["c1"]),
])
def test_templated_connections_rendered_as_text_are_read_back(given, ids):
    """``"{{ params.conns }}"`` renders to ``"['c1', 'c2']"``: those ids, not ``"['c1'"``."""
    import jinja2

    op = SkyPilotOperator(task_id="t", task={"run": "x"}, connections=given)
    op.render_template_fields({"params": {"conns": ["c1", "c2"]}}, jinja2.Environment())
    assert op._conn_ids() == ids
    FakeBackend.offers = {c: [offer(c, "q", acc=None)] for c in ("c1", "c2")}
    deferred, _ = _start(op)
    assert deferred.trigger.handle["connection"] == "c1"
