"""The task YAML: every field and form, every error path (file:line: field: problem)."""

from __future__ import annotations

import os
import textwrap

import pytest

from airflow_skypilot.spec import TaskValidationError, load_task


def _load(text: str, **kw):
    return load_task(textwrap.dedent(text).lstrip("\n"), file="t.yaml", **kw)


def _cands(text: str, **kw):
    return [c.to_json() for c in _load(text, **kw).candidates]


def _errors(text: str, **kw) -> list[str]:
    with pytest.raises(TaskValidationError) as info:
        _load(text, **kw)
    return [str(p) for p in info.value.problems]


# --- accelerators: every form --------------------------------------------------------------

ACCELERATOR_FORMS = [
    ("A100", [("A100", 1)], False),
    ("A100:8", [("A100", 8)], False),
    ("a100:8", [("A100", 8)], False),
    ("'A100:0.5'", [("A100", 0.5)], False),
    ("{A100: 8}", [("A100", 8)], False),
    ("{A100: 0.25}", [("A100", 0.25)], False),
    ("{A100: 8, H100: 8}", [("A100", 8), ("H100", 8)], False),
    ("{A100:8, H100:8}", [("A100", 8), ("H100", 8)], False),
    ("[A100:1]", [("A100", 1)], True),
    ("mi300:8", [("MI300X", 8)], False),
    ("[L4:1, A100:1]", [("L4", 1), ("A100", 1)], True),
    ("['H100', 'A100:2']", [("H100", 1), ("A100", 2)], True),
    ("tpu-v4-8", [("tpu-v4-8", 1)], False),
    ("MyCustomGPU:2", [("MyCustomGPU", 2)], False),
    ("{A100: null}", [("A100", 1)], False),
    ("'141GB:1'", [("H200", 1)], False),
    # the same accelerator with several counts: each count is its own candidate (SkyPilot)
    ("{A100:4, A100:8}", [("A100", 4), ("A100", 8)], False),
    ("{T4: 1, T4:4, V100: 1}", [("T4", 1), ("T4", 4), ("V100", 1)], False),
    ("{A100: 1, A100:1}", [("A100", 1)], False),
    ("[A100:1, A100:1, L4]", [("A100", 1), ("L4", 1)], True),
    ("[A100:8, A100:4]", [("A100", 8), ("A100", 4)], True),
]


@pytest.mark.parametrize(("value", "expected", "ordered"), ACCELERATOR_FORMS)
def test_accelerator_forms(value, expected, ordered):
    task = _load(f"resources:\n  accelerators: {value}\nrun: x\n")
    assert [(c.accelerator, c.accelerator_count) for c in task.candidates] == expected
    assert task.ordered is ordered


CLOUD_CANONICAL_FORMS = [
    # (infra, name, canonical name): SkyPilot canonicalises against the catalog names that
    # the candidate's cloud offers; none: the name as written (a cluster's label decides)
    (None, "MI300", "MI300X"),
    ("k8s", "MI300", "MI300"),
    ("kubernetes/my-ctx", "mi300", "mi300"),
    ("ssh/pool", "MI300", "MI300"),
    ("slurm", "MI300", "MI300"),
    ("aws", "MI300", "MI300"),
    ("k8s", "a100", "A100"),  # an exact (case-insensitive) match wins on any cloud
    ("slurm/alpha", "h100", "H100"),
    ("aws", "A100-80", "A100-80GB"),  # unique among AWS's names (RunPod adds -SXM)
    ("k8s", "MyCustomGPU", "MyCustomGPU"),
    ("k8s", "tpu-v5p-8", "tpu-v5p-8"),
]


@pytest.mark.parametrize(("infra", "name", "expected"), CLOUD_CANONICAL_FORMS)
def test_accelerator_names_are_canonical_for_the_candidates_cloud(infra, name, expected):
    where = f"  infra: {infra}\n" if infra else ""
    task = _load(f"resources:\n{where}  accelerators: {name}:2\nrun: x\n")
    assert [(c.accelerator, c.accelerator_count) for c in task.candidates] == [(expected, 2)]


def test_a_name_ambiguous_elsewhere_is_a_custom_name_on_a_cluster():
    from airflow_skypilot.spec.accelerators import same_accelerator

    task = _load("resources:\n  infra: k8s\n  accelerators: RTXA:1\n")
    assert task.candidates[0].accelerator == "RTXA"
    assert same_accelerator("RTXA", "RTXA") and not same_accelerator("RTXA", "NVIDIA-A100")
    assert same_accelerator("MI300", "AMD-Instinct-MI300X")


def test_accelerator_names_follow_each_any_of_entrys_cloud():
    task = _load("""
        resources:
          accelerators: MI300:8
          any_of:
            - infra: k8s
            - infra: runpod
            - cloud: kubernetes
        """)
    assert sorted((c.infra, c.accelerator) for c in task.candidates) == [
        ("kubernetes", "MI300"), ("runpod", "MI300X")]


def test_ambiguous_name_is_an_error_only_where_it_is_ambiguous():
    assert _errors("resources:\n  gpus: A100-80\n") == [
        "t.yaml:2: resources.gpus: accelerator name 'A100-80' is ambiguous; choose one of "
        "['A100-80GB', 'A100-80GB-SXM']"]
    assert _cands("resources:\n  cloud: aws\n  accelerators: A100-80\n")[0][
        "accelerator"] == "A100-80GB"
    # each merged candidate decides with its own cloud, the base's or the entry's
    task = _load("resources:\n  cloud: aws\n  any_of:\n    - accelerators: A100-80\n")
    assert [c.accelerator for c in task.candidates] == ["A100-80GB"]
    task = _load("resources:\n  accelerators: A100-80\n  any_of:\n    - infra: aws\n"
                 "    - cloud: gcp\n")
    assert sorted((c.infra, c.accelerator) for c in task.candidates) == [
        ("aws", "A100-80GB"), ("gcp", "A100-80GB")]
    assert _errors("resources:\n  any_of:\n    - infra: aws\n    - infra: runpod\n"
                   "      accelerators: A100-80\n") == [
        "t.yaml:5: resources.any_of[1].accelerators: accelerator name 'A100-80' is ambiguous; "
        "choose one of ['A100-80GB', 'A100-80GB-SXM']"]


def test_gpus_is_an_alias_of_accelerators():
    assert _cands("resources:\n  gpus: H100:4\n")[0]["accelerator"] == "H100"


def test_memory_form_expands_to_devices():
    names = {c["accelerator"] for c in _cands("resources:\n  accelerators: '80GB+:8'\n")}
    assert {"H100", "A100-80GB", "H200"} <= names and "A100" not in names


# --- cpus / memory / disk / ports / misc fields ----------------------------------------------

FIELD_FORMS = [
    ("cpus: 8", "cpus", "8"),
    ("cpus: '8+'", "cpus", "8+"),
    ("cpus: 0.5", "cpus", "0.5"),
    ("memory: 32", "memory", "32"),
    ("memory: 32+", "memory", "32+"),
    ("memory: 16GB", "memory", "16.0"),
    ("memory: 1TB+", "memory", "1024.0+"),
    ("memory: 3x", "memory", "3x"),
    ("memory: 512MB", "memory", "0.5"),
    ("disk_size: 256", "disk_size", 256),
    ("disk_size: 256GB", "disk_size", 256),
    ("disk_size: 1TB", "disk_size", 1024),
    ("disk_tier: HIGH", "disk_tier", "high"),
    ("ports: 8080", "ports", ["8080"]),
    ("ports: '10000-10010'", "ports", ["10000-10010"]),
    ("ports: [8080, '9000-9001']", "ports", ["8080", "9000-9001"]),
    ("ports: [8080, '8079-8081', '9000,9001']", "ports", ["8079-8081", "9000-9001"]),
    ("use_spot: true", "use_spot", True),
    ("instance_type: p4d.24xlarge", "instance_type", "p4d.24xlarge"),
    ("image_id: docker:nvcr.io/nvidia/pytorch:24.01-py3", "image_id",
     "docker:nvcr.io/nvidia/pytorch:24.01-py3"),
    ("image_id: {us-east-1: ami-1, us-west-2: ami-2}", "image_id",
     {"us-east-1": "ami-1", "us-west-2": "ami-2"}),
    ("labels: {team: ml}", "labels", {"team": "ml"}),
    ("infra: k8s", "infra", "kubernetes"),
    ("infra: K8S/my-ctx", "infra", "kubernetes/my-ctx"),
    ("infra: k8s/arn:aws:eks:us-east-1:1:cluster/x", "infra",
     "kubernetes/arn:aws:eks:us-east-1:1:cluster/x"),
    ("infra: slurm", "infra", "slurm"),
    ("infra: slurm/alpha/batch", "infra", "slurm/alpha/batch"),
    ("infra: AWS/us-east-1/us-east-1a", "infra", "aws/us-east-1/us-east-1a"),
    ("infra: '*/us-east-1'", "infra", "*/us-east-1"),
    ("cloud: aws", "infra", "aws"),
    ("{cloud: aws, region: us-west-2}", "infra", "aws/us-west-2"),
    ("{cloud: aws, region: us-west-2, zone: us-west-2a}", "infra", "aws/us-west-2/us-west-2a"),
    ("{cloud: kubernetes}", "infra", "kubernetes"),
]


@pytest.mark.parametrize(("snippet", "key", "expected"), FIELD_FORMS)
def test_resource_field_forms(snippet, key, expected):
    if snippet.startswith("{"):
        text = f"resources: {snippet}\n"
    else:
        text = f"resources:\n  {snippet}\n"
    assert _cands(text)[0][key] == expected


def test_fields_accepted_for_fidelity_load():
    task = _load("""
        resources:
          autostop: 10m
          network_tier: best
          max_hourly_cost: 12.5
          priority: 10
          accelerator_args: {tpu_vm: true}
          disk_tier: best
        """)
    assert task.candidates[0].max_hourly_cost == 12.5


@pytest.mark.parametrize("value", ["true", "5", "'1h'", "{idle_minutes: 10, down: true}"])
def test_autostop_forms(value):
    _load(f"resources:\n  autostop: {value}\n")


# --- job_recovery --------------------------------------------------------------------------

RECOVERY_FORMS = [
    ("FAILOVER", {"strategy": "FAILOVER", "max_restarts_on_errors": 0,
                  "recover_on_exit_codes": []}),
    ("eager_next_region", {"strategy": "EAGER_NEXT_REGION", "max_restarts_on_errors": 0,
                           "recover_on_exit_codes": []}),
    ("none", {"strategy": None, "max_restarts_on_errors": 0, "recover_on_exit_codes": []}),
    ("{max_restarts_on_errors: 3}", {"strategy": None, "max_restarts_on_errors": 3,
                                     "recover_on_exit_codes": []}),
    ("{strategy: FAILOVER, recover_on_exit_codes: 33}",
     {"strategy": "FAILOVER", "max_restarts_on_errors": 0, "recover_on_exit_codes": [33]}),
    ("{recover_on_exit_codes: [29, 33], max_restarts_on_errors: 1}",
     {"strategy": None, "max_restarts_on_errors": 1, "recover_on_exit_codes": [29, 33]}),
]


@pytest.mark.parametrize(("value", "expected"), RECOVERY_FORMS)
def test_job_recovery_forms(value, expected):
    task = _load(f"resources:\n  job_recovery: {value}\n")
    assert dict(task.job_recovery) == expected


# --- any_of / ordered ------------------------------------------------------------------------


def test_any_of_overrides_base_fields_and_merges_labels():
    task = _load("""
        resources:
          cpus: 4+
          labels: {team: ml}
          any_of:
            - infra: slurm
              accelerators: A100:4
            - infra: aws
              accelerators: H100:8
              use_spot: true
              labels: {spot: "yes"}
        """)
    assert task.ordered is False
    a, b = task.candidates
    assert (a.infra, a.accelerator, a.accelerator_count, a.cpus) == ("slurm", "A100", 4, "4+")
    assert (b.infra, b.accelerator, b.use_spot) == ("aws", "H100", True)
    assert dict(b.labels) == {"team": "ml", "spot": "yes"}


def test_ordered_keeps_order():
    task = _load("""
        resources:
          ordered:
            - accelerators: H100:1
            - accelerators: A100:1
              infra: k8s
        """)
    assert task.ordered is True
    assert [c.accelerator for c in task.candidates] == ["H100", "A100"]
    assert [c.index for c in task.candidates] == [0, 1]


def test_any_of_with_an_accelerator_set_in_base_multiplies():
    task = _load("""
        resources:
          accelerators: {A100: 1, H100: 1}
          any_of:
            - infra: slurm
            - infra: k8s
        """)
    assert {(c.infra, c.accelerator) for c in task.candidates} == {
        ("slurm", "A100"), ("slurm", "H100"), ("kubernetes", "A100"), ("kubernetes", "H100")}


def test_duplicate_candidates_collapse():
    task = _load("resources:\n  any_of:\n    - cpus: 2\n    - cpus: 2\n")
    assert len(task.candidates) == 1


# --- top-level fields -------------------------------------------------------------------------


def test_full_task_loads():
    task = _load("""
        name: llm-train
        num_nodes: 2
        resources:
          accelerators: A100:8
        envs:
          MODEL: llama
          EPOCHS: 3
          DEBUG: false
        secrets:
          HF_TOKEN: null
        file_mounts:
          /data: s3://bucket/data
          /ckpt:
            name: my-ckpt
            mode: MOUNT
        volumes:
          /mnt/vol: my-pvc
        setup: pip install -r requirements.txt
        run: torchrun train.py
        config:
          kubernetes:
            pod_config: {}
        """, secrets={"HF_TOKEN": "hf_abc"})
    assert task.num_nodes == 2
    assert task.envs == {"MODEL": "llama", "EPOCHS": "3", "DEBUG": "False"}
    assert task.secrets == {"HF_TOKEN": "hf_abc"}
    assert "hf_abc" not in repr(task.secrets) and "hf_abc" not in str(task.to_json())
    assert task.file_mounts["/ckpt"]["name"] == "my-ckpt"
    assert task.config["kubernetes"] == {"pod_config": {}}


def test_local_workdir_and_mounts_are_relative_to_the_yaml(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "data.txt").write_text("x")
    path = tmp_path / "task.yaml"
    path.write_text("workdir: src\nfile_mounts:\n  /data.txt: ./data.txt\nrun: x\n")
    task = load_task(str(path))
    assert task.resolved_workdir() == str(tmp_path / "src")


def test_missing_local_paths_say_they_are_the_only_problem(tmp_path, capsys):
    from airflow_skypilot import cli

    path = tmp_path / "task.yaml"
    path.write_text("workdir: src\nfile_mounts:\n  /d.txt: ./d.txt\n  /b: s3://b\nrun: x\n")
    expected = [
        f"{path}:1: workdir: 'src' is not a directory (relative paths start at {tmp_path})",
        f"{path}:3: file_mounts./d.txt: source './d.txt' does not exist (relative paths start "
        f"at {tmp_path})",
        f"{path}: nothing else is wrong with the task: only the local paths above are missing "
        f"(relative paths start at {tmp_path}, the YAML file's folder)"]
    with pytest.raises(TaskValidationError) as info:
        load_task(str(path))
    assert [str(p) for p in info.value.problems] == expected
    assert cli.main(["validate", str(path)]) == 2
    assert capsys.readouterr().err.splitlines() == expected
    # with another problem, no such note
    path.write_text("workdir: src\nenvs:\n  A: null\nrun: x\n")
    with pytest.raises(TaskValidationError) as info:
        load_task(str(path))
    assert [p.path for p in info.value.problems] == ["workdir", "envs.A"]


def test_workdir_git_form():
    task = _load("workdir:\n  url: https://github.com/x/y\n  ref: main\n")
    assert task.workdir == {"url": "https://github.com/x/y", "ref": "main"}


def test_env_overrides_replace_and_add():
    task = _load("envs:\n  A: '1'\n  B: null\n", envs={"B": "2", "C": 3})
    assert task.envs == {"A": "1", "B": "2", "C": "3"}


def test_envs_fill_file_mounts_and_workdir(tmp_path):
    task = _load("workdir: ${SRC}\nfile_mounts:\n  /data/${NAME}: s3://b/x\nenvs:\n  NAME: d1\n",
                 envs={"SRC": str(tmp_path)})
    assert task.workdir == str(tmp_path)
    assert "/data/d1" in task.file_mounts


def test_local_paths_from_envs_are_checked_once_the_envs_are_filled_in(tmp_path):
    (tmp_path / "d.txt").write_text("x")
    text = "envs:\n  CODE: /no/such/code\n  DATA: /no/such/data\nworkdir: $CODE\n" \
           "file_mounts:\n  /d: ${DATA}/d.txt\n"
    assert _errors(text)[:2] == [
        "t.yaml:4: workdir: '$CODE' (once envs are filled in: '/no/such/code') is not a "
        f"directory (relative paths start at {os.getcwd()})",
        "t.yaml:6: file_mounts./d: source '${DATA}/d.txt' (once envs are filled in: "
        f"'/no/such/data/d.txt') does not exist (relative paths start at {os.getcwd()})"]
    task = _load(text, envs={"CODE": str(tmp_path), "DATA": str(tmp_path)})
    assert task.workdir == str(tmp_path) and task.file_mounts["/d"] == f"{tmp_path}/d.txt"
    # an env without a value is the one problem, not the path made of it
    assert _errors("envs:\n  CODE: null\nworkdir: $CODE\n") == [
        "t.yaml:2: envs.CODE: has no value: supply it as an override (--env CODE=VALUE, or "
        "the operator's envs={'CODE': ...})"]
    # a name that is no env stays as written, and SkyPilot checks that path as written
    assert "workdir: '$NOT_AN_ENV' is not a directory" in _errors("workdir: $NOT_AN_ENV\n")[0]


def test_a_secret_filled_into_a_path_or_a_storage_is_never_in_a_message():
    secrets = {"TOKEN": "s3cr3t'v"}
    errors = _errors("file_mounts:\n  /d: /no/such/$TOKEN\n  /s:\n    name: b\n"
                     "    store: ${TOKEN}\nworkdir: /nope/${TOKEN}\n", secrets=secrets)
    assert len(errors) == 3, errors
    assert not any("s3cr3t" in e for e in errors), errors
    assert errors[0].startswith("t.yaml:2: file_mounts./d: source '/no/such/$TOKEN' (once envs "
                                "are filled in: \"/no/such/***\") does not exist"), errors
    assert errors[1].startswith("t.yaml:3: file_mounts./s: unknown store \"***\""), errors
    assert errors[2].startswith("t.yaml:6: workdir: '/nope/${TOKEN}' (once envs are filled "
                                "in: \"/nope/***\") is not a directory"), errors
    # the secrets field's own errors do not quote what may be a secret's value either
    for text in ("secrets: hunter2\n", "secrets: [hunter2]\n"):
        assert not any("hunter2" in e for e in _errors(text))


def test_env_and_secret_values_are_kept_as_skypilot_str_s_them():
    task = _load("envs:\n  A: [1]\n  B: {x: 1}\n  C: 1.0\n  D: true\n  E: 8\n"
                 "secrets:\n  S: [1, 2]\n  T: 3\n")
    assert task.envs == {"A": "[1]", "B": "{'x': 1}", "C": "1.0", "D": "True", "E": "8"}
    assert dict(task.secrets) == {"S": "[1, 2]", "T": "3"}


def test_one_line_of_yaml_ending_in_yaml_is_a_task_not_a_file_name():
    task = load_task("run: python train.py --config configs/exp.yaml")
    assert task.run == "python train.py --config configs/exp.yaml" and task.source == "<inline>"
    assert load_task("{run: a.yml}").run == "a.yml"
    # a path is still a path, and a missing one says so
    with pytest.raises(TaskValidationError, match="no/such.yaml: cannot read task file"):
        load_task("no/such.yaml")


STORE_YAML = """
    envs:
      STORE: {store}
      BUCKET: my-bucket
    file_mounts:
      /data:
        name: ${{BUCKET}}-data
        store: $STORE
        mode: MOUNT
    run: x
    """


@pytest.mark.parametrize("store", ["s3", "GCS", "r2", "hf", "vastdata", "volume"])
def test_storage_store_from_an_env_is_checked_with_its_value(store):
    task = _load(STORE_YAML.format(store=store))
    assert task.file_mounts["/data"] == {"name": "my-bucket-data", "store": store,
                                         "mode": "MOUNT"}


def test_storage_store_from_an_override():
    task = _load(STORE_YAML.format(store="null"), envs={"STORE": "s3"})
    assert task.file_mounts["/data"]["store"] == "s3"


def test_storage_store_from_an_env_with_a_wrong_value():
    assert _errors(STORE_YAML.format(store="nfs")) == [
        "t.yaml:5: file_mounts./data: unknown store 'nfs'; expected one of S3, GCS, AZURE, R2, "
        "IBM, OCI, NEBIUS, COREWEAVE, VASTDATA, HF, VOLUME (once envs are filled in; the YAML "
        "says {'name': '${BUCKET}-data', 'store': '$STORE', 'mode': 'MOUNT'})"]


def test_storage_store_from_a_missing_env_names_only_the_env():
    assert _errors(STORE_YAML.format(store="null")) == [
        "t.yaml:2: envs.STORE: has no value: supply it as an override (--env STORE=VALUE, or "
        "the operator's envs={'STORE': ...})"]


def test_storage_store_from_an_unknown_name_stays_as_written():
    assert "unknown store '$NOPE'" in _errors(
        "file_mounts:\n  /d:\n    name: b\n    store: $NOPE\n")[0]


def test_env_references_are_filled_as_skypilot_fills_them():
    task = _load("envs:\n  A: x\nfile_mounts:\n  /a/$A/${A}: s3://b/${A}_$A\n"
                 "  /b: s3://b/$$A/$UNSET/${A\n")
    assert task.file_mounts == {"/a/x/x": "s3://b/x_x", "/b": "s3://b/$x/$UNSET/x"}


def test_secret_references_need_overrides():
    assert _load("secrets: ['secrets:HF_TOKEN']\n").missing_secrets == ["HF_TOKEN"]
    assert _errors("secrets: ['secrets:HF_TOKEN']\n", require_secrets=True) == [
        "t.yaml:1: secrets.HF_TOKEN: has no value: supply it as an override "
        "(--secret HF_TOKEN=VALUE, or the operator's secrets={'HF_TOKEN': ...})"]
    task = _load("secrets: ['secrets:HF_TOKEN']\n", secrets={"HF_TOKEN": "x"})
    assert task.secrets == {"HF_TOKEN": "x"}
    task = _load("secrets:\n  secrets:workspace.TOKEN: null\n", secrets={"TOKEN": "y"})
    assert task.secrets == {"TOKEN": "y"}


def test_ignored_keys_warn_with_line():
    task = _load("run: x\nservice:\n  readiness_probe: /\n")
    assert [str(w) for w in task.warnings] == [
        "t.yaml:2: service: SkyServe services are not run by airflow-skypilot; "
        "'service' is checked as SkyPilot checks it, then ignored"]


# --- service / pool: checked as SkyPilot checks them, then ignored -------------------------

SERVICES_ACCEPTED = [
    "service: {}\n",
    "service:\n  readiness_probe: /health\n  replicas: 2\n",
    "service:\n  readiness_probe:\n    path: /v1/models\n    initial_delay_seconds: 1800\n"
    "    post_data: {model: m, max_tokens: 1}\n    headers: {Authorization: Bearer x}\n"
    "  replicas: 1\n  ports: 8080\n",
    "service:\n  readiness_probe: {path: /, post_data: '{\"a\": 1}'}\n",
    "service:\n  replica_policy: {min_replicas: 1, max_replicas: 3, "
    "target_qps_per_replica: 2.5}\n",
    "service:\n  replica_policy: {min_replicas: 2}\n",
    "service:\n  replica_policy: {min_replicas: 2, max_replicas: 2, num_overprovision: 1, "
    "dynamic_ondemand_fallback: true, spot_placer: DYNAMIC_FALLBACK}\n",
    "service:\n  load_balancing_policy: round_robin\n  load_balancer: "
    "{stream_timeout_seconds: 60}\n",
    "service:\n  load_balancing_policy: instance_aware_least_load\n  replica_policy:\n"
    "    min_replicas: 1\n    max_replicas: 4\n    target_qps_per_replica: {H100: 10, "
    "'A100:1': 5}\n",
    "service:\n  tls: {keyfile: k.pem, certfile: c.pem}\n",
    "service:\n  replicas: null\n",
    "service:\n  pool: {workers: 2}\n",
    "pool: {workers: 2}\n",
    "pool: {min_workers: 1, max_workers: 3, queue_length_threshold: 2, "
    "upscale_delay_seconds: 30}\n",
]


@pytest.mark.parametrize("text", SERVICES_ACCEPTED)
def test_service_and_pool_forms_load_and_are_ignored(text):
    task = _load(text + "run: x\n")
    assert any("then ignored" in str(w) for w in task.warnings)


SERVICES_REFUSED = [
    ("service:\n  replica: 2\n", "t.yaml:2: service.replica: unknown field 'replica'; did you "
                                  "mean 'replicas'?"),
    ("service:\n  replica_policy:\n    min_replicas: 0\n    max_replicas: 2\n",
     "t.yaml:2: service.replica_policy: min_replicas (0) and max_replicas (2) differ but "
     "target_qps_per_replica is not set"),
    ("service:\n  replicas: 1\n  replica_policy: {min_replicas: 1}\n",
     "give either 'replicas' or 'replica_policy', not both"),
    ("service:\n  replica_policy: {max_replicas: 1}\n", "'min_replicas' is required"),
    ("service:\n  replica_policy: {min_replicas: -1}\n",
     "t.yaml:2: service.replica_policy.min_replicas: must be >= 0; got -1"),
    ("service:\n  replica_policy: {min_replicas: 3, max_replicas: 1, "
     "target_qps_per_replica: 1}\n", "max_replicas (1) must be >= min_replicas (3)"),
    ("service:\n  replica_policy: {min_replicas: 1, target_qps_per_replica: 1}\n",
     "max_replicas must be set where target_qps_per_replica is"),
    ("service:\n  replicas: two\n", "t.yaml:2: service.replicas: must be a whole number"),
    ("service:\n  readiness_probe: health\n", "the readiness path must start with '/'"),
    ("service:\n  readiness_probe: {initial_delay_seconds: 5}\n", "'path' is required"),
    ("service:\n  readiness_probe: {path: /, post_data: '{bad'}\n",
     "service.readiness_probe.post_data: is not valid JSON text"),
    ("service:\n  ports: 70000\n", "service.ports: must be between 1 and 65535"),
    ("service:\n  load_balancing_policy: fastest\n", "must be one of round_robin"),
    ("service:\n  load_balancing_policy: LEAST_LOAD\n", "unknown load balancing policy "
                                                          "'LEAST_LOAD' (names are lower case)"),
    ("service:\n  replica_policy: {min_replicas: 1, max_replicas: 2, "
     "target_qps_per_replica: {H100: 1}}\n", "needs 'instance_aware_least_load'"),
    ("service:\n  load_balancing_policy: instance_aware_least_load\n",
     "needs a target_qps_per_replica per accelerator"),
    ("service:\n  replica_policy: {min_replicas: 1, max_replicas: 2, "
     "target_qps_per_replica: {h100: 1}}\n", "keys must be accelerators like 'H100'"),
    ("service:\n  tls: {keyfile: k.pem}\n", "'certfile' is required"),
    ("service:\n  replicas: 1\n  workers: 1\n", "give either 'replicas' or 'workers'"),
    ("service:\n  pool: {workers: 1}\n  replicas: 1\n", "a pool takes 'workers', not "
                                                         "'replicas'"),
    ("service:\n  pool: {workers: 1}\n  ports: 8080\n", "ports is not supported for a pool"),
    ("pool: {}\n", "t.yaml:1: pool: set 'workers', or both 'min_workers' and 'max_workers'"),
    ("pool: {min_workers: 1}\n", "'max_workers' must be set with 'min_workers'"),
    ("pool: {min_workers: 3, max_workers: 1}\n", "min_workers (3) must be <= max_workers (1)"),
    ("pool: {workers: 1, queue_length_threshold: 2}\n",
     "'max_workers' must be set with 'queue_length_threshold'"),
    ("pool: {workers: -1}\n", "t.yaml:1: pool.workers: must be >= 0; got -1"),
    ("pool: {wrkers: 1}\n", "pool.wrkers: unknown field 'wrkers'; did you mean 'workers'?"),
    ("service: {}\npool: {}\n", "cannot set both 'service' and 'pool'"),
]


@pytest.mark.parametrize(("text", "expected"), SERVICES_REFUSED)
def test_service_and_pool_are_refused_where_skypilot_refuses_them(text, expected):
    errors = _errors(text + "run: x\n")
    assert any(e.startswith(expected) or expected in e for e in errors), errors


def test_service_gets_envs_filled_in_before_it_is_checked():
    text = "envs:\n  PROBE: /health\nservice:\n  readiness_probe: $PROBE\nrun: x\n"
    _load(text)
    assert "must start with '/'" in _errors(text, envs={"PROBE": "health"})[0]
    # an env with no value is the problem, not the service that uses it
    assert _errors("envs:\n  P: null\nservice:\n  readiness_probe: $P\n") == [
        "t.yaml:2: envs.P: has no value: supply it as an override (--env P=VALUE, or the "
        "operator's envs={'P': ...})"]


def test_a_task_without_resources_is_a_cpu_task():
    task = _load("run: echo hi\n")
    assert task.num_nodes == 1 and task.candidates[0].accelerator is None


def test_reads_a_file_and_reports_its_path(tmp_path):
    path = tmp_path / "task.yaml"
    path.write_text("name: x\nresources:\n  cpus: lots\n")
    with pytest.raises(TaskValidationError) as info:
        load_task(str(path))
    assert str(info.value) == (
        f"{path}:3: resources.cpus: must be a number (e.g. 8) or \"<number>+\" for at least; "
        "got 'lots'")


def test_dict_input():
    task = load_task({"resources": {"accelerators": "H100:1"}, "run": "x"})
    assert task.candidates[0].accelerator == "H100"


# --- errors: every one names file:line: field ---------------------------------------------

ERRORS = [
    ("resurces:\n  cpus: 2\n", "t.yaml:1: resurces: unknown field 'resurces'; did you mean "
                               "'resources'?"),
    ("resources:\n  acelerators: A100\n", "t.yaml:2: resources.acelerators: unknown field "
                                          "'acelerators'; did you mean 'accelerators'?"),
    ("resources:\n  any_of:\n    - cpu: 2\n", "t.yaml:3: resources.any_of[0].cpu: unknown "
                                              "field 'cpu'; did you mean 'cpus'?"),
    ("num_nodes: 0\n", "t.yaml:1: num_nodes: must be a positive whole number; got 0"),
    ("num_nodes: -1\n", "t.yaml:1: num_nodes: must be a positive whole number; got -1"),
    ("num_nodes: '2'\n", "t.yaml:1: num_nodes: input should be a valid integer; got '2'"),
    ("name: 3\n", "t.yaml:1: name: input should be a valid string; got 3"),
    ("run: [a]\n", "t.yaml:1: run: input should be a valid string; got ['a']"),
    ("resources:\n  cpus: -1\n", "t.yaml:2: resources.cpus: must be positive; got -1"),
    ("resources:\n  memory: x\n", "t.yaml:2: resources.memory: must be a number of GB"),
    ("resources:\n  memory: 0\n", "t.yaml:1: resources: memory must be positive (0 is allowed "
                                   "only on Slurm"),
    ("resources:\n  accelerators: A100:0\n", "t.yaml:2: resources.accelerators: count of "
                                             "'A100' must be a positive number; got 0.0"),
    ("resources:\n  accelerators: A100:x\n", "t.yaml:2: resources.accelerators: 'A100:x' "
                                             "should be <name> or <name>:<count>"),
    ("resources:\n  accelerators: {A100: -2}\n", "count of 'A100' must be a positive number"),
    ("resources:\n  accelerators: 5\n", "resources.accelerators: must be 'NAME'"),
    ("resources:\n  use_spot: yes please\n", "t.yaml:2: resources.use_spot: input should be a "
                                             "valid boolean"),
    ("resources:\n  disk_size: lots\n", "t.yaml:2: resources.disk_size: must be a whole number"),
    ("resources:\n  disk_tier: fastest\n", "t.yaml:2: resources.disk_tier: unknown disk tier"),
    ("resources:\n  ports: 70000\n", "resources.ports: a port must be between 1 and 65535"),
    ("resources:\n  ports: '9-1'\n", "t.yaml:2: resources.ports: port range '9-1' ends before"),
    ("resources:\n  infra: mars/x\n", "t.yaml:2: resources.infra: unknown cloud 'mars'"),
    ("resources:\n  infra: aws//x\n", "t.yaml:2: resources.infra: 'aws//x' has an empty part"),
    ("resources:\n  infra: aws/a/b/c\n", "resources.infra: 'aws/a/b/c' has too many parts"),
    ("resources:\n  cloud: mars\n", "t.yaml:2: resources.cloud: unknown cloud 'mars'"),
    ("resources:\n  infra: aws\n  cloud: aws\n", "t.yaml:1: resources: give either 'infra' or "
                                                 "the older 'cloud'/'region'/'zone', not both"),
    ("resources:\n  job_recovery: RESTART\n", "t.yaml:2: resources.job_recovery: unknown "
                                              "recovery strategy 'RESTART'; expected one of "
                                              "EAGER_NEXT_REGION, FAILOVER"),
    ("resources:\n  job_recovery: {max_restarts_on_errors: -1}\n",
     "max_restarts_on_errors must be a whole number >= 0"),
    ("resources:\n  job_recovery: {recover_on_exit_codes: [300]}\n",
     "recover_on_exit_codes must be an exit code 0-255"),
    ("resources:\n  job_recovery: {stratgy: FAILOVER}\n", "unknown key 'stratgy'"),
    ("resources:\n  any_of: [{cpus: 1}]\n  ordered: [{cpus: 2}]\n",
     "t.yaml:1: resources: give either 'any_of' or 'ordered', not both"),
    ("resources:\n  accelerators: {A100: 1, H100: 1}\n  ordered: [{cpus: 2}]\n",
     "cannot give several 'accelerators' together with 'ordered'"),
    ("resources:\n  accelerators: [A100, H100]\n  any_of: [{cpus: 2}]\n",
     "cannot give an ordered list of 'accelerators' with 'any_of'"),
    ("resources:\n  any_of:\n    - accelerators: {A100: 1, H100: 1}\n",
     "t.yaml:3: resources.any_of[0].accelerators: inside any_of/ordered, name one accelerator"),
    ("resources:\n  gpus: A100\n  accelerators: A100\n", "cannot give both 'gpus' and "
                                                         "'accelerators'"),
    ("envs:\n  1BAD: x\n", "t.yaml:2: envs.1BAD: '1BAD' is not a valid environment variable "
                           "name"),
    ("envs: [A]\n", "t.yaml:1: envs: input should be a valid dictionary"),
    ("envs:\n  A: null\n", "t.yaml:2: envs.A: has no value: supply it as an override (--env "
                           "A=VALUE"),
    ("secrets: [T]\n", "t.yaml:1: secrets[0]: list items must be references like "
                        "'secrets:HF_TOKEN'; got a str that is not one"),
    ("secrets:\n  secrets:T: x\n", "a secret reference must have a null value"),
    ("secrets:\n  my-token: x\n", "secret 'my-token' is not a valid environment variable"),
    ("", "t.yaml: the task is empty: add at least a 'run:' (or 'setup:') field"),
    ("# only a comment\n", "the task is empty"),
    ("name: a\nname: b\n", "t.yaml:2: name: duplicate key (also at line 1); remove one"),
    ("name: 'my task!'\n", "t.yaml:1: name: invalid task name 'my task!'"),
    ("resources:\n  accelerators: '{A100:8, H100:8}'\n", "should be <name> or <name>:<count>"),
    ("resources:\n  accelerators: RTXA\n", "accelerator name 'RTXA' is ambiguous"),
    ("resources:\n  accelerators: tpu-v4-8\n  infra: aws\n", "TPU accelerators (tpu-v4-8) "
                                                             "need GCP or Kubernetes"),
    ("resources:\n  job_recovery: NONE\n", "unknown recovery strategy 'NONE'"),
    ("resources:\n  cloud: k8s\n", "resources.cloud: unknown cloud 'k8s'"),
    ("resources:\n  infra: aws/\n", "'aws/' has an empty part"),
    ("resources:\n  autostop: -5\n", "resources.autostop: must be >= 0 minutes"),
    ("resources:\n  autostop: 30s\n", "must be minutes or a duration like '10m'"),
    ("resources:\n  hooks: []\n", "lifecycle hooks live under the top-level 'config.hooks'"),
    ("workdir: ./no-such-dir\n", "t.yaml:1: workdir: './no-such-dir' is not a directory"),
    ("file_mounts:\n  /data: ./nope.txt\n", "t.yaml:2: file_mounts./data: source './nope.txt'"
                                             " does not exist"),
    ("file_mounts:\n  /data/: s3://b\n", "mount path '/data/' must not end with a slash"),
    # SkyPilot's launch refuses a source ending in '/' too, a bucket's or '/' included
    ("file_mounts:\n  /d: s3://b/\n", "t.yaml:2: file_mounts./d: source 's3://b/' must not "
                                        "end with a slash"),
    ("file_mounts:\n  /d: /\n", "t.yaml:2: file_mounts./d: source '/' must not end with a "
                                  "slash"),
    ("file_mounts:\n  /d: $DIR\nenvs:\n  DIR: /tmp/\n", "t.yaml:2: file_mounts./d: source "
     "'$DIR' (once envs are filled in: '/tmp/') must not end with a slash"),
    ("resources:\n  memory: '0x'\n", "t.yaml:1: resources: memory must be positive"),
    ("resources:\n  cpus: 4\n  any_of:\n    - cpus: null\n", "t.yaml:4: "
     "resources.any_of[0].cpus: must not be null in an 'any_of'/'ordered' entry"),
    ("resources:\n  ordered:\n    - infra: null\n", "t.yaml:3: resources.ordered[0].infra: "
     "must not be null"),
    ("file_mounts:\n  /d:\n    mode: SYNC\n", "t.yaml:2: file_mounts./d: unknown mode 'SYNC'; "
                                             "expected one of MOUNT, COPY, MOUNT_CACHED"),
    ("file_mounts:\n  /d:\n    store: nfs\n", "t.yaml:2: file_mounts./d: unknown store 'nfs'"),
    ("file_mounts:\n  /d:\n    sorce: x\n", "t.yaml:2: file_mounts./d: unknown storage key"),
    ("file_mounts:\n  /d:\n    persistent: maybe\n", "persistent must be true or false"),
    ("config:\n  jobs: {}\n", "config section 'jobs' cannot be set by a task"),
    ("config:\n  kubernetes:\n    provision_timeout: soon\n",
     "t.yaml:3: config.kubernetes.provision_timeout: must be a whole number; got 'soon'"),
    ("service: {replicas: 1}\npool: {workers: 1}\n", "cannot set both 'service' and 'pool'"),
    ("workdir: 3\n", "t.yaml:1: workdir: must be a local directory or a mapping {url, ref}"),
    ("file_mounts:\n  /x: 3\n", "t.yaml:2: file_mounts./x: source must be a path/URL"),
    ("- a\n- b\n", "t.yaml:1: a task must be a mapping of fields"),
    ("name: a\n---\nname: b\n", "t.yaml:3: multi-document YAML (a SkyPilot pipeline) is not "
                                "supported"),
    ("name: [a\n", "t.yaml:2:1: YAML syntax error:"),
    ("resources:\n  cpus: 1\n   memory: 2\n", "t.yaml:3:"),
    ("config:\n  kubernetes:\n    enable_docker: build\n",
     "t.yaml:3: config.kubernetes.enable_docker: must be true, false, ALL, BUILD or {mode: "
     "ALL|BUILD, "
     "cache_volume: NAME}; got 'build'"),
    ("config:\n  kubernetes:\n    enable_docker: {cache_volume: v}\n",
     "t.yaml:3: config.kubernetes.enable_docker: mode must be ALL or BUILD; got None"),
    ("config:\n  kubernetes:\n    enable_docker: {mode: ALL, size: 1}\n",
     "t.yaml:3: config.kubernetes.enable_docker: unknown key 'size'"),
    ("config:\n  kubernetes:\n    enable_docker: {mode: ALL, cache_volume: 3}\n",
     "cache_volume must be a volume name; got 3"),
]


@pytest.mark.parametrize(("text", "expected"), ERRORS)
def test_errors_name_file_line_and_field(text, expected):
    errors = _errors(text)
    assert any(e.startswith(expected) or expected in e for e in errors), errors


def test_every_problem_is_reported_at_once():
    errors = _errors("""
        nme: x
        resources:
          cpus: none
          accelerators: A100:0
        envs:
          A: null
        """)
    assert [e.split(":")[1] for e in errors] == ["1", "3", "4", "6"]


@pytest.mark.parametrize("value", ["true", "false", "ALL", "BUILD", "{mode: BUILD}",
                                   "{mode: ALL, cache_volume: docker-cache}"])
def test_kubernetes_enable_docker_forms(value):
    task = _load(f"config:\n  kubernetes:\n    enable_docker: {value}\nrun: x\n")
    assert "enable_docker" in task.config["kubernetes"]


def test_fractional_accelerators_on_several_nodes():
    task = _load("num_nodes: 2\nresources:\n  accelerators: T4:0.5\nrun: x\n")
    assert (task.num_nodes, task.candidates[0].accelerator_count) == (2, 0.5)


def test_override_supplies_a_null_env():
    assert _load("envs:\n  A: null\n", envs={"A": "v"}).envs == {"A": "v"}


def test_secret_wins_over_env_of_the_same_name():
    task = _load("envs:\n  T: plain\nsecrets:\n  T: hidden\n")
    assert task.envs == {"T": "plain"} and task.secrets == {"T": "hidden"}


def test_invalid_env_override_name():
    assert "override '1X' is not a valid environment variable name" in "\n".join(
        _errors("run: x\n", envs={"1X": "a"}))


# --- a bad entry of a mapping or list names its own line and key, not the section's ---------

ENTRY_ERRORS = [
    ("envs:\n  OK: 1\n  A: 2\n  'BAD-NAME': 2\n",
     "t.yaml:5: envs.BAD-NAME: 'BAD-NAME' is not a valid environment variable name"),
    ("secrets:\n  OK: 1\n  A: 2\n  my-token: x\n",
     "t.yaml:5: secrets.my-token: secret 'my-token' is not a valid environment variable name"),
    ("secrets:\n  OK: 1\n  A: 2\n  secrets:T: x\n",
     "t.yaml:5: secrets.secrets:T: 'secrets:T': a secret reference must have a null value"),
    ("secrets:\n  - secrets:A\n  - secrets:B\n  - T\n",
     "t.yaml:5: secrets[2]: list items must be references"),
    ("file_mounts:\n  /ok: s3://a\n  /ok2: s3://c\n  /bad/: s3://b\n",
     "t.yaml:5: file_mounts./bad/: mount path '/bad/' must not end with a slash"),
    ("file_mounts:\n  /ok: s3://a\n  /ok2: s3://c\n  /bad: 3\n",
     "t.yaml:5: file_mounts./bad: source must be a path/URL or a storage mapping; got 3"),
    ("file_mounts:\n  /ok: s3://a\n  /ok2: s3://c\n  /bad: s3://b/\n",
     "t.yaml:5: file_mounts./bad: source 's3://b/' must not end with a slash"),
    ("config:\n  kubernetes:\n    provision_timeout: 10\n    pod_config: 3\n",
     "t.yaml:5: config.kubernetes.pod_config: must be a mapping; got 3"),
    ("config:\n  docker: {}\n  kubernetes:\n    provision_timeout: 10\n    podconfig: {}\n",
     "t.yaml:6: config.kubernetes.podconfig: 'podconfig' cannot be set by a task"),
    ("config:\n  docker: {}\n  nvidia_gpus: {}\n  jobs: {}\n",
     "t.yaml:5: config.jobs: config section 'jobs' cannot be set by a task"),
    ("config:\n  docker: {}\n  nvidia_gpus: {}\n  kubernetes: 3\n",
     "t.yaml:5: config.kubernetes: must be a mapping; got 3"),
    ("config:\n  kubernetes:\n    provision_timeout: 10\n    enable_docker: build\n",
     "t.yaml:5: config.kubernetes.enable_docker: must be true, false, ALL, BUILD"),
    ("resources:\n  cpus: 2\n  labels:\n    a: b\n    c: 1\n",
     "t.yaml:6: resources.labels.c: label 'c' must be a string; got 1"),
    ("resources:\n  cpus: 2\n  accelerators:\n    A100: 8\n    H100: -1\n",
     "t.yaml:6: resources.accelerators.H100: count of 'H100' must be a positive number"),
    ("resources:\n  cpus: 2\n  gpus:\n    A100: 8\n    H100: -1\n",
     "t.yaml:6: resources.gpus.H100: count of 'H100' must be a positive number"),
    ("resources:\n  cpus: 2\n  accelerators:\n    - A100:8\n    - H100:x\n",
     "t.yaml:6: resources.accelerators[1]: 'H100:x' should be <name> or <name>:<count>"),
    ("resources:\n  cpus: 2\n  ports:\n    - 80\n    - 0\n",
     "t.yaml:6: resources.ports[1]: a port must be between 1 and 65535; got '0'"),
    ("resources:\n  cpus: 2\n  job_recovery:\n    strategy: FAILOVER\n"
     "    max_restarts_on_errors: -1\n",
     "t.yaml:6: resources.job_recovery.max_restarts_on_errors: max_restarts_on_errors must be"),
    ("resources:\n  cpus: 2\n  job_recovery:\n    strategy: FAILOVER\n    stratgy: x\n",
     "t.yaml:6: resources.job_recovery.stratgy: unknown key 'stratgy'"),
    ("resources:\n  cpus: 2\n  autostop:\n    idle_minutes: 5\n    down: maybe\n",
     "t.yaml:6: resources.autostop.down: down must be true or false"),
    ("resources:\n  cpus: 2\n  image_id:\n    us-east-1: ami-1\n    us-west-2: 3\n",
     "t.yaml:6: resources.image_id.us-west-2: image for 'us-west-2' must be a string"),
    ("resources:\n  cpus: 2\n  any_of:\n    - cpus: 4\n    - labels:\n        a: b\n        c: 1\n",
     "t.yaml:8: resources.any_of[1].labels.c: label 'c' must be a string"),
    ("resources:\n  cpus: 2\n  volumes:\n    - {path: /a}\n    - 3\n",
     "t.yaml:6: resources.volumes[1]: input should be a valid dictionary"),
    ("workdir:\n  url: https://x/y.git\n  ref: main\n  branch: y\n",
     "t.yaml:5: workdir.branch: unknown key 'branch'"),
]


@pytest.mark.parametrize(("text", "expected"), ENTRY_ERRORS)
def test_a_bad_entry_names_its_own_line_and_key(text, expected):
    """Pydantic's field validators see a whole mapping; the entry's key must reach the path."""
    errors = _errors("name: a\n" + text + "run: x\n")
    assert any(e.startswith(expected) for e in errors), errors


def test_every_bad_entry_of_a_mapping_is_reported_at_once():
    with pytest.raises(TaskValidationError) as info:
        _load("envs:\n  1A: x\n  OK: y\n  2B: z\nfile_mounts:\n  /a/: s3://a\n  /b: 3\nrun: x\n")
    assert [(p.line, p.path) for p in info.value.problems] == [
        (2, "envs.1A"), (4, "envs.2B"), (6, "file_mounts./a/"), (7, "file_mounts./b")]
