"""The scheduling benchmark's simulator (benchmarks/scheduling.py) still runs the real code.

Not a benchmark: the numbers are in benchmarks/README.md. These checks keep the simulator
runnable while the backends and placement change under it (it calls their probe parsers, offer
builders, ``placement.rank``/``reconsider``, ``rebalance._current`` and ``ledger.hold``), and
keep its Slurm backfill model honest.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import scheduling  # benchmarks/ is not a package: on sys.path above


def test_backfill_profile_finds_holes_and_respects_reservations():
    running = [scheduling.BJob(1, 6, 100.0, 50, 0, start=0, node=0, state="running"),
               scheduling.BJob(2, 8, 300.0, 50, 0, start=0, node=1, state="running")]
    profile = scheduling.Profile(0.0, [8, 8], running)
    assert profile.earliest(2, 50, 0) == (0.0, 0)  # the hole beside the 6-GPU job
    assert profile.earliest(8, 50, 0) == (100.0, 0)  # a whole node once the first job's limit ends
    profile.take(0, 100.0, 200.0, 4)  # a reservation from 100 to 300
    assert profile.earliest(8, 50, 0) == (300.0, 0)
    assert profile.earliest(4, 500, 0) == (100.0, 0)


def test_runs_are_deterministic_and_strategies_share_the_trace():
    first = scheduling.simulate("fastest+moves", 1, scheduling.ALL_KNOBS).row()
    scheduling.simulate("skypilot", 1)
    again = scheduling.simulate("fastest+moves", 1, scheduling.ALL_KNOBS).row()
    assert first == again
    assert first["mean_wait_min"] > 0


@pytest.mark.parametrize("strategy", scheduling.STRATEGIES)
def test_every_strategy_finishes_every_job(strategy):
    result = scheduling.simulate(strategy, 0)
    assert len(result.waits) == scheduling.Scenario().jobs
    assert all(w >= 0 for w in result.waits)
    if strategy in ("cheapest", "cheapest+moves", "one-cluster"):
        assert result.cloud_usd == 0  # never a paid place
    if not strategy.endswith("moves"):
        assert result.moves == 0


def test_the_simulated_probe_feeds_the_real_slurm_code_and_step7_withholds_it():
    import copy

    from airflow_skypilot.backends.slurm.cluster import parse_cluster

    _, _, places = scheduling.warm(scheduling.Scenario(), 0)
    alpha = copy.deepcopy(places["slurm_alpha"])
    for knobs, real in ((scheduling.Knobs(), True), (scheduling.STEP7, False)):
        alpha.knobs = knobs
        alpha.changed()
        state = parse_cluster(alpha._probe_text(0.0, [(1, 1, 0, 0)], 3600.0))
        assert state.pending_jobs and state.partitions["gpu"].pending == len(alpha.pending)
        planned = [j for j in state.pending_jobs if j.start and j.sched_nodes and j.gpus]
        assert bool(planned) == real  # backfill's plan reaches slurm.queue.hold
        assert (state.discount is not None and state.discount.ratio is not None) == real
        assert state.starts  # test-only's answer for the shape


def test_the_real_ledger_holds_a_sweeps_room_and_its_entries_are_the_operators():
    """A sweep's members probe at the same moment: with the ledger each ranks after the ones
    before it noted their choice (``ledger.hold``), so fewer pile onto one free place."""
    from airflow_skypilot.ledger import PlacementLedger

    sim = scheduling.Sim(scheduling.Scenario(), scheduling.Knobs(), "fastest", 0)
    sim.run()
    assert sim.entries  # written as Placer writes them, stamped once submitted
    written: list[dict] = []
    PlacementLedger("").note(written, "x", sim.jobs[0].offer)
    assert {tuple(sorted(e)) for e in sim.entries} <= {
        tuple(sorted(written[0])), tuple(sorted([*written[0], "submitted"]))}
    without = scheduling.Sim(scheduling.Scenario(),
                             scheduling.replace(scheduling.Knobs(), herd_avoid=False), "fastest", 0)
    result = without.run()
    assert not without.entries
    assert scheduling.simulate("fastest", 0).row() != result.row()


def test_the_simulated_aws_connection_decides_larger_instances_through_offers_for():
    """The AWS knob is the connection's extra ``larger_instances``: the product's ``offers_for``
    offers exactly the GPUs asked for by default, a larger instance only with the extra."""
    offered = {}
    for aws_types in ("exact", "exact-first"):
        knobs = scheduling.replace(scheduling.Knobs(), aws_types=aws_types)
        sim = scheduling.Sim(scheduling.Scenario(), knobs, "fastest", 0)
        aws = sim.places["aws"]
        assert aws.settings.larger_instances == (aws_types == "exact-first")
        job = next(j for j in sim.jobs if any(
            r.accelerator == "A100" and r.accelerator_count < 8 for r in j.task.candidates))
        offered[aws_types] = [o for o in aws.offers(job.task, 0.0, 3600.0)
                              if o.request.accelerator == "A100"]
    assert offered["exact"] and not any(o.fits for o in offered["exact"])
    assert "larger_instances" in offered["exact"][0].reason
    assert {o.instance_type for o in offered["exact-first"] if o.fits} == {"p4d.24xlarge"}
    assert scheduling.Knobs().aws_types == "exact"
    assert scheduling.STEP7.aws_types == "exact-first"  # Step 7 offered the larger instance
    assert scheduling.ALL_KNOBS.aws_types == scheduling.Knobs().aws_types  # not a what-if


def test_racing_copies_go_only_to_the_backends_named():
    from dataclasses import replace

    def raced(sc):
        sim = scheduling.Sim(sc, scheduling.Knobs(), "fastest+race", 0)
        sim.run()
        return {place.split("/")[0] for j in sim.jobs for place in j.raced}

    assert raced(scheduling.Scenario()) == {"slurm_alpha", "slurm_beta", "k8s"}
    assert raced(replace(scheduling.Scenario(), race_backends=("slurm",))) == {
        "slurm_alpha", "slurm_beta"}
