"""One operator whose task YAML and envs come from the run's conf: each e2e test picks them."""

from __future__ import annotations

from datetime import datetime, timedelta

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

# A job that outlives its task's execution_timeout: the deferral times out in the scheduler and
# the task is resumed only to fail; the operator must stop the job (real-deployment e2e test).
with DAG(
    dag_id="e2e_timeout",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
) as timeout_dag:
    SkyPilotOperator(
        task_id="run",
        task="name: sleep\nresources:\n  infra: slurm\nrun: sleep 600\n",
        poll_interval=1,
        execution_timeout=timedelta(seconds=30),
    )
