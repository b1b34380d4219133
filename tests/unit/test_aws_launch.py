"""The AWS backend's launch against moto, in-process: where it launches, what it sends,
what it leaves behind, and whose instances it touches."""

from __future__ import annotations

import json

import boto3
import pytest
from botocore.exceptions import ClientError
from moto import mock_aws

from airflow_skypilot import placement
from airflow_skypilot.backends.aws import AwsBackend
from airflow_skypilot.exceptions import SubmissionError
from airflow_skypilot.spec import load_task

REGION = "us-east-1"
AMI = "ami-12c6146b"  # one of moto's canned AMIs


@pytest.fixture
def aws(monkeypatch):
    """moto in-process, a bucket, and a function making a backend of a connection to it."""
    for var, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                       ("AWS_SESSION_TOKEN", "testing"), ("AWS_DEFAULT_REGION", REGION)):
        monkeypatch.setenv(var, value)
    with mock_aws():
        s3 = boto3.client("s3", region_name=REGION)

        def backend(conn_id: str = "aws_t", bucket: str = "jobs", **extra) -> AwsBackend:
            s3.create_bucket(Bucket=bucket)
            monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps({
                "conn_type": "aws", "extra": {"region_name": REGION, "regions": [REGION],
                                              "s3_bucket": bucket, "ami_id": AMI, **extra}}))
            return AwsBackend(conn_id)

        yield backend


def ec2_instances() -> list[dict]:
    ec2 = boto3.client("ec2", region_name=REGION)
    return [i for r in ec2.describe_instances()["Reservations"] for i in r["Instances"]]


def chosen(backend: AwsBackend, task):
    return placement.rank([o for o in backend.probe(task) if o.fits]).chosen


def refuse_capacity(backend: AwsBackend, azs: set[str]) -> None:
    """EC2 answers RunInstances in ``azs`` with a capacity error (as at a shortage)."""
    def handler(params, **kw):
        az = (params.get("Placement") or {}).get("AvailabilityZone")
        if az in azs:
            raise ClientError({"Error": {"Code": "InsufficientInstanceCapacity",
                                         "Message": f"no capacity in {az}"}}, "RunInstances")
    backend._clients.client("ec2", REGION, attempts=1).meta.events.register(
        "before-parameter-build.ec2.RunInstances", handler)


# --- the zone the task asked for -------------------------------------------------------------


def test_a_task_pinned_to_a_zone_is_not_launched_in_another_when_it_has_no_capacity(aws):
    b = aws()
    task = load_task({"run": "true", "resources": {"cpus": "2",
                                                    "infra": f"aws/{REGION}/us-east-1a"}})
    offer = chosen(b, task)
    refuse_capacity(b, {"us-east-1a"})
    with pytest.raises(SubmissionError) as err:
        b.submit(task, offer, "sky-pin-c0-t1-a0", {})
    assert err.value.retry_elsewhere
    assert [i for i in ec2_instances() if i["State"]["Name"] != "terminated"] == []
    # refused lately: the next try of the same zone is refused without a launch
    with pytest.raises(SubmissionError) as err:
        b.submit(task, offer, "sky-pin-c0-t2-a0", {})
    assert err.value.retry_elsewhere
    assert ec2_instances() == []


def test_a_task_pinned_to_a_region_still_tries_its_other_zones(aws):
    b = aws()
    task = load_task({"run": "true", "resources": {"cpus": "2", "infra": f"aws/{REGION}"}})
    offer = chosen(b, task)
    refuse_capacity(b, {offer.details["az"]})
    handle = b.submit(task, offer, "sky-region-c0-t1-a0", {})
    assert handle.location.split("/")[1] != offer.details["az"]
    assert [i["Placement"]["AvailabilityZone"] for i in ec2_instances()] == \
        [handle.location.split("/")[1]]


def test_a_spot_launch_falls_back_only_to_zones_priced_within_its_max_hourly_cost(aws):
    b = aws()
    task = load_task({"run": "true", "resources": {"cpus": "2", "use_spot": True,
                                                    "max_hourly_cost": 1.0}})
    offer = chosen(b, task)
    first = offer.details["az"]

    def price_elsewhere_up(parsed, **kw):  # the spot price rose in every other AZ
        for item in parsed.get("SpotPriceHistory", []):
            if item["AvailabilityZone"] != first:
                item["SpotPrice"] = "5.0"

    b._clients.client("ec2", REGION).meta.events.register(
        "after-call.ec2.DescribeSpotPriceHistory", price_elsewhere_up)
    refuse_capacity(b, {first})
    with pytest.raises(SubmissionError) as err:
        b.submit(task, offer, "sky-capped-c0-t1-a0", {})
    assert err.value.retry_elsewhere
    assert ec2_instances() == []


# --- a RunInstances whose answer is lost -----------------------------------------------------


class _Http:
    status_code = 200
    headers: dict = {}


def lose_answers(backend: AwsBackend, lose: int) -> list[str]:
    """EC2 acts on RunInstances but the first ``lose`` answers never arrive; a resent
    ClientToken gets the first request's reservation back (EC2's idempotency, which moto
    lacks). Returns the ClientToken of every request sent."""
    from botocore.exceptions import ReadTimeoutError

    ec2 = backend._clients.client("ec2", REGION, attempts=1)
    sent: list[str] = []
    done: dict[str, dict] = {}

    def before(params, context, **kw):
        token = params["body"].get("ClientToken")
        sent.append(token)
        context["token"] = token
        if token in done:
            return _Http(), done[token]
        return None

    def after(http_response, parsed, context, **kw):
        if "Error" not in parsed:
            done.setdefault(context["token"], parsed)
        if len(sent) <= lose:
            raise ReadTimeoutError(endpoint_url=f"https://ec2.{REGION}.amazonaws.com")

    ec2.meta.events.register("before-call.ec2.RunInstances", before)
    ec2.meta.events.register("after-call.ec2.RunInstances", after)
    return sent


def _secret_names() -> list[str]:
    ssm = boto3.client("ssm", region_name=REGION)
    return [p["Name"] for p in ssm.describe_parameters()["Parameters"]]


def test_a_launch_whose_answer_was_lost_is_found_again_by_resending_its_token(aws):
    b = aws(request_timeout=5)
    task = load_task({"run": "true", "resources": {"cpus": "2"},
                      "secrets": {"HF_TOKEN": "hf_x"}})
    sent = lose_answers(b, lose=1)
    handle = b.submit(task, chosen(b, task), "sky-lost-c0-t1-a0", {})
    live = ec2_instances()
    assert len(live) == 1 and handle.extra["instance_ids"] == [live[0]["InstanceId"]]
    assert len(sent) >= 2 and len(set(sent)) == 1  # the same request, resent
    assert _secret_names()  # the job's instance reads them at boot


def test_a_launch_never_answered_keeps_what_its_instances_need_and_is_adopted_later(aws):
    from airflow_skypilot.exceptions import BackendUnreachable

    b = aws(request_timeout=1)
    task = load_task({"run": "true", "resources": {"cpus": "2"},
                      "secrets": {"HF_TOKEN": "hf_x"}})
    sent = lose_answers(b, lose=10**6)
    with pytest.raises(BackendUnreachable):
        b.submit(task, chosen(b, task), "sky-mute-c0-t1-a0", {})
    assert len(sent) >= 2 and len(set(sent)) == 1
    assert len(ec2_instances()) == 1  # launched all the same: one launch
    assert [n for n in _secret_names() if "sky-mute-c0-t1-a0" in n]
    adopted = b.find("sky-mute-c0-t1-a0")
    assert adopted is not None
    assert adopted.extra["instance_ids"] == [ec2_instances()[0]["InstanceId"]]


# --- the user's files stay out of the user-data ----------------------------------------------


def _inline_files(user_data: str) -> bytes:
    """Everything the user-data carries, its inline payloads unpacked (base64 tar.gz)."""
    import base64
    import gzip
    import io
    import re
    import tarfile

    out = [user_data.encode()]
    for block in re.findall(r"<<'?(\w+)'?\n(.*?)\n\1", user_data, re.S):
        try:
            raw = gzip.decompress(base64.b64decode("".join(block[1].split())))
        except Exception:
            continue
        with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
            out += [tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()]
    return b"\n".join(out)


def test_a_credentials_file_mount_is_not_readable_in_the_user_data(aws, tmp_path):
    import base64

    b = aws()
    cred = tmp_path / "kaggle.json"
    cred.write_text('{"username":"me","key":"SUPERSECRETKAGGLEKEY"}')
    work = tmp_path / "work"
    work.mkdir()
    (work / "train.py").write_text("TOKEN = 'WORKDIRSECRET'\n")
    task = load_task({"run": "python train.py", "workdir": str(work),
                      "file_mounts": {"~/.kaggle/kaggle.json": str(cred)}})
    handle = b.submit(task, chosen(b, task), "sky-cred-c0-t1-a0", {})
    ec2 = boto3.client("ec2", region_name=REGION)
    iid = handle.extra["instance_ids"][0]
    attr = ec2.describe_instance_attribute(InstanceId=iid, Attribute="userData")
    seen = _inline_files(base64.b64decode(attr["UserData"]["Value"]).decode())
    assert b"SUPERSECRETKAGGLEKEY" not in seen and b"WORKDIRSECRET" not in seen
    # the instance fetches its files from the job's S3 folder; cancel removes them
    s3 = boto3.client("s3", region_name=REGION)
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket="jobs").get("Contents", [])]
    staged = [k for k in keys if "sky-cred-c0-t1-a0" in k and k.endswith(".tgz")]
    assert staged
    b.cancel(handle)
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket="jobs").get("Contents", [])]
    assert not set(staged) & set(keys)


# --- two connections to one account and region -----------------------------------------------


def test_a_connection_does_not_take_another_connections_job_for_its_own(aws):
    from airflow_skypilot.exceptions import BackendError

    t, u = aws("aws_t", "jobs"), aws("aws_u", "other")
    task = load_task({"run": "true", "resources": {"cpus": "2"}})
    theirs = t.submit(task, chosen(t, task), "sky-two-abc-c0-t1-a0", {})
    assert u.find_all("sky-two-abc-") == []
    assert u.find("sky-two-abc-c0-t1-a0") is None
    assert [h.job_name for h in t.find_all("sky-two-abc-")] == ["sky-two-abc-c0-t1-a0"]
    # a handle of u's that names t's instances (as one adopted before would): its cancel
    # does not take them down, and does not say the job is gone either
    foreign = type(theirs).from_dict({**theirs.to_dict(), "connection": "aws_u"})
    with pytest.raises(BackendError):
        u.cancel(foreign)
    assert {i["State"]["Name"] for i in ec2_instances()} == {"running"}
    t.cancel(theirs)
    assert {i["State"]["Name"] for i in ec2_instances()} <= {"shutting-down", "terminated"}
