"""One operator whose task YAML, envs and timing arguments come from the run's conf: each e2e
test picks them. ``e2e_retry`` is the same task watched in the worker and retried once."""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import DAG

from airflow_skypilot.operators import SkyPilotOperator


class E2EOperator(SkyPilotOperator):
    """The operator, with its timing arguments templated too: a fault test sets a short
    silence limit (or a long one) in the run's conf, like the task and its envs."""

    template_fields = (*SkyPilotOperator.template_fields, "unreachable_timeout",
                       "confirm_timeout", "wait_for_completion")


#: what a run's conf may set; the defaults are the operator's own
PARAMS = {"task": "tasks/ok.yaml", "envs": {}, "policy": "fastest",
          "unreachable_timeout": None, "confirm_timeout": 30, "wait_for_completion": True}


#: the operator's arguments in every e2e DAG (the run's conf picks the templated ones)
ARGS = dict(
    task_id="run",
    task="{{ params.task }}",
    policy="{{ params.policy }}",
    unreachable_timeout="{{ params.unreachable_timeout }}",
    confirm_timeout="{{ params.confirm_timeout }}",
    wait_for_completion="{{ params.wait_for_completion }}",
    poll_interval=1,
    reprobe_interval=5,
    max_failovers=2,
)


def _operator(**kwargs) -> E2EOperator:
    return E2EOperator(envs="{{ params.envs }}", **ARGS, **kwargs)


def _dag(dag_id: str) -> DAG:
    return DAG(dag_id=dag_id, schedule=None, start_date=datetime(2026, 1, 1), catchup=False,
               render_template_as_native_obj=True, params=PARAMS)


with _dag("e2e_task") as dag:
    _operator()

# The worker watches the job (not deferrable), and a failed try is retried at once: the
# deployment test kills the worker right after its submission.
with _dag("e2e_retry") as retry_dag:
    _operator(deferrable=False, retries=1, retry_delay=timedelta(seconds=1))

# Triggerer HA (the deployment test): many runs at once, each deferred while its job runs; no
# log streaming, so every SSH command a triggerer sends is a status request (the test counts
# them per connection, interval and triggerer).
with DAG(dag_id="e2e_ha", schedule=None, start_date=datetime(2026, 1, 1), catchup=False,
         render_template_as_native_obj=True, params=PARAMS, max_active_runs=32,
         max_active_tasks=32) as ha_dag:
    _operator(stream_logs=False)

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

# A sweep of eight whose members place at the same moment (the deployment test): each its own
# counter file, ``<params.envs.COUNTER>-<i>``.
with _dag("e2e_spread") as spread_dag:
    E2EOperator.partial(**ARGS).expand(envs=[
        {"COUNTER": f"{{{{ params.envs.COUNTER }}}}-{i}",
         "WORK_SECONDS": "{{ params.envs.WORK_SECONDS }}"} for i in range(8)])
