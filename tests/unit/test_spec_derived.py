"""What SkyPilot derives from a candidate's cloud, and that the backends use it.

* ``image_id`` on Kubernetes (and SSH node pools): a bare ``repo/img:tag`` is a container image,
  ``docker:repo/img:tag`` (sky/resources.py ``_maybe_add_docker_prefix_to_image_id``); the
  Kubernetes backend runs that image. A bare image on a candidate with no cloud stays bare, and
  Kubernetes does not take it (it would run in the connection's default image).
"""

from __future__ import annotations

import textwrap

import pytest

from airflow_skypilot.backends.base import Offer
from airflow_skypilot.backends.kubernetes import KubernetesBackend, KubernetesSettings
from airflow_skypilot.spec import load_task


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
