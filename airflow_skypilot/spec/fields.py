"""Parsers for the SkyPilot resource fields that have a text syntax of their own.

Each takes the raw YAML value and returns a normalised value or raises :class:`FieldError`
with a message that says what is expected. They follow SkyPilot 0.14 (sky/resources.py,
sky/utils/resources_utils.py, sky/utils/infra_utils.py); where we are stricter it is said.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

from airflow_skypilot.spec import accelerators as acc


class FieldError(ValueError):
    """A single field's value is wrong; the caller knows the field path. ``where`` is the
    entry of a mapping or list value at fault (``("H100",)``), so the error names its line."""

    def __init__(self, message: str, where: tuple[str | int, ...] = ()):
        super().__init__(message)
        self.where = where


_MEMORY_UNITS = {"kb": 2**-20, "ki": 2**-20, "mb": 2**-10, "mi": 2**-10, "gb": 1, "gi": 1,
                 "tb": 2**10, "ti": 2**10, "pb": 2**20, "pi": 2**20}

#: Clouds SkyPilot knows (sky/skylet/constants.py ALL_CLOUDS). We run on three of them; the
#: others are valid YAML that simply matches no connection here.
ALL_CLOUDS = ("aws", "azure", "gcp", "ibm", "lambda", "scp", "oci", "kubernetes", "runpod", "vast",
              "vsphere", "cudo", "fluidstack", "paperspace", "primeintellect", "do", "nebius",
              "ssh", "slurm", "hyperbolic", "seeweb", "shadeform", "yotta", "mithril", "verda")
SUPPORTED_CLOUDS = ("aws", "kubernetes", "slurm")

DISK_TIERS = ("low", "medium", "high", "ultra", "best")
NETWORK_TIERS = ("standard", "best")
RECOVERY_STRATEGIES = ("EAGER_NEXT_REGION", "FAILOVER")


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if value == value and value not in (float("inf"), float("-inf")) else None


def _num_text(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def parse_cpus(value: Any) -> str:
    """``8`` / ``"8"`` / ``"8+"`` / ``0.5`` -> SkyPilot's text form, positive."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise FieldError(f'must be a number or a string "<number>+"; got {value!r}')
    text = str(value).strip()
    number = _number(text[:-1] if text.endswith("+") else text)
    if number is None:
        raise FieldError(f'must be a number (e.g. 8) or "<number>+" for at least; got {value!r}')
    if number <= 0:
        raise FieldError(f"must be positive; got {value!r}")
    return text


def parse_memory(value: Any) -> str:
    """Memory in GB, in SkyPilot's text form: ``16`` -> ``"16"``, ``"16+"``, ``"16GB"`` ->
    ``"16.0"``, ``"1TB+"`` -> ``"1024.0+"``; ``"3x"`` (memory per CPU) is kept as is."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise FieldError(f'must be a number of GB or "<number><unit>"; got {value!r}')
    text = str(value).strip()
    suffix = ""
    if text.endswith(("+", "x")):
        text, suffix = text[:-1], text[-1]
    number = _number(text)
    if number is not None:
        out = text
    else:
        out = None
        lower = text.lower()
        for unit, factor in _MEMORY_UNITS.items():
            if lower.endswith(unit) and (n := _number(lower[: -len(unit)])) is not None:
                number = n * factor
                out = str(float(number))
                break
    if number is None or out is None:
        raise FieldError(
            'must be a number of GB (e.g. 16) or "<number><unit>" with unit KB/MB/GB/TB/PB '
            f'(e.g. "16GB"), optionally ending in "+" for at least; got {value!r}')
    if number < 0:
        raise FieldError(f"must be positive; got {value!r}")
    return out + suffix


def memory_number(text: str) -> float:
    """The number of :func:`parse_memory`'s text, whatever it ends in: ``"0x"`` -> 0.0 (zero
    memory per CPU is zero memory, which SkyPilot allows on Slurm only)."""
    return float(text.rstrip("+x"))


def split_at_least(text: str | None) -> tuple[float | None, bool]:
    """``"8+"`` -> (8.0, True); ``"8"`` -> (8.0, False); None or ``"3x"`` -> (None, False)."""
    if text is None or text.endswith("x"):
        return None, False
    if text.endswith("+"):
        return float(text[:-1]), True
    return float(text), False


def parse_disk_size(value: Any) -> int:
    """Disk size in GB: ``256`` or ``"256GB"`` / ``"1TB"``; a whole number of GB."""
    if isinstance(value, bool):
        raise FieldError(f"must be a whole number of GB or a size like '256GB'; got {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise FieldError(f"must be positive; got {value!r}")
        return value
    if isinstance(value, str):
        match = re.fullmatch(r"([0-9]+)\s*([A-Za-z]{0,2})", value.strip())
        if match:
            number, unit = int(match.group(1)), match.group(2).lower()
            factor = 1 if unit == "" else _MEMORY_UNITS.get(unit)
            if factor is not None:
                size = number * factor
                if size > 0 and float(size).is_integer():
                    return int(size)
                if size > 0:
                    raise FieldError(f"must be a whole number of GB; {value!r} is {size} GB")
    raise FieldError(
        f"must be a whole number of GB or a size like '256GB' or '1TB'; got {value!r}")


def parse_ports(value: Any) -> tuple[str, ...]:
    """``8080`` / ``"8080,9000"`` / ``"10000-10010"`` / a list -> sorted merged ranges, as
    SkyPilot stores them (``[8080, "8079-8081"]`` -> ``("8079-8081",)``)."""
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    ports: set[int] = set()
    for i, item in enumerate(items):
        at = (i,) if isinstance(value, list) else ()
        if isinstance(item, bool) or not isinstance(item, (int, str)):
            raise FieldError(f"a port must be a number or 'from-to'; got {item!r}", at)
        for token in str(item).split(","):
            text = token.strip()
            parts = text.split("-")
            if len(parts) > 2 or not all(p.isdigit() for p in parts):
                raise FieldError(f"a port must be a number or a range 'from-to'; got {text!r}",
                                 at)
            if not all(1 <= int(p) <= 65535 for p in parts):
                raise FieldError(f"a port must be between 1 and 65535; got {text!r}", at)
            low, high = int(parts[0]), int(parts[-1])
            if low > high:
                raise FieldError(f"port range {text!r} ends before it starts", at)
            ports.update(range(low, high + 1))
    out: list[str] = []
    for port in sorted(ports):
        if out and "-" in out[-1] and int(out[-1].split("-")[1]) == port - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{port}"
        elif out and "-" not in out[-1] and int(out[-1]) == port - 1:
            out[-1] = f"{out[-1]}-{port}"
        else:
            out.append(str(port))
    return tuple(out)


def parse_choice(value: Any, choices: tuple[str, ...], what: str) -> str:
    """A case-insensitive choice, returned lower-case."""
    if not isinstance(value, str) or value.lower() not in choices:
        raise FieldError(f"unknown {what} {value!r}; expected one of {', '.join(choices)}")
    return value.lower()


def parse_labels(value: Any) -> dict[str, str]:
    if not isinstance(value, dict):
        raise FieldError(f"must be a mapping of label names to strings; got {value!r}")
    for key, val in value.items():
        if not isinstance(val, str):
            raise FieldError(f"label {key!r} must be a string; got {val!r}", (key,))
    return {str(k): v for k, v in value.items()}


_TIME_UNITS = {"m": 1, "h": 60, "d": 24 * 60, "w": 7 * 24 * 60}


def parse_autostop(value: Any) -> dict[str, Any] | None:
    """SkyPilot's autostop: bool, minutes, ``"10m"``/``"1h"``, or ``{idle_minutes, down, ...}``.

    Kept for fidelity (and cloud VMs); a batch job on Slurm/Kubernetes ends when it ends.
    """
    if value is None:
        return None
    if isinstance(value, bool):
        return {"enabled": value}
    if isinstance(value, int):
        if value < 0:
            raise FieldError(f"must be >= 0 minutes; got {value!r}")
        return {"enabled": True, "idle_minutes": value}
    if isinstance(value, str):
        match = re.fullmatch(r"([0-9]+)([mhdwMHDW]?)", value.strip())
        if not match:
            raise FieldError(f"must be minutes or a duration like '10m', '1h'; got {value!r}")
        minutes = int(match.group(1)) * _TIME_UNITS.get(match.group(2).lower() or "m", 1)
        return {"enabled": True, "idle_minutes": minutes}
    if isinstance(value, dict):
        allowed = {"idle_minutes", "down", "wait_for", "hook", "hook_timeout"}
        unknown = sorted(set(value) - allowed)
        if unknown:
                raise FieldError(f"unknown key {unknown[0]!r}; allowed: "
                             f"{', '.join(sorted(allowed))}", (unknown[0],))
        idle = value.get("idle_minutes")
        if idle is not None and (isinstance(idle, bool) or not isinstance(idle, int) or idle < 0):
            raise FieldError(f"idle_minutes must be a whole number >= 0; got {idle!r}",
                             ("idle_minutes",))
        down = value.get("down")
        if down is not None and not isinstance(down, bool):
            raise FieldError(f"down must be true or false; got {down!r}", ("down",))
        wait_for = value.get("wait_for")
        if wait_for is not None and str(wait_for).lower() not in ("jobs_and_ssh", "jobs", "none"):
            raise FieldError(f"wait_for must be jobs_and_ssh, jobs or none; got {wait_for!r}",
                             ("wait_for",))
        return {"enabled": True, **value}
    raise FieldError(f"must be true/false, minutes, a duration or a mapping; got {value!r}")


def parse_image_id(value: Any) -> str | dict[str, str] | None:
    """A string (``docker:<image>`` for a container image) or a mapping region -> image."""
    if value is None:
        return None
    if isinstance(value, str):
        if value.startswith("docker:") and not value[len("docker:"):].strip():
            raise FieldError("'docker:' must be followed by an image name")
        return value
    if isinstance(value, dict):
        for key, val in value.items():
            if not isinstance(val, str):
                raise FieldError(f"image for {key!r} must be a string; got {val!r}", (key,))
        return {str(k): v for k, v in value.items()}
    raise FieldError(f"must be a string or a mapping of region to image; got {value!r}")


#: clouds whose every image is a container image: SkyPilot's Kubernetes (and SSH node pools,
#: a Kubernetes too) read a bare ``image_id: repo/img:tag`` as ``docker:repo/img:tag``
CONTAINER_CLOUDS = ("kubernetes", "ssh")


def as_container_image(image_id: str | dict[str, str] | None) -> str | dict[str, str] | None:
    """``image_id`` of a candidate on a :data:`CONTAINER_CLOUDS` cloud, each image with the
    ``docker:`` prefix (sky/resources.py ``_maybe_add_docker_prefix_to_image_id``)."""
    def prefixed(image: str) -> str:
        image = image.strip()
        return image if image.startswith("docker:") else f"docker:{image}"

    if isinstance(image_id, str):
        return prefixed(image_id)
    if isinstance(image_id, dict):
        return {k: prefixed(v) for k, v in image_id.items()}
    return image_id


def docker_image(image_id: str | dict[str, str] | None) -> str | None:
    """The container image named by ``image_id: docker:<image>``, else None."""
    if isinstance(image_id, str) and image_id.startswith("docker:"):
        return image_id[len("docker:"):].strip()
    return None


# --- infra -------------------------------------------------------------------------------


def parse_infra(value: Any) -> str:
    """Canonical infra: ``k8s`` -> ``kubernetes``; ``slurm/<cluster>[/<partition>]``;
    ``aws/<region>[/<zone>]``; ``*`` wildcards kept; clouds lower-case."""
    if not isinstance(value, str):
        raise FieldError(f"must be a string like 'aws/us-east-1' or 'k8s'; got {value!r}")
    text = value.strip()
    if not text:
        raise FieldError("must not be empty")
    parts = [p.strip() for p in text.split("/")]
    if "" in parts:
        raise FieldError(f"{value!r} has an empty part (like 'aws//x' or 'aws/')")
    cloud = parts[0].lower()
    if cloud in ("k8s", "kubernetes"):
        return "/".join(["kubernetes", *parts[1:]])  # the rest is the context, slashes and all
    if cloud == "ssh":
        return "/".join(["ssh", *parts[1:]])
    if cloud != "*" and cloud not in ALL_CLOUDS:
        raise FieldError(f"unknown cloud {parts[0]!r}; expected one of: "
                         f"{', '.join(sorted({*ALL_CLOUDS, 'k8s'}))} or '*'")
    if len(parts) > 3:
        raise FieldError(f"{value!r} has too many parts; expected cloud[/region[/zone]]")
    parts = [cloud, *parts[1:]]
    while len(parts) > 1 and parts[-1] == "*":  # SkyPilot drops trailing wildcards
        parts.pop()
    return "/".join(parts)


def infra_from_legacy(cloud: Any, region: Any, zone: Any) -> str | None:
    """The infra string for SkyPilot's older ``cloud:``/``region:``/``zone:`` fields."""
    if cloud is None and region is None and zone is None:
        return None
    parts = [str(cloud).lower() if cloud is not None else "*"]
    if region is not None or zone is not None:
        parts.append(str(region) if region is not None else "*")
    if zone is not None:
        parts.append(str(zone))
    while len(parts) > 1 and parts[-1] == "*":
        parts.pop()
    return "/".join(parts)


def infra_matches(wanted: str | None, offered: str) -> bool:
    """Does an offer at ``offered`` (e.g. ``slurm/alpha/batch``) satisfy the infra filter?

    Each part of ``wanted`` must equal the offer's part or be ``*``; missing parts match all.
    Kubernetes contexts may contain slashes, so after ``kubernetes/`` the rest is compared whole
    against the offer's context (the offer's own namespace part is not part of infra).
    """
    if not wanted or wanted == "*":
        return True
    w = wanted.split("/")
    o = offered.split("/")
    if w[0] not in ("*", o[0]):
        return False
    if o[0] == "kubernetes" and len(w) > 1:
        return "/".join(w[1:]) == "/".join(o[1:])  # EKS: arn:...:cluster/<name>
    for i, part in enumerate(w[1:], start=1):
        if part == "*":
            continue
        if i >= len(o) or o[i] != part:
            return False
    return True


# --- accelerators -------------------------------------------------------------------------


@contextlib.contextmanager
def _at(key: str | int) -> Iterator[None]:
    """A FieldError raised inside names the entry ``key`` (of a mapping or list value)."""
    try:
        yield
    except FieldError as exc:
        raise FieldError(str(exc), (key, *exc.where)) from None


def _count(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise FieldError(f"count of {name!r} must be a positive number; got {value!r}")
    if value <= 0:
        raise FieldError(f"count of {name!r} must be a positive number; got {value!r}")
    return int(value) if float(value).is_integer() else float(value)


def _one_accelerator(text: str) -> list[tuple[str, float]]:
    """``A100`` / ``A100:8`` / ``A100:0.5`` / ``80GB+:8`` / ``nvidia:80GB:8`` -> [(name, n)];
    a name as written (``tpu-*`` lower-case), memory sizes as the catalog's devices."""
    text = text.strip()
    split = text.split(":")
    manufacturer = memory = None
    count: Any = 1
    if len(split) == 3 and acc.memory_spec(split[1]):
        manufacturer, memory, count = split
    elif len(split) == 2 and acc.memory_spec(split[0]):
        memory, count = split
    elif len(split) == 2 and acc.memory_spec(split[1]):
        manufacturer, memory = split
    elif len(split) == 1 and acc.memory_spec(split[0]):
        memory = split[0]
    elif len(split) == 1:
        return [(_as_written(split[0]), 1)]
    elif len(split) == 2:
        name, count = split
        if not name:
            raise FieldError(f"{text!r}: the accelerator name is missing")
        number = _number(count)
        if number is None:
            raise FieldError(f"{text!r} should be <name> or <name>:<count>")
        return [(_as_written(name), _count(number, name))]
    else:
        raise FieldError(f"{text!r} should be <name> or <name>:<count>")
    number = _number(str(count))
    if number is None or not number.is_integer():
        raise FieldError(f"{text!r}: the count must be a whole number")
    spec = acc.memory_spec(memory)
    assert spec is not None
    devices = acc.devices_by_memory(spec[0], spec[1], manufacturer)
    if not devices:
        raise FieldError(f"{text!r}: no known accelerator has that much memory")
    return [(d, _count(int(number), d)) for d in devices]


def _as_written(name: str) -> str:
    """SkyPilot keeps a name as written until it canonicalises it for a candidate's cloud
    (:func:`accelerators.canonical`); a TPU name is lower-case from the start (its cloud)."""
    return name.lower() if name.lower().startswith("tpu-") else name


def parse_accelerators(value: Any, *, single: bool = False,
                       ) -> tuple[list[tuple[str, float]], str]:
    """All SkyPilot forms -> ([(name as written, count per node)], kind).

    kind is ``"one"`` (a single accelerator), ``"any_of"`` (a mapping or set: any of them,
    SkyPilot picks the cheapest) or ``"ordered"`` (a list: in the user's order).
    ``single`` is set inside ``any_of``/``ordered`` entries, where SkyPilot allows only one.
    The same accelerator with several counts (``{A100:4, A100:8}``) is several candidates, as
    in SkyPilot (sky/resources.py ``from_yaml_config`` keeps each ``name:count`` once).
    """
    pairs: list[tuple[str, float]] = []
    if isinstance(value, str):
        # The quoted one-line set "{A100:8, H100:8}" is refused, as SkyPilot 0.14 does; the
        # unquoted form is a YAML mapping and works.
        pairs = _one_accelerator(value)
    elif isinstance(value, dict):
        if not value:
            raise FieldError("must name at least one accelerator")
        if single and len(value) > 1:
            raise FieldError("inside any_of/ordered, name one accelerator per entry")
        for name, count in value.items():
            if not isinstance(name, str):
                raise FieldError(f"accelerator names must be strings; got {name!r}", (name,))
            with _at(name):
                if count is None:
                    pairs.extend(_one_accelerator(name))
                else:
                    for dev, _ in _one_accelerator(name):
                        pairs.append((dev, _count(count, name)))
    elif isinstance(value, list):
        if single:
            raise FieldError("inside any_of/ordered, name one accelerator per entry, not a list")
        if not value:
            raise FieldError("must name at least one accelerator")
        for i, item in enumerate(value):
            if not isinstance(item, str):
                raise FieldError(f"list items must be strings like 'A100:1'; got {item!r}", (i,))
            with _at(i):
                pairs.extend(_one_accelerator(item))
    else:
        raise FieldError(
            f"must be 'NAME', 'NAME:COUNT', a mapping {{NAME: COUNT}} or a list; got {value!r}")
    unique = list(dict.fromkeys((name, float(count)) for name, count in pairs))
    out = [(name, int(count) if count.is_integer() else count) for name, count in unique]
    if isinstance(value, list):
        kind = "ordered"  # even one entry: SkyPilot keeps a list as an ordered preference
    else:
        kind = "one" if len(out) == 1 else "any_of"
    return out, kind


# --- job recovery --------------------------------------------------------------------------


def parse_job_recovery(value: Any) -> dict[str, Any]:
    """``FAILOVER`` or ``{strategy, max_restarts_on_errors, recover_on_exit_codes}``.

    Stricter than SkyPilot, which checks the strategy name only when a managed job starts:
    an unknown strategy is an error here, at load time.
    """
    default = {"strategy": None, "max_restarts_on_errors": 0, "recover_on_exit_codes": []}
    if value is None:
        return default
    mapping = isinstance(value, dict)
    if isinstance(value, str):
        value = {"strategy": value}
    if not isinstance(value, dict):
        raise FieldError(f"must be a strategy name or a mapping; got {value!r}")

    def at(key: str) -> tuple[str, ...]:  # the key's own line, when the YAML has the key
        return (key,) if mapping else ()

    allowed = {"strategy", "max_restarts_on_errors", "recover_on_exit_codes"}
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise FieldError(f"unknown key {unknown[0]!r}; allowed: {', '.join(sorted(allowed))}",
                         (unknown[0],))
    strategy = value.get("strategy")
    if strategy is not None:
        if not isinstance(strategy, str):
            raise FieldError(f"strategy must be a string; got {strategy!r}", at("strategy"))
        if strategy == "none":
            return default  # SkyPilot: exactly "none" drops the whole setting to the default
        if strategy.upper() not in RECOVERY_STRATEGIES:
            raise FieldError(f"unknown recovery strategy {strategy!r}; "
                             f"expected one of {', '.join(RECOVERY_STRATEGIES)}", at("strategy"))
        else:
            strategy = strategy.upper()
    restarts = value.get("max_restarts_on_errors", 0)
    if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < 0:
        raise FieldError(f"max_restarts_on_errors must be a whole number >= 0; got {restarts!r}",
                         at("max_restarts_on_errors"))
    codes = value.get("recover_on_exit_codes", [])
    if codes is None:
        codes = []
    if isinstance(codes, int) and not isinstance(codes, bool):
        codes = [codes]
    if not isinstance(codes, list) or any(
            isinstance(c, bool) or not isinstance(c, int) or not 0 <= c <= 255 for c in codes):
        raise FieldError("recover_on_exit_codes must be an exit code 0-255 or a list of them; "
                         f"got {value.get('recover_on_exit_codes')!r}", at("recover_on_exit_codes"))
    if len(set(codes)) != len(codes):
        raise FieldError("recover_on_exit_codes has repeated codes", at("recover_on_exit_codes"))
    return {"strategy": strategy, "max_restarts_on_errors": restarts,
            "recover_on_exit_codes": list(codes)}
