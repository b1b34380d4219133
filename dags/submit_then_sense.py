"""Submit without waiting, do other work, then wait for the job with the sensor."""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import DAG, task

from airflow_skypilot.operators import SkyPilotOperator
from airflow_skypilot.sensors import SkyPilotJobSensor

with DAG(
    dag_id="submit_then_sense",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    tags=["skypilot", "example"],
) as dag:
    submit = SkyPilotOperator(
        task_id="submit",
        task="tasks/smoke.yaml",
        wait_for_completion=False,
    )

    @task
    def meanwhile(handle: dict) -> str:
        return f"job {handle['job_id']} is on {handle['connection']} ({handle['location']})"

    wait = SkyPilotJobSensor(task_id="wait", handle=submit.output, poke_interval=2)

    submit >> meanwhile(submit.output) >> wait
