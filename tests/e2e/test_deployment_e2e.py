"""A real Airflow deployment, not ``airflow dags test``: api-server, scheduler (LocalExecutor),
dag-processor and triggerer as separate processes on one SQLite home, driven through the REST API.

This is the path users run: the worker defers, the trigger is serialized to the database and
re-created in the triggerer process, the job's end wakes a second worker for
``execute_complete``; and marking the deferred task failed in the UI makes the triggerer cancel
the trigger, whose ``on_kill`` cancels the Slurm job. And at most one live copy when parts of it
die: a worker killed after its submission (the retry adopts the job), the triggerer killed
while it watches (the next one goes on), a run deleted and re-created under its id (nothing of
the old run is adopted).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from airflow_skypilot import identity
from airflow_skypilot.identity import TaskKey
from airflow_skypilot.links import job_path
from tests.e2e.conftest import (
    E2E_DAGS,
    REPO,
    assert_ran_once,
    counted,
    marks,
    shared_dir,
    wait_until,
)

AIRFLOW = str(Path(sys.executable).parent / "airflow")
DAG_ID = "e2e_task"
RETRY_DAG_ID = "e2e_retry"  # not deferrable, one retry
COMPONENTS = ("api-server", "scheduler", "dag-processor", "triggerer")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Deployment:
    home: Path
    url: str
    env: dict[str, str]
    argv: dict[str, list[str]] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    token: str = ""

    def start(self, component: str) -> None:
        """Start a component in its own session, its output appended to its log."""
        with open(self.home / f"{component}.log", "a") as log:
            self.procs[component] = subprocess.Popen(
                [AIRFLOW, *self.argv.get(component, [component])], env=self.env, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True)

    def kill(self, component: str) -> None:
        """SIGKILL a component and every process it started (its session), as a crash."""
        proc = self.procs[component]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)

    def log(self, component: str) -> str:
        return (self.home / f"{component}.log").read_text(errors="replace")

    def logs(self) -> str:
        return "\n".join(f"--- {c} ---\n{self.log(c)[-3000:]}" for c in COMPONENTS)

    def trigger_log(self, run_id: str, dag_id: str = DAG_ID) -> str:
        """What the triggerer logged for this run's task (``attempt=1.log.trigger.<id>.log``)."""
        return self._task_log(run_id, dag_id, "*.log.trigger.*.log")

    def trigger_logs(self, run_id: str, dag_id: str = DAG_ID) -> dict[int, str]:
        """The trigger's log per triggerer (job id) that ran it."""
        files = self.home.glob(f"logs/dag_id={dag_id}/run_id={run_id}/task_id=run/"
                               "*.log.trigger.*.log")
        return {int(f.name.split(".")[-2]): f.read_text(errors="replace") for f in files}

    def task_log(self, run_id: str, dag_id: str = DAG_ID) -> str:
        """What the workers logged for this run's task."""
        return self._task_log(run_id, dag_id, "attempt=*.log")

    def _task_log(self, run_id: str, dag_id: str, pattern: str) -> str:
        files = sorted(self.home.glob(f"logs/dag_id={dag_id}/run_id={run_id}/task_id=run/"
                                      + pattern))
        return "".join(f.read_text(errors="replace") for f in files)

    def api(self, method: str, path: str, **kw: Any) -> httpx.Response:
        return httpx.request(method, f"{self.url}/api/v2{path}", timeout=30,
                             headers={"Authorization": f"Bearer {self.token}"}, **kw)

    def trigger(self, conf: dict[str, Any], dag_id: str = DAG_ID, run_id: str | None = None
                ) -> str:
        body: dict[str, Any] = {"logical_date": None, "conf": conf}
        if run_id is not None:
            body["dag_run_id"] = run_id
        r = self.api("POST", f"/dags/{dag_id}/dagRuns", json=body)
        assert r.status_code == 200, r.text
        return r.json()["dag_run_id"]

    def delete_run(self, run_id: str, dag_id: str = DAG_ID) -> None:
        """Delete a finished run (the scheduler marks it a moment after its last task)."""
        wait_until(lambda: self.run_state(run_id) in ("success", "failed"), 60, 0.5,
                   what=f"run {run_id} finished")
        r = self.api("DELETE", f"/dags/{dag_id}/dagRuns/{run_id}")
        assert r.status_code == 204, r.text

    def ti(self, run_id: str, dag_id: str = DAG_ID) -> dict[str, Any]:
        r = self.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/run")
        return r.json() if r.status_code == 200 else {}

    def run_state(self, run_id: str) -> str:
        return self.api("GET", f"/dags/{DAG_ID}/dagRuns/{run_id}").json().get("state", "")

    def xcom(self, run_id: str, key: str, dag_id: str = DAG_ID) -> Any:
        r = self.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/run/xcomEntries/{key}")
        if r.status_code != 200:
            return None
        value = r.json()["value"]
        return json.loads(value) if isinstance(value, str) else value

    def wait_ti(self, run_id: str, states: set[str], timeout: float,
                dag_id: str = DAG_ID) -> str:
        def reached():
            state = self.ti(run_id, dag_id).get("state")
            return state if state in states else None
        try:
            return wait_until(reached, timeout, 1, what=f"task state in {states}")
        except AssertionError:
            raise AssertionError(f"task is {self.ti(run_id, dag_id).get('state')!r}, "
                                 f"not in {states}\n"
                                 + self.logs()) from None


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, slurm_sandbox_session, k8s_sandbox_session,
               aws_sandbox_session) -> Iterator[Deployment]:
    sandboxes = (slurm_sandbox_session, k8s_sandbox_session, aws_sandbox_session)
    conns = {cid: c for box in sandboxes for cid, c in box.connections().items()}
    home = tmp_path_factory.mktemp("airflow-deployment")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    (home / "passwords.json").write_text(json.dumps({"admin": "admin"}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env.update({
        "AIRFLOW_HOME": str(home),
        "PYTHONPATH": str(REPO),
        "AIRFLOW__CORE__DAGS_FOLDER": str(E2E_DAGS),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
        "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
        "AIRFLOW__CORE__PARALLELISM": "8",  # a sweep of 8 places at once
        "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{url}/execution/",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(home / "passwords.json"),
        "AIRFLOW__API__BASE_URL": url,
        "AIRFLOW__API_AUTH__JWT_SECRET": "e2e-deployment-not-a-real-secret",
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
        "AIRFLOW__SCHEDULER__TRIGGER_TIMEOUT_CHECK_INTERVAL": "2",
        # a killed triggerer's triggers go to the next one after this much silence (default 30)
        "AIRFLOW__TRIGGERER__TRIGGERER_HEALTH_CHECK_THRESHOLD": "15",
        "AIRFLOW__SKYPILOT__CONNECTIONS": ",".join(sorted(conns)),
    })
    subprocess.run([AIRFLOW, "db", "migrate"], env=env, check=True, capture_output=True,
                   timeout=300)
    # connections in the metadata DB, as users add them: the triggerer then reads them through
    # its supervisor (env-var connections would skip that path)
    (home / "connections.json").write_text(json.dumps(conns))
    subprocess.run([AIRFLOW, "connections", "import", str(home / "connections.json")], env=env,
                   check=True, capture_output=True, timeout=120)
    dep = Deployment(home, url, env, argv={
        "api-server": ["api-server", "--host", "127.0.0.1", "--port", str(port), "--workers",
                       "1"]})
    try:
        for component in COMPONENTS:
            dep.start(component)

        def ready():
            for name, proc in dep.procs.items():
                assert proc.poll() is None, f"{name} exited\n{dep.logs()}"
            try:
                r = httpx.post(f"{url}/auth/token", json={"username": "admin",
                                                          "password": "admin"}, timeout=5)
            except httpx.HTTPError:
                return False
            if r.status_code != 201:
                return False
            dep.token = r.json()["access_token"]
            return all(dep.api("GET", f"/dags/{d}").status_code == 200
                       for d in (DAG_ID, RETRY_DAG_ID, "e2e_timeout"))
        wait_until(ready, 180, 1, what="the deployment up with the DAG parsed")
        yield dep
    finally:
        for proc in dep.procs.values():
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for proc in dep.procs.values():
            try:
                proc.wait(5)  # nothing to keep: the home is thrown away
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


OK_TASK = """\
name: ok
resources:
  infra: {infra}
run: echo "ok from $SKYPILOT_TASK_ID"
"""


@pytest.mark.parametrize("infra, sandbox, prefix", [
    ("slurm", "slurm", "slurm_"), ("k8s", "k8s", "k8s_"), ("aws", "aws", "aws_"),
])
def test_a_deferred_job_completes_through_the_triggerer(deployment, request, infra, sandbox,
                                                        prefix):
    box = request.getfixturevalue(sandbox)  # clean sandbox
    run_id = deployment.trigger({"task": OK_TASK.format(infra=infra)})
    assert deployment.wait_ti(run_id, {"success", "failed"}, 240) == "success", deployment.logs()
    result = deployment.xcom(run_id, "return_value")
    assert result["connection"].startswith(prefix)
    assert [a["state"] for a in result["attempts"]] == ["succeeded"]
    # the scheduler marks the run a moment after its last task
    wait_until(lambda: deployment.run_state(run_id) == "success", 60, what="the run succeeded")
    # the job was watched in the triggerer process: its output is in the trigger's log
    trigger_log = deployment.trigger_log(run_id)
    assert "airflow_skypilot.triggers.skypilot.SkyPilotJobTrigger" in trigger_log
    assert f"ok from sky-airflow_{DAG_ID}_run_" in trigger_log
    assert "Polling" not in trigger_log  # no failed poll: the connection came from the DB
    if sandbox == "aws":
        wait_until(lambda: box.running_instances() == [], 60, what="no instance left running")


SLEEP_ON_SLURM = """\
name: sleep
resources:
  infra: slurm
  accelerators: {A100: 1, H100: 1}
run: sleep 600
"""


def test_marking_the_deferred_task_failed_cancels_the_slurm_job(deployment, slurm):
    run_id = deployment.trigger({"task": SLEEP_ON_SLURM})
    deployment.wait_ti(run_id, {"deferred"}, 180)
    handle = wait_until(lambda: deployment.xcom(run_id, "skypilot_handle"), 30,
                        what="the job handle in XCom")
    cluster = handle["connection"].removeprefix("slurm_")

    def slurm_state() -> str:
        return slurm.run(cluster, "squeue", "-h", "-t", "all", "-j", handle["job_id"],
                         "-o", "%T").stdout.strip()
    wait_until(lambda: slurm_state() == "RUNNING", 60, what="the Slurm job running")
    # on_kill runs in the triggerer: the trigger must have been picked up (a task marked failed
    # before any triggerer runs its trigger leaves the job running; README, known limits)
    wait_until(lambda: "airflow-skypilot: job" in deployment.trigger_log(run_id), 90,
               what="the triggerer watching the job")

    r = deployment.api("PATCH", f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/run",
                       json={"new_state": "failed"})
    assert r.status_code == 200, r.text
    wait_until(lambda: slurm_state() == "CANCELLED", 90,
               what=f"job {handle['job_id']} cancelled\n{deployment.logs()}")
    trigger_log = deployment.trigger_log(run_id)
    assert "cancelled by user action" in trigger_log, trigger_log[-3000:]
    assert f"cancelling slurm job {handle['job_id']}" in trigger_log.lower(), trigger_log[-3000:]
    assert deployment.ti(run_id)["state"] == "failed"


def test_a_job_outliving_its_execution_timeout_is_cancelled(deployment, slurm):
    # the scheduler times the deferral out and resumes the task only to fail it (no
    # execute_complete, no on_kill): the operator still stops the job
    run_id = deployment.trigger({}, dag_id="e2e_timeout")
    deployment.wait_ti(run_id, {"deferred"}, 180, dag_id="e2e_timeout")
    handle = deployment.xcom(run_id, "skypilot_handle", dag_id="e2e_timeout")
    cluster = handle["connection"].removeprefix("slurm_")

    def slurm_state() -> str:
        return slurm.run(cluster, "squeue", "-h", "-t", "all", "-j", handle["job_id"],
                         "-o", "%T").stdout.strip()
    assert deployment.wait_ti(run_id, {"failed", "success"}, 180, dag_id="e2e_timeout") == \
        "failed"
    wait_until(lambda: slurm_state() == "CANCELLED", 30,
               what=f"job {handle['job_id']} cancelled\n{deployment.logs()}")
    log = deployment.task_log(run_id, dag_id="e2e_timeout")
    assert "The deferral ended without the job's end" in log, log[-3000:]
    assert "TaskDeferralTimeout" in log


def test_the_ui_pages_read_db_connections_and_list_the_jobs(deployment, slurm):
    run_id = deployment.trigger({"task": OK_TASK.format(infra="slurm")})
    assert deployment.wait_ti(run_id, {"success", "failed"}, 240) == "success", deployment.logs()
    with httpx.Client(base_url=deployment.url, timeout=120,
                      headers={"Authorization": f"Bearer {deployment.token}"}) as c:
        # the capacity page probes from the api-server process, with the connections in the DB
        body = c.get("/skypilot/api/capacity", params={"refresh": "true"}).json()
        assert not [r for r in body["rows"] if r.get("error")], body["rows"]
        rows = {(r["connection"], r["location"], r.get("accelerator")): r for r in body["rows"]}
        assert rows[("slurm_alpha", "batch", "A100")]["total"] == 8
        assert rows[("slurm_beta", "main", "H100")]["total"] == 8
        assert {"k8s_sandbox", "aws_sandbox"} <= {conn for conn, _, _ in rows}
        # the jobs page lists the run, placed where the task says
        jobs = c.get("/skypilot/api/jobs").json()["jobs"]
    job = next(j for j in jobs if j["run_id"] == run_id)
    assert job["dag_id"] == DAG_ID and job["connection"].startswith("slurm_"), job


# --- at most one live copy: a worker or the triggerer dies, a run is deleted and re-created ----

#: Slurm states of a job that may still run
LIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING",
        "STOPPED", "SIGNALING", "STAGE_OUT"}


def _jobs(slurm, prefix: str) -> list[tuple[str, str, str]]:
    """(cluster, job id, state) of every job under ``prefix`` that the clusters know."""
    out = []
    for cluster in ("alpha", "beta"):
        lines = slurm.run(cluster, "squeue", "-h", "-t", "all", "-o", "%i|%j|%T",
                          check=False).stdout.splitlines()
        out += [(cluster, job, state) for job, name, state in
                (line.split("|") for line in lines) if name.startswith(prefix)]
    return out


class _Watch(threading.Thread):
    """Samples the task's jobs on both clusters twice a second, to the end of the test:
    the most that were alive at once, and every job ever seen."""

    def __init__(self, slurm, prefix: str):
        super().__init__(daemon=True)
        self.slurm, self.prefix = slurm, prefix
        self.most_alive, self.seen = 0, set()
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            jobs = _jobs(self.slurm, self.prefix)
            self.seen |= {(cluster, job) for cluster, job, _ in jobs}
            self.most_alive = max(self.most_alive, sum(s in LIVE for _, _, s in jobs))
            self.done.wait(0.5)

    def __enter__(self) -> _Watch:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.done.set()
        self.join(30)


def _task_process(ti_id: str) -> int:
    """The pid of the process running this task instance (the task runner names itself)."""
    title = f"airflow worker -- {ti_id}".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(title):
                return int(pid)
        except OSError:
            continue
    raise AssertionError(f"no process runs task instance {ti_id}")


def test_a_worker_killed_right_after_submitting_its_retry_adopts_the_job(deployment, slurm):
    # The worker dies (SIGKILL: no on_kill, nothing cancelled) the moment its job is in the
    # queue; Airflow retries the task; the new try finds the job and adopts it: one job.
    counter = f"{shared_dir()}/counter"
    run_id = deployment.trigger(counted(counter, 25), dag_id=RETRY_DAG_ID)
    prefix = TaskKey(RETRY_DAG_ID, "run", run_id).prefix
    with _Watch(slurm, prefix) as watch:
        [(cluster, job, _)] = wait_until(lambda: _jobs(slurm, prefix), 180, 0.2,
                                         what=f"a job {prefix}* submitted")
        ti = deployment.ti(run_id, RETRY_DAG_ID)
        assert ti["state"] == "running" and ti["try_number"] == 1, ti
        os.kill(_task_process(ti["id"]), signal.SIGKILL)
        assert deployment.wait_ti(run_id, {"success", "failed"}, 240, RETRY_DAG_ID) == \
            "success", deployment.task_log(run_id, RETRY_DAG_ID)[-4000:]
    ti = deployment.ti(run_id, RETRY_DAG_ID)
    assert ti["try_number"] == 2, "the killed try was retried"
    result = deployment.xcom(run_id, "return_value", RETRY_DAG_ID)
    assert [(a["connection"], a["job_id"], a["adopted"], a["state"])
            for a in result["attempts"]] == [(f"slurm_{cluster}", job, True, "succeeded")]
    assert watch.seen == {(cluster, job)}, "one job, never a second one"
    assert watch.most_alive == 1
    end = assert_ran_once(counter)
    assert end.copy == (cluster, job)
    log = deployment.task_log(run_id, RETRY_DAG_ID)
    assert f"Adopting job {job} ({prefix}c0-t1-a0) on slurm_{cluster}" in log, log[-4000:]


def test_the_triggerer_killed_while_watching_the_job_still_completes_once(deployment, slurm):
    # The triggerer that watches the job is SIGKILLed and started again: the trigger moves to
    # the new one (from the database), which watches the same job to its end. Nothing is
    # submitted again, nothing is lost.
    counter = f"{shared_dir()}/counter"
    run_id = deployment.trigger(counted(counter, 20))
    prefix = TaskKey(DAG_ID, "run", run_id).prefix
    deployment.wait_ti(run_id, {"deferred"}, 180)
    wait_until(lambda: "counted: attempt" in deployment.trigger_log(run_id), 90, 0.5,
               what="the triggerer streaming the job's output")
    assert not marks(counter, "END"), "killed while the job runs"
    deployment.kill("triggerer")
    killed = time.time()
    deployment.start("triggerer")
    assert deployment.wait_ti(run_id, {"success", "failed"}, 240) == "success", \
        deployment.logs()
    result = deployment.xcom(run_id, "return_value")
    [attempt] = result["attempts"]
    assert attempt["state"] == "succeeded" and not attempt["adopted"], attempt
    assert result["old_copies"] == []
    [(cluster, job, state)] = _jobs(slurm, prefix)  # one job: no second submission
    assert (f"slurm_{cluster}", job, state) == (attempt["connection"], attempt["job_id"],
                                                "COMPLETED")
    assert assert_ran_once(counter).copy == (cluster, job)
    log = deployment.task_log(run_id)
    assert log.count("Submitted slurm job") == 1, log[-4000:]
    # the trigger ran in two triggerers (the log files carry their job ids): the new one
    # watched the job to its end
    logs = deployment.trigger_logs(run_id)
    assert len(logs) == 2, list(logs)
    assert "counted: done" in logs[max(logs)] and "Trigger fired event" in logs[max(logs)]
    assert "counted: done" not in logs[min(logs)]
    assert marks(counter, "END")[0].t > killed, "the job ran on after the kill"


def test_a_deleted_runs_jobs_are_not_adopted_by_the_run_recreated_under_its_id(deployment,
                                                                              slurm):
    # A run submits a job that outlives it (wait_for_completion=False) and is deleted; a new
    # run under the same run_id must not adopt that job (its user code would then never run):
    # it stops it and runs its own. Deleted and re-created again, the new run does not adopt
    # the finished job of the run before either.
    run_id = f"e2e_deleted_{uuid.uuid4().hex[:8]}"
    prefix = TaskKey(DAG_ID, "run", run_id).prefix
    counters = [f"{shared_dir()}/counter{i}" for i in range(3)]

    def again(counter: str, after: float) -> tuple[dict[str, Any], str]:
        """Delete the run and, once its start comes clearly after ``after`` (the last job's
        submission), create it again under the same id: its one attempt (not adopted: it ran
        its own user code, once) and its log."""
        deployment.delete_run(run_id)
        wait_until(lambda: time.time() > after + identity.START_SKEW_SECONDS + 1, 60, 1,
                   what="the new run to start well after the last submission")
        deployment.trigger(counted(counter, 3), run_id=run_id)
        assert deployment.wait_ti(run_id, {"success", "failed"}, 180) == "success", \
            deployment.logs() + "\n--- task log ---\n" + deployment.task_log(run_id)[-6000:]
        [attempt] = deployment.xcom(run_id, "return_value")["attempts"]
        assert not attempt["adopted"], attempt
        assert_ran_once(counter)
        return attempt, deployment.task_log(run_id)

    deployment.trigger(counted(counters[0], 300, wait_for_completion=False), run_id=run_id)
    assert deployment.wait_ti(run_id, {"success", "failed"}, 180) == "success"
    old = deployment.xcom(run_id, "return_value")  # the handle: nobody watches the job
    wait_until(lambda: marks(counters[0], "TICK"), 60, what="the old job running")

    second, log = again(counters[1], old["submitted_at"])
    assert second["job_id"] != old["job_id"]
    assert f"Stopping job {old['job_id']} ({old['job_name']}) on {old['connection']}: " \
        "submitted before this run started" in log, log[-4000:]
    states = {(f"slurm_{c}", j): s for c, j, s in _jobs(slurm, prefix)}
    assert states[(old["connection"], old["job_id"])] == "CANCELLED"
    assert not marks(counters[0], "END"), "the old copy was stopped"
    assert max(m.t for m in marks(counters[0])) < marks(counters[1])[0].t, \
        "the old copy was dead before the new one started"

    third, log = again(counters[2], second["submitted_at"])
    assert third["job_id"] not in (old["job_id"], second["job_id"])
    assert f"Job {second['job_id']} ({prefix}c0-t1-a1) on {second['connection']} is left " \
        "alone: submitted before this run started" in log, log[-4000:]
    assert len({j for _, j, _ in _jobs(slurm, prefix)}) == 3


def test_a_training_steps_asset_event_triggers_the_dag_scheduled_on_it(deployment):
    # tests/e2e/dags/e2e_taskflow.py: a @task.skypilot with the asset as its outlet, and a DAG
    # scheduled on that asset that returns the extras of the events that triggered it
    producer, consumer = "e2e_asset_train", "e2e_asset_evaluate"
    wait_until(lambda: all(deployment.api("GET", f"/dags/{d}").status_code == 200
                           for d in (producer, consumer)), 90, 1, what="the asset DAGs parsed")
    run_id = deployment.trigger({}, dag_id=producer)

    def ti(dag_id: str, run: str, task_id: str) -> dict[str, Any]:
        r = deployment.api("GET", f"/dags/{dag_id}/dagRuns/{run}/taskInstances/{task_id}")
        return r.json() if r.status_code == 200 else {}

    def xcom(dag_id: str, run: str, task_id: str) -> Any:
        r = deployment.api("GET", f"/dags/{dag_id}/dagRuns/{run}/taskInstances/{task_id}/"
                                  "xcomEntries/return_value")
        value = r.json()["value"] if r.status_code == 200 else None
        return json.loads(value) if isinstance(value, str) else value

    wait_until(lambda: ti(producer, run_id, "train_model").get("state") in ("success", "failed"),
               240, 1, what=f"{producer} done\n{deployment.logs()}")
    assert ti(producer, run_id, "train_model")["state"] == "success", deployment.logs()
    result = xcom(producer, run_id, "train_model")
    # the decorated task is the operator: its extra link and its row on the jobs page
    links = deployment.api("GET", f"/dags/{producer}/dagRuns/{run_id}/taskInstances/"
                                  "train_model/links").json()["extra_links"]
    assert links["SkyPilot job"] == deployment.url + job_path(producer, run_id, "train_model")
    jobs = httpx.get(f"{deployment.url}/skypilot/api/jobs", params={"dag_id": producer},
                     headers={"Authorization": f"Bearer {deployment.token}"}, timeout=30)
    (row,) = [j for j in jobs.json()["jobs"] if j["run_id"] == run_id]
    assert (row["operator"], row["job_id"]) == ("SkyPilotDecoratedOperator", result["job_id"])

    # the scheduler starts the DAG scheduled on the asset, which sees the event's extra
    def triggered() -> str | None:
        runs = deployment.api("GET", f"/dags/{consumer}/dagRuns").json()["dag_runs"]
        return next((r["dag_run_id"] for r in runs if r["run_type"] == "asset_triggered"), None)
    consumer_run = wait_until(triggered, 120, 1, what=f"a {consumer} run\n{deployment.logs()}")
    wait_until(lambda: ti(consumer, consumer_run, "evaluate").get("state") in ("success",
                                                                              "failed"),
               120, 1, what=f"{consumer} done")
    seen = xcom(consumer, consumer_run, "evaluate")
    assert [e["job_id"] for e in seen] == [result["job_id"]], seen

    # the asset event, as the REST API lists it, carries where and how the job ran (asked once
    # the run it created has started: Airflow 3.3.2 answers 500 while that run is only queued,
    # its DagRunAssetReference.start_date being required)
    r = deployment.api("GET", "/assets/events", params={
        "source_dag_id": producer, "source_run_id": run_id})
    assert r.status_code == 200, (r.status_code, r.text)
    (event,) = r.json()["asset_events"]
    extra = event["extra"]
    assert {k: extra[k] for k in ("connection", "location", "job_id", "skypilot_task_id",
                                  "attempts", "gpu_hours", "cost")} == {
        "connection": result["connection"], "location": result["location"],
        "job_id": result["job_id"], "skypilot_task_id": result["task_id"], "attempts": 1,
        "gpu_hours": result["gpu_hours"], "cost": result["cost"]}
    assert seen[0] == extra
    assert [(d["dag_id"], d["run_id"]) for d in event["created_dagruns"]] == [
        (consumer, consumer_run)]


def test_a_sweep_placing_at_once_spreads_over_the_places_with_free_gpus(deployment, slurm):
    """Eight mapped members, each on 1 GPU of either cluster, scheduled at once: 3 A100 are free
    on alpha and 5 H100 on beta. Each member goes where a GPU is free for it (the ledger of
    placements made moments ago: ``ledger.py``), so none waits behind a sweep-mate; the user
    code of each ran once. (Whether the eight probes overlap is up to the
    scheduler; tests/unit/test_ledger.py makes them overlap and shows the herd without it.)"""
    from tests.e2e.test_slurm_e2e import _fill

    wait_until(lambda: deployment.api("GET", "/dags/e2e_spread").status_code == 200, 90, 1,
               what="e2e_spread parsed")
    fillers = [*_fill(slurm, "alpha", "gpu:a100:4", 1), *_fill(slurm, "alpha", "gpu:a100:1", 1),
               *_fill(slurm, "beta", "gpu:h100:3", 1)]
    task = (E2E_DAGS / "tasks" / "counted_gpu.yaml").read_text().replace(
        "{A100: 4, H100: 4}", "{A100: 1, H100: 1}")
    counter = f"{shared_dir()}/counter"
    run_id = deployment.trigger({"task": task, "envs": {"COUNTER": counter,
                                                        "WORK_SECONDS": "45"}},
                                dag_id="e2e_spread")
    path = f"/dags/e2e_spread/dagRuns/{run_id}/taskInstances/run"

    def done() -> list[dict[str, Any]] | None:
        tis = deployment.api("GET", f"{path}/listMapped").json().get("task_instances", [])
        return tis if len(tis) == 8 and all(t["state"] in ("success", "failed")
                                            for t in tis) else None
    tis = wait_until(done, 300, 1, what=f"the sweep done\n{deployment.logs()}")
    try:
        assert [t["state"] for t in tis] == ["success"] * 8, deployment.logs()
        results = []
        for i in range(8):
            r = deployment.api("GET", f"{path}/xcomEntries/return_value",
                               params={"map_index": i})
            value = r.json()["value"]
            results.append(json.loads(value) if isinstance(value, str) else value)
        assert Counter(r["connection"] for r in results) == {"slurm_beta": 5,
                                                              "slurm_alpha": 3}, results
        # the Slurm probe lists our jobs by name before it reads the nodes, so a sweep-mate's
        # job is counted once (ledger.py); only one submitted in the milliseconds between that
        # listing and the node read is counted twice, and the member it misleads goes to a queue
        # and is moved within a reprobe interval (5 s here). None waits behind a sweep-mate's
        # 45 s of work.
        for r in results:
            first, last = r["attempts"][0], r["attempts"][-1]
            assert [a["state"] for a in r["attempts"][:-1]] == ["moved"] * \
                (len(r["attempts"]) - 1) and last["state"] == "succeeded", r["attempts"]
            assert last["started_at"] - first["submitted_at"] < 35, r["attempts"]
        moved = [r["attempts"] for r in results if len(r["attempts"]) > 1]
        print(f"\nsweep of 8: {len(moved)} member(s) moved from a queue")
        assert len(moved) <= 1, f"the members placed right at once: {moved}"
        for i in range(8):
            assert_ran_once(f"{counter}-{i}")
    finally:
        slurm.run("alpha", "scancel", *fillers[:2])
        slurm.run("beta", "scancel", fillers[2])
