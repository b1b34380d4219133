"""What a cluster has now, in one SSH command: the probe script and its parser.

The probe uses only portable ``-o``/``-O`` formats that Slurm 22.05 to today print the same way:
``sinfo -N -O`` (per node and partition: state, CPUs, memory, GRES and GRES in use),
``sinfo -o`` (partitions, their MaxTime and DefaultTime), ``squeue -t PENDING -O`` (the queue
ahead: each pending job's request, GPUs per node, job or task, CPUs and memory in all, reason,
planned start and planned nodes, read by :mod:`.queue`), ``scontrol show res`` (reservations:
their nodes, window and flags), ``squeue -t RUNNING -O`` (each
running job's nodes, GPUs, planned end, CPUs and memory: with the queue, backfill's plan, read
by :mod:`.backfill`), the finished
jobs' elapsed time and time limit (``sacct``, else ``sacct -c``; kept on the login node for
:data:`HISTORY_TTL_MIN` minutes, so a probe asks slurmdbd at most that often) and ``sbatch
--test-only`` (Slurm's own estimate of when a job of each shape, with the task's own sbatch
options, would start; it submits nothing). ``sinfo -N`` repeats a node once per partition:
the parser counts it once.

Each Slurm command runs under ``timeout`` and its exit status is reported: a failed ``sinfo``
or ``squeue`` of the nodes or the queue (slurmctld down, paused) makes the probe "could not
ask" (:func:`probe_failed`), not an empty cluster. A failed history only leaves the estimate
undiscounted; a failed list of running jobs leaves it to test-only.
"""

from __future__ import annotations

import re
import shlex
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property, lru_cache

from airflow_skypilot.backends.slurm.backfill import RunningJob, parse_running
from airflow_skypilot.backends.slurm.queue import (
    Discount,
    PendingJob,
    Reservation,
    duration_s,
    history_ratio,
    parse_pending,
    parse_reservation,
)
from airflow_skypilot.backends.slurm.shell import (
    bounded,
    parse_int,
    parse_sections,
    remote_dir_expr,
    section_rc,
)

#: Node states in which a node cannot start a job now (any of these words in sinfo's StateLong).
#: Not ``planned`` (22.05+: idle, but backfill plans a pending job on it): a job that ends
#: before that one starts still runs there now; :mod:`.queue` says which resources are held.
_BAD_STATES = ("down", "drain", "fail", "maint", "reserved", "power", "future", "inval",
               "unknown", "reboot", "boot", "blocked")
_GRES_RE = re.compile(r"(?P<name>[A-Za-z_]\w*):(?:(?P<type>[^:(,]+):)?(?P<count>\d+)")

#: one ``sbatch --test-only`` question: (GPUs per node, nodes, CPUs per task, memory in MB)
Shape = tuple[int, int, int, int]
#: minutes the login node keeps the finished jobs' history between two ``sacct`` calls
HISTORY_TTL_MIN = 15
#: the finished jobs read for the history, at most (the most recent)
HISTORY_JOBS = 500


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

    @property
    def planned(self) -> bool:
        """Idle, but backfill plans a pending job on it (Slurm 22.05's PLANNED state)."""
        return "planned" in self.state.lower()

    def gpus_free(self, gres_type: str) -> int:
        return max(0, self.gpus.get(gres_type, 0) - self.gpus_used.get(gres_type, 0))


@dataclass
class PartitionInfo:
    name: str
    up: bool = True
    default: bool = False
    time_limit: str = ""  # MaxTime as sinfo prints it
    pending: int = 0
    default_time: str = ""  # DefaultTime as sinfo prints it (``n/a``: MaxTime applies)

    @property
    def max_time_s(self) -> float | None:
        """MaxTime in seconds (``math.inf``: unlimited; None: unknown)."""
        return duration_s(self.time_limit)

    @property
    def default_time_s(self) -> float | None:
        """The time limit of a job that gives none: DefaultTime, else MaxTime."""
        return duration_s(self.default_time) or self.max_time_s


@dataclass
class ClusterState:
    """One probe's view of a cluster."""

    nodes: dict[str, NodeInfo]
    partitions: dict[str, PartitionInfo]
    now: float
    home: str = ""
    #: (partition, gres type, GPUs per node, nodes, CPUs per task, memory MB) -> start epoch,
    #: or sbatch's refusal text
    starts: dict[tuple[str, str, int, int, int, int], float | str] = field(default_factory=dict)
    #: every pending job (all partitions, all users), as squeue listed them
    pending_jobs: list[PendingJob] = field(default_factory=list)
    #: the login user (whose pending jobs are "ours")
    user: str = ""
    #: finished jobs ``elapsed s|limit s|state`` (None: the history could not be read)
    history: list[str] | None = None
    #: every running job (None: not listed): their GPUs until their planned end
    running: list[RunningJob] | None = None
    #: the names of the login user's live jobs, listed before the nodes were read (None: not
    #: listed); a job among them is in the nodes' and the queue's counts
    our_jobs: frozenset[str] | None = None
    #: advanced reservations (maintenance...), active or to come; none listed: none known
    #: (``offers`` reads a connection's own reservation into them)
    reservations: list[Reservation] = field(default_factory=list)

    @cached_property
    def discount(self) -> Discount | None:
        """How jobs really end here (None: no history read)."""
        return None if self.history is None else _discount(tuple(self.history))

    def nodes_in(self, partition: str) -> list[NodeInfo]:
        return [n for n in self.nodes.values() if partition in n.partitions]


@lru_cache(maxsize=16)  # the login node keeps one history for 15 minutes: probes repeat it
def _discount(history: tuple[str, ...]) -> Discount:
    return history_ratio(history)


def _clock(text: str) -> float:
    """``date +%s.%N``; a ``date`` without ``%N`` prints it as is: the whole seconds then."""
    head = text.strip()
    try:
        return float(head)
    except ValueError:
        seconds = head.split(".")[0]
        return float(seconds) if seconds.isdigit() else time.time()


PROBE_SCRIPT = r"""
echo "@@now"; date +%s.%N
echo "@@home"; printf '%s\n' "$HOME"
echo "@@user"; id -un
echo "@@ours"
_t squeue -h --me -t PENDING,CONFIGURING,RUNNING,COMPLETING -o '%j'
rc=$?; printf "@@ours_rc\n%s\n" "$rc"
echo "@@nodes"
_t sinfo -h -N -O \
  'NodeList:|,Partition:|,StateLong:|,CPUsState:|,Memory:|,AllocMem:|,Gres:|,GresUsed:|,NodeAddr:|'
rc=$?; printf "@@nodes_rc\n%s\n" "$rc"; [ "$rc" = 0 ] || exit 0
echo "@@partitions"
_t sinfo -h -o '%R|%a|%l|%L'
rc=$?; printf "@@partitions_rc\n%s\n" "$rc"; [ "$rc" = 0 ] || exit 0
echo "@@pending"
_t env SLURM_TIME_FORMAT=%s squeue -h -t PENDING -O \
  'JobID:|,Partition:|,NumNodes:|,Reason:|,tres-per-node:|,NumCPUs:|,MinMemory:|,StartTime:|,'\
'SchedNodes:|,UserName:|,PriorityLong:|,TimeLimit:|,tres-per-job:|,tres-per-task:|,NumTasks:|,'\
'tres-alloc:|,ArrayTaskID:|'
rc=$?; printf "@@pending_rc\n%s\n" "$rc"; [ "$rc" = 0 ] || exit 0
echo "@@reservations"
_t env SLURM_TIME_FORMAT=%s scontrol show res -o
printf "@@reservations_rc\n%s\n" "$?"
echo "@@running"
_t env SLURM_TIME_FORMAT=%s squeue -h -t RUNNING,COMPLETING -O \
  'JobID:|,NodeList:|,tres-per-node:|,EndTime:|,NumCPUs:|,MinMemory:|,tres-per-job:|,'\
'tres-per-task:|,NumTasks:|,tres-alloc:|'
printf "@@running_rc\n%s\n" "$?"
echo "@@history"
if [ -n "$HIST" ]; then
  if [ -z "$(find "$HIST" -mmin -"$HIST_TTL" 2>/dev/null)" ]; then
    mkdir -p "$(dirname "$HIST")" 2>/dev/null
    { _t sacct -a -X -n -P -S now-1days -o ElapsedRaw,TimelimitRaw,State 2>/dev/null ||
      _t sacct -c -a -X -n -P -o ElapsedRaw,TimelimitRaw,State 2>/dev/null; } |
      awk -F'|' '$1 > 0 && $2 ~ /^[0-9]+$/ && $2 > 0 { print $1 "|" $2 * 60 "|" $3 }' |
      tail -n "$HIST_JOBS" > "$HIST.$$"
    if [ "${PIPESTATUS[0]}" = 0 ]; then mv -f "$HIST.$$" "$HIST"; else rm -f "$HIST.$$"; fi
  fi
  cat "$HIST" 2>/dev/null
  printf "@@history_rc\n%s\n" "$?"
fi
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
  # as the job script orders them: the task's options, the connection's, then the backend's
  out=$(_t sbatch --test-only --wrap=true "${TASKOPTS[@]}" "${COMMON[@]}" -p "$1" -N "$4" \
        "${gres[@]}" "${extra[@]}" 2>&1 | tail -n 1)
  when=$(printf '%s\n' "$out" | sed -n 's/.* to start at \([^ ]*\) .*/\1/p')
  if [ -n "$when" ]; then when=$(date -d "$when" +%s 2>/dev/null || echo "$out"); else when=$out; fi
  printf '%s|%s|%s|%s|%s|%s|%s\n' "$1" "$2" "$3" "$4" "$5" "$6" "$when"
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


def probe_script(common_args: Sequence[str], partitions: Sequence[str] | None,
                 shapes: Sequence[Shape], slurm_timeout: float = 20.0,
                 task_args: Sequence[str] = (), history_file: str | None = None) -> str:
    """The probe for ``partitions`` (all when None), with a ``--test-only`` per shape (with
    the task's own ``task_args``), and the finished jobs' history kept in ``history_file``
    on the login node (a ``~/`` path; None: no history)."""
    common = " ".join(shlex.quote(a) for a in common_args)
    task_opts = " ".join(shlex.quote(a) for a in task_args)
    parts = " ".join(partitions or [])
    return "\n".join([
        bounded(slurm_timeout),
        f"COMMON=({common})",
        f"TASKOPTS=({task_opts})",
        f"PARTS={shlex.quote(parts)}",
        f"SHAPES={shlex.quote(' '.join(':'.join(map(str, s)) for s in shapes))}",
        f"HIST={remote_dir_expr(history_file) if history_file else chr(39) * 2}",
        f"HIST_TTL={HISTORY_TTL_MIN}",
        f"HIST_JOBS={HISTORY_JOBS}",
        PROBE_SCRIPT,
    ])


def probe_failed(output: str) -> str:
    """Why the probe's Slurm commands did not answer ("" when they all did)."""
    sec = parse_sections(output)
    for name, what in (("nodes", "sinfo"), ("partitions", "sinfo"), ("pending", "squeue")):
        rc = section_rc(sec, name)
        if rc != 0:
            how = "did not answer in time" if rc in (124, 137) else f"failed (exit {rc})"
            return f"{what} {how}: could not ask slurmctld"
    return ""


def parse_gres(text: str) -> dict[str, int]:
    """``gpu:a100:4(S:0-1),gpu:h100:2`` -> {"a100": 4, "h100": 2}; untyped ``gpu:4`` -> {"": 4}."""
    out: dict[str, int] = {}
    for match in _GRES_RE.finditer(text or ""):
        if match.group("name") != "gpu":
            continue
        gres_type = match.group("type") or ""
        out[gres_type] = out.get(gres_type, 0) + int(match.group("count"))
    return out


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
            name=name, partitions=[part], state=state, cpus_total=parse_int(t),
            cpus_alloc=parse_int(a), mem_total_mb=parse_int(mem),
            mem_alloc_mb=parse_int(alloc_mem), gpus=parse_gres(gres),
            gpus_used=parse_gres(gres_used), addr=addr)
    for line in sec.get("partitions", []):
        parts = line.split("|")
        if len(parts) >= 3:
            name = parts[0].strip().rstrip("*")
            info = partitions.setdefault(name, PartitionInfo(name=name))
            info.up = parts[1].strip().lower() == "up"
            info.time_limit = parts[2].strip()
            if len(parts) >= 4:
                info.default_time = parts[3].strip()
    pending = []
    for line in sec.get("pending", []):
        job = parse_pending(line)
        if job is None:
            continue
        pending.append(job)
        for part in job.partitions:
            if part in partitions:
                partitions[part].pending += 1 + job.array_more
    starts: dict[tuple[str, str, int, int, int, int], float | str] = {}
    for line in sec.get("testonly", []):
        # partition|gres type|gpus per node|nodes|cpus|mem MB|epoch or error text
        parts = line.split("|", 6)
        if len(parts) == 7:
            key = (parts[0], parts[1], parse_int(parts[2]), parse_int(parts[3]),
                   parse_int(parts[4]), parse_int(parts[5]))
            starts[key] = float(parts[6]) if parts[6].strip().isdigit() else parts[6].strip()
    now_lines = sec.get("now", [])
    home_lines = sec.get("home", [])
    user_lines = sec.get("user", [])
    history = sec.get("history") if section_rc(sec, "history") == 0 else None
    ours = (frozenset(n.strip() for n in sec.get("ours", []) if n.strip())
            if section_rc(sec, "ours") == 0 else None)
    running = ([j for j in map(parse_running, sec.get("running", [])) if j is not None]
               if section_rc(sec, "running") == 0 else None)
    reservations = [r for r in map(parse_reservation, sec.get("reservations", []))
                    if r is not None and r.nodes] if section_rc(sec, "reservations") == 0 \
        else []
    return ClusterState(nodes=nodes, partitions=partitions,
                        now=_clock(now_lines[0]) if now_lines else time.time(),
                        home=home_lines[0] if home_lines else "", starts=starts,
                        pending_jobs=pending, user=user_lines[0].strip() if user_lines else "",
                        history=history, our_jobs=ours, running=running,
                        reservations=reservations)
