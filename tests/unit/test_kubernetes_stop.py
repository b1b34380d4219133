"""A pod told to stop (its container's first process TERMed, as the kubelet does): the pod's
scripts, run with a real bash as the container's first process, pass the TERM on to the
task's programs, keep what they write as they stop, wait for them, and end with their own
code (``entry.STOPPED_EXIT``) and a termination message that the status reads as the
cluster's stop (see ``airflow_skypilot.backends.kubernetes.entry``).

Two ways the first process runs: as a process group's leader (a pod sharing its process
namespace; the test kubelet) and as a PID namespace's init (a pod's own namespace, made here
with ``unshare``), where a TERM the script does not catch is never delivered.
"""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from airflow_skypilot.backends.base import JobState
from airflow_skypilot.backends.kubernetes import entry
from airflow_skypilot.backends.kubernetes import manifests as m
from airflow_skypilot.spec import load_task
from tests.unit.test_kubernetes_manifests import (
    _backend,
    _job,
    _jpod,
    _objects,
    _offer,
    _status,
    _term,
)

SECRET = "s3cr3t-value-42"

#: the task's program: counts its start, says it started, and on TERM says so (with the
#: secret, to be masked), takes its time, saves a checkpoint and exits 0, as a trainer would
TRAINER = """\
import os, signal, sys, time
out = os.environ["OUT"]
with open(os.path.join(out, "runs"), "a") as f:
    f.write("run\\n")
def stop(*_):
    print("saving checkpoint, token", os.environ["TOKEN"], flush=True)
    time.sleep(0.8)
    open(os.path.join(out, "checkpoint"), "w").write("step 7")
    print("saved", flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
open(os.path.join(out, "started"), "w").close()
while True:
    time.sleep(0.1)
"""


def _materialise(tmp_path: Path, spec: dict, name: str = "sky-stop-1") -> tuple[list, dict, Path]:
    """The pod's files where its container sees them, its env, and its command."""
    task = load_task(spec)
    job, deps = _objects(_backend(), task, _offer(task), name=name)
    root = tmp_path / "root"
    files = root / m.FILES_MOUNT.lstrip("/")
    files.mkdir(parents=True)
    for key, value in deps["ConfigMap"]["data"].items():
        (files / key).write_text(value)
    (root / "dev" / "shm").mkdir(parents=True)  # the pod's memory emptyDir
    (root / "dev" / "termination-log").write_text("")
    (root / "home").mkdir()
    out = tmp_path / "out"
    out.mkdir()
    (out / "trainer.py").write_text(TRAINER)
    env = {"PATH": os.environ["PATH"], "HOME": str(root / "home"),
           "SANDBOX_MOUNT_ROOT": str(root), "HOSTNAME": f"{name}-0", "OUT": str(out)}
    if "Secret" in deps:
        env.update({k: base64.b64decode(v).decode() for k, v in deps["Secret"]["data"].items()})
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    return command, env, root


def _wait_file(path: Path, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def _children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(p) for p in text.split()]


def _run_and_stop(command, env, root, *, as_init: bool, wait_for: Path, times: int = 1):
    """Start the container's command, TERM its first process (``times`` times, at once) once
    ``wait_for`` exists, and return (exit code, stdout, stderr)."""
    argv = (["unshare", "--pid", "--fork", "--mount-proc", *command] if as_init else command)
    proc = subprocess.Popen(argv, env=env, cwd=root, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _wait_file(wait_for)
        first = proc.pid
        if as_init:  # unshare's child is the namespace's init: the container's first process
            [first] = _children(proc.pid)
        for _ in range(times):
            os.kill(first, signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, out, err


@pytest.mark.parametrize("as_init", [False, True], ids=["group-leader", "pid-namespace-init"])
def test_a_stopped_container_passes_the_term_on_and_keeps_the_checkpoint(tmp_path, as_init):
    """The program gets its TERM, its last words are in the log (masked), its checkpoint is
    saved, it ran once; the container ends with ``STOPPED_EXIT`` (not the program's 0: a
    preemption is not a success) and says why in its termination message."""
    command, env, root = _materialise(tmp_path, {
        "run": 'python3 "$OUT/trainer.py"', "secrets": {"TOKEN": SECRET}})
    out_dir = Path(env["OUT"])
    code, out, err = _run_and_stop(command, env, root, as_init=as_init,
                                   wait_for=out_dir / "started")
    assert code == entry.STOPPED_EXIT, (out, err)
    assert (out_dir / "checkpoint").read_text() == "step 7"
    assert (out_dir / "runs").read_text() == "run\n"
    assert "saving checkpoint, token" in out and "saved" in out, (out, err)
    assert SECRET not in out and SECRET not in err
    note = (root / "dev" / "termination-log").read_text()
    # (the run's shell, TERMed too, ends with 143 once the program has: its prologue's trap)
    assert note.startswith(entry.STOPPED_NOTE) and "exit code: 143" in note


def test_as_init_it_waits_for_a_program_still_saving_after_the_run_ended(tmp_path):
    """A background program that takes longer to stop than the run's own shell: init's end
    would KILL it mid-write, so main.sh waits for every other process first."""
    command, env, root = _materialise(tmp_path, {"run": (
        '( trap \'sleep 1.5; echo late > "$OUT/late"; exit 0\' TERM; '
        'while :; do sleep 0.1; done ) &\n'
        'touch "$OUT/started"; wait')})
    out_dir = Path(env["OUT"])
    code, out, err = _run_and_stop(command, env, root, as_init=True,
                                   wait_for=out_dir / "started")
    assert code == entry.STOPPED_EXIT, (out, err)
    assert (out_dir / "late").read_text() == "late\n"


def test_a_program_killed_at_the_grace_end_leaves_the_note(tmp_path):
    """A program that ignores TERM outlives the grace period and is KILLed with main.sh: the
    note, written when the TERM came, is the termination message still."""
    command, env, root = _materialise(tmp_path, {"run": (
        "trap '' TERM; touch \"$OUT/started\"; while :; do sleep 0.1; done")})
    out_dir = Path(env["OUT"])
    proc = subprocess.Popen(command, env=env, cwd=root, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        _wait_file(out_dir / "started")
        os.kill(proc.pid, signal.SIGTERM)
        time.sleep(1)
        assert proc.poll() is None  # waiting for the program, which goes on
        os.killpg(proc.pid, signal.SIGKILL)  # the grace period's end
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert (root / "dev" / "termination-log").read_text().startswith(entry.STOPPED_NOTE)


def test_a_stop_during_setup_never_starts_the_run(tmp_path):
    command, env, root = _materialise(tmp_path, {
        "setup": 'touch "$OUT/started"; while :; do sleep 0.1; done',
        "run": 'touch "$OUT/ran"'})
    out_dir = Path(env["OUT"])
    code, out, err = _run_and_stop(command, env, root, as_init=False,
                                   wait_for=out_dir / "started")
    assert code == entry.STOPPED_EXIT, (out, err)
    assert not (out_dir / "ran").exists()
    assert "setup failed" not in err
    assert "exit code: 143" in (root / "dev" / "termination-log").read_text()


def test_a_run_that_ends_on_its_own_keeps_its_status_and_leaves_no_note(tmp_path):
    command, env, root = _materialise(tmp_path, {"run": "exit 3"})
    proc = subprocess.run(command, env=env, cwd=root, capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 3, proc.stderr
    assert (root / "dev" / "termination-log").read_text() == ""


def test_a_term_after_the_run_ended_is_no_stop(tmp_path):
    """The run ended (exit 0, its status written by its wrapper) and the TERM comes before
    main.sh has exited (a cancel as the job ends): the run's own result stands, no note
    (before, the success read as the cluster's stop and the job was placed again)."""
    for i in range(15):
        command, env, root = _materialise(tmp_path / str(i), {
            "run": 'echo run >> "$OUT/runs"; exit 0'})
        ended = root / "dev" / "shm" / f"airflow-skypilot-stopping-{env['HOSTNAME']}.run"
        proc = subprocess.Popen(command, env=env, cwd=root, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            deadline = time.monotonic() + 20
            while not ended.exists() and proc.poll() is None:
                assert time.monotonic() < deadline, "the run's status was never written"
            try:
                os.kill(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass  # main.sh had ended already
            out, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        assert ended.read_text() == "0\n"
        assert proc.returncode == 0, (i, out, err)
        assert (Path(env["OUT"]) / "runs").read_text() == "run\n"  # the user code ran once
        assert (root / "dev" / "termination-log").read_text() == ""


@pytest.mark.parametrize("as_init", [False, True], ids=["group-leader", "pid-namespace-init"])
def test_a_second_term_as_the_first_is_passed_on_is_ignored(tmp_path, as_init):
    """Two TERMs microseconds apart (a kubelet and a kill by hand): the stop runs once, the
    program's handler once (a second TERM re-entered it mid-save)."""
    command, env, root = _materialise(tmp_path, {
        "run": 'python3 "$OUT/trainer.py"', "secrets": {"TOKEN": SECRET}})
    out_dir = Path(env["OUT"])
    code, out, err = _run_and_stop(command, env, root, as_init=as_init,
                                   wait_for=out_dir / "started", times=2)
    assert code == entry.STOPPED_EXIT, (out, err)
    assert err.count("passed on to the task") == 1, err
    assert out.count("saving checkpoint") == 1 and (out_dir / "checkpoint").exists(), out
    assert (out_dir / "runs").read_text() == "run\n"  # the user code ran once


def test_a_run_whose_shell_missed_the_term_ends_at_its_prologue(tmp_path):
    """The run's interactive bash ignores TERM until its prologue's trap: a TERM that came
    before is read from the mark main.sh's trap made, and no user code runs."""
    command, env, root = _materialise(tmp_path, {"run": 'touch "$OUT/ran"'})
    mark = tmp_path / "mark"
    mark.write_text("")
    run_sh = root / m.FILES_MOUNT.lstrip("/") / "run.sh"
    proc = subprocess.run(["bash", "--norc", "-i", str(run_sh)], capture_output=True,
                          text=True, timeout=30, stdin=subprocess.DEVNULL,
                          env={**env, "AIRFLOW_SKYPILOT_TERM_MARK": str(mark)})
    assert proc.returncode == 143
    assert not (Path(env["OUT"]) / "ran").exists()
    mark.unlink()
    proc = subprocess.run(["bash", "--norc", "-i", str(run_sh)], capture_output=True,
                          text=True, timeout=30, stdin=subprocess.DEVNULL,
                          env={**env, "AIRFLOW_SKYPILOT_TERM_MARK": str(mark)})
    assert proc.returncode == 0 and (Path(env["OUT"]) / "ran").exists()


# --- how the status reads a stopped container ------------------------------------------------


def _stopped(code=entry.STOPPED_EXIT, message=None):
    state = _term(code)
    state["terminated"]["message"] = message if message is not None else (
        entry.STOPPED_NOTE + "; the step's exit code: 143\n")
    return state


def _failed_by(code, pod="j-0-x"):
    return {"type": "Failed", "reason": "PodFailurePolicy",
            "message": f"Container main for pod ns/{pod} failed with exit code {code} matching "
                       f"FailJob rule at index 1"}


def test_a_pod_deleted_by_hand_is_the_clusters_stop_not_the_programs_failure():
    """``kubectl delete pod``: no DisruptionTarget; main.sh passed the TERM on and ended with
    its own code and note. The note decides while the pod is listed (being deleted or not);
    once it is gone, note and all, the Job's verdict carries main.sh's code."""
    job = _job([_failed_by(entry.STOPPED_EXIT)])
    for pod in (_jpod(phase="Failed", state=_stopped(), deleting=True),
                _jpod(phase="Failed", state=_stopped())):
        st = _status(job, [pod])
        assert st.state == JobState.INFRA_FAILED, st
        assert "was stopped while the job ran" in st.reason
        assert _status(job, [pod], spot=True).state == JobState.PREEMPTED
    st = _status(job, [])  # the pod is gone: deleted
    assert st.state == JobState.INFRA_FAILED and "deleted" in st.reason, st


@pytest.mark.parametrize("code", [143, 137, 3])
def test_a_programs_own_term_or_kill_stays_its_failure_once_its_pod_is_gone(code):
    """A program that dies of its own TERM (143) or is OOM-killed (137), its pod then
    removed (a janitor, the pod GC) before a poll saw it: the Job's verdict is the program's
    failure, not a stop (placing it again would run the code a second time)."""
    st = _status(_job([_failed_by(code)]), [])
    assert (st.state, st.exit_code) == (JobState.FAILED, code), st


def test_a_failed_rank_gone_since_wins_over_the_ranks_the_controller_stopped():
    """Rank 1 failed (exit 3) and its pod is gone; rank 0, which the Job controller then
    deleted, is listed with main.sh's note: the verdict names rank 1, the program failed."""
    pods = [_jpod(0, phase="Failed", state=_stopped(), deleting=True)]
    st = _status(_job([_failed_by(3, pod="j-1-x")]), pods, num_nodes=2)
    assert (st.state, st.exit_code) == (JobState.FAILED, 3), st
    # the verdict names the stopped rank itself: the cluster's stop
    st = _status(_job([_failed_by(entry.STOPPED_EXIT, pod="j-0-x")]), pods, num_nodes=2)
    assert st.state == JobState.INFRA_FAILED, st


def test_a_programs_own_143_stays_its_failure():
    """No note: the program (or its shell) exited 143 by itself, its pod still there."""
    pod = _jpod(phase="Failed", state=_term(143))
    st = _status(_job([_failed_by(143)]), [pod])
    assert (st.state, st.exit_code) == (JobState.FAILED, 143)
    # a note that is not ours, and a pod gone whose code was not a TERM's
    st = _status(_job([_failed_by(143)]), [_jpod(phase="Failed", state=_stopped(
        message="stopped by the cluster, says the program"))])
    assert st.state == JobState.FAILED
    st = _status(_job([_failed_by(3)]), [])
    assert (st.state, st.exit_code) == (JobState.FAILED, 3)
    # the verdict names another pod than the one listed: not gone
    st = _status(_job([_failed_by(143, pod="j-0-x")]), [_jpod(phase="Failed", state=_term(143))])
    assert st.state == JobState.FAILED


def test_a_ranks_failure_wins_over_the_ranks_the_controller_stopped():
    """Rank 1 failed; the Job controller deleted rank 0, which main.sh ended with its note."""
    pods = [_jpod(0, phase="Failed", state=_stopped(), deleting=True),
            _jpod(1, phase="Failed", state=_term(3))]
    st = _status(_job([_failed_by(3, pod="j-1-x")]), pods, num_nodes=2)
    assert (st.state, st.exit_code, st.exit_codes) == (JobState.FAILED, 3, [3])


def test_a_pod_stopped_at_its_own_deadline_is_the_tasks_time_limit():
    """A pod_config's activeDeadlineSeconds is the task's own limit: not placed again."""
    pod = _jpod(phase="Failed", state=_stopped(), reason="DeadlineExceeded")
    st = _status(_job([_failed_by(143)]), [pod])
    assert st.state == JobState.FAILED and "activeDeadlineSeconds" in st.reason, st
    # a Job past its deadline: its pods stopped by the Job controller, the Job's verdict rules
    st = _status(_job([{"type": "Failed", "reason": "DeadlineExceeded"}]),
                 [_jpod(phase="Failed", state=_stopped(), deleting=True)])
    assert st.state == JobState.FAILED and "time limit" in st.reason, st
