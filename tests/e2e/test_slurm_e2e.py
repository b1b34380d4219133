"""Step 3's end-to-end checks: real Airflow (`airflow dags test`), real Slurm clusters."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import uuid

import pytest
from airflow.sdk.exceptions import TaskDeferred

from airflow_skypilot.backends.base import JobHandle
from airflow_skypilot.operators import SkyPilotOperator
from airflow_skypilot.triggers.skypilot import SkyPilotJobTrigger, pollers_in_this_loop
from tests.e2e.conftest import REPO, copies_marked, failover_copies, shared_dir, wait_until

pytestmark = [pytest.mark.sandbox, pytest.mark.e2e]


def _fill(slurm, cluster, gres, count, partition=None):
    ids = []
    for _ in range(count):
        argv = ["sbatch", "--parsable", f"--gres={gres}", "--mem=100M", "--wrap", "sleep 600"]
        if partition:
            argv[1:1] = ["-p", partition]
        ids.append(slurm.run(cluster, *argv).stdout.strip())
    wait_until(lambda: all(slurm.run(cluster, "squeue", "-h", "-j", i, "-o", "%T").stdout.strip()
                           == "RUNNING" for i in ids), 30, what="fillers running")
    return ids


def _our_jobs(slurm, cluster, prefix="sky-e2e-task-run"):
    out = slurm.run(cluster, "squeue", "-h", "-t", "all", "-o", "%i|%j|%T").stdout
    return [line.split("|") for line in out.splitlines() if f"|{prefix}" in line]


def test_train_pipeline_runs_on_slurm(airflow_slurm):
    """The example DAG, as the demo runs it."""
    run = airflow_slurm.run("train_pipeline", dags=REPO / "dags")
    assert run.returncode == 0, run.output[-4000:]
    assert run.states == {"paths": "success", "preprocess": "success", "train": "success",
                          "evaluate": "success"}
    assert run.result("train")["connection"] in ("slurm_alpha", "slurm_beta")
    assert "eval: model trained on 100 rows" in run.output


def test_full_cluster_is_skipped_at_once_and_the_table_says_why(airflow_slurm, slurm):
    _fill(slurm, "alpha", "gpu:a100:4", 2)  # every A100 busy
    start = time.monotonic()
    run = airflow_slurm.run("e2e_task", {"task": "tasks/train_ckpt.yaml", "envs": {
        "CKPT_DIR": shared_dir(), "STEPS": "1"}})
    elapsed = time.monotonic() - start
    assert run.returncode == 0, run.output[-4000:]
    result = run.result("run")
    assert result["connection"] == "slurm_beta" and len(result["attempts"]) == 1
    assert elapsed < 90, "placed at once, not after a pending timeout"
    table = run.xcom("run", "skypilot_placement")
    rows = {(r["connection"], r["location"], r["verdict"]): r for r in table["rows"]}
    assert rows[("slurm_beta", "main", "chosen")]["reason"].startswith("free now")
    alpha = rows[("slurm_alpha", "batch", "queued")]
    assert alpha["reason"].startswith("0 of 8 A100 free, need 2 A100")
    assert "0 of 8 A100 free, need 2 A100" in run.output  # the same table in the task log


def test_node_failure_moves_the_job_to_the_other_cluster(airflow_slurm, slurm):
    ckpt, copies = shared_dir(), shared_dir()
    _fill(slurm, "beta", "gpu:h100:8", 1)  # beta busy: the first attempt goes to alpha
    with airflow_slurm.started("e2e_task", {"task": copies_marked("tasks/train_ckpt.yaml"),
                                            "envs": {"CKPT_DIR": ckpt, "STEPS": "12",
                                                     "COPIES_DIR": copies}}) as proc:
        job = wait_until(lambda: [j for j in _our_jobs(slurm, "alpha") if j[2] == "RUNNING"],
                         90, what="the training job running on alpha")[0]
        nodes = slurm.run("alpha", "squeue", "-h", "-j", job[0], "-o", "%N").stdout.strip()
        wait_until(lambda: slurm.run("beta", "bash", "-c", f"cat {ckpt}/* 2>/dev/null",
                                     check=False).stdout.strip() not in ("", "1"), 30,
                   what="a few checkpointed steps")
        slurm.run("beta", "scancel", "-u", "skyuser", "--partition", "main",
                  "--name", "wrap")  # free beta so the failover has somewhere to go
        slurm.kill_slurmd(nodes)
        run = airflow_slurm.finish(proc, "e2e_task", timeout=300)
    assert run.returncode == 0, run.output[-6000:]
    result = run.result("run")
    assert [(a["connection"], a["state"]) for a in result["attempts"]] == [
        ("slurm_alpha", "infra_failed"), ("slurm_beta", "succeeded")]
    task_ids = set(re.findall(r"task=(sky-airflow_\S+)", run.output))
    assert len(task_ids) == 1, "the same SKYPILOT_TASK_ID on both clusters"
    assert "resuming from step" in run.output, "the second attempt used the checkpoint"
    assert "moving elsewhere (EAGER_NEXT_REGION)" in run.output
    # the user code: the copy on the failed node stopped mid-run, the one on beta finished
    first, second = failover_copies(copies)
    assert (first[0].cluster, first[0].job) == ("alpha", job[0])
    assert second[0].cluster == "beta"


def test_user_failure_is_not_failed_over_and_shows_the_log_tail(airflow_slurm, slurm):
    run = airflow_slurm.run("e2e_task", {"task": "tasks/fail.yaml"})
    assert run.returncode != 0
    assert run.states["run"] == "failed"
    assert "ValueError: bad batch" in run.output
    assert "no restart on user errors" in run.output
    submitted = re.findall(r"Submitted slurm job (\d+)", run.output)
    assert len(submitted) == 1, "no failover for a user error"


def test_max_restarts_on_errors_restarts_once(airflow_slurm):
    marks = shared_dir()
    run = airflow_slurm.run("e2e_task", {"task": "tasks/fail_once.yaml",
                                         "envs": {"MARK_DIR": marks}})
    assert run.returncode == 0, run.output[-4000:]
    attempts = run.result("run")["attempts"]
    assert [a["state"] for a in attempts] == ["failed", "succeeded"]
    assert "second attempt succeeds" in run.output


def test_login_node_down_at_probe_time_places_on_the_other(airflow_slurm, slurm):
    slurm.stop_sshd("alpha")
    try:
        # a connection that cannot be listed at the start of the try is swept (a job of an
        # earlier try may run there) for up to unreachable_timeout after the job's end: short
        run = airflow_slurm.run("e2e_task", {"task": "tasks/ok.yaml", "unreachable_timeout": 10})
    finally:
        slurm.start_sshd("alpha")
    assert run.returncode == 0, run.output[-4000:]
    assert run.result("run")["connection"] == "slurm_beta"
    assert re.search(r"Connection slurm_alpha skipped for this placement: .*Unable to connect",
                     run.output)


# --- the operator and trigger in-process, against the real clusters ---------------------------


class _TI:
    def __init__(self, run_id: str):
        self.dag_id, self.task_id, self.run_id = "e2e_twice", "run", run_id
        self.try_number, self.map_index, self.start_date = 1, -1, None

    def xcom_push(self, key, value):
        pass


def test_execute_twice_for_the_same_try_leaves_one_job(slurm):
    run_id = f"manual__{uuid.uuid4().hex}"
    op = SkyPilotOperator(task_id="run", task=str(REPO / "tests/e2e/dags/tasks/sleep.yaml"),
                          connections=["slurm_alpha", "slurm_beta"], deferrable=True)
    handles = []
    for _ in range(2):
        with pytest.raises(TaskDeferred) as info:
            op.execute({"ti": _TI(run_id)})
        handles.append(info.value.trigger.handle)
    assert handles[0]["job_id"] == handles[1]["job_id"]
    assert handles[1]["adopted"] is True
    cluster = handles[0]["connection"].split("_")[1]
    names = slurm.run(cluster, "squeue", "-h", "-t", "all", "-o", "%j").stdout.split()
    assert names.count(handles[0]["job_name"]) == 1


def test_killing_the_task_cancels_the_slurm_job(slurm):
    # Deferred: the trigger's on_kill (Airflow >= 3.3 calls it on mark-failed/kill).
    op = SkyPilotOperator(task_id="run", task=str(REPO / "tests/e2e/dags/tasks/sleep.yaml"),
                          connections=["slurm_beta"], deferrable=True)
    with pytest.raises(TaskDeferred) as info:
        op.execute({"ti": _TI(f"manual__{uuid.uuid4().hex}")})
    trigger = info.value.trigger
    job_id = trigger.handle["job_id"]
    asyncio.run(trigger.on_kill())
    wait_until(lambda: slurm.run("beta", "squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T")
               .stdout.strip() == "CANCELLED", 30, what="the job cancelled")
    # Running in a worker (deferrable=False): the operator's on_kill.
    op = SkyPilotOperator(task_id="run", task=str(REPO / "tests/e2e/dags/tasks/sleep.yaml"),
                          connections=["slurm_beta"], deferrable=False, poll_interval=1,
                          max_failovers=0, reprobe_interval=1)
    ti = _TI(f"manual__{uuid.uuid4().hex}")  # job dirs outlive the sandbox: a fresh name
    thread = threading.Thread(target=lambda: _swallow(op.execute, {"ti": ti}), daemon=True)
    thread.start()
    wait_until(lambda: op._handle is not None, 60, what="submission")
    op.on_kill()
    job_id = op._handle.job_id
    wait_until(lambda: slurm.run("beta", "squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T")
               .stdout.strip() == "CANCELLED", 30, what="the job cancelled")
    thread.join(60)
    assert not thread.is_alive(), "the killed task's worker loop ended"


def _swallow(fn, *args):
    try:
        fn(*args)
    except Exception:  # the killed task ends in an error; this test looks at Slurm only
        pass


def test_fifty_watched_jobs_one_status_command_per_interval(slurm):
    from airflow_skypilot.backends.slurm import SlurmBackend
    from airflow_skypilot.spec import load_task

    beta = SlurmBackend("slurm_beta")
    task = load_task({"run": "sleep 600", "resources": {"cpus": 1}})
    offer = next(o for o in beta.probe(task) if o.fits)
    base = f"sky-many-{uuid.uuid4().hex[:6]}"
    handles = [beta.submit(task, offer, f"{base}-{i}", {"SKYPILOT_TASK_ID": "t"})
               for i in range(50)]
    slurm.clear_commands_log("beta")
    interval = 1.0

    async def watch() -> dict:
        triggers = [SkyPilotJobTrigger(h.to_dict(), poll_interval=interval) for h in handles]
        runs = [asyncio.ensure_future(t.run().__anext__()) for t in triggers]
        await asyncio.sleep(interval * 5 + 0.5)
        poller = pollers_in_this_loop()[("slurm", "slurm_beta")]
        counts = {"status": poller.status_polls, "logs": poller.log_polls}
        for r in runs:
            r.cancel()
        await asyncio.gather(*runs, return_exceptions=True)
        return counts

    counts = asyncio.run(watch())
    commands = slurm.commands_log("beta")
    slurm.reset()  # the 50 jobs must not outlive the test; each log line is one SSH command
    assert 5 <= counts["status"] <= 7, "one status poll per interval, whatever the job count"
    assert counts["logs"] == counts["status"]
    assert len(commands) == counts["status"] + counts["logs"], (
        "per interval one status command and one log command reach the cluster, for 50 jobs")
    json.dumps([h.to_dict() for h in handles])
    for h in handles:
        JobHandle.from_dict(h.to_dict())
