"""``@task.skypilot``, sweeps and assets in real Airflow (``airflow dags test``) on real Slurm.

The DAGs are in tests/e2e/dags/e2e_taskflow.py. The downstream DAG run an asset event triggers
needs a scheduler: that is in test_deployment_e2e.py.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys

import pytest

from tests.e2e.conftest import shared_dir

pytestmark = [pytest.mark.sandbox, pytest.mark.e2e]


def _instances(airflow, run) -> dict[tuple[str, int], dict]:
    """Every task instance of the run, mapped ones apart: (task_id, map_index) -> its state,
    operator and return value (conftest's DagRun folds mapped instances together)."""
    db = sqlite3.connect(airflow.home / "airflow.db")
    try:
        out = {(t, m): {"state": s, "operator": o} for t, m, s, o in db.execute(
            "SELECT task_id, map_index, state, custom_operator_name FROM task_instance "
            "WHERE dag_id=? AND run_id=?", (run.dag_id, run.run_id))}
        for t, m, key, value in db.execute(
                "SELECT task_id, map_index, key, value FROM xcom WHERE dag_id=? AND run_id=?",
                (run.dag_id, run.run_id)):
            out[(t, m)][key] = json.loads(value) if isinstance(value, (str, bytes)) else value
    finally:
        db.close()
    return out


def _slurm_jobs(slurm) -> dict[str, tuple[str, str]]:
    """Every job on either cluster: name -> (job id, state)."""
    jobs = {}
    for cluster in ("alpha", "beta"):
        out = slurm.run(cluster, "squeue", "-h", "-t", "all", "-o", "%i|%j|%T").stdout
        for line in out.splitlines():
            job_id, name, state = line.split("|")
            jobs[name] = (job_id, state)
    return jobs


#: the jobs page's entries, read from the Airflow DB as the api-server reads them (authorization,
#: the api-server's part, is tested with a real api-server in tests/integration)
JOBS_PAGE = """
import json, sys
from airflow_skypilot.plugins import jobs, sweep_views
jobs.readable_dag_ids = lambda user: {sys.argv[1]}
jobs.can_read_job = lambda *args: True
print(json.dumps(sweep_views.group_sweeps(jobs.list_jobs(None, dag_id=sys.argv[1])), default=str))
"""


def _jobs_page(airflow, dag_id: str) -> list[dict]:
    out = subprocess.run([sys.executable, "-c", JOBS_PAGE, dag_id], env=airflow.env,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_a_decorated_task_runs_its_upstreams_value_and_returned_resources(airflow_slurm, slurm):
    run = airflow_slurm.run("e2e_taskflow")
    assert run.returncode == 0, run.output[-4000:]
    assert run.states == {"greeting": "success", "hello": "success", "on_h100": "success"}

    hello = run.result("hello")  # the operator's result, not the function's
    assert hello["state"] == "succeeded" and hello["connection"].startswith("slurm_")
    assert f"hello from upstream on {hello['task_id']}" in run.output  # the job's output
    assert run.xcom("hello", "skypilot_placement")["chosen"]["connection"] == \
        hello["connection"]

    h100 = run.result("on_h100")  # the returned resources placed it where H100s are
    assert (h100["connection"], h100["location"]) == ("slurm_beta", "main")
    assert f"h100 step: 1 GPU(s) on {h100['task_id']}" in run.output
    # every job is a real, completed Slurm job
    jobs = _slurm_jobs(slurm)
    for result in (hello, h100):
        assert jobs[result["job_name"]] == (result["job_id"], "COMPLETED")
    instances = _instances(airflow_slurm, run)
    assert instances[("hello", -1)]["operator"] == "@task.skypilot"


def test_a_mapped_sweep_runs_every_instance_as_its_own_job(airflow_slurm, slurm):
    out = shared_dir()
    run = airflow_slurm.run("e2e_sweep", conf={"out": out})
    assert run.returncode == 0, run.output[-4000:]
    instances = _instances(airflow_slurm, run)
    sweep = {m: ti for (t, m), ti in instances.items() if t == "train"}
    classic = {m: ti for (t, m), ti in instances.items() if t == "classic"}
    assert sorted(sweep) == [0, 1, 2, 3] and sorted(classic) == [0, 1]

    jobs = _slurm_jobs(slurm)
    for group in (sweep, classic):
        results = [ti["return_value"] for ti in group.values()]
        assert all(ti["state"] == "success" for ti in group.values())
        assert all(r["state"] == "succeeded" for r in results)
        # each instance: its own job, job name and SKYPILOT_TASK_ID, and its own placement
        assert len({r["job_name"] for r in results}) == len(results)
        assert len({r["task_id"] for r in results}) == len(results)
        assert len({(r["connection"], r["job_id"]) for r in results}) == len(results)
        assert all(ti["skypilot_placement"]["chosen"] for ti in group.values())
        for result in results:
            assert jobs[result["job_name"]] == (result["job_id"], "COMPLETED")
            # the envs reached the job (the classic form's are templated per instance)
            with open(f"{out}/{result['task_id']}.json") as fh:
                assert json.load(fh)["loss"] >= 0
    assert {sweep[m]["return_value"]["task_id"].split("_train_")[1].split("_")[0]
            for m in sweep} == {"0", "1", "2", "3"}  # the map index is in SKYPILOT_TASK_ID

    # the jobs page: one group per sweep, its instances in map-index order
    page = {e["jobs"][0]["task_id"]: e for e in _jobs_page(airflow_slurm, "e2e_sweep")}
    assert set(page) == {"train", "classic"}
    for task_id, group in (("train", sweep), ("classic", classic)):
        summary = page[task_id]["sweep"]
        assert (summary["size"], summary["states"], summary["attempts"]) == \
            (len(group), [["success", len(group)]], len(group))
        assert [(j["map_index"], j["job_id"]) for j in page[task_id]["jobs"]] == \
            [(m, group[m]["return_value"]["job_id"]) for m in sorted(group)]

    best = run.result("best")  # picked downstream from what each job wrote
    assert best["lr"] == 0.01 and best["loss"] == 0
    assert best["job_id"] == sweep[2]["return_value"]["job_id"]


def test_bad_returns_fail_clearly_before_anything_is_submitted(airflow_slurm, slurm):
    run = airflow_slurm.run("e2e_taskflow_bad")
    assert run.states == {"returns_none": "failed", "returns_list": "failed",
                          "returns_invalid_dict": "failed"}, run.output[-4000:]
    assert ("returns_none() returned None (did it forget to return?); a @task.skypilot "
            "function returns the job's run script (a str) or SkyPilot task fields (a dict, "
            "merged over the base task)") in run.output
    assert "returns_list() returned a list; a @task.skypilot function returns" in run.output
    assert ("returns_invalid_dict()'s result: resouces: unknown field 'resouces'; did you "
            "mean 'resources'?") in run.output
    assert not [key for key in run.xcoms if key[1] == "skypilot_handle"]
    assert not [n for n in _slurm_jobs(slurm) if n.startswith("sky-e2e-taskflow-bad-")]


def test_a_training_steps_asset_event_says_where_and_how_it_ran(airflow_slurm):
    run = airflow_slurm.run("e2e_asset_train")
    assert run.returncode == 0, run.output[-4000:]
    result = run.result("train_model")
    db = sqlite3.connect(airflow_slurm.home / "airflow.db")
    try:
        rows = db.execute(
            "SELECT e.extra FROM asset_event e JOIN asset a ON a.id = e.asset_id "
            "WHERE a.name = 'e2e_model' AND e.source_dag_id = ? AND e.source_run_id = ?",
            (run.dag_id, run.run_id)).fetchall()
    finally:
        db.close()
    assert len(rows) == 1, rows
    extra = json.loads(rows[0][0])
    assert extra == {
        "state": "succeeded", "connection": result["connection"],
        "location": result["location"], "infra": result["infra"], "backend": "slurm",
        "job_id": result["job_id"], "job_name": result["job_name"],
        "skypilot_task_id": result["task_id"], "attempts": 1,
        "places": [f"{result['connection']}/{result['location']}"],
        "gpu_hours": result["gpu_hours"], "cost": result["cost"]}
