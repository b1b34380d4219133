"""Step 4's end-to-end check: Slurm full -> Kubernetes; pod evicted -> back to Slurm."""

from __future__ import annotations

import os

import pytest

from tests.e2e.conftest import copies_marked, failover_copies, shared_dir, wait_until
from tests.e2e.test_slurm_e2e import _fill

pytestmark = [pytest.mark.sandbox, pytest.mark.e2e]


def _pods(k8s, prefix="sky-e2e-task-run"):
    return [p for p in k8s.processes() if p.get("pod", "").startswith(prefix)]


def test_slurm_full_runs_on_kubernetes_and_eviction_brings_it_back(airflow_k8s, slurm, k8s):
    fillers = _fill(slurm, "alpha", "gpu:a100:4", 2) + _fill(slurm, "beta", "gpu:h100:8", 1)
    ckpt, copies = shared_dir(), shared_dir()
    proc = airflow_k8s.start("e2e_task", {"task": copies_marked("tasks/train_ckpt.yaml"),
                                          "envs": {"CKPT_DIR": ckpt, "STEPS": "12",
                                                   "COPIES_DIR": copies}})
    try:
        pod = wait_until(lambda: _pods(k8s), 120, what="the training pod running")[0]
        wait_until(lambda: any(os.listdir(ckpt)) and
                   open(os.path.join(ckpt, os.listdir(ckpt)[0])).read().strip() not in ("", "1"),
                   60, what="a few checkpointed steps")
        k8s.evict_pod(pod["namespace"], pod["pod"])
        # The job is placed again; Slurm is still full, so it queues there until a cluster frees.
        wait_until(lambda: "Submitted Slurm job" in proc.output(), 120,
                   what="a queued Slurm job after the eviction")
        for cluster in ("alpha", "beta"):
            slurm.run(cluster, "scancel", *[f for f in fillers], check=False)
        run = airflow_k8s.finish(proc, "e2e_task", timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert run.returncode == 0, run.output[-6000:]
    attempts = run.result("run")["attempts"]
    assert attempts[0]["connection"] == "k8s_sandbox"
    assert attempts[0]["state"] in ("infra_failed", "preempted")
    assert attempts[-1]["connection"].startswith("slurm_") and attempts[-1]["state"] == \
        "succeeded"
    assert "resuming from step" in run.output
    # the user code: the evicted pod's copy stopped mid-run (the Job started no other pod),
    # the copy on Slurm finished
    first, second = failover_copies(copies)
    assert first[0].cluster == "" and second[0].cluster in ("alpha", "beta")
