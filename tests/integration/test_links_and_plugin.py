"""The "SkyPilot job" extra link and the UI plugin (jobs, job and capacity pages).

The pages are checked against a real Airflow: a temporary AIRFLOW_HOME (SQLite, ``airflow db
migrate``), XComs written by real task instances of ``airflow dags test`` the way the operator
writes them, and ``airflow api-server`` on 127.0.0.1 with the simple auth manager, so routing,
mounting, login cookies/JWTs and authorization are Airflow's own.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from airflow_skypilot import placement
from airflow_skypilot.backends.base import CapacityRow, JobHandle
from airflow_skypilot.exceptions import BackendUnreachable
from airflow_skypilot.links import SkyPilotJobLink, job_path, job_url
from airflow_skypilot.plugins import capacity as plugin_capacity
from airflow_skypilot.plugins import formatting, jobs, routes
from airflow_skypilot.plugins import skypilot as plugin
from tests.conftest import free_port
from tests.fakes import offer

REPO = Path(__file__).resolve().parents[2]
AIRFLOW = str(Path(sys.executable).parent / "airflow")
DAG_ID = "skypilot_ui_seed"
XSS = "<img src=x onerror=alert(1)>"
SECRET = "hunter2-do-not-show"
PLUGIN_CLASS = "airflow_skypilot.plugins.skypilot.SkyPilotPlugin"


def _entry_point_installed() -> bool:
    return any(ep.value.replace(":", ".") == PLUGIN_CLASS
               for ep in metadata.entry_points(group="airflow.plugins"))


def _airflow_env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env.update({
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    })
    if not _entry_point_installed():
        # provider-declared plugins load only with eager provider discovery
        env["AIRFLOW__CORE__LAZY_DISCOVER_PROVIDERS"] = "False"
    env.update(extra)
    return env


# --- the extra link -----------------------------------------------------------------------------
def test_link_points_at_the_job_page_of_the_task_instance(monkeypatch):
    from airflow.sdk.types import TaskInstanceKey

    monkeypatch.setenv("AIRFLOW__API__BASE_URL", "https://airflow.example.com/team-a/")
    key = TaskInstanceKey(dag_id="train_pipeline", task_id="group.train",
                          run_id="manual__2025-01-02T03:04:05+00:00", try_number=2, map_index=-1)
    url = SkyPilotJobLink().get_link(None, ti_key=key)  # type: ignore[arg-type]
    assert url == ("https://airflow.example.com/team-a/skypilot/jobs/train_pipeline/"
                   "manual__2025-01-02T03%3A04%3A05%2B00%3A00/group.train")
    mapped = key._replace(map_index=3)
    assert SkyPilotJobLink().get_link(None, ti_key=mapped).endswith(  # type: ignore[arg-type]
        "/group.train/3")
    assert SkyPilotJobLink().name == "SkyPilot job"


def test_link_helpers():
    assert job_path("d", "r/x", "t", 0) == "/skypilot/jobs/d/r%2Fx/t/0"
    assert job_url("d", "r", "t", None, base_url="http://h:8080/") == \
        "http://h:8080/skypilot/jobs/d/r/t"


def test_operator_and_provider_register_the_link_and_plugin():
    from airflow_skypilot.get_provider_info import get_provider_info
    from airflow_skypilot.operators.skypilot import XCOM_HANDLE, XCOM_PLACEMENT, SkyPilotOperator

    assert any(isinstance(link, SkyPilotJobLink) for link in SkyPilotOperator.operator_extra_links)
    info = get_provider_info()
    assert "airflow_skypilot.links.skypilot.SkyPilotJobLink" in info["extra-links"]
    # the plugin loads through its `airflow.plugins` entry point (listing it in the provider
    # metadata too would register it twice when providers are discovered eagerly)
    assert "plugins" not in info
    from importlib.metadata import entry_points

    assert [e.value for e in entry_points(group="airflow.plugins") if e.name == "skypilot"] == \
        [PLUGIN_CLASS.replace(".SkyPilotPlugin", ":SkyPilotPlugin")]
    # the plugin reads the keys the operator writes (from runstate, cheap to import)
    assert (jobs.XCOM_HANDLE, jobs.XCOM_PLACEMENT) == (XCOM_HANDLE, XCOM_PLACEMENT)


def test_plugin_registers_app_and_ui_entries():
    from airflow.api_fastapi.core_api.datamodels.plugins import ExternalViewResponse

    cls = plugin.SkyPilotPlugin
    assert cls.name == "skypilot"
    (app,) = cls.fastapi_apps
    assert app["url_prefix"] == "/skypilot" and app["app"] is plugin.app
    routes = {r.path for r in plugin.app.routes}
    assert {"/jobs", "/capacity", "/api/jobs", "/api/capacity",
            "/jobs/{dag_id}/{run_id}/{task_id}/{map_index}"} <= routes
    views = {v["destination"]: v for v in cls.external_views}
    assert views["nav"]["href"] in ("skypilot/jobs", "skypilot/capacity")
    assert {v["url_route"] for v in cls.external_views} == {
        "skypilot-jobs", "skypilot-capacity", "skypilot"}
    assert views["task_instance"]["href"] == \
        "skypilot/jobs/{DAG_ID}/{RUN_ID}/{TASK_ID}/{MAP_INDEX}"
    for view in cls.external_views:  # the API server's own schema accepts them
        ExternalViewResponse(**view)


def test_attempts_come_from_result_then_deferral_state_then_handle():
    handle = {"job_id": "7", "connection": "c", "location": "p"}
    result = {"attempts": [{"job_id": "6"}, {"job_id": "7"}]}
    assert jobs.attempts_of(result, handle, None)[1] == "result"
    assert [a["job_id"] for a in jobs.attempts_of(result, handle, None)[0]] == ["6", "7"]
    # next_kwargs as the task runner stores the operator's defer kwargs
    from airflow.sdk.serde import serialize

    state = {"attempts": [{"job_id": "5", "state": "preempted", "reason": "spot"},
                          {"job_id": "7", "state": "pending"}], "blocked": [("a", "b")]}
    attempts, source = jobs.attempts_of(None, handle, serialize({"state": state}))
    assert source == "running" and [a["job_id"] for a in attempts] == ["5", "7"]
    legacy = {"__type": "dict", "__var": {"state": {"__type": "dict", "__var": {
        "attempts": [{"__type": "dict", "__var": {"job_id": "5"}}]}}}}
    assert jobs.attempts_of(None, handle, legacy)[0][0]["job_id"] == "5"
    assert jobs.attempts_of(None, handle, None)[1] == "handle"
    assert jobs.attempts_of(None, None, None) == ([], "none")


def test_handle_extras_never_show_credentials():
    extra = {"namespace": "ml", "env": {"A": SECRET}, "api_token": SECRET, "ssh_key": SECRET,
             "instance_ids": ["i-1", "i-2"], "spot": True}
    shown = dict(jobs.handle_extra({"extra": extra}))
    assert shown == {"namespace": "ml", "instance_ids": "i-1, i-2", "spot": "True"}


def test_unmapped_placeholder_map_index_means_unmapped():
    assert routes.parse_map_index("{MAP_INDEX}") == -1
    assert routes.parse_map_index("%7BMAP_INDEX%7D") == -1
    assert routes.parse_map_index("2") == 2
    assert routes.parse_map_index("-1") == -1


class _Backend:
    """Capacity only: answers, hangs, or cannot be reached, by connection id."""

    calls = 0

    def __init__(self, conn_id: str):
        self.conn_id = conn_id

    def capacity(self) -> list[CapacityRow]:
        type(self).calls += 1
        if self.conn_id == "hung":
            time.sleep(3)
        if self.conn_id == "down":
            raise BackendUnreachable("cannot reach the login node")
        if self.conn_id == "empty":
            return []
        return [CapacityRow(self.conn_id, "gpu", "A100", total=8, free=3, pending=1,
                            price_per_hour=2.0)]


def test_capacity_probe_runs_off_the_loop_with_deadline_and_cache(monkeypatch):
    import anyio

    from airflow_skypilot.hooks import capacity

    monkeypatch.setattr(capacity, "backend_for_connection", _Backend)
    monkeypatch.setattr(plugin_capacity, "can_read_connection", lambda user, c: c != "secret")
    monkeypatch.setattr(plugin_capacity, "probe_timeout", lambda: 0.5)
    monkeypatch.setattr(plugin_capacity, "PROBES", plugin_capacity.CapacityProbes(refresh_after=0))
    conns = ["ok", "hung", "secret", "down", "empty"]
    start = time.monotonic()
    data = anyio.run(plugin_capacity.capacity_for, object(), conns, False)
    assert time.monotonic() - start < 2.5
    rows = {r["connection"]: r for r in data["rows"]}
    assert [r["connection"] for r in data["rows"]] == conns  # in the order asked for
    assert rows["ok"]["free"] == 3 and "error" not in rows["ok"]
    assert rows["hung"]["error"] == "no answer within 0.5s"
    assert "cannot reach the login node" in rows["down"]["error"]
    assert rows["secret"]["error"] == "you are not allowed to read this connection"
    assert rows["empty"]["note"] == "reported no locations"
    calls = _Backend.calls
    again = anyio.run(plugin_capacity.capacity_for, object(), conns, False)
    assert _Backend.calls == calls and again["probed_at"] == data["probed_at"]  # cached
    anyio.run(plugin_capacity.capacity_for, object(), conns, True)
    assert _Backend.calls > calls  # refresh=true probes again


def test_capacity_template_renders_rows_escaped():
    rows = [{"connection": "a", "location": XSS, "accelerator": "A100", "total": 8, "free": 2,
             "pending": 1, "price_per_hour": 2.0},
            {"connection": "a", "location": "cpu", "accelerator": None, "total": None,
             "free": None, "pending": 0, "price_per_hour": None},
            {"connection": "b", "location": "", "accelerator": None, "error": f"boom {XSS}"},
            {"connection": "c", "location": "", "accelerator": None, "note": "reported no "
             "locations"}]
    groups = [{"connection": c, "rows": [r for r in rows if r["connection"] == c], "free": 2,
               "total": 8, "errors": 0} for c in "abc"]
    html = formatting.TEMPLATES.get_template("skypilot/capacity.html").render(
        prefix="/skypilot", ui_base="", nonce="n", page="capacity", title="t", conns=list("abc"),
        explicit=True, query="conn=a", groups=groups,
        data={"probed_at": 0, "seconds": 1.0, "ttl": 10, "timeout": 5, "rows": rows})
    assert XSS not in html and html.count("&lt;img src=x onerror=alert(1)&gt;") == 2
    assert "2 / 8" in html and 'style="width: 25%"' in html and "(CPU)" in html
    assert "reported no locations" in html and "2 of 8 GPUs free" in html


# --- a real Airflow with seeded task instances --------------------------------------------------
SEED_DAG = textwrap.dedent('''
    import pendulum
    from airflow.sdk import DAG, get_current_context, task

    from airflow_skypilot.operators.skypilot import SkyPilotOperator


    def _push(key_values):
        ti = get_current_context()["ti"]
        for key, value in key_values.items():
            ti.xcom_push(key=key, value=value)


    def _conf():
        return get_current_context()["dag_run"].conf


    with DAG("skypilot_ui_seed", schedule=None, start_date=pendulum.datetime(2025, 1, 1),
             catchup=False):
        @task
        def train():
            c = _conf()
            _push({"skypilot_placement": c["placement"], "skypilot_handle": c["handle"]})
            return c["result"]

        @task
        def waiting():
            _push({"skypilot_placement": _conf()["nothing"]})

        @task
        def shard(i):
            h = dict(_conf()["handle"], job_id=f"shard-{i}", location=f"zone-{i}")
            _push({"skypilot_handle": h})
            return h  # wait_for_completion=False returns the handle

        @task
        def lost():
            _push({"skypilot_handle": dict(_conf()["handle"], job_id="lost-1")})
            raise RuntimeError("node failure")

        @task
        def plain():
            return 1

        # a real SkyPilotOperator that fails while loading its task: its extra link is kept
        broken = SkyPilotOperator(task_id="broken", task={"resurces": {}}, connections=["x"],
                                  retries=0)

        train() >> waiting() >> shard.expand(i=[0, 1]) >> plain() >> broken
        lost()
''')


def _seed_payloads() -> dict[str, Any]:
    offers = [
        offer("slurm_alpha", "gpu", acc="A100", count=2, gpus_free=6, gpus_total=8, price=2.5),
        offer("k8s_default", "ctx/ml", acc="A100", count=2, gpus_free=2, gpus_total=4,
              price=3.1),
        offer("aws_default", "us-east-1/us-east-1a", acc="A100", count=2, gpus_free=0,
              gpus_total=8, nodes_free=0, est_in=1800, price=4.1, pending=3),
        offer("slurm_beta", "gpu", acc="A100", count=2, fits=False, reason="no A100 here"),
    ]
    plan = placement.rank(offers, "fastest",
                          blocked=[placement.Blocked("slurm_alpha/debug", "node failure")],
                          unreachable={"aws_west": f"timeout {XSS}"})
    nothing = placement.rank([offers[3]], "fastest", unreachable={"slurm_gamma": "refused"})
    handle = JobHandle(backend="slurm", connection="slurm_alpha", job_id="4242",
                       job_name="skypilot-ui-seed-train-a1", location="gpu",
                       infra="slurm/alpha", accelerator="A100", gpus_per_node=2,
                       price_per_hour=2.5, submitted_at=1_700_000_000.0,
                       extra={"job_dir": "/home/u/.skypilot/jobs/x", "env": {"TOKEN": SECRET},
                              "api_token": SECRET}).to_dict()
    result = {
        "state": "succeeded", "connection": "slurm_alpha", "location": "gpu",
        "infra": "slurm/alpha", "backend": "slurm", "job_id": "4242",
        "job_name": "skypilot-ui-seed-train-a1", "task_id": "sky-x",
        "attempts": [
            {"connection": "aws_default", "location": "us-east-1/us-east-1a", "job_id": "i-0abc",
             "state": "preempted", "reason": f"spot reclaimed {XSS}", "exit_code": None,
             "submitted_at": 1_699_990_000.0, "started_at": 1_699_990_100.0,
             "ended_at": 1_699_995_000.0, "adopted": False},
            {"connection": "slurm_alpha", "location": "gpu", "job_id": "4242",
             "state": "succeeded", "reason": "", "exit_code": 0,
             "submitted_at": 1_700_000_000.0, "started_at": 1_700_000_060.0,
             "ended_at": 1_700_003_660.0, "adopted": False},
        ],
        "gpu_hours": 4.722222, "cost": 12.35,
    }
    return {"placement": plan.to_json(), "nothing": nothing.to_json(), "handle": handle,
            "result": result}


class Server:
    """``airflow api-server`` on 127.0.0.1 with a seeded metadata DB."""

    def __init__(self, home: Path, port: int, env: dict[str, str], payloads: dict[str, Any]):
        self.home, self.port, self.env, self.payloads = home, port, env, payloads
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self._tokens: dict[str, str] = {}

    def run_id(self) -> str:
        db = sqlite3.connect(self.home / "airflow.db")
        try:
            return db.execute("SELECT run_id FROM dag_run WHERE dag_id=?", (DAG_ID,)).fetchone()[0]
        finally:
            db.close()

    def token(self, user: str) -> str:
        if user not in self._tokens:
            r = httpx.post(f"{self.url}/auth/token", json={"username": user, "password": user},
                           timeout=30)
            assert r.status_code == 201, r.text
            self._tokens[user] = r.json()["access_token"]
        return self._tokens[user]

    def client(self, user: str | None = "admin", via: str = "cookie") -> httpx.Client:
        if user is None:
            return httpx.Client(base_url=self.url, timeout=60)
        if via == "cookie":  # what the Airflow UI (and so an iframe) sends
            return httpx.Client(base_url=self.url, timeout=60,
                                cookies={"_token": self.token(user)})
        return httpx.Client(base_url=self.url, timeout=60,
                            headers={"Authorization": f"Bearer {self.token(user)}"})


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    home = tmp_path_factory.mktemp("airflow-ui-home")
    dags = home / "dags"
    dags.mkdir()
    (dags / "skypilot_ui_seed.py").write_text(SEED_DAG)
    (home / "passwords.json").write_text(json.dumps({"admin": "admin", "viewer": "viewer"}))
    port = free_port()
    env = _airflow_env(
        home,
        AIRFLOW__CORE__DAGS_FOLDER=str(dags),
        AIRFLOW__API__BASE_URL=f"http://127.0.0.1:{port}",
        AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS="admin:admin,viewer:viewer",
        AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE=str(home / "passwords.json"),
        AIRFLOW__SKYPILOT__CONNECTIONS="slurm_down,not_a_backend",
        AIRFLOW__SKYPILOT__PROBE_TIMEOUT="8",
        AIRFLOW_CONN_SLURM_DOWN=json.dumps({"conn_type": "slurm", "host": "127.0.0.1",
                                            "port": 1, "login": "nobody"}),
        AIRFLOW_CONN_NOT_A_BACKEND=json.dumps({"conn_type": "http", "host": "example.invalid"}),
    )
    payloads = _seed_payloads()
    subprocess.run([AIRFLOW, "db", "migrate"], env=env, check=True, capture_output=True,
                   timeout=300)
    srv = Server(home, port, env, payloads)
    log = open(home / "api-server.log", "w")
    # the server starts while the seed run writes its task instances (both take ~15 s)
    srv.proc = subprocess.Popen(
        [AIRFLOW, "api-server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        seeded = subprocess.run([AIRFLOW, "dags", "test", DAG_ID, "-c", json.dumps(payloads)],
                                env=env, capture_output=True, text=True, timeout=300)
        deadline = time.monotonic() + 180
        while True:
            assert srv.proc.poll() is None, (home / "api-server.log").read_text()[-4000:]
            try:
                if httpx.get(f"{srv.url}/api/v2/monitor/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "api-server did not start"
            time.sleep(1)
        assert srv.run_id(), seeded.stdout[-3000:] + seeded.stderr[-3000:]
        yield srv
    finally:
        os.killpg(srv.proc.pid, signal.SIGTERM)
        try:
            srv.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(srv.proc.pid, signal.SIGKILL)
            srv.proc.wait(10)
        log.close()


def _page(path: str, server: Server, user: str | None = "admin", **kw: Any) -> httpx.Response:
    with server.client(user) as c:
        return c.get(path, **kw)


def test_airflow_plugins_lists_the_plugin(tmp_path):
    env = _airflow_env(tmp_path)
    out = subprocess.run([AIRFLOW, "plugins", "-o", "json"], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    plugins = json.loads(out.stdout[out.stdout.index("["):])
    mine = [p for p in plugins if p["name"] == "skypilot"]
    assert len(mine) == 1, out.stdout
    assert mine[0]["fastapi_apps"][0]["url_prefix"] == "/skypilot"
    assert {v["url_route"] for v in mine[0]["external_views"]} >= {"skypilot-jobs"}


def test_plugin_loads_with_default_provider_discovery(tmp_path):
    assert _entry_point_installed(), (
        "pyproject lacks [project.entry-points.\"airflow.plugins\"] skypilot = "
        "\"airflow_skypilot.plugins.skypilot:SkyPilotPlugin\" (or the package was not "
        "reinstalled): with Airflow's default lazy provider discovery the plugin then does not "
        "load")
    env = _airflow_env(tmp_path)
    env.pop("AIRFLOW__CORE__LAZY_DISCOVER_PROVIDERS", None)
    out = subprocess.run([AIRFLOW, "plugins", "-o", "json"], env=env, capture_output=True,
                         text=True, timeout=300, check=True)
    assert '"skypilot"' in out.stdout


def test_api_server_lists_plugin_and_nav_entries(server):
    with server.client("admin", via="bearer") as c:
        plugins = c.get("/api/v2/plugins").json()["plugins"]
    (mine,) = [p for p in plugins if p["name"] == "skypilot"]
    nav = {v["name"]: v for v in mine["external_views"]}
    assert nav["SkyPilot jobs"]["destination"] == "nav"
    assert nav["SkyPilot"]["destination"] == "task_instance"
    r = httpx.get(f"{server.url}/skypilot/icon.svg")
    assert r.status_code == 200 and r.headers["content-type"].startswith("image/svg")


def test_anonymous_callers_are_turned_away(server):
    run_id = server.run_id()
    for path in ("/skypilot/api/jobs", "/skypilot/api/capacity",
                 f"/skypilot/api/jobs/{DAG_ID}/{quote(run_id, safe='')}/train"):
        assert _page(path, server, user=None).status_code == 401, path
    r = _page("/skypilot/jobs", server, user=None)
    assert r.status_code == 303
    assert "/api/v2/auth/login?next=" in r.headers["location"]
    with server.client(None) as c:
        c.cookies.set("_token", "not-a-jwt")
        assert c.get("/skypilot/api/jobs").status_code in (401, 403)


def test_jobs_json_lists_skypilot_task_instances(server):
    with server.client("admin", via="bearer") as c:
        body = c.get("/skypilot/api/jobs").json()
    jobs = {(j["task_id"], j["map_index"]): j for j in body["jobs"]}
    assert set(jobs) == {("train", -1), ("waiting", -1), ("shard", 0), ("shard", 1),
                         ("lost", -1)}
    train = jobs[("train", -1)]
    assert train["state"] == "success"
    assert (train["connection"], train["location"], train["job_id"]) == \
        ("slurm_alpha", "gpu", "4242")
    assert train["attempts"] == 2 and train["gpu_hours"] == pytest.approx(4.722222)
    assert train["cost"] == pytest.approx(12.35)
    assert train["ui_url"] == f"/dags/{DAG_ID}/runs/{quote(server.run_id(), safe='')}/tasks/train"
    assert train["job_url"] == job_path(DAG_ID, server.run_id(), "train")
    assert jobs[("lost", -1)]["state"] == "failed" and jobs[("lost", -1)]["attempts"] == 1
    assert jobs[("waiting", -1)]["job_id"] is None
    assert jobs[("waiting", -1)]["placement_summary"].startswith("no placement")
    assert jobs[("shard", 1)]["location"] == "zone-1"
    starts = [j["start_date"] for j in body["jobs"]]
    assert starts == sorted(starts, reverse=True)  # newest first
    assert SECRET not in json.dumps(body)
    with server.client("admin") as c:
        only = c.get("/skypilot/api/jobs", params={"dag_id": "no_such_dag"}).json()
    assert only["jobs"] == []


def test_viewer_reads_jobs_too(server):
    with server.client("viewer") as c:
        assert len(c.get("/skypilot/api/jobs").json()["jobs"]) == 5


def test_jobs_page_renders_the_list(server):
    r = _page("/skypilot/jobs", server)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    html = r.text
    for text in ("SkyPilot jobs", "slurm_alpha", "4242", "zone-1", "$12.35", "4.72",
                 "no placement"):
        assert text in html, text
    assert f'href="{job_path(DAG_ID, server.run_id(), "shard", 1)}"' in html
    assert 'target="_top" data-airflow' in html  # Airflow links leave the plugin iframe
    csp = r.headers["content-security-policy"]
    nonce = re.search(r"script-src 'nonce-([^']+)'", csp).group(1)
    assert f'<script nonce="{nonce}">' in html and "frame-ancestors 'self'" in csp
    assert html.count('class="badge s-success"') >= 3 and 'class="badge s-failed"' in html


def test_job_page_shows_every_placement_row_escaped(server):
    plan = server.payloads["placement"]
    r = _page(job_path(DAG_ID, server.run_id(), "train"), server)
    assert r.status_code == 200, r.text
    html = r.text
    body = html[html.index("<main>"):]
    rows = re.findall(r"<tr class=\"(chosen|)\">", body[body.index("<h2>Placement"):
                                                      body.index("<h2>Job handle")])
    assert len(rows) == len(plan["rows"]) >= 5
    assert rows.count("chosen") == 1
    for row in plan["rows"]:
        assert f"<td>{row['connection']}</td>" in body
    assert plan["summary"] in html
    assert XSS not in html and "&lt;img src=x onerror=alert(1)&gt;" in html
    assert "spot reclaimed &lt;img" in html  # attempts come from the result
    assert "i-0abc" in html and "preempted" in html
    assert SECRET not in html and "api_token" not in html
    assert "/home/u/.skypilot/jobs/x" in html  # harmless handle extras are shown


def test_job_page_of_a_mapped_and_a_failed_task(server):
    run_id = server.run_id()
    html = _page(job_path(DAG_ID, run_id, "shard", 1), server).text
    assert "shard-1" in html and "zone-1" in html and "[1]" in html
    html = _page(job_path(DAG_ID, run_id, "lost"), server).text
    assert "lost-1" in html and "Only the current job is known" in html
    # the task instance tab's href with {MAP_INDEX} left in place by the UI
    tab = plugin.TI_TAB["href"].replace("{DAG_ID}", DAG_ID).replace(
        "{RUN_ID}", quote(run_id, safe="")).replace("{TASK_ID}", "train")
    r = _page("/" + tab, server)
    assert r.status_code == 200 and "4242" in r.text
    r = _page(job_path(DAG_ID, run_id, "plain"), server)
    assert r.status_code == 200 and "has no SkyPilot job" in r.text
    r = _page(job_path(DAG_ID, run_id, "nope"), server)
    assert r.status_code == 404 and "No task instance" in r.text


def test_job_json(server):
    with server.client("admin", via="bearer") as c:
        r = c.get("/skypilot/api" + job_path(DAG_ID, server.run_id(), "train")[len("/skypilot"):])
    assert r.status_code == 200, r.text
    job = r.json()
    assert job["placement"]["rows"] == [
        {k: row.get(k) for k in jobs.ROW_FIELDS} for row in server.payloads["placement"]["rows"]]
    assert job["handle"]["job_id"] == "4242" and "extra" not in job["handle"]
    assert job["handle_extra"] == {"job_dir": "/home/u/.skypilot/jobs/x"}
    assert [a["state"] for a in job["attempts"]] == ["preempted", "succeeded"]
    assert job["result"]["cost"] == pytest.approx(12.35)
    assert SECRET not in r.text


def test_extra_link_is_served_by_the_api(server):
    run_id = server.run_id()
    with server.client("admin", via="bearer") as c:
        r = c.get(f"/api/v2/dags/{DAG_ID}/dagRuns/{quote(run_id, safe='')}/taskInstances/"
                  "broken/links")
    assert r.status_code == 200, r.text
    links = r.json()["extra_links"]
    assert links["SkyPilot job"] == server.url + job_path(DAG_ID, run_id, "broken")


def test_capacity_shows_unreachable_connections_as_error_rows(server):
    with server.client("admin", via="bearer") as c:
        data = c.get("/skypilot/api/capacity").json()
    assert data["connections"] == ["slurm_down", "not_a_backend"]
    errors = {r["connection"]: r["error"] for r in data["rows"]}
    assert set(errors) == {"slurm_down", "not_a_backend"}
    assert "http" in errors["not_a_backend"]
    r = _page("/skypilot/capacity", server, params={"conn": ["slurm_down", "ghost"]})
    assert r.status_code == 200, r.text
    assert len(re.findall(r'<tr class="error[ "]', r.text)) == 2
    assert "connection &#39;ghost&#39; is not defined" in r.text  # the backend registry's words
    assert _page("/skypilot/capacity", server, params={"conn": "bad id!"}).status_code == 400


def test_capacity_needs_connection_access(server):
    # the simple auth manager's viewers may not read connections: nothing is probed for them
    with server.client("viewer") as c:
        data = c.get("/skypilot/api/capacity", params={"conn": "slurm_down"}).json()
    assert data["rows"] == [{"connection": "slurm_down", "location": "", "accelerator": None,
                             "error": "you are not allowed to read this connection"}]
