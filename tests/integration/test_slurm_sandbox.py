"""The Slurm sandbox behaves like the real clusters the Slurm backend will meet.

Why: every Slurm backend test trusts this sandbox, so its facts (GRES, multi-node addresses,
NODE_FAIL on a dead node, drain, an unreachable login node, host-key pinning) are checked here
against the real daemons, not assumed.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import pwd
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import paramiko
import pytest

from tests.sandbox.slurm import LOGIN_USER, SlurmSandbox

pytestmark = pytest.mark.sandbox


@pytest.fixture(scope="module")
def sandbox() -> SlurmSandbox:
    """One sandbox for the module; `make` stops it, so no down() here."""
    sb = SlurmSandbox()
    sb.up()
    return sb


@pytest.fixture
def slurm(sandbox: SlurmSandbox) -> Iterator[SlurmSandbox]:
    """Each test starts from idle clusters with every daemon running."""
    sandbox.reset()
    yield sandbox


@pytest.fixture
def conn_env(sandbox: SlurmSandbox, monkeypatch: pytest.MonkeyPatch) -> dict[str, dict]:
    """Expose the generated connections to hooks the way Airflow reads env connections."""
    conns = sandbox.connections()
    for conn_id, conn in conns.items():
        monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(conn))
    return conns


def wait_for(pred: Callable[[], object], timeout: float, interval: float = 0.5) -> object:
    """Poll pred until truthy (bounded); returns its value or fails the test."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {timeout}s")
        time.sleep(interval)


def job_fields(sb: SlurmSandbox, cluster: str, job_id: str) -> dict[str, str]:
    """scontrol's view of one job as a dict (JobState, Reason, ExitCode, NodeList...)."""
    out = sb.run(cluster, "scontrol", "-o", "show", "job", job_id).stdout
    return dict(f.split("=", 1) for f in out.split() if "=" in f)


def submit(sb: SlurmSandbox, cluster: str, *args: str, script: str | None = None) -> str:
    """sbatch as the login user; returns the job id."""
    proc = sb.run(cluster, "sbatch", "--parsable", *args, input=script)
    return proc.stdout.strip().split(";")[0]


def ssh_client(conn: dict) -> paramiko.SSHClient:
    """Plain paramiko client pinned to the connection's host key, as a real client would be."""
    extra = conn["extra"]
    key_type, key_data = extra["host_key"].split()[:2]
    client = paramiko.SSHClient()
    key = paramiko.PKey.from_type_string(key_type, base64.b64decode(key_data))
    client.get_host_keys().add(f"[{conn['host']}]:{conn['port']}", key_type, key)
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    client.connect(
        conn["host"],
        port=conn["port"],
        username=conn["login"],
        key_filename=extra["key_file"],
        look_for_keys=False,
        allow_agent=False,
        timeout=10,
    )
    return client


def test_sinfo_shows_partitions_and_gres(slurm: SlurmSandbox) -> None:
    alpha = slurm.run("alpha", "sinfo", "-h", "-o", "%P|%N|%G|%c|%l").stdout.split()
    assert "batch*|a[1-2]|gpu:a100:4|8|infinite" in alpha
    assert "short|a2|gpu:a100:4|8|10:00" in alpha
    beta = slurm.run("beta", "sinfo", "-h", "-o", "%P|%N|%G|%c").stdout.split()
    assert beta == ["main*|b1|gpu:h100:8|8"]
    data = json.loads(slurm.run("alpha", "sinfo", "--json").stdout)
    assert {n["name"] for n in data["nodes"]} == {"a1", "a2"}


def test_two_node_job_runs_on_two_addresses(slurm: SlurmSandbox) -> None:
    out = f"{pwd.getpwnam(LOGIN_USER).pw_dir}/sandbox-test-{uuid.uuid4().hex[:8]}.out"
    script = (
        "#!/bin/bash\n"
        "srun bash -c 'echo $SLURM_NODEID $SLURMD_NODENAME "
        '$(scontrol show node $SLURMD_NODENAME | grep -o "NodeAddr=[^ ]*") '
        "gpus=$CUDA_VISIBLE_DEVICES'\n"
    )
    job = submit(slurm, "alpha", "-N", "2", "--gres=gpu:a100:2", "-o", out, script=script)
    wait_for(lambda: job_fields(slurm, "alpha", job)["JobState"] == "COMPLETED", 30)
    lines = sorted(Path(out).read_text().splitlines())
    Path(out).unlink()
    assert lines == [
        "0 a1 NodeAddr=127.0.1.1 gpus=0,1",
        "1 a2 NodeAddr=127.0.1.2 gpus=0,1",
    ]


def test_too_many_gpus_is_rejected_at_submit(slurm: SlurmSandbox) -> None:
    proc = slurm.run("alpha", "sbatch", "--gres=gpu:a100:5", "--wrap", "true", check=False)
    assert proc.returncode != 0
    assert "Requested node configuration is not available" in proc.stderr
    proc = slurm.run("beta", "sbatch", "--gres=gpu:h100:9", "--wrap", "true", check=False)
    assert proc.returncode != 0


def test_busy_cluster_leaves_job_pending_on_resources(slurm: SlurmSandbox) -> None:
    first = submit(slurm, "beta", "--gres=gpu:h100:8", "-o", "/dev/null", "--wrap", "sleep 60")
    wait_for(lambda: job_fields(slurm, "beta", first)["JobState"] == "RUNNING", 15)
    second = submit(slurm, "beta", "--gres=gpu:h100:1", "-o", "/dev/null", "--wrap", "true")
    time.sleep(3)
    fields = job_fields(slurm, "beta", second)
    assert (fields["JobState"], fields["Reason"]) == ("PENDING", "Resources")
    assert int(first) >= 5000  # beta's job ids never collide with alpha's


def test_finished_jobs_stay_visible(slurm: SlurmSandbox) -> None:
    ok = submit(slurm, "alpha", "-o", "/dev/null", "--wrap", "true")
    bad = submit(slurm, "alpha", "-o", "/dev/null", "--wrap", "exit 3")
    wait_for(lambda: job_fields(slurm, "alpha", bad)["JobState"] == "FAILED", 15)
    wait_for(lambda: job_fields(slurm, "alpha", ok)["JobState"] == "COMPLETED", 15)
    assert job_fields(slurm, "alpha", bad)["ExitCode"] == "3:0"
    rows = slurm.run("alpha", "squeue", "-h", "-t", "all", "-o", "%i|%T").stdout.split()
    assert f"{ok}|COMPLETED" in rows and f"{bad}|FAILED" in rows
    # jobcomp/filetxt: sacct -c works without slurmdbd (plain sacct does not).
    comp = slurm.run("alpha", "sacct", "-c", "-P", "-n", "-j", bad, "-o", "jobid,state,exitcode")
    assert comp.stdout.split() == [f"{bad}|FAILED|3:0"]


def test_kill_slurmd_ends_job_with_node_fail(slurm: SlurmSandbox) -> None:
    marker = f"sleep 29{uuid.uuid4().int % 10}.5"
    victim = submit(slurm, "alpha", "--no-requeue", "-w", "a1", "-o", "/dev/null", "--wrap", marker)
    bystander = submit(
        slurm, "alpha", "--no-requeue", "-w", "a2", "-o", "/dev/null", "--wrap", "sleep 120"
    )
    for job in (victim, bystander):
        wait_for(lambda j=job: job_fields(slurm, "alpha", j)["JobState"] == "RUNNING", 15)
    started = time.monotonic()
    slurm.kill_slurmd("a1")
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert marker not in ps, "the job's processes on a1 must die with the node"
    wait_for(lambda: job_fields(slurm, "alpha", victim)["JobState"] == "NODE_FAIL", 45)
    elapsed = time.monotonic() - started
    print(f"kill_slurmd -> NODE_FAIL in {elapsed:.1f}s")
    assert elapsed < 40
    assert job_fields(slurm, "alpha", bystander)["JobState"] == "RUNNING"
    assert "DOWN" in slurm.run("alpha", "scontrol", "-o", "show", "node", "a1").stdout
    slurm.start_slurmd("a1")  # ReturnToService=2: the node comes back by itself
    wait_for(
        lambda: "State=IDLE " in slurm.run("alpha", "scontrol", "-o", "show", "node", "a1").stdout,
        20,
    )


def test_drained_node_is_not_used(slurm: SlurmSandbox) -> None:
    slurm.drain_node("a1", reason="maintenance")
    sinfo = slurm.run("alpha", "sinfo", "-h", "-N", "-o", "%N|%t").stdout.split()
    assert "a1|drain" in sinfo
    job = submit(slurm, "alpha", "-w", "a1", "-o", "/dev/null", "--wrap", "true")
    time.sleep(3)
    assert job_fields(slurm, "alpha", job)["JobState"] == "PENDING"
    two_nodes = submit(slurm, "alpha", "-N", "2", "-o", "/dev/null", "--wrap", "true")
    time.sleep(1)
    assert job_fields(slurm, "alpha", two_nodes)["JobState"] == "PENDING"
    slurm.resume_node("a1")
    wait_for(lambda: job_fields(slurm, "alpha", job)["JobState"] == "COMPLETED", 20)


def test_stop_and_start_sshd(slurm: SlurmSandbox) -> None:
    conns = slurm.connections()
    alpha, beta = conns["slurm_alpha"], conns["slurm_beta"]
    slurm.stop_sshd("alpha")
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((alpha["host"], alpha["port"]), timeout=5).close()
    ssh_client(beta).close()  # the other login node is unaffected
    slurm.start_sshd("alpha")
    client = ssh_client(alpha)
    _, stdout, _ = client.exec_command("sinfo -h -o %P")
    assert stdout.read().decode().split() == ["batch*", "short"]
    client.close()


def test_ssh_session_env_and_commands_log(slurm: SlurmSandbox) -> None:
    conns = slurm.connections()
    slurm.clear_commands_log("alpha")
    client = ssh_client(conns["slurm_alpha"])
    command = "id -un; echo \"$SLURM_CONF\"; echo 'a\\b'\ncat; exit 5"
    stdin, stdout, stderr = client.exec_command(command)
    stdin.write("from stdin\n")
    stdin.channel.shutdown_write()
    assert stdout.channel.recv_exit_status() == 5
    lines = stdout.read().decode().splitlines()
    assert lines == [LOGIN_USER, str(slurm.slurm_conf("alpha")), "a\\b", "from stdin"]
    sftp = client.open_sftp()
    name = f"sftp-{uuid.uuid4().hex[:8]}.txt"
    with sftp.open(name, "w") as fh:
        fh.write("via sftp")
    assert sftp.stat(name).st_size == 8
    sftp.remove(name)
    sftp.close()
    client.close()
    log = slurm.commands_log("alpha")
    assert log[0] == command  # multi-line command with a backslash, one entry, verbatim
    assert log[1:] == ["/usr/lib/openssh/sftp-server"]
    assert command not in slurm.commands_log("beta")


def test_ssh_submit_on_beta_runs_as_login_user(slurm: SlurmSandbox) -> None:
    client = ssh_client(slurm.connections()["slurm_beta"])
    _, stdout, _ = client.exec_command("sbatch --parsable -o /dev/null --wrap 'id -un'")
    job = stdout.read().decode().strip()
    client.close()
    fields = wait_for(
        lambda: (f := job_fields(slurm, "beta", job))["JobState"] == "COMPLETED" and f, 15
    )
    assert fields["UserId"].startswith(f"{LOGIN_USER}(")  # type: ignore[index]
    assert fields["NodeList"] == "b1"  # type: ignore[index]


def test_sshhook_pins_host_key(
    slurm: SlurmSandbox, conn_env: dict[str, dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    from airflow.providers.ssh.hooks.ssh import SSHHook, SSHHookAsync

    hook = SSHHook(ssh_conn_id="slurm_alpha")
    assert hook.no_host_key_check is False and hook.host_key is not None
    with hook.get_conn() as client:
        code, out, _ = hook.exec_ssh_client_command(
            client, "sinfo -h -o %P:%G", get_pty=False, environment=None
        )
    assert code == 0 and out.decode().split() == ["batch*:gpu:a100:4", "short:gpu:a100:4"]

    code, out, _ = asyncio.run(SSHHookAsync(ssh_conn_id="slurm_beta").run_command("sinfo -h -o %G"))
    assert code == 0 and out.split() == ["gpu:h100:8"]

    wrong = dict(conn_env["slurm_alpha"])
    wrong["extra"] = dict(wrong["extra"], host_key=conn_env["slurm_beta"]["extra"]["host_key"])
    monkeypatch.setenv("AIRFLOW_CONN_SLURM_WRONG", json.dumps(wrong))
    with pytest.raises(paramiko.BadHostKeyException):
        SSHHook(ssh_conn_id="slurm_wrong", conn_timeout=5).get_conn()
    import asyncssh

    with pytest.raises(asyncssh.HostKeyNotVerifiable):
        asyncio.run(SSHHookAsync(ssh_conn_id="slurm_wrong").run_command("true"))


def test_connections_json_imports_into_airflow(sandbox: SlurmSandbox, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env |= {"AIRFLOW_HOME": str(tmp_path), "AIRFLOW__CORE__LOAD_EXAMPLES": "False"}
    airflow = str(Path(sys.executable).with_name("airflow"))

    def cli(*args: str) -> str:
        proc = subprocess.run(
            [airflow, *args], env=env, capture_output=True, text=True, timeout=180, check=False
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout

    cli("db", "migrate")
    cli("connections", "import", str(sandbox.connections_file))
    got = json.loads(cli("connections", "get", "slurm_beta", "-o", "json"))[0]
    want = sandbox.connections()["slurm_beta"]
    assert (got["conn_type"], got["host"], int(got["port"]), got["login"]) == (
        "slurm",
        "127.0.0.1",
        want["port"],
        LOGIN_USER,
    )
    assert got["extra_dejson"]["host_key"] == want["extra"]["host_key"]
    assert got["extra_dejson"]["key_file"] == want["extra"]["key_file"]
