"""Placement: free vs queued vs blocked vs price, ordered vs any-of, and the explanation."""

from __future__ import annotations

import time

import pytest

from airflow_skypilot.placement import Blocked, rank
from tests.fakes import offer


def _verdicts(plan):
    return [(r.connection, r.location, r.verdict) for r in plan.rows]


def test_free_now_beats_queued_even_if_queued_is_cheaper():
    queued = offer("alpha", "batch", gpus_free=2, nodes_free=0, est_in=3600, count=4)
    free = offer("beta", "main", gpus_free=8, price=3.0, count=4)
    plan = rank([queued, free])
    assert plan.chosen is free
    row = next(r for r in plan.rows if r.connection == "alpha")
    assert row.verdict == "queued"
    assert row.reason == "2 of 8 A100 free, need 4 A100; est. start in 1h00m"


def test_soonest_start_wins_among_queued():
    late = offer("a", nodes_free=0, est_in=7200)
    soon = offer("b", nodes_free=0, est_in=600)
    unknown = offer("c", nodes_free=0, est_in=None)
    plan = rank([late, unknown, soon])
    assert [o.connection for o in plan.ranked] == ["b", "a", "c"]
    assert plan.rows[0].reason.startswith("nothing free now anywhere; soonest:")


def test_queues_alike_go_by_the_work_ahead_per_gpu_not_by_name():
    # both starts unknown: 6 jobs ahead of 16 GPUs beats 1 of 2, whatever the names say
    small = offer("a", gpus_free=0, gpus_total=2, nodes_free=0, pending=1)
    big = offer("b", gpus_free=0, gpus_total=16, nodes_free=0, pending=6)
    unsaid = offer("0", gpus_free=0, gpus_total=64, nodes_free=0, pending=None)
    assert [o.connection for o in rank([small, unsaid, big]).ranked] == ["b", "a", "0"]
    # a known start still comes first
    known = offer("z", gpus_free=0, nodes_free=0, pending=50, est_in=7200)
    assert rank([small, big, known]).chosen is known


def test_price_breaks_ties_between_free_offers():
    plan = rank([offer("cloud", price=32.8), offer("onprem", price=0.0)])
    assert plan.chosen.connection == "onprem"
    assert plan.rows[1].reason == "$32.8/h vs $0/h"


def test_cheapest_policy_prefers_price_over_speed():
    free_dear = offer("cloud", price=10.0)
    queued_cheap = offer("hpc", nodes_free=0, est_in=600, price=0.0)
    plan = rank([free_dear, queued_cheap], "cheapest")
    assert plan.chosen is queued_cheap
    assert plan.rows[1].reason == "free now, but $10/h vs $0/h"


def test_a_cpu_only_job_leaves_gpu_nodes_to_gpu_jobs_when_elsewhere_is_as_good():
    on_gpus = offer("gpu-cluster", acc=None, gpus_free=None, gpus_total=None)
    on_gpus.details["gpu_place"] = True
    on_cpus = offer("cpu-cluster", acc=None, gpus_free=None, gpus_total=None)
    plan = rank([on_gpus, on_cpus])
    assert plan.chosen is on_cpus
    row = next(r for r in plan.rows if r.connection == "gpu-cluster")
    assert row.reason == "would take GPU nodes for a job that asks for no GPU"
    # but a GPU place that can start now still beats a CPU place with a queue
    queued = offer("cpu-cluster", acc=None, gpus_free=None, gpus_total=None, nodes_free=0,
                   est_in=600)
    assert rank([on_gpus, queued]).chosen is on_gpus


def test_blocked_places_are_skipped_and_explained():
    at = time.mktime((2026, 1, 1, 12, 3, 0, 0, 0, -1)) - time.timezone
    bad = offer("alpha", "batch")
    plan = rank([bad, offer("beta", "main", price=1.0)],
                blocked=[Blocked("alpha/batch", "node failure", at=at)])
    assert plan.chosen.connection == "beta"
    assert ("alpha", "batch", "blocked") in _verdicts(plan)
    assert "blocked: node failure at 12:03" in plan.table()


def test_blocking_a_whole_connection():
    plan = rank([offer("alpha", "batch"), offer("alpha", "short")],
                blocked=[Blocked("alpha/*", "cluster unreachable")])
    assert plan.chosen is None
    assert plan.summary.startswith("no placement: 2 blocked")


def test_no_fit_offers_are_explained_not_chosen():
    plan = rank([offer("alpha", fits=False, reason="needs 16 GPUs per node, nodes have 4")])
    assert plan.chosen is None
    assert plan.rows[0].verdict == "no fit"
    assert plan.rows[0].reason == "needs 16 GPUs per node, nodes have 4"


def test_unreachable_connections_get_rows():
    plan = rank([offer("beta")], unreachable={"alpha": "connection refused"})
    assert plan.chosen.connection == "beta"
    assert ("alpha", "", "unreachable") in _verdicts(plan)


def test_any_of_picks_free_then_cheapest_candidate():
    h100 = offer("c", "h", acc="H100", index=1, price=4.0)
    a100 = offer("c", "a", acc="A100", index=0, price=2.0)
    assert rank([h100, a100]).chosen is a100


def test_ordered_prefers_earlier_candidate_when_free():
    first = offer("c", "x", acc="H100", index=0, price=9.0)
    second = offer("c", "y", acc="A100", index=1, price=1.0)
    plan = rank([second, first], ordered=True)
    assert plan.chosen is first
    assert plan.rows[1].reason == "candidate #2; #1 comes first in your order"


def test_ordered_falls_to_a_later_candidate_that_is_free_now():
    first_busy = offer("c", "x", acc="H100", index=0, nodes_free=0, est_in=3600)
    second_free = offer("c", "y", acc="A100", index=1)
    assert rank([first_busy, second_free], ordered=True).chosen is second_free


def test_ordered_cheapest_keeps_order_before_price():
    first = offer("c", "x", index=0, price=9.0)
    second = offer("c", "y", index=1, price=1.0)
    assert rank([second, first], "cheapest", ordered=True).chosen is first


def test_prefer_same_place_first_for_failover_strategy():
    same = offer("alpha", "batch", price=1.0)
    other = offer("beta", "main", price=0.0)
    assert rank([same, other]).chosen is other
    assert rank([same, other], prefer="alpha/batch").chosen is same


def test_prefer_does_not_wait_on_a_busy_place():
    same = offer("alpha", "batch", nodes_free=0, est_in=600)
    other = offer("beta", "main")
    assert rank([same, other], prefer="alpha/batch").chosen is other


def test_multi_node_needs_enough_free_nodes():
    one_free = offer("a", num_nodes=2, nodes_free=1, est_in=300)
    two_free = offer("b", num_nodes=2, nodes_free=2, price=5)
    assert rank([one_free, two_free]).chosen is two_free


def test_max_hourly_cost_is_an_instances_price_as_in_skypilot():
    """SkyPilot's Resources are per node: its catalog keeps instance types whose hourly
    price is within the cap. Two nodes at $6/h each are within $10/h; at $12/h they are not."""
    two = offer("cloud", num_nodes=2, nodes_free=2, price=12.0, max_cost=10.0)
    assert rank([two]).chosen is two
    plan = rank([offer("cloud", num_nodes=2, nodes_free=2, price=24.0, max_cost=10.0)])
    assert plan.chosen is None
    assert plan.rows[0].reason == "$12/h a node is over max_hourly_cost $10/h"


def test_max_hourly_cost_excludes_dear_offers():
    plan = rank([offer("cloud", price=40.0, max_cost=10.0)])
    assert plan.chosen is None
    assert plan.rows[0].verdict == "over budget"
    assert plan.rows[0].reason == "$40/h is over max_hourly_cost $10/h"


def test_unknown_policy_is_an_error():
    with pytest.raises(ValueError, match="unknown placement policy"):
        rank([], "random")


def test_table_and_json_list_every_offer():
    plan = rank([offer("a"), offer("b", fits=False, reason="no GPUs")],
                unreachable={"c": "timeout"})
    table = plan.table().splitlines()
    assert table[0].split()[:3] == ["connection", "location", "request"]
    assert len(table) == 2 + 3
    assert table[2].startswith("*")
    data = plan.to_json()
    assert [r["verdict"] for r in data["rows"]] == ["chosen", "no fit", "unreachable"]
    assert data["chosen"]["connection"] == "a"


def test_blocked_round_trips():
    b = Blocked("a/b", "preempted", at=5.0)
    assert Blocked.from_dict(b.to_dict()) == b


def test_blocking_every_location_under_a_prefix():
    plan = rank([offer("aws", "us-east-1/us-east-1a"), offer("aws", "us-east-1/us-east-1b"),
                 offer("aws", "us-west-2/us-west-2a")],
                blocked=[Blocked("aws/us-east-1/*", "no capacity in the region")])
    assert plan.chosen.location == "us-west-2/us-west-2a"


def test_a_cheaper_queue_chosen_under_cheapest_does_not_claim_nothing_is_free():
    queued = offer("onprem", "gpu", nodes_free=0, est_in=3600, price=0.0)
    free = offer("aws", "us-east-1/us-east-1a", price=4.1)
    plan = rank([free, queued], "cheapest")
    assert plan.chosen is queued
    assert "nothing free now" not in plan.rows[0].reason
    assert plan.rows[0].reason.startswith(
        "queued (8 of 8 A100 free, need 1 A100; est. start in 1h00m) though "
        "aws/us-east-1/us-east-1a is free now: this one costs $0/h vs $4.1/h")
    assert plan.rows[1].reason == "free now, but $4.1/h vs $0/h"


def test_an_earlier_queued_candidate_under_ordered_cheapest_says_a_later_one_is_free():
    first = offer("k8s", "ctx/ns", acc="H100", index=0, nodes_free=0, est_in=600, price=10)
    second = offer("k8s", "ctx/ns", acc="A100", index=1, price=3)
    plan = rank([second, first], "cheapest", ordered=True)
    assert plan.chosen is first
    assert "nothing free now" not in plan.rows[0].reason
    assert "k8s/ctx/ns is free now: this one comes earlier in your order" in plan.rows[0].reason
    assert plan.rows[1].reason == "free now, but later in your order"


def test_nothing_free_names_the_soonest_only_when_it_is_the_soonest():
    first = offer("a", acc="H100", index=0, nodes_free=0, est_in=3600)
    second = offer("b", acc="A100", index=1, nodes_free=0, est_in=60)
    plan = rank([second, first], "fastest", ordered=True)
    assert plan.chosen is first
    assert plan.rows[0].reason.startswith("nothing free now anywhere; 8 of 8 H100 free")
    assert plan.rows[1].reason == "candidate #2; #1 comes first in your order"


def test_a_loser_to_the_failover_place_says_so_not_the_candidate_order():
    first = offer("a", "x", acc="H100", index=0)
    again = offer("b", "y", acc="A100", index=1)
    plan = rank([first, again], "fastest", ordered=True, prefer="b/y")
    assert plan.chosen is again
    assert plan.rows[1].reason == "b/y goes first: same place first (job_recovery FAILOVER)"


def test_queues_told_apart_by_their_depth_say_so_not_tie():
    deep = offer("s1", nodes_free=0, pending=10)
    short = offer("s2", nodes_free=0, pending=1)
    plan = rank([deep, short])
    assert plan.chosen is short
    assert plan.rows[1].reason == ("more work queued ahead: 10 job(s) pending for 8 A100 vs "
                                   "1 job(s) pending for 8 A100")
