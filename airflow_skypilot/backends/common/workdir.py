"""Which local files travel to the job, and from where: one rule for every backend.

All of a local ``workdir`` or file mount goes, but ``.git`` and what the tree's ``.skyignore``
lists, as SkyPilot does (SFTP upload on Slurm, ConfigMap archive on Kubernetes, user-data
payload on AWS). Relative sources start at the task YAML's folder, not the worker's cwd.
"""

from __future__ import annotations

import fnmatch
import os
import posixpath

from airflow_skypilot.spec.task import Task


def ignore_patterns(root: str) -> list[str]:
    """``.git`` plus the non-comment lines of ``root/.skyignore``."""
    patterns = [".git"]
    path = os.path.join(root, ".skyignore")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as fh:
            patterns += [ln.strip() for ln in fh if ln.strip() and not ln.startswith("#")]
    return patterns


def is_ignored(rel: str, patterns: list[str]) -> bool:
    """Does a pattern match the tree-relative path ``rel`` or its last component?"""
    name = os.path.basename(rel)
    return any(fnmatch.fnmatch(rel, p.strip("/")) or fnmatch.fnmatch(name, p.strip("/"))
               for p in patterns)


def walk(local: str) -> list[tuple[str, str, bool]]:
    """``(path, tree-relative path, is_dir)`` of everything under ``local`` that travels,
    parents before children, in a stable order (the same tree renders the same bytes)."""
    patterns = ignore_patterns(local)
    out: list[tuple[str, str, bool]] = []
    for root, dirs, files in os.walk(local):
        rel_root = os.path.relpath(root, local)
        dirs[:] = sorted(d for d in dirs
                         if not is_ignored(os.path.normpath(os.path.join(rel_root, d)), patterns))
        for name in dirs:
            out.append((os.path.join(root, name), os.path.normpath(os.path.join(rel_root, name)),
                        True))
        for name in sorted(files):
            rel = os.path.normpath(os.path.join(rel_root, name))
            if not is_ignored(rel, patterns):
                out.append((os.path.join(root, name), rel, False))
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
