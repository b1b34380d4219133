"""The Kubernetes sandbox behaves like a cluster when driven by the real client libraries."""

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException

from tests.e2e.conftest import shared_dir
from tests.sandbox.kubernetes import CONN_ID, NOPODS_CONN_ID, KubernetesSandbox

pytestmark = pytest.mark.sandbox

T = TypeVar("T")
NS = "default"
REPO_ROOT = Path(__file__).resolve().parents[2]


def wait_for(check: Callable[[], T], timeout: float = 20.0, interval: float = 0.1) -> T:
    """Poll ``check`` until it returns something truthy (bounded, never a busy loop)."""
    deadline = time.monotonic() + timeout
    last: T = check()
    while not last:
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s (last: {last!r})")
        time.sleep(interval)
        last = check()
    return last


@pytest.fixture(scope="session")
def sandbox() -> Iterator[KubernetesSandbox]:
    box = KubernetesSandbox()
    was_up = box.is_up()
    box.up()
    yield box
    if not was_up:
        box.down()


@pytest.fixture
def k8s(sandbox: KubernetesSandbox) -> KubernetesSandbox:
    sandbox.reset()
    return sandbox


@pytest.fixture
def api(k8s: KubernetesSandbox) -> client.ApiClient:
    return config.new_client_from_config(config_file=str(k8s.kubeconfig), context="sandbox")


@pytest.fixture
def core(api: client.ApiClient) -> client.CoreV1Api:
    return client.CoreV1Api(api)


@pytest.fixture
def batch(api: client.ApiClient) -> client.BatchV1Api:
    return client.BatchV1Api(api)


def job_body(
    name: str,
    script: str,
    *,
    completions: int = 1,
    indexed: bool = False,
    gpus: int = 0,
    image: str = "ubuntu:22.04",
    subdomain: str | None = None,
    backoff_limit: int = 0,
    env: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "main",
        "image": image,
        "command": ["/bin/bash", "-c", script],
        "env": env or [],
    }
    if gpus:
        container["resources"] = {
            "limits": {"nvidia.com/gpu": str(gpus)},
            "requests": {"cpu": "1", "memory": "1Gi"},
        }
    spec: dict[str, Any] = {"restartPolicy": "Never", "containers": [container]}
    if subdomain:
        spec["subdomain"] = subdomain
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {
            "completions": completions,
            "parallelism": completions,
            "completionMode": "Indexed" if indexed else "NonIndexed",
            "backoffLimit": backoff_limit,
            "template": {"spec": spec},
        },
    }


def pod_body(name: str, script: str, **container: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "main",
                    "image": "ubuntu:22.04",
                    "command": ["/bin/bash", "-c", script],
                    **container,
                }
            ],
        },
    }


def job_condition(batch: client.BatchV1Api, name: str) -> str | None:
    job = batch.read_namespaced_job(name, NS)
    for cond in job.status.conditions or []:
        if cond.status == "True" and cond.type in ("Complete", "Failed"):
            return cond.type
    return None


def job_pods(core: client.CoreV1Api, name: str) -> list[client.V1Pod]:
    return core.list_namespaced_pod(NS, label_selector=f"job-name={name}").items


def pod_log(core: client.CoreV1Api, name: str, **kwargs: Any) -> str:
    # kubernetes 36.0 returns repr(bytes) for logs (client issue #2596): read the raw body.
    raw = core.read_namespaced_pod_log(name, NS, _preload_content=False, **kwargs)
    return raw.data.decode()


def phase(core: client.CoreV1Api, name: str) -> str:
    return core.read_namespaced_pod(name, NS).status.phase


def condition_of(pod: client.V1Pod, ctype: str) -> client.V1PodCondition | None:
    return next((c for c in pod.status.conditions or [] if c.type == ctype), None)


def test_indexed_job_with_headless_service(
    core: client.CoreV1Api, batch: client.BatchV1Api
) -> None:
    core.create_namespaced_service(
        NS,
        {
            "metadata": {"name": "train"},
            "spec": {"clusterIP": "None", "selector": {"job-name": "train"}},
        },
    )
    script = 'echo "rank=$JOB_COMPLETION_INDEX host=$HOSTNAME"; echo to-stderr >&2'
    batch.create_namespaced_job(
        NS, job_body("train", script, completions=2, indexed=True, gpus=8, subdomain="train")
    )
    assert wait_for(lambda: job_condition(batch, "train")) == "Complete"
    job = batch.read_namespaced_job("train", NS)
    assert job.status.succeeded == 2 and job.status.completed_indexes == "0-1"
    pods = sorted(
        job_pods(core, "train"),
        key=lambda p: p.metadata.labels["batch.kubernetes.io/job-completion-index"],
    )
    assert len(pods) == 2
    assert {p.spec.node_name for p in pods} == {"gpu-node-1", "gpu-node-2"}  # 8 GPUs each
    assert len({p.status.pod_ip for p in pods}) == 2
    for index, pod in enumerate(pods):
        assert pod.spec.hostname == f"train-{index}" and pod.spec.subdomain == "train"
        assert pod.metadata.annotations["batch.kubernetes.io/job-completion-index"] == str(index)
        assert pod.metadata.owner_references[0].kind == "Job"
        assert pod.metadata.labels["batch.kubernetes.io/controller-uid"] == job.metadata.uid
        assert pod.status.phase == "Succeeded"
        terminated = pod.status.container_statuses[0].state.terminated
        assert terminated.exit_code == 0 and terminated.reason == "Completed"
        log = pod_log(core, pod.metadata.name)
        assert log == f"rank={index} host=train-{index}\nto-stderr\n"
        assert pod_log(core, pod.metadata.name, tail_lines=1) == "to-stderr\n"
        stamped = pod_log(core, pod.metadata.name, timestamps=True)
        assert stamped.splitlines()[0].endswith(f"Z rank={index} host=train-{index}")
    svc = core.read_namespaced_service("train", NS)
    assert svc.spec.cluster_ip == "None"


def test_user_exit_code_fails_pod_and_job(core: client.CoreV1Api, batch: client.BatchV1Api) -> None:
    batch.create_namespaced_job(NS, job_body("boom", "echo bad; exit 3"))
    assert wait_for(lambda: job_condition(batch, "boom")) == "Failed"
    job = batch.read_namespaced_job("boom", NS)
    failed = next(c for c in job.status.conditions if c.type == "Failed")
    assert failed.reason == "BackoffLimitExceeded" and job.status.failed == 1
    (pod,) = job_pods(core, "boom")
    assert pod.status.phase == "Failed"
    terminated = pod.status.container_statuses[0].state.terminated
    assert terminated.exit_code == 3 and terminated.reason == "Error"
    assert condition_of(pod, "DisruptionTarget") is None  # a user failure, not an infra one
    assert pod_log(core, pod.metadata.name) == "bad\n"


def test_backoff_limit_retries_then_succeeds(
    core: client.CoreV1Api, batch: client.BatchV1Api
) -> None:
    flag = f"{shared_dir()}/flag"  # the pod's process may run as another user
    script = f"if [ -e {flag} ]; then rm {flag}; exit 0; else touch {flag}; exit 1; fi"
    batch.create_namespaced_job(NS, job_body("retry", script, backoff_limit=2))
    assert wait_for(lambda: job_condition(batch, "retry")) == "Complete"
    job = batch.read_namespaced_job("retry", NS)
    assert job.status.failed == 1 and job.status.succeeded == 1


def test_secret_env_envfrom_and_volume(core: client.CoreV1Api) -> None:
    core.create_namespaced_secret(
        NS, {"metadata": {"name": "creds"}, "stringData": {"token": "s3cr3t", "user": "alice"}}
    )
    script = (
        'echo "token=$TOKEN user=$user pod=$POD ns=$PODNS ip=$IP"; '
        'cat "${SANDBOX_MOUNT_ROOT:-}/etc/creds/token"; echo; pwd'
    )
    env = [
        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}},
        {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "PODNS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]
    body = pod_body(
        "envpod",
        script,
        env=env,
        envFrom=[{"secretRef": {"name": "creds"}}],
        workingDir="/workspace",
        volumeMounts=[{"name": "creds", "mountPath": "/etc/creds", "readOnly": True}],
    )
    body["spec"]["volumes"] = [{"name": "creds", "secret": {"secretName": "creds"}}]
    core.create_namespaced_pod(NS, body)
    wait_for(lambda: phase(core, "envpod") in ("Succeeded", "Failed"))
    pod = core.read_namespaced_pod("envpod", NS)
    assert pod.status.phase == "Succeeded"
    lines = pod_log(core, "envpod").splitlines()
    assert lines[0] == f"token=s3cr3t user=alice pod=envpod ns=default ip={pod.status.pod_ip}"
    assert lines[1] == "s3cr3t"
    assert lines[2].endswith("/root/workspace")


def test_missing_secret_blocks_container(core: client.CoreV1Api) -> None:
    env = [{"name": "T", "valueFrom": {"secretKeyRef": {"name": "nope", "key": "k"}}}]
    core.create_namespaced_pod(NS, pod_body("nosecret", "true", env=env))

    def waiting() -> str | None:
        statuses = core.read_namespaced_pod("nosecret", NS).status.container_statuses
        state = statuses[0].state if statuses else None
        return state.waiting.reason if state and state.waiting else None

    assert wait_for(waiting) == "CreateContainerConfigError"
    assert phase(core, "nosecret") == "Pending"


def test_oversized_gpu_request_stays_pending(core: client.CoreV1Api) -> None:
    core.create_namespaced_pod(
        NS, pod_body("huge", "true", resources={"limits": {"nvidia.com/gpu": "16"}})
    )
    pod = wait_for(
        lambda: (
            (p := core.read_namespaced_pod("huge", NS)) and condition_of(p, "PodScheduled") and p
        )
    )
    cond = condition_of(pod, "PodScheduled")
    assert pod.status.phase == "Pending" and pod.spec.node_name is None
    assert cond.status == "False" and cond.reason == "Unschedulable"
    assert cond.message.startswith("0/3 nodes are available: 3 Insufficient nvidia.com/gpu.")
    events = core.list_namespaced_event(NS, field_selector="involvedObject.name=huge").items
    assert any(e.reason == "FailedScheduling" for e in events)


def test_scheduler_counts_gpus_and_honours_cordon_and_taints(
    k8s: KubernetesSandbox, core: client.CoreV1Api
) -> None:
    gpu = {"limits": {"nvidia.com/gpu": "6"}}
    core.create_namespaced_pod(NS, pod_body("a", "sleep 30", resources=gpu))
    wait_for(lambda: core.read_namespaced_pod("a", NS).spec.node_name)
    first = core.read_namespaced_pod("a", NS).spec.node_name
    other = "gpu-node-2" if first == "gpu-node-1" else "gpu-node-1"
    k8s.cordon(other)
    core.create_namespaced_pod(NS, pod_body("b", "true", resources=gpu))
    pod = wait_for(
        lambda: (p := core.read_namespaced_pod("b", NS)) and condition_of(p, "PodScheduled") and p
    )
    message = condition_of(pod, "PodScheduled").message
    assert "1 node(s) were unschedulable" in message
    assert "2 Insufficient nvidia.com/gpu" in message  # 2 free on `first`, none on cpu-node-1
    k8s.taint(other, "dedicated", "NoSchedule")  # before uncordon, or "b" could slip in
    k8s.uncordon(other)
    wait_for(
        lambda: (
            "untolerated taint {dedicated: }"
            in (condition_of(core.read_namespaced_pod("b", NS), "PodScheduled").message or "")
        )
    )
    core.delete_namespaced_pod("b", NS, grace_period_seconds=0)
    body = pod_body("c", "true", resources=gpu)
    body["spec"]["tolerations"] = [{"key": "dedicated", "operator": "Exists"}]
    body["spec"]["nodeSelector"] = {"skypilot.co/accelerator": "a100"}
    core.create_namespaced_pod(NS, body)
    assert wait_for(lambda: core.read_namespaced_pod("c", NS).spec.node_name) == other


def test_eviction_api_fails_pod_as_disruption(
    k8s: KubernetesSandbox, core: client.CoreV1Api
) -> None:
    core.create_namespaced_pod(NS, pod_body("victim", "echo started; sleep 60"))
    wait_for(lambda: "started" in pod_log_safe(core, "victim"))
    assert any(p["pod"] == "victim" for p in k8s.processes())
    core.create_namespaced_pod_eviction(
        "victim",
        NS,
        {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": "victim"}},
    )
    wait_for(lambda: phase(core, "victim") == "Failed")
    pod = core.read_namespaced_pod("victim", NS)
    assert pod.status.reason == "Evicted"
    disruption = condition_of(pod, "DisruptionTarget")
    assert disruption.status == "True" and disruption.reason == "EvictionByEvictionAPI"
    wait_for(lambda: not k8s.processes())


def pod_log_safe(core: client.CoreV1Api, name: str) -> str:
    try:
        return pod_log(core, name)
    except ApiException:
        return ""


def test_evict_fault_fails_job_pod(
    k8s: KubernetesSandbox, core: client.CoreV1Api, batch: client.BatchV1Api
) -> None:
    batch.create_namespaced_job(NS, job_body("spot", "sleep 60", gpus=1))
    pod = wait_for(lambda: [p for p in job_pods(core, "spot") if p.status.phase == "Running"])[0]
    k8s.evict_pod(NS, pod.metadata.name)
    assert wait_for(lambda: job_condition(batch, "spot")) == "Failed"
    pod = core.read_namespaced_pod(pod.metadata.name, NS)
    assert pod.status.phase == "Failed" and pod.status.reason == "Evicted"
    assert condition_of(pod, "DisruptionTarget").reason == "EvictionByEvictionAPI"


def test_node_failure_kills_pods(
    k8s: KubernetesSandbox, core: client.CoreV1Api, batch: client.BatchV1Api
) -> None:
    batch.create_namespaced_job(NS, job_body("lost", "sleep 60", gpus=8))
    pod = wait_for(lambda: [p for p in job_pods(core, "lost") if p.status.phase == "Running"])[0]
    node = pod.spec.node_name
    k8s.fail_node(node)
    assert wait_for(lambda: job_condition(batch, "lost")) == "Failed"
    pod = core.read_namespaced_pod(pod.metadata.name, NS)
    assert pod.status.phase == "Failed"
    assert condition_of(pod, "DisruptionTarget").reason == "DeletionByTaintManager"
    assert pod.status.container_statuses[0].state.terminated.reason == "ContainerStatusUnknown"
    ready = next(c for c in core.read_node(node).status.conditions if c.type == "Ready")
    assert ready.status == "Unknown"
    assert not k8s.processes()
    with pytest.raises(ApiException) as err:  # the lost kubelet cannot serve logs
        core.read_namespaced_pod_log(pod.metadata.name, NS)
    assert err.value.status == 500
    core.create_namespaced_pod(
        NS, pod_body("after", "true", resources={"limits": {"nvidia.com/gpu": "8"}})
    )
    assert wait_for(lambda: core.read_namespaced_pod("after", NS).spec.node_name) != node


def test_bad_image_backs_off(core: client.CoreV1Api) -> None:
    core.create_namespaced_pod(
        NS, pod_body("img", "true", image="registry.example/does-not-exist:1")
    )

    def reason() -> str | None:
        statuses = core.read_namespaced_pod("img", NS).status.container_statuses or []
        waiting = statuses[0].state.waiting if statuses else None
        return waiting.reason if waiting else None

    assert wait_for(reason) in ("ErrImagePull", "ImagePullBackOff")
    wait_for(lambda: reason() == "ImagePullBackOff")
    assert phase(core, "img") == "Pending"
    with pytest.raises(ApiException) as err:
        core.read_namespaced_pod_log("img", NS)
    assert err.value.status == 400 and "waiting to start" in err.value.body


def test_foreground_delete_removes_pods_and_processes(
    k8s: KubernetesSandbox, core: client.CoreV1Api, batch: client.BatchV1Api
) -> None:
    batch.create_namespaced_job(NS, job_body("fg", "sleep 120", completions=2, indexed=True))
    wait_for(lambda: len([p for p in job_pods(core, "fg") if p.status.phase == "Running"]) == 2)
    pids = [p["pid"] for p in k8s.processes()]
    assert len(pids) == 2
    batch.delete_namespaced_job("fg", NS, propagation_policy="Foreground")
    wait_for(lambda: not job_pods(core, "fg"))

    def job_gone() -> bool:
        try:
            batch.read_namespaced_job("fg", NS)
        except ApiException as exc:
            return exc.status == 404
        return False

    wait_for(job_gone)
    assert not k8s.processes()
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()


def test_suspending_a_running_job_deletes_its_pods(
    k8s: KubernetesSandbox, core: client.CoreV1Api, batch: client.BatchV1Api
) -> None:
    """As the real Job controller (KEP-2232): a Job suspended while it runs loses its active
    pods (gracefully) and gets no new ones; the Job object stays."""
    batch.create_namespaced_job(NS, job_body("susp", "sleep 120", completions=2, indexed=True))
    wait_for(lambda: len([p for p in job_pods(core, "susp") if p.status.phase == "Running"]) == 2)
    batch.patch_namespaced_job("susp", NS, {"spec": {"suspend": True}})
    wait_for(lambda: not job_pods(core, "susp") and not k8s.processes())
    time.sleep(3)  # the controller has had its turns: nothing is started again
    assert not job_pods(core, "susp") and not k8s.processes()
    assert batch.read_namespaced_job("susp", NS).spec.suspend


def test_default_job_delete_orphans_pods(core: client.CoreV1Api, batch: client.BatchV1Api) -> None:
    batch.create_namespaced_job(NS, job_body("orphan", "sleep 30"))
    wait_for(lambda: job_pods(core, "orphan"))
    batch.delete_namespaced_job("orphan", NS)  # no propagationPolicy: batch/v1 orphans pods
    pods = wait_for(
        lambda: [p for p in job_pods(core, "orphan") if not p.metadata.owner_references]
    )
    assert pods[0].metadata.deletion_timestamp is None


def test_forbidden_token_cannot_list_pods(k8s: KubernetesSandbox) -> None:
    api = config.new_client_from_config(config_file=str(k8s.kubeconfig_nopods))
    core = client.CoreV1Api(api)
    with pytest.raises(ApiException) as err:
        core.list_namespaced_pod(NS)
    assert err.value.status == 403
    body = json.loads(err.value.body)
    assert body["kind"] == "Status" and body["reason"] == "Forbidden"
    assert len(core.list_node().items) == 3


def test_request_counter(k8s: KubernetesSandbox, core: client.CoreV1Api) -> None:
    k8s.reset_requests()
    core.list_namespaced_pod(NS)
    core.list_namespaced_pod(NS, label_selector="a=b")
    core.list_namespaced_pod("kube-system")
    pod_lists = [
        r
        for r in k8s.requests()
        if r["method"] == "GET" and r["path"] == f"/api/v1/namespaces/{NS}/pods"
    ]
    assert len(pod_lists) == 2
    assert {r["query"].get("labelSelector") for r in pod_lists} == {None, "a=b"}
    k8s.reset_requests()
    assert k8s.requests() == []


def test_selectors_and_watch(core: client.CoreV1Api) -> None:
    core.create_namespaced_pod(
        NS, {**pod_body("w1", "true"), "metadata": {"name": "w1", "labels": {"app": "x"}}}
    )
    core.create_namespaced_pod(NS, pod_body("w2", "sleep 30"))
    wait_for(lambda: phase(core, "w1") == "Succeeded")
    wait_for(lambda: core.read_namespaced_pod("w2", NS).spec.node_name)
    done = core.list_namespaced_pod(NS, field_selector="status.phase=Succeeded").items
    assert [p.metadata.name for p in done] == ["w1"]
    assert [
        p.metadata.name for p in core.list_namespaced_pod(NS, label_selector="app in (x,y)").items
    ] == ["w1"]
    node = core.read_namespaced_pod("w2", NS).spec.node_name
    assert "w2" in [
        p.metadata.name
        for p in core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={node}").items
    ]
    with pytest.raises(ApiException) as err:
        core.list_namespaced_pod(NS, field_selector="spec.containers=x")
    assert err.value.status == 400
    seen = [
        (e["type"], e["object"].metadata.name)
        for e in watch.Watch().stream(
            core.list_namespaced_pod, NS, label_selector="app=x", timeout_seconds=1
        )
    ]
    assert seen == [("ADDED", "w1")]


def test_airflow_hooks_over_http(
    k8s: KubernetesSandbox, core: client.CoreV1Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import (
        AsyncKubernetesHook,
        KubernetesHook,
    )

    for conn_id, conn in k8s.connections().items():
        monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(conn))
    core.create_namespaced_pod(NS, pod_body("hooked", "echo from-hook"))
    wait_for(lambda: phase(core, "hooked") == "Succeeded")
    hook = KubernetesHook(conn_id=CONN_ID)
    assert sorted(n.metadata.name for n in hook.core_v1_client.list_node().items) == [
        "cpu-node-1",
        "gpu-node-1",
        "gpu-node-2",
    ]
    assert hook.get_namespace() == NS

    async def use_async() -> tuple[list[str], list[str]]:
        ahook = AsyncKubernetesHook(conn_id=CONN_ID)
        async with ahook.get_conn() as conn:
            from kubernetes_asyncio import client as async_client

            pods = await async_client.CoreV1Api(conn).list_namespaced_pod(NS)
        pod = await ahook.get_pod("hooked", NS)
        assert pod.status.phase == "Succeeded"
        return [p.metadata.name for p in pods.items], await ahook.read_logs("hooked", NS)

    names, lines = asyncio.run(use_async())
    assert names == ["hooked"]
    assert [line.split(" ", 1)[1] for line in lines] == ["from-hook"]
    nopods = KubernetesHook(conn_id=NOPODS_CONN_ID).core_v1_client
    with pytest.raises(ApiException) as err:
        nopods.list_namespaced_pod(NS)
    assert err.value.status == 403


def test_cli_status_and_connections_file(k8s: KubernetesSandbox) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.sandbox.kubernetes",
            "status",
            "--state-dir",
            str(k8s.state_dir),
            "--port",
            str(k8s.port),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["up"] is True
    conns = json.loads(k8s.connections_file.read_text())
    assert conns[CONN_ID]["conn_type"] == "kubernetes"
    assert conns[CONN_ID]["extra"]["kube_config_path"] == str(k8s.kubeconfig)
