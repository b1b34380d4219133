"""What a job's upload sends, and where: planned here, applied by :meth:`SSHRunner.upload`.

The plan is a list of :mod:`~airflow_skypilot.backends.slurm.remote` steps, parents first and
with no remote I/O: the job dir (0700) and its files, the local workdir into ``workdir/``, then
the local file mounts at their targets, in SkyPilot's order (a mount under the workdir is not
overwritten by it). A tree is what :func:`~airflow_skypilot.backends.common.workdir.walk` says
travels, as SkyPilot's ``rsync -a`` sends it: folders made (0755), files copied with their
modes, and a symbolic link made as a link with the same target text (:class:`MakeLink`), never
followed: a link to a folder is not a copy of the folder, a link to a big file not a copy of
it, and a dangling link is not an error.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Mapping

from airflow_skypilot.backends.common.workdir import Link, local_source, mount_destination, walk
from airflow_skypilot.backends.slurm.remote import (
    Chmod,
    MakeDirs,
    MakeLink,
    PutFile,
    UploadStep,
    WriteFile,
)
from airflow_skypilot.spec.task import Task


def tree(local: str, remote: str) -> list[UploadStep]:
    """A local tree (what :func:`walk` says travels), parents first, file modes kept, links
    as links."""
    steps: list[UploadStep] = [MakeDirs(remote, 0o755)]
    for entry in walk(local):
        target = f"{remote}/{entry.rel}"
        if isinstance(entry, Link):
            steps.append(MakeLink(entry.target, target))
        else:
            steps.append(MakeDirs(target, 0o755, in_tree=True) if entry.is_dir
                         else PutFile(entry.path, target))
    return steps


def mount_target(dst: str, home: str, workdir: str) -> str:
    """Where a file mount lands, as an absolute path (:func:`mount_destination`'s rule: the
    home, the root, or the job's ``workdir``, its cwd during setup and run)."""
    anchor, rest = mount_destination(dst)
    if anchor == "root":
        return rest
    base = home if anchor == "home" else workdir
    return posixpath.normpath(f"{base}/{rest}") if rest else base


def upload_plan(task: Task, job_dir: str, files: Mapping[str, tuple[str, int]],
                home: str) -> list[UploadStep]:
    """The job dir and its files, the local workdir into ``workdir/``, then the local file
    mounts at their targets (``~`` is ``home``; a relative one is under ``workdir/``, made
    whether or not the task has a workdir). SkyPilot's order: the workdir first, then the
    mounts, so a mount under the workdir is never overwritten by it."""
    steps: list[UploadStep] = [MakeDirs(job_dir, 0o700), Chmod(job_dir, 0o700)]
    steps += [WriteFile(f"{job_dir}/{name}", content, mode)
              for name, (content, mode) in files.items()]
    workdir = f"{job_dir}/workdir"
    steps.append(MakeDirs(workdir, 0o700))
    if isinstance(task.workdir, str):
        steps += tree(local_source(task, task.workdir), workdir)
    for dst, src in task.file_mounts.items():
        if isinstance(src, str) and "://" not in src:
            local = local_source(task, src)
            target = mount_target(dst, home, workdir)
            if os.path.isdir(local):
                steps += tree(local, target)
            else:
                steps += [MakeDirs(os.path.dirname(target) or "/", 0o755),
                          PutFile(local, target)]
    return steps
