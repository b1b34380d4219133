"""``sbatch`` options as a task (``config.slurm.sbatch_options``) or a connection gives them.

Each option becomes one ``#SBATCH`` line of the job script, so a control character in it (a
newline above all) would start a shell line of its own: refused wherever the option comes from.
Which options a task may not set is decided here too: the ones the Slurm backend sets itself
(the partition the placement chose, the job's shape, its name and log paths...) and the ones the
connection pins (account, qos, reservation, and anything in its own ``sbatch_options``).

sbatch reads options as ``getopt_long`` does: a long option may be abbreviated to any unambiguous
prefix (``--part=x`` is ``--partition=x``) and short options may be bundled (``-Hpbatch``). So a
task option is matched by prefix against the owned names, and short options are expanded.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

#: C0 controls and DEL: each would break the ``#SBATCH`` line or start a new one
CONTROL = re.compile(r"[\x00-\x1f\x7f]")

#: sbatch's short options (Slurm 22.05 man page) -> long name
SHORT = {
    "A": "account", "a": "array", "B": "extra-node-info", "b": "begin", "C": "constraint",
    "c": "cpus-per-task", "D": "chdir", "d": "dependency", "e": "error", "F": "nodefile",
    "G": "gpus", "H": "hold", "h": "help", "i": "input", "J": "job-name", "k": "no-kill",
    "L": "licenses", "M": "clusters", "m": "distribution", "N": "nodes", "n": "ntasks",
    "O": "overcommit", "o": "output", "p": "partition", "Q": "quiet", "q": "qos",
    "S": "core-spec", "s": "oversubscribe", "t": "time", "u": "usage", "V": "version",
    "v": "verbose", "W": "wait", "w": "nodelist", "x": "exclude",
}
#: short options that take no argument (the rest take one)
SHORT_FLAGS = set("HhkOQsuVvW")
#: sbatch's long options (Slurm 22.05-23.11)
LONG = frozenset("""
account acctg-freq array batch bb bbf begin chdir cluster-constraint clusters comment constraint
container container-id contiguous core-spec cores-per-socket cpu-freq cpus-per-gpu
cpus-per-task deadline delay-boot dependency distribution error exclude exclusive export
export-file extra extra-node-info get-user-env gid gpu-bind gpu-freq gpus gpus-per-node
gpus-per-socket gpus-per-task gres gres-flags help hint hold ignore-pbs input job-name
kill-on-invalid-dep licenses mail-type mail-user mcs-label mem mem-bind mem-per-cpu mem-per-gpu
mincpus network nice no-kill no-requeue nodefile nodelist nodes ntasks ntasks-per-core
ntasks-per-gpu ntasks-per-node ntasks-per-socket open-mode output overcommit oversubscribe
parsable partition power prefer priority profile propagate qos quiet reboot requeue reservation
signal sockets-per-node spread-job switches test-only thread-spec threads-per-core time
time-min tmp tres-per-task uid usage use-min-nodes verbose version wait wait-all-nodes wckey
wrap
""".split())

_WHY_SHAPE = "the job's shape comes from num_nodes and resources"
#: options no task may set, with why: the backend sets them (from the placement and the task's
#: resources) or the connection owns them
BACKEND_OWNED: dict[str, str] = {
    "partition": "the placement picks the partition (infra: slurm/<cluster>/<partition>, "
                 "within the connection's 'partitions')",
    "account": "the connection owns it (extra 'account')",
    "qos": "the connection owns it (extra 'qos')",
    "reservation": "the connection owns it (extra 'reservation')",
    "clusters": "a connection is one cluster",
    "cluster-constraint": "a connection is one cluster",
    "nodes": f"{_WHY_SHAPE}: use num_nodes",
    "ntasks": f"{_WHY_SHAPE}: one task per node",
    "ntasks-per-node": f"{_WHY_SHAPE}: one task per node",
    "gres": f"{_WHY_SHAPE}: use resources.accelerators",
    "gpus": f"{_WHY_SHAPE}: use resources.accelerators",
    "gpus-per-node": f"{_WHY_SHAPE}: use resources.accelerators",
    "gpus-per-task": f"{_WHY_SHAPE}: use resources.accelerators",
    "gpus-per-socket": f"{_WHY_SHAPE}: use resources.accelerators",
    "cpus-per-task": f"{_WHY_SHAPE}: use resources.cpus",
    "mem": f"{_WHY_SHAPE}: use resources.memory",
    "mem-per-cpu": f"{_WHY_SHAPE}: use resources.memory",
    "mem-per-gpu": f"{_WHY_SHAPE}: use resources.memory",
    "array": "one job per task: an array would run several copies",
    "job-name": "the backend names the job (adoption finds it by name)",
    "output": "the backend sets the job's log file",
    "error": "the backend sets the job's log file",
    "input": "the backend runs the generated job script",
    "chdir": "the backend runs the job in its own directory",
    "open-mode": "the backend sets the job's log file",
    "requeue": "failover is the operator's (job_recovery), not Slurm's requeue",
    "no-requeue": "failover is the operator's (job_recovery), not Slurm's requeue",
    "wrap": "the backend runs the generated job script",
    "parsable": "the backend reads sbatch's answer",
    "test-only": "the backend submits the job",
    "wait": "sbatch must return at once",
    "uid": "jobs run as the connection's user",
    "gid": "jobs run as the connection's user",
    "help": "not a job option",
    "usage": "not a job option",
    "version": "not a job option",
}


@dataclass(frozen=True)
class Option:
    """One option: its long name (short ones expanded), its value, and where it was given
    (a dict key or a list index of the task's ``sbatch_options``)."""

    name: str
    value: str | None
    where: str | int
    given: str  # as written, for messages


class OptionError(ValueError):
    """An option that cannot be read, or that carries a control character."""

    def __init__(self, message: str, where: str | int | None = None):
        super().__init__(message)
        self.where = where


def _check_text(text: str, where: str | int | None, what: str) -> None:
    if match := CONTROL.search(text):
        raise OptionError(f"{what} {text!r} contains the control character "
                          f"{match.group()!r}: refused (each option is one '#SBATCH' line)",
                          where)


def parse_tokens(tokens: Iterable[Any], where_of: Any = None) -> list[Option]:
    """sbatch arguments (a list, as ``sbatch`` would get them) -> options. A token that does
    not start with ``-`` is the value of the option before it."""
    out: list[Option] = []
    pending: Option | None = None  # a long/short option whose value may be the next token
    for index, token in enumerate(tokens):
        where = where_of(index) if where_of else index
        if not isinstance(token, (str, int, float)) or isinstance(token, bool):
            raise OptionError(f"an sbatch option must be a string; got {token!r}", where)
        token = str(token)
        _check_text(token, where, "sbatch option")
        if not token.startswith("-") or token == "-":
            if pending is None:
                raise OptionError(f"{token!r} is not an option (options start with '-')", where)
            out[-1] = Option(pending.name, token, pending.where, f"{pending.given} {token}")
            pending = None
            continue
        pending = None
        if token.startswith("--"):
            name, sep, value = token[2:].partition("=")
            _check_name(name, where, token)
            out.append(Option(name, value if sep else None, where, token))
            if not sep:
                pending = out[-1]
            continue
        letters = token[1:]
        for i, letter in enumerate(letters):
            name = SHORT.get(letter)
            if name is None:
                raise OptionError(f"unknown sbatch option -{letter} in {token!r}", where)
            if letter in SHORT_FLAGS:
                out.append(Option(name, None, where, token))
                continue
            value = letters[i + 1:]
            out.append(Option(name, value or None, where, token))
            if not value:
                pending = out[-1]
            break
    return out


def _check_name(name: str, where: str | int | None, given: str) -> None:
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]*", name):
        raise OptionError(f"{given!r} is not an sbatch option name", where)


def task_options(raw: Any) -> list[Option]:
    """``config.slurm.sbatch_options``: a mapping ``{option: value | true}`` (SkyPilot's form;
    keys without dashes) or a list of arguments. Raises OptionError.

    As SkyPilot's ``_build_custom_sbatch_directives``: ``_`` in a key is ``-`` (``mail_type``
    is ``--mail-type``, so ``job_name`` is as owned as ``job-name``), and a ``false`` or
    ``null`` value emits nothing (``exclusive: false``)."""
    if raw is None:
        return []
    if isinstance(raw, Mapping):
        out = []
        for key, value in raw.items():
            given = str(key)
            _check_text(given, given, "sbatch option")
            written = given.lstrip("-")
            _check_name(written, given, given)
            if value is None or value is False:
                continue
            name = written.replace("_", "-")
            if value is True:
                out.append(Option(name, None, given, f"--{written}"))
                continue
            if isinstance(value, (dict, list)):
                raise OptionError(f"the value of {given!r} must be a string or a number, true "
                                  f"for a flag, or false/null for none; got {value!r}", given)
            text = str(value)
            _check_text(text, given, f"the value of {given!r},")
            out.append(Option(name, text, given, f"--{written}={text}"))
        return out
    if isinstance(raw, list):
        return parse_tokens(raw)
    raise OptionError(f"must be a mapping of options or a list of arguments; got {raw!r}")


def render(options: Iterable[Option]) -> list[str]:
    """One argument per option: ``--name=value``, or ``--name`` for a flag."""
    return [f"--{o.name}={o.value}" if o.value is not None else f"--{o.name}" for o in options]


def canonical(name: str) -> str:
    """The full option ``name`` stands for, as getopt_long resolves it: itself when it is an
    sbatch option, else the one option it abbreviates; unchanged when unknown or ambiguous."""
    if name in LONG:
        return name
    matches = [full for full in LONG if full.startswith(name)]
    return matches[0] if len(matches) == 1 else name


def owner_of(name: str, owned: Mapping[str, str]) -> tuple[str, str] | None:
    """(owned option, why) if option ``name`` is an owned one; None otherwise. A name that is
    not a known option (ambiguous, or newer than this list) is owned if it abbreviates one."""
    full = canonical(name)
    if full in owned:
        return full, owned[full]
    if full not in LONG:
        for candidate, why in owned.items():
            if candidate.startswith(name):
                return candidate, why
    return None


def refused(options: Iterable[Option], owned: Mapping[str, str]) -> list[tuple[Option, str]]:
    """The options among ``options`` that ``owned`` refuses, each with a message."""
    out = []
    for opt in options:
        hit = owner_of(opt.name, owned)
        if hit is None:
            continue
        full, why = hit
        alias = "" if opt.given.split("=")[0] == f"--{full}" else f" (--{full})"
        out.append((opt, f"sbatch option {opt.given!r}{alias} cannot be set by a task: {why}"))
    return out
