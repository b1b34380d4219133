"""A scheduled retraining run: every night, on the day's data, wherever GPUs are free."""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import DAG

from airflow_skypilot.operators import SkyPilotOperator

with DAG(
    dag_id="nightly_retrain",
    schedule="@daily",
    start_date=datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=1,
    params={"workspace": "/tmp/airflow-skypilot-demo"},
    tags=["skypilot", "example"],
) as dag:
    SkyPilotOperator(
        task_id="retrain",
        task="tasks/nightly_train.yaml",
        envs={
            "DATE": "{{ ds }}",
            "OUT_DIR": "{{ params.workspace }}/nightly/{{ ds_nodash }}",
        },
        policy="cheapest",
    )
