"""What the sandbox benchmarks share: side-by-side repetitions, ratio summaries, the sandbox.

Machines here are shared and noisy, so a benchmark never compares numbers taken at different
times: it runs its variants interleaved (A, B, A, B... with the order flipped every other
round, so neither always goes first), takes a ratio per round, and reports the median ratio
with its range over the rounds.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SANDBOX = REPO / ".sandbox"
#: the connections a DAG sees by default on the sandbox (tests/sandbox/__main__.py)
DEFAULT_CONNECTIONS = ("slurm_alpha", "slurm_beta", "k8s_sandbox", "aws_sandbox")


@dataclass
class Spread:
    """The median of some values, with their range and count."""

    median: float
    low: float
    high: float
    n: int

    def fmt(self, unit: str = "x", digits: int = 2) -> str:
        """``1.14x (1.05-1.30, n=7)``."""
        return (f"{self.median:.{digits}f}{unit} ({self.low:.{digits}f}-{self.high:.{digits}f}"
                f", n={self.n})")


def spread(values: Sequence[float]) -> Spread:
    """Median and range of ``values`` (at least one)."""
    if not values:
        raise ValueError("no values")
    return Spread(statistics.median(values), min(values), max(values), len(values))


def ratios(numerators: Sequence[float], denominators: Sequence[float]) -> list[float]:
    """The per-round ratios of two series measured side by side (same length)."""
    if len(numerators) != len(denominators):
        raise ValueError("the two series must have one value per round")
    return [a / b for a, b in zip(numerators, denominators, strict=True)]


def interleaved(rounds: int, variants: dict[str, Callable[[], Any]]) -> dict[str, list[Any]]:
    """Run every variant once per round, the order reversed every other round; each variant's
    results, one per round."""
    names = list(variants)
    out: dict[str, list[Any]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            out[name].append(variants[name]())
    return out


@dataclass
class Machine:
    """Where and when a run happened (for the README)."""

    date: str = field(default_factory=lambda: time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    nproc: int = field(default_factory=lambda: os.cpu_count() or 0)
    load: str = field(default_factory=lambda: " ".join(Path("/proc/loadavg").read_text()
                                                        .split()[:3]))

    def line(self) -> str:
        return f"{self.date}, nproc {self.nproc}, load average {self.load} at the start"


# --- the sandbox -----------------------------------------------------------------------------

def sandbox_connections() -> dict[str, dict]:
    """The sandbox's Airflow connections (``.sandbox/connections.json``), or {} when it is
    not up."""
    path = SANDBOX / "connections.json"
    if not path.exists():
        return {}
    return json.loads(path.read_text())


def use_sandbox(conn_ids: Sequence[str] = DEFAULT_CONNECTIONS) -> dict[str, dict]:
    """Make the sandbox's connections visible to hooks in this process (AIRFLOW_CONN_<ID>);
    raises when one of ``conn_ids`` is missing (the sandbox is not up)."""
    conns = sandbox_connections()
    missing = [c for c in conn_ids if c not in conns]
    if missing:
        raise SystemExit(f"sandbox connections missing: {', '.join(missing)}; start it: "
                         "SKYPILOT_SANDBOX_PORT_BASE=... python -m tests.sandbox up")
    for conn_id, conn in conns.items():
        os.environ[f"AIRFLOW_CONN_{conn_id.upper()}"] = json.dumps(conn)
    return conns


def slurm_cmd(cluster: str, *argv: str, check: bool = True, as_root: bool = False
              ) -> subprocess.CompletedProcess[str]:
    """A Slurm command against one sandbox cluster, run on this host (as the sandbox does:
    measurement plumbing, not the code under test)."""
    from tests.sandbox.slurm import SlurmSandbox

    return SlurmSandbox().run(cluster, *argv, check=check, as_root=as_root)


def slurmctld_events(cluster: str, needle: str, since: float) -> list[tuple[float, str]]:
    """(epoch, line) of the cluster's slurmctld log lines containing ``needle`` stamped at or
    after ``since`` (slurmctld stamps each line to the millisecond, in local time)."""
    from tests.sandbox.slurm import SlurmSandbox

    path = SlurmSandbox().cluster_dir(cluster) / "log" / "slurmctld.log"
    out = []
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return []
    for line in text.splitlines():
        if needle not in line or not line.startswith("["):
            continue
        t = parse_slurm_stamp(line[1:line.index("]")])
        if t is not None and t >= since:
            out.append((t, line))
    return out


def parse_slurm_stamp(stamp: str) -> float | None:
    """``2026-12-01T04:40:44.818`` (local time) -> epoch seconds; None if not a stamp."""
    import datetime as dt

    try:
        return dt.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%f").timestamp()
    except ValueError:
        try:
            return dt.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S").timestamp()
        except ValueError:
            return None
