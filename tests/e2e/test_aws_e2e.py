"""Step 5's end-to-end check: Slurm and Kubernetes full -> spot instance; reclaimed -> elsewhere."""

from __future__ import annotations

import os

import pytest
from kubernetes import client, config

from tests.e2e.conftest import copies_marked, failover_copies, shared_dir, wait_until
from tests.e2e.test_slurm_e2e import _fill

pytestmark = [pytest.mark.sandbox, pytest.mark.e2e]


def _fill_k8s(k8s) -> None:
    api = config.new_client_from_config(config_file=str(k8s.kubeconfig), context="sandbox")
    core = client.CoreV1Api(api)
    for node in ("gpu-node-1", "gpu-node-2"):
        core.create_namespaced_pod("default", {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"fill-{node}"},
            "spec": {"restartPolicy": "Never", "nodeSelector": {"kubernetes.io/hostname": node},
                     "containers": [{"name": "c", "image": "busybox",
                                     "command": ["sleep", "600"],
                                     "resources": {"limits": {"nvidia.com/gpu": "8"}}}]}})
    wait_until(lambda: all(core.read_namespaced_pod(f"fill-{n}", "default").status.phase
                           == "Running" for n in ("gpu-node-1", "gpu-node-2")), 30,
               what="Kubernetes GPUs filled")
    api.close()


def _ours(aws) -> list[dict]:
    return [i for i in aws.instances() if i.get("status") == "running" and i.get("pid")]


def test_full_on_prem_overflows_to_spot_and_survives_a_reclaim(airflow_all, slurm, k8s, aws):
    _fill(slurm, "alpha", "gpu:a100:4", 2)
    _fill(slurm, "beta", "gpu:h100:8", 1)
    _fill_k8s(k8s)
    ckpt, copies = shared_dir(), shared_dir()
    proc = airflow_all.start("e2e_task", {"task": copies_marked("tasks/spot_overflow.yaml"),
                                          "envs": {"CKPT_DIR": ckpt, "STEPS": "15",
                                                   "COPIES_DIR": copies}})
    try:
        wait_until(lambda: "Submitted aws job" in proc.output(), 120, what="a spot launch")
        wait_until(lambda: os.listdir(ckpt) and open(os.path.join(ckpt, os.listdir(ckpt)[0]))
                   .read().strip() not in ("", "1", "2"), 120, what="a few checkpointed steps")
        instance = wait_until(lambda: _ours(aws), 30, what="the instance process")[0]
        aws.interrupt_spot(instance["instance_id"], notice_seconds=2)
        run = airflow_all.finish(proc, "e2e_task", timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert run.returncode == 0, run.output[-6000:]
    attempts = run.result("run")["attempts"]
    assert attempts[0]["connection"] == "aws_sandbox" and attempts[0]["state"] == "preempted"
    assert attempts[-1]["state"] == "succeeded"
    assert attempts[-1]["location"] != attempts[0]["location"], "placed elsewhere"
    table = run.xcom("run", "skypilot_placement")
    assert any(r["connection"] == "slurm_alpha" and r["verdict"] == "queued"
               for r in table["rows"]), "the table shows on-prem was full"
    assert "resuming from step" in run.output
    # the user code: the reclaimed instance's copy stopped mid-run, the next one finished
    failover_copies(copies)
    wait_until(lambda: aws.running_instances() == [], 60, what="no instance left running")
