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
    except (TypeError, ValueError):
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
