"""The Slurm backend against two real Slurm clusters (tests/sandbox/slurm.py), over real SSH."""

from __future__ import annotations

import asyncio
import json
import shlex
import time
import uuid

import pytest

from airflow_skypilot.backends.base import JobState
from airflow_skypilot.backends.slurm import SlurmBackend
from airflow_skypilot.cli import main as cli
from airflow_skypilot.exceptions import BackendUnreachable
from airflow_skypilot.hooks.capacity import SkyPilotCapacityHook
from airflow_skypilot.spec import load_task
from tests.conftest import wait_for_job
from tests.e2e.conftest import shared_dir

pytestmark = pytest.mark.sandbox

HOME = "/home/skyuser"


def _name(prefix: str) -> str:
    """Job dirs outlive sandbox resets: every test submission gets a fresh name."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _task(run: str = "true", **fields):
    spec = {"run": run, **fields}
    return load_task(spec)


def _wait(backend, handle, states, timeout=60.0):
    return wait_for_job(backend, handle, states, timeout)


def _log(backend, handle) -> str:
    text, _ = backend.read_log(handle)
    return text


def _offer(backend, task, location=None, accelerator=None):
    offers = [o for o in backend.probe(task) if o.fits]
    if location:
        offers = [o for o in offers if o.location == location]
    if accelerator:
        offers = [o for o in offers if o.request.accelerator == accelerator]
    assert offers, "no fitting offer"
    return offers[0]


def _submit(backend, task, prefix):
    return backend.submit(task, _offer(backend, task), _name(prefix), {"SKYPILOT_TASK_ID": "t"})


def _filler(slurm, cluster, gres, partition=None, nodes=1, seconds=300):
    argv = ["sbatch", "--parsable", f"--gres={gres}", "-N", str(nodes), "--mem=100M",
            "--wrap", f"sleep {seconds}"]
    if partition:
        argv[1:1] = ["-p", partition]
    return slurm.run(cluster, *argv).stdout.strip().split(";")[0]


def _wait_running(slurm, cluster, job_id, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = slurm.run(cluster, "squeue", "-h", "-j", job_id, "-o", "%T").stdout.strip()
        if state == "RUNNING":
            return
        time.sleep(0.3)
    raise AssertionError(f"filler {job_id} not running")


def test_capacity_is_right_under_load(slurm):
    alpha = SlurmBackend("slurm_alpha")
    before = {(r.location, r.accelerator): r for r in alpha.capacity()}
    assert before[("batch", "A100")].total == 8 and before[("batch", "A100")].free == 8
    assert before[("short", "A100")].total == 4 and before[("short", "A100")].free == 4
    job1 = _filler(slurm, "alpha", "gpu:a100:3", partition="short")  # lands on a2
    job2 = _filler(slurm, "alpha", "gpu:a100:2", partition="batch")
    _wait_running(slurm, "alpha", job1)
    _wait_running(slurm, "alpha", job2)
    after = {(r.location, r.accelerator): r for r in alpha.capacity()}
    assert after[("batch", "A100")].free == 3  # 8 - 3 - 2: a2 counted once across partitions
    assert after[("short", "A100")].free == 1
    pending = _filler(slurm, "alpha", "gpu:a100:4", partition="short")
    time.sleep(1)
    task = _task(resources={"accelerators": "A100:4"})
    offers = {o.location: o for o in alpha.probe(task)}
    assert offers["short"].fits and not offers["short"].free_now
    assert offers["short"].pending_jobs == 1
    # a2's idle GPU is held for the pending 4-GPU job planned there: not free for a new job
    assert offers["short"].details["gpus_idle"] == 1 and offers["short"].gpus_free == 0
    assert offers["short"].details["reserved_by_pending"] == 1
    assert offers["short"].details["held_for"] == [pending] and offers["short"].nodes_free == 0
    assert offers["batch"].nodes_free == 0  # a1 has 2 free, a2 has 1: no node with 4
    assert offers["batch"].est_start is not None and offers["batch"].est_start > time.time()
    queued = {(r.location, r.accelerator): r for r in alpha.capacity()}
    # the waiting job is short's queue (show-gpus' pending); batch's queue is still empty
    assert queued[("short", "A100")].pending == 1, queued[("short", "A100")]
    assert queued[("batch", "A100")].pending == 0, queued[("batch", "A100")]
    assert after[("short", "A100")].pending == after[("batch", "A100")].pending == 0


def test_the_probe_lists_our_live_jobs_by_name(slurm):
    # the ledger's "already counted" check (ledger.hold): a job of the login user that is
    # pending or running is in every offer's jobs_seen; one that ended, and anybody else's, not
    alpha = SlurmBackend("slurm_alpha")
    task = _task(run="sleep 300")
    running = _submit(alpha, task, "seen-run")
    _wait(alpha, running, {JobState.RUNNING})
    done = _submit(alpha, _task(), "seen-done")
    _wait(alpha, done, {JobState.SUCCEEDED})
    root = slurm.run("alpha", "sbatch", "--parsable", "-J", "not-ours", "--wrap", "sleep 300",
                     as_root=True).stdout.strip()
    offers = alpha.probe(_task(resources={"accelerators": "A100:1"}))
    try:
        assert offers and all(o.jobs_seen is not None for o in offers)
        seen = offers[0].jobs_seen
        assert running.job_name in seen
        assert done.job_name not in seen and "not-ours" not in seen
    finally:
        alpha.cancel(running)
        slurm.run("alpha", "scancel", root.split(";")[0], as_root=True)


def test_two_node_job_gets_every_skypilot_env_var(slurm, tmp_path):
    alpha = SlurmBackend("slurm_alpha")
    task = load_task({
        "num_nodes": 2,
        "resources": {"accelerators": "A100:2"},
        "envs": {"MY_ENV": "x"},
        "setup": 'echo "setup rank=$SKYPILOT_SETUP_NODE_RANK"',
        "run": "echo \"rank=$SKYPILOT_NODE_RANK nodes=$SKYPILOT_NUM_NODES "
               "gpus=$SKYPILOT_NUM_GPUS_PER_NODE task=$SKYPILOT_TASK_ID my=$MY_ENV\"\n"
               "echo \"rank=$SKYPILOT_NODE_RANK sees=$CUDA_VISIBLE_DEVICES\"\n"
               "echo \"ips=$(echo $SKYPILOT_NODE_IPS | tr '\\n' ',')\"\n"
               "echo \"cluster=$SKYPILOT_CLUSTER_INFO\"",
    })
    offer = _offer(alpha, task, location="batch")
    handle = alpha.submit(task, offer, _name("sky-test-two-node"), {"SKYPILOT_TASK_ID": "sky-abc"})
    status = _wait(alpha, handle, {JobState.SUCCEEDED, JobState.FAILED})
    log = _log(alpha, handle)
    assert status.state == JobState.SUCCEEDED, log
    assert sorted(status.nodes) in (["a1", "a2"], ["a[1-2]"]), status.nodes
    for rank in (0, 1):
        assert f"rank={rank} nodes=2 gpus=2 task=sky-abc my=x" in log
        assert f"rank={rank} sees=0,1" in log  # the step (--overlap) has the job's GPUs
        assert f"setup rank={rank}" in log
    assert "ips=127.0.1.1 127.0.1.2," in log or "ips=127.0.1.1,127.0.1.2," in log
    assert '"cloud": "Slurm"' in log and '"zone": "batch"' in log


TRICKY = {
    "SPACES": "a b  c",
    "QUOTES": "it's \"quoted\" `back`",
    "SUBST": "$(touch /tmp/airflow-skypilot-pwned) ${HOME} $HOME",
    "NEWLINES": "line1\nline2\n\nline4",
    "BACKSLASH": "a\\nb\\\\c",
    "UNICODE": "naïve ☃",
}


def test_envs_arrive_byte_for_byte(slurm):
    beta = SlurmBackend("slurm_beta")
    script = "".join(f'printf "%s" "${name}" | base64 -w0; echo " {name}"\n' for name in TRICKY)
    task = load_task({"envs": TRICKY, "run": script})
    handle = _submit(beta, task, "sky-test-envs")
    status = _wait(beta, handle, {JobState.SUCCEEDED, JobState.FAILED})
    log = _log(beta, handle)
    assert status.state == JobState.SUCCEEDED, log
    import base64

    seen = {}
    for line in log.splitlines():
        parts = line.split(" ")
        if len(parts) == 2 and parts[1] in TRICKY:
            seen[parts[1]] = base64.b64decode(parts[0]).decode()
    assert seen == TRICKY
    assert slurm.run("beta", "test", "!", "-e", "/tmp/airflow-skypilot-pwned", check=False) \
        .returncode == 0


def test_secrets_are_never_in_clear_in_the_script_or_a_readable_file(slurm):
    beta = SlurmBackend("slurm_beta")
    import hashlib

    digest = hashlib.sha256(b"s3cr3t-value").hexdigest()
    task = load_task({"secrets": {"API_TOKEN": "s3cr3t-value"},
                      "run": f'test "$(printf %s "$API_TOKEN" | sha256sum | cut -d" " -f1)" = '
                             f'{digest} && echo token-ok; sleep 3'})
    handle = _submit(beta, task, "sky-test-secret")
    job_dir = handle.extra["job_dir"]
    listing = slurm.run("beta", "bash", "-c",
                        f"stat -c '%a %n' {shlex.quote(job_dir)} {shlex.quote(job_dir)}/*")
    modes = dict(line.split(" ", 1)[::-1] for line in listing.stdout.splitlines())
    assert modes[job_dir] == "700"
    assert modes[f"{job_dir}/secrets.sh"] == "600"
    grep = slurm.run("beta", "grep", "-rl", "s3cr3t-value", job_dir, check=False)
    assert grep.stdout.strip().splitlines() == [f"{job_dir}/secrets.sh"]
    status = _wait(beta, handle, {JobState.SUCCEEDED, JobState.FAILED})
    assert status.state == JobState.SUCCEEDED
    assert "token-ok" in _log(beta, handle)
    gone = slurm.run("beta", "test", "-e", f"{job_dir}/secrets.sh", check=False)
    assert gone.returncode != 0, "secrets.sh must be removed when the job ends"


def test_a_file_mount_keeps_its_mode_from_the_first_byte(slurm, tmp_path):
    """A 0600 credential mounted from the worker (~/.kaggle/kaggle.json) is not readable by
    others on the login node: SFTP created it with the server's umask (0644) before."""
    cred = tmp_path / "kaggle.json"
    cred.write_text('{"key": "not-for-others"}')
    cred.chmod(0o600)
    script = tmp_path / "run.sh"
    script.write_text("echo hi\n")
    script.chmod(0o750)
    where = f"{shared_dir()}/mount"  # a dir the job's user may create things in
    beta = SlurmBackend("slurm_beta")
    task = load_task({"run": "true", "file_mounts": {f"{where}/kaggle.json": str(cred),
                                                     f"{where}/run.sh": str(script)}})
    handle = _submit(beta, task, "sky-test-mount-mode")
    try:
        listing = slurm.run("beta", "stat", "-c", "%a %n", f"{where}/kaggle.json",
                            f"{where}/run.sh")
        modes = dict(line.split(" ", 1)[::-1] for line in listing.stdout.splitlines())
        assert modes == {f"{where}/kaggle.json": "600", f"{where}/run.sh": "750"}
        assert _wait(beta, handle, {JobState.SUCCEEDED, JobState.FAILED}).state == \
            JobState.SUCCEEDED
    finally:
        slurm.run("beta", "rm", "-rf", where, check=False)


def test_setup_failure_skips_run_and_fails(slurm):
    beta = SlurmBackend("slurm_beta")
    task = load_task({"setup": "exit 7", "run": "echo should-not-run"})
    handle = _submit(beta, task, "sky-test-setup")
    status = _wait(beta, handle, {JobState.SUCCEEDED, JobState.FAILED})
    assert (status.state, status.exit_code) == (JobState.FAILED, 7)
    assert "should-not-run" not in _log(beta, handle)


def test_killing_the_slurmd_under_a_job_is_an_infra_failure(slurm):
    alpha = SlurmBackend("slurm_alpha")
    task = _task("sleep 300", resources={"accelerators": "A100:1"})
    offer = _offer(alpha, task, location="short")  # short has only a2
    handle = alpha.submit(task, offer, _name("sky-test-nodefail"), {"SKYPILOT_TASK_ID": "t"})
    _wait(alpha, handle, {JobState.RUNNING})
    slurm.kill_slurmd("a2")
    status = _wait(alpha, handle, {JobState.INFRA_FAILED, JobState.FAILED, JobState.LOST},
                   timeout=90)
    assert status.state == JobState.INFRA_FAILED, status
    assert status.state.infra_failure
    assert status.raw_state == "NODE_FAIL"


def test_too_many_gpus_is_explained_and_nothing_submitted(slurm):
    alpha = SlurmBackend("slurm_alpha")
    task = _task(resources={"accelerators": "A100:8"})
    before = slurm.run("alpha", "squeue", "-h", "-t", "all", "-o", "%i").stdout.split()
    offers = alpha.probe(task)
    assert offers and not any(o.fits for o in offers)
    assert {o.reason for o in offers} == {
        "needs 8 A100 per node; nodes in batch have at most 4",
        "needs 8 A100 per node; nodes in short have at most 4"}
    after = slurm.run("alpha", "squeue", "-h", "-t", "all", "-o", "%i").stdout.split()
    assert after == before  # sbatch --test-only submits nothing


def test_unknown_gpu_type_and_shapes_are_explained(slurm):
    beta = SlurmBackend("slurm_beta")
    reasons = {o.reason for o in beta.probe(_task(resources={"accelerators": "L4:1"}))}
    assert reasons == {"no L4 in partition main (has: h100)"}
    reasons = {o.reason for o in beta.probe(_task(num_nodes=2,
                                                  resources={"accelerators": "H100:1"}))}
    assert reasons == {"needs 2 nodes; main has 1 with H100"}
    reasons = {o.reason for o in beta.probe(_task(resources={"cpus": "64+"}))}
    assert reasons == {"needs 64+ CPUs per node; nodes in main have at most 8"}
    reasons = {o.reason for o in beta.probe(_task(resources={"use_spot": True}))}
    assert reasons == {"use_spot: true: Slurm has no spot capacity"}


def test_infra_filter_selects_cluster_and_partition(slurm):
    alpha = SlurmBackend("slurm_alpha")
    task = _task(resources={"accelerators": "A100:1", "infra": "slurm/alpha/short"})
    assert [o.location for o in alpha.probe(task)] == ["short"]
    assert SlurmBackend("slurm_beta").probe(task) == []


def test_a_scripts_output_is_read_to_its_end_not_to_its_exit_status(slurm):
    # sshd sends the exit status when the shell is reaped, which may come before the last
    # output still in the pipe (CI lost a lookup's last line so: "squeue failed (exit None)");
    # output written after the shell exited shows it every time
    remote = SlurmBackend("slurm_alpha").remote
    for _ in range(3):
        rc, out, _ = remote.run("(sleep 1; echo late) & echo early", 30)
        assert (rc, out.split()) == (0, ["early", "late"])
    # and the triggerer's side (asyncssh waits for the channel to close)
    rc, out, _ = asyncio.run(remote.arun("(sleep 1; echo late) & echo early", 30))
    assert (rc, out.split()) == (0, ["early", "late"])


def test_unreachable_login_node_is_reported_and_the_others_answer(slurm):
    slurm.stop_sshd("alpha")
    try:
        with pytest.raises(BackendUnreachable):
            SlurmBackend("slurm_alpha").probe(_task())
        hook = SkyPilotCapacityHook(["slurm_alpha", "slurm_beta"], timeout=30)
        result = hook.probe(_task(resources={"accelerators": "H100:1"}))
        assert "slurm_alpha" in result.errors
        assert "Unable to connect" in result.errors["slurm_alpha"]
        assert [o.connection for o in result.offers if o.fits] == ["slurm_beta"]
    finally:
        slurm.start_sshd("alpha")


def test_finished_job_that_left_the_queue_is_judged_by_its_exit_file(slurm):
    beta = SlurmBackend("slurm_beta")
    task = _task("exit 4")
    handle = _submit(beta, task, "sky-test-gone")
    _wait(beta, handle, {JobState.FAILED})
    handle.job_id = "99999"  # a job Slurm no longer knows, same job dir
    status = beta.status([handle])["99999"]
    assert (status.state, status.exit_code) == (JobState.FAILED, 4)
    handle.extra["job_dir"] = "/nonexistent"
    assert beta.status([handle])["99999"].state == JobState.LOST


def test_workdir_is_copied_over_sftp(slurm, tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "train.py").write_text("print('from workdir')\n")
    (tmp_path / "src" / ".git").mkdir()
    (tmp_path / "src" / ".git" / "HEAD").write_text("ref")
    yaml = tmp_path / "task.yaml"
    (tmp_path / "src" / ".gitignore").write_text("*.ckpt\n")
    (tmp_path / "src" / "big.ckpt").write_text("weights")
    yaml.write_text("workdir: src\nrun: |\n  ls -a\n  test ! -e big.ckpt && cat .git/HEAD\n"
                    "  python3 train.py\n")
    task = load_task(str(yaml))
    beta = SlurmBackend("slurm_beta")
    handle = _submit(beta, task, "sky-test-workdir")
    status = _wait(beta, handle, {JobState.SUCCEEDED, JobState.FAILED})
    log = _log(beta, handle)
    assert status.state == JobState.SUCCEEDED, log
    # .git travels, as in SkyPilot; what .gitignore lists does not
    assert "from workdir" in log and ".git" in log and "ref" in log


def test_a_relative_file_mount_is_in_the_jobs_cwd_beside_the_workdir(slurm, tmp_path):
    """SkyPilot puts a relative destination under its workdir (~/sky_workdir), the cwd of
    setup and run; here SFTP put it in the login user's home."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "train.py").write_text("print('from workdir')\n")
    (tmp_path / "data" / "deep").mkdir(parents=True)
    (tmp_path / "data" / "deep" / "f.txt").write_text("from a dir mount\n")
    (tmp_path / "one.cfg").write_text("from a file mount\n")
    tag = uuid.uuid4().hex[:8]  # the home is shared: names of its own
    rel, conf = f"relative_dir-{tag}", f"conf-{tag}"
    (tmp_path / "task.yaml").write_text(
        f"workdir: src\nfile_mounts:\n  {rel}: data\n  ./{conf}/one.cfg: one.cfg\n"
        f"setup: test -f {rel}/deep/f.txt\n"
        f"run: |\n  test -f {rel}/deep/f.txt && cat {rel}/deep/f.txt {conf}/one.cfg\n"
        "  python3 train.py\n  pwd\n")
    beta = SlurmBackend("slurm_beta")
    handle = _submit(beta, load_task(str(tmp_path / "task.yaml")), "sky-test-relmount")
    status = _wait(beta, handle, {JobState.SUCCEEDED, JobState.FAILED})
    log = _log(beta, handle)
    assert status.state == JobState.SUCCEEDED, log
    assert "from a dir mount\nfrom a file mount\nfrom workdir\n" in log
    assert f"{handle.extra['job_dir']}/workdir\n" in log
    gone = slurm.run("beta", "ls", "-d", f"{HOME}/{rel}", f"{HOME}/{conf}", check=False)
    slurm.run("beta", "rm", "-rf", f"{HOME}/{rel}", f"{HOME}/{conf}", check=False)
    assert gone.returncode != 0 and not gone.stdout.strip(), gone.stdout


def test_cli_show_gpus_and_plan(slurm, capsys, tmp_path):
    assert cli(["show-gpus", "--conn", "slurm_alpha", "--conn", "slurm_beta", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    keyed = {(r["connection"], r["location"], r["accelerator"]): r for r in rows}
    assert keyed[("slurm_alpha", "batch", "A100")]["total"] == 8
    assert keyed[("slurm_beta", "main", "H100")]["free"] == 8
    assert set(rows[0]) >= {"connection", "location", "accelerator", "total", "free", "pending",
                            "price_per_hour"}
    path = tmp_path / "t.yaml"
    path.write_text("resources:\n  accelerators: {A100: 2, H100: 2}\nrun: x\n")
    assert cli(["plan", str(path), "--conn", "slurm_alpha", "--conn", "slurm_beta"]) == 0
    out = capsys.readouterr().out
    assert "*  slurm_alpha  batch" in out and "no H100 in partition batch" in out
    assert cli(["plan", str(path), "--conn", "slurm_alpha", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["chosen"]["connection"] == "slurm_alpha"
    slurm.stop_sshd("beta")
    try:
        assert cli(["show-gpus", "--conn", "slurm_alpha", "--conn", "slurm_beta", "--json"]) == 0
        rows = json.loads(capsys.readouterr().out)
        assert [r["connection"] for r in rows if "error" in r] == ["slurm_beta"]
    finally:
        slurm.start_sshd("beta")


def test_task_sbatch_options_reach_sbatch_one_line_each_and_nothing_runs_from_them(slurm):
    """A value full of shell syntax stays one quoted ``#SBATCH`` word: sbatch sees exactly it,
    and no shell ever runs a piece of it (roadmap step 7, item 6)."""
    beta = SlurmBackend("slurm_beta")
    marker = "/tmp/airflow-skypilot-pwned-sbatch"
    comment = f"it's $(touch {marker}) `touch {marker}` #x ; a  b"
    task = _task("sleep 2", config={"slurm": {"sbatch_options": {
        "comment": comment, "exclusive": True}}})
    handle = _submit(beta, task, "sky-test-sbatch")
    seen = slurm.run("beta", "squeue", "-h", "-j", handle.job_id, "-o", "%k").stdout
    status = _wait(beta, handle, {JobState.SUCCEEDED, JobState.FAILED})
    assert status.state == JobState.SUCCEEDED, _log(beta, handle)
    assert seen.rstrip("\n") == comment
    assert slurm.run("beta", "test", "!", "-e", marker, check=False).returncode == 0
