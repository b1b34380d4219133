"""Finding an instance's processes by their environment (light: no moto/boto3 imports).

Used by the runner to kill an instance's whole tree and by `down` to leave no orphans even if
the daemon died: every instance process carries its instance's access key and the sandbox's
endpoint in its environment, which daemonized descendants keep when they leave the group.
"""

from __future__ import annotations

import os
from pathlib import Path

from .config import INSTANCE_KEY_PREFIX


def instance_processes(endpoint: str) -> dict[int, str]:
    """Live processes of this sandbox's instances: pid -> the instance's access key."""
    prefix = f"AWS_ACCESS_KEY_ID={INSTANCE_KEY_PREFIX}".encode()
    endpoint_marker = f"AWS_ENDPOINT_URL={endpoint}".encode()
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if endpoint_marker not in environ:
            continue
        for item in environ:
            if item.startswith(prefix):
                found[int(entry.name)] = item.split(b"=", 1)[1].decode()
                break
    return found


def instance_pids(endpoint: str, access_key: str | None = None) -> list[int]:
    """PIDs of one instance of this sandbox (or of all its instances when access_key is None)."""
    return [
        pid
        for pid, key in instance_processes(endpoint).items()
        if access_key is None or key == access_key
    ]
