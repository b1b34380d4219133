"""What to do when a job ends badly: SkyPilot's recovery settings as small pure classes.

Infrastructure failures (the allocation is gone: node failure, preemption, lost) are placed
again, up to the operator's ``max_failovers``, following ``job_recovery.strategy``:

``EAGER_NEXT_REGION`` (SkyPilot's default)
    block the place that failed for the rest of this run and move elsewhere at once.
``FAILOVER``
    try the same place first (if it can start the job now); block it only when it fails again.

User-code failures (the allocation was fine, the program exited non-zero) are restarted only
as ``job_recovery`` allows: an exit code listed in ``recover_on_exit_codes`` restarts without
counting against ``max_restarts_on_errors`` (as in SkyPilot; here still bounded by
``max_failovers`` so a job that always exits that way cannot loop forever); any other failure
counts against ``max_restarts_on_errors`` (default 0: no restart).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from airflow_skypilot.placement import Blocked


@dataclass(frozen=True)
class Decision:
    """Whether to submit again, where not to go, where to try first, and why."""

    again: bool
    reason: str
    block: Blocked | None = None
    prefer: str | None = None
    counts_as: str = ""  # "failover" | "restart" | "exit_code_restart"


class EagerNextRegion:
    name = "EAGER_NEXT_REGION"

    def on_infra_failure(self, place: str, what: str, history: list[Mapping[str, Any]],
                         at: float) -> Decision:
        return Decision(True, f"{what} at {place}: moving elsewhere (EAGER_NEXT_REGION)",
                        block=Blocked(place, what, at), counts_as="failover")


class Failover:
    name = "FAILOVER"

    def on_infra_failure(self, place: str, what: str, history: list[Mapping[str, Any]],
                         at: float) -> Decision:
        failed_here = sum(1 for a in history if a.get("place") == place
                          and a.get("infra_failure"))
        if failed_here <= 1:
            return Decision(True, f"{what} at {place}: trying the same place first (FAILOVER)",
                            prefer=place, counts_as="failover")
        return Decision(True, f"{what} at {place} again: moving elsewhere (FAILOVER)",
                        block=Blocked(place, what, at), counts_as="failover")


STRATEGIES = {"EAGER_NEXT_REGION": EagerNextRegion, "FAILOVER": Failover}


def strategy_for(job_recovery: Mapping[str, Any]):
    return STRATEGIES[job_recovery.get("strategy") or "EAGER_NEXT_REGION"]()


def on_user_failure(job_recovery: Mapping[str, Any], exit_code: int | None, restarts: int,
                    code_restarts: int, max_code_restarts: int, place: str) -> Decision:
    """Restart a job whose program failed, only as ``job_recovery`` allows."""
    codes = list(job_recovery.get("recover_on_exit_codes") or [])
    if exit_code is not None and exit_code in codes:
        if code_restarts < max_code_restarts:
            return Decision(True, f"exit code {exit_code} is in recover_on_exit_codes: "
                                  "restarting", prefer=place, counts_as="exit_code_restart")
        return Decision(False, f"exit code {exit_code} is in recover_on_exit_codes, but it "
                               f"already restarted {code_restarts} times (max_failovers)")
    limit = int(job_recovery.get("max_restarts_on_errors") or 0)
    if restarts < limit:
        return Decision(True, f"restart {restarts + 1} of {limit} (max_restarts_on_errors)",
                        prefer=place, counts_as="restart")
    if limit:
        return Decision(False, f"failed after {restarts} restart(s) (max_restarts_on_errors: "
                               f"{limit})")
    return Decision(False, "no restart on user errors (job_recovery.max_restarts_on_errors is "
                           "0)")
