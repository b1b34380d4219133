"""The AWS backend against the AWS sandbox (tests/sandbox/aws): moto over HTTP, instances whose
user-data really runs (with the real AWS CLI inside), spot interruptions, capacity faults and
the Service Quotas stub. Every test leaves no instance running (checked after each test).
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import hashlib
import json
import os
import time
import uuid
from pathlib import Path

import boto3
import pytest

from airflow_skypilot import placement
from airflow_skypilot.backends.aws import AwsBackend
from airflow_skypilot.backends.base import JobState
from airflow_skypilot.cli import main as cli
from airflow_skypilot.exceptions import SubmissionError
from airflow_skypilot.spec import load_task
from tests.conftest import use_connections, wait_for_job, wait_until
from tests.e2e.conftest import shared_dir
from tests.sandbox.aws.config import ACCESS_KEY_ID, BUCKET, SECRET_ACCESS_KEY

pytestmark = pytest.mark.sandbox

CONN = "aws_sandbox"
DONE = {JobState.SUCCEEDED, JobState.FAILED, JobState.PREEMPTED, JobState.INFRA_FAILED,
        JobState.CANCELLED, JobState.LOST}
TRICKY = {
    "SPACES": "a b  c",
    "QUOTES": "it's \"quoted\" `back`",
    "SUBST": "$(touch /tmp/airflow-skypilot-aws-pwned) ${HOME} $HOME",
    "NEWLINES": "line1\nline2\n\nline4",
    "UNICODE": "naïve ☃",
}


@pytest.fixture
def box(aws, monkeypatch):
    """The sandbox with short log/spot intervals; after the test: nothing left running."""
    conn = aws.connections()[CONN]
    conn["extra"] = {**conn["extra"], "log_interval": 1, "spot_check_interval": 1}
    use_connections(monkeypatch, {CONN: conn})
    yield aws
    deadline = time.monotonic() + 15  # the runner kills a terminated instance's processes
    while aws.running_instances() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert aws.running_instances() == []


def _client(box, service: str, region: str = "us-east-1"):
    return boto3.session.Session().client(
        service, region_name=region, endpoint_url=box.endpoint_url(),
        aws_access_key_id=ACCESS_KEY_ID, aws_secret_access_key=SECRET_ACCESS_KEY)


def _name(prefix: str) -> str:
    return f"sky-{prefix}-{uuid.uuid4().hex[:8]}"


def _offer(backend, task, location=None):
    offers = [o for o in backend.probe(task) if o.fits]
    if location:
        offers = [o for o in offers if o.location == location]
    assert offers, "no fitting offer"
    return placement.rank(offers).chosen


def _wait(backend, handle, states=DONE, timeout=90.0):
    return wait_for_job(backend, handle, states, timeout)


def _instances(box, job_name: str, region: str = "us-east-1") -> list[dict]:
    ec2 = _client(box, "ec2", region)
    pages = ec2.describe_instances(
        Filters=[{"Name": "tag:skypilot-airflow:job-name", "Values": [job_name]}])
    return sorted((i for r in pages["Reservations"] for i in r["Instances"]),
                  key=lambda i: i["AmiLaunchIndex"])


def _s3_text(box, key: str) -> str:
    return _client(box, "s3").get_object(Bucket=BUCKET, Key=key)["Body"].read().decode()


# --- placement -----------------------------------------------------------------------------


def test_offers_and_prices_from_the_moto_catalogue(box):
    backend = AwsBackend(CONN)
    task = load_task({"run": "true", "resources": {"accelerators": "A10G:1"}})
    offers = {o.location: o for o in backend.probe(task)}
    expected = set()
    for region in ("us-east-1", "us-west-2"):
        listed = _client(box, "ec2", region).describe_instance_type_offerings(
            LocationType="availability-zone",
            Filters=[{"Name": "instance-type", "Values": ["g5.xlarge"]}])
        expected |= {f"{region}/{o['Location']}" for o in listed["InstanceTypeOfferings"]}
    assert set(offers) == expected and "us-east-1/us-east-1b" in expected
    on_demand = offers["us-east-1/us-east-1b"]
    assert on_demand.fits and on_demand.free_now and on_demand.instance_type == "g5.xlarge"
    assert on_demand.price_per_hour == 1.006 and not on_demand.spot
    assert on_demand.infra == "aws/us-east-1/us-east-1b"
    assert on_demand.nodes_free == 64 and on_demand.gpus_free == 64  # 256 vCPUs / 4
    assert on_demand.details["quota_code"] == "L-DB2E81BA"

    spot_task = load_task({"run": "true", "resources": {"accelerators": "A10G:1",
                                                        "use_spot": True}})
    spot = {o.location: o for o in backend.probe(spot_task)}["us-east-1/us-east-1b"]
    assert spot.fits and spot.spot and spot.price_per_hour == pytest.approx(0.00001)
    assert spot.details["on_demand_price"] == 1.006
    assert spot.details["quota_code"] == "L-3819A6DF"
    plan = placement.rank([on_demand, spot], "cheapest")
    assert plan.chosen is spot

    two = load_task({"num_nodes": 2, "run": "true", "resources": {"accelerators": "A100:8"}})
    p4d = {o.location: o for o in backend.probe(two)}["us-east-1/us-east-1a"]
    assert p4d.instance_type == "p4d.24xlarge" and p4d.price_per_hour == pytest.approx(2 * 21.96)

    never = load_task({"run": "true", "resources": {"accelerators": "A100:16"}})
    reasons = {o.reason for o in backend.probe(never)}
    assert reasons == {"no EC2 instance type has 16 x A100 (at most 8)"}
    h200 = load_task({"run": "true", "resources": {"instance_type": "p5e.48xlarge"}})
    by_loc = {o.location: o for o in backend.probe(h200)}
    assert not by_loc["us-east-1"].fits
    assert by_loc["us-east-1"].reason == "p5e.48xlarge not offered in us-east-1"
    assert by_loc["us-west-2/us-west-2c"].fits


def test_quota_limits_what_can_start(box):
    box.set_quota("L-DB2E81BA", 8)  # G and VT on-demand: 8 vCPUs = two g5.xlarge
    backend = AwsBackend(CONN)
    two = load_task({"num_nodes": 2, "run": "true", "resources": {
        "accelerators": "A10G:1", "infra": "aws/us-east-1/us-east-1a"}})
    (offer,) = backend.probe(two)
    assert offer.fits and offer.free_now and offer.nodes_free == 2 and offer.nodes_total == 2
    three = load_task({"num_nodes": 3, "run": "true", "resources": {
        "accelerators": "A10G:1", "infra": "aws/us-east-1/us-east-1a"}})
    (offer,) = AwsBackend(CONN).probe(three)
    assert not offer.fits
    assert offer.reason == ("needs 12 vCPUs of the G and VT on-demand quota (L-DB2E81BA); the "
                            "quota is 8")
    # Someone else's g5.xlarge takes 4 of the 8 vCPUs: one more fits now, not two.
    ec2 = _client(box, "ec2")
    iid = ec2.run_instances(ImageId="ami-12c6146b", InstanceType="g5.xlarge", MinCount=1,
                            MaxCount=1)["Instances"][0]["InstanceId"]
    try:
        fresh = AwsBackend(CONN)
        (offer,) = fresh.probe(two)
        assert offer.fits and not offer.free_now and offer.nodes_free == 1
        assert "needs 8 vCPUs of the G and VT on-demand quota (L-DB2E81BA), 4 of 8 left" \
            in offer.reason
        with pytest.raises(SubmissionError) as refused:
            fresh.submit(two, offer, _name("quota"), {})
        assert refused.value.retry_elsewhere and "4 of 8 left" in str(refused.value)
        assert _instances(box, "none") == []
    finally:
        ec2.terminate_instances(InstanceIds=[iid])


# --- jobs ----------------------------------------------------------------------------------


def test_job_runs_and_its_exit_code_and_log_come_back(box):
    backend = AwsBackend(CONN)
    task = load_task({
        "resources": {"accelerators": "A10G:1"},
        "envs": TRICKY,
        "setup": 'echo "setup rank=$SKYPILOT_SETUP_NODE_RANK"',
        "run": 'echo "rank=$SKYPILOT_NODE_RANK nodes=$SKYPILOT_NUM_NODES '
               'gpus=$SKYPILOT_NUM_GPUS_PER_NODE task=$SKYPILOT_TASK_ID ips=$SKYPILOT_NODE_IPS"\n'
               "python3 -c \"import json, os; print('ENV=' + json.dumps({k: os.environ[k] for k "
               f"in {sorted(TRICKY)!r}}}))\"\n"
               'echo "cluster=$SKYPILOT_CLUSTER_INFO"',
    })
    name = _name("run")
    handle = backend.submit(task, _offer(backend, task), name, {"SKYPILOT_TASK_ID": "sky-t1"})
    assert not handle.adopted and handle.job_id == name
    assert json.loads(json.dumps(handle.to_dict())) == handle.to_dict()  # JSON-serialisable
    status = _wait(backend, handle)
    text, offset = backend.read_log(handle)
    assert status.state == JobState.SUCCEEDED and status.exit_code == 0, text
    ip = _instances(box, name)[0]["PrivateIpAddress"]
    assert f"rank=0 nodes=1 gpus=1 task=sky-t1 ips={ip}" in text
    assert "setup rank=0" in text and '"cloud": "AWS"' in text
    env_line = next(ln for ln in text.splitlines() if ln.startswith("ENV="))
    assert json.loads(env_line[4:]) == TRICKY
    assert not Path("/tmp/airflow-skypilot-aws-pwned").exists()
    assert _s3_text(box, f"jobs/{name}/rank-0/exit_code").strip() == "0"
    # Offsets: nothing new after the end; a later offset gives the rest.
    assert backend.read_log(handle, offset) == ("", offset)
    tail, end = backend.read_log(handle, 10)
    assert tail == text.encode()[10:].decode() and end == offset
    assert asyncio.run(_read_async(backend, handle, 10)) == (tail, end)
    backend.cleanup(handle)
    instances = _instances(box, name)
    assert instances, "the job's instance is still listed (terminated), else nothing is checked"
    assert all(i["State"]["Name"] == "terminated" for i in instances), instances


async def _read_async(backend, handle, offset):
    try:
        return await backend.aread_log(handle, offset)
    finally:
        await backend.aclose()


def test_two_node_job_gets_ranks_and_both_ips(box):
    backend = AwsBackend(CONN)
    task = load_task({
        "num_nodes": 2,
        "resources": {"accelerators": "A10G:1"},
        "setup": 'echo "setup rank=$SKYPILOT_SETUP_NODE_RANK"',
        "run": 'echo "rank=$SKYPILOT_NODE_RANK of $SKYPILOT_NUM_NODES '
               'ips=$(echo $SKYPILOT_NODE_IPS | tr " " ,)"',
    })
    name = _name("two")
    handle = backend.submit(task, _offer(backend, task), name, {"SKYPILOT_TASK_ID": "t2"})
    status = _wait(backend, handle, timeout=120)
    text, _ = backend.read_log(handle)
    assert status.state == JobState.SUCCEEDED, text
    insts = _instances(box, name)
    assert [i["AmiLaunchIndex"] for i in insts] == [0, 1]
    ips = ",".join(i["PrivateIpAddress"] for i in insts)
    assert handle.extra["instance_ids"] == [i["InstanceId"] for i in insts]
    assert f"rank=0 of 2 ips={ips}" in text and "setup rank=0" in text
    rank1 = _s3_text(box, f"jobs/{name}/rank-1/log")
    assert f"rank=1 of 2 ips={ips}" in rank1 and "setup rank=1" in rank1
    assert sorted(status.nodes) == sorted(ips.split(","))
    # the job's log: rank 0's, then rank 1's with each line prefixed (the job is final)
    rank0 = _s3_text(box, f"jobs/{name}/rank-0/log")
    joined = rank0 + ("" if rank0.endswith("\n") else "\n") + "".join(
        f"(rank 1) {line}" for line in rank1.splitlines(keepends=True))
    assert text == joined
    # from another process (nothing seen by a poll) and in pieces: the same text
    other, pieces, offset = AwsBackend(CONN), [], 0
    while True:
        piece, offset = other.read_log(handle, offset, limit=64)
        if not piece:
            break
        pieces.append(piece)
    assert "".join(pieces) == joined and offset == len(joined.encode())
    middle = len(rank0.encode()) - 5  # across the end of rank 0
    assert other.read_log(handle, middle) == (joined.encode()[middle:].decode(),
                                              len(joined.encode()))
    assert asyncio.run(_read_async(AwsBackend(CONN), handle, middle)) == \
        other.read_log(handle, middle)
    backend.cleanup(handle)


def test_a_rank_that_fails_while_rank_0_sleeps_is_in_the_log_once_the_job_failed(box):
    """Rank 1 fails at once, its error on stderr; rank 0 sleeps on (until the cleanup
    terminates it). The job is FAILED then, and its log and failure tail hold rank 1's
    output, prefixed, while rank 0 still runs; the stream goes on without repeating it."""
    backend = AwsBackend(CONN)
    marks = Path(shared_dir())  # one file per run of each rank's user code
    task = load_task({
        "num_nodes": 2,
        "resources": {"accelerators": "A10G:1"},
        "run": f'touch {marks}/ran-$SKYPILOT_NODE_RANK.$$\n'
               'if [ "$SKYPILOT_NODE_RANK" = 1 ]; then\n'
               '  echo "FAILING 1"; echo "rank1 Traceback: the real error" >&2; exit 1\n'
               'fi\n'
               'echo "rank0 sleeping"; sleep 300',
    })
    name = _name("fail1")
    handle = backend.submit(task, _offer(backend, task), name, {"SKYPILOT_TASK_ID": "tf"})
    try:
        status = _wait(backend, handle, timeout=120)
        text, offset = backend.read_log(handle)
        assert status.state == JobState.FAILED and status.reason == "exit code 1 on rank 1", text
        assert [i["State"]["Name"] for i in _instances(box, name)][0] == "running"  # rank 0
        for line in ("(rank 1) FAILING 1", "(rank 1) rank1 Traceback: the real error"):
            assert line in text.splitlines()
            assert line in backend.read_tail(handle).splitlines()
            # from another process (nothing seen by a poll), and the triggerer's way
            assert line in AwsBackend(CONN).read_tail(handle).splitlines()
            assert line in asyncio.run(_read_async(AwsBackend(CONN), handle, 0))[0]
        # rank 0's own lines: in its next upload (every few seconds), which a loaded machine
        # may not have made when rank 1's failure is read
        deadline = time.monotonic() + 30
        while "rank0 sleeping" not in text.splitlines() and time.monotonic() < deadline:
            time.sleep(1)
            text, _ = backend.read_log(handle)
        assert "rank0 sleeping" in text.splitlines(), text
    finally:
        backend.cleanup(handle)
    # rank 0 terminated: its log is final; what comes next repeats nothing
    wait_until(lambda: all(i["State"]["Name"] == "terminated" for i in _instances(box, name)),
               timeout=30)
    rest, end = AwsBackend(CONN).read_log(handle, offset)
    assert "rank 1" not in rest and "rank0 sleeping" not in rest and end >= offset
    assert AwsBackend(CONN).read_log(handle, end) == ("", end)
    runs = sorted(p.name.split(".")[0] for p in marks.iterdir())
    assert runs == ["ran-0", "ran-1"], runs  # each rank's user code ran once


def test_capacity_error_in_one_az_moves_to_the_next(box):
    box.fail_capacity("g5.xlarge", "us-east-1a")
    backend = AwsBackend(CONN)
    task = load_task({"run": "echo ok", "resources": {"accelerators": "A10G:1"},
                      "secrets": {"TOKEN": "t"}})
    offer = _offer(backend, task, location="us-east-1/us-east-1a")
    box.reset_requests()
    started = time.monotonic()
    handle = backend.submit(task, offer, _name("ice"), {})
    assert time.monotonic() - started < 15  # no long botocore retry of the HTTP 500
    assert handle.location == "us-east-1/us-east-1b" and handle.extra["az"] == "us-east-1b"
    runs = [r for r in box.requests() if r["action"] == "RunInstances" and r["caller"] == "client"]
    assert sum(r["count"] for r in runs) == 2 and sum(r["errors"] for r in runs) == 1
    assert _wait(backend, handle).state == JobState.SUCCEEDED
    backend.cleanup(handle)

    box.fail_capacity("g5.xlarge", "*")
    name = _name("ice-all")
    other = AwsBackend(CONN)
    with pytest.raises(SubmissionError) as refused:
        other.submit(task, offer, name, {})
    text = str(refused.value)
    assert refused.value.retry_elsewhere
    for az in ("us-east-1a", "us-east-1b", "us-east-1c", "us-east-1d", "us-east-1f"):
        assert f"{az}: InsufficientInstanceCapacity" in text
    ssm = _client(box, "ssm")
    assert ssm.get_parameters_by_path(Path=f"/airflow-skypilot/{name}")["Parameters"] == []
    # The same backend (the operator's, for its next offer) skips the AZs refused just now.
    box.reset_requests()
    with pytest.raises(SubmissionError, match="refused g5.xlarge in every AZ"):
        other.submit(task, offer, _name("ice-again"), {})
    assert not [r for r in box.requests() if r["action"] == "RunInstances"]
    box.clear_faults()


def test_spot_interruption_is_preempted(box):
    backend = AwsBackend(CONN)
    task = load_task({"run": "echo started; sleep 120",
                      "resources": {"accelerators": "A10G:1", "use_spot": True}})
    offer = _offer(backend, task)
    assert offer.spot
    handle = backend.submit(task, offer, _name("spot"), {})
    (inst,) = _instances(box, handle.job_name)
    assert inst["InstanceLifecycle"] == "spot"
    _wait(backend, handle, {JobState.RUNNING})
    wait_until(lambda: "started" in backend.read_log(handle)[0], timeout=30,
               what="the job's log to say started")
    box.interrupt_spot(inst["InstanceId"], notice_seconds=3)
    status = _wait(backend, handle, timeout=30)
    assert status.state == JobState.PREEMPTED and status.state.infra_failure
    assert "spot" in status.reason
    backend.cancel(handle)  # the operator cancels on infra failure
    final = _wait(backend, handle, DONE, timeout=30)
    assert final.state.infra_failure
    assert _instances(box, handle.job_name)[0]["State"]["Name"] == "terminated"


def test_secrets_reach_the_job_but_not_user_data_and_are_deleted(box):
    secret = "hf_SECRET value with 'quotes' and $(cmd)\nand a second line"
    digest = hashlib.sha256(secret.encode()).hexdigest()
    backend = AwsBackend(CONN)
    task = load_task({"run": 'printf %s "$HF_TOKEN" | sha256sum; sleep 3',
                      "resources": {"accelerators": "A10G:1"}, "secrets": {"HF_TOKEN": secret}})
    handle = backend.submit(task, _offer(backend, task), _name("secret"), {})
    ssm = _client(box, "ssm")
    path = f"/airflow-skypilot/{handle.job_name}"
    params = ssm.get_parameters_by_path(Path=path)["Parameters"]
    assert [(p["Name"], p["Type"]) for p in params] == [(f"{path}/HF_TOKEN", "SecureString")]
    (inst,) = _instances(box, handle.job_name)
    raw = _client(box, "ec2").describe_instance_attribute(
        InstanceId=inst["InstanceId"], Attribute="userData")["UserData"]["Value"]
    user_data = base64.b64decode(raw)
    assert secret.encode() not in user_data
    assert base64.b64encode(secret.encode()) not in user_data
    assert b"HF_TOKEN" in user_data  # the parameter's name, to fetch it
    status = _wait(backend, handle)
    assert status.state == JobState.SUCCEEDED
    assert digest in backend.read_log(handle)[0]
    backend.cleanup(handle)
    assert ssm.get_parameters_by_path(Path=path)["Parameters"] == []
    rows = {(r["service"], r["action"], r["caller"]) for r in box.requests()}
    assert ("ssm", "GetParameters", f"instance:{inst['InstanceId']}") in rows


def test_large_workdir_is_staged_in_s3(box, tmp_path):
    (tmp_path / "data.bin").write_bytes(os.urandom(40_000))  # does not compress under 16 KB
    digest = hashlib.sha256((tmp_path / "data.bin").read_bytes()).hexdigest()
    (tmp_path / "task.yaml").write_text(
        "resources:\n  accelerators: A10G:1\nworkdir: .\nrun: sha256sum data.bin\n")
    task = load_task(str(tmp_path / "task.yaml"))
    backend = AwsBackend(CONN)
    handle = backend.submit(task, _offer(backend, task), _name("big"), {})
    assert handle.extra["payload_staged"]
    assert _wait(backend, handle).state == JobState.SUCCEEDED
    assert digest in backend.read_log(handle)[0]
    backend.cleanup(handle)
    keys = [o["Key"] for o in _client(box, "s3").list_objects_v2(
        Bucket=BUCKET, Prefix=f"jobs/{handle.job_name}/").get("Contents", [])]
    assert f"jobs/{handle.job_name}/payload.tgz" not in keys
    assert f"jobs/{handle.job_name}/rank-0/log" in keys


def test_a_secret_filled_into_a_file_mount_reaches_the_node_but_not_user_data(box, tmp_path):
    """SkyPilot fills secrets into file_mounts: mounts.sh names the secret, the node reads it
    from SSM (secrets.sh) before it puts the mounts in place."""
    (tmp_path / "cfg.txt").write_text("from a secret path\n")
    backend = AwsBackend(CONN)
    task = load_task({"run": 'cat ~/cfg-"$KEY"/app.txt', "secrets": {"KEY": "s3cr3tval"},
                      "resources": {"cpus": "2+"},
                      "file_mounts": {"~/cfg-$KEY/app.txt": str(tmp_path / "cfg.txt")}})
    handle = backend.submit(task, _offer(backend, task), _name("secret-mount"), {})
    (inst,) = _instances(box, handle.job_name)
    raw = _client(box, "ec2").describe_instance_attribute(
        InstanceId=inst["InstanceId"], Attribute="userData")["UserData"]["Value"]
    boot = base64.b64decode(raw).decode()
    if handle.extra.get("payload_staged"):
        payload = _client(box, "s3").get_object(
            Bucket=BUCKET, Key=f"jobs/{handle.job_name}/payload.tgz")["Body"].read()
    else:  # inline, between the heredoc's lines
        inline = boot.split("<<'AIRFLOW_SKYPILOT_PAYLOAD'\n", 1)[1].split(
            "\nAIRFLOW_SKYPILOT_PAYLOAD\n", 1)[0]
        payload = base64.b64decode("".join(inline.split()))
    files = gzip.decompress(payload)  # the tar's bytes: mounts.sh among them
    assert b"mounts.sh" in files and b'cfg-"$(. ./secrets.sh && printf %s "${KEY}")"' in files
    assert "s3cr3tval" not in boot and b"s3cr3tval" not in files
    assert _wait(backend, handle).state == JobState.SUCCEEDED
    assert "from a secret path" in backend.read_log(handle)[0]
    backend.cleanup(handle)


def test_a_relative_file_mount_is_in_the_nodes_cwd_and_under_sky_workdir(box, tmp_path):
    """SkyPilot puts a relative destination under ~/sky_workdir, its workdir and the cwd of
    setup and run; here it was copied under $HOME, and ~/sky_workdir did not exist."""
    (tmp_path / "data" / "deep").mkdir(parents=True)
    (tmp_path / "data" / "deep" / "f.txt").write_text("from a dir mount\n")
    (tmp_path / "one.cfg").write_text("from a file mount\n")
    backend = AwsBackend(CONN)
    task = load_task({
        "resources": {"cpus": "2+"},
        "file_mounts": {"relative_dir": str(tmp_path / "data"),
                        "./conf/one.cfg": str(tmp_path / "one.cfg")},
        "setup": "test -f relative_dir/deep/f.txt",
        "run": "test -f relative_dir/deep/f.txt && test -f ~/sky_workdir/relative_dir/deep/f.txt"
               " && cat conf/one.cfg && test ! -e ~/relative_dir && "
               'test "$(cd ~/sky_workdir && pwd -P)" = "$(pwd -P)" && echo found-it'})
    handle = backend.submit(task, _offer(backend, task), _name("relmount"), {})
    status = _wait(backend, handle)
    text, _ = backend.read_log(handle)
    assert status.state == JobState.SUCCEEDED, text
    assert "from a file mount" in text and "found-it" in text
    backend.cleanup(handle)


def test_polling_is_batched_one_describe_per_region(box):
    backend = AwsBackend(CONN)
    task = load_task({"run": "sleep 300", "resources": {"accelerators": "A10G:1"}})
    offer = _offer(backend, task)
    handles = [backend.submit(task, offer, _name(f"batch{i}"), {}) for i in range(3)]
    for h in handles:
        _wait(backend, h, {JobState.RUNNING})

    async def polls(n):
        poller = AwsBackend(CONN)
        try:
            return [await poller.astatus(handles) for _ in range(n)]
        finally:
            await poller.aclose()

    box.reset_requests()
    results = asyncio.run(polls(2))
    for statuses in results:
        assert {s.state for s in statuses.values()} == {JobState.RUNNING}
        assert set(statuses) == {h.job_id for h in handles}
    mine = [r for r in box.requests() if r["caller"] == "client"]
    describes = [r for r in mine if r["action"] == "DescribeInstances"]
    assert [(r["region"], r["count"]) for r in describes] == [("us-east-1", 2)]
    lists = sum(r["count"] for r in mine if r["action"] == "ListObjectsV2")
    assert lists == 2  # one listing per poll for every job (one bucket)
    two = load_task({"run": "echo two-ranks; sleep 300", "num_nodes": 2,
                     "resources": {"accelerators": "A10G:1"}})
    handles.append(backend.submit(two, _offer(backend, two), _name("batch-two"), {}))
    _wait(backend, handles[-1], {JobState.RUNNING})

    async def poll_then_logs():  # the shared poller's pattern: the poll's listing is reused
        poller = AwsBackend(CONN)
        try:
            await poller.astatus(handles)
            box.reset_requests()
            return await poller.aread_logs([(h, 0) for h in handles])
        finally:
            await poller.aclose()

    asyncio.run(poll_then_logs())
    mine = [r for r in box.requests() if r["caller"] == "client"]
    assert {r["action"] for r in mine} <= {"GetObject"}, mine
    assert sum(r["count"] for r in mine) == len(handles)  # one ranged read of rank 0 each
    for h in handles:
        backend.cancel(h)


# --- CLI -----------------------------------------------------------------------------------


def _json_out(text: str):
    """The CLI's JSON. Airflow's default logging writes to stdout too (the amazon provider logs
    one info line per client it creates), so skip any log line before the JSON document."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line in ("[", "{", "[]", "{}"))
    return json.loads("\n".join(lines[start:]))


def test_cli_show_gpus_and_plan(box, tmp_path, capsys):
    assert cli(["show-gpus", "--conn", CONN, "--json"]) == 0
    rows = _json_out(capsys.readouterr().out)
    by_key = {(r["location"], r["accelerator"]): r for r in rows}
    a10g = by_key[("us-east-1/us-east-1a", "A10G")]
    assert a10g["connection"] == CONN and a10g["total"] is None and a10g["pending"] is None
    assert a10g["free"] == 64 and a10g["price_per_hour"] == 1.006
    assert a10g["details"]["instance_type"] == "g5.xlarge"
    assert "on-demand" in a10g["details"]["price_basis"]
    assert by_key[("us-east-1/us-east-1a", "A100")]["price_per_hour"] == 21.96
    assert all(r.get("error") is None for r in rows)

    path = tmp_path / "task.yaml"
    path.write_text("resources:\n  accelerators: A10G:1\n  use_spot: true\nrun: echo hi\n")
    assert cli(["plan", str(path), "--conn", CONN, "--json", "--policy", "cheapest"]) == 0
    plan = _json_out(capsys.readouterr().out)
    chosen = plan["chosen"]
    assert chosen["connection"] == CONN and chosen["spot"] is True
    assert chosen["instance_type"] == "g5.xlarge" and chosen["price_per_hour"] > 0
    assert any(r["verdict"] == "chosen" and r["price"] for r in plan["rows"])


def test_cancel_terminates_only_instances_whose_tags_are_the_jobs(box):
    """A handle comes from XCom or a trigger's kwargs: an instance id in it that EC2 shows
    as another job's (or does not show) is refused, never terminated."""
    backend = AwsBackend(CONN)
    task = load_task({"run": "sleep 120", "resources": {"cpus": "2+"}})
    offer = _offer(backend, task)
    mine = backend.submit(task, offer, _name("tags-a"), {})
    other = backend.submit(task, offer, _name("tags-b"), {})
    for handle in (mine, other):
        _wait(backend, handle, {JobState.RUNNING})
    forged = type(mine).from_dict(mine.to_dict())
    forged.extra["instance_ids"] = mine.extra["instance_ids"] + other.extra["instance_ids"] + [
        "i-0123456789abcdef0"]
    # an id EC2 does not show is refused once the launch is past launch_grace (before it,
    # "not shown" may be "not listed yet": the cancel is not confirmed; tested below)
    forged.submitted_at -= 600
    AwsBackend(CONN).cancel(forged)
    assert _wait(backend, mine).state == JobState.CANCELLED
    assert backend.status([other])[other.job_id].state == JobState.RUNNING
    states = {i["State"]["Name"] for i in _instances(box, other.job_name)}
    assert states == {"running"}, states
    backend.cancel(other)
    assert _wait(backend, other).state == JobState.CANCELLED


class _ListingLag:
    """EC2's eventual consistency, as AWS documents it, on the backend's own client: for
    ``seconds`` after a launch DescribeInstances lists none of its instances (by filter) and
    does not know their ids (InvalidInstanceID.NotFound)."""

    def __init__(self, client, seconds: float):
        self.seconds, self.on = seconds, True
        client.meta.events.register("before-call.ec2.DescribeInstances", self._by_id)
        client.meta.events.register("after-call.ec2.DescribeInstances", self._listed)

    def _young(self, inst) -> bool:
        return self.on and time.time() - inst["LaunchTime"].timestamp() < self.seconds

    def _by_id(self, params, **_):
        if self.on and params.get("InstanceIds"):
            from botocore.exceptions import ClientError

            raise ClientError({"Error": {"Code": "InvalidInstanceID.NotFound",
                                         "Message": "does not exist"}}, "DescribeInstances")

    def _listed(self, parsed, **_):
        for res in parsed.get("Reservations", []):
            res["Instances"] = [i for i in res["Instances"] if not self._young(i)]
        parsed["Reservations"] = [r for r in parsed.get("Reservations", []) if r["Instances"]]


def test_a_launch_whose_answer_was_lost_is_not_called_gone_while_ec2_may_not_list_it(box):
    """RunInstances acted on, its answer lost: the placer sweeps the job by name. While EC2
    may not list the instance yet, "none listed" is not "none": the sweep stays until it
    finds the instance and terminates it (it was confirmed 'nothing alive' and left running)."""
    from botocore.exceptions import ReadTimeoutError

    from airflow_skypilot import sweeps
    from airflow_skypilot.exceptions import BackendUnreachable
    from airflow_skypilot.runstate import Sweep

    backend = AwsBackend(CONN)
    task = load_task({"run": "sleep 300", "resources": {"cpus": "2+"}})
    offer = _offer(backend, task)
    name = _name("lost-answer")

    def lost(**_):  # EC2 launched; the answer never came back
        raise ReadTimeoutError(endpoint_url=box.endpoint_url())

    region = offer.details["region"]
    backend._clients.client("ec2", region, attempts=1).meta.events.register(
        "after-call.ec2.RunInstances", lost)
    lag = _ListingLag(backend._clients.client("ec2", region), 600)
    with pytest.raises(BackendUnreachable, match="may have been launched"):
        backend.submit(task, offer, name, {})
    assert len(_instances(box, name)) == 1  # it exists
    sweep = Sweep(connection=CONN, job_name=name, reason="submission cut short")
    with pytest.raises(BackendUnreachable, match="may still show up"):
        sweeps.step(sweep, backend)
    assert sweep.done_at is None
    lag.on = False  # EC2 lists it now
    assert sweeps.step(sweep, backend) and sweep.done_at is not None
    assert {i["State"]["Name"] for i in _instances(box, name)} <= {"shutting-down",
                                                                   "terminated"}


def test_a_launch_in_doubt_that_made_nothing_leaves_no_secret_once_called_none(box):
    """RunInstances never reached EC2 and no answer came: the launch is in doubt, its secrets
    are kept for instances that may boot. Once ``launch_grace`` is past and EC2 lists none,
    "none" is the answer, and the secrets (and the launch's objects) go with it."""
    from botocore.exceptions import ReadTimeoutError

    from airflow_skypilot.exceptions import BackendUnreachable

    backend = AwsBackend(CONN)
    task = load_task({"run": "true", "resources": {"cpus": "2+"},
                      "secrets": {"HF_TOKEN": "hf_never_launched"}})
    offer = _offer(backend, task)
    name = _name("doubt-none")

    def unsent(**_):  # the request never reaches EC2
        raise ReadTimeoutError(endpoint_url=box.endpoint_url())

    backend._clients.client("ec2", offer.details["region"], attempts=1).meta.events.register(
        "before-call.ec2.RunInstances", unsent)
    with pytest.raises(BackendUnreachable, match="may have been launched"):
        backend.submit(task, offer, name, {})
    assert _instances(box, name) == []
    ssm = _client(box, "ssm")
    path = f"/airflow-skypilot/{name}"
    assert [p["Name"] for p in ssm.get_parameters_by_path(Path=path)["Parameters"]] == \
        [f"{path}/HF_TOKEN"]  # kept while in doubt
    with pytest.raises(BackendUnreachable, match="may still show up"):
        backend.find(name)
    assert len(ssm.get_parameters_by_path(Path=path)["Parameters"]) == 1
    backend.settings.launch_grace = 0.0  # the grace is past
    assert backend.find(name) is None
    assert ssm.get_parameters_by_path(Path=path)["Parameters"] == []
    keys = _client(box, "s3").list_objects_v2(
        Bucket=BUCKET, Prefix=backend.settings.job_prefix(name)).get("Contents", [])
    assert keys == []
    assert backend.find(name) is None  # and "none" stays the answer


def test_a_cancel_moments_after_a_launch_that_ec2_does_not_show_yet_is_not_confirmed(box):
    from airflow_skypilot.exceptions import BackendUnreachable

    backend = AwsBackend(CONN)
    task = load_task({"run": "sleep 300", "resources": {"cpus": "2+"}})
    offer = _offer(backend, task)
    handle = backend.submit(task, offer, _name("early-cancel"), {})
    lag = _ListingLag(backend._clients.client("ec2", offer.details["region"]), 600)
    with pytest.raises(BackendUnreachable, match="does not show .* yet: not terminated"):
        backend.cancel(handle)  # it logged "no instance was left" and returned
    assert {i["State"]["Name"] for i in _instances(box, handle.job_name)} <= {"pending",
                                                                             "running"}
    lag.on = False
    backend.cancel(handle)
    assert _wait(backend, handle).state == JobState.CANCELLED
