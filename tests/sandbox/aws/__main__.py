"""CLI: `python -m tests.sandbox.aws up|down|status|reset` (and `serve`, used by `up`)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .sandbox import AwsSandbox, SandboxError


def main(argv: list[str] | None = None) -> int:
    """Run one sandbox command; exit 0 on success (status: 0 up, 3 down)."""
    parser = argparse.ArgumentParser(prog="python -m tests.sandbox.aws")
    parser.add_argument("command", choices=["up", "down", "status", "reset", "serve"])
    parser.add_argument("--state-dir", type=Path, default=None)
    parser.add_argument("--port-base", type=int, default=None)
    parser.add_argument("--awscli-bin", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sandbox = AwsSandbox(args.state_dir, args.port_base)
    if args.command == "serve":
        from .daemon import serve

        return serve(sandbox.state_dir, sandbox.port_base, args.awscli_bin)
    try:
        if args.command == "up":
            started = time.monotonic()
            sandbox.up()
            print(
                json.dumps(
                    {
                        "endpoint_url": sandbox.endpoint_url(),
                        "connections_file": str(sandbox.state_dir / "connections.json"),
                        "seconds": round(time.monotonic() - started, 1),
                    },
                    indent=2,
                )
            )
        elif args.command == "down":
            sandbox.down()
            print("down")
        elif args.command == "reset":
            sandbox.reset()
            print("reset")
        else:
            info = sandbox.status()
            print(json.dumps(info, indent=2, default=str))
            return 0 if info["up"] else 3
    except SandboxError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
