"""Which local files travel to the job, and from where: one rule for every backend.

What SkyPilot's rsync leaves out of a local ``workdir`` or file-mount directory stays here too
(SFTP upload on Slurm, Secret archive on Kubernetes, user-data payload on AWS): with a
``.skyignore`` at the tree's top, what the ``.skyignore`` files list; without one, what the
``.gitignore`` files list and ``.git/info/exclude`` (SkyPilot's ``--filter='dir-merge,-
.gitignore'`` and ``--exclude-from``). ``.git`` itself travels, as in SkyPilot (``git`` works in
the job), unless a list names it; Kubernetes leaves it out (its Secret holds ~900 KiB).

Patterns are rsync's, which differ from git's (SkyPilot issue #3298): a file's patterns apply
from its own folder down; ``/x`` is anchored there; ``x/`` names directories only; a pattern
with a ``/`` inside or ``**`` matches the end of the path at any depth (``data/*`` leaves out
``src/data/a.py``), one without only the last component; ``*`` and ``?`` do not cross ``/``,
``**`` does, ``x/***`` is ``x`` and all in it. A left-out directory is not entered. Lines that
are empty or start with ``#`` are skipped, and so are git's negations (``!x``: rsync reads them
as a file named ``!x``). Relative sources start at the task YAML's folder, not the worker's cwd.
"""

from __future__ import annotations

import os
import posixpath
import re
from dataclasses import dataclass

from airflow_skypilot.spec.task import Task

SKYIGNORE = ".skyignore"
GITIGNORE = ".gitignore"


@dataclass(frozen=True)
class Rule:
    """One exclude pattern, anchored at ``base`` (its file's folder, tree-relative, "" = top)."""

    base: str
    regex: re.Pattern[str]
    anchored: bool  # matched against the whole path below ``base``
    whole_path: bool  # has a "/" inside or "**": the end of the path, at any depth
    dir_only: bool

    def matches(self, rel: str, is_dir: bool) -> bool:
        if self.dir_only and not is_dir:
            return False
        if self.base:
            if not rel.startswith(self.base + "/"):
                return False
            rel = rel[len(self.base) + 1:]
        if self.anchored:
            return bool(self.regex.fullmatch(rel))
        if not self.whole_path:
            return bool(self.regex.fullmatch(rel.rsplit("/", 1)[-1]))
        parts = rel.split("/")
        return any(self.regex.fullmatch("/".join(parts[i:])) for i in range(len(parts)))


def _glob_regex(glob: str) -> str:
    """rsync's wildcards: ``**`` any text, ``*`` and ``?`` within one component, ``[...]``."""
    out, i = [], 0
    while i < len(glob):
        c = glob[i]
        if glob.startswith("**", i):
            out.append(".*")
            i += 2
            while i < len(glob) and glob[i] == "*":
                i += 1
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[" and (end := glob.find("]", i + 2)) != -1:
            body = glob[i + 1:end]
            body = "^" + body[1:] if body.startswith("!") else body
            out.append("[" + body.replace("\\", "\\\\") + "]")
            i = end
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


def parse_rules(text: str, base: str = "") -> list[Rule]:
    """The exclude rules of one ignore file whose folder is ``base`` (tree-relative)."""
    rules = []
    for line in text.splitlines():
        pattern = line.strip()
        if not pattern or pattern.startswith(("#", "!")):
            continue
        dir_only = pattern.endswith("/")
        pattern = pattern.rstrip("/")
        anchored = pattern.startswith("/")
        pattern = pattern.lstrip("/")
        if not pattern:
            continue
        if pattern.endswith("/***"):  # the folder and everything in it
            regex = _glob_regex(pattern[:-4]) + "(?:/.*)?"
        else:
            regex = _glob_regex(pattern)
        rules.append(Rule(base, re.compile(regex, re.S), anchored,
                          "/" in pattern or "**" in pattern, dir_only))
    return rules


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return ""


def ignore_file(root: str) -> str:
    """The name of the ignore files that count in the tree ``root`` (SkyPilot's choice)."""
    return SKYIGNORE if os.path.isfile(os.path.join(root, SKYIGNORE)) else GITIGNORE


def top_rules(root: str) -> list[Rule]:
    """What counts everywhere in the tree: without a .skyignore, ``.git/info/exclude``."""
    if ignore_file(root) == SKYIGNORE:
        return []
    return parse_rules(_read(os.path.join(root, ".git", "info", "exclude")))


def walk(local: str, keep_git: bool = True) -> list[tuple[str, str, bool]]:
    """``(path, tree-relative path, is_dir)`` of everything under ``local`` that travels,
    parents before children, in a stable order (the same tree renders the same bytes).
    ``keep_git=False`` leaves ``.git`` out as well."""
    name = ignore_file(local)
    rules: dict[str, list[Rule]] = {"": top_rules(local)}
    out: list[tuple[str, str, bool]] = []
    for root, dirs, files in os.walk(local):
        rel_root = os.path.relpath(root, local).replace(os.sep, "/")
        rel_root = "" if rel_root == "." else rel_root
        parent = rules[rel_root] if rel_root in rules else []
        mine = parent + parse_rules(_read(os.path.join(root, name)), rel_root)

        def kept(rel: str, is_dir: bool, mine: list[Rule] = mine) -> bool:
            if not keep_git and rel.split("/", 1)[0] == ".git":
                return False
            return not any(rule.matches(rel, is_dir) for rule in mine)

        def rel_of(entry: str, rel_root: str = rel_root) -> str:
            return f"{rel_root}/{entry}" if rel_root else entry

        dirs[:] = sorted(d for d in dirs if kept(rel_of(d), True))
        for d in dirs:
            rules[rel_of(d)] = mine
            out.append((os.path.join(root, d), rel_of(d), True))
        for f in sorted(files):
            if kept(rel_of(f), os.path.isdir(os.path.join(root, f))):
                out.append((os.path.join(root, f), rel_of(f), False))
    return out


def local_source(task: Task, src: str) -> str:
    """A local workdir or file-mount source as an absolute path (``~`` expanded; relative
    paths start at the task file's folder)."""
    path = os.path.expanduser(str(src))
    if not os.path.isabs(path) and task.base_dir:
        path = os.path.join(task.base_dir, path)
    return os.path.normpath(path)


def mount_destination(dst: str) -> tuple[str, str]:
    """Where a file mount's destination lands, as SkyPilot reads it: ``("home", rest)`` for
    ``~`` and ``~/rest``, ``("root", dst)`` for an absolute path, else ``("workdir", rest)``
    (``rest`` "" for the workdir itself): SkyPilot puts a relative destination under its
    workdir ``~/sky_workdir``, so one that climbs out of it (``../x``) lands in the home, as
    ``~/sky_workdir/../x`` does there. Every backend maps the three anchors to its own paths."""
    if dst == "~" or dst.startswith("~/"):
        rest = posixpath.normpath(dst[2:] or ".").lstrip("/")
        return "home", "" if rest == "." else rest
    if dst.startswith("/"):
        return "root", dst
    rel = posixpath.normpath(dst)
    if rel == "..":
        return "home", ""
    if rel.startswith("../"):
        return "home", posixpath.normpath("sky_workdir/" + rel)
    return "workdir", "" if rel == "." else rel
