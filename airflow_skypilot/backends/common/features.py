"""Task features a backend may not support, declared once per backend class.

As SkyPilot's ``CloudImplementationFeatures`` / ``_CLOUD_UNSUPPORTED_FEATURES``: what a task
candidate needs is worked out here, once, from the task; each backend class only declares the
features it lacks and why (``Backend.unsupported_features``). The placement table then shows
that reason as the candidate's "does not fit" at that backend, and nothing is submitted.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum

from airflow_skypilot.spec.fill import masked
from airflow_skypilot.spec.task import ResourceRequest, Task


class Feature(str, Enum):
    """Something a task candidate may need from the place it runs."""

    SPOT = "spot"  # resources.use_spot
    INSTANCE_TYPE = "instance_type"  # a cloud VM type, e.g. p4d.24xlarge
    DOCKER_IMAGE = "docker_image"  # image_id: docker:<image>
    MACHINE_IMAGE = "machine_image"  # image_id that is not a container (an AMI, a VM image)
    FRACTIONAL_GPUS = "fractional_gpus"  # T4:0.5
    GIT_WORKDIR = "git_workdir"  # workdir: {url, ref}
    STORAGE_MOUNTS = "storage_mounts"  # file_mounts whose value is a storage spec (dict)
    S3_MOUNTS = "s3_mounts"  # file_mounts from s3://
    OTHER_BUCKET_MOUNTS = "other_bucket_mounts"  # file_mounts from gs://, r2://, https://...
    VOLUMES = "volumes"  # volumes: {path: name}
    INLINE_VOLUMES = "inline_volumes"  # volumes whose value is a spec, not a claim's name


def required(task: Task, req: ResourceRequest) -> dict[Feature, str]:
    """The features candidate ``req`` of ``task`` needs, each with the task text that needs
    it (used in the "does not fit" reason)."""
    out: dict[Feature, str] = {}
    if req.use_spot:
        out[Feature.SPOT] = "use_spot: true"
    if req.instance_type:
        out[Feature.INSTANCE_TYPE] = f"instance_type {req.instance_type}"
    if req.container_image:
        out[Feature.DOCKER_IMAGE] = f"image_id docker:{req.container_image}"
    elif req.image_id:
        out[Feature.MACHINE_IMAGE] = f"image_id {req.image_id}"
    if req.accelerator and not float(req.accelerator_count).is_integer():
        out[Feature.FRACTIONAL_GPUS] = f"{req.accelerator}:{req.accelerator_count}"
    if isinstance(task.workdir, dict):
        out[Feature.GIT_WORKDIR] = "workdir from git"
    # The reason reaches the placement table (XCom, the UI): a mount's source may carry a
    # secret filled in from the task (https://user:${TOKEN}@host/...), so only its scheme is
    # named, and a secret filled into a path is masked.
    for dst, src in task.file_mounts.items():
        where = f"file_mounts {_masked(dst, task)}"
        if not isinstance(src, str):
            out.setdefault(Feature.STORAGE_MOUNTS, where)
        elif src.startswith("s3://"):
            out.setdefault(Feature.S3_MOUNTS, f"{where} (s3://...)")
        elif "://" in src:
            scheme = src.split("://", 1)[0]
            out.setdefault(Feature.OTHER_BUCKET_MOUNTS, f"{where} ({_masked(scheme, task)}://...)")
    for path, volume in task.volumes.items():
        out.setdefault(Feature.VOLUMES, f"volumes {_masked(path, task)}")
        if not isinstance(volume, str):
            out.setdefault(Feature.INLINE_VOLUMES, f"volumes {_masked(path, task)}")
    return out


def _masked(text: object, task: Task) -> str:
    """``text`` with every secret value of ``task`` replaced by ``***``."""
    return masked(str(text), task.secrets.values())


def unsupported_reason(unsupported: Mapping[Feature, str], task: Task,
                       req: ResourceRequest) -> str:
    """Why a backend that lacks ``unsupported`` cannot run the candidate ("" when it can)."""
    for feature, what in required(task, req).items():
        if feature in unsupported:
            return f"{what}: {unsupported[feature]}"
    return ""
