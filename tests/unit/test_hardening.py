"""Bad input that used to get through (roadmap step 7, item 6): each one is a clear error that
names the field (``FILE:LINE: field: problem``), before anything is submitted, from the spec,
the CLI and the operator alike (the operator's is an AirflowFailException: no retry).

The backends' side (a connection's pins, its extras, pod_config) is in test_hardening_backends.
"""

from __future__ import annotations

import json
import os
import time

import pytest
from airflow.sdk.exceptions import AirflowFailException

from airflow_skypilot.backends import registry
from airflow_skypilot.backends.common import jobscript
from airflow_skypilot.cli import main
from airflow_skypilot.operators import SkyPilotOperator
from airflow_skypilot.spec import TaskValidationError, load_task
from airflow_skypilot.spec import source as yaml_source
from tests.fakes import FakeBackend, offer


def _problems(task, **kw) -> list[str]:
    with pytest.raises(TaskValidationError) as info:
        load_task(task, **kw)
    return [str(p) for p in info.value.problems]


def _bomb(levels: int = 7) -> str:
    """A "billion laughs": 9**levels strings once expanded, from ~350 bytes of YAML."""
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\nrun: echo hi\n"


# --- the YAML text: size, aliases, values, depth, encoding ---------------------------------


def test_an_alias_bomb_is_refused_at_once():
    text = _bomb(7)
    assert len(text.encode()) < 400
    start = time.monotonic()
    problems = _problems(text)
    assert time.monotonic() - start < 2.0  # it took 18 s and 1.2 GB before the limits
    assert problems == [f"<inline>:1: more than {yaml_source.MAX_YAML_NODES} values once YAML "
                        "aliases are expanded: refused (a YAML alias bomb?)"]


def test_too_many_aliases_too_many_values_and_too_deep_are_refused():
    many = "x: &x 1\nl: [" + ",".join(["*x"] * (yaml_source.MAX_YAML_ALIASES + 1)) + "]\n"
    assert _problems(many) == [f"<inline>:2: more than {yaml_source.MAX_YAML_ALIASES} YAML "
                               "aliases (*name): refused (a YAML alias bomb?)"]
    wide = "envs: [" + ",".join(["1"] * (yaml_source.MAX_YAML_NODES + 5)) + "]\n"
    assert _problems(wide) == [f"<inline>:1: more than {yaml_source.MAX_YAML_NODES} values: "
                               "refused"]
    deep = "run: x\nconfig: " + "{a: " * 70 + "1" + "}" * 70 + "\n"
    assert _problems(deep) == [f"<inline>:2: nested more than {yaml_source.MAX_YAML_DEPTH} "
                               "levels deep: refused"]
    deeper = "[" * 5000 + "]" * 5000  # beyond Python's recursion limit in PyYAML itself
    assert _problems(deeper) == ["<inline>: nested too deeply to parse: refused"]


def test_text_over_the_size_limit_is_refused(tmp_path):
    big = "run: |\n" + "  echo 0123456789abcdef\n" * (yaml_source.MAX_YAML_BYTES // 24 + 10)
    assert _problems(big) == [f"<inline>: the task YAML is larger than "
                              f"{yaml_source.MAX_YAML_BYTES} bytes: refused"]
    path = tmp_path / "big.yaml"
    path.write_text(big)
    assert _problems(str(path)) == [f"{path}: the task YAML is larger than "
                                    f"{yaml_source.MAX_YAML_BYTES} bytes: refused"]


def test_aliases_within_the_limits_still_work():
    # a merge key and a shared value, as a hand-written YAML may have them
    task = load_task("envs: &e {A: '1'}\nsecrets: {T: x}\nrun: x\nsetup: x\n"
                     "resources: {accelerators: A100:1, labels: {a: b}}\n"
                     "config: {kubernetes: {custom_metadata: {labels: *e}}}\n")
    assert task.envs == {"A": "1"}
    assert task.config["kubernetes"]["custom_metadata"]["labels"] == {"A": "1"}


def test_a_non_utf8_file_names_the_file_the_line_and_the_byte(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("name: t\nrun: echo caf\xe9\n".encode("latin-1"))
    assert _problems(str(path)) == [
        f"{path}:2: not UTF-8 text: byte 21 is 0xe9 (a task YAML must be UTF-8)"]


def test_values_pyyaml_cannot_build_are_problems_at_their_line():
    assert _problems("run: x\nname: 2001-13-01\n") == [
        "<inline>:2: name: YAML error: cannot read '2001-13-01': month must be in 1..12"]
    problems = _problems("run: x\nnum_nodes: " + "1" * 5000 + "\n")
    assert problems[0].startswith("<inline>:2: num_nodes: YAML error: cannot read this value: "
                                  "Exceeds the limit")


def test_a_path_with_a_nul_byte_is_a_problem_not_a_crash():
    assert _problems("/tmp/a\0b.yaml") == [
        "/tmp/a\\x00b.yaml: cannot read task file: embedded null byte"]


# --- env and secret names ------------------------------------------------------------------


def test_secret_and_env_override_names_must_be_env_var_names():
    assert _problems("run: x\n", secrets={"A;touch x": "v"}) == [
        "<inline>:1: secrets: override 'A;touch x' is not a valid environment variable name "
        "(--secret, or the operator's secrets=)"]
    assert _problems("run: x\n", envs={"A B": "v"}) == [
        "<inline>:1: envs: override 'A B' is not a valid environment variable name "
        "(--env, or the operator's envs=)"]


@pytest.mark.parametrize("name", ["SKYPILOT_TASK_ID", "SKYPILOT_NODE_RANK", "SKYPILOT_NODE_IPS",
                                  "SKYPILOT_NUM_NODES", "SKYPILOT_NUM_GPUS_PER_NODE",
                                  "SKYPILOT_SETUP_NODE_RANK", "SKYPILOT_SETUP_NODE_IPS",
                                  "SKYPILOT_SETUP_NUM_GPUS_PER_NODE",
                                  "SKYPILOT_CLUSTER_INFO", "SKYPILOT_ATTEMPT", "SKYPILOT_USER"])
def test_a_secret_cannot_replace_what_airflow_skypilot_sets(name):
    message = f"{name!r} is set by airflow-skypilot for every job; a secret cannot replace it"
    assert _problems(f"run: x\nsecrets:\n  {name}: fake\n") == [
        f"<inline>:3: secrets.{name}: {message}"]
    assert _problems("run: x\n", secrets={name: "fake"}) == [f"<inline>:1: secrets: {message}"]


def test_an_env_of_a_reserved_name_is_ignored_with_a_warning():
    task = load_task("run: x\nenvs:\n  SKYPILOT_NODE_IPS: fake\n  OK: '1'\n",
                     envs={"SKYPILOT_TASK_ID": "fake"})
    assert sorted(str(w) for w in task.warnings) == [
        "<inline>:2: envs: 'SKYPILOT_TASK_ID' is set by airflow-skypilot for every job; this "
        "env is ignored",
        "<inline>:3: envs.SKYPILOT_NODE_IPS: 'SKYPILOT_NODE_IPS' is set by airflow-skypilot for "
        "every job; this env is ignored"]
    env = jobscript.skypilot_env(task, task_id="real", num_gpus_per_node=0, cluster_info={})
    assert env["SKYPILOT_TASK_ID"] == "real" and "SKYPILOT_NODE_IPS" not in env
    assert env["OK"] == "1"


def test_the_job_scripts_own_variables_are_refused_as_envs_and_secrets():
    why = "names starting with AIRFLOW_SKYPILOT_ are airflow-skypilot's own"
    assert _problems("run: x\nsecrets:\n  AIRFLOW_SKYPILOT_SECRET_NAMES: x\n") == [
        f"<inline>:3: secrets.AIRFLOW_SKYPILOT_SECRET_NAMES: 'AIRFLOW_SKYPILOT_SECRET_NAMES': "
        f"{why}"]
    assert _problems("run: x\n", envs={"AIRFLOW_SKYPILOT_WORKDIR": "/"}) == [
        f"<inline>:1: envs: 'AIRFLOW_SKYPILOT_WORKDIR': {why}"]


# --- config.slurm.sbatch_options -------------------------------------------------------------


def _sbatch(options) -> str:
    return "run: x\nconfig:\n  slurm:\n    sbatch_options: " + json.dumps(options) + "\n"


@pytest.mark.parametrize(("options", "expected"), [
    ({"comment": "a\nrm -rf ~"}, "config.slurm.sbatch_options.comment: the value of 'comment', "
                                 "'a\\nrm -rf ~' contains the control character '\\n'"),
    ({"comment": "a\rb"}, "contains the control character '\\r'"),
    ({"comment": "a\u0000b"}, "contains the control character '\\x00'"),
    ({"comm\nent": "x"}, "sbatch option 'comm\\nent' contains the control character '\\n'"),
    (["--comment=a\nb"], "config.slurm.sbatch_options[0]: sbatch option '--comment=a\\nb' "
                         "contains the control character '\\n'"),
    (["--exclusive", "--mail-user", "me@x\n"], "config.slurm.sbatch_options[2]: sbatch option "
                                               "'me@x\\n' contains"),
])
def test_control_characters_in_sbatch_options_are_refused(options, expected):
    problems = _problems(_sbatch(options))
    assert len(problems) == 1 and expected in problems[0], problems
    assert problems[0].startswith("<inline>:4: config.slurm.sbatch_options")


@pytest.mark.parametrize(("options", "owned"), [
    ({"partition": "big"}, "partition"), ({"p": "big"}, "partition"),
    (["-p", "big"], "partition"), (["--part=big"], "partition"), (["-Hpbig"], "partition"),
    ({"account": "other"}, "account"), (["-A", "other"], "account"),
    ({"qos": "high"}, "qos"), ({"reservation": "r"}, "reservation"),
    ({"nodes": 8}, "nodes"), (["-N8"], "nodes"), ({"gres": "gpu:8"}, "gres"),
    ({"gpus": 8}, "gpus"), ({"cpus-per-task": 64}, "cpus-per-task"), ({"mem": "0"}, "mem"),
    ({"job-name": "x"}, "job-name"), (["-o", "/tmp/x"], "output"), ({"chdir": "/"}, "chdir"),
    ({"array": "0-99"}, "array"), (["-M", "other"], "clusters"), ({"requeue": True}, "requeue"),
    ({"wrap": "id"}, "wrap"), ({"uid": 0}, "uid"),
    # SkyPilot turns '_' into '-': job_name is --job-name
    ({"job_name": "x"}, "job-name"), ({"cpus_per_task": 4}, "cpus-per-task"),
    ({"--ntasks_per_node": 1}, "ntasks-per-node"),
])
def test_sbatch_options_the_backend_owns_are_refused(options, owned):
    problems = _problems(_sbatch(options))
    assert len(problems) == 1, problems
    assert problems[0].startswith("<inline>:4: config.slurm.sbatch_options")
    assert "cannot be set by a task" in problems[0]
    assert f"'--{owned}" in problems[0] or f"(--{owned})" in problems[0], problems[0]


def test_other_sbatch_options_load_and_malformed_ones_do_not():
    task = load_task(_sbatch({"exclusive": True, "time": "1:00:00", "constraint": "a100",
                              "comment": "two words", "mail-user": "me@x.org"}))
    assert task.config["slurm"]["sbatch_options"]["time"] == "1:00:00"
    load_task(_sbatch(["--exclusive", "-t", "10", "--nodelist=n[1-2]", "-x", "n3"]))
    assert "must be a string or a number, true for a flag" in _problems(
        _sbatch({"exclusive": ["a"]}))[0]
    assert "'nodes' is not an option" in _problems(_sbatch(["nodes"]))[0]
    assert "unknown sbatch option -z" in _problems(_sbatch(["-z"]))[0]


def test_sbatch_option_keys_with_underscores_become_dashed_options_as_in_skypilot():
    from airflow_skypilot.backends.slurm.settings import task_sbatch_options

    task = load_task(_sbatch({"mail_type": "END", "mail-user": "me@x.org"}))
    assert task_sbatch_options(task) == ["--mail-type=END", "--mail-user=me@x.org"]


def test_sbatch_options_that_are_false_or_null_load_and_emit_nothing_as_in_skypilot():
    from airflow_skypilot.backends.slurm.settings import task_sbatch_options

    task = load_task(_sbatch({"exclusive": False, "comment": None, "time": "10"}))
    assert task_sbatch_options(task) == ["--time=10"]
    # an owned option that is off sets nothing, so nothing is refused (SkyPilot drops it too)
    assert task_sbatch_options(load_task(_sbatch({"job-name": None, "requeue": False}))) == []


# --- the CLI says the same, exit 2 ------------------------------------------------------------


@pytest.mark.parametrize(("text", "args", "expected"), [
    (_bomb(7), [], "more than 20000 values once YAML aliases are expanded"),
    (b"run: caf\xe9\n", [], "not UTF-8 text: byte 8 is 0xe9"),
    ("run: x\n", ["--secret", "A;touch x=1"], "secrets: override 'A;touch x' is not a valid"),
    ("run: x\n", ["--secret", "SKYPILOT_TASK_ID=x"], "a secret cannot replace it"),
    (_sbatch({"qos": "x\nid"}), [], "config.slurm.sbatch_options.qos: the value of 'qos'"),
    (_sbatch({"account": "other"}), [], "cannot be set by a task: the connection owns it"),
])
def test_the_cli_refuses_each_with_exit_2(tmp_path, capsys, text, args, expected):
    path = tmp_path / "task.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    assert main(["validate", str(path), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{path}:") and expected in err, err


def test_the_cli_shows_pod_config_warnings(tmp_path, capsys):
    path = tmp_path / "task.yaml"
    path.write_text("run: x\nconfig:\n  kubernetes:\n    pod_config:\n      spec:\n"
                    "        hostNetwork: true\n")
    assert main(["validate", str(path)]) == 0
    err = capsys.readouterr().err
    assert (f"warning: {path}:6: config.kubernetes.pod_config.spec.hostNetwork: shares the "
            "node's network: a Kubernetes connection runs this task only if it sets "
            "'allow_privileged_pod_config': true") in err


# --- the operator: AirflowFailException, nothing submitted ----------------------------------


class TI:
    dag_id, task_id, run_id, try_number, map_index, start_date = "d", "t", "r", 1, -1, None

    def __init__(self):
        self.xcom: dict = {}

    def xcom_push(self, key, value):
        self.xcom[key] = json.loads(json.dumps(value))


@pytest.fixture(autouse=True)
def _fake(monkeypatch):
    registry.register_backend(FakeBackend)
    monkeypatch.setenv("AIRFLOW_CONN_C1", json.dumps({"conn_type": "fake"}))
    FakeBackend.reset()
    FakeBackend.offers = {"c1": [offer("c1", "p")]}
    yield
    FakeBackend.reset()


@pytest.mark.parametrize(("task", "kw", "expected"), [
    (_bomb(7), {}, "alias bomb"),
    ("run: x\nname: 2001-13-01\n", {}, "month must be in 1..12"),
    ("run: x\n", {"secrets": {"A;touch x": "v"}}, "not a valid environment variable name"),
    ("run: x\n", {"secrets": {"SKYPILOT_TASK_ID": "v"}}, "a secret cannot replace it"),
    ("run: x\n", {"envs": {"AIRFLOW_SKYPILOT_SECRET_NAMES": "v"}}, "airflow-skypilot's own"),
    (_sbatch({"comment": "a\nb"}), {}, "control character"),
    (_sbatch(["--partition=big"]), {}, "cannot be set by a task"),
])
def test_the_operator_fails_without_retry_and_submits_nothing(task, kw, expected):
    op = SkyPilotOperator(task_id="t", task=task, connections=["c1"], **kw)
    with pytest.raises(AirflowFailException, match="invalid SkyPilot task") as info:
        op.execute({"ti": TI()})
    assert expected in str(info.value)
    assert FakeBackend.jobs == {}


def test_the_operator_refuses_a_non_utf8_file(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_bytes(b"run: \xff\n")
    op = SkyPilotOperator(task_id="t", task=str(path), connections=["c1"])
    with pytest.raises(AirflowFailException, match="not UTF-8 text: byte 5 is 0xff"):
        op.execute({"ti": TI()})
    assert FakeBackend.jobs == {}


def test_the_operator_takes_one_line_of_yaml_ending_in_yaml_as_the_task_not_a_path():
    text = "run: python train.py --config configs/exp.yaml"
    op = SkyPilotOperator(task_id="t", task=text, connections=["c1"])
    assert op._task_source() == text
    assert op.load().run == "python train.py --config configs/exp.yaml"
    # a relative YAML path is still made absolute from the DAG's folder
    from airflow.sdk import DAG

    with DAG("d", schedule=None) as dag:
        path_op = SkyPilotOperator(task_id="t2", task="tasks/train.yaml", connections=["c1"])
    folder = os.path.dirname(dag.fileloc)
    assert path_op._task_source() == os.path.join(folder, "tasks/train.yaml")
