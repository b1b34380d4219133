"""What an ``aws`` connection's extras say, read once into :class:`AwsSettings`.

Credentials, ``region_name`` and ``endpoint_url`` are the amazon provider's (its hooks read
them); the extras below are this backend's. Per-region values may be one value for every
region or a dict keyed by region (``default``/``*`` for the rest): :meth:`AwsSettings.pick`.
The settings also name where a job's things live: its S3 prefix and its SSM path.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: the backend's name in offers, handles and infra strings (``aws/<region>/<az>``)
BACKEND = "aws"


def _strings(value: Any) -> list[str]:
    if value in (None, "", []):
        return []
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    return [str(v) for v in value]


def _per_region(value: Any, listy: bool) -> dict[str, Any]:
    """A dict keyed by region (``default``/``*`` for all), or one value for every region."""
    if value in (None, "", [], {}):
        return {}
    if isinstance(value, dict):
        return {("*" if k in ("default", "*") else str(k)): (_strings(v) if listy else str(v))
                for k, v in value.items() if v not in (None, "", [])}
    return {"*": _strings(value) if listy else str(value)}


@dataclass
class AwsSettings:
    """What an ``aws`` connection's extras may say (all optional but ``s3_bucket`` to run).

    ``regions`` (list; default the connection's ``region_name``), ``s3_bucket``, ``s3_prefix``,
    per region (a dict keyed by region, ``default`` for the rest, or one value for all):
    ``subnet_id`` (one or a list; their AZs are the only ones used), ``security_group_ids``,
    ``ami_id``, ``instance_profile`` (name or ARN; needs s3:GetObject/PutObject/ListBucket on the
    prefix, ssm:GetParameters on ``ssm_prefix`` and, for multi-node jobs,
    ec2:DescribeInstances). ``ami_name_pattern`` / ``ami_owners``: the AMI when none is given
    (newest by creation date). ``max_price_per_hour`` (USD for the whole job), ``key_name``,
    ``boot_seconds`` (expected launch-to-running delay), ``log_interval`` /
    ``spot_check_interval`` (seconds, on the instance), ``ssm_prefix``, ``prices`` (instance type
    -> USD/h, over the shipped catalog), ``cpu_families`` (CPU-only tasks; default m6i), ``tags``.
    ``request_timeout`` (seconds one AWS request may wait for an answer; default 20, up to three
    attempts), ``launch_grace`` (seconds after a launch during which instances EC2 does not
    list yet are "unknown", not gone; default 120: DescribeInstances is eventually consistent).
    ``larger_instances`` (default false: SkyPilot's match, exactly the GPU count asked for;
    true: where no such type is offered, the fewest-GPU larger one, billed whole).
    """

    regions: list[str]
    s3_bucket: str | None = None
    s3_prefix: str = "airflow-skypilot/"
    subnet_id: dict[str, list[str]] = field(default_factory=dict)
    security_group_ids: dict[str, list[str]] = field(default_factory=dict)
    ami_id: dict[str, str] = field(default_factory=dict)
    instance_profile: dict[str, str] = field(default_factory=dict)
    ami_name_pattern: str = "Deep Learning*GPU*"
    ami_owners: list[str] = field(default_factory=lambda: ["amazon"])
    max_price_per_hour: float | None = None
    key_name: str | None = None
    boot_seconds: float = 120.0
    log_interval: int = 10
    spot_check_interval: int = 5
    ssm_prefix: str = "/airflow-skypilot"
    prices: dict[str, float] = field(default_factory=dict)
    cpu_families: list[str] = field(default_factory=lambda: ["m6i"])
    tags: dict[str, str] = field(default_factory=dict)
    request_timeout: float = 20.0
    launch_grace: float = 120.0
    larger_instances: bool = False

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> AwsSettings:
        regions = _strings(extra.get("regions")) or _strings(extra.get("region_name")) \
            or ["us-east-1"]
        prefix = str(extra.get("s3_prefix") or "airflow-skypilot/").lstrip("/")
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        ssm = "/" + str(extra.get("ssm_prefix") or "/airflow-skypilot").strip("/")
        max_price = extra.get("max_price_per_hour")
        return cls(
            regions=regions,
            s3_bucket=extra.get("s3_bucket") or None,
            s3_prefix=prefix,
            subnet_id=_per_region(extra.get("subnet_id") or extra.get("subnet_ids"), True),
            security_group_ids=_per_region(extra.get("security_group_ids"), True),
            ami_id=_per_region(extra.get("ami_id"), False),
            instance_profile=_per_region(extra.get("instance_profile"), False),
            ami_name_pattern=str(extra.get("ami_name_pattern") or "Deep Learning*GPU*"),
            ami_owners=_strings(extra.get("ami_owners")) or ["amazon"],
            max_price_per_hour=float(max_price) if max_price not in (None, "") else None,
            key_name=extra.get("key_name") or None,
            boot_seconds=float(extra.get("boot_seconds") or 120.0),
            log_interval=max(1, int(extra.get("log_interval") or 10)),
            spot_check_interval=max(1, int(extra.get("spot_check_interval") or 5)),
            ssm_prefix=ssm,
            prices={str(k): float(v) for k, v in (extra.get("prices") or {}).items()},
            cpu_families=_strings(extra.get("cpu_families")) or ["m6i"],
            tags={str(k): str(v) for k, v in (extra.get("tags") or {}).items()},
            request_timeout=max(1.0, float(extra.get("request_timeout") or 20.0)),
            launch_grace=max(0.0, float(extra.get("launch_grace") if extra.get("launch_grace")
                                        not in (None, "") else 120.0)),
            larger_instances=str(extra.get("larger_instances") or "").strip().lower()
            in ("true", "1", "yes", "on"),
        )

    @staticmethod
    def pick(mapping: Mapping[str, Any], region: str) -> Any:
        return mapping.get(region, mapping.get("*"))

    @property
    def s3_region(self) -> str:
        """The region the S3 client is made for (the connection's first)."""
        return self.regions[0]

    def job_prefix(self, job_name: str) -> str:
        """The job's S3 prefix in ``s3_bucket``: ``<s3_prefix><job name>/``."""
        return f"{self.s3_prefix}{job_name}/"

    def ssm_path(self, job_name: str) -> str:
        """The SSM Parameter Store path of the job's secrets."""
        return f"{self.ssm_prefix}/{job_name}"
