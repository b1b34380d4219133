"""A job's output: rank 0's pod log while the job runs; once every pod has ended the other
ranks follow, each line prefixed ``(rank N) `` (:mod:`airflow_skypilot.backends.common.logs`,
as on AWS). Offsets are bytes into that text, which only ever grows.

The log API reads from the start of a pod's log only, so a read asks for at most
``offset + LOG_CHUNK + 1`` bytes of rank 0 and returns at most :data:`LOG_CHUNK` bytes of
whole lines. The triggerer's batched read (:func:`aread_many`) takes the pods of the poll just
before it when the caller has them, so it costs one log request per job and nothing more
(Kubernetes cannot return many pods' logs); else one pod list per namespace for all jobs.

Two things break the "only ever grows" rule, and a read recovers from each (:func:`_assemble`):

* the kubelet rotates a container's log (10 MiB by default) and the API then serves only the
  newest file: rank 0's text comes back shorter than the offset. The read re-anchors: a
  :data:`ROTATED` line, then the newest file from its start, and offsets from then on count
  in it.
* the Job controller deletes the pods still running when another rank fails, rank 0's
  included: a rank's bytes are never read as rank 0's. While rank 0 is gone and another rank
  still runs nothing is read; once the remaining pods have all ended, their logs (the failed
  rank's among them) follow a :data:`RANK0_GONE` line, at offsets from :data:`GONE_BASE` on, so
  a later read finds them again and never repeats them.

A failure's tail (:func:`read_tail`) is the end of that text without reading it from the start:
the log API gives a pod's last lines (``tailLines``; it has no "last bytes"), so each pod it
needs is asked for its last lines, and :func:`~airflow_skypilot.backends.base.tail_text` joins
them and keeps at most the bytes asked for.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from airflow_skypilot.backends.base import TAIL_BYTES, JobHandle, tail_text
from airflow_skypilot.backends.common.logs import LOG_CHUNK, join_logs, slice_log
from airflow_skypilot.backends.kubernetes.client import KubeClient
from airflow_skypilot.backends.kubernetes.cluster import TERMINAL
from airflow_skypilot.backends.kubernetes.names import LABEL_JOB
from airflow_skypilot.backends.kubernetes.status import PodView, pods_of

__all__ = ["GONE_BASE", "LOG_CHUNK", "TAIL_BYTES", "aread_many", "aread_tail", "join_logs",
           "log_plan", "read", "read_tail", "slice_log"]

#: offsets at and past this count in the other ranks' logs of a job whose rank-0 pod is gone
GONE_BASE = 1 << 40
ROTATED = ("[log rotated: the Kubernetes API serves only rank 0's newest log file; earlier "
           "output is gone from it]\n")
RANK0_GONE = ("[the pod of rank 0 is gone (the Job controller deleted it when the job "
              "ended); the other ranks' logs follow]\n")


def log_plan(pods: list[Mapping[str, Any]], num_nodes: int) -> tuple[list[PodView], bool]:
    """The pods whose logs make up the job's output (newest per rank, rank order) and whether
    every rank has ended (then the text is final)."""
    latest: dict[int, PodView] = {}
    for v in sorted((PodView.parse(p) for p in pods), key=lambda v: v.created):
        latest[v.rank] = v
    plan = [latest[r] for r in sorted(latest)]
    final = len(plan) >= num_nodes and all(v.phase in TERMINAL for v in plan)
    return plan, final


def _started(view: PodView) -> bool:
    """A pod that never started has no log to ask for."""
    return not (view.phase == "Pending" and not view.started)


def _to_read(plan: list[PodView], final: bool) -> tuple[str, list[PodView]]:
    """("rank0", plan): rank 0's log (then the others if final); ("gone", pods): rank 0's pod
    is gone and every remaining pod has ended; ("wait", []): rank 0 is gone, others run."""
    if plan and plan[0].rank == 0:
        return "rank0", plan
    if plan and all(v.phase in TERMINAL for v in plan):
        return "gone", plan
    return "wait", []


def _assemble(mode: str, logs: list[tuple[int, bytes]], offset: int,
              final: bool) -> tuple[str, int]:
    """The text from ``offset`` out of the logs read for ``mode`` (see the module docstring)."""
    if mode == "gone":
        data = join_logs([(0, b""), *logs], True)
        if offset < GONE_BASE:
            text, end = slice_log(data, 0, True, LOG_CHUNK)
            return RANK0_GONE + text, GONE_BASE + end
        text, end = slice_log(data, offset - GONE_BASE, True, LOG_CHUNK)
        return text, GONE_BASE + end
    data = join_logs(logs, final)
    if logs[0][1] and offset > len(data):  # rotated: the newest file is shorter than we read
        text, end = slice_log(data, 0, final, LOG_CHUNK)
        return ROTATED + text, end
    return slice_log(data, offset, final, LOG_CHUNK)


def _list_pods(client: KubeClient, core: Any, namespace: str,
               handle: JobHandle) -> list[dict[str, Any]]:
    found = client.call(core.list_namespaced_pod, namespace,
                        label_selector=f"{LABEL_JOB}={handle.job_name}")
    return pods_of(handle.job_name, found.get("items") or [], handle.extra.get("uid"))


def read(client: KubeClient, namespace: str, handle: JobHandle, offset: int,
         pods: list[dict[str, Any]] | None) -> tuple[str, int]:
    """The job's text from byte ``offset`` on the sync client; ``pods`` None: list them."""
    core, _ = client.apis()
    if pods is None:
        pods = _list_pods(client, core, namespace, handle)
    plan, final = log_plan(pods, handle.num_nodes)
    mode, plan = _to_read(plan, final)
    if mode == "wait":
        return "", offset

    def pod_log(view: PodView, limit: int | None = None) -> bytes:
        return client.pod_log(core, namespace, view.name, limit) if _started(view) else b""

    if mode == "gone":
        return _assemble(mode, [(v.rank, pod_log(v)) for v in plan], offset, True)
    # rank 0 up to what this call can return: the log API reads from the start only
    first = pod_log(plan[0], offset + LOG_CHUNK + 1)
    final = final and len(first) <= offset + LOG_CHUNK
    logs = [(plan[0].rank, first)]
    if final:
        logs += [(v.rank, pod_log(v)) for v in plan[1:]]
    return _assemble(mode, logs, offset, final)


async def aread_many(client: KubeClient, requests: list[tuple[JobHandle, int]],
                     cached: Mapping[str, list[dict[str, Any]]], default_namespace: str
                     ) -> dict[str, tuple[str, int]]:
    """New output of many jobs in one client session, keyed by job id. ``cached``: the pods
    of jobs just seen, by job id; the others are listed (one pod list per namespace), then
    the logs are read a few at a time."""
    out: dict[str, tuple[str, int]] = {}

    def namespace(handle: JobHandle) -> str:
        return handle.extra.get("namespace") or default_namespace

    async with client.asession() as (core, _batch):
        pods: dict[str, list[dict[str, Any]]] = {}
        missing: dict[str, list[JobHandle]] = {}
        for handle, _ in requests:
            if handle.job_id in cached:
                pods[handle.job_id] = cached[handle.job_id]
            else:
                missing.setdefault(namespace(handle), []).append(handle)
        for ns, handles in missing.items():
            selector = (f"{LABEL_JOB}={handles[0].job_name}" if len(handles) == 1
                        else LABEL_JOB)
            found = (await client.acall(core.list_namespaced_pod, ns,
                                        label_selector=selector)).get("items") or []
            for h in handles:
                pods[h.job_id] = pods_of(h.job_name, found, h.extra.get("uid"))
        gate = asyncio.Semaphore(8)  # Kubernetes has no API for the logs of many pods

        async def pod_log(ns: str, view: PodView, limit: int | None = None) -> bytes:
            return await client.apod_log(core, ns, view.name, limit) if _started(view) else b""

        async def one(handle: JobHandle, offset: int) -> None:
            ns = namespace(handle)
            plan, final = log_plan(pods[handle.job_id], handle.num_nodes)
            mode, plan = _to_read(plan, final)
            if mode == "wait":
                out[handle.job_id] = ("", offset)
                return
            async with gate:
                if mode == "gone":
                    logs = [(v.rank, await pod_log(ns, v)) for v in plan]
                    final = True
                else:
                    first = await pod_log(ns, plan[0], offset + LOG_CHUNK + 1)
                    final = final and len(first) <= offset + LOG_CHUNK
                    logs = [(plan[0].rank, first)]
                    if final:
                        logs += [(v.rank, await pod_log(ns, v)) for v in plan[1:]]
            out[handle.job_id] = _assemble(mode, logs, offset, final)

        await asyncio.gather(*(one(h, o) for h, o in requests))
    return out


#: the log API cuts a tail by lines only: one line asked for per this many bytes of a tail
#: (longer lines are cut to the bytes asked for after)
TAIL_LINE_BYTES = 64


def _tail_plan(pods: list[dict[str, Any]], num_nodes: int,
               max_bytes: int) -> tuple[list[PodView], list[tuple[int, bytes, bool]], int]:
    """(the pods whose ends make the text's end, the parts known without reading, lines to
    ask each for). Rank 0's pod gone: the text starts with :data:`RANK0_GONE`."""
    plan, final = log_plan(pods, num_nodes)
    mode, plan = _to_read(plan, final)
    known = [(0, RANK0_GONE.encode(), True)] if mode == "gone" else []
    # rank 0 alone until every rank has ended (the text is then final)
    return (plan if mode == "gone" or final else plan[:1]), known, \
        max(1, max_bytes // TAIL_LINE_BYTES)


def _tail(known: list[tuple[int, bytes, bool]], ends: list[tuple[int, bytes]], lines: int,
          max_bytes: int) -> str:
    """One line more than ``lines`` was asked for: a pod with more has lost its start."""
    return tail_text([*known, *((rank, data, len(data.splitlines()) <= lines)
                                for rank, data in ends)], max_bytes)


def read_tail(client: KubeClient, namespace: str, handle: JobHandle, max_bytes: int,
              pods: list[dict[str, Any]] | None) -> str:
    """The end of the job's text (at most ``max_bytes`` bytes); ``pods`` None: list them."""
    core, _ = client.apis()
    if pods is None:
        pods = _list_pods(client, core, namespace, handle)
    views, known, lines = _tail_plan(pods, handle.num_nodes, max_bytes)
    ends = [(v.rank, client.pod_log(core, namespace, v.name, tail_lines=lines + 1)
             if _started(v) else b"") for v in views]
    return _tail(known, ends, lines, max_bytes)


async def aread_tail(client: KubeClient, namespace: str, handle: JobHandle, max_bytes: int,
                     pods: list[dict[str, Any]] | None) -> str:
    """As :func:`read_tail` on the async client."""
    async with client.asession() as (core, _batch):
        if pods is None:
            found = await client.acall(core.list_namespaced_pod, namespace,
                                       label_selector=f"{LABEL_JOB}={handle.job_name}")
            pods = pods_of(handle.job_name, found.get("items") or [], handle.extra.get("uid"))
        views, known, lines = _tail_plan(pods, handle.num_nodes, max_bytes)
        ends = [(v.rank, await client.apod_log(core, namespace, v.name, tail_lines=lines + 1)
                 if _started(v) else b"") for v in views]
    return _tail(known, ends, lines, max_bytes)
