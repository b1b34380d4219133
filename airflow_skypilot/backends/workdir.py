"""Which files of a local ``workdir`` or file mount travel to the job: all of them but ``.git``
and what the tree's ``.skyignore`` lists, as SkyPilot does. One rule for every backend (SFTP
upload on Slurm, ConfigMap archive on Kubernetes, user-data payload on AWS)."""

from __future__ import annotations

import fnmatch
import os


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
