"""``python -m tests.sandbox.kubernetes up|down|status|reset|serve``."""

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path

from tests.sandbox.kubernetes.sandbox import KubernetesSandbox


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.sandbox.kubernetes",
        description="Kubernetes test sandbox (kmock + test kubelet)",
    )
    parser.add_argument("command", choices=["up", "down", "status", "reset", "serve"])
    parser.add_argument("--state-dir", type=Path, default=None)
    parser.add_argument("--port", type=int, default=None)
    args = parser.parse_args(argv)
    sandbox = KubernetesSandbox(args.state_dir, args.port)
    if args.command == "serve":  # the daemon itself (``up`` runs this detached)
        from tests.sandbox.kubernetes.server import serve

        logging.basicConfig(
            level=logging.INFO,
            stream=sys.stderr,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
        asyncio.run(serve(sandbox.state_dir, sandbox.port))
        return 0
    if args.command == "up":
        sandbox.up()
        print(json.dumps(sandbox.status(), indent=2))
        return 0
    if args.command == "down":
        sandbox.down()
        print("kubernetes sandbox is down")
        return 0
    if args.command == "reset":
        sandbox.reset()
        return 0
    status = sandbox.status()
    print(json.dumps(status, indent=2))
    return 0 if status["up"] else 1


if __name__ == "__main__":
    sys.exit(main())
