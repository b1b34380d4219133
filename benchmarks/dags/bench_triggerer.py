"""The DAG whose deferred task instances the triggerer-memory benchmark creates
(``benchmarks/triggerer_memory.py``): one mapped SkyPilot task. Nothing runs it: the benchmark
writes its deferred task instances and their trigger rows straight into the metadata DB."""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import DAG

from airflow_skypilot.operators import SkyPilotOperator

with DAG(dag_id="bench_triggerer", schedule=None, start_date=datetime(2026, 1, 1),
         catchup=False):
    SkyPilotOperator.partial(
        task_id="watch",
        task="name: watch\nresources:\n  infra: slurm\n  cpus: 1\nrun: sleep 3600\n",
        connections=["slurm_alpha", "slurm_beta"],
    ).expand(envs=[{"I": "0"}])
