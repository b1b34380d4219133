"""Client side of the AWS sandbox: start/stop the daemon, drive faults, read counters.

Only standard-library imports here, so tests and the CLI stay light; moto lives in the daemon.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from . import config
from .procs import instance_pids

#: the AWS CLI the instances' user-data calls, pinned as the suite's other packages are
AWSCLI = "awscli==1.46.3"

UP_TIMEOUT = 90.0
DOWN_TIMEOUT = 20.0


class SandboxError(RuntimeError):
    """The sandbox could not do what was asked (the message says why)."""


def ensure_awscli(state_dir: Path) -> Path:
    """Return the bin dir holding the real AWS CLI, installing it in its own venv if needed.

    The CLI pins its own botocore, so it never goes into the project venv. The venv is cached
    in the state dir (or taken from $SKYPILOT_SANDBOX_AWSCLI) and reused by later `up`s.
    """
    override = os.environ.get(config.AWSCLI_ENV)
    if override:
        prefix = Path(override)
        for candidate in (prefix / "bin", prefix):
            if (candidate / "aws").exists():
                return candidate
        raise SandboxError(f"${config.AWSCLI_ENV}={override} has no aws command")
    venv = state_dir / "awscli"
    marker = venv / ".sandbox-ready"
    if marker.exists() and (venv / "bin" / "aws").exists():
        return venv / "bin"
    state_dir.mkdir(parents=True, exist_ok=True)
    with open(state_dir / "awscli.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.exists() and (venv / "bin" / "aws").exists():
            return venv / "bin"
        try:
            subprocess.run(
                [sys.executable, "-m", "venv", "--clear", str(venv)],
                check=True,
                timeout=180,
                capture_output=True,
            )
            subprocess.run(
                [
                    str(venv / "bin" / "python"),
                    "-m",
                    "pip",
                    "install",
                    "-q",
                    "--disable-pip-version-check",
                    AWSCLI,
                ],
                check=True,
                timeout=600,
                capture_output=True,
            )
            version = subprocess.run(
                [str(venv / "bin" / "aws"), "--version"],
                check=True,
                timeout=60,
                capture_output=True,
                text=True,
            )
        except subprocess.CalledProcessError as exc:
            raise SandboxError(
                f"installing awscli into {venv} failed: {(exc.stderr or b'')[-2000:]!r}"
            ) from exc
        except subprocess.TimeoutExpired as exc:
            raise SandboxError(f"installing awscli into {venv} timed out") from exc
        marker.write_text((version.stdout or version.stderr).strip() + "\n")
    return venv / "bin"


class AwsSandbox:
    """A local AWS (moto + instance runner) for tests and demos; see README.md."""

    def __init__(self, state_dir: Path | None = None, port_base: int | None = None) -> None:
        self.state_dir = Path(state_dir or config.DEFAULT_STATE_DIR).resolve()
        self.port_base = config.port_base() if port_base is None else port_base
        self.port = self.port_base + config.MOTO_PORT_OFFSET
        self._proc: subprocess.Popen[bytes] | None = None

    # -- daemon lifecycle -------------------------------------------------------------------
    def endpoint_url(self) -> str:
        """The URL every AWS client of the sandbox uses."""
        return f"http://{config.HOST}:{self.port}"

    def is_up(self) -> bool:
        """Whether the daemon answers on its port."""
        try:
            return bool(self._call("GET", "/_sandbox/health", timeout=2).get("ok"))
        except (OSError, SandboxError, ValueError):
            return False

    def up(self) -> dict[str, dict]:
        """Start the daemon unless it is up (idempotent); return the Airflow connections."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        awscli_bin = ensure_awscli(self.state_dir)
        if not self.is_up():
            self._start(awscli_bin)
        conns = self.connections()
        (self.state_dir / "connections.json").write_text(json.dumps(conns, indent=2) + "\n")
        return conns

    def _start(self, awscli_bin: Path) -> None:
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds
            try:
                probe.bind((config.HOST, self.port))
            except OSError as exc:
                raise SandboxError(
                    f"port {self.port} is taken by something that is not this sandbox; set "
                    f"{config.PORT_BASE_ENV} to move the sandboxes"
                ) from exc
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(config.REPO_ROOT), env.get("PYTHONPATH", "")) if p
        )
        log_path = self.state_dir / "daemon.log"
        with open(log_path, "ab") as log_file:
            self._proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.sandbox.aws",
                    "serve",
                    "--state-dir",
                    str(self.state_dir),
                    "--port-base",
                    str(self.port_base),
                    "--awscli-bin",
                    str(awscli_bin),
                ],
                cwd=config.REPO_ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        (self.state_dir / "daemon.pid").write_text(f"{self._proc.pid}\n")
        deadline = time.monotonic() + UP_TIMEOUT
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise SandboxError(
                    f"daemon exited with {self._proc.returncode}:\n" + _tail(log_path)
                )
            if self.is_up() and (self.state_dir / "daemon.json").exists():
                return
            time.sleep(0.25)
        raise SandboxError(f"daemon did not answer within {UP_TIMEOUT:.0f}s:\n" + _tail(log_path))

    def down(self) -> None:
        """Stop the daemon and every instance process (by pid; no orphans)."""
        pid = _read_pid(self.state_dir / "daemon.pid")
        if self.is_up():
            with contextlib.suppress(OSError, SandboxError, ValueError):
                self._call("POST", "/_sandbox/shutdown", timeout=10)
        if pid is not None:
            _wait_gone(pid, DOWN_TIMEOUT, self._proc)
            if _is_our_daemon(pid):
                _signal(pid, signal.SIGTERM)
                if not _wait_gone(pid, 5, self._proc):
                    _signal(pid, signal.SIGKILL)
                    _wait_gone(pid, 5, self._proc)
        for leftover in instance_pids(self.endpoint_url()):
            _signal(leftover, signal.SIGKILL)
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=5)
            self._proc = None
        (self.state_dir / "daemon.pid").unlink(missing_ok=True)
        (self.state_dir / "daemon.json").unlink(missing_ok=True)

    def status(self) -> dict[str, Any]:
        """A summary for `python -m tests.sandbox.aws status`."""
        info: dict[str, Any] = {
            "up": self.is_up(),
            "endpoint_url": self.endpoint_url(),
            "state_dir": str(self.state_dir),
        }
        if info["up"]:
            info["health"] = self._call("GET", "/_sandbox/health")
            info["instances"] = self._call("GET", "/_sandbox/instances")["instances"]
        return info

    # -- connections ------------------------------------------------------------------------
    def connections(self) -> dict[str, dict]:
        """Airflow connections (the format `airflow connections import` reads)."""
        return {
            config.CONN_ID: {
                "conn_type": "aws",
                "description": "Local AWS sandbox (moto + instance runner); dummy credentials",
                "login": config.ACCESS_KEY_ID,
                "password": config.SECRET_ACCESS_KEY,
                "extra": {
                    "endpoint_url": self.endpoint_url(),
                    "region_name": config.DEFAULT_REGION,
                    "regions": list(config.REGIONS),
                    "s3_bucket": config.BUCKET,
                    "s3_prefix": config.BUCKET_PREFIX,
                },
            }
        }

    def airflow_env(self) -> dict[str, str]:
        """AIRFLOW_CONN_* variables that hand the connections to hooks without a database."""
        return {
            f"AIRFLOW_CONN_{cid.upper()}": json.dumps(c) for cid, c in self.connections().items()
        }

    # -- state and faults -------------------------------------------------------------------
    def reset(self) -> None:
        """Power off all instances, reset moto, re-seed AMIs/bucket, clear faults and counts."""
        self.resume()  # a paused daemon first: the reset is a request to it
        self._call("POST", "/_sandbox/reset", {}, timeout=60)

    def pause(self) -> None:
        """SIGSTOP the daemon: the endpoint keeps its port but answers nothing (EC2, S3, SSM,
        IMDS) until :meth:`resume`; the instances' processes run on (their own AWS calls
        wait)."""
        pid = _read_pid(self.state_dir / "daemon.pid")
        if pid is None or not _is_our_daemon(pid):
            raise SandboxError("the AWS sandbox daemon is not running")
        _signal(pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT the daemon (no-op when it runs)."""
        pid = _read_pid(self.state_dir / "daemon.pid")
        if pid is not None and _is_our_daemon(pid):
            _signal(pid, signal.SIGCONT)

    def interrupt_spot(self, instance_id: str, notice_seconds: float = 2) -> None:
        """Post a spot interruption notice; the instance is reclaimed after notice_seconds."""
        self._call(
            "POST",
            "/_sandbox/spot/interrupt",
            {"instance_id": instance_id, "notice_seconds": notice_seconds},
        )

    def fail_capacity(self, instance_type: str, az: str) -> None:
        """RunInstances of this type in this AZ ("*": any AZ) fails InsufficientInstanceCapacity."""
        self._call("POST", "/_sandbox/faults", {"instance_type": instance_type, "az": az})

    def clear_faults(self) -> None:
        """Remove every injected fault."""
        self._call("POST", "/_sandbox/faults/clear", {})

    def set_quota(self, quota_code: str, value: float, region: str | None = None) -> None:
        """Set an EC2 vCPU quota value (all regions, or one)."""
        self._call(
            "POST", "/_sandbox/quotas", {"quota_code": quota_code, "value": value, "region": region}
        )

    def requests(self) -> list[dict]:
        """Counted AWS requests: rows of service, action, region, caller, count, errors."""
        return self._call("GET", "/_sandbox/requests")["requests"]

    def reset_requests(self) -> None:
        """Zero the request counters."""
        self._call("POST", "/_sandbox/requests/reset", {})

    def running_instances(self) -> list[dict]:
        """Instances not stopped/terminated in EC2 and any live instance process."""
        return self._call("GET", "/_sandbox/running")["running"]

    def instances(self) -> list[dict]:
        """The runner's view: pid, exit code, IMDS endpoint, directory of each instance."""
        return self._call("GET", "/_sandbox/instances")["instances"]

    # -- plumbing ---------------------------------------------------------------------------
    def _call(
        self, method: str, path: str, body: dict[str, Any] | None = None, timeout: float = 30
    ) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(
            self.endpoint_url() + path,
            data=data,
            method=method,
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")
            raise SandboxError(f"{method} {path}: HTTP {exc.code}: {detail}") from exc


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _is_our_daemon(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"tests.sandbox.aws" in cmdline and b"serve" in cmdline


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _wait_gone(pid: int, timeout: float, proc: subprocess.Popen[bytes] | None) -> bool:
    """Wait (bounded, sleeping) for a pid to exit; reap it if it is our child."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.pid == pid:
            if proc.poll() is not None:
                return True
        elif not _is_our_daemon(pid):
            return True
        time.sleep(0.1)
    return False
