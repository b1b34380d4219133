"""``@task.skypilot`` end to end (tests/e2e/test_taskflow_e2e.py, test_deployment_e2e.py):
a run script from an upstream value, task fields with resources, a mapped sweep, bad returns,
and an asset a training step produces with a DAG scheduled on it."""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import DAG, Asset, task

from airflow_skypilot.operators import SkyPilotOperator

START = datetime(2026, 1, 1)
FAST = {"poll_interval": 1, "reprobe_interval": 5}

# --- a run script from an upstream value; task fields with resources ---------------------------
with DAG(dag_id="e2e_taskflow", schedule=None, start_date=START, catchup=False):

    @task
    def greeting() -> str:
        return "hello from upstream"

    @task.skypilot(task="name: hello\nresources:\n  cpus: 1+\n", **FAST)
    def hello(message: str) -> str:
        return f'echo "{message} on $SKYPILOT_TASK_ID"'

    @task.skypilot(task="tasks/ok.yaml", **FAST)
    def on_h100() -> dict:
        # only slurm_beta has H100s: the returned resources decide the placement
        return {"resources": {"accelerators": "H100:1"}, "envs": {"WHAT": "h100 step"},
                "run": 'echo "$WHAT: $SKYPILOT_NUM_GPUS_PER_NODE GPU(s) on $SKYPILOT_TASK_ID"'}

    hello(greeting()) >> on_h100()

# --- a sweep: the decorated task mapped over 4 values, the operator over 2 ----------------------
SWEEP_TASK = """\
name: sweep
envs:
  LR: null
  OUT_DIR: null
run: |
  set -euo pipefail
  loss=$(awk -v lr="$LR" 'BEGIN {printf "%.6f", (log(lr) - log(0.01))^2}')
  echo "lr=$LR loss=$loss"
  printf '{"lr": %s, "loss": %s}' "$LR" "$loss" > "$OUT_DIR/$SKYPILOT_TASK_ID.json"
"""

with DAG(dag_id="e2e_sweep", schedule=None, start_date=START, catchup=False,
         params={"out": "/tmp"}):

    @task.skypilot(task=SWEEP_TASK, **FAST)
    def train(lr: float, params=None) -> dict:
        return {"envs": {"LR": lr, "OUT_DIR": params["out"]}}

    SkyPilotOperator.partial(
        task_id="classic", task=SWEEP_TASK, **FAST,
    ).expand(envs=[{"LR": "0.5", "OUT_DIR": "{{ params.out }}"},
                   {"LR": "0.05", "OUT_DIR": "{{ params.out }}"}])

    @task
    def best(results: list, params=None) -> dict:
        import json
        import os

        runs = []
        for result in results:
            with open(os.path.join(params["out"], f"{result['task_id']}.json")) as fh:
                runs.append({**json.load(fh), "job_id": result["job_id"]})
        return min(runs, key=lambda r: r["loss"])

    best(train.expand(lr=[0.1, 0.03, 0.01, 0.003]))

# --- bad returns: each fails with a clear message, nothing is submitted ------------------------
with DAG(dag_id="e2e_taskflow_bad", schedule=None, start_date=START, catchup=False):

    @task.skypilot(**FAST)
    def returns_none():
        print("forgot to return")

    @task.skypilot(**FAST)
    def returns_list():
        return ["echo", "hi"]

    @task.skypilot(task="tasks/ok.yaml", **FAST)
    def returns_invalid_dict():
        return {"resouces": {"accelerators": "A100:1"}}

    returns_none()
    returns_list()
    returns_invalid_dict()

# --- an asset: training produces the model, an evaluation DAG is scheduled on it ---------------
E2E_MODEL = Asset(name="e2e_model", uri="file:///tmp/airflow-skypilot-e2e/model")

with DAG(dag_id="e2e_asset_train", schedule=None, start_date=START, catchup=False):

    @task.skypilot(outlets=[E2E_MODEL], **FAST)
    def train_model() -> str:
        return 'echo "model trained by $SKYPILOT_TASK_ID"'

    train_model()

with DAG(dag_id="e2e_asset_evaluate", schedule=[E2E_MODEL], start_date=START, catchup=False):

    @task
    def evaluate(triggering_asset_events=None) -> list:
        """What the asset events that triggered this run say about the training job."""
        return [dict(event.extra) for event in triggering_asset_events[E2E_MODEL]]

    evaluate()
