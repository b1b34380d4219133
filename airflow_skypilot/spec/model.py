"""Pydantic models of SkyPilot's task YAML (SkyPilot 0.14's schema, sky/utils/schemas.py).

Every key SkyPilot accepts is accepted here, so a user's YAML loads unchanged; unknown keys
are errors (with a "did you mean"). Fields with a text syntax are parsed by
:mod:`airflow_skypilot.spec.fields`; their errors become pydantic errors at the field's path.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError, ValidationError

from airflow_skypilot.spec import fields as f

_ENV_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


_Entry = tuple[tuple[Any, ...], str]


def _at(errors: list[_Entry], value: Any) -> ValidationError:
    """``(loc, message)`` problems found inside a field's value, to raise from its validator.
    Pydantic puts the field's path in front of each ``loc`` (an entry's key, as written), so a
    problem names the entry and its line (``envs.BAD-NAME``), not the field's first line."""
    return ValidationError.from_exception_data("skypilot", [
        {"type": PydanticCustomError("skypilot", message), "loc": loc, "input": value}
        for loc, message in errors])


def _wrap(parser, value: Any, **kwargs: Any) -> Any:
    try:
        return parser(value, **kwargs)
    except f.FieldError as exc:
        raise _at([(exc.where, str(exc))], value) from None


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
    # SkyPilot's RESOURCE_CONFIG_ALIASES: ``gpus`` is ``accelerators``; an error names the
    # key as written
    accelerators: Any = Field(default=None,
                              validation_alias=AliasChoices("accelerators", "gpus"))
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
        if isinstance(data, dict) and "hooks" in data:
            raise PydanticCustomError(
                "skypilot", "lifecycle hooks live under the top-level 'config.hooks', not "
                            "'resources.hooks'")
        if isinstance(data, dict) and "gpus" in data and "accelerators" in data:
            raise PydanticCustomError("skypilot", "cannot give both 'gpus' and 'accelerators'")
        return data

    @field_validator("cloud", mode="before")
    @classmethod
    def _cloud(cls, v: Any) -> Any:
        if isinstance(v, str) and v.lower() not in f.ALL_CLOUDS:
            raise PydanticCustomError("skypilot", f"unknown cloud {v!r}; expected one of "
                                      f"{', '.join(f.ALL_CLOUDS)}")
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
            # names as written: each candidate canonicalises them for its own cloud, once
            # any_of/ordered entries are merged (spec/task.py)
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
    def _cross_fields(self) -> ResourceFields:
        legacy = (self.cloud, self.region, self.zone)
        if self.infra is not None and any(x is not None for x in legacy):
            raise PydanticCustomError(
                "skypilot", "give either 'infra' or the older 'cloud'/'region'/'zone', not both")
        cloud = (self.infra or self.cloud or "").split("/")[0].lower()
        if self.memory is not None and f.memory_number(self.memory) == 0 and cloud != "slurm":
            raise PydanticCustomError("skypilot", "memory must be positive (0 is allowed only "
                                                  "on Slurm, where it means 'do not ask')")
        if self.accelerators is not None:
            tpus = [n for n, _ in self.accelerators[0] if n.startswith("tpu-")]
            if tpus and cloud not in ("", "gcp", "kubernetes", "*"):
                raise PydanticCustomError(
                    "skypilot", f"TPU accelerators ({tpus[0]}) need GCP or Kubernetes; "
                                f"got cloud {cloud!r}")
        return self


class ResourceOverride(ResourceFields):
    """One entry of ``any_of``/``ordered``: overrides the base fields; one accelerator only."""

    @field_validator("*", mode="before")
    @classmethod
    def _not_null(cls, v: Any, info: ValidationInfo) -> Any:
        # SkyPilot's schema refuses null here (only ports and image_id may be null): an entry
        # cannot unset what the base sets
        if v is None and info.field_name not in ("ports", "image_id"):
            raise PydanticCustomError(
                "skypilot", "must not be null in an 'any_of'/'ordered' entry (it cannot unset "
                            "the base's value; leave the field out)")
        return v


class ResourcesSpec(ResourceFields):
    """The ``resources:`` section: base fields plus ``any_of`` or ``ordered`` candidates."""

    single_accelerator: ClassVar[bool] = False

    any_of: list[ResourceOverride] | None = None
    ordered: list[ResourceOverride] | None = None

    @field_validator("any_of", "ordered", mode="before")
    @classmethod
    def _empty_is_absent(cls, v: Any) -> Any:
        return None if v == [] else v  # SkyPilot ignores an empty any_of/ordered

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
        return self


_TASK_NAME = re.compile(r"^[a-zA-Z0-9]+(?:[._-]{1,2}[a-zA-Z0-9]+)*$")
_STORAGE_KEYS = {"name", "source", "store", "persistent", "mode", "type", "config"}
_STORAGE_MODES = ("MOUNT", "COPY", "MOUNT_CACHED")
_STORES = ("S3", "GCS", "AZURE", "R2", "IBM", "OCI", "NEBIUS", "COREWEAVE", "VASTDATA", "HF",
           "VOLUME")
_FILE_MOUNT_TYPES = ("MODEL_CHECKPOINT_RO", "MODEL_CHECKPOINT_RW", "DATASET_RO", "DATASET_RW")

#: What a task's ``config:`` may override (SkyPilot's OVERRIDEABLE_CONFIG_KEYS_IN_TASK), with
#: the type of each leaf where it is checked; ``None`` accepts any value.
CONFIG_KEYS: dict[str, dict[str, type | tuple[type, ...] | None]] = {
    "docker": {"run_options": (str, list)},
    "nvidia_gpus": {"disable_ecc": bool},
    "ssh": {"custom_metadata": dict, "pod_config": dict, "provision_timeout": int},
    "kubernetes": {"custom_metadata": dict, "pod_config": dict, "provision_timeout": int,
                   "dws": dict, "kueue": dict, "quota": None, "remote_identity": None,
                   "enable_docker": None, "set_pod_resource_limits": None},
    "azure": {"remote_identity": None, "vpc_name": str},
    "gcp": {"vpc_name": str, "subnet_names": None, "managed_instance_group": dict,
            "enable_gvnic": bool, "enable_gpu_direct": bool, "placement_policy": str},
    "vast": {"datacenter_only": bool, "create_instance_kwargs": dict},
    "slurm": {"sbatch_options": (dict, list), "quota": None, "cpu_partition": str},
    "active_workspace": None,
    "hooks": None,
}


def _enable_docker(value: Any) -> str | None:
    """``config.kubernetes.enable_docker`` (SkyPilot 0.14): true/false, ``ALL``/``BUILD``, or
    ``{mode: ALL|BUILD, cache_volume: NAME}``; what is wrong, or None."""
    modes = ("ALL", "BUILD")
    if isinstance(value, bool) or isinstance(value, str) and value in modes:
        return None
    if isinstance(value, dict):
        unknown = sorted(set(value) - {"mode", "cache_volume"})
        if unknown:
            return f"unknown key {unknown[0]!r}; allowed: cache_volume, mode"
        if value.get("mode") not in modes:
            return f"mode must be ALL or BUILD; got {value.get('mode')!r}"
        volume = value.get("cache_volume")
        if volume is not None and not isinstance(volume, str):
            return f"cache_volume must be a volume name; got {volume!r}"
        return None
    return (f"must be true, false, ALL, BUILD or {{mode: ALL|BUILD, cache_volume: NAME}}; "
            f"got {value!r}")


def _type_name(want: type | tuple[type, ...]) -> str:
    names = {bool: "true or false", int: "a whole number", str: "a string", dict: "a mapping",
             list: "a list"}
    wants = want if isinstance(want, tuple) else (want,)
    return " or ".join(names.get(w, w.__name__) for w in wants)


#: leaves of ``config`` with a check of their own: (section, key) -> what is wrong, or None
CONFIG_CHECKS = {("kubernetes", "enable_docker"): _enable_docker}


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

    @model_validator(mode="before")
    @classmethod
    def _service_and_pool(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("service") is not None \
                and data.get("pool") is not None:
            raise PydanticCustomError("skypilot", "cannot set both 'service' and 'pool'")
        return data

    @field_validator("name")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        if v is not None and not _TASK_NAME.match(v):
            raise PydanticCustomError(
                "skypilot", f"invalid task name {v!r}: letters and digits, separated by at most "
                            "two of '.', '_', '-'")
        return v

    @field_validator("workdir", mode="before")
    @classmethod
    def _workdir(cls, v: Any) -> Any:
        if v is None or isinstance(v, str):
            return v
        if isinstance(v, dict):
            unknown = sorted(set(v) - {"url", "ref"}, key=str)
            bad = [k for k in ("url", "ref") if k in v and not isinstance(v[k], str)]
            if unknown or bad or "url" not in v:
                why = f"unknown key {unknown[0]!r}; " if unknown else ""
                raise _at([(tuple((unknown or bad)[:1]), f"{why}a git workdir is {{url, ref}} "
                                                         f"with string values; got {v!r}")], v)
            return v
        raise PydanticCustomError(
            "skypilot", f"must be a local directory or a mapping {{url, ref}}; got {v!r}")

    @field_validator("config", mode="before")
    @classmethod
    def _config(cls, v: Any) -> Any:
        if not isinstance(v, dict):
            return v
        errors: list[_Entry] = []
        for section, body in v.items():
            if section not in CONFIG_KEYS:
                errors.append(((section,), f"config section {section!r} cannot be set by a "
                                           f"task; allowed: {', '.join(CONFIG_KEYS)}"))
                continue
            leaves = CONFIG_KEYS[section]
            if leaves is None:
                continue
            if not isinstance(body, dict):
                errors.append(((section,), f"must be a mapping; got {body!r}"))
                continue
            for key, value in body.items():
                where = (section, key)
                if key not in leaves:
                    errors.append((where, f"{key!r} cannot be set by a task; allowed: "
                                          f"{', '.join(leaves)}"))
                    continue
                check = CONFIG_CHECKS.get((section, key))
                why = check(value) if check else None
                want = leaves[key]
                if why:
                    errors.append((where, why))
                elif want is not None and (isinstance(value, bool) and want is int
                                           or not isinstance(value, want)):
                    errors.append((where, f"must be {_type_name(want)}; got {value!r}"))
        if errors:
            raise _at(errors, v)
        return v

    @field_validator("inputs", "outputs")
    @classmethod
    def _one_entry(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and len(v) > 1:
            raise PydanticCustomError("skypilot", "at most one entry {uri: size_gb}")
        return v

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
        errors: list[_Entry] = [((key,), f"{key!r} is not a valid environment variable name")
                               for key in v if not isinstance(key, str) or not _ENV_NAME.match(key)]
        if errors:
            raise _at(errors, v)
        return {key: _env_value(value) for key, value in v.items()}

    @field_validator("secrets", mode="before")
    @classmethod
    def _secrets(cls, v: Any) -> Any:
        """Dict form ``{NAME: value | null}``; references ``secrets:NAME`` (null value) or the
        list form ``[secrets:NAME]`` name secrets supplied when the task runs."""
        errors: list[_Entry] = []
        if isinstance(v, dict):
            out = {}
            for raw, val in v.items():
                key = str(raw)
                name = secret_ref_name(key)
                if key.startswith(SECRET_REF) and val is not None:
                    errors.append(((raw,), f"{key!r}: a secret reference must have a null "
                                           "value"))
                elif not _ENV_NAME.match(name):
                    errors.append(((raw,), f"secret {name!r} is not a valid environment "
                                           "variable name"))
                out[name] = _env_value(val)
            if errors:
                raise _at(errors, v)
            return out
        if isinstance(v, list):
            out = {}
            for i, item in enumerate(v):
                if not isinstance(item, str) or not item.startswith(SECRET_REF):
                    # not quoted: it may be a secret's value written in the wrong place
                    errors.append(((i,), "list items must be references like "
                                         f"'secrets:HF_TOKEN'; got a {type(item).__name__} "
                                         "that is not one"))
                    continue
                out[secret_ref_name(item)] = None
            if errors:
                raise _at(errors, v)
            return out
        if v is not None:  # the value is not quoted: it may be a secret
            raise PydanticCustomError(
                "skypilot", "must be a mapping of names to values or a list of names; got a "
                            f"{type(v).__name__}")
        return v

    @field_validator("file_mounts", mode="before")
    @classmethod
    def _file_mounts(cls, v: Any) -> Any:
        if isinstance(v, dict):
            errors: list[_Entry] = []
            for dst, src in v.items():
                if not isinstance(dst, str) or not dst:
                    errors.append(((dst,), f"mount path {dst!r} must be a string"))
                elif dst.endswith("/") and dst != "/":
                    errors.append(((dst,), f"mount path {dst!r} must not end with a slash"))
                # a storage mapping is checked once envs are filled in (storage_problem), as
                # SkyPilot builds its Storage only after filling envs into file_mounts
                elif not isinstance(src, (dict, str)):
                    errors.append(((dst,), "source must be a path/URL or a storage mapping; "
                                           f"got {src!r}"))
                # SkyPilot's _validate_path refuses it at launch, cloud URLs ('s3://b/') and
                # '/' included; a source that ends in '/' only once envs are filled in is
                # checked then (fill.local_path_problems)
                elif isinstance(src, str) and src.endswith("/"):
                    errors.append(((dst,), f"source {src!r} must not end with a slash"))
            if errors:
                raise _at(errors, v)
        return v


SECRET_REF = "secrets:"
_SCOPES = ("personal.", "workspace.", "global.")


def secret_ref_name(key: str) -> str:
    """``secrets:workspace.HF_TOKEN`` -> ``HF_TOKEN``; a plain name is returned unchanged."""
    if key.startswith(SECRET_REF):
        key = key[len(SECRET_REF):]
        for scope in _SCOPES:
            if key.startswith(scope):
                key = key[len(scope):]
    return key


def _env_value(value: Any) -> str | None:
    """SkyPilot keeps envs and secrets as ``str(value)``: ``8`` -> ``"8"``, ``true`` ->
    ``"True"``, ``[1]`` -> ``"[1]"``; null is a value still to be supplied."""
    return None if value is None else str(value)


def storage_problem(spec: dict[str, Any]) -> str | None:
    """What is wrong with a storage mapping of ``file_mounts`` (SkyPilot's storage schema,
    sky/utils/schemas.py get_storage_schema, main keys), once envs are filled in; None if
    nothing."""
    unknown = sorted(set(spec) - _STORAGE_KEYS)
    if unknown:
        return f"unknown storage key {unknown[0]!r}; allowed: {', '.join(sorted(_STORAGE_KEYS))}"
    for key, choices in (("store", _STORES), ("mode", _STORAGE_MODES),
                         ("type", _FILE_MOUNT_TYPES)):
        value = spec.get(key)
        if value is not None and (not isinstance(value, str)
                                  or value.lower() not in (c.lower() for c in choices)):
            return f"unknown {key} {value!r}; expected one of {', '.join(choices)}"
    for key, want, what in (("name", str, "a string"), ("persistent", bool, "true or false"),
                            ("config", dict, "a mapping")):
        value = spec.get(key)
        if value is not None and not isinstance(value, want):
            return f"{key} must be {what}; got {value!r}"
    source = spec.get("source")
    if source is not None and not (isinstance(source, str) or isinstance(source, list) and source
                                   and all(isinstance(x, str) for x in source)):
        return f"source must be a path/URL or a list of them; got {source!r}"
    return None


def _replaces(*groups: tuple[frozenset[str], ...]) -> dict[str, frozenset[str]]:
    """key -> the keys of the other sides of its group."""
    out: dict[str, frozenset[str]] = {}
    for sides in groups:
        for side in sides:
            others = frozenset().union(*(s for s in sides if s is not side))
            for key in side:
                out[key] = out.get(key, frozenset()) | others
    return out


def _alias_groups(model: type[BaseModel]) -> list[tuple[frozenset[str], ...]]:
    """A field and its alias (``_metadata``/``metadata``: populate_by_name takes both)."""
    return [(frozenset({name}), frozenset({info.alias})) for name, info in
            model.model_fields.items() if info.alias and info.alias != name]


#: Keys that give the same thing as others, or that SkyPilot refuses beside them (aliases,
#: alternatives), by section ("" is the top level). Merging a task's fields over a base
#: (``@task.skypilot``), a key given drops the base's others, as it replaces its own. A
#: ``region``/``zone`` alone does not drop the base's ``infra`` (that would widen the cloud):
#: both stay, and the task is refused with a clear error.
REPLACES: dict[str, dict[str, frozenset[str]]] = {
    "": _replaces(*_alias_groups(TaskSpec),
                  (frozenset({"service"}), frozenset({"pool"}))),
    "resources": {
        **_replaces(*_alias_groups(ResourcesSpec),
                    (frozenset({"accelerators"}), frozenset({"gpus"})),
                    (frozenset({"any_of"}), frozenset({"ordered"})),
                    (frozenset({"cloud"}), frozenset({"infra"}))),
        "infra": frozenset({"cloud", "region", "zone"}),
    },
}
