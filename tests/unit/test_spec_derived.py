"""What SkyPilot derives from a candidate's cloud, and that the backends use it.

* ``instance_type`` on AWS: the accelerators SkyPilot's catalog says the type carries
  (``Resources.accelerators``), from spec/instance_types.py, checked here against EC2's own
  ``DescribeInstanceTypes`` data (as shipped in moto) with SkyPilot's catalog rule; the AWS
  backend places the candidate on that very type.
* ``image_id`` on Kubernetes (and SSH node pools): a bare ``repo/img:tag`` is a container image,
  ``docker:repo/img:tag`` (sky/resources.py ``_maybe_add_docker_prefix_to_image_id``); the
  Kubernetes backend runs that image. A bare image on a candidate with no cloud stays bare, and
  Kubernetes does not take it (it would run in the connection's default image).
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import textwrap
from importlib.util import find_spec

import pytest

from airflow_skypilot.backends.aws.catalog import parse_instance_types, suitable_types
from airflow_skypilot.backends.base import Offer
from airflow_skypilot.backends.kubernetes import KubernetesBackend, KubernetesSettings
from airflow_skypilot.spec import load_task
from airflow_skypilot.spec.instance_types import AWS


def _load(text: str, **kw):
    return load_task(textwrap.dedent(text).lstrip("\n"), file="t.yaml", **kw)


def _k8s(**kw) -> KubernetesBackend:
    return KubernetesBackend("k8s_test", settings=KubernetesSettings(
        context="ctx", namespace="team-a", **kw))


def _k8s_image(task, req) -> str:
    offer = Offer(connection="k8s_test", backend="kubernetes", location="ctx/team-a",
                  infra="kubernetes/ctx", request=req, num_nodes=task.num_nodes)
    job = _k8s(image="busybox:1").job_manifest(task, offer, "sky-job-1",
                                               {"SKYPILOT_TASK_ID": "t"})
    return job["spec"]["template"]["spec"]["containers"][0]["image"]


# --- instance_type on AWS ------------------------------------------------------------------

INSTANCE_TYPE_FORMS = [
    # (resources, [(accelerator, count)] of the candidates)
    ("{infra: aws, instance_type: p4d.24xlarge}", [("A100", 8)]),
    ("{infra: aws/us-east-1, instance_type: p4de.24xlarge}", [("A100-80GB", 8)]),
    ("{cloud: aws, instance_type: p3.2xlarge}", [("V100", 1)]),
    ("{infra: aws, instance_type: g6f.large}", [("L4", 0.125)]),
    ("{infra: aws, instance_type: inf2.xlarge}", [("Inferentia2", 1)]),
    ("{infra: aws, instance_type: trn1.32xlarge}", [("Trainium", 16)]),
    ("{infra: aws, instance_type: m5.8xlarge}", [(None, 0)]),  # no accelerator
    ("{infra: aws, instance_type: x9.unknown}", [(None, 0)]),  # not listed: AWS decides
    # no cloud: SkyPilot's parser derives nothing (its launch infers the cloud first)
    ("{instance_type: p4d.24xlarge}", [(None, 0)]),
    ("{infra: k8s, instance_type: p4d.24xlarge}", [(None, 0)]),
    # what the YAML says wins
    ("{infra: aws, instance_type: p4d.24xlarge, accelerators: A100:1}", [("A100", 1)]),
    ("{infra: aws, any_of: [{instance_type: g6.8xlarge}, {instance_type: g5.16xlarge}, "
     "{instance_type: p5.48xlarge, use_spot: true}]}",
     [("A10G", 1), ("H100", 8), ("L4", 1)]),
]


@pytest.mark.parametrize(("resources", "expected"), INSTANCE_TYPE_FORMS)
def test_instance_type_carries_its_accelerators_on_aws(resources, expected):
    task = _load(f"resources: {resources}\nrun: x\n")
    got = sorted((c["accelerator"] or "", c["accelerator_count"])
                 for c in task.to_json()["candidates"])
    assert got == sorted((name or "", count) for name, count in expected)


def test_validate_json_shows_the_carried_accelerators(tmp_path, capsys):
    from airflow_skypilot import cli

    path = tmp_path / "t.yaml"
    path.write_text("resources:\n  infra: aws\n  instance_type: p4d.24xlarge\nnum_nodes: 2\n"
                    "run: x\n")
    assert cli.main(["validate", str(path), "--json"]) == 0
    (cand,) = json.loads(capsys.readouterr().out)["candidates"]
    assert (cand["accelerator"], cand["accelerator_count"], cand["instance_type"]) == (
        "A100", 8, "p4d.24xlarge")


def _moto_instance_types() -> dict[str, dict]:
    spec = find_spec("moto")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("moto (a test dependency in pyproject's [test] extra) is not installed")
    path = os.path.join(spec.submodule_search_locations[0], "ec2", "resources",
                        "instance_types.json.gz")
    with gzip.open(path) as fh:
        return json.load(fh)


def _skypilot_rule(name: str, row: dict) -> tuple[str, float] | None:
    """sky/catalog/data_fetchers/fetch_aws.py: AcceleratorName/Count of a type."""
    device = None
    for col, key in (("GpuInfo", "Gpus"), ("NeuronInfo", "NeuronDevices"), ("FpgaInfo", "Fpgas")):
        if isinstance(row.get(col), dict):
            device = row[col][key][0]
    if device is None:
        return None
    acc, count = device["Name"], device["Count"]
    if name == "p3dn.24xlarge":
        acc = "V100-32GB"
    elif name == "p4de.24xlarge":
        acc, count = "A100-80GB", 8
    elif name in ("p5e.48xlarge", "p5en.48xlarge"):
        acc, count = "H200", 8
    elif name.startswith(("g6f", "gr6f")):
        count = round(row["GpuInfo"]["Gpus"][0]["MemoryInfo"]["SizeInMiB"] / 22888, 3)
    elif name == "p5.4xlarge":
        count = 1
    elif name.startswith("g7e"):
        acc = "RTXPRO6000"
    return acc, count


def test_the_table_is_skypilots_catalog_rule_on_ec2s_data():
    ec2 = _moto_instance_types()
    derived = {n: r for n, row in ec2.items() if (r := _skypilot_rule(n, row))}
    assert {n: AWS[n] for n in derived} == derived  # every accelerated type EC2 lists
    # the rest are types SkyPilot's catalog still has and this EC2 snapshot no longer lists
    assert sorted(n.split(".")[0] for n in set(AWS) - set(derived)) == [
        "dl1", "g4ad", "g4ad", "g4ad", "g4ad", "g4ad", "p3", "p3", "p3"]


def test_the_aws_backend_places_a_candidate_on_its_own_type():
    ec2 = _moto_instance_types()
    catalog = parse_instance_types(ec2.values())
    for name, (acc, count) in AWS.items():
        if name not in catalog:
            continue
        task = _load(f"resources:\n  infra: aws\n  instance_type: {name}\nrun: x\n")
        (req,) = task.candidates
        assert (req.accelerator, req.accelerator_count) == (acc, count)
        types, why = suitable_types(catalog, req)
        assert ([t.name for t in types], why) == ([name], ""), name
    # an accelerator the YAML names is still checked against the type
    task = _load("resources:\n  infra: aws\n  instance_type: p4d.24xlarge\n"
                 "  accelerators: H100:8\nrun: x\n")
    assert suitable_types(catalog, task.candidates[0]) == (
        [], "p4d.24xlarge has 8 x A100, not H100")


def test_the_loader_derives_them_without_airflow_or_boto3():
    code = ("import sys; from airflow_skypilot.spec import load_task; "
            "t = load_task({'run': 'x', 'resources': {'infra': 'aws', "
            "'instance_type': 'p4d.24xlarge'}}); assert t.candidates[0].accelerator == 'A100'; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('airflow', 'boto3', 'botocore') or m.startswith('airflow_skypilot.backends')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"


def test_a_type_the_table_lacks_loads_without_accelerators():
    task = _load("resources:\n  infra: aws\n  instance_type: p2.xlarge\nrun: x\n")
    assert task.candidates[0].accelerator is None  # AWS says what it carries, at placement


# --- image_id on Kubernetes ------------------------------------------------------------------

IMAGE_FORMS = [
    # (resources, image_id of the candidate, the container image)
    ("{infra: k8s, image_id: nvcr.io/nvidia/pytorch:24.01-py3}",
     "docker:nvcr.io/nvidia/pytorch:24.01-py3", "nvcr.io/nvidia/pytorch:24.01-py3"),
    ("{infra: kubernetes/my-ctx, image_id: ' ghcr.io/me/x:1 '}", "docker:ghcr.io/me/x:1",
     "ghcr.io/me/x:1"),
    ("{cloud: kubernetes, image_id: ubuntu:22.04}", "docker:ubuntu:22.04", "ubuntu:22.04"),
    ("{infra: ssh/my-pool, image_id: ubuntu:22.04}", "docker:ubuntu:22.04", "ubuntu:22.04"),
    ("{infra: k8s, image_id: 'docker:ubuntu:22.04'}", "docker:ubuntu:22.04", "ubuntu:22.04"),
    ("{image_id: 'docker:ubuntu:22.04'}", "docker:ubuntu:22.04", "ubuntu:22.04"),
    ("{infra: slurm, image_id: ubuntu:22.04}", "ubuntu:22.04", None),
    ("{infra: aws, image_id: ami-0123456789abcdef0}", "ami-0123456789abcdef0", None),
    ("{image_id: ubuntu:22.04}", "ubuntu:22.04", None),
]


@pytest.mark.parametrize(("resources", "image_id", "container"), IMAGE_FORMS)
def test_bare_image_id_is_a_container_image_on_kubernetes(resources, image_id, container):
    task = _load(f"resources: {resources}\nrun: x\n")
    (req,) = task.candidates
    assert req.image_id == image_id
    assert task.to_json()["candidates"][0]["image_id"] == image_id
    assert req.container_image == container
    if container is not None:
        assert _k8s_image(task, req) == container


def test_any_of_decides_the_image_per_candidate():
    task = _load("""
        resources:
          image_id: rocm/pytorch:latest
          any_of:
            - infra: k8s
            - cloud: kubernetes
              accelerators: MI300:1
            - infra: slurm
        run: x
        """)
    got = sorted((c.infra, c.accelerator or "-", c.image_id) for c in task.candidates)
    assert got == [("kubernetes", "-", "docker:rocm/pytorch:latest"),
                   ("kubernetes", "MI300", "docker:rocm/pytorch:latest"),
                   ("slurm", "-", "rocm/pytorch:latest")]


def test_kubernetes_does_not_take_a_bare_image_without_a_cloud():
    task = _load("resources:\n  image_id: nvcr.io/nvidia/pytorch:24.01-py3\nrun: x\n")
    (req,) = task.candidates
    why = _k8s().unsupported(task, req)
    assert why.startswith("image_id nvcr.io/nvidia/pytorch:24.01-py3: not a container image: "
                          "write image_id: docker:<image>")
    ok = _load("resources:\n  infra: k8s\n  image_id: nvcr.io/nvidia/pytorch:24.01-py3\n"
               "run: x\n")
    assert _k8s().unsupported(ok, ok.candidates[0]) == ""
