"""The names that tie a job's objects together: labels, annotations, object and host names.

A job's Job, ConfigMap, Secrets and Service are all named after the job and carry
:data:`LABEL_JOB`; that label is how status, logs and cleanup find them again (one list per
namespace for every job). ``skypilot.airflow/`` annotations on the Job hold what a later
process needs to rebuild the handle (:data:`ANN_PREFIX`); :data:`ANN_CANCELLED` marks a Job
we cancelled (its value is when), so the Job itself records that it was stopped on purpose.
"""

from __future__ import annotations

import re

#: labels and annotations (``skypilot.airflow/`` is ours)
LABEL_JOB = "skypilot.airflow/job-name"
LABEL_MANAGED = "app.kubernetes.io/managed-by"
MANAGED_BY = "airflow-skypilot"
ANN_PREFIX = "skypilot.airflow/"
INDEX_KEY = "batch.kubernetes.io/job-completion-index"
#: set by cancel on the Job (RFC 3339 time of the cancel): the job reads CANCELLED until cleanup
ANN_CANCELLED = ANN_PREFIX + "cancelled"
#: on the Job: the task's ``config.kubernetes.provision_timeout`` (seconds; negative: wait), read
#: by status over the connection's ``pending_timeout``
ANN_PENDING_TIMEOUT = ANN_PREFIX + "pending-timeout"
#: label/annotation key prefixes a task may not set: ours, and the Job controller's
RESERVED_PREFIXES = (ANN_PREFIX, "batch.kubernetes.io/")

#: the job's container in each pod
CONTAINER = "main"
#: the extended resource that counts GPUs
GPU_RESOURCE = "nvidia.com/gpu"


def service_name(job_name: str) -> str:
    """A Service name is a DNS-1035 label (starts with a letter): the job name when it is one."""
    if job_name[:1].isalpha():
        return job_name
    return ("s-" + job_name)[:63].rstrip("-")


def configmap_name(job_name: str) -> str:
    return f"{job_name}-files"


def secret_name(job_name: str) -> str:
    return f"{job_name}-secrets"


def bundle_name(job_name: str) -> str:
    """The Secret with the job's workdir and file mounts (they may hold credentials)."""
    return f"{job_name}-bundle"


def pod_hostname(job_name: str, rank: int) -> str:
    return f"{job_name}-{rank}"


def node_addresses(job_name: str, namespace: str, num_nodes: int,
                   cluster_domain: str = "cluster.local") -> list[str]:
    """``SKYPILOT_NODE_IPS`` of a multi-node job: stable pod DNS names, in rank order."""
    svc = service_name(job_name)
    return [f"{pod_hostname(job_name, i)}.{svc}.{namespace}.svc.{cluster_domain}"
            for i in range(num_nodes)]


def labels_for(job_name: str) -> dict[str, str]:
    return {LABEL_MANAGED: MANAGED_BY, LABEL_JOB: job_name}


_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def key_error(key: str) -> str:
    """Why ``key`` is not a valid label or annotation key ("" when it is): an optional DNS
    subdomain prefix (at most 253 characters) and ``/``, then a name of at most 63
    characters, alphanumeric at both ends, with ``-``, ``_`` and ``.`` between."""
    prefix, _, name = key.rpartition("/")
    if "/" in key and (not prefix or len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix)):
        return (f"key {key!r}: its prefix must be a DNS subdomain (lower-case alphanumerics, "
                "'-' and '.', at most 253 characters)")
    if not _NAME.match(name):
        return (f"key {key!r}: the name must be 1-63 characters, alphanumeric at both ends, "
                "with '-', '_' or '.' between")
    if any(key.startswith(p) for p in RESERVED_PREFIXES):
        return f"key {key!r}: the prefixes {', '.join(RESERVED_PREFIXES)} are reserved"
    return ""


def label_value_error(key: str, value: str) -> str:
    """Why ``value`` is not a valid label value ("" when it is): empty, or at most 63
    characters, alphanumeric at both ends, with ``-``, ``_`` and ``.`` between."""
    if value and not _NAME.match(value):
        return (f"label {key!r}: value {value!r} must be at most 63 characters, alphanumeric "
                "at both ends, with '-', '_' or '.' between (or empty)")
    return ""
