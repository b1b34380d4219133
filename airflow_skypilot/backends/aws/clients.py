"""The AWS clients of one connection, and what an AWS error means.

Clients come from the amazon provider's hooks, so credentials, ``region_name`` and
``endpoint_url`` are read from the Airflow connection exactly as the provider reads them. Sync
calls use ``EC2Hook`` / ``AwsBaseHook(client_type=...)`` boto3 clients, cached per service,
region and retry budget; the triggerer's calls use the same hooks' aiobotocore clients
(``get_async_conn``), kept open per service and region until :meth:`AwsClients.aclose`.

Errors are classified once, here: "cannot talk to AWS at all" (no connection, no answer within
the connection's ``request_timeout``, or AWS saying it cannot answer now: throttling, internal
errors) becomes :class:`~airflow_skypilot.exceptions.BackendUnreachable` (the caller counts the
backend as down: "could not ask" is never an answer), anything else a
:class:`~airflow_skypilot.exceptions.BackendError` with AWS's code and message.
RunInstances refusals are told apart the same way: one AZ's capacity (another AZ may work)
versus the region's quota (no other AZ helps).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterable
from typing import Any

from airflow_skypilot.exceptions import BackendError, BackendUnreachable

#: RunInstances errors that are about this AZ (another AZ of the region may work)
CAPACITY_ERRORS = frozenset({
    "InsufficientInstanceCapacity", "InsufficientCapacity", "InsufficientHostCapacity",
    "InsufficientReservedInstanceCapacity", "Unsupported", "InsufficientFreeAddressesInSubnet",
    "SpotMaxPriceTooLow",
})
#: RunInstances errors about the region's quota (no other AZ helps)
QUOTA_ERRORS = frozenset({"VcpuLimitExceeded", "MaxSpotInstanceCountExceeded",
                          "InstanceLimitExceeded"})
#: AWS error codes that say "cannot answer now" (after botocore's own retries): errors,
#: timeouts, and every throttling code botocore's standard retry mode knows (Service Quotas
#: throttles with TooManyRequestsException) but LimitExceededException, which some services
#: use for a real limit
UNAVAILABLE_CODES = frozenset({
    "InternalError", "InternalFailure", "InternalServerError", "ServiceUnavailable",
    "Unavailable", "RequestLimitExceeded", "Throttling", "ThrottlingException", "SlowDown",
    "RequestTimeout", "RequestTimeoutException", "EC2ThrottledException", "ThrottledException",
    "RequestThrottledException", "TooManyRequestsException", "RequestThrottled",
    "ProvisionedThroughputExceededException", "TransactionInProgressException",
    "BandwidthLimitExceeded", "PriorRequestNotComplete", "500", "502", "503", "504",
})
#: botocore errors that mean "cannot talk to AWS at all"
_UNREACHABLE_NAMES = ("EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError",
                      "NoCredentialsError", "ConnectionClosedError", "NoRegionError",
                      "ClientConnectorError", "ServerDisconnectedError", "TimeoutError")


def client_error(exc: BaseException) -> tuple[str, str]:
    """(AWS error code, message) of a botocore error; the exception's type name otherwise."""
    response = getattr(exc, "response", None) or {}
    err = response.get("Error") or {}
    return str(err.get("Code") or type(exc).__name__), str(err.get("Message") or exc)


def is_unreachable(exc: BaseException) -> bool:
    """Did the call fail before AWS answered (network, credentials, timeout), or did AWS
    answer only that it cannot answer now?"""
    names = {c.__name__ for c in type(exc).__mro__}
    if names & set(_UNREACHABLE_NAMES) or isinstance(exc, (OSError, asyncio.TimeoutError)):
        return True
    return getattr(exc, "response", None) is not None and client_error(exc)[0] in \
        UNAVAILABLE_CODES


def chunks(items: list[Any], size: int) -> Iterable[list[Any]]:
    """``items`` in slices of at most ``size`` (the API's limit on names per call)."""
    for i in range(0, len(items), size):
        yield items[i:i + size]


class AwsClients:
    """The boto3 and aiobotocore clients of one Airflow connection."""

    def __init__(self, conn_id: str, request_timeout: Callable[[], float] = lambda: 20.0):
        self.conn_id = conn_id
        #: seconds one request may wait for an answer (asked for when a client is made)
        self._timeout = request_timeout
        self._clients: dict[tuple[str, str, int], Any] = {}
        self._lock = threading.Lock()
        self._aclients: dict[tuple[str, str], tuple[Any, Any]] = {}
        self._alock: asyncio.Lock | None = None

    def _config(self, attempts: int) -> Any:
        from botocore.config import Config

        # Few attempts: botocore retries HTTP 500s, and EC2 answers a capacity shortage with one.
        # A silent endpoint costs at most attempts x (connect + read timeout) and the backoff.
        return Config(retries={"total_max_attempts": attempts, "mode": "standard"},
                      connect_timeout=5, read_timeout=self._timeout())

    def _hook(self, service: str, region: str, attempts: int) -> Any:
        if service == "ec2":
            from airflow.providers.amazon.aws.hooks.ec2 import EC2Hook

            return EC2Hook(aws_conn_id=self.conn_id, region_name=region, api_type="client_type",
                           config=self._config(attempts))
        from airflow.providers.amazon.aws.hooks.base_aws import AwsBaseHook

        return AwsBaseHook(aws_conn_id=self.conn_id, client_type=service, region_name=region,
                           config=self._config(attempts))

    def client(self, service: str, region: str, attempts: int = 3) -> Any:
        """A boto3 client from the amazon provider's hook (cached per service and region)."""
        key = (service, region, attempts)
        with self._lock:
            if key not in self._clients:
                try:
                    self._clients[key] = self._hook(service, region, attempts).conn
                except Exception as exc:
                    raise BackendUnreachable(f"{self.conn_id}: cannot create the {service} "
                                             f"client for {region}: {exc}") from exc
            return self._clients[key]

    async def aclient(self, service: str, region: str) -> Any:
        """An aiobotocore client from the hook's ``get_async_conn`` (kept open; see aclose)."""
        if self._alock is None:
            self._alock = asyncio.Lock()
        async with self._alock:
            if (service, region) not in self._aclients:
                ctx = await self._hook(service, region, 3).get_async_conn()
                client = await ctx.__aenter__()
                self._aclients[(service, region)] = (ctx, client)
            return self._aclients[(service, region)][1]

    def close(self) -> None:
        with self._lock:
            for client in self._clients.values():
                try:
                    client.close()
                except Exception:  # closing is best effort
                    pass
            self._clients.clear()

    async def aclose(self) -> None:
        clients, self._aclients = self._aclients, {}
        for ctx, _ in clients.values():
            try:
                await ctx.__aexit__(None, None, None)
            except Exception:  # a broken connection is gone either way
                pass

    def error(self, exc: BaseException, what: str) -> BackendError:
        """The backend error for ``exc`` raised while doing ``what``: unreachable or an API
        error with its code."""
        code, message = client_error(exc)
        if is_unreachable(exc):
            return BackendUnreachable(f"{self.conn_id}: {what}: {type(exc).__name__}: {exc}")
        return BackendError(f"{self.conn_id}: {what}: {code}: {message}")
