"""Step 8 through real Airflow on the real Slurm clusters: placement is not a one-time guess.
A job that waits in one cluster's queue moves when the other cluster frees up, the waiting copy
is cancelled before it ever ran, and the user code runs once (``tasks/counted_gpu.yaml``)."""

from __future__ import annotations

import time

import pytest

from tests.e2e.conftest import assert_ran_once, marks, shared_dir, wait_until
from tests.e2e.test_slurm_e2e import _fill, _our_jobs

pytestmark = [pytest.mark.sandbox, pytest.mark.e2e]

FILL = {"alpha": ("gpu:a100:4", 2), "beta": ("gpu:h100:8", 1)}


def test_a_waiting_job_moves_to_the_cluster_that_frees_up(airflow_slurm, slurm):
    fillers = {cluster: _fill(slurm, cluster, gres, n) for cluster, (gres, n) in FILL.items()}
    counter = f"{shared_dir()}/counter"
    conf = {"task": "tasks/counted_gpu.yaml", "envs": {"COUNTER": counter}}
    with airflow_slurm.started("e2e_task", conf) as proc:
        waiting = wait_until(lambda: [(c, j) for c in FILL for j in _our_jobs(slurm, c)
                                      if j[2] == "PENDING"], 120, what="the job queued")
        (here, job), = waiting
        other = "beta" if here == "alpha" else "alpha"
        slurm.run(other, "scancel", *fillers[other])  # the other cluster frees up
        freed = time.time()
        run = airflow_slurm.finish(proc, "e2e_task", timeout=240)
    assert run.returncode == 0, run.output[-6000:]
    result = run.result("run")
    assert [(a["connection"], a["state"]) for a in result["attempts"]] == [
        (f"slurm_{here}", "moved"), (f"slurm_{other}", "succeeded")], result["attempts"]
    assert result["attempts"][0]["reason"].startswith(f"moved to slurm_{other}/")
    assert result["old_copies"][0]["confirmed_dead"] is True
    # the waiting copy was cancelled without ever running; the user code ran once, elsewhere
    states = {line[0]: line[2] for line in _our_jobs(slurm, here)}
    assert states[job[0]] == "CANCELLED", states
    end = assert_ran_once(counter)
    assert end.cluster == other
    # one reprobe interval (5 s in the e2e DAG), the move, and Slurm's start of the new job
    assert marks(counter, "START")[0].t - freed < 30, "it moved soon after the other freed up"
    assert run.output.count("Submitted slurm job") == 2
