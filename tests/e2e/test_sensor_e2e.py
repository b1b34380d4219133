"""The example ``submit_then_sense`` DAG in real Airflow (``airflow dags test``) on real Slurm:
submit without waiting, do other work, then wait for the job with ``SkyPilotJobSensor``."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import REPO

pytestmark = [pytest.mark.sandbox, pytest.mark.e2e]


def _jobs_named(slurm, prefix: str) -> list[list[str]]:
    """Every job (any state) on either cluster whose name starts with ``prefix``."""
    jobs = []
    for cluster in ("alpha", "beta"):
        out = slurm.run(cluster, "squeue", "-h", "-t", "all", "-o", "%i|%j|%T").stdout
        jobs += [line.split("|") + [cluster] for line in out.splitlines()
                 if line.split("|")[1].startswith(prefix)]
    return jobs


def test_submit_then_sense_runs_the_job_once_and_the_sensor_sees_it_end(airflow_slurm, slurm):
    run = airflow_slurm.run("submit_then_sense", dags=REPO / "dags")
    assert run.returncode == 0, run.output[-4000:]
    assert run.states == {"submit": "success", "meanwhile": "success", "wait": "success"}

    handle = run.result("submit")  # wait_for_completion=False: the operator returns the handle
    assert handle["connection"] in ("slurm_alpha", "slurm_beta")
    assert run.xcom("submit", "skypilot_handle") == handle
    assert run.result("meanwhile") == (
        f"job {handle['job_id']} is on {handle['connection']} ({handle['location']})")

    result = run.result("wait")
    assert result["state"] == "succeeded"
    assert (result["connection"], result["job_id"]) == (handle["connection"], handle["job_id"])
    assert result["ended_at"] >= result["started_at"] > 0

    # one job for the task, on one cluster, and it completed
    jobs = _jobs_named(slurm, handle["job_name"].rsplit("-a", 1)[0])
    assert [(j[0], j[2], j[3]) for j in jobs] == [
        (handle["job_id"], "COMPLETED", handle["connection"].split("_")[1])]
    assert "hello from airflow-skypilot" in run.output  # the sensor streamed its output
