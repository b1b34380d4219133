"""The local workdir and file mounts as Secret entries (pure: no I/O but reading files).

Each tree or file becomes one base64 ``tar.gz`` text key of the job's ``<job>-bundle`` Secret
(a Secret, not a ConfigMap: file mounts may be credentials, and the ``view`` role reads
ConfigMaps); the pod's ``main.sh`` unpacks each at its target. What travels is
:func:`common.workdir.walk`'s rule (``.git`` and ``.skyignore`` left out), from
:func:`common.workdir.local_source`. A Secret holds at most 1 MiB, so a bundle over
:data:`DEFAULT_BUNDLE_LIMIT` is refused
(:class:`BundleTooLarge`): the placement table says so and nothing is submitted.
"""

from __future__ import annotations

import base64
import io
import os
import tarfile
from collections.abc import Mapping
from dataclasses import dataclass, field

from airflow_skypilot.backends.common.jobscript import node_word
from airflow_skypilot.backends.common.workdir import local_source, mount_word, walk
from airflow_skypilot.spec.fill import masked
from airflow_skypilot.spec.task import Task

#: the bundle Secret's payload limit (the API server refuses objects over 1 MiB in all)
DEFAULT_BUNDLE_LIMIT = 900 * 1024
#: stop reading a workdir once this many raw bytes were seen (it cannot compress that well)
_RAW_FACTOR = 64


class BundleTooLarge(ValueError):
    """The workdir and file mounts do not fit in one Secret."""


@dataclass
class Bundle:
    """Secret keys (base64 tar.gz text) and where main.sh unpacks each."""

    data: dict[str, str] = field(default_factory=dict)
    targets: list[tuple[str, str]] = field(default_factory=list)  # (key, shell word of dir)

    @property
    def size(self) -> int:
        return sum(len(v) for v in self.data.values())


def _root_owned(info: tarfile.TarInfo) -> tarfile.TarInfo:
    """Files unpack as the pod's user, whatever uid the Airflow worker has."""
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


def _tar_b64(entries: list[tuple[str, str]], raw_limit: int) -> str:
    """(local path, name in the archive) pairs -> base64 of a tar.gz; bounded reading."""
    raw = 0
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
        for path, arcname in entries:
            if os.path.isfile(path) and not os.path.islink(path):
                raw += os.path.getsize(path)
                if raw > raw_limit:
                    raise BundleTooLarge(f"more than {raw_limit // 1024} KiB of files")
            tar.add(path, arcname=arcname, recursive=False, filter=_root_owned)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _tree(local: str) -> list[tuple[str, str]]:
    """Every file and directory under ``local`` that travels, archive-relative."""
    # no .git: the Secret holds ~900 KiB packed, and a repository's history rarely fits
    return [(path, rel) for path, rel, _ in walk(local, keep_git=False)]


#: main.sh's variable holding the job's workdir (the pod's cwd during setup and run)
WORKDIR_WORD = '"$AIRFLOW_SKYPILOT_WORKDIR"'


def _dest_dir_word(dst: str, secrets: Mapping[str, str]) -> str:
    """A bash word for a file mount's destination directory inside the pod (main.sh, in the
    ConfigMap: a secret filled into it is a reference to the pod's env from the Secret), by
    :func:`mount_destination`'s rule (``""``: the workdir itself)."""
    return mount_word(dst, home='"$HOME"', workdir=WORKDIR_WORD, root='"$AIRFLOW_SKYPILOT_ROOT"',
                      word=lambda text: node_word(text, secrets))


def bundle(task: Task, limit: int = DEFAULT_BUNDLE_LIMIT) -> Bundle:
    """The local workdir and file mounts as Secret entries; raises BundleTooLarge."""
    out = Bundle()
    raw_limit = limit * _RAW_FACTOR
    workdir = task.resolved_workdir()
    if workdir:
        if not os.path.isdir(workdir):
            raise BundleTooLarge(f"workdir {workdir} is not a directory")
        out.data["workdir.tgz.b64"] = _tar_b64(_tree(workdir), raw_limit)
        out.targets.append(("workdir.tgz.b64", WORKDIR_WORD))  # first: mounts go over it
    for i, (dst, src) in enumerate(sorted(task.file_mounts.items())):
        path = local_source(task, src)
        key = f"mount-{i}.tgz.b64"
        if os.path.isdir(path):
            out.data[key] = _tar_b64(_tree(path), raw_limit)
            out.targets.append((key, _dest_dir_word(dst.rstrip("/") or "/", task.secrets)))
        elif os.path.isfile(path):
            # a source given as a link is the file it points to, as SkyPilot resolves a source
            # before its rsync (a link would dangle in the pod)
            out.data[key] = _tar_b64([(os.path.realpath(path), os.path.basename(dst.rstrip("/")))],
                                     raw_limit)
            # "" (a file right in the workdir) for a relative one, "/" for one at the root
            parent = os.path.dirname(dst.rstrip("/")) or ("/" if dst.startswith("/") else "")
            out.targets.append((key, _dest_dir_word(parent, task.secrets)))
        else:
            raise BundleTooLarge(masked(f"file_mounts {dst}: {src} does not exist",
                                        task.secrets.values()))
        if out.size > limit:
            break
    if out.size > limit:
        raise BundleTooLarge(
            f"workdir and file_mounts are {out.size // 1024} KiB once packed; a Secret "
            f"takes at most {limit // 1024} KiB")
    return out


def check(task: Task, limit: int) -> str:
    """Why the task's files cannot travel ("" when they can, or when there are none)."""
    if not (task.workdir or task.file_mounts):
        return ""
    try:
        bundle(task, limit)
    except BundleTooLarge as exc:
        return str(exc)
    except OSError as exc:
        return f"cannot read the workdir or file_mounts: {exc}"
    return ""
