"""The Kubernetes backend against the sandbox cluster (tests/sandbox/kubernetes), over HTTP.

The backend talks through the cncf-kubernetes hooks; the test side uses the real
``kubernetes`` client to load the cluster, look behind the backend and inject faults.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from airflow_skypilot.backends.base import JobHandle, JobState, JobStatus
from airflow_skypilot.backends.kubernetes import KubernetesBackend, KubernetesSettings, names
from airflow_skypilot.backends.registry import backend_for_connection
from airflow_skypilot.cli import main as cli
from airflow_skypilot.spec import load_task
from tests.unit.test_kubernetes_stop import TRAINER  # saves a checkpoint on TERM

pytestmark = pytest.mark.sandbox

NS = "default"
T = TypeVar("T")
NASTY = {
    "SPACES": "a  b   c",
    "QUOTES": "it's \"quoted\" `tick`",
    "SUBST": "$(echo pwned) ${HOME} $$ $(SPACES)",
    "NEWLINES": "line1\nline2\n\n",
    "UNICODE": "naïve ☃",
}


def wait_for(check: Callable[[], T], timeout: float = 30.0, interval: float = 0.3) -> T:
    deadline = time.monotonic() + timeout
    last = check()
    while not last:
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {timeout}s (last: {last!r})")
        time.sleep(interval)
        last = check()
    return last


@pytest.fixture
def kube(k8s) -> client.CoreV1Api:
    api = config.new_client_from_config(config_file=str(k8s.kubeconfig), context="sandbox")
    yield api
    api.close()


def _core(api) -> client.CoreV1Api:
    return client.CoreV1Api(api)


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def _submit(backend: KubernetesBackend, spec: dict[str, Any], name: str | None = None,
            accelerator: str | None = None) -> JobHandle:
    task = load_task(spec)
    offers = [o for o in backend.probe(task) if o.fits]
    assert offers, [o.reason for o in backend.probe(task)]
    return backend.submit(task, offers[0], name or _name("job"),
                          {"SKYPILOT_TASK_ID": "sky-task-xyz"})


def _until(backend, handle, states, timeout=40.0, use_poll=False) -> JobStatus:
    def check():
        if use_poll:
            status = asyncio.run(backend.astatus([handle]))[handle.job_id]
        else:
            status = backend.status([handle])[handle.job_id]
        return status if status.state in states else None
    return wait_for(check, timeout)


def _terminal(backend, handle, timeout=40.0, use_poll=False) -> JobStatus:
    return _until(backend, handle, [s for s in JobState if s.terminal], timeout, use_poll)


def _pods(api, job_name) -> list[client.V1Pod]:
    return _core(api).list_namespaced_pod(NS, label_selector=f"{names.LABEL_JOB}={job_name}").items


def _filler(api, name, gpus, node=None, extra=None) -> None:
    """A plain pod holding GPUs (the command runs on the host: a sleep)."""
    spec = {"restartPolicy": "Never", "containers": [{
        "name": "c", "image": "busybox", "command": ["sleep", "300"],
        "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}]}
    if node:
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    spec.update(extra or {})
    _core(api).create_namespaced_pod(NS, {"apiVersion": "v1", "kind": "Pod",
                                          "metadata": {"name": name}, "spec": spec})


def _phase(api, name) -> str:
    return _core(api).read_namespaced_pod(name, NS).status.phase


def _use_extras(monkeypatch, k8s, **extra) -> None:
    conn = k8s.connections()["k8s_sandbox"]
    conn["extra"].update(extra)
    monkeypatch.setenv("AIRFLOW_CONN_K8S_SANDBOX", json.dumps(conn))


# --- capacity -------------------------------------------------------------------------------


def test_capacity_is_right_under_load(k8s, kube):
    backend = backend_for_connection("k8s_sandbox")
    assert isinstance(backend, KubernetesBackend)
    rows = {r.accelerator: r for r in backend.capacity()}
    assert (rows["A100"].total, rows["A100"].free, rows["A100"].pending) == (16, 16, 0)
    assert rows["A100"].location == "sandbox/default"
    _filler(kube, "fill-a", 3, "gpu-node-1")
    _filler(kube, "fill-b", 6, "gpu-node-2")
    _filler(kube, "fill-big", 9)  # no node has 9: stays Pending
    wait_for(lambda: _phase(kube, "fill-a") == _phase(kube, "fill-b") == "Running")
    rows = {r.accelerator: r for r in backend.capacity()}
    assert (rows["A100"].total, rows["A100"].free, rows["A100"].pending) == (16, 16 - 9, 1)
    task = load_task({"run": "true", "resources": {"accelerators": "A100:4"}})
    [offer] = backend.probe(task)
    assert offer.fits and offer.gpus_free == 7
    assert (offer.nodes_total, offer.nodes_free, offer.pending_jobs) == (2, 1, 1)
    assert offer.free_now and offer.est_start is not None
    # a cordoned node has no capacity
    k8s.cordon("gpu-node-1")
    [offer] = backend.probe(task)
    assert (offer.gpus_free, offer.nodes_free) == (2, 0)
    assert not offer.free_now and offer.est_start is None
    assert "gpu-node-1" in offer.details["nodes_unusable"]
    k8s.uncordon("gpu-node-1")
    k8s.taint("gpu-node-2", "maintenance", "NoSchedule")
    [offer] = backend.probe(task)
    assert (offer.gpus_free, offer.nodes_free) == (5, 1)


def test_forbidden_pod_listing_leaves_free_unknown_not_zero(k8s):
    backend = backend_for_connection("k8s_sandbox_nopods")
    [offer] = backend.probe(load_task({"run": "true", "resources": {"accelerators": "A100:2"}}))
    assert offer.fits
    assert offer.gpus_total == 16 and offer.nodes_total == 2
    assert offer.gpus_free is None and offer.nodes_free is None and offer.est_start is None
    assert "pods may not be listed" in offer.details["note"]
    rows = {r.accelerator: r for r in backend.capacity()}
    assert rows["A100"].total == 16 and rows["A100"].free is None
    assert rows["A100"].details["free"] == "unknown"


def test_show_gpus_and_plan_cli(k8s, kube, tmp_path, capsys):
    _filler(kube, "fill-cli", 8, "gpu-node-1")
    wait_for(lambda: _phase(kube, "fill-cli") == "Running")
    assert cli(["show-gpus", "--conn", "k8s_sandbox", "--conn", "k8s_sandbox_nopods",
                "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    by = {(r["connection"], r["accelerator"]): r for r in rows}
    assert by[("k8s_sandbox", "A100")]["free"] == 8
    assert by[("k8s_sandbox", "A100")]["location"] == "sandbox/default"
    assert by[("k8s_sandbox_nopods", "A100")]["free"] is None
    assert all("error" not in r for r in rows)
    path = tmp_path / "task.yaml"
    path.write_text("resources:\n  accelerators: A100:8\nrun: python train.py\n")
    assert cli(["plan", str(path), "--conn", "k8s_sandbox", "--conn", "k8s_sandbox_nopods",
                "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["chosen"]["connection"] == "k8s_sandbox"
    assert plan["chosen"]["nodes_free"] == 1
    path.write_text("resources:\n  accelerators: H100:1\nrun: x\n")
    assert cli(["plan", str(path), "--conn", "k8s_sandbox"]) == 0
    out = capsys.readouterr().out
    assert "no H100 nodes in sandbox" in out


# --- running jobs ---------------------------------------------------------------------------


def test_two_node_job_ranks_addresses_and_env(k8s, kube):
    backend = KubernetesBackend("k8s_sandbox")
    dump = "; ".join(f'echo "{k}=$(printf "%s" "${k}" | base64 -w0)"'
                     for k in [*NASTY, "API_TOKEN", "SKYPILOT_NODE_IPS"])
    spec = {
        "num_nodes": 2, "envs": NASTY, "secrets": {"API_TOKEN": "tok $(x) 'q'\n2"},
        "resources": {"accelerators": "A100:2"},
        "setup": 'echo "setup-rank=$SKYPILOT_SETUP_NODE_RANK"',
        "run": 'echo "rank=$SKYPILOT_NODE_RANK nodes=$SKYPILOT_NUM_NODES '
               'gpus=$SKYPILOT_NUM_GPUS_PER_NODE task=$SKYPILOT_TASK_ID"\n' + dump,
    }
    handle = _submit(backend, spec, name=_name("two"))
    assert handle.num_nodes == 2 and not handle.adopted
    assert handle.infra == "kubernetes/sandbox" and handle.location == "sandbox/default"
    json.dumps(handle.to_dict())  # travels through XCom and triggers
    status = _terminal(backend, handle)
    assert status.state == JobState.SUCCEEDED, status
    assert len(status.nodes) == 2
    text, offset = backend.read_log(handle)
    assert offset == len(text.encode())
    rank0, rank1 = [], []
    for line in text.splitlines():
        (rank1 if line.startswith("(rank 1) ") else rank0).append(
            line.removeprefix("(rank 1) "))
    addrs = "\n".join(f"{handle.job_name}-{i}.{handle.job_name}.default.svc.cluster.local"
                      for i in range(2))
    for rank, lines in ((0, rank0), (1, rank1)):
        assert f"setup-rank={rank}" in lines
        assert f"rank={rank} nodes=2 gpus=2 task=sky-task-xyz" in lines
        values = {k: base64.b64decode(v).decode() for k, _, v in
                  (ln.partition("=") for ln in lines if ln.split("=")[0] in
                   {*NASTY, "API_TOKEN", "SKYPILOT_NODE_IPS"})}
        assert values["SKYPILOT_NODE_IPS"] == addrs
        assert values["API_TOKEN"] == "tok $(x) 'q'\n2"
        for key, value in NASTY.items():
            assert values[key] == value, key
    # rank 0 first, then rank 1: rank 0's lines come before any "(rank 1)" line
    assert text.index("rank=0 ") < text.index("(rank 1) ")
    # reading on from the offset gives nothing new; from the middle, the rest
    assert backend.read_log(handle, offset) == ("", offset)
    half = len(text.encode()) // 2
    rest, end = backend.read_log(handle, half)
    assert end == offset and text.encode()[half:].decode(errors="replace") == rest


def test_log_read_in_chunks_adds_up_to_the_whole_log(k8s, monkeypatch):
    from airflow_skypilot.backends.kubernetes import logs as kmod

    monkeypatch.setattr(kmod, "LOG_CHUNK", 100)
    backend = KubernetesBackend("k8s_sandbox")
    handle = _submit(backend, {"num_nodes": 2, "run": 'for i in $(seq 1 40); do '
                               'echo "rank $SKYPILOT_NODE_RANK line $i"; done'})
    assert _terminal(backend, handle).state == JobState.SUCCEEDED
    pieces, offset = [], 0
    for _ in range(200):
        text, new = backend.read_log(handle, offset)
        assert len(text.encode()) <= 100
        if new == offset:
            break
        pieces.append(text)
        offset = new
    whole = "".join(pieces)
    lines = whole.splitlines()
    assert lines[1:41] == [f"rank 0 line {i}" for i in range(1, 41)]
    assert [ln for ln in lines if ln.startswith("(rank 1) rank")] == [
        f"(rank 1) rank 1 line {i}" for i in range(1, 41)]
    assert offset == len(whole.encode())


def test_eviction_is_an_infrastructure_failure(k8s, kube):
    backend = KubernetesBackend("k8s_sandbox")
    handle = _submit(backend, {"run": "echo started; sleep 60"})
    _until(backend, handle, [JobState.RUNNING], use_poll=True)
    [pod] = _pods(kube, handle.job_name)
    k8s.evict_pod(NS, pod.metadata.name)
    status = _terminal(backend, handle, use_poll=True)
    assert status.state == JobState.INFRA_FAILED, status
    assert "Eviction" in status.reason
    assert status.state.infra_failure


def test_node_failure_is_an_infrastructure_failure(k8s, kube):
    backend = KubernetesBackend("k8s_sandbox")
    handle = _submit(backend, {"run": "sleep 60", "resources": {"accelerators": "A100:1"}})
    _until(backend, handle, [JobState.RUNNING])
    [pod] = _pods(kube, handle.job_name)
    k8s.fail_node(pod.spec.node_name)
    status = _terminal(backend, handle)
    assert status.state == JobState.INFRA_FAILED, status
    assert status.state.infra_failure
    # and the failed node has no capacity for the next placement
    [offer] = backend.probe(load_task({"run": "x", "resources": {"accelerators": "A100:1"}}))
    assert offer.nodes_free == 1 and pod.spec.node_name in offer.details["nodes_unusable"]


def test_not_ready_node_past_the_grace_is_an_infrastructure_failure(k8s, kube, monkeypatch):
    _use_extras(monkeypatch, k8s, node_not_ready_grace=1)
    backend = KubernetesBackend("k8s_sandbox")
    handle = _submit(backend, {"run": "sleep 60"})
    _until(backend, handle, [JobState.RUNNING])
    [pod] = _pods(kube, handle.job_name)
    k8s.set_not_ready(pod.spec.node_name)
    status = _terminal(backend, handle, use_poll=True)
    assert status.state == JobState.INFRA_FAILED and "NotReady" in status.reason
    backend.cancel(handle)


def test_a_ranks_failure_beside_a_notready_node_is_infra_within_the_grace(
        k8s, kube, monkeypatch, tmp_path):
    """Rank 1's node goes NotReady, then rank 0 exits 1 (its collective broke): the allocation
    lost decides, not the exit code, long before the NotReady grace runs out. (Rank 1 is slow
    to stop, as a node whose kubelet went silent never stops it: the Job controller's
    deletion leaves it Terminating on that node, where the status sees it.)"""
    _use_extras(monkeypatch, k8s, node_not_ready_grace=600)
    go = tmp_path / "go"  # pods run as host processes: rank 0 fails once it exists
    backend = KubernetesBackend("k8s_sandbox")
    handle = _submit(backend, {"num_nodes": 2, "resources": {"accelerators": "A100:8"}, "run": (
        f'if [ "$SKYPILOT_NODE_RANK" = 0 ]; then until [ -e {go} ]; do sleep 0.2; done; '
        "exit 1; fi; trap '' TERM; sleep 60")})

    def both_running() -> dict[str, client.V1Pod] | None:
        running = {p.metadata.labels[names.INDEX_KEY]: p for p in _pods(kube, handle.job_name)
                   if p.status.phase == "Running"}
        return running if len(running) == 2 else None

    pods = wait_for(both_running)
    assert pods["0"].spec.node_name != pods["1"].spec.node_name
    k8s.set_not_ready(pods["1"].spec.node_name)
    go.touch()
    status = _terminal(backend, handle, use_poll=True)
    assert status.state == JobState.INFRA_FAILED and status.state.infra_failure, status
    assert "NotReady" in status.reason and pods["1"].spec.node_name in status.reason
    assert status.exit_codes == [1]
    backend.cancel(handle)


def test_bad_image_fails_clearly_and_is_not_failed_over(k8s, kube, monkeypatch):
    _use_extras(monkeypatch, k8s, image_error_grace=3)
    backend = KubernetesBackend("k8s_sandbox")
    handle = _submit(backend, {"run": "true", "resources": {
        "image_id": "docker:does-not-exist/x", "accelerators": "A100:1"}})
    first = _until(backend, handle, [JobState.PENDING, JobState.FAILED], use_poll=True)
    assert first.state == JobState.PENDING  # within the grace: it may still clear
    status = _terminal(backend, handle, use_poll=True)
    assert status.state == JobState.FAILED, status
    assert not status.state.infra_failure
    assert "does-not-exist/x" in status.reason and "ImagePull" in status.reason
    assert status.exit_code is None
    # cleanup of a job that never ended frees its GPU: the Job is deleted
    backend.cleanup(handle)
    wait_for(lambda: not _pods(kube, handle.job_name) and backend.find(handle.job_name) is None)


def _trainer(backend, out) -> JobHandle:
    (out / "trainer.py").write_text(TRAINER)
    handle = _submit(backend, {"run": 'python3 "$OUT/trainer.py"', "envs": {"OUT": str(out)},
                               "secrets": {"TOKEN": "tok-3141592"}})
    wait_for(lambda: (out / "started").exists())
    return handle


@pytest.mark.parametrize("how", ["delete-pod", "cancel"])
def test_a_stopped_pod_gives_the_program_its_term_to_checkpoint_on(k8s, kube, tmp_path, how):
    """The kubelet TERMs a container's first process only (main.sh), which passes it on: the
    program saves its checkpoint and ran once (its last words, masked: the unit tests of
    test_kubernetes_stop.py; a deleted pod's log goes with it). A pod
    deleted by hand (no DisruptionTarget; the program exits 0) reads as the cluster's stop,
    which the operator places again, not as a success nor as the program's failure; our own
    cancel reads CANCELLED. (Before: the TERM went nowhere, the program was KILLed at the
    grace's end with no checkpoint, and a deleted pod's 137 could read as a user failure.)"""
    backend = KubernetesBackend("k8s_sandbox")
    handle = _trainer(backend, tmp_path)
    if how == "cancel":
        backend.cancel(handle)
    else:
        [pod] = _pods(kube, handle.job_name)
        _core(kube).delete_namespaced_pod(pod.metadata.name, NS)
    status = _terminal(backend, handle, use_poll=True)
    wait_for(lambda: not any(p["pod"].startswith(handle.job_name) for p in k8s.processes()))
    assert (tmp_path / "checkpoint").read_text() == "step 7"
    assert (tmp_path / "runs").read_text() == "run\n"
    if how == "cancel":
        assert status.state == JobState.CANCELLED, status
        return
    assert status.state == JobState.INFRA_FAILED, status
    assert status.state.infra_failure and ("stopped" in status.reason
                                           or "deleted" in status.reason), status
    # and the same verdict once the pod is gone, from the Job's own record
    wait_for(lambda: not _pods(kube, handle.job_name))
    later = backend.status([handle])[handle.job_id]
    assert later.state == JobState.INFRA_FAILED, later


def test_cancel_stops_the_pods_keeps_the_job_as_cancelled_until_cleanup(k8s, kube):
    """Cancel stops every pod and deletes the Service, Secret and ConfigMap at once, but keeps
    the Job, marked and suspended: it reads CANCELLED (our own stop), where a Job that is
    gone reads LOST (an infrastructure failure, which the operator fails over). Cleanup then
    deletes the Job. (Before, cancel deleted the Job, so a cancelled job read LOST.)"""
    backend = KubernetesBackend("k8s_sandbox")
    handle = _submit(backend, {"num_nodes": 2, "run": "sleep 60",
                               "secrets": {"TOKEN": "x"}})
    _until(backend, handle, [JobState.RUNNING])
    core, batch = _core(kube), client.BatchV1Api(kube)
    name = handle.job_name
    assert core.read_namespaced_service(name, NS).spec.cluster_ip == "None"
    assert core.read_namespaced_secret(names.secret_name(name), NS)
    assert core.read_namespaced_config_map(names.configmap_name(name), NS)
    backend.cancel(handle)
    status = backend.status([handle])[handle.job_id]
    assert status.state == JobState.CANCELLED, status
    assert status.ended_at is not None

    def dependents_left() -> list[str]:
        left = []
        for read, obj in ((core.read_namespaced_service, name),
                          (core.read_namespaced_secret, names.secret_name(name)),
                          (core.read_namespaced_config_map, names.configmap_name(name))):
            with contextlib.suppress(ApiException):
                read(obj, NS)
                left.append(obj)
        return left

    wait_for(lambda: not dependents_left() and not _pods(kube, name))
    assert not any(p["pod"].startswith(name) for p in k8s.processes())
    job = batch.read_namespaced_job(name, NS)
    assert job.spec.suspend and names.ANN_CANCELLED in job.metadata.annotations
    time.sleep(3)  # the Job controller has had its turns: nothing starts again
    assert not _pods(kube, name) and not any(p["pod"].startswith(name)
                                             for p in k8s.processes())
    later = asyncio.run(backend.astatus([handle]))[handle.job_id]
    assert (later.state, later.ended_at) == (JobState.CANCELLED, status.ended_at)
    backend.cancel(handle)  # safe twice
    again = _submit(backend, {"num_nodes": 2, "run": "sleep 60", "secrets": {"TOKEN": "x"}},
                    name)  # a retried submit adopts it and does not start it again
    assert again.adopted and backend.status([again])[name].state == JobState.CANCELLED
    assert batch.read_namespaced_job(name, NS).spec.suspend
    backend.cleanup(handle)
    wait_for(lambda: backend.find(name) is None)
    assert backend.status([handle])[handle.job_id].state == JobState.LOST
    backend.cancel(handle)  # and after cleanup
    backend.cleanup(handle)


def test_cancel_where_pods_may_not_be_listed_leaves_it_to_the_suspend(k8s, kube):
    """RBAC without pod listing: cancel marks and suspends the Job, and the Job controller
    deletes the pods of a suspended Job."""
    backend = KubernetesBackend("k8s_sandbox_nopods")
    handle = _submit(backend, {"run": "sleep 60", "secrets": {"TOKEN": "x"}})
    wait_for(lambda: any(p["pod"].startswith(handle.job_name) for p in k8s.processes()))
    backend.cancel(handle)
    assert backend.status([handle])[handle.job_id].state == JobState.CANCELLED
    wait_for(lambda: not _pods(kube, handle.job_name) and not any(
        p["pod"].startswith(handle.job_name) for p in k8s.processes()))
    with pytest.raises(ApiException):
        _core(kube).read_namespaced_secret(names.secret_name(handle.job_name), NS)
    backend.cleanup(handle)


def test_a_submission_cut_short_is_finished_on_adoption(k8s, kube):
    """A worker that died after creating the (suspended) Job: the retry completes it."""
    backend = KubernetesBackend("k8s_sandbox")
    task = load_task({"run": "echo finished-by-retry", "secrets": {"S": "v"}})
    [offer] = backend.probe(task)
    name = _name("cut")
    manifest = backend.job_manifest(task, offer, name, {})
    client.BatchV1Api(kube).create_namespaced_job(NS, manifest)
    handle = backend.submit(task, offer, name, {})
    assert handle.adopted
    status = _terminal(backend, handle)
    assert status.state == JobState.SUCCEEDED, status
    assert "finished-by-retry" in backend.read_log(handle)[0]


def test_job_deleted_behind_our_back_is_lost(k8s, kube):
    backend = KubernetesBackend("k8s_sandbox")
    handle = _submit(backend, {"run": "sleep 60"})
    _until(backend, handle, [JobState.RUNNING])
    client.BatchV1Api(kube).delete_namespaced_job(handle.job_name, NS,
                                                  propagation_policy="Background")
    status = _until(backend, handle, [JobState.LOST, JobState.CANCELLED])
    assert status.state.terminal


def _namespace(api) -> str:
    name = _name("ns")
    _core(api).create_namespace({"metadata": {"name": name}})
    return name


def test_poll_is_batched_one_pod_list_per_namespace(k8s, kube):
    """N jobs in two namespaces -> per poll one Job list and one pod list per namespace.

    Own namespaces, so requests of anyone else using the sandbox are not counted."""
    extra = k8s.connections()["k8s_sandbox"]["extra"]
    spaces = [_namespace(kube), _namespace(kube)]
    backends = [KubernetesBackend("k8s_sandbox", KubernetesSettings.from_extra(
        "k8s_sandbox", {**extra, "namespace": ns})) for ns in spaces]
    handles = [_submit(backends[i % 2], {"run": "echo hi; sleep 30"}) for i in range(6)]
    assert {h.extra["namespace"] for h in handles} == set(spaces)
    backend = KubernetesBackend("k8s_sandbox")  # polls them all, wherever they run

    def mine(path_end: str) -> list[dict[str, Any]]:
        return [r for r in k8s.requests() if r["method"] == "GET"
                and any(r["path"] == f"/api{'s/batch' if path_end == 'jobs' else ''}/v1/"
                        f"namespaces/{ns}/{path_end}" for ns in spaces)]

    k8s.reset_requests()
    for _ in range(3):
        statuses = asyncio.run(backend.astatus(handles))
        assert set(statuses) == {h.job_id for h in handles}
    assert len(mine("pods")) == 3 * 2, mine("pods")
    assert len(mine("jobs")) == 3 * 2, mine("jobs")
    for h in handles:
        _until(backend, h, [JobState.RUNNING])

    async def poll_then_logs() -> dict[str, tuple[str, int]]:  # the shared poller's pattern
        await backend.astatus(handles)
        k8s.reset_requests()
        return await backend.aread_logs([(h, 0) for h in handles])

    logs = asyncio.run(poll_then_logs())
    assert all("hi" in text for text, _ in logs.values()), logs
    assert not mine("pods")  # the poll's pod list is reused
    reads = [r for r in k8s.requests() if r["path"].endswith("/log")
             and any(f"/namespaces/{ns}/" in r["path"] for ns in spaces)]
    assert len(reads) == len(handles)
    # without a poll just before: one pod list per namespace for all of them, then the logs
    k8s.reset_requests()
    asyncio.run(KubernetesBackend("k8s_sandbox").aread_logs([(h, 0) for h in handles]))
    assert len(mine("pods")) == 2, mine("pods")
    for h in handles:
        backend.cancel(h)


def test_a_namespace_that_cannot_be_listed_silences_only_its_own_jobs(k8s, kube):
    """RBAC lost in one namespace: its jobs get no answer (UNKNOWN, never "gone"); the jobs
    of the connection's other namespaces are still read (before, the whole poll failed and,
    after the silence, every job of the connection counted as lost and was placed again)."""
    from airflow_skypilot.exceptions import BackendError
    from tests.e2e.conftest import shared_dir
    from tests.sandbox.kubernetes.server import FORBIDDEN_NAMESPACE_LABEL

    extra = k8s.connections()["k8s_sandbox"]["extra"]
    ok, lost = _namespace(kube), _namespace(kube)
    marks = shared_dir()
    handles = {ns: _submit(KubernetesBackend("k8s_sandbox", KubernetesSettings.from_extra(
        "k8s_sandbox", {**extra, "namespace": ns})), {"run": f"echo ran >> {marks}/{ns}; "
                                                              "sleep 60"})
        for ns in (ok, lost)}
    backend = KubernetesBackend("k8s_sandbox")
    for h in handles.values():
        _until(backend, h, [JobState.RUNNING])

    def label(ns: str, value: str | None) -> None:
        _core(kube).patch_namespace(ns, {"metadata": {"labels": {
            FORBIDDEN_NAMESPACE_LABEL: value}}})

    label(lost, "true")
    try:
        for poll in (lambda: asyncio.run(backend.astatus(list(handles.values()))),
                     lambda: backend.status(list(handles.values()))):
            statuses = poll()
            assert statuses[handles[ok].job_id].state == JobState.RUNNING
            silent = statuses[handles[lost].job_id]
            assert silent.state == JobState.UNKNOWN, silent
            assert f"namespace {lost} could not be listed" in silent.reason
            assert "Forbidden" in silent.reason or "403" in silent.reason, silent.reason
        # a connection none of whose namespaces answers is a failed poll, as before
        with pytest.raises(BackendError):
            asyncio.run(backend.astatus([handles[lost]]))
    finally:
        label(lost, None)
    assert backend.status([handles[lost]])[handles[lost].job_id].state == JobState.RUNNING
    for ns, h in handles.items():
        backend.cancel(h)
        # the silence changed nothing of the job: its code ran once, nothing went again
        assert open(f"{marks}/{ns}").read() == "ran\n"


def test_workdir_and_file_mounts_reach_the_pod(k8s, tmp_path):
    wd = tmp_path / "wd"
    wd.mkdir()
    (wd / "train.py").write_text("print('hello from the workdir')\n")
    (tmp_path / "cfg.txt").write_text("from a file mount\n")
    backend = KubernetesBackend("k8s_sandbox")
    handle = _submit(backend, {"workdir": str(wd), "file_mounts": {
        "~/cfg/app.txt": str(tmp_path / "cfg.txt")},
        "run": "cat train.py ~/cfg/app.txt"})
    assert _terminal(backend, handle).state == JobState.SUCCEEDED
    text, _ = backend.read_log(handle)
    assert "print('hello from the workdir')" in text and "from a file mount" in text
    (wd / "big.bin").write_bytes(bytes(range(256)) * 4096 * 2)  # 2 MiB of poor entropy
    (wd / "noise.bin").write_bytes(os.urandom(1024 * 1024))
    [offer] = backend.probe(load_task({"workdir": str(wd), "run": "true"}))
    assert not offer.fits and "a Secret takes at most" in offer.reason


def test_a_relative_file_mount_is_in_the_pods_cwd_and_under_sky_workdir(k8s, tmp_path):
    """SkyPilot puts a relative destination under ~/sky_workdir, its workdir and the cwd of
    setup and run; here it was unpacked under $HOME, and ~/sky_workdir did not exist. Each
    pod (node) has its own."""
    data = tmp_path / "data"
    (data / "deep").mkdir(parents=True)
    (data / "deep" / "f.txt").write_text("from a dir mount\n")
    (tmp_path / "one.cfg").write_text("from a file mount\n")
    backend = KubernetesBackend("k8s_sandbox")
    check = ("test -f relative_dir/deep/f.txt && test -f ~/sky_workdir/relative_dir/deep/f.txt"
             " && cat conf/one.cfg && test ! -e ~/relative_dir && "
             'test "$(cd ~/sky_workdir && pwd -P)" = "$(pwd -P)" && '
             'echo "found-it-$SKYPILOT_NODE_RANK"')
    handle = _submit(backend, {"num_nodes": 2, "resources": {"accelerators": "A100:1"},
                               "file_mounts": {"relative_dir": str(data),
                                               "./conf/one.cfg": str(tmp_path / "one.cfg")},
                               "setup": "test -f relative_dir/deep/f.txt", "run": check})
    status = _terminal(backend, handle)
    text, _ = backend.read_log(handle)
    assert status.state == JobState.SUCCEEDED, text
    assert "found-it-0" in text and "(rank 1) found-it-1" in text
    assert text.count("from a file mount") == 2
    backend.cleanup(handle)


def test_a_secret_filled_into_a_mount_path_reaches_the_pod_as_a_reference(k8s, kube,
                                                                          tmp_path):
    """SkyPilot fills secrets into file_mounts; main.sh, in the ConfigMap, names the secret
    and the pod expands it from its env (the task's Secret)."""
    (tmp_path / "cfg.txt").write_text("from a secret path\n")
    backend = KubernetesBackend("k8s_sandbox")
    # secrets named like main.sh's variables once were (ROOT, JOB_DIR) are the task's own
    handle = _submit(backend, {"secrets": {"KEY": "s3cr3tval", "ROOT": "team", "JOB_DIR": "j"},
                               "file_mounts": {"~/cfg-$KEY/app.txt": str(tmp_path / "cfg.txt"),
                                               "~/by-$ROOT/app.txt": str(tmp_path / "cfg.txt")},
                               "run": 'cat ~/cfg-"$KEY"/app.txt ~/by-team/app.txt && '
                                      'test "$ROOT/$JOB_DIR" = team/j && echo names-kept'})
    assert _terminal(backend, handle).state == JobState.SUCCEEDED, backend.read_log(handle)
    text, _ = backend.read_log(handle)
    assert text.count("from a secret path") == 2 and "names-kept" in text
    cm = _core(kube).read_namespaced_config_map(names.configmap_name(handle.job_name), NS)
    assert cm.data["main.sh"] and "s3cr3tval" not in json.dumps(cm.data)
    backend.cleanup(handle)


def test_operator_side_status_has_no_event_loop_per_call(k8s):
    """``status`` is the sync path (the worker): it must work inside a running event loop's
    thread too, where ``asyncio.run`` would fail."""
    backend = KubernetesBackend("k8s_sandbox")
    handle = _submit(backend, {"run": "true"})

    async def inside_a_loop() -> JobStatus:
        return backend.status([handle])[handle.job_id]

    assert asyncio.run(inside_a_loop()).state in set(JobState)
    assert _terminal(backend, handle).state == JobState.SUCCEEDED


def test_jobs_can_be_watched_where_pods_may_not_be_listed(k8s):
    """RBAC that allows Jobs but not pod listing: the Job's own status has to do."""
    backend = KubernetesBackend("k8s_sandbox_nopods")
    handle = _submit(backend, {"run": "sleep 2"})
    running = _until(backend, handle, [JobState.RUNNING, JobState.SUCCEEDED], use_poll=True)
    assert "pods may not be listed" in running.raw_state or running.state.terminal
    assert _terminal(backend, handle, use_poll=True).state == JobState.SUCCEEDED
    failing = _submit(backend, {"run": "exit 3"})
    status = _terminal(backend, failing)
    assert status.state == JobState.FAILED and not status.state.infra_failure


def test_the_trigger_watches_a_kubernetes_job_to_the_end(k8s):
    """The shared poller's pattern (poll, then aread_log per job) end to end."""
    from airflow_skypilot.triggers.skypilot import SkyPilotJobTrigger

    backend = KubernetesBackend("k8s_sandbox")
    handles = [_submit(backend, {"run": f'echo "hello from job {i}"; sleep 1; exit {i}'})
               for i in range(2)]

    async def watch(handle: JobHandle) -> dict[str, Any]:
        trigger = SkyPilotJobTrigger(handle.to_dict(), poll_interval=0.3)
        async for event in trigger.run():
            return event.payload
        raise AssertionError("no event")

    async def both() -> list[dict[str, Any]]:
        return await asyncio.wait_for(asyncio.gather(*(watch(h) for h in handles)), 60)

    events = asyncio.run(both())
    for i, event in enumerate(events):
        assert event["status"] == "done", event
        status = JobStatus.from_dict(event["job_status"])
        assert status.state == (JobState.SUCCEEDED if i == 0 else JobState.FAILED)
        assert f"hello from job {i}" in event["log_tail"]
        assert event["log_offset"] > 0
