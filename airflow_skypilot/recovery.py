"""What to do when a job ends badly: SkyPilot's recovery settings as small pure classes.

Infrastructure failures (the allocation is gone: node failure, preemption, lost) are placed
again, up to the operator's ``max_failovers``, following ``job_recovery.strategy``:

``EAGER_NEXT_REGION`` (SkyPilot's default)
    move elsewhere at once: the failed place is blocked (for ``block_cooldown``) while another
    place takes the job, a queue included, and its region (an AWS region; a Slurm or
    Kubernetes cluster, SkyPilot's region for them) is tried last while another place can
    start it now, as SkyPilot blocks the region for one launch and then retries everywhere:
    with nowhere else to go, the job goes back at once rather than wait out a cooldown.
``FAILOVER``
    try the same place first (if it can start the job now); block it (for ``block_cooldown``)
    only when it fails again.

User-code failures (the allocation was fine, the program exited non-zero) are restarted only
as ``job_recovery`` allows: an exit code of any rank listed in ``recover_on_exit_codes``
restarts without counting against ``max_restarts_on_errors`` (as in SkyPilot; here still
bounded by ``max_failovers`` so a job that always exits that way cannot loop forever); any
other failure counts against ``max_restarts_on_errors`` (default 0: no restart). A restart
goes where the strategy recovers to (SkyPilot's controller recovers a restarted job through
it): ``FAILOVER`` the same place first, ``EAGER_NEXT_REGION`` elsewhere first (the place that
failed is tried last, not blocked: the program, not the place, failed).

The rule has one home: :func:`decide` answers what to do after an attempt ended (succeed, place
again, or fail with a message), from the run's state alone; :func:`record` does the accounting
of a placement again. The operator acts on the answer in ``execute_complete`` (deferred) and in
its worker loop (not deferred) alike.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from airflow_skypilot.backends.base import JobState
from airflow_skypilot.runstate import Attempt, Blocked, RunState


@dataclass(frozen=True)
class Decision:
    """Whether to submit again, where not to go, where to try first, and why."""

    again: bool
    reason: str
    block: Blocked | None = None
    prefer: str | None = None
    counts_as: str = ""  # "failover" | "restart" | "exit_code_restart"
    avoid: str | None = None  # a place (or ``conn/region/*``) tried last


def region_of(attempt: Attempt) -> str:
    """The place pattern of ``attempt``'s region: ``conn/<region>/*`` for an AWS zone, else
    its connection's (a Slurm cluster is SkyPilot's region, its partitions the zones; a
    Kubernetes cluster likewise)."""
    if attempt.backend == "aws" and "/" in attempt.location:
        return f"{attempt.connection}/{attempt.location.split('/', 1)[0]}/*"
    return f"{attempt.connection}/*"


class EagerNextRegion:
    name = "EAGER_NEXT_REGION"

    def on_infra_failure(self, ended: Attempt, what: str, history: Sequence[Attempt],
                         at: float) -> Decision:
        return Decision(True, f"{what} at {ended.place}: moving elsewhere (EAGER_NEXT_REGION)",
                        block=Blocked(ended.place, what, at, soft=True), counts_as="failover",
                        avoid=region_of(ended))

    def on_restart(self, ended: Attempt) -> Decision:
        return Decision(True, "elsewhere first (EAGER_NEXT_REGION)", avoid=region_of(ended))


class Failover:
    name = "FAILOVER"

    def on_infra_failure(self, ended: Attempt, what: str, history: Sequence[Attempt],
                         at: float) -> Decision:
        place = ended.place
        failed_here = sum(1 for a in history if a.place == place and a.infra_failure)
        if failed_here <= 1:
            return Decision(True, f"{what} at {place}: trying the same place first (FAILOVER)",
                            prefer=place, counts_as="failover")
        return Decision(True, f"{what} at {place} again: moving elsewhere (FAILOVER)",
                        block=Blocked(place, what, at), counts_as="failover")

    def on_restart(self, ended: Attempt) -> Decision:
        return Decision(True, "the same place first (FAILOVER)", prefer=ended.place)


STRATEGIES = {"EAGER_NEXT_REGION": EagerNextRegion, "FAILOVER": Failover}


def strategy_for(job_recovery: Mapping[str, Any]):
    return STRATEGIES[job_recovery.get("strategy") or "EAGER_NEXT_REGION"]()


def on_user_failure(job_recovery: Mapping[str, Any], exit_codes: Sequence[int], restarts: int,
                    code_restarts: int, max_code_restarts: int) -> Decision:
    """Restart a job whose program failed, only as ``job_recovery`` allows (``exit_codes``:
    every failed rank's; any of them in ``recover_on_exit_codes`` counts)."""
    codes = list(job_recovery.get("recover_on_exit_codes") or [])
    matched = next((c for c in exit_codes if c in codes), None)
    if matched is not None:
        if code_restarts < max_code_restarts:
            return Decision(True, f"exit code {matched} is in recover_on_exit_codes: "
                                  "restarting", counts_as="exit_code_restart")
        return Decision(False, f"exit code {matched} is in recover_on_exit_codes, but it "
                               f"already restarted {code_restarts} times (max_failovers)")
    limit = int(job_recovery.get("max_restarts_on_errors") or 0)
    if restarts < limit:
        return Decision(True, f"restart {restarts + 1} of {limit} (max_restarts_on_errors)",
                        counts_as="restart")
    if limit:
        return Decision(False, f"failed after {restarts} restart(s) (max_restarts_on_errors: "
                               f"{limit})")
    return Decision(False, "no restart on user errors (job_recovery.max_restarts_on_errors is "
                           "0)")


# --- the rule ----------------------------------------------------------------------------------
SUCCEED, AGAIN, FAIL = "succeed", "again", "fail"
#: which RunState counter a placement again uses
COUNTERS = {"failover": "failovers", "restart": "restarts", "exit_code_restart": "code_restarts"}
_INFRA_FAILURES = frozenset(s.value for s in JobState if s.infra_failure)


@dataclass(frozen=True)
class Verdict:
    """What to do after an attempt ended.

    ``action`` is :data:`SUCCEED`, :data:`AGAIN` (place it again: ``block`` that place, try
    ``prefer`` first, count it as ``counts_as``) or :data:`FAIL` (``message`` says why).
    ``cancel``: the job may still run somewhere (its place failed, or went silent): stop it
    before anything else.
    """

    action: str
    message: str = ""
    block: Blocked | None = None
    prefer: str | None = None
    counts_as: str = ""
    cancel: bool = False
    avoid: str | None = None


def decide(run: RunState, ended: Attempt, job_recovery: Mapping[str, Any], max_failovers: int,
           *, tail: str = "", now: float | None = None) -> Verdict:
    """The failover rule: what to do now that ``ended`` (closed, in ``run.attempts``) ended.

    Pure: reads the run's counters and history, changes nothing (see :func:`record`).
    ``tail`` is the end of the job's log, quoted when a failure of the program is final.
    """
    now = time.time() if now is None else now
    where = f"job {ended.job_id} on {ended.connection}"
    if ended.state == JobState.SUCCEEDED.value:
        return Verdict(SUCCEED, f"{where} succeeded")
    if ended.state in _INFRA_FAILURES:
        if run.failovers >= max_failovers:
            return Verdict(FAIL, (
                f"job lost to infrastructure failures {run.failovers + 1} times; gave up "
                f"(max_failovers={max_failovers}). Last: {ended.reason}\n"
                + run.attempts_text()), cancel=True)
        decision = strategy_for(job_recovery).on_infra_failure(
            ended, ended.reason or ended.state, run.attempts, now)
        return Verdict(AGAIN, decision.reason, block=decision.block, prefer=decision.prefer,
                       counts_as="failover", cancel=True, avoid=decision.avoid)
    if ended.state == JobState.FAILED.value:
        codes = ended.exit_codes or ([] if ended.exit_code is None else [ended.exit_code])
        decision = on_user_failure(job_recovery, codes, run.restarts, run.code_restarts,
                                   max_failovers)
        if not decision.again:
            return Verdict(FAIL, f"{where} failed: {ended.reason}; {decision.reason}.\n"
                                 f"Last lines of its log:\n{tail}")
        where_to = strategy_for(job_recovery).on_restart(ended)
        return Verdict(AGAIN, f"{decision.reason}; {where_to.reason}", prefer=where_to.prefer,
                       counts_as=decision.counts_as, avoid=where_to.avoid)
    # CANCELLED outside Airflow, or anything unexpected: do not fight the user
    return Verdict(FAIL, f"{where} ended {ended.state}"
                         f"{': ' + ended.reason if ended.reason else ''}; not placed again.\n"
                         f"{tail}")


def replay(run: RunState, before: Sequence[Attempt], job_recovery: Mapping[str, Any],
           cooldown: float | None = None) -> None:
    """A new try adopts a job its try placed again after earlier attempts ended (the worker
    died meanwhile): ``before``, closed and oldest first, go into the run's history, and what
    each was placed again for counts as when it happened (its failover or restart counter,
    its place blocked from its end), so ``max_restarts_on_errors`` and ``max_failovers`` hold
    across the worker's death. An ending that placed nothing again (cancelled: a move, a
    submission cut short) counts nothing."""
    for ended in before:
        run.attempts.append(ended)
        verdict = decide(run, ended, job_recovery, max_failovers=1 << 30, now=ended.ended_at)
        if verdict.action == AGAIN:
            record(run, verdict, cooldown)


def record(run: RunState, verdict: Verdict, cooldown: float | None = None) -> None:
    """The accounting of a placement again: its counter, the blocked place (lapsing after
    ``cooldown`` seconds; None: for the rest of the run), where to try first and last, and
    the next attempt's number (its job name)."""
    if verdict.action != AGAIN:
        raise ValueError(f"only a verdict to place again is recorded, not {verdict.action!r}")
    counter = COUNTERS[verdict.counts_as]
    setattr(run, counter, getattr(run, counter) + 1)
    if verdict.block is not None:
        block = verdict.block
        if cooldown is not None:
            block = replace(block, until=block.at + cooldown)
        run.blocked.append(block)
    run.prefer = verdict.prefer
    run.avoid = verdict.avoid
    run.attempt += 1
