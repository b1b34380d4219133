"""Step 7's fault tests through real Airflow (`airflow dags test`) on the real Slurm clusters:
at most one live copy of a task, ever. Each one counts what the user code did
(``tasks/counted.yaml`` writes START, a TICK a second and END to a counter file)."""

from __future__ import annotations

import time

import pytest

from tests.e2e.conftest import assert_ran_once, counted, marks, shared_dir, wait_until

pytestmark = [pytest.mark.sandbox, pytest.mark.e2e]

#: how long slurmctld stays frozen (the issue's 60 s), and the silence limit of that test
PAUSE = 60
PAUSE_LIMIT = 120


def _state(slurm, cluster: str, job: str) -> str:
    return slurm.run(cluster, "squeue", "-h", "-t", "all", "-j", job, "-o", "%T",
                     check=False).stdout.strip()


def test_a_paused_slurmctld_is_waited_out_not_failed_over(airflow_slurm, slurm):
    # The controller of the job's cluster freezes for a minute (squeue, scancel and sbatch
    # time out), then comes back: the job never stopped, so nothing moves. The silence limit
    # is clearly longer than the pause.
    counter = f"{shared_dir()}/counter"
    conf = counted(counter, PAUSE + 15, unreachable_timeout=PAUSE_LIMIT)
    with airflow_slurm.started("e2e_task", conf) as proc:
        first = wait_until(lambda: marks(counter, "TICK"), 120, what="the job running")[0]
        slurm.pause_slurmctld(first.cluster)
        paused = time.time()
        try:
            time.sleep(PAUSE)
        finally:
            slurm.resume_slurmctld(first.cluster)
        resumed = time.time()
        run = airflow_slurm.finish(proc, "e2e_task", timeout=240)
    assert run.returncode == 0, run.output[-6000:]
    result = run.result("run")
    assert [(a["connection"], a["state"], a["adopted"]) for a in result["attempts"]] == [
        (f"slurm_{first.cluster}", "succeeded", False)], result["attempts"]
    assert result["old_copies"] == []
    # the silence was noticed (polls failed while the controller was frozen) and waited out
    assert f"No answer about job {first.job} on slurm_{first.cluster}" in run.output, \
        run.output[-6000:]
    assert "Submitted slurm job" in run.output and run.output.count("Submitted slurm job") == 1
    end = assert_ran_once(counter)
    assert end.attempt == first.attempt and end.copy == first.copy
    ticks = [m.t for m in marks(counter, "TICK")]
    assert any(paused < t < resumed for t in ticks), "the job ran on while slurmctld was frozen"


def test_a_silent_login_node_fails_over_and_its_copy_is_cancelled_once_it_answers(
        airflow_slurm, slurm):
    # The login node of the job's cluster goes away for longer than the silence limit: the job
    # counts as lost and is placed on the other cluster. The first copy may still run (nobody
    # can ask), so it is cancelled as soon as its login node answers again; the result says so.
    counter = f"{shared_dir()}/counter"
    conf = counted(counter, 45, unreachable_timeout=20, confirm_timeout=5)
    with airflow_slurm.started("e2e_task", conf) as proc:
        first = wait_until(lambda: marks(counter, "TICK"), 120, what="the job running")[0]
        other = "beta" if first.cluster == "alpha" else "alpha"
        slurm.stop_sshd(first.cluster)
        stopped = time.time()
        try:
            second = wait_until(lambda: [m for m in marks(counter, "START")
                                         if m.cluster == other], 120, interval=0.2,
                                what=f"the failover copy running on {other}")[0]
        finally:
            slurm.start_sshd(first.cluster)
        back = time.time()
        wait_until(lambda: _state(slurm, first.cluster, first.job) == "CANCELLED", 30,
                   interval=0.2, what=f"job {first.job} on {first.cluster} cancelled")
        cancelled = time.time()
        run = airflow_slurm.finish(proc, "e2e_task", timeout=180)
    assert run.returncode == 0, run.output[-6000:]
    assert back - stopped > 20, "the login node was away for longer than the silence limit"
    assert cancelled - back < 15, "cancelled as soon as the login node answered (next sweep)"
    result = run.result("run")
    assert [(a["connection"], a["job_id"], a["state"]) for a in result["attempts"]] == [
        (f"slurm_{first.cluster}", first.job, "lost"),
        (f"slurm_{other}", second.job, "succeeded")], result["attempts"]
    assert result["attempts"][0]["confirmed_dead"] is False  # not at failover time...
    [old] = result["old_copies"]  # ...but later, and the result lists it
    assert old["connection"] == f"slurm_{first.cluster}" and first.job in old["what"], old
    assert old["confirmed_dead"] is True and "cancelled" in old["outcome"], old
    assert f"Old copy confirmed dead: slurm_{first.cluster} job {first.job}" in run.output
    # the user code: the first copy was stopped before its end, the second ran to its end
    lines = marks(counter)
    assert {m.copy for m in lines} == {first.copy, second.copy}
    assert [m.copy for m in lines if m.kind == "END"] == [second.copy]
    assert [m.copy for m in lines if m.kind == "START"] == [first.copy, second.copy]
    assert int(second.attempt) > int(first.attempt), "a new copy, a higher SKYPILOT_ATTEMPT"
    # both ran only while the first could not be reached (it ran on: nobody could stop it),
    # and none of the first after its cancel
    assert any(m.copy == first.copy and m.t > stopped + 20 for m in lines)
    assert max(m.t for m in lines if m.copy == first.copy) < cancelled
    assert min(m.t for m in lines if m.copy == second.copy) > stopped + 20


def test_a_bad_templated_task_fails_before_anything_reaches_a_backend(airflow_all, slurm,
                                                                        k8s, aws):
    # The task's YAML text comes from the run's conf (``task: "{{ params.task }}"``): a
    # 350-byte alias bomb is refused at once, without a retry, and no backend hears of it.
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 7)]
    bomb = "\n".join(lines) + "\nrun: echo hi\n"
    for cluster in ("alpha", "beta"):
        slurm.clear_commands_log(cluster)
    k8s.reset_requests()
    aws.reset_requests()
    start = time.monotonic()
    run = airflow_all.run("e2e_task", {"task": bomb}, timeout=300)
    elapsed = time.monotonic() - start
    assert run.returncode != 0
    assert run.states == {"run": "failed"}
    assert "invalid SkyPilot task" in run.output
    assert "aliases are expanded: refused (a YAML alias bomb?)" in run.output, run.output[-4000:]
    assert "up_for_retry" not in run.output.lower()
    assert elapsed < 60, "refused at once, not after a parse of 1.2 GB"
    assert slurm.commands_log("alpha") == [] and slurm.commands_log("beta") == []
    assert k8s.requests() == []
    assert aws.requests() == []
