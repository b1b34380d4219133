"""Job identity: names unique per deployment, run and task instance; what a new try adopts."""

from __future__ import annotations

import pytest

from airflow_skypilot.backends.base import JobHandle, JobState, JobStatus
from airflow_skypilot.identity import (
    TaskKey,
    attempt_number,
    classify,
    parse_job_name,
)

KEY = TaskKey("dag", "train", "manual__1")


def _h(name: str, submitted_at: float = 1000.0, job_id: str | None = None) -> JobHandle:
    return JobHandle(backend="fake", connection="c1", job_id=job_id or name, job_name=name,
                     location="p", infra="fake", submitted_at=submitted_at)


def _s(state: JobState) -> JobStatus:
    return JobStatus(state)


def test_names_are_short_dns_safe_and_parse_back():
    long = TaskKey("D" * 200, "t" * 200, "r" * 300, 12, "prod")
    name = long.job_name(3, 14, 2)
    assert len(name) <= 63 and name == name.lower() and name.startswith("sky-")
    parts = parse_job_name(name)
    assert (parts.prefix, parts.clear, parts.try_number, parts.attempt) == \
        (long.prefix, 3, 14, 2)
    assert parse_job_name("someone-elses-job") is None


@pytest.mark.parametrize(("a", "b"), [
    (TaskKey("dag", "train-1", "r"), TaskKey("dag", "train", "r", map_index=1)),
    (TaskKey("a_b", "c", "r"), TaskKey("a", "b_c", "r")),
    (TaskKey("dag", "t", "r1"), TaskKey("dag", "t", "r2")),
    (TaskKey("dag", "t", "r", deployment="prod"), TaskKey("dag", "t", "r", deployment="dev")),
])
def test_different_task_instances_never_share_names_or_task_ids(a, b):
    assert a.prefix != b.prefix
    assert not a.prefix.startswith(b.prefix) and not b.prefix.startswith(a.prefix)
    assert a.skypilot_task_id != b.skypilot_task_id


def test_the_task_id_is_the_same_for_every_try_and_clear():
    assert KEY.skypilot_task_id.startswith("sky-airflow_dag_train_manual__1_")
    assert KEY.job_name(0, 1, 0) != KEY.job_name(0, 2, 0) != KEY.job_name(1, 2, 0)
    assert attempt_number(2, 1) > attempt_number(1, 3) > attempt_number(1, 0)


def test_a_new_try_adopts_the_newest_live_job_of_the_same_clear_and_stops_older_ones():
    older = _h(KEY.job_name(0, 1, 0))
    newer = _h(KEY.job_name(0, 2, 1))
    out = classify([(older, _s(JobState.RUNNING)), (newer, _s(JobState.PENDING))],
                   prefix=KEY.prefix, clear=0, run_started_at=900.0)
    assert out.adopt is newer and out.adopt_status.state == JobState.PENDING
    assert [(h, why) for h, why in out.stop] == [(older, "an older copy than the one adopted")]


def test_the_adopted_jobs_history_is_the_ended_jobs_of_its_try_before_it():
    a1 = _h(KEY.job_name(0, 1, 1))  # listed out of order
    a0 = _h(KEY.job_name(0, 1, 0))
    adopted = _h(KEY.job_name(0, 1, 2))
    other_try = _h(KEY.job_name(0, 2, 0))  # a later try's: not this try's history
    other_clear = _h(KEY.job_name(1, 1, 0))
    stale = _h(KEY.job_name(0, 1, 1), submitted_at=10.0, job_id="old")  # a deleted run's
    unknown = _h(KEY.job_name(0, 1, 0), job_id="unknown")  # no status: nothing to count
    out = classify([(a1, _s(JobState.PREEMPTED)), (adopted, _s(JobState.RUNNING)),
                    (a0, _s(JobState.FAILED)), (other_try, _s(JobState.FAILED)),
                    (other_clear, _s(JobState.FAILED)), (stale, _s(JobState.FAILED)),
                    (unknown, None)],
                   prefix=KEY.prefix, clear=0, run_started_at=900.0)
    assert out.adopt is adopted
    assert [(h, st.state) for h, st in out.before] == [(a0, JobState.FAILED),
                                                       (a1, JobState.PREEMPTED)]


def test_a_succeeded_job_is_adopted_and_a_failed_one_left_alone():
    ok = _h(KEY.job_name(0, 1, 0))
    failed = _h(KEY.job_name(0, 2, 0))
    out = classify([(ok, _s(JobState.SUCCEEDED)), (failed, _s(JobState.FAILED))],
                   prefix=KEY.prefix, clear=0, run_started_at=None)
    assert out.adopt is ok and out.stop == []
    assert [h for h, _ in out.ignore] == [failed]


def test_a_job_of_an_earlier_clear_is_stopped_never_adopted():
    before_clear = _h(KEY.job_name(0, 1, 0))
    finished = _h(KEY.job_name(0, 1, 1))
    out = classify([(before_clear, _s(JobState.RUNNING)), (finished, _s(JobState.SUCCEEDED))],
                   prefix=KEY.prefix, clear=1, run_started_at=None)
    assert out.adopt is None
    assert [h for h, _ in out.stop] == [before_clear] and "clear 0" in out.stop[0][1]
    assert [h for h, _ in out.ignore] == [finished], "a success of another clear is not ours"


def test_a_job_from_before_the_run_started_is_a_deleted_runs_and_never_adopted():
    stale_done = _h(KEY.job_name(0, 1, 0), submitted_at=100.0)
    stale_live = _h(KEY.job_name(0, 1, 1), submitted_at=100.0)
    skewed = _h(KEY.job_name(0, 2, 0), submitted_at=990.0)  # within the clock-skew allowance
    out = classify([(stale_done, _s(JobState.SUCCEEDED)), (stale_live, _s(JobState.RUNNING)),
                    (skewed, _s(JobState.RUNNING))],
                   prefix=KEY.prefix, clear=0, run_started_at=1000.0)
    assert out.adopt is skewed
    assert [h for h, _ in out.stop] == [stale_live] and "deleted run" in out.stop[0][1]
    assert [h for h, _ in out.ignore] == [stale_done]


def test_names_under_a_longer_prefix_are_not_ours():
    other = TaskKey("dag", "train", "manual__1", map_index=-1, deployment="x")
    job = _h(other.job_name(0, 1, 0))
    out = classify([(job, _s(JobState.RUNNING))], prefix=KEY.prefix, clear=0,
                   run_started_at=None)
    assert out.adopt is None and out.stop == [] and out.ignore == []


def test_one_job_seen_through_two_connections_to_one_cluster_is_one_job():
    """Two connections to one cluster list its jobs twice: adopt it, never stop it."""
    a = _h(KEY.job_name(0, 1, 0), job_id="1124")
    for infra in (a.infra, "slurm/c2/p"):  # a Slurm connection's cluster is its conn_id
        b = JobHandle(backend=a.backend, connection="c2", job_id="1124", job_name=a.job_name,
                      location="p", infra=infra, submitted_at=a.submitted_at)
        out = classify([(a, _s(JobState.RUNNING)), (b, _s(JobState.RUNNING))],
                       prefix=KEY.prefix, clear=0, run_started_at=None)
        assert out.adopt is a and out.stop == []
