"""AWS as a place to run jobs: EC2 instances, on the amazon provider's hooks.

An AWS account is an Airflow connection of type ``aws`` (credentials, ``region_name``,
``endpoint_url`` as the amazon provider reads them) with extras (:class:`AwsSettings`).

What the backend can offer (SkyPilot's ``clouds/`` side): :mod:`.catalog` (instance types,
GPUs, prices, which types suit a candidate), :mod:`.quotas` (vCPU quotas), :mod:`.offers`
(offers and ``show-gpus`` rows per region and AZ). Running jobs (the ``provision/`` side):
:mod:`.launch` (RunInstances, AMI, secrets, terminate), :mod:`.userdata` (what an instance
runs), :mod:`.handles` (find and adopt), :mod:`.status` (markers and the state rule),
:mod:`.logs`. Under them: :mod:`.settings` (the connection's extras), :mod:`.clients` (the
hooks' clients, error classes) and :mod:`.ec2` (read-only EC2 queries, the job tags). The
facade :class:`AwsBackend` (:mod:`.backend`) passes settings and clients to each.
"""

from airflow_skypilot.backends.aws.backend import AwsBackend
from airflow_skypilot.backends.aws.catalog import (
    InstanceTypeInfo,
    parse_instance_types,
    price_catalog,
    suitable_types,
)
from airflow_skypilot.backends.aws.ec2 import InstanceView
from airflow_skypilot.backends.aws.quotas import QuotaView, quota_class, vcpus_in_use
from airflow_skypilot.backends.aws.settings import AwsSettings
from airflow_skypilot.backends.aws.status import Markers, build_markers, judge, marker_keys

__all__ = ["AwsBackend", "AwsSettings", "InstanceTypeInfo", "InstanceView", "Markers",
           "QuotaView", "build_markers", "judge", "marker_keys", "parse_instance_types",
           "price_catalog", "quota_class", "suitable_types", "vcpus_in_use"]
