"""A scheduled retraining run: every night, on the day's data, wherever GPUs are free; and an
evaluation that starts whenever a new model is out.

``retrain`` declares the model as its outlet (an Asset). When it succeeds, Airflow records an
asset event whose extra says where and how the job ran (connection, location, job id, attempts,
GPU-hours, cost), and ``nightly_evaluate``, scheduled on that asset, starts.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import DAG, Asset, task

from airflow_skypilot.operators import SkyPilotOperator

WORKSPACE = "/tmp/airflow-skypilot-demo"
#: the newest model (each night's job points ``latest`` at its own folder)
NIGHTLY_MODEL = Asset(name="nightly_model", uri=f"file://{WORKSPACE}/nightly/latest")

with DAG(
    dag_id="nightly_retrain",
    schedule="@daily",
    start_date=datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=1,
    # a night whose job never found GPUs must not hold back the next night's run
    dagrun_timeout=timedelta(hours=23),
    params={"workspace": WORKSPACE},
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
        # waiting for capacity and the run itself: stopped (its job cancelled) after this
        execution_timeout=timedelta(hours=12),
        outlets=[NIGHTLY_MODEL],
    )

with DAG(
    dag_id="nightly_evaluate",
    schedule=[NIGHTLY_MODEL],
    start_date=datetime(2026, 1, 1),
    catchup=False,
    tags=["skypilot", "example"],
) as evaluate_dag:

    @task.skypilot(task="tasks/evaluate.yaml")
    def evaluate(triggering_asset_events=None) -> dict:
        """Evaluate the newest model; the asset event says where and how it was trained."""
        for event in (triggering_asset_events or {}).get(NIGHTLY_MODEL, []):
            x = event.extra
            print(f"model trained on {x.get('connection')}/{x.get('location')}: job "
                  f"{x.get('job_id')}, {x.get('attempts')} attempt(s), "
                  f"{x.get('gpu_hours')} GPU-hours, ${x.get('cost')}")
        return {"envs": {"CKPT_DIR": f"{WORKSPACE}/nightly/latest"}}

    evaluate()
