"""What a Slurm connection says beyond SSH: its extras, and the sbatch arguments they give.

A Slurm cluster is an Airflow connection (type ``slurm``, or a plain ``ssh``) to its login node.
Its extras name the cluster (as in ``infra: slurm/<cluster>/<partition>``), restrict partitions,
and add accounting and scheduling options to every ``sbatch`` (the real one and the
``--test-only`` probe alike, so the estimate is for the job that will be submitted).

Each option becomes an ``#SBATCH`` line of the job script: an extra with a control character
(a newline would start a shell line) is a :class:`ConfigurationError` naming the connection and
the extra, raised when the connection is read, before anything is submitted. What the
connection sets, a task's ``config.slurm.sbatch_options`` may not set again
(:meth:`SlurmSettings.owned_options`, :func:`task_conflicts`).
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from airflow_skypilot.exceptions import ConfigurationError
from airflow_skypilot.spec import sbatch
from airflow_skypilot.spec.task import Task

#: the backend's name in handles, offers and infra strings
BACKEND = "slurm"


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
    #: seconds one SSH command (a whole script) may take
    command_timeout: float = 60.0
    #: seconds one Slurm client command (squeue, sacct, sbatch, scancel...) may take on the
    #: login node: a paused or overloaded slurmctld makes them wait far longer on their own
    slurm_timeout: float = 20.0
    #: seconds the upload of a job's files (workdir, file mounts) may take in all
    upload_timeout: float = 600.0
    #: days a finished job's dir (its log) is kept on the login node; <= 0: kept for ever
    log_retention_days: float = 7.0
    #: seconds a job keeps launching again a step srun could not launch (slurmctld restarting
    #: or failing over answers no step request) before it ends as an infrastructure failure
    step_launch_retry: float = 120.0

    @classmethod
    def from_extra(cls, conn_id: str, extra: Mapping[str, Any]) -> SlurmSettings:
        def strings(value: Any) -> list[str] | None:
            if value in (None, "", []):
                return None
            if isinstance(value, str):
                return [v.strip() for v in value.split(",") if v.strip()]
            return [str(v) for v in value]

        _check_extras(conn_id, extra)
        options = extra.get("sbatch_options") or []
        if isinstance(options, str):
            try:
                options = shlex.split(options)
            except ValueError as exc:
                raise ConfigurationError(f"connection {conn_id!r}: extra 'sbatch_options' "
                                         f"cannot be read: {exc}") from None
        try:
            parsed = sbatch.parse_tokens(options)
        except sbatch.OptionError as exc:
            raise ConfigurationError(f"connection {conn_id!r}: extra 'sbatch_options': "
                                     f"{exc}") from None
        # a reservation given among the options confines the jobs as the extra does: the
        # probe must know it (which nodes the jobs may use), whichever way it was given
        given = [o.value for o in parsed if sbatch.canonical(o.name) == "reservation" and o.value]
        reservation = extra.get("reservation") or (given[-1] if given else None)
        if given and given[-1] != reservation:
            raise ConfigurationError(
                f"connection {conn_id!r}: extra 'reservation' is {reservation!r} but extra "
                f"'sbatch_options' asks --reservation={given[-1]}: give one of them")
        return cls(
            cluster=str(extra.get("cluster") or conn_id),
            partitions=strings(extra.get("partitions")),
            account=extra.get("account") or None,
            qos=extra.get("qos") or None,
            constraint=extra.get("constraint") or None,
            reservation=reservation,
            sbatch_options=[str(o) for o in options],
            time_limit=str(extra["time_limit"]) if extra.get("time_limit") else None,
            remote_work_dir=_under_home(str(extra.get("remote_work_dir") or
                                            "~/.airflow-skypilot")),
            price_per_gpu_hour=float(extra.get("price_per_gpu_hour") or 0.0),
            price_per_node_hour=float(extra.get("price_per_node_hour") or 0.0),
            command_timeout=_seconds(conn_id, extra, "command_timeout", 60.0),
            slurm_timeout=_seconds(conn_id, extra, "slurm_timeout", 20.0),
            upload_timeout=_seconds(conn_id, extra, "upload_timeout", 600.0),
            log_retention_days=_number(conn_id, extra, "log_retention_days", 7.0),
            step_launch_retry=_retry_seconds(conn_id, extra),
        )

    @classmethod
    def from_connection(cls, conn_id: str) -> SlurmSettings:
        """Read the Airflow connection (a blocking SDK call) and its extras."""
        from airflow_skypilot.compat import get_connection

        return cls.from_extra(conn_id, get_connection(conn_id).extra_dejson or {})

    def common_sbatch_args(self) -> list[str]:
        """The connection's options for every sbatch: account, qos, ... then its own list."""
        out = []
        for flag, value in (("--account", self.account), ("--qos", self.qos),
                            ("--constraint", self.constraint),
                            ("--reservation", self.reservation), ("--time", self.time_limit)):
            if flag == "--reservation" and self._reservation_in_options():
                continue  # given among sbatch_options (from_extra read it from there)
            if value:
                out.append(f"{flag}={value}")
        return out + list(self.sbatch_options)

    def _reservation_in_options(self) -> bool:
        return any(sbatch.canonical(o.name) == "reservation"
                   for o in sbatch.parse_tokens(self.sbatch_options))

    def owned_options(self) -> dict[str, str]:
        """The sbatch options a task may not set at this connection, with why: the ones the
        backend always owns, and every option the connection itself gives."""
        owned = dict(sbatch.BACKEND_OWNED)
        if self.constraint:
            owned["constraint"] = "the connection sets it (extra 'constraint')"
        if self.time_limit:
            owned["time"] = "the connection sets it (extra 'time_limit')"
        for opt in sbatch.parse_tokens(self.sbatch_options):
            owned.setdefault(sbatch.canonical(opt.name),
                             "the connection sets it (extra 'sbatch_options')")
        return owned

    def infra(self, partition: str | None = None) -> str:
        """``slurm/<cluster>``, or ``slurm/<cluster>/<partition>`` when a partition is given."""
        base = f"{BACKEND}/{self.cluster}"
        return base if partition is None else f"{base}/{partition}"


#: the extras that become sbatch arguments or remote paths: no control characters there
_TEXT_EXTRAS = ("cluster", "partitions", "account", "qos", "constraint", "reservation",
                "sbatch_options", "time_limit", "remote_work_dir")


def _number(conn_id: str, extra: Mapping[str, Any], name: str, default: float) -> float:
    value = extra.get(name)
    if value in (None, ""):
        return default
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigurationError(f"connection {conn_id!r}: extra {name!r} must be a number; "
                                 f"got {value!r}") from None


def _seconds(conn_id: str, extra: Mapping[str, Any], name: str, default: float) -> float:
    value = _number(conn_id, extra, name, default)
    if value <= 0:
        raise ConfigurationError(f"connection {conn_id!r}: extra {name!r} must be a number of "
                                 f"seconds above 0; got {value!r}")
    return value


def _retry_seconds(conn_id: str, extra: Mapping[str, Any]) -> float:
    """``step_launch_retry``: 0 (never launched again) up to a week (bash's arithmetic and the
    job script's deadline stay whole numbers of seconds)."""
    value = _number(conn_id, extra, "step_launch_retry", 120.0)
    if not 0 <= value <= 7 * 86400:  # also false for nan
        raise ConfigurationError(f"connection {conn_id!r}: extra 'step_launch_retry' must be "
                                 f"seconds from 0 to 604800; got {value!r}")
    return value


def _check_extras(conn_id: str, extra: Mapping[str, Any]) -> None:
    for name in _TEXT_EXTRAS:
        value = extra.get(name)
        values = value if isinstance(value, (list, tuple)) else [value]
        for item in values:
            if item is None:
                continue
            if isinstance(item, (dict, list, tuple)):
                raise ConfigurationError(f"connection {conn_id!r}: extra {name!r} must be text "
                                         f"(or a list of text); got {item!r}")
            if match := sbatch.CONTROL.search(str(item)):
                raise ConfigurationError(
                    f"connection {conn_id!r}: extra {name!r} contains the control character "
                    f"{match.group()!r}: refused (each sbatch option is one '#SBATCH' line)")


def _task_options(task: Task) -> list[sbatch.Option]:
    return sbatch.task_options((task.config.get("slurm") or {}).get("sbatch_options"))


def task_sbatch_options(task: Task) -> list[str]:
    """``config.slurm.sbatch_options`` (SkyPilot's per-task override) as directives: the
    mapping form as ``--key=value`` (``--key`` for true), the list form as given."""
    opts = (task.config.get("slurm") or {}).get("sbatch_options")
    _task_options(task)  # checked when the task was loaded; a changed task is checked again
    if isinstance(opts, dict):
        return sbatch.render(sbatch.task_options(opts))
    if isinstance(opts, list):
        return [str(o) for o in opts]
    return []


def task_conflicts(task: Task, settings: SlurmSettings) -> str:
    """Why this connection refuses the task's sbatch options ("" when it does not)."""
    try:
        options = _task_options(task)
    except sbatch.OptionError as exc:
        return f"config.slurm.sbatch_options: {exc}"
    hits = sbatch.refused(options, settings.owned_options())
    return "; ".join(f"config.slurm.sbatch_options: {message}" for _, message in hits)


def time_option(task: Task, settings: SlurmSettings) -> str | None:
    """The ``--time`` the job will be submitted with (None when none), as sbatch reads the
    directives: the task's options, then the connection's; the last one given wins."""
    try:
        options = sbatch.parse_tokens(task_sbatch_options(task) + settings.common_sbatch_args())
    except sbatch.OptionError:
        return None
    times = [o.value for o in options if sbatch.canonical(o.name) == "time" and o.value]
    return times[-1] if times else None


#: task sbatch options that do not change where or when Slurm may start the job
NEUTRAL_OPTIONS = frozenset("""
time time-min comment mail-type mail-user signal export export-file nice priority wckey
acctg-freq profile propagate get-user-env kill-on-invalid-dep quiet verbose ignore-pbs
mcs-label cpu-freq gpu-freq gpu-bind mem-bind network open-mode requeue no-requeue parsable
""".split())


def task_constraints(task: Task) -> list[str]:
    """The task's own sbatch options that may keep Slurm from starting it now where resources
    are idle (``--begin``, ``--dependency``, ``--nodelist``, ``--exclusive``...), as given."""
    try:
        options = _task_options(task)
    except sbatch.OptionError:
        return []
    return [o.given for o in options if sbatch.canonical(o.name) not in NEUTRAL_OPTIONS]


def _under_home(path: str) -> str:
    """A relative ``remote_work_dir`` is under the home (where SFTP puts it); the job script
    changes into the job dir before it names the dir again, so it must not stay relative.
    ``$HOME/x`` is ``~/x``; another user's home (``~bob``) or other variables are refused:
    the path is quoted, never expanded by a shell."""
    for home in ("$HOME", "${HOME}"):
        if path == home or path.startswith(home + "/"):
            path = "~" + path[len(home):]
    if path.startswith("~") and not (path == "~" or path.startswith("~/")) or "$" in path:
        raise ConfigurationError(f"remote_work_dir {path!r}: give an absolute path or one "
                                 "under ~/ (no other user's ~ and no variables)")
    return path if path.startswith(("/", "~")) else f"~/{path}"
