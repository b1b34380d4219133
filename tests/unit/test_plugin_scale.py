"""The pages stay small and right whatever the metadata DB holds: a job reads only its own XComs
(not every task's ``return_value`` in its run), a sweep of thousands is shown a page at a time
and summed whole on the jobs page too, a job queued for a day stays listed however many ran
since, a mapped job's page links only its neighbours, the usage page says which tasks it cannot
count, and clicks of "probe again" share one probe. A scratch SQLite DB of Airflow's own tables
stands in for the metadata DB."""

from __future__ import annotations

import contextlib
import json
import re
import threading
import uuid
from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import create_engine, event, insert
from sqlalchemy.orm import Session
from sqlalchemy.pool import StaticPool

from airflow_skypilot.plugins import auth, capacity, jobs, routes, sweep_views, usage

RESULT = {"state": "succeeded", "connection": "slurm_a", "location": "batch", "job_id": "1",
          "gpu_hours": 0.5, "cost": 1.0,
          "attempts": [{"connection": "slurm_a", "location": "batch", "job_id": "1",
                        "state": "succeeded", "submitted_at": 1000, "started_at": 1010,
                        "ended_at": 1900}]}
HANDLE = {"backend": "slurm", "connection": "slurm_a", "location": "batch", "job_id": "1"}


@pytest.fixture(scope="module")
def engine():
    from airflow.models import import_all_models
    from airflow.models.base import Base

    import_all_models()
    engine = create_engine("sqlite://", connect_args={"check_same_thread": False},
                           poolclass=StaticPool)
    Base.metadata.create_all(engine)
    return engine


@pytest.fixture
def db(engine, monkeypatch):
    """Empty tables, the plugin's sessions on them, and a reader allowed every DAG."""
    from airflow.models.base import Base
    from airflow.utils import session as airflow_session

    with engine.begin() as conn:
        for table in reversed(Base.metadata.sorted_tables):
            conn.execute(table.delete())

    @contextlib.contextmanager
    def create_session():
        with Session(engine) as session:
            yield session
            session.commit()

    monkeypatch.setattr(airflow_session, "create_session", create_session)
    for module in (jobs, routes):
        monkeypatch.setattr(module, "team_names", lambda dag_ids: {})
        monkeypatch.setattr(module, "can_read_job", lambda user, dag_id, team=None: True)
    monkeypatch.setattr(jobs, "readable_dag_ids", lambda user: {"d", "e"})
    monkeypatch.setitem(routes.app.dependency_overrides, auth.current_user, lambda: object())
    return _Rows(engine)


class _Rows:
    """Writes DAG runs, task instances and XComs as the scheduler and operator would."""

    def __init__(self, engine):
        self.engine = engine
        self.runs: dict[tuple[str, str], int] = {}

    def run(self, dag_id, run_id):
        from airflow.models.dagrun import DagRun

        if (dag_id, run_id) not in self.runs:
            with self.engine.begin() as conn:
                self.runs[(dag_id, run_id)] = conn.execute(insert(DagRun.__table__).values(
                    dag_id=dag_id, run_id=run_id, run_type="manual", clear_number=0,
                    run_after=datetime(2026, 1, 1, tzinfo=timezone.utc),
                    logical_date=datetime(2026, 1, 1, len(self.runs), tzinfo=timezone.utc),
                    span_status="not_started")).inserted_primary_key[0]
        return self.runs[(dag_id, run_id)]

    def tis(self, dag_id, run_id, task_id, map_indexes=(-1,), state="success", xcoms=None,
            start=None, end=None, next_kwargs=None):
        """Task instances of one task, each with these XComs (``{key: value}``)."""
        from airflow.models.taskinstance import TaskInstance
        from airflow.models.xcom import XComModel

        rid = self.run(dag_id, run_id)
        start = start or datetime(2026, 1, 1, 1, tzinfo=timezone.utc)
        with self.engine.begin() as conn:
            conn.execute(insert(TaskInstance.__table__), [
                {"id": uuid.uuid4(), "dag_id": dag_id, "run_id": run_id, "task_id": task_id,
                 "map_index": i, "state": state, "try_number": 1, "pool": "default_pool",
                 "pool_slots": 1, "span_status": "not_started", "start_date": start,
                 "end_date": end, "next_method": "execute_complete" if next_kwargs else None,
                 "next_kwargs": next_kwargs}
                for i in map_indexes])
            rows = [{"dag_run_id": rid, "dag_id": dag_id, "run_id": run_id, "task_id": task_id,
                     "map_index": i, "key": key, "value": json.dumps(value), "timestamp": start}
                    for i in map_indexes for key, value in (xcoms or {}).items()]
            if rows:
                conn.execute(insert(XComModel.__table__), rows)


@pytest.fixture
def xcom_loads():
    """How many XCom rows the plugin loads."""
    from airflow.models.xcom import XComModel

    count = {"rows": 0}

    def loaded(target, context):
        count["rows"] += 1

    event.listen(XComModel, "load", loaded)
    yield count
    event.remove(XComModel, "load", loaded)


def _client():
    from fastapi.testclient import TestClient

    return TestClient(routes.app, root_path="/skypilot")


def test_a_job_reads_only_its_own_xcoms(db, xcom_loads):
    # scheduled runs share run ids across DAGs; other tasks return large values
    big = {"data": "x" * 1000}
    for run_id in ("scheduled__1", "scheduled__2"):
        db.tis("d", run_id, "train", xcoms={"skypilot_handle": HANDLE, "return_value": RESULT})
        db.tis("d", run_id, "etl", xcoms={"return_value": big})
        db.tis("e", run_id, "etl", xcoms={"return_value": big})
        db.tis("d", run_id, "sweep", map_indexes=range(5),
               xcoms={"skypilot_handle": HANDLE, "return_value": RESULT})

    listed = jobs.list_jobs(object(), limit=4, dag_id="d")
    assert len(listed) == 4 and {j["task_id"] for j in listed} <= {"train", "sweep"}
    assert xcom_loads["rows"] == 2 * len(listed)  # a handle and a result each, nothing else

    xcom_loads["rows"] = 0
    job = jobs.load_job("d", "scheduled__1", "sweep", 3)
    assert job["task_instance"]["job_id"] == "1" and job["attempts_source"] == "result"
    assert xcom_loads["rows"] == 2  # not its siblings' nor the run's other tasks'

    xcom_loads["rows"] = 0
    assert jobs.load_job("d", "scheduled__1", "etl", -1)["handle"] is None
    assert xcom_loads["rows"] == 1  # its own return_value: no handle, so no SkyPilot job


def test_a_large_sweep_is_shown_a_page_at_a_time_and_summed_over_all(db):
    db.tis("d", "r", "train", map_indexes=range(240),
           xcoms={"skypilot_handle": HANDLE, "return_value": RESULT})
    db.tis("d", "r", "train", map_indexes=range(240, 250), state="failed",
           xcoms={"skypilot_handle": {**HANDLE, "connection": "k8s"}})
    client = _client()

    html = client.get("/sweeps/d/r/train").text
    assert html.count('<g class="lane"') == 200  # sweep_views.SWEEP_PAGE
    assert len(re.findall(r'<span class="idx">\[\d+\]</span>', html)) == 200
    assert "instances 1–200 of 250" in html
    assert 'href="/skypilot/sweeps/d/r/train?start=200">next' in html and "previous" not in html
    # the summary is the whole sweep's, not the page's
    assert "sweep of 250" in html and "240 success" in html and "10 failed" in html
    assert "slurm_a ×240, k8s ×10" in html and "$240.00" in html

    html = client.get("/sweeps/d/r/train?start=200").text
    assert html.count('<g class="lane"') == 50 and "instances 201–250 of 250" in html
    assert 'href="/skypilot/sweeps/d/r/train?start=0">← previous' in html

    data = client.get("/api/sweeps/d/r/train?start=10&limit=5").json()
    assert [m["map_index"] for m in data["members"]] == [10, 11, 12, 13, 14]
    assert data["sweep"]["size"] == 250 and data["sweep"]["attempts"] == 250
    assert data["page"] == {"start": 10, "limit": 5, "first": 11, "last": 15, "total": 250,
                            "previous": 5, "next": 15}


def test_a_mapped_jobs_page_links_its_neighbours_and_counts_the_rest(db):
    db.tis("d", "r", "train", map_indexes=range(240),
           xcoms={"skypilot_handle": HANDLE, "return_value": RESULT})
    db.tis("d", "r", "train", map_indexes=range(240, 250), state="failed")
    html = _client().get("/jobs/d/r/train/230").text
    head = re.search(r"sweep of .*?side by side</a>", html, re.S).group(0)
    links = [int(i) for i in re.findall(r'href="/skypilot/jobs/d/r/train/(\d+)"', head)]
    assert links == [i for i in range(220, 241) if i != 230]  # jobs.SIBLINGS_NEAR either side
    assert "sweep of 250 (10 failed, 240 success)" in head and head.count("…") == 2
    assert 'href="/skypilot/sweeps/d/r/train?start=200"' in head  # the page it is on


def _queued(job_id, since):
    """A deferred task's ``next_kwargs``: the run state whose last attempt is still pending."""
    return {"state": {"attempts": [{"connection": "slurm_a", "location": "batch",
                                    "job_id": job_id, "state": "pending",
                                    "submitted_at": since.timestamp()}]}}


def test_a_job_queued_for_a_day_stays_listed_however_many_ran_since(db):
    old = datetime(2025, 12, 31, tzinfo=timezone.utc)
    db.tis("d", "old", "big_train", state="deferred", start=old,
           next_kwargs=_queued("77", old), xcoms={"skypilot_handle": {**HANDLE, "job_id": "77"}})
    running = {"state": {"attempts": [{"connection": "slurm_a", "location": "batch",
                                       "job_id": "78", "state": "running"}]}}
    db.tis("d", "old", "long_run", state="deferred", start=old, next_kwargs=running,
           xcoms={"skypilot_handle": {**HANDLE, "job_id": "78"}})
    db.tis("d", "r", "sweep", map_indexes=range(150),
           xcoms={"skypilot_handle": HANDLE, "return_value": RESULT})  # all ran after them
    db.tis("d", "r", "etl", state="deferred", xcoms={"return_value": {}})  # not SkyPilot's
    client = _client()

    listed = client.get("/api/jobs").json()["jobs"]
    # both deferred ones (the queued one and the running one), once, and the 100 newest others
    assert [j["task_id"] for j in listed].count("sweep") == 100
    assert sorted(j["task_id"] for j in listed if j["task_id"] != "sweep") == [
        "big_train", "long_run"]
    assert [j["job_id"] for j in listed if j["waiting"]] == ["77"]
    assert listed[-1]["task_id"] in ("big_train", "long_run")  # newest first, as before
    assert len(client.get("/api/jobs?limit=3").json()["jobs"]) == 5

    html = client.get("/jobs").text
    waiting = re.search(r'<table class="waiting">.*?</table>', html, re.S).group(0)
    assert ">big_train</a>" in waiting and "long_run" not in waiting


def test_the_jobs_page_sums_a_whole_sweep_not_its_listed_instances(db):
    db.tis("d", "r", "train", map_indexes=range(240),
           xcoms={"skypilot_handle": HANDLE, "return_value": RESULT})
    db.tis("d", "r", "train", map_indexes=range(240, 250), state="failed",
           xcoms={"skypilot_handle": {**HANDLE, "connection": "k8s"}})
    db.tis("d", "r", "pair", map_indexes=range(2), xcoms={"skypilot_handle": HANDLE,
           "return_value": RESULT}, start=datetime(2026, 1, 1, 2, tzinfo=timezone.utc))
    client = _client()

    sweeps = {s["task_id"]: s for s in client.get("/api/jobs").json()["sweeps"]}
    train = sweeps["train"]  # as its own page says (test above), not the 98 listed here
    assert (train["size"], train["attempts"], train["gpu_hours"], train["cost"]) == (
        250, 250, 120.0, 240.0)
    assert train["states"] == [["failed", 10], ["success", 240]]
    assert train["places"] == [["slurm_a", 240], ["k8s", 10]]
    assert train["shown"] == 98
    assert (sweeps["pair"]["size"], sweeps["pair"]["shown"]) == (2, 2)

    heads = re.findall(r'<tr class="sweep-head group-start">(.*?)</tr>',
                       client.get("/jobs").text, re.S)
    (head,) = [h for h in heads if "<b>train</b>" in h]
    assert "sweep of 250" in head and "98 of 250 listed below" in head
    assert "240 success" in head and "10 failed" in head and "$240.00" in head
    # one listed instance of a large sweep is still the sweep's entry, with its totals
    sweeps = {s["task_id"]: s for s in client.get("/api/jobs?limit=3").json()["sweeps"]}
    assert (sweeps["train"]["size"], sweeps["train"]["shown"]) == (250, 1)


def test_the_jobs_page_reads_whole_sweeps_within_a_budget(db, xcom_loads, monkeypatch):
    """Whole-sweep figures cost every instance's XComs: the newest sweeps on the list get them
    while their sizes fit the budget; older ones show size and states counted in SQL, and
    send the rest to their own page (a list of 20 sweeps of 1000 decoded 40 000 XComs)."""
    monkeypatch.setattr(sweep_views, "WHOLE_SWEEPS_BUDGET", 300)
    for n in range(4):  # four sweeps of 200, each with its newest instance on the list
        db.tis("d", f"r{n}", "train", map_indexes=[0],
               xcoms={"skypilot_handle": HANDLE, "return_value": RESULT},
               start=datetime(2026, 1, 2, n, tzinfo=timezone.utc))
        db.tis("d", f"r{n}", "train", map_indexes=range(1, 200),
               xcoms={"skypilot_handle": HANDLE, "return_value": RESULT})
    client = _client()

    sweeps = {s["run_id"]: s for s in client.get("/api/jobs?limit=4").json()["sweeps"]}
    assert xcom_loads["rows"] <= 2 * 4 + 2 * 200  # the listed jobs', and one whole sweep's
    newest, older = sweeps.pop("r3"), list(sweeps.values())
    assert (newest["size"], newest["gpu_hours"], newest.get("partial")) == (200, 100.0, None)
    assert [(s["size"], s["states"], s["gpu_hours"], s["partial"]) for s in older] == [
        (200, [["success", 200]], None, True)] * 3
    assert all("map_indexes" not in s for s in [newest, *older])
    html = client.get("/jobs?limit=4").text
    assert html.count(">on its page</a>") == 3 and html.count("sweep of 200") == 4


def test_a_job_read_by_both_queries_is_listed_once(db, engine):
    """The deferred jobs and the others are two statements: on Postgres each sees its own
    snapshot, so a task that left "deferred" between them comes back from both."""
    db.tis("d", "r", "train", state="deferred", next_kwargs={"state": {"attempts": []}},
           xcoms={"skypilot_handle": HANDLE})
    fired = []

    def resumed(conn, cursor, statement, params, context, executemany):
        # the trigger fires right after the deferred jobs' query: the scheduler moves it on
        if not fired and "task_instance.state = " in statement and "LIMIT" in statement:
            fired.append(statement)
            cursor.connection.execute(
                "UPDATE task_instance SET state='scheduled' WHERE task_id='train'")

    event.listen(engine, "after_cursor_execute", resumed)
    try:
        listed = _client().get("/api/jobs").json()["jobs"]
    finally:
        event.remove(engine, "after_cursor_execute", resumed)
    assert fired and [j["task_id"] for j in listed] == ["train"]


def test_the_usage_page_says_which_tasks_it_cannot_count(db, monkeypatch):
    monkeypatch.setattr(auth, "readable_dag_ids", lambda user: {"d", "e"})
    monkeypatch.setattr(auth, "can_read_job", lambda user, dag_id, team=None: dag_id == "d")
    monkeypatch.setattr(auth, "team_names", lambda dag_ids: {})
    now = datetime.now(timezone.utc)
    hour_ago = now - timedelta(hours=1)
    db.tis("d", "r", "ok", start=hour_ago, end=now,
           xcoms={"skypilot_handle": HANDLE, "return_value": RESULT})
    # failed after failovers: the operator leaves only its last job's handle in XCom
    db.tis("d", "r", "failed_after_failovers", state="failed", start=hour_ago, end=now,
           xcoms={"skypilot_handle": {**HANDLE, "job_id": "9"}})
    db.tis("d", "r", "submit", start=hour_ago, end=now,  # wait_for_completion=False
           xcoms={"skypilot_handle": HANDLE, "return_value": HANDLE})
    db.tis("d", "r", "etl", state="failed", start=hour_ago, end=now)  # not SkyPilot's
    db.tis("e", "r", "failed", state="failed", start=hour_ago, end=now,  # not readable
           xcoms={"skypilot_handle": HANDLE})
    db.tis("d", "r", "failed_long_ago", state="failed", start=now - timedelta(days=20),
           end=now - timedelta(days=20), xcoms={"skypilot_handle": HANDLE})

    data = usage.usage_for(object(), 7, now=now)
    assert data["jobs"] == 1 and data["gpu_hours"] == 0.5
    assert data["not_counted"] == {"failed": 1, "no_attempts": 1}

    html = _client().get("/usage?days=7").text
    note = re.search(r'<div class="summary none not-counted">(.*?)</div>', html, re.S).group(1)
    assert "lower bound" in note and "1 SkyPilot task that failed in the period" in note
    assert "1 result without attempts" in note
    assert "tries that failed" in html  # the page says the limit whatever the period holds


class _HungHook:
    """A capacity hook whose probe waits to be let go, counting the probes."""

    probes = 0
    release = threading.Event()

    def __init__(self, conn_ids, timeout):
        self.conn_ids = conn_ids

    def capacity(self):
        type(self).probes += 1
        self.release.wait(10)
        return []


def test_clicks_of_probe_again_share_one_probe(monkeypatch):
    from airflow_skypilot.hooks import capacity as hook

    monkeypatch.setattr(hook, "SkyPilotCapacityHook", _HungHook)
    _HungHook.probes, _HungHook.release = 0, threading.Event()
    probes = capacity.CapacityProbes()
    answers = []
    clicks = [threading.Thread(target=lambda: answers.append(probes.probe(["c"], 5, True)))
              for _ in range(8)]
    for click in clicks:
        click.start()
    while _HungHook.probes == 0:
        threading.Event().wait(0.01)
    threading.Event().wait(0.2)  # the other clicks arrive while it runs
    _HungHook.release.set()
    for click in clicks:
        click.join(10)
    assert _HungHook.probes == 1 and len(answers) == 8 and len(set(map(repr, answers))) == 1

    assert probes.probe(["c"], 5, True) == answers[0]  # clicked again just after: that answer
    assert _HungHook.probes == 1
    probes.refresh_after = 0
    probes.probe(["c"], 5, True)  # later, it probes again
    assert _HungHook.probes == 2
