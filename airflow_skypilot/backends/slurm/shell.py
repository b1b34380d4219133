"""Conventions shared by every script the Slurm backend runs on the login node.

Each script is bash sent on stdin (never on a command line) and prints its answers in ``@@name``
sections, so one SSH round trip can answer several questions and a missing section says which
part did not run. Remote paths may start with ``~``: a script writes them as ``"$HOME"/'rest'``;
SFTP, which has no shell, gets them made absolute with the login node's ``$HOME``.
"""

from __future__ import annotations

import shlex


def parse_sections(output: str) -> dict[str, list[str]]:
    """Split ``@@name`` headed sections of a script's output (blank lines dropped)."""
    sections: dict[str, list[str]] = {}
    current = None
    for line in output.splitlines():
        if line.startswith("@@"):
            current = line[2:].strip()
            sections.setdefault(current, [])
        elif current is not None and line.strip():
            sections[current].append(line)
    return sections


def parse_int(text: str, default: int = 0) -> int:
    """An integer from Slurm's text (``"8"``, ``"8.0"``); ``default`` when there is none."""
    try:
        return int(float(text))
    except (TypeError, ValueError, OverflowError):  # OverflowError: "inf"
        return default


def remote_dir_expr(path: str) -> str:
    """A shell word for a remote path that may start with ``~/``: ``"$HOME"/'rest'``."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        return '"$HOME"/' + shlex.quote(path[2:])
    return shlex.quote(path)


def abs_remote(path: str, home: str) -> str:
    """A remote path with a leading ``~`` replaced by ``home`` (for SFTP)."""
    if path == "~":
        return home
    if path.startswith("~/"):
        return f"{home.rstrip('/')}/{path[2:]}"
    return path


#: exit statuses of a command the ``bounded`` prelude stopped (``timeout``: 124; SIGKILL: 137)
TIMED_OUT = (124, 137)
#: what Slurm's client commands print when slurmctld (or slurmdbd) did not answer
_NO_ANSWER = ("socket timed out", "unable to contact slurm controller", "connection refused",
              "connect failure", "zero bytes were transmitted", "communication connection failure",
              "slurm_persist_conn_open", "unable to establish connection", "not responding",
              "timed out")
#: the same, public: the submit script tells a refusal from no answer with it
NO_ANSWER = _NO_ANSWER


def bounded(seconds: float) -> str:
    """A script prelude defining ``_t CMD ARGS...``: CMD for at most ``seconds``, then SIGTERM
    (SIGKILL 5 s later), exit 124. A paused or overloaded slurmctld makes ``squeue`` wait much
    longer than that (MessageTimeout, retries): "did not answer in time" is "could not ask",
    and the script goes on to say so. Where coreutils' ``timeout`` is missing, CMD runs as is
    (the SSH command's own timeout still bounds it)."""
    limit = max(1, int(seconds + 0.999))
    return "\n".join([
        "if command -v timeout >/dev/null 2>&1; then",
        f"  _t() {{ timeout -k 5 {limit} \"$@\"; }}",
        "else",
        '  _t() { "$@"; }',
        "fi",
    ])


def rc_line(name: str) -> str:
    """A script line printing the last command's exit status as section ``@@<name>_rc``."""
    return f'printf "@@{name}_rc\\n%s\\n" "$?"'


def section_rc(sections: dict[str, list[str]], name: str) -> int | None:
    """The exit status a :func:`rc_line` printed (None: the line never ran)."""
    lines = sections.get(f"{name}_rc") or []
    try:
        return int(lines[0].strip()) if lines else None
    except ValueError:
        return None


def no_answer(rc: int | None, text: str) -> bool:
    """Did a Slurm command fail because the controller did not answer (or in time), so that
    what it was asked may or may not have happened?"""
    return rc in TIMED_OUT or any(s in text.lower() for s in _NO_ANSWER)
