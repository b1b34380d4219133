"""``@task.skypilot`` over the in-memory backend: what the function returns, how it is merged
over the base task, the errors for anything else (before anything is submitted), secrets,
deferral and resume, mapping, and the asset event's extra.

Real Airflow runs of the same (``airflow dags test`` on the sandbox) are in
tests/e2e/test_taskflow_e2e.py.
"""

from __future__ import annotations

import json

import pytest
from airflow.sdk import DAG, Asset, AssetAlias, task
from airflow.sdk.bases.decorator import DecoratedMappedOperator
from airflow.sdk.definitions.mappedoperator import MappedOperator
from airflow.sdk.exceptions import AirflowFailException, TaskDeferred
from airflow.sdk.execution_time.context import OutletEventAccessors

from airflow_skypilot.backends.base import JobState
from airflow_skypilot.decorators import SkyPilotDecoratedOperator, skypilot_task
from airflow_skypilot.decorators.skypilot import merge_task
from airflow_skypilot.links import SkyPilotJobLink
from airflow_skypilot.operators import SkyPilotOperator
from airflow_skypilot.runstate import asset_extra
from tests.fakes import FakeBackend
from tests.unit.test_operator import TI, _event, _fake  # noqa: F401  (the fake backend)

BASE = {"resources": {"accelerators": "A100:1", "cpus": "2+"}, "envs": {"A": "1"},
        "run": "echo base"}


def _decorated(fn, **kw):
    """The operator ``@task.skypilot(**kw)`` makes of ``fn`` called with no arguments."""
    kw.setdefault("connections", ["c1", "c2"])
    kw.setdefault("deferrable", True)
    kw.setdefault("task_id", "train")
    with DAG("dag", schedule=None):
        out = task.skypilot(**kw)(fn)()
    return out.operator


def _run(op, ti=None):
    ti = ti or TI()
    with pytest.raises(TaskDeferred) as info:
        op.execute({"ti": ti})
    return info.value, ti


# --- registration ---------------------------------------------------------------------------
def test_task_skypilot_is_the_providers_decorator_and_makes_the_operator():
    assert task.skypilot is skypilot_task
    op = _decorated(lambda: "echo hi", task_id="hello")
    assert isinstance(op, SkyPilotDecoratedOperator) and isinstance(op, SkyPilotOperator)
    assert op.task_id == "hello" and op.custom_operator_name == "@task.skypilot"
    assert op.operator_extra_links == (SkyPilotJobLink(),)
    assert {"op_args", "op_kwargs", "task", "connections", "envs", "secrets", "policy"} == \
        set(op.template_fields)


def test_a_dict_annotation_does_not_unroll_the_result():
    def train() -> dict:
        return {"run": "x"}
    assert _decorated(train).multiple_outputs is False
    with DAG("dag", schedule=None):
        op = task.skypilot(multiple_outputs=True, connections=["c1"])(train)().operator
    assert op.multiple_outputs is True


def test_operator_arguments_are_checked_at_parse_time():
    with pytest.raises(ValueError, match="policy must be one of"):
        _decorated(lambda: "x", policy="quickest")


# --- what the function returns --------------------------------------------------------------
def test_a_str_is_the_run_script_merged_into_the_base_task():
    op = _decorated(lambda: "python train.py --lr 0.1", task=BASE)
    loaded = op.load({"ti": TI()})
    assert loaded.run == "python train.py --lr 0.1"
    assert loaded.envs == {"A": "1"} and loaded.candidates[0].accelerator == "A100"
    assert op.task == {**BASE, "run": "python train.py --lr 0.1"}  # the rendered field


def test_a_dict_is_merged_over_the_base_one_level_deep():
    op = _decorated(lambda: {"resources": {"accelerators": "H100:2"}, "envs": {"B": 2},
                             "num_nodes": 2}, task=BASE)
    loaded = op.load({"ti": TI()})
    (cand,) = loaded.candidates
    assert (cand.accelerator, cand.accelerator_count) == ("H100", 2)
    assert cand.cpus == "2+"  # kept from the base's resources
    assert loaded.envs == {"A": "1", "B": "2"} and loaded.num_nodes == 2
    assert loaded.run == "echo base"


def test_merge_rule():
    assert merge_task({}, "echo") == {"run": "echo"}
    assert merge_task({"setup": "s", "run": "r"}, {"setup": None}) == {"setup": None, "run": "r"}
    base = {"resources": {"accelerators": {"A100": 2, "H100": 2}}}
    # a mapping field is merged one level: the accelerators' alternatives are one value
    assert merge_task(base, {"resources": {"accelerators": {"H100": 8}}}) == \
        {"resources": {"accelerators": {"H100": 8}}}
    assert merge_task({"envs": {"A": "1"}}, {"envs": "nope"}) == {"envs": "nope"}


@pytest.mark.parametrize("base, returned, merged", [
    ({"accelerators": "A100:1", "cpus": 2}, {"gpus": "H100:8"}, {"cpus": 2, "gpus": "H100:8"}),
    ({"gpus": "A100:1", "cpus": 2}, {"accelerators": "H100:8"},
     {"cpus": 2, "accelerators": "H100:8"}),
    ({"any_of": [{"infra": "aws"}], "cpus": 2}, {"ordered": [{"infra": "k8s"}]},
     {"cpus": 2, "ordered": [{"infra": "k8s"}]}),
    ({"ordered": [{"infra": "aws"}]}, {"any_of": [{"infra": "k8s"}]},
     {"any_of": [{"infra": "k8s"}]}),
    ({"cloud": "aws", "region": "us-east-1", "cpus": 2}, {"infra": "k8s"},
     {"cpus": 2, "infra": "k8s"}),
    ({"infra": "aws/us-east-1"}, {"cloud": "gcp"}, {"cloud": "gcp"}),
    # a region alone keeps the base's infra: refused, rather than widened to any cloud
    ({"infra": "aws"}, {"region": "us-west-2"}, {"infra": "aws", "region": "us-west-2"}),
    # both given by the function: both kept, and the task refused as it would be anyway
    ({"cpus": 2}, {"gpus": "H100", "accelerators": "A100"},
     {"cpus": 2, "gpus": "H100", "accelerators": "A100"}),
])
def test_a_returned_key_replaces_the_bases_aliases_and_alternatives(base, returned, merged):
    """``gpus`` is ``accelerators``: replacing one by the other must not clash."""
    assert merge_task({"resources": base}, {"resources": returned}) == {"resources": merged}


def test_returned_gpus_replace_the_base_yamls_accelerators(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text("resources:\n  cpus: 2\n  accelerators: A100:1\n  any_of:\n"
                    "    - infra: aws\nrun: echo\n")
    op = _decorated(lambda: {"resources": {"gpus": "H100:8", "ordered": [{"infra": "k8s"}]}},
                    task=str(base))
    (cand,) = op.load({"ti": TI()}).candidates
    assert (cand.accelerator, cand.accelerator_count, cand.infra, cand.cpus) == \
        ("H100", 8, "kubernetes", "2")


def test_returned_accelerators_replace_the_base_yamls_any_of_entries_too(tmp_path):
    """An any_of/ordered entry overrides the top level: left in, the entries' A100:8/H100:8
    would run while the log shows the returned L4:1."""
    base = tmp_path / "base.yaml"
    base.write_text("resources:\n  cpus: 8+\n  any_of:\n    - accelerators: A100:8\n"
                    "    - accelerators: H100:8\nrun: echo\n")
    op = _decorated(lambda: {"resources": {"accelerators": "L4:1"}}, task=str(base))
    (cand,) = op.load({"ti": TI()}).candidates
    assert (cand.accelerator, cand.accelerator_count, cand.cpus) == ("L4", 1, "8+")
    assert op.task["resources"] == {"cpus": "8+", "accelerators": "L4:1"}  # what the log shows


@pytest.mark.parametrize("entries, returned, merged", [
    # the rest of an entry stays; entries that become the same are one
    ({"ordered": [{"accelerators": "A100:8", "infra": "aws"}, {"gpus": "H100:8", "infra": "k8s"},
                  {"accelerators": "H100:8", "infra": "aws"}]},
     {"gpus": "L4:1"}, {"ordered": [{"infra": "aws"}, {"infra": "k8s"}], "gpus": "L4:1"}),
    # an alternative goes too: returned infra takes the entries' cloud/region/zone
    ({"any_of": [{"cloud": "aws", "region": "us-east-1", "use_spot": True}, {"use_spot": False}]},
     {"infra": "k8s"}, {"any_of": [{"use_spot": True}, {"use_spot": False}], "infra": "k8s"}),
    # entries without the key, and the function's own choices, stay as written
    ({"any_of": [{"infra": "aws"}, {}]}, {"accelerators": "L4:1"},
     {"any_of": [{"infra": "aws"}, {}], "accelerators": "L4:1"}),
    ({"any_of": [{"accelerators": "A100:8"}]},
     {"accelerators": "L4:1", "any_of": [{"accelerators": "T4:1"}]},
     {"any_of": [{"accelerators": "T4:1"}], "accelerators": "L4:1"}),
    # an entry left empty is the top level, still a candidate: "k8s, else anywhere" stays so
    # (not k8s only); the list goes once nothing but the top level is left
    ({"ordered": [{"accelerators": "H100:8", "infra": "kubernetes"}, {"accelerators": "A100:8"}]},
     {"accelerators": "L4:1"}, {"ordered": [{"infra": "kubernetes"}, {}], "accelerators": "L4:1"}),
    ({"any_of": [{"accelerators": "A100:8"}, {"accelerators": "H100:8", "use_spot": True}]},
     {"accelerators": "L4:1"}, {"any_of": [{}, {"use_spot": True}], "accelerators": "L4:1"}),
])
def test_a_returned_resources_key_leaves_the_bases_choices(entries, returned, merged):
    assert merge_task({"resources": {"cpus": 2, **entries}}, {"resources": returned}) == \
        {"resources": {"cpus": 2, **merged}}


def test_top_level_aliases_and_alternatives_are_replaced_too():
    assert merge_task({"service": {"replicas": 1}, "run": "r"}, {"pool": {"workers": 1}}) == \
        {"run": "r", "pool": {"workers": 1}}
    assert merge_task({"_metadata": {"a": 1}}, {"metadata": {"b": 2}}) == {"metadata": {"b": 2}}


def test_a_bad_entry_of_the_base_yaml_names_its_own_line(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text("name: base\nenvs:\n  OK: 1\n  A: 2\n  BAD-NAME: 3\nconfig:\n"
                    "  kubernetes:\n    provision_timeout: 10\n    pod_config: 3\nrun: echo\n")
    op = _decorated(lambda: {"envs": {"B": "2"}}, task=str(base))
    with pytest.raises(AirflowFailException) as info:
        op.execute({"ti": TI()})
    text = str(info.value)
    assert f"{base}:5: envs.BAD-NAME: 'BAD-NAME' is not a valid" in text, text
    assert f"{base}:9: config.kubernetes.pod_config: must be a mapping; got 3" in text, text
    assert FakeBackend.jobs == {}


def test_no_base_task_takes_the_function_alone():
    loaded = _decorated(lambda: {"resources": {"accelerators": "A100:1"}, "run": "go"}).load(
        {"ti": TI()})
    assert loaded.run == "go"


def test_a_relative_yaml_path_starts_at_the_dag_files_folder(tmp_path, monkeypatch):
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "base.yaml").write_text("name: base\nworkdir: .\nrun: echo base\n")
    op = _decorated(lambda: "echo mine", task="tasks/base.yaml")
    op.dag.fileloc = str(tmp_path / "dag.py")
    monkeypatch.chdir("/")
    loaded = op.load({"ti": TI()})
    assert (loaded.name, loaded.run) == ("base", "echo mine")
    assert loaded.resolved_workdir() == str(tmp_path / "tasks")  # the YAML's own folder


def test_arguments_come_from_op_args_and_op_kwargs_and_the_context():
    seen = {}

    def train(lr, *, epochs, ti=None):
        seen.update(lr=lr, epochs=epochs, ti=ti)
        return f"train --lr {lr} --epochs {epochs}"
    with DAG("dag", schedule=None):
        op = task.skypilot(connections=["c1"])(train)(0.5, epochs=3).operator
    ti = TI()
    assert op.load({"ti": ti}).run == "train --lr 0.5 --epochs 3"
    assert seen == {"lr": 0.5, "epochs": 3, "ti": ti}


# --- bad returns: clear errors, nothing submitted --------------------------------------------
@pytest.mark.parametrize("returned, message", [
    (None, r"train\(\) returned None \(did it forget to return\?\); a @task.skypilot function "
           r"returns the job's run script \(a str\) or SkyPilot task fields \(a dict"),
    (["echo", "hi"], r"train\(\) returned a list; a @task.skypilot function returns"),
    (3, r"train\(\) returned a int;"),
    ("  \n", r"train\(\) returned an empty run script"),
    ({"resouces": {"accelerators": "A100:1"}},
     r"invalid SkyPilot task:\ntrain\(\)'s result: resouces: unknown field 'resouces'; did you "
     r"mean 'resources'\?"),
    ({"resources": {"accelerators": "A100:x"}},
     r"train\(\)'s result: resources.accelerators: 'A100:x' should be"),
    ({"run": ["echo", "hi"]}, r"train\(\)'s result: run: input should be a valid string"),
])
def test_a_bad_return_fails_before_anything_is_submitted(returned, message):
    def train():
        return returned
    op = _decorated(train, task=BASE)
    with pytest.raises(AirflowFailException, match=message):
        op.execute({"ti": TI()})
    assert FakeBackend.jobs == {}


def test_problems_point_at_the_base_yamls_lines_or_the_functions_result(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text("name: base\nenvs:\n  DATA: null\n  KEEP: k\nrun: echo\n")

    def train():
        return {"resouces": {}, "envs": {"EXTRA": None}}
    op = _decorated(train, task=str(base))
    with pytest.raises(AirflowFailException) as info:
        op.execute({"ti": TI()})
    text = str(info.value)
    assert f"{base}:3: envs.DATA: has no value" in text
    assert "train()'s result: envs.EXTRA: has no value" in text
    assert "train()'s result: resouces: unknown field" in text
    assert FakeBackend.jobs == {}


def test_an_unreadable_base_task_fails_before_the_function_runs(tmp_path):
    called = []
    op = _decorated(lambda: called.append(1) or "x", task=str(tmp_path / "missing.yaml"))
    with pytest.raises(AirflowFailException, match="cannot read task file"):
        op.execute({"ti": TI()})
    assert called == [] and FakeBackend.jobs == {}


def test_an_exception_in_the_function_is_the_tasks_error():
    def train():
        raise RuntimeError("no config today")
    with pytest.raises(RuntimeError, match="no config today"):
        _decorated(train).execute({"ti": TI()})
    assert FakeBackend.jobs == {}


@pytest.fixture
def task_log(capsys):
    """The task log these tests read: Airflow's structlog, printed to this test's stdout. An
    earlier test in the session (an Airflow CLI run in-process) may have configured structlog
    with a stream of its own; for this test its loggers write to the stdout of the moment."""
    import structlog

    factory = structlog.get_config()["logger_factory"]
    if getattr(factory, "io", None) is not None:
        structlog.configure(logger_factory=type(factory)(factory.cls, None))
    yield capsys
    structlog.configure(logger_factory=factory)


# --- secrets ---------------------------------------------------------------------------------
def test_returned_secrets_are_masked_before_anything_can_show_them(monkeypatch, task_log):
    masked = []
    monkeypatch.setattr("airflow_skypilot.operators.skypilot.mask_secret", masked.append)
    op = _decorated(lambda: {"secrets": {"TOKEN": "s3cr3t-token"}, "run": "use $TOKEN"})
    deferred, _ = _run(op)
    assert "s3cr3t-token" in masked
    log = task_log.readouterr().out  # the merged task is logged, without the secret's value
    assert "<lambda>() returned the fields secrets, run; the task:" in log
    assert "TOKEN: '***'" in log and "s3cr3t-token" not in log
    assert "s3cr3t-token" not in json.dumps(deferred.trigger.serialize(), default=str)
    assert "s3cr3t-token" not in json.dumps(deferred.kwargs, default=str)


def test_secrets_of_an_invalid_return_are_masked_too(monkeypatch):
    masked = []
    monkeypatch.setattr("airflow_skypilot.operators.skypilot.mask_secret", masked.append)
    op = _decorated(lambda: {"secrets": {"TOKEN": ["s3cr3t-in-a-list"]}, "run": "x",
                             "resources": {"cpus": "lots"}})
    with pytest.raises(AirflowFailException):
        op.execute({"ti": TI()})
    assert "s3cr3t-in-a-list" in masked


# --- deferral, resume, failover --------------------------------------------------------------
def test_the_run_state_carries_a_digest_of_the_answer_not_its_secrets():
    op = _decorated(lambda: {"secrets": {"TOKEN": "t0k"}, "run": "go"})
    deferred, _ = _run(op)
    digest = deferred.trigger.state["spec_digest"]
    assert len(digest) == 16 and "t0k" not in json.dumps(deferred.trigger.state)


def test_a_resumed_try_calls_the_function_again_only_when_it_needs_the_task(task_log):
    calls = []

    def train():
        calls.append(1)
        return {"resources": {"accelerators": "A100:1"}, "run": f"go {len(calls)}"}
    deferred, ti = _run(_decorated(train))
    assert len(calls) == 1
    # success: the result needs nothing of the task
    event, state = _event(deferred, JobState.SUCCEEDED)
    result = _decorated(train).execute_complete({"ti": ti}, event, state)
    assert result["state"] == "succeeded" and len(calls) == 1
    assert "returned a different task" not in task_log.readouterr().out


def test_a_failover_after_a_deferral_places_the_functions_answer_again(task_log):
    calls = []

    def train():
        calls.append(1)
        return {"resources": {"accelerators": "A100:1"}, "run": f"go {len(calls)}"}
    deferred, ti = _run(_decorated(train))
    event, state = _event(deferred, JobState.INFRA_FAILED, reason="node down")
    with pytest.raises(TaskDeferred) as again:
        _decorated(train).execute_complete({"ti": ti}, event, state)
    assert len(calls) == 2
    assert again.value.trigger.handle["connection"] == "c2"  # c1/p is blocked now
    assert again.value.trigger.state["task_env_id"] == deferred.trigger.state["task_env_id"]
    # "go 1" then "go 2": the second answer differs from the first, and the log says so
    assert "train() returned a different task than at this try's first call" in \
        task_log.readouterr().out


# --- mapping ---------------------------------------------------------------------------------
def test_expand_maps_the_decorated_task_and_partial_expand_the_operator():
    with DAG("dag", schedule=None):
        @task.skypilot(task=BASE, connections=["c1"])
        def train(lr):
            return {"envs": {"LR": lr}}
        sweep = train.expand(lr=[0.1, 0.01])
        classic = SkyPilotOperator.partial(task_id="classic", task=BASE,
                                           connections=["c1"]).expand(
            envs=[{"LR": "0.1"}, {"LR": "0.01"}])
    assert isinstance(sweep.operator, DecoratedMappedOperator)
    assert sweep.operator.operator_class is SkyPilotDecoratedOperator
    assert sweep.operator.operator_extra_links == (SkyPilotJobLink(),)
    assert isinstance(classic, MappedOperator)
    assert classic.operator_extra_links == (SkyPilotJobLink(),)


def test_mapped_instances_get_their_own_job_names_and_task_ids():
    names, task_ids = set(), set()
    for index in range(3):
        ti = TI()
        ti.map_index = index
        op = _decorated(lambda: {"resources": {"accelerators": "A100:1"}, "run": "go"})
        deferred, _ = _run(op, ti)
        names.add(deferred.trigger.handle["job_name"])
        task_ids.add(deferred.trigger.state["task_env_id"])
    assert len(names) == 3 and len(task_ids) == 3
    assert all(t.startswith("sky-airflow_dag_train_") for t in task_ids)


# --- assets ----------------------------------------------------------------------------------
MODEL = Asset(name="model", uri="s3://models/train/latest")


def _succeed(op, context):
    deferred, ti = _run(op)
    context["ti"] = ti
    event, state = _event(deferred, JobState.SUCCEEDED)
    return op.execute_complete(context, event, state)


def test_success_sets_the_outlets_asset_extra_where_and_how_it_ran():
    events = OutletEventAccessors()
    op = _decorated(lambda: {"resources": {"accelerators": "A100:1"}, "run": "go"},
                    outlets=[MODEL, AssetAlias("models")])
    result = _succeed(op, {"outlet_events": events})
    extra = events[MODEL].extra
    assert extra == {
        "state": "succeeded", "connection": "c1", "location": "p", "infra": "fake/c1/p",
        "backend": "fake", "job_id": result["job_id"], "job_name": result["job_name"],
        "gpu_hours": 1.0, "cost": 0.0, "skypilot_task_id": result["task_id"], "attempts": 1,
        "places": ["c1/p"]}
    assert json.loads(json.dumps(extra)) == extra
    assert not events[AssetAlias("models")].extra  # an alias names no asset: left alone


def test_no_outlets_no_asset_extra():
    events = OutletEventAccessors()
    _succeed(_decorated(lambda: {"resources": {"accelerators": "A100:1"}, "run": "go"}),
             {"outlet_events": events})
    assert len(events) == 0


def test_not_waiting_the_asset_event_says_submitted():
    events = OutletEventAccessors()
    op = SkyPilotOperator(task_id="t", task=BASE, connections=["c1"], outlets=[MODEL],
                          wait_for_completion=False)
    ti = TI()
    handle = op.execute({"ti": ti, "outlet_events": events})
    extra = events[MODEL].extra
    assert extra["state"] == "submitted" and extra["job_id"] == handle["job_id"]
    assert "attempts" not in extra and extra["skypilot_task_id"].startswith("sky-airflow_dag_")


def test_asset_extra_from_a_result():
    result = {"state": "succeeded", "connection": "a", "location": "l", "job_id": "7",
              "task_id": "sky-x", "attempts": [{"connection": "k", "location": "n"},
                                               {"connection": "a", "location": "l"}],
              "gpu_hours": 0.5, "cost": 1.25, "old_copies": []}
    assert asset_extra(result) == {"state": "succeeded", "connection": "a", "location": "l",
                                   "job_id": "7", "gpu_hours": 0.5, "cost": 1.25,
                                   "skypilot_task_id": "sky-x", "attempts": 2,
                                   "places": ["k/n", "a/l"]}
