"""The Slurm backend when its cluster misbehaves: "could not ask" is never "gone".

A paused slurmctld, a hung login node, a lost job record, a worker in another time zone, an
upload that takes too long; and the job dirs the backend leaves behind (what cleanup keeps,
what the next submit removes). Every job that is meant to run counts its runs in a shared file:
it runs exactly once.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

import pytest

from airflow_skypilot.backends.base import JobState
from airflow_skypilot.backends.slurm import SlurmBackend
from airflow_skypilot.exceptions import BackendUnreachable, SubmissionError
from airflow_skypilot.spec import load_task
from tests.conftest import use_connections, wait_for_job, wait_until
from tests.e2e.conftest import shared_dir

pytestmark = pytest.mark.sandbox

CONN = "slurm_alpha"
CLUSTER = "alpha"


def _name(word: str) -> str:
    return f"sky-fault-{word}-{uuid.uuid4().hex[:8]}-c0-t1-a0"


def _quick(slurm, monkeypatch, **extra) -> None:
    """The alpha connection with short limits (and ``extra``)."""
    conn = slurm.connections()[CONN]
    conn["extra"] = {**conn["extra"], "slurm_timeout": 8, "command_timeout": 30, **extra}
    use_connections(monkeypatch, {CONN: conn})


def _submit(backend, run: str, name: str, offer=None, setup: str | None = None):
    task = load_task({"run": run, **({"setup": setup} if setup else {})})
    offer = offer or next(o for o in backend.probe(task) if o.fits)
    return backend.submit(task, offer, name, {"SKYPILOT_TASK_ID": name})


def _ended(backend, handle, timeout: float):
    """The job's status once it ended (or failed the test after ``timeout``), and its log."""
    status = wait_for_job(backend, handle, {JobState.INFRA_FAILED, JobState.FAILED,
                                            JobState.SUCCEEDED}, timeout)
    return status, backend.read_log(handle)[0]


def _ran(marks: Path, name: str) -> list[str]:
    path = marks / name
    return path.read_text().splitlines() if path.exists() else []


def test_a_paused_slurmctld_is_unknown_never_lost_and_the_job_completes_once(slurm, monkeypatch):
    _quick(slurm, monkeypatch)
    backend = SlurmBackend(CONN)
    marks = Path(shared_dir())
    handle = _submit(backend, f"sleep 12; echo ran >> {marks}/runs", _name("ctld"))
    wait_for_job(backend, handle, {JobState.RUNNING}, 60)
    seen = []
    slurm.pause_slurmctld(CLUSTER)
    try:
        deadline = time.monotonic() + 25  # longer than the job: it ends while nobody answers
        while time.monotonic() < deadline:
            start = time.monotonic()
            status = SlurmBackend(CONN).status([handle])[handle.job_id]
            assert time.monotonic() - start < 20
            seen.append(status.state)
            assert status.state in (JobState.UNKNOWN, JobState.RUNNING, JobState.SUCCEEDED), \
                status  # SUCCEEDED: its exit file, which the job wrote itself
        with pytest.raises(BackendUnreachable, match="could not ask"):
            backend.probe(load_task({"run": "true"}))  # not "an empty cluster"
        with pytest.raises(BackendUnreachable, match="squeue"):
            backend.find_all(handle.job_name[:-len("c0-t1-a0")])
        assert backend.find(handle.job_name).job_id == handle.job_id  # its job_id file says
    finally:
        slurm.resume_slurmctld(CLUSTER)
    assert JobState.UNKNOWN in seen and JobState.LOST not in seen
    done = wait_for_job(backend, handle, {s for s in JobState if s.terminal}, 90)
    assert done.state == JobState.SUCCEEDED, done
    assert _ran(marks, "runs") == ["ran"]


def test_a_job_whose_record_was_lost_is_never_submitted_twice(slurm, monkeypatch):
    """The job dir has no job_id (the session died between sbatch and writing it): only
    squeue can say whether the job exists, so while it cannot, submit and find raise."""
    _quick(slurm, monkeypatch)
    backend = SlurmBackend(CONN)
    marks = Path(shared_dir())
    name = _name("record")
    offer = next(o for o in backend.probe(load_task({"run": "true"})) if o.fits)
    first = _submit(backend, f"echo up >> {marks}/started; sleep 25; echo ran >> {marks}/runs",
                    name, offer)
    # paused only once the user code runs: a job step being created while slurmctld is
    # stopped fails ("Expired or invalid job"), which is not what this test is about
    deadline = time.monotonic() + 60
    while not (marks / "started").exists():
        assert time.monotonic() < deadline, "the job's user code never started"
        time.sleep(0.2)
    Path(first.extra["job_dir"], "job_id").unlink()
    slurm.pause_slurmctld(CLUSTER)
    try:
        with pytest.raises(BackendUnreachable, match="squeue"):
            SlurmBackend(CONN).find(name)
        with pytest.raises(BackendUnreachable, match="squeue"):
            _submit(SlurmBackend(CONN), f"echo twice >> {marks}/runs", name, offer)
    finally:
        slurm.resume_slurmctld(CLUSTER)
    adopted = _submit(SlurmBackend(CONN), f"echo twice >> {marks}/runs", name, offer)
    assert adopted.adopted and adopted.job_id == first.job_id
    assert adopted.submitted_at == first.submitted_at  # its handle file's
    names = slurm.run(CLUSTER, "squeue", "-h", "-t", "all", "-n", name, "-o", "%i").stdout
    assert names.split() == [first.job_id]
    assert wait_for_job(backend, first, {JobState.SUCCEEDED}, 60).state == JobState.SUCCEEDED
    assert _ran(marks, "runs") == ["ran"]


def test_a_hung_login_node_is_unreachable_in_bounded_time(slurm, monkeypatch):
    _quick(slurm, monkeypatch)
    backend = SlurmBackend(CONN)
    handle = _submit(backend, "sleep 300", _name("hung"))
    wait_for_job(backend, handle, {JobState.RUNNING}, 60)
    took = {}
    slurm.pause_sshd(CLUSTER)  # the listener and the open session: nothing answers
    try:
        for what, call in (("status on the open connection", lambda: backend.status([handle])),
                           ("cancel on a new connection",
                            lambda: SlurmBackend(CONN).cancel(handle))):
            start = time.monotonic()
            with pytest.raises(BackendUnreachable):
                call()
            took[what] = time.monotonic() - start
    finally:
        slurm.resume_sshd(CLUSTER)
    # a channel open (15 s), or the TCP connect, the banner and authentication (15 s each)
    assert all(seconds < 50 for seconds in took.values()), took
    assert wait_for_job(backend, handle, {JobState.RUNNING}, 30).state == JobState.RUNNING
    backend.cancel(handle)
    assert wait_for_job(backend, handle, {JobState.CANCELLED}, 60).state == JobState.CANCELLED


def test_times_do_not_shift_when_the_worker_is_in_another_time_zone(slurm, monkeypatch):
    backend = SlurmBackend(CONN)
    before = time.time()
    handle = _submit(backend, "sleep 2", _name("tz"))
    with monkeypatch.context() as zone:
        zone.setenv("TZ", "Pacific/Kiritimati")  # UTC+14; the cluster is at UTC
        time.tzset()
        try:
            done = wait_for_job(backend, handle, {JobState.SUCCEEDED}, 60)
        finally:
            zone.undo()
            time.tzset()
    assert before - 2 <= done.started_at <= done.ended_at <= time.time() + 2, (before, done)
    assert done.ended_at - done.started_at < 30


def test_an_upload_past_its_time_submits_nothing(slurm, monkeypatch, tmp_path):
    _quick(slurm, monkeypatch, upload_timeout=0.001)
    backend = SlurmBackend(CONN)
    name = _name("upload")
    (tmp_path / "data.bin").write_bytes(os.urandom(1 << 20))
    task = load_task({"run": "true", "workdir": str(tmp_path)})
    offer = next(o for o in backend.probe(task) if o.fits)
    with pytest.raises(SubmissionError, match="did not finish within"):
        backend.submit(task, offer, name, {})
    assert slurm.run(CLUSTER, "squeue", "-h", "-t", "all", "-n", name, "-o", "%i").stdout == ""


def _age(path: Path, days: float) -> None:
    when = time.time() - days * 86400
    os.utime(path, (when, when))


def test_cleanup_keeps_the_log_and_the_next_submit_removes_old_dirs(slurm, monkeypatch):
    _quick(slurm, monkeypatch, log_retention_days=7)
    backend = SlurmBackend(CONN)
    stem = f"sky-gc-{uuid.uuid4().hex[:8]}-"
    done = _submit(backend, "echo finished-log-line", stem + "c0-t1-a0")
    assert wait_for_job(backend, done, {JobState.SUCCEEDED}, 60).state == JobState.SUCCEEDED
    job_dir = Path(done.extra["job_dir"])
    assert (job_dir / "workdir").is_dir() and (job_dir / "run.sh").exists()
    for copy in ("workdir.0", "workdir.1", "workdir.1.part"):  # the ranks' own (2+ nodes)
        (job_dir / copy / "venv").mkdir(parents=True)
        for path in (job_dir / copy, job_dir / copy / "venv"):
            os.chown(path, job_dir.stat().st_uid, job_dir.stat().st_gid)
    backend.cleanup(done)
    left = sorted(p.name for p in job_dir.iterdir())
    assert left == ["exit_code", "handle", "job_id", "lock", "slurm.log"], left
    assert "finished-log-line" in backend.read_log(done)[0]
    found = backend.find_all(stem)
    assert [(h.job_id, h.submitted_at) for h in found] == [(done.job_id, done.submitted_at)]
    backend.cleanup(done)  # twice: nothing else goes

    live = _submit(backend, "sleep 120", stem + "c0-t2-a0")  # old, but still running
    wait_for_job(backend, live, {JobState.RUNNING}, 60)
    backend.cleanup(live)  # a running job keeps its files (it may still read them)
    assert (Path(live.extra["job_dir"]) / "run.sh").exists()
    aborted = job_dir.parent / (stem + "c0-t3-a0")  # a submission that never reached sbatch
    aborted.mkdir()
    owner = job_dir.stat()
    os.chown(aborted, owner.st_uid, owner.st_gid)
    recent = _submit(backend, "true", stem + "c0-t4-a0")
    beta = SlurmBackend("slurm_beta")  # the same home on another cluster
    theirs = _submit(beta, "true", stem + "c0-t5-a0")
    wait_for_job(beta, theirs, {JobState.SUCCEEDED}, 60)
    for old in (job_dir, Path(live.extra["job_dir"]), aborted, Path(theirs.extra["job_dir"])):
        for path in [*old.iterdir(), old]:
            _age(path, 8)
    _age(Path(recent.extra["job_dir"]), 3)

    conn = json.loads(os.environ[f"AIRFLOW_CONN_{CONN.upper()}"])
    conn["extra"]["log_retention_days"] = 0  # kept for ever
    use_connections(monkeypatch, {CONN: conn})
    _submit(SlurmBackend(CONN), "true", _name("keep"))
    assert job_dir.exists() and aborted.exists()

    _quick(slurm, monkeypatch, log_retention_days=7)
    _submit(SlurmBackend(CONN), "true", _name("next"))  # the clean-up rides on a submit
    assert not job_dir.exists() and not aborted.exists()
    assert Path(live.extra["job_dir"], "run.sh").exists(), "a running job's dir stays"
    assert Path(recent.extra["job_dir"]).exists(), "a dir within the retention stays"
    assert Path(theirs.extra["job_dir"]).exists(), "another cluster's job is its own to judge"
    listed = {h.job_name for h in backend.find_all(stem)}  # (squeue still shows the first)
    assert {live.job_name, recent.job_name} <= listed and aborted.name not in listed
    assert theirs.job_name not in listed  # each cluster lists its own jobs only
    assert [h.job_name for h in beta.find_all(stem)] == [theirs.job_name]
    assert SlurmBackend(CONN).find(theirs.job_name) is None
    backend.cancel(live)


def test_a_step_launched_while_slurmctld_is_paused_is_launched_again_and_runs_once(
        slurm, monkeypatch):
    # slurmctld stops answering (a restart, a failover) just as the job launches its run step:
    # srun gives up after MessageTimeout ("Unable to confirm allocation ... Socket timed out").
    # No node began the step, so the job launches it again once slurmctld answers: the job
    # succeeds and its run runs once (the CI failure of stop 17: a contract test's job died so).
    _quick(slurm, monkeypatch)
    backend = SlurmBackend(CONN)
    marks = Path(shared_dir())
    name = _name("relaunch")
    handle = _submit(backend, f"echo run >> {marks}/{name}", name,
                     setup=f"echo setup >> {marks}/{name}; sleep 3")
    wait_until(lambda: _ran(marks, name) == ["setup"], 60, what="the setup step began")
    slurm.pause_slurmctld(CLUSTER)
    try:
        time.sleep(15)  # setup ends, the run step's srun times out (MessageTimeout 5 s)
        assert _ran(marks, name) == ["setup"]
    finally:
        slurm.resume_slurmctld(CLUSTER)
    status, log = _ended(backend, handle, 120)
    assert status.state == JobState.SUCCEEDED, (status, log)
    assert "srun could not launch the run step (exit 1); launching it again in 5s" in log
    assert _ran(marks, name) == ["setup", "run"], "each step ran once"


def test_a_step_of_the_tasks_own_beside_ours_launches_and_ours_launches_beside_any(
        slurm, monkeypatch):
    # The task's run calls srun itself (Slurm users' scripts do): its step launches beside
    # ours, which overlaps every other step. The same keeps a step that slurmctld created
    # after srun had given up on it (a request answered late, after a pause: the CI failure of
    # stop 17's fix, "step creation still disabled (Requested nodes are busy)" until the time
    # limit) from holding the node against the next step.
    _quick(slurm, monkeypatch)
    backend = SlurmBackend(CONN)
    marks = Path(shared_dir())
    name = _name("overlap")
    handle = _submit(backend, f"srun -n1 -N1 bash -c 'echo run >> {marks}/{name}'", name,
                     setup=f"srun -n1 -N1 bash -c 'echo setup >> {marks}/{name}'")
    status, log = _ended(backend, handle, 60)
    assert status.state == JobState.SUCCEEDED, (status, log)
    assert _ran(marks, name) == ["setup", "run"], log


def test_a_step_srun_could_not_launch_is_an_infra_failure_and_its_code_never_ran(
        slurm, monkeypatch):
    # A real cluster limit: MaxStepCount=1 lets the job's setup step start and refuses its run
    # step ("Unable to create step ... Step limit reached"), again and again until the
    # connection's step_launch_retry runs out. The task's run never began, so the job is an
    # infrastructure failure (placed again elsewhere), not the user's code failing.
    _quick(slurm, monkeypatch, step_launch_retry=12)
    backend = SlurmBackend(CONN)
    marks = Path(shared_dir())
    name = _name("nostep")
    conf = slurm.slurm_conf(CLUSTER)
    original = conf.read_text()
    conf.write_text(original + "MaxStepCount=1\n")
    try:
        slurm.run(CLUSTER, "scontrol", "reconfigure", as_root=True)
        handle = _submit(backend, f"echo run >> {marks}/{name}", name,
                         setup=f"echo setup >> {marks}/{name}")
        status, log = _ended(backend, handle, 90)
    finally:
        conf.write_text(original)
        slurm.run(CLUSTER, "scontrol", "reconfigure", as_root=True)
    assert status.state == JobState.INFRA_FAILED, (status, log)
    assert "could not launch the job's run step" in status.reason
    assert status.state.infra_failure
    assert _ran(marks, name) == ["setup"], "setup ran once, the run step never began"
    assert log.count("launching it again") == 1, log  # after 5 s; then 10 more is over 12
    assert "srun could not launch the run step (exit 1)\n" in log


def test_a_failing_step_is_the_users_failure_not_a_launch_failure(slurm):
    # the counterpart: the step began and the task's own script failed (exit 3)
    backend = SlurmBackend(CONN)
    status, _ = _ended(backend, _submit(backend, "exit 3", _name("fail")), 90)
    assert (status.state, status.exit_code) == (JobState.FAILED, 3), status


def test_a_failed_multi_node_job_gives_every_failed_ranks_code_while_squeue_lists_it(slurm):
    """Rank 1 exits 3, srun kills rank 0 (its node up): the user's failure, read from what each
    rank wrote from the first poll that sees it ended, while squeue still lists it (MinJobAge),
    not only once Slurm forgot it (recover_on_exit_codes sees every rank's code)."""
    backend = SlurmBackend(CONN)
    task = load_task({"num_nodes": 2, "resources": {"accelerators": "A100:1"}, "run": (
        'if [ "$SKYPILOT_NODE_RANK" = 1 ]; then sleep 2; exit 3; fi; sleep 120')})
    name = _name("ranks")
    offer = next(o for o in backend.probe(task) if o.fits)
    handle = backend.submit(task, offer, name, {"SKYPILOT_TASK_ID": name})
    status, log = _ended(backend, handle, 90)
    listed = slurm.run(CLUSTER, "squeue", "-h", "-t", "all", "-j", handle.job_id, "-o", "%T")
    assert listed.stdout.strip() in ("FAILED", "COMPLETING"), listed.stdout
    assert status.raw_state == "FAILED", (status, log)  # squeue's answer, not the exit file's
    assert (status.state, status.exit_code, status.exit_codes) == (JobState.FAILED, 3, [3]), \
        (status, log)
    assert status.reason == "exit code 3 on rank 1"


def _ranks(marks: Path, run: str) -> str:
    """A 2-node run: each rank notes in ``marks`` that it ran, waits until both did (a rank
    failing at once would have srun kill the other before that), then runs ``run``."""
    return (f"echo ran >> {marks}/ran.$SKYPILOT_NODE_RANK; until [ -e {marks}/ran.0 ] && "
            f"[ -e {marks}/ran.1 ]; do sleep 0.2; done; {run}")


def test_a_failing_ranks_last_lines_all_reach_the_log(slurm):
    """Rank 1 prints to stdout and stderr and exits 1 at once, rank 0 sleeping: srun's
    --kill-on-bad-exit ended the step before srun forwarded all of it (a line lost in 4 runs
    of 6, twice the stderr one, where a traceback goes)."""
    backend = SlurmBackend(CONN)
    marks = Path(shared_dir())
    task = load_task({"num_nodes": 2, "resources": {"accelerators": "A100:1"}, "run": _ranks(
        marks, 'if [ "$SKYPILOT_NODE_RANK" = 1 ]; then echo "out one"; echo "out two"; '
               'echo "Traceback: boom" >&2; exit 1; fi; sleep 120')})
    name = _name("lastlines")
    offer = next(o for o in backend.probe(task) if o.fits)
    status, log = _ended(backend, backend.submit(task, offer, name, {"SKYPILOT_TASK_ID": name}),
                         90)
    assert (status.state, status.exit_codes) == (JobState.FAILED, [1]), (status, log)
    assert "1: out one\n1: out two\n1: Traceback: boom\n" in log, log
    assert (_ran(marks, "ran.0"), _ran(marks, "ran.1")) == (["ran"], ["ran"])


def _forgotten(handle):
    """``handle`` as a later poll sees it once Slurm forgot the job (after MinJobAge, without
    accounting): the same job dir, an id squeue and sacct no longer know."""
    from dataclasses import replace

    return replace(handle, job_id="99999999")


def test_a_job_stopped_at_its_time_limit_is_the_users_failure_even_once_slurm_forgets_it(
        slurm):
    """slurmstepd SIGTERMs the batch script at the time limit: its trap notes when, against
    the job's end time, so a job Slurm no longer lists reads as the user's failure (it read
    lost, and was placed again to hit its limit again)."""
    backend = SlurmBackend(CONN)
    marks = Path(shared_dir())
    name = _name("timelimit")
    task = load_task({"run": f"echo started >> {marks}/runs; sleep 600; echo ran >> {marks}/runs",
                      "config": {"slurm": {"sbatch_options": {"time": "1"}}}})
    offer = next(o for o in backend.probe(task) if o.fits)
    handle = backend.submit(task, offer, name, {"SKYPILOT_TASK_ID": name})
    status, log = _ended(backend, handle, 150)
    assert status.state == JobState.FAILED and status.raw_state == "TIMEOUT", (status, log)
    # slurmctld says TIMEOUT as it sends the signal: the trap's note follows, moments later
    # on a quiet machine (a CI run with the e2e shard beside it waited more than 30 s)
    note = Path(handle.extra["job_dir"], "killed")
    wait_until(note.exists, 120, what="the batch script's note")
    killed = note.read_text().split()
    assert killed[0] == "killed" and int(killed[1]) >= int(killed[2]), killed
    gone = backend.status([_forgotten(handle)])["99999999"]
    assert gone.state == JobState.FAILED and not gone.state.infra_failure, gone
    assert "time limit" in gone.reason
    assert _ran(marks, "runs") == ["started"]


def test_a_job_cancelled_by_someone_else_reads_lost_once_slurm_forgets_it(slurm):
    """A scancel (or a preemption) before the time limit: Slurm says CANCELLED while it lists
    the job; once it forgot it, the note says 'stopped before its time limit': lost, placed
    again (a preempted job must be; Slurm no longer tells the two apart)."""
    backend = SlurmBackend(CONN)
    marks = Path(shared_dir())
    name = _name("scancel")
    handle = _submit(backend, f"echo started >> {marks}/runs; sleep 600", name)
    wait_until(lambda: _ran(marks, "runs"), 60, what="the user code running")
    slurm.run(CLUSTER, "scancel", handle.job_id, as_root=True)
    wait_until(lambda: Path(handle.extra["job_dir"], "killed").exists(), 30,
               what="the batch script's note")
    gone = backend.status([_forgotten(handle)])["99999999"]
    assert gone.state == JobState.LOST and "before its time limit" in gone.reason, gone
    assert _ran(marks, "runs") == ["started"]


def test_a_job_id_slurm_gave_again_is_not_ours_to_watch_or_cancel(slurm):
    """Slurm gives an id again (a controller that lost its state; the docker/ deployment wipes
    it on every start, the job dirs stay): our old job's handle then names another task's
    running job. Its state was read as ours (our task ended with the other's result, or a
    clear's reconcile stopped it as an old copy) and its cancel killed it. Now a row counts
    only under our job's name, or, by another name, submitted when ours was: ours reads lost
    (no exit code of its own), the cancel leaves the other job alone, and that job's user
    code runs once to its end."""
    from dataclasses import replace

    backend = SlurmBackend(CONN)
    marks = Path(shared_dir())
    theirs = _submit(backend, f"echo started >> {marks}/runs; sleep 8; echo ran >> {marks}/runs",
                     _name("theirs"))
    wait_until(lambda: _ran(marks, "runs"), 60, what="their user code running")
    old_dir = Path(shared_dir())  # our old job's dir: no exit code, its job ended with the state
    ours = replace(theirs, job_name=_name("ours"), submitted_at=theirs.submitted_at - 3600,
                   extra={**theirs.extra, "job_dir": str(old_dir)})
    got = backend.status([ours])[ours.job_id]
    assert got.state == JobState.LOST, got  # not their RUNNING
    backend.cancel(ours)
    assert wait_for_job(backend, theirs, {JobState.SUCCEEDED}, 60).state == JobState.SUCCEEDED
    assert _ran(marks, "runs") == ["started", "ran"]
    got = backend.status([ours])[ours.job_id]  # accounting's row of their ended job: not ours
    assert got.state == JobState.LOST and got.exit_code is None, got


def test_a_job_the_site_renamed_is_still_ours_to_watch_and_cancel(slurm):
    """A site's job_submit plugin or an admin's `scontrol update JobName=` renames our job:
    it is still ours (submitted when we submitted it), read RUNNING, not lost and placed
    again beside itself, and our cancel stops it; its user code ran once."""
    backend = SlurmBackend(CONN)
    marks = Path(shared_dir())
    handle = _submit(backend, f"echo started >> {marks}/runs; sleep 600", _name("renamed"))
    wait_until(lambda: _ran(marks, "runs"), 60, what="the user code running")
    slurm.run(CLUSTER, "scontrol", "update", f"JobId={handle.job_id}", "JobName=site-renamed",
              as_root=True)
    listed = slurm.run(CLUSTER, "squeue", "-h", "-j", handle.job_id, "-o", "%j").stdout
    assert listed.strip() == "site-renamed"
    assert backend.status([handle])[handle.job_id].state == JobState.RUNNING
    backend.cancel(handle)
    status = wait_for_job(backend, handle, {JobState.CANCELLED}, 60)
    assert status.state == JobState.CANCELLED, status
    assert _ran(marks, "runs") == ["started"]


def test_secrets_are_removed_when_sbatch_refuses_the_job(slurm):
    backend = SlurmBackend(CONN)
    name = _name("refused")
    # the probe (sbatch --test-only) would refuse it too: probed without the bad option
    offer = next(o for o in backend.probe(load_task({"run": "true"})) if o.fits)
    task = load_task({"run": "true", "secrets": {"TOKEN": "s3cret"},
                      "config": {"slurm": {"sbatch_options": {"licenses": "nosuchlicense:1"}}}})
    with pytest.raises(SubmissionError):
        backend.submit(task, offer, name, {"SKYPILOT_TASK_ID": name})
    home = Path(os.path.expanduser("~skyuser"))
    job_dir = home / backend.settings.remote_work_dir.removeprefix("~/") / "jobs" / name
    assert job_dir.is_dir() and not (job_dir / "secrets.sh").exists(), \
        sorted(p.name for p in job_dir.iterdir())
