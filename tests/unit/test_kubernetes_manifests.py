"""What the Kubernetes backend sends and how it reads answers, without a cluster.

Every manifest is checked against the OpenAPI schema of a current Kubernetes release
(``kubernetes-validate``, strict: unknown fields fail), since the sandbox's emulator does not
validate. The pod's entry script is run with the real bash, rooted in a temp dir exactly as the
test kubelet roots a pod, and the status mapping is fed the shapes a real API server returns
(evicted pods that are already deleted, Job conditions of the pod failure policy, ...).
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import time
from datetime import UTC, datetime

import kubernetes_validate
import pytest

from airflow_skypilot.backends.base import JobState, Offer
from airflow_skypilot.backends.common import jobscript
from airflow_skypilot.backends.kubernetes import (
    KubernetesBackend,
    KubernetesSettings,
    bundle,
    job_status,
    names,
)
from airflow_skypilot.backends.kubernetes import manifests as m
from airflow_skypilot.backends.kubernetes.cluster import ClusterView, NodeView, cluster_view
from airflow_skypilot.backends.kubernetes.logs import join_logs, log_plan, slice_log
from airflow_skypilot.exceptions import ConfigurationError
from airflow_skypilot.spec import load_task

K8S_VERSION = kubernetes_validate.utils.latest_version()  # newest bundled: 1.37 today

NASTY = {
    "SPACES": "a  b   c",
    "QUOTES": "it's \"quoted\" `tick`",
    "SUBST": "$(echo pwned) ${HOME} $HOME $$ $(VAR)",
    "NEWLINES": "line1\nline2\n\nline4\n",
    "BACKSLASH": "back\\slash \\n not a newline",
    "UNICODE": "naïve ☃ 日本",
    "EMPTY": "",
}


def _settings(**kw) -> KubernetesSettings:
    base = {"context": "ctx", "namespace": "team-a"}
    base.update(kw)
    return KubernetesSettings(**base)


def _backend(**kw) -> KubernetesBackend:
    return KubernetesBackend("k8s_test", settings=_settings(**kw))


def _offer(task, **details) -> Offer:
    return Offer(connection="k8s_test", backend="kubernetes", location="ctx/team-a",
                 infra="kubernetes/ctx", request=task.candidates[0], num_nodes=task.num_nodes,
                 details=details)


def _objects(backend, task, offer, name="sky-job-1", env=None, files=None):
    env = env if env is not None else {"SKYPILOT_TASK_ID": "sky-task-1"}
    job = backend.job_manifest(task, offer, name, env)
    owner = {"metadata": {"name": name, "uid": "0f0f0f0f-1111-2222-3333-444444444444"}}
    deps = backend.dependents(task, offer, name, env, files or bundle.bundle(task), owner)
    # the files' Secret is "Bundle" here (the task's secrets are "Secret")
    return job, {"Bundle" if d["metadata"]["name"] == names.bundle_name(name) else d["kind"]: d
                 for d in deps}


def _validate(obj) -> None:
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


# --- schema ---------------------------------------------------------------------------------

CASES = {
    "single-cpu": {"run": "echo hi"},
    "single-gpu-secrets": {"run": "nvidia-smi", "secrets": {"HF_TOKEN": "hf_abc"},
                           "resources": {"accelerators": "A100:4", "cpus": "8+",
                                         "memory": "32.5", "image_id": "docker:nvcr.io/x:1"}},
    "multi-node": {"num_nodes": 3, "setup": "pip install x", "run": "torchrun ...",
                   "envs": NASTY, "secrets": {"WANDB_API_KEY": "w"},
                   "resources": {"accelerators": "H100:8", "cpus": 0.5, "memory": "3x"}},
    "volumes-pod-config": {"run": "ls /data", "volumes": {"/data": "datasets-pvc"},
                           "config": {"kubernetes": {"pod_config": {"spec": {
                               "imagePullSecrets": [{"name": "regcred"}],
                               "containers": [{"env": [{"name": "EXTRA", "value": "1"}]}]}}}}},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_manifest_matches_the_kubernetes_schema(case):
    task = load_task(CASES[case])
    backend = _backend(tolerations=[{"key": "team", "operator": "Equal", "value": "a",
                                     "effect": "NoSchedule"}],
                       node_selector={"pool": "batch"}, service_account="runner",
                       priority_class="batch-low")
    offer = _offer(task, node_selector={"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
                   tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists"}])
    job, deps = _objects(backend, task, offer)
    _validate(job)
    for obj in deps.values():
        _validate(obj)
    assert set(deps) == {"ConfigMap"} | ({"Secret"} if task.secrets else set()) | (
        {"Service"} if task.num_nodes > 1 else set())


def test_the_schema_check_is_strict():
    """A sanity check of the check itself: a misspelt field must fail it."""
    task = load_task({"run": "true"})
    job, _ = _objects(_backend(), task, _offer(task))
    job["spec"]["template"]["spec"]["restartPolicyy"] = "Never"
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(job)
    job, _ = _objects(_backend(), task, _offer(task))
    job["spec"]["backoffLimit"] = "0"
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(job)


def test_manifest_with_a_workdir_matches_the_schema(tmp_path):
    (tmp_path / "wd").mkdir()
    (tmp_path / "wd" / "train.py").write_text("print('hi')\n")
    (tmp_path / "cfg.yaml").write_text("a: 1\n")
    task = load_task({"workdir": str(tmp_path / "wd"), "run": "python train.py",
                      "file_mounts": {"/etc/app/config.yaml": str(tmp_path / "cfg.yaml")}})
    job, deps = _objects(_backend(), task, _offer(task))
    _validate(deps["ConfigMap"])
    _validate(deps["Bundle"])
    _validate(job)
    assert {"workdir.tgz.b64", "mount-0.tgz.b64"} <= set(deps["Bundle"]["data"])


# --- what goes where ------------------------------------------------------------------------


def test_secrets_are_never_in_the_job_configmap_or_annotations():
    secret_value = "s3cr3t-VALUE-never-in-clear"
    task = load_task({"run": "echo", "envs": {"PUBLIC": "p"},
                      "secrets": {"API_KEY": secret_value, "PUBLIC": secret_value}})
    job, deps = _objects(_backend(), task, _offer(task))
    in_clear = json.dumps(job) + json.dumps(deps["ConfigMap"])
    assert secret_value not in in_clear
    assert base64.b64encode(secret_value.encode()).decode() not in json.dumps(job)
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["envFrom"] == [{"secretRef": {"name": "sky-job-1-secrets"}}]
    assert "API_KEY" not in json.dumps(container.get("env"))
    secret = deps["Secret"]
    assert secret["type"] == "Opaque"
    assert base64.b64decode(secret["data"]["API_KEY"]).decode() == secret_value
    # a secret of the same name as an env wins: env.sh does not set it (only names the
    # secrets whose values node.sh masks in the output)
    assert "export PUBLIC=" not in deps["ConfigMap"]["data"]["env.sh"]
    # owned by the Job: garbage collected with it
    assert secret["metadata"]["ownerReferences"][0]["kind"] == "Job"
    assert secret["metadata"]["ownerReferences"][0]["uid"]


def test_no_user_text_reaches_a_field_kubernetes_expands():
    """Kubernetes expands ``$(VAR)`` in env values, command and args: none carry user text."""
    task = load_task({"run": "echo $(whoami)", "envs": NASTY})
    job, deps = _objects(_backend(), task, _offer(task))
    text = json.dumps(job)
    assert "$(" not in text
    assert "whoami" not in text
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["/bin/bash", "-c", m.BOOTSTRAP]
    assert deps["ConfigMap"]["data"]["run.sh"] == jobscript.PROLOGUE + "echo $(whoami)\n"


def test_labels_make_the_job_and_its_pods_findable():
    task = load_task({"num_nodes": 2, "run": "true"})
    job, deps = _objects(_backend(), task, _offer(task), name="sky-find-me-a0")
    want = {names.LABEL_JOB: "sky-find-me-a0", names.LABEL_MANAGED: names.MANAGED_BY}
    assert want.items() <= job["metadata"]["labels"].items()
    assert want.items() <= job["spec"]["template"]["metadata"]["labels"].items()
    for obj in deps.values():
        assert want.items() <= obj["metadata"]["labels"].items()
    svc = deps["Service"]
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"].items() <= job["spec"]["template"]["metadata"]["labels"].items()
    assert job["spec"]["template"]["spec"]["subdomain"] == svc["metadata"]["name"]
    # the capacity model reads its ranks' anti-affinity: never two on one node
    from airflow_skypilot.backends.kubernetes.queue import spread_key

    template = job["spec"]["template"]
    assert spread_key(template["spec"], template["metadata"]["labels"]) == \
        f"{names.LABEL_JOB}=sky-find-me-a0"


def test_indexed_job_for_several_nodes_plain_job_for_one():
    multi = load_task({"num_nodes": 4, "run": "true"})
    job, _ = _objects(_backend(), multi, _offer(multi))
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == 4
    assert spec["backoffLimit"] == 0
    assert spec["suspend"] is True  # resumed once its ConfigMap and Secret exist
    assert spec["template"]["spec"]["restartPolicy"] == "Never"
    anti = spec["template"]["spec"]["affinity"]["podAntiAffinity"]
    assert anti["requiredDuringSchedulingIgnoredDuringExecution"][0]["topologyKey"] == \
        "kubernetes.io/hostname"
    rules = spec["podFailurePolicy"]["rules"]
    assert rules[0]["onPodConditions"][0]["type"] == "DisruptionTarget"
    single = load_task({"run": "true"})
    job, deps = _objects(_backend(), single, _offer(single))
    assert "completionMode" not in job["spec"]
    assert "subdomain" not in job["spec"]["template"]["spec"]
    assert "Service" not in deps


def test_gpu_limits_requests_and_node_selectors():
    task = load_task({"run": "true", "resources": {"accelerators": "A100:2", "cpus": "4+",
                                                   "memory": "16.5"}})
    backend = _backend(node_selector={"pool": "gpu"},
                       tolerations=[{"key": "dedicated", "operator": "Exists"}])
    offer = _offer(task, node_selector={"skypilot.co/accelerator": "a100"})
    job, _ = _objects(backend, task, offer)
    pod = job["spec"]["template"]["spec"]
    resources = pod["containers"][0]["resources"]
    assert resources["limits"] == {"nvidia.com/gpu": "2"}
    assert resources["requests"] == {"cpu": "4", "memory": "16896Mi"}
    assert pod["nodeSelector"] == {"pool": "gpu", "skypilot.co/accelerator": "a100"}
    keys = [t["key"] for t in pod["tolerations"]]
    assert keys == ["dedicated", "nvidia.com/gpu"]
    assert job["metadata"]["annotations"]["skypilot.airflow/gpus-per-node"] == "2"
    cpu_only = load_task({"run": "true", "resources": {"cpus": 0.5}})
    job, _ = _objects(_backend(), cpu_only, _offer(cpu_only))
    resources = job["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert resources == {"requests": {"cpu": "500m"}}


def test_image_from_image_id_or_the_connection_default():
    task = load_task({"run": "true", "resources": {"image_id": "docker:ghcr.io/me/train:2"}})
    job, _ = _objects(_backend(image="busybox:1"), task, _offer(task))
    assert job["spec"]["template"]["spec"]["containers"][0]["image"] == "ghcr.io/me/train:2"
    task = load_task({"run": "true"})
    job, _ = _objects(_backend(image="busybox:1"), task, _offer(task))
    assert job["spec"]["template"]["spec"]["containers"][0]["image"] == "busybox:1"


def test_pod_config_merges_but_cannot_rewire_the_job():
    task = load_task({"run": "true", "config": {"kubernetes": {"pod_config": {
        "metadata": {"labels": {"team": "a", names.LABEL_JOB: "hijack"}},
        "spec": {"imagePullSecrets": [{"name": "regcred"}], "restartPolicy": "Always",
                 "containers": [{"command": ["sh"], "env": [{"name": "X", "value": "1"}]}]}}}}})
    job, _ = _objects(_backend(), task, _offer(task), name="sky-pc")
    tmpl = job["spec"]["template"]
    assert tmpl["metadata"]["labels"]["team"] == "a"
    assert tmpl["metadata"]["labels"][names.LABEL_JOB] == "sky-pc"
    assert tmpl["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert tmpl["spec"]["restartPolicy"] == "Never"
    container = tmpl["spec"]["containers"][0]
    assert container["command"][0] == "/bin/bash"
    assert {"name": "X", "value": "1"} in container["env"]


# --- the pod's scripts, run with bash as the test kubelet runs them --------------------------


def _run_pod(tmp_path, task, rank: int | None, name="sky-job-1", extra_env=None):
    """Materialise the ConfigMap where the pod would see it and run the container command."""
    backend = _backend()
    job, deps = _objects(backend, task, _offer(task), name=name)
    root = tmp_path / f"root{rank}"
    files = root / m.FILES_MOUNT.lstrip("/")
    files.mkdir(parents=True)
    for key, value in deps["ConfigMap"]["data"].items():
        (files / key).write_text(value)
    if "Bundle" in deps:  # the Secret's files, decoded, as the kubelet writes them
        bundled = root / m.BUNDLE_MOUNT.lstrip("/")
        bundled.mkdir(parents=True)
        for key, value in deps["Bundle"]["data"].items():
            (bundled / key).write_bytes(base64.b64decode(value))
    (root / "home").mkdir()
    env = {"PATH": os.environ["PATH"], "HOME": str(root / "home"),
           "SANDBOX_MOUNT_ROOT": str(root), "HOSTNAME": f"{name}-{rank or 0}",
           "AIRFLOW_SKYPILOT_POD_IP": "10.1.2.3"}
    if rank is not None:
        env["JOB_COMPLETION_INDEX"] = str(rank)
    if "Secret" in deps:
        env.update({k: base64.b64decode(v).decode() for k, v in deps["Secret"]["data"].items()})
    env.update(extra_env or {})
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=30,
                          cwd=root), root


def test_envs_and_secrets_arrive_byte_for_byte(tmp_path):
    dump = "; ".join(f'printf "%s" "${k}" | base64 -w0; echo' for k in [*NASTY, "TOKEN"])
    task = load_task({"run": dump, "envs": NASTY, "secrets": {"TOKEN": "t $(x) 'y'\nz"}})
    proc, _ = _run_pod(tmp_path, task, rank=None)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()[1:]
    got = [base64.b64decode(line).decode() for line in lines]
    assert got == [*NASTY.values(), "t $(x) 'y'\nz"]


def test_skypilot_env_in_setup_and_run_of_each_rank(tmp_path):
    task = load_task({
        "num_nodes": 2, "resources": {"accelerators": "A100:2"},
        "setup": 'echo "setup rank=$SKYPILOT_SETUP_NODE_RANK"',
        "run": 'echo "rank=$SKYPILOT_NODE_RANK n=$SKYPILOT_NUM_NODES '
               'g=$SKYPILOT_NUM_GPUS_PER_NODE id=$SKYPILOT_TASK_ID"\n'
               'printf "%s" "$SKYPILOT_NODE_IPS" | base64 -w0; echo\npwd'})
    for rank in (0, 1):
        proc, root = _run_pod(tmp_path, task, rank=rank, name="sky-two")
        assert proc.returncode == 0, proc.stderr
        out = proc.stdout.splitlines()
        assert f"setup rank={rank}" in out
        assert f"rank={rank} n=2 g=2 id=sky-task-1" in out
        ips = base64.b64decode(out[out.index(f"rank={rank} n=2 g=2 id=sky-task-1") + 1]).decode()
        assert ips == ("sky-two-0.sky-two.team-a.svc.cluster.local\n"
                       "sky-two-1.sky-two.team-a.svc.cluster.local")
        assert out[-1] == str(root / m.WORKDIR_MOUNT.lstrip("/"))


def test_failed_setup_skips_run_and_keeps_its_exit_code(tmp_path):
    task = load_task({"setup": "exit 7", "run": "echo should-not-run"})
    proc, _ = _run_pod(tmp_path, task, rank=None)
    assert proc.returncode == 7
    assert "should-not-run" not in proc.stdout
    assert "setup failed with exit code 7" in proc.stderr


def test_workdir_and_file_mounts_are_unpacked(tmp_path):
    wd = tmp_path / "wd"
    (wd / "pkg").mkdir(parents=True)
    (wd / "pkg" / "a.txt").write_text("from workdir\n")
    (wd / "skip.log").write_text("ignored\n")
    (wd / ".skyignore").write_text("*.log\n")
    (wd / ".git").mkdir()
    (wd / ".git" / "HEAD").write_text("ref\n")
    data = tmp_path / "data"
    data.mkdir()
    (data / "d.txt").write_text("from a dir mount\n")
    (tmp_path / "one.cfg").write_text("from a file mount\n")
    task = load_task({"workdir": str(wd), "file_mounts": {
        "/mnt/data": str(data), "~/conf/app.cfg": str(tmp_path / "one.cfg")},
        "run": 'cat pkg/a.txt "$SANDBOX_MOUNT_ROOT/mnt/data/d.txt" ~/conf/app.cfg; '
               "ls -A | sort | tr '\\n' ' '"})
    proc, _ = _run_pod(tmp_path, task, rank=None)
    assert proc.returncode == 0, proc.stderr
    assert "from workdir\nfrom a dir mount\nfrom a file mount\n" in proc.stdout
    assert proc.stdout.rstrip().endswith(".skyignore pkg")


def test_a_relative_mount_is_under_the_workdir_and_sky_workdir_is_it_on_every_rank(tmp_path):
    """SkyPilot: a relative destination is under ~/sky_workdir, the cwd of setup and run.
    Here it was unpacked under $HOME, and ~/sky_workdir did not exist."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "f.txt").write_text("from a dir mount\n")
    (tmp_path / "one.cfg").write_text("from a file mount\n")
    task = load_task({"num_nodes": 2, "file_mounts": {
        "relative_dir": str(data), "conf/one.cfg": str(tmp_path / "one.cfg"),
        "~/sky_workdir/via_home/one.cfg": str(tmp_path / "one.cfg")},
        "setup": "test -f relative_dir/f.txt && echo setup-sees-it",
        "run": "test -f relative_dir/f.txt && test -f ~/sky_workdir/relative_dir/f.txt && "
               "cat conf/one.cfg via_home/one.cfg && "
               'test "$(cd ~/sky_workdir && pwd -P)" = "$(pwd -P)" && echo same-dir'})
    for rank in (0, 1):  # every node links its own ~/sky_workdir
        proc, root = _run_pod(tmp_path, task, rank=rank, name="sky-rel")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "setup-sees-it" in proc.stdout and "same-dir" in proc.stdout
        assert proc.stdout.count("from a file mount") == 2
        assert not (root / "home" / "relative_dir").exists()


@pytest.mark.parametrize("there", ["dangling link", "empty dir", "dir of files", "file"])
def test_what_is_at_sky_workdir_already_is_replaced_only_when_nothing_is_lost(tmp_path, there):
    """A link (from an earlier job) or an empty directory (an image's) gives way; a directory
    of files or a file is left as it is, with a note, and the job runs all the same."""
    home = tmp_path / "h"
    home.mkdir()
    link = home / "sky_workdir"
    if there == "dangling link":
        link.symlink_to(tmp_path / "gone")
    elif there == "file":
        link.write_text("mine\n")
    else:
        link.mkdir()
        if there == "dir of files":
            (link / "keep.txt").write_text("mine\n")
    (tmp_path / "one.cfg").write_text("from a file mount\n")
    task = load_task({"file_mounts": {"rel/one.cfg": str(tmp_path / "one.cfg")},
                      "run": "cat rel/one.cfg"})
    proc, root = _run_pod(tmp_path, task, rank=None, extra_env={"HOME": str(home)})
    assert proc.returncode == 0, proc.stderr
    assert "from a file mount" in proc.stdout
    if there in ("dangling link", "empty dir"):
        assert link.is_symlink() and os.path.samefile(link, root / m.WORKDIR_MOUNT.lstrip("/"))
    else:
        assert not link.is_symlink() and "sky_workdir kept: not a link" in proc.stderr
        assert (link / "keep.txt" if there == "dir of files" else link).read_text() == "mine\n"


def test_a_home_of_slash_has_sky_workdir_as_the_workdir_already(tmp_path):
    """An image's user without a home (HOME=/): ~/sky_workdir is the workdir's own mount
    path, nothing to link and nothing to warn about."""
    (tmp_path / "one.cfg").write_text("from a file mount\n")
    task = load_task({"file_mounts": {"rel/one.cfg": str(tmp_path / "one.cfg")},
                      "run": "cat ~/sky_workdir/rel/one.cfg"})
    proc, root = _run_pod(tmp_path, task, rank=None,
                          extra_env={"HOME": str(tmp_path / "rootNone")})  # the pod's "/"
    assert proc.returncode == 0, proc.stderr
    assert "from a file mount" in proc.stdout and "sky_workdir" not in proc.stderr
    assert not (root / m.WORKDIR_MOUNT.lstrip("/")).is_symlink()


def test_a_workdir_too_large_for_its_secret_is_refused(tmp_path):
    (tmp_path / "big.bin").write_bytes(os.urandom(300 * 1024))
    task = load_task({"workdir": str(tmp_path), "run": "true"})
    assert bundle.bundle(task, limit=900 * 1024).size > 300 * 1024
    with pytest.raises(bundle.BundleTooLarge, match="a Secret takes at most"):
        bundle.bundle(task, limit=200 * 1024)


# --- offers from a cluster view (the probe's arithmetic) ------------------------------------


def _node(name, gpus=8, label="a100", cpu="16", mem="64Gi", ready=True, cordon=False,
          taints=None, labels=None, since=None):
    all_labels = {"kubernetes.io/hostname": name, **(labels or {})}
    if label:
        all_labels["skypilot.co/accelerator"] = label
    alloc = {"cpu": cpu, "memory": mem, "pods": "110"}
    if gpus:
        alloc["nvidia.com/gpu"] = str(gpus)
    return {"metadata": {"name": name, "labels": all_labels},
            "spec": {"unschedulable": cordon, "taints": taints or []},
            "status": {"allocatable": alloc, "conditions": [
                {"type": "Ready", "status": "True" if ready else "False",
                 "lastTransitionTime": since or "2026-01-01T00:00:00Z"}]}}


def _pod(name, node, gpus=0, cpu="1", phase="Running", ns="other"):
    res = {"requests": {"cpu": cpu}}
    if gpus:
        res["limits"] = {"nvidia.com/gpu": str(gpus)}
    return {"metadata": {"name": name, "namespace": ns}, "spec": {
        "nodeName": node, "containers": [{"name": "c", "resources": res}]},
        "status": {"phase": phase}}


def _offers(task, nodes, pods, **settings):
    backend = _backend(**settings)
    view = cluster_view(nodes, pods, "team-a")
    return [backend._offer(task, req, view, "") for req in task.candidates]


def test_free_gpus_subtract_requests_of_pods_in_every_namespace():
    nodes = [_node("n1"), _node("n2"), _node("cpu", gpus=0, label=None)]
    pods = [_pod("a", "n1", gpus=3), _pod("b", "n1", gpus=2, ns="team-a"),
            _pod("c", "n2", gpus=1), _pod("p", None, gpus=8, phase="Pending", ns="team-a")]
    [offer] = _offers(load_task({"run": "x", "resources": {"accelerators": "A100:4"}}),
                      nodes, pods)
    assert offer.fits
    assert (offer.gpus_total, offer.gpus_free) == (16, 16 - 6)
    assert (offer.nodes_total, offer.nodes_free) == (2, 1)  # n1 has 3 left, n2 has 7
    assert offer.pending_jobs == 1
    assert offer.est_start is not None
    assert offer.details["node_selector"] == {"skypilot.co/accelerator": "a100"}
    [offer] = _offers(load_task({"run": "x", "num_nodes": 2,
                                 "resources": {"accelerators": "A100:4"}}), nodes, pods)
    assert offer.fits and offer.nodes_free == 1 and offer.est_start is None


def test_cordoned_notready_and_tainted_nodes_have_no_capacity():
    nodes = [_node("n1", cordon=True), _node("n2", ready=False),
             _node("n3", taints=[{"key": "maintenance", "effect": "NoSchedule"}]),
             _node("n4", taints=[{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]),
             _node("n5", taints=[{"key": "team", "value": "a", "effect": "NoExecute"}])]
    task = load_task({"run": "x", "resources": {"accelerators": "A100:1"}})
    [offer] = _offers(task, nodes, [])
    assert offer.fits
    assert offer.gpus_total == 40
    assert offer.gpus_free == 8  # n4 only: the GPU taint is tolerated for GPU jobs
    assert set(offer.details["nodes_unusable"]) == {"n1", "n2", "n3", "n5"}
    [offer] = _offers(task, nodes, [], tolerations=[{"key": "team", "operator": "Equal",
                                                     "value": "a"}])
    assert offer.gpus_free == 16


def test_nodes_tainted_for_others_alone_refuse_the_job_but_passing_states_do_not():
    # every A100 node is dedicated to another team: the offer was chosen ("start unknown")
    # and its pods stayed Pending for ever
    team = [{"key": "dedicated", "value": "ml-team", "effect": "NoSchedule"}]
    nodes = [_node("g1", taints=team), _node("g2", taints=team)]
    task = load_task({"run": "x", "resources": {"accelerators": "A100:8"}})
    [offer] = _offers(task, nodes, [])
    assert not offer.fits
    assert offer.reason == (
        "taint dedicated=ml-team:NoSchedule on every matching node (g1, g2), not tolerated "
        "(the connection's tolerations do not cover it): its pods would stay Pending")
    [offer] = _offers(task, nodes, [], tolerations=[{"key": "dedicated", "operator": "Exists"}])
    assert offer.fits and offer.free_now
    # too few nodes left for a two-node job
    two = load_task({"run": "x", "num_nodes": 2, "resources": {"accelerators": "A100:8"}})
    [offer] = _offers(two, [*nodes, _node("g3")], [])
    assert not offer.fits and offer.reason.startswith(
        "taint dedicated=ml-team:NoSchedule on 2 of 3 matching nodes (g1, g2)")
    assert offer.reason.endswith("the other nodes: needs 2 nodes; ctx has 1 with A100")
    # cordoned, NotReady, Kubernetes' own and the autoscaler's taints pass: not refused
    passing = [_node("p1", cordon=True), _node("p2", ready=False),
               _node("p3", taints=[{"key": "node.kubernetes.io/unreachable",
                                    "effect": "NoExecute"}]),
               _node("p4", taints=[{"key": "ToBeDeletedByClusterAutoscaler",
                                    "effect": "NoSchedule"}])]
    for node in passing:
        [offer] = _offers(task, [*nodes, node], [])
        assert offer.fits and not offer.free_now, node["metadata"]["name"]


def test_explained_no_fits():
    nodes = [_node("n1", gpus=4), _node("n2", gpus=4), _node("cpu", gpus=0, label=None,
                                                               cpu="8", mem="32Gi")]
    cases = {
        "H100:1": "no H100 nodes",
        "A100:8": "needs 8 A100 per node; nodes in ctx have at most 4",
        "A100:0.5": "Kubernetes allocates whole GPUs",
    }
    for accel, why in cases.items():
        [offer] = _offers(load_task({"run": "x", "resources": {"accelerators": accel}}),
                          nodes, [])
        assert not offer.fits and why in offer.reason, (accel, offer.reason)
    for spec, why in [
        ({"num_nodes": 3, "resources": {"accelerators": "A100:1"}}, "needs 3 nodes"),
        ({"resources": {"cpus": 64}}, "needs 64 CPUs"),
        ({"resources": {"memory": 512}}, "needs 512 GB"),
        ({"resources": {"instance_type": "p4d.24xlarge"}}, "cloud VM type"),
        ({"resources": {"use_spot": True}}, "no spot nodes"),
        ({"workdir": {"url": "https://github.com/x/y"}}, "git workdir"),
        ({"file_mounts": {"/d": "s3://bucket/x"}}, "s3://"),
    ]:
        [offer] = _offers(load_task({"run": "x", **spec}), nodes, [])
        assert not offer.fits and why in offer.reason, (spec, offer.reason)


def test_spot_nodes_are_recognised_by_their_labels():
    nodes = [_node("od"), _node("spot", labels={"karpenter.sh/capacity-type": "spot"})]
    [offer] = _offers(load_task({"run": "x", "resources": {"accelerators": "A100:1",
                                                           "use_spot": True}}), nodes, [])
    assert offer.fits and offer.spot
    assert offer.nodes_total == 1
    assert offer.details["node_selector"] == {"karpenter.sh/capacity-type": "spot",
                                              "skypilot.co/accelerator": "a100"}


def test_gpu_type_from_any_known_label():
    nodes = [_node("g", label=None, labels={"cloud.google.com/gke-accelerator": "nvidia-l4"}),
             _node("e", label=None, labels={"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"})]
    [l4] = _offers(load_task({"run": "x", "resources": {"accelerators": "L4:1"}}), nodes, [])
    assert l4.fits and l4.accelerator == "L4"
    assert l4.details["node_selector"] == {"cloud.google.com/gke-accelerator": "nvidia-l4"}
    [a80] = _offers(load_task({"run": "x", "resources": {"accelerators": "A100-80GB:8"}}),
                    nodes, [])
    assert a80.fits and a80.accelerator == "A100-80GB"


def test_gpu_labels_with_a_memory_size_after_the_name():
    # GKE's and GPU Feature Discovery's H100/H200 labels: read as no H100 before (the digits
    # after the name were taken for a longer name)
    from airflow_skypilot.spec.accelerators import canonical_from_label

    for label, name in (("nvidia-h100-80gb", "H100"), ("nvidia-h200-141gb", "H200"),
                        ("NVIDIA-H100-80GB-HBM3", "H100"), ("NVIDIA-GH200-480GB", "GH200"),
                        ("nvidia-h100-mega-80gb", "H100-MEGA"), ("a100-40gb", "A100"),
                        ("nvidia-a10-24gb", "A10"), ("nvidia-l4-24gb", "L4"),
                        ("nvidia-l40-48gb", "L40"), ("a100", "A100"), ("a10", "A10")):
        assert canonical_from_label(label) == name, label
    nodes = [_node("h", label=None, labels={"cloud.google.com/gke-accelerator":
                                            "nvidia-h100-80gb"})]
    [h100] = _offers(load_task({"run": "x", "resources": {"accelerators": "H100:8"}}), nodes, [])
    assert h100.fits and h100.accelerator == "H100"


def test_forbidden_pod_listing_leaves_free_unknown_not_zero():
    backend = _backend()
    view = cluster_view([_node("n1")], None, "team-a", note="pods may not be listed")
    [offer] = [backend._offer(load_task({"run": "x", "resources": {"accelerators": "A100:1"}}),
                              req, view, "")
               for req in load_task({"run": "x", "resources": {
                   "accelerators": "A100:1"}}).candidates]
    assert offer.fits
    assert offer.gpus_total == 8
    assert offer.gpus_free is None and offer.nodes_free is None and offer.est_start is None
    assert offer.details["free"] == "unknown"
    assert not offer.free_now


def test_nodeview_quantities():
    node = NodeView.parse(_node("n", cpu="15500m", mem="63Gi", gpus=8))
    assert node.cpus == 15.5 and node.memory_gb == 63 and node.gpus == 8
    assert ClusterView(nodes=[node], pods_known=True, pending=0).nodes[0].accelerator == "A100"


# --- status mapping (real API server shapes) ------------------------------------------------

NOW = time.time()


def _ts(seconds_ago: float) -> str:
    return datetime.fromtimestamp(NOW - seconds_ago, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _job(conditions=(), deleting=False, suspend=False, failed=0):
    meta = {"name": "j", "uid": "u1", "namespace": "ns"}
    if deleting:
        meta["deletionTimestamp"] = _ts(1)
    return {"metadata": meta, "spec": {"suspend": suspend, "completions": 1},
            "status": {"conditions": [dict(c, status="True") for c in conditions],
                       "failed": failed}}


def _jpod(rank=0, phase="Running", state=None, conds=(), reason=None, node="n1", age=10,
          deleting=False, image="img"):
    meta = {"name": f"j-{rank}-x", "creationTimestamp": _ts(age),
            "labels": {names.LABEL_JOB: "j", names.INDEX_KEY: str(rank)},
            "ownerReferences": [{"uid": "u1"}]}
    if deleting:
        meta["deletionTimestamp"] = _ts(1)
    status = {"phase": phase, "conditions": list(conds),
              "containerStatuses": [{"name": "main", "state": state or {"running": {
                  "startedAt": _ts(5)}}}]}
    if reason:
        status["reason"] = reason
    return {"metadata": meta, "spec": {"nodeName": node, "containers": [
        {"name": "main", "image": image}]}, "status": status}


def _term(code, reason="Error"):
    return {"terminated": {"exitCode": code, "reason": reason, "finishedAt": _ts(1)}}


def _status(job, pods, **kw):
    kw.setdefault("num_nodes", 1)
    kw.setdefault("now", NOW)
    return job_status(job, pods, **kw)


def test_status_success_running_and_user_failure():
    assert _status(_job([{"type": "Complete"}]), []).state == JobState.SUCCEEDED
    assert _status(_job(), [_jpod()]).state == JobState.RUNNING
    st = _status(_job(), [_jpod(phase="Failed", state=_term(3))])
    assert (st.state, st.exit_code) == (JobState.FAILED, 3)
    assert not st.state.infra_failure
    st = _status(_job(), [_jpod(phase="Failed", state=_term(137, "OOMKilled"))])
    assert st.state == JobState.FAILED and "OOMKilled" in st.reason
    two = [_jpod(0, phase="Succeeded", state=_term(0, "Completed")), _jpod(1)]
    assert _status(_job(), two, num_nodes=2).state == JobState.RUNNING
    two[1] = _jpod(1, phase="Succeeded", state=_term(0, "Completed"))
    assert _status(_job(), two, num_nodes=2).state == JobState.SUCCEEDED


def test_rank_failure_wins_over_the_ranks_the_controller_kills():
    pods = [_jpod(0, phase="Failed", state=_term(143), deleting=True),
            _jpod(1, phase="Failed", state=_term(3))]
    st = _status(_job([{"type": "Failed", "reason": "PodFailurePolicy"}]), pods, num_nodes=2)
    assert (st.state, st.exit_code) == (JobState.FAILED, 3)
    assert "rank 1" in st.reason
    # every failing rank's code, for recover_on_exit_codes (the killed one is not a cause)
    assert st.exit_codes == [3]
    pods = [_jpod(0, phase="Failed", state=_term(42)), _jpod(1, phase="Failed", state=_term(3))]
    assert _status(_job(), pods, num_nodes=2).exit_codes == [3, 42]


def test_disruptions_are_infrastructure_failures():
    evicted = _jpod(phase="Failed", reason="Evicted", state=_term(137), conds=[
        {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}])
    assert _status(_job(), [evicted]).state == JobState.INFRA_FAILED
    preempted = _jpod(phase="Failed", state=_term(137), conds=[
        {"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"}])
    assert _status(_job(), [preempted]).state == JobState.PREEMPTED
    lost = _jpod(phase="Failed", state=_term(137, "ContainerStatusUnknown"), deleting=True)
    assert _status(_job(), [lost]).state == JobState.INFRA_FAILED
    assert _status(_job(), [evicted], spot=True).state == JobState.PREEMPTED


def test_pods_gone_with_the_job_verdict_left_behind():
    """A real API server deletes evicted pods; the pod failure policy's condition remains."""
    cond = {"type": "Failed", "reason": "PodFailurePolicy",
            "message": "Pod ns/j-0-x has condition DisruptionTarget matching FailJob rule at "
                       "index 0"}
    assert _status(_job([cond]), []).state == JobState.INFRA_FAILED
    cond = {"type": "Failed", "reason": "PodFailurePolicy",
            "message": "Container main for pod ns/j-0-x failed with exit code 42 matching "
                       "FailJob rule at index 1"}
    st = _status(_job([cond]), [])
    assert (st.state, st.exit_code) == (JobState.FAILED, 42)
    st = _status(_job([{"type": "Failed", "reason": "BackoffLimitExceeded"}]), [])
    assert st.state == JobState.INFRA_FAILED
    assert _status(_job(failed=1), []).state == JobState.INFRA_FAILED
    assert _status(_job(), [_jpod(deleting=True)]).state == JobState.INFRA_FAILED


def test_node_gone_or_notready_past_the_grace_is_infra():
    nodes = {"n1": NodeView.parse(_node("n1", ready=False, since=_ts(30)))}
    assert _status(_job(), [_jpod()], nodes=nodes, node_not_ready_grace=60).state == \
        JobState.RUNNING
    st = _status(_job(), [_jpod()], nodes=nodes, node_not_ready_grace=20)
    assert st.state == JobState.INFRA_FAILED and "NotReady" in st.reason
    assert _status(_job(), [_jpod()], nodes={}).state == JobState.INFRA_FAILED


@pytest.mark.parametrize("not_ready_for", [30, 90, 150])
def test_a_peers_failure_beside_a_notready_node_is_infra_within_the_grace(not_ready_for):
    """Rank 0 exited 1 (its collective broke) while rank 1's node is NotReady: the allocation
    lost decides before an exit code, however long the node has been NotReady (the grace only
    keeps a healthy running job from failing for a blip). A healthy peer's failure stays the
    user's."""
    nodes = {"n1": NodeView.parse(_node("n1")),
             "n2": NodeView.parse(_node("n2", ready=False, since=_ts(not_ready_for)))}
    pods = [_jpod(0, phase="Failed", state=_term(1), node="n1"), _jpod(1, node="n2")]
    st = _status(_job(), pods, nodes=nodes, num_nodes=2, node_not_ready_grace=120)
    assert st.state == JobState.INFRA_FAILED and st.state.infra_failure, st
    assert "n2" in st.reason and "NotReady" in st.reason and "j-0-x" in st.reason
    assert st.exit_codes == [1] and st.still_up  # rank 1 may still run its code
    healthy = {"n1": nodes["n1"], "n2": NodeView.parse(_node("n2"))}
    st = _status(_job(), pods, nodes=healthy, num_nodes=2, node_not_ready_grace=120)
    assert (st.state, st.exit_codes) == (JobState.FAILED, [1])


def test_image_and_config_errors_fail_after_the_grace_and_are_not_infra():
    pull = {"waiting": {"reason": "ImagePullBackOff", "message": 'Back-off pulling "bad/x"'}}
    young = _jpod(phase="Pending", state=pull, age=5, image="bad/x")
    st = _status(_job(), [young], image_error_grace=60)
    assert st.state == JobState.PENDING and "ImagePullBackOff" in st.reason
    old = _jpod(phase="Pending", state=pull, age=120, image="bad/x")
    st = _status(_job(), [old], image_error_grace=60)
    assert st.state == JobState.FAILED and not st.state.infra_failure
    assert "bad/x" in st.reason and "not placed elsewhere" in st.reason
    cfg = {"waiting": {"reason": "CreateContainerConfigError", "message": 'secret "s" not found'}}
    st = _status(_job(), [_jpod(phase="Pending", state=cfg, age=120)], image_error_grace=60)
    assert st.state == JobState.FAILED and "secret" in st.reason


def test_pending_reasons_lost_and_cancelled():
    unsched = _jpod(phase="Pending", node="", state={"waiting": {"reason": "Pending"}}, conds=[
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}])
    st = _status(_job(), [unsched])
    assert st.state == JobState.PENDING and "Insufficient nvidia.com/gpu" in st.reason
    st = _status(_job(), [unsched], pending_timeout=5)
    assert st.state == JobState.INFRA_FAILED and "could not be scheduled" in st.reason
    assert "suspended" in _status(_job(suspend=True), []).reason
    cut_short = _job(suspend=True)
    cut_short["metadata"].update(creationTimestamp=_ts(600),
                                 annotations={"skypilot.airflow/managed": "true"})
    assert _status(cut_short, []).state == JobState.LOST  # its submitter died half way
    assert _status(_job(), []).state == JobState.PENDING
    assert _status(None, []).state == JobState.LOST
    assert _status(_job(deleting=True), [_jpod()]).state == JobState.CANCELLED
    # a finished Job being removed (TTL) is still a success
    assert _status(_job([{"type": "Complete"}], deleting=True), []).state == JobState.SUCCEEDED


def _cancelled(job, seconds_ago=2.0):
    job["metadata"]["annotations"] = {
        names.ANN_CANCELLED: datetime.fromtimestamp(NOW - seconds_ago, UTC).isoformat()}
    job["spec"]["suspend"] = True
    return job


def test_our_cancel_reads_cancelled_until_the_job_is_gone():
    st = _status(_cancelled(_job()), [])
    assert st.state == JobState.CANCELLED and not st.state.infra_failure
    assert names.ANN_CANCELLED in st.reason and st.exit_code is None
    assert st.ended_at == pytest.approx(NOW - 2.0)  # when it was cancelled, on every poll
    assert _status(_cancelled(_job()), [], now=NOW + 60).ended_at == st.ended_at
    # what the pods and the controller did after the cancel (pods killed and counted as
    # failed, the Job failed by its policy) is the cancel's doing: cancel marks only a Job
    # that had not ended
    killed = _jpod(phase="Failed", state=_term(143), deleting=True)
    after = {"type": "Failed", "reason": "PodFailurePolicy", "lastTransitionTime": _ts(1),
             "message": "Container main for pod ns/j-0-x failed with exit code 143"}
    assert _status(_cancelled(_job([after])), [killed]).state == JobState.CANCELLED
    assert _status(_cancelled(_job([after])), [_jpod(phase="Failed", state=_term(143))]
                   ).state == JobState.CANCELLED
    assert _status(_cancelled(_job(failed=1)), []).state == JobState.CANCELLED
    assert _status(_cancelled(_job()), [_jpod()]).state == JobState.CANCELLED
    # a success that raced the cancel is a success
    assert _status(_cancelled(_job([{"type": "Complete"}])), []).state == JobState.SUCCEEDED
    # a cancelled Job is suspended but not a submission cut short
    old = _cancelled(_job())
    old["metadata"].update(creationTimestamp=_ts(600))
    old["metadata"]["annotations"]["skypilot.airflow/managed"] = "true"
    assert _status(old, []).state == JobState.CANCELLED
    from airflow_skypilot.backends.kubernetes import submit
    assert submit.is_cancelled(old) and not submit.needs_finishing(old)
    # absent from a list that succeeded: lost, whatever we did before
    assert _status(None, []).state == JobState.LOST


class _FakeKube:
    """The calls submit.cancel makes, on one Job and its pods."""

    def __init__(self, job, pods, pods_forbidden=False):
        from types import SimpleNamespace

        self.job, self.pods, self.calls = job, pods, []
        self.forbidden = pods_forbidden
        names_ = ("read_namespaced_job", "patch_namespaced_job", "list_namespaced_pod",
                  "delete_namespaced_pod", "delete_namespaced_service",
                  "delete_namespaced_secret", "delete_namespaced_config_map",
                  "delete_namespaced_job")
        api = SimpleNamespace(**{n: n for n in names_})
        self._apis = (api, api)

    def apis(self):
        return self._apis

    def call(self, fn, *args, **kw):
        from airflow_skypilot.backends.kubernetes.client import KubeApiError

        self.calls.append((fn, args[0] if args else None))
        if fn == "read_namespaced_job":
            if self.job is None:
                raise KubeApiError(404, "not found")
            return self.job
        if fn == "list_namespaced_pod":
            if self.forbidden:
                raise KubeApiError(403, "forbidden")
            return {"items": self.pods}
        if fn == "patch_namespaced_job":
            for op in args[2]:
                if op["path"].startswith("/metadata/annotations"):
                    self.job["metadata"].setdefault("annotations", {})[
                        names.ANN_CANCELLED] = op["value"]
                else:
                    self.job["spec"]["suspend"] = op["value"]
        return {}


def test_cancel_marks_only_a_job_that_had_not_ended():
    from airflow_skypilot.backends.kubernetes import submit

    def patched(kube):
        return any(fn == "patch_namespaced_job" for fn, _ in kube.calls)

    running = _FakeKube(_job(), [_jpod()])
    done = submit.cancel(running, "ns", "j", now=NOW)
    assert patched(running) and submit.is_cancelled(running.job) and running.job["spec"]["suspend"]
    assert ("delete_namespaced_pod", "j-0-x") in running.calls
    assert ("delete_namespaced_secret", "j-secrets") in running.calls
    assert "marked cancelled and suspended" in done
    assert _status(running.job, []).state == JobState.CANCELLED
    again = _FakeKube(running.job, [])
    submit.cancel(again, "ns", "j")  # twice: marked once
    assert not patched(again)
    for job, pods in ((_job([{"type": "Failed", "reason": "PodFailurePolicy"}]), []),
                      (_job([{"type": "Complete"}]), []),
                      (_job(), [_jpod(phase="Failed", state=_term(3))])):  # no verdict yet
        ended = _FakeKube(job, pods)
        submit.cancel(ended, "ns", "j")
        assert not patched(ended) and not submit.is_cancelled(ended.job)
        assert ("delete_namespaced_secret", "j-secrets") in ended.calls
    blind = _FakeKube(_job(), [], pods_forbidden=True)  # the controller deletes the pods
    assert "pods may not be listed" in " ".join(submit.cancel(blind, "ns", "j"))
    assert patched(blind) and blind.job["spec"]["suspend"]
    gone = _FakeKube(None, [])
    submit.cancel(gone, "ns", "j")
    assert not patched(gone) and ("delete_namespaced_secret", "j-secrets") in gone.calls


def test_success_has_exit_code_0_and_terminal_states_a_stable_end():
    done = _jpod(phase="Succeeded", state=_term(0, "Completed"))
    complete = {"type": "Complete", "lastTransitionTime": _ts(3)}
    for job, pods in ((_job([complete]), []), (_job(), [done])):
        st = _status(job, pods)
        assert (st.state, st.exit_code) == (JobState.SUCCEEDED, 0)
        assert st.ended_at == _status(job, pods, now=NOW + 60).ended_at
    failed = {"type": "Failed", "reason": "PodFailurePolicy", "lastTransitionTime": _ts(7),
              "message": "Container main for pod ns/j-0-x failed with exit code 42"}
    st = _status(_job([failed]), [])  # the pods are gone: the condition's time
    assert st.ended_at == pytest.approx(NOW - 7, abs=1)
    assert _status(_job([failed]), [], now=NOW + 60).ended_at == st.ended_at
    # a rank's failure: when it failed, not when the controller killed the other ranks
    first = _jpod(1, phase="Failed", state={"terminated": {"exitCode": 3,
                                                           "finishedAt": _ts(9)}})
    killed = _jpod(0, phase="Failed", state={"terminated": {"exitCode": 143,
                                                            "finishedAt": _ts(2)}},
                   deleting=True)
    for job in (_job(), _job([failed])):
        st = _status(job, [killed, first], num_nodes=2)
        assert (st.state, st.exit_code) == (JobState.FAILED, 3)
        assert st.ended_at == pytest.approx(NOW - 9, abs=1)


# --- logs ------------------------------------------------------------------------------------


def test_log_offsets_stay_consistent_as_ranks_finish():
    rank0 = b"r0 line1\nr0 partial"
    text, off = slice_log(join_logs([(0, rank0)], final=False), 0, final=False)
    assert (text, off) == ("r0 line1\n", 9)  # a partial line waits for its end
    text, off2 = slice_log(join_logs([(0, rank0)], final=False), off, final=False)
    assert (text, off2) == ("", 9)
    final = join_logs([(0, rank0 + b" done"), (1, b"r1 a\nr1 b")], final=True)
    text, off3 = slice_log(final, off2, final=True)
    assert text == "r0 partial done\n(rank 1) r1 a\n(rank 1) r1 b\n"
    assert off3 == len(final)
    assert final.startswith(rank0)  # the text only ever grows: old offsets stay valid


def test_log_chunks_never_split_a_character():
    data = ("é" * 10).encode()
    text, off = slice_log(data, 0, final=True, limit=5)
    assert text == "éé" and off == 4


def test_a_line_longer_than_a_chunk_comes_in_pieces():
    data = b"x" * 10 + b"\nend"
    assert slice_log(data, 0, final=False, limit=4) == ("xxxx", 4)
    assert slice_log(data, 8, final=False, limit=4) == ("xx\n", 11)
    assert slice_log(data, 11, final=False, limit=4) == ("", 11)  # partial: wait
    assert slice_log(data, 11, final=True, limit=4) == ("end", 14)


def test_log_plan_orders_ranks_and_knows_when_it_is_final():
    pods = [_jpod(1, phase="Succeeded", state=_term(0, "Completed")),
            _jpod(0, phase="Running")]
    plan, final = log_plan(pods, 2)
    assert [v.rank for v in plan] == [0, 1] and not final
    pods[1] = _jpod(0, phase="Failed", state=_term(1))
    assert log_plan(pods, 2)[1]


def test_settings_from_connection_extras():
    s = KubernetesSettings.from_extra("conn", {
        "extra__kubernetes__namespace": "ml", "cluster_context": "prod",
        "node_selector": '{"pool": "gpu"}', "tolerations": [{"key": "a", "operator": "Exists"}],
        "price_per_gpu_hour": "2.5", "image_error_grace": 5, "ttl_seconds_after_finished": "off"})
    assert (s.namespace, s.context, s.location, s.infra) == ("ml", "prod", "prod/ml",
                                                             "kubernetes/prod")
    assert s.node_selector == {"pool": "gpu"} and s.tolerations[0]["key"] == "a"
    assert s.price_per_gpu_hour == 2.5 and s.image_error_grace == 5
    assert s.ttl_seconds_after_finished is None
    default = KubernetesSettings.from_extra("conn", {})
    assert (default.namespace, default.context, default.image) == ("default", "conn",
                                                                   "python:3.11-slim")
    with pytest.raises(ConfigurationError, match="node_selector"):
        KubernetesSettings.from_extra("conn", {"node_selector": "[1"})


def test_an_api_server_that_cannot_answer_now_is_unreachable_and_one_silence_is_waited_once():
    from airflow_skypilot.backends.base import JobHandle
    from airflow_skypilot.backends.kubernetes.client import KubeApiError, api_error
    from airflow_skypilot.backends.kubernetes.status import list_all
    from airflow_skypilot.exceptions import BackendUnreachable

    for status in (429, 500, 503, 504):
        err = api_error("k", status, b'{"message": "etcdserver: request timed out"}')
        assert isinstance(err, BackendUnreachable) and isinstance(err, KubeApiError)
        assert err.status == status
    for status in (400, 403, 404, 409, 422):
        assert not isinstance(api_error("k", status, b"{}"), BackendUnreachable)

    calls = []

    class Silent:
        conn_id = "k"

        def apis(self):
            from types import SimpleNamespace

            api = SimpleNamespace(list_namespaced_job=1, list_namespaced_pod=2, list_node=3)
            return api, api

        def call(self, fn, *args, **kwargs):
            calls.append(fn)
            raise BackendUnreachable("k: Kubernetes API unreachable: read timed out")

    handle = JobHandle(backend="kubernetes", connection="k", job_id="j", job_name="j",
                       location="c/default", infra="kubernetes/c/default")
    results = list_all(Silent(), {"default": [handle]}, with_nodes=True)
    assert len(calls) == 1, "each request after the first would wait as long again"
    assert len(results) == 3 and all(isinstance(r, BackendUnreachable) for r in results)


def test_an_eks_context_with_a_slash_is_matched_whole_by_infra():
    from airflow_skypilot.backends.kubernetes import offers as k_offers
    from airflow_skypilot.backends.kubernetes.settings import KubernetesSettings

    arn = "arn:aws:eks:us-east-1:123456789012:cluster/gpu"
    settings = KubernetesSettings.from_extra("k", {"cluster_context": arn})
    for infra, applies in ((f"k8s/{arn}", True), (f"kubernetes/{arn}", True), ("k8s", True),
                           ("k8s/arn:aws:eks:us-east-1:123456789012:cluster/cpu", False),
                           ("k8s/arn:aws:eks:us-east-1:123456789012:cluster", False)):
        task = load_task({"run": "x", "resources": {"infra": infra}})
        assert k_offers.applies(task.candidates[0], settings) is applies, infra


def test_an_ended_job_whose_pods_still_run_is_still_up():
    """Its user code may still run: a sweep must not take it for dead (it did, and the next
    copy started beside it)."""
    # our cancel: the pod is deleted but runs out its grace period
    st = _status(_cancelled(_job()), [_jpod(deleting=True)])
    assert (st.state, st.still_up) == (JobState.CANCELLED, True)
    assert not _status(_cancelled(_job()), []).still_up  # gone: dead
    # multi-node: one rank preempted or failed, the other still running
    evicted = _jpod(1, phase="Failed", state=_term(137), conds=[
        {"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"}])
    st = _status(_job(), [_jpod(0), evicted], num_nodes=2)
    assert (st.state, st.still_up) == (JobState.PREEMPTED, True)
    st = _status(_job(), [_jpod(0), _jpod(1, phase="Failed", state=_term(3))], num_nodes=2)
    assert (st.state, st.still_up) == (JobState.FAILED, True)
    done = _jpod(0, phase="Failed", state=_term(143))
    assert not _status(_job(), [done, _jpod(1, phase="Failed", state=_term(3))],
                       num_nodes=2).still_up
    # pods that may not be listed: the Job's own count of active pods says
    job = _cancelled(_job())
    job["status"]["active"] = 1
    assert _status(job, None).still_up
    assert not _status(_job([{"type": "Complete"}]), [_jpod(phase="Succeeded",
                                                             state=_term(0))]).still_up


def test_pods_left_by_a_deleted_job_are_still_up_and_cancelled():
    """kubectl delete job --cascade=orphan (or a deletion not collected yet): the pods run on
    without their Job; it read LOST and dead, and cancel deleted nothing."""
    from airflow_skypilot.backends.kubernetes import submit

    orphan = _jpod()
    st = _status(None, [orphan], namespace="ns")
    assert (st.state, st.still_up) == (JobState.LOST, True) and "still run" in st.reason
    assert not _status(None, [], namespace="ns").still_up
    kube = _FakeKube(None, [orphan])
    submit.cancel(kube, "ns", "j")
    assert ("delete_namespaced_pod", "j-0-x") in kube.calls


def test_a_submission_failed_half_way_is_could_not_ask_unless_the_job_is_deleted(monkeypatch):
    """The start's answer lost (it may have landed), or the Job not deleted after: the placer
    must sweep the job by name (a BackendUnreachable), not take the place as refusing it."""
    from airflow_skypilot.backends.kubernetes import KubernetesBackend, KubernetesSettings
    from airflow_skypilot.backends.kubernetes import backend as kb
    from airflow_skypilot.exceptions import BackendUnreachable, SubmissionError

    b = KubernetesBackend("k", settings=KubernetesSettings(context="ctx", namespace="ns"))
    monkeypatch.setattr(b, "dependents", lambda *a, **k: [])
    deletes: list[str] = []

    def run(start_error, delete_error=None):
        def start(*a, **k):
            raise start_error

        def delete_all(client, name, ns):
            deletes.append(name)
            if delete_error:
                raise delete_error
            return ["job"]

        monkeypatch.setattr(kb.submit, "start", start)
        monkeypatch.setattr(kb.submit, "delete_all", delete_all)
        with pytest.raises((BackendUnreachable, SubmissionError)) as info:
            b._finish({}, None, None, "j", {}, None)
        return info.value

    assert isinstance(run(BackendUnreachable("read timed out")), BackendUnreachable)
    got = run(kb.BackendError("422 invalid"), BackendUnreachable("timed out"))
    assert isinstance(got, BackendUnreachable) and "could not be deleted" in str(got)
    refused = run(kb.BackendError("422 invalid"))
    assert type(refused) is SubmissionError and deletes == ["j", "j", "j"]


def test_a_pod_whose_node_object_is_gone_is_gone_but_not_one_on_a_notready_node():
    """PodGC deletes pods of a deleted Node; a NotReady node may be a partition, its pod may
    still run its code (not confirmed ended: the sweep keeps trying and says so)."""
    nodes = {"n1": NodeView.parse(_node("n1", ready=False, since=_ts(3600)))}
    st = _status(_cancelled(_job()), [_jpod(node="n1", deleting=True)], nodes=nodes)
    assert st.still_up
    st = _status(_cancelled(_job()), [_jpod(node="gone", deleting=True)], nodes=nodes)
    assert not st.still_up
