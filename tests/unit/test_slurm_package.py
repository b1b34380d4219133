"""The Slurm package's pure parts, without a cluster: offers from a probe, the job's files and
its upload plan, and batched log reads."""

from __future__ import annotations

import base64

from airflow_skypilot.backends.base import JobHandle
from airflow_skypilot.backends.common import jobscript
from airflow_skypilot.backends.slurm import SlurmBackend, logs, offers, submit
from airflow_skypilot.backends.slurm.cluster import parse_cluster
from airflow_skypilot.backends.slurm.remote import Chmod, MakeDirs, PutFile, WriteFile
from airflow_skypilot.backends.slurm.settings import SlurmSettings
from airflow_skypilot.spec import load_task
from tests.unit.test_slurm_parse import PROBE

SETTINGS = SlurmSettings.from_extra("c", {"cluster": "alpha", "price_per_gpu_hour": 2,
                                          "price_per_node_hour": 1, "account": "ml"})
STATE = parse_cluster(PROBE + "@@partitions\nempty|up|infinite\n")


def _offers(resources, num_nodes=1):
    task = load_task({"run": "x", "num_nodes": num_nodes, "resources": resources})
    backend = SlurmBackend("c", SETTINGS)
    return task, {o.location: o for o in offers.offers(task, STATE, SETTINGS, "c",
                                                        backend.unsupported)}


def test_offers_read_the_probe_through_the_shared_fit_rule():
    _, got = _offers({"accelerators": "A100:2"}, num_nodes=2)
    batch = got["batch"]
    assert batch.fits and batch.infra == "slurm/alpha/batch" and batch.accelerator == "A100"
    assert batch.details["gres_type"] == "a100"  # what submit asks Slurm for
    assert (batch.nodes_total, batch.nodes_free) == (3, 2)  # a3 is down
    assert (batch.gpus_total, batch.gpus_free) == (12, 6)
    assert batch.pending_jobs == 2 and batch.price_per_hour == 2 * (2 * 2 + 1)
    assert not got["short"].fits and got["short"].reason == "needs 2 nodes; short has 1 with A100"
    assert got["empty"].reason == "no A100 in partition empty (has: no GPUs)"
    _, got = _offers({"accelerators": "A100:8"})
    assert got["batch"].reason == "needs 8 A100 per node; nodes in batch have at most 4"
    _, got = _offers({"memory": "32+"})
    assert got["batch"].reason == "needs 32+ GB per node; nodes in batch have at most 15.6 GB"
    assert got["empty"].reason == "no nodes in empty"


def test_slurms_start_estimate_and_refusals_reach_the_offer():
    _, got = _offers({"accelerators": "A100:2"})
    assert got["batch"].free_now and got["batch"].est_start == STATE.now
    task = load_task({"run": "x", "resources": {"accelerators": "A100:1", "memory": 2}})
    assert offers.probe_shapes(task, SETTINGS) == [(1, 1, 0, 2048)]
    refused = parse_cluster(PROBE.replace("short|a100|8|1|0|0|", "short|a100|1|1|0|2048|"))
    offer = offers.offer_at(task, task.candidates[0], "short", refused, SETTINGS, "c")
    assert not offer.fits and offer.reason.startswith(
        "Slurm refuses this shape in short: allocation failure")


def test_the_job_files_and_their_upload_plan(tmp_path):
    (tmp_path / "src" / ".git").mkdir(parents=True)
    (tmp_path / "src" / "pkg").mkdir()
    (tmp_path / "src" / "pkg" / "train.py").write_text("print(1)\n")
    (tmp_path / "src" / ".git" / "HEAD").write_text("ref")
    (tmp_path / "data.txt").write_text("d")
    (tmp_path / "t.yaml").write_text(
        "workdir: src\nfile_mounts:\n  ~/in/data.txt: data.txt\nsecrets:\n  TOKEN: s3cr3t\n"
        "resources:\n  accelerators: A100:2\n  cpus: 3\nrun: python pkg/train.py\n")
    task = load_task(str(tmp_path / "t.yaml"))
    _, got = _offers({"accelerators": "A100:2", "cpus": 3})
    job_dir = "/home/u/.airflow-skypilot/jobs/sky-x"
    assert submit.remote_job_dir(SETTINGS, "sky-x", "/home/u") == job_dir
    files = submit.render(task, got["batch"], SETTINGS, "sky-x", {"SKYPILOT_TASK_ID": "t"},
                          job_dir)
    sbatch = files["job.sbatch"][0]
    for directive in ("--partition=batch", "--gres=gpu:a100:2", "--cpus-per-task=3",
                      "--account=ml", "--no-requeue"):
        assert f"#SBATCH {directive}\n" in sbatch
    assert files["secrets.sh"][1] == 0o600 and "s3cr3t" not in files["env.sh"][0]
    assert files["run.sh"][0] == jobscript.PROLOGUE + "python pkg/train.py\n"
    plan = submit.upload_plan(task, job_dir, files, "/home/u")
    assert plan[:2] == [MakeDirs(job_dir, 0o700), Chmod(job_dir, 0o700)]
    written = {s.path: s.mode for s in plan if isinstance(s, WriteFile)}
    assert written[f"{job_dir}/secrets.sh"] == 0o600
    puts = [(s.local, s.remote) for s in plan if isinstance(s, PutFile)]
    assert puts == [(str(tmp_path / "src" / ".git" / "HEAD"), f"{job_dir}/workdir/.git/HEAD"),
                    (str(tmp_path / "src" / "pkg" / "train.py"), f"{job_dir}/workdir/pkg/train.py"),
                    (str(tmp_path / "data.txt"), "/home/u/in/data.txt")]
    pkg = MakeDirs(f"{job_dir}/workdir/pkg", 0o755, in_tree=True)
    assert plan.index(pkg) < plan.index(PutFile(str(tmp_path / "src" / "pkg" / "train.py"),
                                                f"{job_dir}/workdir/pkg/train.py"))
    dirs = [s.path for s in plan if isinstance(s, MakeDirs)]
    assert "/home/u/in" in dirs and f"{job_dir}/workdir/.git" in dirs  # SkyPilot ships .git


def test_many_logs_are_read_in_one_script_each_from_its_offset():
    handles = [JobHandle(backend="slurm", connection="c", job_id=i, job_name=i, location="b",
                         infra="slurm/c/b", extra={"log": f"/j/{i}/slurm.log"}) for i in "12"]
    script = logs.logs_script([(handles[0], 0), (handles[1], 10)])
    assert "tail -c +1 /j/1/slurm.log" in script and "tail -c +11 /j/2/slurm.log" in script
    out = f"@@log 1\n{base64.b64encode('héllo'.encode()).decode()}\n@@log 2\n\n"
    got = logs.split_logs(out, [(handles[0], 0), (handles[1], 10)])
    assert got == {"1": ("héllo", 6), "2": ("", 10)}
    assert logs.split_log("@@log\n" + base64.b64encode(b"abc").decode(), 4) == ("abc", 7)
    # a read cut inside a character: it comes whole with the next read, not as two "?"
    e = "é€😀".encode()  # 2, 3 and 4 bytes
    for cut in range(1, len(e)):
        first = logs.split_log("@@log\n" + base64.b64encode(e[:cut]).decode(), 0)
        rest = logs.split_log("@@log\n" + base64.b64encode(e[first[1]:]).decode(), first[1])
        assert first[0] + rest[0] == "é€😀" and rest[1] == len(e), cut
    assert logs.split_logs(f"@@log 1\n{base64.b64encode(e[:1]).decode()}\n",
                           [(handles[0], 0)]) == {"1": ("", 0)}


def test_memory_per_cpu_becomes_mem_per_cpu():
    """SkyPilot's ``memory: 4x`` is GB per CPU: Slurm has the same notion."""
    task, got = _offers({"cpus": 2, "memory": "4x"})
    sbatch = submit.render(task, got["batch"], SETTINGS, "sky-x", {}, "/j")["job.sbatch"][0]
    assert "#SBATCH --mem-per-cpu=4096M\n" in sbatch and "--mem=" not in sbatch
    task, got = _offers({"cpus": 2, "memory": "6"})
    sbatch = submit.render(task, got["batch"], SETTINGS, "sky-x", {}, "/j")["job.sbatch"][0]
    assert "#SBATCH --mem=6144M\n" in sbatch and "--mem-per-cpu" not in sbatch


def test_a_lookup_needs_an_answered_squeue_only_when_the_job_dir_has_no_job_id():
    import pytest

    from airflow_skypilot.exceptions import BackendUnreachable

    name = "sky-x-c0-t1-a0"
    recorded = ("@@home\n/home/u\n@@job_id\n42\n@@meta\npartition=batch\n"
                "submitted_at=1796000000.125\n@@queued\n@@queued_rc\n1\n")
    handle, home = submit.parse_lookup(recorded, SETTINGS, "c", name)
    assert (handle.job_id, handle.submitted_at, home) == ("42", 1796000000.125, "/home/u")
    silent = "@@home\n/home/u\n@@job_id\n@@meta\n@@queued\n@@queued_rc\n124\n"
    with pytest.raises(BackendUnreachable, match="squeue did not answer"):
        submit.parse_lookup(silent, SETTINGS, "c", name)  # never "no such job"
    with pytest.raises(BackendUnreachable):
        submit.parse_lookup("", SETTINGS, "c", name)  # the script never ran
    none = "@@home\n/home/u\n@@job_id\n@@meta\n@@queued\n@@queued_rc\n0\n"
    assert submit.parse_lookup(none, SETTINGS, "c", name) == (None, "/home/u")
    unrecorded = ("@@home\n/home/u\n@@job_id\n@@meta\n@@queued\n"
                  f"7|batch|1796000001|{name}\n@@queued_rc\n0\n")
    handle, _ = submit.parse_lookup(unrecorded, SETTINGS, "c", name)
    assert (handle.job_id, handle.location, handle.submitted_at) == ("7", "batch", 1796000001.0)
    listing = ("@@home\n/home/u\n@@dirs\n"
               f"{name}\t42\tpartition=batch\tsubmitted_at=1796000000.125\t\n"
               "sky-x-c0-t1-a1\t\tpartition=batch\t\n@@queued\n"
               "8|short|1796000002|sky-x-c0-t2-a0\n9|batch|1796000003|other\n@@queued_rc\n0\n")
    found = submit.parse_find_all(listing, SETTINGS, "c", "sky-x-")
    assert [(h.job_name, h.job_id, h.submitted_at) for h in found] == [
        (name, "42", 1796000000.125), ("sky-x-c0-t2-a0", "8", 1796000002.0)]
    with pytest.raises(BackendUnreachable):
        submit.parse_find_all(listing.replace("@@queued_rc\n0", "@@queued_rc\n1"), SETTINGS,
                              "c", "sky-x-")
    # a home shared with cluster beta: its job dirs are beta's jobs, not alpha's
    shared = listing.replace("partition=batch\tsubmitted", "cluster=beta\tsubmitted")
    assert "sky-x-c0-t1-a0" not in [h.job_name for h in submit.parse_find_all(
        shared, SETTINGS, "c", "sky-x-")]
    theirs = recorded.replace("@@meta\n", "@@meta\ncluster=beta\n")
    assert submit.parse_lookup(theirs, SETTINGS, "c", name) == (None, "/home/u")
    assert submit.dir_owner(theirs, SETTINGS) == "beta"
    assert submit.dir_owner(recorded, SETTINGS) == ""


def test_sbatch_and_scancel_without_an_answer_are_unreachable_not_refused():
    import pytest

    from airflow_skypilot.exceptions import BackendError, BackendUnreachable, SubmissionError

    ok = "@@submitted\n42\n@@gc\nsky-old-c0-t1-a0\n"
    assert submit.parse_submitted(0, ok, "", "c") == ("42", False, ["sky-old-c0-t1-a0"])
    timed_out = "@@sbatch_rc\n124\n@@gc\n"
    with pytest.raises(BackendUnreachable, match="may exist"):
        submit.parse_submitted(99, timed_out, "", "c")
    with pytest.raises(BackendUnreachable):
        submit.parse_submitted(99, "@@sbatch_rc\n1\n", "sbatch: error: Batch job submission "
                               "failed: Socket timed out on send/recv operation", "c")
    with pytest.raises(BackendUnreachable, match="lock"):
        submit.parse_submitted(98, "", "", "c")
    with pytest.raises(SubmissionError) as refused:
        submit.parse_submitted(99, "@@sbatch_rc\n1\n", "sbatch: error: Batch job submission "
                               "failed: Requested node configuration is not available", "c")
    assert refused.value.retry_elsewhere and not isinstance(refused.value, BackendUnreachable)
    handle = JobHandle(backend="slurm", connection="c", job_id="42", job_name="n",
                       location="batch", infra="slurm/alpha/batch")
    submit.check_cancelled(0, "", "", handle)
    submit.check_cancelled(1, "scancel: error: Invalid job id specified", "", handle)
    with pytest.raises(BackendUnreachable):
        submit.check_cancelled(1, "scancel: error: Kill job error on job id 42: Socket timed "
                               "out on send/recv operation", "", handle)
    with pytest.raises(BackendUnreachable):
        submit.check_cancelled(124, "", "", handle)
    with pytest.raises(BackendError):
        submit.check_cancelled(1, "scancel: error: Access/permission denied", "", handle)


def test_the_job_script_launches_a_step_again_for_the_connections_step_launch_retry():
    task, got = _offers({"accelerators": "A100:2"})
    script = submit.render(task, got["batch"], SETTINGS, "sky-x", {}, "/j")["job.sbatch"][0]
    assert "\nSTEP_RETRY=120\n" in script and script.count("\nlaunch setup\n") == 1
    quick = SlurmSettings.from_extra("c", {"cluster": "alpha", "step_launch_retry": "0"})
    script = submit.render(task, got["batch"], quick, "sky-x", {}, "/j")["job.sbatch"][0]
    assert "\nSTEP_RETRY=0\n" in script  # 0: a step srun could not launch is not tried again


def test_a_step_launch_retry_the_job_script_cannot_count_is_refused_at_the_connection():
    import pytest

    from airflow_skypilot.exceptions import ConfigurationError

    for bad in ("inf", "nan", -1, 1e19):
        with pytest.raises(ConfigurationError, match="step_launch_retry"):
            SlurmSettings.from_extra("c", {"step_launch_retry": bad})


def test_sbatch_notices_on_stderr_never_become_the_job_id(tmp_path):
    """A site's job_submit plugin (or a warning) talks on stderr on success: the id is only
    what --parsable prints. The real submit script, run by bash with a stand-in sbatch."""
    import os
    import subprocess

    import pytest

    from airflow_skypilot.exceptions import BackendError, BackendUnreachable

    bin_dir, job_dir = tmp_path / "bin", tmp_path / "job"
    bin_dir.mkdir()
    job_dir.mkdir()

    def run(prints: str) -> subprocess.CompletedProcess:
        sbatch = bin_dir / "sbatch"
        sbatch.write_text("#!/bin/bash\necho 'sbatch: Warning: job_submit/lua: no --time "
                          f"given, partition default applied' >&2\n{prints}\n")
        sbatch.chmod(0o755)
        (job_dir / "job_id").unlink(missing_ok=True)
        env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(tmp_path)}
        return subprocess.run(["bash", "-s"], input=submit.submit_script(str(job_dir), "n"),
                              capture_output=True, text=True, env=env, timeout=30)

    done = run("echo '4242;alpha'")
    assert submit.parse_submitted(done.returncode, done.stdout, done.stderr, "c")[0] == "4242"
    assert (job_dir / "job_id").read_text() == "4242\n"
    assert "job_submit/lua" in done.stderr  # the notice, apart (the backend logs it)
    odd = run("echo 'Submitted batch job 4243'")  # not --parsable's shape: no id to trust
    with pytest.raises(BackendUnreachable, match="printed no job id"):
        submit.parse_submitted(odd.returncode, odd.stdout, odd.stderr, "c")
    assert not (job_dir / "job_id").exists()
    # an id that is not a number is never taken for a job gone at scancel
    handle = JobHandle(backend="slurm", connection="c", job_id="sbatch: Warning", job_name="n",
                       location="batch", infra="slurm/alpha/batch")
    with pytest.raises(BackendError):
        submit.check_cancelled(1, "scancel: error: Invalid job id specified", "", handle)


def test_the_steps_ask_srun_for_the_cpus_the_job_asked_sbatch_for(tmp_path):
    """Since Slurm 22.05 srun does not inherit --cpus-per-task from sbatch: on a cluster that
    binds tasks to CPUs the setup and run steps had one CPU. The job script runs in bash with
    stand-in srun and scontrol that note what srun got."""
    import os
    import subprocess

    task, got = _offers({"accelerators": "A100:2", "cpus": 3})
    script = submit.render(task, got["batch"], SETTINGS, "sky-x", {}, str(tmp_path))
    assert "#SBATCH --cpus-per-task=3" in script["job.sbatch"][0]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/sh\necho "${SRUN_CPUS_PER_TASK:-unset}" >> '
                                  f'{tmp_path}/srun.cpus\n')
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho n1\n")
    for stub in ("srun", "scontrol"):
        (bin_dir / stub).chmod(0o755)
    (tmp_path / "job.sbatch").write_text(script["job.sbatch"][0])
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_CPUS_PER_TASK": "3",
           "SLURM_JOB_NODELIST": "n1", "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_ID": "7"}
    done = subprocess.run(["bash", str(tmp_path / "job.sbatch")], env=env,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "srun.cpus").read_text().split() == ["3", "3"]  # setup, run


def test_a_relative_remote_work_dir_is_under_the_home():
    """The job script changes into the job dir and names it again: relative, every
    submission failed (sbatch: chdir ... No such file)."""
    got = SlurmSettings.from_extra("c", {"remote_work_dir": "scratch/airflow"})
    assert got.remote_work_dir == "~/scratch/airflow"
    assert SlurmSettings.from_extra("c", {"remote_work_dir": "/scratch/a"}).remote_work_dir \
        == "/scratch/a"
    assert submit.remote_job_dir(got, "sky-x", "/home/u") == "/home/u/scratch/airflow/jobs/sky-x"
    assert SlurmSettings.from_extra("c", {"remote_work_dir": "$HOME/x"}).remote_work_dir == "~/x"
    import pytest

    from airflow_skypilot.exceptions import ConfigurationError

    for bad in ("~bob/x", "/scratch/$USER"):  # quoted, never expanded: a literal dir
        with pytest.raises(ConfigurationError, match="remote_work_dir"):
            SlurmSettings.from_extra("c", {"remote_work_dir": bad})
