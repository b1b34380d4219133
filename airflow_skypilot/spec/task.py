"""The loaded task: what to run, and the candidate resource requests it may run on.

``load_task`` is the one entry point: YAML file, YAML text or dict in; a :class:`Task` out, or a
:class:`TaskValidationError` listing every problem (file, line, field) before anything runs.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from airflow_skypilot.spec import accelerators as acc
from airflow_skypilot.spec import checks, instance_types
from airflow_skypilot.spec import fields as f
from airflow_skypilot.spec.errors import Problem, TaskValidationError
from airflow_skypilot.spec.fill import (
    SecretDict,
    local_path_problems,
    masked,
    redacted,
    service_problems,
    slash_problems,
    storage_problems,
    substitute,
)
from airflow_skypilot.spec.model import (
    ResourceFields,
    ResourceOverride,
    ResourcesSpec,
    TaskSpec,
)
from airflow_skypilot.spec.source import MAX_YAML_BYTES, Source, dotted, load_yaml, too_large

#: Top-level keys SkyPilot accepts that a batch job here does not use; they load with a warning.
IGNORED_KEYS = {
    "service": "SkyServe services are not run by airflow-skypilot; 'service' is checked as "
               "SkyPilot checks it, then ignored",
    "pool": "worker pools are not used by airflow-skypilot; 'pool' is checked as SkyPilot "
            "checks it, then ignored",
    "event_callback": "'event_callback' is ignored; use Airflow callbacks instead",
    "inputs": "'inputs' (experimental in SkyPilot) is ignored",
    "outputs": "'outputs' (experimental in SkyPilot) is ignored",
    "managed_secrets": "SkyPilot managed secrets are not available; pass secrets through the "
                       "operator's 'secrets' argument",
    "api_server_access": "'api_server_access' is ignored (there is no SkyPilot API server)",
    "file_mounts_mapping": "'file_mounts_mapping' is internal to SkyPilot and ignored",
}


@dataclass(frozen=True)
class ResourceRequest:
    """One candidate: what a single node of the job needs, and where it may go."""

    index: int
    accelerator: str | None = None
    accelerator_count: float = 0
    cpus: str | None = None
    memory: str | None = None
    use_spot: bool = False
    infra: str | None = None
    instance_type: str | None = None
    disk_size: int | None = None
    disk_tier: str | None = None
    image_id: str | dict[str, str] | None = None
    ports: tuple[str, ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict)
    max_hourly_cost: float | None = None
    priority: int | None = None
    job_recovery: Mapping[str, Any] = field(default_factory=lambda: f.parse_job_recovery(None))

    @property
    def cloud(self) -> str | None:
        """First part of ``infra`` (``slurm``, ``kubernetes``, ``aws``...), None for any."""
        if not self.infra or self.infra.startswith("*"):
            return None
        return self.infra.split("/")[0]

    @property
    def container_image(self) -> str | None:
        return f.docker_image(self.image_id)

    def cpus_needed(self) -> tuple[float | None, bool]:
        return f.split_at_least(self.cpus)

    def memory_needed_gb(self) -> tuple[float | None, bool]:
        return f.split_at_least(self.memory)

    def gpus_per_node(self) -> float:
        return self.accelerator_count if self.accelerator else 0

    def describe(self) -> str:
        """Short human text: ``A100:4, 8+ CPUs, 32+ GB, spot, infra=slurm/alpha``."""
        parts = []
        if self.accelerator:
            count = self.accelerator_count
            parts.append(f"{self.accelerator}:{int(count) if float(count).is_integer() else count}")
        if self.instance_type:
            parts.append(self.instance_type)
        if self.cpus:
            parts.append(f"{self.cpus} CPUs")
        if self.memory:
            parts.append(f"{self.memory} GB")
        if self.use_spot:
            parts.append("spot")
        if self.infra:
            parts.append(f"infra={self.infra}")
        return ", ".join(parts) or "CPU only"

    def to_json(self) -> dict[str, Any]:
        """The ``validate --json`` candidate object (docs/architecture.md), plus extra fields."""
        return {
            "accelerator": self.accelerator,
            "accelerator_count": self.accelerator_count if self.accelerator else 0,
            "cpus": self.cpus,
            "memory": self.memory,
            "use_spot": self.use_spot,
            "infra": self.infra,
            "instance_type": self.instance_type,
            "disk_size": self.disk_size,
            "disk_tier": self.disk_tier,
            "image_id": self.image_id,
            "ports": list(self.ports),
            "labels": dict(self.labels),
            "job_recovery": dict(self.job_recovery),
            "max_hourly_cost": self.max_hourly_cost,
            "priority": self.priority,
        }


@dataclass
class Task:
    """A validated SkyPilot task, with every override applied."""

    name: str | None
    num_nodes: int
    candidates: list[ResourceRequest]
    ordered: bool = False
    envs: dict[str, str] = field(default_factory=dict)
    secrets: dict[str, str] = field(default_factory=SecretDict)
    #: secrets the YAML names without a value; they must be supplied before the task runs
    missing_secrets: list[str] = field(default_factory=list)
    workdir: str | dict[str, Any] | None = None
    file_mounts: dict[str, Any] = field(default_factory=dict)
    volumes: dict[str, Any] = field(default_factory=dict)
    setup: str | None = None
    run: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    source: str = "<task>"
    base_dir: str | None = None
    warnings: list[Problem] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not isinstance(self.secrets, SecretDict):
            self.secrets = SecretDict(self.secrets)

    def __repr__(self) -> str:  # a secret filled into a path (SkyPilot does) stays out of logs
        shown = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self))
        return masked(f"Task({shown})", self.secrets.values())

    @property
    def job_recovery(self) -> Mapping[str, Any]:
        """The task's recovery settings (SkyPilot keeps them per resource; the first wins)."""
        return self.candidates[0].job_recovery

    def to_json(self) -> dict[str, Any]:
        """``airflow-skypilot validate --json`` (docs/architecture.md); secret values omitted."""
        return {
            "name": self.name,
            "num_nodes": self.num_nodes,
            "envs": dict(self.envs),
            "secrets": sorted({*self.secrets, *self.missing_secrets}),
            "ordered": self.ordered,
            "candidates": [c.to_json() for c in self.candidates],
        }

    def capacity_view(self) -> dict[str, Any]:
        """What a capacity probe needs of the task, and nothing else: no envs, no secrets, no
        scripts, no local paths (a triggerer on another machine probes with it; where the
        task fits was settled at placement). Plain JSON: it travels in trigger kwargs."""
        slurm = (self.config.get("slurm") or {}) if isinstance(self.config, dict) else {}
        return {
            "name": self.name,
            "num_nodes": self.num_nodes,
            "ordered": self.ordered,
            "candidates": [{"index": c.index, **c.to_json()} for c in self.candidates],
            "sbatch_options": slurm.get("sbatch_options"),
        }

    @classmethod
    def from_capacity_view(cls, view: Mapping[str, Any]) -> Task:
        """The task a probe sees from :meth:`capacity_view`."""
        config = {"slurm": {"sbatch_options": view["sbatch_options"]}} \
            if view.get("sbatch_options") else {}
        return cls(name=view.get("name"), num_nodes=int(view.get("num_nodes") or 1),
                   candidates=[request_from_json(c) for c in view.get("candidates") or []],
                   ordered=bool(view.get("ordered")), config=config, source="<capacity view>")

    def resolved_workdir(self) -> str | None:
        """Absolute local workdir (relative paths are relative to the YAML file), if local."""
        if not isinstance(self.workdir, str):
            return None
        path = os.path.expanduser(self.workdir)
        if not os.path.isabs(path) and self.base_dir:
            path = os.path.join(self.base_dir, path)
        return os.path.normpath(path)


# --- loading --------------------------------------------------------------------------------


def load_task(
    task: str | os.PathLike[str] | Mapping[str, Any],
    envs: Mapping[str, Any] | None = None,
    secrets: Mapping[str, Any] | None = None,
    *,
    file: str | None = None,
    require_secrets: bool = False,
    base_dir: str | None = None,
) -> Task:
    """Load and validate a task from a YAML path, YAML text or a dict.

    ``envs``/``secrets`` override (and add to) the YAML's, as ``sky launch --env/--secret`` do;
    an env left without a value is an error. A secret left without a value is a reference to
    be supplied when the task runs (as SkyPilot's managed secrets): an error only with
    ``require_secrets`` (the operator, before it submits). Raises TaskValidationError.
    ``base_dir``: where a dict's relative ``workdir``/``file_mounts`` paths start (a YAML
    file's own folder is used for a file).
    """
    if isinstance(task, Mapping):
        src = Source(data=dict(task), file=file or "<dict>")
    else:
        text, name = read_task_text(task)
        file = file or name
        base_dir = os.path.dirname(os.path.abspath(name)) if name != "<inline>" else None
        sources = load_yaml(text, file=file)
        if len(sources) > 1:
            second = sources[1]
            raise TaskValidationError([Problem(
                path="", file=file, line=second.line_of(()),
                message="multi-document YAML (a SkyPilot pipeline) is not supported: declare "
                        "each task as its own operator in the DAG")])
        src = sources[0] if sources else Source(data=None, file=file)
    return _build(src, envs or {}, secrets or {}, base_dir, require_secrets)


def names_a_file(text: str) -> bool:
    """Whether the one-line string ``text`` is a YAML path rather than YAML text: it ends in
    .yaml/.yml and is not itself a YAML mapping (``run: python t.py --config c.yaml`` is a
    task, not a file name)."""
    if "\n" in text or not text.endswith((".yaml", ".yml")):
        return False
    try:
        parsed = yaml.safe_load(text)
    except yaml.YAMLError:
        return True
    return not isinstance(parsed, dict)


def read_task_text(task: str | os.PathLike[str]) -> tuple[str, str]:
    """(text, file name). A string that names an existing file, or ends in .yaml/.yml and is
    not a YAML mapping (:func:`names_a_file`), is a path; anything else is YAML text."""
    text = os.fspath(task)
    looks_like_path = names_a_file(text) or ("\n" not in text and os.path.isfile(text))
    if not looks_like_path:
        return text, "<inline>"
    try:
        with open(text, "rb") as fh:
            raw = fh.read(MAX_YAML_BYTES + 1)
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        why = getattr(exc, "strerror", None) or str(exc)
        raise TaskValidationError(
            [Problem(path="", file=repr(text)[1:-1], message=f"cannot read task file: {why}")]
        ) from None
    if len(raw) > MAX_YAML_BYTES:
        raise TaskValidationError([too_large(text)])
    try:
        return raw.decode("utf-8"), text
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise TaskValidationError([Problem(
            path="", file=text, line=line,
            message=f"not UTF-8 text: byte {exc.start} is 0x{raw[exc.start]:02x} (a task YAML "
                    "must be UTF-8)")]) from None


def _build(src: Source, env_over: Mapping[str, Any], sec_over: Mapping[str, Any],
           base_dir: str | None, require_secrets: bool) -> Task:
    data = src.data
    if data is None and src.file != "<dict>":
        raise TaskValidationError([src.problem((), (
            "the task is empty: add at least a 'run:' (or 'setup:') field"))])
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise TaskValidationError([src.problem(
            (), f"a task must be a mapping of fields (name, resources, run, ...); "
                f"got {type(data).__name__}")])
    problems: list[Problem] = []
    try:
        spec = TaskSpec.model_validate(data)
    except ValidationError as exc:
        problems.extend(_pydantic_problems(exc, src, TaskSpec, data))
        # Still report values that are missing, so one run shows every problem.
        sections = [("envs", env_over)] + ([("secrets", sec_over)] if require_secrets else [])
        for section, over in sections:
            raw = data.get(section)
            if isinstance(raw, dict):
                problems.extend(_missing(src, section, {**raw, **over}))
        raise TaskValidationError(_sorted(problems)) from None

    warnings = list(src.warnings)
    for key, why in IGNORED_KEYS.items():
        if getattr(spec, key, None) is not None:
            warnings.append(src.problem((key,), why))

    envs = dict(spec.envs or {})
    for key, value in env_over.items():
        envs[str(key)] = _override_value(value)
    problems.extend(_missing(src, "envs", envs))

    bad_names, name_warnings = checks.names(src, spec.envs or {}, env_over, spec.secrets or {},
                                            sec_over)
    problems.extend(bad_names)
    warnings.extend(name_warnings)
    problems.extend(checks.slurm_options(src, spec.config or {}))
    warnings.extend(checks.pod_config(src, spec.config or {}))
    secrets: dict[str, str | None] = dict(spec.secrets or {})
    for key, value in sec_over.items():
        secrets[str(key)] = _override_value(value)
    if require_secrets:
        problems.extend(_missing(src, "secrets", secrets))
    # SkyPilot fills envs (and inline secrets) into file_mounts, workdir, volumes and service
    # before it reads them: a storage's `store: $STORE` is checked with STORE's value
    substitutions = {**{k: v for k, v in envs.items() if v is not None},
                     **{k: v for k, v in secrets.items() if v is not None}}
    unfilled = {k for k, v in envs.items() if v is None}
    # these checks read filled-in values, so their messages may quote a secret's value
    hide = [v for v in secrets.values() if v]
    local_paths = _local_paths(spec, src, base_dir, substitutions, unfilled)
    problems.extend(redacted([*local_paths, *slash_problems(spec, src, substitutions),
                              *storage_problems(spec, src, substitutions, unfilled),
                              *service_problems(spec, src, substitutions, unfilled)], hide))

    candidates, ordered = [], False
    try:
        candidates, ordered = _expand(data.get("resources"), src)
    except TaskValidationError as exc:
        problems.extend(exc.problems)

    num_nodes = spec.num_nodes or 1
    if problems:
        problems = _sorted(problems)
        if len(local_paths) == len(problems):
            # Say so: in a DAG folder or a copied YAML this is the usual, and only, problem
            where = f"{base_dir}, the YAML file's folder" if base_dir else os.getcwd()
            problems.append(Problem(path="", file=src.file, message=(
                "nothing else is wrong with the task: only the local paths above are missing "
                f"(relative paths start at {where})")))
        raise TaskValidationError(problems)

    workdir: Any = spec.workdir.model_dump() if isinstance(spec.workdir, BaseModel) \
        else spec.workdir
    return Task(
        name=spec.name,
        num_nodes=num_nodes,
        candidates=candidates,
        ordered=ordered,
        envs={k: v for k, v in envs.items() if v is not None},
        secrets=SecretDict({k: v for k, v in secrets.items() if v is not None}),
        missing_secrets=sorted(k for k, v in secrets.items() if v is None),
        workdir=substitute(workdir, substitutions),
        file_mounts=substitute(dict(spec.file_mounts or {}), substitutions),
        volumes=substitute(dict(spec.volumes or {}), substitutions),
        setup=spec.setup,
        run=spec.run,
        config=dict(spec.config or {}),
        source=src.file,
        base_dir=base_dir,
        warnings=warnings,
    )


def _missing(src: Source, section: str, values: Mapping[str, Any]) -> list[Problem]:
    flag = "--env" if section == "envs" else "--secret"
    return [src.problem((section, key), (
        f"has no value: supply it as an override ({flag} {key}=VALUE, or the operator's "
        f"{section}={{'{key}': ...}})")) for key, value in values.items() if value is None]


def _override_value(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _expand(raw: Any, src: Source) -> tuple[list[ResourceRequest], bool]:
    """The candidates of ``resources:`` as SkyPilot expands them (any_of/ordered/accelerators)."""
    if raw is None:
        return [ResourceRequest(index=0)], False
    raw = dict(raw)
    base_acc: tuple[Any, ...] = ("resources", "gpus" if "gpus" in raw else "accelerators")
    if "gpus" in raw:
        raw["accelerators"] = raw.pop("gpus")
    base_spec = ResourcesSpec.model_validate(raw)
    any_of, ordered_list = raw.pop("any_of", None) or None, raw.pop("ordered", None) or None
    entries = any_of if any_of is not None else ordered_list
    out: list[ResourceRequest] = []
    is_ordered = False
    if entries is None:
        pairs, kind = base_spec.accelerators or ([], "one")
        out.extend(_requests(base_spec, pairs, src, base_acc))
        is_ordered = kind == "ordered"
    else:
        key = "any_of" if any_of is not None else "ordered"
        is_ordered = key == "ordered"
        for i, entry in enumerate(entries):
            entry = dict(entry)
            acc_where = base_acc
            if "gpus" in entry or "accelerators" in entry:
                acc_where = ("resources", key, i, "gpus" if "gpus" in entry else "accelerators")
            if "gpus" in entry:
                entry["accelerators"] = entry.pop("gpus")
            merged = {**raw}
            labels = dict(raw.get("labels") or {})
            merged.update(entry)
            if "labels" in entry and entry["labels"] is not None:
                labels.update(entry["labels"])
                merged["labels"] = labels
            if "infra" in entry and any(k in raw for k in ("cloud", "region", "zone")):
                # SkyPilot merges then validates; an override's infra beside the base's legacy
                # cloud/region/zone would fail there. Say where, clearly.
                raise TaskValidationError([src.problem(
                    ("resources", key, i, "infra"),
                    "cannot override with 'infra' when the base resources use "
                    "'cloud'/'region'/'zone'")])
            try:
                spec = ResourcesSpec.model_validate(merged)
            except ValidationError as exc:
                raise TaskValidationError(
                    _pydantic_problems(exc, src, ResourcesSpec, merged,
                                       prefix=("resources", key, i))) from None
            pairs, _ = spec.accelerators or ([], "one")
            out.extend(_requests(spec, pairs, src, acc_where))
    # Drop exact duplicates (SkyPilot keeps candidates in a set or list of unique Resources).
    unique: list[ResourceRequest] = []
    for req in out:
        if all(replace(req, index=0) != replace(u, index=0) for u in unique):
            unique.append(replace(req, index=len(unique)))
    return unique, is_ordered


def _requests(spec: ResourceFields, pairs: list[tuple[str, float]], src: Source,
              acc_where: tuple[Any, ...]) -> list[ResourceRequest]:
    """The candidates of one merged resource spec: one per accelerator, each named as
    SkyPilot's Resources canonicalises it for the candidate's cloud (MI300 stays MI300 on
    Kubernetes, whose labels decide; it is MI300X where any cloud may take it)."""
    infra = spec.infra or f.infra_from_legacy(spec.cloud, spec.region, spec.zone)
    if infra == "*":
        infra = None
    if infra is None and any(name.startswith("tpu-") for name, _ in pairs):
        infra = "gcp"  # as SkyPilot: a TPU name without a cloud means GCP
    cloud = infra.split("/")[0] if infra else None
    try:
        pairs = [(acc.canonical(name, cloud), count) for name, count in pairs]
    except acc.AmbiguousAcceleratorError as exc:
        raise TaskValidationError([src.problem(acc_where, str(exc))]) from None
    if not pairs and (carried := instance_types.accelerator_of(cloud, spec.instance_type)):
        pairs = [carried]  # SkyPilot: Resources.accelerators from its catalog, cloud known
    image_id = spec.image_id
    if cloud in f.CONTAINER_CLOUDS:
        image_id = f.as_container_image(image_id)
    common = dict(
        cpus=spec.cpus, memory=spec.memory, use_spot=bool(spec.use_spot), infra=infra,
        instance_type=spec.instance_type, disk_size=spec.disk_size,
        disk_tier=spec.disk_tier, image_id=image_id, ports=spec.ports or (),
        labels=dict(spec.labels or {}), max_hourly_cost=spec.max_hourly_cost,
        priority=spec.priority,
        job_recovery=spec.job_recovery or f.parse_job_recovery(None),
    )
    if not pairs:
        return [ResourceRequest(index=0, **common)]
    return [ResourceRequest(index=0, accelerator=name, accelerator_count=count, **common)
            for name, count in pairs]


# --- errors ---------------------------------------------------------------------------------


def _pydantic_problems(exc: ValidationError, src: Source, root: type[BaseModel], data: Any,
                       prefix: tuple[Any, ...] = ()) -> list[Problem]:
    out: list[Problem] = []
    seen: set[tuple[str, str]] = set()
    for err in exc.errors():
        loc = _real_loc(err["loc"], data)
        path = (*prefix, *loc)
        if err["type"] == "extra_forbidden":
            key = loc[-1] if loc else ""
            message = f"unknown field {key!r}"
            allowed = _allowed_keys(root, loc[:-1])
            close = difflib.get_close_matches(str(key), allowed, n=1, cutoff=0.6)
            if close:
                message += f"; did you mean {close[0]!r}?"
            elif allowed:
                message += f" (allowed here: {', '.join(sorted(allowed))})"
        else:
            message = err["msg"]
            if err["type"] == "skypilot":
                message = err["ctx"]["error"] if "ctx" in err and "error" in err["ctx"] else \
                    message
            if message[:1].isupper() and not message[1:2].isupper():
                message = message[0].lower() + message[1:]
            if "input" in err and err["type"] not in ("skypilot", "missing"):
                message += f"; got {err['input']!r}"
        key2 = (dotted(path), message)
        if key2 in seen:
            continue
        seen.add(key2)
        out.append(src.problem(path, message))
    return out


def _real_loc(loc: tuple[Any, ...], data: Any) -> tuple[Any, ...]:
    """Pydantic locs may contain union tags and aliases; keep the parts that are real keys."""
    out: list[Any] = []
    node = data
    for part in loc:
        if isinstance(node, dict) and part in node:
            out.append(part)
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            out.append(part)
            node = node[part]
        elif isinstance(node, dict) and not out and part not in node:
            out.append(part)  # a missing field at this level: still name it
            node = None
        elif node is None or not isinstance(node, (dict, list)):
            break
    return tuple(out)


_MODEL_AT: dict[tuple[str, ...], type[BaseModel]] = {
    (): TaskSpec,
    ("resources",): ResourcesSpec,
    ("resources", "any_of"): ResourceOverride,
    ("resources", "ordered"): ResourceOverride,
}


def _allowed_keys(root: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    if root is not TaskSpec:
        model = root
    else:
        model = _MODEL_AT.get(tuple(p for p in loc if isinstance(p, str)))
        if model is None:
            return []
    keys = []
    for name, info in model.model_fields.items():
        key = info.alias or name
        if not key.startswith("_"):
            keys.append(key)
    if model is ResourcesSpec or model is ResourceOverride or model is ResourceFields:
        keys.append("gpus")
    return keys


def _sorted(problems: list[Problem]) -> list[Problem]:
    return sorted(problems, key=lambda p: (p.line or 0, p.path))


def problems_to_text(problems: list[Problem]) -> str:
    return "\n".join(str(p) for p in problems)


def request_from_json(data: Mapping[str, Any]) -> ResourceRequest:
    """Rebuild a ResourceRequest from :meth:`ResourceRequest.to_json` plus ``index``."""
    known = {k: v for k, v in data.items() if k in ResourceRequest.__dataclass_fields__}
    known["ports"] = tuple(known.get("ports") or ())
    known.setdefault("index", 0)
    return ResourceRequest(**known)


__all__ = ["ResourceRequest", "Task", "load_task", "request_from_json", "asdict"]


def _local_paths(spec: Any, src: Source, base_dir: str | None, env: Mapping[str, str],
                 unfilled: set[str]) -> list[Problem]:
    """The local-path check under this module's name (the conformance checker turns it off)."""
    return local_path_problems(spec, src, base_dir, env, unfilled)
