"""Pydantic models of SkyPilot's task YAML (SkyPilot 0.14's schema, sky/utils/schemas.py).

Every key SkyPilot accepts is accepted here, so a user's YAML loads unchanged; unknown keys
are errors (with a "did you mean"). Fields with a text syntax are parsed by
:mod:`airflow_skypilot.spec.fields`; their errors become pydantic errors at the field's path.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from airflow_skypilot.spec import fields as f

_ENV_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


def _wrap(parser, value: Any, **kwargs: Any) -> Any:
    try:
        return parser(value, **kwargs)
    except f.FieldError as exc:
        raise PydanticCustomError("skypilot", str(exc)) from None


_PARSERS = {
    "infra": f.parse_infra,
    "cpus": f.parse_cpus,
    "memory": f.parse_memory,
    "job_recovery": f.parse_job_recovery,
    "disk_size": f.parse_disk_size,
    "ephemeral_storage": f.parse_disk_size,
    "disk_tier": lambda v: f.parse_choice(v, f.DISK_TIERS, "disk tier"),
    "network_tier": lambda v: f.parse_choice(v, f.NETWORK_TIERS, "network tier"),
    "ports": f.parse_ports,
    "labels": f.parse_labels,
    "image_id": f.parse_image_id,
    "autostop": f.parse_autostop,
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True, frozen=False)


class ResourceFields(_Strict):
    """Fields of one resource request (an ``any_of``/``ordered`` entry, or the base)."""

    cloud: str | None = None
    region: str | None = None
    zone: str | None = None
    infra: str | None = None
    cpus: Any = None
    memory: Any = None
    accelerators: Any = None
    instance_type: str | None = None
    use_spot: bool | None = None
    job_recovery: Any = None
    volumes: list[dict[str, Any]] | None = None
    disk_size: Any = None
    ephemeral_storage: Any = None
    disk_tier: str | None = None
    network_tier: str | None = None
    local_disk: str | None = None
    max_hourly_cost: float | None = None
    ports: Any = None
    labels: Any = None
    accelerator_args: dict[str, Any] | None = None
    image_id: Any = None
    autostop: Any = None
    priority: int | None = Field(default=None, ge=-1000, le=1000)
    priority_class: str | None = None
    no_missing_accel_warnings: bool | None = Field(default=None,
                                                   alias="_no_missing_accel_warnings")
    docker_login_config: dict[str, Any] | None = Field(default=None,
                                                       alias="_docker_login_config")
    is_image_managed: bool | None = Field(default=None, alias="_is_image_managed")
    requires_fuse: bool | None = Field(default=None, alias="_requires_fuse")
    cluster_config_overrides: dict[str, Any] | None = Field(
        default=None, alias="_cluster_config_overrides")

    single_accelerator: ClassVar[bool] = True

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, data: Any) -> Any:
        # SkyPilot's RESOURCE_CONFIG_ALIASES: ``gpus`` is ``accelerators``.
        if isinstance(data, dict) and "gpus" in data:
            if "accelerators" in data:
                raise PydanticCustomError("skypilot", "cannot give both 'gpus' and 'accelerators'")
            data = dict(data)
            data["accelerators"] = data.pop("gpus")
        return data

    @field_validator("cloud", mode="before")
    @classmethod
    def _cloud(cls, v: Any) -> Any:
        if isinstance(v, str) and v.lower() not in (*f.ALL_CLOUDS, "k8s"):
            raise PydanticCustomError("skypilot", f"unknown cloud {v!r}")
        return v

    @field_validator("infra", "cpus", "memory", "accelerators", "job_recovery", "disk_size",
                     "ephemeral_storage", "disk_tier", "network_tier", "ports", "labels",
                     "image_id", "autostop", mode="before")
    @classmethod
    def _parse(cls, v: Any, info: ValidationInfo) -> Any:
        """Fields with a text syntax of their own: parsed by :mod:`fields`, None stays None."""
        if v is None and info.field_name not in ("ports", "autostop", "image_id"):
            return None
        if info.field_name == "accelerators":
            return _wrap(f.parse_accelerators, v, single=cls.single_accelerator)
        return _wrap(_PARSERS[info.field_name], v)

    @field_validator("max_hourly_cost", mode="before")
    @classmethod
    def _max_cost(cls, v: Any) -> Any:
        if isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if isinstance(v, float) and v <= 0:
            raise PydanticCustomError("skypilot", "must be greater than 0")
        return v

    @model_validator(mode="after")
    def _legacy_location(self) -> ResourceFields:
        legacy = (self.cloud, self.region, self.zone)
        if self.infra is not None and any(x is not None for x in legacy):
            raise PydanticCustomError(
                "skypilot", "give either 'infra' or the older 'cloud'/'region'/'zone', not both")
        return self


class ResourceOverride(ResourceFields):
    """One entry of ``any_of``/``ordered``: overrides the base fields; one accelerator only."""


class ResourcesSpec(ResourceFields):
    """The ``resources:`` section: base fields plus ``any_of`` or ``ordered`` candidates."""

    single_accelerator: ClassVar[bool] = False

    any_of: list[ResourceOverride] | None = None
    ordered: list[ResourceOverride] | None = None

    @model_validator(mode="after")
    def _candidates(self) -> ResourcesSpec:
        if self.any_of is not None and self.ordered is not None:
            raise PydanticCustomError("skypilot", "give either 'any_of' or 'ordered', not both")
        if self.accelerators is not None:
            pairs, kind = self.accelerators
            if len(pairs) > 1 and self.ordered is not None:
                raise PydanticCustomError(
                    "skypilot", "cannot give several 'accelerators' together with 'ordered'")
            if len(pairs) > 1 and self.any_of is not None and kind == "ordered":
                raise PydanticCustomError(
                    "skypilot", "cannot give an ordered list of 'accelerators' with 'any_of'")
        for name in ("any_of", "ordered"):
            if getattr(self, name) == []:
                raise PydanticCustomError("skypilot", f"'{name}' must list at least one entry")
        return self


class WorkdirGit(_Strict):
    url: str
    ref: str | None = None


class TaskSpec(_Strict):
    """A SkyPilot task YAML (one document)."""

    name: str | None = None
    workdir: Any = None
    event_callback: str | None = None
    num_nodes: int | None = None
    resources: ResourcesSpec | None = None
    file_mounts: dict[str, Any] | None = None
    service: dict[str, Any] | None = None
    pool: dict[str, Any] | None = None
    setup: str | None = None
    run: str | None = None
    envs: dict[str, Any] | None = None
    secrets: Any = None
    managed_secrets: list[Any] | None = None
    inputs: dict[str, Any] | None = None
    outputs: dict[str, Any] | None = None
    file_mounts_mapping: dict[str, Any] | None = None
    config: dict[str, Any] | None = None
    volumes: dict[str, Any] | None = None
    volume_mounts: list[Any] | None = None
    api_server_access: bool | None = None
    metadata: dict[str, Any] | None = Field(default=None, alias="_metadata")

    @field_validator("workdir", mode="before")
    @classmethod
    def _workdir(cls, v: Any) -> Any:
        if v is None or isinstance(v, str):
            return v
        if isinstance(v, dict):
            return WorkdirGit.model_validate(v)
        raise PydanticCustomError(
            "skypilot", f"must be a local directory or a mapping {{url, ref}}; got {v!r}")

    @field_validator("num_nodes")
    @classmethod
    def _num_nodes(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise PydanticCustomError("skypilot", f"must be a positive whole number; got {v}")
        return v

    @field_validator("envs", mode="before")
    @classmethod
    def _envs(cls, v: Any) -> Any:
        if not isinstance(v, dict):
            return v
        out = {}
        for key, value in v.items():
            if not isinstance(key, str) or not _ENV_NAME.match(key):
                raise PydanticCustomError(
                    "skypilot", f"{key!r} is not a valid environment variable name")
            out[key] = _env_value(key, value)
        return out

    @field_validator("secrets", mode="before")
    @classmethod
    def _secrets(cls, v: Any) -> Any:
        if isinstance(v, dict):
            return {str(k): _env_value(str(k), val) for k, val in v.items()}
        if isinstance(v, list):
            for item in v:
                if not isinstance(item, str):
                    raise PydanticCustomError(
                        "skypilot", f"secret references must be names; got {item!r}")
            return v
        if v is not None:
            raise PydanticCustomError(
                "skypilot", f"must be a mapping of names to values or a list of names; got {v!r}")
        return v

    @field_validator("file_mounts", mode="before")
    @classmethod
    def _file_mounts(cls, v: Any) -> Any:
        if isinstance(v, dict):
            for dst, src in v.items():
                if not isinstance(dst, str) or not dst:
                    raise PydanticCustomError("skypilot", f"mount path {dst!r} must be a string")
                if not isinstance(src, (str, dict)):
                    raise PydanticCustomError(
                        "skypilot",
                        f"{dst}: source must be a path/URL or a storage mapping; got {src!r}")
        return v


def _env_value(key: str, value: Any) -> str | None:
    """SkyPilot keeps envs as strings; numbers and booleans are written as YAML would."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    raise PydanticCustomError(
        "skypilot", f"value of {key!r} must be a string, number or boolean; got {value!r}")
