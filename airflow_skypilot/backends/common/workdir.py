"""Which local files travel to the job, and from where: one rule for every backend.

What SkyPilot's rsync leaves out of a local ``workdir`` or file-mount folder stays here too
(SFTP upload on Slurm, Secret archive on Kubernetes, user-data payload on AWS): what the
``.skyignore`` files list, or without one at the top, the ``.gitignore`` files and
``.git/info/exclude`` (:mod:`~airflow_skypilot.backends.common.ignore`). ``.git`` itself
travels, as in SkyPilot (``git`` works in the job), unless a list names it; Kubernetes leaves
every ``.git`` out (its Secret holds ~900 KiB). Relative sources start at the task YAML's
folder, not the worker's cwd; relative destinations at the job's workdir.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from airflow_skypilot.backends.common.ignore import Filter
from airflow_skypilot.spec.task import Task

log = logging.getLogger(__name__)

#: a ``.git`` with more files than this gets a note: each is a request (SFTP) or in the payload
GIT_FILES_NOTED = 2000


def walk(local: str, keep_git: bool = True) -> list[tuple[str, str, bool]]:
    """``(path, tree-relative path, is_dir)`` of everything under ``local`` that travels,
    parents before children, in a stable order (the same tree renders the same bytes).
    ``keep_git=False`` leaves every ``.git`` out as well."""
    rules = Filter(local)
    out: list[tuple[str, str, bool]] = []
    for root, dirs, files in os.walk(local):
        rel_root = os.path.relpath(root, local).replace(os.sep, "/")
        rel_root = "" if rel_root == "." else rel_root
        rules.enter(rel_root, None if not rel_root else rel_root.rpartition("/")[0])

        def rel(name: str, rel_root: str = rel_root) -> str:
            return f"{rel_root}/{name}" if rel_root else name

        def kept(name: str, is_dir: bool, rel_root: str = rel_root) -> bool:
            if not keep_git and name == ".git":
                return False
            # a link to a folder is not entered, and no folder for a dir-only pattern
            real_dir = is_dir and not os.path.islink(os.path.join(local, rel(name)))
            return not rules.left_out(rel_root, rel(name), real_dir)

        dirs[:] = sorted(d for d in dirs if kept(d, True))
        out += [(os.path.join(root, name), rel(name), True) for name in dirs]
        out += [(os.path.join(root, name), rel(name), False) for name in sorted(files)
                if kept(name, False)]
    git = sum(1 for _, rel, is_dir in out if not is_dir and rel.startswith(".git/"))
    if git > GIT_FILES_NOTED:
        log.warning("%s/.git travels with it, as in SkyPilot (%d files): list .git/ in its "
                    ".skyignore or .gitignore to leave the history behind", local, git)
    return out


def mount_word(dst: str, *, home: str, workdir: str, word: Callable[[str], str],
               root: str = "") -> str:
    """A file mount's destination as one word of a node's script, by
    :func:`mount_destination`'s rule: ``home``, ``workdir`` or ``root`` (words the script
    expands) joined to the rest, which ``word`` quotes (and writes its secrets as references)."""
    anchor, rest = mount_destination(dst)
    if anchor == "root":
        return root + word(rest)
    base = home if anchor == "home" else workdir
    return base + "/" + word(rest) if rest else base


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
    ``~/sky_workdir/../x`` does there. Every backend maps the three anchors to its own paths.

    Only the leading ``~/``, ``./`` and ``../`` are read; the rest is kept as written (no
    normalising): a secret filled into it must still be found there, to be written as a
    reference to the secret and never in clear."""
    if dst == "~" or dst.startswith("~/"):
        return "home", dst[2:].lstrip("/")
    if dst.startswith("/"):
        return "root", dst
    rest, ups = dst, 0
    while True:
        if rest in (".", "./") or rest.startswith("./"):
            rest = rest[2:].lstrip("/")
        elif rest in ("..", "../") or rest.startswith("../"):
            rest, ups = rest[3:].lstrip("/"), ups + 1
        else:
            break
    if ups:  # out of ~/sky_workdir: the home, or above it
        return "home", "../" * (ups - 1) + rest
    return "workdir", rest
