"""``airflow-skypilot``: validate a task YAML, show live GPU capacity, plan a placement.

Exit codes: 0 ok; 2 the task is invalid (one ``FILE:LINE: field: problem`` line per problem on
stderr) or cannot be read, or the command line is wrong; 1 anything else (e.g. no connection
could be read, or ``plan`` was given a misconfigured or undefined connection: one line each on
stderr).

``FILE`` is always a file: a mistyped path (``tasks/train``) is a file that cannot be read, not
YAML text (the operator's ``task=`` may be either; a command line means a file).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

from airflow_skypilot.spec import TaskValidationError, load_task
from airflow_skypilot.spec.errors import Problem
from airflow_skypilot.spec.task import names_a_file


def _pairs(items: Sequence[str] | None, flag: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(_usage_error(f"{flag} expects KEY=VALUE, got {item!r}"))
        out[key] = value
    return out


def _usage_error(message: str) -> int:
    print(f"airflow-skypilot: error: {message}", file=sys.stderr)
    return 2


#: the longest ``--timeout``: a day is already far more than a probe needs, and the waits it
#: bounds refuse a few billion seconds (OverflowError)
MAX_TIMEOUT = 86400.0


def _seconds(text: str) -> float:
    """``--timeout``: a number of seconds above 0 and at most :data:`MAX_TIMEOUT` (not nan)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (0 < value <= MAX_TIMEOUT):  # nan compares false
        raise argparse.ArgumentTypeError(
            f"must be a number of seconds above 0 and at most {MAX_TIMEOUT:g}, got {text!r}")
    return value


def _check_file(path: str) -> None:
    """TaskValidationError unless load_task will read ``path`` as a file: it takes a string
    that names no file (and does not end in .yaml) for YAML text."""
    if names_a_file(path) or ("\n" not in path and os.path.isfile(path)):
        return  # read as a file, and reported as load_task reports a file it cannot read
    try:
        os.stat(path)
        why = ("Is a directory" if os.path.isdir(path) else
               "a line break in the path" if os.path.isfile(path) else "not a regular file")
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        why = getattr(exc, "strerror", None) or str(exc)
    raise TaskValidationError([Problem(path="", file=repr(path)[1:-1],
                                       message=f"cannot read task file: {why}")])


def _load(args: argparse.Namespace):
    """The task, or None after printing one line per problem to stderr (exit 2)."""
    try:
        _check_file(args.file)
        return load_task(args.file, envs=_pairs(args.env, "--env"),
                         secrets=_pairs(getattr(args, "secret", None), "--secret"))
    except TaskValidationError as exc:
        for problem in exc.problems:
            print(problem, file=sys.stderr)
        return None


def cmd_validate(args: argparse.Namespace) -> int:
    task = _load(args)
    if task is None:
        return 2
    for warning in task.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if args.json:
        print(json.dumps(task.to_json(), indent=2))
        return 0
    print(f"{args.file}: valid")
    print(f"  name:      {task.name or '-'}")
    print(f"  num_nodes: {task.num_nodes}")
    if task.envs:
        print(f"  envs:      {', '.join(sorted(task.envs))}")
    if task.secrets:
        print(f"  secrets:   {', '.join(sorted(task.secrets))} (values hidden)")
    if task.missing_secrets:
        print(f"  to supply: {', '.join(task.missing_secrets)} (secrets without a value: give "
              "them with --secret or the operator's secrets=)")
    recovery = task.job_recovery
    print(f"  recovery:  {recovery['strategy'] or 'EAGER_NEXT_REGION (default)'}, "
          f"max_restarts_on_errors={recovery['max_restarts_on_errors']}"
          + (f", recover_on_exit_codes={recovery['recover_on_exit_codes']}"
             if recovery["recover_on_exit_codes"] else ""))
    kind = " (in this order)" if task.ordered else " (any of)" if len(task.candidates) > 1 else ""
    print(f"  candidates{kind}:")
    for cand in task.candidates:
        print(f"    {cand.index + 1}. {cand.describe()}")
    return 0


def _hook(args: argparse.Namespace):
    from airflow_skypilot.hooks.capacity import SkyPilotCapacityHook

    return SkyPilotCapacityHook(args.conn, timeout=args.timeout)


def cmd_show_gpus(args: argparse.Namespace) -> int:
    rows = _hook(args).capacity()
    if args.json:
        print(json.dumps([r.to_json() for r in rows], indent=2))
        return 0
    table: list[list[Any]] = [["CONNECTION", "LOCATION", "ACCELERATOR", "FREE", "TOTAL",
                               "PENDING", "$/H", "NOTE"]]
    for r in _group_zones(rows):
        table.append([r.connection, r.location, r.accelerator or "-",
                      "-" if r.free is None else r.free, "-" if r.total is None else r.total,
                      "-" if r.pending is None else r.pending,
                      "-" if r.price_per_hour is None else f"{r.price_per_hour:g}",
                      f"error: {r.error}" if r.error else ""])
    _print_table(table)
    return 0


def _group_zones(rows: list[Any]) -> list[Any]:
    """For people: zones of one region with the same numbers share a row
    (``us-east-1/{a,b,c}``, :mod:`airflow_skypilot.zones`); ``--json`` keeps one row per zone."""
    from dataclasses import replace

    from airflow_skypilot import zones

    out = [replace(g.first, location=g.location) if g.grouped else g.first
           for g in zones.group(rows, zones.capacity_key)]
    order = list(dict.fromkeys(r.connection for r in rows))
    return sorted(out, key=lambda r: (order.index(r.connection), r.accelerator or "",
                                      r.location))


def cmd_plan(args: argparse.Namespace) -> int:
    from airflow_skypilot import placement

    task = _load(args)
    if task is None:
        return 2
    result = _hook(args).probe(task)
    plan = placement.rank(result.offers, args.policy, ordered=task.ordered,
                          unreachable=result.errors)
    if args.json:
        print(json.dumps(plan.to_json(), indent=2, default=str))
    else:
        print(plan.table())
        print()
        print(plan.summary)
    # the operator fails on these (fail_on_config_errors): a plan that hid them would promise
    # a placement the task never gets
    for conn_id, error in result.config_errors.items():
        print(f"airflow-skypilot: error: misconfigured connection {conn_id} (the operator "
              f"fails on it): {error}", file=sys.stderr)
    # every connection failed: the plan shows nothing to place on, and that is not "ok"
    failed = {**result.errors, **result.config_errors}
    if not result.offers and failed and all(c in failed for c in args.conn):
        print("airflow-skypilot: error: no connection could be read", file=sys.stderr)
        for conn_id, error in result.errors.items():
            print(f"airflow-skypilot: error: unreachable connection {conn_id}: {error}",
                  file=sys.stderr)
        return 1
    return 1 if result.config_errors else 0


def cmd_backends(args: argparse.Namespace) -> int:
    """The backends this installation knows (built-in and entry points), their connection
    types and the task features each declares it cannot provide."""
    from airflow_skypilot.backends import registry

    rows = registry.describe()
    if args.json:
        print(json.dumps({"backends": rows, "load_errors": registry.load_errors}, indent=2))
        return 0
    table = [["BACKEND", "CONNECTION TYPES", "CLASS"]]
    table += [[r["name"], ",".join(r["conn_types"]), r["class"]] for r in rows]
    _print_table(table)
    for r in rows:
        if r["unsupported_features"]:
            print(f"\n{r['name']} cannot run:")
            for feature, why in r["unsupported_features"].items():
                print(f"  {feature}: {why}")
    for name, error in registry.load_errors.items():
        print(f"\nentry point {name} failed to load: {error}", file=sys.stderr)
    return 0


def _print_table(rows: list[list[Any]]) -> None:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(str(v).ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="airflow-skypilot",
        description="SkyPilot task YAMLs on Slurm, Kubernetes and AWS, from Airflow.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("validate", help="check a task YAML and list its candidates")
    p.add_argument("file")
    p.add_argument("--env", action="append", metavar="KEY=VALUE", help="override an env")
    p.add_argument("--secret", action="append", metavar="KEY=VALUE", help="supply a secret")
    p.add_argument("--json", action="store_true", help="print the contract JSON")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("show-gpus", help="live GPU capacity of Airflow connections")
    p.add_argument("--conn", action="append", required=True, metavar="CONN_ID")
    p.add_argument("--timeout", type=_seconds, default=30.0, metavar="SECONDS")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_show_gpus)

    p = sub.add_parser("plan", help="explain where a task would be placed (submits nothing)")
    p.add_argument("file")
    p.add_argument("--conn", action="append", required=True, metavar="CONN_ID")
    p.add_argument("--env", action="append", metavar="KEY=VALUE")
    p.add_argument("--secret", action="append", metavar="KEY=VALUE")
    p.add_argument("--policy", choices=("fastest", "cheapest"), default="fastest")
    p.add_argument("--timeout", type=_seconds, default=30.0, metavar="SECONDS")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("backends", help="the backends installed, and what each cannot run")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_backends)
    return parser


def _airflow_environment() -> None:
    """Read connections the way Airflow's own CLI does: outside a task, Airflow 3 reads the
    metadata DB (``airflow connections import``) only in a "server" process context."""
    os.environ.setdefault("_AIRFLOW_PROCESS_CONTEXT", "server")
    _logs_to_stderr()


def _logs_to_stderr() -> None:
    """Airflow logs to stdout by default; this CLI's stdout is its output (``--json``)."""
    try:
        import airflow  # noqa: F401  (configures logging on import)
        from airflow.sdk.log import configure_logging
    except Exception:  # without Airflow's logging there is nothing to move
        return
    configure_logging.cache_clear()
    # The process's own stderr: a replaced sys.stderr (a test's capture) may be closed later,
    # and the logging configuration outlives this call.
    configure_logging(output=sys.__stderr__)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command not in ("validate", "backends"):  # no connections: stays fast
        _airflow_environment()
    try:
        return args.func(args)
    except SystemExit as exc:
        return int(exc.code or 0)
    except Exception as exc:  # a clear one-line error instead of a traceback
        print(f"airflow-skypilot: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
