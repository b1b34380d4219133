"""``python -m tests.sandbox up|down|status|env [slurm] [kubernetes] [aws]``: all sandboxes.

``up`` starts what is asked (default: all three), writes the Airflow connections of everything
that is up to ``.sandbox/connections.json`` (``airflow connections import`` reads it), and
prints them. ``down`` stops everything the sandboxes started. ``env`` prints ``export
AIRFLOW_CONN_...`` lines and ``AIRFLOW__SKYPILOT__CONNECTIONS`` for a shell.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from tests.sandbox.paths import state_root

REPO = Path(__file__).resolve().parents[2]
STATE = state_root()
NAMES = ("slurm", "kubernetes", "aws")
#: the connections a DAG sees by default (the "nopods" one is for a forbidden-listing test)
DEFAULT_CONNECTIONS = ("slurm_alpha", "slurm_beta", "k8s_sandbox", "aws_sandbox")


def sandbox(name: str):
    if name == "slurm":
        from tests.sandbox.slurm import SlurmSandbox

        return SlurmSandbox()
    if name == "kubernetes":
        from tests.sandbox.kubernetes import KubernetesSandbox

        return KubernetesSandbox()
    if name == "aws":
        from tests.sandbox.aws import AwsSandbox

        return AwsSandbox()
    raise SystemExit(f"unknown sandbox {name!r}; expected one of {', '.join(NAMES)}")


def connections() -> dict[str, dict]:
    conns: dict[str, dict] = {}
    for name in NAMES:
        box = sandbox(name)
        if box.is_up():
            conns.update(box.connections())
    return conns


def write_connections() -> dict[str, dict]:
    conns = connections()
    STATE.mkdir(exist_ok=True)
    (STATE / "connections.json").write_text(json.dumps(conns, indent=2) + "\n")
    return conns


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.sandbox")
    parser.add_argument("command", choices=("up", "down", "status", "env"))
    parser.add_argument("which", nargs="*", default=[], help=", ".join(NAMES))
    args = parser.parse_args(argv)
    which = args.which or list(NAMES)
    if args.command == "up":
        for name in which:
            start = time.monotonic()
            sandbox(name).up()
            print(f"sandbox {name}: up ({time.monotonic() - start:.1f}s)", flush=True)
        conns = write_connections()
        print(f"connections ({STATE / 'connections.json'}): {', '.join(sorted(conns))}")
    elif args.command == "down":
        failed = False
        for name in reversed(which):
            try:
                sandbox(name).down()
                print(f"sandbox {name}: down", flush=True)
            except Exception as exc:  # stop the others even if one fails
                failed = True
                print(f"sandbox {name}: could not stop cleanly: {exc}", file=sys.stderr)
        if (STATE / "connections.json").exists():
            write_connections()
        return 1 if failed else 0
    elif args.command == "status":
        up = {name: sandbox(name).is_up() for name in which}
        for name, state in up.items():
            print(f"sandbox {name}: {'up' if state else 'down'}")
        return 0 if all(up.values()) else 1
    else:
        conns = connections()
        for conn_id, conn in sorted(conns.items()):
            print(f"export AIRFLOW_CONN_{conn_id.upper()}={shlex.quote(json.dumps(conn))}")
        default = [c for c in DEFAULT_CONNECTIONS if c in conns]
        print(f"export AIRFLOW__SKYPILOT__CONNECTIONS={shlex.quote(','.join(default))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
