"""``SkyPilotOperator``: place a SkyPilot task where it can start soonest, run it, survive loss.

``execute`` loads the task (every problem reported before anything is submitted), finds the
jobs earlier tries of this task instance left (adopting one that is still its own, stopping
every other live one: ``identity.classify``), probes every connection concurrently, ranks the
offers, submits, pushes the handle and the placement table to XCom, and defers. The trigger
watches the job; ``execute_complete`` finishes, places the job again elsewhere on an
infrastructure failure, or restarts it as ``job_recovery`` allows (the rule is
:func:`airflow_skypilot.recovery.decide`). Not deferrable, the same steps run in a loop in the
worker.

At most one live copy: an old copy is cancelled and confirmed dead before its task is placed
again, or swept from the trigger until its silent backend answers (``sweeps.py``). The run's
state between deferrals is a :class:`~airflow_skypilot.runstate.RunState`.
"""

from __future__ import annotations

import base64
import os
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from functools import cached_property
from typing import TYPE_CHECKING, Any

from airflow.sdk import AssetAlias, BaseOperator
from airflow.sdk.configuration import conf
from airflow.sdk.exceptions import AirflowException, AirflowFailException
from airflow.sdk.log import mask_secret

from airflow_skypilot import identity, placement, polling, rebalance, recovery
from airflow_skypilot.backends.base import JobHandle, JobState, JobStatus, Offer
from airflow_skypilot.backends.registry import backend_for_handle
from airflow_skypilot.hooks.capacity import SkyPilotCapacityHook
from airflow_skypilot.ledger import PlacementLedger, ledger_path
from airflow_skypilot.links import SkyPilotJobLink
from airflow_skypilot.operators import _args as args
from airflow_skypilot.operators._stop import StopsItsJobs
from airflow_skypilot.placer import Placer
from airflow_skypilot.runstate import (
    XCOM_HANDLE,
    XCOM_PLACEMENT,
    XCOM_WATCH,
    Attempt,
    RunState,
    asset_extra,
    watch_record,
)
from airflow_skypilot.settings import default_connections, default_deferrable, deployment_id
from airflow_skypilot.spec import Task, TaskValidationError, load_task
from airflow_skypilot.spec.secrets import secret_values
from airflow_skypilot.spec.task import names_a_file
from airflow_skypilot.triggers.skypilot import (
    DEFAULT_UNREACHABLE_TIMEOUT,
    SkyPilotJobTrigger,
    SkyPilotSweepTrigger,
    SkyPilotWaitTrigger,
)

if TYPE_CHECKING:
    from airflow.sdk import Context

__all__ = ["XCOM_HANDLE", "XCOM_PLACEMENT", "SkyPilotOperator", "default_connections",
           "default_deferrable"]



class _Move(Exception):
    """The worker's watch of a waiting job ends: move it to ``to``."""

    def __init__(self, to: Offer, reason: str):
        super().__init__(reason)
        self.to, self.reason = to, reason


class SkyPilotOperator(args.TaskNotRenderedInside, StopsItsJobs, BaseOperator):
    """Run a SkyPilot task YAML on the connected Slurm, Kubernetes or AWS capacity.

    :param task: a YAML file path (relative paths start at the DAG file's folder), YAML text,
        or a dict. Templated (the path or text, not the YAML's contents).
    :param connections: Airflow connection ids to consider; default ``[skypilot] connections``.
        Templated: a list rendered to text (``"{{ params.conns }}"``) is read back as that list,
        other text is comma-separated ids.
    :param envs: env overrides (``sky launch --env``); templated.
    :param secrets: secret values (``sky launch --secret``); templated, never logged.
    :param policy: ``fastest`` (free now first, then soonest start, then price) or ``cheapest``;
        templated (a literal value is checked at once, a rendered one before anything runs).
    :param max_failovers: placements again after infrastructure failures (and the bound on
        ``recover_on_exit_codes`` restarts).
    :param deferrable: free the worker slot while the job queues and runs.
    :param poll_interval: seconds between status polls.
    :param wait_for_completion: False: submit, push the handle, return it (see the sensor).
    :param cancel_on_kill: cancel the backend job when the task is killed or marked failed, or
        when its deferral times out (``execution_timeout``) before the job ends.
    :param probe_timeout: seconds each connection gets to answer a capacity probe.
    :param reprobe_interval: seconds between probes while nothing fits anywhere, and between
        looks at a job waiting in a queue (it moves when another place starts it clearly
        sooner: ``placement.reconsider``).
    :param max_moves: moves of a waiting job at most (0: never move it).
    :param paid_move_min_wait: seconds; a waiting job whose queue estimates its start within
        this is not moved to a costlier place (a cloud instance) under ``fastest``: queued jobs
        tend to start well before their estimate. 0: a costlier place that can start it now
        always wins. Placement itself is not affected: a job is placed where it starts soonest.
    :param stream_logs: copy the job's output into the task log as it runs.
    :param unreachable_timeout: seconds the job's backend may stay silent (cannot be asked, or
        cannot say) before the job counts as lost and is placed again; default
        ``[skypilot] unreachable_timeout``. Shorter silences are waited out: "could not ask" is
        never "gone".
    :param confirm_timeout: seconds to wait for an old copy's end to be confirmed before the
        job is placed again (a copy that stays unconfirmed is swept from the trigger).
    :param block_cooldown: seconds a failed place stays blocked; default
        ``[skypilot] block_cooldown``.
    """

    template_fields: Sequence[str] = ("task", "connections", "envs", "secrets", "policy")
    template_fields_renderers = {"task": "yaml", "envs": "json"}
    ui_color = "#d6e4ff"
    # "SkyPilot job" button: the plugin's page with this try's placement table and attempts
    operator_extra_links = (SkyPilotJobLink(),)

    def __init__(
        self,
        *,
        task: str | os.PathLike[str] | Mapping[str, Any],
        connections: Sequence[str] | str | None = None,
        envs: Mapping[str, Any] | str | None = None,
        secrets: Mapping[str, Any] | str | None = None,
        policy: str = "fastest",
        max_failovers: int = 3,
        deferrable: bool | None = None,
        poll_interval: float = 10.0,
        wait_for_completion: bool = True,
        cancel_on_kill: bool = True,
        probe_timeout: float | None = None,
        reprobe_interval: float = 60.0,
        stream_logs: bool = True,
        unreachable_timeout: float | None = None,
        confirm_timeout: float = 30.0,
        block_cooldown: float | None = None,
        max_moves: int = placement.MAX_MOVES,
        paid_move_min_wait: float = placement.PAID_MOVE_MIN_WAIT_S,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        # Template fields are kept as given: they are rendered after __init__, and turned into
        # what the run needs (path, mappings, policy) in execute (see load()).
        self.task = task
        self.connections = connections
        self.envs = envs
        self.secrets = secrets
        self.policy = policy
        self.max_failovers = max_failovers
        self.deferrable = default_deferrable() if deferrable is None else deferrable
        self.poll_interval = poll_interval
        self.wait_for_completion = wait_for_completion
        self.cancel_on_kill = cancel_on_kill
        self.probe_timeout = probe_timeout
        self.reprobe_interval = reprobe_interval
        self.stream_logs = stream_logs
        self.unreachable_timeout = unreachable_timeout
        self.confirm_timeout = confirm_timeout
        self.block_cooldown = block_cooldown
        self.max_moves = max_moves
        self.paid_move_min_wait = paid_move_min_wait
        self._handle: JobHandle | None = None
        # literal values now, at DAG parse time; Jinja ones (template fields) in load()
        args.check(vars(self), self.template_fields)

    # --- settings ----------------------------------------------------------------------------
    def _conn_ids(self) -> list[str]:
        # a templated list renders to its text: read back, not split into "['c1'" and "'c2']"
        conns = args.as_names(self.connections) or default_connections()
        if not conns:
            raise AirflowFailException(
                "no connections: pass connections=[...] or set [skypilot] connections")
        return conns

    @property
    def _silence(self) -> float:
        if self.unreachable_timeout is not None:
            return float(self.unreachable_timeout)
        return conf.getfloat("skypilot", "unreachable_timeout",
                             fallback=DEFAULT_UNREACHABLE_TIMEOUT)

    @property
    def _cooldown(self) -> float:
        if self.block_cooldown is not None:
            return float(self.block_cooldown)
        return conf.getfloat("skypilot", "block_cooldown", fallback=600.0)

    def _task_source(self) -> Any:
        """The rendered ``task``: a relative YAML path made absolute (from the DAG's folder)."""
        spec: Any = os.fspath(self.task) if isinstance(self.task, os.PathLike) else self.task
        if isinstance(spec, str) and names_a_file(spec):  # one line of YAML is not a path
            if not os.path.isabs(spec):
                dag = getattr(self, "dag", None)
                base = os.path.dirname(getattr(dag, "fileloc", "") or "") or os.getcwd()
                spec = os.path.join(base, spec)
        return spec

    def _mask_secrets(self, values: Any = None) -> None:
        """Register every secret value with Airflow's masker: the ``secrets`` overrides and
        the YAML's own ``secrets``, or ``values`` when given (the loaded task's)."""
        found = list(values) if values is not None else \
            secret_values(self._task_source(), args.as_mapping(self.secrets))
        for value in found:
            # no name: given one, the masker only masks values of names that look secret. Its
            # base64 form too: an SSM parameter (b64:...) or a Kubernetes Secret's data, which
            # the clients' DEBUG logs print
            mask_secret(value)
            if isinstance(value, str) and value:
                mask_secret(base64.b64encode(value.encode()).decode("ascii"))

    def _do_render_template_fields(self, parent: Any, template_fields: Any, context: Context,
                                   jinja_env: Any, seen_oids: set[int]) -> None:
        """Render, then mask the secret values at once: the rendered fields (the YAML text)
        are stored, and logged on errors, right after rendering. Airflow calls this for mapped
        tasks too (on the unmapped copy)."""
        super()._do_render_template_fields(parent, template_fields, context, jinja_env,
                                           seen_oids)
        if parent is self:
            self._mask_secrets()

    def load(self, context: Context | None = None) -> Task:
        """The task with overrides applied, from the rendered template fields.

        AirflowFailException (no retry) if the task, the overrides or the policy are invalid.
        Every secret value is registered with Airflow's masker before anything can log it.
        """
        self._mask_secrets()
        try:  # the rendered values: no Jinja left
            args.check(vars(self), ())
        except ValueError as exc:
            raise AirflowFailException(str(exc)) from None
        spec = self._task_source()
        envs = {} if self.envs is None else args.as_mapping(self.envs)
        secrets = {} if self.secrets is None else args.as_mapping(self.secrets)
        for name, value in (("envs", envs), ("secrets", secrets)):
            if not isinstance(value, Mapping):
                raise AirflowFailException(f"{name} must be a mapping after templating; got "
                                           f"{type(value).__name__}")
        try:
            task = self._load_task(spec, envs, secrets)
        except TaskValidationError as exc:
            raise AirflowFailException(f"invalid SkyPilot task:\n{exc}") from None
        self._mask_secrets(task.secrets.values())
        for warning in task.warnings:
            self.log.warning("%s", warning)
        return task

    def _load_task(self, spec: Any, envs: Mapping[str, Any], secrets: Mapping[str, Any]) -> Task:
        """Validate the rendered task with its overrides (``@task.skypilot`` loads its merged
        task with where each field came from); raises TaskValidationError."""
        return load_task(spec, envs=envs, secrets=secrets, require_secrets=True)

    def _new_run(self, context: Context) -> RunState:
        """A fresh run state for this try: its task instance's identity and job-name prefix."""
        ti = context["ti"]
        map_index = getattr(ti, "map_index", -1)
        key = identity.TaskKey(ti.dag_id, ti.task_id, ti.run_id,
                               -1 if map_index is None else int(map_index), deployment_id())
        return RunState(prefix=key.prefix, task_env_id=key.skypilot_task_id,
                        clear=identity.clear_of(ti, context.get("dag_run"), self.retries),
                        try_number=int(ti.try_number or 1))

    def _hook(self) -> SkyPilotCapacityHook:
        timeout = conf.getfloat("skypilot", "probe_timeout", fallback=60.0) \
            if self.probe_timeout in (None, 0) else float(self.probe_timeout)
        if not hasattr(self, "_capacity_hook"):
            self._capacity_hook = SkyPilotCapacityHook(self._conn_ids(), timeout=timeout)
        return self._capacity_hook

    def _push(self, context: Context, key: str, value: Any) -> None:
        try:
            context["ti"].xcom_push(key=key, value=value)
        except Exception as exc:  # XCom is for the UI; never fail a job over it
            self.log.warning("Could not push XCom %s: %s", key, exc)

    # --- execute -----------------------------------------------------------------------------
    def execute(self, context: Context) -> Any:
        task = self.load(context)
        run = self._run_state = self._new_run(context)
        handle, status = self._reconcile(context, run, task)
        if status is not None and status.state.terminal:  # an earlier try's job had succeeded
            result = self._job_ended(context, lambda: task, run, handle, status, "")
            if result is not None:
                return result
            handle = None
        if handle is None:
            handle = self._place_and_submit(context, task, run)
        return self._run(context, task, run, handle)

    def _run(self, context: Context, task: Task, run: RunState, handle: JobHandle | None) -> Any:
        """From a placement (``None``: nothing could take the job) to the task's end.

        Deferrable, every wait is a deferral (to the trigger that watches the job, or to the
        one that waits to probe again) and ``execute_complete`` comes back here. Not
        deferrable, the same steps loop in the worker: a wait for capacity may last days, so it
        must not recurse.
        """
        while True:
            if handle is None:
                self._wait_for_capacity(context, run)
                handle = self._place_and_submit(context, task, run)
                continue
            self._push(context, XCOM_HANDLE, handle.to_dict())
            self._note_sweeps(context, run)
            if not self.wait_for_completion:
                self.log.info("Not waiting for job %s (wait_for_completion=False)",
                              handle.job_id)
                self._describe_outlets(context, asset_extra(
                    {**handle.to_dict(), "state": "submitted", "task_id": run.task_env_id}))
                return handle.to_dict()
            if self.deferrable:
                self._defer_to_watch(context, handle, run, task)
            try:
                status, tail = self._poll_in_worker(context, handle, run, task)
            except _Move as move:
                handle = self._move(context, task, run, handle, move.to, move.reason)
                continue
            result = self._job_ended(context, lambda: task, run, handle, status, tail)
            if result is not None:
                return result
            handle = self._place_and_submit(context, task, run)

    @cached_property
    def _placer(self) -> Placer:
        return Placer(self._hook(), self.policy, cooldown=self._cooldown,
                      confirm_timeout=self.confirm_timeout, log=self.log,
                      ledger=PlacementLedger(ledger_path()), silence=self._silence,
                      launcher=self.owner)

    def _reconcile(self, context: Context, run: RunState, task: Task
                   ) -> tuple[JobHandle | None, JobStatus | None]:
        started = getattr(context.get("dag_run"), "start_date", None)
        handle, status = self._placer.reconcile(run, started.timestamp() if started else None,
                                                task.job_recovery)
        self._handle = handle or self._handle
        return handle, status

    def _place_and_submit(self, context: Context, task: Task, run: RunState) -> JobHandle | None:
        try:
            handle = self._placer.place(task, run)
        finally:
            if self._placer.last_plan is not None:
                self._push(context, XCOM_PLACEMENT, self._placer.last_plan.to_json())
        self._handle = handle or self._handle
        return handle

    def _defer_to_watch(self, context: Context, handle: JobHandle, run: RunState,
                        task: Task) -> None:
        state = run.to_dict()
        self.defer(
            trigger=SkyPilotJobTrigger(handle.to_dict(), poll_interval=self.poll_interval,
                                       unreachable_timeout=self._silence,
                                       log_offset=run.log_offset, stream_logs=self.stream_logs,
                                       cancel_on_kill=self.cancel_on_kill, state=state,
                                       reconsider=self._reconsider_spec(handle, run, task)),
            method_name="execute_complete", kwargs={"state": state},
            timeout=self._remaining(context),
        )

    def _reconsider_spec(self, handle: JobHandle, run: RunState,
                         task: Task) -> dict[str, Any] | None:
        """How the trigger looks again at the job while it waits (None: it never moves)."""
        if run.moves >= self.max_moves or not run.places:
            return None
        return rebalance.ReconsiderSpec(
            connections=self._conn_ids(), task=task.capacity_view(), policy=self.policy,
            places=run.places, interval=self.reprobe_interval, moves=run.moves,
            max_moves=self.max_moves, paid_min_wait=self.paid_move_min_wait,
            blocked=[b.to_dict() for b in run.blocked],
            probe_timeout=self._hook().timeout, waiting_since=handle.submitted_at).to_dict()

    def _move(self, context: Context, task: Task, run: RunState, handle: JobHandle, to: Offer,
              reason: str) -> JobHandle | None:
        """Move a waiting copy (see ``Placer.move``); a refused move places it anew."""
        new, moved = self._placer.move(task, run, handle, to, reason)
        if moved and new is None:
            new = self._place_and_submit(context, task, run)
        self._handle = new or self._handle
        return new

    def _remaining(self, context: Context) -> timedelta | None:
        if self.execution_timeout is None:
            return None
        ti = context["ti"]
        start = getattr(ti, "start_date", None)
        if start is None:
            return self.execution_timeout
        from airflow.sdk import timezone

        left = self.execution_timeout - (timezone.utcnow() - start)
        return max(left, timedelta(seconds=1))

    def _wait_for_capacity(self, context: Context, run: RunState) -> None:
        """Nothing fits now (places blocked or unreachable): wait, then the caller probes again.

        Deferrable, the wait is a deferral (``execute_complete`` resumes with a ``reprobe``
        event); otherwise the worker sleeps.
        """
        if run.waiting_since is None:
            run.waiting_since = time.time()
        self.log.info("Nothing can take the job now (%s); probing again in %gs",
                      run.last_plan, self.reprobe_interval)
        if self.deferrable:
            state = run.to_dict()
            self._note_sweeps(context, run)
            self.defer(trigger=SkyPilotWaitTrigger(self.reprobe_interval, state=state),
                       method_name="execute_complete", kwargs={"state": state},
                       timeout=self._remaining(context))
        self._placer.sweep_pending(run, keep=())
        time.sleep(self.reprobe_interval)

    def _poll_in_worker(self, context: Context, handle: JobHandle, run: RunState,
                        task: Task) -> tuple[JobStatus, str]:
        """The non-deferrable watch: poll until the job ends; its status and log tail. Raises
        :class:`_Move` when the job waits where another place would start it sooner. What it
        sees goes to the ``skypilot_watch`` XCom, as the trigger's watch does."""
        spec = self._reconsider_spec(handle, run, task)
        next_look = [time.time() + self.reprobe_interval]
        seen: list[JobState | None] = [None]

        def watched(status: JobStatus) -> None:
            self._push(context, XCOM_WATCH, watch_record(
                run.to_dict(), handle.to_dict(), status.state.value, time.time(),
                started_at=status.started_at, est_start=status.est_start))

        def between(status: JobStatus) -> None:
            self._placer.sweep_pending(run, keep=(handle.job_name,))
            if status.state == JobState.RUNNING and seen[0] != JobState.RUNNING:
                watched(status)
            seen[0] = status.state
            if spec and status.state == JobState.PENDING and time.time() >= next_look[0]:
                next_look[0] = time.time() + self.reprobe_interval
                decision = rebalance.decide(rebalance.ReconsiderSpec.from_dict(spec), handle,
                                            status)
                run.note_look(decision.look)
                watched(status)
                if decision.move_to is not None:
                    raise _Move(decision.move_to, decision.move_to.details.get("move_reason", ""))

        status, tail, run.log_offset = polling.until_done(
            backend_for_handle(handle), handle, poll_interval=self.poll_interval,
            silence=self._silence, offset=run.log_offset, stream_logs=self.stream_logs,
            log=self.log, between=between)
        return status, tail

    # --- resume ------------------------------------------------------------------------------
    def execute_complete(self, context: Context, event: dict[str, Any] | None,
                         state: dict[str, Any] | None = None) -> Any:
        # The trigger hands the state back in its event, with what it confirmed meanwhile;
        # the defer kwargs hold the state as it was at deferral (`airflow dags test` drops
        # them), so the event's copy wins.
        event = event or {}
        run = self._run_state = RunState.from_dict(event.get("state") or state)
        if event.get("handle"):  # what a kill would have to stop, whatever comes next
            self._handle = JobHandle.from_dict(event["handle"])
        if not run.prefix or not run.task_env_id:  # a state of an older release: its identity
            fresh = self._new_run(context)  # from the task instance, as this release names it
            run.prefix = run.prefix or fresh.prefix
            run.task_env_id = run.task_env_id or fresh.task_env_id
        if event.get("status") == "swept":  # done: the job had succeeded, old copies swept
            return self._finish(context, run, run.attempts[-1], None)
        if event.get("status") == "reprobe":  # the wait for capacity is over: probe again
            task = self.load(context)
            return self._run(context, task, run, self._place_and_submit(context, task, run))
        if event.get("status") == "move":  # waiting where another place starts it sooner
            task = self.load(context)
            return self._run(context, task, run, self._move(
                context, task, run, JobHandle.from_dict(event["handle"]),
                Offer.from_dict(event["to"]), event.get("reason", "")))
        if not event or event.get("status") == "error":
            message = event.get("message", "no event")
            if event.get("handle"):  # do not leave a job running that nobody watches
                handle = JobHandle.from_dict(event["handle"])
                self._placer.stop_copy(run, handle, f"its trigger failed: {message}")
            raise AirflowException(f"watching the SkyPilot job failed: {message}")
        handle = JobHandle.from_dict(event["handle"])
        self._handle = handle
        status = JobStatus.from_dict(event["job_status"])
        run.log_offset = event.get("log_offset", run.log_offset)
        loaded: list[Task] = []

        def load() -> Task:
            if not loaded:
                loaded.append(self.load(context))
            return loaded[0]

        result = self._job_ended(context, load, run, handle, status, event.get("log_tail") or "")
        if result is not None:
            return result
        return self._run(context, load(), run, self._place_and_submit(context, load(), run))

    def _job_ended(self, context: Context, load: Any, run: RunState, handle: JobHandle,
                   status: JobStatus, tail: str) -> dict[str, Any] | None:
        """Act on the failover rule: the result on success, None to place the job again;
        raises when the task fails. An old copy that may still run is stopped first."""
        ended = run.close(handle, status)
        self.log.info("Job %s on %s ended: %s%s", handle.job_id, handle.connection,
                      status.state.value, f" ({status.reason})" if status.reason else "")
        if status.state.infra_failure or status.still_up:  # it may still run: stopped first
            why = f"{ended.state}: {ended.reason or 'its place failed'}" + (
                "; part of its allocation is still up" if status.still_up else "")
            self._placer.stop_copy(run, handle, why, attempt=ended)
        # the task (re-read on resume) is needed only to go on; a success needs nothing of it
        job_recovery = {} if status.state == JobState.SUCCEEDED else load().job_recovery
        verdict = recovery.decide(run, ended, job_recovery, self.max_failovers, tail=tail)
        self._cleanup(handle)
        if verdict.action == recovery.SUCCEED:
            return self._finish(context, run, ended, handle)
        if verdict.action == recovery.FAIL:
            raise AirflowException(verdict.message + run.sweeps_text())
        self.log.warning("%s", verdict.message)
        recovery.record(run, verdict, cooldown=self._cooldown)
        return None

    def _finish(self, context: Context, run: RunState, final: Attempt,
                handle: JobHandle | None) -> dict[str, Any]:
        """The task's result; first, known old copies not yet confirmed dead get one more
        chance (a last deferral, or a loop in the worker, up to ``unreachable_timeout``).

        A precaution (a connection that could not be listed for earlier tries' jobs) does not
        hold the task's end: it was tried all along, and the result says it stayed unchecked.
        """
        if run.pending_sweeps and handle is not None:
            self._placer.sweep_pending(run, keep=())
            # within what is left of execution_timeout, with a margin: the job succeeded, and
            # the deferral timing out would fail the task
            left = self._remaining(context)
            wait = self._silence if left is None else min(
                self._silence, left.total_seconds() - min(60.0, left.total_seconds() / 4))
            if run.pending_copies and self.deferrable and wait > 0:
                state = run.to_dict()
                self._note_sweeps(context, run)
                self.defer(trigger=SkyPilotSweepTrigger(wait, interval=max(
                    self.poll_interval, 5.0), state=state), method_name="execute_complete",
                    kwargs={"state": state}, timeout=left)
            deadline = time.time() + max(0.0, wait)
            while run.pending_copies and time.time() < deadline:
                time.sleep(max(self.poll_interval, 5.0))
                self._placer.sweep_pending(run, keep=())
        if run.pending_copies:
            self.log.error("The job succeeded, but old copies could not be confirmed dead; "
                           "stop them by hand:%s", run.sweeps_text())
        elif run.pending_sweeps:
            self.log.warning("The job succeeded; these connections could not be checked for "
                             "copies of earlier tries:%s", run.sweeps_text())
        result = run.result(final)
        if handle is not None:
            self._push(context, XCOM_HANDLE, handle.to_dict())
        self._describe_outlets(context, asset_extra(result))
        return result

    def _describe_outlets(self, context: Context, extra: dict[str, Any]) -> None:
        """Where and how the job ran, as the extra of the asset events of the task's outlets
        (Airflow emits them when the task succeeds); an asset alias names no asset: skipped."""
        events = context.get("outlet_events") if self.outlets else None
        for outlet in self.outlets if events is not None else ():
            try:
                if not isinstance(outlet, AssetAlias):
                    events[outlet].extra.update(extra)
            except Exception as exc:  # the job succeeded: the task does not fail over this
                self.log.warning("Could not set the asset event's extra for %s: %s", outlet, exc)

    def _cleanup(self, handle: JobHandle) -> None:
        try:
            backend_for_handle(handle).cleanup(handle)
        except Exception as exc:
            self.log.warning("Cleanup of %s job %s on %s failed: %s", handle.backend,
                             handle.job_id, handle.connection, exc)
