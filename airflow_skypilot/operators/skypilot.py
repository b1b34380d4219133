"""``SkyPilotOperator``: place a SkyPilot task where it can start soonest, run it, survive loss.

``execute`` loads the task (every problem reported before anything is submitted), adopts a job
this try already submitted if one is alive, probes every connection concurrently, ranks the
offers, submits, pushes the handle and the placement table to XCom, and defers. The trigger
watches the job; ``execute_complete`` finishes, places the job again elsewhere on an
infrastructure failure, or restarts it as ``job_recovery`` allows.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator
from airflow.sdk.configuration import conf
from airflow.sdk.exceptions import AirflowException, AirflowFailException

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
from airflow_skypilot.spec import Task, TaskValidationError, load_task
from airflow_skypilot.triggers.skypilot import (
    LOG_TAIL_LINES,
    SkyPilotJobTrigger,
    SkyPilotWaitTrigger,
)

if TYPE_CHECKING:
    from airflow.sdk import Context

XCOM_HANDLE = "skypilot_handle"
#: Airflow's next_method for "resume only to fail" (trigger timeout or trigger failure)
TRIGGER_FAIL_REPR = "__fail__"
XCOM_PLACEMENT = "skypilot_placement"


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
    :param policy: ``fastest`` (free now first, then soonest start, then price) or ``cheapest``.
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
    """

    template_fields: Sequence[str] = ("task_spec", "connections", "envs", "secrets", "policy")
    template_fields_renderers = {"task_spec": "yaml", "envs": "json"}
    ui_color = "#d6e4ff"
    # "SkyPilot job" button: the plugin's page with this try's placement table and attempts
    operator_extra_links = (SkyPilotJobLink(),)

    def __init__(
        self,
        *,
        task: str | os.PathLike[str] | Mapping[str, Any],
        connections: Sequence[str] | str | None = None,
        envs: Mapping[str, Any] | None = None,
        secrets: Mapping[str, Any] | None = None,
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
        self.task_spec = os.fspath(task) if isinstance(task, os.PathLike) else task
        self.connections = connections
        self.envs = envs if isinstance(envs, str) else dict(envs or {})
        self.secrets = secrets if isinstance(secrets, str) else dict(secrets or {})
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
        if policy not in placement.POLICIES and "{{" not in policy:
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

    def load(self, context: Context | None = None) -> Task:
        """The task with overrides applied; AirflowFailException (no retry) if it is invalid."""
        spec: Any = self.task_spec
        if isinstance(spec, str) and "\n" not in spec and spec.endswith((".yaml", ".yml")):
            if not os.path.isabs(spec):
                dag = getattr(self, "dag", None)
                base = os.path.dirname(getattr(dag, "fileloc", "") or "") or os.getcwd()
                spec = os.path.join(base, spec)
        envs, secrets = self.envs, self.secrets
        for name, value in (("envs", envs), ("secrets", secrets)):
            if not isinstance(value, Mapping):
                raise AirflowFailException(f"{name} must be a mapping after templating; got "
                                           f"{type(value).__name__}")
        try:
            task = load_task(spec, envs=envs, secrets=secrets, require_secrets=True)
        except TaskValidationError as exc:
            raise AirflowFailException(f"invalid SkyPilot task:\n{exc}") from None
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
        state: dict[str, Any] = {
            "prefix": prefix, "task_env_id": task_env_id, "attempt": 0, "attempts": [],
            "blocked": [], "failovers": 0, "restarts": 0, "code_restarts": 0, "prefer": None,
            "log_offset": 0, "started_at": time.time(),
        }
        handle = self._adopt(context, state)
        if handle is None:
            handle = self._place_and_submit(context, task, state)
        if handle is None:
            return self._wait_for_capacity(context, state)
        return self._watch(context, handle, state)

    def _adopt(self, context: Context, state: dict[str, Any]) -> JobHandle | None:
        """The job this try submitted before (the worker restarted, or execute ran twice).

        It is adopted whatever its state: a running job is watched, a finished one is judged
        as if the trigger had just seen it end (success, failover or restart by the rules), so
        a replay follows the same attempt names and never submits twice.
        """
        name = f"{state['prefix']}-a0"
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
                self._record_attempt(state, handle)
                return handle
        return None

    def _hook(self) -> SkyPilotCapacityHook:
        timeout = self.probe_timeout or conf.getfloat("skypilot", "probe_timeout", fallback=60.0)
        if not hasattr(self, "_capacity_hook"):
            self._capacity_hook = SkyPilotCapacityHook(self._conn_ids(), timeout=timeout)
        return self._capacity_hook

    def _place_and_submit(self, context: Context, task: Task,
                          state: dict[str, Any]) -> JobHandle | None:
        """Probe, rank, submit; on a refused submission, block that place and take the next."""
        hook = self._hook()
        blocked = [placement.Blocked.from_dict(b) for b in state["blocked"]]
        result = hook.probe(task)
        for conn_id, error in result.errors.items():
            self.log.warning("Connection %s skipped for this placement: %s", conn_id, error)
        for _ in range(8):
            plan = placement.rank(result.offers, self.policy, ordered=task.ordered,
                                  blocked=blocked, unreachable=result.errors,
                                  prefer=state.get("prefer"))
            self.log.info("Placement (policy %s):\n%s\n%s", self.policy, plan.table(),
                          plan.summary)
            self._push(context, XCOM_PLACEMENT, plan.to_json())
            if plan.chosen is None:
                state["last_plan"] = plan.summary
                if not any(r.verdict in ("blocked", "unreachable", "over budget")
                           for r in plan.rows) and plan.rows and not result.errors:
                    raise AirflowFailException(
                        "this task cannot run on any connected capacity:\n" + plan.table())
                return None
            offer = plan.chosen
            name = f"{state['prefix']}-a{state['attempt']}"
            env = {"SKYPILOT_TASK_ID": state["task_env_id"]}
            try:
                handle = hook.backend(offer.connection).submit(task, offer, name, env)
            except SubmissionError as exc:
                if not exc.retry_elsewhere:
                    raise AirflowException(f"submission to {offer.place_key} failed: {exc}") \
                        from exc
                self.log.warning("Submission to %s failed, trying the next place: %s",
                                 offer.place_key, exc)
                block = placement.Blocked(offer.place_key, f"submission failed: {exc}")
                blocked.append(block)
                state["blocked"].append(block.to_dict())
                continue
            state["prefer"] = None
            self._record_attempt(state, handle)
            self.log.info("%s %s job %s on %s (%s) as %s", "Adopted" if handle.adopted else
                          "Submitted", handle.backend, handle.job_id, handle.connection,
                          handle.location, handle.job_name)
            return handle
        raise AirflowException("no place accepted the job after 8 submissions")

    def _record_attempt(self, state: dict[str, Any], handle: JobHandle) -> None:
        self._handle = handle
        state["attempts"].append({
            "connection": handle.connection, "location": handle.location,
            "place": f"{handle.connection}/{handle.location}", "infra": handle.infra,
            "backend": handle.backend, "job_id": handle.job_id, "job_name": handle.job_name,
            "state": JobState.PENDING.value, "reason": "", "exit_code": None,
            "submitted_at": handle.submitted_at, "started_at": None, "ended_at": None,
            "gpus": handle.gpus_per_node * handle.num_nodes,
            "price_per_hour": handle.price_per_hour, "adopted": handle.adopted,
            "infra_failure": False,
        })
        state["log_offset"] = 0

    def _push(self, context: Context, key: str, value: Any) -> None:
        try:
            context["ti"].xcom_push(key=key, value=value)
        except Exception as exc:  # XCom is for the UI; never fail a job over it
            self.log.warning("Could not push XCom %s: %s", key, exc)

    def _watch(self, context: Context, handle: JobHandle, state: dict[str, Any]) -> Any:
        self._push(context, XCOM_HANDLE, handle.to_dict())
        if not self.wait_for_completion:
            self.log.info("Not waiting for job %s (wait_for_completion=False)", handle.job_id)
            return handle.to_dict()
        if self.deferrable:
            self.defer(
                trigger=SkyPilotJobTrigger(handle.to_dict(), poll_interval=self.poll_interval,
                                           max_unreachable=self.max_unreachable,
                                           log_offset=state["log_offset"],
                                           stream_logs=self.stream_logs,
                                           cancel_on_kill=self.cancel_on_kill, state=state),
                method_name="execute_complete", kwargs={"state": state},
                timeout=self._remaining(context),
            )
        return self._poll_in_worker(context, handle, state)

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

    def _wait_for_capacity(self, context: Context, state: dict[str, Any]) -> Any:
        """Nothing fits now (places blocked or unreachable): wait and probe again."""
        state.setdefault("waiting_since", time.time())
        self.log.info("Nothing can take the job now (%s); probing again in %gs",
                      state.get("last_plan", ""), self.reprobe_interval)
        waiting = {**state, "phase": "waiting"}
        if self.deferrable:
            self.defer(trigger=SkyPilotWaitTrigger(self.reprobe_interval, state=waiting),
                       method_name="execute_complete", kwargs={"state": waiting},
                       timeout=self._remaining(context))
        time.sleep(self.reprobe_interval)
        return self.execute_complete(context, None, waiting)

    def _poll_in_worker(self, context: Context, handle: JobHandle, state: dict[str, Any]) -> Any:
        """The non-deferrable path: the same semantics, polling from the worker."""
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
                state["log_offset"] = self._stream(backend, handle, state["log_offset"])
            if status.state.terminal:
                tail = self._tail(backend, handle, state["log_offset"])
                event = {"status": "done", "handle": handle.to_dict(),
                         "job_status": status.to_dict(), "log_tail": tail,
                         "log_offset": state["log_offset"]}
                return self.execute_complete(context, event, state)
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
        state = dict(state or (event or {}).get("state") or {})
        task = self.load(context)
        if state.pop("phase", None) == "waiting":
            handle = self._place_and_submit(context, task, state)
            if handle is None:
                return self._wait_for_capacity(context, state)
            return self._watch(context, handle, state)
        if not event or event.get("status") == "error":
            message = (event or {}).get("message", "no event")
            raise AirflowException(f"watching the SkyPilot job failed: {message}")
        handle = JobHandle.from_dict(event["handle"])
        self._handle = handle
        status = JobStatus.from_dict(event["job_status"])
        state["log_offset"] = event.get("log_offset", state.get("log_offset", 0))
        attempt = self._close_attempt(state, handle, status)
        self.log.info("Job %s on %s ended: %s%s", handle.job_id, handle.connection,
                      status.state.value, f" ({status.reason})" if status.reason else "")
        if status.state == JobState.SUCCEEDED:
            self._cleanup(handle)
            result = self._result(state, handle)
            self._push(context, XCOM_HANDLE, handle.to_dict())
            return result
        tail = event.get("log_tail") or ""
        place = attempt["place"]
        if status.state.infra_failure:
            attempt["infra_failure"] = True
            self._cleanup(handle, cancel=True)
            decision = recovery.strategy_for(task.job_recovery).on_infra_failure(
                place, status.reason or status.state.value, state["attempts"], time.time())
            if state["failovers"] >= self.max_failovers:
                raise AirflowException(
                    f"job lost to infrastructure failures {state['failovers'] + 1} times; gave "
                    f"up (max_failovers={self.max_failovers}). Last: {status.reason}\n"
                    + self._attempts_text(state))
            state["failovers"] += 1
        elif status.state == JobState.FAILED:
            self._cleanup(handle)
            decision = recovery.on_user_failure(
                task.job_recovery, status.exit_code, state["restarts"], state["code_restarts"],
                self.max_failovers, place)
            if not decision.again:
                raise AirflowException(
                    f"job {handle.job_id} on {handle.connection} failed: {status.reason}; "
                    f"{decision.reason}.\nLast lines of its log:\n{tail}")
            state["restarts" if decision.counts_as == "restart" else "code_restarts"] += 1
        else:  # CANCELLED outside Airflow, or anything unexpected: do not fight the user
            self._cleanup(handle)
            raise AirflowException(
                f"job {handle.job_id} on {handle.connection} ended {status.state.value}"
                f"{': ' + status.reason if status.reason else ''}; not placed again.\n{tail}")
        self.log.warning("%s", decision.reason)
        if decision.block is not None:
            state["blocked"].append(decision.block.to_dict())
        state["prefer"] = decision.prefer
        state["attempt"] += 1
        new = self._place_and_submit(context, task, state)
        if new is None:
            return self._wait_for_capacity(context, state)
        return self._watch(context, new, state)

    def _close_attempt(self, state: dict[str, Any], handle: JobHandle,
                       status: JobStatus) -> dict[str, Any]:
        attempt = next((a for a in reversed(state["attempts"])
                        if a["job_id"] == handle.job_id and a["connection"] == handle.connection),
                       None)
        if attempt is None:
            self._record_attempt(state, handle)
            attempt = state["attempts"][-1]
        attempt.update({"state": status.state.value, "reason": status.reason,
                        "exit_code": status.exit_code, "started_at": status.started_at,
                        "ended_at": status.ended_at or time.time()})
        return attempt

    def _cleanup(self, handle: JobHandle, cancel: bool = False) -> None:
        try:
            backend = backend_for_handle(handle)
            if cancel:
                backend.cancel(handle)  # a lost job may still run somewhere: stop it
            backend.cleanup(handle)
        except Exception as exc:
            self.log.warning("Cleanup of %s job %s on %s failed: %s", handle.backend,
                             handle.job_id, handle.connection, exc)

    def _result(self, state: dict[str, Any], handle: JobHandle) -> dict[str, Any]:
        gpu_hours = cost = 0.0
        for a in state["attempts"]:
            start = a.get("started_at") or a.get("submitted_at")
            end = a.get("ended_at") or time.time()
            hours = max(0.0, (end - start) / 3600) if start else 0.0
            gpu_hours += hours * (a.get("gpus") or 0)
            cost += hours * (a.get("price_per_hour") or 0)
        return {
            "state": "succeeded",
            "connection": handle.connection,
            "location": handle.location,
            "infra": handle.infra,
            "backend": handle.backend,
            "job_id": handle.job_id,
            "job_name": handle.job_name,
            "task_id": state.get("task_env_id"),
            "attempts": [{k: a.get(k) for k in (
                "connection", "location", "job_id", "state", "reason", "exit_code",
                "submitted_at", "started_at", "ended_at", "adopted")} for a in state["attempts"]],
            "gpu_hours": round(gpu_hours, 6),
            "cost": round(cost, 6),
        }

    @staticmethod
    def _attempts_text(state: dict[str, Any]) -> str:
        return "\n".join(f"  attempt {i + 1}: {a['connection']}/{a['location']} job "
                         f"{a['job_id']}: {a['state']} {a.get('reason') or ''}"
                         for i, a in enumerate(state["attempts"]))

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
