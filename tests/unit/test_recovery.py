"""The failover rule, directly: ``recovery.decide`` (pure) and ``recovery.record``."""

from __future__ import annotations

import pytest

from airflow_skypilot import recovery
from airflow_skypilot.backends.base import JobHandle, JobState, JobStatus
from airflow_skypilot.recovery import AGAIN, FAIL, SUCCEED
from airflow_skypilot.runstate import RunState


def _handle(n: int, conn="c1", location="p") -> JobHandle:
    return JobHandle(backend="fake", connection=conn, job_id=str(n), job_name=f"j-a{n}",
                     location=location, infra="fake")


def _ended(run: RunState, state: JobState, exit_code=None, reason="", conn="c1", location="p"):
    handle = _handle(len(run.attempts) + 1, conn, location)
    run.record(handle)
    return run.close(handle, JobStatus(state, reason=reason, exit_code=exit_code), now=100.0)


def _decide(run, ended, job_recovery=None, max_failovers=3, tail="Traceback: boom"):
    before = run.to_dict()
    verdict = recovery.decide(run, ended, job_recovery or {}, max_failovers, tail=tail, now=5.0)
    assert run.to_dict() == before, "decide changes nothing"
    return verdict


def test_success():
    run = RunState(prefix="x")
    verdict = _decide(run, _ended(run, JobState.SUCCEEDED, exit_code=0))
    assert verdict.action == SUCCEED and not verdict.cancel


@pytest.mark.parametrize("state", [JobState.INFRA_FAILED, JobState.PREEMPTED, JobState.LOST])
def test_infra_failure_moves_elsewhere_first_and_cancels_the_old_copy(state):
    """EAGER_NEXT_REGION: the failed place is blocked while another place takes the job (a
    soft block) and its cluster tried last (SkyPilot blocks the region for one launch, then
    retries everywhere: a deployment with one cluster goes back at once)."""
    from airflow_skypilot import placement
    from tests.fakes import offer

    run = RunState(prefix="x-")
    verdict = _decide(run, _ended(run, state, reason="node failure"))
    assert verdict.action == AGAIN and verdict.cancel and verdict.counts_as == "failover"
    assert verdict.block.place == "c1/p" and verdict.block.soft and verdict.avoid == "c1/*"
    assert "moving elsewhere (EAGER_NEXT_REGION)" in verdict.message
    recovery.record(run, verdict, cooldown=600)
    assert (run.failovers, run.attempt, run.prefer, run.avoid) == (1, 1, None, "c1/*")
    assert [(b.place, b.until, b.soft) for b in run.blocked] == [("c1/p", 605.0, True)]
    assert run.job_name == "x-c0-t1-a1"
    # another place takes it, even queued: that one; nowhere else: back at once
    failed, queued = offer("c1", "p"), offer("c2", "q", gpus_free=0, nodes_free=0, est_in=3600)
    kw = {"blocked": run.blocked, "avoid": run.avoid, "now": 100.0}
    assert placement.rank([failed, queued], **kw).chosen is queued
    assert placement.rank([failed], **kw).chosen is failed
    # a move of a job waiting elsewhere does not go back to it within the cooldown
    assert placement.reconsider(queued, [failed], "fastest", blocked=run.blocked,
                                now=100.0) is None


def test_failover_strategy_prefers_the_same_place_once():
    run = RunState(prefix="x")
    job_recovery = {"strategy": "FAILOVER"}
    first = _decide(run, _ended(run, JobState.PREEMPTED, reason="spot"), job_recovery)
    assert first.prefer == "c1/p" and first.block is None
    recovery.record(run, first)
    second = _decide(run, _ended(run, JobState.PREEMPTED, reason="spot"), job_recovery)
    assert second.block.place == "c1/p" and second.prefer is None
    assert "again: moving elsewhere (FAILOVER)" in second.message


def test_gives_up_after_max_failovers_with_every_attempt():
    run = RunState(prefix="x")
    recovery.record(run, _decide(run, _ended(run, JobState.LOST, reason="gone"),
                                 max_failovers=1))
    verdict = _decide(run, _ended(run, JobState.LOST, reason="gone again", conn="c2"),
                      max_failovers=1)
    assert verdict.action == FAIL and verdict.cancel
    assert "lost to infrastructure failures 2 times; gave up (max_failovers=1)" in \
        verdict.message
    assert "attempt 1: c1/p job 1: lost gone" in verdict.message
    assert "attempt 2: c2/p job 2: lost gone again" in verdict.message


def test_user_failure_fails_with_the_log_tail():
    run = RunState(prefix="x")
    verdict = _decide(run, _ended(run, JobState.FAILED, exit_code=1, reason="exit code 1"))
    assert verdict.action == FAIL and not verdict.cancel
    assert verdict.message.startswith("job 1 on c1 failed: exit code 1; no restart on user")
    assert verdict.message.endswith("Last lines of its log:\nTraceback: boom")


def test_max_restarts_on_errors_counts_restarts():
    run = RunState(prefix="x")
    job_recovery = {"max_restarts_on_errors": 1}
    verdict = _decide(run, _ended(run, JobState.FAILED, exit_code=1), job_recovery)
    # SkyPilot's default strategy recovers a restart elsewhere first; the place is not blocked
    assert verdict.action == AGAIN and verdict.avoid == "c1/*" and not verdict.cancel
    assert verdict.prefer is None and verdict.block is None
    assert "restart 1 of 1" in verdict.message and "EAGER_NEXT_REGION" in verdict.message
    recovery.record(run, verdict)
    assert (run.restarts, run.failovers, run.attempt) == (1, 0, 1)
    verdict = _decide(run, _ended(run, JobState.FAILED, exit_code=1), job_recovery)
    assert verdict.action == FAIL and "failed after 1 restart(s)" in verdict.message


def test_recover_on_exit_codes_is_bounded_by_max_failovers():
    run = RunState(prefix="x")
    job_recovery = {"recover_on_exit_codes": [33]}
    for _ in range(2):
        verdict = _decide(run, _ended(run, JobState.FAILED, exit_code=33), job_recovery,
                          max_failovers=2)
        assert verdict.counts_as == "exit_code_restart"
        recovery.record(run, verdict)
    assert (run.code_restarts, run.restarts) == (2, 0)
    verdict = _decide(run, _ended(run, JobState.FAILED, exit_code=33), job_recovery,
                      max_failovers=2)
    assert verdict.action == FAIL and "already restarted 2 times" in verdict.message


def test_cancelled_outside_airflow_is_not_placed_again():
    run = RunState(prefix="x")
    verdict = _decide(run, _ended(run, JobState.CANCELLED, reason="scancel"), tail="")
    assert verdict.action == FAIL and not verdict.cancel
    assert verdict.message.startswith("job 1 on c1 ended cancelled: scancel; not placed again")


def test_only_a_verdict_to_place_again_is_recorded():
    run = RunState(prefix="x")
    with pytest.raises(ValueError):
        recovery.record(run, recovery.Verdict(FAIL, "no"))


def test_a_restart_goes_where_the_strategy_recovers_to():
    run = RunState(prefix="x")
    failover = _decide(run, _ended(run, JobState.FAILED, exit_code=1),
                       {"max_restarts_on_errors": 1, "strategy": "FAILOVER"})
    assert (failover.prefer, failover.avoid) == ("c1/p", None)
    assert "the same place first (FAILOVER)" in failover.message


def test_any_ranks_exit_code_in_recover_on_exit_codes_restarts():
    """SkyPilot restarts when any node's exit code is listed: rank 1 exited 42 (listed),
    rank 0 then 1 (its peer gone); the status names rank 0's code."""
    run = RunState(prefix="x")
    handle = _handle(1)
    run.record(handle)
    ended = run.close(handle, JobStatus(JobState.FAILED, reason="exit code 1 on rank 0",
                                        exit_code=1, exit_codes=[1, 42]), now=100.0)
    verdict = _decide(run, ended, {"recover_on_exit_codes": [42]})
    assert verdict.action == AGAIN and verdict.counts_as == "exit_code_restart"
    assert "exit code 42 is in recover_on_exit_codes" in verdict.message
    assert RunState.from_dict(run.to_dict()).attempts[0].exit_codes == [1, 42]


def test_eager_next_region_tries_the_failed_aws_region_last():
    """SkyPilot's order after a preemption in us-east-1a: another region first, and only then
    the same region's zones (tried last, not blocked: with nowhere else to go it goes back)."""
    from airflow_skypilot import placement
    from tests.fakes import offer

    run = RunState(prefix="x")
    handle = JobHandle(backend="aws", connection="aws1", job_id="i-1", job_name="j-a0",
                       location="us-east-1/us-east-1a", infra="aws/us-east-1/us-east-1a")
    run.record(handle)
    ended = run.close(handle, JobStatus(JobState.PREEMPTED, reason="spot reclaimed"),
                      now=100.0)
    verdict = _decide(run, ended)
    assert verdict.block.place == "aws1/us-east-1/us-east-1a" and verdict.block.soft
    assert verdict.avoid == "aws1/us-east-1/*"
    recovery.record(run, verdict)
    zones = [offer("aws1", z) for z in ("us-east-1/us-east-1a", "us-east-1/us-east-1b",
                                        "us-west-2/us-west-2a")]
    zones[2].price_per_hour = 9.0  # dearer: the region, not the price, decides here
    plan = placement.rank(zones, blocked=run.blocked, avoid=run.avoid, now=200.0)
    assert plan.chosen.location == "us-west-2/us-west-2a"
    assert [r.verdict for r in plan.rows] == ["chosen", "candidate", "blocked"]
    assert "tried last" in plan.rows[1].reason
    # nothing else: the same region's other zone after all (a soft preference, not a block)
    plan = placement.rank(zones[:2], blocked=run.blocked, avoid=run.avoid, now=200.0)
    assert plan.chosen.location == "us-east-1/us-east-1b"
    # not even that: the failed zone itself (its block is soft)
    plan = placement.rank(zones[:1], blocked=run.blocked, avoid=run.avoid, now=200.0)
    assert plan.chosen.location == "us-east-1/us-east-1a"
    # nor does a queue elsewhere win over it: SkyPilot falls back rather than wait elsewhere
    queued = offer("aws1", "us-west-2/us-west-2a", gpus_free=0, nodes_free=0, est_in=36000)
    plan = placement.rank([zones[1], queued], blocked=run.blocked, avoid=run.avoid, now=200.0)
    assert plan.chosen.location == "us-east-1/us-east-1b"
    assert "tried last" not in plan.rows[0].reason
