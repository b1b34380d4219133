"""``@task.skypilot``: a SkyPilot task from a Python function (TaskFlow).

The function returns the job's ``run`` script (a ``str``) or task fields (a ``dict``), merged
over the base ``task`` (a YAML path, YAML text or a dict; none: an empty task). Its arguments
may be upstream XComs, and it maps like any TaskFlow task (``train.expand(lr=[...])``).

The decorated operator *is* a :class:`SkyPilotOperator` (and a ``DecoratedOperator``): the
placement table, failover, deferral, extra link and UI page are the operator's own. The function
runs in ``execute`` right before the task is loaded; the merged task goes through the
operator's loader, so every problem is reported before anything is submitted, as
``FILE:LINE: field: problem`` for a field of the base YAML and ``NAME()'s result: field:
problem`` for a field the function returned. Secret values it returns are registered with the
masker before anything could log them. After a deferral the function is called again when the
task is needed once more (a failover, a restart, a new probe); a different answer is reported.

Merge rule: a returned field replaces the base's; a mapping field in both (``envs``,
``secrets``, ``resources``, ``file_mounts``, ``config``...) is merged one level: each returned
key replaces the base's (``resources: {accelerators: ...}`` replaces the base's accelerators and
keeps its ``cpus``). A key replaces its aliases and alternatives too (``gpus`` the base's
``accelerators``, ``ordered`` its ``any_of``, ``infra`` its ``cloud``/``region``/``zone``, ``pool``
its ``service``: :data:`airflow_skypilot.spec.model.REPLACES`). A returned ``resources`` key
(and its aliases and alternatives) is also taken out of the base's ``any_of``/``ordered``
entries, which override the top level: returned ``accelerators`` replace the entries' too. An
entry left empty stands for the top level (still a candidate); one the same as another is
dropped, and the list when only the top level is left. The result
is not a Jinja template (``{{`` in a script stays as it is).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import yaml
from airflow.sdk.bases.decorator import (
    DecoratedOperator,
    TaskDecorator,
    determine_kwargs,
    task_decorator_factory,
)
from airflow.sdk.definitions.context import context_merge
from airflow.sdk.exceptions import AirflowFailException

from airflow_skypilot.operators.skypilot import SkyPilotOperator
from airflow_skypilot.runstate import RunState
from airflow_skypilot.spec import Task, TaskValidationError, load_task
from airflow_skypilot.spec.errors import Problem
from airflow_skypilot.spec.model import REPLACES
from airflow_skypilot.spec.secrets import secret_values
from airflow_skypilot.spec.source import Source, dotted, load_yaml
from airflow_skypilot.spec.task import read_task_text

if TYPE_CHECKING:
    from airflow.sdk import Context

__all__ = ["SkyPilotDecoratedOperator", "merge_task", "skypilot_task"]

#: the resources' lists of candidates, each entry overriding the top-level fields
_CHOICES = ("any_of", "ordered")

USAGE = ("a @task.skypilot function returns the job's run script (a str) or SkyPilot task "
         "fields (a dict, merged over the base task)")


def merge_task(base: Mapping[str, Any], returned: Any, name: str = "the function") -> dict:
    """The base task with what the function returned merged over it (see the module's doc).

    Raises AirflowFailException for anything but a non-empty ``str`` or a ``dict``.
    """
    if isinstance(returned, str):
        if not returned.strip():
            raise AirflowFailException(f"{name}() returned an empty run script; {USAGE}")
        return {**base, "run": returned}
    if isinstance(returned, Mapping):
        merged = _over(base, returned, "")
        for key, value in returned.items():
            old = base.get(key)
            if isinstance(old, Mapping) and isinstance(value, Mapping):
                merged[key] = _over(old, value, key)
        if isinstance(merged.get("resources"), Mapping) and \
                isinstance(returned.get("resources"), Mapping):
            merged["resources"] = _trim_choices(merged["resources"], returned["resources"])
        return merged
    what = "None (did it forget to return?)" if returned is None else \
        f"a {type(returned).__name__}"
    raise AirflowFailException(f"{name}() returned {what}; {USAGE}")


def _over(base: Mapping[str, Any], returned: Mapping[str, Any], section: str) -> dict:
    """``returned``'s keys over ``base``'s, one level; a key also drops the base's aliases and
    alternatives of it (returned ``gpus`` drops ``accelerators``), which would clash."""
    replaces = REPLACES.get(section, {})
    dropped = {k for key in returned if isinstance(key, str) for k in replaces.get(key, ())}
    return {**{k: v for k, v in base.items() if k not in dropped or k in returned}, **returned}


def _trim_choices(merged: Mapping[str, Any], returned: Mapping[str, Any]) -> dict:
    """The base's ``any_of``/``ordered`` entries without the keys the function returned (and
    their aliases and alternatives): an entry overrides the top level, so a returned
    ``accelerators`` would otherwise lose to the entries' own. An entry left empty is the top
    level itself, still a candidate (``ordered: [{H100, k8s}, {A100}]`` becomes "k8s, else
    anywhere"); one the same as an earlier one is dropped, and the list once nothing but the
    top level is left."""
    replaces = REPLACES["resources"]
    keys = {k for key in returned if isinstance(key, str)
            for k in (key, *replaces.get(key, ())) if k not in _CHOICES}
    out = dict(merged)
    for choices in _CHOICES:
        entries = merged.get(choices)
        # the function's own choices stay as it wrote them
        if choices in returned or not isinstance(entries, list) or not any(
                isinstance(e, Mapping) and keys & set(e) for e in entries):
            continue
        kept: list[Any] = []
        for entry in entries:
            if isinstance(entry, Mapping) and keys & set(entry):
                # an entry left empty is the top level as it is: still a candidate
                entry = {k: v for k, v in entry.items() if k not in keys}
            if entry not in kept:
                kept.append(entry)
        if all(entry == {} for entry in kept):
            out.pop(choices)  # nothing but the top level is left
        else:
            out[choices] = kept
    return out


def _within(path: str, field: tuple[Any, ...]) -> bool:
    """Is the dotted ``path`` the field's, or below it?"""
    prefix = dotted(field)
    return path == prefix or path.startswith((f"{prefix}.", f"{prefix}["))


def _path_keys(path: str) -> tuple[str, str]:
    """The top-level field of a dotted problem path, and the rest (``envs.A`` -> envs, A)."""
    match = re.match(r"([^.\[]*)[.]?(.*)", path)
    return (match.group(1), match.group(2)) if match else (path, "")


class SkyPilotDecoratedOperator(DecoratedOperator, SkyPilotOperator):
    """The operator behind ``@task.skypilot``: calls the function, then runs the task.

    :param python_callable: returns the run script (str) or task fields (dict).
    :param task: the base task the result is merged over (YAML path, YAML text or dict;
        default: an empty task). Relative paths, the YAML's and a dict's ``workdir`` and
        ``file_mounts``, start at the DAG file's folder (a YAML file's own, for its fields).
    :param op_args: positional arguments of the function (templated; may be XComs).
    :param op_kwargs: keyword arguments of the function (templated; may be XComs).

    Every other argument is :class:`SkyPilotOperator`'s.
    """

    template_fields: Sequence[str] = (*DecoratedOperator.template_fields,
                                      *SkyPilotOperator.template_fields)
    template_fields_renderers: ClassVar[dict[str, str]] = {
        **DecoratedOperator.template_fields_renderers,
        **SkyPilotOperator.template_fields_renderers,
    }
    custom_operator_name: str = "@task.skypilot"
    # set per instance once the function has run: the rendered ``task`` then shows the merged
    # task (secret values masked). Airflow renders a resumed try's fields again from the DAG:
    # after a deferral the field shows the base task, and the log has the merged one
    overwrite_rtif_after_execution: bool = False

    def __init__(self, *, python_callable: Callable, op_args: Collection[Any] | None = None,
                 op_kwargs: Mapping[str, Any] | None = None,
                 task: str | os.PathLike[str] | Mapping[str, Any] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(python_callable=python_callable, op_args=op_args, op_kwargs=op_kwargs,
                         task=task, **kwargs)
        self._origin: dict[str, Any] | None = None  # set once the function has run
        self._expected_digest = ""  # the first answer's digest, from the run state
        self._digest_now = ""

    @property
    def _name(self) -> str:
        return getattr(self.python_callable, "__name__", "function")

    # --- the function ------------------------------------------------------------------------
    def load(self, context: Context | None = None) -> Task:
        """Call the function (once per process), merge its result, then load as the operator
        does; every problem is an AirflowFailException before anything is submitted."""
        if self._origin is None:
            if context is None:
                raise AirflowFailException(f"{self.custom_operator_name} needs the task "
                                           "context to call its function")
            self._apply(context)
        return super().load(context)

    def _base(self) -> tuple[dict[str, Any], Source | None, str | None]:
        """The base task's fields, its parsed YAML (for line numbers) and its folder."""
        self._mask_secrets()
        spec = self._task_source()
        dag_dir = os.path.dirname(getattr(getattr(self, "dag", None), "fileloc", "") or "")
        if spec is None:
            return {}, None, dag_dir or None
        if isinstance(spec, Mapping):
            return dict(spec), None, dag_dir or None
        try:
            text, file = read_task_text(spec)
            sources = load_yaml(text, file=file)
            if len(sources) > 1:
                raise TaskValidationError([Problem(
                    path="", file=file, message="multi-document YAML is not supported: the "
                                                "base task must be one task")])
        except TaskValidationError as exc:
            raise AirflowFailException(f"invalid SkyPilot task:\n{exc}") from None
        src = sources[0] if sources else Source(data=None, file=file)
        if src.data is not None and not isinstance(src.data, Mapping):
            problem = src.problem((), "a task must be a mapping of fields (name, resources, "
                                      f"run, ...); got {type(src.data).__name__}")
            raise AirflowFailException(f"invalid SkyPilot task:\n{problem}")
        folder = os.path.dirname(os.path.abspath(file)) if file != "<inline>" else dag_dir
        return dict(src.data or {}), src, folder or None

    def _apply(self, context: Context) -> None:
        base, src, folder = self._base()
        context_merge(context, self.op_kwargs)
        kwargs = determine_kwargs(self.python_callable, self.op_args, context)
        returned = self.python_callable(*self.op_args, **kwargs)
        if isinstance(returned, Mapping):  # before anything can show them, valid or not
            self._mask_secrets(secret_values({"secrets": {"_": returned.get("secrets")}}))
        merged = merge_task(base, returned, self._name)
        self._mask_secrets(secret_values(merged))
        self._origin = {"returned": returned if isinstance(returned, Mapping) else
                        {"run": returned}, "base": src, "folder": folder}
        self.task = merged
        self.overwrite_rtif_after_execution = True
        self.log.info("%s() returned %s; the task:\n%s", self._name,
                      "the run script" if isinstance(returned, str) else
                      f"the fields {', '.join(map(str, returned))}", self._shown(merged))
        digest = self._digest(merged)
        if self._expected_digest and digest != self._expected_digest:
            self.log.warning("%s() returned a different task than at this try's first call "
                             "(the job was placed with that one); the new one is used from "
                             "now on", self._name)
        self._digest_now = digest

    @staticmethod
    def _without_secrets(merged: Mapping[str, Any]) -> dict[str, Any]:
        secrets = merged.get("secrets")
        if isinstance(secrets, Mapping):
            return {**merged, "secrets": {k: "***" for k in secrets}}
        return dict(merged)

    @classmethod
    def _shown(cls, merged: Mapping[str, Any]) -> str:
        """The merged task as YAML for the log, secret values left out (and masked anyway)."""
        try:
            return yaml.safe_dump(cls._without_secrets(merged), sort_keys=False).rstrip()
        except yaml.YAMLError:
            return json.dumps(cls._without_secrets(merged), indent=2, default=repr)

    @classmethod
    def _digest(cls, merged: Mapping[str, Any]) -> str:
        """A digest of the task without its secret values (it travels in the run state)."""
        text = json.dumps(cls._without_secrets(merged), sort_keys=True, default=repr)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def _load_task(self, spec: Any, envs: Mapping[str, Any], secrets: Mapping[str, Any]) -> Task:
        origin = self._origin or {}
        label = f"{self._name}()'s result"
        try:
            return load_task(spec, envs=envs, secrets=secrets, require_secrets=True,
                             file=label, base_dir=origin.get("folder"))
        except TaskValidationError as exc:
            raise TaskValidationError([self._locate(p, origin, label)
                                       for p in exc.problems]) from None

    @staticmethod
    def _locate(problem: Problem, origin: Mapping[str, Any], label: str) -> Problem:
        """A problem of the merged task, pointed at the base YAML's line when the field came
        from there (the operator's ``envs``/``secrets`` overrides are neither's)."""
        base: Source | None = origin.get("base")
        returned = origin.get("returned") or {}
        top, rest = _path_keys(problem.path)
        mine = top in returned
        if mine and isinstance(returned[top], Mapping) and rest:
            mine = any(rest == k or rest.startswith((f"{k}.", f"{k}[")) for k in returned[top])
        if mine or base is None or problem.file != label:
            return problem
        # the deepest field of the base YAML the path is in (``envs.BAD-NAME``'s own line)
        where = max((p for p in base.lines if p and p[0] == top and _within(problem.path, p)),
                    key=len, default=(top,))
        return Problem(path=problem.path, message=problem.message, file=base.file,
                       line=base.line_of(where) if top else None)

    # --- the run state: the digest of the first answer travels with it -----------------------
    def _new_run(self, context: Context) -> RunState:
        run = super()._new_run(context)
        run.spec_digest = self._digest_now
        return run

    def execute_complete(self, context: Context, event: dict[str, Any] | None,
                         state: dict[str, Any] | None = None) -> Any:
        carried = (event or {}).get("state") or state or {}
        self._expected_digest = str(carried.get("spec_digest") or "") \
            if isinstance(carried, Mapping) else ""
        return super().execute_complete(context, event, state)


def skypilot_task(python_callable: Callable | None = None, multiple_outputs: bool | None = None,
                  **kwargs: Any) -> TaskDecorator:
    """``@task.skypilot(task=None, connections=..., policy=..., **operator kwargs)``.

    The function returns the run script (str) or task fields (dict), merged over ``task``.
    The task's return value is the operator's result (where it ran, attempts, GPU-hours,
    cost), not the function's: ``multiple_outputs`` is off unless set (a ``-> dict``
    annotation describes the task fields, not the result).
    """
    return task_decorator_factory(
        python_callable=python_callable,
        multiple_outputs=bool(multiple_outputs),
        decorated_operator_class=SkyPilotDecoratedOperator,
        **kwargs,
    )
