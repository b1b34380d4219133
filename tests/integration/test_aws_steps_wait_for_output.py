"""AWS sandbox: setup and run end once their output is closed by every process holding it.

As SkyPilot's ``log_lib.run_with_log`` (it reads the output until EOF, then waits), and as the
Slurm and Kubernetes backends do: a writer the run left in the background keeps the job
running and its lines reach the log. The node used to power off once the run's shell exited,
the writer killed and its lines lost. A cancel still ends such a job at once.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from airflow_skypilot.backends.aws import AwsBackend
from airflow_skypilot.backends.base import JobState
from airflow_skypilot.spec import load_task
from tests.conftest import wait_until
from tests.e2e.conftest import shared_dir
from tests.integration.test_aws_backend import (  # noqa: F401  (box: the sandbox fixture)
    CONN,
    DONE,
    _instances,
    _name,
    _offer,
    _s3_text,
    _wait,
    box,
)

pytestmark = pytest.mark.sandbox


def _until_body_done(backend, handle) -> None:
    """The job runs and its run body's last line is in the log (its background writer on)."""
    _wait(backend, handle, {JobState.RUNNING}, timeout=60)
    wait_until(lambda: "run body done" in backend.read_log(handle)[0], timeout=60,
               what="the run body's line in the log")


def test_a_background_writers_late_line_is_logged_before_the_job_ends(box):  # noqa: F811
    backend = AwsBackend(CONN)
    marks = Path(shared_dir())  # one file per run of the user code
    task = load_task({"run": f"touch {marks}/ran.$$\n"
                             '(sleep 8; echo "late line from background") &\n'
                             'echo "run body done"\n'})
    handle = backend.submit(task, _offer(backend, task), _name("late"), {})
    try:
        _until_body_done(backend, handle)
        running = time.monotonic()
        status = _wait(backend, handle, timeout=60)
        text, _ = backend.read_log(handle)
        assert status.state == JobState.SUCCEEDED and status.exit_code == 0, (status, text)
        lines = text.splitlines()
        assert lines.index("run body done") < lines.index("late line from background") \
            < lines.index("airflow-skypilot: exit_code: 0"), text
        assert lines.count("run body done") == 1, text
        # the job lasted until the writer ended (~8 s after the run body; 4 s before the fix)
        assert time.monotonic() - running > 4
        assert _s3_text(box, f"jobs/{handle.job_name}/rank-0/exit_code").strip() == "0"
    finally:
        backend.cleanup(handle)
    assert [p.name.split(".")[0] for p in marks.iterdir()] == ["ran"]  # user code ran once


def test_a_cancel_ends_a_job_whose_background_writer_ignores_term_at_once(box):  # noqa: F811
    backend = AwsBackend(CONN)
    task = load_task({"run": "(trap '' TERM HUP; sleep 300; echo \"late line from background\")"
                             " &\n"
                             'echo "run body done"\n'})
    handle = backend.submit(task, _offer(backend, task), _name("late-cancel"), {})
    try:
        _until_body_done(backend, handle)
        time.sleep(3)  # the run's shell has exited: the writer holds its output
        status = backend.status([handle])[handle.job_id]
        assert status.state == JobState.RUNNING, status
        start = time.monotonic()
        backend.cancel(handle)
        final = _wait(backend, handle, DONE, timeout=30)
        assert final.state == JobState.CANCELLED, final
        assert time.monotonic() - start < 20
        wait_until(lambda: all(i["State"]["Name"] == "terminated"
                               for i in _instances(box, handle.job_name)), timeout=30,
                   what="the job's instance terminated")
        assert "late line from background" not in backend.read_log(handle)[0]
    finally:
        backend.cleanup(handle)
