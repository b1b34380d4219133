"""The backends the contract suite (test_backend_contract.py) runs against, one target each.

The suite talks to a backend only through the :class:`~airflow_skypilot.backends.base.Backend`
protocol. What the protocol cannot say (how many requests a poll made, what is stored about a
job outside its secret store, what still runs) a target observes on its sandbox, and the faults
that silence a backend it makes there: its connection pointed at a closed port
(:meth:`Target.unreachable`, the same for all), and the real faults its sandbox has
(:meth:`Target.faults`: a paused slurmctld, a stopped login node, a paused API server or AWS
endpoint). Adding a backend to the contract = one more :class:`Target` subclass in
:data:`TARGETS`; the test functions stay as they are, and every backend meets all of them.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import gzip
import io
import json
import os
import re
import tarfile
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from airflow_skypilot.backends.base import Backend, JobHandle
from airflow_skypilot.backends.registry import backend_for_connection
from tests.conftest import free_port, use_connections

# --- helpers shared by the targets -------------------------------------------------------------

_B64_RUN = re.compile(r"(?:[A-Za-z0-9+/]{4}\n?){8,}(?:[A-Za-z0-9+/]{2,3}={0,2})?")


def unpacked(name: str, data: bytes | str, depth: int = 0) -> dict[str, str]:
    """``data`` as text, plus the text of everything packed inside it (gzip, tar, base64 runs):
    a secret in an embedded base64 ``tar.gz`` is still found by a substring test."""
    raw = data.encode() if isinstance(data, str) else data
    out: dict[str, str] = {}
    if depth > 4:
        return {name: raw.decode("utf-8", "replace")}
    if raw[:2] == b"\x1f\x8b":
        with contextlib.suppress(OSError, EOFError):
            return unpacked(f"{name}|gunzip", gzip.decompress(raw), depth + 1)
    if len(raw) > 262 and raw[257:262] == b"ustar":
        with contextlib.suppress(tarfile.TarError), \
                tarfile.open(fileobj=io.BytesIO(raw)) as tar:
            for member in tar.getmembers():
                fh = tar.extractfile(member) if member.isfile() else None
                if fh is not None:
                    out.update(unpacked(f"{name}|{member.name}", fh.read(), depth + 1))
            return out
    text = raw.decode("utf-8", "replace")
    out[name] = text
    for i, match in enumerate(_B64_RUN.finditer(text)):
        lines = match.group(0).rstrip("\n").split("\n")
        # a wrapped run may have taken the first letters of the next line too (a heredoc's
        # end marker, "AIRF" of AIRFLOW_SKYPILOT_PAYLOAD): then it decodes without its last line
        for candidate in (lines, lines[:-1]) if len(lines) > 1 else (lines,):
            decoded = _b64(re.sub(r"\s+", "", "".join(candidate)))
            if decoded is None:
                continue
            if decoded[:2] == b"\x1f\x8b" or decoded[257:262] == b"ustar":
                if not _whole(decoded):
                    continue
                out.update(unpacked(f"{name}|b64#{i}", decoded, depth + 1))
            else:
                with contextlib.suppress(UnicodeDecodeError):
                    out[f"{name}|b64#{i}"] = decoded.decode("utf-8")
            break
    return out


def _b64(blob: str) -> bytes | None:
    try:
        return base64.b64decode(blob + "=" * (-len(blob) % 4))
    except (binascii.Error, ValueError):
        return None


def _whole(packed: bytes) -> bool:
    """Does a gzip or tar stream read to its end (not cut, nothing after it)?"""
    try:
        if packed[:2] == b"\x1f\x8b":
            gzip.decompress(packed)
        else:
            with tarfile.open(fileobj=io.BytesIO(packed)) as tar:
                tar.getmembers()
    except (OSError, EOFError, tarfile.TarError):
        return False
    return True


def processes_with_env(key: str, value: str) -> list[str]:
    """Local processes whose environment has ``key=value`` (every sandbox runs its jobs as
    processes on this machine; a job's processes inherit ``SKYPILOT_TASK_ID``)."""
    needle = f"{key}={value}".encode() + b"\0"
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            env = (proc / "environ").read_bytes()
            if needle in b"\0" + env or env.startswith(needle):
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    found.append(f"pid {proc.name}: {cmd.strip()}")
        except (OSError, IndexError):
            continue
    return found


def closed_port() -> int:
    """A local TCP port nothing listens on: where a silent backend's address points."""
    return free_port()


#: a fault: (what it is, a context manager that holds it while the block runs)
Fault = tuple[str, Callable[[], contextlib.AbstractContextManager[None]]]


def held(start: Callable[[], Any], end: Callable[[], Any]
         ) -> Callable[[], contextlib.AbstractContextManager[None]]:
    """A fault's context manager: ``start()``, the block, then ``end()`` whatever happened."""
    @contextlib.contextmanager
    def hold() -> Iterator[None]:
        start()
        try:
            yield
        finally:
            end()
    return hold


# --- the target protocol --------------------------------------------------------------------


class Target(ABC):
    """One backend on its sandbox, as the contract suite sees it."""

    #: the pytest id (``-k slurm``)
    id: ClassVar[str]
    #: the tests/conftest.py fixture that gives a clean sandbox with its connections set
    fixture: ClassVar[str]
    #: the Airflow connection the suite's backend uses
    conn_id: ClassVar[str]
    #: a GPU type with at least 2 nodes of at least 1 free GPU on a clean sandbox
    accelerator: ClassVar[str]
    #: candidate resources (a task's ``resources``) for a plain CPU job
    cpu_resources: ClassVar[dict[str, Any]] = {}
    #: seconds a short job may take from submit to its end on this sandbox
    job_timeout: ClassVar[float] = 60.0
    #: most requests one status poll of any number of jobs may make (the batched query)
    max_status_queries: ClassVar[int] = 1
    #: connection extras for the fault tests: the backend's own limits on a silent peer
    quick_extras: ClassVar[dict[str, Any]] = {}
    #: seconds any call may take, with :attr:`quick_extras`, to say "could not ask"
    silent_within: ClassVar[float] = 30.0
    #: does a probe name the jobs whose room it already counts (``Offer.jobs_seen``)?
    probe_lists_jobs: ClassVar[bool] = True
    #: does the backend hold work that cannot start yet in a queue (a capacity row's
    #: ``pending``, the queue depth)? Without one, ``pending`` is None
    has_queue: ClassVar[bool] = True
    #: does a node of a multi-node job stay until every rank's run has ended (SkyPilot's
    #: nodes do)? Kubernetes' pod of a rank ends with its run (README, known limits)
    keeps_nodes: ClassVar[bool] = True
    #: does a workdir's ``.git`` travel (SkyPilot's rsync sends it)? Not in Kubernetes'
    #: Secret of ~900 KiB (README)
    ships_git: ClassVar[bool] = True
    #: GPUs of :attr:`accelerator` on each node that has them: a job of that many fills a node
    gpus_per_node: ClassVar[int]
    #: a shell command a job's rank runs to print its own address (as SKYPILOT_NODE_IPS
    #: lists the rank's node), found without SKYPILOT_NODE_IPS
    own_address: ClassVar[str]

    def __init__(self, box: Any, monkeypatch: pytest.MonkeyPatch):
        self.box = box
        self.monkeypatch = monkeypatch
        #: (handle, SKYPILOT_TASK_ID) of every job a test submitted: cancelled after it
        self.submitted: list[tuple[JobHandle, str]] = []

    def connect(self) -> None:
        """Adjust the connection for fast tests (after the fixture has set it)."""
        return None

    def backend(self) -> Backend:
        """A fresh backend on the target's connection, as a worker or triggerer makes one."""
        return backend_for_connection(self.conn_id)

    # --- the connection and faults ------------------------------------------------------------
    def connection(self) -> dict[str, Any]:
        """The connection as the backends in this process see it now."""
        return json.loads(os.environ[f"AIRFLOW_CONN_{self.conn_id.upper()}"])

    def use(self, conn: dict[str, Any]) -> None:
        """Make ``conn`` the connection (for the rest of the test)."""
        use_connections(self.monkeypatch, {self.conn_id: conn})

    def quicken(self) -> None:
        """Give the connection :attr:`quick_extras` (the fault tests' limits)."""
        conn = self.connection()
        self.use({**conn, "extra": {**(conn.get("extra") or {}), **self.quick_extras}})

    @contextlib.contextmanager
    def unreachable(self) -> Iterator[None]:
        """While the block runs, the connection points at a closed port."""
        before = self.connection()
        moved = self._at_port(before, closed_port())
        self.use(moved)
        try:
            yield
        finally:
            self.use(before)
            self._forget(moved)

    @abstractmethod
    def _at_port(self, conn: dict[str, Any], port: int) -> dict[str, Any]:
        """``conn`` with the backend's address at local ``port``."""

    def _forget(self, conn: dict[str, Any]) -> None:
        """Remove what :meth:`_at_port` made for ``conn`` (files...): it is no longer used."""
        return None

    def is_own_address(self, listed: str, own: str) -> bool:
        """Is ``listed`` (a line of SKYPILOT_NODE_IPS) the address :attr:`own_address`
        printed?"""
        return listed == own

    def faults(self) -> list[Fault]:
        """The sandbox's real faults that silence the backend while the job runs on."""
        return []

    # --- what the protocol cannot tell --------------------------------------------------------
    @abstractmethod
    def reset_requests(self) -> None:
        """Zero the request counters."""

    @abstractmethod
    def status_queries(self) -> int:
        """Requests since :meth:`reset_requests` that asked the backend for job states."""

    @abstractmethod
    def all_requests(self) -> int:
        """Every request since :meth:`reset_requests` (status, logs, markers, ...)."""

    @abstractmethod
    def submissions(self, job_name: str) -> int:
        """How many jobs the backend holds under ``job_name`` (submitted, in any state)."""

    @abstractmethod
    def running(self, handle: JobHandle, task_id: str) -> list[str]:
        """What of the job still runs or holds resources (empty: nothing)."""

    @abstractmethod
    def secret_store(self, handle: JobHandle) -> list[str]:
        """Where the job's secrets are still stored (empty: nowhere)."""

    @abstractmethod
    def stored_texts(self, handle: JobHandle) -> dict[str, str]:
        """Everything stored about the job outside its secret store (name -> text, unpacked
        with :func:`unpacked`), where a secret value must never appear."""

    def leftovers(self, handle: JobHandle, task_id: str) -> list[str]:
        return self.secret_store(handle) + self.running(handle, task_id)


# --- Slurm ------------------------------------------------------------------------------------


class SlurmTarget(Target):
    """Cluster alpha (partitions batch = a1, a2 and short = a2; 4 x A100 per node) over ssh."""

    id = "slurm"
    fixture = "slurm"
    conn_id = "slurm_alpha"
    cluster = "alpha"
    accelerator = "A100"
    gpus_per_node = 4
    # the node the rank's step runs on (slurmd sets SLURMD_NODENAME), its NodeAddr
    own_address = ("scontrol show node -o \"$SLURMD_NODENAME\" | tr ' ' '\\n' "
                   "| sed -n 's/^NodeAddr=//p'")
    max_status_queries = 1  # one ssh command
    # the sandbox's MessageTimeout is 5 s: a paused slurmctld fails squeue after about that
    quick_extras = {"slurm_timeout": 8, "command_timeout": 30}
    silent_within = 25.0

    def _at_port(self, conn: dict[str, Any], port: int) -> dict[str, Any]:
        return {**conn, "port": port}

    def faults(self) -> list[Fault]:
        box, cluster = self.box, self.cluster
        return [("slurmctld paused (SIGSTOP)", held(lambda: box.pause_slurmctld(cluster),
                                                    lambda: box.resume_slurmctld(cluster))),
                ("login node's sshd stopped", held(lambda: box.stop_sshd(cluster),
                                                   lambda: box.start_sshd(cluster)))]

    def reset_requests(self) -> None:
        self.box.clear_commands_log(self.cluster)

    def status_queries(self) -> int:
        return len(self.box.commands_log(self.cluster))

    all_requests = status_queries

    def _squeue(self, *args: str) -> list[str]:
        proc = self.box.run(self.cluster, "squeue", "-h", *args, check=False)
        return proc.stdout.split()

    def submissions(self, job_name: str) -> int:
        return len(self._squeue("-t", "all", "-n", job_name, "-o", "%i"))

    def running(self, handle: JobHandle, task_id: str) -> list[str]:
        active = [f"squeue: {state}" for state in self._squeue(
            "-j", handle.job_id, "-t", "PD,R,CG,CF,S,RQ,RS,SO,ST", "-o", "%T")]
        return active + processes_with_env("SKYPILOT_TASK_ID", task_id)

    def secret_store(self, handle: JobHandle) -> list[str]:
        path = Path(handle.extra["job_dir"]) / "secrets.sh"
        return [str(path)] if path.exists() else []

    def stored_texts(self, handle: JobHandle) -> dict[str, str]:
        job_dir = Path(handle.extra["job_dir"])
        out: dict[str, str] = {}
        for path in sorted(job_dir.rglob("*")):  # the login node is this machine; we are root
            if path.is_file() and path.name != "secrets.sh":
                out.update(unpacked(str(path), path.read_bytes()))
        for name, argv in (("scontrol show job", ["scontrol", "show", "job", "-dd",
                                                  handle.job_id]),
                           ("batch script", ["scontrol", "write", "batch_script",
                                             handle.job_id, "-"])):
            out.update(unpacked(name, self.box.run(self.cluster, *argv, check=False).stdout))
        out["ssh command lines"] = "\n".join(self.box.commands_log(self.cluster))
        return out


# --- Kubernetes -------------------------------------------------------------------------------


class KubernetesTarget(Target):
    """The kmock cluster (gpu-node-1, gpu-node-2 with 8 x A100 each, cpu-node-1)."""

    id = "kubernetes"
    fixture = "k8s"
    conn_id = "k8s_sandbox"
    accelerator = "A100"
    gpus_per_node = 8
    # a pod knows its hostname (<job>-<rank>, from the Indexed Job's completion index), not its
    # DNS name: the sandbox's pods are local processes without cluster DNS (`hostname -f` is
    # this machine's), so the rank checks the first label of the name the list has for it
    own_address = 'echo "$HOSTNAME"'
    keeps_nodes = False
    ships_git = False
    max_status_queries = 3  # one Job list and one pod list per namespace, one node list
    label = "skypilot.airflow/job-name"
    quick_extras = {"request_timeout": 5}
    silent_within = 20.0

    def _at_port(self, conn: dict[str, Any], port: int) -> dict[str, Any]:
        import yaml

        config = yaml.safe_load(Path(conn["extra"]["kube_config_path"]).read_text())
        for cluster in config["clusters"]:
            cluster["cluster"]["server"] = f"http://127.0.0.1:{port}"
        # beside the sandbox's own kubeconfig: gone with the sandbox (a temp dir was left behind)
        path = self.box.kubeconfig.with_name(f"kubeconfig-at-port-{port}")
        path.write_text(yaml.safe_dump(config))
        return {**conn, "extra": {**conn["extra"], "kube_config_path": str(path)}}

    def _forget(self, conn: dict[str, Any]) -> None:
        path = Path(conn["extra"]["kube_config_path"])
        if path.name.startswith("kubeconfig-at-port-"):  # never the sandbox's own
            path.unlink(missing_ok=True)

    def is_own_address(self, listed: str, own: str) -> bool:
        return bool(own) and listed.split(".", 1)[0] == own

    def faults(self) -> list[Fault]:
        return [("API server paused (SIGSTOP)", held(self.box.pause, self.box.resume))]

    def connect(self) -> None:
        from kubernetes import client, config

        self.api = config.new_client_from_config(config_file=str(self.box.kubeconfig),
                                                 context="sandbox")
        self.core = client.CoreV1Api(self.api)
        self.batch = client.BatchV1Api(self.api)

    def reset_requests(self) -> None:
        self.box.reset_requests()

    def status_queries(self) -> int:
        return len(self.box.requests())

    all_requests = status_queries

    def _ns(self, handle: JobHandle) -> str:
        return handle.extra.get("namespace") or "default"

    def submissions(self, job_name: str) -> int:
        jobs = self.batch.list_namespaced_job("default").items
        return sum((j.metadata.labels or {}).get(self.label) == job_name
                   or j.metadata.name == job_name for j in jobs)

    def running(self, handle: JobHandle, task_id: str) -> list[str]:
        pods = [f"pod process {p['pod']} (pid {p['pid']})" for p in self.box.processes()
                if p["pod"].startswith(handle.job_name)]
        return pods + processes_with_env("SKYPILOT_TASK_ID", task_id)

    def secret_store(self, handle: JobHandle) -> list[str]:
        return [f"Secret {s.metadata.name}" for s in
                self.core.list_namespaced_secret(self._ns(handle)).items
                if s.metadata.name.startswith(handle.job_name)]

    def stored_texts(self, handle: JobHandle) -> dict[str, str]:
        ns = self._ns(handle)
        out: dict[str, str] = {}
        for kind, items in (
            ("Job", self.batch.list_namespaced_job(ns).items),
            ("Pod", self.core.list_namespaced_pod(ns).items),
            ("ConfigMap", self.core.list_namespaced_config_map(ns).items),
            ("Service", self.core.list_namespaced_service(ns).items),
            ("Event", self.core.list_namespaced_event(ns).items),
        ):
            for obj in items:
                text = json.dumps(self.api.sanitize_for_serialization(obj), indent=1)
                out.update(unpacked(f"{kind} {obj.metadata.name}", text))
                for key, value in ((getattr(obj, "data", None) or {}).items()
                                   if kind == "ConfigMap" else ()):
                    out.update(unpacked(f"{kind} {obj.metadata.name} {key}", value))
        return out


# --- AWS --------------------------------------------------------------------------------------


class AwsTarget(Target):
    """moto over HTTP with instances whose user-data runs here (us-east-1, us-west-2)."""

    id = "aws"
    fixture = "aws"
    probe_lists_jobs = False  # instances still launching are counted, not named
    conn_id = "aws_sandbox"
    accelerator = "A10G"
    gpus_per_node = 1
    # EC2 has no queue: an instance launches now or the launch fails (insufficient capacity,
    # a quota), so nothing waits and capacity rows say pending=None, not a made-up 0
    has_queue = False
    # the instance's private IP from its metadata service (IMDSv2: a token first)
    own_address = ('imds="${AWS_EC2_METADATA_SERVICE_ENDPOINT:-http://169.254.169.254}"; '
                   'tok=$(curl -sf -m 5 -X PUT -H "X-aws-ec2-metadata-token-ttl-seconds: 60" '
                   '"$imds/latest/api/token"); curl -sf -m 5 '
                   '-H "X-aws-ec2-metadata-token: $tok" "$imds/latest/meta-data/local-ipv4"')
    cpu_resources = {"cpus": "2+"}
    job_timeout = 90.0
    #: one DescribeInstances per region and one ListObjectsV2 per bucket (the markers of every
    #: job with a started instance); the suite's jobs are in one region and one bucket
    max_status_queries = 2
    tag = "skypilot-airflow:job-name"
    # up to three attempts of 4 s each, and the backoff between them
    quick_extras = {"request_timeout": 4}
    silent_within = 30.0

    def _at_port(self, conn: dict[str, Any], port: int) -> dict[str, Any]:
        return {**conn, "extra": {**conn["extra"], "endpoint_url": f"http://127.0.0.1:{port}"}}

    def faults(self) -> list[Fault]:
        return [("AWS endpoint paused (SIGSTOP)", held(self.box.pause, self.box.resume))]

    def connect(self) -> None:
        import boto3

        from tests.sandbox.aws.config import ACCESS_KEY_ID, BUCKET, SECRET_ACCESS_KEY

        conn = self.box.connections()[self.conn_id]
        conn["extra"] = {**conn["extra"], "log_interval": 1, "spot_check_interval": 1}
        use_connections(self.monkeypatch, {self.conn_id: conn})
        self.bucket = BUCKET
        session = boto3.session.Session()
        self._client = lambda service, region="us-east-1": session.client(
            service, region_name=region, endpoint_url=self.box.endpoint_url(),
            aws_access_key_id=ACCESS_KEY_ID, aws_secret_access_key=SECRET_ACCESS_KEY)

    def reset_requests(self) -> None:
        self.box.reset_requests()

    def _count(self, action: str | None = None) -> int:
        return sum(r["count"] for r in self.box.requests() if r["caller"] == "client"
                   and (action is None or r["action"] == action))

    def status_queries(self) -> int:
        return self._count("DescribeInstances") + self._count("ListObjectsV2")

    def all_requests(self) -> int:
        return self._count()

    def _instances(self, handle_or_name: JobHandle | str) -> list[dict]:
        name = getattr(handle_or_name, "job_name", handle_or_name)
        region = getattr(handle_or_name, "extra", {}).get("region", "us-east-1")
        pages = self._client("ec2", region).describe_instances(
            Filters=[{"Name": f"tag:{self.tag}", "Values": [name]}])
        return [{**i, "ReservationId": r["ReservationId"]} for r in pages["Reservations"]
                for i in r["Instances"]]

    def submissions(self, job_name: str) -> int:
        return len({i["ReservationId"] for i in self._instances(job_name)})

    def running(self, handle: JobHandle, task_id: str) -> list[str]:
        ids = set(handle.extra.get("instance_ids", []))
        alive = [f"instance {r['instance_id']} ({r['state']}, pids {r['pids']})"
                 for r in self.box.running_instances() if r["instance_id"] in ids]
        return alive + processes_with_env("SKYPILOT_TASK_ID", task_id)

    def secret_store(self, handle: JobHandle) -> list[str]:
        ssm = self._client("ssm", handle.extra.get("region", "us-east-1"))
        params = ssm.get_parameters_by_path(Path=handle.extra["ssm_path"], Recursive=True)
        return [f"SSM {p['Name']}" for p in params["Parameters"]]

    def _objects(self, handle: JobHandle) -> list[str]:
        listed = self._client("s3").list_objects_v2(Bucket=self.bucket,
                                                    Prefix=handle.extra["prefix"])
        return [o["Key"] for o in listed.get("Contents", [])]

    def leftovers(self, handle: JobHandle, task_id: str) -> list[str]:
        staged = [f"s3 {k}" for k in self._objects(handle) if k.endswith("payload.tgz")]
        return super().leftovers(handle, task_id) + staged

    def stored_texts(self, handle: JobHandle) -> dict[str, str]:
        out: dict[str, str] = {}
        ec2 = self._client("ec2", handle.extra.get("region", "us-east-1"))
        for inst in self._instances(handle):
            iid = inst["InstanceId"]
            raw = ec2.describe_instance_attribute(InstanceId=iid, Attribute="userData")
            value = (raw.get("UserData") or {}).get("Value", "")
            out.update(unpacked(f"{iid} user-data", base64.b64decode(value)))
            out[f"{iid} tags"] = json.dumps(inst.get("Tags", []))
        s3 = self._client("s3")
        for key in self._objects(handle):
            body = s3.get_object(Bucket=self.bucket, Key=key)["Body"].read()
            out.update(unpacked(f"s3 {key}", body))
        ids = set(handle.extra.get("instance_ids", []))
        for inst in self.box.instances():  # what EC2's GetConsoleOutput would show
            console = Path(inst.get("dir") or "/nonexistent") / "console.log"
            if inst.get("instance_id") in ids and console.exists():
                out[f"{inst['instance_id']} console"] = console.read_text(errors="replace")
        return out


TARGETS: list[type[Target]] = [SlurmTarget, KubernetesTarget, AwsTarget]
