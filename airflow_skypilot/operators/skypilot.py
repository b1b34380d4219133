"""``SkyPilotOperator``: place a SkyPilot task where it can start soonest, run it, survive loss.

``execute`` loads the task (every problem reported before anything is submitted), adopts a job
this try already submitted if one is alive, probes every connection concurrently, ranks the
offers, submits, pushes the handle and the placement table to XCom, and defers. The trigger
watches the job; ``execute_complete`` finishes, places the job again elsewhere on an
infrastructure failure, or restarts it as ``job_recovery`` allows (the rule is
:func:`airflow_skypilot.recovery.decide`). Not deferrable, the same steps run in a loop in the
worker.

The run's state between deferrals is a :class:`~airflow_skypilot.runstate.RunState`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator
from airflow.sdk.bases.operator import TRIGGER_FAIL_REPR
from airflow.sdk.configuration import conf
from airflow.sdk.exceptions import AirflowException, AirflowFailException
from airflow.sdk.log import mask_secret

from airflow_skypilot import placement, recovery
from airflow_skypilot.backends.base import (
    Backend,
    JobHandle,
    JobState,
    JobStatus,
)
from airflow_skypilot.backends.common import jobscript
from airflow_skypilot.backends.registry import backend_for_handle
from airflow_skypilot.exceptions import BackendError, SubmissionError
from airflow_skypilot.hooks.capacity import SkyPilotCapacityHook
from airflow_skypilot.links import SkyPilotJobLink
from airflow_skypilot.runstate import XCOM_HANDLE, XCOM_PLACEMENT, Blocked, RunState
from airflow_skypilot.spec import Task, TaskValidationError, load_task
from airflow_skypilot.spec.secrets import secret_values
from airflow_skypilot.triggers.skypilot import (
    LOG_TAIL_LINES,
    SkyPilotJobTrigger,
    SkyPilotWaitTrigger,
)

if TYPE_CHECKING:
    from airflow.sdk import Context

__all__ = ["XCOM_HANDLE", "XCOM_PLACEMENT", "SkyPilotOperator", "default_connections",
           "default_deferrable"]

#: submissions refused in a row (each place then blocked) before one placement gives up
MAX_SUBMISSIONS = 8


def default_connections() -> list[str]:
    """``[skypilot] connections``: comma-separated conn ids."""
    raw = conf.get("skypilot", "connections", fallback="") or ""
    return [c.strip() for c in raw.split(",") if c.strip()]


def default_deferrable() -> bool:
    """Deferral is the normal path: on unless ``[skypilot] deferrable = False`` (and
    ``[operators] default_deferrable = True`` always keeps it on)."""
    return conf.getboolean("operators", "default_deferrable", fallback=False) or \
        conf.getboolean("skypilot", "deferrable", fallback=True)


class SkyPilotOperator(BaseOperator):
    """Run a SkyPilot task YAML on the connected Slurm, Kubernetes or AWS capacity.

    :param task: a YAML file path (relative paths start at the DAG file's folder), YAML text,
        or a dict. Templated (the path or text, not the YAML's contents).
    :param connections: Airflow connection ids to consider; default ``[skypilot] connections``.
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
    :param reprobe_interval: seconds between probes while nothing fits anywhere.
    :param stream_logs: copy the job's output into the task log as it runs.
    :param max_unreachable: failed polls in a row before the job is declared lost.
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
        max_unreachable: int = 6,
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
        self.max_unreachable = max_unreachable
        self._handle: JobHandle | None = None
        # A literal policy can be checked now, at DAG parse time; a Jinja one after rendering.
        if isinstance(policy, str) and "{{" not in policy and policy not in placement.POLICIES:
            raise ValueError(f"policy must be one of {placement.POLICIES}, got {policy!r}")

    # --- helpers -----------------------------------------------------------------------------
    def _conn_ids(self) -> list[str]:
        conns = self.connections
        if isinstance(conns, str):
            conns = [c.strip() for c in conns.split(",") if c.strip()]
        conns = list(conns or default_connections())
        if not conns:
            raise AirflowFailException(
                "no connections: pass connections=[...] or set [skypilot] connections")
        return conns

    def _task_source(self) -> Any:
        """The rendered ``task``: a relative YAML path made absolute (from the DAG's folder)."""
        spec: Any = os.fspath(self.task) if isinstance(self.task, os.PathLike) else self.task
        if isinstance(spec, str) and "\n" not in spec and spec.endswith((".yaml", ".yml")):
            if not os.path.isabs(spec):
                dag = getattr(self, "dag", None)
                base = os.path.dirname(getattr(dag, "fileloc", "") or "") or os.getcwd()
                spec = os.path.join(base, spec)
        return spec

    def _mask_secrets(self, values: Any = None) -> None:
        """Register every secret value with Airflow's masker: the ``secrets`` overrides and
        the YAML's own ``secrets``, or ``values`` when given (the loaded task's)."""
        found = list(values) if values is not None else \
            secret_values(self._task_source(), self.secrets)
        for value in found:
            # no name: given one, the masker only masks values of names that look secret
            mask_secret(value)

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
        if self.policy not in placement.POLICIES:
            raise AirflowFailException(
                f"policy must be one of {placement.POLICIES}, got {self.policy!r}")
        spec = self._task_source()
        envs = {} if self.envs is None else self.envs
        secrets = {} if self.secrets is None else self.secrets
        for name, value in (("envs", envs), ("secrets", secrets)):
            if not isinstance(value, Mapping):
                raise AirflowFailException(f"{name} must be a mapping after templating; got "
                                           f"{type(value).__name__}")
        try:
            task = load_task(spec, envs=envs, secrets=secrets, require_secrets=True)
        except TaskValidationError as exc:
            raise AirflowFailException(f"invalid SkyPilot task:\n{exc}") from None
        self._mask_secrets(task.secrets.values())
        for warning in task.warnings:
            self.log.warning("%s", warning)
        return task

    @staticmethod
    def _ids(context: Context) -> tuple[str, str, str, int, int]:
        ti = context["ti"]
        return (ti.dag_id, ti.task_id, ti.run_id, int(ti.try_number or 1),
                int(getattr(ti, "map_index", -1) if getattr(ti, "map_index", -1) is not None
                    else -1))

    def _run_key(self, context: Context) -> tuple[str, str]:
        dag_id, task_id, run_id, try_number, map_index = self._ids(context)
        task_key = task_id if map_index < 0 else f"{task_id}-{map_index}"
        return (jobscript.job_name(dag_id, task_key, run_id, try_number, 0).rsplit("-a", 1)[0],
                jobscript.task_id_for(dag_id, task_key, run_id))

    # --- execute -----------------------------------------------------------------------------
    def execute(self, context: Context) -> Any:
        task = self.load(context)
        prefix, task_env_id = self._run_key(context)
        run = RunState(prefix=prefix, task_env_id=task_env_id)
        handle = self._adopt(run)
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
            if not self.wait_for_completion:
                self.log.info("Not waiting for job %s (wait_for_completion=False)",
                              handle.job_id)
                return handle.to_dict()
            if self.deferrable:
                self._defer_to_watch(context, handle, run)
            status, tail = self._poll_in_worker(handle, run)
            result = self._job_ended(context, task, run, handle, status, tail)
            if result is not None:
                return result
            handle = self._place_and_submit(context, task, run)

    def _adopt(self, run: RunState) -> JobHandle | None:
        """The job this try submitted before (the worker restarted, or execute ran twice).

        It is adopted whatever its state: a running job is watched, a finished one is judged
        as if the trigger had just seen it end (success, failover or restart by the rules), so
        a replay follows the same attempt names and never submits twice.
        """
        name = run.job_name
        hook = self._hook()
        for conn_id in hook.connections:
            try:
                handle = hook.backend(conn_id).find(name)
            except Exception as exc:  # an unreachable cluster cannot hold up the task
                self.log.warning("Could not check %s for an earlier job %s: %s", conn_id, name,
                                 exc)
                continue
            if handle is not None:
                self.log.info("Adopting job %s on %s (%s): this try submitted it before",
                              handle.job_id, conn_id, name)
                handle.adopted = True
                self._record(run, handle)
                return handle
        return None

    def _hook(self) -> SkyPilotCapacityHook:
        timeout = self.probe_timeout or conf.getfloat("skypilot", "probe_timeout", fallback=60.0)
        if not hasattr(self, "_capacity_hook"):
            self._capacity_hook = SkyPilotCapacityHook(self._conn_ids(), timeout=timeout)
        return self._capacity_hook

    def _place_and_submit(self, context: Context, task: Task, run: RunState) -> JobHandle | None:
        """Probe, rank, submit; on a refused submission, block that place and take the next.

        None when nothing can take the job now (places blocked, unreachable or over budget).
        """
        hook = self._hook()
        result = hook.probe(task)
        if result.misconfigured:
            raise AirflowFailException("misconfigured connection(s), nothing was submitted:\n"
                                       + "\n".join(f"  {conn_id}: {why}" for conn_id, why
                                                    in result.misconfigured.items()))
        for conn_id, error in result.errors.items():
            self.log.warning("Connection %s skipped for this placement: %s", conn_id, error)
        for _ in range(MAX_SUBMISSIONS):
            plan = placement.rank(result.offers, self.policy, ordered=task.ordered,
                                  blocked=run.blocked, unreachable=result.errors,
                                  prefer=run.prefer)
            self.log.info("Placement (policy %s):\n%s\n%s", self.policy, plan.table(),
                          plan.summary)
            self._push(context, XCOM_PLACEMENT, plan.to_json())
            if plan.chosen is None:
                run.last_plan = plan.summary
                if not any(r.verdict in ("blocked", "unreachable", "over budget")
                           for r in plan.rows) and plan.rows and not result.errors:
                    raise AirflowFailException(
                        "this task cannot run on any connected capacity:\n" + plan.table())
                return None
            offer = plan.chosen
            env = {"SKYPILOT_TASK_ID": run.task_env_id}
            try:
                handle = hook.backend(offer.connection).submit(task, offer, run.job_name, env)
            except SubmissionError as exc:
                if not exc.retry_elsewhere:
                    raise AirflowException(f"submission to {offer.place_key} failed: {exc}") \
                        from exc
                self.log.warning("Submission to %s failed, trying the next place: %s",
                                 offer.place_key, exc)
                run.blocked.append(Blocked(offer.place_key, f"submission failed: {exc}"))
                continue
            run.prefer = None
            self._record(run, handle)
            self.log.info("%s %s job %s on %s (%s) as %s", "Adopted" if handle.adopted else
                          "Submitted", handle.backend, handle.job_id, handle.connection,
                          handle.location, handle.job_name)
            return handle
        raise AirflowException(f"no place accepted the job after {MAX_SUBMISSIONS} submissions")

    def _record(self, run: RunState, handle: JobHandle) -> None:
        self._handle = handle
        run.record(handle)

    def _push(self, context: Context, key: str, value: Any) -> None:
        try:
            context["ti"].xcom_push(key=key, value=value)
        except Exception as exc:  # XCom is for the UI; never fail a job over it
            self.log.warning("Could not push XCom %s: %s", key, exc)

    def _defer_to_watch(self, context: Context, handle: JobHandle, run: RunState) -> None:
        state = run.to_dict()
        self.defer(
            trigger=SkyPilotJobTrigger(handle.to_dict(), poll_interval=self.poll_interval,
                                       max_unreachable=self.max_unreachable,
                                       log_offset=run.log_offset, stream_logs=self.stream_logs,
                                       cancel_on_kill=self.cancel_on_kill, state=state),
            method_name="execute_complete", kwargs={"state": state},
            timeout=self._remaining(context),
        )

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
            self.defer(trigger=SkyPilotWaitTrigger(self.reprobe_interval, state=state),
                       method_name="execute_complete", kwargs={"state": state},
                       timeout=self._remaining(context))
        time.sleep(self.reprobe_interval)

    def _poll_in_worker(self, handle: JobHandle, run: RunState) -> tuple[JobStatus, str]:
        """The non-deferrable watch: poll until the job ends; its status and log tail."""
        backend = backend_for_handle(handle)
        failures = 0
        while True:
            try:
                status = backend.status([handle]).get(handle.job_id) or JobStatus(
                    JobState.LOST, reason="not in the backend's answer")
                failures = 0
            except BackendError as exc:
                failures += 1
                self.log.warning("Polling %s failed (%d/%d): %s", handle.connection, failures,
                                 self.max_unreachable, exc)
                if failures < self.max_unreachable:
                    time.sleep(self.poll_interval)
                    continue
                status = JobStatus(JobState.LOST, reason=f"unreachable: {exc}")
            if self.stream_logs:
                run.log_offset = self._stream(backend, handle, run.log_offset)
            if status.state.terminal:
                return status, self._tail(backend, handle, run.log_offset)
            time.sleep(self.poll_interval)

    def _stream(self, backend: Backend, handle: JobHandle, offset: int) -> int:
        try:
            text, offset = backend.read_log(handle, offset)
        except Exception as exc:
            self.log.debug("Could not read the log of %s: %s", handle.key, exc)
            return offset
        for line in text.splitlines():
            self.log.info("[%s] %s", handle.job_id, line)
        return offset

    @staticmethod
    def _tail(backend: Backend, handle: JobHandle, offset: int) -> str:
        try:
            text, _ = backend.read_log(handle, max(0, offset - 32768))
        except Exception as exc:
            return f"(log unavailable: {exc})"
        return "\n".join(text.splitlines()[-LOG_TAIL_LINES:])

    # --- resume ------------------------------------------------------------------------------
    def execute_complete(self, context: Context, event: dict[str, Any] | None,
                         state: dict[str, Any] | None = None) -> Any:
        # The defer kwargs carry the state; `airflow dags test` drops them, so the trigger
        # hands the same state back in its event.
        event = event or {}
        run = RunState.from_dict(state or event.get("state"))
        task = self.load(context)
        if event.get("status") == "reprobe":  # the wait for capacity is over: probe again
            return self._run(context, task, run, self._place_and_submit(context, task, run))
        if not event or event.get("status") == "error":
            message = event.get("message", "no event")
            raise AirflowException(f"watching the SkyPilot job failed: {message}")
        handle = JobHandle.from_dict(event["handle"])
        self._handle = handle
        status = JobStatus.from_dict(event["job_status"])
        run.log_offset = event.get("log_offset", run.log_offset)
        result = self._job_ended(context, task, run, handle, status, event.get("log_tail") or "")
        if result is not None:
            return result
        return self._run(context, task, run, self._place_and_submit(context, task, run))

    def _job_ended(self, context: Context, task: Task, run: RunState, handle: JobHandle,
                   status: JobStatus, tail: str) -> dict[str, Any] | None:
        """Act on the failover rule: the result on success, None to place the job again;
        raises when the task fails."""
        ended = run.close(handle, status)
        self.log.info("Job %s on %s ended: %s%s", handle.job_id, handle.connection,
                      status.state.value, f" ({status.reason})" if status.reason else "")
        verdict = recovery.decide(run, ended, task.job_recovery, self.max_failovers, tail=tail)
        self._cleanup(handle, cancel=verdict.cancel)
        if verdict.action == recovery.SUCCEED:
            result = run.result(ended)
            self._push(context, XCOM_HANDLE, handle.to_dict())
            return result
        if verdict.action == recovery.FAIL:
            raise AirflowException(verdict.message)
        self.log.warning("%s", verdict.message)
        recovery.record(run, verdict)
        return None

    def _cleanup(self, handle: JobHandle, cancel: bool = False) -> None:
        try:
            backend = backend_for_handle(handle)
            if cancel:
                backend.cancel(handle)  # a lost job may still run somewhere: stop it
            backend.cleanup(handle)
        except Exception as exc:
            self.log.warning("Cleanup of %s job %s on %s failed: %s", handle.backend,
                             handle.job_id, handle.connection, exc)

    def resume_execution(self, next_method: str, next_kwargs: dict[str, Any] | None,
                         context: Context) -> Any:
        """Also stop the job when Airflow resumes the task only to fail it.

        When the deferral times out (``execution_timeout``) or the trigger itself crashes,
        Airflow schedules the task with ``next_method="__fail__"`` and the base class raises
        without calling ``execute_complete`` or any ``on_kill``: the job would run on unwatched
        (and a retry would start a second one). The handle is in XCom (pushed before deferring).
        """
        if next_method == TRIGGER_FAIL_REPR:
            self._cancel_unwatched_job(context, (next_kwargs or {}).get("error", "unknown"))
        return super().resume_execution(next_method, next_kwargs, context)

    def _cancel_unwatched_job(self, context: Context, why: Any) -> None:
        if not self.cancel_on_kill:
            return
        ti = context["ti"]
        try:
            raw = ti.xcom_pull(task_ids=ti.task_id, key=XCOM_HANDLE, map_indexes=ti.map_index)
        except Exception as exc:
            self.log.warning("Could not read the job handle to cancel the job: %s", exc)
            return
        if not raw:
            return
        handle = JobHandle.from_dict(raw)
        self._handle = handle
        self.log.warning("The deferral ended without the job's end (%s): cancelling %s job %s "
                         "on %s", why, handle.backend, handle.job_id, handle.connection)
        self._cleanup(handle, cancel=True)

    def on_kill(self) -> None:
        """Cancel the backend job when the task is killed while running in the worker."""
        if not self.cancel_on_kill or self._handle is None:
            return
        handle = self._handle
        self.log.info("Task killed: cancelling %s job %s on %s", handle.backend, handle.job_id,
                      handle.connection)
        try:
            backend_for_handle(handle).cancel(handle)
        except Exception as exc:
            self.log.warning("Could not cancel job %s: %s", handle.job_id, exc)
