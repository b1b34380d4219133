"""The task's labels and annotations on the Kubernetes objects, and its provision timeout.

SkyPilot puts ``resources.labels`` on the pods ("Custom tags for the pods", its
kubernetes-ray template) and ``config.kubernetes.custom_metadata`` labels and annotations on
every object it creates; ``config.kubernetes.provision_timeout`` is how long it waits for the
pods to be scheduled before failing over. Built as tests/unit/test_kubernetes_manifests.py
builds them, and checked against the Kubernetes OpenAPI schema.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

import kubernetes_validate
import pytest

from airflow_skypilot.backends.base import JobState, Offer
from airflow_skypilot.backends.kubernetes import (
    KubernetesBackend,
    KubernetesSettings,
    bundle,
    job_status,
    names,
)
from airflow_skypilot.exceptions import SubmissionError
from airflow_skypilot.spec import load_task

K8S_VERSION = kubernetes_validate.utils.latest_version()
NOW = time.time()


def _backend(**kw) -> KubernetesBackend:
    return KubernetesBackend("k8s_test", settings=KubernetesSettings(
        context="ctx", namespace="team-a", **kw))


def _offer(task) -> Offer:
    return Offer(connection="k8s_test", backend="kubernetes", location="ctx/team-a",
                 infra="kubernetes/ctx", request=task.candidates[0], num_nodes=task.num_nodes)


def _objects(backend, task, name="sky-job-1"):
    offer = _offer(task)
    env = {"SKYPILOT_TASK_ID": "sky-task-1"}
    job = backend.job_manifest(task, offer, name, env)
    owner = {"metadata": {"name": name, "uid": "0f0f0f0f-1111-2222-3333-444444444444"}}
    deps = backend.dependents(task, offer, name, env, bundle.bundle(task), owner)
    return job, {"Bundle" if d["metadata"]["name"] == names.bundle_name(name) else d["kind"]: d
                 for d in deps}


def _ours(name="sky-job-1"):
    return names.labels_for(name)


def test_resource_labels_go_on_the_pods_and_the_job_and_ours_win():
    task = load_task({"run": "true", "resources": {"labels": {
        "team": "ml", "example.com/cost-center": "cc-42",
        names.LABEL_MANAGED: "someone-else"}}})
    job, deps = _objects(_backend(), task)
    pod_labels = job["spec"]["template"]["metadata"]["labels"]
    for labels in (pod_labels, job["metadata"]["labels"]):
        assert labels["team"] == "ml" and labels["example.com/cost-center"] == "cc-42"
        assert labels[names.LABEL_MANAGED] == names.MANAGED_BY  # ours win
        assert labels[names.LABEL_JOB] == "sky-job-1"
    # SkyPilot puts resources.labels on its pods only: not on the ConfigMap
    assert deps["ConfigMap"]["metadata"]["labels"] == _ours()
    kubernetes_validate.validate(job, K8S_VERSION, strict=True)


def test_resource_labels_of_the_chosen_candidate():
    task = load_task({"run": "true", "resources": {"labels": {"tier": "base"}, "any_of": [
        {"cpus": 1, "labels": {"tier": "small"}}, {"cpus": 2}]}})
    backend = _backend()
    chosen = [c for c in task.candidates if c.labels.get("tier") == "small"]
    assert chosen
    offer = Offer(connection="k8s_test", backend="kubernetes", location="ctx/team-a",
                  infra="kubernetes/ctx", request=chosen[0], num_nodes=1)
    job = backend.job_manifest(task, offer, "sky-job-1", {})
    assert job["spec"]["template"]["metadata"]["labels"]["tier"] == "small"


def test_custom_metadata_goes_on_every_object_and_ours_win(tmp_path):
    (tmp_path / "train.py").write_text("print('hi')\n")
    task = load_task({
        "num_nodes": 2, "run": "true", "workdir": str(tmp_path), "secrets": {"TOKEN": "t"},
        "resources": {"labels": {"team": "from-resources", "only-resources": "r"}},
        "config": {"kubernetes": {
            "pod_config": {"metadata": {"labels": {"team": "from-pod-config", "pc": "p"},
                                        "annotations": {"note": "from-pod-config"}}},
            "custom_metadata": {
                "labels": {"team": "from-custom", "env": "prod", "version": 3,
                           names.LABEL_MANAGED: "helm"},
                "annotations": {"example.com/owner": "alice@example.com",
                                "note": "from custom: free text, any length"}}}}})
    job, deps = _objects(_backend(), task)
    assert set(deps) == {"ConfigMap", "Secret", "Bundle", "Service"}
    for obj in [job, *deps.values()]:
        meta = obj["metadata"]
        assert meta["labels"]["env"] == "prod" and meta["labels"]["version"] == "3"
        assert meta["labels"][names.LABEL_MANAGED] == names.MANAGED_BY  # ours win
        assert meta["labels"][names.LABEL_JOB] == "sky-job-1"
        assert meta["annotations"]["example.com/owner"] == "alice@example.com"
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    # ours win on the Job's annotations too
    assert job["metadata"]["annotations"][names.ANN_PREFIX + "managed"] == "true"
    pod = job["spec"]["template"]["metadata"]
    # SkyPilot's order on the pods: resources.labels < pod_config < custom_metadata < ours
    assert pod["labels"]["team"] == "from-custom"
    assert pod["labels"]["pc"] == "p" and pod["labels"]["only-resources"] == "r"
    assert pod["labels"][names.LABEL_JOB] == "sky-job-1"
    assert pod["annotations"]["note"] == "from custom: free text, any length"
    assert pod["annotations"]["example.com/owner"] == "alice@example.com"
    assert job["spec"]["template"]["spec"]["subdomain"] == deps["Service"]["metadata"]["name"]
    assert deps["Service"]["spec"]["selector"] == {names.LABEL_JOB: "sky-job-1"}


@pytest.mark.parametrize("resources,config,field", [
    ({"labels": {"bad key": "x"}}, {}, "resources.labels"),
    ({"labels": {"team": "x" * 64}}, {}, "resources.labels"),
    ({"labels": {"team": "-starts-with-a-dash"}}, {}, "resources.labels"),
    ({}, {"custom_metadata": {"labels": {"Example.com/x": "y"}}},
     "config.kubernetes.custom_metadata.labels"),
    ({}, {"custom_metadata": {"labels": {"ok": "has space"}}},
     "config.kubernetes.custom_metadata.labels"),
    ({}, {"custom_metadata": {"annotations": {"skypilot.airflow/cancelled": "now"}}},
     "config.kubernetes.custom_metadata.annotations"),
    ({}, {"custom_metadata": {"annotations": {"k": ["not", "text"]}}},
     "config.kubernetes.custom_metadata.annotations"),
    ({}, {"custom_metadata": {"name": "other"}}, "config.kubernetes.custom_metadata"),
])
def test_invalid_labels_are_refused_before_anything_is_submitted(resources, config, field):
    task = load_task({"run": "true", "resources": resources,
                      "config": {"kubernetes": config} if config else {}})
    backend = _backend()
    why = backend.unsupported(task, task.candidates[0])
    assert why.startswith(field), why
    with pytest.raises(SubmissionError, match="custom_metadata|resources.labels"):
        backend.job_manifest(task, _offer(task), "sky-job-1", {})


def test_valid_labels_are_not_refused():
    task = load_task({"run": "true", "resources": {"labels": {"a.b/c-d_e.f": "", "x": "1"}},
                      "config": {"kubernetes": {"custom_metadata": {
                          "labels": {"app.kubernetes.io/part-of": "training"},
                          "annotations": {"anything": "goes: {here} $(x)"}}}}})
    assert _backend().unsupported(task, task.candidates[0]) == ""


def _ts(seconds_ago: float) -> str:
    return datetime.fromtimestamp(NOW - seconds_ago, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _unschedulable_for(seconds: float) -> dict:
    return {"metadata": {"name": "sky-job-1-0-x", "creationTimestamp": _ts(seconds),
                         "labels": {names.LABEL_JOB: "sky-job-1", names.INDEX_KEY: "0"}},
            "spec": {"containers": [{"name": "main", "image": "img"}]},
            "status": {"phase": "Pending", "conditions": [
                {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                 "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}]}}


def _started(job: dict) -> dict:
    job = dict(job, spec=dict(job["spec"], suspend=False), status={})
    job["metadata"] = dict(job["metadata"], uid="u1", creationTimestamp=_ts(300))
    return job


def test_provision_timeout_is_the_jobs_pending_timeout():
    task = load_task({"run": "true", "config": {"kubernetes": {"provision_timeout": 60}}})
    job, _ = _objects(_backend(), task)
    assert job["metadata"]["annotations"][names.ANN_PENDING_TIMEOUT] == "60"
    kubernetes_validate.validate(job, K8S_VERSION, strict=True)
    live = _started(job)
    # the connection waits forever; the task's provision_timeout fails it over after 60s
    st = job_status(live, [_unschedulable_for(120)], num_nodes=1, now=NOW,
                    pending_timeout=None)
    assert st.state == JobState.INFRA_FAILED and "could not be scheduled" in st.reason
    st = job_status(live, [_unschedulable_for(30)], num_nodes=1, now=NOW,
                    pending_timeout=None)
    assert st.state == JobState.PENDING


def test_negative_provision_timeout_waits_and_none_keeps_the_connections():
    task = load_task({"run": "true", "config": {"kubernetes": {"provision_timeout": -1}}})
    live = _started(_objects(_backend(), task)[0])
    st = job_status(live, [_unschedulable_for(3600)], num_nodes=1, now=NOW,
                    pending_timeout=30)
    assert st.state == JobState.PENDING  # SkyPilot: negative waits indefinitely
    plain = _started(_objects(_backend(), load_task({"run": "true"}))[0])
    assert names.ANN_PENDING_TIMEOUT not in plain["metadata"]["annotations"]
    st = job_status(plain, [_unschedulable_for(60)], num_nodes=1, now=NOW, pending_timeout=30)
    assert st.state == JobState.INFRA_FAILED
