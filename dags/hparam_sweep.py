"""A learning-rate sweep: eight training runs from one ``@task.skypilot`` function, each placed
on its own wherever a GPU is free first, then the best run picked downstream.

``train.partial(...).expand(lr=[...])`` maps the decorated task: every instance is a job of its
own (its own job name, ``SKYPILOT_TASK_ID``, placement table and failover), and the SkyPilot
jobs page shows the eight as one sweep. A job writes its final metrics to
``$OUT_DIR/$SKYPILOT_TASK_ID.json`` on the storage every cluster shares; ``pick_best`` reads
them back by the ``task_id`` in each instance's result.
"""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import DAG, task

LEARNING_RATES = [0.3, 0.1, 0.03, 0.01, 0.003, 0.001, 0.0003, 0.0001]

with DAG(
    dag_id="hparam_sweep",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    params={"workspace": "/tmp/airflow-skypilot-demo", "epochs": 3},
    tags=["skypilot", "example"],
) as dag:

    @task
    def out_dir(params=None, run_id=None) -> str:
        """One folder per DAG run for the runs' metrics, writable by every cluster's user."""
        import os

        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in run_id)
        path = f"{params['workspace']}/sweeps/{safe}"
        for folder in (params["workspace"], f"{params['workspace']}/sweeps", path):
            os.makedirs(folder, exist_ok=True)
            os.chmod(folder, 0o1777)
        return path

    @task.skypilot(task="tasks/sweep_train.yaml", poll_interval=5)
    def train(lr: float, out: str, params=None) -> dict:
        """One run of the sweep: the YAML's training with this learning rate."""
        return {"envs": {"LR": lr, "OUT_DIR": out, "EPOCHS": params["epochs"]}}

    @task
    def pick_best(results: list, out: str) -> dict:
        """The run with the lowest loss, with where it ran (each result says)."""
        import json
        import os

        runs = []
        for result in results:
            with open(os.path.join(out, f"{result['task_id']}.json")) as fh:
                metrics = json.load(fh)
            runs.append({**metrics, "connection": result["connection"],
                         "location": result["location"], "job_id": result["job_id"],
                         "gpu_hours": result["gpu_hours"], "cost": result["cost"]})
        for run in sorted(runs, key=lambda r: r["loss"]):
            print(f"lr={run['lr']:<8} loss={run['loss']:<8} on {run['connection']}/"
                  f"{run['location']} (job {run['job_id']})")
        return min(runs, key=lambda r: r["loss"])

    where = out_dir()
    pick_best(train.partial(out=where).expand(lr=LEARNING_RATES), where)
