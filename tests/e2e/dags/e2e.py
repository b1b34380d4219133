"""One operator whose task YAML and envs come from the run's conf: each e2e test picks them."""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import DAG

from airflow_skypilot.operators import SkyPilotOperator

with DAG(
    dag_id="e2e_task",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    render_template_as_native_obj=True,
    params={"task": "tasks/ok.yaml", "envs": {}, "policy": "fastest"},
) as dag:
    SkyPilotOperator(
        task_id="run",
        task="{{ params.task }}",
        envs="{{ params.envs }}",
        policy="{{ params.policy }}",
        poll_interval=1,
        reprobe_interval=5,
        max_failovers=2,
    )
