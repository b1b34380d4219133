"""Start estimates and "free now" against real Slurm 22.05 (tests/sandbox/slurm.py): what the
probe says must be what Slurm then does.

alpha: a1, a2 with 4 A100 each; batch = a1+a2, short = a2 (MaxTime 10 min). beta: b1 with
8 H100. Backfill runs every second (bf_interval=1).
"""

from __future__ import annotations

import time
import uuid

import pytest

from airflow_skypilot.backends.base import JobState
from airflow_skypilot.backends.slurm import SlurmBackend
from airflow_skypilot.spec import load_task
from tests.conftest import use_connections, wait_until
from tests.sandbox.slurm import remote_work_dir

pytestmark = pytest.mark.sandbox


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _task(resources, options=None, num_nodes=1, run="sleep 600"):
    spec = {"run": run, "num_nodes": num_nodes, "resources": resources}
    if options:
        spec["config"] = {"slurm": {"sbatch_options": options}}
    return load_task(spec)


def _at(backend, task, location):
    offers = [o for o in backend.probe(task) if o.location == location]
    assert len(offers) == 1, offers
    return offers[0]


def _squeue(slurm, cluster, job_id, fmt):
    return slurm.run(cluster, "env", "SLURM_TIME_FORMAT=%s", "squeue", "-h", "-j", job_id,
                     "-o", fmt).stdout.strip()


def _until(pred, timeout=30.0, interval=0.5):
    return wait_until(pred, timeout, interval, what="the condition")


def _filler(slurm, cluster, *args):
    job = slurm.run(cluster, "sbatch", "--parsable", "-o", "/dev/null", "--mem=100M", *args,
                    "--wrap", "sleep 900").stdout.strip().split(";")[0]
    _until(lambda: _squeue(slurm, cluster, job, "%T") == "RUNNING")
    return job


def test_a_pending_jobs_status_carries_its_own_start_from_the_queue(slurm):
    beta = SlurmBackend("slurm_beta")
    _filler(slurm, "beta", "--gres=gpu:h100:8", "-t", "30")
    started = time.time()
    task = _task({"accelerators": "H100:4"}, {"time": "60"})
    offer = _at(beta, task, "main")
    assert offer.fits and not offer.free_now and offer.est_start is not None
    handle = beta.submit(task, offer, _name("sky-est"), {"SKYPILOT_TASK_ID": "t"})
    status = _until(lambda: (s := beta.status([handle])[handle.job_id]).est_start and s)
    assert status.state == JobState.PENDING
    # backfill plans it when the filler reaches its 30-minute limit: squeue's StartTime
    assert abs(status.est_start - (started + 1800)) < 120, status
    assert status.est_start == float(_squeue(slurm, "beta", handle.job_id, "%S"))


def test_idle_gpus_held_for_the_first_placements_pending_job_are_not_free(slurm):
    """Two placements moments apart: the first queues a 2-node job that backfill plans on a1
    (busy 30 more minutes) and a2 (idle); the second sees a2's idle GPUs held for it, unless
    it ends before then, and Slurm does exactly that."""
    alpha = SlurmBackend("slurm_alpha")
    _filler(slurm, "alpha", "-p", "batch", "-w", "a1", "--gres=gpu:a100:4", "-t", "30")
    first_task = _task({"accelerators": "A100:4"}, {"time": "60"}, num_nodes=2)
    first_offer = _at(alpha, first_task, "batch")
    assert not first_offer.free_now
    first = alpha.submit(first_task, first_offer, _name("sky-first"), {"SKYPILOT_TASK_ID": "1"})
    _until(lambda: _squeue(slurm, "alpha", first.job_id, "%Y") not in ("", "(null)"))

    long_task = _task({"accelerators": "A100:1"}, {"time": "60"})
    long = _at(alpha, long_task, "batch")
    assert long.details["gpus_idle"] == 4 and long.gpus_free == 0 and not long.free_now
    assert long.details["reserved_by_pending"] == 4
    assert long.details["held_for"] == [first.job_id] and long.details["pending_ours"] == 1
    assert long.notes[0] == "4 idle A100 held for 1 pending job(s) ahead, 1 of them ours"
    short_task = _task({"accelerators": "A100:1"}, {"time": "10"})
    short = _at(alpha, short_task, "batch")
    assert short.free_now  # ends before the 2-node job starts: backfill takes it now

    ran = alpha.submit(short_task, short, _name("sky-short"), {"SKYPILOT_TASK_ID": "2"})
    waits = alpha.submit(long_task, long, _name("sky-long"), {"SKYPILOT_TASK_ID": "3"})
    _until(lambda: alpha.status([ran])[ran.job_id].state == JobState.RUNNING)
    time.sleep(3)  # several backfill passes
    assert alpha.status([waits])[waits.job_id].state == JobState.PENDING


def test_gpus_a_pending_job_asks_per_job_are_held_for_it_too(slurm):
    """As above, the job ahead asking its GPUs per job (``--gpus=8`` on 2 nodes), which
    squeue's ``%b`` does not show: a2's idle GPUs are held for it, and Slurm agrees."""
    alpha = SlurmBackend("slurm_alpha")
    _filler(slurm, "alpha", "-p", "batch", "-w", "a1", "--gres=gpu:a100:4", "-t", "30")
    first = slurm.run("alpha", "sbatch", "--parsable", "-o", "/dev/null", "--mem=100M", "-p",
                      "batch", "-N", "2", "--gpus=8", "-t", "60", "--wrap",
                      "true").stdout.strip()
    _until(lambda: _squeue(slurm, "alpha", first, "%Y") not in ("", "(null)"))
    assert _squeue(slurm, "alpha", first, "%b") == "N/A"  # not per node
    task = _task({"accelerators": "A100:1"}, {"time": "60"})
    offer = _at(alpha, task, "batch")
    assert offer.gpus_free == 0 and not offer.free_now, offer
    assert offer.details["reserved_by_pending"] == 4 and offer.details["held_for"] == [first]
    waits = alpha.submit(task, offer, _name("sky-held"), {"SKYPILOT_TASK_ID": "t"})
    time.sleep(3)  # several backfill passes
    assert alpha.status([waits])[waits.job_id].state == JobState.PENDING


@pytest.mark.parametrize("memory", [["--mem=100M"], ["-c", "2", "--mem-per-cpu=300M"]],
                         ids=["mem-per-node", "mem-per-cpu"])
def test_backfills_hole_is_the_estimate_where_test_only_says_later_and_slurm_starts_it_there(
        slurm, memory):
    """a1 busy for 10 minutes; a2 for 2 (its job really ends in 40 s); a 2-node job queued
    for both from a1's end. A 1-minute job fits a2 in between: the estimate is backfill's hole
    at a2's planned end, where test-only answers later; Slurm starts it as soon as a2 frees,
    the 2-node job still waiting. The jobs ask memory per node, or per CPU (squeue's ``%m``
    then says 300M for the 600M a job holds: the plan reads ``tres-alloc``)."""
    alpha = SlurmBackend("slurm_alpha")
    _filler(slurm, "alpha", "-p", "batch", "-w", "a1", "--gres=gpu:a100:4", "-t", "10")
    a2 = slurm.run("alpha", "sbatch", "--parsable", "-o", "/dev/null", *memory, "-p",
                   "batch", "-w", "a2", "--gres=gpu:a100:4", "-t", "2", "--wrap",
                   "sleep 40").stdout.strip()
    _until(lambda: _squeue(slurm, "alpha", a2, "%T") == "RUNNING")
    big = slurm.run("alpha", "sbatch", "--parsable", "-o", "/dev/null", *memory, "-p",
                    "batch", "-N", "2", "--gres=gpu:a100:4", "-t", "10", "--wrap",
                    "true").stdout.strip()
    _until(lambda: _squeue(slurm, "alpha", big, "%Y") not in ("", "(null)"))
    task = _task({"accelerators": "A100:1"}, {"time": "1"}, run="true")
    offer = _at(alpha, task, "batch")
    assert not offer.free_now
    assert offer.details["backfill_start"] == float(_squeue(slurm, "alpha", a2, "%e"))
    assert offer.details["test_only_start"] > offer.details["backfill_start"] + 60, offer.details
    assert offer.details["estimate"].startswith("backfill's plan")
    assert any(note.startswith("est. by backfill's plan") for note in offer.notes)
    handle = alpha.submit(task, offer, _name("sky-hole"), {"SKYPILOT_TASK_ID": "t"})
    _until(lambda: alpha.status([handle])[handle.job_id].state in (JobState.RUNNING,
                                                                   JobState.SUCCEEDED), 90)
    assert _squeue(slurm, "alpha", big, "%T") == "PENDING"


def test_a_maintenance_reservation_to_come_holds_its_nodes_for_a_job_that_would_overlap_it(
        slurm):
    """a1 busy; a maintenance of a2 begins in 10 minutes (an admin's reservation: sinfo -T,
    INACTIVE until then; squeue shows nothing of it). A 60-minute job is not free now on a2's
    idle GPUs, and Slurm does not start it; a 5-minute one ends before: free now, and it runs."""
    alpha = SlurmBackend("slurm_alpha")
    _filler(slurm, "alpha", "-p", "batch", "-w", "a1", "--gres=gpu:a100:4", "-t", "30")
    slurm.reserve("alpha", "maint-a2", "a2", 600, 60)
    long_task = _task({"accelerators": "A100:1"}, {"time": "60"})
    long = _at(alpha, long_task, "batch")
    assert long.gpus_free == 0 and not long.free_now, long
    assert long.details["held_for_reservations"] == ["maint-a2"]
    assert "4 idle A100 held for reservation(s) maint-a2 starting before it would end" in \
        long.notes
    short_task = _task({"accelerators": "A100:1"}, {"time": "5"}, run="sleep 30")
    short = _at(alpha, short_task, "batch")
    assert short.free_now and "held_for_reservations" not in short.details
    waits = alpha.submit(long_task, long, _name("sky-maint"), {"SKYPILOT_TASK_ID": "1"})
    ran = alpha.submit(short_task, short, _name("sky-before"), {"SKYPILOT_TASK_ID": "2"})
    _until(lambda: alpha.status([ran])[ran.job_id].state == JobState.RUNNING)
    time.sleep(3)  # several backfill passes
    assert alpha.status([waits])[waits.job_id].state == JobState.PENDING


def test_a_connection_whose_jobs_run_in_a_reservation_starts_them_on_its_idle_nodes(
        slurm, monkeypatch):
    """A group's reservation of a2 (active, idle: sinfo shows a2 RESERVED); a1 busy. Through a
    connection with the extra ``reservation``, a2 is free now, and the job runs there; for
    the plain connection a2 is not free."""
    alpha = SlurmBackend("slurm_alpha")
    _filler(slurm, "alpha", "-p", "batch", "-w", "a1", "--gres=gpu:a100:4", "-t", "30")
    slurm.reserve("alpha", "grp", "a2", 0, 60, users="skyuser", flags="")
    _until(lambda: "reserved" in slurm.run("alpha", "sinfo", "-h", "-n", "a2", "-o",
                                           "%T").stdout)
    task = _task({"accelerators": "A100:1"}, {"time": "20"}, run="sleep 30")
    assert not _at(alpha, task, "batch").free_now
    conn = slurm.connections()["slurm_alpha"]
    conn["extra"] = {**conn["extra"], "reservation": "grp"}
    use_connections(monkeypatch, {"slurm_alpha": conn})
    inside = SlurmBackend("slurm_alpha")
    offer = _at(inside, task, "batch")
    assert offer.free_now and offer.gpus_free == 4, offer
    # a job that would outlast the reservation does not fit there: Slurm would start it and
    # end it with the reservation (TIMEOUT; measured here with a 2-minute one)
    over = _at(inside, _task({"accelerators": "A100:1"}, {"time": "90"}), "batch")
    assert not over.fits and over.reason.startswith("time limit 1h30m; reservation grp ends in")
    handle = inside.submit(task, offer, _name("sky-grp"), {"SKYPILOT_TASK_ID": "t"})
    _until(lambda: inside.status([handle])[handle.job_id].state == JobState.RUNNING)
    assert _squeue(slurm, "alpha", handle.job_id, "%N") == "a2"


def test_a_time_limit_over_max_time_does_not_fit_and_slurm_would_never_start_it(slurm):
    alpha = SlurmBackend("slurm_alpha")
    task = _task({"accelerators": "A100:1"}, {"time": "20"})
    offers = {o.location: o for o in alpha.probe(task)}
    assert offers["batch"].fits and offers["batch"].free_now
    assert not offers["short"].fits
    assert offers["short"].reason == ("asks --time=20 (20m); partition short allows at most "
                                      "10m (MaxTime): Slurm would keep it pending")
    # the fact behind it (test-only says "now" for it all the same)
    job = slurm.run("alpha", "sbatch", "--parsable", "-p", "short", "-t", "20", "-o",
                    "/dev/null", "--wrap", "true").stdout.strip()
    _until(lambda: _squeue(slurm, "alpha", job, "%r") == "PartitionTimeLimit")
    assert _at(alpha, _task({"accelerators": "A100:1"}, {"time": "10"}), "short").fits


def test_test_only_is_asked_with_the_tasks_own_sbatch_options(slurm):
    alpha = SlurmBackend("slurm_alpha")
    now = time.time()
    later = _at(alpha, _task({"accelerators": "A100:1"}, {"begin": "now+2hours"}), "batch")
    assert not later.free_now and abs(later.est_start - (now + 7200)) < 120
    assert later.details["estimate"] == "sbatch --test-only with the task's --begin=now+2hours"
    _filler(slurm, "alpha", "-p", "batch", "-w", "a1", "--gres=gpu:a100:4", "-t", "30")
    pinned = _at(alpha, _task({"accelerators": "A100:1"}, {"nodelist": "a1"}), "batch")
    assert not pinned.free_now and abs(pinned.est_start - (now + 1800)) < 120
    assert _at(alpha, _task({"accelerators": "A100:1"}), "batch").free_now  # a2 is idle


def test_the_history_of_finished_jobs_discounts_the_estimate(slurm):
    alpha = SlurmBackend("slurm_alpha")
    history = f"{remote_work_dir()}/probe-history-alpha"
    slurm.run("alpha", "bash", "-c", f"rm -f {history}")
    jobs = [slurm.run("alpha", "sbatch", "--parsable", "-p", "batch", "-t", "10", "-o",
                      "/dev/null", "--wrap", "sleep 1").stdout.strip() for _ in range(22)]
    _until(lambda: not slurm.run("alpha", "squeue", "-h", "-j", ",".join(jobs), "-t",
                                 "PENDING,RUNNING,COMPLETING", "-o", "%i").stdout.strip(),
           timeout=60)
    _filler(slurm, "alpha", "-p", "batch", "--gres=gpu:a100:4", "-w", "a1", "-t", "30")
    _filler(slurm, "alpha", "-p", "batch", "--gres=gpu:a100:4", "-w", "a2", "-t", "30")
    state = alpha.cluster_state(_task({"accelerators": "A100:4"}))
    assert state.history is not None and len(state.history) >= 22  # sacct -c (no slurmdbd)
    offer = _at(alpha, _task({"accelerators": "A100:4"}), "batch")
    raw = offer.details["test_only_start"]
    assert "recent jobs end at a median" in offer.details["estimate"]
    assert offer.probed_at < offer.est_start < raw
    # the login node keeps the history: the next probe reads the file, not sacct
    assert slurm.run("alpha", "bash", "-c", f"test -s {history} && echo ok").stdout.strip() \
        == "ok"
