"""Start, stop and drive the Kubernetes sandbox from tests (or the CLI in ``__main__``).

The daemon is a separate process so that a test session, ``airflow dags test`` and the demo
all talk to the same cluster over HTTP, exactly as production code talks to a real one.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from tests.sandbox.kubernetes.kubelet import reap_stale
from tests.sandbox.kubernetes.server import FORBIDDEN_TOKEN, SANDBOX_TOKEN
from tests.sandbox.paths import state_root

REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_STATE_DIR = state_root() / "kubernetes"
DEFAULT_PORT_BASE = 28000  # below the ephemeral range (32768-60999): no random clashes
PORT_OFFSET = 300  # Slurm uses base+100..119, AWS base+200..299
CONN_ID = "k8s_sandbox"
NOPODS_CONN_ID = "k8s_sandbox_nopods"
CONTEXT = "sandbox"
NOPODS_CONTEXT = "sandbox-nopods"
NAMESPACE = "default"


def sandbox_port() -> int:
    """The API port: ``$SKYPILOT_SANDBOX_PORT_BASE`` (default 28000) + 300."""
    return int(os.environ.get("SKYPILOT_SANDBOX_PORT_BASE", DEFAULT_PORT_BASE)) + PORT_OFFSET


class KubernetesSandbox:
    """Handle on the sandbox daemon: lifecycle, Airflow connections and fault injection."""

    def __init__(self, state_dir: Path | None = None, port: int | None = None) -> None:
        self.state_dir = Path(state_dir) if state_dir else DEFAULT_STATE_DIR
        self.port = port or sandbox_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.kubeconfig = self.state_dir / "kubeconfig"
        self.kubeconfig_nopods = self.state_dir / "kubeconfig-nopods"
        self.connections_file = self.state_dir / "connections.json"
        self.pid_file = self.state_dir / "daemon.pid"
        self.log_file = self.state_dir / "daemon.log"

    # ------------------------------------------------------------------ lifecycle
    def up(self, timeout: float = 30.0) -> dict[str, dict]:
        """Start the daemon unless it already runs; return the Airflow connections."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        if not self.is_up():
            self._start(timeout)
        self._write_config()
        return self.connections()

    def _start(self, timeout: float) -> None:
        with contextlib.suppress(urllib.error.URLError, OSError):
            urllib.request.urlopen(f"{self.url}/version", timeout=1).close()
            raise RuntimeError(
                f"port {self.port} is taken by something that is not the sandbox; "
                "set SKYPILOT_SANDBOX_PORT_BASE"
            )
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO_ROOT), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])]
        )
        with open(self.log_file, "ab") as log:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.sandbox.kubernetes",
                    "serve",
                    "--state-dir",
                    str(self.state_dir),
                    "--port",
                    str(self.port),
                ],
                cwd=REPO_ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"kubernetes sandbox exited with {proc.returncode}:\n" + self._log_tail()
                )
            if self.is_up():
                return
            time.sleep(0.1)
        proc.kill()
        raise TimeoutError(f"kubernetes sandbox did not answer in {timeout}s:\n" + self._log_tail())

    def _log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def down(self, timeout: float = 15.0) -> None:
        """Stop the daemon (SIGTERM, then SIGKILL) and any pod process it left behind."""
        pid = self._pid()
        if pid is not None and self._is_ours(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and self._alive(pid):
                time.sleep(0.1)
            if self._alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                while self._alive(pid) and time.monotonic() < deadline + 5:
                    time.sleep(0.1)
            with contextlib.suppress(ChildProcessError):  # started by this process: reap it
                os.waitpid(pid, os.WNOHANG)
        reap_stale(self.state_dir / "pods.pids")
        with contextlib.suppress(FileNotFoundError):
            self.pid_file.unlink()

    def _pid(self) -> int | None:
        try:
            return int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None

    @staticmethod
    def _alive(pid: int) -> bool:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        return stat.rsplit(")", 1)[1].split()[0] != "Z"

    @staticmethod
    def _is_ours(pid: int) -> bool:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return False
        return b"tests.sandbox.kubernetes" in cmdline

    def is_up(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/_sandbox/ping", timeout=2) as resp:
                return json.load(resp).get("sandbox") == "kubernetes"
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def status(self) -> dict[str, Any]:
        return {
            "up": self.is_up(),
            "url": self.url,
            "pid": self._pid(),
            "state_dir": str(self.state_dir),
            "kubeconfig": str(self.kubeconfig),
            "connections": str(self.connections_file),
            "log": str(self.log_file),
        }

    # ------------------------------------------------------------------ connections
    def connections(self) -> dict[str, dict]:
        """Airflow connections (``airflow connections import`` format, extra as a dict)."""
        return {
            CONN_ID: {
                "conn_type": "kubernetes",
                "description": "Kubernetes sandbox",
                "extra": {
                    "kube_config_path": str(self.kubeconfig),
                    "namespace": NAMESPACE,
                    "cluster_context": CONTEXT,
                },
            },
            NOPODS_CONN_ID: {
                "conn_type": "kubernetes",
                "description": "Kubernetes sandbox, pod listing forbidden",
                "extra": {
                    "kube_config_path": str(self.kubeconfig_nopods),
                    "namespace": NAMESPACE,
                    "cluster_context": NOPODS_CONTEXT,
                },
            },
        }

    def _kubeconfig(self, contexts: list[tuple[str, str]]) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "preferences": {},
            "current-context": contexts[0][0],
            "clusters": [{"name": CONTEXT, "cluster": {"server": self.url}}],
            "users": [{"name": ctx, "user": {"token": token}} for ctx, token in contexts],
            "contexts": [
                {"name": ctx, "context": {"cluster": CONTEXT, "user": ctx, "namespace": NAMESPACE}}
                for ctx, _ in contexts
            ],
        }

    def _write_config(self) -> None:
        both = [(CONTEXT, SANDBOX_TOKEN), (NOPODS_CONTEXT, FORBIDDEN_TOKEN)]
        self.kubeconfig.write_text(yaml.safe_dump(self._kubeconfig(both), sort_keys=False))
        self.kubeconfig_nopods.write_text(
            yaml.safe_dump(self._kubeconfig(both[1:]), sort_keys=False)
        )
        self.connections_file.write_text(json.dumps(self.connections(), indent=2) + "\n")

    # ------------------------------------------------------------------ control
    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(
            f"{self.url}/_sandbox/{path}",
            data=data,
            method=method,
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as resp:
                return json.load(resp)
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")
            raise RuntimeError(f"sandbox {method} {path}: {exc.code} {detail}") from exc

    def reset(self) -> None:
        """Delete every workload (killing its processes), heal the nodes, clear request counts."""
        self.resume()  # a paused daemon first: the reset is a request to it
        self._call("POST", "reset")

    def pause(self) -> None:
        """SIGSTOP the daemon: the API server keeps its port but answers nothing (and its
        kubelet records nothing) until :meth:`resume`; the pods' processes run on."""
        pid = self._pid()
        if pid is None or not self._is_ours(pid):
            raise RuntimeError("the kubernetes sandbox is not running")
        os.kill(pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT the daemon (no-op when it runs)."""
        pid = self._pid()
        if pid is not None and self._is_ours(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def evict_pod(self, namespace: str, name: str) -> None:
        self._call("POST", f"pods/{namespace}/{name}/evict")

    def fail_node(self, name: str) -> None:
        self._call("POST", f"nodes/{name}/fail")

    def restore_node(self, name: str) -> None:
        self._call("POST", f"nodes/{name}/restore")

    def set_not_ready(self, name: str) -> None:
        self._call("POST", f"nodes/{name}/not-ready")

    def cordon(self, name: str) -> None:
        self._call("POST", f"nodes/{name}/cordon")

    def uncordon(self, name: str) -> None:
        self._call("POST", f"nodes/{name}/uncordon")

    def taint(self, name: str, key: str, effect: str = "NoSchedule", value: str = "") -> None:
        self._call("POST", f"nodes/{name}/taint", {"key": key, "effect": effect, "value": value})

    def untaint(self, name: str, key: str) -> None:
        self._call("POST", f"nodes/{name}/untaint", {"key": key})

    def requests(self) -> list[dict]:
        """API requests since the last reset: {method, path, query, user, time}."""
        return self._call("GET", "requests")

    def reset_requests(self) -> None:
        self._call("POST", "requests/reset")

    def processes(self) -> list[dict]:
        """Pod processes still running: {namespace, pod, uid, container, pid, node}."""
        return self._call("GET", "processes")
