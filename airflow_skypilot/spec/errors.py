"""Validation problems that point at the file, the line and the field.

A task is checked completely before anything is submitted; every problem found is reported at
once, one line each, in the form ``FILE:LINE: field.path: what is wrong``.
"""

from __future__ import annotations

from dataclasses import dataclass

from airflow_skypilot.exceptions import SkyPilotError


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a task, located as precisely as the source allows."""

    path: str
    message: str
    file: str = "<task>"
    line: int | None = None
    column: int | None = None

    def __str__(self) -> str:
        where = self.file
        if self.line is not None:
            where += f":{self.line}"
            if self.column is not None:
                where += f":{self.column}"
        field = f" {self.path}:" if self.path else ""
        return f"{where}:{field} {self.message}"


class TaskValidationError(SkyPilotError, ValueError):
    """The task YAML is invalid; ``problems`` lists every problem found."""

    def __init__(self, problems: list[Problem]):
        self.problems = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))
