"""The few in-process adjustments the daemon makes to moto (documented in README.md).

1. Default VPCs get a loopback CIDR (127.30.0.0/16 in us-east-1, 127.31.0.0/16 in us-west-2, ...)
   instead of 172.31.0.0/16, so an instance's PrivateIpAddress is an address its local process
   can really bind and that other "instances" can connect to (multi-node jobs need that).
2. An instance launched without a subnet takes its address from the AZ's default subnet (as on
   AWS) instead of moto's random 10.x "EC2-Classic" address.
3. Instance.terminate/stop take an optional state-reason override from the calling thread, so a
   spot reclaim says Server.SpotInstanceTermination and `shutdown -h now` inside an instance says
   Client.InstanceInitiatedShutdown, as on AWS (moto always says Client.UserInitiatedShutdown).
4. Seeding: current-style Deep Learning AMIs (owner 898082745236, alias amazon) per region.

Import this module only in the daemon, before any EC2 backend is created.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from .config import ACCOUNT_ID, REGIONS

_override = threading.local()
_applied = False

DLAMI_OWNER = "898082745236"  # the owner id of AWS's Deep Learning AMIs (moto uses it too)
SEED_AMIS: tuple[tuple[str, str, str], ...] = (
    # (name, creation date, description)
    (
        "Deep Learning OSS Nvidia Driver AMI GPU PyTorch 2.5.1 (Ubuntu 22.04) 20250105",
        "2025-01-05T10:00:00.000Z",
        "Supported EC2 instances: G4dn, G5, G6, Gr6, G6e, P4, P4de, P5, P5e, P5en. PyTorch-2.5.1",
    ),
    (
        "Deep Learning OSS Nvidia Driver AMI GPU PyTorch 2.7 (Ubuntu 22.04) 20250602",
        "2025-06-02T10:00:00.000Z",
        "Supported EC2 instances: G4dn, G5, G6, Gr6, G6e, P4, P4de, P5, P5e, P5en, P6-B200. "
        "PyTorch-2.7",
    ),
    (
        "Deep Learning OSS Nvidia Driver AMI GPU PyTorch 2.7 (Ubuntu 22.04) 20250715",
        "2025-07-15T10:00:00.000Z",
        "Supported EC2 instances: G4dn, G5, G6, Gr6, G6e, P4, P4de, P5, P5e, P5en, P6-B200. "
        "PyTorch-2.7",
    ),
    (
        "Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04) 20250710",
        "2025-07-10T10:00:00.000Z",
        "Supported EC2 instances: G4dn, G5, G6, Gr6, G6e, P4, P4de, P5, P5e, P5en, P6-B200.",
    ),
)
# moto ships two 2017 Deep Learning AMIs without a creation date, so they report "now" and would
# look newest; we give them the date their names say.
LEGACY_DLAMI_DATE = "2017-10-31T00:00:00.000Z"

_REGION_OCTET = {"us-east-1": 30, "us-west-2": 31}


@dataclass(frozen=True)
class ReasonOverride:
    """A state reason as AWS reports it (code, message, StateTransitionReason prefix)."""

    code: str
    message: str
    transition_prefix: str


SPOT_TERMINATION = ReasonOverride(
    "Server.SpotInstanceTermination",
    "Server.SpotInstanceTermination: Spot instance termination",
    "Service initiated",
)
INSTANCE_SHUTDOWN = ReasonOverride(
    "Client.InstanceInitiatedShutdown",
    "Client.InstanceInitiatedShutdown: Instance initiated shutdown",
    "User initiated",
)


@contextmanager
def state_reason(reason: ReasonOverride | None) -> Iterator[None]:
    """Make terminate/stop calls in this thread record `reason` instead of moto's default."""
    previous = getattr(_override, "reason", None)
    _override.reason = reason
    try:
        yield
    finally:
        _override.reason = previous


def loopback_cidr(region: str) -> str:
    """Return the default-VPC CIDR of a region: a distinct /16 inside 127.0.0.0/8."""
    if region in _REGION_OCTET:
        return f"127.{_REGION_OCTET[region]}.0.0/16"
    digest = int(hashlib.sha256(region.encode()).hexdigest(), 16)
    return f"127.{40 + digest % 200}.0.0/16"


def apply() -> None:
    """Install the patches (idempotent)."""
    global _applied
    if _applied:
        return
    from moto.ec2.exceptions import DefaultVpcAlreadyExists
    from moto.ec2.models.instances import Instance, StateReason
    from moto.ec2.models.vpcs import VPCBackend

    def create_default_vpc(self: Any) -> Any:
        if self.describe_vpcs(filters={"is-default": ["true"]}):
            raise DefaultVpcAlreadyExists
        vpc = self.create_vpc(cidr_block=loopback_cidr(self.region_name), is_default=True)
        for zone in self.describe_availability_zones():
            self.create_default_subnet(zone.name)
        return vpc

    VPCBackend.create_default_vpc = create_default_vpc  # type: ignore[method-assign]

    def _with_reason(original: Any) -> Any:
        def wrapper(self: Any) -> Any:
            previous = original(self)
            reason: ReasonOverride | None = getattr(_override, "reason", None)
            if reason is not None:
                now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S GMT")
                self._reason = f"{reason.transition_prefix} ({now})"
                self.state_reason = StateReason(reason.message, reason.code)
            return previous

        wrapper.__name__ = original.__name__
        wrapper.__wrapped__ = original  # type: ignore[attr-defined]
        return wrapper

    original_prep_nics = Instance.prep_nics

    def prep_nics(
        self: Any,
        nic_spec: list[dict[str, Any]],
        private_ip: str | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        # moto gives an instance launched without a subnet a random 10.x address ("EC2-Classic")
        # although it attaches it to the AZ's default subnet; AWS (and we) take the address
        # from that default subnet, which is loopback here.
        if private_ip is None and not self._subnet_id and not nic_spec:
            subnet = self.ec2_backend.get_default_subnets().get(self._placement.zone)
            if subnet is not None:
                private_ip = subnet.get_available_subnet_ip(instance=self)
                self._private_ips.add(private_ip)
        return original_prep_nics(self, nic_spec, private_ip, *args, **kwargs)

    Instance.prep_nics = prep_nics  # type: ignore[method-assign]
    Instance.terminate = _with_reason(Instance.terminate)  # type: ignore[method-assign]
    Instance.stop = _with_reason(Instance.stop)  # type: ignore[method-assign]
    _applied = True


def _ami_id(region: str, name: str) -> str:
    """Deterministic AMI id per (region, name), so logs and docs stay stable across resets."""
    return "ami-0" + hashlib.sha256(f"{region}/{name}".encode()).hexdigest()[:16]


def seed_amis(regions: tuple[str, ...] = REGIONS) -> list[str]:
    """Add the Deep Learning AMIs to each region's EC2 backend; return their ids."""
    from moto.core.parse import default_timestamp_parser as parse_timestamp
    from moto.ec2.models import ec2_backends
    from moto.ec2.models.amis import Ami

    ids = []
    for region in regions:
        backend = ec2_backends[ACCOUNT_ID][region]
        for ami in backend.amis.values():
            if ami.name and ami.name.startswith("Deep Learning AMI ") and "2017" in ami.name:
                ami.creation_date = parse_timestamp(LEGACY_DLAMI_DATE)
        for name, created, description in SEED_AMIS:
            ami_id = _ami_id(region, name)
            if ami_id in backend.amis:
                continue
            backend.amis[ami_id] = Ami(
                backend,
                ami_id,
                name=name,
                description=description,
                owner_id=DLAMI_OWNER,
                owner_alias="amazon",
                public=True,
                virtualization_type="hvm",
                architecture="x86_64",
                state="available",
                creation_date=parse_timestamp(created),
                image_location=f"amazon/{name}",
                hypervisor="xen",
                root_device_type="ebs",
                root_device_name="/dev/sda1",
                region_name=f"{region}a",
                boot_mode="uefi-preferred",
            )
            ids.append(ami_id)
    return ids
