"""Reviewed Kubernetes bugs: credentials in a ConfigMap, pod_config reading Secrets, /dev/shm,
object sizes, the namespace fallback and log reads across rotation and deleted pods."""

from __future__ import annotations

import base64
import io
import json
import tarfile

import pytest

from airflow_skypilot.backends.base import JobHandle, Offer
from airflow_skypilot.backends.kubernetes import (
    KubernetesBackend,
    KubernetesSettings,
    bundle,
    names,
    settings,
    submit,
)
from airflow_skypilot.backends.kubernetes import logs as klogs
from airflow_skypilot.exceptions import SubmissionError
from airflow_skypilot.spec import load_task, podsecurity


def _backend(**kw) -> KubernetesBackend:
    return KubernetesBackend("k", settings=KubernetesSettings(context="ctx", namespace="ns", **kw))


def _offer(task) -> Offer:
    return Offer(connection="k", backend="kubernetes", location="ctx/ns", infra="kubernetes/ctx",
                 request=task.candidates[0], num_nodes=task.num_nodes, details={})


def _objects(task, name="sky-x"):
    b, o, env = _backend(), _offer(task), {"SKYPILOT_TASK_ID": "tid"}
    job = b.job_manifest(task, o, name, env)
    deps = b.dependents(task, o, name, env, bundle.bundle(task),
                        {"metadata": {"name": name, "uid": "u"}})
    return job, deps


# --- 1. workdir and file_mounts travel in a Secret -------------------------------------------


def test_file_mounts_travel_in_a_secret_never_in_the_configmap(tmp_path):
    cred = tmp_path / "credentials"
    cred.write_text("aws_secret_access_key = TOPSECRET\n")
    (tmp_path / "wd").mkdir()
    (tmp_path / "wd" / "a.py").write_text("print(1)\n")
    task = load_task({"run": "true", "workdir": str(tmp_path / "wd"),
                      "file_mounts": {"~/.aws/credentials": str(cred)}})
    job, deps = _objects(task)
    [cm] = [d for d in deps if d["kind"] == "ConfigMap"]
    assert not any(k.endswith(".b64") for k in cm["data"])
    [sec] = [d for d in deps if d["metadata"]["name"] == names.bundle_name("sky-x")]
    assert sec["kind"] == "Secret"
    assert sec["metadata"]["ownerReferences"][0]["uid"] == "u"
    found = b""
    for value in sec["data"].values():
        tgz = base64.b64decode(base64.b64decode(value))
        with tarfile.open(fileobj=io.BytesIO(tgz)) as tar:
            for member in tar.getmembers():
                if member.isfile():
                    found += tar.extractfile(member).read()
    assert b"TOPSECRET" in found
    assert "TOPSECRET" not in json.dumps(cm)
    pod = job["spec"]["template"]["spec"]
    vol = {v["name"]: v for v in pod["volumes"]}["skypilot-bundle"]
    assert vol["secret"]["secretName"] == names.bundle_name("sky-x")
    assert any(m["name"] == "skypilot-bundle" for m in pod["containers"][0]["volumeMounts"])


def test_a_secret_filled_into_a_mount_path_is_not_in_the_configmap(tmp_path):
    """main.sh (ConfigMap, readable with the view role) unpacks into the mount's path: a
    secret SkyPilot filled into it is written as a reference to the pod's env."""
    (tmp_path / "f.txt").write_text("x")
    task = load_task({"run": "true", "secrets": {"KEY": None},
                      "file_mounts": {"/data-$KEY/f.txt": str(tmp_path / "f.txt")}},
                     secrets={"KEY": "s3cr3tval"})
    _, deps = _objects(task)
    [cm] = [d for d in deps if d["kind"] == "ConfigMap"]
    assert "s3cr3tval" not in json.dumps(cm)
    assert '"$AIRFLOW_SKYPILOT_ROOT"/data-"${KEY}"' in cm["data"]["main.sh"]


def test_a_task_without_files_has_no_bundle_secret():
    job, deps = _objects(load_task({"run": "true"}))
    assert [d["kind"] for d in deps] == ["ConfigMap"]
    assert "skypilot-bundle" not in {v["name"] for v in job["spec"]["template"]["spec"]["volumes"]}


class _Calls:
    def __init__(self, job):
        from types import SimpleNamespace

        self.job, self.calls = job, []
        api = SimpleNamespace(**{n: n for n in (
            "read_namespaced_job", "list_namespaced_pod", "delete_namespaced_secret",
            "delete_namespaced_config_map", "delete_namespaced_service",
            "delete_namespaced_job")})
        self._apis = (api, api)

    def apis(self):
        return self._apis

    def call(self, fn, *args, **kw):
        self.calls.append((fn, args[0] if args else None))
        return self.job if fn == "read_namespaced_job" else {"items": []}


def test_cleanup_of_an_ended_job_deletes_the_files_secret_too():
    ended = {"metadata": {"name": "j", "uid": "u", "annotations": {}}, "spec": {},
             "status": {"conditions": [{"type": "Failed", "status": "True"}]}}
    fake = _Calls(ended)
    assert submit.cleanup(fake, "ns", "j") is None
    assert ("delete_namespaced_secret", "j-secrets") in fake.calls
    assert ("delete_namespaced_secret", names.bundle_name("j")) in fake.calls
    assert not any(fn == "delete_namespaced_job" for fn, _ in fake.calls)  # kept for its logs


# --- 2. pod_config may not read the namespace's Secrets --------------------------------------

SECRET_READS = {
    "secret volume": ({"volumes": [{"name": "s", "secret": {"secretName": "other"}}]},
                      "volumes[0].secret"),
    "envFrom": ({"containers": [{"envFrom": [{"secretRef": {"name": "ci-token"}}]}]},
                "envFrom[0].secretRef"),
    "secretKeyRef": ({"containers": [{"env": [{"name": "T", "valueFrom": {
        "secretKeyRef": {"name": "x", "key": "k"}}}]}]}, "secretKeyRef"),
    "projected secret": ({"volumes": [{"name": "p", "projected": {"sources": [
        {"secret": {"name": "x"}}]}}]}, "projected.sources[0].secret"),
    "projected token": ({"volumes": [{"name": "p", "projected": {"sources": [
        {"serviceAccountToken": {"path": "t"}}]}}]}, "serviceAccountToken"),
    "csi secret": ({"volumes": [{"name": "c", "csi": {"driver": "d", "nodePublishSecretRef": {
        "name": "x"}}}]}, "nodePublishSecretRef"),
}


@pytest.mark.parametrize("case", sorted(SECRET_READS))
def test_pod_config_reading_a_secret_is_refused_unless_the_connection_allows(case):
    spec, field = SECRET_READS[case]
    pc = {"spec": spec}
    assert podsecurity.refused(pc)
    task = load_task({"run": "true", "config": {"kubernetes": {"pod_config": pc}}})
    why = KubernetesSettings(context="c").pod_config_refusal(task)
    assert field in why and podsecurity.ALLOW_EXTRA in why
    allowed = KubernetesSettings(context="c", allow_privileged_pod_config=True)
    assert allowed.pod_config_refusal(task) == ""


def test_pod_config_configmaps_and_plain_env_still_pass():
    pc = {"spec": {"containers": [{"envFrom": [{"configMapRef": {"name": "cfg"}}],
                                   "env": [{"name": "A", "value": "b"}]}],
                   "volumes": [{"name": "c", "configMap": {"name": "cfg"}},
                               {"name": "p", "projected": {"sources": [
                                   {"configMap": {"name": "cfg"}}]}}]}}
    assert podsecurity.refused(pc) == []


# --- 3. /dev/shm -----------------------------------------------------------------------------


def _pod(task):
    return _objects(task)[0]["spec"]["template"]["spec"]


def test_dev_shm_is_memory_backed():
    pod = _pod(load_task({"run": "true"}))
    [mount] = [m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    [vol] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert vol["emptyDir"] == {"medium": "Memory"}


def test_a_pod_config_dshm_replaces_ours_by_name():
    pc = {"spec": {"volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory",
                                                            "sizeLimit": "8Gi"}},
                               {"name": "skypilot-files", "emptyDir": {}}],
                   "containers": [{"volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"},
                                                    {"name": "extra", "mountPath": "/x"}]}]}}
    pod = _pod(load_task({"run": "true", "config": {"kubernetes": {"pod_config": pc}}}))
    vols = [v["name"] for v in pod["volumes"]]
    assert vols.count("dshm") == 1 and vols.count("skypilot-files") == 1
    assert {v["name"]: v for v in pod["volumes"]}["dshm"]["emptyDir"]["sizeLimit"] == "8Gi"
    assert {v["name"]: v for v in pod["volumes"]}["skypilot-files"].get("configMap")
    paths = [m["mountPath"] for m in pod["containers"][0]["volumeMounts"]]
    assert paths.count("/dev/shm") == 1 and "/x" in paths


def test_a_pod_config_shm_mount_of_another_name_replaces_ours_by_path():
    pc = {"spec": {"volumes": [{"name": "shm", "emptyDir": {"medium": "Memory"}}],
                   "containers": [{"volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}]}]}}
    pod = _pod(load_task({"run": "true", "config": {"kubernetes": {"pod_config": pc}}}))
    mounts = [m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert [m["name"] for m in mounts] == ["shm"]


# --- 4. sizes of everything that goes in the objects -----------------------------------------


class _NoCalls:
    def apis(self):
        raise AssertionError("nothing may be sent")

    def call(self, *a, **kw):
        raise AssertionError("nothing may be sent")


def test_scripts_and_envs_too_large_for_the_configmap_fail_before_the_job_is_created(
        monkeypatch, tmp_path):
    run = "\n".join(f"echo step {i} " + "x" * 60 for i in range(4000))
    task = load_task({"run": run, "envs": {"CFG": "y" * 900_000}})
    assert bundle.check(task, bundle.DEFAULT_BUNDLE_LIMIT) == ""
    b = _backend()
    monkeypatch.setattr(submit, "get_job", lambda *a: None)
    monkeypatch.setattr(submit, "create_job", lambda *a: pytest.fail("Job created"))
    b.client = _NoCalls()
    with pytest.raises(SubmissionError, match="ConfigMap .* KiB") as info:
        b.submit(task, _offer(task), "sky-big", {"SKYPILOT_TASK_ID": "t"})
    assert info.value.retry_elsewhere


# --- 5. namespace fallback -------------------------------------------------------------------


def test_namespace_falls_back_to_the_pod_then_the_kubeconfig_context(monkeypatch, tmp_path):
    ns_file = tmp_path / "namespace"
    ns_file.write_text("airflow-ns\n")
    monkeypatch.setattr(settings, "INCLUSTER_NAMESPACE", str(ns_file))
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    s = KubernetesSettings.from_extra
    assert s("c", {"in_cluster": True}).namespace == "airflow-ns"
    assert s("c", {"in_cluster": True, "namespace": "mine"}).namespace == "mine"
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert s("c", {}).namespace == "default"  # not in a pod, no kubeconfig
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    assert s("c", {}).namespace == "airflow-ns"  # in a pod: the hook tries in-cluster first
    kubeconfig = {"current-context": "a", "contexts": [
        {"name": "a", "context": {"cluster": "x", "namespace": "team-a"}},
        {"name": "b", "context": {"cluster": "x", "namespace": "team-b"}},
        {"name": "c", "context": {"cluster": "x"}}]}
    path = tmp_path / "config"
    path.write_text(json.dumps(kubeconfig))
    assert s("c", {"kube_config_path": str(path)}).namespace == "team-a"
    assert s("c", {"kube_config_path": str(path), "cluster_context": "b"}).namespace == "team-b"
    assert s("c", {"kube_config": json.dumps(kubeconfig),
                   "cluster_context": "c"}).namespace == "default"
    monkeypatch.setenv("KUBECONFIG", str(path))
    assert s("c", {}).namespace == "airflow-ns"  # in a pod with a kubeconfig: in-cluster
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
    assert s("c", {}).namespace == "team-a"
    ns_file.unlink()
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    assert s("c", {}).namespace == "default"


# --- 6. logs ---------------------------------------------------------------------------------


def _kpod(name, rank, phase):
    return {"metadata": {"name": name, "labels": {names.INDEX_KEY: str(rank),
                                                  names.LABEL_JOB: "j"},
                         "creationTimestamp": "2025-01-01T00:00:00Z"},
            "spec": {"nodeName": "n"},
            "status": {"phase": phase, "startTime": "2025-01-01T00:00:01Z"}}


class _Logs:
    def __init__(self, logs):
        self.logs, self.read = logs, []

    def apis(self):
        return None, None

    def pod_log(self, core, ns, name, limit=None):
        self.read.append(name)
        data = self.logs.get(name, b"")
        return data[:limit] if limit else data


def _handle(n):
    return JobHandle(backend="kubernetes", connection="k", job_id="j", job_name="j",
                     location="c/n", infra="kubernetes/c", num_nodes=n)


def _drain(client, handle, offset, pods):
    out = ""
    while True:
        text, offset = klogs.read(client, "n", handle, offset, pods)
        if not text:
            return out, offset
        out += text


def test_a_rotated_rank0_log_is_followed_again():
    fake = _Logs({"j-0": b"".join(b"old %06d\n" % i for i in range(200_000))})
    pods = [_kpod("j-0", 0, "Running")]
    _, offset = _drain(fake, _handle(1), 0, pods)
    fake.logs["j-0"] = b"new 1\nnew 2\n"  # the kubelet rotated: the newest file only
    text, offset2 = klogs.read(fake, "n", _handle(1), offset, pods)
    assert text == klogs.ROTATED + "new 1\nnew 2\n" and offset2 == 12
    fake.logs["j-0"] += b"new 3\n"
    assert klogs.read(fake, "n", _handle(1), offset2, pods) == ("new 3\n", 18)
    tail, _ = klogs.read(fake, "n", _handle(1), max(0, offset - 32768), pods)
    assert tail.splitlines()[-2:] == ["new 2", "new 3"]


def test_an_unanswered_log_read_is_not_a_rotation():
    fake = _Logs({"j-0": b"a\nb\n"})
    pods = [_kpod("j-0", 0, "Running")]
    fake.logs["j-0"] = b""  # the API said nothing (pod_log's errors read as b"")
    assert klogs.read(fake, "n", _handle(1), 4, pods) == ("", 4)


def test_another_rank_is_never_read_as_rank0_and_its_failure_shows_once():
    fake = _Logs({"j-0": b"step\n" * 10,
                  "j-1": b"starting\nRuntimeError: CUDA out of memory\n"})
    running = [_kpod("j-0", 0, "Running"), _kpod("j-1", 1, "Running")]
    text, offset = klogs.read(fake, "n", _handle(2), 0, running)
    assert offset == 50
    # rank 0's pod deleted by the Job controller; rank 1 still running: nothing is read
    assert klogs.read(fake, "n", _handle(2), offset, [_kpod("j-1", 1, "Running")]) == \
        ("", offset)
    assert "j-1" not in fake.read
    ended = [_kpod("j-1", 1, "Failed")]
    text, offset2 = klogs.read(fake, "n", _handle(2), offset, ended)
    assert text.startswith(klogs.RANK0_GONE)
    assert "(rank 1) RuntimeError: CUDA out of memory" in text
    assert klogs.read(fake, "n", _handle(2), offset2, ended) == ("", offset2)  # never twice
    tail, _ = klogs.read(fake, "n", _handle(2), max(0, offset2 - 32768), ended)
    assert tail.splitlines()[-1] == "(rank 1) RuntimeError: CUDA out of memory"


def test_the_async_read_recovers_the_same_way():
    import asyncio
    from contextlib import asynccontextmanager

    class _Async(_Logs):
        @asynccontextmanager
        async def asession(self):
            yield None, None

        async def apod_log(self, core, ns, name, limit=None):
            return self.pod_log(core, ns, name, limit)

    fake = _Async({"j-0": b"x\n" * 100, "j-1": b"boom\n"})
    h = _handle(2)
    out = asyncio.run(klogs.aread_many(fake, [(h, 150)], {"j": [_kpod("j-0", 0, "Running")]},
                                       "n"))
    assert out["j"] == ("x\n" * 25, 200)
    fake.logs["j-0"] = b"y\n"
    out = asyncio.run(klogs.aread_many(fake, [(h, 150)], {"j": [_kpod("j-0", 0, "Running")]},
                                       "n"))
    assert out["j"] == (klogs.ROTATED + "y\n", 2)
    out = asyncio.run(klogs.aread_many(fake, [(h, 150)], {"j": [_kpod("j-1", 1, "Failed")]},
                                       "n"))
    assert out["j"][0] == klogs.RANK0_GONE + "(rank 1) boom\n"
