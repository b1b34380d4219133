"""``service:`` and ``pool:``: checked as SkyPilot 0.14 checks them, then ignored.

airflow-skypilot runs batch jobs; SkyServe services and worker pools are not run (the loader
warns). A task YAML that SkyPilot refuses must still be refused here, so both sections go
through SkyPilot's own rules: the service schema (sky/utils/schemas.py
``get_service_schema``) and ``SkyServiceSpec.from_yaml_config`` / ``SkyServiceSpec.__init__``
(sky/serve/service_spec.py), which a top-level ``pool: {...}`` also goes through, as
``{pool: {...}}``. Envs are filled into ``service`` before (sky/task.py), not into ``pool``.

:func:`problems` returns ``(path inside the section, message)`` pairs, the first problem
SkyPilot would raise (it stops at the first), or none.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any

Path = tuple[str, ...]

#: sky/serve/load_balancing_policies.py LB_POLICIES
LB_POLICIES = ("round_robin", "least_load", "instance_aware_least_load")
#: sky/serve/spot_placer.py SPOT_PLACERS
SPOT_PLACERS = ("dynamic_fallback",)
#: sky/serve/constants.py DEFAULT_MIN_REPLICAS
DEFAULT_MIN_REPLICAS = 1

_QPS_KEY = re.compile(r"^[A-Z0-9]+(?::[0-9]+)?$")


class _Invalid(Exception):
    def __init__(self, path: Path, message: str):
        super().__init__(message)
        self.path = path
        self.message = message


# --- the schema (JSON-schema draft 7 types, as jsonschema checks them) ---------------------


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_integer(v: Any) -> bool:
    return _is_number(v) and (isinstance(v, int) or float(v).is_integer())


def _integer(minimum: int | None = None) -> Callable[[Any], str | None]:
    def check(v: Any) -> str | None:
        if not _is_integer(v):
            return f"must be a whole number; got {v!r}"
        if minimum is not None and v < minimum:
            return f"must be >= {minimum}; got {v!r}"
        return None
    return check


def _number(minimum: float | None = None) -> Callable[[Any], str | None]:
    def check(v: Any) -> str | None:
        if not _is_number(v):
            return f"must be a number; got {v!r}"
        if minimum is not None and v < minimum:
            return f"must be >= {minimum:g}; got {v!r}"
        return None
    return check


def _string(v: Any) -> str | None:
    return None if isinstance(v, str) else f"must be a string; got {v!r}"


def _boolean(v: Any) -> str | None:
    return None if isinstance(v, bool) else f"must be true or false; got {v!r}"


def _choice(choices: tuple[str, ...]) -> Callable[[Any], str | None]:
    def check(v: Any) -> str | None:
        if not isinstance(v, str):
            return f"must be a string; got {v!r}"
        if v.lower() not in choices:
            return f"must be one of {', '.join(choices)}; got {v!r}"
        return None
    return check


def _post_data(v: Any) -> str | None:
    return None if isinstance(v, (str, dict)) else f"must be a string or a mapping; got {v!r}"


def _headers(v: Any) -> str | None:
    if not isinstance(v, dict):
        return f"must be a mapping of header names to strings; got {v!r}"
    for key, value in v.items():
        if not isinstance(value, str):
            return f"header {key!r} must be a string; got {value!r}"
    return None


def _qps(v: Any) -> str | None:
    if _is_number(v):
        return None if v >= 0 else f"must be >= 0; got {v!r}"
    if isinstance(v, dict):
        for key, value in v.items():
            if not isinstance(key, str) or not _QPS_KEY.match(key):
                return (f"keys must be accelerators like 'H100' or 'H100:1' (upper case); "
                        f"got {key!r}")
            if not _is_number(value) or value < 0:
                return f"{key}: must be a number >= 0; got {value!r}"
        return None
    return f"must be a number or a mapping {{ACCELERATOR: qps}}; got {v!r}"


_Fields = Mapping[str, Callable[[Any], str | None] | tuple[Any, ...]]

_READINESS: _Fields = {
    "path": _string, "initial_delay_seconds": _number(),
    "timeout_seconds": _number(), "endpoint_probe_interval_seconds": _number(),
    "consecutive_failure_threshold_timeout": _number(), "post_data": _post_data,
    "headers": _headers,
}
_POOL: _Fields = {
    "workers": _integer(0), "min_workers": _integer(0), "queue_length_threshold": _integer(1),
    "max_workers": _integer(0), "upscale_delay_seconds": _number(0),
    "downscale_delay_seconds": _number(0),
}
_REPLICA_POLICY: _Fields = {
    "min_replicas": _integer(0), "max_replicas": _integer(0), "num_overprovision": _integer(0),
    "target_qps_per_replica": _qps, "dynamic_ondemand_fallback": _boolean,
    "base_ondemand_fallback_replicas": _integer(0), "spot_placer": _choice(SPOT_PLACERS),
    "upscale_delay_seconds": _number(), "downscale_delay_seconds": _number(),
}
_SERVICE: _Fields = {
    "readiness_probe": ("readiness",),
    "load_balancer": ("object", {"stream_timeout_seconds": _number()}, ()),
    "pool": ("object", _POOL, ()),
    "replica_policy": ("object", _REPLICA_POLICY, ("min_replicas",)),
    "ports": _integer(), "replicas": _integer(), "workers": _integer(),
    "load_balancing_policy": _choice(LB_POLICIES),
    "tls": ("object", {"keyfile": _string, "certfile": _string}, ("keyfile", "certfile")),
}


def _object(value: Any, fields: _Fields, required: tuple[str, ...], path: Path) -> None:
    import difflib

    if not isinstance(value, dict):
        raise _Invalid(path, f"must be a mapping; got {value!r}")
    for key in value:
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            raise _Invalid((*path, str(key)), f"unknown field {key!r}" + (
                f"; did you mean {close[0]!r}?" if close else
                f" (allowed here: {', '.join(fields)})"))
    for key in required:
        if key not in value:
            raise _Invalid(path, f"{key!r} is required")
    for key, check in fields.items():
        if key not in value:
            continue
        if isinstance(check, tuple):
            if check[0] == "readiness":
                if not isinstance(value[key], str):
                    _object(value[key], _READINESS, ("path",), (*path, key))
            else:
                _object(value[key], check[1], check[2], (*path, key))
        elif (why := check(value[key])) is not None:
            raise _Invalid((*path, key), why)


# --- SkyServiceSpec.from_yaml_config and __init__ ----------------------------------------------


def _spec(config: dict[str, Any]) -> None:
    """sky/serve/service_spec.py, what it refuses (in its order)."""
    # validate_schema drops top-level null values first
    config = {k: v for k, v in config.items() if v is not None}
    _object(config, _SERVICE, (), ())
    if "replicas" in config and "replica_policy" in config:
        raise _Invalid(("replicas",), "give either 'replicas' or 'replica_policy', not both")
    readiness = config.get("readiness_probe", "/")
    path = readiness if isinstance(readiness, str) else readiness["path"]
    post_data = None if isinstance(readiness, str) else readiness.get("post_data")
    if isinstance(post_data, str):
        try:
            json.loads(post_data)
        except json.JSONDecodeError:
            raise _Invalid(("readiness_probe", "post_data"),
                           "is not valid JSON text") from None
    ports = config.get("ports")
    if ports is not None and not 1 <= ports <= 65535:
        raise _Invalid(("ports",), f"must be between 1 and 65535; got {ports!r}")
    pool = config.get("pool")
    policy = config.get("replica_policy")
    if policy is not None and pool:
        raise _Invalid(("replica_policy",), "a pool takes 'workers' (or min_workers and "
                                            "max_workers), not 'replica_policy'")
    simple = config.get("replicas")
    workers = config.get("workers")
    if simple is not None and workers is not None:
        raise _Invalid(("replicas",), "give either 'replicas' or 'workers', not both")
    if simple is not None and pool:
        raise _Invalid(("replicas",), "a pool takes 'workers', not 'replicas'")
    if simple is None:
        simple = workers
    queue = min_workers = max_workers = None
    if isinstance(pool, dict):
        queue = pool.get("queue_length_threshold")
        min_workers, max_workers = pool.get("min_workers"), pool.get("max_workers")
        workers = pool.get("workers", workers)
        if min_workers is None and max_workers is None and workers is None:
            raise _Invalid(("pool",), "set 'workers', or both 'min_workers' and 'max_workers'")
        if queue is not None and max_workers is None:
            raise _Invalid(("pool",), "'max_workers' must be set with 'queue_length_threshold'")
        if min_workers is not None and max_workers is None:
            raise _Invalid(("pool",), "'max_workers' must be set with 'min_workers'")
        if min_workers is not None and max_workers is not None and min_workers > max_workers:
            raise _Invalid(("pool",), f"min_workers ({min_workers}) must be <= max_workers "
                                      f"({max_workers})")
    spec: dict[str, Any] = {"target_qps_per_replica": None, "max_replicas": None}
    if policy is None or simple is not None:
        if simple is not None:
            min_replicas = simple
        elif workers is not None:
            min_replicas = workers
        else:
            min_replicas = DEFAULT_MIN_REPLICAS
        if pool is not None and max_workers is not None:
            min_replicas = min_workers if min_workers is not None else min_replicas
        spec.update(min_replicas=min_replicas, max_replicas=max_workers,
                    upscale_delay_seconds=pool.get("upscale_delay_seconds")
                    if isinstance(pool, dict) else None,
                    downscale_delay_seconds=pool.get("downscale_delay_seconds")
                    if isinstance(pool, dict) else None)
        where: Path = ("pool",) if pool is not None else ("replicas",)
    else:
        spec.update({k: policy.get(k) for k in _REPLICA_POLICY})
        where = ("replica_policy",)
    lb_policy = config.get("load_balancing_policy")
    qps = spec["target_qps_per_replica"]
    if isinstance(qps, dict) and lb_policy != "instance_aware_least_load":
        raise _Invalid(("load_balancing_policy",), "a target_qps_per_replica per accelerator "
                                                   "needs 'instance_aware_least_load'")
    if lb_policy == "instance_aware_least_load" and not isinstance(qps, dict):
        raise _Invalid(("replica_policy", "target_qps_per_replica"),
                       "'instance_aware_least_load' needs a target_qps_per_replica per "
                       "accelerator ({H100: qps, ...})")
    # SkyServiceSpec.__init__
    if pool:
        unsupported = {
            "num_overprovision": spec.get("num_overprovision"),
            "target_qps_per_replica": qps,
            "base_ondemand_fallback_replicas": spec.get("base_ondemand_fallback_replicas"),
            "dynamic_ondemand_fallback": spec.get("dynamic_ondemand_fallback"),
            "spot_placer": spec.get("spot_placer"),
            "load_balancing_policy": lb_policy, "ports": ports, "post_data": post_data,
            "tls": config.get("tls"),
            "headers": None if isinstance(readiness, str) else readiness.get("headers"),
        }
        if spec["max_replicas"] is None:
            unsupported["upscale_delay_seconds"] = spec.get("upscale_delay_seconds")
            unsupported["downscale_delay_seconds"] = spec.get("downscale_delay_seconds")
        for name, value in unsupported.items():
            if value is not None:
                raise _Invalid(("pool",), f"{name} is not supported for a pool")
    min_replicas, max_replicas = spec["min_replicas"], spec["max_replicas"]
    if max_replicas is not None and max_replicas < min_replicas:
        raise _Invalid(where, f"max_replicas ({max_replicas}) must be >= min_replicas "
                              f"({min_replicas})")
    if qps is not None:
        if max_replicas is None:
            raise _Invalid(where, "max_replicas must be set where target_qps_per_replica is")
    elif not pool and max_replicas is not None and max_replicas != min_replicas:
        raise _Invalid(where, f"min_replicas ({min_replicas}) and max_replicas "
                              f"({max_replicas}) differ but target_qps_per_replica is not "
                              "set: set it to autoscale, or make them equal")
    if not path.startswith("/"):
        raise _Invalid(("readiness_probe",), f"the readiness path must start with '/'; "
                                             f"got {path!r}")
    if lb_policy is not None and lb_policy not in LB_POLICIES:
        raise _Invalid(("load_balancing_policy",), f"unknown load balancing policy "
                                                   f"{lb_policy!r} (names are lower case)")


def problems(service: Any = None, pool: Any = None) -> list[tuple[tuple[str, ...], str]]:
    """The first problem SkyPilot finds in ``service`` (envs already filled in) or in the
    top-level ``pool``, as ``(path from the top of the task, message)``; [] when none."""
    try:
        if service is not None:
            _spec(service)
        elif pool is not None:
            _spec({"pool": pool} if isinstance(pool, dict) else {"pool": {}})
    except _Invalid as exc:  # a top-level pool is checked as {pool: ...}: its path fits
        return [((*(("service",) if service is not None else ()), *exc.path), exc.message)]
    return []
