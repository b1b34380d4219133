"""Two real Slurm 22.05 clusters on loopback, each behind its own sshd login node.

Why: the Slurm backend talks to clusters only over SSH (the ssh provider's hooks), so the most
honest test double is a real slurmctld/slurmd pair reached through a real sshd. Everything runs
from Debian's packages with our own config files (``SLURM_CONF``, ``sshd -f``); nothing is
written to /etc/slurm or /etc/ssh. Runtime state lives under a state dir (default
``<repo>/.sandbox/slurm``, or /var/tmp/airflow-skypilot-sandbox/<checkout hash>/slurm when the
checkout is not world-traversable) and is wiped on every start.

CLI (from the repo root)::

    .venv/bin/python -m tests.sandbox.slurm up|down|status|env [--state-dir DIR]

Clusters: alpha = a1 (127.0.1.1), a2 (127.0.1.2), 8 CPUs, 16000 MB, gpu:a100:4 each,
partitions batch (a1,a2, default) and short (a2, MaxTime 10 min); beta = b1 (127.0.2.1),
gpu:h100:8, partition main. Job ids start at 1000 (alpha) and 5000 (beta). Ports are
base+100.. (alpha: slurmctld +100, a1 +101, a2 +102, sshd +109; beta: slurmctld +110,
b1 +111, sshd +119), base = $SKYPILOT_SANDBOX_PORT_BASE or 28000. Jobs and SSH logins run
as ``skyuser``.

State dir layout::

    connections.json            `airflow connections import` format (slurm_alpha, slurm_beta)
    ssh/id_ed25519[.pub]        client key (kept across restarts), ssh/authorized_keys
    munged.started-by-sandbox   present only if we started munged (down() then stops it)
    <cluster>/slurm.conf        SLURM_CONF of that cluster; gres.conf next to it
    <cluster>/commands.log      per SSH command one line "<epoch> TAB <client port> TAB
                                <command>" (\\, newline escaped as \\\\, \\n); the client
                                port tells SSH connections apart; SFTP shows as the
                                sftp-server path
    <cluster>/jobcomp.txt       jobcomp/filetxt records, read by `sacct -c`
    <cluster>/ssh/              host key, sshd_config, command-wrapper.sh (ForceCommand)
    <cluster>/{state,spool,run,log,dev}/  wiped on every start

Finished jobs: `squeue -t all` and `scontrol show job` show them for MinJobAge=300 s (purged
about 300-360 s after the end); `sacct -c` shows them until the next start; plain `sacct`
fails (no slurmdbd).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tests.sandbox.paths import state_root

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_STATE_DIR = state_root() / "slurm"
# Where the state goes when the checkout is not world-traversable (``mktemp -d`` is 0700): the
# login user must read slurm.conf and the ssh wrapper. One dir per checkout, found again by
# ``down``.
FALLBACK_STATE_ROOT = Path("/var/tmp/airflow-skypilot-sandbox")
PORT_BASE_ENV = "SKYPILOT_SANDBOX_PORT_BASE"
DEFAULT_PORT_BASE = 28000
# Slurm takes ports base+100 .. base+119 so other sandboxes can share one base.
SLURM_PORT_OFFSET = 100
LOGIN_USER = "skyuser"
SFTP_SERVER = "/usr/lib/openssh/sftp-server"
MUNGE_KEY = Path("/etc/munge/munge.key")
MUNGE_RUN_DIR = Path("/run/munge")
REQUIRED_BINARIES = {
    "slurmctld": "slurmctld",
    "slurmd": "slurmd",
    "sbatch": "slurm-client",
    "srun": "slurm-client",
    "scontrol": "slurm-client",
    "squeue": "slurm-client",
    "sinfo": "slurm-client",
    "scancel": "slurm-client",
    "sacct": "slurm-client",
    "munged": "munge",
    "munge": "munge",
    "unmunge": "munge",
    "sshd": "openssh-server",
    "ssh-keygen": "openssh-client",
}
APT_HINT = "apt-get install -y slurmctld slurmd slurm-client munge openssh-server"
# Bounded waits: the machine is small and shared, so poll gently and give up clearly.
POLL_INTERVAL = 0.25
CTLD_TIMEOUT = 30.0
NODES_TIMEOUT = 40.0
STOP_TIMEOUT = 8.0


class SandboxError(RuntimeError):
    """The sandbox could not be brought into the requested state."""


@dataclass(frozen=True)
class Node:
    """One fake compute node: its own slurmd on its own port and loopback address."""

    name: str
    addr: str
    gpu_type: str
    gpus: int
    cpus: int = 8
    memory_mb: int = 16000


@dataclass(frozen=True)
class Partition:
    """A Slurm partition; ``max_time`` is in Slurm's notation (minutes or UNLIMITED)."""

    name: str
    nodes: tuple[str, ...]
    default: bool = False
    max_time: str = "UNLIMITED"


@dataclass(frozen=True)
class Cluster:
    """One Slurm cluster: own slurm.conf, slurmctld, slurmds and sshd login node."""

    name: str
    port_offset: int
    first_job_id: int
    nodes: tuple[Node, ...]
    partitions: tuple[Partition, ...]


CLUSTERS: tuple[Cluster, ...] = (
    Cluster(
        name="alpha",
        port_offset=0,
        first_job_id=1000,
        nodes=(Node("a1", "127.0.1.1", "a100", 4), Node("a2", "127.0.1.2", "a100", 4)),
        partitions=(
            Partition("batch", ("a1", "a2"), default=True),
            Partition("short", ("a2",), max_time="10"),
        ),
    ),
    Cluster(
        name="beta",
        port_offset=10,
        first_job_id=5000,
        nodes=(Node("b1", "127.0.2.1", "h100", 8),),
        partitions=(Partition("main", ("b1",), default=True),),
    ),
)
CLUSTER_BY_NAME = {c.name: c for c in CLUSTERS}
NODE_CLUSTER = {n.name: c for c in CLUSTERS for n in c.nodes}


def port_base() -> int:
    """Base port, movable with SKYPILOT_SANDBOX_PORT_BASE so parallel checkouts don't clash."""
    return int(os.environ.get(PORT_BASE_ENV, DEFAULT_PORT_BASE))


def remote_work_dir() -> str:
    """The connections' ``remote_work_dir`` on the login user's home: the default for the
    default ports, one of its own for another set of sandboxes (whose jobs' dirs, and the
    clean-up of old ones that rides on every submit, must not meet this set's)."""
    base = port_base()
    return "~/.airflow-skypilot" if base == DEFAULT_PORT_BASE else f"~/.airflow-skypilot-{base}"


def ctld_port(cluster: Cluster) -> int:
    """slurmctld port of a cluster."""
    return port_base() + SLURM_PORT_OFFSET + cluster.port_offset


def slurmd_port(cluster: Cluster, node: Node) -> int:
    """slurmd port of a node (each slurmd on this host needs its own)."""
    return ctld_port(cluster) + 1 + cluster.nodes.index(node)


def sshd_port(cluster: Cluster) -> int:
    """Login-node sshd port of a cluster."""
    return ctld_port(cluster) + 9


# --------------------------------------------------------------------------- processes


def _proc_stat(pid: int) -> tuple[str, str, int] | None:
    """(comm, state, ppid) of a pid, or None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    comm = raw[raw.index("(") + 1 : raw.rindex(")")]
    fields = raw[raw.rindex(")") + 2 :].split()
    return comm, fields[0], int(fields[1])


def _alive(pid: int | None, comm: str | None = None) -> bool:
    """True if pid runs (zombies count as dead: pid 1 here does not reap orphans)."""
    if not pid:
        return False
    info = _proc_stat(pid)
    if info is None or info[1] in ("Z", "X"):
        return False
    return comm is None or info[0].startswith(comm[:15])


def _read_pid(path: Path) -> int | None:
    """Pid from a pid file, None if missing or garbage."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _all_pids() -> list[int]:
    """Every pid currently in /proc."""
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _descendants(roots: Iterable[int]) -> list[int]:
    """All live descendants of the given pids (not including them)."""
    children: dict[int, list[int]] = {}
    for pid in _all_pids():
        info = _proc_stat(pid)
        if info is not None:
            children.setdefault(info[2], []).append(pid)
    out: list[int] = []
    stack = list(roots)
    while stack:
        for child in children.get(stack.pop(), []):
            out.append(child)
            stack.append(child)
    return out


def _environ(pid: int) -> dict[str, str]:
    """Environment of a process (empty if unreadable)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def _kill(pids: Iterable[int], sig: int) -> None:
    """Signal pids, ignoring ones that are already gone."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _stop(pids: list[int], timeout: float = STOP_TIMEOUT) -> None:
    """SIGTERM, wait (bounded), then SIGKILL what is left."""
    pids = [p for p in pids if _alive(p)]
    _kill(pids, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(POLL_INTERVAL)
    _kill([p for p in pids if _alive(p)], signal.SIGKILL)


def _tail(path: Path, lines: int = 25) -> str:
    """Last lines of a log for error messages."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return f"(no log at {path})"
    return f"--- tail of {path} ---\n" + "\n".join(text[-lines:])


def _check(argv: list[str], **kwargs) -> subprocess.CompletedProcess[str]:
    """Run a setup command; raise with its output when it fails."""
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, **kwargs)
    if proc.returncode != 0:
        raise SandboxError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _unescape_log(text: str) -> str:
    """Undo the ssh wrapper's escaping of backslash and newline."""
    out: list[str] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch == "\\" and i + 1 < len(text):
            nxt = text[i + 1]
            out.append("\n" if nxt == "n" else nxt)
            i += 2
        else:
            out.append(ch)
            i += 1
    return "".join(out)


# --------------------------------------------------------------------------- templates

SLURM_CONF = """\
# Generated by tests/sandbox/slurm.py; wiped and rewritten on every start.
ClusterName={cluster}
SlurmctldHost={hostname}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=10
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool/%n
SlurmctldPidFile={dir}/run/slurmctld.pid
SlurmdPidFile={dir}/run/slurmd-%n.pid
SlurmctldLogFile={dir}/log/slurmctld.log
SlurmdLogFile={dir}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups in this container: track job processes through /proc, no task binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
# No slurmdbd: finished jobs stay in squeue/scontrol for MinJobAge, and in JobCompLoc forever.
JobCompType=jobcomp/filetxt
JobCompLoc={dir}/jobcomp.txt
MinJobAge=300
FirstJobId={first_job_id}
MpiDefault=none
MailProg=/bin/true
SwitchType=switch/none
PropagateResourceLimits=NONE
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1000
GresTypes=gpu
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,bf_interval=1,sched_interval=2
# Fast failure detection for fault-injection tests.
SlurmdTimeout=10
SlurmctldTimeout=10
MessageTimeout=5
InactiveLimit=0
KillWait=2
ReturnToService=2
# The fake nodes claim more CPUs/memory than this machine has.
SlurmdParameters=config_overrides
{nodes}
{partitions}
"""

SSHD_CONFIG = """\
# Generated by tests/sandbox/slurm.py: the login node of cluster {cluster}.
Port {port}
ListenAddress 127.0.0.1
HostKey {ssh_dir}/ssh_host_ed25519_key
PidFile {run_dir}/sshd.pid
AuthorizedKeysFile {authorized_keys}
AllowUsers {user}
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin no
UsePAM no
# Off so a state dir below a sticky world-writable dir (/tmp) still works; keys are ours.
StrictModes no
PrintMotd no
X11Forwarding no
MaxStartups 100:30:200
MaxSessions 64
LogLevel VERBOSE
SetEnv SLURM_CONF={slurm_conf}
Subsystem sftp {sftp_server}
ForceCommand {wrapper}
"""

# Runs as the login user for every session. Logs the command, then runs it exactly as sshd
# would have (bash -c), keeping stdin/stdout/exit code. SFTP arrives as the subsystem's path.
SSH_WRAPPER = """\
#!/bin/bash
# Generated by tests/sandbox/slurm.py: record each ssh command of cluster {cluster}, then run it.
if [ -n "${{SSH_ORIGINAL_COMMAND+x}}" ]; then
    c=${{SSH_ORIGINAL_COMMAND//\\\\/\\\\\\\\}}
    c=${{c//$'\\n'/\\\\n}}
    p=${{SSH_CLIENT#* }}
    {{ flock 9; printf '%s\\t%s\\t%s\\n' "$EPOCHREALTIME" "${{p%% *}}" "$c" >&9; }} 9>>'{log}'
    exec /bin/bash -c "$SSH_ORIGINAL_COMMAND"
fi
exec -a -bash /bin/bash
"""


# --------------------------------------------------------------------------- the sandbox


def _traversable(path: Path) -> bool:
    """Can any user reach ``path`` (o+x on it, or where it will be made, and every parent)?"""
    return all(p.stat().st_mode & stat.S_IXOTH for p in [path, *path.parents] if p.exists())


def _default_state_dir() -> Path:
    """``<repo>/.sandbox/slurm``, or a per-checkout dir under /var/tmp if the login user
    could not reach that one."""
    default = DEFAULT_STATE_DIR.resolve()
    if _traversable(default):
        return default
    digest = hashlib.sha1(str(state_root()).encode()).hexdigest()[:12]
    return FALLBACK_STATE_ROOT / digest / "slurm"


class SlurmSandbox:
    """Start, stop, inspect and break the two local Slurm clusters."""

    def __init__(self, state_dir: Path | None = None) -> None:
        self.state_dir = Path(state_dir).resolve() if state_dir else _default_state_dir()
        self.hostname = socket.gethostname().split(".")[0]

    # ---- paths
    def cluster_dir(self, cluster: str) -> Path:
        """Per-cluster state dir: configs, logs, pid files, spool, slurmctld state."""
        return self.state_dir / cluster

    def slurm_conf(self, cluster: str) -> Path:
        """The cluster's slurm.conf (what SLURM_CONF points at)."""
        return self.cluster_dir(cluster) / "slurm.conf"

    @property
    def key_file(self) -> Path:
        """Client private key (ed25519) that the connections use."""
        return self.state_dir / "ssh" / "id_ed25519"

    @property
    def connections_file(self) -> Path:
        """connections.json in ``airflow connections import`` format."""
        return self.state_dir / "connections.json"

    def commands_log_path(self, cluster: str) -> Path:
        """Log of every command that arrived over the cluster's sshd."""
        return self.cluster_dir(cluster) / "commands.log"

    def host_key_file(self, cluster: str) -> Path:
        """The sshd host private key of a cluster (public key next to it)."""
        return self.cluster_dir(cluster) / "ssh" / "ssh_host_ed25519_key"

    def _pid_file(self, cluster: str, daemon: str) -> Path:
        return self.cluster_dir(cluster) / "run" / f"{daemon}.pid"

    def _log_file(self, cluster: str, daemon: str) -> Path:
        return self.cluster_dir(cluster) / "log" / f"{daemon}.log"

    @property
    def _munge_marker(self) -> Path:
        return self.state_dir / "munged.started-by-sandbox"

    # ---- lifecycle
    def up(self) -> dict[str, dict]:
        """Start munge, both clusters and their sshds; reuse them if already healthy."""
        self._check_packages()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.state_dir.chmod(0o755)
        self._check_traversable()
        self._ensure_user()
        self._ensure_munge()
        self._ensure_client_key()
        if self.is_up():
            # Healthy is enough: jobs may be running (e.g. `make sandbox-up` twice).
            return self._write_connections()
        self._stop_clusters()
        self._check_ports()
        try:
            self._start_clusters()
        except BaseException:
            self._stop_clusters()  # logs stay in the state dir for the post-mortem
            raise
        return self._write_connections()

    def _start_clusters(self) -> None:
        for cluster in CLUSTERS:
            self._prepare_cluster(cluster)
        for cluster in CLUSTERS:
            self._start_slurmctld(cluster)
        for cluster in CLUSTERS:
            self._wait_ping(cluster.name)
        for cluster in CLUSTERS:
            for node in cluster.nodes:
                self._start_slurmd(cluster, node)
            self._start_sshd(cluster)
        for cluster in CLUSTERS:
            self._wait_nodes_idle(cluster.name, NODES_TIMEOUT)

    def down(self) -> None:
        """Stop everything this sandbox started, by pid; safe to call when already down."""
        self._stop_clusters()
        munged = _read_pid(self._munge_marker)
        if _alive(munged, "munged"):
            _stop([munged])  # type: ignore[list-item]
        self._munge_marker.unlink(missing_ok=True)

    def _stop_clusters(self) -> None:
        """Cancel jobs (briefly let them end), then stop every daemon and leftover step."""
        live_ctlds = [
            c.name
            for c in CLUSTERS
            if _alive(_read_pid(self._pid_file(c.name, "slurmctld")), "slurmctld")
        ]
        for name in live_ctlds:
            self._cancel_all(name)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(self._stepd_pids(n) for n in live_ctlds):
            time.sleep(POLL_INTERVAL)
        for cluster in CLUSTERS:
            name = cluster.name
            steps = self._stepd_pids(name)
            pids = [p for node in cluster.nodes if (p := self._slurmd_pid(node.name))]
            ctld = _read_pid(self._pid_file(name, "slurmctld"))
            if ctld and _alive(ctld, "slurmctld"):
                pids.append(ctld)
            _stop(pids + steps + _descendants(steps))
            self.stop_sshd(name)
            steps = self._stepd_pids(name)
            _kill(steps + _descendants(steps), signal.SIGKILL)

    def is_up(self) -> bool:
        """True when every daemon we start is alive and both controllers answer."""
        if not _munge_works():
            return False
        for cluster in CLUSTERS:
            name = cluster.name
            if not _alive(_read_pid(self._pid_file(name, "slurmctld")), "slurmctld"):
                return False
            if not _alive(_read_pid(self._pid_file(name, "sshd")), "sshd"):
                return False
            if not all(self._slurmd_pid(n.name) for n in cluster.nodes):
                return False
            if not self._ping(name):
                return False
        return True

    def connections(self) -> dict[str, dict]:
        """Airflow connections (conn_id -> connection dict) for both login nodes."""
        self._ensure_client_key()
        conns = {}
        for cluster in CLUSTERS:
            self._ensure_host_key(cluster.name)
            host_key = self.host_key_file(cluster.name).with_suffix(".pub").read_text().split()
            conns[f"slurm_{cluster.name}"] = {
                "conn_type": "slurm",
                "description": f"Slurm sandbox cluster {cluster.name} (login node over SSH)",
                "host": "127.0.0.1",
                "port": sshd_port(cluster),
                "login": LOGIN_USER,
                "extra": {
                    "key_file": str(self.key_file),
                    "host_key": f"{host_key[0]} {host_key[1]}",
                    "no_host_key_check": False,
                    "cluster": cluster.name,
                    **({} if remote_work_dir() == "~/.airflow-skypilot"
                       else {"remote_work_dir": remote_work_dir()}),
                },
            }
        return conns

    def reset(self) -> None:
        """Undo what a test did: cancel jobs, restart daemons, resume nodes, wait until idle."""
        for cluster in CLUSTERS:  # a paused daemon first: everything below asks it
            self.resume_slurmctld(cluster.name)
            self.resume_sshd(cluster.name)
        if not _munge_works() or not all(
            _alive(_read_pid(self._pid_file(c.name, "slurmctld")), "slurmctld") for c in CLUSTERS
        ):
            self.up()
            return
        for cluster in CLUSTERS:
            self._cancel_all(cluster.name)
            for node in cluster.nodes:
                if not self._slurmd_pid(node.name):
                    self._start_slurmd(cluster, node)
            if not _alive(_read_pid(self._pid_file(cluster.name, "sshd")), "sshd"):
                self._start_sshd(cluster)
        for cluster in CLUSTERS:
            self._wait_ping(cluster.name)
            for node, state in self._node_states(cluster.name).items():
                if {"DRAIN", "DOWN", "FAIL"} & set(state.replace("*", "").split("+")):
                    self.resume_node(node)
        for cluster in CLUSTERS:
            self._wait_nodes_idle(cluster.name, NODES_TIMEOUT)

    # ---- faults
    def kill_slurmd(self, node: str) -> None:
        """SIGKILL a node's slurmd and its job steps, as if the machine died."""
        cluster = NODE_CLUSTER[node]
        pid = self._slurmd_pid(node)
        if pid:
            _kill([pid], signal.SIGKILL)
        # Two passes: a step may have been forking while we looked.
        for _ in range(2):
            steps = self._stepd_pids(cluster.name, node)
            _kill(steps + _descendants(steps), signal.SIGKILL)
            time.sleep(0.1)
        deadline = time.monotonic() + STOP_TIMEOUT
        while pid and _alive(pid) and time.monotonic() < deadline:
            time.sleep(POLL_INTERVAL / 5)

    def start_slurmd(self, node: str) -> None:
        """Start a node's slurmd again and wait until slurmctld hears from it."""
        cluster = NODE_CLUSTER[node]
        if not self._slurmd_pid(node):
            self._start_slurmd(cluster, cluster.nodes[[n.name for n in cluster.nodes].index(node)])
        deadline = time.monotonic() + NODES_TIMEOUT
        while time.monotonic() < deadline:
            state = self._node_states(cluster.name).get(node, "")
            if state and "NOT_RESPONDING" not in state and "*" not in state:
                return
            time.sleep(POLL_INTERVAL)
        raise SandboxError(
            f"slurmd of {node} did not register with {cluster.name}'s slurmctld\n"
            + _tail(self._log_file(cluster.name, f"slurmd-{node}"))
        )

    def drain_node(self, node: str, reason: str = "test") -> None:
        """Mark a node DRAIN: running jobs finish, nothing new is scheduled there."""
        cluster = NODE_CLUSTER[node].name
        self.run(
            cluster,
            "scontrol",
            "update",
            f"NodeName={node}",
            "State=DRAIN",
            f"Reason={reason}",
            as_root=True,
        )

    def resume_node(self, node: str) -> None:
        """Return a drained or down node to service (no-op if it is fine)."""
        cluster = NODE_CLUSTER[node].name
        proc = self.run(
            cluster,
            "scontrol",
            "update",
            f"NodeName={node}",
            "State=RESUME",
            check=False,
            as_root=True,
        )
        if proc.returncode != 0 and "Invalid node state" not in proc.stderr:
            raise SandboxError(f"resume {node} failed: {proc.stderr.strip()}")

    def pause_slurmctld(self, cluster: str) -> None:
        """SIGSTOP the cluster's slurmctld: it keeps its port and its jobs run on, but nothing
        answers (squeue, sbatch, scancel wait for MessageTimeout, then fail)."""
        pid = _read_pid(self._pid_file(cluster, "slurmctld"))
        if not _alive(pid, "slurmctld"):
            raise SandboxError(f"slurmctld of {cluster} is not running")
        _kill([pid], signal.SIGSTOP)  # type: ignore[list-item]

    def resume_slurmctld(self, cluster: str) -> None:
        """SIGCONT the cluster's slurmctld (no-op when it runs)."""
        pid = _read_pid(self._pid_file(cluster, "slurmctld"))
        if _alive(pid, "slurmctld"):
            _kill([pid], signal.SIGCONT)  # type: ignore[list-item]

    def pause_sshd(self, cluster: str) -> None:
        """SIGSTOP the login node's sshd and every session under it: connections are
        accepted (the kernel's backlog) and open ones stay, but nothing answers: a hung
        login node."""
        pid = _read_pid(self._pid_file(cluster, "sshd"))
        if not _alive(pid, "sshd"):
            raise SandboxError(f"sshd of {cluster} is not running")
        _kill([pid, *_descendants([pid])], signal.SIGSTOP)  # type: ignore[list-item]

    def resume_sshd(self, cluster: str) -> None:
        """SIGCONT the login node's sshd and its sessions (no-op when they run)."""
        pid = _read_pid(self._pid_file(cluster, "sshd"))
        if _alive(pid, "sshd"):
            _kill([pid, *_descendants([pid])], signal.SIGCONT)  # type: ignore[list-item]

    def stop_sshd(self, cluster: str) -> None:
        """Take the login node away: the listener and all its sessions."""
        pid = _read_pid(self._pid_file(cluster, "sshd"))
        if not _alive(pid, "sshd"):
            return
        tree = _descendants([pid])  # type: ignore[list-item]
        _kill([pid], signal.SIGKILL)  # type: ignore[list-item]
        _kill(tree, signal.SIGKILL)
        deadline = time.monotonic() + STOP_TIMEOUT
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(POLL_INTERVAL / 5)

    def start_sshd(self, cluster: str) -> None:
        """Bring the login node back (no-op when it is running)."""
        if not _alive(_read_pid(self._pid_file(cluster, "sshd")), "sshd"):
            self._start_sshd(CLUSTER_BY_NAME[cluster])

    # ---- helpers for tests
    def run(
        self,
        cluster: str,
        *argv: str,
        check: bool = True,
        input: str | None = None,
        timeout: float = 60.0,
        as_root: bool = False,
    ) -> subprocess.CompletedProcess[str]:
        """Run a Slurm command on this host against one cluster, as the login user."""
        user = pwd.getpwnam(LOGIN_USER) if not as_root else pwd.getpwuid(0)
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
            "HOME": user.pw_dir,
            "USER": user.pw_name,
            "LOGNAME": user.pw_name,
            "SHELL": "/bin/bash",
            "LANG": "C.UTF-8",
            "SLURM_CONF": str(self.slurm_conf(cluster)),
        }
        kwargs: dict = {}
        if not as_root:
            kwargs = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}
        proc = subprocess.run(
            list(argv),
            input=input,
            capture_output=True,
            text=True,
            env=env,
            cwd=user.pw_dir,
            timeout=timeout,
            check=False,
            **kwargs,
        )
        if check and proc.returncode != 0:
            err = subprocess.CalledProcessError(
                proc.returncode, proc.args, proc.stdout, proc.stderr
            )
            err.add_note(f"stderr: {proc.stderr.strip()}")
            raise err
        return proc

    def commands_log(self, cluster: str) -> list[str]:
        """Every command that arrived over the cluster's sshd, in order, one entry each."""
        return [command for _, _, command in self.timed_commands(cluster)]

    def timed_commands(self, cluster: str) -> list[tuple[float, int, str]]:
        """Every command that arrived over the cluster's sshd, in order: (epoch seconds, the
        SSH client's port: one per SSH connection, the command)."""
        try:
            lines = self.commands_log_path(cluster).read_text().splitlines()
        except FileNotFoundError:
            return []
        out = []
        for line in lines:
            t, port, command = line.split("\t", 2)
            out.append((float(t), int(port), _unescape_log(command)))
        return out

    def clear_commands_log(self, cluster: str) -> None:
        """Empty the commands log (keeps the file and its owner so sshd can append)."""
        path = self.commands_log_path(cluster)
        if path.exists():
            with path.open("w"):
                pass

    def status(self) -> dict[str, dict]:
        """Per-process liveness and node states, for the CLI and for debugging."""
        out: dict[str, dict] = {"munge": {"works": _munge_works()}}
        for cluster in CLUSTERS:
            name = cluster.name
            ctld = _alive(_read_pid(self._pid_file(name, "slurmctld")), "slurmctld")
            out[name] = {
                "slurmctld": ctld,
                "ping": ctld and self._ping(name),
                "slurmd": {n.name: bool(self._slurmd_pid(n.name)) for n in cluster.nodes},
                "sshd": _alive(_read_pid(self._pid_file(name, "sshd")), "sshd"),
                "sshd_port": sshd_port(cluster),
                "nodes": self._node_states(name) if ctld else {},
            }
        return out

    # ---- internals: setup
    def _check_packages(self) -> None:
        missing = sorted({pkg for b, pkg in REQUIRED_BINARIES.items() if not shutil.which(b)})
        if not Path(SFTP_SERVER).exists():
            missing.append("openssh-sftp-server")
        if missing:
            raise SandboxError(
                f"Slurm sandbox needs Debian packages {', '.join(missing)}; run: {APT_HINT}"
            )
        if os.geteuid() != 0:
            raise SandboxError("Slurm sandbox must run as root (it starts slurmd and sshd)")

    def _check_traversable(self) -> None:
        """The login user reads slurm.conf and runs the ssh wrapper from the state dir."""
        for parent in [self.state_dir, *self.state_dir.parents]:
            if not parent.stat().st_mode & stat.S_IXOTH:
                raise SandboxError(
                    f"state dir {self.state_dir} is not reachable by {LOGIN_USER}: "
                    f"{parent} lacks o+x; pick a state dir under world-traversable dirs"
                )

    def _ensure_user(self) -> None:
        """Create the login user jobs run as (never root), with bash and a writable home."""
        try:
            user = pwd.getpwnam(LOGIN_USER)
        except KeyError:
            # '*' (not '!') so sshd without PAM does not treat the account as locked.
            _check(
                [
                    "useradd",
                    "--create-home",
                    "--shell",
                    "/bin/bash",
                    "--user-group",
                    "--password",
                    "*",
                    LOGIN_USER,
                ]
            )
            user = pwd.getpwnam(LOGIN_USER)
        if user.pw_shell != "/bin/bash":
            _check(["usermod", "--shell", "/bin/bash", LOGIN_USER])
        home = Path(user.pw_dir)
        home.mkdir(parents=True, exist_ok=True)
        os.chown(home, user.pw_uid, user.pw_gid)

    def _ensure_munge(self) -> None:
        """Use a running munged, else start one (remembered so down() stops only ours)."""
        if _munge_works():
            return
        munge = pwd.getpwnam("munge")
        if not MUNGE_KEY.exists():
            MUNGE_KEY.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chown(MUNGE_KEY.parent, munge.pw_uid, munge.pw_gid)
            _check(["mungekey", "--create", f"--keyfile={MUNGE_KEY}"])
            os.chown(MUNGE_KEY, munge.pw_uid, munge.pw_gid)
            MUNGE_KEY.chmod(0o600)
        for d, mode in (
            (MUNGE_RUN_DIR, 0o755),
            (Path("/var/lib/munge"), 0o700),
            (Path("/var/log/munge"), 0o700),
        ):
            d.mkdir(parents=True, exist_ok=True)
            os.chown(d, munge.pw_uid, munge.pw_gid)
            d.chmod(mode)
        pid_file = MUNGE_RUN_DIR / "munged.pid"
        subprocess.run(
            ["munged"],
            user=munge.pw_uid,
            group=munge.pw_gid,
            extra_groups=[],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if _munge_works():
                self._munge_marker.write_text(f"{_read_pid(pid_file)}\n")
                return
            time.sleep(POLL_INTERVAL)
        raise SandboxError("munged did not start\n" + _tail(Path("/var/log/munge/munged.log")))

    def _ensure_client_key(self) -> None:
        """Client key pair and authorized_keys, kept across restarts so connections stay valid."""
        ssh_dir = self.key_file.parent
        ssh_dir.mkdir(parents=True, exist_ok=True)
        ssh_dir.chmod(0o755)
        if not self.key_file.exists():
            _check(
                [
                    "ssh-keygen",
                    "-q",
                    "-t",
                    "ed25519",
                    "-N",
                    "",
                    "-C",
                    f"{LOGIN_USER}@slurm-sandbox",
                    "-f",
                    str(self.key_file),
                ]
            )
        authorized = ssh_dir / "authorized_keys"
        pub = self.key_file.with_suffix(".pub").read_text()
        if not authorized.exists() or authorized.read_text() != pub:
            authorized.write_text(pub)
        authorized.chmod(0o644)

    def _ensure_host_key(self, cluster: str) -> None:
        key = self.host_key_file(cluster)
        key.parent.mkdir(parents=True, exist_ok=True)
        if not key.exists():
            _check(
                [
                    "ssh-keygen",
                    "-q",
                    "-t",
                    "ed25519",
                    "-N",
                    "",
                    "-C",
                    f"slurm-sandbox-{cluster}",
                    "-f",
                    str(key),
                ]
            )
        key.chmod(0o600)

    def _check_ports(self) -> None:
        """Fail early and clearly if another process holds one of our ports."""
        for cluster in CLUSTERS:
            ports = [ctld_port(cluster), sshd_port(cluster)]
            ports += [slurmd_port(cluster, n) for n in cluster.nodes]
            for port in ports:
                with socket.socket() as sock:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    try:
                        sock.bind(("0.0.0.0", port))
                    except OSError as exc:
                        raise SandboxError(
                            f"port {port} (cluster {cluster.name}) is in use: {exc}; "
                            f"set {PORT_BASE_ENV} to move the sandbox's ports"
                        ) from exc

    def _prepare_cluster(self, cluster: Cluster) -> None:
        """Write configs and wipe runtime state of one cluster."""
        d = self.cluster_dir(cluster.name)
        for sub in ("state", "spool", "run", "log", "dev"):
            shutil.rmtree(d / sub, ignore_errors=True)
            (d / sub).mkdir(parents=True)
        # Pre-created and owned by the login user: slurmctld (root) would create it 0600, and
        # `sacct -c` run as the login user opens it for append, not just for reading.
        login = pwd.getpwnam(LOGIN_USER)
        jobcomp = d / "jobcomp.txt"
        jobcomp.write_text("")
        os.chown(jobcomp, login.pw_uid, login.pw_gid)
        jobcomp.chmod(0o644)
        d.chmod(0o755)
        gres_lines = ["AutoDetect=off"]
        node_lines = []
        for node in cluster.nodes:
            (d / "spool" / node.name).mkdir()
            dev = d / "dev" / node.name
            dev.mkdir()
            for i in range(node.gpus):
                (dev / f"nvidia{i}").symlink_to("/dev/null")
            gres_lines.append(
                f"NodeName={node.name} Name=gpu Type={node.gpu_type} "
                f"File={dev}/nvidia[0-{node.gpus - 1}]"
            )
            node_lines.append(
                f"NodeName={node.name} NodeHostname={self.hostname} NodeAddr={node.addr} "
                f"Port={slurmd_port(cluster, node)} CPUs={node.cpus} "
                f"RealMemory={node.memory_mb} Gres=gpu:{node.gpu_type}:{node.gpus} State=UNKNOWN"
            )
        part_lines = [
            f"PartitionName={p.name} Nodes={','.join(p.nodes)} "
            f"Default={'YES' if p.default else 'NO'} MaxTime={p.max_time} State=UP"
            for p in cluster.partitions
        ]
        conf = SLURM_CONF.format(
            cluster=cluster.name,
            hostname=self.hostname,
            ctld_port=ctld_port(cluster),
            dir=d,
            first_job_id=cluster.first_job_id,
            nodes="\n".join(node_lines),
            partitions="\n".join(part_lines),
        )
        self.slurm_conf(cluster.name).write_text(conf)
        (d / "gres.conf").write_text("\n".join(gres_lines) + "\n")
        # sshd login node
        self._ensure_host_key(cluster.name)
        ssh_dir = self.host_key_file(cluster.name).parent
        ssh_dir.chmod(0o755)
        log = self.commands_log_path(cluster.name)
        log.write_text("")
        user = pwd.getpwnam(LOGIN_USER)
        os.chown(log, user.pw_uid, user.pw_gid)
        log.chmod(0o644)
        wrapper = ssh_dir / "command-wrapper.sh"
        wrapper.write_text(SSH_WRAPPER.format(cluster=cluster.name, log=log))
        wrapper.chmod(0o755)
        (ssh_dir / "sshd_config").write_text(
            SSHD_CONFIG.format(
                cluster=cluster.name,
                port=sshd_port(cluster),
                ssh_dir=ssh_dir,
                run_dir=d / "run",
                authorized_keys=self.key_file.parent / "authorized_keys",
                user=LOGIN_USER,
                slurm_conf=self.slurm_conf(cluster.name),
                sftp_server=SFTP_SERVER,
                wrapper=wrapper,
            )
        )

    # ---- internals: daemons
    def _daemon_env(self, cluster: str) -> dict[str, str]:
        return {
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "LANG": "C.UTF-8",
            "SLURM_CONF": str(self.slurm_conf(cluster)),
            # Lets us tell our slurmstepds (they inherit slurmd's environment) from others'.
            "SKYPILOT_SANDBOX_STATE": str(self.state_dir),
        }

    def _spawn(self, argv: list[str], env: dict[str, str], what: str, log: Path) -> None:
        """Run a self-daemonizing program and wait for its launcher to return."""
        proc = subprocess.run(
            argv,
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
            stdin=subprocess.DEVNULL,
        )
        if proc.returncode != 0:
            raise SandboxError(
                f"{what} failed to start ({proc.returncode}): {proc.stderr.strip()}\n" + _tail(log)
            )

    def _start_slurmctld(self, cluster: Cluster) -> None:
        name = cluster.name
        self._spawn(
            ["slurmctld", "-f", str(self.slurm_conf(name))],
            self._daemon_env(name),
            f"slurmctld of {name}",
            self._log_file(name, "slurmctld"),
        )

    def _start_slurmd(self, cluster: Cluster, node: Node) -> None:
        name = cluster.name
        (self.cluster_dir(name) / "spool" / node.name).mkdir(parents=True, exist_ok=True)
        log = self._log_file(name, f"slurmd-{node.name}")
        # slurmstepd inherits slurmd's environment: the node name there lets kill_slurmd
        # find exactly that node's job steps.
        env = self._daemon_env(name) | {"SKYPILOT_SANDBOX_NODE": node.name}
        self._spawn(
            ["slurmd", "-f", str(self.slurm_conf(name)), "-N", node.name],
            env,
            f"slurmd {node.name}",
            log,
        )
        deadline = time.monotonic() + 10
        while not self._slurmd_pid(node.name):
            if time.monotonic() > deadline:
                raise SandboxError(f"slurmd {node.name} did not stay up\n" + _tail(log))
            time.sleep(POLL_INTERVAL)

    def _start_sshd(self, cluster: Cluster) -> None:
        name = cluster.name
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation dir
        config = self.host_key_file(name).parent / "sshd_config"
        log = self._log_file(name, "sshd")
        self._spawn(
            ["/usr/sbin/sshd", "-f", str(config), "-E", str(log)],
            self._daemon_env(name),
            f"sshd of {name}",
            log,
        )
        deadline = time.monotonic() + 10
        while True:
            pid = _read_pid(self._pid_file(name, "sshd"))
            if _alive(pid, "sshd") and _port_open(sshd_port(cluster)):
                return
            if time.monotonic() > deadline:
                raise SandboxError(f"sshd of {name} did not start\n" + _tail(log))
            time.sleep(POLL_INTERVAL)

    def _slurmd_pid(self, node: str) -> int | None:
        """Pid of a node's live slurmd, or None."""
        cluster = NODE_CLUSTER[node].name
        pid = _read_pid(self._pid_file(cluster, f"slurmd-{node}"))
        return pid if _alive(pid, "slurmd") else None

    def _stepd_pids(self, cluster: str, node: str | None = None) -> list[int]:
        """Live slurmstepds of a cluster (optionally one node), told apart by their environ."""
        nodes = {node} if node else {n.name for n in CLUSTER_BY_NAME[cluster].nodes}
        out = []
        for pid in _all_pids():
            if not _alive(pid, "slurmstepd"):
                continue
            env = _environ(pid)
            if (
                env.get("SKYPILOT_SANDBOX_STATE") == str(self.state_dir)
                and env.get("SKYPILOT_SANDBOX_NODE") in nodes
            ):
                out.append(pid)
        return out

    # ---- internals: slurm queries
    def _ping(self, cluster: str) -> bool:
        try:
            proc = self.run(cluster, "scontrol", "ping", check=False, timeout=10, as_root=True)
        except subprocess.TimeoutExpired:
            return False
        return proc.returncode == 0 and " is UP" in proc.stdout

    def _wait_ping(self, cluster: str) -> None:
        deadline = time.monotonic() + CTLD_TIMEOUT
        log = self._log_file(cluster, "slurmctld")
        while not self._ping(cluster):
            pid = _read_pid(self._pid_file(cluster, "slurmctld"))
            if time.monotonic() > deadline or (pid and not _alive(pid)):
                raise SandboxError(
                    f"slurmctld of {cluster} does not answer scontrol ping\n" + _tail(log)
                )
            time.sleep(POLL_INTERVAL)

    def _node_states(self, cluster: str) -> dict[str, str]:
        """Node name -> scontrol State (e.g. IDLE, ALLOCATED, DOWN*+DRAIN)."""
        proc = self.run(
            cluster, "scontrol", "-o", "show", "node", check=False, timeout=10, as_root=True
        )
        states = {}
        for line in proc.stdout.splitlines():
            fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
            if "NodeName" in fields:
                states[fields["NodeName"]] = fields.get("State", "")
        return states

    def _active_jobs(self, cluster: str) -> list[str]:
        proc = self.run(cluster, "squeue", "-h", "-o", "%A", check=False, timeout=10, as_root=True)
        return proc.stdout.split()

    def _cancel_all(self, cluster: str) -> None:
        jobs = self._active_jobs(cluster)
        if jobs:
            self.run(cluster, "scancel", *jobs, check=False, as_root=True)
        for name in self._reservations(cluster):
            self.run(cluster, "scontrol", "delete", f"reservationname={name}", check=False,
                     timeout=10, as_root=True)

    def _reservations(self, cluster: str) -> list[str]:
        proc = self.run(cluster, "sinfo", "-h", "-T", check=False, timeout=10, as_root=True)
        # "No reservations in the system" when there are none
        return [line.split()[0] for line in proc.stdout.splitlines() if len(line.split()) >= 6]

    def reserve(self, cluster: str, name: str, nodes: str, start_in_s: int,
                minutes: int, users: str = "root", flags: str = "maint") -> None:
        """A reservation of ``nodes`` from ``start_in_s`` seconds on, made as an admin makes
        one (a maintenance by default; ``flags=""`` and ``users`` for a group's block);
        ``reset`` deletes it."""
        self.run(cluster, "scontrol", "create", "reservation", f"reservationname={name}",
                 f"starttime=now+{start_in_s}", f"duration={minutes}", f"nodes={nodes}",
                 *([f"flags={flags}"] if flags else []), f"users={users}", as_root=True)

    def _wait_nodes_idle(self, cluster: str, timeout: float) -> None:
        """Wait (bounded) until no job is active and every node is plain IDLE."""
        start = time.monotonic()
        deadline = start + timeout
        forced: set[str] = set()
        while True:
            states = self._node_states(cluster)
            jobs = self._active_jobs(cluster)
            if states and not jobs and all(s == "IDLE" for s in states.values()):
                return
            # A node whose slurmd was killed and restarted can stay COMPLETING for minutes
            # (its epilog message was lost). A real admin takes it down and resumes it; so do we.
            if time.monotonic() - start > 15:
                for node, state in states.items():
                    if "COMPLETING" in state and node not in forced:
                        forced.add(node)
                        self.run(cluster, "scontrol", "update", f"NodeName={node}", "State=DOWN",
                                 "Reason=sandbox-reset-stuck-completing", check=False,
                                 as_root=True)
                        self.resume_node(node)
            if time.monotonic() > deadline:
                bad = {n: s for n, s in states.items() if s != "IDLE"}
                logs = "\n".join(_tail(self._log_file(cluster, f"slurmd-{n}"), 10) for n in bad)
                raise SandboxError(
                    f"cluster {cluster}: nodes not idle after {timeout:.0f}s: {bad or states}; "
                    f"active jobs: {jobs}\n{logs}\n" + _tail(self._log_file(cluster, "slurmctld"))
                )
            time.sleep(POLL_INTERVAL * 2)

    def _write_connections(self) -> dict[str, dict]:
        conns = self.connections()
        self.connections_file.write_text(json.dumps(conns, indent=2) + "\n")
        self.connections_file.chmod(0o644)
        return conns


def _munge_works() -> bool:
    """True if a munged answers on the default socket (what Slurm uses)."""
    try:
        enc = subprocess.run(["munge", "-n"], capture_output=True, timeout=10, check=False)
        if enc.returncode != 0:
            return False
        dec = subprocess.run(
            ["unmunge"], input=enc.stdout, capture_output=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return dec.returncode == 0


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    """``up`` / ``down`` / ``status`` / ``env`` for make targets and humans."""
    parser = argparse.ArgumentParser(
        prog="python -m tests.sandbox.slurm",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("command", choices=["up", "down", "status", "env"])
    parser.add_argument("--state-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    sandbox = SlurmSandbox(args.state_dir)
    try:
        if args.command == "up":
            started = time.monotonic()
            conns = sandbox.up()
            print(
                f"slurm sandbox up in {time.monotonic() - started:.1f}s; "
                f"connections: {sandbox.connections_file}",
                file=sys.stderr,
            )
            for conn_id, conn in conns.items():
                print(
                    f"  {conn_id}: ssh -i {sandbox.key_file} -p {conn['port']} "
                    f"{conn['login']}@{conn['host']}",
                    file=sys.stderr,
                )
        elif args.command == "down":
            sandbox.down()
            print("slurm sandbox down", file=sys.stderr)
        elif args.command == "status":
            print(json.dumps(sandbox.status(), indent=2))
            return 0 if sandbox.is_up() else 1
        else:
            for conn_id, conn in sandbox.connections().items():
                print(f"export AIRFLOW_CONN_{conn_id.upper()}='{json.dumps(conn)}'")
    except SandboxError as exc:
        print(f"slurm sandbox: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
