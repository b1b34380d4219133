"""RunState and Attempt: JSON round trips, older shapes, the result the README promises."""

from __future__ import annotations

import json
import subprocess
import sys

from airflow_skypilot.backends.base import JobHandle, JobState, JobStatus
from airflow_skypilot.runstate import (
    RESULT_ATTEMPT_FIELDS,
    UI_ATTEMPT_FIELDS,
    Attempt,
    Blocked,
    RunState,
)


def _handle(job_id="7", conn="c1", location="p", **kw) -> JobHandle:
    return JobHandle(backend="fake", connection=conn, job_id=job_id, job_name=f"sky-x-a{job_id}",
                     location=location, infra=f"fake/{conn}/{location}", num_nodes=2,
                     gpus_per_node=4, price_per_hour=3.0, submitted_at=1000.0, **kw)


def _state() -> RunState:
    run = RunState(prefix="sky-dag-train-abc-t1", task_env_id="sky-airflow_dag_train_r",
                   started_at=900.0)
    run.record(_handle("1"))
    run.close(_handle("1"), JobStatus(JobState.PREEMPTED, reason="spot", started_at=1100.0,
                                      ended_at=4700.0))
    run.blocked.append(Blocked("c1/p", "spot", at=4700.0))
    run.failovers, run.attempt, run.prefer = 1, 1, "c2/q"
    run.record(_handle("2", conn="c2", location="q", adopted=True))
    return run


def test_round_trips_through_json():
    run = _state()
    data = json.loads(json.dumps(run.to_dict()))
    again = RunState.from_dict(data)
    assert again == run
    assert again.to_dict() == data
    assert isinstance(again.attempts[0], Attempt) and isinstance(again.blocked[0], Blocked)


def test_the_dict_keeps_the_keys_earlier_readers_use():
    data = _state().to_dict()
    assert {"prefix", "task_env_id", "attempt", "attempts", "blocked", "failovers", "restarts",
            "code_restarts", "prefer", "log_offset", "started_at"} <= set(data)
    first = data["attempts"][0]
    assert first["place"] == "c1/p" and first["infra_failure"] is True
    assert first["gpus"] == 8 and first["state"] == "preempted"
    assert data["blocked"][0] == {"place": "c1/p", "reason": "spot", "at": 4700.0,
                                  "until": None, "soft": False}


def test_older_and_odd_shapes_load_with_defaults():
    assert RunState.from_dict(None).attempts == []
    old = {"prefix": "p", "attempts": [{"job_id": "5", "connection": "c", "place": "c/x",
                                        "some_future_key": 1}, "not an attempt"],
           "blocked": [("a", "b"), {"place": "c/x", "reason": "r"}, {"reason": "no place"}],
           "phase": "waiting"}
    run = RunState.from_dict(old)
    assert run.prefix == "p" and run.failovers == 0 and run.log_offset == 0
    assert [a.job_id for a in run.attempts] == ["5"]
    assert run.attempts[0].state == "pending" and run.attempts[0].exit_code is None
    assert [b.place for b in run.blocked] == ["c/x"]


def test_close_records_an_attempt_it_never_saw():
    run = RunState(prefix="x")
    ended = run.close(_handle("9"), JobStatus(JobState.SUCCEEDED, exit_code=0), now=50.0)
    assert run.attempts == [ended] and ended.ended_at == 50.0 and ended.state == "succeeded"


def test_job_name_follows_the_clear_try_and_attempt():
    run = RunState(prefix="sky-d-t-abc-", clear=1, try_number=2)
    assert run.job_name == "sky-d-t-abc-c1-t2-a0"
    run.attempt = 3
    assert run.job_name == "sky-d-t-abc-c1-t2-a3"


def test_result_is_the_readme_shape_built_from_the_attempts():
    run = _state()
    final = run.close(_handle("2", conn="c2", location="q"),
                      JobStatus(JobState.SUCCEEDED, exit_code=0, started_at=5000.0,
                                ended_at=8600.0))
    result = run.result(final, now=9000.0)
    assert list(result) == ["state", "connection", "location", "infra", "backend", "job_id",
                            "job_name", "task_id", "attempts", "old_copies", "gpu_hours",
                            "cost"]
    assert (result["connection"], result["location"], result["job_id"]) == ("c2", "q", "2")
    assert result["task_id"] == "sky-airflow_dag_train_r"
    assert [tuple(a) for a in result["attempts"]] == [RESULT_ATTEMPT_FIELDS] * 2
    assert [a["state"] for a in result["attempts"]] == ["preempted", "succeeded"]
    assert result["attempts"][1]["adopted"] is True
    # 1 h on 8 GPUs at $3/h, twice
    assert result["gpu_hours"] == 16.0 and result["cost"] == 6.0
    assert json.loads(json.dumps(result)) == result


def test_ui_view_fills_what_an_older_result_lacks():
    view = Attempt.ui_view({"job_id": "6", "state": "succeeded"})
    assert tuple(view) == UI_ATTEMPT_FIELDS
    assert view["job_id"] == "6" and view["gpus"] is None


def test_module_stays_light_for_the_ui_plugin():
    code = ("import sys, airflow_skypilot.runstate; "
            "print(any(m.startswith(('airflow', 'pydantic')) and m != 'airflow_skypilot' "
            "and not m.startswith('airflow_skypilot') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "False"
