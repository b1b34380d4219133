"""AWS: setup and run end once their output is closed by every process holding it.

SkyPilot runs both through ``log_lib.run_with_log``, which reads the process's output until
EOF and then waits for it: a writer the script left in the background keeps the step going,
and its lines are logged. The bootstrap is run for real here, with bash, against the stub
``curl``/``aws``/``shutdown`` of :mod:`tests.unit.test_aws_backend`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

from airflow_skypilot.spec import load_task
from tests.unit.test_aws_backend import _boot as _boot_task

LATE = "(sleep 3; echo \"late line from background\") &\n"


def _boot(tmp_path, spec):
    """The bootstrap of the task ``spec`` for rank 0 of one node: (fake, env, user-data)."""
    return _boot_task(tmp_path, load_task(spec))


def _rank0(fake):
    return fake / "s3" / "bucket/jobs/sky-job-1/rank-0"


def _until_logged(tmp_path, proc, text: str) -> None:
    """Wait until the node's log has ``text``, the bootstrap still running."""
    log = tmp_path / "home/.airflow-skypilot/sky-job-1/node.log"
    deadline = time.monotonic() + 30
    while text not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline, f"{text!r} never logged"
        assert proc.poll() is None, "the bootstrap ended with the run's shell"
        time.sleep(0.2)


def _lines(log: str) -> list[str]:
    return log.splitlines()


def test_run_ends_when_its_background_writer_has_and_keeps_the_scripts_exit_code(tmp_path):
    fake, env, user_data = _boot(tmp_path, {"run": LATE + 'echo "run body done"\nexit 3'})
    start = time.monotonic()
    proc = subprocess.run(["bash", str(user_data)], env=env, capture_output=True, timeout=60)
    took = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr
    log = (_rank0(fake) / "log").read_text()
    lines = _lines(log)
    # the script's own exit code, not the pipe's (cat's 0)
    assert (_rank0(fake) / "exit_code").read_text() == "3\n", log
    assert lines.index("run body done") < lines.index("late line from background") \
        < lines.index("airflow-skypilot: exit_code: 3"), log
    assert lines.count("run body done") == 1 and took >= 3, (took, log)


def test_setup_ends_when_its_background_writer_has_before_run_starts(tmp_path):
    fake, env, user_data = _boot(tmp_path, {
        "setup": LATE + 'echo "setup body done"', "run": 'echo "run started"'})
    proc = subprocess.run(["bash", str(user_data)], env=env, capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    log = (_rank0(fake) / "log").read_text()
    lines = _lines(log)
    assert (_rank0(fake) / "exit_code").read_text() == "0\n", log
    assert lines.index("setup body done") < lines.index("late line from background") \
        < lines.index("airflow-skypilot: run") < lines.index("run started"), log


def test_a_background_writers_secret_is_masked_in_the_log(tmp_path):
    """(Guard: node.sh's awk mask was a pipe already, so it waited before the fix too.)"""
    secret = "s3cr3t-value"
    fake, env, user_data = _boot(tmp_path, {
        "run": '(sleep 2; echo "late token=$TOKEN") &\necho "run body done"',
        "secrets": {"TOKEN": secret}})
    proc = subprocess.run(["bash", str(user_data)], env=env, capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    log = (_rank0(fake) / "log").read_text()
    assert "late token=***" in _lines(log) and secret not in log, log
    assert (_rank0(fake) / "exit_code").read_text() == "0\n", log


def test_a_term_ends_the_bootstrap_at_once_though_a_writer_ignoring_it_holds_the_output(
        tmp_path):
    """An OS shutdown (EC2 terminating the instance: a cancel) TERMs the bootstrap: it reports
    and powers off at once, not after the writer, which ignores TERM and holds the output."""
    fake, env, user_data = _boot(tmp_path, {
        "run": "(trap '' TERM HUP; sleep 60; echo \"late line from background\") &\n"
               'echo "run body done"'})
    proc = subprocess.Popen(["bash", str(user_data)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        _until_logged(tmp_path, proc, "run body done")
        time.sleep(1)
        assert proc.poll() is None, "the run ended while a writer held its output"
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
        assert time.monotonic() - start < 5
        out = _rank0(fake)
        assert not (out / "exit_code").exists()  # the run did not end: no exit code of its own
        assert (out / "bootstrap_error").exists() and (fake / "shutdown").exists()
        assert "late line from background" not in (out / "log").read_text()
    finally:
        # the writer left behind (on EC2 the power-off ends it)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_broken_log_pipe_is_the_nodes_failure_not_the_jobs(tmp_path):
    """The log's ``cat`` killed mid-run: the run dies of SIGPIPE (141) at its next line; that
    is a failure of the node (``bootstrap_error``), not an exit code of the user's script."""
    fake, env, user_data = _boot(tmp_path, {"run": 'echo "run started"; sleep 3; echo after'})
    proc = subprocess.Popen(["bash", str(user_data)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        _until_logged(tmp_path, proc, "run started")
        cats = subprocess.run(["pgrep", "-P", str(proc.pid), "-x", "cat"], capture_output=True,
                              text=True).stdout.split()
        assert cats, "no log pipe"
        for pid in cats:
            os.kill(int(pid), signal.SIGKILL)
        proc.wait(timeout=30)
        out = _rank0(fake)
        assert not (out / "exit_code").exists()
        assert "output could not be logged" in (out / "bootstrap_error").read_text()
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
