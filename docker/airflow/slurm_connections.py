"""The Airflow connections of the docker/ Slurm clusters, with their login nodes' host keys pinned.

Used by the init job (docker/airflow/init.sh)::

    python slurm_connections.py write OUT.json    # `airflow connections import` format
    python slurm_connections.py check-capacity CAPACITY.json
                                                  # `airflow-skypilot show-gpus --json` output

Configuration (environment, set in docker-compose.yml):

``SKYPILOT_SLURM_CONNECTIONS``
    one login node per line: ``CONN_ID HOST[:PORT] CLUSTER``
``SKYPILOT_SSH_KEY_FILE``
    the Airflow side's private key, as the Airflow containers see it
``SKYPILOT_SSH_PUBLIC_DIR``
    the shared volume where each login node publishes ``hostkeys/<CLUSTER>.pub``
``SKYPILOT_SLURM_LOGIN_USER``
    the user jobs run as on the clusters
``SKYPILOT_HOST_KEY_WAIT``
    seconds to wait for a host key to appear (default 120)

A host key comes from the cluster container itself, through a volume only the containers share:
nothing is learnt over the network (no ssh-keyscan, no ``no_host_key_check``), so the first
connection is already verified.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KEY_TYPES = ("ssh-ed25519", "ecdsa-sha2-nistp256", "ecdsa-sha2-nistp384", "ecdsa-sha2-nistp521",
             "ssh-rsa")


class SetupError(RuntimeError):
    """The connections cannot be written (bad configuration or a missing host key)."""


@dataclass(frozen=True)
class LoginNode:
    conn_id: str
    host: str
    port: int
    cluster: str


def parse_login_nodes(text: str) -> list[LoginNode]:
    """``CONN_ID HOST[:PORT] CLUSTER`` per line; blank lines and ``#`` comments are skipped."""
    nodes: list[LoginNode] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 3:
            raise SetupError(f"SKYPILOT_SLURM_CONNECTIONS line {number}: expected "
                             f"'CONN_ID HOST[:PORT] CLUSTER', got {raw.strip()!r}")
        conn_id, address, cluster = parts
        host, _, port = address.partition(":")
        if port and not port.isdigit():
            raise SetupError(f"SKYPILOT_SLURM_CONNECTIONS line {number}: bad port {port!r}")
        nodes.append(LoginNode(conn_id, host, int(port or 22), cluster))
    ids = [n.conn_id for n in nodes]
    if len(set(ids)) != len(ids):
        raise SetupError(f"SKYPILOT_SLURM_CONNECTIONS repeats a connection id: {ids}")
    if not nodes:
        raise SetupError("SKYPILOT_SLURM_CONNECTIONS names no login node")
    return nodes


def read_host_key(path: Path, wait: float = 0.0) -> str:
    """``TYPE BASE64`` of a published ``.pub`` host key (the comment is dropped)."""
    deadline = time.monotonic() + wait
    while not path.is_file() or not path.read_text().strip():
        if time.monotonic() >= deadline:
            raise SetupError(f"no host key at {path}: is that cluster's container up and "
                             f"healthy? (it publishes its key once its nodes are idle)")
        time.sleep(1)
    parts = path.read_text().split()
    if len(parts) < 2 or parts[0] not in KEY_TYPES:
        raise SetupError(f"{path} does not hold an OpenSSH public key")
    return f"{parts[0]} {parts[1]}"


def build_connections(nodes: list[LoginNode], public_dir: Path, key_file: str, login: str,
                      wait: float = 0.0) -> dict[str, dict[str, Any]]:
    """conn_id -> connection, in ``airflow connections import`` form."""
    conns: dict[str, dict[str, Any]] = {}
    for node in nodes:
        host_key = read_host_key(public_dir / "hostkeys" / f"{node.cluster}.pub", wait)
        conns[node.conn_id] = {
            "conn_type": "slurm",
            "description": f"Slurm cluster {node.cluster} of the docker/ deployment "
                           f"(login node {node.host})",
            "host": node.host,
            "port": node.port,
            "login": login,
            "extra": {
                "cluster": node.cluster,
                "key_file": key_file,
                # Pinned: the login node's own public key, not whatever answers on the network.
                "host_key": host_key,
                "remote_work_dir": "~/.airflow-skypilot",
            },
        }
    return conns


def check_capacity(rows: list[dict[str, Any]], conn_ids: list[str]) -> list[str]:
    """Problems in ``show-gpus --json`` output: unreachable connections, or none answered."""
    problems = [f"{row.get('connection')}: {row['error']}" for row in rows if row.get("error")]
    answered = {row.get("connection") for row in rows if not row.get("error")}
    problems += [f"{conn_id}: no capacity rows" for conn_id in conn_ids
                 if conn_id not in answered and not any(p.startswith(f"{conn_id}:")
                                                        for p in problems)]
    return problems


def _env(name: str, default: str | None = None) -> str:
    value = os.environ.get(name, default)
    if value is None or value == "":
        raise SetupError(f"{name} is not set")
    return value


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("write", "check-capacity", "ids"):
        print(__doc__, file=sys.stderr)
        return 2
    command, path = argv
    try:
        nodes = parse_login_nodes(_env("SKYPILOT_SLURM_CONNECTIONS"))
        if command == "ids":
            Path(path).write_text("".join(f"{n.conn_id}\n" for n in nodes))
            return 0
        if command == "write":
            conns = build_connections(
                nodes, Path(_env("SKYPILOT_SSH_PUBLIC_DIR")), _env("SKYPILOT_SSH_KEY_FILE"),
                _env("SKYPILOT_SLURM_LOGIN_USER"),
                wait=float(_env("SKYPILOT_HOST_KEY_WAIT", "120")))
            Path(path).write_text(json.dumps(conns, indent=2) + "\n")
            for conn_id, conn in conns.items():
                print(f"{conn_id}: {conn['login']}@{conn['host']}:{conn['port']} "
                      f"(cluster {conn['extra']['cluster']}), host key "
                      f"{conn['extra']['host_key'][:40]}...")
            return 0
        rows = json.loads(Path(path).read_text())
        problems = check_capacity(rows, [n.conn_id for n in nodes])
        for row in rows:
            if not row.get("error"):
                print(f"{row['connection']}: {row['location']} {row.get('accelerator') or '-'} "
                      f"{row.get('free')}/{row.get('total')} free")
        for problem in problems:
            print(f"capacity check failed: {problem}", file=sys.stderr)
        return 1 if problems else 0
    except SetupError as exc:
        print(f"slurm_connections: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
