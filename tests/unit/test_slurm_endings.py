"""How Slurm jobs end when nobody watched the end: a job Slurm holds or can never start, a job
a signal stopped (time limit, scancel) after Slurm forgot it, and a submission sbatch refused
(its secrets must not stay). The generated scripts run in bash with stand-in Slurm commands."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from airflow_skypilot.backends.base import JobHandle, JobState
from airflow_skypilot.backends.slurm import submit
from airflow_skypilot.backends.slurm.status import parse_status, status_script
from airflow_skypilot.spec import load_task
from tests.unit.test_slurm_package import SETTINGS, _offers


def _handle(job_dir: str = "/d") -> JobHandle:
    return JobHandle(backend="slurm", connection="c", job_id="7", job_name="n",
                     location="batch", infra="slurm/c/batch", extra={"job_dir": job_dir})


def _pending(reason: str):
    out = (f"@@squeue\n7|n|PENDING|{reason}|(null)|N/A|N/A\n@@squeue_rc\n0\n"
           "@@sacct\n@@sacct_rc\n1\n@@exits\n")
    return parse_status(out, [_handle()])["7"]


@pytest.mark.parametrize("reason", [
    "launch failed requeued held",  # a node's Prolog failed: drained, job requeued and held
    "JobHeldAdmin", "JobHoldMaxRequeue", "BadConstraints", "PartitionTimeLimit",
    "InvalidAccount", "QOSNotAllowed", "ReservationDeleted", "QOSMaxWallDurationPerJobLimit",
    "AssocMaxGRESPerJob", "QOSMinGRES",
])
def test_a_job_slurm_will_never_start_by_itself_is_a_failure_of_its_place(reason):
    status = _pending(reason)
    assert status.state == JobState.INFRA_FAILED and status.state.infra_failure
    assert reason in status.reason
    assert status.still_up  # still queued: it is cancelled before the job is placed again


@pytest.mark.parametrize("reason", [
    "Resources", "Priority", "Dependency", "BeginTime", "Licenses", "NodeDown",
    "ReqNodeNotAvail, UnavailableNodes:a1", "PartitionDown", "PartitionNodeLimit",
    "QOSMaxJobsPerUserLimit", "AssocGrpGRES", "QOSMaxSubmitJobPerUserLimit",
    "JobHeldUser", "job requeued in held state",  # the user's own hold: theirs to release
])
def test_a_job_that_waits_for_what_clears_by_itself_stays_pending(reason):
    status = _pending(reason)
    assert (status.state, status.reason, status.still_up) == (JobState.PENDING, reason, False)


def _stubs(tmp_path, squeue_says: str) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    stubs = {
        # a step that runs until it is signalled, after noting that it started
        "srun": f"#!/bin/sh\ntouch {tmp_path}/srun.started\nexec sleep 30\n",
        "scontrol": "#!/bin/sh\necho n1\n",
        # the job's own end time at its start; later (Slurm forgot the job) nothing
        "squeue": f"#!/bin/sh\ncase \"$*\" in *'-j'*) echo {squeue_says} ;; esac\n",
        "sacct": "#!/bin/sh\nexit 1\n",
    }
    for name, text in stubs.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return {**env, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "n1",
            "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_ID": "7"}


def _stopped_by_sigterm(tmp_path, end_time: int):
    """Run the job script until its step started, SIGTERM it as slurmstepd does at a time
    limit or scancel, then read it with the real status script once Slurm forgot the job."""
    _, got = _offers({"accelerators": "A100:2"})
    task = load_task({"run": "x", "resources": {"accelerators": "A100:2"},
                      "secrets": {"TOKEN": "s3cret"}})
    files = submit.render(task, got["batch"], SETTINGS, "sky-x", {}, str(tmp_path))
    for name, (text, mode) in files.items():
        (tmp_path / name).write_text(text)
        (tmp_path / name).chmod(mode)
    assert "secrets.sh" in files
    env = _stubs(tmp_path, str(end_time))
    job = subprocess.Popen(["bash", str(tmp_path / "job.sbatch")], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while not (tmp_path / "srun.started").exists():
            assert time.monotonic() < deadline and job.poll() is None, job.communicate()
            time.sleep(0.05)
        job.send_signal(signal.SIGTERM)
        job.communicate(timeout=10)  # the trap runs at once, not when the step ends
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 143
    assert not (tmp_path / "exit_code").exists()
    assert not (tmp_path / "secrets.sh").exists()  # the EXIT trap still ran
    return _read_once_forgotten(tmp_path, env)


def _read_once_forgotten(tmp_path, env):
    """The real status script's answer for the job of ``tmp_path`` (id 7, which the stand-in
    squeue and sacct no longer know)."""
    handle = _handle(str(tmp_path))
    done = subprocess.run(["bash", "-s"], input=status_script([handle]), env=env,
                          capture_output=True, text=True, timeout=30)
    return parse_status(done.stdout, [handle])["7"]


def test_a_job_stopped_at_its_time_limit_is_the_users_failure_after_slurm_forgets_it(
        tmp_path):
    status = _stopped_by_sigterm(tmp_path, end_time=int(time.time()) - 1)
    assert status.state == JobState.FAILED and not status.state.infra_failure
    assert "time limit" in status.reason


def test_a_job_stopped_before_its_time_limit_is_still_placed_again(tmp_path):
    """A signal before the time limit: a preemption, its node shut down, or a scancel, which
    Slurm no longer tells apart once it forgot the job: lost (placed again), as before."""
    status = _stopped_by_sigterm(tmp_path, end_time=int(time.time()) + 3600)
    assert status.state == JobState.LOST and status.state.infra_failure
    assert "before its time limit" in status.reason and status.ended_at is not None
    # without its end time (squeue did not tell it) the same
    (tmp_path / "killed").write_text(f"killed {int(time.time())} \n")
    out = ("@@squeue\n@@squeue_rc\n0\n@@sacct\n@@sacct_rc\n1\n@@exits\n"
           f"7|{(tmp_path / 'killed').read_text().strip()}\n")
    assert parse_status(out, [_handle()])["7"].state == JobState.LOST


@pytest.mark.parametrize(("sbatch", "secrets_stay"), [
    ("echo 'sbatch: error: Batch job submission failed: Requested node configuration is not "
     "available' >&2; exit 1", False),  # a refusal: no job will ever read them
    ("echo 'sbatch: error: Batch job submission failed: Socket timed out on send/recv "
     "operation' >&2; exit 1", True),  # no answer: the job may exist all the same
    ("sleep 60", True),  # cut short by the script's own timeout: the same
    ("echo 4242", True),  # submitted
])
def test_secrets_go_when_sbatch_refuses_and_stay_where_the_job_may_exist(
        tmp_path, sbatch, secrets_stay):
    bin_dir, job_dir = tmp_path / "bin", tmp_path / "job"
    bin_dir.mkdir()
    job_dir.mkdir()
    (bin_dir / "sbatch").write_text(f"#!/bin/bash\n{sbatch}\n")
    (bin_dir / "sbatch").chmod(0o755)
    (job_dir / "secrets.sh").write_text("export TOKEN=s3cret\n")
    quick = SETTINGS.__class__.from_extra("c", {"cluster": "alpha", "slurm_timeout": 2})
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(tmp_path)}
    done = subprocess.run(["bash", "-s"], input=submit.submit_script(str(job_dir), "n", quick),
                          capture_output=True, text=True, env=env, timeout=30)
    assert (job_dir / "secrets.sh").exists() == secrets_stay, done
    assert "sbatch" in done.stderr or done.returncode == 0 or "@@sbatch_rc\n124" in done.stdout


def test_a_tasks_export_none_still_lets_the_steps_see_what_the_job_script_exports(tmp_path):
    """sbatch --export=NONE sets SLURM_EXPORT_ENV=NONE in the job, and srun reads it: its
    steps get none of the script's exports (sbatch(1)). The stand-in srun does the same."""
    task, got = _offers({"accelerators": "A100:2", "cpus": 3})
    (tmp_path / "job.sbatch").write_text(
        submit.render(task, got["batch"], SETTINGS, "sky-x", {}, str(tmp_path))["job.sbatch"][0])
    env = _stubs(tmp_path, "")
    seen = 'echo "${SKYPILOT_NODE_IPS:-unset} ${SRUN_CPUS_PER_TASK:-unset}"'
    (tmp_path / "bin" / "srun").write_text(
        '#!/bin/sh\nif [ "${SLURM_EXPORT_ENV:-ALL}" = NONE ]; then '
        f"env -i sh -c '{seen}'; else sh -c '{seen}'; fi >> {tmp_path}/seen\n")
    (tmp_path / "bin" / "scontrol").write_text("#!/bin/sh\necho NodeAddr=10.0.0.1\n")
    env.update(SLURM_EXPORT_ENV="NONE", SLURM_CPUS_PER_TASK="3")
    done = subprocess.run(["bash", str(tmp_path / "job.sbatch")], env=env,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "seen").read_text().split("\n")[:2] == ["10.0.0.1 3", "10.0.0.1 3"]


#: a stand-in srun for two nodes: runs the step's command once per rank (its own process
#: group, SLURM_NODEID set); in the run step, ``$LOSE``'s whole process group is SIGKILLed a
#: second in (its node lost, or srun's --kill-on-bad-exit: no chance to write anything), and
#: a second later the step ends, as Slurm ends it (a node failure ends the job; a bad exit the
#: step): the other rank, if it still waits for its peer's exit code, goes too. A rank that
#: exits with a failure of its own ends the other (``--kill-on-bad-exit``), as srun does.
_SRUN_2 = """#!/bin/bash
while [ "$1" != bash ]; do shift; done
for r in 0 1; do SLURM_NODEID=$r setsid "$@" & p[$r]=$!; done
if [ -n "$LOSE" ] && [ "${@: -1}" = run ]; then
  sleep 1; kill -9 -- -${p[$LOSE]}; sleep 1; kill -9 -- -${p[0]} -${p[1]} 2>/dev/null
fi
rc=0
for _ in 0 1; do
  wait -n && continue
  rc=1; kill -9 -- -${p[0]} -${p[1]} 2>/dev/null
done
exit $rc
"""


def _two_nodes(tmp_path, down: str = "", before: str = "", fails: bool = True,
               **env_vars: str):
    """Run the real job script of a 2-node job with :data:`_SRUN_2` (its run: ``before``,
    then as the variables say), then the real status script once Slurm forgot the job
    (squeue and sacct answer nothing about it). Each rank notes that it ran in ``ran.<rank>``."""
    _, got = _offers({"accelerators": "A100:2"})
    task = load_task({"num_nodes": 2, "resources": {"accelerators": "A100:2"},
                      # both ranks ran before either fails (and srun kills the other)
                      "run": f'echo ran >> {tmp_path}/ran.$SKYPILOT_NODE_RANK; until [ -e '
                             f'{tmp_path}/ran.0 ] && [ -e {tmp_path}/ran.1 ]; do sleep 0.1; '
                             f'done; {before}\n'
                             'if [ "$SKYPILOT_NODE_RANK" = "${SLEEP_RANK:-}" ]; then sleep 30; '
                             'fi; eval exit "\\${RC_$SKYPILOT_NODE_RANK:-0}"'})
    for name, (text, mode) in submit.render(task, got["batch"], SETTINGS, "sky-x", {},
                                            str(tmp_path)).items():
        (tmp_path / name).write_text(text)
        (tmp_path / name).chmod(mode)
    (tmp_path / "workdir").mkdir()  # as the upload makes it (each rank works in a copy)
    env = _stubs(tmp_path, "")
    (tmp_path / "bin" / "srun").write_text(_SRUN_2)
    (tmp_path / "bin" / "scontrol").write_text(
        '#!/bin/sh\ncase "$*" in *hostnames*) printf "n1\\nn2\\n" ;;\n'
        f'  *" {down}") echo "NodeName={down} State=DOWN+NOT_RESPONDING" ;;\n'
        '  *node*) echo "NodeName=x State=ALLOCATED" ;; esac\n')
    env.update(SLURM_JOB_NUM_NODES="2", SLURM_JOB_NODELIST="n[1-2]", **env_vars)
    done = subprocess.run(["bash", str(tmp_path / "job.sbatch")], env=env,
                          capture_output=True, text=True, timeout=30)
    assert (done.returncode != 0) == fails, done.stderr
    for rank in (0, 1):  # each rank's user code ran, once
        assert (tmp_path / f"ran.{rank}").read_text() == "ran\n"
    return _read_once_forgotten(tmp_path, env)


def test_a_rank_whose_node_died_is_an_infrastructure_failure_after_slurm_forgets_the_job(
        tmp_path):
    status = _two_nodes(tmp_path, LOSE="1", SLEEP_RANK="1")
    assert (tmp_path / "exit_code.run.0").read_text().strip() == "0"
    assert not (tmp_path / "exit_code.run.1").exists()
    assert status.state == JobState.INFRA_FAILED and status.state.infra_failure
    assert "rank 1" in status.reason


def test_a_rank_that_cannot_write_its_exit_code_ends_the_step_instead_of_a_wait_for_it(
        tmp_path):
    """Its run ended well, but its node could not write the job dir: it ended with code 0
    and no file, and the other rank waited for that file until the job's time limit."""
    (tmp_path / "exit_code.run.1.tmp").mkdir()  # rank 1's write fails
    # after rank 0 wrote its own: srun kills it (--kill-on-bad-exit) as rank 1 fails
    status = _two_nodes(tmp_path, before=f"[ $SKYPILOT_NODE_RANK = 0 ] || until [ -e "
                                         f"{tmp_path}/exit_code.run.0 ]; do sleep 0.1; done")
    assert (tmp_path / "exit_code.run.0").read_text().strip() == "0"
    assert not (tmp_path / "exit_code.run.1").exists()
    assert status.state == JobState.INFRA_FAILED and "rank 1" in status.reason


def test_a_rank_that_failed_of_its_own_is_the_users_failure_with_its_code(tmp_path):
    status = _two_nodes(tmp_path, RC_1="3")
    assert (status.state, status.exit_code, status.exit_codes) == (JobState.FAILED, 3, [3])
    assert "rank 1" in status.reason


def test_a_rank_srun_killed_for_another_ranks_failure_keeps_it_the_users(tmp_path):
    """srun's --kill-on-bad-exit SIGKILLs the other ranks (no code of their own), their
    nodes up: the failing rank's code decides, not a lost node."""
    status = _two_nodes(tmp_path, RC_1="3", LOSE="0", SLEEP_RANK="0")
    assert not (tmp_path / "exit_code.run.0").exists()
    assert (status.state, status.exit_codes) == (JobState.FAILED, [3])


def test_a_rank_without_a_code_whose_node_slurm_has_down_is_lost_beside_a_failed_peer(
        tmp_path):
    """A peer that failed because the node went (its collective broke) is not the user's."""
    status = _two_nodes(tmp_path, down="n2", RC_0="1", LOSE="1", SLEEP_RANK="1")
    assert status.state == JobState.INFRA_FAILED and "rank 1" in status.reason
    assert status.exit_codes == [1]


def test_a_single_node_job_writes_and_reads_its_exit_code_as_before(tmp_path):
    (tmp_path / "exit_code").write_text("3\n")
    handle = _handle(str(tmp_path))
    out = subprocess.run(["bash", "-s"], input=status_script([handle]),
                         env=_stubs(tmp_path, ""), capture_output=True, text=True, timeout=30)
    status = parse_status(out.stdout, [handle])["7"]
    assert (status.state, status.exit_code, status.reason) == (JobState.FAILED, 3, "exit code 3")


def test_a_killed_note_is_not_believed_while_squeue_does_not_answer():
    """The note is written as SIGTERM arrives; the job's steps may still run (COMPLETING) for
    KillWait or longer: only squeue's answer that the job is gone makes it terminal."""
    note = f"killed {int(time.time())} {int(time.time()) + 3600}"
    silent = f"@@squeue\n@@squeue_rc\n124\n@@sacct\n@@sacct_rc\n124\n@@exits\n7|{note}\n"
    assert parse_status(silent, [_handle()])["7"].state == JobState.UNKNOWN
    answered = silent.replace("@@squeue_rc\n124", "@@squeue_rc\n0")
    assert parse_status(answered, [_handle()])["7"].state == JobState.LOST
