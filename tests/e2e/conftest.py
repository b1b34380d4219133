"""Real Airflow, end to end: ``airflow dags test`` in a subprocess against the sandboxes.

One Airflow home (SQLite) per session; connections come in as ``AIRFLOW_CONN_*`` env vars;
``[skypilot] connections`` lists them. Results are read back from the run's XCom.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import wait_until  # noqa: F401  (the e2e tests import it from here)

REPO = Path(__file__).resolve().parents[2]
E2E_DAGS = Path(__file__).resolve().parent / "dags"
AIRFLOW = str(Path(sys.executable).parent / "airflow")


@dataclass
class DagRun:
    dag_id: str
    run_id: str
    returncode: int
    output: str
    states: dict[str, str] = field(default_factory=dict)
    xcoms: dict[tuple[str, str], Any] = field(default_factory=dict)

    def result(self, task_id: str) -> Any:
        return self.xcoms.get((task_id, "return_value"))

    def xcom(self, task_id: str, key: str) -> Any:
        return self.xcoms.get((task_id, key))


class Running:
    """A ``dags test`` in progress; its output is collected as it comes."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self._lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.append(line)

    def output(self) -> str:
        return "".join(self._lines)

    def wait(self, timeout: float) -> bool:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        self._reader.join(30)
        return True

    def poll(self):
        return self.proc.poll()

    def kill(self) -> None:
        self.proc.kill()


class Airflow:
    """Runs ``airflow dags test`` with a fixed environment and reads the outcome."""

    def __init__(self, home: Path):
        self.home = home
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")},
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
            "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
            "PYTHONPATH": str(REPO),
        }

    def connect(self, conns: dict[str, dict], default: list[str]) -> None:
        for key in [k for k in self.env if k.startswith("AIRFLOW_CONN_")]:
            del self.env[key]
        for conn_id, conn in conns.items():
            self.env[f"AIRFLOW_CONN_{conn_id.upper()}"] = json.dumps(conn)
        self.env["AIRFLOW__SKYPILOT__CONNECTIONS"] = ",".join(default)

    def migrate(self) -> None:
        subprocess.run([AIRFLOW, "db", "migrate"], env=self.env, check=True,
                       capture_output=True, timeout=300)

    def start(self, dag_id: str, conf: dict | None = None, dags: Path = E2E_DAGS) -> Running:
        env = {**self.env, "AIRFLOW__CORE__DAGS_FOLDER": str(dags)}
        argv = [AIRFLOW, "dags", "test", dag_id]
        if conf is not None:
            argv += ["-c", json.dumps(conf)]
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        return Running(proc)

    @contextmanager
    def started(self, dag_id: str, conf: dict | None = None, dags: Path = E2E_DAGS
                ) -> Iterator[Running]:
        """:meth:`start`; on the way out, the run is killed if it has not ended (a test that
        failed before :meth:`finish`)."""
        running = self.start(dag_id, conf, dags)
        try:
            yield running
        finally:
            if running.poll() is None:
                running.kill()

    def finish(self, running: Running, dag_id: str, timeout: float = 600) -> DagRun:
        if not running.wait(timeout):
            running.proc.kill()
            running.wait(30)
            raise AssertionError(f"dags test {dag_id} timed out:\n{running.output()[-5000:]}")
        return self.read(dag_id, running.proc.returncode, running.output())

    def run(self, dag_id: str, conf: dict | None = None, dags: Path = E2E_DAGS,
            timeout: float = 600) -> DagRun:
        return self.finish(self.start(dag_id, conf, dags), dag_id, timeout)

    def read(self, dag_id: str, returncode: int, output: str) -> DagRun:
        db = sqlite3.connect(self.home / "airflow.db")
        try:
            row = db.execute("SELECT run_id FROM dag_run WHERE dag_id=? ORDER BY id DESC LIMIT 1",
                             (dag_id,)).fetchone()
            assert row, f"no run of {dag_id}:\n{output[-3000:]}"
            run_id = row[0]
            states = dict(db.execute(
                "SELECT task_id, state FROM task_instance WHERE dag_id=? AND run_id=?",
                (dag_id, run_id)).fetchall())
            xcoms = {}
            for task_id, key, value in db.execute(
                    "SELECT task_id, key, value FROM xcom WHERE dag_id=? AND run_id=?",
                    (dag_id, run_id)):
                xcoms[(task_id, key)] = json.loads(value) if isinstance(value, (str, bytes)) \
                    else value
        finally:
            db.close()
        return DagRun(dag_id, run_id, returncode, output, states, xcoms)


@pytest.fixture(scope="session")
def airflow(tmp_path_factory) -> Airflow:
    home = tmp_path_factory.mktemp("airflow-home")
    af = Airflow(home)
    af.migrate()
    return af


@pytest.fixture
def airflow_slurm(airflow, slurm) -> Airflow:
    """Airflow with the two Slurm clusters as its default connections."""
    airflow.connect(slurm.connections(), ["slurm_alpha", "slurm_beta"])
    return airflow


@pytest.fixture
def airflow_k8s(airflow, slurm, k8s) -> Airflow:
    """Airflow with both Slurm clusters and the Kubernetes cluster."""
    airflow.connect({**slurm.connections(), **k8s.connections()},
                    ["slurm_alpha", "slurm_beta", "k8s_sandbox"])
    return airflow


@pytest.fixture
def airflow_all(airflow, slurm, k8s, aws) -> Airflow:
    """Airflow with every sandbox: two Slurm clusters, Kubernetes and AWS."""
    airflow.connect({**slurm.connections(), **k8s.connections(), **aws.connections()},
                    ["slurm_alpha", "slurm_beta", "k8s_sandbox", "aws_sandbox"])
    return airflow


#: the directories :func:`shared_dir` made that are not removed yet
_SHARED_DIRS: list[str] = []


def shared_dir() -> str:
    """A fresh directory every job of a test can write (checkpoints), whoever it runs as.
    Removed after the test (:func:`_remove_shared_dirs`, for the tests here) or when the
    session's process ends (the tests elsewhere that use it)."""
    path = f"/tmp/airflow-skypilot-e2e/{uuid.uuid4().hex}"
    os.makedirs(path, exist_ok=True)
    os.chmod(path, 0o1777)
    _SHARED_DIRS.append(path)
    return path


def remove_shared_dirs() -> None:
    """Remove every directory :func:`shared_dir` made (the files the jobs wrote with them)."""
    while _SHARED_DIRS:
        shutil.rmtree(_SHARED_DIRS.pop(), ignore_errors=True)


atexit.register(remove_shared_dirs)


@pytest.fixture(autouse=True)
def _remove_shared_dirs() -> Iterator[None]:
    """After each e2e test (after the fixtures that stop its jobs: this one is set up first,
    so it is torn down last), the directories it made are removed."""
    yield
    remove_shared_dirs()


@dataclass(frozen=True)
class Mark:
    """One line the user code of ``tasks/counted.yaml`` wrote: START, TICK or END."""

    kind: str
    attempt: str
    host: str
    cluster: str
    job: str
    t: float

    @property
    def copy(self) -> tuple[str, str]:
        """Which copy wrote it (one Slurm job): its cluster and job id."""
        return self.cluster, self.job


def marks(counter: str, kind: str | None = None) -> list[Mark]:
    """The lines of a ``counted.yaml`` counter file (``kind``: only those), in order."""
    try:
        text = Path(counter).read_text()
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        word, *fields = line.split()
        values = dict(f.split("=", 1) for f in fields if "=" in f)
        if kind is None or word == kind:
            out.append(Mark(word, values.get("attempt", ""), values.get("host", ""),
                            values.get("cluster", ""), values.get("job", ""),
                            float(values.get("t", "0"))))
    return out


def counted(counter: str, seconds: int, **conf: Any) -> dict[str, Any]:
    """A run's conf for ``tasks/counted.yaml``: its counter file, how long it works, and any
    other param of the e2e DAGs (``unreachable_timeout``...)."""
    return {"task": "tasks/counted.yaml",
            "envs": {"COUNTER": counter, "WORK_SECONDS": str(seconds)}, **conf}


def assert_ran_once(counter: str) -> Mark:
    """The user code ran exactly once: one copy, one START, one END; that END."""
    lines = marks(counter)
    copies = {m.copy for m in lines}
    starts = [m for m in lines if m.kind == "START"]
    ends = [m for m in lines if m.kind == "END"]
    assert len(copies) == 1 and len(starts) == 1 and len(ends) == 1, \
        f"the user code did not run exactly once:\n{Path(counter).read_text()}"
    assert lines[0].kind == "START" and lines[-1].kind == "END"
    return ends[0]




#: what :func:`copies_marked` puts before a task's run: counted.yaml's ``mark``, into a file
#: of the copy's own under $COPIES_DIR (copies on different backends run as different users)
_MARK = """umask 000
copy_file="$COPIES_DIR/copy.${SKYPILOT_ATTEMPT}.$(hostname).$$"
mark() {
  printf '%s attempt=%s host=%s cluster=%s job=%s t=%s\\n' "$1" "$SKYPILOT_ATTEMPT" \\
    "${SLURMD_NODENAME:-$(hostname)}" "${SLURM_CLUSTER_NAME:-}" "${SLURM_JOB_ID:-}" \\
    "$(date +%s.%N)" >> "$copy_file"
}
mark START
"""


def copies_marked(task_file: str) -> str:
    """The YAML text of the checkpointing trainer ``task_file`` (under dags/: its run loops
    ``echo "step $i"``), whose user code also records each copy of itself as
    ``tasks/counted.yaml`` does: START, a TICK per step, END once it trained; each copy in a
    file of its own under the env ``COPIES_DIR`` (read with :func:`failover_copies`)."""
    import yaml

    spec = yaml.safe_load((E2E_DAGS / task_file).read_text())
    step = 'echo "step $i";'
    assert spec["run"].count(step) == 1, f"{task_file}'s run has no step loop to mark"
    spec["envs"] = {**(spec.get("envs") or {}), "COPIES_DIR": None}
    spec["run"] = _MARK + spec["run"].replace(step, f"{step} mark TICK;") + "mark END\n"

    class Dumper(yaml.SafeDumper):  # the run as a block, readable in the rendered task
        pass

    Dumper.add_representer(str, lambda dumper, text: dumper.represent_scalar(
        "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None))
    return yaml.dump(spec, Dumper=Dumper, sort_keys=False)


def failover_copies(copies_dir: str) -> list[list[Mark]]:
    """The copies of a task that failed over once: the first was killed mid-run, so its user
    code ran twice, but never at once. Asserts that: two copies, each started once, the first
    stopped (no END) before the second started, the second (a later SKYPILOT_ATTEMPT) ran to
    its END, the only one. Returns each copy's marks, in order."""
    copies = sorted((marks(str(f)) for f in Path(copies_dir).glob("copy.*")),
                    key=lambda lines: lines[0].t if lines else 0.0)
    shown = "\n".join(f"{f.name}:\n{f.read_text()}" for f in Path(copies_dir).glob("copy.*"))
    assert len(copies) == 2, f"the user code ran as {len(copies)} copies, not 2:\n{shown}"
    first, second = copies
    for lines in copies:
        assert [m.kind for m in lines].count("START") == 1 and lines[0].kind == "START", shown
    assert "END" not in [m.kind for m in first], f"the killed copy finished:\n{shown}"
    assert any(m.kind == "TICK" for m in first), f"the first copy did no work:\n{shown}"
    assert first[-1].t < second[0].t, f"the copies overlapped:\n{shown}"
    assert [m.kind for m in second].count("END") == 1 and second[-1].kind == "END", shown
    assert int(second[0].attempt) > int(first[0].attempt), shown
    return copies
