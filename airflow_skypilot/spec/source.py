"""YAML loading that remembers where every value came from.

PyYAML's composer gives nodes with marks; we construct plain Python data from them and keep a
map from field path (a tuple of keys and list indices) to the 1-based line of that field, so a
problem found later (by pydantic or by our own checks) can name ``file:line``.

The text may come from a DAG run's ``conf`` (a templated ``task``), so it is bounded: at most
:data:`MAX_YAML_BYTES` of text, :data:`MAX_YAML_ALIASES` aliases, :data:`MAX_YAML_NODES` values
once aliases are expanded (a 350-byte "billion laughs" would otherwise take 1.2 GB and many
seconds) and :data:`MAX_YAML_DEPTH` levels of nesting. A value PyYAML cannot build (a date
like ``2001-13-01``, an integer of 5000 digits) is a problem at its line, like any other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml

from airflow_skypilot.spec.errors import Problem, TaskValidationError

Path = tuple[str | int, ...]

#: the largest task YAML text (bytes, UTF-8) that is parsed at all; SkyPilot's own examples
#: are under 13 KB
MAX_YAML_BYTES = 1024 * 1024
#: the most aliases (``*name``) one YAML text may use; SkyPilot's examples use none
MAX_YAML_ALIASES = 100
#: the most values (mappings, lists, scalars; keys included) the data may have once every
#: alias is expanded; SkyPilot's examples have at most ~70
MAX_YAML_NODES = 20_000
#: the deepest nesting of mappings and lists
MAX_YAML_DEPTH = 64


@dataclass
class Source:
    """Parsed YAML data plus the line of every field path in it."""

    data: Any
    file: str = "<task>"
    lines: dict[Path, int] = field(default_factory=dict)
    warnings: list[Problem] = field(default_factory=list)

    def line_of(self, path: Path) -> int | None:
        """The line of ``path``, or of its nearest ancestor that has one."""
        path = tuple(path)
        while path:
            if path in self.lines:
                return self.lines[path]
            path = path[:-1]
        return self.lines.get((), None)

    def problem(self, path: Path, message: str) -> Problem:
        return Problem(path=dotted(path), message=message, file=self.file, line=self.line_of(path))


def dotted(path: Path) -> str:
    """``('resources', 'any_of', 0, 'cpus')`` -> ``resources.any_of[0].cpus``."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


class _Loader(yaml.SafeLoader):
    """SafeLoader; plain scalars keep SkyPilot's (PyYAML's) resolution rules. Counts what it
    composes: more than :data:`MAX_YAML_ALIASES` aliases or :data:`MAX_YAML_NODES` values are
    refused before the rest of the text is even scanned."""

    aliases = 0
    nodes = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        mark = self.peek_event().start_mark
        if self.check_event(yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > MAX_YAML_ALIASES:
                raise _Refused(f"more than {MAX_YAML_ALIASES} YAML aliases (*name): refused "
                               "(a YAML alias bomb?)", mark.line + 1)
        else:
            self.nodes += 1
            if self.nodes > MAX_YAML_NODES:
                raise _Refused(f"more than {MAX_YAML_NODES} values: refused", mark.line + 1)
        return super().compose_node(parent, index)


class _Refused(Exception):
    """The text is over one of the limits above."""

    def __init__(self, message: str, line: int | None = None):
        super().__init__(message)
        self.line = line


class _Budget:
    """Values still allowed (aliases expanded) while the data is built."""

    def __init__(self) -> None:
        self.left = MAX_YAML_NODES

    def spend(self, node: yaml.Node, depth: int) -> None:
        self.left -= 1
        if self.left < 0:
            raise _Refused(f"more than {MAX_YAML_NODES} values once YAML aliases are "
                           "expanded: refused (a YAML alias bomb?)", node.start_mark.line + 1)
        if depth > MAX_YAML_DEPTH:
            raise _Refused(f"nested more than {MAX_YAML_DEPTH} levels deep: refused",
                           node.start_mark.line + 1)


def load_yaml(text: str, file: str = "<task>") -> list[Source]:
    """Parse every YAML document in ``text``; raises TaskValidationError on syntax errors and
    on text over the limits (size, aliases, values, depth)."""
    if len(text) > MAX_YAML_BYTES or len(text.encode("utf-8", "replace")) > MAX_YAML_BYTES:
        raise TaskValidationError([too_large(file)])
    try:
        nodes = _compose_all(text)
    except _Refused as exc:
        raise TaskValidationError([Problem(path="", message=str(exc), file=file,
                                           line=exc.line)]) from None
    except RecursionError:
        raise TaskValidationError([Problem(
            path="", file=file, message="nested too deeply to parse: refused")]) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else None
        column = mark.column + 1 if mark else None
        what = exc.problem or str(exc)
        if exc.context:
            what = f"{exc.context}: {what}"
        raise TaskValidationError(
            [Problem(path="", message=f"YAML syntax error: {what}", file=file, line=line,
                     column=column)]
        ) from None
    except yaml.YAMLError as exc:
        raise TaskValidationError(
            [Problem(path="", message=f"YAML error: {exc}", file=file)]
        ) from None
    sources = []
    loader = _Loader("")
    budget = _Budget()
    try:
        for node in nodes:
            src = Source(data=None, file=file)
            if node is not None:
                src.lines[()] = node.start_mark.line + 1
                try:
                    src.data = _construct(node, (), src, loader, budget)
                except _Refused as exc:
                    raise TaskValidationError([Problem(path="", message=str(exc), file=file,
                                                       line=exc.line)]) from None
            sources.append(src)
    finally:
        loader.dispose()
    return sources


def too_large(file: str) -> Problem:
    return Problem(path="", file=file, message=f"the task YAML is larger than "
                                               f"{MAX_YAML_BYTES} bytes: refused")


def _compose_all(text: str) -> list[yaml.Node]:
    loader = _Loader(text)
    try:
        nodes = []
        while loader.check_node():
            nodes.append(loader.get_node())
        return nodes
    finally:
        loader.dispose()


def _construct(node: yaml.Node, path: Path, src: Source, loader: _Loader,
               budget: _Budget) -> Any:
    budget.spend(node, len(path))
    try:
        if isinstance(node, yaml.MappingNode):
            loader.flatten_mapping(node)
            out: dict[Any, Any] = {}
            for key_node, value_node in node.value:
                budget.spend(key_node, len(path) + 1)
                key = _scalar(loader, key_node)
                if isinstance(key, (list, dict)):
                    raise TaskValidationError([Problem(
                        path=dotted(path), message="a mapping key must be a plain value",
                        file=src.file, line=key_node.start_mark.line + 1)])
                child = (*path, key)
                if key in out:
                    raise TaskValidationError([Problem(
                        path=dotted(child),
                        message=f"duplicate key (also at line {src.lines[child]}); remove one",
                        file=src.file, line=key_node.start_mark.line + 1)])
                src.lines[child] = key_node.start_mark.line + 1
                out[key] = _construct(value_node, child, src, loader, budget)
            return out
        if isinstance(node, yaml.SequenceNode):
            items = []
            for index, item in enumerate(node.value):
                child = (*path, index)
                src.lines[child] = item.start_mark.line + 1
                items.append(_construct(item, child, src, loader, budget))
            return items
        return _scalar(loader, node)
    except yaml.constructor.ConstructorError as exc:
        mark = exc.problem_mark
        raise TaskValidationError([Problem(
            path=dotted(path), message=f"YAML error: {exc.problem}", file=src.file,
            line=mark.line + 1 if mark else None)]) from None


def _scalar(loader: _Loader, node: yaml.Node) -> Any:
    """A key or a leaf. A complex key (a mapping or list) is built by PyYAML itself, which
    shares aliases, so it cannot blow up; it is refused by the caller."""
    try:
        return loader.construct_object(node, deep=True)
    except (ValueError, OverflowError) as exc:  # a date like 2001-13-01, a 5000-digit int
        if isinstance(exc, TaskValidationError):
            raise
        raise yaml.constructor.ConstructorError(
            None, None, f"cannot read {node.value!r}: {exc}"
            if isinstance(node.value, str) and len(node.value) <= 40
            else f"cannot read this value: {exc}", node.start_mark) from None
