"""YAML loading that remembers where every value came from.

PyYAML's composer gives nodes with marks; we construct plain Python data from them and keep a
map from field path (a tuple of keys and list indices) to the 1-based line of that field, so a
problem found later (by pydantic or by our own checks) can name ``file:line``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml

from airflow_skypilot.spec.errors import Problem, TaskValidationError

Path = tuple[str | int, ...]


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
    """SafeLoader; plain scalars keep SkyPilot's (PyYAML's) resolution rules."""


def load_yaml(text: str, file: str = "<task>") -> list[Source]:
    """Parse every YAML document in ``text``; raises TaskValidationError on syntax errors."""
    try:
        nodes = list(yaml.compose_all(text, Loader=_Loader))
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
    try:
        for node in nodes:
            src = Source(data=None, file=file)
            if node is not None:
                src.lines[()] = node.start_mark.line + 1
                src.data = _construct(node, (), src, loader)
            sources.append(src)
    finally:
        loader.dispose()
    return sources


def _construct(node: yaml.Node, path: Path, src: Source, loader: _Loader) -> Any:
    try:
        if isinstance(node, yaml.MappingNode):
            loader.flatten_mapping(node)
            out: dict[Any, Any] = {}
            for key_node, value_node in node.value:
                key = loader.construct_object(key_node, deep=True)
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
                out[key] = _construct(value_node, child, src, loader)
            return out
        if isinstance(node, yaml.SequenceNode):
            items = []
            for index, item in enumerate(node.value):
                child = (*path, index)
                src.lines[child] = item.start_mark.line + 1
                items.append(_construct(item, child, src, loader))
            return items
        return loader.construct_object(node, deep=True)
    except yaml.constructor.ConstructorError as exc:
        mark = exc.problem_mark
        raise TaskValidationError([Problem(
            path=dotted(path), message=f"YAML error: {exc.problem}", file=src.file,
            line=mark.line + 1 if mark else None)]) from None
