"""Checks on what a task may ask for, beyond SkyPilot's schema: input that would get through.

A task's YAML text may come from a DAG run's ``conf``; its envs and secrets from the operator's
templated ``envs``/``secrets`` or ``--env``/``--secret``. What is refused here is refused at
load time, with ``FILE:LINE: field: problem``, before anything is submitted:

* env and secret names that are not environment variable names (``A;touch x``), from the YAML
  or from overrides;
* secrets named like the variables airflow-skypilot sets (:data:`RESERVED_ENV_NAMES`): a secret
  is sourced after them and would replace them (a fake ``SKYPILOT_TASK_ID`` moves a checkpoint);
  envs of those names are accepted, as SkyPilot does, and warned about: SkyPilot's values win;
* names starting with :data:`INTERNAL_PREFIX` (the job scripts' own variables, e.g. the list of
  secret names whose values are masked in the job's output);
* ``config.slurm.sbatch_options`` with a control character, or an option the backend or the
  connection owns (:mod:`airflow_skypilot.spec.sbatch`).

``config.kubernetes.pod_config`` fields that escape a cluster's control are only warned about
here: each Kubernetes connection refuses them unless it allows them (see
:mod:`airflow_skypilot.spec.podsecurity`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from airflow_skypilot.spec import podsecurity, sbatch
from airflow_skypilot.spec.errors import Problem
from airflow_skypilot.spec.model import _ENV_NAME
from airflow_skypilot.spec.source import Source

#: the variables every job gets from airflow-skypilot (docs/architecture.md), SkyPilot's names
RESERVED_ENV_NAMES = frozenset({
    "SKYPILOT_TASK_ID", "SKYPILOT_NODE_RANK", "SKYPILOT_NODE_IPS", "SKYPILOT_NUM_NODES",
    "SKYPILOT_NUM_GPUS_PER_NODE", "SKYPILOT_SETUP_NODE_RANK", "SKYPILOT_SETUP_NODE_IPS",
    "SKYPILOT_SETUP_NUM_GPUS_PER_NODE",
    "SKYPILOT_CLUSTER_INFO", "SKYPILOT_ATTEMPT", "SKYPILOT_USER",
})
#: the prefix of the job scripts' own variables; no env or secret may use it
INTERNAL_PREFIX = "AIRFLOW_SKYPILOT_"


def names(src: Source, envs: Mapping[str, Any], env_over: Mapping[str, Any],
          secrets: Mapping[str, Any], sec_over: Mapping[str, Any]
          ) -> tuple[list[Problem], list[Problem]]:
    """(problems, warnings) about env and secret names; ``envs``/``secrets`` are the YAML's."""
    problems: list[Problem] = []
    warnings: list[Problem] = []
    for section, yaml_names, over, flag in (("envs", envs, env_over, "--env"),
                                            ("secrets", secrets, sec_over, "--secret")):
        for key in over:
            if not isinstance(key, str) or not _ENV_NAME.match(key):
                problems.append(src.problem((section,), (
                    f"override {key!r} is not a valid environment variable name ({flag}, "
                    f"or the operator's {section}=)")))
        seen = {str(k): k in over for k in [*yaml_names, *over]}
        for key, is_override in seen.items():
            where = (section,) if is_override and key not in yaml_names else (section, key)
            if key.startswith(INTERNAL_PREFIX):
                problems.append(src.problem(where, (
                    f"{key!r}: names starting with {INTERNAL_PREFIX} are airflow-skypilot's own")))
            elif key in RESERVED_ENV_NAMES and section == "secrets":
                problems.append(src.problem(where, (
                    f"{key!r} is set by airflow-skypilot for every job; a secret cannot "
                    "replace it")))
            elif key in RESERVED_ENV_NAMES:
                warnings.append(src.problem(where, (
                    f"{key!r} is set by airflow-skypilot for every job; this env is ignored")))
    return problems, warnings


def slurm_options(src: Source, config: Mapping[str, Any]) -> list[Problem]:
    """``config.slurm.sbatch_options``: readable, no control characters, nothing the backend
    or the connection owns (the connection's own pins are checked by the Slurm backend)."""
    slurm = config.get("slurm") if isinstance(config, Mapping) else None
    raw = slurm.get("sbatch_options") if isinstance(slurm, Mapping) else None
    base = ("config", "slurm", "sbatch_options")
    try:
        options = sbatch.task_options(raw)
    except sbatch.OptionError as exc:
        where = base + ((exc.where,) if exc.where is not None else ())
        return [src.problem(where, str(exc))]
    return [src.problem(base + (opt.where,), message)
            for opt, message in sbatch.refused(options, sbatch.BACKEND_OWNED)]


def pod_config(src: Source, config: Mapping[str, Any]) -> list[Problem]:
    """Warnings for ``config.kubernetes.pod_config`` fields Kubernetes connections refuse."""
    k8s = config.get("kubernetes") if isinstance(config, Mapping) else None
    raw = k8s.get("pod_config") if isinstance(k8s, Mapping) else None
    if not isinstance(raw, Mapping):
        return []
    return [src.problem(("config", "kubernetes", "pod_config", *path), (
        f"{why}: a Kubernetes connection runs this task only if it sets "
        f"'{podsecurity.ALLOW_EXTRA}': true"))
        for path, why in podsecurity.refused(raw)]
