"""Slurm clusters over SSH, on the ssh provider's ``SSHHook`` (paramiko) and ``SSHHookAsync``.

A Slurm cluster is an Airflow connection (type ``slurm``, or a plain ``ssh``) to its login node,
with extras (see :class:`SlurmSettings`). Everything goes through portable Slurm commands and
``-o``/``-O`` formats that Slurm 22.05 to today print the same way:

probe
    one SSH command: ``sinfo -N -O`` (per node and partition: state, CPUs, memory, GRES and
    GRES in use), ``sinfo -o`` (partitions), ``squeue -t PENDING`` (queue depth) and
    ``sbatch --test-only`` (Slurm's own estimate of when a job of each shape would start).
submit
    files over SFTP into ``<remote_work_dir>/jobs/<job name>/`` (mode 0700): the task's
    ``setup.sh``/``run.sh`` verbatim, ``env.sh``, ``secrets.sh`` (0600), a node wrapper and
    the sbatch script; then ``sbatch`` under ``flock``. A job dir that already has a job id,
    or a queued job of the same name, is adopted: never two jobs for one name.
status
    one command for all watched jobs: ``squeue -t all -u $USER``, ``sacct`` where accounting
    exists, and each job's ``exit_code`` file for jobs that already left the queue.
"""

from __future__ import annotations

import asyncio
import base64
import importlib
import logging
import os
import re
import shlex
import stat
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from airflow_skypilot.backends.base import (
    Backend,
    CapacityRow,
    JobHandle,
    JobState,
    JobStatus,
    Offer,
)
from airflow_skypilot.backends.common import jobscript
from airflow_skypilot.backends.common.features import Feature
from airflow_skypilot.backends.common.workdir import ignore_patterns, is_ignored
from airflow_skypilot.exceptions import BackendError, BackendUnreachable, SubmissionError
from airflow_skypilot.spec import accelerators as acc
from airflow_skypilot.spec import fields
from airflow_skypilot.spec.task import ResourceRequest, Task

log = logging.getLogger(__name__)

# asyncssh logs every channel at INFO: six lines per poll in each watched task's log. Quiet it
# unless the deployment configured that logger itself.
if logging.getLogger("asyncssh").level == logging.NOTSET:
    logging.getLogger("asyncssh").setLevel(logging.WARNING)

#: Node states in which a node cannot start a job now (any of these words in sinfo's StateLong)
_BAD_STATES = ("down", "drain", "fail", "maint", "reserved", "power", "future", "inval",
               "unknown", "reboot", "planned", "boot", "blocked")
_GRES_RE = re.compile(r"(?P<name>[A-Za-z_]\w*):(?:(?P<type>[^:(,]+):)?(?P<count>\d+)")

#: squeue/sacct state -> our state (SkyPilot's rule: the allocation is gone -> infra)
STATE_MAP: dict[str, JobState] = {
    "PENDING": JobState.PENDING,
    "CONFIGURING": JobState.PENDING,
    "REQUEUED": JobState.PENDING,
    "REQUEUE_HOLD": JobState.PENDING,
    "REQUEUE_FED": JobState.PENDING,
    "RESV_DEL_HOLD": JobState.PENDING,
    "SUSPENDED": JobState.RUNNING,
    "RUNNING": JobState.RUNNING,
    "COMPLETING": JobState.RUNNING,
    "STAGE_OUT": JobState.RUNNING,
    "SIGNALING": JobState.RUNNING,
    "RESIZING": JobState.RUNNING,
    "COMPLETED": JobState.SUCCEEDED,
    "FAILED": JobState.FAILED,
    "OUT_OF_MEMORY": JobState.FAILED,
    "TIMEOUT": JobState.FAILED,
    "DEADLINE": JobState.FAILED,
    "SPECIAL_EXIT": JobState.FAILED,
    "NODE_FAIL": JobState.INFRA_FAILED,
    "BOOT_FAIL": JobState.INFRA_FAILED,
    "PREEMPTED": JobState.PREEMPTED,
    "REVOKED": JobState.LOST,
    "CANCELLED": JobState.CANCELLED,
    "STOPPED": JobState.RUNNING,
}


@dataclass
class SlurmSettings:
    """What a Slurm connection's extras may say (all optional)."""

    cluster: str
    partitions: list[str] | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    reservation: str | None = None
    sbatch_options: list[str] = field(default_factory=list)
    time_limit: str | None = None
    remote_work_dir: str = "~/.airflow-skypilot"
    price_per_gpu_hour: float = 0.0
    price_per_node_hour: float = 0.0
    command_timeout: float = 60.0

    @classmethod
    def from_extra(cls, conn_id: str, extra: Mapping[str, Any]) -> SlurmSettings:
        def strings(value: Any) -> list[str] | None:
            if value in (None, "", []):
                return None
            if isinstance(value, str):
                return [v.strip() for v in value.split(",") if v.strip()]
            return [str(v) for v in value]

        options = extra.get("sbatch_options") or []
        if isinstance(options, str):
            options = shlex.split(options)
        return cls(
            cluster=str(extra.get("cluster") or conn_id),
            partitions=strings(extra.get("partitions")),
            account=extra.get("account") or None,
            qos=extra.get("qos") or None,
            constraint=extra.get("constraint") or None,
            reservation=extra.get("reservation") or None,
            sbatch_options=[str(o) for o in options],
            time_limit=str(extra["time_limit"]) if extra.get("time_limit") else None,
            remote_work_dir=str(extra.get("remote_work_dir") or "~/.airflow-skypilot"),
            price_per_gpu_hour=float(extra.get("price_per_gpu_hour") or 0.0),
            price_per_node_hour=float(extra.get("price_per_node_hour") or 0.0),
            command_timeout=float(extra.get("command_timeout") or 60.0),
        )

    def common_sbatch_args(self) -> list[str]:
        out = []
        for flag, value in (("--account", self.account), ("--qos", self.qos),
                            ("--constraint", self.constraint),
                            ("--reservation", self.reservation), ("--time", self.time_limit)):
            if value:
                out.append(f"{flag}={value}")
        return out + list(self.sbatch_options)


# --- parsing (pure) -------------------------------------------------------------------------


@dataclass
class NodeInfo:
    name: str
    partitions: list[str]
    state: str
    cpus_total: int
    cpus_alloc: int
    mem_total_mb: int
    mem_alloc_mb: int
    gpus: dict[str, int]  # gres type -> count configured ("" for untyped)
    gpus_used: dict[str, int]
    addr: str = ""

    @property
    def usable(self) -> bool:
        state = self.state.lower()
        return not state.endswith("*") and not any(word in state for word in _BAD_STATES)

    @property
    def cpus_free(self) -> int:
        return max(0, self.cpus_total - self.cpus_alloc)

    @property
    def mem_free_mb(self) -> int:
        return max(0, self.mem_total_mb - self.mem_alloc_mb)

    def gpus_free(self, gres_type: str) -> int:
        return max(0, self.gpus.get(gres_type, 0) - self.gpus_used.get(gres_type, 0))


@dataclass
class PartitionInfo:
    name: str
    up: bool = True
    default: bool = False
    time_limit: str = ""
    pending: int = 0


@dataclass
class ClusterState:
    """One probe's view of a cluster."""

    nodes: dict[str, NodeInfo]
    partitions: dict[str, PartitionInfo]
    now: float
    home: str = ""
    starts: dict[tuple[str, str, int, int], float | str] = field(default_factory=dict)

    def nodes_in(self, partition: str) -> list[NodeInfo]:
        return [n for n in self.nodes.values() if partition in n.partitions]


def parse_gres(text: str) -> dict[str, int]:
    """``gpu:a100:4(S:0-1),gpu:h100:2`` -> {"a100": 4, "h100": 2}; untyped ``gpu:4`` -> {"": 4}."""
    out: dict[str, int] = {}
    for match in _GRES_RE.finditer(text or ""):
        if match.group("name") != "gpu":
            continue
        gres_type = match.group("type") or ""
        out[gres_type] = out.get(gres_type, 0) + int(match.group("count"))
    return out


def _int(text: str, default: int = 0) -> int:
    try:
        return int(float(text))
    except (TypeError, ValueError):
        return default


def parse_sections(output: str) -> dict[str, list[str]]:
    """Split ``@@name`` headed sections of the probe script's output."""
    sections: dict[str, list[str]] = {}
    current = None
    for line in output.splitlines():
        if line.startswith("@@"):
            current = line[2:].strip()
            sections.setdefault(current, [])
        elif current is not None and line.strip():
            sections[current].append(line)
    return sections


def parse_cluster(output: str) -> ClusterState:
    """The probe script's output -> ClusterState (a node in two partitions is one node)."""
    sec = parse_sections(output)
    nodes: dict[str, NodeInfo] = {}
    partitions: dict[str, PartitionInfo] = {}
    for line in sec.get("nodes", []):
        parts = line.split("|")
        if len(parts) < 9:
            continue
        name, part, state, cpus, mem, alloc_mem, gres, gres_used, addr = (
            p.strip() for p in parts[:9])
        default = part.endswith("*")
        part = part.rstrip("*")
        partitions.setdefault(part, PartitionInfo(name=part, default=default))
        a, _i, _o, t = (cpus.split("/") + ["0"] * 4)[:4]
        if name in nodes:
            nodes[name].partitions.append(part)
            continue
        nodes[name] = NodeInfo(
            name=name, partitions=[part], state=state, cpus_total=_int(t), cpus_alloc=_int(a),
            mem_total_mb=_int(mem), mem_alloc_mb=_int(alloc_mem), gpus=parse_gres(gres),
            gpus_used=parse_gres(gres_used), addr=addr)
    for line in sec.get("partitions", []):
        parts = line.split("|")
        if len(parts) >= 3:
            name = parts[0].strip().rstrip("*")
            info = partitions.setdefault(name, PartitionInfo(name=name))
            info.up = parts[1].strip().lower() == "up"
            info.time_limit = parts[2].strip()
    for line in sec.get("pending", []):
        parts = line.split("|")
        if len(parts) >= 2:
            for part in parts[1].split(","):
                if part in partitions:
                    partitions[part].pending += 1
    starts: dict[tuple[str, str, int, int], float | str] = {}
    for line in sec.get("testonly", []):
        # partition|gres type|gpus per node|nodes|epoch or error text
        parts = line.split("|", 4)
        if len(parts) == 5:
            key = (parts[0], parts[1], _int(parts[2]), _int(parts[3]))
            starts[key] = float(parts[4]) if parts[4].strip().isdigit() else parts[4].strip()
    now_lines = sec.get("now", [])
    home_lines = sec.get("home", [])
    return ClusterState(nodes=nodes, partitions=partitions,
                        now=float(now_lines[0]) if now_lines else time.time(),
                        home=home_lines[0] if home_lines else "", starts=starts)


def parse_status(output: str, handles: list[JobHandle]) -> dict[str, JobStatus]:
    """The status script's output -> a JobStatus per watched job id."""
    sec = parse_sections(output)
    queue: dict[str, list[str]] = {}
    for line in sec.get("squeue", []):
        parts = line.split("|")
        if len(parts) >= 6:
            queue[parts[0].strip()] = [p.strip() for p in parts]
    accounted: dict[str, list[str]] = {}
    for line in sec.get("sacct", []):
        parts = line.split("|")
        if len(parts) >= 3 and "." not in parts[0]:
            accounted[parts[0].strip()] = [p.strip() for p in parts]
    exits: dict[str, str] = {}
    for line in sec.get("exits", []):
        job_id, _, code = line.partition("|")
        exits[job_id.strip()] = code.strip()
    out: dict[str, JobStatus] = {}
    for handle in handles:
        jid = handle.job_id
        code_text = exits.get(jid, "")
        exit_code = _int(code_text, None) if code_text else None  # type: ignore[arg-type]
        if jid in queue:
            # id|name|state|reason|nodes|start|end
            _, _, raw, reason, nodes, start, end = (queue[jid] + [""] * 7)[:7]
            out[jid] = _status_from(raw, reason, exit_code, nodes, start, end)
        elif jid in accounted:
            _, raw, code, *_ = accounted[jid] + ["", "", ""]
            sacct_code = _int(code.split(":")[0], None) if code else None  # type: ignore[arg-type]
            out[jid] = _status_from(raw.split()[0], "", exit_code if exit_code is not None
                                    else sacct_code, "", "", "")
        elif exit_code is not None:
            state = JobState.SUCCEEDED if exit_code == 0 else JobState.FAILED
            out[jid] = JobStatus(state, reason="" if exit_code == 0 else f"exit code {exit_code}",
                                 exit_code=exit_code, raw_state="(exit file)")
        else:
            out[jid] = JobStatus(JobState.LOST, reason="job is no longer known to Slurm and left "
                                                      "no exit code", raw_state="(vanished)")
    return out


def _epoch(text: str) -> float | None:
    if not text or text in ("N/A", "Unknown", "None"):
        return None
    try:
        return time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def _status_from(raw: str, reason: str, exit_code: int | None, nodes: str, start: str,
                 end: str) -> JobStatus:
    raw = raw.upper().split()[0] if raw else "UNKNOWN"
    raw = raw.rstrip("+")
    state = STATE_MAP.get(raw, JobState.LOST)
    if raw == "CANCELLED" and reason.lower().startswith("node"):
        state = JobState.INFRA_FAILED
    text = {
        "TIMEOUT": "time limit reached", "OUT_OF_MEMORY": "out of memory",
        "NODE_FAIL": "node failure", "BOOT_FAIL": "node failed to boot",
        "PREEMPTED": "preempted", "CANCELLED": "cancelled",
    }.get(raw, "")
    if state == JobState.PENDING and reason and reason not in ("None", "(null)"):
        text = reason
    if state == JobState.FAILED and not text:
        text = f"exit code {exit_code}" if exit_code is not None else "failed"
    if state == JobState.SUCCEEDED and exit_code not in (None, 0):
        state, text = JobState.FAILED, f"exit code {exit_code}"
    return JobStatus(state, reason=text, exit_code=exit_code,
                     started_at=_epoch(start), ended_at=_epoch(end) if state.terminal else None,
                     nodes=[n for n in nodes.split(",") if n and n != "(null)"] if nodes else [],
                     raw_state=raw)


# --- shell helpers ----------------------------------------------------------------------------


def _remote_dir_expr(path: str) -> str:
    """A shell word for a remote path that may start with ``~/``: ``"$HOME"/'rest'``."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        return '"$HOME"/' + shlex.quote(path[2:])
    return shlex.quote(path)


def _abs_remote(path: str, home: str) -> str:
    if path == "~":
        return home
    if path.startswith("~/"):
        return f"{home.rstrip('/')}/{path[2:]}"
    return path


PROBE_SCRIPT = r"""
echo "@@now"; date +%s
echo "@@home"; printf '%s\n' "$HOME"
echo "@@nodes"
sinfo -h -N -O \
  'NodeList:|,Partition:|,StateLong:|,CPUsState:|,Memory:|,AllocMem:|,Gres:|,GresUsed:|,NodeAddr:|'
echo "@@partitions"
sinfo -h -o '%R|%a|%l'
echo "@@pending"
squeue -h -t PENDING -o '%i|%P|%D|%r'
echo "@@testonly"
test_one() {  # partition gres_type gpus nodes cpus mem_mb
  local gres=()
  if [ "$3" -gt 0 ]; then
    if [ -n "$2" ]; then gres=(--gres="gpu:$2:$3"); else gres=(--gres="gpu:$3"); fi
  fi
  local extra=()
  [ "$5" -gt 0 ] && extra+=(--cpus-per-task="$5")
  [ "$6" -gt 0 ] && extra+=(--mem="${6}M")
  local out when
  out=$(sbatch --test-only --wrap=true -p "$1" -N "$4" "${gres[@]}" "${extra[@]}" \
        "${COMMON[@]}" 2>&1 | tail -n 1)
  when=$(printf '%s\n' "$out" | sed -n 's/.* to start at \([^ ]*\) .*/\1/p')
  if [ -n "$when" ]; then when=$(date -d "$when" +%s 2>/dev/null || echo "$out"); else when=$out; fi
  printf '%s|%s|%s|%s|%s\n' "$1" "$2" "$3" "$4" "$when"
}
sinfo -h -N -O 'Partition:|,Gres:|' | sort -u | while IFS='|' read -r part gres _; do
  part=${part%\*}
  case " $PARTS " in *" $part "*|"  ") ;; *) continue ;; esac
  for shape in $SHAPES; do
    IFS=: read -r gpus nodes cpus mem <<<"$shape"
    if [ "$gpus" -gt 0 ]; then
      for tok in $(printf '%s' "$gres" | tr ',' ' '); do
        case $tok in
          gpu:*:*) t=${tok#gpu:}; t=${t%%:*}
                   test_one "$part" "$t" "$gpus" "$nodes" "$cpus" "$mem" ;;
          gpu:[0-9]*) test_one "$part" "" "$gpus" "$nodes" "$cpus" "$mem" ;;
        esac
      done
    else
      test_one "$part" "" 0 "$nodes" "$cpus" "$mem"
    fi
  done
done | sort -u
"""


class SlurmBackend(Backend):
    """A Slurm cluster behind an SSH login node."""

    name = "slurm"
    conn_types = ("slurm", "ssh")
    unsupported_features = {
        Feature.SPOT: "Slurm has no spot capacity",
        Feature.INSTANCE_TYPE: "a cloud VM type, not a Slurm resource",
        Feature.DOCKER_IMAGE: "needs a container runtime on the cluster; this backend runs "
                              "jobs directly on the nodes",
        Feature.FRACTIONAL_GPUS: "Slurm allocates whole GPUs",
        Feature.GIT_WORKDIR: "a git workdir is not cloned on Slurm; use a local workdir",
        Feature.STORAGE_MOUNTS: "only local files can be copied to a Slurm cluster",
        Feature.S3_MOUNTS: "only local files can be copied to a Slurm cluster",
        Feature.OTHER_BUCKET_MOUNTS: "only local files can be copied to a Slurm cluster",
        Feature.VOLUMES: "volumes are Kubernetes volumes; a Slurm cluster has none",
    }

    def __init__(self, conn_id: str, settings: SlurmSettings | None = None):
        super().__init__(conn_id)
        self._settings = settings
        self._hook: Any = None
        self._ahook: Any = None
        self._aconn: Any = None
        self._alock: asyncio.Lock | None = None
        self._home: str | None = None

    # --- connection --------------------------------------------------------------------------
    @property
    def settings(self) -> SlurmSettings:
        if self._settings is None:
            from airflow_skypilot.compat import get_connection

            conn = get_connection(self.conn_id)
            self._settings = SlurmSettings.from_extra(self.conn_id, conn.extra_dejson or {})
        return self._settings

    def _client(self):
        from airflow.providers.ssh.hooks.ssh import SSHHook

        if self._hook is None:
            self._hook = SSHHook(ssh_conn_id=self.conn_id, conn_timeout=15,
                                 cmd_timeout=self.settings.command_timeout,
                                 conn_retry_attempts=1)
        try:
            return self._hook.get_conn()
        except Exception as exc:  # paramiko raises many kinds; all mean "cannot reach"
            raise BackendUnreachable(f"cannot reach the login node of {self.conn_id}: "
                                     f"{type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        if self._hook is not None and getattr(self._hook, "client", None):
            self._hook.client.close()
            self._hook.client = None

    def run(self, script: str, timeout: float | None = None) -> tuple[int, str, str]:
        """Run a bash script on the login node (sent on stdin: never on a command line)."""
        client = self._client()
        timeout = timeout or self.settings.command_timeout
        try:
            transport = client.get_transport()
            chan = transport.open_session(timeout=15)
            chan.settimeout(timeout)
            chan.exec_command("bash -s")
            chan.sendall(script.encode())
            chan.shutdown_write()
            out, err = bytearray(), bytearray()
            deadline = time.monotonic() + timeout
            while True:
                if chan.recv_ready():
                    out += chan.recv(65536)
                elif chan.recv_stderr_ready():
                    err += chan.recv_stderr(65536)
                elif chan.exit_status_ready():
                    while chan.recv_ready():
                        out += chan.recv(65536)
                    while chan.recv_stderr_ready():
                        err += chan.recv_stderr(65536)
                    break
                else:
                    if time.monotonic() > deadline:
                        chan.close()
                        raise BackendUnreachable(
                            f"{self.conn_id}: command did not finish within {timeout:g}s")
                    time.sleep(0.01)
            rc = chan.recv_exit_status()
            chan.close()
            return rc, out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
        except (OSError, EOFError) as exc:
            self.close()
            raise BackendUnreachable(f"{self.conn_id}: connection lost: {exc}") from exc
        except Exception as exc:
            if isinstance(exc, BackendError):
                raise
            self.close()
            raise BackendUnreachable(f"{self.conn_id}: {type(exc).__name__}: {exc}") from exc

    async def aprepare(self) -> None:
        await super().aprepare()
        # the ssh provider imports asyncssh inside get_conn(): a blocking import on the
        # triggerer's loop the first time; import it in a thread first
        await asyncio.to_thread(importlib.import_module, "asyncssh")

    async def arun(self, script: str, timeout: float | None = None) -> tuple[int, str, str]:
        """Async :meth:`run` on one cached asyncssh connection (the triggerer's loop)."""
        from airflow.providers.ssh.hooks.ssh import SSHHookAsync

        timeout = timeout or self.settings.command_timeout
        if self._alock is None:
            self._alock = asyncio.Lock()
        async with self._alock:
            try:
                if self._aconn is None:
                    self._ahook = SSHHookAsync(ssh_conn_id=self.conn_id)
                    self._aconn = await asyncio.wait_for(self._ahook.get_conn(), 20)
                result = await asyncio.wait_for(
                    self._aconn.run("bash -s", input=script, check=False), timeout)
            except Exception as exc:
                await self.aclose()
                raise BackendUnreachable(
                    f"cannot reach the login node of {self.conn_id}: "
                    f"{type(exc).__name__}: {exc}") from exc
        out = result.stdout if isinstance(result.stdout, str) else (result.stdout or b"").decode()
        err = result.stderr if isinstance(result.stderr, str) else (result.stderr or b"").decode()
        return result.exit_status or 0, out, err

    async def aclose(self) -> None:
        if self._aconn is not None:
            try:
                self._aconn.close()
            except Exception:  # closing a broken connection may raise; it is gone either way
                pass
            self._aconn = None

    # --- placement ---------------------------------------------------------------------------
    def _shapes(self, task: Task) -> list[tuple[int, int, int, int]]:
        shapes = set()
        for req in task.candidates:
            if not self._applies(req):
                continue
            gpus = int(req.accelerator_count) if req.accelerator else 0
            cpus, _ = req.cpus_needed()
            mem, _ = req.memory_needed_gb()
            shapes.add((gpus, task.num_nodes, int(cpus or 0), int((mem or 0) * 1024)))
        return sorted(shapes)

    def _probe_script(self, shapes: list[tuple[int, int, int, int]]) -> str:
        common = " ".join(shlex.quote(a) for a in self.settings.common_sbatch_args())
        parts = " ".join(self.settings.partitions or [])
        return "\n".join([
            f"COMMON=({common})",
            f"PARTS={shlex.quote(parts)}",
            f"SHAPES={shlex.quote(' '.join(':'.join(map(str, s)) for s in shapes))}",
            PROBE_SCRIPT,
        ])

    def cluster_state(self, task: Task | None = None) -> ClusterState:
        shapes = self._shapes(task) if task else []
        rc, out, err = self.run(self._probe_script(shapes))
        if "@@nodes" not in out:
            raise BackendError(f"{self.conn_id}: probe failed (exit {rc}): {err.strip()[-300:]}")
        state = parse_cluster(out)
        self._home = state.home or self._home
        return state

    def _applies(self, req: ResourceRequest) -> bool:
        """Does the candidate's infra filter allow this cluster at all?"""
        return fields.infra_matches(req.infra, f"slurm/{self.settings.cluster}") or (
            req.infra is not None and req.infra.startswith(f"slurm/{self.settings.cluster}/"))

    def probe(self, task: Task) -> list[Offer]:
        state = self.cluster_state(task)
        offers = []
        for req in task.candidates:
            if not self._applies(req):
                continue
            for part in sorted(state.partitions):
                if not fields.infra_matches(req.infra, f"slurm/{self.settings.cluster}/{part}"):
                    continue
                offers.append(self._offer(task, req, part, state))
        return offers

    def _offer(self, task: Task, req: ResourceRequest, part: str, st: ClusterState) -> Offer:
        s = self.settings
        info = st.partitions[part]
        nodes = st.nodes_in(part)
        offer = Offer(connection=self.conn_id, backend=self.name, location=part,
                      infra=f"slurm/{s.cluster}/{part}", request=req, num_nodes=task.num_nodes,
                      accelerator=req.accelerator, gpus_per_node=req.accelerator_count,
                      nodes_total=len(nodes), pending_jobs=info.pending, probed_at=st.now,
                      details={"cluster": s.cluster, "partition": part})

        def no(reason: str) -> Offer:
            offer.fits, offer.reason = False, reason
            return offer

        if s.partitions and part not in s.partitions:
            return no(f"partition {part} is not allowed by connection {self.conn_id} "
                      f"(allowed: {', '.join(s.partitions)})")
        if not info.up:
            return no(f"partition {part} is down")
        if why := self.unsupported(task, req):
            return no(why)
        cpus, _ = req.cpus_needed()
        mem_gb, _ = req.memory_needed_gb()
        mem_mb = int((mem_gb or 0) * 1024)
        gres_type = ""
        need = 0
        if req.accelerator:
            if not float(req.accelerator_count).is_integer():
                return no(f"{req.accelerator}:{req.accelerator_count}: Slurm allocates whole GPUs")
            need = int(req.accelerator_count)
            types = sorted({t for n in nodes for t in n.gpus})
            matching = [t for t in types if t and acc.same_accelerator(req.accelerator, t)]
            if not matching:
                have = ", ".join(t or "untyped gpu" for t in types) or "no GPUs"
                return no(f"no {req.accelerator} in partition {part} (has: {have})")
            gres_type = matching[0]
            nodes = [n for n in nodes if n.gpus.get(gres_type, 0) > 0]
            most = max(n.gpus[gres_type] for n in nodes)
            offer.gpus_total = sum(n.gpus[gres_type] for n in nodes)
            offer.gpus_free = sum(n.gpus_free(gres_type) for n in nodes if n.usable)
            offer.accelerator = gres_type
            if need > most:
                return no(f"needs {need} {req.accelerator} per node; nodes in {part} have at "
                          f"most {most}")
        if task.num_nodes > len(nodes):
            return no(f"needs {task.num_nodes} nodes; {part} has {len(nodes)}"
                      + (f" with {req.accelerator}" if req.accelerator else ""))
        if cpus and cpus > max(n.cpus_total for n in nodes):
            return no(f"needs {req.cpus} CPUs per node; nodes in {part} have at most "
                      f"{max(n.cpus_total for n in nodes)}")
        if mem_mb and mem_mb > max(n.mem_total_mb for n in nodes):
            return no(f"needs {req.memory} GB per node; nodes in {part} have at most "
                      f"{max(n.mem_total_mb for n in nodes) / 1024:.3g} GB")
        free_nodes = [n for n in nodes if n.usable and n.gpus_free(gres_type) >= need
                      and n.cpus_free >= (cpus or 1) and n.mem_free_mb >= mem_mb]
        offer.nodes_free = len(free_nodes)
        offer.nodes_total = len(nodes)
        offer.details.update({"gres_type": gres_type, "gpus_per_node": need,
                              "usable_nodes": sum(n.usable for n in nodes)})
        key = (part, gres_type, need, task.num_nodes)
        start = st.starts.get(key)
        if isinstance(start, float):
            if start - st.now < 30 * 86400:
                offer.est_start = max(start, st.now)
            else:  # jobs without time limits make Slurm answer "in decades": that is unknown
                offer.details["test_only"] = "no start estimate within 30 days"
        elif isinstance(start, str) and start:
            offer.details["test_only"] = start
            if "not available" in start.lower() or "violates" in start.lower():
                return no(f"Slurm refuses this shape in {part}: {start}")
        if offer.nodes_free >= task.num_nodes:
            offer.est_start = st.now
        offer.price_per_hour = task.num_nodes * (need * s.price_per_gpu_hour
                                                 + s.price_per_node_hour)
        return offer

    def capacity(self) -> list[CapacityRow]:
        state = self.cluster_state()
        rows = []
        allowed = self.settings.partitions
        for part in sorted(state.partitions):
            if allowed and part not in allowed:
                continue
            nodes = state.nodes_in(part)
            types = sorted({t for n in nodes for t in n.gpus})
            info = state.partitions[part]
            if not types:
                rows.append(CapacityRow(
                    connection=self.conn_id, location=part, accelerator=None,
                    total=None, free=None, pending=info.pending,
                    price_per_hour=self.settings.price_per_node_hour,
                    details={"cpus_total": sum(n.cpus_total for n in nodes),
                             "cpus_free": sum(n.cpus_free for n in nodes if n.usable)}))
            for t in types:
                with_t = [n for n in nodes if t in n.gpus]
                rows.append(CapacityRow(
                    connection=self.conn_id, location=part,
                    accelerator=acc.canonical_from_label(t) if t else "gpu",
                    total=sum(n.gpus[t] for n in with_t),
                    free=sum(n.gpus_free(t) for n in with_t if n.usable),
                    pending=info.pending, price_per_hour=self.settings.price_per_gpu_hour,
                    details={"gres": t, "nodes": len(with_t),
                             "nodes_down": sum(not n.usable for n in with_t)}))
        return rows

    # --- jobs --------------------------------------------------------------------------------
    def _job_dir(self, job_name: str, home: str) -> str:
        base = _abs_remote(self.settings.remote_work_dir, home)
        return f"{base.rstrip('/')}/jobs/{job_name}"

    def find(self, job_name: str) -> JobHandle | None:
        handle, _ = self._lookup(job_name)
        return handle

    def _lookup(self, job_name: str) -> tuple[JobHandle | None, str]:
        jobs = _remote_dir_expr(self.settings.remote_work_dir) + "/jobs/" + shlex.quote(job_name)
        script = "\n".join([
            'printf "@@home\\n%s\\n" "$HOME"',
            "echo @@job_id", f"cat {jobs}/job_id 2>/dev/null",
            "echo @@meta", f"cat {jobs}/handle 2>/dev/null",
            "echo @@queued", f"squeue -h -n {shlex.quote(job_name)} -u \"$USER\" -o '%i|%P'",
        ])
        rc, out, err = self.run(script)
        sec = parse_sections(out)
        home = (sec.get("home") or [""])[0]
        self._home = home or self._home
        job_id = (sec.get("job_id") or [""])[0].strip()
        partition = ""
        if not job_id and sec.get("queued"):
            job_id, _, partition = sec["queued"][0].partition("|")
        if not job_id:
            return None, home
        meta = dict(kv.split("=", 1) for kv in sec.get("meta", []) if "=" in kv)
        partition = meta.get("partition", partition)
        job_dir = self._job_dir(job_name, home)
        return JobHandle(
            backend=self.name, connection=self.conn_id, job_id=job_id.strip(), job_name=job_name,
            location=partition, infra=f"slurm/{self.settings.cluster}/{partition}",
            num_nodes=_int(meta.get("num_nodes", "1"), 1), accelerator=meta.get("accelerator")
            or None, gpus_per_node=float(meta.get("gpus_per_node", "0") or 0),
            price_per_hour=float(meta.get("price_per_hour", "0") or 0),
            submitted_at=float(meta.get("submitted_at", time.time())), adopted=True,
            extra={"job_dir": job_dir, "log": f"{job_dir}/slurm.log"},
        ), home

    def submit(self, task: Task, offer: Offer, job_name: str,
               env: Mapping[str, str]) -> JobHandle:
        existing, home = self._lookup(job_name)
        if existing is not None:
            log.info("Adopting Slurm job %s (%s) on %s: it was submitted before",
                     existing.job_id, job_name, self.conn_id)
            return existing
        if why := self.unsupported(task, offer.request):
            raise SubmissionError(why, retry_elsewhere=True)
        if not home:
            raise SubmissionError(f"{self.conn_id}: could not learn the remote $HOME")
        job_dir = self._job_dir(job_name, home)
        files = self._render(task, offer, job_name, env, job_dir)
        self._upload(task, job_dir, files)
        args = ["sbatch", "--parsable", f"--job-name={job_name}",
                f"--output={job_dir}/slurm.log", f"--chdir={job_dir}",
                f"{job_dir}/job.sbatch"]
        submit = " ".join(shlex.quote(a) for a in args)
        jd = shlex.quote(job_dir)
        script = "\n".join([
            f"cd {jd} || exit 97",
            "exec 9>lock",
            "flock -w 60 9 || exit 98",
            'if [ -s job_id ]; then echo "@@adopted"; cat job_id; exit 0; fi',
            f"out=$({submit} 2>&1) || {{ echo \"$out\" >&2; exit 99; }}",
            'jid=${out%%;*}',
            'printf "%s\\n" "$jid" > job_id.tmp && mv job_id.tmp job_id',
            'echo "@@submitted"; printf "%s\\n" "$jid"',
        ])
        rc, out, err = self.run(script)
        sec = parse_sections(out)
        ids = sec.get("submitted") or sec.get("adopted")
        if rc != 0 or not ids:
            message = (err or out).strip().splitlines()
            text = message[-1] if message else f"exit {rc}"
            retry = not any(w in text.lower() for w in ("invalid", "unrecognized", "syntax"))
            raise SubmissionError(f"sbatch on {self.conn_id} failed: {text}",
                                  retry_elsewhere=retry)
        job_id = ids[0].strip()
        log.info("Submitted Slurm job %s (%s) to %s partition %s", job_id, job_name,
                 self.conn_id, offer.location)
        return JobHandle(
            backend=self.name, connection=self.conn_id, job_id=job_id, job_name=job_name,
            location=offer.location, infra=offer.infra, num_nodes=task.num_nodes,
            accelerator=offer.request.accelerator, gpus_per_node=offer.request.accelerator_count,
            price_per_hour=offer.price_per_hour, adopted="adopted" in sec,
            extra={"job_dir": job_dir, "log": f"{job_dir}/slurm.log"})

    def _render(self, task: Task, offer: Offer, job_name: str, env: Mapping[str, str],
                job_dir: str) -> dict[str, tuple[str, int]]:
        """Every file of the job: name -> (content, mode)."""
        s = self.settings
        req = offer.request
        gpus = int(req.accelerator_count) if req.accelerator else 0
        gres_type = offer.details.get("gres_type", "")
        info = {"cluster_name": s.cluster, "cloud": "Slurm", "region": s.cluster,
                "zone": offer.location}
        node_env = jobscript.skypilot_env(
            task, task_id=env.get("SKYPILOT_TASK_ID", job_name),
            num_gpus_per_node=jobscript.gpus_per_node(req.accelerator_count),
            cluster_info=info, extra=env)
        directives = [f"--partition={offer.location}", f"--nodes={task.num_nodes}",
                      "--ntasks-per-node=1", "--no-requeue", "--open-mode=append"]
        if gpus:
            directives.append(f"--gres=gpu:{gres_type}:{gpus}" if gres_type
                              else f"--gres=gpu:{gpus}")
        cpus, _ = req.cpus_needed()
        if cpus:
            directives.append(f"--cpus-per-task={int(cpus + 0.999)}")
        mem, _ = req.memory_needed_gb()
        if mem:
            directives.append(f"--mem={int(mem * 1024)}M")
        directives += s.common_sbatch_args()
        for option in _task_sbatch_options(task):
            directives.append(option)
        label = " --label" if task.num_nodes > 1 else ""
        jd = shlex.quote(job_dir)
        sbatch = ["#!/bin/bash"] + [f"#SBATCH {shlex.quote(d)}" for d in directives] + [
            "# airflow-skypilot: generated; the task's own scripts are setup.sh and run.sh.",
            f"JOB_DIR={jd}",
            'trap \'rm -f "$JOB_DIR/secrets.sh"\' EXIT',
            "# SKYPILOT_NODE_IPS: each node's address (NodeAddr, resolved to an IP), in rank order",
            'ips=""',
            'for n in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do',
            "  a=$(scontrol show node -o \"$n\" | tr ' ' '\\n' | sed -n 's/^NodeAddr=//p')",
            '  a=${a:-$n}',
            "  case $a in *[!0-9.]*)",
            "    ip=$(getent ahostsv4 \"$a\" 2>/dev/null | awk 'NR==1{print $1}'); a=${ip:-$a} ;;",
            "  esac",
            '  ips="$ips$a"$\'\\n\'',
            "done",
            'export SKYPILOT_NODE_IPS="${ips%$\'\\n\'}"',
            'echo "airflow-skypilot: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST"',
            f"srun{label} --kill-on-bad-exit=1 --ntasks-per-node=1 "
            f'-N "$SLURM_JOB_NUM_NODES" bash "$JOB_DIR/node.sh" setup',
            "rc=$?",
            "if [ $rc -eq 0 ]; then",
            f"  srun{label} --kill-on-bad-exit=1 --ntasks-per-node=1 "
            f'-N "$SLURM_JOB_NUM_NODES" bash "$JOB_DIR/node.sh" run',
            "  rc=$?",
            "else",
            '  echo "airflow-skypilot: setup failed with exit code $rc; run skipped" >&2',
            "fi",
            'printf "%s\\n" "$rc" > "$JOB_DIR/exit_code.tmp" && '
            'mv "$JOB_DIR/exit_code.tmp" "$JOB_DIR/exit_code"',
            "exit $rc",
        ]
        workdir = f"{job_dir}/workdir"
        node = jobscript.node_script(job_dir=jd, workdir=shlex.quote(workdir),
                                     rank_var="SLURM_NODEID", has_setup=bool(task.setup),
                                     has_run=bool(task.run))
        meta = {
            "partition": offer.location, "num_nodes": task.num_nodes,
            "accelerator": req.accelerator or "", "gpus_per_node": req.accelerator_count,
            "price_per_hour": offer.price_per_hour, "submitted_at": time.time(),
        }
        files = {
            "job.sbatch": ("\n".join(sbatch) + "\n", 0o700),
            "node.sh": (node, 0o700),
            "env.sh": (jobscript.exports(node_env), 0o600),
            "setup.sh": (jobscript.user_script(task.setup) or "", 0o600),
            "run.sh": (jobscript.user_script(task.run) or "", 0o600),
            "handle": ("".join(f"{k}={v}\n" for k, v in meta.items()), 0o600),
        }
        if task.secrets:
            files["secrets.sh"] = (jobscript.exports(task.secrets), 0o600)
        return files

    def _upload(self, task: Task, job_dir: str, files: dict[str, tuple[str, int]]) -> None:
        client = self._client()
        try:
            sftp = client.open_sftp()
        except Exception as exc:
            raise SubmissionError(f"{self.conn_id}: SFTP unavailable: {exc}") from exc
        try:
            _sftp_makedirs(sftp, job_dir, 0o700)
            sftp.chmod(job_dir, 0o700)
            for name, (content, mode) in files.items():
                path = f"{job_dir}/{name}"
                with sftp.open(path, "w") as fh:
                    sftp.chmod(path, mode)  # before any byte is written
                    fh.write(content.encode())
            _sftp_makedirs(sftp, f"{job_dir}/workdir", 0o700)
            local = task.resolved_workdir()
            if local:
                _sftp_put_tree(sftp, local, f"{job_dir}/workdir")
            home = self._home or ""
            for dst, src in task.file_mounts.items():
                if isinstance(src, str) and "://" not in src:
                    src_path = os.path.expanduser(src)
                    if not os.path.isabs(src_path) and task.base_dir:
                        src_path = os.path.join(task.base_dir, src_path)
                    target = _abs_remote(dst if not dst.startswith("~") else dst, home)
                    if os.path.isdir(src_path):
                        _sftp_put_tree(sftp, src_path, target)
                    else:
                        _sftp_makedirs(sftp, os.path.dirname(target) or "/", 0o755)
                        sftp.put(src_path, target)
        except (OSError, EOFError) as exc:
            raise SubmissionError(f"{self.conn_id}: upload to {job_dir} failed: {exc}") from exc
        finally:
            sftp.close()

    def cancel(self, handle: JobHandle) -> None:
        job_dir = handle.extra.get("job_dir", "")
        script = f"scancel {shlex.quote(handle.job_id)} 2>&1; rc=$?"
        if job_dir:
            script += f"\nrm -f {shlex.quote(job_dir)}/secrets.sh"
        script += "\nexit $rc"
        rc, out, err = self.run(script)
        if rc != 0 and "Invalid job id" not in out + err:
            raise BackendError(f"scancel {handle.job_id} on {self.conn_id} failed: "
                               f"{(out + err).strip()}")
        log.info("Cancelled Slurm job %s on %s", handle.job_id, self.conn_id)

    def cleanup(self, handle: JobHandle) -> None:
        job_dir = handle.extra.get("job_dir")
        if job_dir:
            self.run(f"rm -f {shlex.quote(job_dir)}/secrets.sh")

    def _status_script(self, handles: list[JobHandle]) -> str:
        ids = ",".join(shlex.quote(h.job_id) for h in handles)
        lines = [
            "echo @@squeue",
            "squeue -h -t all -u \"$USER\" -o '%i|%j|%T|%r|%N|%S|%e'",
            "echo @@sacct",
            f"sacct -n -P -X -j {ids} -o JobIDRaw,State,ExitCode,Start,End 2>/dev/null || true",
            "echo @@exits",
        ]
        for h in handles:
            job_dir = h.extra.get("job_dir")
            if job_dir:
                lines.append(f"[ -f {shlex.quote(job_dir)}/exit_code ] && printf '%s|%s\\n' "
                             f"{shlex.quote(h.job_id)} \"$(cat {shlex.quote(job_dir)}/exit_code)\"")
        lines.append("true")
        return "\n".join(lines)

    async def poll(self, handles: list[JobHandle]) -> dict[str, JobStatus]:
        if not handles:
            return {}
        rc, out, err = await self.arun(self._status_script(handles))
        if "@@squeue" not in out:
            raise BackendUnreachable(f"{self.conn_id}: status query failed: {err.strip()[-200:]}")
        return parse_status(out, handles)

    def status(self, handles: list[JobHandle]) -> dict[str, JobStatus]:
        if not handles:
            return {}
        rc, out, err = self.run(self._status_script(handles))
        if "@@squeue" not in out:
            raise BackendUnreachable(f"{self.conn_id}: status query failed: {err.strip()[-200:]}")
        return parse_status(out, handles)

    def _log_script(self, handle: JobHandle, offset: int, limit: int) -> str:
        path = shlex.quote(handle.extra.get("log", ""))
        return (f"echo @@log; tail -c +{int(offset) + 1} {path} 2>/dev/null "
                f"| head -c {int(limit)} | base64 -w0; echo")

    def read_log(self, handle: JobHandle, offset: int = 0,
                 limit: int = 1 << 20) -> tuple[str, int]:
        rc, out, err = self.run(self._log_script(handle, offset, limit))
        return _split_log(out, offset)

    async def read_log_async(self, handle: JobHandle, offset: int = 0,
                             limit: int = 1 << 20) -> tuple[str, int]:
        rc, out, err = await self.arun(self._log_script(handle, offset, limit))
        return _split_log(out, offset)

    async def read_logs_async(self, requests: list[tuple[JobHandle, int]],
                              limit: int = 1 << 18) -> dict[str, tuple[str, int]]:
        """New output of every streamed job in one SSH command (base64-framed per job)."""
        if not requests:
            return {}
        lines = []
        for handle, offset in requests:
            path = shlex.quote(handle.extra.get("log", ""))
            lines.append(f"printf '@@log %s\\n' {shlex.quote(handle.job_id)}; "
                         f"tail -c +{int(offset) + 1} {path} 2>/dev/null | head -c {int(limit)} "
                         f"| base64 -w0; echo")
        rc, out, err = await self.arun("\n".join(lines))
        texts: dict[str, tuple[str, int]] = {}
        offsets = {h.job_id: o for h, o in requests}
        current = None
        for line in out.splitlines():
            if line.startswith("@@log "):
                current = line[6:].strip()
            elif current is not None:
                data = base64.b64decode(line.strip() or b"")
                texts[current] = (data.decode("utf-8", "replace"), offsets[current] + len(data))
                current = None
        return {h.job_id: texts.get(h.job_id, ("", o)) for h, o in requests}


def _split_log(out: str, offset: int) -> tuple[str, int]:
    """``@@log`` then the bytes read, base64: the offset counts bytes, not characters."""
    head, _, body = out.partition("\n")
    if head.strip() != "@@log":
        return "", offset
    data = base64.b64decode(body.strip() or b"")
    return data.decode("utf-8", "replace"), offset + len(data)


def _task_sbatch_options(task: Task) -> list[str]:
    """``config.slurm.sbatch_options`` (SkyPilot's per-task override) as directives."""
    opts = (task.config.get("slurm") or {}).get("sbatch_options")
    if isinstance(opts, dict):
        return [f"--{k}={v}" if v is not True else f"--{k}" for k, v in opts.items()]
    if isinstance(opts, list):
        return [str(o) for o in opts]
    return []


def _sftp_makedirs(sftp: Any, path: str, mode: int) -> None:
    parts = path.split("/")
    current = "/" if path.startswith("/") else ""
    for part in parts:
        if not part:
            continue
        current = f"{current}{part}" if current.endswith("/") or not current else \
            f"{current}/{part}"
        try:
            sftp.stat(current)
        except OSError:
            sftp.mkdir(current, mode)


def _sftp_put_tree(sftp: Any, local: str, remote: str) -> None:
    """Copy a local directory tree; skips ``.git`` and what ``.skyignore`` lists."""
    patterns = ignore_patterns(local)
    for root, dirs, files in os.walk(local):
        rel_root = os.path.relpath(root, local)
        dirs[:] = [d for d in dirs
                   if not is_ignored(os.path.normpath(os.path.join(rel_root, d)), patterns)]
        target_root = remote if rel_root == "." else f"{remote}/{rel_root}"
        _sftp_makedirs(sftp, target_root, 0o755)
        for name in files:
            rel = os.path.normpath(os.path.join(rel_root, name))
            if is_ignored(rel, patterns):
                continue
            path = os.path.join(root, name)
            sftp.put(path, f"{target_root}/{name}")
            sftp.chmod(f"{target_root}/{name}", stat.S_IMODE(os.stat(path).st_mode))


__all__ = ["SlurmBackend", "SlurmSettings", "parse_cluster", "parse_gres", "parse_status"]
