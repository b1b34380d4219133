"""Service Quotas stub for EC2 vCPU quotas: moto 5.2 implements Service Quotas only for `vpc`.

This is the one call the sandbox answers itself. The shapes follow the real
GetServiceQuota / ListServiceQuotas responses (awsJson1_1), values are vCPUs.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from .config import ACCOUNT_ID, DEFAULT_QUOTA_VCPUS

EC2_SERVICE_NAME = "Amazon Elastic Compute Cloud (Amazon EC2)"

# code -> (name, usage class for the CloudWatch usage metric)
EC2_QUOTAS: dict[str, tuple[str, str]] = {
    "L-1216C47A": (
        "Running On-Demand Standard (A, C, D, H, I, M, R, T, Z) instances",
        "Standard/OnDemand",
    ),
    "L-DB2E81BA": ("Running On-Demand G and VT instances", "G/OnDemand"),
    "L-417A185B": ("Running On-Demand P instances", "P/OnDemand"),
    "L-34B43A08": (
        "All Standard (A, C, D, H, I, M, R, T, Z) Spot Instance Requests",
        "Standard/Spot",
    ),
    "L-3819A6DF": ("All G and VT Spot Instance Requests", "G/Spot"),
    "L-7212CCBC": ("All P Spot Instance Requests", "P/Spot"),
}


class QuotaTable:
    """Configurable EC2 quota values: a global value per code, optionally per region."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[tuple[str, str], float] = {}

    def reset(self) -> None:
        """Forget every override (back to DEFAULT_QUOTA_VCPUS)."""
        with self._lock:
            self._values.clear()

    def set(self, code: str, value: float, region: str | None = None) -> None:
        """Set a quota value; region None applies to every region without its own value."""
        if code not in EC2_QUOTAS:
            raise KeyError(f"unknown EC2 quota code {code!r}; known: {sorted(EC2_QUOTAS)}")
        with self._lock:
            self._values[(region or "*", code)] = float(value)

    def value(self, code: str, region: str) -> float:
        """Return the quota value in vCPUs for a region."""
        with self._lock:
            if (region, code) in self._values:
                return self._values[(region, code)]
            return self._values.get(("*", code), DEFAULT_QUOTA_VCPUS)

    def snapshot(self) -> dict[str, Any]:
        """Return the current overrides (for GET /_sandbox/quotas)."""
        with self._lock:
            return {f"{r}/{c}": v for (r, c), v in sorted(self._values.items())}

    def quota(self, code: str, region: str, default: bool = False) -> dict[str, Any]:
        """Return one quota in the real API's shape."""
        name, usage_class = EC2_QUOTAS[code]
        return {
            "ServiceCode": "ec2",
            "ServiceName": EC2_SERVICE_NAME,
            "QuotaArn": f"arn:aws:servicequotas:{region}:{ACCOUNT_ID}:ec2/{code}",
            "QuotaCode": code,
            "QuotaName": name,
            "Value": DEFAULT_QUOTA_VCPUS if default else self.value(code, region),
            "Unit": "None",
            "Adjustable": True,
            "GlobalQuota": False,
            "UsageMetric": {
                "MetricNamespace": "AWS/Usage",
                "MetricName": "ResourceCount",
                "MetricDimensions": {
                    "Class": usage_class,
                    "Resource": "vCPU",
                    "Service": "EC2",
                    "Type": "Resource",
                },
                "MetricStatisticRecommendation": "Maximum",
            },
            "QuotaAppliedAtLevel": "ACCOUNT",
        }

    def handle(self, action: str, body: bytes, region: str) -> tuple[int, dict[str, Any]] | None:
        """Answer an EC2 Service Quotas call, or None to let moto answer (other services)."""
        try:
            params = json.loads(body or b"{}")
        except ValueError:
            params = {}
        if params.get("ServiceCode") != "ec2":
            return None
        code = params.get("QuotaCode")
        if action in ("GetServiceQuota", "GetAWSDefaultServiceQuota"):
            if code not in EC2_QUOTAS:
                return 400, {
                    "__type": "NoSuchResourceException",
                    "Message": f"The request failed because the specified quota {code} "
                    "does not exist.",
                }
            return 200, {"Quota": self.quota(code, region, action.startswith("GetAWS"))}
        if action in ("ListServiceQuotas", "ListAWSDefaultServiceQuotas"):
            default = action.startswith("ListAWS")
            quotas = [self.quota(c, region, default) for c in EC2_QUOTAS]
            if params.get("QuotaCode"):
                quotas = [q for q in quotas if q["QuotaCode"] == params["QuotaCode"]]
            return 200, {"Quotas": quotas}
        return None
