"""The backends' side of the input hardening (roadmap step 7, items 6 and 7), without servers:

* a Slurm connection's extras with a control character are a ConfigurationError naming the
  connection and the extra; a task may not set an sbatch option the connection pins (its offers
  do not fit, with the option named); the job script never has a raw newline in a directive;
* a Kubernetes task's ``pod_config`` that escapes the cluster's control does not fit (one test
  per refused field) unless the connection allows it;
* a misconfigured connection fails the operator at once, nothing submitted;
* secret values are registered with Airflow's masker: in the task log, in an exception, in the
  rendered YAML they are ``***``; none reaches the trigger's kwargs, XCom or the run state.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from airflow.sdk._shared.secrets_masker import redact, reset_secrets_masker
from airflow.sdk.exceptions import AirflowFailException, TaskDeferred

from airflow_skypilot.backends import registry
from airflow_skypilot.backends.kubernetes.cluster import cluster_view
from airflow_skypilot.backends.kubernetes.settings import KubernetesSettings
from airflow_skypilot.backends.slurm import SlurmBackend, offers, submit
from airflow_skypilot.backends.slurm.cluster import parse_cluster
from airflow_skypilot.backends.slurm.settings import SlurmSettings
from airflow_skypilot.exceptions import ConfigurationError, SubmissionError
from airflow_skypilot.hooks.capacity import SkyPilotCapacityHook
from airflow_skypilot.operators import SkyPilotOperator
from airflow_skypilot.spec import load_task
from tests.fakes import FakeBackend, offer
from tests.unit.test_kubernetes_manifests import _backend, _node, _objects, _offer, _validate
from tests.unit.test_slurm_parse import PROBE

REPO = Path(__file__).resolve().parents[2]
STATE = parse_cluster(PROBE)


def _task(options=None, pod_config=None, **fields):
    config = {}
    if options is not None:
        config["slurm"] = {"sbatch_options": options}
    if pod_config is not None:
        config["kubernetes"] = {"pod_config": pod_config}
    return load_task({"run": "x", "resources": {"accelerators": "A100:1"}, "config": config,
                      **fields})


# --- Slurm: the connection's extras -----------------------------------------------------------


@pytest.mark.parametrize(("extra", "value"), [
    ("qos", "normal\nrm -rf ~"), ("account", "ml\r"), ("constraint", "a100\x00"),
    ("reservation", "r\n"), ("partitions", "gpu,de\nbug"), ("partitions", ["gpu", "x\ny"]),
    ("sbatch_options", "--comment='a\nb'"), ("sbatch_options", ["--comment=a\nb"]),
    ("time_limit", "1:00\n"), ("remote_work_dir", "~/x\ny"), ("cluster", "al\npha"),
])
def test_a_control_character_in_a_slurm_extra_names_the_connection_and_the_extra(extra, value):
    with pytest.raises(ConfigurationError) as info:
        SlurmSettings.from_extra("slurm_x", {extra: value})
    assert str(info.value).startswith(f"connection 'slurm_x': extra {extra!r} contains the "
                                      "control character")


def test_unreadable_connection_sbatch_options_are_a_configuration_error():
    with pytest.raises(ConfigurationError, match="extra 'sbatch_options' cannot be read"):
        SlurmSettings.from_extra("slurm_x", {"sbatch_options": "--comment='open"})
    with pytest.raises(ConfigurationError, match="extra 'sbatch_options': unknown sbatch option"):
        SlurmSettings.from_extra("slurm_x", {"sbatch_options": "-z"})


# --- Slurm: what the connection pins, a task may not set ---------------------------------------


PINNED = SlurmSettings.from_extra("c", {
    "cluster": "alpha", "account": "ml", "qos": "normal", "time_limit": "1:00:00",
    "constraint": "a100", "sbatch_options": "--exclusive --mail-type=END"})


@pytest.mark.parametrize(("options", "named"), [
    ({"time": "4:00:00"}, "'--time=4:00:00' cannot be set by a task: the connection sets it "
                          "(extra 'time_limit')"),
    (["-t", "10"], "'-t 10' (--time) cannot be set by a task: the connection sets it"),
    ({"constraint": "h100"}, "'--constraint=h100' cannot be set by a task: the connection "
                             "sets it (extra 'constraint')"),
    ({"exclusive": True}, "'--exclusive' cannot be set by a task: the connection sets it "
                          "(extra 'sbatch_options')"),
    (["--mail-type=ALL"], "'--mail-type=ALL' cannot be set by a task"),
])
def test_a_task_may_not_override_what_the_connection_pins(options, named):
    task = _task(options)
    backend = SlurmBackend("c", PINNED)
    why = backend.unsupported(task, task.candidates[0])
    assert why.startswith("config.slurm.sbatch_options: sbatch option ") and named in why, why
    got = offers.offers(task, STATE, PINNED, "c", backend.unsupported)
    assert got and all(not o.fits and o.reason == why for o in got)


def test_what_the_connection_does_not_pin_a_task_may_set():
    task = _task({"time-min": "10", "comment": "x", "nodelist": "a1"})
    assert SlurmBackend("c", PINNED).unsupported(task, task.candidates[0]) == ""
    free = SlurmSettings.from_extra("c", {"cluster": "alpha"})
    task = _task({"time": "4:00:00", "constraint": "h100", "exclusive": True})
    assert SlurmBackend("c", free).unsupported(task, task.candidates[0]) == ""


NASTY_BUT_ALLOWED = {"comment": "it's \"quoted\" $(id) `id` #x ; & | > naïve",
                     "mail-user": "a b@c", "exclusive": True, "begin": "now+1hour"}


def _sbatch_lines(script: str) -> list[str]:
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    out = []
    for line in lines[1:]:
        if not line.startswith("#SBATCH "):
            break
        out.append(line)
    return out


def test_the_job_script_has_one_line_per_directive_and_no_raw_newline():
    task = _task(NASTY_BUT_ALLOWED)
    settings = SlurmSettings.from_extra("c", {"cluster": "alpha", "account": "ml",
                                              "sbatch_options": "--comment='set by admin'"})
    [batch] = [o for o in offers.offers(task, STATE, settings, "c",
                                        SlurmBackend("c", settings).unsupported)
               if o.location == "batch"]
    script = submit.render(task, batch, settings, "sky-x", {}, "/j")["job.sbatch"][0]
    directives = []
    for line in _sbatch_lines(script):
        words = shlex.split(line[len("#SBATCH "):])
        assert len(words) == 1, line  # one quoted word: nothing left over for the shell
        directives.append(words[0])
    assert f"--comment={NASTY_BUT_ALLOWED['comment']}" in directives
    assert "--comment=set by admin" in directives and "--exclusive" in directives
    # the task's first, then the connection's, then the backend's own: sbatch keeps the last
    order = [d.split("=")[0] for d in directives]
    assert order.index("--mail-user") < order.index("--account") < order.index("--partition")
    assert directives[-1].startswith("--open-mode") or "--gres" in directives[-1]
    after = script.splitlines()[len(directives) + 1]
    assert after.startswith("# airflow-skypilot: generated")


def test_the_job_script_refuses_a_control_character_that_got_past_the_checks():
    task = _task({"comment": "ok"})
    task.config["slurm"]["sbatch_options"]["comment"] = "a\nid"  # changed after loading
    settings = SlurmSettings.from_extra("c", {"cluster": "alpha"})
    [batch] = [o for o in offers.offers(task, STATE, settings, "c",
                                        SlurmBackend("c", settings).unsupported)
               if o.location == "batch"]
    assert "control character" in batch.reason and not batch.fits
    with pytest.raises(Exception, match="control character"):
        submit.render(task, batch, settings, "sky-x", {}, "/j")
    bad = SlurmSettings(cluster="alpha", qos="a\nid")  # built by hand, not from the extras
    clean = _task()
    [batch] = [o for o in offers.offers(clean, STATE, bad, "c",
                                        SlurmBackend("c", bad).unsupported)
               if o.location == "batch"]
    with pytest.raises(SubmissionError, match="control character") as info:
        submit.render(clean, batch, bad, "sky-x", {}, "/j")
    assert info.value.retry_elsewhere is False


# --- Kubernetes: pod_config ---------------------------------------------------------------------


REFUSED = [
    ({"spec": {"hostNetwork": True}}, "spec.hostNetwork", "shares the node's network"),
    ({"spec": {"hostPID": True}}, "spec.hostPID", "shares the node's processes"),
    ({"spec": {"hostIPC": True}}, "spec.hostIPC", "shares the node's IPC"),
    ({"spec": {"volumes": [{"name": "v", "emptyDir": {}},
                           {"name": "h", "hostPath": {"path": "/"}}]}},
     "spec.volumes[1].hostPath", "mounts a directory of the node"),
    ({"spec": {"containers": [{"securityContext": {"privileged": True}}]}},
     "spec.containers[0].securityContext.privileged", "root on the node"),
    ({"spec": {"containers": [{"securityContext": {"allowPrivilegeEscalation": True}}]}},
     "spec.containers[0].securityContext.allowPrivilegeEscalation", "privilege escalation"),
    ({"spec": {"containers": [{"securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}}]}},
     "spec.containers[0].securityContext.capabilities.add[0]", "adds capability 'SYS_ADMIN'"),
    ({"spec": {"initContainers": [{"name": "i", "image": "x",
                                   "securityContext": {"privileged": True}}]}},
     "spec.initContainers[0].securityContext.privileged", "root on the node"),
    ({"spec": {"containers": [{"ports": [{"containerPort": 80, "hostPort": 80}]}]}},
     "spec.containers[0].ports[0].hostPort", "shares the node's ports"),
    ({"spec": {"containers": [{"securityContext": {"procMount": "Unmasked"}}]}},
     "spec.containers[0].securityContext.procMount", "unmasks /proc"),
    ({"spec": {"securityContext": {"seccompProfile": {"type": "Unconfined"}}}},
     "spec.securityContext.seccompProfile.type", "no seccomp profile"),
    ({"spec": {"securityContext": {"sysctls": [{"name": "kernel.msgmax", "value": "1"}]}}},
     "spec.securityContext.sysctls[0].name", "unsafe sysctl 'kernel.msgmax'"),
    ({"spec": {"securityContext": {"seLinuxOptions": {"type": "spc_t"}}}},
     "spec.securityContext.seLinuxOptions.type", "SELinux type 'spc_t'"),
    ({"spec": {"serviceAccountName": "cluster-admin"}}, "spec.serviceAccountName",
     "the connection decides the pod's service account"),
    ({"spec": {"serviceAccount": "cluster-admin"}}, "spec.serviceAccount",
     "the connection decides the pod's service account"),
    ({"spec": {"automountServiceAccountToken": True}}, "spec.automountServiceAccountToken",
     "service account token"),
    ({"spec": {"nodeName": "n1"}}, "spec.nodeName", "bypasses the scheduler"),
    ({"spec": {"schedulerName": "mine"}}, "spec.schedulerName", "bypasses the scheduler"),
    ({"spec": {"priorityClassName": "system-node-critical"}}, "spec.priorityClassName",
     "the connection decides the pod's priority"),
    ({"spec": {"tolerations": [{"operator": "Exists"}]}}, "spec.tolerations",
     "the connection decides the pod's tolerations"),
    ({"spec": {"containers": [{"resources": {"limits": {"nvidia.com/gpu": "8"}}}]}},
     "spec.containers[0].resources.limits.nvidia.com/gpu", "resources.accelerators"),
    ({"metadata": {"annotations": {
        "container.apparmor.security.beta.kubernetes.io/skypilot": "unconfined"}}},
     "metadata.annotations.container.apparmor.security.beta.kubernetes.io/skypilot",
     "AppArmor profile 'unconfined'"),
]


def _k8s_offers(task, **settings):
    backend = _backend(**settings)
    view = cluster_view([_node("n1")], [], "team-a")
    return [backend._offer(task, req, view, "") for req in task.candidates]


@pytest.mark.parametrize(("pod_config", "path", "why"), REFUSED,
                         ids=[r[1] for r in REFUSED])
def test_a_pod_config_that_escapes_the_cluster_is_refused(pod_config, path, why):
    task = _task(pod_config=pod_config)
    [got] = _k8s_offers(task)
    assert not got.fits
    assert got.reason.startswith(f"config.kubernetes.pod_config.{path}: ") and why in got.reason
    assert got.reason.endswith("(refused unless the connection sets "
                               "'allow_privileged_pod_config': true)")
    with pytest.raises(SubmissionError, match=re.escape(f"pod_config.{path}: ")):
        _objects(_backend(), task, _offer(task))
    # the loader warns with the YAML's line, so `validate` shows it too
    assert any(f"config.kubernetes.pod_config.{path}: " in str(w) and why in str(w)
               for w in task.warnings)


def test_a_connection_may_allow_privileged_pod_configs():
    pod_config = {"spec": {"hostNetwork": True, "containers": [
        {"securityContext": {"capabilities": {"add": ["IPC_LOCK"]}}}]}}
    task = _task(pod_config=pod_config)
    [got] = _k8s_offers(task, allow_privileged_pod_config=True)
    assert got.fits, got.reason
    job, _ = _objects(_backend(allow_privileged_pod_config=True), task, _offer(task))
    spec = job["spec"]["template"]["spec"]
    assert spec["hostNetwork"] is True
    assert spec["containers"][0]["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    _validate(job)
    assert KubernetesSettings.from_extra("c", {"allow_privileged_pod_config": "true"}) \
        .allow_privileged_pod_config
    assert not KubernetesSettings.from_extra("c", {}).allow_privileged_pod_config
    with pytest.raises(ConfigurationError, match="'allow_privileged_pod_config' must be true"):
        KubernetesSettings.from_extra("c", {"allow_privileged_pod_config": "yes please"})


def test_a_pod_config_node_selector_narrows_but_cannot_swap_the_connections():
    task = _task(pod_config={"spec": {"nodeSelector": {"pool": "team-b", "zone": "z1"}}})
    job, _ = _objects(_backend(node_selector={"pool": "team-a"}), task,
                      _offer(task, node_selector={"skypilot.co/accelerator": "a100"}))
    assert job["spec"]["template"]["spec"]["nodeSelector"] == {
        "pool": "team-a", "zone": "z1", "skypilot.co/accelerator": "a100"}


def test_a_baseline_pod_config_still_fits():
    task = _task(pod_config={"metadata": {"labels": {"team": "a"}}, "spec": {
        "imagePullSecrets": [{"name": "regcred"}], "runtimeClassName": "nvidia",
        "automountServiceAccountToken": False,
        "securityContext": {"runAsUser": 1000, "sysctls": [
            {"name": "net.ipv4.tcp_keepalive_time", "value": "60"}]},
        "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory"}}],
        "containers": [{"securityContext": {"capabilities": {"add": ["CHOWN"]},
                                            "allowPrivilegeEscalation": False},
                        "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}]}]}})
    [got] = _k8s_offers(task)
    assert got.fits, got.reason
    assert not task.warnings


# --- a misconfigured connection fails the operator at once -----------------------------------


class MisconfiguredBackend(FakeBackend):
    name = "misconfigured"
    conn_types = ("misconfigured",)

    def probe(self, task):
        SlurmSettings.from_extra(self.conn_id, {"qos": "normal\nid"})
        raise AssertionError("not reached")


class TI:
    dag_id, task_id, run_id, try_number, map_index, start_date = "d", "t", "r", 1, -1, None

    def __init__(self):
        self.xcom: dict = {}

    def xcom_push(self, key, value):
        self.xcom[key] = json.loads(json.dumps(value))


@pytest.fixture
def fake_conns(monkeypatch):
    registry.register_backend(FakeBackend)
    registry.register_backend(MisconfiguredBackend)
    monkeypatch.setenv("AIRFLOW_CONN_C1", json.dumps({"conn_type": "fake"}))
    monkeypatch.setenv("AIRFLOW_CONN_BAD", json.dumps({"conn_type": "misconfigured"}))
    FakeBackend.reset()
    FakeBackend.offers = {"c1": [offer("c1", "p")]}
    yield
    FakeBackend.reset()


def test_a_misconfigured_connection_fails_the_task_before_anything_is_submitted(fake_conns):
    result = SkyPilotCapacityHook(["c1", "bad"]).probe(_task())
    assert result.config_errors == {
        "bad": "ConfigurationError: connection 'bad': extra 'qos' contains the control "
               "character '\\n': refused (each sbatch option is one '#SBATCH' line)"}
    assert [o.connection for o in result.offers] == ["c1"]
    op = SkyPilotOperator(task_id="t", task={"run": "x"}, connections=["c1", "bad"])
    with pytest.raises(AirflowFailException, match="misconfigured connections.*\n  bad: "
                                                   "ConfigurationError: connection 'bad': "
                                                   "extra 'qos'"):
        op.execute({"ti": TI()})
    assert FakeBackend.jobs == {}
    op = SkyPilotOperator(task_id="t", task={"run": "x"}, connections=["c1", "nope_undefined"])
    with pytest.raises(AirflowFailException, match="'nope_undefined' is not defined"):
        op.execute({"ti": TI()})
    assert FakeBackend.jobs == {}


# --- secrets through Airflow's masker ---------------------------------------------------------


@pytest.fixture
def masker():
    reset_secrets_masker()
    yield
    reset_secrets_masker()


def test_secret_values_are_masked_once_the_templates_are_rendered(masker):
    yaml_text = "run: x\nsecrets:\n  YAML_TOKEN: yaml-secret-value-2\n  REF: null\n"
    op = SkyPilotOperator(task_id="t", task=yaml_text, connections=["c1"],
                          secrets={"DB_URL": "{{ params.v }}"})
    op.render_template_fields({"params": {"v": "op-secret-value-1"}})
    assert op.secrets == {"DB_URL": "op-secret-value-1"}
    text = "op-secret-value-1 and yaml-secret-value-2, " + yaml_text
    assert redact(text) == "*** and ***, " + yaml_text.replace("yaml-secret-value-2", "***")


def test_a_secrets_base64_form_is_masked_too(masker):
    """AWS stores a secret in SSM as b64:<base64>, Kubernetes in a Secret's base64 data; the
    clients' DEBUG logs print the request bodies."""
    import base64

    op = SkyPilotOperator(task_id="t", task="run: x\n", connections=["c1"],
                          secrets={"T": "hf_supersecret_value"})
    op.render_template_fields({"params": {}})
    b64 = base64.b64encode(b"hf_supersecret_value").decode()
    assert redact(f'{{"Value": "b64:{b64}"}}') == '{"Value": "b64:***"}'


def test_a_mapped_tasks_secrets_are_masked_too(masker):
    """Airflow renders a mapped task on an unmapped copy (``_do_render_template_fields``)."""
    from airflow.sdk import DAG

    with DAG("d", schedule=None) as dag:
        mapped = SkyPilotOperator.partial(task_id="t", task="run: x\n", connections=["c1"]) \
            .expand(secrets=[{"A": "mapped-secret-0"}, {"A": "mapped-secret-1"}])

    class MapTI:
        map_index, task_id, dag_id, run_id = 1, "t", "d", "r"

    class Run:
        conf: dict = {}

    mapped.render_template_fields({"ti": MapTI(), "params": {}, "task": mapped, "dag": dag,
                                   "dag_run": Run()})
    assert redact("mapped-secret-0 mapped-secret-1") == "mapped-secret-0 ***"


def test_secrets_of_a_yaml_file_are_masked_and_a_broken_task_still_is(masker, tmp_path):
    path = tmp_path / "t.yaml"
    # broken: the secret's value also stands where a number must (SkyPilot str()s a nested
    # secret, so that one would load)
    path.write_text("run: x\nsecrets:\n  T: leaked-secret-xyz\nresources:\n"
                    "  cpus: leaked-secret-xyz\n")
    op = SkyPilotOperator(task_id="t", task=str(path), connections=["c1"])
    with pytest.raises(AirflowFailException) as info:
        op.load()
    assert "leaked-secret-xyz" in str(info.value)  # the message has it: the log must not
    assert "leaked-secret-xyz" not in redact(str(info.value))


def test_no_secret_value_reaches_the_trigger_xcom_or_the_run_state(fake_conns, masker):
    secret = "never-in-clear-123"
    op = SkyPilotOperator(task_id="t", task={"run": "x", "secrets": {"A": "yaml-" + secret}},
                          connections=["c1"], secrets={"B": secret}, deferrable=True)
    ti = TI()
    with pytest.raises(TaskDeferred) as info:
        op.execute({"ti": ti})
    deferred = info.value
    classpath, kwargs = deferred.trigger.serialize()
    blobs = [json.dumps(kwargs, default=str), json.dumps(deferred.kwargs, default=str),
             json.dumps(ti.xcom, default=str)]
    assert all(secret not in blob for blob in blobs)
    assert redact(f"x {secret} y") == "x *** y"


def test_a_secret_in_a_task_log_line_or_an_exception_is_redacted(tmp_path):
    """As in a worker: Airflow's own logging (with its masking processor), a real operator."""
    script = textwrap.dedent("""
        import sys
        from airflow.sdk.log import configure_logging
        configure_logging(output=sys.stdout)
        from airflow_skypilot.operators import SkyPilotOperator
        op = SkyPilotOperator(
            task_id="t", connections=["c1"], secrets={"API_URL": "{{ params.v }}"},
            task="run: x\\nsecrets:\\n  T: leaked-yaml-secret\\nresources:\\n"
                 "  cpus: leaked-yaml-secret\\n")
        op.render_template_fields({"params": {"v": "op-secret-in-log"}})
        op.log.info("connecting with %s", "op-secret-in-log")
        try:
            op.load()
        except Exception as exc:
            op.log.error("failed: %s", exc)
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, timeout=120, cwd=str(tmp_path)).stdout
    assert "connecting with ***" in out and "got '***'" in out, out
    assert "op-secret-in-log" not in out and "leaked-yaml-secret" not in out
