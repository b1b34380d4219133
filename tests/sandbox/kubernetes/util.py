"""Small Kubernetes semantics the emulator needs: quantities, times, names, patches.

They live apart from the server so the scheduler, the kubelet and the API share one
definition of "what a real cluster would accept", and so they can be unit-tested alone.
"""

import base64
import copy
import datetime
import json
import re
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

import jsonpatch

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 1000),
    "": Fraction(1),
    "k": Fraction(10**3),
    "M": Fraction(10**6),
    "G": Fraction(10**9),
    "T": Fraction(10**12),
    "P": Fraction(10**15),
    "E": Fraction(10**18),
}
_QUANTITY = re.compile(r"^([+-]?[0-9.]+)([eE][+-]?[0-9]+|Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]?)$")


def parse_quantity(value: object) -> Fraction:
    """Parse a resource quantity ("500m", "64Gi", 8) so requests can be summed exactly."""
    if isinstance(value, (int, float)):
        return Fraction(value)
    text = str(value).strip()
    match = _QUANTITY.match(text)
    if not match:
        raise ValueError(f"quantities must match the regular expression: {text!r}")
    number, suffix = Fraction(match.group(1)), match.group(2)
    if suffix in _BINARY:
        return number * _BINARY[suffix]
    if suffix and suffix[0] in "eE":
        return number * Fraction(10) ** int(suffix[1:])
    return number * _DECIMAL[suffix]


def now() -> datetime.datetime:
    """The current UTC time (one place to change if tests ever need a fake clock)."""
    return datetime.datetime.now(tz=datetime.timezone.utc)


def rfc3339(moment: datetime.datetime | None = None) -> str:
    """Second-precision RFC 3339, as the API server writes metadata and status times."""
    return (moment or now()).strftime("%Y-%m-%dT%H:%M:%SZ")


def rfc3339_nano(moment: datetime.datetime | None = None) -> str:
    """Nanosecond RFC 3339, as the kubelet prefixes log lines with ``timestamps=true``."""
    moment = moment or now()
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond:06d}000Z"


def parse_time(text: str) -> datetime.datetime:
    """Parse an RFC 3339 time as written by :func:`rfc3339` or :func:`rfc3339_nano`."""
    text = text.strip().replace("Z", "+00:00")
    match = re.match(r"^(.*T\d\d:\d\d:\d\d)(\.\d+)?(.*)$", text)
    if match and match.group(2):  # Python parses at most 6 fractional digits
        text = match.group(1) + match.group(2)[:7] + match.group(3)
    return datetime.datetime.fromisoformat(text)


def clone(obj: Any) -> Any:
    """Deep-copy a JSON document, so stored objects never alias what callers mutate."""
    return copy.deepcopy(obj)


# Names, as the API server validates them (apimachinery/pkg/util/validation).
_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_SUBDOMAIN = re.compile(
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
)
_DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")


def name_errors(name: str, kind: str) -> list[str]:
    """Why ``name`` is not a valid object name for ``kind`` (empty when it is)."""
    if kind in ("Namespace",):
        if len(name) > 63 or not _DNS1123_LABEL.match(name):
            return [
                f"a lowercase RFC 1123 label must consist of lower case alphanumeric characters "
                f"or '-', and must start and end with an alphanumeric character (e.g. "
                f"'my-name',  or '123-abc', regex used for validation is "
                f"'{_DNS1123_LABEL.pattern[1:-1]}')"
            ]
        return []
    if kind == "Service":
        if len(name) > 63 or not _DNS1035_LABEL.match(name):
            return [
                "a DNS-1035 label must consist of lower case alphanumeric characters or '-', "
                "start with an alphabetic character, and end with an alphanumeric character "
                "(e.g. 'my-name',  or 'abc-123', regex used for validation is "
                f"'{_DNS1035_LABEL.pattern[1:-1]}')"
            ]
        return []
    if len(name) > 253 or not _DNS1123_SUBDOMAIN.match(name):
        return [
            "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, "
            "'-' or '.', and must start and end with an alphanumeric character (e.g. "
            "'example.com', regex used for validation is "
            f"'{_DNS1123_SUBDOMAIN.pattern[1:-1]}')"
        ]
    return []


def label_errors(labels: Mapping[str, Any] | None, field: str) -> list[tuple[str, str]]:
    """(field, message) for each label key or value a real API server would reject."""
    errors: list[tuple[str, str]] = []
    for key, value in (labels or {}).items():
        prefix, _, name = str(key).rpartition("/")
        if (prefix and (len(prefix) > 253 or not _DNS1123_SUBDOMAIN.match(prefix))) or (
            len(name) > 63 or not _LABEL_NAME.match(name)
        ):
            errors.append(
                (
                    field,
                    f'Invalid value: "{key}": name part must consist of '
                    "alphanumeric characters, '-', '_' or '.', and must start "
                    "and end with an alphanumeric character",
                )
            )
        if not isinstance(value, str):
            errors.append((f"{field}.{key}", f"Invalid value: {value!r}: must be a string"))
        elif len(value) > 63:
            errors.append((field, f'Invalid value: "{value}": must be no more than 63 characters'))
        elif not _LABEL_VALUE.match(value):
            errors.append(
                (
                    field,
                    f'Invalid value: "{value}": a valid label must be an empty '
                    "string or consist of alphanumeric characters, '-', '_' or "
                    "'.', and must start and end with an alphanumeric character",
                )
            )
    return errors


# Patches. Strategic merge is approximated: the lists the sandbox's users patch are merged by
# their Kubernetes merge key; every other list is replaced, as in a JSON merge patch.
_MERGE_KEYS = {
    "conditions": "type",
    "containers": "name",
    "initContainers": "name",
    "containerStatuses": "name",
    "initContainerStatuses": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
    "ownerReferences": "uid",
    "imagePullSecrets": "name",
    "addresses": "type",
}


def merge_patch(target: Any, patch: Any, strategic: bool = False) -> Any:
    """Apply an RFC 7386 merge patch (``strategic`` also merges keyed lists)."""
    if not isinstance(patch, Mapping):
        return clone(patch)
    result = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if key.startswith("$"):  # strategic-merge directives: not supported, ignore
            continue
        if value is None:
            result.pop(key, None)
        elif isinstance(value, Mapping):
            result[key] = merge_patch(result.get(key), value, strategic)
        elif (
            strategic
            and isinstance(value, list)
            and key in _MERGE_KEYS
            and isinstance(result.get(key), list)
        ):
            merge_key = _MERGE_KEYS[key]
            merged = [clone(item) for item in result[key]]
            for item in value:
                if not isinstance(item, Mapping) or merge_key not in item:
                    merged.append(clone(item))
                    continue
                for index, old in enumerate(merged):
                    if isinstance(old, Mapping) and old.get(merge_key) == item[merge_key]:
                        merged[index] = merge_patch(old, item, strategic)
                        break
                else:
                    merged.append(clone(item))
            result[key] = merged
        elif strategic and key == "finalizers" and isinstance(result.get(key), list):
            result[key] = list(dict.fromkeys([*result[key], *value]))
        else:
            result[key] = clone(value)
    return result


def apply_patch(obj: dict[str, Any], body: Any, content_type: str) -> dict[str, Any]:
    """Apply a PATCH body according to its content type, as the API server does."""
    content_type = content_type.split(";")[0].strip().lower()
    if content_type == "application/json-patch+json" or isinstance(body, list):
        return jsonpatch.apply_patch(clone(obj), body, in_place=False)
    if content_type == "application/merge-patch+json":
        return merge_patch(obj, body)
    if content_type in ("application/strategic-merge-patch+json", "application/json", ""):
        return merge_patch(obj, body, strategic=True)
    raise ValueError(content_type)


def secret_string_data(secret: dict[str, Any]) -> dict[str, Any]:
    """Fold ``stringData`` into base64 ``data`` like the API server (stringData is write-only)."""
    data = dict(secret.get("data") or {})
    for key, value in (secret.pop("stringData", None) or {}).items():
        data[key] = base64.b64encode(str(value).encode()).decode()
    secret["data"] = data
    return secret


def compact_indexes(indexes: set[int]) -> str:
    """Format completed indexes as the Job status does: "0-2,5"."""
    parts: list[str] = []
    ordered = sorted(indexes)
    start = prev = None
    for index in ordered:
        if start is None:
            start = prev = index
        elif prev is not None and index == prev + 1:
            prev = index
        else:
            parts.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = index
    if start is not None:
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ",".join(parts)


def dumps(obj: Any) -> bytes:
    """Serialise a response body compactly (the client libraries do not care about spacing)."""
    return json.dumps(obj, separators=(",", ":")).encode()
