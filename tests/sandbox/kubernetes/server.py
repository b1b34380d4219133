"""The sandbox's API server: kmock's KubernetesEmulator on loopback, with the gaps filled.

kmock 0.8 serves discovery (``/api``, ``/apis``, ``/api/v1``, ``/apis/batch/v1`` from its
bundled resource list), renders ``Status`` errors and stores objects. It cannot parse
``/api/v1/namespaces`` (unpacking error), treats subresources (``/log``, ``/status``,
``/eviction``) as the object itself, only knows ``watch=true`` (clients send ``watch=True``),
has no PUT, ignores selectors, and does not fill ``uid``/``resourceVersion``. So every
resource request is routed here first; everything else falls through to kmock.

Sandbox-only control endpoints live under ``/_sandbox/`` (see :func:`SandboxAPI._control`).
"""

import asyncio
import base64
import collections
import contextlib
import ctypes
import json
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp.web
import attrs
import kmock

from tests.sandbox.kubernetes.cluster import Cluster, api_error, not_found
from tests.sandbox.kubernetes.kubelet import reap_stale
from tests.sandbox.kubernetes.selectors import (
    SelectorError,
    parse_field_selector,
    parse_label_selector,
)
from tests.sandbox.kubernetes.store import NAMESPACES, PODS, Resource, Store, WatchEvent
from tests.sandbox.kubernetes.util import apply_patch, dumps, parse_time

log = logging.getLogger("k8s-sandbox")

FORBIDDEN_TOKEN = "no-pods-token"
#: a namespace labelled so refuses every token's lists of its objects (its RoleBinding gone)
FORBIDDEN_NAMESPACE_LABEL = "sandbox.airflow-skypilot.io/lists-forbidden"
SANDBOX_TOKEN = "sandbox-token"
VERSION = {
    "major": "1",
    "minor": "30",
    "gitVersion": "v1.30.0-sandbox",
    "gitCommit": "0000000000000000000000000000000000000000",
    "gitTreeState": "clean",
    "buildDate": "2024-04-17T00:00:00Z",
    "goVersion": "go1.22.2",
    "compiler": "gc",
    "platform": "linux/amd64",
}
MAX_WATCH_SECONDS = 1800


def parse_api_path(path: str) -> tuple[Resource, str | None, str | None, str | None] | None:
    """(resource, namespace, name, subresource) of a resource URL; None for other paths."""
    parts = [p for p in path.split("/") if p]
    if len(parts) >= 3 and parts[0] == "api":
        group, version, rest = "", parts[1], parts[2:]
    elif len(parts) >= 4 and parts[0] == "apis":
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        return None
    namespace = None
    if (
        rest[0] == "namespaces"
        and len(rest) >= 3
        and not (len(rest) == 3 and rest[2] in ("status", "finalize"))
    ):
        namespace, rest = rest[1], rest[2:]
    plural = rest[0]
    name = rest[1] if len(rest) > 1 else None
    subresource = "/".join(rest[2:]) or None
    return kmock.resource(group, version, plural), namespace, name, subresource


def token_of(request: aiohttp.web.BaseRequest) -> str:
    header = request.headers.get("Authorization", "")
    return header[7:].strip() if header.lower().startswith("bearer ") else ""


def truthy(value: str | None) -> bool:
    return (value or "").lower() in ("true", "1")


def cri_lines(data: bytes) -> list[bytes]:
    """A CRI log file's lines: split on newlines only, as the kubelet reads them (a ``\\r`` is
    part of a line: a progress bar's frames stay in it; ``bytes.splitlines`` split them apart)."""
    parts = data.split(b"\n")
    return parts[:-1] if parts[-1] == b"" else parts


@attrs.define(kw_only=True)
class SandboxAPI(kmock.KubernetesEmulator):
    """kmock's emulator with the sandbox's routing in front of it."""

    cluster: Cluster | None = attrs.field(default=None, init=False)
    store: Store | None = attrs.field(default=None, init=False)
    request_log: collections.deque[dict[str, Any]] = attrs.field(
        factory=lambda: collections.deque(maxlen=50000), init=False
    )
    stop_event: asyncio.Event = attrs.field(factory=asyncio.Event, init=False)

    async def __call__(self, raw: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        path = raw.path
        if path.startswith("/_sandbox"):
            return await self._safely(self._control, raw)
        self._count(raw)
        if path.rstrip("/") == "/version":
            return aiohttp.web.json_response(VERSION)
        if parse_api_path(path) is None:
            del self._requests[:]  # kmock keeps every request; a long-lived daemon must not
            return await super().__call__(raw)  # discovery, served by kmock
        return await self._safely(self._resource, raw)

    async def _safely(
        self, handler: Callable[[aiohttp.web.BaseRequest], Any], raw: aiohttp.web.BaseRequest
    ) -> aiohttp.web.StreamResponse:
        try:
            return await handler(raw)
        except kmock.KubernetesError as exc:
            return await self._render_error(exc)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as exc:
            log.exception("request %s %s failed", raw.method, raw.path_qs)
            return await self._render_error(api_error(500, "InternalError", repr(exc)))

    async def _serve_version(self, request: kmock.Request) -> kmock.Payload:
        """kmock names the core group version "/v1"; a real server says "v1"."""
        result = await super()._serve_version(request)
        if isinstance(result, dict) and str(result.get("groupVersion", "")).startswith("/"):
            result["groupVersion"] = result["groupVersion"][1:]
        return result

    async def _render_error(self, exc: Exception) -> aiohttp.web.StreamResponse:
        """A Status like the real API server's (kmock's would carry a Python traceback)."""
        if not isinstance(exc, kmock.KubernetesError):
            return await super()._render_error(exc)
        body: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Status",
            "metadata": {},
            "status": "Failure",
            "message": exc.message,
            "reason": exc.reason,
            "code": exc.status,
        }
        details = {k: v for k, v in (exc.details or {}).items() if v not in ("", None)}
        if details:
            body["details"] = details
        return self._json(body, exc.status)

    def _count(self, raw: aiohttp.web.BaseRequest) -> None:
        token = token_of(raw)
        self.request_log.append(
            {
                "method": raw.method,
                "path": raw.path,
                "query": dict(raw.query),
                "user": "no-pods"
                if token == FORBIDDEN_TOKEN
                else "sandbox"
                if token
                else "anonymous",
                "time": time.time(),
            }
        )

    # ------------------------------------------------------------------ resources
    async def _resource(self, raw: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        assert self.cluster is not None and self.store is not None
        parsed = parse_api_path(raw.path)
        assert parsed is not None
        res, namespace, name, sub = parsed
        method = raw.method.upper()
        query = raw.query
        info = self.store.info(res)
        if info is None:
            raise api_error(
                404,
                "NotFound",
                "the server could not find the requested resource",
                group=res.group,
                kind=res.plural,
            )
        if namespace is not None and not info.namespaced:
            raise api_error(404, "NotFound", "the server could not find the requested resource")
        verb = {
            "GET": "get" if name else "list",
            "POST": "create",
            "PUT": "update",
            "PATCH": "patch",
            "DELETE": "delete" if name else "deletecollection",
        }.get(method, "")
        if method == "GET" and truthy(query.get("watch")):
            verb = "watch"
        if (
            token_of(raw) == FORBIDDEN_TOKEN
            and res == PODS
            and verb in ("list", "watch")
            and not sub
        ):
            where = f'in the namespace "{namespace}"' if namespace else "at the cluster scope"
            raise api_error(
                403,
                "Forbidden",
                f'pods is forbidden: User "system:serviceaccount:'
                f'default:sandbox-no-pods" cannot {verb} resource "pods" in API group '
                f'"" {where}',
                kind="pods",
            )
        if namespace and verb in ("list", "watch") and not sub:
            ns_obj = self.store.get(NAMESPACES, None, namespace) or {}
            if (ns_obj.get("metadata", {}).get("labels") or {}).get(
                    FORBIDDEN_NAMESPACE_LABEL) == "true":
                raise api_error(
                    403,
                    "Forbidden",
                    f'{res.plural} is forbidden: User "system:serviceaccount:default:sandbox" '
                    f'cannot {verb} resource "{res.plural}" in API group "{res.group}" in the '
                    f'namespace "{namespace}"',
                    kind=res.plural,
                )
        body = await self._body(raw)

        if name is None:
            if method == "GET":
                return await self._list_or_watch(raw, res, namespace, verb == "watch")
            if method == "POST":
                created = self.cluster.create(
                    res, namespace, body, dry_run=query.get("dryRun") == "All"
                )
                return self._json(created, 201)
            if method == "DELETE":
                pred = self._predicate(res, query)
                return self._json(self.cluster.delete_collection(res, namespace, pred, body or {}))
            raise self._not_allowed(method)

        if sub is None:
            if method == "GET":
                obj = self.store.get(res, namespace, name)
                if obj is None:
                    raise not_found(res, name)
                return self._json(obj)
            if method == "PUT":
                return self._json(self.cluster.replace(res, namespace, name, body))
            if method == "PATCH":
                return self._json(self._patch(raw, res, namespace, name, body, None))
            if method == "DELETE":
                options = dict(body or {})
                for key in ("propagationPolicy", "gracePeriodSeconds", "orphanDependents"):
                    if key in query and key not in options:
                        value: Any = query[key]
                        if key == "gracePeriodSeconds":
                            value = int(value)
                        elif key == "orphanDependents":
                            value = truthy(value)
                        options[key] = value
                result, code, warnings = self.cluster.delete(res, namespace, name, options)
                response = self._json(result, code)
                for warning in warnings:
                    response.headers.add("Warning", f'299 - "{warning}"')
                return response
            raise self._not_allowed(method)

        if sub == "status" and "status" in info.subresources:
            if method == "GET":
                obj = self.store.get(res, namespace, name)
                if obj is None:
                    raise not_found(res, name)
                return self._json(obj)
            if method == "PUT":
                return self._json(self.cluster.replace(res, namespace, name, body, "status"))
            if method == "PATCH":
                return self._json(self._patch(raw, res, namespace, name, body, "status"))
            raise self._not_allowed(method)
        if res == PODS and sub == "log" and method == "GET":
            return await self._log(raw, namespace or "", name)
        if res == PODS and sub == "eviction" and method == "POST":
            self.cluster.evict(namespace or "", name)
            return self._json(
                {
                    "apiVersion": "v1",
                    "kind": "Status",
                    "metadata": {},
                    "status": "Success",
                    "code": 201,
                },
                201,
            )
        if res == PODS and sub == "binding" and method == "POST":
            target = ((body or {}).get("target") or {}).get("name", "")
            self.cluster.bind(namespace or "", name, target)
            return self._json(
                {
                    "apiVersion": "v1",
                    "kind": "Status",
                    "metadata": {},
                    "status": "Success",
                    "code": 201,
                },
                201,
            )
        raise api_error(404, "NotFound", "the server could not find the requested resource")

    @staticmethod
    async def _body(raw: aiohttp.web.BaseRequest) -> Any:
        text = await raw.text()
        if not text.strip():
            return None
        try:
            return json.loads(text)
        except ValueError as exc:
            raise api_error(
                400, "BadRequest", f"the body of the request was in an unknown format: {exc}"
            ) from exc

    @staticmethod
    def _not_allowed(method: str) -> kmock.KubernetesError:
        return api_error(
            405,
            "MethodNotAllowed",
            f"the server does not allow this method on the requested resource ({method})",
        )

    @staticmethod
    def _json(obj: Any, status: int = 200) -> aiohttp.web.Response:
        return aiohttp.web.Response(body=dumps(obj), status=status, content_type="application/json")

    def _patch(
        self,
        raw: aiohttp.web.BaseRequest,
        res: Resource,
        namespace: str | None,
        name: str,
        body: Any,
        sub: str | None,
    ) -> dict[str, Any]:
        assert self.cluster is not None and self.store is not None
        old = self.store.get(res, namespace, name)
        if old is None:
            raise not_found(res, name)
        try:
            new = apply_patch(old, body, raw.headers.get("Content-Type", ""))
        except ValueError as exc:
            raise api_error(
                415,
                "UnsupportedMediaType",
                f"the body of the request was in an unknown format - accepted media "
                f"types include: application/json-patch+json, "
                f"application/merge-patch+json, application/strategic-merge-patch+json"
                f" ({exc})",
            ) from exc
        except Exception as exc:  # jsonpatch conflicts, bad paths
            raise api_error(
                422,
                "Invalid",
                f"the server rejected our request due to an error in our request: {exc}",
            ) from exc
        precondition = isinstance(body, dict) and bool(
            (body.get("metadata") or {}).get("resourceVersion")
        )
        return self.cluster.replace(res, namespace, name, new, sub, precondition=precondition)

    def _predicate(self, res: Resource, query: Any) -> Callable[[dict[str, Any]], bool]:
        try:
            by_label = parse_label_selector(query.get("labelSelector"))
            by_field = parse_field_selector(query.get("fieldSelector"), str(res.plural))
        except SelectorError as exc:
            raise api_error(400, "BadRequest", str(exc)) from exc
        return lambda obj: by_label(obj) and by_field(obj)

    # ------------------------------------------------------------------ list / watch
    async def _list_or_watch(
        self, raw: aiohttp.web.BaseRequest, res: Resource, namespace: str | None, watch: bool
    ) -> aiohttp.web.StreamResponse:
        assert self.store is not None
        pred = self._predicate(res, raw.query)
        if watch:
            return await self._watch(raw, res, namespace, pred)
        items = [obj for obj in self.store.items(res, namespace) if pred(obj)]
        items.sort(key=lambda o: (o["metadata"].get("namespace") or "", o["metadata"]["name"]))
        meta: dict[str, Any] = {"resourceVersion": str(self.store.rv)}
        limit = int(raw.query.get("limit") or 0)
        token = raw.query.get("continue")
        if token:
            try:
                after = json.loads(base64.urlsafe_b64decode(token.encode()).decode())
            except ValueError as exc:
                raise api_error(400, "BadRequest", "continue key is not valid") from exc
            items = [
                o
                for o in items
                if [o["metadata"].get("namespace") or "", o["metadata"]["name"]] > after
            ]
        if limit and len(items) > limit:
            last = items[limit - 1]["metadata"]
            meta["continue"] = base64.urlsafe_b64encode(
                json.dumps([last.get("namespace") or "", last["name"]]).encode()
            ).decode()
            meta["remainingItemCount"] = len(items) - limit
            items = items[:limit]
        kind = self.store.kind(res)
        return self._json(
            {
                "apiVersion": self.store.api_version(res),
                "kind": f"{kind}List",
                "metadata": meta,
                "items": items,
            }
        )

    async def _watch(
        self,
        raw: aiohttp.web.BaseRequest,
        res: Resource,
        namespace: str | None,
        pred: Callable[[dict[str, Any]], bool],
    ) -> aiohttp.web.StreamResponse:
        """A watch stream: initial state (or replay from resourceVersion), then live events."""
        assert self.store is not None
        store = self.store
        timeout = min(int(raw.query.get("timeoutSeconds") or MAX_WATCH_SECONDS), MAX_WATCH_SECONDS)
        since = raw.query.get("resourceVersion") or ""
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(raw)  # type: ignore[arg-type]
        queue: asyncio.Queue[WatchEvent] = asyncio.Queue()
        store.watchers.add(queue)
        previous: dict[str, bool] = {}  # uid -> matched last time (for selector transitions)

        async def send(kind: str, obj: dict[str, Any]) -> None:
            await response.write(dumps({"type": kind, "object": obj}) + b"\n")

        def relevant(event: WatchEvent) -> bool:
            return event.resource == res and (namespace is None or event.namespace == namespace)

        try:
            if since in ("", "0"):
                for obj in store.items(res, namespace):
                    if pred(obj):
                        previous[obj["metadata"]["uid"]] = True
                        await send("ADDED", obj)
                seen = store.rv
            else:
                try:
                    seen = int(since)
                except ValueError:
                    seen = -1
                if seen < store.oldest_rv() or seen < 0:
                    await send(
                        "ERROR",
                        {
                            "apiVersion": "v1",
                            "kind": "Status",
                            "metadata": {},
                            "status": "Failure",
                            "reason": "Expired",
                            "code": 410,
                            "message": f"too old resource version: {since} ({store.oldest_rv()})",
                        },
                    )
                    return response
                for event in list(store.log):
                    if event.rv > seen and relevant(event):
                        await self._send_event(send, event, pred, previous)
                seen = store.rv
            deadline = time.monotonic() + timeout
            while (left := deadline - time.monotonic()) > 0 and not self.stop_event.is_set():
                try:
                    event = await asyncio.wait_for(queue.get(), timeout=min(left, 2.0))
                except TimeoutError:
                    continue
                if event.rv > seen and relevant(event):
                    await self._send_event(send, event, pred, previous)
            return response
        finally:
            store.watchers.discard(queue)
            with contextlib.suppress(Exception):
                await response.write_eof()

    @staticmethod
    async def _send_event(
        send: Callable[[str, dict[str, Any]], Any],
        event: WatchEvent,
        pred: Callable[[dict[str, Any]], bool],
        previous: dict[str, bool],
    ) -> None:
        """Send one event, turning selector transitions into ADDED/DELETED like a real watch."""
        uid = event.obj["metadata"].get("uid", "")
        matches = pred(event.obj)
        if uid in previous:
            was = previous[uid]
        else:  # first sight when resuming: a modified object was already known to the client
            was = matches if event.type == "MODIFIED" else False
        if event.type == "DELETED":
            previous.pop(uid, None)
            if matches or was:
                await send("DELETED", event.obj)
            return
        previous[uid] = matches
        if matches:
            await send("ADDED" if event.type == "ADDED" or not was else "MODIFIED", event.obj)
        elif was:  # left the selector: a real watch reports it as deleted
            await send("DELETED", event.obj)

    # ------------------------------------------------------------------ logs
    async def _log(
        self, raw: aiohttp.web.BaseRequest, namespace: str, name: str
    ) -> aiohttp.web.StreamResponse:
        assert self.cluster is not None and self.store is not None
        pod = self.store.get(PODS, namespace, name)
        if pod is None:
            raise not_found(PODS, name)
        query = raw.query
        mains = [c["name"] for c in pod["spec"].get("containers") or []]
        inits = [c["name"] for c in pod["spec"].get("initContainers") or []]
        container = query.get("container")
        if not container:
            if len(mains) != 1:
                raise api_error(
                    400,
                    "BadRequest",
                    f"a container name must be specified for pod "
                    f"{name}, choose one of: [{' '.join(mains)}]"
                    + (f" or one of the init containers: [{' '.join(inits)}]" if inits else ""),
                )
            container = mains[0]
        if container not in mains + inits:
            raise api_error(400, "BadRequest", f"container {container} is not valid for pod {name}")
        node = pod["spec"].get("nodeName")
        if node in self.cluster.kubelet.down_nodes:
            ip = self.cluster.node_ip(node)
            raise api_error(
                500,
                "InternalError",
                f'Get "https://{ip}:10250/containerLogs/'
                f'{namespace}/{name}/{container}": dial tcp {ip}:10250: connect: '
                "no route to host",
            )
        files = self.cluster.kubelet.log_files(pod, container)
        previous = truthy(query.get("previous"))
        if previous:
            if len(files) < 2:
                raise api_error(
                    400,
                    "BadRequest",
                    f'previous terminated container "{container}" in pod "{name}" not found',
                )
            files = [files[-2]]
        elif not files:
            statuses = [
                *(pod["status"].get("containerStatuses") or []),
                *(pod["status"].get("initContainerStatuses") or []),
            ]
            waiting = next(
                (
                    (s.get("state") or {}).get("waiting") or {}
                    for s in statuses
                    if s.get("name") == container
                ),
                {},
            )
            reason = waiting.get("reason") or "ContainerCreating"
            if reason in ("ErrImagePull", "ImagePullBackOff"):
                reason = "trying and failing to pull image"
            raise api_error(
                400,
                "BadRequest",
                f'container "{container}" in pod "{name}" is waiting to start: {reason}',
            )
        else:
            files = [files[-1]]
        path = files[0]
        timestamps = truthy(query.get("timestamps"))
        since_time = None
        if query.get("sinceSeconds"):
            since_time = time.time() - int(query["sinceSeconds"])
        elif query.get("sinceTime"):
            since_time = parse_time(query["sinceTime"]).timestamp()
        tail = int(query["tailLines"]) if query.get("tailLines") else None
        limit = int(query["limitBytes"]) if query.get("limitBytes") else None

        def render(lines: list[bytes]) -> bytes:
            out = []
            for line in lines:
                stamp, _, rest = line.partition(b" ")
                _, _, rest = rest.partition(b" ")  # stream
                _, _, content = rest.partition(b" ")  # F/P tag
                if since_time is not None:
                    try:
                        if parse_time(stamp.decode()).timestamp() < since_time:
                            continue
                    except ValueError:
                        pass
                out.append((stamp + b" " + content if timestamps else content) + b"\n")
            return b"".join(out)

        data = path.read_bytes()
        lines = cri_lines(data)
        body = render(lines if tail is None else lines[-tail:] if tail > 0 else [])
        if limit is not None:
            body = body[:limit]
        if not truthy(query.get("follow")) or previous:
            return aiohttp.web.Response(body=body, content_type="text/plain", charset="utf-8")
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "text/plain; charset=utf-8"})
        await response.prepare(raw)  # type: ignore[arg-type]
        await response.write(body)
        offset = len(data)
        uid = pod["metadata"]["uid"]
        while not self.stop_event.is_set():
            await asyncio.sleep(0.2)
            size = path.stat().st_size if path.exists() else offset
            if size > offset:
                with open(path, "rb") as handle:
                    handle.seek(offset)
                    chunk = handle.read(size - offset)
                complete = chunk.rfind(b"\n") + 1
                if complete:
                    await response.write(render(cri_lines(chunk[:complete])))
                    offset += complete
                    continue
            if not self._container_running(uid, container, path):
                break
        with contextlib.suppress(Exception):
            await response.write_eof()
        return response

    def _container_running(self, uid: str, container: str, path: Path) -> bool:
        assert self.cluster is not None
        run = self.cluster.kubelet.runs.get(uid)
        if run is None or container not in run.containers:
            return False
        cr = run.containers[container]
        current = run.poddir / "logs" / container / f"{cr.restart_count}.log"
        return current == path and cr.proc is not None and cr.proc.returncode is None

    # ------------------------------------------------------------------ /_sandbox control
    async def _control(self, raw: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        """Test hooks: ``GET ping|requests|processes``, ``POST reset|requests/reset``,
        ``POST pods/{ns}/{name}/evict``, ``POST nodes/{name}/{fail|restore|not-ready|cordon|
        uncordon|taint|untaint}`` (taint/untaint take a JSON body {key, effect, value})."""
        assert self.cluster is not None
        parts = [p for p in raw.path.split("/") if p][1:]
        method = raw.method.upper()
        body = await self._body(raw) or {}
        if method == "GET" and parts == ["ping"]:
            return self._json({"sandbox": "kubernetes", "pid": os.getpid()})
        if method == "GET" and parts == ["requests"]:
            return self._json(list(self.request_log))
        if method == "POST" and parts == ["requests", "reset"]:
            self.request_log.clear()
            return self._json({"ok": True})
        if method == "GET" and parts == ["processes"]:
            return self._json(self.cluster.kubelet.processes())
        if method == "POST" and parts == ["reset"]:
            await self.cluster.reset()
            self.request_log.clear()
            return self._json({"ok": True})
        if method == "POST" and len(parts) == 4 and parts[0] == "pods" and parts[3] == "evict":
            self.cluster.evict(parts[1], parts[2])
            return self._json({"ok": True})
        if method == "POST" and len(parts) == 3 and parts[0] == "nodes":
            name, action = parts[1], parts[2]
            actions: dict[str, Callable[[], None]] = {
                "fail": lambda: self.cluster.fail_node(name),  # type: ignore[union-attr]
                "restore": lambda: self.cluster.restore_node(name),  # type: ignore[union-attr]
                "not-ready": lambda: self.cluster.set_not_ready(name),  # type: ignore[union-attr]
                "cordon": lambda: self.cluster.cordon(name),  # type: ignore[union-attr]
                "uncordon": lambda: self.cluster.uncordon(name),  # type: ignore[union-attr]
                "taint": lambda: self.cluster.taint(  # type: ignore[union-attr]
                    name, body["key"], body.get("effect", "NoSchedule"), body.get("value", "")
                ),
                "untaint": lambda: self.cluster.untaint(name, body["key"]),  # type: ignore[union-attr]
            }
            if action in actions:
                actions[action]()
                return self._json({"ok": True})
        raise api_error(404, "NotFound", f"no sandbox control endpoint {method} {raw.path}")


def become_subreaper() -> None:
    """Adopt orphaned pod grandchildren so they can be reaped (PR_SET_CHILD_SUBREAPER)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)


async def serve(state_dir: Path, port: int, host: str = "127.0.0.1") -> None:
    """Run the API server and the controllers until SIGTERM/SIGINT, then stop every pod."""
    state_dir.mkdir(parents=True, exist_ok=True)
    pid_file = state_dir / "daemon.pid"
    stale = reap_stale(state_dir / "pods.pids")
    if stale:
        log.warning("killed %d pod process(es) left by a previous daemon", stale)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    become_subreaper()
    api = SandboxAPI()
    api.resources.load_bundled()
    store = Store(api)
    cluster = Cluster(store, state_dir, port)
    api.store, api.cluster = store, cluster
    cluster.bootstrap()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, api.stop_event.set)
    async with api, kmock.Server(api, host=host, port=port):
        pid_file.write_text(f"{os.getpid()}\n")
        log.info("kubernetes sandbox listening on http://%s:%d (pid %d)", host, port, os.getpid())
        controllers = asyncio.create_task(cluster.run(api.stop_event))
        await api.stop_event.wait()
        log.info("stopping: killing %d pod(s)", len(cluster.kubelet.runs))
        await cluster.kubelet.kill_all(grace=2)
        for _ in range(5):  # grandchildren die a moment after their group leader
            await asyncio.sleep(0.1)
            cluster.kubelet.reap_orphans()
        controllers.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await controllers
    reap_stale(state_dir / "pods.pids")
    with contextlib.suppress(FileNotFoundError):
        if pid_file.read_text().strip() == str(os.getpid()):
            pid_file.unlink()
    log.info("stopped")
