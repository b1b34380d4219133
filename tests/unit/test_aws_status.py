"""A multi-node job's state once EC2 stops listing the instance of a rank that ended.

EC2 forgets a terminated instance about an hour after it went: a running job must not read
PENDING then (a waiting job may be moved: cancelled and submitted elsewhere)."""

from __future__ import annotations

import time

from airflow_skypilot.backends.aws import InstanceView, Markers, judge
from airflow_skypilot.backends.aws.status import judge_handle
from airflow_skypilot.backends.base import JobHandle, JobState

NOW = time.time()


def _rank0(state: str = "running") -> InstanceView:
    return InstanceView("i-0", 0, state, launch_time=NOW - 7200, private_ip="10.0.0.1",
                        reservation_id="r-1")


def _handle(submitted_at: float) -> JobHandle:
    return JobHandle(backend="aws", connection="aws_t", job_id="j", job_name="j",
                     location="us-east-1/us-east-1a", infra="aws/us-east-1/us-east-1a",
                     num_nodes=2, submitted_at=submitted_at,
                     extra={"region": "us-east-1", "reservation_id": "r-1"})


def test_a_rank_that_exited_and_is_no_longer_listed_leaves_the_job_running():
    markers = Markers(exit_codes={1: 0}, setup_done={0, 1})
    st = judge(2, False, [_rank0()], markers, now=NOW, launched_at=NOW - 7200, grace=300)
    assert st.state == JobState.RUNNING


def test_a_rank_that_aborted_and_is_no_longer_listed_does_not_make_the_job_pending():
    st = judge(2, False, [_rank0()], Markers(aborted={1}), now=NOW, launched_at=NOW - 7200,
               grace=300)
    assert st.state != JobState.PENDING


def test_a_rank_gone_without_an_exit_code_and_no_longer_listed_is_lost_to_the_infra():
    markers = Markers(setup_done={0, 1})
    st = judge(2, False, [_rank0()], markers, now=NOW, launched_at=NOW - 7200, grace=300)
    assert st.state == JobState.INFRA_FAILED and "rank 1" in st.reason
    assert st.still_up  # rank 0 still runs: it is to be taken down
    spot = judge(2, True, [_rank0()], markers, now=NOW, launched_at=NOW - 7200, grace=300)
    assert spot.state == JobState.PREEMPTED


def test_a_launch_not_fully_listed_yet_is_pending_within_the_grace():
    young = InstanceView("i-0", 0, "running", launch_time=NOW - 5, reservation_id="r-1")
    st = judge_handle(_handle(NOW - 5), [young], Markers(), grace=300, now=NOW)
    assert st.state == JobState.PENDING
    old = judge_handle(_handle(NOW - 7200), [_rank0()], Markers(), grace=300, now=NOW)
    assert old.state == JobState.INFRA_FAILED


def test_a_listed_rank_still_pending_keeps_the_job_pending():
    st = judge(2, False, [_rank0(), InstanceView("i-1", 1, "pending", reservation_id="r-1")],
               Markers(), now=NOW, launched_at=NOW - 7200, grace=300)
    assert st.state == JobState.PENDING
