"""Constants and paths shared by the AWS sandbox daemon and its client.

Kept in one place so the daemon, the client class and the tests agree on ports, credentials
and names without importing each other's heavy modules (moto is only imported by the daemon).
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.sandbox.paths import state_root

REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_STATE_DIR = state_root() / "aws"

# Ports: the Slurm sandbox uses base+0..50 and the Kubernetes one base+100..; we use base+200..299.
PORT_BASE_ENV = "SKYPILOT_SANDBOX_PORT_BASE"
DEFAULT_PORT_BASE = 28000  # below the ephemeral range (32768-60999); Slurm: +100..119, K8s: +300
MOTO_PORT_OFFSET = 200
IMDS_FIRST_OFFSET = 201  # one IMDS server per running instance, base+201..base+299
IMDS_LAST_OFFSET = 299

HOST = "127.0.0.1"
ACCOUNT_ID = "123456789012"  # moto's default account: every unknown access key maps to it
REGIONS = ("us-east-1", "us-west-2")
DEFAULT_REGION = "us-east-1"

CONN_ID = "aws_sandbox"
# The credentials the Airflow connection carries (counted as caller "client").
ACCESS_KEY_ID = "AKIASKYPILOTSANDBOX1"
SECRET_ACCESS_KEY = "sandbox-secret-key-not-real"
# The daemon's own EC2 watcher and seeding: never counted, so tests see only their own traffic.
RUNNER_ACCESS_KEY_ID = "AKIASANDBOXRUNNER000"
# Instance-profile style keys given to instance processes: ASIASBX + 13 chars of the instance id.
INSTANCE_KEY_PREFIX = "ASIASBX"
INSTANCE_SECRET = "sandbox-instance-secret-not-real"

BUCKET = "skypilot-sandbox"
BUCKET_PREFIX = "jobs/"
DEFAULT_QUOTA_VCPUS = 256.0

# Marker in the User-Agent of the `shutdown` shim's API calls (see middleware: state reason).
OS_SHUTDOWN_UA = "sandbox-os-shutdown"

AWSCLI_ENV = "SKYPILOT_SANDBOX_AWSCLI"  # optional: an existing venv/prefix that has bin/aws


def port_base() -> int:
    """Return the port base, overridable so parallel checkouts do not collide."""
    return int(os.environ.get(PORT_BASE_ENV, DEFAULT_PORT_BASE))


def moto_port(base: int | None = None) -> int:
    """Return the moto server port for a given base (default: from the environment)."""
    return (port_base() if base is None else base) + MOTO_PORT_OFFSET


def instance_access_key(instance_id: str) -> str:
    """Return the instance-profile access key of one instance (20 chars, like a real ASIA key)."""
    return INSTANCE_KEY_PREFIX + instance_id.removeprefix("i-")[-13:].upper().rjust(13, "0")
