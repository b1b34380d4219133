"""The pages in a real browser: Debian's headless Chromium, driven over the DevTools protocol,
renders the jobs, job, sweep, capacity and usage pages of an Airflow 3.3 api-server.

The deployment is a light one of this module's own (the shared deployment fixture of
test_deployment_e2e is being reshaped, and this test needs none of its scheduler, workers or
triggerer): ``airflow api-server`` on a free port over a SQLite home in a temporary folder,
its metadata DB seeded by ``airflow dags test`` of a DAG that writes what the operator writes
(the XComs). What it writes comes from the project's own code on the sandbox: a placement
ranked from a live probe of every sandbox connection (with the ~20 AWS zone rows that the page
groups), a 2-attempt failover and a sweep built with ``RunState`` as the operator builds them,
and a job still waiting in a queue (its task instance deferred, with the looks at it). The
capacity page probes the sandbox live from the api-server.

For each page: no console error (exceptions, console.error, CSP violations), what the page
must show (one timeline bar per attempt, a grouped AWS row with its zones, bars per place, no
horizontal overflow in a 1400 px window), and a full-page screenshot. The screenshots' folder
is printed in the test output and is in the test's ``screenshots`` property.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from airflow_skypilot import placement
from airflow_skypilot.backends.base import JobHandle, JobState, JobStatus
from airflow_skypilot.hooks.capacity import SkyPilotCapacityHook
from airflow_skypilot.links import job_path
from airflow_skypilot.runstate import Blocked, Look, RunState
from airflow_skypilot.spec import load_task
from tests.conftest import free_port
from tests.e2e.conftest import REPO

pytestmark = [pytest.mark.sandbox, pytest.mark.e2e]

AIRFLOW = str(Path(sys.executable).parent / "airflow")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DAG_ID = "ui_browser_seed"
CONNS = ("slurm_alpha", "slurm_beta", "k8s_sandbox", "aws_sandbox")
WIDTH, HEIGHT = 1400, 900

SEED_DAG = textwrap.dedent('''
    import pendulum
    from airflow.sdk import DAG, get_current_context, task


    def _push(values):
        ti = get_current_context()["ti"]
        for key, value in values.items():
            if key != "return_value":
                ti.xcom_push(key=key, value=value)
        return values.get("return_value")


    def _conf():
        return get_current_context()["dag_run"].conf


    with DAG("ui_browser_seed", schedule=None, start_date=pendulum.datetime(2025, 1, 1),
             catchup=False):
        @task
        def train():
            return _push(_conf()["train"])

        @task
        def sweep(i):
            return _push(_conf()["sweep"][i])

        @task
        def waiting():
            return _push(_conf()["waiting"])

        train() >> sweep.expand(i=[0, 1, 2, 3]) >> waiting()
''')


# --- what the operator would have written, from the project's code on the sandbox ------------
def _handle(conn: str, location: str, job_id: str, backend: str, at: float, gpus: int = 2,
            price: float = 0.0) -> JobHandle:
    return JobHandle(backend=backend, connection=conn, job_id=job_id,
                     job_name=f"sky-ui-browser-{job_id}", location=location,
                     infra=f"{backend}/{conn}/{location}", accelerator="A100",
                     gpus_per_node=gpus, price_per_hour=price, submitted_at=at)


def _ran(run: RunState, handle: JobHandle, state: JobState, started: float | None,
         ended: float, reason: str = "") -> None:
    run.record(handle)
    run.close(handle, JobStatus(state, reason=reason, exit_code=0 if state ==
                                JobState.SUCCEEDED else None, started_at=started,
                                ended_at=ended))


def _payloads() -> dict[str, Any]:
    # H100:1 has an instance with exactly that on AWS (p5.4xlarge): the AWS zones' rows to group
    task = load_task({"resources": {"accelerators": {"A100": 2, "H100": 1}, "cpus": "2+"},
                      "run": "python train.py"})
    probe = SkyPilotCapacityHook(list(CONNS), timeout=60).probe(task)
    assert not probe.errors, probe.errors
    k8s_place = next(o.place_key for o in probe.offers if o.connection == "k8s_sandbox")
    # the failover's second placement: the Kubernetes place that failed is blocked
    plan = placement.rank(probe.offers, "fastest", blocked=[Blocked(
        k8s_place, "infra_failed: pod was disrupted", until=time.time() + 600)])
    assert plan.chosen is not None and plan.chosen.connection != "k8s_sandbox"
    now = time.time()
    run = RunState(task_env_id="sky-ui-browser-train")
    _ran(run, _handle("k8s_sandbox", "sandbox/default", "sky-ui-browser-t1-a0", "kubernetes",
                      now - 900), JobState.INFRA_FAILED, now - 890, now - 560,
         "pod sky-ui-browser-t1-a0 was disrupted: DeletionByTaintManager")
    final = _handle(plan.chosen.connection, plan.chosen.location, "1042", "slurm", now - 540)
    _ran(run, final, JobState.SUCCEEDED, now - 525, now - 60)
    train = {"skypilot_placement": plan.to_json(), "skypilot_handle": final.to_dict(),
             "return_value": run.result(run.attempts[-1])}

    sweep = []
    places = [("k8s_sandbox", "sandbox/default", "kubernetes", 0.0),
              ("slurm_alpha", "batch", "slurm", 0.0), ("aws_sandbox", "us-east-1/us-east-1a",
                                                      "aws", 21.96),
              ("slurm_beta", "main", "slurm", 0.0)]
    for i, (conn, loc, backend, price) in enumerate(places):
        member = RunState(task_env_id=f"sky-ui-browser-sweep-{i}")
        start = now - 1500 + 120 * i
        if i == 2:  # waited in a queue on slurm_beta, looked at twice, then moved to AWS
            moved = _handle("slurm_beta", "main", f"20{i}", "slurm", start)
            member.note_look(Look(first_at=start + 60, last_at=start + 120, count=2,
                                  place="slurm_beta/main", est_start=start + 3600,
                                  best="aws_sandbox/us-east-1/us-east-1b",
                                  best_start=start + 900, outcome="stayed",
                                  why="est. in 55m vs here in 58m: saves 3m"))
            _ran(member, moved, JobState.CANCELLED, None, start + 180, "moved")
            member.attempts[-1].state = "moved"
            start += 200
        handle = _handle(conn, loc, f"{backend[:3]}-{i}", backend, start, gpus=2, price=price)
        _ran(member, handle, JobState.SUCCEEDED, start + 20, start + 700 + 60 * i)
        sweep.append({"skypilot_handle": handle.to_dict(),
                      "skypilot_placement": plan.to_json(),
                      "return_value": member.result(member.attempts[-1]),
                      "skypilot_watch": {"looks": [x.to_dict() for x in member.looks],
                                         "looks_total": member.looks_total}})

    # every place busy: the job waits where it starts soonest (slurm_beta, est. in 35 min)
    busy = [replace(o, gpus_free=0, nodes_free=0, probed_at=now,
                    est_start=now + (2100 if o.connection == "slurm_beta" else 3600))
            for o in probe.offers]
    queue_plan = placement.rank(busy, "fastest")
    assert queue_plan.chosen.place_key == "slurm_beta/main", queue_plan.table()
    waiting = RunState(task_env_id="sky-ui-browser-waiting")
    queued = _handle("slurm_beta", "main", "1077", "slurm", now - 300)
    waiting.record(queued)
    for k, (best, why) in enumerate([
            ("slurm_alpha/batch", "slurm_alpha/batch est. in 41m vs here in 52m: saves 11m, "
                                  "under half the wait or 2 min"),
            ("aws_sandbox/us-east-1/us-east-1a", "no clear margin: aws_sandbox/us-east-1/"
                                                 "us-east-1a unknown, here in 35m")]):
        waiting.note_look(Look(first_at=now - 240 + 120 * k, last_at=now - 180 + 160 * k,
                               count=3 + k, place="slurm_beta/main",
                               est_start=now + 2100 - 600 * k, best=best,
                               best_start=now + 1500 if k == 0 else None, outcome="stayed",
                               why=why))
    return {"train": train, "sweep": sweep,
            "waiting": {"skypilot_placement": queue_plan.to_json(),
                        "skypilot_handle": queued.to_dict(),
                        "skypilot_watch": {"job_id": "1077", "connection": "slurm_beta",
                                           "location": "main", "state": "pending",
                                           "seen_at": now - 290,
                                           "looks": [x.to_dict() for x in waiting.looks],
                                           "looks_total": waiting.looks_total}},
            "waiting_state": waiting.to_dict()}


# --- the light deployment ------------------------------------------------------------------------
DEFER = textwrap.dedent('''
    import json, sys
    from airflow.models.taskinstance import TaskInstance as TI
    from airflow.utils.session import create_session
    from airflow.utils.state import TaskInstanceState
    from sqlalchemy import select

    with create_session() as session:
        ti = session.scalar(select(TI).where(TI.dag_id == sys.argv[1], TI.task_id == "waiting"))
        ti.state = TaskInstanceState.DEFERRED
        ti.end_date = None
        ti.next_method = "execute_complete"
        ti.next_kwargs = {"state": json.loads(sys.stdin.read())}
''')


class Site:
    def __init__(self, url: str, token: str, run_id: str, home: Path):
        self.url, self.token, self.run_id, self.home = url, token, run_id, home

    def path(self, task_id: str, map_index: int = -1) -> str:
        return job_path(DAG_ID, self.run_id, task_id, map_index)


@pytest.fixture(scope="module")
def site(tmp_path_factory, slurm_sandbox_session, k8s_sandbox_session,
         aws_sandbox_session) -> Iterator[Site]:
    conns = {cid: c for box in (slurm_sandbox_session, k8s_sandbox_session,
                                aws_sandbox_session) for cid, c in box.connections().items()}
    for conn_id, conn in conns.items():  # for the probe in this process
        os.environ[f"AIRFLOW_CONN_{conn_id.upper()}"] = json.dumps(conn)
    home = tmp_path_factory.mktemp("ui-browser-home")
    (home / "dags").mkdir()
    (home / "dags" / f"{DAG_ID}.py").write_text(SEED_DAG)
    (home / "passwords.json").write_text(json.dumps({"admin": "admin"}))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env.update({f"AIRFLOW_CONN_{cid.upper()}": json.dumps(c) for cid, c in conns.items()})
    env.update({
        "AIRFLOW_HOME": str(home), "PYTHONPATH": str(REPO),
        "AIRFLOW__CORE__DAGS_FOLDER": str(home / "dags"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False", "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(home / "passwords.json"),
        "AIRFLOW__API__BASE_URL": f"http://127.0.0.1:{port}",
        "AIRFLOW__API_AUTH__JWT_SECRET": "ui-browser-not-a-real-secret",
        "AIRFLOW__SKYPILOT__CONNECTIONS": ",".join(CONNS),
    })
    payloads = _payloads()
    subprocess.run([AIRFLOW, "db", "migrate"], env=env, check=True, capture_output=True,
                   timeout=300)
    log = open(home / "api-server.log", "w")
    proc = subprocess.Popen([AIRFLOW, "api-server", "--host", "127.0.0.1", "--port", str(port),
                             "--workers", "1"], env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        seeded = subprocess.run([AIRFLOW, "dags", "test", DAG_ID, "-c", json.dumps(payloads)],
                                env=env, capture_output=True, text=True, timeout=300)
        assert seeded.returncode == 0, seeded.stdout[-3000:] + seeded.stderr[-3000:]
        subprocess.run([sys.executable, "-c", DEFER, DAG_ID], env=env, check=True,
                       input=json.dumps(payloads["waiting_state"]), text=True,
                       capture_output=True, timeout=120)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (home / "api-server.log").read_text()[-4000:]
            try:
                r = httpx.post(f"{url}/auth/token", json={"username": "admin",
                                                          "password": "admin"}, timeout=5)
                if r.status_code == 201:
                    token = r.json()["access_token"]
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "api-server did not start"
            time.sleep(1)
        runs = httpx.get(f"{url}/api/v2/dags/{DAG_ID}/dagRuns", timeout=30,
                         headers={"Authorization": f"Bearer {token}"}).json()["dag_runs"]
        yield Site(url, token, runs[0]["dag_run_id"], home)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()


# --- headless Chromium over the DevTools protocol ----------------------------------------------
class Browser:
    """One headless Chromium and one tab, driven over CDP (websockets); console errors of
    every page are collected."""

    def __init__(self, profile: Path):
        from contextlib import ExitStack

        from websockets.sync.client import connect

        self._stack = ExitStack()
        self.proc = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
             "--no-first-run", "--disable-background-networking", "--disable-component-update",
             "--disable-sync", "--disable-dev-shm-usage", "--hide-scrollbars",
             f"--user-data-dir={profile}", "--remote-debugging-port=0",
             f"--window-size={WIDTH},{HEIGHT}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.exists() and len(port_file.read_text().splitlines()) >= 2):
            assert self.proc.poll() is None, "chromium exited"
            assert time.monotonic() < deadline, "chromium did not open its DevTools port"
            time.sleep(0.1)
        port, path = port_file.read_text().splitlines()[:2]
        self.ws = self._stack.enter_context(
            connect(f"ws://127.0.0.1:{port}{path}", max_size=None, open_timeout=30))
        self._id = 0
        self.events: list[dict[str, Any]] = []
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target,
                                 flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable", session=True)
        self.call("Emulation.setDeviceMetricsOverride", session=True, width=WIDTH,
                  height=HEIGHT, deviceScaleFactor=1, mobile=False)

    def call(self, method: str, session: bool = False, timeout: float = 60,
             **params: Any) -> dict[str, Any]:
        self._id += 1
        msg: dict[str, Any] = {"id": self._id, "method": method, "params": params}
        if session:
            msg["sessionId"] = self.session
        self.ws.send(json.dumps(msg))
        deadline = time.monotonic() + timeout
        while True:
            data = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if data.get("id") == self._id:
                assert "error" not in data, (method, data["error"])
                return data.get("result", {})
            if "method" in data:
                self.events.append(data)

    def wait_event(self, method: str, timeout: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            for i, event in enumerate(self.events):
                if event["method"] == method:
                    return self.events.pop(i)
            data = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if "method" in data:
                self.events.append(data)

    def open(self, url: str) -> list[str]:
        """Load ``url``; the console errors it caused."""
        self.events.clear()
        self.call("Page.navigate", session=True, url=url)
        self.wait_event("Page.loadEventFired")
        self.js("new Promise(r => setTimeout(r, 200))")  # late console output
        errors = []
        for event in self.events:
            p = event.get("params", {})
            if event["method"] == "Runtime.exceptionThrown":
                errors.append(json.dumps(p.get("exceptionDetails", {}))[:500])
            elif event["method"] == "Runtime.consoleAPICalled" and p.get("type") == "error":
                errors.append(json.dumps(p.get("args", []))[:500])
            elif event["method"] == "Log.entryAdded" and p["entry"].get("level") == "error":
                errors.append(f"{p['entry'].get('source')}: {p['entry'].get('text')} "
                              f"({p['entry'].get('url', '')})")
        return errors

    def js(self, expression: str) -> Any:
        out = self.call("Runtime.evaluate", session=True, expression=expression,
                        returnByValue=True, awaitPromise=True)
        assert "exceptionDetails" not in out, out["exceptionDetails"]
        return out["result"].get("value")

    def screenshot(self, path: Path) -> None:
        size = self.call("Page.getLayoutMetrics", session=True)["cssContentSize"]
        shot = self.call("Page.captureScreenshot", session=True, format="png",
                         captureBeyondViewport=True,
                         clip={"x": 0, "y": 0, "width": WIDTH,
                               "height": min(max(size["height"], HEIGHT), 8000), "scale": 1})
        path.write_bytes(base64.b64decode(shot["data"]))

    def close(self) -> None:
        try:
            self._stack.close()
        finally:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


@pytest.fixture(scope="module")
def browser(tmp_path_factory, site) -> Iterator[Browser]:
    if CHROMIUM is None:
        pytest.fail("Debian's chromium is not installed (`make system-deps` installs it)")
    b = Browser(tmp_path_factory.mktemp("chromium-profile"))
    try:
        b.call("Network.setCookie", session=True, name="_token", value=site.token,
               url=site.url, path="/")
        yield b
    finally:
        b.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory, request) -> Path:
    folder = tmp_path_factory.mktemp("ui-screenshots")
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line(f"\nUI screenshots: {folder}")
    return folder


def _page(browser: Browser, site: Site, path: str, shot: Path, record) -> None:
    errors = browser.open(site.url + path)
    browser.screenshot(shot)
    record(shot.stem, str(shot))
    assert errors == [], f"console errors on {path}: {errors}"
    assert browser.js("document.title").endswith("SkyPilot"), path
    overflow = browser.js("document.documentElement.scrollWidth - window.innerWidth")
    assert overflow <= 0, f"{path} overflows a {WIDTH} px window by {overflow} px ({shot})"


def test_the_pages_render_in_a_browser(site, browser, shots, record_property):
    # the jobs page: every column in a 1400 px window, the waiting job and the sweep listed
    _page(browser, site, "/skypilot/jobs", shots / "jobs.png", record_property)
    right = browser.js("""(() => { const th = [...document.querySelectorAll('table.jobs th')]
        .find(t => t.textContent.includes('GPU-hours')); return th.getBoundingClientRect().right;
        })()""")
    assert right <= WIDTH, f"the GPU-hours column is cut at {right} px"
    assert browser.js("document.querySelectorAll('table.waiting tbody tr').length") == 1
    assert "slurm_beta" in browser.js("document.querySelector('table.waiting').innerText")
    assert browser.js("document.querySelectorAll('table.jobs tr.sweep-head').length") == 1

    # the job page of the 2-attempt failover: one timeline bar per attempt, a grouped AWS row
    _page(browser, site, site.path("train"), shots / "job-failover.png", record_property)
    states = browser.js("[...document.querySelectorAll('svg.timeline g.attempt')]"
                        ".map(g => g.dataset.state)")
    assert states == ["infra_failed", "succeeded"]
    assert browser.js("document.querySelectorAll('table.attempts tbody tr').length") == 2
    grouped = browser.js("""[...document.querySelectorAll('table.placement tr.zone-group')]
        .map(r => [r.children[3].textContent.trim(), r.dataset.zones,
                   r.querySelector('summary').textContent.trim()])""")
    aws = [g for g in grouped if g[0] == "aws_sandbox"]
    assert aws and all(int(n) > 1 for _, n, _ in aws), grouped
    assert any("us-east-1/{" in summary for _, _, summary in aws), aws
    rows = browser.js("document.querySelectorAll('table.placement tbody > tr').length")
    zone_rows = browser.js("[...document.querySelectorAll('table.placement tr.zone-group')]"
                           ".reduce((n, r) => n + Number(r.dataset.zones), 0)")
    assert rows < 20 and zone_rows >= 8, (rows, zone_rows)
    # each zone's detail is there on demand
    browser.js("document.querySelector('table.placement tr.zone-group summary').click()")
    assert browser.js("document.querySelector('table.placement tr.zone-group details').open")
    assert "us-east-1a" in browser.js(
        "document.querySelector('table.placement tr.zone-group details ul').innerText") or \
        "us-west-2a" in browser.js(
        "document.querySelector('table.placement tr.zone-group details ul').innerText")
    browser.screenshot(shots / "job-failover-zones-open.png")

    # the waiting job: where it waits, its estimated start and every look
    _page(browser, site, site.path("waiting"), shots / "job-waiting.png", record_property)
    text = browser.js("document.querySelector('main').innerText").lower()
    assert "waiting" in text and "waits at\nslurm_beta" in text and "est. start\nin " in text
    assert browser.js("document.querySelectorAll('table.looks tbody tr').length") == 2
    assert browser.js("document.querySelectorAll('svg.timeline g.look-mark').length") == 2

    # the sweep, side by side: one lane per instance, one bar per attempt
    sweep = "/skypilot/sweeps/" + "/".join(quote(x, safe="") for x in
                                           (DAG_ID, site.run_id, "sweep"))
    _page(browser, site, sweep, shots / "sweep.png", record_property)
    assert browser.js("document.querySelectorAll('svg.timeline g.lane').length") == 4
    assert browser.js("document.querySelectorAll('svg.timeline g.attempt').length") == 5
    assert browser.js("document.querySelectorAll('svg.timeline path.arrow').length") == 1

    # capacity, probed live from the api-server: bars per place, AWS zones grouped
    _page(browser, site, "/skypilot/capacity", shots / "capacity.png", record_property)
    places = browser.js("[...document.querySelectorAll('svg.capacity-bars g.place')]"
                        ".map(g => g.dataset.connection)")
    assert set(places) == set(CONNS), places
    aws_rows = browser.js("""[...document.querySelectorAll('table.capacity tbody tr')]
        .filter(r => r.closest('tbody') && r.innerText.includes('us-east-1')).length""")
    assert browser.js("document.querySelectorAll('table.capacity tr.zone-group').length") > 5
    assert aws_rows < 40, aws_rows

    # usage over a period: per DAG and per connection, from the results
    _page(browser, site, "/skypilot/usage?days=7", shots / "usage.png", record_property)
    assert browser.js("document.querySelectorAll('svg.usage-bars rect').length") >= 4
    assert DAG_ID in browser.js("document.querySelector('table.usage-dag').innerText")
    conns = browser.js("document.querySelector('table.usage-connection').innerText")
    assert "k8s_sandbox" in conns and "aws_sandbox" in conns
    record_property("screenshots", str(shots))
