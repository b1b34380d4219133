"""The sandbox daemon: moto server + middleware + instance runner + IMDS servers, one process.

Started detached by `python -m tests.sandbox.aws up` (see sandbox.py); stops on SIGTERM/SIGINT
or POST /_sandbox/shutdown, powering off every instance process first.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .config import (
    ACCOUNT_ID,
    BUCKET,
    DEFAULT_REGION,
    HOST,
    IMDS_FIRST_OFFSET,
    IMDS_LAST_OFFSET,
    MOTO_PORT_OFFSET,
    RUNNER_ACCESS_KEY_ID,
    SECRET_ACCESS_KEY,
)

log = logging.getLogger("sandbox.aws")


def _json(start_response: Any, payload: Any, status: str = "200 OK") -> list[bytes]:
    data = json.dumps(payload, default=str).encode()
    start_response(
        status, [("Content-Type", "application/json"), ("Content-Length", str(len(data)))]
    )
    return [data]


class Daemon:
    """Holds the pieces together and answers the /_sandbox/* control API."""

    def __init__(self, state_dir: Path, port_base: int, awscli_bin: Path | None) -> None:
        self.state_dir = state_dir
        self.port = port_base + MOTO_PORT_OFFSET
        self.endpoint = f"http://{HOST}:{self.port}"
        self.awscli_bin = awscli_bin
        self.stop_event = threading.Event()
        self.started = time.time()
        self.reset_lock = threading.Lock()

        from . import motopatch
        from .middleware import FaultTable, RequestCounter, SandboxMiddleware
        from .quotas import QuotaTable
        from .runner import InstanceRunner

        motopatch.apply()
        from moto.moto_server.werkzeug_app import (
            DomainDispatcherApplication,
            MotoRequestHandler,
            create_backend_app,
        )
        from werkzeug.serving import make_server

        self.counter = RequestCounter()
        self.faults = FaultTable()
        self.quotas = QuotaTable()
        self.runner = InstanceRunner(
            state_dir,
            self.port,
            range(port_base + IMDS_FIRST_OFFSET, port_base + IMDS_LAST_OFFSET + 1),
            awscli_bin,
        )
        self.app = SandboxMiddleware(
            DomainDispatcherApplication(create_backend_app),
            self.counter,
            self.faults,
            self.quotas,
            self.runner,
            self,
        )
        self.server = make_server(
            HOST, self.port, self.app, threaded=True, request_handler=MotoRequestHandler
        )
        self.server.daemon_threads = True

    # -- lifecycle --------------------------------------------------------------------------
    def run(self) -> int:
        """Serve until told to stop; return the exit code."""
        thread = threading.Thread(
            target=self.server.serve_forever,
            kwargs={"poll_interval": 0.5},
            name="moto-server",
            daemon=True,
        )
        thread.start()
        self.seed()
        self.runner.start()
        state = {
            "pid": os.getpid(),
            "port": self.port,
            "endpoint": self.endpoint,
            "started": self.started,
            "awscli_bin": str(self.awscli_bin or ""),
        }
        (self.state_dir / "daemon.json").write_text(json.dumps(state, indent=2) + "\n")
        log.info("AWS sandbox up at %s (pid %s)", self.endpoint, os.getpid())
        self.stop_event.wait()
        log.info("stopping")
        self.runner.stop()
        self.server.shutdown()
        self.server.server_close()
        (self.state_dir / "daemon.json").unlink(missing_ok=True)
        log.info("stopped")
        return 0

    def seed(self) -> None:
        """Put the fixtures the backend expects in place: Deep Learning AMIs and the bucket."""
        import boto3

        from . import motopatch

        motopatch.seed_amis()
        s3 = boto3.session.Session().client(
            "s3",
            region_name=DEFAULT_REGION,
            endpoint_url=self.endpoint,
            aws_access_key_id=RUNNER_ACCESS_KEY_ID,
            aws_secret_access_key=SECRET_ACCESS_KEY,
        )
        try:
            s3.create_bucket(Bucket=BUCKET)
        except s3.exceptions.BucketAlreadyOwnedByYou:
            pass

    def reset(self) -> None:
        """Power off every instance, reset moto, re-seed, clear faults, quotas and counts."""
        from moto.moto_api._internal.models import moto_api_backend

        with self.reset_lock, self.runner.lock:
            self.runner.forget_all()
            self.runner.watched.clear()
            moto_api_backend.reset()
            self.faults.clear()
            self.quotas.reset()
        self.seed()
        self.counter.reset()

    def after_moto_reset(self) -> None:
        """Someone POSTed /moto-api/reset directly: drop the instances' processes, re-seed."""
        with self.runner.lock:
            self.runner.forget_all()
            self.runner.watched.clear()
        self.seed()

    def running(self) -> list[dict[str, Any]]:
        """Instances not powered off in moto or with a live process (one row per instance)."""
        from moto.ec2.models import ec2_backends

        from .procs import instance_processes

        rows: dict[str, dict[str, Any]] = {}
        account = ec2_backends[ACCOUNT_ID]
        for region in list(account.keys()):
            for inst in account[region].all_instances():
                if inst.state in ("pending", "running", "stopping", "shutting-down"):
                    rows[inst.id] = {
                        "instance_id": inst.id,
                        "region": region,
                        "state": inst.state,
                        "instance_type": inst.instance_type,
                        "pids": [],
                    }
        known = dict(self.runner.key_to_instance)
        regions = {t["instance_id"]: t["region"] for t in self.runner.snapshot()}
        for pid, key in sorted(instance_processes(self.endpoint).items()):
            iid = known.get(key)
            row_id = iid or f"unknown:{key}"
            row = rows.setdefault(
                row_id,
                {
                    "instance_id": iid,
                    "region": regions.get(iid or ""),
                    "state": "process-only" if iid else "orphan",
                    "instance_type": None,
                    "pids": [],
                },
            )
            row["pids"].append(pid)
        return list(rows.values())

    # -- control API ------------------------------------------------------------------------
    def handle(self, environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        """Answer /_sandbox/* (JSON in, JSON out)."""
        method = environ.get("REQUEST_METHOD", "GET")
        path = environ.get("PATH_INFO", "").rstrip("/")
        body: dict[str, Any] = {}
        if method == "POST":
            length = int(environ.get("CONTENT_LENGTH") or 0)
            raw = environ["wsgi.input"].read(length) if length else b""
            try:
                body = json.loads(raw or b"{}")
            except ValueError:
                return _json(start_response, {"error": "body is not JSON"}, "400 Bad Request")
        try:
            return self._route(method, path, body, start_response)
        except (KeyError, ValueError, TypeError) as exc:
            return _json(start_response, {"error": str(exc)}, "400 Bad Request")

    def _route(
        self, method: str, path: str, body: dict[str, Any], start_response: Any
    ) -> Iterable[bytes]:
        ok = {"ok": True}
        if path == "/_sandbox/health":
            return _json(
                start_response,
                {
                    "ok": True,
                    "pid": os.getpid(),
                    "port": self.port,
                    "uptime": time.time() - self.started,
                },
            )
        if path == "/_sandbox/requests":
            return _json(start_response, {"requests": self.counter.rows()})
        if path == "/_sandbox/requests/reset" and method == "POST":
            self.counter.reset()
            return _json(start_response, ok)
        if path == "/_sandbox/faults":
            if method == "POST":
                self.faults.fail_capacity(str(body["instance_type"]), str(body["az"]))
            return _json(start_response, self.faults.snapshot())
        if path == "/_sandbox/faults/clear" and method == "POST":
            self.faults.clear()
            return _json(start_response, ok)
        if path == "/_sandbox/quotas":
            if method == "POST":
                self.quotas.set(str(body["quota_code"]), float(body["value"]), body.get("region"))
            return _json(start_response, self.quotas.snapshot())
        if path == "/_sandbox/spot/interrupt" and method == "POST":
            action = self.runner.interrupt_spot(
                str(body["instance_id"]), float(body.get("notice_seconds", 2))
            )
            return _json(start_response, action)
        if path == "/_sandbox/instances":
            return _json(start_response, {"instances": self.runner.snapshot()})
        if path == "/_sandbox/running":
            return _json(start_response, {"running": self.running()})
        if path == "/_sandbox/reset" and method == "POST":
            self.reset()
            return _json(start_response, ok)
        if path == "/_sandbox/shutdown" and method == "POST":
            threading.Timer(0.2, self.stop_event.set).start()
            return _json(start_response, ok)
        return _json(start_response, {"error": f"no route {method} {path}"}, "404 Not Found")


def serve(state_dir: Path, port_base: int, awscli_bin: Path | None) -> int:
    """Entry point of the detached daemon process."""
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    # Never let boto3 in this process find real credentials, a profile or the real IMDS.
    for name in list(os.environ):
        if name.startswith("AWS_"):
            del os.environ[name]
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
    daemon = Daemon(state_dir, port_base, awscli_bin)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: daemon.stop_event.set())
    return daemon.run()
