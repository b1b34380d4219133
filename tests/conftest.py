"""Shared fixtures: the sandboxes (started on demand, reset per test) and their connections.

``make test`` starts the sandboxes before pytest and stops them after; run alone, pytest starts
what a test needs (``up()`` is idempotent) and leaves it running for the next run
(``make sandbox-down`` stops it).
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.sandbox.paths import state_root

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("AIRFLOW_HOME", str(state_root() / "airflow-home"))
os.environ.setdefault("AIRFLOW__CORE__LOAD_EXAMPLES", "False")
os.environ.setdefault("AIRFLOW__CORE__DAGS_FOLDER", str(REPO / "dags"))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A skipped test is not a passed one: a run that skipped any fails (``make test``, CI).
    ``SKYPILOT_TESTS_ALLOW_SKIPS=1`` lets a run by hand skip what its machine lacks."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = (reporter.stats.get("skipped") or []) if reporter is not None else []
    if skipped and exitstatus == 0 and os.environ.get("SKYPILOT_TESTS_ALLOW_SKIPS") != "1":
        where = sorted({report.nodeid for report in skipped})
        if reporter is not None:
            reporter.write_line(f"{len(skipped)} test(s) skipped, which counts as a failure "
                                f"(SKYPILOT_TESTS_ALLOW_SKIPS=1 to allow): "
                                + ", ".join(where[:10]), red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(autouse=True)
def _own_placement_ledger(tmp_path_factory, monkeypatch):
    """Each test its own ledger of placements made moments ago (ledger.py): one test's
    placements do not make another's places look full."""
    path = tmp_path_factory.mktemp("ledger") / "placements.json"
    monkeypatch.setenv("AIRFLOW__SKYPILOT__PLACEMENT_LEDGER", str(path))


def use_connections(monkeypatch: pytest.MonkeyPatch, conns: dict[str, dict]) -> None:
    """Make Airflow connections visible to hooks in this process (AIRFLOW_CONN_<ID> JSON)."""
    for conn_id, conn in conns.items():
        monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(conn))


def wait_until(predicate, timeout: float = 60, interval: float = 0.5, what: str = "condition"):
    """Poll ``predicate`` (sleeping ``interval``) until it returns something truthy; that."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}")


def free_port() -> int:
    """A local TCP port nothing listens on now (taken and given back at once)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_job(backend, handle, states, timeout: float):
    """Poll ``backend`` until the job reaches one of ``states`` (JobState values); its status."""
    deadline = time.monotonic() + timeout
    status = None
    while time.monotonic() < deadline:
        status = backend.status([handle])[handle.job_id]
        if status.state in states:
            return status
        time.sleep(0.5)
    raise AssertionError(f"job {handle.job_id} still {status} after {timeout}s")


def _sandbox(name: str):
    """The sandbox ``name`` (tests/sandbox/<name>), started if it is not up."""
    from tests.sandbox.__main__ import sandbox

    box = sandbox(name)
    box.up()
    return box


def _clean(box, monkeypatch: pytest.MonkeyPatch):
    """Undo what the previous test did, and make the sandbox's connections visible."""
    box.reset()
    use_connections(monkeypatch, box.connections())
    return box


@pytest.fixture(scope="session")
def slurm_sandbox_session():
    return _sandbox("slurm")


@pytest.fixture(scope="session")
def k8s_sandbox_session():
    return _sandbox("kubernetes")


@pytest.fixture(scope="session")
def aws_sandbox_session():
    return _sandbox("aws")


@pytest.fixture
def slurm(slurm_sandbox_session, monkeypatch) -> Iterator:
    """The two Slurm clusters, clean (no jobs, every node up), connections set."""
    yield _clean(slurm_sandbox_session, monkeypatch)


@pytest.fixture
def k8s(k8s_sandbox_session, monkeypatch) -> Iterator:
    """The Kubernetes sandbox, clean, connections set."""
    yield _clean(k8s_sandbox_session, monkeypatch)


@pytest.fixture
def aws(aws_sandbox_session, monkeypatch) -> Iterator:
    """The AWS sandbox, clean (nothing running), connections set."""
    yield _clean(aws_sandbox_session, monkeypatch)
