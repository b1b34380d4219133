"""Instance runner: makes EC2 instances in moto actually run their user-data as local processes.

It watches EC2 through boto3 like any client (one describe_instances per watched region per
second), starts a process for each instance that turned `running`, gives it an IMDS endpoint and
an instance-like environment, and kills the process tree when the instance stops or terminates.
"""

from __future__ import annotations

import base64
import binascii
import email
import getpass
import gzip
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import boto3
from botocore.config import Config

from . import motopatch
from .config import (
    ACCOUNT_ID,
    HOST,
    INSTANCE_SECRET,
    OS_SHUTDOWN_UA,
    RUNNER_ACCESS_KEY_ID,
    SECRET_ACCESS_KEY,
    instance_access_key,
)
from .imds import ImdsServer, InstanceMetadata
from .procs import instance_pids

log = logging.getLogger("sandbox.aws.runner")

POLL_INTERVAL = 1.0
POWERED_OFF = ("stopping", "stopped", "shutting-down", "terminated")

SHUTDOWN_SHIM = '''#!{python}
"""shutdown(8) for a sandbox EC2 instance: asks EC2 to stop or terminate this instance.

Like `shutdown -h now` on a real instance: the instance's InstanceInitiatedShutdownBehavior
decides between stop and terminate, and EC2 reports Client.InstanceInitiatedShutdown.
"""
import os, sys, time
from datetime import datetime, timedelta

INSTANCE_ID = {instance_id!r}
PIDFILE = {pidfile!r}


def power_off():
    try:  # awscli 1.46 (as installed here) vendors botocore as awscli.botocore
        from awscli.botocore.config import Config
        from awscli.botocore.session import get_session
    except ImportError:
        from botocore.config import Config
        from botocore.session import get_session
    session = get_session()
    ec2 = session.create_client("ec2", config=Config(
        user_agent_extra={ua!r}, retries={{"max_attempts": 3, "mode": "standard"}}))
    attr = ec2.describe_instance_attribute(
        InstanceId=INSTANCE_ID, Attribute="instanceInitiatedShutdownBehavior")
    behaviour = attr.get("InstanceInitiatedShutdownBehavior", {{}}).get("Value", "stop")
    if behaviour == "terminate":
        ec2.terminate_instances(InstanceIds=[INSTANCE_ID])
    else:
        ec2.stop_instances(InstanceIds=[INSTANCE_ID])


def main(argv):
    when = "now"
    for arg in argv:
        if arg in ("-r", "--reboot"):
            sys.stderr.write("shutdown: reboot is not supported in the sandbox\\n")
            return 1
        if arg in ("-k",):
            return 0
        if arg in ("-c",):
            try:
                os.kill(int(open(PIDFILE).read()), 15)
                os.unlink(PIDFILE)
            except (OSError, ValueError):
                pass
            return 0
        if not arg.startswith("-") and when == "now" and (
                arg == "now" or arg.startswith("+") or ":" in arg):
            when = arg
    delay = 0.0
    if when.startswith("+"):
        delay = 60.0 * float(when[1:] or 0)
    elif ":" in when:
        now = datetime.now()
        hh, mm = (int(x) for x in when.split(":", 1))
        target = now.replace(hour=hh, minute=mm, second=0, microsecond=0)
        if target <= now:
            target += timedelta(days=1)
        delay = (target - now).total_seconds()
    if delay <= 0:
        power_off()
        return 0
    if os.fork() == 0:
        with open(PIDFILE, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(delay)
        power_off()
        os._exit(0)
    print("Shutdown scheduled in %d s, use 'shutdown -c' to cancel." % delay)
    return 0


sys.exit(main(sys.argv[1:]))
'''

SUDO_SHIM = """#!/bin/bash
# sudo for a sandbox instance: cloud-init runs user-data as root, here everything runs as the
# sandbox user, so sudo only drops its own options and runs the command (never a host binary
# through sudo's secure_path).
while [ $# -gt 0 ]; do
  case "$1" in
    -u|-g|-C|-h|-p|-r|-t|-U) shift 2 ;;
    --) shift; break ;;
    -*) shift ;;
    *) break ;;
  esac
done
[ $# -eq 0 ] && exit 0
exec "$@"
"""

POWEROFF_SHIM = """#!/bin/bash
# poweroff/halt on a sandbox instance: same as shutdown -h now.
exec "$(dirname "$0")/shutdown" -h now
"""


@dataclass
class Tracked:
    """One instance the runner has seen running."""

    instance_id: str
    region: str
    directory: Path
    access_key: str
    meta: InstanceMetadata | None = None
    proc: subprocess.Popen[bytes] | None = None
    imds: ImdsServer | None = None
    status: str = "idle"  # idle | running | exited | killed
    exit_code: int | None = None
    powered_off: bool = False
    note: str = ""
    started: float = field(default_factory=time.time)

    def as_dict(self) -> dict[str, Any]:
        """Describe the instance's process for /_sandbox/instances."""
        return {
            "instance_id": self.instance_id,
            "region": self.region,
            "status": self.status,
            "pid": self.proc.pid if self.proc else None,
            "exit_code": self.exit_code,
            "powered_off": self.powered_off,
            "imds_endpoint": self.imds.endpoint if self.imds else None,
            "local_ipv4": self.meta.local_ipv4 if self.meta else None,
            "lifecycle": self.meta.lifecycle if self.meta else None,
            "instance_action": self.meta.instance_action if self.meta else None,
            "dir": str(self.directory),
            "note": self.note,
        }


class InstanceRunner:
    """Runs instances' user-data locally; see the module docstring."""

    def __init__(
        self, state_dir: Path, moto_port: int, imds_ports: Iterable[int], awscli_bin: Path | None
    ) -> None:
        self.state_dir = state_dir
        self.instances_dir = state_dir / "instances"
        self.endpoint = f"http://{HOST}:{moto_port}"
        self.imds_ports = list(imds_ports)
        self.awscli_bin = awscli_bin
        self.lock = threading.RLock()
        self.tracked: dict[str, Tracked] = {}
        self.key_to_instance: dict[str, str] = {}
        self.watched: set[str] = set()
        self.timers: dict[str, threading.Timer] = {}
        self.pending_actions: dict[str, dict[str, str]] = {}  # notices for not-yet-seen instances
        self._clients: dict[str, Any] = {}
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="instance-runner", daemon=True)
        self._fallback_ip = 0

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        """Start watching in the background."""
        self.instances_dir.mkdir(parents=True, exist_ok=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching and power off every instance process."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)
        self.forget_all()

    def watch_region(self, region: str) -> None:
        """Poll this region from now on (called when EC2 sees a mutating call there)."""
        if region not in self.watched:
            with self.lock:
                self.watched.add(region)
        self._wake.set()

    def poke(self) -> None:
        """Poll now instead of at the next tick (e.g. right after RunInstances)."""
        self._wake.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
            except Exception:  # keep watching whatever one poll did
                log.exception("poll failed")
            self._wake.wait(POLL_INTERVAL)
            self._wake.clear()

    def _client(self, region: str) -> Any:
        if region not in self._clients:
            self._clients[region] = boto3.session.Session().client(
                "ec2",
                region_name=region,
                endpoint_url=self.endpoint,
                aws_access_key_id=RUNNER_ACCESS_KEY_ID,
                aws_secret_access_key=SECRET_ACCESS_KEY,
                config=Config(
                    retries={"max_attempts": 1},
                    connect_timeout=2,
                    read_timeout=15,
                    user_agent_extra="sandbox-runner",
                ),
            )
        return self._clients[region]

    # -- polling ----------------------------------------------------------------------------
    def poll_once(self) -> None:
        """One pass: start new running instances, power off stopped/terminated ones."""
        with self.lock:
            regions = sorted(self.watched | {t.region for t in self.tracked.values()})
            for region in regions:
                try:
                    reservations = self._describe(region)
                except Exception as exc:
                    log.warning("describe_instances %s failed: %s", region, exc)
                    continue
                present: set[str] = set()
                for reservation in reservations:
                    for inst in reservation.get("Instances", []):
                        iid = inst["InstanceId"]
                        present.add(iid)
                        state = inst["State"]["Name"]
                        if state == "running" and iid not in self.tracked:
                            self._launch(region, reservation, inst)
                        elif state in POWERED_OFF and iid in self.tracked:
                            self._power_off(self.tracked[iid], state)
                for t in list(self.tracked.values()):
                    if t.region == region and t.instance_id not in present:
                        self._power_off(t, "vanished")
            for t in self.tracked.values():
                if t.proc is not None and t.exit_code is None:
                    code = t.proc.poll()
                    if code is not None:
                        self._record_exit(t, code, "exited")

    def _describe(self, region: str) -> list[dict[str, Any]]:
        pages = self._client(region).get_paginator("describe_instances").paginate()
        return [r for page in pages for r in page.get("Reservations", [])]

    def _record_exit(self, t: Tracked, code: int, status: str) -> None:
        t.exit_code = code
        t.status = status
        (t.directory / "exit_code").write_text(f"{code}\n")
        log.info("instance %s process %s (exit %s)", t.instance_id, status, code)

    # -- starting ---------------------------------------------------------------------------
    def _launch(self, region: str, reservation: dict[str, Any], inst: dict[str, Any]) -> None:
        iid = inst["InstanceId"]
        directory = self.instances_dir / iid
        t = Tracked(iid, region, directory, instance_access_key(iid))
        self.tracked[iid] = t
        self.key_to_instance[t.access_key] = iid
        try:
            self._start_process(t, reservation, inst)
        except Exception as exc:
            t.note = f"start failed: {exc}"
            log.exception("could not start instance %s", iid)

    def _start_process(self, t: Tracked, reservation: dict[str, Any], inst: dict[str, Any]) -> None:
        for sub in ("home", "bin", "tmp"):
            (t.directory / sub).mkdir(parents=True, exist_ok=True)
        attr = self._client(t.region).describe_instance_attribute(
            InstanceId=t.instance_id, Attribute="userData"
        )
        encoded = (attr.get("UserData") or {}).get("Value")
        user_data = _b64decode(encoded) if encoded else None
        if user_data is not None:
            (t.directory / "user-data.raw").write_bytes(user_data)
        t.meta = self._metadata(t, reservation, inst, user_data)
        t.meta.instance_action = self.pending_actions.pop(t.instance_id, None)
        argv = self._program(t, user_data)
        if argv is None:
            return
        t.imds = self._start_imds(t.meta)
        self._write_shims(t)
        env = self.environment(t)
        with open(t.directory / "console.log", "ab") as console:
            t.proc = subprocess.Popen(
                argv,
                cwd=t.directory / "home",
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=console,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        t.status = "running"
        (t.directory / "pid").write_text(f"{t.proc.pid}\n")
        log.info("instance %s started pid %s (%s)", t.instance_id, t.proc.pid, argv)

    def _metadata(
        self, t: Tracked, reservation: dict[str, Any], inst: dict[str, Any], user_data: bytes | None
    ) -> InstanceMetadata:
        private_ip = inst.get("PrivateIpAddress") or ""
        if not private_ip.startswith("127."):
            # Not in a loopback default VPC (e.g. a custom VPC): give it a loopback address anyway.
            self._fallback_ip += 1
            private_ip = f"127.0.30.{self._fallback_ip % 250 + 1}"
            t.note = "PrivateIpAddress is not loopback; IMDS local-ipv4 differs from EC2's"
        profile = (inst.get("IamInstanceProfile") or {}).get("Arn", "")
        role = profile.rsplit("/", 1)[-1] if profile else None
        launch = inst.get("LaunchTime")
        launch_s = (
            launch.strftime("%Y-%m-%dT%H:%M:%SZ")
            if isinstance(launch, datetime)
            else str(launch or "")
        )
        nics = inst.get("NetworkInterfaces") or [{}]
        expiration = (datetime.now(timezone.utc) + timedelta(hours=6)).strftime(
            "%Y-%m-%dT%H:%M:%SZ"
        )
        return InstanceMetadata(
            instance_id=t.instance_id,
            instance_type=inst.get("InstanceType", ""),
            region=t.region,
            availability_zone=(inst.get("Placement") or {}).get("AvailabilityZone", ""),
            image_id=inst.get("ImageId", ""),
            local_ipv4=private_ip,
            local_hostname=inst.get("PrivateDnsName") or f"ip-{private_ip.replace('.', '-')}",
            reservation_id=reservation.get("ReservationId", ""),
            lifecycle="spot" if inst.get("InstanceLifecycle") == "spot" else "on-demand",
            launch_time=launch_s,
            user_data=user_data,
            http_tokens=(inst.get("MetadataOptions") or {}).get("HttpTokens", "optional"),
            account_id=ACCOUNT_ID,
            security_groups=[g.get("GroupName", "") for g in inst.get("SecurityGroups", [])],
            iam_role=role,
            credentials={
                "Code": "Success",
                "Type": "AWS-HMAC",
                "AccessKeyId": t.access_key,
                "SecretAccessKey": INSTANCE_SECRET,
                "Token": self._token(t),
                "Expiration": expiration,
                "LastUpdated": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            },
            ami_launch_index=int(inst.get("AmiLaunchIndex", 0) or 0),
            mac=nics[0].get("MacAddress") or "0e:00:00:00:00:01",
        )

    @staticmethod
    def _token(t: Tracked) -> str:
        return f"sandbox-session-token-{t.instance_id}"

    def _program(self, t: Tracked, user_data: bytes | None) -> list[str] | None:
        """Turn user-data into an argv the way cloud-init would, or None if nothing runs."""
        if not user_data:
            t.note = t.note or "no user-data: nothing to run"
            return None
        data = user_data
        if data[:2] == b"\x1f\x8b":
            data = gzip.decompress(data)
        if data.startswith(b"#!"):
            return _script_argv(t.directory / "user-data", data)
        head = data[:200].lower()
        if head.startswith(b"content-type: multipart") or head.startswith(b"mime-version"):
            message = email.message_from_bytes(data)
            parts = [
                p.get_payload(decode=True)
                for p in message.walk()
                if p.get_content_type() == "text/x-shellscript"
            ]
            scripts = [p for p in parts if isinstance(p, bytes)]
            if not scripts:
                t.note = "multipart user-data without text/x-shellscript parts: not run"
                return None
            lines = ["#!/bin/bash", "rc=0"]
            for i, script in enumerate(scripts):
                argv = _script_argv(t.directory / f"user-data.part{i}", script)
                lines.append(" ".join(f"'{a}'" for a in argv) + " || rc=$?")
            lines.append("exit $rc")
            wrapper = t.directory / "user-data"
            wrapper.write_text("\n".join(lines) + "\n")
            return ["/bin/bash", str(wrapper)]
        t.note = "user-data is not a script (e.g. #cloud-config): not run, served by IMDS only"
        return None

    def _start_imds(self, meta: InstanceMetadata) -> ImdsServer:
        used = {t.imds.server_address[1] for t in self.tracked.values() if t.imds}
        for port in self.imds_ports:
            if port in used:
                continue
            try:
                server = ImdsServer(HOST, port, meta)
            except OSError:
                continue
            server.start()
            return server
        raise RuntimeError(f"no free IMDS port in {self.imds_ports[0]}..{self.imds_ports[-1]}")

    def _write_shims(self, t: Tracked) -> None:
        bin_dir = t.directory / "bin"
        if self.awscli_bin is not None:
            aws = bin_dir / "aws"
            if not aws.exists():
                aws.symlink_to(self.awscli_bin / "aws")
            python = self.awscli_bin / "python"
        else:  # no AWS CLI: the shim still works with the daemon's own botocore
            python = Path(sys.executable)
        shutdown = bin_dir / "shutdown"
        shutdown.write_text(
            SHUTDOWN_SHIM.format(
                python=python,
                instance_id=t.instance_id,
                ua=OS_SHUTDOWN_UA,
                pidfile=str(t.directory / "shutdown.pid"),
            )
        )
        for name, text in (
            ("sudo", SUDO_SHIM),
            ("poweroff", POWEROFF_SHIM),
            ("halt", POWEROFF_SHIM),
        ):
            (bin_dir / name).write_text(text)
        for shim in bin_dir.iterdir():
            if not shim.is_symlink():
                shim.chmod(0o755)

    def environment(self, t: Tracked) -> dict[str, str]:
        """The environment an instance's user-data gets (documented in README.md)."""
        user = getpass.getuser()
        region = t.region
        return {
            "PATH": f"{t.directory / 'bin'}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin"
            ":/sbin:/bin",
            "HOME": str(t.directory / "home"),
            "USER": user,
            "LOGNAME": user,
            "SHELL": "/bin/bash",
            "LANG": "C.UTF-8",
            "TMPDIR": str(t.directory / "tmp"),
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": t.access_key,
            "AWS_SECRET_ACCESS_KEY": INSTANCE_SECRET,
            "AWS_SESSION_TOKEN": self._token(t),
            "AWS_DEFAULT_REGION": region,
            "AWS_REGION": region,
            "AWS_EC2_METADATA_SERVICE_ENDPOINT": t.imds.endpoint if t.imds else "",
        }

    # -- stopping ---------------------------------------------------------------------------
    def _power_off(self, t: Tracked, state: str) -> None:
        """The instance lost power: kill its process tree, drop its IMDS."""
        if t.powered_off:
            return
        t.powered_off = True
        timer = self.timers.pop(t.instance_id, None)
        if timer is not None:
            timer.cancel()
        if t.proc is not None:
            alive = t.proc.poll() is None
            self._kill_tree(t)
            code = t.proc.wait(timeout=10)
            if alive:
                self._record_exit(t, code, "killed")
            elif t.exit_code is None:
                self._record_exit(t, code, "exited")
        if t.imds is not None:
            t.imds.stop()
        log.info("instance %s powered off (%s)", t.instance_id, state)

    def _kill_tree(self, t: Tracked) -> None:
        assert t.proc is not None
        try:
            os.killpg(t.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in instance_pids(self.endpoint, t.access_key):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def power_off(self, instance_id: str) -> None:
        """Power off one instance's processes now (used after a spot reclaim)."""
        with self.lock:
            t = self.tracked.get(instance_id)
            if t is not None:
                self._power_off(t, "reclaimed")

    def forget_all(self) -> None:
        """Power off everything and forget it (reset, daemon stop)."""
        with self.lock:
            for timer in self.timers.values():
                timer.cancel()
            self.timers.clear()
            self.pending_actions.clear()
            for t in self.tracked.values():
                try:
                    self._power_off(t, "reset")
                except Exception:
                    log.exception("power off %s failed", t.instance_id)
            self.tracked.clear()
            self.key_to_instance.clear()
            self._fallback_ip = 0
        if self.instances_dir.exists():
            shutil.rmtree(self.instances_dir, ignore_errors=True)
        self.instances_dir.mkdir(parents=True, exist_ok=True)

    # -- faults -----------------------------------------------------------------------------
    def interrupt_spot(self, instance_id: str, notice_seconds: float) -> dict[str, str]:
        """Post the spot interruption notice now, reclaim the instance after the notice."""
        from moto.ec2.models import ec2_backends

        backend, inst = _find_instance(ec2_backends[ACCOUNT_ID], instance_id)
        if inst.state != "running":
            raise ValueError(f"{instance_id} is {inst.state}, not running")
        if inst.lifecycle != "spot":
            raise ValueError(f"{instance_id} is not a spot instance")
        when = datetime.now(timezone.utc) + timedelta(seconds=notice_seconds)
        action = {"action": "terminate", "time": when.strftime("%Y-%m-%dT%H:%M:%SZ")}
        with self.lock:
            t = self.tracked.get(instance_id)
            if t is not None and t.meta is not None:
                t.meta.instance_action = action
            else:
                self.pending_actions[instance_id] = action
            timer = threading.Timer(
                notice_seconds, self._reclaim, args=(backend.region_name, instance_id)
            )
            timer.daemon = True
            old = self.timers.pop(instance_id, None)
            if old is not None:
                old.cancel()
            self.timers[instance_id] = timer
            timer.start()
        log.info("spot interruption of %s at %s", instance_id, action["time"])
        return action

    def _reclaim(self, region: str, instance_id: str) -> None:
        from moto.ec2.models import ec2_backends

        with self.lock:
            self.timers.pop(instance_id, None)
        try:
            backend = ec2_backends[ACCOUNT_ID][region]
            with motopatch.state_reason(motopatch.SPOT_TERMINATION):
                backend.terminate_instances([instance_id])
        except Exception:
            log.exception("spot reclaim of %s failed", instance_id)
        self.power_off(instance_id)

    def snapshot(self) -> list[dict[str, Any]]:
        """The runner's view of every instance it has seen."""
        with self.lock:
            return [t.as_dict() for t in self.tracked.values()]


def _b64decode(value: str) -> bytes:
    try:
        return base64.b64decode(value, validate=False)
    except (binascii.Error, ValueError):
        return value.encode()


def _script_argv(path: Path, data: bytes) -> list[str]:
    """Write a #! script; shell scripts run as `/bin/bash [FLAGS] FILE`, others via their #!."""
    path.write_bytes(data)
    path.chmod(0o755)
    words = data.split(b"\n", 1)[0][2:].decode(errors="replace").split() or ["sh"]
    if words[0].endswith("/env") and len(words) > 1:
        words = words[1:]
    if words[0].rsplit("/", 1)[-1] in ("sh", "bash", "dash"):
        return ["/bin/bash", *words[1:], str(path)]  # keep flags such as `#!/bin/bash -ex`
    return [str(path)]


def _find_instance(account_backends: Any, instance_id: str) -> tuple[Any, Any]:
    """Find an instance in any region that has an EC2 backend (in-process)."""
    from moto.ec2.exceptions import InvalidInstanceIdError

    for region in list(account_backends.keys()):
        backend = account_backends[region]
        try:
            return backend, backend.get_instance(instance_id)
        except InvalidInstanceIdError:
            continue
    raise ValueError(f"no instance {instance_id}")
