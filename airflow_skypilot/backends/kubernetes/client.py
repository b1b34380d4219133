"""The Kubernetes API, through the cncf-kubernetes provider's hooks.

``KubernetesHook`` (sync: the worker) and ``AsyncKubernetesHook`` (the triggerer's event loop)
read the connection's kubeconfig, context and in-cluster extras. :class:`KubeClient` makes
every call with ``_preload_content=False`` and parses the JSON itself (the generated models
are slow and lossy), and turns errors into ours: an error status is :class:`KubeApiError`
(callers decide what 403/404/409 mean), no answer or refused credentials is
:class:`~airflow_skypilot.exceptions.BackendUnreachable`, and so is an API server that answered
only that it cannot answer now (429, 5xx: :class:`KubeApiUnavailable`, both at once). Every
call waits at most the connection's ``request_timeout``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from airflow.utils.log.logging_mixin import LoggingMixin

from airflow_skypilot.backends.kubernetes.names import CONTAINER
from airflow_skypilot.exceptions import BackendError, BackendUnreachable


class KubeApiError(BackendError):
    """The API server answered with an error status."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class KubeApiUnavailable(KubeApiError, BackendUnreachable):
    """The API server answered that it cannot answer now (overloaded, etcd down): "could not
    ask", never an answer about a job."""


def api_error(conn_id: str, status: int | None, body: Any) -> BackendError:
    """An API error status -> KubeApiError (or BackendUnreachable: no answer, no auth, or
    the server cannot answer now)."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else str(body or "")
    try:
        message = json.loads(text).get("message") or text
    except (ValueError, AttributeError):
        message = text
    message = message.strip()[:500]
    if not status:
        return BackendUnreachable(f"{conn_id}: Kubernetes API unreachable: {message}")
    if status == 401:
        return BackendUnreachable(f"{conn_id}: Kubernetes API refused the credentials: {message}")
    if status == 429 or status >= 500:
        return KubeApiUnavailable(status, f"{conn_id}: Kubernetes API cannot answer now: "
                                          f"{message}")
    return KubeApiError(status, message)


def _no_read_retries(api_client: Any) -> None:
    """urllib3 tries a request four times by default, a read timeout too: a silent API server
    would cost four ``request_timeout``s a call. Connection errors are still retried (twice);
    an answer that does not come is not waited for again (the next poll asks anyway)."""
    from urllib3.util import Retry

    pool = getattr(getattr(api_client, "rest_client", None), "pool_manager", None)
    kw = getattr(pool, "connection_pool_kw", None)
    if isinstance(kw, dict) and not isinstance(kw.get("retries"), Retry):
        kw["retries"] = Retry(total=2, connect=2, read=0, status=0, redirect=0)
        pool.clear()  # pools made before this keep their own retries


def truthy(value: Any) -> bool:
    return str(value).strip().lower() in ("true", "1", "yes", "on")


def import_clients() -> None:
    """Import the client libraries (about a second for the generated async client)."""
    import kubernetes.utils
    import kubernetes_asyncio.client
    import kubernetes_asyncio.config  # noqa: F401
    from airflow.providers.cncf.kubernetes.hooks import kubernetes  # noqa: F401


class KubeClient(LoggingMixin):
    """One connection's hooks, and API calls on them: JSON in and out, errors as ours.

    ``request_timeout`` is asked for at each call (the connection is only read when needed).
    """

    def __init__(self, conn_id: str, request_timeout: Callable[[], float]):
        super().__init__()
        self.conn_id = conn_id
        self._timeout = request_timeout
        self._hook: Any = None
        self._ahook: Any = None

    # --- the hooks ----------------------------------------------------------------------------
    def _sync_hook(self) -> Any:
        if self._hook is None:
            from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook
            from kubernetes import client

            # Our own Configuration: the hook would otherwise load a kubeconfig into the
            # process-wide default, which concurrent probes of other connections share. (The
            # provider loads in-cluster config into the default only: that one is shared.)
            hook = KubernetesHook(conn_id=self.conn_id)
            extras = hook.conn_extras or {}
            if not truthy(extras.get("in_cluster") or
                          extras.get("extra__kubernetes__in_cluster")):
                hook.client_configuration = client.Configuration()
            self._hook = hook
        return self._hook

    def apis(self) -> tuple[Any, Any]:
        """The sync ``CoreV1Api`` and ``BatchV1Api``."""
        try:
            hook = self._sync_hook()
            core, batch = hook.core_v1_client, hook.batch_v1_client
            _no_read_retries(core.api_client)
            return core, batch
        except Exception as exc:  # bad kubeconfig, missing context, no in-cluster env
            self._hook = None
            raise BackendUnreachable(f"{self.conn_id}: cannot load the Kubernetes "
                                     f"configuration: {type(exc).__name__}: {exc}") from exc

    @asynccontextmanager
    async def asession(self) -> AsyncIterator[tuple[Any, Any]]:
        """The async ``CoreV1Api`` and ``BatchV1Api`` of one client session."""
        from airflow.providers.cncf.kubernetes.hooks.kubernetes import AsyncKubernetesHook
        from kubernetes_asyncio import client as aclient

        if self._ahook is None:
            self._ahook = AsyncKubernetesHook(conn_id=self.conn_id)
        async with self._ahook.get_conn() as api:
            yield aclient.CoreV1Api(api), aclient.BatchV1Api(api)

    def close(self) -> None:
        hook, self._hook = self._hook, None
        if hook is not None and "api_client" in vars(hook):
            try:
                hook.api_client.close()
            except Exception:  # a broken pool is gone either way
                pass

    # --- calls --------------------------------------------------------------------------------
    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """One API call on the sync client, JSON in and out; errors as our exceptions."""
        from kubernetes.client.exceptions import ApiException

        try:
            resp = fn(*args, _preload_content=False, _request_timeout=self._timeout(), **kwargs)
            body = resp.data
        except ApiException as exc:
            raise api_error(self.conn_id, exc.status, exc.body or exc.reason) from None
        except Exception as exc:  # urllib3 connection errors, timeouts
            raise BackendUnreachable(f"{self.conn_id}: Kubernetes API unreachable: "
                                     f"{type(exc).__name__}: {exc}") from exc
        return json.loads(body) if body else {}

    async def acall(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """One API call on the async client (raw response: we check the status ourselves)."""
        from kubernetes_asyncio.client.exceptions import ApiException

        try:
            resp = await fn(*args, _preload_content=False, _request_timeout=self._timeout(),
                            **kwargs)
            try:
                body = await resp.read()
                status = resp.status
            finally:
                resp.release()
        except ApiException as exc:
            raise api_error(self.conn_id, exc.status, exc.body or exc.reason) from None
        except Exception as exc:  # aiohttp errors, timeouts
            raise BackendUnreachable(f"{self.conn_id}: Kubernetes API unreachable: "
                                     f"{type(exc).__name__}: {exc}") from exc
        if not 200 <= status < 300:
            raise api_error(self.conn_id, status, body)
        return json.loads(body) if body else {}

    def pod_log(self, core: Any, namespace: str, pod: str, limit: int | None = None,
                tail_lines: int | None = None) -> bytes:
        """The job container's log of ``pod`` (at most ``limit`` bytes, or its last
        ``tail_lines`` lines); b"" if it has none."""
        from kubernetes.client.exceptions import ApiException

        kwargs = _log_kwargs(limit, tail_lines)
        try:  # kubernetes 36's sync client mangles logs unless the raw response is read
            resp = core.read_namespaced_pod_log(pod, namespace, container=CONTAINER,
                                                _preload_content=False,
                                                _request_timeout=self._timeout(), **kwargs)
            return resp.data or b""
        except ApiException as exc:  # no log yet, or its node is gone
            self.log.debug("No log for pod %s: %s", pod, exc.status)
            return b""
        except Exception as exc:
            raise BackendUnreachable(f"{self.conn_id}: {type(exc).__name__}: {exc}") from exc

    async def apod_log(self, core: Any, namespace: str, pod: str, limit: int | None = None,
                       tail_lines: int | None = None) -> bytes:
        """As :meth:`pod_log` on the async client; any failure is "nothing new to show"."""
        kwargs = _log_kwargs(limit, tail_lines)
        try:
            resp = await core.read_namespaced_pod_log(
                pod, namespace, container=CONTAINER, _preload_content=False,
                _request_timeout=self._timeout(), **kwargs)
            try:
                body = await resp.read()
                ok = 200 <= resp.status < 300
            finally:
                resp.release()
        except Exception as exc:  # no log yet, or its node is gone: nothing new to show
            self.log.debug("No log for pod %s: %s", pod, exc)
            return b""
        return body if ok else b""


def _log_kwargs(limit: int | None, tail_lines: int | None) -> dict[str, Any]:
    """The log API's bounds: ``limitBytes`` from the start, or ``tailLines`` from the end."""
    kwargs: dict[str, Any] = {"limit_bytes": limit} if limit else {}
    if tail_lines:
        kwargs["tail_lines"] = tail_lines
    return kwargs
