"""placement.reconsider: when a job waiting in a queue moves, and when it stays (pure)."""

from __future__ import annotations

import pytest

from airflow_skypilot.placement import (
    MAX_MOVES,
    PAID_MOVE_MIN_WAIT_S,
    Blocked,
    judge,
    reconsider,
)
from tests.fakes import offer


def _here(est_in=3600, price=0.0, index=0):
    return offer("alpha", "batch", nodes_free=0, gpus_free=0, est_in=est_in, price=price,
                 index=index)


def test_a_place_that_can_start_it_now_wins_over_the_queue():
    free = offer("beta", "main")
    moved = reconsider(_here(), [_here(), free], "fastest", waited_s=90)
    assert moved is not None and moved.place_key == "beta/main"
    assert moved.details["move_reason"] == \
        "waited 1m; beta/main can start it now; here est. in 1h00m"


def test_it_stays_when_its_own_place_can_start_it_now():
    assert reconsider(offer("alpha", "batch"), [offer("beta", "main")], "fastest") is None


@pytest.mark.parametrize(("here", "there", "moves"), [
    (3600, 600, True),     # saves 50 of 60 min
    (3600, 1900, False),   # saves 28 of 60 min: less than half
    (200, 20, True),       # saves 180 s: over half the wait and over the 120 s floor
    (150, 40, False),      # saves 110 s: over half, but below the 120 s floor
])
def test_a_queue_elsewhere_needs_a_clear_margin(here, there, moves):
    other = offer("beta", "main", nodes_free=0, est_in=there)
    moved = reconsider(_here(est_in=here), [other], "fastest")
    assert (moved is not None) is moves


def test_unknown_estimates_give_no_margin_but_free_now_still_wins():
    unknown_here = _here(est_in=None)
    assert reconsider(unknown_here, [offer("beta", "main", nodes_free=0, est_in=60)],
                      "fastest") is None
    assert reconsider(unknown_here, [offer("beta", "main")], "fastest").place_key == \
        "beta/main"
    assert reconsider(_here(), [offer("beta", "main", nodes_free=0, est_in=None)],
                      "fastest") is None


def test_moves_are_bounded():
    free = offer("beta", "main")
    assert reconsider(_here(), [free], "fastest", moves=MAX_MOVES - 1) is not None
    assert reconsider(_here(), [free], "fastest", moves=MAX_MOVES) is None


def test_cheapest_never_moves_to_a_costlier_place_fastest_may_to_start_now():
    paid = offer("aws", "us-east-1a", price=3.0)
    assert reconsider(_here(), [paid], "cheapest") is None
    moved = reconsider(_here(), [paid], "fastest")
    assert moved is not None and moved.details["move_reason"].endswith("$3/h vs $0/h")


@pytest.mark.parametrize(("here", "moves"), [
    (1799, False),  # starts within PAID_MOVE_MIN_WAIT_S where it is: not worth paying for
    (1800, True),
    (None, True),   # no estimate where it is: a place that starts it now wins
])
def test_fastest_pays_to_move_only_to_save_a_long_wait(here, moves):
    paid = offer("aws", "us-east-1a", price=3.0)
    assert PAID_MOVE_MIN_WAIT_S == 1800
    look = judge(_here(est_in=here), [paid], "fastest")
    assert (look.move_to is not None) is moves
    if not moves:
        assert look.why == ("the other places cost more, and here it starts est. in 29m, "
                            "under paid_move_min_wait (30m)")


def test_a_short_wait_still_moves_to_a_place_that_costs_no_more():
    free = offer("beta", "main")
    paid = offer("aws", "us-east-1a", price=3.0)
    moved = reconsider(_here(est_in=600), [paid, free], "fastest")
    assert moved is not None and moved.place_key == "beta/main"
    # and a paid place that starts it now is taken for a short wait when the setting is off
    assert reconsider(_here(est_in=600), [paid], "fastest", paid_min_wait=0) is not None


def test_the_request_price_cap_holds_for_moves():
    capped = offer("aws", "us-east-1a", price=30.0, max_cost=10.0)
    assert reconsider(_here(), [capped], "fastest") is None


def test_ordered_never_moves_to_a_later_candidate():
    later = offer("beta", "main", index=1)
    assert reconsider(_here(index=0), [later], "fastest", ordered=True) is None
    earlier = offer("beta", "main", index=0)
    assert reconsider(_here(index=1), [earlier], "fastest", ordered=True) is not None


def test_blocked_places_and_the_current_place_are_not_destinations():
    free = offer("beta", "main")
    assert reconsider(_here(), [free], "fastest",
                      blocked=[Blocked("beta/main", "node failure")]) is None
    same_place_other_candidate = offer("alpha", "batch", index=1)
    assert reconsider(_here(), [same_place_other_candidate], "fastest") is None


def test_no_ping_pong_between_two_queues_with_similar_estimates():
    a = offer("alpha", "batch", nodes_free=0, est_in=1800)
    b = offer("beta", "main", nodes_free=0, est_in=1500)
    assert reconsider(a, [b], "fastest") is None
    assert reconsider(b, [a], "fastest") is None


def test_under_cheapest_a_place_that_starts_it_now_is_not_hidden_by_a_cheaper_queue():
    here = _here(price=2.0)
    cheaper_queue = offer("beta", "main", nodes_free=0, est_in=None, price=1.0)
    free_same_price = offer("gamma", "gpu", price=2.0)
    moved = reconsider(here, [cheaper_queue, free_same_price], "cheapest")
    assert moved is not None and moved.place_key == "gamma/gpu"


def test_a_move_target_whose_price_rose_since_the_look_is_no_longer_as_promised():
    from airflow_skypilot.placement import as_promised

    chosen = offer("aws", "us-east-1a", price=1.0, max_cost=2.0)
    assert as_promised(chosen, [offer("aws", "us-east-1a", price=1.02, max_cost=2.0)])
    # a spot price that moved: over the request's cap, or more than 5% over what was judged
    assert as_promised(chosen, [offer("aws", "us-east-1a", price=5.0, max_cost=2.0)]) is None
    assert as_promised(offer("aws", "us-east-1a", price=1.0),
                       [offer("aws", "us-east-1a", price=1.5)]) is None


def test_the_jobs_own_place_is_read_for_its_own_gpu_count():
    """any_of A100:8 else A100:4, both at one partition: a job placed as A100:4 is judged by
    the A100:4 offer there (the A100:8 one waits far longer), not by the first candidate's."""
    from airflow_skypilot.backends.base import JobHandle, JobState, JobStatus
    from airflow_skypilot.rebalance import _current

    eight = offer("c1", "p", count=8, nodes_free=0, est_in=7200, index=0)
    four = offer("c1", "p", count=4, nodes_free=1, index=1)
    handle = JobHandle(backend="fake", connection="c1", job_id="1", job_name="j",
                       location="p", infra="fake/c1/p", accelerator="A100", gpus_per_node=4)
    current = _current([eight, four], handle, JobStatus(JobState.PENDING))
    assert current is not None and current.gpus_per_node == 4 and current.free_now
