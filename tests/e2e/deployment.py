"""A production-shaped Airflow deployment for the e2e tests, started and stopped by them.

- **PostgreSQL** (Debian's ``postgresql``): ``initdb`` into a fresh temp dir, the postmaster on a
  free loopback port with password (SCRAM) logins, no Unix socket outside that dir. Root cannot
  run postgres: as root, the data dir is given to the ``postgres`` user the package creates and
  initdb and the postmaster run as that user (``subprocess`` ``user=``); as anyone else they run
  as that user. Durability is off (``fsync``, ``synchronous_commit``): a test database.
- **Redis** (Debian's ``redis-server``): the Celery broker, on a free loopback port with a
  password, nothing persisted.
- **Airflow**: api-server, scheduler (CeleryExecutor), dag-processor, two triggerers and two
  Celery workers, each its own process (in its own session, so a kill takes its children) with
  its own log, its own log-server port and its own host name (``[core] hostname_callable``:
  as on separate machines, the TI's host, a triggerer's job and a Celery node say which
  component it was). Connections live in the metadata DB (encrypted with a Fernet key).

Nothing is machine-global: ports are free ones picked at start, every file is under a temp dir
of this process, and only the processes started here are stopped (by their own ids).
"""

from __future__ import annotations

import glob
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import free_port, wait_until

REPO = Path(__file__).resolve().parents[2]
E2E_DAGS = Path(__file__).resolve().parent / "dags"
AIRFLOW = str(Path(sys.executable).parent / "airflow")
#: env var each component's host name comes from (read by :func:`component_hostname`)
HOSTNAME_ENV = "AIRFLOW_SKYPILOT_E2E_HOSTNAME"
TRIGGERERS = ("triggerer-1", "triggerer-2")
WORKERS = ("worker-1", "worker-2")
COMPONENTS = ("api-server", "scheduler", "dag-processor", *TRIGGERERS, *WORKERS)
#: task slots per Celery worker; with two workers, ``[core] parallelism``: a sweep of 8 (the
#: spread scenario) places at once
WORKER_CONCURRENCY = 4
#: triggerer-1 runs at most this many triggers (``airflow triggerer --capacity``; triggerer-2
#: has Airflow's default, 1000): the HA test fills it, and the rest go to triggerer-2
TRIGGERER_1_CAPACITY = 10
#: the e2e DAG whose task (``run``) the deployment tests trigger unless they say otherwise
DAG_ID = "e2e_task"


def component_hostname() -> str:
    """``[core] hostname_callable`` of the deployment: the component's own name."""
    return os.environ.get(HOSTNAME_ENV) or socket.getfqdn()


def _stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, grace: float = 20) -> None:
    """Stop a process we started (and its session), by its id: ``sig``, then SIGKILL."""
    if proc.poll() is not None:
        return
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


# --------------------------------------------------------------------------------- PostgreSQL

def _pg_bindir() -> Path:
    """The newest installed PostgreSQL's bin dir (Debian keeps them versioned)."""
    dirs = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"),
                  key=lambda p: int(Path(p).parts[-3]))
    if not dirs:
        raise RuntimeError("PostgreSQL is not installed (Debian package `postgresql`; "
                           "`make venv` installs it)")
    return Path(dirs[-1]).parent


@dataclass
class Postgres:
    root: Path
    port: int
    password: str
    proc: subprocess.Popen
    user: str = "airflow"
    database: str = "airflow"

    @property
    def url(self) -> str:
        return (f"postgresql+psycopg2://{self.user}:{self.password}@127.0.0.1:{self.port}/"
                f"{self.database}")

    @classmethod
    def start(cls) -> Postgres:
        bindir = _pg_bindir()
        # not under pytest's tmp dir: that one is 0700 and ours; the postgres user needs its own
        root = Path(tempfile.mkdtemp(prefix="airflow-skypilot-pg-"))
        run_as = {"user": "postgres", "group": "postgres", "extra_groups": []} \
            if os.geteuid() == 0 else {}
        if run_as:
            shutil.chown(root, "postgres", "postgres")
        password = secrets.token_hex(12)
        pwfile = root / "pwfile"
        pwfile.write_text(password + "\n")
        if run_as:
            shutil.chown(pwfile, "postgres", "postgres")
        pwfile.chmod(0o600)
        data = root / "data"
        subprocess.run([str(bindir / "initdb"), "-D", str(data), "-U", "airflow",
                        f"--pwfile={pwfile}", "--auth-host=scram-sha-256",
                        "--auth-local=scram-sha-256", "-E", "UTF8", "--locale=C.UTF-8",
                        "--no-sync"], check=True, capture_output=True, cwd=root, timeout=120,
                       **run_as)
        pwfile.unlink()
        for _ in range(3):  # a free port can be taken between the pick and the bind
            port = free_port()
            with open(root / "postgres.log", "ab") as log:
                proc = subprocess.Popen(
                    [str(bindir / "postgres"), "-D", str(data),
                     "-c", "listen_addresses=127.0.0.1", "-c", f"port={port}",
                     "-c", f"unix_socket_directories={root}", "-c", "max_connections=200",
                     "-c", "fsync=off", "-c", "synchronous_commit=off",
                     "-c", "full_page_writes=off", "-c", "shared_buffers=64MB"],
                    stdout=log, stderr=subprocess.STDOUT, cwd=root, start_new_session=True,
                    **run_as)
            pg = cls(root, port, password, proc)
            try:
                wait_until(pg._ready, 60, 0.3, what="PostgreSQL accepting connections")
            except AssertionError:
                _stop(proc, signal.SIGINT)
                continue
            pg._sql("CREATE DATABASE airflow", database="postgres")
            return pg
        shutil.rmtree(root, ignore_errors=True)
        raise RuntimeError(f"PostgreSQL did not start:\n{pg.log()[-3000:]}")

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"postgres exited:\n{self.log()[-3000:]}")
        try:
            self._sql("SELECT 1", database="postgres")
        except Exception:
            return False
        return True

    def _sql(self, statement: str, database: str | None = None) -> list[tuple]:
        import psycopg2

        db = psycopg2.connect(host="127.0.0.1", port=self.port, user=self.user,
                              password=self.password, dbname=database or self.database,
                              connect_timeout=5)
        db.autocommit = True
        try:
            with db.cursor() as cur:
                cur.execute(statement)
                return cur.fetchall() if cur.description else []
        finally:
            db.close()

    def query(self, statement: str) -> list[tuple]:
        """Rows of a statement on the Airflow database."""
        return self._sql(statement)

    def log(self) -> str:
        return (self.root / "postgres.log").read_text(errors="replace")

    def stop(self) -> None:
        _stop(self.proc, signal.SIGINT, grace=30)  # SIGINT: postgres's fast shutdown
        shutil.rmtree(self.root, ignore_errors=True)


# -------------------------------------------------------------------------------------- Redis

@dataclass
class Redis:
    root: Path
    port: int
    password: str
    proc: subprocess.Popen

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    @classmethod
    def start(cls, root: Path) -> Redis:
        server = shutil.which("redis-server")
        if server is None:
            raise RuntimeError("redis-server is not installed (Debian package `redis-server`; "
                               "`make venv` installs it)")
        root.mkdir(parents=True, exist_ok=True)
        password = secrets.token_hex(12)
        conf = root / "redis.conf"  # the password in a file, not on a command line
        for _ in range(3):
            port = free_port()
            conf.write_text(f"bind 127.0.0.1\nport {port}\nrequirepass {password}\n"
                            f"dir {root}\nsave \"\"\nappendonly no\ndaemonize no\n"
                            "protected-mode yes\nlogfile \"\"\n")
            conf.chmod(0o600)
            with open(root / "redis.log", "ab") as log:
                proc = subprocess.Popen([server, str(conf)], stdout=log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
            redis = cls(root, port, password, proc)
            try:
                wait_until(redis._ready, 30, 0.2, what="Redis answering PING")
            except AssertionError:
                _stop(proc)
                continue
            return redis
        raise RuntimeError(f"Redis did not start:\n{redis.log()[-3000:]}")

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"redis-server exited:\n{self.log()[-3000:]}")
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=2) as s:
                s.sendall(f"AUTH {self.password}\r\nPING\r\n".encode())
                answer = b""
                while b"+PONG" not in answer and b"-" not in answer:
                    chunk = s.recv(100)
                    if not chunk:
                        break
                    answer += chunk
                return b"+PONG" in answer
        except OSError:
            return False

    def log(self) -> str:
        return (self.root / "redis.log").read_text(errors="replace")

    def stop(self) -> None:
        _stop(self.proc)


# ------------------------------------------------------------------------------------ Airflow

@dataclass
class Deployment:
    home: Path
    url: str
    env: dict[str, str]
    postgres: Postgres | None = None
    redis: Redis | None = None
    argv: dict[str, list[str]] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    started: dict[str, float] = field(default_factory=dict)
    token: str = ""

    # ---- processes
    def start(self, component: str) -> None:
        """Start a component in its own session, its output appended to its log; its own host
        name and log-server port (a fresh one: the old one may linger after a kill)."""
        env = {**self.env, HOSTNAME_ENV: component}
        if component.startswith("triggerer"):
            env["AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT"] = str(free_port())
        if component.startswith("worker"):
            env["AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT"] = str(free_port())
        self.started[component] = time.time()
        with open(self.home / f"{component}.log", "a") as log:
            self.procs[component] = subprocess.Popen(
                [AIRFLOW, *self.argv.get(component, [component])], env=env, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True)

    def kill(self, component: str) -> None:
        """SIGKILL a component and every process it started (its session), as a crash."""
        proc = self.procs[component]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)

    def stop_component(self, component: str) -> None:
        """Stop a component as an operator would (SIGTERM, then wait for it)."""
        _stop(self.procs[component], grace=60)

    def session_pids(self, component: str) -> list[int]:
        """The component's processes: its own and its children's (one session)."""
        sid = self.procs[component].pid
        pids = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            with suppress(OSError):
                if os.getsid(int(pid)) == sid:
                    pids.append(int(pid))
        return pids

    def tcp_ports(self, component: str) -> set[int]:
        """The local ports of the TCP connections the component's processes hold now (an SSH
        connection's client port is what the sandbox's commands log records)."""
        inodes = set()
        for pid in self.session_pids(component):
            with suppress(OSError):
                for fd in os.listdir(f"/proc/{pid}/fd"):
                    with suppress(OSError):
                        target = os.readlink(f"/proc/{pid}/fd/{fd}")
                        if target.startswith("socket:["):
                            inodes.add(target[8:-1])
        ports = set()
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with suppress(OSError), open(table) as f:
                next(f)
                for line in f:
                    cols = line.split()
                    if cols[9] in inodes:
                        ports.add(int(cols[1].rsplit(":", 1)[1], 16))
        return ports

    def alive(self, component: str) -> bool:
        proc = self.procs.get(component)
        return proc is not None and proc.poll() is None

    def stop(self) -> None:
        for proc in self.procs.values():
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(10)  # nothing to keep: the home is thrown away
            except subprocess.TimeoutExpired:
                with suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)

    # ---- logs
    def log(self, component: str) -> str:
        try:
            return (self.home / f"{component}.log").read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def logs(self) -> str:
        return "\n".join(f"--- {c} ---\n{self.log(c)[-3000:]}" for c in COMPONENTS)

    def trigger_log(self, run_id: str, dag_id: str = DAG_ID, task_id: str = "run") -> str:
        """What the triggerers logged for this run's task (``attempt=1.log.trigger.<id>.log``)."""
        return "".join(self.trigger_logs(run_id, dag_id, task_id).values())

    def trigger_logs(self, run_id: str, dag_id: str = DAG_ID, task_id: str = "run"
                     ) -> dict[int, str]:
        """The trigger's log per triggerer (job id) that ran it."""
        files = sorted(self.home.glob(f"logs/dag_id={dag_id}/run_id={run_id}/"
                                      f"task_id={task_id}/*.log.trigger.*.log"))
        return {int(f.name.split(".")[-2]): f.read_text(errors="replace") for f in files}

    def task_log(self, run_id: str, dag_id: str = DAG_ID, task_id: str = "run",
                 map_index: int = -1) -> str:
        """What the workers logged for this run's task (of this map index)."""
        mapped = "" if map_index < 0 else f"map_index={map_index}/"
        files = sorted(self.home.glob(f"logs/dag_id={dag_id}/run_id={run_id}/"
                                      f"task_id={task_id}/{mapped}attempt=*.log"))
        return "".join(f.read_text(errors="replace") for f in files)

    # ---- REST API
    def api(self, method: str, path: str, **kw: Any) -> httpx.Response:
        return httpx.request(method, f"{self.url}/api/v2{path}", timeout=30,
                             headers={"Authorization": f"Bearer {self.token}"}, **kw)

    def login(self) -> bool:
        try:
            r = httpx.post(f"{self.url}/auth/token",
                           json={"username": "admin", "password": "admin"}, timeout=5)
        except httpx.HTTPError:
            return False
        if r.status_code != 201:
            return False
        self.token = r.json()["access_token"]
        return True

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
        wait_until(lambda: self.run_state(run_id, dag_id) in ("success", "failed"), 60, 0.5,
                 what=f"run {run_id} finished")
        r = self.api("DELETE", f"/dags/{dag_id}/dagRuns/{run_id}")
        assert r.status_code == 204, r.text

    def ti(self, run_id: str, dag_id: str = DAG_ID, task_id: str = "run") -> dict[str, Any]:
        r = self.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}")
        return r.json() if r.status_code == 200 else {}

    def tis(self, dag_id: str = DAG_ID, run_ids: set[str] | None = None) -> list[dict[str, Any]]:
        """The task instances of every run of the DAG (or of these runs)."""
        r = self.api("GET", f"/dags/{dag_id}/dagRuns/~/taskInstances",
                     params={"limit": 1000})
        assert r.status_code == 200, r.text
        return [t for t in r.json()["task_instances"]
                if run_ids is None or t["dag_run_id"] in run_ids]

    def triggerers(self) -> dict[int, str]:
        """Triggerer job id -> its component's name, for every triggerer job ever started."""
        r = self.api("GET", "/jobs", params={"job_type": "TriggererJob", "limit": 100})
        assert r.status_code == 200, r.text
        return {j["id"]: j["hostname"] for j in r.json()["jobs"]}

    def triggerer_job(self, component: str) -> int | None:
        """The job id of the component's live triggerer job, of the process running now
        (None while it has none: a killed one's job stays "alive" until its heartbeat ages)."""
        r = self.api("GET", "/jobs", params={"job_type": "TriggererJob", "hostname": component,
                                             "is_alive": True, "order_by": "-id"})
        jobs = r.json()["jobs"] if r.status_code == 200 else []
        since = self.started.get(component, 0.0) - 1
        return next((j["id"] for j in jobs
                     if datetime.fromisoformat(j["start_date"]).timestamp() >= since), None)

    def run_state(self, run_id: str, dag_id: str = DAG_ID) -> str:
        return self.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}").json().get("state", "")

    def xcom(self, run_id: str, key: str, dag_id: str = DAG_ID, task_id: str = "run") -> Any:
        r = self.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/"
                            f"xcomEntries/{key}")
        if r.status_code != 200:
            return None
        value = r.json()["value"]
        return json.loads(value) if isinstance(value, str) else value

    def wait_ti(self, run_id: str, states: set[str], timeout: float, dag_id: str = DAG_ID) -> str:
        def reached():
            state = self.ti(run_id, dag_id).get("state")
            return state if state in states else None
        try:
            return wait_until(reached, timeout, 1, what=f"task state in {states}")
        except AssertionError:
            raise AssertionError(f"task is {self.ti(run_id, dag_id).get('state')!r}, "
                                 f"not in {states}\n" + self.logs()) from None

    def wait_started(self, component: str, timeout: float = 120) -> None:
        """Until the component is up: a triggerer's job heartbeats, a worker's Celery node is
        ready, any other has not exited."""
        def up() -> bool:
            assert self.alive(component), f"{component} exited\n{self.log(component)[-3000:]}"
            if component.startswith("triggerer"):
                return self.triggerer_job(component) is not None
            if component.startswith("worker"):
                return f"@{component} ready." in self.log(component)
            return True
        wait_until(up, timeout, 1, what=f"{component} up\n{self.log(component)[-2000:]}")


def _airflow_env(home: Path, url: str, postgres: Postgres, redis: Redis,
                 conns: dict[str, dict], dags: Path) -> dict[str, str]:
    from cryptography.fernet import Fernet

    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env.update({
        "AIRFLOW_HOME": str(home),
        "PYTHONPATH": str(REPO),
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
        "AIRFLOW__CORE__FERNET_KEY": Fernet.generate_key().decode(),
        "AIRFLOW__CORE__HOSTNAME_CALLABLE": "tests.e2e.deployment.component_hostname",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": postgres.url,
        "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
        "AIRFLOW__CELERY__BROKER_URL": redis.url,
        "AIRFLOW__CELERY__RESULT_BACKEND": "db+" + postgres.url.replace("+psycopg2", ""),
        "AIRFLOW__CELERY__WORKER_CONCURRENCY": str(WORKER_CONCURRENCY),
        "AIRFLOW__CORE__PARALLELISM": str(len(WORKERS) * WORKER_CONCURRENCY),
        "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{url}/execution/",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(home / "passwords.json"),
        "AIRFLOW__API__BASE_URL": url,
        "AIRFLOW__API__SECRET_KEY": secrets.token_hex(16),
        "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_hex(16),
        "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
        "AIRFLOW__SCHEDULER__TRIGGER_TIMEOUT_CHECK_INTERVAL": "2",
        # a triggerer whose heartbeat (every 5 s) is older than this is dead: the others take
        # its triggers. Airflow's default; not lower: a triggerer's first trigger builds its
        # in-process execution API in the heartbeat's thread, which took ~20 s on two loaded
        # cores, and a live triggerer's triggers then move (apache/airflow#73454)
        "AIRFLOW__TRIGGERER__TRIGGERER_HEALTH_CHECK_THRESHOLD": "30",
        "AIRFLOW__SKYPILOT__CONNECTIONS": ",".join(sorted(conns)),
    })
    return env


@contextmanager
def deployed(conns: dict[str, dict], home: Path, dags: Path = E2E_DAGS,
             wait_dags: tuple[str, ...] = ()) -> Iterator[Deployment]:
    """Start the whole deployment (database, broker, every Airflow component), yield it once
    the API answers, every component is up and ``wait_dags`` are parsed; stop all of it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    (home / "passwords.json").write_text(json.dumps({"admin": "admin"}))
    postgres = redis = None
    dep = None
    try:
        postgres = Postgres.start()
        redis = Redis.start(home / "redis")
        env = _airflow_env(home, url, postgres, redis, conns, dags)
        subprocess.run([AIRFLOW, "db", "migrate"], env=env, check=True, capture_output=True,
                       timeout=600)
        # connections in the metadata DB, as users add them: the triggerer then reads them
        # through its supervisor (env-var connections would skip that path)
        (home / "connections.json").write_text(json.dumps(conns))
        subprocess.run([AIRFLOW, "connections", "import", str(home / "connections.json")],
                       env=env, check=True, capture_output=True, timeout=120)
        (home / "connections.json").unlink()
        argv = {"api-server": ["api-server", "--host", "127.0.0.1", "--port", str(port),
                               "--workers", "1"]}
        argv.update({"triggerer-1": ["triggerer", "--capacity", str(TRIGGERER_1_CAPACITY)],
                     "triggerer-2": ["triggerer"]})
        argv.update({w: ["celery", "worker", "--celery-hostname", w, "--without-mingle",
                         "--without-gossip"] for w in WORKERS})
        dep = Deployment(home, url, env, postgres, redis, argv)
        for component in COMPONENTS:
            dep.start(component)

        def ready():
            for name in COMPONENTS:
                assert dep.alive(name), f"{name} exited\n{dep.logs()}"
            return dep.login() and all(dep.api("GET", f"/dags/{d}").status_code == 200
                                       for d in wait_dags)
        wait_until(ready, 240, 1, what="the API up with the DAGs parsed")
        for component in (*TRIGGERERS, *WORKERS):
            dep.wait_started(component)
        yield dep
    finally:
        if dep is not None:
            dep.stop()
        if redis is not None:
            redis.stop()
        if postgres is not None:
            postgres.stop()
