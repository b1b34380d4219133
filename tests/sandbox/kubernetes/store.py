"""The object store: kmock's ``objects`` array plus what kmock 0.8 leaves out.

kmock keeps objects but does not fill ``metadata.uid/resourceVersion/creationTimestamp`` and
has no resource-version ordered event log, so watches cannot resume from a version. This
wrapper owns every write, so each one gets a fresh resourceVersion and one watch event.
"""

import asyncio
import collections
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import kmock

from tests.sandbox.kubernetes.util import clone

PODS = kmock.resource("", "v1", "pods")
NODES = kmock.resource("", "v1", "nodes")
NAMESPACES = kmock.resource("", "v1", "namespaces")
SECRETS = kmock.resource("", "v1", "secrets")
CONFIGMAPS = kmock.resource("", "v1", "configmaps")
SERVICES = kmock.resource("", "v1", "services")
EVENTS = kmock.resource("", "v1", "events")
SERVICEACCOUNTS = kmock.resource("", "v1", "serviceaccounts")
JOBS = kmock.resource("batch", "v1", "jobs")

Resource = kmock.resource


@dataclasses.dataclass(frozen=True)
class WatchEvent:
    """One change, as a watch stream sends it."""

    rv: int
    type: str
    resource: Resource
    namespace: str | None
    obj: dict[str, Any]


class Store:
    """Versioned objects on top of kmock's array; every write bumps one global version."""

    def __init__(self, emulator: kmock.KubernetesEmulator) -> None:
        self.objects = emulator.objects
        self.resources = emulator.resources
        self.rv = 1000
        self.log: collections.deque[WatchEvent] = collections.deque(maxlen=20000)
        self.watchers: set[asyncio.Queue[WatchEvent]] = set()
        self.on_change: list[Callable[[], None]] = []

    # ---- resource metadata ----
    def info(self, res: Resource) -> kmock.ResourceInfo | None:
        """The discovery info of a resource (kind, namespaced), or None if unknown."""
        return self.resources[res] if res in self.resources else None

    def kind(self, res: Resource) -> str:
        info = self.info(res)
        return (info.kind if info and info.kind else res.plural.capitalize()) if res.plural else ""

    @staticmethod
    def api_version(res: Resource) -> str:
        return f"{res.group}/{res.version}" if res.group else str(res.version)

    def namespaced(self, res: Resource) -> bool:
        info = self.info(res)
        return bool(info and info.namespaced)

    def oldest_rv(self) -> int:
        """The oldest version a watch can resume from (older ones get 410 Gone)."""
        return self.log[0].rv - 1 if len(self.log) == self.log.maxlen else 0

    # ---- reads ----
    def get(self, res: Resource, namespace: str | None, name: str) -> dict[str, Any] | None:
        key = (res, namespace if self.namespaced(res) else None, name)
        if key in self.objects and not self.objects[key].deleted:
            return clone(self.objects[key].raw)
        return None

    def items(self, res: Resource, namespace: str | None = None) -> list[dict[str, Any]]:
        """All live objects of a resource (in one namespace, or everywhere when None)."""
        return [clone(obj) for obj in self.iter_raw(res, namespace)]

    def iter_raw(self, res: Resource, namespace: str | None = None) -> Iterator[dict[str, Any]]:
        """Objects without copying: for read-only scans by the controllers."""
        for (key_res, key_ns, _), obj in list(self.objects.items()):
            if key_res == res and not obj.deleted and (namespace is None or key_ns == namespace):
                yield obj.raw

    def all_namespaced(self) -> list[tuple[Resource, str, str]]:
        return [
            (res, ns, name)
            for (res, ns, name), obj in list(self.objects.items())
            if ns is not None and not obj.deleted
        ]

    # ---- writes ----
    def next_rv(self) -> int:
        self.rv += 1
        return self.rv

    def put(self, res: Resource, obj: dict[str, Any], event: str = "MODIFIED") -> dict[str, Any]:
        """Store ``obj`` (ADDED or MODIFIED) with a new resourceVersion; return a copy."""
        meta = obj.setdefault("metadata", {})
        rv = self.next_rv()
        meta["resourceVersion"] = str(rv)
        obj.setdefault("apiVersion", self.api_version(res))
        obj.setdefault("kind", self.kind(res))
        namespace = meta.get("namespace") if self.namespaced(res) else None
        self.objects[res, namespace, meta["name"]] = clone(obj)
        self._emit(WatchEvent(rv, event, res, namespace, clone(obj)))
        return clone(obj)

    def remove(self, res: Resource, namespace: str | None, name: str) -> dict[str, Any] | None:
        """Hard-delete an object, with a DELETED event carrying its last state."""
        namespace = namespace if self.namespaced(res) else None
        key = (res, namespace, name)
        if key not in self.objects:
            return None
        entry = self.objects[key]
        last = None if entry.deleted else clone(entry.raw)
        del self.objects[key]
        if last is None:
            return None
        rv = self.next_rv()
        last.setdefault("metadata", {})["resourceVersion"] = str(rv)
        self._emit(WatchEvent(rv, "DELETED", res, namespace, clone(last)))
        return last

    def _emit(self, event: WatchEvent) -> None:
        self.log.append(event)
        for queue in list(self.watchers):
            if queue.qsize() < 10000:  # a stuck watcher must not grow memory without bound
                queue.put_nowait(event)
        if event.resource != EVENTS:  # events never drive a controller: no wake-up loops
            for callback in self.on_change:
                callback()
