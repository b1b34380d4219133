"""The example DAGs parse, and the TaskFlow ones are wired as their docs say (they run on the
sandbox in ``make demo``-like e2e tests; here only their shape is checked)."""

from __future__ import annotations

from pathlib import Path

import pytest
from airflow.dag_processing.dagbag import DagBag
from airflow.sdk import Asset
from airflow.sdk.bases.decorator import DecoratedMappedOperator

from airflow_skypilot.decorators import SkyPilotDecoratedOperator

DAGS = Path(__file__).resolve().parents[2] / "dags"


@pytest.fixture(scope="module")
def dagbag() -> DagBag:
    return DagBag(dag_folder=str(DAGS))


def test_every_example_dag_parses(dagbag):
    assert dagbag.import_errors == {}
    assert {"train_pipeline", "nightly_retrain", "nightly_evaluate", "submit_then_sense",
            "hparam_sweep"} <= set(dagbag.dag_ids)


def test_hparam_sweep_maps_the_decorated_training_over_eight_values(dagbag):
    dag = dagbag.dags["hparam_sweep"]
    train = dag.get_task("train")
    assert isinstance(train, DecoratedMappedOperator)
    assert train.operator_class is SkyPilotDecoratedOperator
    assert len(train.op_kwargs_expand_input.value["lr"]) == 8
    assert dag.get_task("pick_best").upstream_task_ids == {"train", "out_dir"}


def test_nightly_evaluate_is_scheduled_on_the_asset_retrain_produces(dagbag):
    (model,) = dagbag.dags["nightly_retrain"].get_task("retrain").outlets
    assert isinstance(model, Asset) and model.name == "nightly_model"
    evaluate = dagbag.dags["nightly_evaluate"]
    assert list(evaluate.timetable.asset_condition.objects) == [model]
    assert evaluate.get_task("evaluate").custom_operator_name == "@task.skypilot"


def test_the_nightly_run_cannot_wait_for_ever_and_hold_back_the_next_night(dagbag):
    """max_active_runs=1: a night whose job never finds GPUs would block every later one."""
    nightly = dagbag.dags["nightly_retrain"]
    assert nightly.max_active_runs == 1
    assert nightly.dagrun_timeout is not None
    assert nightly.get_task("retrain").execution_timeout is not None
