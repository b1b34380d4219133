"""The CLI's contract: validate --json shape, error lines and exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from airflow_skypilot.cli import main

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "airflow_skypilot.cli"]


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "task.yaml"
    path.write_text(text)
    return str(path)


def test_validate_json_contract(tmp_path, capsys):
    path = _write(tmp_path, "name: t\nnum_nodes: 2\nresources:\n  accelerators: {A100: 8, "
                            "H100: 8}\n  cpus: 8+\n  memory: 32+\n  infra: k8s\nenvs:\n  X: null\n")
    assert main(["validate", path, "--env", "X=1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) >= {"name", "num_nodes", "envs", "ordered", "candidates"}
    assert data["name"] == "t" and data["num_nodes"] == 2 and data["envs"] == {"X": "1"}
    assert data["ordered"] is False
    first = data["candidates"][0]
    assert {k: first[k] for k in ("accelerator", "accelerator_count", "cpus", "memory",
                                  "use_spot", "infra", "instance_type")} == {
        "accelerator": "A100", "accelerator_count": 8, "cpus": "8+", "memory": "32+",
        "use_spot": False, "infra": "kubernetes", "instance_type": None}


_CONTRACT_KEYS = ("accelerator", "accelerator_count", "cpus", "memory", "use_spot", "infra",
                  "instance_type")


def _candidate(accelerator, count, *, cpus=None, memory=None, use_spot=False, infra=None,
               instance_type=None):
    return {"accelerator": accelerator, "accelerator_count": count, "cpus": cpus,
            "memory": memory, "use_spot": use_spot, "infra": infra,
            "instance_type": instance_type}


@pytest.mark.parametrize(("text", "expected"), [
    pytest.param(
        "name: o\nresources:\n  cpus: 4\n  ordered:\n"
        "    - infra: k8s\n      accelerators: H100:2\n"
        "    - infra: slurm/c2\n      accelerators: A100:1\n      memory: 16+\n"
        "    - infra: aws/us-east-1\n      instance_type: p3.2xlarge\n"
        "      accelerators: V100:1\n      use_spot: true\n"
        "run: echo hi\n",
        [_candidate("H100", 2, cpus="4", infra="kubernetes"),
         _candidate("A100", 1, cpus="4", memory="16+", infra="slurm/c2"),
         _candidate("V100", 1, cpus="4", use_spot=True, infra="aws/us-east-1",
                    instance_type="p3.2xlarge")],
        id="ordered-block"),
    pytest.param(
        "resources:\n  accelerators: [H100:1, A100:2]\n  infra: slurm\nrun: echo hi\n",
        [_candidate("H100", 1, infra="slurm"), _candidate("A100", 2, infra="slurm")],
        id="accelerator-list"),
])
def test_validate_json_ordered_keeps_candidate_order(tmp_path, capsys, text, expected):
    """An `ordered` task (or an accelerator list, which SkyPilot treats as ordered) says
    ordered: true and lists every candidate, in the task's order, with the contract's fields."""
    path = _write(tmp_path, text)
    assert main(["validate", path, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ordered"] is True
    assert [{k: c[k] for k in _CONTRACT_KEYS} for c in data["candidates"]] == expected


def test_validate_invalid_exits_2_with_one_line_per_problem(tmp_path, capsys):
    path = _write(tmp_path, "resurces:\n  cpus: 1\nnum_nodes: 0\n")
    assert main(["validate", path, "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        f"{path}:1: resurces: unknown field 'resurces'; did you mean 'resources'?",
        f"{path}:3: num_nodes: must be a positive whole number; got 0",
    ]


def test_validate_missing_file_exits_2(tmp_path, capsys):
    assert main(["validate", str(tmp_path / "nope.yaml")]) == 2
    assert "cannot read task file" in capsys.readouterr().err


@pytest.mark.parametrize("given", ["tasks/train", "run: echo", "{run: echo}", "."])
def test_file_is_always_a_file_never_yaml_text(given, tmp_path, capsys, monkeypatch):
    """A mistyped path (no .yaml) is a file that cannot be read, as a missing one is, not YAML
    text that may well be valid; so is a directory."""
    monkeypatch.chdir(tmp_path)
    assert main(["validate", given]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"{given}: cannot read task file: "), err
    assert main(["plan", given, "--conn", "c1"]) == 2
    assert "cannot read task file" in capsys.readouterr().err
    (tmp_path / "train").write_text("run: echo\n")  # a file without the suffix is still read
    assert main(["validate", "train"]) == 0 and "train: valid" in capsys.readouterr().out


@pytest.mark.parametrize("timeout", ["0", "-5", "nan", "inf", "-inf", "1e10", "soon"])
@pytest.mark.parametrize("command", [["show-gpus"], ["plan", "task.yaml"]])
def test_timeout_must_be_a_positive_finite_number_of_seconds(command, timeout, capsys):
    """0, negative or nan answered every row "no answer within -5s" and exit 0; inf crashed."""
    with pytest.raises(SystemExit) as info:
        main([*command, "--conn", "c1", f"--timeout={timeout}"])
    assert info.value.code == 2
    assert f"argument --timeout: must be a number of seconds above 0 and at most 86400, " \
           f"got {timeout!r}" in capsys.readouterr().err


def test_timeout_takes_seconds():
    from airflow_skypilot.cli import build_parser

    for given, seconds in (("2.5", 2.5), ("86400", 86400.0)):
        assert build_parser().parse_args(["show-gpus", "--conn", "c", "--timeout", given]) \
            .timeout == seconds
    assert build_parser().parse_args(["plan", "t.yaml", "--conn", "c"]).timeout == 30.0


def test_validate_bad_env_flag_exits_2(tmp_path, capsys):
    path = _write(tmp_path, "run: x\n")
    assert main(["validate", path, "--env", "NOEQUALS"]) == 2
    assert "--env expects KEY=VALUE" in capsys.readouterr().err


def test_validate_human_output_and_warnings(tmp_path, capsys):
    path = _write(tmp_path, "resources:\n  accelerators: [H100:1, A100:1]\nservice: {}\n")
    assert main(["validate", path]) == 0
    out, err = capsys.readouterr()
    assert "candidates (in this order):" in out
    assert "1. H100:1" in out and "2. A100:1" in out
    assert f"warning: {path}:3: service:" in err


def test_secrets_never_printed(tmp_path, capsys):
    path = _write(tmp_path, "secrets:\n  TOKEN: null\n")
    assert main(["validate", path, "--secret", "TOKEN=s3cr3t", "--json"]) == 0
    out = capsys.readouterr().out
    assert "s3cr3t" not in out
    assert json.loads(out)["secrets"] == ["TOKEN"]


def test_console_script_runs_the_same(tmp_path):
    """The installed `airflow-skypilot` entry point, as users run it."""
    path = _write(tmp_path, "resources:\n  accelerators: A100:x\n")
    exe = Path(sys.executable).parent / "airflow-skypilot"
    cmd = [str(exe)] if exe.exists() else CLI
    proc = subprocess.run([*cmd, "validate", path, "--json"], capture_output=True, text=True,
                          env={**os.environ}, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"{path}:2: resources.accelerators: 'A100:x' should be <name> or <name>:<count>")


@pytest.mark.parametrize("task", sorted((REPO / "dags" / "tasks").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_example_tasks_validate(task, capsys):
    args = ["validate", str(task), "--json"]
    for key in ("DATA_DIR", "CKPT_DIR", "OUT_DIR", "DATE"):
        args += ["--env", f"{key}=/tmp/x"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["candidates"]


def test_usage_error_exits_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["frobnicate"])
    assert info.value.code == 2


def test_backends_lists_each_backend_with_what_it_cannot_run(capsys):
    assert main(["backends", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["name"]: r for r in out["backends"]}
    assert set(rows) >= {"slurm", "kubernetes", "aws"}
    assert rows["slurm"]["conn_types"] == ["slurm", "ssh"]
    assert "spot" in rows["slurm"]["unsupported_features"]
    assert "spot" not in rows["aws"]["unsupported_features"]
    assert main(["backends"]) == 0
    text = capsys.readouterr().out
    assert "slurm cannot run:" in text and "spot: Slurm has no spot capacity" in text


def _plan_with(monkeypatch, offers):
    """``plan`` over FakeBackend connections; an id without offers is not defined, as a typo
    in ``--conn`` would be."""
    from airflow_skypilot import cli
    from airflow_skypilot.exceptions import ConfigurationError
    from airflow_skypilot.hooks.capacity import SkyPilotCapacityHook
    from tests.fakes import FakeBackend

    def backend(conn_id):
        if conn_id not in offers:
            raise ConfigurationError(f"connection {conn_id!r} is not defined")
        return FakeBackend(conn_id)

    monkeypatch.setattr(FakeBackend, "offers", offers)  # restored after the test
    monkeypatch.setattr(cli, "_hook", lambda args: SkyPilotCapacityHook(
        args.conn, timeout=args.timeout, backend_factory=backend))


def test_plan_with_an_undefined_connection_names_it_on_stderr_and_exits_1(
        tmp_path, capsys, monkeypatch):
    from tests.fakes import offer

    _plan_with(monkeypatch, {"c1": [offer("c1", "p")]})
    path = _write(tmp_path, "resources:\n  accelerators: A100:1\nrun: x\n")
    assert main(["plan", path, "--conn", "c1", "--conn", "c1_typo", "--json"]) == 1
    out, err = capsys.readouterr()
    assert json.loads(out)["chosen"]["connection"] == "c1"  # the plan is still shown
    assert err.splitlines() == [
        "airflow-skypilot: error: misconfigured connection c1_typo (the operator fails on "
        "it): ConfigurationError: connection 'c1_typo' is not defined"]
    assert main(["plan", path, "--conn", "c1"]) == 0
    assert capsys.readouterr().err == ""


def test_plan_exits_1_with_the_reasons_when_no_connection_could_be_read(
        tmp_path, capsys, monkeypatch):
    from tests.fakes import FakeBackend, offer

    _plan_with(monkeypatch, {"c1": [offer("c1", "p")], "c2": []})
    monkeypatch.setattr(FakeBackend, "down", {"c1", "c2"})
    path = _write(tmp_path, "resources:\n  accelerators: A100:1\nrun: x\n")
    assert main(["plan", path, "--conn", "c1", "--conn", "c2", "--json"]) == 1
    out, err = capsys.readouterr()
    assert json.loads(out)["chosen"] is None  # the table still shows why
    assert err.splitlines() == [
        "airflow-skypilot: error: no connection could be read",
        "airflow-skypilot: error: unreachable connection c1: BackendUnreachable: c1 is down",
        "airflow-skypilot: error: unreachable connection c2: BackendUnreachable: c2 is down"]
    # one connection read (even with nothing to offer): the plan itself is the answer
    monkeypatch.setattr(FakeBackend, "down", {"c1"})
    assert main(["plan", path, "--conn", "c1", "--conn", "c2"]) == 0
    assert capsys.readouterr().err == ""
