"""The AWS sandbox itself: moto over HTTP, the instance runner, IMDS, faults, quotas, counters.

Everything goes through the real client libraries (boto3, aiobotocore, the amazon provider's
hooks) and, inside instances, the real AWS CLI.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError

from tests.conftest import wait_until
from tests.sandbox.aws import AwsSandbox
from tests.sandbox.aws.config import ACCESS_KEY_ID, BUCKET, CONN_ID, SECRET_ACCESS_KEY

pytestmark = pytest.mark.sandbox

AMI = "ami-12c6146b"  # any image id: moto does not validate it by default
IMDS = "${AWS_EC2_METADATA_SERVICE_ENDPOINT:-http://169.254.169.254}"
IMDS_HELPERS = f"""#!/bin/bash
set -u
IMDS={IMDS}
TOKEN=$(curl -sf -X PUT "$IMDS/latest/api/token" -H "X-aws-ec2-metadata-token-ttl-seconds: 300")
md() {{ curl -sf -H "X-aws-ec2-metadata-token: $TOKEN" "$IMDS/latest/meta-data/$1"; }}
IID=$(md instance-id)
AZ=$(md placement/availability-zone)
"""


def wait_for(predicate: Callable[[], Any], timeout: float = 30, interval: float = 0.25) -> Any:
    """Poll (sleeping) until predicate returns something truthy; fail after timeout."""
    return wait_until(predicate, timeout, interval, what=f"{predicate} ({timeout}s)")


def alive(pid: int) -> bool:
    """Whether a pid is a live (non-zombie) process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


@pytest.fixture(scope="session")
def aws_sandbox() -> Iterator[AwsSandbox]:
    """One daemon for the session; stopped at the end only if this session started it."""
    sandbox = AwsSandbox()
    was_up = sandbox.is_up()
    sandbox.up()
    yield sandbox
    if not was_up:
        sandbox.down()


@pytest.fixture
def aws(aws_sandbox: AwsSandbox) -> AwsSandbox:
    """A clean sandbox for each test."""
    aws_sandbox.reset()
    return aws_sandbox


def client(sandbox: AwsSandbox, service: str, region: str = "us-east-1", **config: Any) -> Any:
    """A boto3 client with the connection's credentials, talking to the sandbox."""
    return boto3.session.Session().client(
        service,
        region_name=region,
        endpoint_url=sandbox.endpoint_url(),
        aws_access_key_id=ACCESS_KEY_ID,
        aws_secret_access_key=SECRET_ACCESS_KEY,
        config=Config(**config) if config else None,
    )


def instance(ec2: Any, instance_id: str) -> dict[str, Any]:
    return ec2.describe_instances(InstanceIds=[instance_id])["Reservations"][0]["Instances"][0]


def _fetch(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.read().decode()
    except OSError:
        return None


def runner_view(sandbox: AwsSandbox, instance_id: str) -> dict[str, Any] | None:
    return next((i for i in sandbox.instances() if i["instance_id"] == instance_id), None)


def test_gpu_catalog_offerings_spot_prices_and_dlami(aws: AwsSandbox) -> None:
    ec2 = client(aws, "ec2")
    types = {
        t["InstanceType"]: t
        for t in ec2.describe_instance_types(
            InstanceTypes=["g5.xlarge", "p4d.24xlarge", "g6.xlarge", "p5.48xlarge"]
        )["InstanceTypes"]
    }
    gpus = {
        name: (t["GpuInfo"]["Gpus"][0]["Name"], t["GpuInfo"]["Gpus"][0]["Count"])
        for name, t in types.items()
    }
    assert gpus == {
        "g5.xlarge": ("A10G", 1),
        "p4d.24xlarge": ("A100", 8),
        "g6.xlarge": ("L4", 1),
        "p5.48xlarge": ("H100", 8),
    }
    assert types["g5.xlarge"]["VCpuInfo"]["DefaultVCpus"] == 4
    with_gpu = [
        t
        for page in ec2.get_paginator("describe_instance_types").paginate()
        for t in page["InstanceTypes"]
        if "GpuInfo" in t
    ]
    assert len(with_gpu) > 40

    offers = ec2.describe_instance_type_offerings(
        LocationType="availability-zone",
        Filters=[{"Name": "instance-type", "Values": ["g5.xlarge"]}],
    )["InstanceTypeOfferings"]
    zones = {o["Location"] for o in offers}
    assert "us-east-1a" in zones and "us-east-1e" not in zones

    prices = ec2.describe_spot_price_history(
        InstanceTypes=["g5.xlarge"], ProductDescriptions=["Linux/UNIX"]
    )["SpotPriceHistory"]
    assert {p["AvailabilityZone"] for p in prices} == zones
    assert all(float(p["SpotPrice"]) > 0 for p in prices)

    for region in ("us-east-1", "us-west-2"):
        images = client(aws, "ec2", region).describe_images(
            Owners=["amazon"],
            Filters=[
                {"Name": "name", "Values": ["Deep Learning OSS Nvidia Driver AMI GPU PyTorch *"]},
                {"Name": "state", "Values": ["available"]},
            ],
        )["Images"]
        newest = max(images, key=lambda i: i["CreationDate"])
        assert newest["Name"].endswith("(Ubuntu 22.04) 20250715")
        assert newest["OwnerId"] == "898082745236"


def test_user_data_reads_imds_uploads_with_aws_cli_and_shuts_down(aws: AwsSandbox) -> None:
    ec2, s3 = client(aws, "ec2"), client(aws, "s3")
    script = (
        IMDS_HELPERS
        + """
V1=$(curl -s -o /dev/null -w '%{http_code}' "$IMDS/latest/meta-data/instance-id")
DOC=$(curl -sf -H "X-aws-ec2-metadata-token: $TOKEN" \
      "$IMDS/latest/dynamic/instance-identity/document" | grep -c '"region": "us-east-1"')
PUBLIC=$(curl -s -o /dev/null -w '%{http_code}' -H "X-aws-ec2-metadata-token: $TOKEN" \
      "$IMDS/latest/meta-data/public-ipv4")
echo "$IID $AZ $(md local-ipv4) $(md instance-life-cycle) $V1 $DOC $PUBLIC" > result.txt
aws s3 cp result.txt "s3://skypilot-sandbox/jobs/$IID/result.txt"
shutdown -h now
sleep 60
"""
    )
    launched = ec2.run_instances(
        ImageId=AMI,
        InstanceType="g5.xlarge",
        MinCount=1,
        MaxCount=1,
        Placement={"AvailabilityZone": "us-east-1b"},
        UserData=script,
        InstanceInitiatedShutdownBehavior="terminate",
        MetadataOptions={"HttpTokens": "required"},
    )
    iid = launched["Instances"][0]["InstanceId"]
    private_ip = launched["Instances"][0]["PrivateIpAddress"]
    assert private_ip.startswith("127.")

    final = wait_for(lambda: (i := instance(ec2, iid))["State"]["Name"] == "terminated" and i)
    body = s3.get_object(Bucket=BUCKET, Key=f"jobs/{iid}/result.txt")["Body"].read().decode()
    # IMDSv1 is refused (HttpTokens=required), there is no public IPv4.
    assert body.split() == [iid, "us-east-1b", private_ip, "on-demand", "401", "1", "404"]
    assert final["StateReason"]["Code"] == "Client.InstanceInitiatedShutdown"
    view = wait_for(lambda: (v := runner_view(aws, iid)) and v["powered_off"] and v)
    assert not alive(view["pid"])
    assert aws.running_instances() == []


def test_two_instance_launch_runs_two_processes_with_their_own_imds(aws: AwsSandbox) -> None:
    ec2, s3 = client(aws, "ec2"), client(aws, "s3")
    # Each instance serves its id on port 18080 of its own private IP, like separate hosts.
    script = (
        IMDS_HELPERS
        + """
mkdir www && echo "$IID" > www/id
python3 -m http.server 18080 --bind "$(md local-ipv4)" --directory www >/dev/null 2>&1 &
echo "$IID $(md ami-launch-index) $(md local-ipv4)" > me.txt
aws s3api put-object --bucket skypilot-sandbox --key "jobs/multi/$IID" --body me.txt >/dev/null
wait
"""
    )
    launched = ec2.run_instances(
        ImageId=AMI, InstanceType="g6.xlarge", MinCount=2, MaxCount=2, UserData=script
    )
    ids = sorted(i["InstanceId"] for i in launched["Instances"])
    assert len(set(ids)) == 2

    def uploaded() -> list[str]:
        listing = s3.list_objects_v2(Bucket=BUCKET, Prefix="jobs/multi/").get("Contents", [])
        return [o["Key"] for o in listing] if len(listing) == 2 else []

    keys = wait_for(uploaded)
    assert sorted(k.rsplit("/", 1)[1] for k in keys) == ids
    views = [wait_for(lambda i=i: runner_view(aws, i)) for i in ids]
    assert all(alive(v["pid"]) for v in views)
    assert len({v["pid"] for v in views}) == 2
    assert len({v["imds_endpoint"] for v in views}) == 2
    ips = {instance(ec2, i)["PrivateIpAddress"] for i in ids}
    assert len(ips) == 2 and {v["local_ipv4"] for v in views} == ips
    lines = [s3.get_object(Bucket=BUCKET, Key=k)["Body"].read().decode().split() for k in keys]
    assert sorted(line[1] for line in lines) == ["0", "1"]
    for iid in ids:
        ip = instance(ec2, iid)["PrivateIpAddress"]
        url = f"http://{ip}:18080/id"
        served = wait_for(lambda url=url: _fetch(url), timeout=10)
        assert served.strip() == iid

    ec2.terminate_instances(InstanceIds=ids)
    wait_for(lambda: not any(alive(v["pid"]) for v in views), timeout=10)
    assert aws.running_instances() == []


def test_shutdown_with_stop_behaviour_stops_the_instance(aws: AwsSandbox) -> None:
    ec2 = client(aws, "ec2")
    script = "#!/bin/bash\nsudo shutdown -h now\nsleep 60\n"
    iid = ec2.run_instances(
        ImageId=AMI, InstanceType="g5.xlarge", MinCount=1, MaxCount=1, UserData=script
    )["Instances"][0]["InstanceId"]  # default: stop
    final = wait_for(lambda: (i := instance(ec2, iid))["State"]["Name"] == "stopped" and i)
    assert final["StateReason"]["Code"] == "Client.InstanceInitiatedShutdown"
    view = wait_for(lambda: (v := runner_view(aws, iid)) and v["powered_off"] and v)
    assert view["status"] == "killed" and not alive(view["pid"])
    assert aws.running_instances() == []


def test_spot_interruption_notice_then_reclaim(aws: AwsSandbox) -> None:
    ec2 = client(aws, "ec2")
    script = (
        IMDS_HELPERS
        + """
md instance-life-cycle > lifecycle.txt
while true; do
  if curl -sf -H "X-aws-ec2-metadata-token: $TOKEN" "$IMDS/latest/meta-data/spot/instance-action" \
      > action.tmp; then
    mv action.tmp notice.json
  fi
  sleep 0.2
done
"""
    )
    launched = ec2.run_instances(
        ImageId=AMI,
        InstanceType="g5.xlarge",
        MinCount=1,
        MaxCount=1,
        UserData=script,
        InstanceMarketOptions={
            "MarketType": "spot",
            "SpotOptions": {"InstanceInterruptionBehavior": "terminate"},
        },
    )
    iid = launched["Instances"][0]["InstanceId"]
    assert instance(ec2, iid)["InstanceLifecycle"] == "spot"
    view = wait_for(lambda: (v := runner_view(aws, iid)) and v["status"] == "running" and v)
    home = Path(view["dir"]) / "home"
    assert (
        wait_for(
            lambda: (
                (home / "lifecycle.txt").exists() and (home / "lifecycle.txt").read_text().strip()
            )
        )
        == "spot"
    )

    aws.interrupt_spot(iid, notice_seconds=3)
    notice = json.loads(
        wait_for(
            lambda: (home / "notice.json").exists() and (home / "notice.json").read_text(),
            timeout=3,
        )
    )
    assert notice["action"] == "terminate" and notice["time"].endswith("Z")
    assert instance(ec2, iid)["State"]["Name"] == "running"  # still running during the notice

    final = wait_for(
        lambda: (i := instance(ec2, iid))["State"]["Name"] == "terminated" and i, timeout=15
    )
    assert final["StateReason"]["Code"] == "Server.SpotInstanceTermination"
    wait_for(lambda: not alive(view["pid"]), timeout=5)
    assert aws.running_instances() == []


def test_capacity_fault_only_for_that_type_and_az(aws: AwsSandbox) -> None:
    ec2 = client(aws, "ec2", retries={"total_max_attempts": 1})  # 500s are retried
    aws.fail_capacity("p4d.24xlarge", "us-east-1a")

    def launch(instance_type: str, az: str) -> str:
        r = ec2.run_instances(
            ImageId=AMI,
            InstanceType=instance_type,
            MinCount=1,
            MaxCount=1,
            Placement={"AvailabilityZone": az},
        )
        return r["Instances"][0]["InstanceId"]

    with pytest.raises(ClientError) as failure:
        launch("p4d.24xlarge", "us-east-1a")
    error = failure.value.response
    assert error["Error"]["Code"] == "InsufficientInstanceCapacity"
    assert error["ResponseMetadata"]["HTTPStatusCode"] == 500
    assert "us-east-1a" in error["Error"]["Message"]
    assert "us-east-1b" in error["Error"]["Message"]  # AWS suggests the other zones

    assert launch("p4d.24xlarge", "us-east-1b")
    assert launch("g5.xlarge", "us-east-1a")
    aws.clear_faults()
    assert launch("p4d.24xlarge", "us-east-1a")
    rows = [r for r in aws.requests() if r["action"] == "RunInstances"]
    assert sum(r["count"] for r in rows) == 4 and sum(r["errors"] for r in rows) == 1


def test_service_quotas_stub(aws: AwsSandbox) -> None:
    quotas = client(aws, "service-quotas")
    quota = quotas.get_service_quota(ServiceCode="ec2", QuotaCode="L-DB2E81BA")["Quota"]
    assert quota["Value"] == 256.0 and quota["QuotaName"] == "Running On-Demand G and VT instances"
    aws.set_quota("L-DB2E81BA", 32)
    aws.set_quota("L-7212CCBC", 0, region="us-west-2")
    assert (
        quotas.get_service_quota(ServiceCode="ec2", QuotaCode="L-DB2E81BA")["Quota"]["Value"]
        == 32.0
    )
    west = client(aws, "service-quotas", "us-west-2")
    assert (
        west.get_service_quota(ServiceCode="ec2", QuotaCode="L-7212CCBC")["Quota"]["Value"] == 0.0
    )
    assert (
        quotas.get_service_quota(ServiceCode="ec2", QuotaCode="L-7212CCBC")["Quota"]["Value"]
        == 256.0
    )
    codes = {q["QuotaCode"] for q in quotas.list_service_quotas(ServiceCode="ec2")["Quotas"]}
    assert {"L-1216C47A", "L-DB2E81BA", "L-417A185B", "L-3819A6DF", "L-7212CCBC"} <= codes
    with pytest.raises(ClientError) as missing:
        quotas.get_service_quota(ServiceCode="ec2", QuotaCode="L-00000000")
    assert missing.value.response["Error"]["Code"] == "NoSuchResourceException"
    # Other services still get moto's own answer.
    vpc = quotas.list_aws_default_service_quotas(ServiceCode="vpc")["Quotas"]
    assert vpc


def test_ssm_secure_string_read_inside_instance(aws: AwsSandbox) -> None:
    ssm = client(aws, "ssm")
    ssm.put_parameter(Name="/skypilot/hf_token", Value="hf_sandbox_secret", Type="SecureString")
    script = """#!/bin/bash
aws ssm get-parameter --name /skypilot/hf_token --with-decryption \
    --query Parameter.Value --output text > secret.txt
echo done > done.txt
"""
    ec2 = client(aws, "ec2")
    iid = ec2.run_instances(
        ImageId=AMI, InstanceType="m5.large", MinCount=1, MaxCount=1, UserData=script
    )["Instances"][0]["InstanceId"]
    view = wait_for(lambda: (v := runner_view(aws, iid)) and v["exit_code"] is not None and v)
    assert view["exit_code"] == 0
    home = Path(view["dir"]) / "home"
    assert (home / "secret.txt").read_text().strip() == "hf_sandbox_secret"
    # The user-data finished but the instance keeps running, as on EC2.
    assert instance(ec2, iid)["State"]["Name"] == "running"
    rows = {(r["service"], r["action"], r["caller"]) for r in aws.requests()}
    assert ("ssm", "GetParameter", f"instance:{iid}") in rows


def test_request_counter_counts_by_service_action_region(aws: AwsSandbox) -> None:
    aws.reset_requests()
    east, west = client(aws, "ec2"), client(aws, "ec2", "us-west-2")
    for _ in range(3):
        east.describe_instances()
    west.describe_instances()
    client(aws, "s3").list_objects_v2(Bucket=BUCKET, Prefix="jobs/")
    counts = {
        (r["service"], r["action"], r["region"]): r["count"]
        for r in aws.requests()
        if r["caller"] == "client"
    }
    assert counts == {
        ("ec2", "DescribeInstances", "us-east-1"): 3,
        ("ec2", "DescribeInstances", "us-west-2"): 1,
        ("s3", "ListObjectsV2", "us-east-1"): 1,
    }
    assert all(r["caller"] != "sandbox" for r in aws.requests())
    aws.reset_requests()
    assert aws.requests() == []


def test_reset_leaves_nothing_running(aws: AwsSandbox) -> None:
    ec2 = client(aws, "ec2")
    iid = ec2.run_instances(
        ImageId=AMI,
        InstanceType="g5.xlarge",
        MinCount=1,
        MaxCount=1,
        UserData="#!/bin/bash\nsleep 300 & sleep 300\n",
    )["Instances"][0]["InstanceId"]
    view = wait_for(lambda: (v := runner_view(aws, iid)) and v["status"] == "running" and v)
    assert aws.running_instances()
    aws.reset()
    assert not alive(view["pid"])
    assert aws.running_instances() == []
    assert ec2.describe_instances()["Reservations"] == []
    assert client(aws, "s3").head_bucket(Bucket=BUCKET)


def test_airflow_connection_and_hooks_reach_the_sandbox(
    aws: AwsSandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    from airflow.providers.amazon.aws.hooks.base_aws import AwsBaseHook
    from airflow.providers.amazon.aws.hooks.ec2 import EC2Hook
    from airflow.secrets.local_filesystem import load_connections_dict

    conns = aws.connections()
    imported = load_connections_dict(str(aws.state_dir / "connections.json"))
    assert imported[CONN_ID].conn_type == "aws"
    assert imported[CONN_ID].extra_dejson["endpoint_url"] == aws.endpoint_url()
    assert imported[CONN_ID].extra_dejson["regions"] == ["us-east-1", "us-west-2"]
    for name, value in aws.airflow_env().items():
        monkeypatch.setenv(name, value)
    assert json.loads(aws.airflow_env()["AIRFLOW_CONN_AWS_SANDBOX"]) == conns[CONN_ID]
    aws.reset_requests()

    hook = EC2Hook(aws_conn_id=CONN_ID, api_type="client_type")
    assert hook.conn.meta.endpoint_url == aws.endpoint_url()
    iid = hook.conn.run_instances(ImageId=AMI, InstanceType="g5.xlarge", MinCount=1, MaxCount=1)[
        "Instances"
    ][0]["InstanceId"]
    assert hook.get_instance_state(iid) == "running"

    async def async_calls() -> tuple[str, str]:
        base = AwsBaseHook(aws_conn_id=CONN_ID, client_type="ec2", region_name="us-west-2")
        async with await base.get_async_conn() as ec2:
            zones = await ec2.describe_availability_zones()
        state = await EC2Hook(aws_conn_id=CONN_ID, api_type="client_type").get_instance_state_async(
            iid
        )
        return zones["AvailabilityZones"][0]["ZoneName"], state

    zone, state = asyncio.run(async_calls())
    assert (zone, state) == ("us-west-2a", "running")
    rows = {(r["action"], r["region"]) for r in aws.requests() if r["caller"] == "client"}
    assert {
        ("RunInstances", "us-east-1"),
        ("DescribeAvailabilityZones", "us-west-2"),
        ("DescribeInstances", "us-east-1"),
    } <= rows
