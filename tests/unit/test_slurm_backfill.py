"""Backfill's hole for a new job, from the running and pending jobs a probe lists: the planner
(:mod:`airflow_skypilot.backends.slurm.backfill`) and the offer that takes it over test-only's
FIFO answer when sooner."""

from __future__ import annotations

import math

from airflow_skypilot.backends.slurm import offers
from airflow_skypilot.backends.slurm.backfill import NOTHING, Need, backfill_start, parse_running
from airflow_skypilot.backends.slurm.cluster import parse_cluster
from airflow_skypilot.backends.slurm.queue import Reservation, parse_pending
from airflow_skypilot.backends.slurm.settings import SlurmSettings
from airflow_skypilot.spec import load_task

NOW = 1_800_000_000.0
H = 3600.0


def _pending(line: str):
    return parse_pending(line)


def _start(gpus: int, limit: float, *, running=(), pending=(), used=None, nodes=1,
           capacity=None, cpus: int = 1):
    """The hole for ``gpus`` A100 and ``cpus`` CPUs per node on nodes of 8 A100, 64 CPUs."""
    capacity = {n: Need(g, 64, 512000) for n, g in (capacity or {"n1": 8}).items()}
    running = [parse_running(r) for r in running]
    if used is None:
        used = {n: sum((Need(j.gpus.get("a100", 0), j.cpus_per_node, j.mem_mb)
                        for j in running if n in j.nodes), NOTHING) for n in capacity}
    return backfill_start(capacity, used, running, [_pending(p) for p in pending],
                          partitions={"gpu"}, now=NOW, gres_type="a100",
                          want=Need(gpus, cpus, 0), num_nodes=nodes, time_limit_s=limit)


def test_running_lines_parse_with_their_nodes_gpus_planned_end_cpus_and_memory():
    job = parse_running(f"7|n[1-2]|gres:gpu:a100:4|{int(NOW + H)}|16|4G")
    assert (job.nodes, job.gpus, job.end) == (("n1", "n2"), {"a100": 4}, NOW + H)
    assert (job.cpus_per_node, job.mem_mb) == (8, 4096)
    assert parse_running("8|n1|gres/gpu=2|Unknown").end == math.inf  # no time limit
    assert parse_running("") is None
    # the -O line (22.05, from the sandbox): --gpus=4 --mem-per-cpu=1000 -c 2 on one node: the
    # node's GPUs, and 2000M (tres-alloc), where %m says 1000M (per CPU)
    one = parse_running(f"1001|a2|N/A|{int(NOW + H)}|2|1000M|gres:gpu:4|N/A|1|"
                        "cpu=2,mem=2000M,node=1,billing=2|")
    assert (one.gpus, one.cpus_per_node, one.mem_mb) == ({"": 4}, 2, 2000)
    per_task = parse_running(f"9|a1|N/A|{int(NOW + H)}|3|1000M|N/A|gres:gpu:1|3|cpu=3,mem=3G|")
    assert per_task.gpus == {"": 3}
    # on two nodes, how Slurm split --gpus=3 is not said: on no node (the plan gives up)
    two = parse_running(f"10|n[1-2]|N/A|{int(NOW + H)}|2|1000M|gres:gpu:3|N/A|2|mem=2G|")
    assert (two.gpus, two.mem_mb) == ({}, 1024)


def test_memory_per_cpu_and_gpus_per_job_are_accounted_so_the_hole_is_found():
    # n1 runs a --gpus=4 --mem-per-cpu=8000 -c 16 job until +1h: 4 GPUs, 128000M in use; as %m
    # alone read it (8000M) the plan missed 120000M and gave no estimate
    line = (f"1|n1|N/A|{int(NOW + H)}|16|8000M|gres:gpu:4|N/A|1|cpu=16,mem=128000M,node=1|")
    used = {"n1": Need(4, 16, 128000)}
    assert _start(4, 600, running=[line], used=used) == NOW  # 4 GPUs left beside it
    assert _start(6, 600, running=[line], used=used) == NOW + H
    old = f"1|n1|gres:gpu:a100:4|{int(NOW + H)}|16|8000M"  # the 6-field line of before
    assert _start(4, 600, running=[old], used=used) is None
    # a pending job ahead on our partition whose per-job GPUs spread over 2 nodes: no plan
    spread = f"2|gpu|2|Resources|N/A|2|0|{int(NOW + H)}|n[1-2]|u|1|60|gres:gpu:a100:6|N/A|2||"
    assert _start(4, 600, running=[line], used=used, pending=[spread]) is None
    # a job array ahead: squeue shows its first task's plan only; the others' are unknown
    array = f"3|gpu|1|Resources|gres:gpu:a100:2|1|0|{int(NOW + H)}|n1|u|1|60|N/A|N/A|1||0-5|"
    assert _start(4, 600, running=[line], used=used, pending=[array]) is None
    one = f"3|gpu|1|Resources|gres:gpu:a100:2|1|0|{int(NOW + H)}|n1|u|1|60|N/A|N/A|1||N/A|"
    assert _start(4, 600, running=[line], used=used, pending=[one]) == NOW


def test_a_short_job_fits_the_hole_before_a_reservation_a_long_one_starts_after_it():
    # n1: 6 of 8 GPUs run until +1h; a pending 8-GPU job is planned there at +1h for 2h
    running = [f"1|n1|gres:gpu:a100:6|{int(NOW + H)}"]
    pending = [f"2|gpu|1|Resources|gres:gpu:a100:8|8|0|{int(NOW + H)}|n1|u|10|120"]
    assert _start(2, 600, running=running, pending=pending) == NOW  # beside it, now
    assert _start(2, 2 * H, running=running, pending=pending) == NOW + 3 * H  # after it
    assert _start(4, 600, running=running, pending=pending) == NOW + 3 * H  # 2 free only


def test_a_job_ends_at_its_time_limit_in_the_plan_and_a_job_without_one_never():
    running = [f"1|n1|gres:gpu:a100:8|{int(NOW + H)}", "2|n2|gres:gpu:a100:8|N/A"]
    assert _start(8, H, running=running, capacity={"n1": 8, "n2": 8}) == NOW + H
    assert _start(8, H, running=running, capacity={"n1": 8, "n2": 8}, nodes=2) is None


def test_two_nodes_must_both_have_room_at_the_same_time():
    running = [f"1|n1|gres:gpu:a100:8|{int(NOW + H)}", f"2|n2|gres:gpu:a100:8|{int(NOW + 2 * H)}"]
    assert _start(4, 600, running=running, capacity={"n1": 8, "n2": 8}, nodes=2) == NOW + 2 * H


def test_what_the_plan_does_not_say_gives_no_estimate():
    running = [f"1|n1|gres:gpu:a100:4|{int(NOW + H)}"]
    # GPUs (asked with --gpus) or CPUs in use that no running job listed accounts for
    assert _start(2, 600, running=running, used={"n1": Need(6, 0, 0)}) is None
    assert _start(2, 600, running=running, used={"n1": Need(4, 64, 0)}) is None
    # a runnable pending job of this partition, not planned yet (just submitted)
    assert _start(2, 600, running=running,
                  pending=["3|gpu|1|Priority|gres:gpu:a100:2|8|0|N/A|(null)|u|10|60"]) is None
    # ...of another partition sharing our nodes (their partitions are `partitions`): the same
    assert _start(2, 600, running=running,
                  pending=["3|gpu,gpulong|1|Priority|gres:gpu:a100:2|8|0|N/A|(null)|u|10|60"]
                  ) is None
    # ...held or waiting on a dependency: it takes nothing; a partition without our nodes: not
    # ours
    assert _start(2, 600, running=running,
                  pending=["3|gpu|1|Dependency|gres:gpu:a100:8|8|0|N/A|(null)|u|10|60",
                           "4|other|1|Priority|gres:gpu:a100:8|8|0|N/A|(null)|u|10|60"]) == NOW
    assert _start(2, math.inf, running=running) is None  # no time limit: no hole to fit


def test_a_reservation_keeps_the_hole_out_of_its_window():
    # n1 busy until +1h; a maintenance of n2 from +10 min to +2h
    running = [f"1|n1|gres:gpu:a100:8|{int(NOW + H)}"]
    resv = [Reservation("maint", False, NOW + 600, NOW + 2 * H, ("n2",))]
    capacity = {"n1": Need(8, 64, 512000), "n2": Need(8, 64, 512000)}

    def start(limit):
        jobs = [parse_running(r) for r in running]
        used = {"n1": Need(8, 0, 0), "n2": NOTHING}
        return backfill_start(capacity, used, jobs, [], partitions={"gpu"}, now=NOW,
                              gres_type="a100", want=Need(8, 1, 0), num_nodes=1,
                              time_limit_s=limit, reservations=resv)

    assert start(300) == NOW  # on n2, done before the maintenance
    assert start(1800) == NOW + H  # on n1 when its job ends
    assert start(3 * H) == NOW + H  # n1 again (n2 only after the maintenance: +2h)


def test_cpus_in_use_until_a_jobs_end_keep_the_hole_until_then():
    # the reviewer's case: every GPU idle, every CPU taken by a CPU-only job for 10 hours
    running = [f"1|n1|N/A|{int(NOW + 10 * H)}|64|0"]
    assert _start(2, 1200, running=running) == NOW + 10 * H
    assert _start(2, 1200, running=[f"1|n1|N/A|{int(NOW + 10 * H)}|62|0"], cpus=2) == NOW


def test_several_nodes_at_once_in_bounded_time():
    # 400 nodes each busy to its own end, a 399-node job planned on the first 399 at +1h for
    # 10h: a 2-node request finds no common hole before +11h (the last node alone fits now)
    nodes = {f"n{i}": 8 for i in range(400)}
    running = [f"r{i}|n{i}|gres:gpu:a100:8|{int(NOW + 60 + i)}|1|0" for i in range(399)]
    pending = [f"p|gpu|399|Resources|gres:gpu:a100:8|399|0|{int(NOW + H)}|n[0-398]|u|10|600"]
    assert _start(8, 2 * H, running=running, pending=pending, capacity=nodes, nodes=2) \
        == NOW + 11 * H


PROBE = f"""\
@@now
{int(NOW)}
@@nodes
n1|gpu*|allocated|64/0/0/64|512000|0|gpu:a100:8|gpu:a100:8(IDX:0-7)|10.0.0.1|
n2|gpu*|allocated|64/0/0/64|512000|0|gpu:a100:8|gpu:a100:8(IDX:0-7)|10.0.0.2|
@@partitions
gpu|up|2-00:00:00|n/a
@@pending
3|gpu|1|Resources|gres:gpu:a100:8|8|0|{int(NOW + H / 2)}|n2|other|10|120
@@running
1|n1|gres:gpu:a100:8|{int(NOW + H)}|64|0
2|n2|gres:gpu:a100:8|{int(NOW + H / 2)}|64|0
@@running_rc
0
@@testonly
gpu|a100|2|1|0|0|{int(NOW + 3 * H)}
"""


def _offer(probe: str, limit: str):
    task = load_task({"run": "x", "resources": {"accelerators": "A100:2"},
                      "config": {"slurm": {"sbatch_options": [f"--time={limit}"]}}})
    settings = SlurmSettings.from_extra("c", {"cluster": "c"})
    st = parse_cluster(probe)
    return offers.offer_at(task, task.candidates[0], "gpu", st, settings, "c")


def test_the_offer_takes_backfills_hole_when_test_only_says_later():
    # n2 frees at +30 min but the pending job ahead is planned there for 2h; n1 frees at +1h
    # with nothing planned after: backfill starts a 20-minute job there at +1h, where
    # test-only (the job last in a FIFO queue) says +3h
    offer = _offer(PROBE, "20")
    assert offer.nodes_free == 0
    assert offer.details["test_only_start"] == NOW + 3 * H
    assert offer.details["backfill_start"] == NOW + H
    assert offer.details["estimate"].startswith("backfill's plan")
    assert offer.est_start == NOW + H
    assert any("est. by backfill's plan" in note for note in offer.notes)


def test_the_offer_keeps_test_only_when_the_plan_is_not_sooner_or_not_listed():
    sooner = PROBE.replace(f"gpu|a100|2|1|0|0|{int(NOW + 3 * H)}",
                           f"gpu|a100|2|1|0|0|{int(NOW + H / 2)}")
    offer = _offer(sooner, "20")
    assert "backfill_start" not in offer.details and offer.est_start == NOW + H / 2
    assert offer.details["estimate"].startswith("sbatch --test-only")
    unlisted = PROBE.replace("@@running_rc\n0", "@@running_rc\n1")  # squeue failed
    offer = _offer(unlisted, "20")
    assert "backfill_start" not in offer.details and offer.est_start == NOW + 3 * H
