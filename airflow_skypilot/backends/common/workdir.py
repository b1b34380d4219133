"""Which local files travel to the job, and from where: one rule for every backend.

What SkyPilot's rsync leaves out of a local ``workdir`` or file-mount folder stays here too
(SFTP upload on Slurm, Secret archive on Kubernetes, user-data payload on AWS): what the
``.skyignore`` files list, or without one at the top, the ``.gitignore`` files and
``.git/info/exclude`` (:mod:`~airflow_skypilot.backends.common.ignore`). ``.git`` itself
travels, as in SkyPilot (``git`` works in the job), unless a list names it; Kubernetes leaves
every ``.git`` out (its Secret holds ~900 KiB). Relative sources start at the task YAML's
folder, not the worker's cwd; relative destinations at the job's workdir.

A symbolic link travels as a link, as rsync ``-a`` (``-l``) sends it: its target text as
written (relative or absolute, inside the tree or not, dangling or not), never followed. It is
a :class:`Link` entry of :func:`walk`, left out by name as a file is (for rsync a link to a
folder is not a folder: ``x/`` does not name it), and nothing under it is listed.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable
from typing import NamedTuple

from airflow_skypilot.backends.common.ignore import Filter
from airflow_skypilot.spec.task import Task

log = logging.getLogger(__name__)

#: a ``.git`` with more files than this gets a note: each is a request (SFTP) or in the payload
GIT_FILES_NOTED = 2000


class Entry(NamedTuple):
    """One thing of a tree that travels: its local path, its tree-relative path ("/"-joined),
    and whether it is a folder (one made there, its own entries listed after it)."""

    path: str
    rel: str
    is_dir: bool


class Link(Entry):
    """A symbolic link (to a file, a folder, or nothing): made as a link with ``target``, the
    text :func:`os.readlink` gives. Never a folder: ``is_dir`` is False."""

    target: str

    def __new__(cls, path: str, rel: str, target: str) -> Link:
        self = super().__new__(cls, path, rel, False)
        self.target = target  # the text as it was when walked: what is sent is what was read
        return self

    def __getnewargs__(self) -> tuple[str, str, str]:  # a copy (pickle, copy) keeps the target
        return self.path, self.rel, self.target

    def __repr__(self) -> str:
        return f"Link(path={self.path!r}, rel={self.rel!r}, target={self.target!r})"


def walk(local: str, keep_git: bool = True) -> list[Entry]:
    """``(path, tree-relative path, is_dir)`` of everything under ``local`` that travels,
    parents before children, in a stable order (the same tree renders the same bytes); a
    symbolic link is a :class:`Link`. ``keep_git=False`` leaves every ``.git`` out as well."""
    rules = Filter(local)
    out: list[Entry] = []
    for root, dirs, files in os.walk(local):
        rel_root = os.path.relpath(root, local).replace(os.sep, "/")
        rel_root = "" if rel_root == "." else rel_root
        rules.enter(rel_root, None if not rel_root else rel_root.rpartition("/")[0])

        def rel(name: str, rel_root: str = rel_root) -> str:
            return f"{rel_root}/{name}" if rel_root else name

        def kept(name: str, is_dir: bool, rel_root: str = rel_root) -> bool:
            if not keep_git and name == ".git":
                return False
            return not rules.left_out(rel_root, rel(name), is_dir)

        # os.walk lists a link to a folder among the folders (not entering it), any other
        # link (to a file, dangling) among the files: each is a link, matched by the rules
        # as rsync matches a link, as a non-directory
        links = {name for name in (*dirs, *files) if os.path.islink(os.path.join(root, name))}
        dirs[:] = sorted(d for d in dirs if d not in links and kept(d, True))
        out += [Entry(os.path.join(root, name), rel(name), True) for name in dirs]
        for name in sorted({*files, *links}):
            if kept(name, False):
                path = os.path.join(root, name)
                if name in links:
                    out.append(Link(path, rel(name), os.readlink(path)))
                elif _special(path):
                    # a FIFO, socket or device: rsync -a makes one there, nothing here can
                    # (SFTP has no mkfifo), and reading a FIFO to send it blocks for ever
                    log.warning("%s/%s is not a file, folder or link: left behind", local,
                                rel(name))
                else:
                    out.append(Entry(path, rel(name), False))
    git = sum(1 for _, rel, is_dir in out if not is_dir and rel.startswith(".git/"))
    if git > GIT_FILES_NOTED:
        log.warning("%s/.git travels with it, as in SkyPilot (%d files): list .git/ in its "
                    ".skyignore or .gitignore to leave the history behind", local, git)
    return out


def _special(path: str) -> bool:
    try:
        return not stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:  # gone since it was listed: left to the reader to say so
        return False


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
