"""Label and field selectors, which kmock 0.8 ignores: the emulator filters lists itself.

Field selectors are checked against the same per-resource allow-list as a real API server,
so a selector that works here also works on a cluster (and one that a cluster rejects with
"field label not supported" is rejected here too).
"""

import re
from collections.abc import Callable, Mapping
from typing import Any

Predicate = Callable[[dict[str, Any]], bool]

_COMMON_FIELDS = {"metadata.name", "metadata.namespace"}
SUPPORTED_FIELDS: dict[str, set[str]] = {
    "pods": _COMMON_FIELDS
    | {
        "spec.nodeName",
        "spec.restartPolicy",
        "spec.schedulerName",
        "spec.serviceAccountName",
        "spec.hostNetwork",
        "status.phase",
        "status.podIP",
        "status.podIPs",
        "status.nominatedNodeName",
    },
    "events": _COMMON_FIELDS
    | {
        "involvedObject.kind",
        "involvedObject.namespace",
        "involvedObject.name",
        "involvedObject.uid",
        "involvedObject.apiVersion",
        "involvedObject.resourceVersion",
        "involvedObject.fieldPath",
        "reason",
        "reportingComponent",
        "source",
        "type",
    },
    "nodes": _COMMON_FIELDS | {"spec.unschedulable"},
    "jobs": _COMMON_FIELDS | {"status.successful"},
    "secrets": _COMMON_FIELDS | {"type"},
    "namespaces": _COMMON_FIELDS | {"status.phase"},
}


class SelectorError(ValueError):
    """A selector the API server would answer with 400 Bad Request."""


def _split_terms(text: str) -> list[str]:
    """Split on commas that are not inside ``in (a,b)`` parentheses."""
    terms: list[str] = []
    depth, current = 0, ""
    for char in text:
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        if char == "," and depth == 0:
            terms.append(current)
            current = ""
        else:
            current += char
    terms.append(current)
    return [term.strip() for term in terms if term.strip()]


_SET_TERM = re.compile(r"^([^\s!=()]+)\s+(in|notin)\s+\(([^)]*)\)$")
_EQ_TERM = re.compile(r"^([^\s!=()]+)\s*(==|=|!=)\s*([^\s!=()]*)$")
_EXISTS_TERM = re.compile(r"^(!?)\s*([^\s!=()]+)$")


def parse_label_selector(text: str | None) -> Predicate:
    """Compile ``labelSelector`` ("a=b,c in (x,y),!d") into a predicate on an object."""
    checks: list[Callable[[Mapping[str, str]], bool]] = []
    for term in _split_terms(text or ""):
        if match := _SET_TERM.match(term):
            key, op = match.group(1), match.group(2)
            values = {v.strip() for v in match.group(3).split(",") if v.strip()}
            if op == "in":
                checks.append(lambda labels, k=key, vs=values: labels.get(k) in vs)
            else:
                checks.append(lambda labels, k=key, vs=values: labels.get(k) not in vs)
        elif match := _EQ_TERM.match(term):
            key, op, value = match.groups()
            if op == "!=":
                checks.append(lambda labels, k=key, v=value: labels.get(k) != v)
            else:
                checks.append(lambda labels, k=key, v=value: labels.get(k) == v)
        elif match := _EXISTS_TERM.match(term):
            negated, key = match.group(1) == "!", match.group(2)
            checks.append(lambda labels, k=key, n=negated: (k in labels) != n)
        else:
            raise SelectorError(f"unable to parse requirement: {term!r}")

    def predicate(obj: dict[str, Any]) -> bool:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        return all(check(labels) for check in checks)

    return predicate


def field_value(obj: Mapping[str, Any], path: str) -> str:
    """The string form of a dotted field, as the API server compares field selectors."""
    value: Any = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    if path == "source" and isinstance(value, Mapping):  # events: "source" is the component
        value = value.get("component")
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):  # status.podIPs
        return ",".join(str(v.get("ip", v)) if isinstance(v, Mapping) else str(v) for v in value)
    return "" if value is None else str(value)


def parse_field_selector(text: str | None, plural: str) -> Predicate:
    """Compile ``fieldSelector`` ("spec.nodeName=n1,status.phase!=Failed") for ``plural``."""
    allowed = SUPPORTED_FIELDS.get(plural, _COMMON_FIELDS)
    checks: list[tuple[str, bool, str]] = []
    for term in _split_terms(text or ""):
        match = re.match(r"^([^=!]+?)\s*(==|=|!=)\s*(.*)$", term)
        if not match:
            raise SelectorError(f"invalid selector: '{term}'; can't understand '{term}'")
        path, op, value = match.group(1).strip(), match.group(2), match.group(3).strip()
        if path not in allowed:
            raise SelectorError(f"field label not supported: {path}")
        checks.append((path, op == "!=", value))

    def predicate(obj: dict[str, Any]) -> bool:
        return all((field_value(obj, path) == value) != negated for path, negated, value in checks)

    return predicate


def match_label_selector_object(
    selector: Mapping[str, Any] | None, labels: Mapping[str, str]
) -> bool:
    """Match a structured LabelSelector (matchLabels + matchExpressions), e.g. a Job's."""
    if not selector:
        return True
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    return all(
        match_expression(expr, labels.get(expr.get("key", "")), expr.get("key", "") in labels)
        for expr in selector.get("matchExpressions") or []
    )


def match_expression(expr: Mapping[str, Any], value: str | None, present: bool) -> bool:
    """One selector requirement (In, NotIn, Exists, DoesNotExist, Gt, Lt)."""
    operator = expr.get("operator")
    values = [str(v) for v in expr.get("values") or []]
    if operator == "In":
        return present and value in values
    if operator == "NotIn":
        return not present or value not in values
    if operator == "Exists":
        return present
    if operator == "DoesNotExist":
        return not present
    if operator in ("Gt", "Lt") and present and values:
        try:
            left, right = int(value or ""), int(values[0])
        except ValueError:
            return False
        return left > right if operator == "Gt" else left < right
    return False
