"""Preprocess on CPUs, train on whichever GPUs are free first, evaluate: one SkyPilot YAML each.

The connections come from ``[skypilot] connections`` (the sandbox sets them). Paths are decided
once, by a small Python task, and handed to the three steps as envs.
"""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import DAG, task

from airflow_skypilot.operators import SkyPilotOperator

with DAG(
    dag_id="train_pipeline",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    params={"workspace": "/tmp/airflow-skypilot-demo", "epochs": 5},
    tags=["skypilot", "example"],
) as dag:

    @task
    def paths(params=None, run_id=None) -> dict[str, str]:
        """One folder per DAG run, on the storage every cluster shares. Clusters may run jobs
        as different users (a Slurm account, root in a pod), so the folders are shared."""
        import os

        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in run_id)
        root = f"{params['workspace']}/{safe}"
        out = {"data": f"{root}/data", "ckpt": f"{root}/ckpt"}
        for path in (params["workspace"], root, *out.values()):
            os.makedirs(path, exist_ok=True)
            os.chmod(path, 0o1777)
        return out

    where = paths()

    preprocess = SkyPilotOperator(
        task_id="preprocess",
        task="tasks/preprocess.yaml",
        envs={"DATA_DIR": "{{ ti.xcom_pull(task_ids='paths')['data'] }}"},
    )
    train = SkyPilotOperator(
        task_id="train",
        task="tasks/train.yaml",
        envs={
            "DATA_DIR": "{{ ti.xcom_pull(task_ids='paths')['data'] }}",
            "CKPT_DIR": "{{ ti.xcom_pull(task_ids='paths')['ckpt'] }}",
            "EPOCHS": "{{ params.epochs }}",
        },
        max_failovers=2,
    )
    evaluate = SkyPilotOperator(
        task_id="evaluate",
        task="tasks/evaluate.yaml",
        envs={"CKPT_DIR": "{{ ti.xcom_pull(task_ids='paths')['ckpt'] }}"},
    )

    where >> preprocess >> train >> evaluate
