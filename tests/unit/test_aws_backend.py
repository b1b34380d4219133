"""The AWS backend's pure parts: user-data, instance type choice, quotas, prices, status map.

The bootstrap script is run for real here, with bash, against stub ``curl`` (IMDS), ``aws``
(S3 into a directory, SSM from files) and ``shutdown`` commands: the sandbox tests run it
against moto and the real AWS CLI.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import shlex
import stat
import subprocess
import tarfile
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from airflow_skypilot.backends.aws import (
    AwsBackend,
    AwsSettings,
    InstanceView,
    Markers,
    QuotaView,
    build_markers,
    judge,
    launch,
    marker_keys,
    parse_instance_types,
    price_catalog,
    quota_class,
    suitable_types,
    vcpus_in_use,
)
from airflow_skypilot.backends.aws import userdata as ud
from airflow_skypilot.backends.aws.logs import decode_log
from airflow_skypilot.backends.aws.offers import RegionState, offers_for
from airflow_skypilot.backends.base import JobState
from airflow_skypilot.backends.common import jobscript
from airflow_skypilot.spec import load_task

TRICKY = {
    "SPACES": "a b  c",
    "QUOTES": "it's \"quoted\" `back`",
    "SUBST": "$(touch /tmp/airflow-skypilot-aws-pwned) ${HOME} $HOME",
    "NEWLINES": "line1\nline2\n\nline4\n",
    "BACKSLASH": "a\\nb\\\\c",
    "UNICODE": "naïve ☃",
    "TABS": "a\tb",
}


# --- canned DescribeInstanceTypes data (shapes as EC2 returns them) -------------------------


def _type(name: str, vcpus: int, mem_gib: float, gpu: tuple[str, int, int] | None = None,
          arch: str = "x86_64") -> dict:
    out = {"InstanceType": name, "VCpuInfo": {"DefaultVCpus": vcpus},
           "MemoryInfo": {"SizeInMiB": int(mem_gib * 1024)},
           "ProcessorInfo": {"SupportedArchitectures": [arch]}}
    if gpu:
        label, count, mem_mib = gpu
        out["GpuInfo"] = {"Gpus": [{"Name": label, "Manufacturer": "NVIDIA", "Count": count,
                                    "MemoryInfo": {"SizeInMiB": mem_mib}}]}
    return out


CANNED = [
    _type("g5.xlarge", 4, 16, ("A10G", 1, 22888)),
    _type("g5.2xlarge", 8, 32, ("A10G", 1, 22888)),
    _type("g5.4xlarge", 16, 64, ("A10G", 1, 22888)),
    _type("g5.12xlarge", 48, 192, ("A10G", 4, 22888)),
    _type("g5.48xlarge", 192, 768, ("A10G", 8, 22888)),
    _type("g6.xlarge", 4, 16, ("L4", 1, 22888)),
    _type("g6f.large", 2, 8, ("L4", 0, 2861)),
    _type("g6f.4xlarge", 16, 64, ("L4", 0, 11444)),
    _type("p4d.24xlarge", 96, 1152, ("A100", 8, 40960)),
    _type("p4de.24xlarge", 96, 1152, ("A100", 8, 81920)),
    _type("p3dn.24xlarge", 96, 768, ("V100", 8, 32768)),
    _type("g5g.xlarge", 4, 8, ("T4g", 1, 16384), arch="arm64"),
    _type("m6i.large", 2, 8),
    _type("m6i.xlarge", 4, 16),
    _type("m6i.2xlarge", 8, 32),
    _type("m6i.4xlarge", 16, 64),
    _type("m6i.metal", 128, 512),
    _type("c6i.xlarge", 4, 8),
]
CATALOG = parse_instance_types(CANNED)


def _req(**resources):
    return load_task({"run": "true", "resources": resources}).candidates[0]


def _price(name: str) -> float | None:
    return price_catalog().prices.get(name)


def _choose(**resources):
    types, why = suitable_types(CATALOG, _req(**resources), price_of=_price)
    return [t.name for t in types], why


def test_gpu_names_from_ec2_gpuinfo():
    assert CATALOG["p4d.24xlarge"].gpu == "A100"
    assert CATALOG["p4de.24xlarge"].gpu == "A100-80GB"
    assert CATALOG["p3dn.24xlarge"].gpu == "V100-32GB"
    assert CATALOG["g5.xlarge"].gpu == "A10G" and CATALOG["g5.xlarge"].gpu_memory_gb == 22.4
    assert CATALOG["g6f.large"].gpus == 0.125 and CATALOG["g6f.4xlarge"].gpus == 0.5
    assert CATALOG["m6i.large"].gpu is None and CATALOG["g5g.xlarge"].arch == "arm64"


@pytest.mark.parametrize("resources, first, why", [
    ({"accelerators": "A10G:1"}, "g5.xlarge", ""),
    ({"accelerators": "A10G:2"}, "g5.12xlarge", ""),  # at least 2: the 4-GPU type
    ({"accelerators": "A10G:1", "cpus": "16+"}, "g5.4xlarge", ""),
    ({"accelerators": "A10G:1", "cpus": "8"}, "g5.2xlarge", ""),  # exactly 8 vCPUs
    ({"accelerators": "A100:8"}, "p4d.24xlarge", ""),
    ({"accelerators": "A100-80GB:8"}, "p4de.24xlarge", ""),
    ({"accelerators": "L4:0.5"}, "g6f.4xlarge", ""),
    ({"accelerators": "L4:1"}, "g6.xlarge", ""),
    ({"accelerators": "A100:16"}, None, "no EC2 instance type has 16 x A100 (at most 8)"),
    ({"accelerators": "H100:8"}, None, "no EC2 instance type has H100"),
    ({"accelerators": "A10G:1", "memory": "1000+"}, None,
     "no EC2 instance type with 1 x A10G has at least 1000 GB of memory"),
    ({}, "m6i.2xlarge", ""),  # SkyPilot's default: 8+ vCPUs
    ({"cpus": 4, "memory": 16}, "m6i.xlarge", ""),
    ({"cpus": "2+"}, "m6i.large", ""),
    ({"cpus": 200}, None, "no m6i instance type has 200 CPUs"),
    ({"instance_type": "c6i.xlarge"}, "c6i.xlarge", ""),
    ({"instance_type": "g5.xlarge", "accelerators": "A100:1"}, None,
     "g5.xlarge has 1 x A10G, not A100"),
    ({"instance_type": "x9.huge"}, None, "unknown EC2 instance type x9.huge"),
])
def test_instance_type_choice(resources, first, why):
    names, reason = _choose(**resources)
    if first is None:
        assert names == [] and reason.startswith(why), reason
    else:
        assert names[0] == first and reason == "", (names, reason)


def test_cheaper_type_first_among_same_gpu_count():
    names, _ = _choose(accelerators="A10G:1")
    assert names[:3] == ["g5.xlarge", "g5.2xlarge", "g5.4xlarge"]
    assert "g5.12xlarge" not in names[:3]


# --- quotas ---------------------------------------------------------------------------------


@pytest.mark.parametrize("itype, cls", [
    ("g5.xlarge", "g"), ("g6e.48xlarge", "g"), ("gr6.4xlarge", "g"), ("vt1.3xlarge", "g"),
    ("p4d.24xlarge", "p"), ("p6-b200.48xlarge", "p"), ("m6i.large", "standard"),
    ("c7g.xlarge", "standard"), ("t3.micro", "standard"), ("inf2.xlarge", None),
    ("trn1.32xlarge", None), ("x2idn.16xlarge", None), ("dl1.24xlarge", None),
    ("f1.2xlarge", None),
])
def test_quota_class(itype, cls):
    assert quota_class(itype) == cls


def test_quota_arithmetic():
    running = [
        {"InstanceType": "p4d.24xlarge", "State": {"Name": "running"}},
        {"InstanceType": "g5.xlarge", "State": {"Name": "pending"}},
        {"InstanceType": "g5.xlarge", "State": {"Name": "running"},
         "InstanceLifecycle": "spot"},
        {"InstanceType": "g5.xlarge", "State": {"Name": "terminated"}},  # not counted
        {"InstanceType": "m6i.large", "State": {"Name": "running"},
         "CpuOptions": {"CoreCount": 1, "ThreadsPerCore": 2}},
    ]
    used = vcpus_in_use(running, lambda t: CATALOG[t].vcpus)
    assert used == {("p", False): 96, ("g", False): 4, ("g", True): 4, ("standard", False): 2}
    p = QuotaView("p", False, "L-417A185B", limit=128, used=used[("p", False)])
    assert p.room == 32 and p.nodes(96) == (0, 1)
    assert p.describe(192) == ("needs 192 vCPUs of the P on-demand quota (L-417A185B), "
                               "32 of 128 left")
    g = QuotaView("g", True, "L-3819A6DF", limit=64, used=4)
    assert g.nodes(4) == (15, 16) and g.label == "G and VT spot"
    assert QuotaView("g", False, None, limit=None).nodes(4) == (None, None)


# --- prices ---------------------------------------------------------------------------------


def test_price_catalog_names_its_source_and_date():
    catalog = price_catalog()
    assert "aws.amazon.com/ec2/pricing" in catalog.source
    assert time.strptime(catalog.as_of, "%Y-%m-%d")
    assert catalog.prices["g5.xlarge"] == 1.006 and catalog.prices["m6i.2xlarge"] == 0.384
    assert all(p > 0 for p in catalog.prices.values())
    price, source = catalog.price("us-east-1", "p4d.24xlarge")
    assert price and catalog.as_of in source
    price, source = catalog.price("eu-west-1", "g5.xlarge")
    assert price == 1.006 and "may differ" in source
    assert catalog.price("us-east-1", "p6-b300.48xlarge")[0] is None
    # The file ships with the package (pyproject package-data has **/*.json).
    data = Path(__file__).resolve().parents[2] / "airflow_skypilot/backends/aws/data" \
        / "aws_prices.json"
    raw = json.loads(data.read_text())
    assert {"source", "as_of", "prices", "regions"} <= set(raw)


def test_price_override_and_estimate():
    backend = AwsBackend("x", settings=AwsSettings(regions=["us-east-1"],
                                                   prices={"g5.xlarge": 0.5}))
    assert backend.on_demand_price("us-east-1", CATALOG["g5.xlarge"])[0] == 0.5
    catalog = dict(CATALOG)
    odd = parse_instance_types([_type("g5.96xlarge", 384, 1536, ("A10G", 16, 22888))])
    catalog.update(odd)
    price, source = backend.on_demand_price("us-east-1", odd["g5.96xlarge"], catalog)
    assert source.startswith("estimated") and "not in the shipped catalog" in source
    assert price == pytest.approx(16 * 1.006)  # the cheapest A10G per GPU, times 16
    unknown = parse_instance_types([_type("zz1.large", 2, 4, ("Nope", 1, 1024))])["zz1.large"]
    assert backend.on_demand_price("us-east-1", unknown, {**catalog, "zz1.large": unknown})[0] \
        is None


# --- settings -------------------------------------------------------------------------------


def test_settings_from_extras():
    s = AwsSettings.from_extra({
        "region_name": "eu-west-1", "s3_bucket": "b", "s3_prefix": "/x/y",
        "subnet_id": {"eu-west-1": "subnet-1,subnet-2", "default": ["subnet-9"]},
        "security_group_ids": "sg-1", "ami_id": {"eu-west-1": "ami-1"},
        "instance_profile": "role", "max_price_per_hour": "12.5", "boot_seconds": 90,
        "ssm_prefix": "secrets/sky/",
    })
    assert s.regions == ["eu-west-1"] and s.s3_prefix == "x/y/"
    assert s.pick(s.subnet_id, "eu-west-1") == ["subnet-1", "subnet-2"]
    assert s.pick(s.subnet_id, "us-east-1") == ["subnet-9"]
    assert s.pick(s.security_group_ids, "anywhere") == ["sg-1"]
    assert s.pick(s.ami_id, "us-east-1") is None and s.pick(s.ami_id, "eu-west-1") == "ami-1"
    assert s.max_price_per_hour == 12.5 and s.boot_seconds == 90
    assert s.ssm_prefix == "/secrets/sky" and s.ami_name_pattern == "Deep Learning*GPU*"
    assert AwsSettings.from_extra({"regions": ["a", "b"]}).regions == ["a", "b"]


# --- offers from a region's state (no AWS) ---------------------------------------------------


def _state(quotas=None, spot=None, offered=None, subnets=None) -> RegionState:
    return RegionState(
        region="us-east-1", catalog=CATALOG,
        offered=offered or {n: {"us-east-1a", "us-east-1b"} for n in CATALOG},
        spot_prices=spot or {}, quotas=quotas or {}, subnet_azs=subnets, now=1000.0)


def _offers(task_spec, state, **settings):
    backend = AwsBackend("aws_x", settings=AwsSettings(regions=["us-east-1"], **settings))
    task = load_task({"run": "true", **task_spec})
    req = task.candidates[0]
    types, why = suitable_types(CATALOG, req, price_of=_price)
    return offers_for(backend.conn_id, backend.settings, task, req, state, types, why)


def test_offers_carry_price_quota_and_start():
    quotas = {("g", False): QuotaView("g", False, "L-DB2E81BA", limit=64, used=52)}
    offers = _offers({"resources": {"accelerators": "A10G:1"}, "num_nodes": 2},
                     _state(quotas=quotas))
    assert [o.location for o in offers] == ["us-east-1/us-east-1a", "us-east-1/us-east-1b"]
    o = offers[0]
    assert o.fits and o.instance_type == "g5.xlarge" and o.infra == "aws/us-east-1/us-east-1a"
    assert o.price_per_hour == pytest.approx(2 * 1.006) and not o.spot
    assert o.nodes_free == 3 and o.nodes_total == 16 and o.gpus_free == 3
    assert o.free_now and o.est_start == 1000.0 + 120.0
    assert o.details["quota_code"] == "L-DB2E81BA"


def test_the_azs_of_one_quota_hold_each_others_placements_made_moments_ago():
    # us-east-1a and 1b draw on the region's one G quota: a launch decided in 1a moments ago
    # takes the room 1b shows too (the ledger); the spot quota is another group
    from airflow_skypilot.backends.aws.offers import share_quotas
    from airflow_skypilot.ledger import hold

    quotas = {("g", False): QuotaView("g", False, "L-DB2E81BA", limit=8, used=0),
              ("g", True): QuotaView("g", True, "L-3819A6DF", limit=8, used=0)}
    spot = {("g5.xlarge", "us-east-1a"): 0.35, ("g5.xlarge", "us-east-1b"): 0.36}
    state = _state(quotas=quotas, spot=spot)
    a, b = share_quotas(_offers({"resources": {"accelerators": "A10G:1"}}, state))
    assert a.shares_capacity_with == [b.place_key] and b.shares_capacity_with == [a.place_key]
    assert (a.nodes_free, b.nodes_free) == (2, 2)  # 8 vCPUs of quota, 4 a g5.xlarge
    entries = [{"copy": f"t{i}", "place": a.place_key, "gpus": 1, "nodes": 1, "at": 1000.0}
               for i in range(2)]
    hold([a, b], entries, probe_began=1000.0)
    assert (a.free_now, b.free_now) == (False, False)  # both launches take the region's quota
    # mixed: on-demand and spot offers of the same AZs link within their own quota only
    mixed = share_quotas(
        _offers({"resources": {"accelerators": "A10G:1"}}, state)
        + _offers({"resources": {"accelerators": "A10G:1", "use_spot": True}}, state))
    assert [(o.spot, o.shares_capacity_with) for o in mixed] == [
        (False, [b.place_key]), (False, [a.place_key]),
        (True, [b.place_key]), (True, [a.place_key])]


def test_offer_not_free_when_quota_used_and_no_fit_when_quota_too_small():
    quotas = {("p", False): QuotaView("p", False, "L-417A185B", limit=128, used=96)}
    offer = _offers({"resources": {"accelerators": "A100:8"}}, _state(quotas=quotas))[0]
    assert offer.fits and not offer.free_now and offer.est_start is None
    assert "needs 96 vCPUs of the P on-demand quota (L-417A185B), 32 of 128 left" in offer.reason
    assert offer.details["estimate"] == "unknown"  # as every backend says an unknown start
    assert offer.notes[-1] == f"start unknown: {offer.reason}"
    quotas = {("p", False): QuotaView("p", False, "L-417A185B", limit=64, used=0)}
    offer = _offers({"resources": {"accelerators": "A100:8"}}, _state(quotas=quotas))[0]
    assert not offer.fits
    assert offer.reason == "needs 96 vCPUs of the P on-demand quota (L-417A185B); the quota is 64"


def test_spot_offers_use_the_spot_price_and_say_when_there_is_none():
    spot = {("g5.xlarge", "us-east-1a"): 0.35}
    offers = _offers({"resources": {"accelerators": "A10G:1", "use_spot": True}},
                     _state(spot=spot))
    by_loc = {o.location: o for o in offers}
    a = by_loc["us-east-1/us-east-1a"]
    assert a.fits and a.spot and a.price_per_hour == 0.35
    assert a.details["on_demand_price"] == 1.006 and a.details["spot_price"] == 0.35
    assert a.est_start == 1120.0 and a.nodes_free is None  # no quota known: expect a launch
    b = by_loc["us-east-1/us-east-1b"]
    assert not b.fits and "no spot price for g5.xlarge in us-east-1b" in b.reason


def test_no_fit_reasons():
    offers = _offers({"resources": {"accelerators": "A100:16"}}, _state())
    assert offers[0].reason == "no EC2 instance type has 16 x A100 (at most 8)"
    offers = _offers({"resources": {"accelerators": "A10G:1"}},
                     _state(offered={"p4d.24xlarge": {"us-east-1a"}}))
    assert not offers[0].fits and "not offered in us-east-1" in offers[0].reason
    offers = _offers({"resources": {"accelerators": "A10G:1"}}, _state(),
                     max_price_per_hour=0.5)
    assert not offers[0].fits and "max_price_per_hour $0.5" in offers[0].reason
    offers = _offers({"resources": {"accelerators": "A10G:1", "infra": "aws/us-east-1/us-east-1c"}},
                     _state())
    assert len(offers) == 1 and not offers[0].fits
    assert offers[0].location == "us-east-1/us-east-1c"
    offers = _offers({"resources": {"accelerators": "A10G:1"}},
                     _state(subnets={"us-east-1b": "subnet-1"}))
    assert [o.location for o in offers] == ["us-east-1/us-east-1b"]


def test_probe_explains_what_aws_cannot_run(monkeypatch):
    backend = AwsBackend("aws_x", settings=AwsSettings(regions=["us-east-1", "us-west-2"]))
    monkeypatch.setattr(backend, "_probe_region", lambda *a: pytest.fail("no AWS call"))
    task = load_task({"run": "true", "resources": {"image_id": "docker:ubuntu"}})
    (offer,) = backend.probe(task)
    assert not offer.fits and "docker" in offer.reason
    task = load_task({"run": "true", "resources": {"infra": "aws/eu-west-1"}})
    (offer,) = backend.probe(task)
    assert "names no region of connection aws_x (us-east-1,us-west-2)" in offer.reason
    task = load_task({"run": "true", "resources": {"infra": "k8s"}})
    assert backend.probe(task) == []  # another cloud's candidate


# --- status mapping -------------------------------------------------------------------------


def _inst(rank, state, spot=False, code="", tags=None):
    return InstanceView(instance_id=f"i-{rank}", rank=rank, state=state, spot=spot,
                        reason_code=code, reason="", launch_time=100.0,
                        private_ip=f"10.0.0.{rank + 1}", reservation_id="r-1", tags=tags or {})


def _markers(**kw):
    return Markers(**kw)


STATUS_TABLE = [
    # (nodes, spot, instances, markers, expected state, exit code, reason contains)
    (1, False, [_inst(0, "pending")], {}, JobState.PENDING, None, ""),
    (1, False, [_inst(0, "running")], {}, JobState.RUNNING, None, ""),
    (2, False, [_inst(0, "running"), _inst(1, "pending")], {}, JobState.PENDING, None,
     "1 of 2"),
    (1, False, [_inst(0, "running")], {"exit_codes": {0: 0}}, JobState.SUCCEEDED, 0, ""),
    (1, False, [_inst(0, "terminated")], {"exit_codes": {0: 0}}, JobState.SUCCEEDED, 0, ""),
    (1, False, [], {"exit_codes": {0: 0}}, JobState.SUCCEEDED, 0, ""),  # EC2 forgot it
    (1, False, [_inst(0, "terminated")], {"exit_codes": {0: 3}}, JobState.FAILED, 3,
     "exit code 3"),
    (2, False, [_inst(0, "running"), _inst(1, "terminated")], {"exit_codes": {1: 7}},
     JobState.FAILED, 7, "exit code 7 on rank 1"),
    (2, False, [_inst(0, "running"), _inst(1, "terminated")], {"exit_codes": {1: 0}},
     JobState.RUNNING, None, ""),
    (1, False, [_inst(0, "terminated", code="Client.UserInitiatedShutdown")], {},
     JobState.INFRA_FAILED, None, "without an exit code"),
    (1, False, [_inst(0, "stopped")], {}, JobState.INFRA_FAILED, None, "stopped"),
    (1, True, [_inst(0, "terminated", spot=True, code="Server.SpotInstanceTermination")], {},
     JobState.PREEMPTED, None, "spot instance reclaimed"),
    (1, True, [_inst(0, "running", spot=True)], {"preempted": {0: "{...}"}},
     JobState.PREEMPTED, None, "spot interruption notice on rank 0"),
    (1, False, [_inst(0, "running")], {"errors": {0: "cannot read secrets"}},
     JobState.INFRA_FAILED, None, "bootstrap failed on rank 0: cannot read secrets"),
    (1, False, [_inst(0, "terminated", tags={"skypilot-airflow:cancelled": "1"})], {},
     JobState.CANCELLED, None, "cancelled"),
    (1, True, [_inst(0, "terminated", spot=True, tags={"skypilot-airflow:cancelled": "1"})],
     {"preempted": {0: ""}}, JobState.PREEMPTED, None, "spot interruption notice"),
    (1, True, [_inst(0, "terminated", spot=True, code="Server.SpotInstanceTermination",
                     tags={"skypilot-airflow:cancelled": "1"})], {}, JobState.PREEMPTED, None,
     "reclaimed"),
    (1, False, [], {}, JobState.LOST, None, "no instance"),
    (2, False, [_inst(0, "terminated"), _inst(1, "terminated")],
     {"exit_codes": {0: 2}, "aborted": {1}}, JobState.FAILED, 2, "exit code 2 on rank 0"),
]


@pytest.mark.parametrize("nodes, spot, instances, markers, state, code, reason", STATUS_TABLE)
def test_status_mapping(nodes, spot, instances, markers, state, code, reason):
    status = judge(nodes, spot, instances, _markers(**markers), now=200.0)
    assert status.state == state, status
    assert status.exit_code == code
    assert reason in status.reason
    if state.terminal:
        assert status.ended_at == 200.0
    if instances:
        assert status.started_at == 100.0


def test_markers_from_s3_keys():
    keys = ["rank-0/log", "rank-0/exit_code", "rank-1/exit_code", "rank-1/preempted",
            "rank-2/bootstrap_error", "handle.json", "rank-0/setup_done", "rank-3/aborted"]
    found = marker_keys(keys)
    assert {(r, n) for _, r, n in found} == {(0, "exit_code"), (1, "exit_code"),
                                             (1, "preempted"), (2, "bootstrap_error"),
                                             (0, "setup_done"), (3, "aborted")}
    m = build_markers(found, {"rank-0/exit_code": "0\n", "rank-1/exit_code": "137\n",
                              "rank-2/bootstrap_error": "IMDS unreachable\n"})
    assert m.exit_codes == {0: 0, 1: 137} and m.errors == {2: "IMDS unreachable"}
    assert m.preempted == {1: ""} and m.aborted == {3} and m.setup_done == {0}


def test_a_terminal_status_ends_when_aws_recorded_it():
    """Every poll gives the same ended_at: the deciding marker's time, the cancel's, the
    instance's transition; the job's newest object, or now, only when nothing says."""
    m = Markers(exit_codes={0: 0, 1: 0}, written={(0, "exit_code"): 150.0,
                                                 (1, "exit_code"): 160.0}, last_write=170.0)
    two = [_inst(0, "terminated"), _inst(1, "terminated")]
    assert judge(2, False, two, m, now=200.0).ended_at == 160.0
    assert judge(2, False, two, m, now=900.0).ended_at == 160.0
    m = Markers(exit_codes={1: 7}, written={(1, "exit_code"): 155.0})
    one_left = [_inst(0, "running"), _inst(1, "terminated")]
    assert judge(2, False, one_left, m, now=200.0).ended_at == 155.0
    m = Markers(errors={0: "x"}, written={(0, "bootstrap_error"): 120.0})
    assert judge(1, False, two[:1], m, now=200.0).ended_at == 120.0
    m = Markers(preempted={0: ""}, written={(0, "preempted"): 130.0})
    assert judge(1, True, [_inst(0, "running", spot=True)], m, now=200.0).ended_at == 130.0
    tagged = _inst(0, "terminated", tags={"skypilot-airflow:cancelled":
                                          launch.cancelled_tag_value(140.25)})
    st = judge(1, False, [tagged], Markers(), now=200.0)
    assert (st.state, st.ended_at) == (JobState.CANCELLED, 140.25)
    from airflow_skypilot.backends.aws.ec2 import transition_time

    when = transition_time("User initiated (2024-05-01 12:00:00 GMT)")
    assert when == 1714564800.0 and transition_time("") is None
    reclaimed = _inst(0, "terminated", spot=True, code="Server.SpotInstanceTermination")
    reclaimed.transition_time = when
    assert judge(1, True, [reclaimed], Markers(last_write=99.0), now=200.0).ended_at == when
    old_tag = _inst(0, "terminated", tags={"skypilot-airflow:cancelled": "1"})
    assert judge(1, False, [old_tag], Markers(last_write=99.0), now=200.0).ended_at == 99.0
    assert judge(1, False, [], Markers(last_write=98.0), now=200.0).ended_at == 98.0



def test_instances_not_listed_yet_right_after_the_launch_are_unknown_not_lost():
    """DescribeInstances is eventually consistent: within the grace of the launch, a job
    whose instances EC2 does not list yet is UNKNOWN (its backend cannot tell), then LOST."""
    from airflow_skypilot.backends.aws.status import judge_handle
    from airflow_skypilot.backends.base import JobHandle

    soon = judge(1, False, [], Markers(), now=200.0, launched_at=150.0, grace=120.0)
    assert soon.state == JobState.UNKNOWN and not soon.state.terminal
    assert "eventually consistent" in soon.reason
    assert judge(1, False, [], Markers(), now=300.0, launched_at=150.0,
                 grace=120.0).state == JobState.LOST
    done = Markers(exit_codes={0: 0}, written={(0, "exit_code"): 190.0})
    assert judge(1, False, [], done, now=200.0, launched_at=150.0,
                 grace=120.0).state == JobState.SUCCEEDED  # the markers speak for it
    handle = JobHandle(backend="aws", connection="c", job_id="j", job_name="j",
                       location="us-east-1/us-east-1a", infra="aws/us-east-1/us-east-1a",
                       submitted_at=150.0, extra={"reservation_id": "r-new"})
    older = [_inst(0, "terminated")]  # an earlier launch under the same name (r-1)
    assert judge_handle(handle, older, Markers(), grace=120.0,
                        now=200.0).state == JobState.UNKNOWN  # never another launch's
    assert judge_handle(handle, older, Markers(), grace=120.0,
                        now=400.0).state == JobState.LOST


def test_aws_saying_it_cannot_answer_now_is_unreachable():
    from airflow_skypilot.backends.aws.clients import AwsClients, is_unreachable
    from airflow_skypilot.exceptions import BackendUnreachable

    class _Err(Exception):
        def __init__(self, code):
            super().__init__(code)
            self.response = {"Error": {"Code": code, "Message": "m"}}

    for code in ("RequestLimitExceeded", "InternalError", "ServiceUnavailable", "SlowDown"):
        assert is_unreachable(_Err(code))
        assert isinstance(AwsClients("c").error(_Err(code), "x"), BackendUnreachable)
    for code in ("InsufficientInstanceCapacity", "UnauthorizedOperation", "NoSuchKey"):
        assert not is_unreachable(_Err(code))
        assert not isinstance(AwsClients("c").error(_Err(code), "x"), BackendUnreachable)

class _S3Error(Exception):
    def __init__(self, code):
        super().__init__(code)
        self.response = {"Error": {"Code": code, "Message": code}}


class _FakeS3:
    """S3 as the backend uses it: paginated, ordered listings (``page`` keys a page) and
    ranged reads; every request is recorded."""

    def __init__(self, objects: dict[str, bytes], page: int = 3):
        self.objects, self.page, self.calls = dict(objects), page, []
        self.modified = {k: 1000.0 + i for i, k in enumerate(sorted(objects))}

    def get_paginator(self, name):
        s3 = self

        class Paginator:
            def paginate(self, Bucket, Prefix="", StartAfter=""):
                keys = sorted(k for k in s3.objects if k.startswith(Prefix) and k > StartAfter)
                for i in range(0, max(len(keys), 1), s3.page):
                    s3.calls.append(("list", Prefix, StartAfter))
                    chunk = keys[i:i + s3.page]
                    yield {"Contents": [{
                        "Key": k, "ETag": f"e{len(s3.objects[k])}", "Size": len(s3.objects[k]),
                        "LastModified": datetime.fromtimestamp(s3.modified[k], timezone.utc)}
                        for k in chunk]}
        return Paginator()

    def get_object(self, Bucket, Key, Range=None):
        self.calls.append(("get", Key, Range))
        if Key not in self.objects:
            raise _S3Error("NoSuchKey")
        data = self.objects[Key]
        if Range and Range.startswith("bytes=-"):  # a suffix range: the last bytes
            return {"Body": io.BytesIO(data[-int(Range.removeprefix("bytes=-")):])}
        if Range:
            start, _, end = Range.removeprefix("bytes=").partition("-")
            if int(start) >= len(data):
                raise _S3Error("InvalidRange")
            data = data[int(start):int(end) + 1 if end else None]
        return {"Body": io.BytesIO(data)}


class _FakeClients:
    def __init__(self, s3):
        self.s3 = s3

    def client(self, service, region, attempts=3):
        assert service == "s3"
        return self.s3

    def error(self, exc, what):
        from airflow_skypilot.exceptions import BackendError

        return BackendError(f"{what}: {exc}")


def _aws_handle(name, nodes=1):
    from airflow_skypilot.backends.base import JobHandle

    return JobHandle(backend="aws", connection="c", job_id=name, job_name=name,
                     location="us-east-1/us-east-1a", infra="aws/us-east-1/us-east-1a",
                     num_nodes=nodes, extra={"bucket": "b", "prefix": f"jobs/{name}/"})


def test_one_listing_reads_the_markers_of_every_job():
    from airflow_skypilot.backends.aws.status import MarkerReader, listing_call

    objects = {f"jobs/old-{i}/rank-0/exit_code": b"0\n" for i in range(4)}  # other jobs
    objects.update({f"jobs/job-z{i}/rank-0/log": b"x" for i in range(4)})
    objects.update({"jobs/job-a/rank-0/log": b"hello\n", "jobs/job-a/rank-0/exit_code": b"3\n",
                    "jobs/job-b/rank-0/log": b"hi\n", "jobs/job-b/handle.json": b"{}",
                    "jobs/job-c/rank-0/setup_done": b"0\n", "jobs/job-bb/rank-0/log": b"",
                    "jobs/job-c/rank-1/exit_code": b"0\n"})
    s3 = _FakeS3(objects)
    reader = MarkerReader(_FakeClients(s3))
    handles = [_aws_handle(n, 2) for n in ("job-c", "job-a", "job-b")]
    found = reader.read_many(AwsSettings(regions=["us-east-1"]), handles)
    lists = [c for c in s3.calls if c[0] == "list"]
    # one listing of the common prefix, from just before job-a; it stops on the page that
    # passes job-c (3 pages of 3 keys: job-a .. job-c, then job-z0, job-z1): the old jobs
    # before are never listed, the later ones only as far as that page
    assert lists == [("list", "jobs/job-", "jobs/job-a")] * 3
    gets = [c[1] for c in s3.calls if c[0] == "get"]
    assert gets == ["jobs/job-a/rank-0/exit_code", "jobs/job-c/rank-1/exit_code"]
    assert found["job-a"].exit_codes == {0: 3} and found["job-a"].log_sizes == {0: 6}
    assert found["job-b"].exit_codes == {} and found["job-b"].log_sizes == {0: 3}
    assert found["job-c"].exit_codes == {1: 0} and found["job-c"].setup_done == {0}
    assert found["job-a"].when(0, "exit_code") == s3.modified["jobs/job-a/rank-0/exit_code"]
    s3.calls.clear()
    reader.read_many(AwsSettings(regions=["us-east-1"]), handles)  # content: once per ETag
    assert not [c for c in s3.calls if c[0] == "get"]
    assert listing_call(["jobs/a/"]) == ({"Prefix": "jobs/a/"}, "jobs/a/")


def _log_objects(rank0: bytes, rank1: bytes, ended=(0, 1)):
    objects = {"jobs/j/rank-0/log": rank0, "jobs/j/rank-1/log": rank1}
    objects.update({f"jobs/j/rank-{r}/exit_code": b"0\n" for r in ended})
    return objects


def _read_all(s3, handle, view, limit):
    from airflow_skypilot.backends.aws.logs import read_log

    out, offset = [], 0
    for _ in range(1000):
        text, offset = read_log(_FakeClients(s3), AwsSettings(regions=["us-east-1"]), handle,
                                offset, limit, view)
        if not text:
            return "".join(out), offset
        out.append(text)
    raise AssertionError("no end")


def test_the_log_of_several_ranks_is_rank_0_then_the_others_prefixed():
    from airflow_skypilot.backends.aws.logs import JobView, read_log
    from airflow_skypilot.backends.aws.status import MarkerReader

    handle, settings = _aws_handle("j", 2), AwsSettings(regions=["us-east-1"])
    rank0 = "r0 start\nr0 ☃ end".encode()  # no newline at its end
    rank1 = b"r1 one\nr1 two\n"
    s3 = _FakeS3(_log_objects(rank0, rank1, ended=(0,)))
    running = JobView(MarkerReader(_FakeClients(s3)).read_many(settings, [handle])["j"])
    assert not running.final(2)
    assert read_log(_FakeClients(s3), settings, handle, 0, view=running) == (
        rank0.decode(), len(rank0))  # while it runs: rank 0 only
    s3 = _FakeS3(_log_objects(rank0, rank1))
    final = JobView(MarkerReader(_FakeClients(s3)).read_many(settings, [handle])["j"])
    assert final.final(2)
    whole = rank0.decode() + "\n(rank 1) r1 one\n(rank 1) r1 two\n"
    size = len(whole.encode())
    assert read_log(_FakeClients(s3), settings, handle, 0, view=final) == (whole, size)
    assert read_log(_FakeClients(s3), settings, handle, len(rank0), view=final) == (
        whole.encode()[len(rank0):].decode(), size)  # what streaming rank 0 left
    assert read_log(_FakeClients(s3), settings, handle, size, view=final) == ("", size)
    for limit in (4, 5, 7, 64):  # in pieces, never half a character: the same text
        assert _read_all(s3, handle, final, limit) == (whole, size)
    # every instance gone without end markers: final as well, with what was written
    s3 = _FakeS3(_log_objects(rank0, rank1, ended=()))
    gone = JobView(MarkerReader(_FakeClients(s3)).read_many(settings, [handle])["j"], True)
    assert read_log(_FakeClients(s3), settings, handle, 0, view=gone) == (whole, size)
    # a rank without a log, and one node: nothing else to read
    s3 = _FakeS3({"jobs/j/rank-0/log": b"only\n", "jobs/j/rank-0/exit_code": b"0\n",
                  "jobs/j/rank-1/exit_code": b"0\n"})
    view = JobView(MarkerReader(_FakeClients(s3)).read_many(settings, [handle])["j"])
    assert read_log(_FakeClients(s3), settings, handle, 0, view=view) == ("only\n", 5)
    one = _aws_handle("j", 1)
    s3.calls.clear()
    assert read_log(_FakeClients(s3), settings, one, 2, view=None) == ("ly\n", 5)
    assert len(s3.calls) == 1


def test_a_rank_that_fails_while_rank_0_runs_is_in_the_log_and_the_tail_at_once():
    """Rank 1 fails (its exit code and whole log are in S3) while rank 0 sleeps: the job is
    FAILED, and its cleanup terminates rank 0 before every rank ends. Rank 1's output must
    come with the next read and be in the failure's tail, not wait for rank 0's end; the
    stream goes on from there without repeating or losing a line."""
    from airflow_skypilot.backends.aws import logs
    from airflow_skypilot.backends.aws.logs import LOG_LIMIT, JobView, read_log, read_tail
    from airflow_skypilot.backends.aws.status import MarkerReader

    handle, settings = _aws_handle("j", 2), AwsSettings(regions=["us-east-1"])
    rank1 = b"FAILING 1\nrank1 Traceback: the real error\nairflow-skypilot: exit_code: 1\n"
    failed = [("(rank 1) " + line) for line in rank1.decode().splitlines(keepends=True)]
    objects = {"jobs/j/rank-0/log": b"r0 start\nr0 sleep", "jobs/j/rank-1/log": rank1}
    got, offset = [], 0

    def read(objects, gone=False, limit=LOG_LIMIT):
        nonlocal offset
        s3 = _FakeS3(objects)
        view = JobView(MarkerReader(_FakeClients(s3)).read_many(settings, [handle])["j"], gone)
        text, offset = read_log(_FakeClients(s3), settings, handle, offset, limit, view)
        got.append(text)
        return s3, view, text

    read(objects)  # both run: rank 0 as it comes (a line without its end as well)
    assert got == ["r0 start\nr0 sleep"] and offset == 17
    objects["jobs/j/rank-1/exit_code"] = b"1\n"
    s3, view, text = read(objects)  # rank 1 has ended: its log at once, prefixed
    assert text == "".join(failed)
    after_rank1 = offset
    tail = read_tail(_FakeClients(s3), settings, handle, view=view)
    assert tail.endswith("(rank 1) rank1 Traceback: the real error\n"
                         "(rank 1) airflow-skypilot: exit_code: 1\n") and "r0 start" in tail
    assert read(objects)[2] == ""  # nothing new: nothing again
    objects["jobs/j/rank-0/log"] = b"r0 start\nr0 sleep still\nr0 m\xc3\xa1s\n"
    assert read(objects)[2] == " still\nr0 más\n"  # rank 0 goes on where it was
    objects["jobs/j/rank-0/log"] += b"r0 killed"  # cleanup terminated it: final
    assert read(objects, gone=True)[2] == "r0 killed\n"
    end = offset
    assert read(objects, gone=True)[2] == "" and offset == end
    # every line once, rank 0's in order and rank 1's (prefixed) in order
    assert "".join(got) == "r0 start\nr0 sleep" + "".join(failed) + " still\nr0 más\n" \
        "r0 killed\n"
    # from that offset once the job is final, in pieces: the same, never half a character
    for limit in (4, 5, 7):  # (as above: a read holds at least one character)
        got, offset = [], after_rank1
        while read(objects, gone=True, limit=limit)[2]:
            assert len(got) < 100
        assert "".join(got) == " still\nr0 más\nr0 killed\n" and offset == end
    # while rank 0 runs, in pieces: each read is rank 0's next bytes, then the others'
    objects["jobs/j/rank-0/log"] = b"r0 start\nr0 sleep still\nr0 m\xc3\xa1s\n"
    for limit in (4, 5, 7, 64):
        mine, others, offset = b"", b"", 17
        for _ in range(100):
            before = offset
            data = read(objects, limit=limit)[2].encode()
            if not data:
                break
            # two positions in one offset
            was = logs.split_positions(before)[0] if before >= logs.SPLIT else before
            at0, at_others = logs.split_positions(offset)
            mine, others = mine + data[:at0 - was], others + data[at0 - was:]
            assert len(others) == at_others
        assert mine == b" still\nr0 m\xc3\xa1s\n" and others.decode() == "".join(failed)


def test_a_final_text_read_to_its_end_is_not_read_again_when_ec2_forgets_the_instances():
    """Read while final (the instances gone), the whole text came with one-position offsets;
    an hour on, EC2 no longer lists the terminated instances and rank 0 has no end marker:
    the job no longer read as final, and the next read gave rank 1's lines again."""
    from airflow_skypilot.backends.aws.logs import JobView, read_log
    from airflow_skypilot.backends.aws.status import MarkerReader

    handle, settings = _aws_handle("j", 2), AwsSettings(regions=["us-east-1"])
    objects = {"jobs/j/rank-0/log": b"r0 start\n", "jobs/j/rank-1/log": b"r1 Traceback\n",
               "jobs/j/rank-1/exit_code": b"1\n"}

    def read(offset, gone):
        s3 = _FakeS3(objects)
        view = JobView(MarkerReader(_FakeClients(s3)).read_many(settings, [handle])["j"], gone)
        return read_log(_FakeClients(s3), settings, handle, offset, 1 << 20, view)

    text, end = read(0, gone=True)
    assert text == "r0 start\n(rank 1) r1 Traceback\n"
    assert read(end, gone=False) == ("", end)


def test_a_two_position_offset_grows_with_either_and_stays_a_64_bit_integer():
    """It was rank 0's position plus 2**40 times the others': past 16 MiB of the other ranks'
    text it passed 2**64, which msgpack (the trigger's events) cannot carry."""
    import itertools

    from airflow_skypilot.backends.aws import logs

    for at0, at_others in itertools.product((0, 1, 7, 10**6, 3 * 2**29), repeat=2):
        offset = logs.split_offset(at0, at_others)
        assert logs.split_positions(offset) == (at0, at_others)
        assert logs.SPLIT <= offset < 2**63
        assert logs.split_offset(at0 + 1, at_others) > offset
        assert logs.split_offset(at0, at_others + 1) > offset


def test_log_decoding_keeps_partial_characters():
    data = "héllo ☃".encode()
    text, used = decode_log(data[:-1])
    assert text == "héllo " and used == len(data) - 3
    assert decode_log(data) == ("héllo ☃", len(data))
    assert decode_log(b"") == ("", 0)


# --- user-data ------------------------------------------------------------------------------


def _render(task, secrets_names=(), payload=True, **boot):
    env = jobscript.skypilot_env(task, task_id="sky-task-1", num_gpus_per_node=1,
                                 cluster_info={"cloud": "AWS"}, extra={"SKYPILOT_TASK_ID": "x"})
    p = ud.render_payload(task, env)
    b = ud.Bootstrap(job_name="sky-job-1", region="us-east-1",
                     s3_job_uri="s3://bucket/jobs/sky-job-1/", num_nodes=task.num_nodes,
                     spot=False, tag_key="skypilot-airflow:job-name",
                     secret_params=[f"/airflow-skypilot/sky-job-1/{k}" for k in secrets_names],
                     payload_b64=p.b64 if payload else None,
                     payload_uri=None if payload else "s3://bucket/jobs/sky-job-1/payload.tgz",
                     **boot)
    return ud.render_user_data(b), p


def _unpack(payload: ud.Payload) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(payload.data), mode="r:gz") as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def test_user_data_is_small_and_has_no_secret():
    secret = "hf_s3cr3t-Value/with+chars=="
    task = load_task({"run": "python train.py", "setup": "pip install -r req.txt",
                      "envs": TRICKY, "secrets": {"HF_TOKEN": secret, "DB_PASS": "pw$(x)"}})
    script, payload = _render(task, sorted(task.secrets))
    # well under EC2's 16 KB with the payload inline (since SkyPilot's prologue went into
    # setup.sh and run.sh, and the run barrier into the bootstrap: 8.2 KiB, was 7.9; the
    # steps' log pipe and the mask's line reads: 9.1 KiB)
    assert ud.user_data_size(script) < 10 * 1024 < ud.USER_DATA_BUDGET
    files = _unpack(payload)
    everything = script.encode() + b"".join(files.values())
    for value in task.secrets.values():
        assert value.encode() not in everything
        assert base64.b64encode(value.encode()) not in everything
    assert "/airflow-skypilot/sky-job-1/HF_TOKEN" in script  # names only
    assert set(files) >= {"node.sh", "env.sh", "setup.sh", "run.sh"}
    assert files["run.sh"] == (jobscript.PROLOGUE + "python train.py\n").encode()
    # Same job, same bytes: a resubmission renders the same user-data.
    assert _render(task, sorted(task.secrets))[0] == script


def test_env_round_trips_through_the_payload(tmp_path):
    task = load_task({"run": "true", "envs": TRICKY})
    _, payload = _render(task)
    env_sh = tmp_path / "env.sh"
    env_sh.write_bytes(_unpack(payload)["env.sh"])
    dump = subprocess.run(
        ["bash", "-c", f'. {shlex.quote(str(env_sh))} && python3 -c "import json, os; '
                       f'print(json.dumps(dict(os.environ)))"'],
        capture_output=True, text=True, check=True, env={"PATH": os.environ["PATH"]})
    seen = json.loads(dump.stdout)
    for key, value in TRICKY.items():
        assert seen[key] == value, key
    assert seen["SKYPILOT_TASK_ID"] == "sky-task-1"
    assert not Path("/tmp/airflow-skypilot-aws-pwned").exists()


def test_large_payload_is_fetched_from_s3_instead():
    task = load_task({"run": "true"})
    script, _ = _render(task, payload=False)
    assert "PAYLOAD_URI=s3://bucket/jobs/sky-job-1/payload.tgz" in script
    assert "AIRFLOW_SKYPILOT_PAYLOAD" not in script


def test_payload_packs_what_the_workdir_rules_let_travel(tmp_path):
    root = tmp_path / "proj"
    for d in ("a", "a-b", "b/c", ".git", "skip"):
        (root / d).mkdir(parents=True)
    for rel in ("a/f", "a.txt", "a-b/g", "b/c/h", ".git/HEAD", "skip/z", "z.log"):
        (root / rel).write_text(rel)
    (root / ".skyignore").write_text("skip\n*.log\n")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x").write_text("x")
    (root / "task.yaml").write_text("workdir: .\nfile_mounts:\n  /d: ../data\nrun: echo\n")
    payload = ud.render_payload(load_task(str(root / "task.yaml")), {})
    with tarfile.open(fileobj=io.BytesIO(payload.data), mode="r:gz") as tar:
        members = tar.getmembers()
    tree = [m.name for m in members if m.name.startswith(("workdir", "mounts/"))]
    # tar's own order (depth first, by name); what .skyignore lists stays behind, .git
    # travels (SkyPilot's: git works in the job)
    assert tree == ["workdir", "workdir/.git", "workdir/.git/HEAD", "workdir/.skyignore",
                    "workdir/a", "workdir/a/f", "workdir/a-b",
                    "workdir/a-b/g", "workdir/a.txt", "workdir/b", "workdir/b/c",
                    "workdir/b/c/h", "workdir/task.yaml", "mounts/0", "mounts/0/x"]
    assert {(m.uid, m.gid, m.uname, m.gname) for m in members} == {(0, 0, "", "")}
    # the same bytes on a later render, even a second apart (gzip's header timestamp is 0)
    assert payload.data[4:8] == b"\0\0\0\0"
    assert ud.render_payload(load_task(str(root / "task.yaml")), {}).data == payload.data


# --- the bootstrap, run locally against stub commands ----------------------------------------

STUB_CURL = r"""#!/bin/bash
# IMDS stub: answers from $FAKE/imds/<path>; 404 (exit 22) when the file is missing.
url=""; for a in "$@"; do case $a in http*) url=$a ;; esac; done
path=${url#*/latest/}
case $path in
  api/token) echo tok; exit 0 ;;
  meta-data/*) f="$FAKE/imds/${path#meta-data/}"; [ -f "$f" ] && { cat "$f"; exit 0; }; exit 22 ;;
esac
exit 22
"""

STUB_AWS = r"""#!/bin/bash
# AWS CLI stub: s3 cp/ls against $FAKE/s3, ssm get-parameters from $FAKE/ssm, ec2 from a file.
echo "$*" >> "$FAKE/aws.calls"
case "$1 $2" in
  "s3 cp")
    shift 2; args=(); for a in "$@"; do [ "$a" = --only-show-errors ] || args+=("$a"); done
    src=${args[0]}; dst=${args[1]}
    if [[ $dst == s3://* ]]; then
      key=${dst#s3://}; mkdir -p "$FAKE/s3/$(dirname "$key")"
      if [ "$src" = - ]; then cat > "$FAKE/s3/$key"; else cp "$src" "$FAKE/s3/$key"; fi
    else
      cp "$FAKE/s3/${src#s3://}" "$dst"
    fi ;;
  "s3 ls")
    root=${4#s3://}; (cd "$FAKE/s3" && find "$root" -type f | sed 's/^/2026-01-01 00:00:00 1 /') ;;
  "ssm get-parameters")
    names=(); shift 2
    while [ $# -gt 0 ]; do
      case $1 in
        --names) shift
                 while [ $# -gt 0 ] && [[ $1 != --* ]]; do names+=("$1"); shift; done ;;
        *) shift ;;
      esac
    done
    for n in "${names[@]}"; do  # a missing parameter is left out, as SSM does
      f="$FAKE/ssm/${n##*/}"; [ -f "$f" ] && printf '%s\t%s\n' "$n" "$(cat "$f")"
    done
    true ;;
  "ec2 describe-instances") cat "$FAKE/peers" ;;
  *) echo "aws stub: unexpected $*" >&2; exit 2 ;;
esac
"""

STUB_SHUTDOWN = """#!/bin/bash
echo "$*" > "$FAKE/shutdown"
"""


def _stubs(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    fake = tmp_path / "fake"
    bin_dir = tmp_path / "bin"
    for d in (fake / "imds", fake / "s3", fake / "ssm", bin_dir, tmp_path / "home"):
        d.mkdir(parents=True, exist_ok=True)
    for name, text in (("curl", STUB_CURL), ("aws", STUB_AWS), ("shutdown", STUB_SHUTDOWN)):
        path = bin_dir / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(tmp_path / "home"),
           "FAKE": str(fake), "AWS_EC2_METADATA_SERVICE_ENDPOINT": "http://imds.invalid"}
    return fake, env


def _imds(fake: Path, rank: int, ip: str) -> None:
    for key, value in {"ami-launch-index": str(rank), "local-ipv4": ip,
                       "instance-id": f"i-{rank}", "reservation-id": "r-1"}.items():
        (fake / "imds" / key).write_text(value)


def _boot(tmp_path: Path, task) -> tuple[Path, dict[str, str], Path]:
    """The bootstrap of ``task`` for rank 0 of one node, with its secrets in the stub SSM:
    (the stubs' folder, their env, the user-data file)."""
    script, _ = _render(task, sorted(task.secrets), log_interval=1)
    fake, env = _stubs(tmp_path)
    _imds(fake, 0, "10.0.0.5")
    for key, value in task.secrets.items():
        (fake / "ssm" / key).write_text("b64:" + base64.b64encode(value.encode()).decode())
    user_data = tmp_path / "user-data"
    user_data.write_text(script)
    return fake, env, user_data


def test_bootstrap_runs_setup_and_run_with_env_and_secrets(tmp_path):
    task = load_task({
        "setup": 'echo "setup rank=$SKYPILOT_SETUP_NODE_RANK"',
        "run": 'echo "rank=$SKYPILOT_NODE_RANK ips=$SKYPILOT_NODE_IPS n=$SKYPILOT_NUM_NODES"\n'
               'python3 -c "import hashlib, json, os; print(\'ENV=\' + json.dumps({k: '
               '(hashlib.sha256(os.environ[k].encode()).hexdigest() if k in (\'TOKEN\', '
               '\'PASS\') else os.environ[k]) for k in os.environ if k in $KEYS}))"\n'
               'echo "token=$TOKEN"\nexit 4',
        "envs": {**TRICKY, "KEYS": json.dumps(sorted([*TRICKY, "TOKEN", "PASS"]))},
        "secrets": {"TOKEN": "tok en\n$(x)'\"", "PASS": "p\\w\td"},
    })
    fake, env, user_data = _boot(tmp_path, task)
    proc = subprocess.run(["bash", str(user_data)], env=env, capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    s3 = fake / "s3" / "bucket/jobs/sky-job-1/rank-0"
    log = (s3 / "log").read_text()
    assert (s3 / "exit_code").read_text() == "4\n", log
    assert "setup rank=0" in log and "rank=0 ips=10.0.0.5 n=1" in log
    seen = json.loads(next(ln for ln in log.splitlines() if ln.startswith("ENV="))[4:])
    digests = {k: hashlib.sha256(v.encode()).hexdigest() for k, v in task.secrets.items()}
    assert seen == {**TRICKY, **digests}  # secrets arrive byte for byte...
    assert "token=***" in log and "tok en" not in log  # ...and never reach the log in clear
    assert (fake / "shutdown").read_text().strip() == "-h now"
    job_dir = tmp_path / "home/.airflow-skypilot/sky-job-1"
    assert not (job_dir / "secrets.sh").exists()  # removed when the job ended
    assert log.rstrip().endswith("exit_code: 4")  # the last upload is after the run


def _second_rank(tmp_path, run: str):
    """Rank 1 of a 2-node job's bootstrap, rank 0's setup done already: (fake, env, rank 0's
    S3 prefix as a dir); the user-data at tmp_path/user-data."""
    task = load_task({"num_nodes": 2, "run": run})
    script, _ = _render(task, barrier_interval=1)
    fake, env = _stubs(tmp_path)
    _imds(fake, 1, "10.0.0.9")
    (fake / "peers").write_text("1\t10.0.0.9\n0\t10.0.0.8\n")
    done = fake / "s3" / "bucket/jobs/sky-job-1/rank-0"
    done.mkdir(parents=True)
    (done / "setup_done").write_text("0\n")  # rank 0 finished its setup already
    (tmp_path / "user-data").write_text(script)
    return fake, env, done


def test_bootstrap_second_rank_lists_its_peers_and_waits_for_setup(tmp_path):
    fake, env, done = _second_rank(tmp_path, 'echo "ips=$(echo $SKYPILOT_NODE_IPS | tr " " ,)"')
    proc = subprocess.Popen(["bash", str(tmp_path / "user-data")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out = fake / "s3" / "bucket/jobs/sky-job-1/rank-1"
    deadline = time.monotonic() + 60
    while not (out / "run_done").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    # its run ended well: the node stays up (SkyPilot's nodes live until the job ends) while
    # rank 0 runs, then ends when rank 0's run has ended too
    time.sleep(2.5)
    assert proc.poll() is None and not (out / "exit_code").exists()
    assert not (fake / "shutdown").exists()
    (done / "run_done").write_text("0\n")
    assert proc.wait(timeout=60) == 0, proc.stderr.read()
    assert (out / "exit_code").read_text() == "0\n"
    assert (out / "setup_done").exists()
    assert "ips=10.0.0.8,10.0.0.9" in (out / "log").read_text()


def test_bootstrap_rank_that_waits_ends_when_another_rank_ends_otherwise(tmp_path):
    fake, env, done = _second_rank(tmp_path, "true")
    (done / "exit_code").write_text("3\n")  # rank 0's run failed: nothing to wait for
    proc = subprocess.run(["bash", str(tmp_path / "user-data")], env=env, capture_output=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert (fake / "s3" / "bucket/jobs/sky-job-1/rank-1" / "exit_code").read_text() == "0\n"


def test_bootstrap_reports_missing_secrets_as_bootstrap_error(tmp_path):
    task = load_task({"run": "echo should-not-run", "secrets": {"TOKEN": "x"}})
    script, _ = _render(task, ["TOKEN"])
    fake, env = _stubs(tmp_path)
    _imds(fake, 0, "10.0.0.5")
    # no $FAKE/ssm/TOKEN: SSM does not return the parameter
    (tmp_path / "user-data").write_text(script)
    subprocess.run(["bash", str(tmp_path / "user-data")], env=env, capture_output=True,
                   timeout=60)
    out = fake / "s3" / "bucket/jobs/sky-job-1/rank-0"
    assert "secrets" in (out / "bootstrap_error").read_text()
    assert not (out / "exit_code").exists()
    assert "should-not-run" not in (out / "log").read_text()
    assert (fake / "shutdown").exists()


# --- launch parameters and an unreachable account --------------------------------------------


def test_launch_parameters():
    backend = AwsBackend("aws_x", settings=AwsSettings(
        regions=["us-east-1"], key_name="kp", security_group_ids={"*": ["sg-1"]},
        instance_profile={"us-east-1": "arn:aws:iam::1:instance-profile/sky"},
        tags={"team": "ml"}))
    task = load_task({"num_nodes": 2, "run": "true", "resources": {
        "accelerators": "A10G:1", "use_spot": True, "disk_size": 200,
        "labels": {"project": "x"}}})
    req = task.candidates[0]
    params = launch.launch_params(backend.settings, backend.conn_id, task, req, "sky-j",
                                  CATALOG["g5.xlarge"], "ami-1", "/dev/sda1", "#!/bin/bash\n",
                                  {"n": 2})
    assert params["MinCount"] == params["MaxCount"] == 2
    assert params["InstanceInitiatedShutdownBehavior"] == "terminate"
    assert params["MetadataOptions"]["HttpTokens"] == "required"
    assert params["InstanceMarketOptions"]["MarketType"] == "spot"
    assert params["BlockDeviceMappings"][0]["Ebs"]["VolumeSize"] == 200
    tags = {t["Key"]: t["Value"] for t in params["TagSpecifications"][0]["Tags"]}
    assert tags["skypilot-airflow:job-name"] == "sky-j" and tags["Name"] == "sky-j"
    assert tags["project"] == "x" and tags["team"] == "ml"
    assert json.loads(tags["skypilot-airflow:meta"]) == {"n": 2}
    assert params["KeyName"] == "kp"
    placed = launch.region_params(backend.settings, "us-east-1", "us-east-1b", None)
    assert placed == {"Placement": {"AvailabilityZone": "us-east-1b"},
                      "SecurityGroupIds": ["sg-1"],
                      "IamInstanceProfile": {"Arn": "arn:aws:iam::1:instance-profile/sky"}}
    assert launch.region_params(backend.settings, "us-east-1", "us-east-1b",
                                {"us-east-1b": "subnet-2"})["SubnetId"] == "subnet-2"


def test_unreachable_account_raises_backend_unreachable(monkeypatch):
    import asyncio

    from airflow_skypilot.backends.base import JobHandle
    from airflow_skypilot.exceptions import BackendUnreachable

    monkeypatch.setenv("AIRFLOW_CONN_AWS_DOWN", json.dumps({
        "conn_type": "aws", "login": "AKIAEXAMPLE", "password": "x",
        "extra": {"endpoint_url": "http://127.0.0.1:9", "region_name": "us-east-1",
                  "s3_bucket": "b"}}))
    backend = AwsBackend("aws_down")
    task = load_task({"run": "true", "resources": {"accelerators": "A10G:1"}})
    with pytest.raises(BackendUnreachable):
        backend.probe(task)
    with pytest.raises(BackendUnreachable):
        backend.capacity()
    handle = JobHandle(backend="aws", connection="aws_down", job_id="j", job_name="j",
                       location="us-east-1/us-east-1a", infra="aws/us-east-1/us-east-1a",
                       extra={"region": "us-east-1", "bucket": "b", "prefix": "p/j/"})

    async def poll():
        try:
            return await backend.astatus([handle])
        finally:
            await backend.aclose()

    with pytest.raises(BackendUnreachable):
        asyncio.run(poll())


# --- exact GPU counts first; billed price and wasted GPUs; instances still launching --------


def test_exactly_the_gpus_asked_for_unless_the_connection_allows_larger_instances():
    # SkyPilot's match by default: no A100 type has 2, so no offer (and why)
    [offer] = _offers({"resources": {"accelerators": "A100:2"}}, _state())
    assert not offer.fits and offer.instance_type is None
    assert offer.reason == ("no instance type with exactly 2 A100 is offered in us-east-1 (the "
                            "connection's extra larger_instances: true takes a larger one, "
                            "billed whole)")
    assert AwsSettings.from_extra({"larger_instances": "true"}).larger_instances
    assert not AwsSettings.from_extra({}).larger_instances


def test_a_larger_instance_only_where_no_exact_one_is_offered_and_it_says_what_it_wastes():
    larger = {"larger_instances": True}
    offer = _offers({"resources": {"accelerators": "A100:2"}}, _state(), **larger)[0]
    assert offer.instance_type == "p4d.24xlarge" and offer.details["gpus_wasted"] == 6
    assert offer.price_per_hour == _price("p4d.24xlarge")  # the whole instance is billed
    assert offer.notes == ["p4d.24xlarge: 8 A100 for 2 asked (6 idle), $22/h"]
    two = _offers({"resources": {"accelerators": "A10G:2"}, "num_nodes": 2}, _state(),
                  **larger)[0]
    assert two.details["gpus_wasted"] == 4 and two.notes[0].endswith("/h for 2")
    exact = _offers({"resources": {"accelerators": "A10G:1"}}, _state(), **larger)[0]
    assert "gpus_wasted" not in exact.details and exact.notes == []


def test_an_exact_count_type_wins_over_larger_ones_in_every_az():
    catalog = {**CATALOG, **parse_instance_types([_type("g5.6xlarge", 24, 96,
                                                        ("A10G", 2, 22888))])}
    req = _req(accelerators="A10G:2")
    # exact first even where a larger type would cost less
    types, _ = suitable_types(catalog, req, price_of=lambda n: 0.1 if n == "g5.12xlarge"
                              else _price(n) or 2.0)
    assert [t.name for t in types][:2] == ["g5.6xlarge", "g5.12xlarge"]
    offered = {n: {"us-east-1a", "us-east-1b"} for n in catalog}
    offered["g5.6xlarge"] = {"us-east-1a"}
    state = RegionState(region="us-east-1", catalog=catalog, offered=offered, spot_prices={},
                        quotas={}, subnet_azs=None, now=1000.0)
    settings = AwsSettings(regions=["us-east-1"], prices={"g5.6xlarge": 2.0})
    task = load_task({"run": "true", "resources": {"accelerators": "A10G:2"}})
    got = offers_for("aws_x", settings, task, req, state, types, "")
    assert [(o.location, o.instance_type) for o in got] == [("us-east-1/us-east-1a",
                                                             "g5.6xlarge")]
    # nowhere offered: no offer, or the larger type with its waste where the connection allows
    del offered["g5.6xlarge"]
    got = offers_for("aws_x", settings, task, req, state, types, "")
    assert [o.fits for o in got] == [False]
    settings.larger_instances = True
    got = offers_for("aws_x", settings, task, req, state, types, "")
    assert {o.instance_type for o in got} == {"g5.12xlarge"}


def test_instances_still_launching_count_against_the_quota_and_say_so():
    from airflow_skypilot.backends.aws.quotas import launching

    instances = [
        {"InstanceType": "p4d.24xlarge", "State": {"Name": "pending"},
         "Tags": [{"Key": "skypilot-airflow:job-name", "Value": "sky-a"}]},
        {"InstanceType": "p4d.24xlarge", "State": {"Name": "pending"}},
        {"InstanceType": "p4d.24xlarge", "State": {"Name": "running"}},
    ]
    assert launching(instances, lambda t: CATALOG[t].vcpus) == {("p", False): (192.0, 2, 1)}
    used = vcpus_in_use(instances, lambda t: CATALOG[t].vcpus)[("p", False)]
    quotas = {("p", False): QuotaView("p", False, "L-417A185B", limit=384, used=used,
                                      pending=192, pending_instances=2, pending_ours=1)}
    offer = _offers({"resources": {"accelerators": "A100:8"}}, _state(quotas=quotas))[0]
    assert offer.nodes_free == 1 and offer.free_now  # 384 - 288 = 96 vCPUs: one more p4d
    assert offer.details["reserved_by_pending"] == 192 and offer.details["pending_ours"] == 1
    assert offer.notes == ["192 vCPUs of the quota taken by 2 instance(s) still launching, "
                           "1 of them ours"]


def test_a_lost_allocation_decides_before_an_exit_code_it_caused():
    """SkyPilot's rule: a failure is the program's only when its nodes are still there."""
    def inst(rank, state, code=""):
        return _inst(rank, state, spot=True, code=code)

    # a 2-node spot job: EC2 reclaims rank 1; rank 0's training dies on the lost peer (exit 1)
    st = judge(2, True, [inst(0, "running"),
                         inst(1, "terminated", "Server.SpotInstanceTermination")],
               Markers(exit_codes={0: 1}), now=200.0)
    assert st.state == JobState.PREEMPTED and "reclaimed" in st.reason
    # one node, notice written; the reclaim's shutdown kills the program (143)
    st = judge(1, True, [inst(0, "shutting-down", "Server.SpotInstanceTermination")],
               Markers(exit_codes={0: 143}, preempted={0: "{}"}), now=200.0)
    assert st.state == JobState.PREEMPTED and "notice" in st.reason
    # the same with the bootstrap's error marker instead of the exit code
    st = judge(1, True, [inst(0, "terminated", "Server.SpotInstanceTermination")],
               Markers(errors={0: "the bootstrap exited unexpectedly"}, preempted={0: ""}),
               now=200.0)
    assert st.state == JobState.PREEMPTED
    # on demand: rank 1's node gone without an end of its own, rank 0 failed on it
    st = judge(2, False, [_inst(0, "running"), _inst(1, "stopped")],
               Markers(exit_codes={0: 1}), now=200.0)
    assert st.state == JobState.INFRA_FAILED and "without an exit code of its own" in st.reason
    assert st.still_up  # rank 0 still runs: a sweep of this copy cancels it, not trusts it
    assert not judge(2, False, [_inst(0, "terminated"), _inst(1, "stopped")],
                     Markers(exit_codes={0: 1}), now=200.0).still_up
    # the program's own failure, its node shut down after it: the user's
    st = judge(2, False, [_inst(0, "running"), _inst(1, "terminated")],
               Markers(exit_codes={1: 3}), now=200.0)
    assert (st.state, st.exit_code) == (JobState.FAILED, 3)
    # every failed rank's code, for recover_on_exit_codes (the reason names the lowest rank)
    st = judge(2, False, [_inst(0, "terminated"), _inst(1, "terminated")],
               Markers(exit_codes={0: 1, 1: 42}), now=200.0)
    assert (st.exit_code, st.exit_codes) == (1, [1, 42])
    # a success is a success, notice or not
    st = judge(1, True, [inst(0, "terminated")], Markers(exit_codes={0: 0}, preempted={0: ""}),
               now=200.0)
    assert st.state == JobState.SUCCEEDED
    # after a failure, the rest terminated by our cleanup (tagged): still the program's
    tagged = _inst(0, "terminated", tags={"skypilot-airflow:cancelled": "1"})
    st = judge(2, False, [tagged, _inst(1, "terminated")], Markers(exit_codes={1: 3}),
               now=200.0)
    assert st.state == JobState.FAILED


def test_a_secret_filled_into_a_file_mount_is_not_in_the_payload_in_clear(tmp_path):
    """SkyPilot fills secrets into file_mounts; mounts.sh (in user-data or an S3 object) names
    the secret instead, read from secrets.sh on the node."""

    from airflow_skypilot.backends.aws.userdata import mounts_script
    from airflow_skypilot.spec import load_task

    (tmp_path / "f.txt").write_text("x")
    task = load_task({"run": "x", "secrets": {"KEY": None, "HOME": None, "PATH": None},
                      "file_mounts": {"/s3/$KEY": "s3://team-$KEY/data",
                                      "dir-$KEY/f.txt": str(tmp_path / "f.txt")}},
                     secrets={"KEY": "s3cr3t value", "HOME": "/evil", "PATH": "/nowhere"})
    script, local = mounts_script(task)
    assert "s3cr3t" not in script
    ref = '"$(. ./secrets.sh && printf %s "${KEY}")"'
    assert f"s3://team-{ref}/data /s3/{ref}" in script
    # secrets named like the script's own variables (HOME, PATH) do not replace them
    home = _run_mounts(tmp_path, script, local, skip="/s3/", secrets_sh=(
        "export KEY='s3cr3t value'\nexport HOME=/evil\nexport PATH=/nowhere\n"))
    assert (home.parent / "job" / "workdir" / "dir-s3cr3t value" / "f.txt").read_text() == "x"


def _run_mounts(tmp_path, script: str, local, skip: str, secrets_sh: str = ""):
    """Run mounts.sh with the payload laid out as the bootstrap unpacks it (each local
    source holding "x"), its lines naming ``skip`` left out; the home it filled."""
    import subprocess

    home, job = tmp_path / "home", tmp_path / "job"
    home.mkdir()
    job.mkdir()
    if secrets_sh:
        (job / "secrets.sh").write_text(secrets_sh)
    for _, name in local:
        (job / name).parent.mkdir(parents=True, exist_ok=True)
        (job / name).write_text("x")
    kept = "\n".join(line for line in script.splitlines() if skip not in line)
    done = subprocess.run(["bash", "-c", kept], env={"HOME": str(home), "JOB_DIR": str(job),
                                                     "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return home
