"""A real Airflow deployment, production-shaped, not ``airflow dags test``: PostgreSQL, the
CeleryExecutor on Redis with two Celery workers, two triggerers, api-server, scheduler and
dag-processor, each a process of its own, connections in the metadata DB, driven through the REST
API (tests/e2e/deployment.py starts and stops it; one deployment for the whole module).

This is the path users run: the worker defers, the trigger is serialized to the database and
re-created in a triggerer process, the job's end wakes a worker for ``execute_complete``; and
marking the deferred task failed in the UI makes the triggerer cancel the trigger, whose
``on_kill`` cancels the Slurm job. And at most one live copy when parts of it die: a worker
killed after its submission (the retry adopts the job), the triggerer killed while it watches
(another goes on), a run deleted and re-created under its id (nothing of the old run is
adopted). Triggerer HA: 20 deferred tasks over two triggerers, one SIGKILLed: the other takes
its triggers over, every job ends once, and each triggerer still sends one status request per
connection per poll interval.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from airflow_skypilot import identity
from airflow_skypilot.identity import TaskKey
from airflow_skypilot.links import job_path
from tests.e2e.conftest import (
    E2E_DAGS,
    assert_ran_once,
    counted,
    marks,
    shared_dir,
    wait_until,
)
from tests.e2e.deployment import TRIGGERER_1_CAPACITY, TRIGGERERS, Deployment, deployed

DAG_ID = "e2e_task"
RETRY_DAG_ID = "e2e_retry"  # not deferrable, one retry
HA_DAG_ID = "e2e_ha"  # the same task as e2e_task, its runs apart
SPREAD_DAG_ID = "e2e_spread"  # a sweep of 8 mapped members


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, slurm_sandbox_session, k8s_sandbox_session,
               aws_sandbox_session) -> Iterator[Deployment]:
    """One deployment for every scenario of this module (tests/e2e/deployment.py)."""
    sandboxes = (slurm_sandbox_session, k8s_sandbox_session, aws_sandbox_session)
    conns = {cid: c for box in sandboxes for cid, c in box.connections().items()}
    home = tmp_path_factory.mktemp("airflow-deployment")
    with deployed(conns, home, wait_dags=(DAG_ID, RETRY_DAG_ID, HA_DAG_ID, "e2e_timeout",
                                            SPREAD_DAG_ID)) as dep:
        yield dep


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


def _watching(deployment: Deployment, run_id: str, dag_id: str = DAG_ID) -> tuple[int, str]:
    """The triggerer that holds this deferred task's trigger: (its job id, its component)."""
    def assigned():
        trigger = deployment.ti(run_id, dag_id).get("trigger") or {}
        return trigger.get("triggerer_id")
    job_id = wait_until(assigned, 60, 0.5, what="the trigger assigned to a triggerer")
    return job_id, deployment.triggerers()[job_id]


def test_the_triggerer_killed_while_watching_the_job_still_completes_once(deployment, slurm):
    # The triggerer that watches the job is SIGKILLed (and started again): the trigger moves to
    # another one (from the database), which watches the same job to its end. Nothing is
    # submitted again, nothing is lost.
    counter = f"{shared_dir()}/counter"
    run_id = deployment.trigger(counted(counter, 20))
    prefix = TaskKey(DAG_ID, "run", run_id).prefix
    deployment.wait_ti(run_id, {"deferred"}, 180)
    wait_until(lambda: "counted: attempt" in deployment.trigger_log(run_id), 90, 0.5,
               what="the triggerer streaming the job's output")
    assert not marks(counter, "END"), "killed while the job runs"
    killed_job, triggerer = _watching(deployment, run_id)
    deployment.kill(triggerer)
    killed = time.time()
    deployment.start(triggerer)
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
    # the trigger ran in two triggerers (the log files carry their job ids): the killed one,
    # and the one (the other triggerer, or the restarted one) that watched the job to its end
    logs = deployment.trigger_logs(run_id)
    assert len(logs) == 2 and killed_job in logs, (killed_job, list(logs))
    [taker] = set(logs) - {killed_job}
    assert "counted: done" in logs[taker] and "Trigger fired event" in logs[taker]
    assert "counted: done" not in logs[killed_job]
    assert marks(counter, "END")[0].t > killed, "the job ran on after the kill"
    deployment.wait_started(triggerer)


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


# --- triggerer HA: two triggerers share the deferred tasks; one dies, the other takes over -----

#: the HA scenario's jobs per cluster: 1-CPU jobs, no more on a cluster than it has CPUs, so
#: none waits in a queue (none is looked at again or moved: the triggerers only poll)
HA_PLACES = {"alpha": 12, "beta": 8}
#: the e2e DAGs' poll_interval (tests/e2e/dags/e2e.py)
POLL_INTERVAL = 1.0


def _ha_task(cluster: str) -> str:
    """tasks/counted.yaml, pinned to one cluster."""
    text = (E2E_DAGS / "tasks" / "counted.yaml").read_text()
    assert "  infra: slurm\n" in text
    return text.replace("  infra: slurm\n", f"  infra: slurm/{cluster}\n")


class _Ports(threading.Thread):
    """Samples the TCP connections each triggerer's processes hold, to the end of the test: the
    client port of an SSH command (the sandbox's commands log) then says which triggerer sent
    it."""

    def __init__(self, deployment: Deployment):
        super().__init__(daemon=True)
        self.deployment = deployment
        self.owner: dict[int, str] = {}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            for name in TRIGGERERS:
                if self.deployment.alive(name):
                    for port in self.deployment.tcp_ports(name):
                        self.owner.setdefault(port, name)
            self.done.wait(0.2)

    def __enter__(self) -> _Ports:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.done.set()
        self.join(30)


def _requests(commands: list[tuple[float, str | None]], who: str, start: float, end: float
              ) -> tuple[int, int]:
    """``who``'s SSH commands in [start, end): how many, and the most in one poll interval."""
    times = [t for t, owner in commands if owner == who and start <= t < end]
    per_interval = Counter(int((t - start) // POLL_INTERVAL) for t in times)
    return len(times), max(per_interval.values(), default=0)


def test_triggerer_ha_the_other_triggerer_takes_a_killed_ones_jobs_over(deployment, slurm):
    # 20 deferred tasks over the two triggerers: the first ten defer while triggerer-2 is
    # stopped, and fill triggerer-1 (`--capacity 10`); the other ten then go to triggerer-2.
    # Their jobs run until a gate file appears. triggerer-1 is SIGKILLed: once its heartbeat is
    # older than [triggerer] triggerer_health_check_threshold (30 s), triggerer-2 takes its
    # triggers over. Every job then completes, each user code ran exactly once (one START, one
    # END, one Slurm job per task), and each triggerer polled each cluster once per interval
    # for all the jobs it watched (the e2e_ha DAG streams no logs: every SSH command a
    # triggerer sends is a status request).
    folder = shared_dir()
    gate = f"{folder}/gate"
    counters: dict[str, tuple[str, str]] = {}
    victim, survivor = TRIGGERERS
    killed = 0.0
    wave = [c for c, n in HA_PLACES.items() for _ in range(n // 2)]
    assert len(wave) == TRIGGERER_1_CAPACITY

    def tis() -> dict[str, dict[str, Any]]:
        return {t["dag_run_id"]: t for t in deployment.tis(HA_DAG_ID, set(counters))}

    def holder(ti: dict[str, Any]) -> int | None:
        return (ti.get("trigger") or {}).get("triggerer_id")

    def all_watched():
        now = tis()
        failed = [r for r, t in now.items() if t["state"] in ("failed", "upstream_failed")]
        assert not failed, deployment.task_log(failed[0], HA_DAG_ID)[-4000:]
        ok = len(now) == len(counters) and all(
            t["state"] == "deferred" and holder(t) for t in now.values())
        return now if ok and all(marks(c, "START") for _, c in counters.values()) else None

    def submit() -> dict[str, dict[str, Any]]:
        """Ten more runs; their task instances once all are deferred, their jobs running."""
        for cluster in wave:
            counter = f"{folder}/counter{len(counters)}"
            run_id = deployment.trigger(
                {"task": _ha_task(cluster),
                 "envs": {"COUNTER": counter, "WORK_SECONDS": "2", "GATE": gate}},
                dag_id=HA_DAG_ID)
            counters[run_id] = (cluster, counter)
        return wait_until(all_watched, 300, 1, what=f"{len(counters)} tasks deferred, their "
                          f"jobs running\n{deployment.logs()}")

    try:
        with _Ports(deployment) as ports:
            started = time.time()
            deployment.stop_component(survivor)
            first = submit()
            deployment.start(survivor)
            deployment.wait_started(survivor)
            before = submit()
            watched = time.time()
            runs = set(counters)
            names = deployment.triggerers()
            held = Counter(names[holder(t)] for t in before.values())
            assert {names[holder(t)] for r, t in before.items() if r in first} == {victim}
            assert held == {victim: TRIGGERER_1_CAPACITY, survivor: TRIGGERER_1_CAPACITY}, held
            held_on = Counter((names[holder(t)], counters[r][0]) for r, t in before.items())

            time.sleep(8)  # both triggerers poll their jobs for a while
            survivor_job = deployment.triggerer_job(survivor)
            deployment.kill(victim)
            killed = time.time()

            def taken_over():
                now = tis()
                return now if all(holder(t) == survivor_job for t in now.values()) else None
            after = wait_until(taken_over, 120, 0.5, what=f"{survivor} holding every trigger")
            took_over = time.time()
            assert all(t["state"] == "deferred" for t in after.values())
            assert not any(marks(c, "END") for _, c in counters.values()), "the jobs ran on"

            time.sleep(8)  # the survivor polls all the jobs for a while
            Path(gate).touch()
            released = time.time()

            def all_done():
                now = tis()
                states = Counter(t["state"] for t in now.values())
                assert not states.keys() & {"failed", "upstream_failed"}, states
                return states == Counter({"success": len(runs)})
            wait_until(all_done, 300, 1, what=f"every task done\n{deployment.logs()}")
            finished = time.time()

        # exactly once: one attempt, one Slurm job, the user code's START and END once
        for run_id, (cluster, counter) in counters.items():
            result = deployment.xcom(run_id, "return_value", HA_DAG_ID)
            [attempt] = result["attempts"]
            assert (attempt["connection"], attempt["state"], attempt["adopted"]) == \
                (f"slurm_{cluster}", "succeeded", False), attempt
            assert result["old_copies"] == []
            jobs = _jobs(slurm, TaskKey(HA_DAG_ID, "run", run_id).prefix)
            assert [(c, j) for c, j, _ in jobs] == [(cluster, attempt["job_id"])], jobs
            assert assert_ran_once(counter).copy == (cluster, attempt["job_id"])
            assert marks(counter, "END")[0].t > released

        # per-connection batching, per triggerer: one status request per cluster per poll
        # interval, whatever the number of jobs it watches
        interval_counts: dict[tuple[str, str], tuple[int, int, float]] = {}
        for cluster in HA_PLACES:
            commands = [(t, ports.owner.get(port))
                        for t, port, _ in slurm.timed_commands(cluster) if t >= started]
            windows = {victim: (watched, killed), survivor: (watched, released)}
            for who, (start, end) in windows.items():
                n, most = _requests(commands, who, start, end)
                interval_counts[(who, cluster)] = (n, most, end - start)
                intervals = (end - start) / POLL_INTERVAL
                if held_on[(who, cluster)] or who == survivor:
                    assert intervals / 3 <= n <= intervals + 2, (who, cluster, n, intervals)
                    assert most <= 2, (who, cluster, most)  # jitter: never one per job
            # the killed triggerer sent nothing after its death; the survivor alone polled
            # every job of the cluster after the takeover
            assert _requests(commands, victim, killed, finished)[0] == 0
            n, most = _requests(commands, survivor, took_over, released)
            assert n <= (released - took_over) / POLL_INTERVAL + 2 and most <= 2, (n, most)
        print(f"\ntriggers before the kill: {dict(held)} ({dict(held_on)}); killed {victim}; "
              f"{survivor} held all {len(after)} {took_over - killed:.1f}s after the kill; "
              f"status requests (n, most per interval, window s): "
              + ", ".join(f"{w}/{c}: {n}, {m}, {s:.1f}"
                          for (w, c), (n, m, s) in sorted(interval_counts.items()))
              + f"; all {len(runs)} done {finished - released:.1f}s after the release, "
              f"{finished - started:.0f}s in all")
        # the survivor ran the victim's triggers too: their runs have two trigger logs
        moved = [r for r, t in before.items() if names[holder(t)] == victim]
        for run_id in moved:
            assert len(deployment.trigger_logs(run_id, HA_DAG_ID)) == 2, run_id
    finally:
        Path(gate).touch()
        for name in TRIGGERERS:
            if not deployment.alive(name):
                deployment.start(name)
                deployment.wait_started(name)


def test_a_sweep_placing_at_once_spreads_over_the_places_with_free_gpus(deployment, slurm):
    """Eight mapped members, each on 1 GPU of either cluster, scheduled at once: 3 A100 are free
    on alpha and 5 H100 on beta. Each member goes where a GPU is free for it (the ledger of
    placements made moments ago: ``ledger.py``), so none waits behind a sweep-mate; the user
    code of each ran once. (Whether the eight probes overlap is up to the
    scheduler; tests/unit/test_ledger.py makes them overlap and shows the herd without it.)"""
    from tests.e2e.test_slurm_e2e import _fill

    fillers = [*_fill(slurm, "alpha", "gpu:a100:4", 1), *_fill(slurm, "alpha", "gpu:a100:1", 1),
               *_fill(slurm, "beta", "gpu:h100:3", 1)]
    task = (E2E_DAGS / "tasks" / "counted_gpu.yaml").read_text().replace(
        "{A100: 4, H100: 4}", "{A100: 1, H100: 1}")
    counter = f"{shared_dir()}/counter"
    run_id = deployment.trigger({"task": task, "envs": {"COUNTER": counter,
                                                        "WORK_SECONDS": "45"}},
                                dag_id=SPREAD_DAG_ID)
    path = f"/dags/{SPREAD_DAG_ID}/dagRuns/{run_id}/taskInstances/run"

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
