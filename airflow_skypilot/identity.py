"""Who a job belongs to: its name, and which earlier jobs a new try may adopt.

Every job of one task instance (one deployment, DAG, task, map index and run) carries one
*prefix*; the rest of its name says under which clear of the task instance (its ``max_tries``
less its retries: Airflow moves it only when this task instance is cleared, not when another
task of the run is), which try and which attempt (failover or restart) it was submitted::

    sky-<dag-task slug>-<digest of the task instance>-c<clear>-t<try>-a<attempt>

The digest is of the exact tuple (with the map index a field of its own), so ``train-1`` and a
mapped ``train[1]`` never share names, and of the ``[skypilot] deployment_id``, so two Airflow
deployments that share a cluster account never see each other's jobs. Backends list jobs by
prefix (``Backend.find_all``), which is how every try finds the jobs of the tries before it.

What a new try does with them (:func:`classify`): it *adopts* a job of the same clear of the
same run that is still alive or has succeeded (the worker died after submitting; the task was
retried), and *stops* every other live one: a job of an earlier clear (the user asked for a
re-run), or one submitted before this run started (a run deleted and created again under the
same run_id). Nothing of another run is ever adopted, and nothing of this task is left running.

One case reads as a retry, not a re-run: clearing a task instance while it *runs* (Airflow sets
it to restarting and leaves ``max_tries`` alone), so the next try adopts its job rather than
running it again. Its worker is killed first, and ``on_kill`` cancels the job (unless
``cancel_on_kill=False``): then there is nothing to adopt and the job runs anew.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from airflow_skypilot.backends.base import JobHandle, JobState

#: a job submitted this long before the run's start still counts as the run's own (clock skew
#: between the worker that submitted it and the scheduler that started the run)
START_SKEW_SECONDS = 30.0
_NAME_RE = re.compile(r"^(?P<prefix>.+-)c(?P<clear>\d+)-t(?P<try>\d+)-a(?P<attempt>\d+)$")
_SLUG_LEN = 28
_DIGEST_LEN = 10


@dataclass(frozen=True)
class TaskKey:
    """One task instance of one DAG run, as this deployment knows it."""

    dag_id: str
    task_id: str
    run_id: str
    map_index: int = -1
    deployment: str = ""

    @property
    def digest(self) -> str:
        parts = (self.deployment, self.dag_id, self.task_id, str(self.map_index), self.run_id)
        return hashlib.sha256("\0".join(parts).encode()).hexdigest()

    @property
    def prefix(self) -> str:
        """What every job name of this task instance starts with (DNS-1123 safe)."""
        slug = re.sub(r"[^a-z0-9]+", "-", f"{self.dag_id}-{self.task_id}".lower())
        slug = slug.strip("-")[:_SLUG_LEN].strip("-") or "task"
        return f"sky-{slug}-{self.digest[:_DIGEST_LEN]}-"

    def job_name(self, clear: int, try_number: int, attempt: int) -> str:
        """The job of one attempt of one try (<= 63 characters)."""
        return f"{self.prefix}c{clear}-t{try_number}-a{attempt}"

    @property
    def skypilot_task_id(self) -> str:
        """``SKYPILOT_TASK_ID``: the same for every try, clear and failover of this task
        instance (the checkpoint key), distinct for every other one."""
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", self.run_id)
        task = self.task_id if self.map_index < 0 else f"{self.task_id}_{self.map_index}"
        return f"sky-airflow_{self.dag_id}_{task}_{safe}_{self.digest[:6]}"


@dataclass(frozen=True)
class NameParts:
    prefix: str
    clear: int
    try_number: int
    attempt: int


def parse_job_name(name: str) -> NameParts | None:
    """The parts of a job name made by :meth:`TaskKey.job_name` (None for any other name)."""
    match = _NAME_RE.match(name)
    if not match:
        return None
    return NameParts(match["prefix"], int(match["clear"]), int(match["try"]),
                     int(match["attempt"]))


def clear_of(ti: Any, dag_run: Any, retries: int | None) -> int:
    """Which clear of its task instance a try belongs to: ``max_tries`` less the task's
    retries (Airflow moves ``max_tries`` only when this task instance is cleared; the run's
    ``clear_number`` moves when any task of the run is, and a retry after clearing another
    task must still adopt its job). The run's number where ``max_tries`` is not given."""
    max_tries = getattr(ti, "max_tries", None)
    if isinstance(max_tries, int) and not isinstance(max_tries, bool):
        return max(0, max_tries - int(retries or 0))
    return int(getattr(dag_run, "clear_number", 0) or 0)


def attempt_number(try_number: int, attempt: int) -> int:
    """``SKYPILOT_ATTEMPT``: grows with every new copy of the task instance (tries grow across
    clears), so a program can fence its writes: a copy with a lower number is an old one."""
    return try_number * 1000 + attempt


def next_attempt(found: Iterable[JobHandle], clear: int, try_number: int,
                 adopted: JobHandle | None) -> int:
    """The attempt number to go on with: the adopted job's, else the first one no job of this
    clear and try has used (a name is submitted at most once: a used one would be adopted)."""
    used = [p.attempt for p in map(parse_job_name, (h.job_name for h in found))
            if p and p.clear == clear and p.try_number == try_number]
    if adopted is not None:
        parts = parse_job_name(adopted.job_name)
        return max([parts.attempt if parts else 0, *used])
    return max(used) + 1 if used else 0


@dataclass
class Earlier:
    """What to do with the jobs earlier tries left: adopt at most one, stop the live rest."""

    adopt: JobHandle | None = None
    adopt_status: Any = None  # its JobStatus
    stop: list[tuple[JobHandle, str]] = None  # type: ignore[assignment]
    ignore: list[tuple[JobHandle, str]] = None  # type: ignore[assignment]
    #: the ended jobs of the adopted job's try that came before it, oldest first, each with
    #: its status: the failovers and restarts its try already made (they still count)
    before: list[tuple[JobHandle, Any]] = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        self.stop = self.stop or []
        self.ignore = self.ignore or []
        self.before = self.before or []


def classify(found: Iterable[tuple[JobHandle, Any]], *, prefix: str, clear: int,
             run_started_at: float | None) -> Earlier:
    """Sort the jobs found under ``prefix`` (each with its status) for a new try.

    Adoptable: same clear, submitted after the run started, alive or succeeded; the newest such
    job is adopted (the highest try, then attempt). Every other live job of the prefix is to be
    stopped; finished ones are left alone. The ended jobs of the adopted one's try that came
    before it are its history (``before``): the try goes on with their failovers and restarts.
    """
    out = Earlier()
    candidates: list[tuple[tuple[int, int], JobHandle, Any]] = []
    ended: list[tuple[NameParts, JobHandle, Any]] = []  # of this clear, since the run began
    seen: set[tuple[str, str, str]] = set()
    for handle, status in found:
        # two connections to one cluster list the same job twice (their infra names may
        # differ: a Slurm connection's cluster name is its conn_id unless set): one job. A
        # name is submitted once, so the same name and id on one backend kind is that job
        same = (handle.backend, handle.job_name, handle.job_id)
        if same in seen:
            continue
        seen.add(same)
        parts = parse_job_name(handle.job_name)
        if parts is None or parts.prefix != prefix:
            continue  # not a name of ours (another task whose prefix is a prefix of ours)
        alive = status is not None and not status.state.terminal
        # ended, but part of its allocation still runs (a lost rank's peer): stopped, never
        # adopted
        up = status is not None and status.up
        succeeded = status is not None and status.state == JobState.SUCCEEDED
        if parts.clear != clear:
            why = f"submitted under clear {parts.clear} of the run (now {clear})"
        elif run_started_at is not None and handle.submitted_at and \
                handle.submitted_at < run_started_at - START_SKEW_SECONDS:
            why = "submitted before this run started (a deleted run of the same id)"
        elif alive or succeeded:
            candidates.append(((parts.try_number, parts.attempt), handle, status))
            continue
        elif up:
            why = "an earlier try's job that ended with part of its allocation still up"
            ended.append((parts, handle, status))
        else:
            out.ignore.append((handle, "an earlier try's job that ended"))
            if status is not None:
                ended.append((parts, handle, status))
            continue
        (out.stop if up else out.ignore).append((handle, why))
    candidates.sort(key=lambda c: c[0])
    if candidates:
        (try_number, attempt), out.adopt, out.adopt_status = candidates.pop()
        out.before = [(h, st) for parts, h, st in sorted(ended, key=lambda e: e[0].attempt)
                      if parts.try_number == try_number and parts.attempt < attempt]
    for _, handle, status in candidates:
        if status.up:
            out.stop.append((handle, "an older copy than the one adopted"))
    return out
