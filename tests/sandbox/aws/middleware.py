"""WSGI middleware in front of moto: request counting, launch faults, the Service Quotas stub.

Everything that is not one of those passes through to moto untouched, so the clients see
moto's real behaviour over real HTTP.
"""

from __future__ import annotations

import io
import json
import threading
import uuid
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from typing import Any
from urllib.parse import parse_qs

from . import motopatch
from .config import ACCOUNT_ID, INSTANCE_KEY_PREFIX, OS_SHUTDOWN_UA, RUNNER_ACCESS_KEY_ID

StartResponse = Callable[..., Any]
WsgiApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]

# EC2 calls that do not change anything: they do not make the runner watch a region.
_READ_PREFIXES = ("Describe", "Get", "List")
_QUOTA_ACTIONS = (
    "GetServiceQuota",
    "ListServiceQuotas",
    "GetAWSDefaultServiceQuota",
    "ListAWSDefaultServiceQuotas",
)


class RequestCounter:
    """Counts AWS API requests by (service, action, region, caller)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rows: dict[tuple[str, str, str, str], list[int]] = {}

    def add(self, service: str, action: str, region: str, caller: str, error: bool) -> None:
        """Count one request (and whether it failed)."""
        with self._lock:
            row = self._rows.setdefault((service, action, region, caller), [0, 0])
            row[0] += 1
            row[1] += int(error)

    def reset(self) -> None:
        """Forget all counts."""
        with self._lock:
            self._rows.clear()

    def rows(self) -> list[dict[str, Any]]:
        """Return the counts, one row per (service, action, region, caller)."""
        with self._lock:
            items = sorted(self._rows.items())
        return [
            {"service": s, "action": a, "region": r, "caller": c, "count": n, "errors": e}
            for (s, a, r, c), (n, e) in items
        ]


class FaultTable:
    """Capacity faults: RunInstances of (instance type, AZ) fails; AZ "*" means every AZ."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._capacity: set[tuple[str, str]] = set()

    def fail_capacity(self, instance_type: str, az: str) -> None:
        """Make launches of this type in this AZ fail with InsufficientInstanceCapacity."""
        with self._lock:
            self._capacity.add((instance_type, az))

    def clear(self) -> None:
        """Remove every fault."""
        with self._lock:
            self._capacity.clear()

    def capacity_fails(self, instance_type: str, az: str) -> bool:
        """Return whether a launch of this type in this AZ should fail."""
        with self._lock:
            return (instance_type, az) in self._capacity or (instance_type, "*") in self._capacity

    def snapshot(self) -> dict[str, Any]:
        """Return the configured faults (for GET /_sandbox/faults)."""
        with self._lock:
            return {"capacity": [{"instance_type": t, "az": z} for t, z in sorted(self._capacity)]}


def _read_body(environ: dict[str, Any]) -> bytes:
    """Read the request body and put it back for the app behind us."""
    try:
        length = int(environ.get("CONTENT_LENGTH") or 0)
    except ValueError:
        length = 0
    body = environ["wsgi.input"].read(length) if length > 0 else b""
    environ["wsgi.input"] = io.BytesIO(body)
    return body


def _credential(environ: dict[str, Any]) -> tuple[str, str, str]:
    """Return (access key, region, service) from SigV4 (header or presigned query)."""
    auth = environ.get("HTTP_AUTHORIZATION", "")
    scope = ""
    if "Credential=" in auth:
        scope = auth.split("Credential=", 1)[1].split(",", 1)[0].strip()
    else:
        query = parse_qs(environ.get("QUERY_STRING", ""))
        scope = (query.get("X-Amz-Credential") or [""])[0]
    parts = scope.split("/")
    if len(parts) >= 5:
        return parts[0], parts[2], parts[3]
    return "", "us-east-1", ""


def s3_operation(
    method: str, path: str, query: dict[str, list[str]], environ: dict[str, Any]
) -> str:
    """Name the S3 REST operation of a path-style request (the common ones)."""
    parts = [p for p in path.split("/") if p]
    if not parts:
        return "ListBuckets" if method == "GET" else f"{method} /"
    if len(parts) == 1:
        bucket_ops = {
            "PUT": "CreateBucket",
            "DELETE": "DeleteBucket",
            "HEAD": "HeadBucket",
        }
        if method == "GET":
            if "location" in query:
                return "GetBucketLocation"
            if "uploads" in query:
                return "ListMultipartUploads"
            if "versions" in query:
                return "ListObjectVersions"
            return "ListObjectsV2" if query.get("list-type") == ["2"] else "ListObjects"
        if method == "POST" and "delete" in query:
            return "DeleteObjects"
        return bucket_ops.get(method, f"{method} bucket")
    if method == "PUT":
        if "partNumber" in query:
            return "UploadPart"
        if "HTTP_X_AMZ_COPY_SOURCE" in environ:
            return "CopyObject"
        if "tagging" in query:
            return "PutObjectTagging"
        return "PutObject"
    if method == "POST":
        if "uploads" in query:
            return "CreateMultipartUpload"
        if "uploadId" in query:
            return "CompleteMultipartUpload"
    if method == "DELETE":
        return "AbortMultipartUpload" if "uploadId" in query else "DeleteObject"
    if method == "GET":
        if "uploadId" in query:
            return "ListParts"
        return "GetObjectTagging" if "tagging" in query else "GetObject"
    if method == "HEAD":
        return "HeadObject"
    return f"{method} object"


def ec2_error(
    code: str, message: str, status: str = "500 Internal Server Error"
) -> tuple[str, list[tuple[str, str]], bytes]:
    """An EC2 (query protocol) error response exactly as AWS formats it."""
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Response><Errors><Error><Code>{code}</Code><Message>{message}</Message></Error>"
        f"</Errors><RequestID>{uuid.uuid4()}</RequestID></Response>"
    ).encode()
    headers = [
        ("Content-Type", "text/xml;charset=UTF-8"),
        ("Content-Length", str(len(body))),
        ("Server", "AmazonEC2"),
    ]
    return status, headers, body


class SandboxMiddleware:
    """Wraps moto's WSGI app; `control` answers /_sandbox/* and reacts to moto resets."""

    def __init__(
        self,
        app: WsgiApp,
        counter: RequestCounter,
        faults: FaultTable,
        quotas: Any,
        runner: Any,
        control: Any,
    ) -> None:
        self.app = app
        self.counter = counter
        self.faults = faults
        self.quotas = quotas
        self.runner = runner
        self.control = control
        #: RunInstances answers by (region, ClientToken): EC2 answers a request sent again with
        #: the token of one it already ran with that launch, and launches nothing (moto
        #: ignores the token)
        self.launched: dict[tuple[str, str], tuple[str, list[tuple[str, str]], bytes]] = {}

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path.startswith("/_sandbox/"):
            return self.control.handle(environ, start_response)
        if path.startswith("/moto-api"):
            result = self.app(environ, start_response)
            if path.startswith("/moto-api/reset") and environ.get("REQUEST_METHOD") == "POST":
                self.launched.clear()
                self.control.after_moto_reset()
            return result
        return self._aws(environ, start_response)

    def _aws(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        key, region, service = _credential(environ)
        method = environ.get("REQUEST_METHOD", "GET")
        query = parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True)
        ctype = environ.get("CONTENT_TYPE", "")
        params: dict[str, str] = {}
        body = b""
        target = environ.get("HTTP_X_AMZ_TARGET", "")
        if ctype.startswith("application/x-www-form-urlencoded"):
            body = _read_body(environ)
            params = {k: v[0] for k, v in parse_qs(body.decode(errors="replace")).items()}
        if target:
            action = target.rsplit(".", 1)[-1]
        elif "Action" in params or "Action" in query:
            action = params.get("Action") or query["Action"][0]
        elif service == "s3":
            action = s3_operation(method, environ.get("PATH_INFO", ""), query, environ)
        else:
            action = f"{method} {environ.get('PATH_INFO', '')}"[:80]
        caller = self._caller(key)

        status_box: list[str] = []
        headers_box: list[list[Any]] = []

        def recording_start_response(status: str, headers: list[Any], *args: Any) -> Any:
            status_box.append(status)
            headers_box.append(list(headers))
            return start_response(status, headers, *args)

        def respond(status: str, headers: list[tuple[str, str]], data: bytes) -> list[bytes]:
            recording_start_response(status, headers)
            return [data]

        try:
            if service == "servicequotas" and action in _QUOTA_ACTIONS:
                body = body or _read_body(environ)
                answer = self.quotas.handle(action, body, region)
                if answer is not None:
                    code, payload = answer
                    data = json.dumps(payload).encode()
                    status = "200 OK" if code == 200 else "400 Bad Request"
                    return respond(
                        status,
                        [
                            ("Content-Type", "application/x-amz-json-1.1"),
                            ("Content-Length", str(len(data))),
                            ("x-amzn-RequestId", str(uuid.uuid4())),
                        ],
                        data,
                    )
            reason_ctx: Any = nullcontext()
            if service == "ec2" and caller != "sandbox":
                if action == "RunInstances":
                    token = params.get("ClientToken")
                    if token and (region, token) in self.launched:
                        return respond(*self.launched[(region, token)])
                    fault = self._capacity_fault(region, params)
                    if fault is not None:
                        return respond(*fault)
                if (
                    action in ("TerminateInstances", "StopInstances")
                    and caller.startswith("instance:")
                    and OS_SHUTDOWN_UA in environ.get("HTTP_USER_AGENT", "")
                ):
                    own = caller.split(":", 1)[1]
                    if params.get("InstanceId.1") == own and "InstanceId.2" not in params:
                        reason_ctx = motopatch.state_reason(motopatch.INSTANCE_SHUTDOWN)
                if not action.startswith(_READ_PREFIXES):
                    self.runner.watch_region(region)
            with reason_ctx:
                result = self.app(environ, recording_start_response)
                # Materialize inside the reason context: moto computes lazily in some paths.
                data_list = list(result)
                if hasattr(result, "close"):
                    result.close()
            if service == "ec2" and action in ("RunInstances", "StartInstances"):
                self.runner.poke()
            token = params.get("ClientToken")
            if action == "RunInstances" and token and status_box and \
                    status_box[0].startswith("2") and caller != "sandbox":
                self.launched[(region, token)] = (status_box[0], headers_box[0],
                                                  b"".join(data_list))
            return data_list
        finally:
            if caller != "sandbox":
                failed = bool(status_box) and not status_box[0].startswith(("2", "3"))
                self.counter.add(service or "unknown", action, region, caller, failed)

    def _caller(self, key: str) -> str:
        if key == RUNNER_ACCESS_KEY_ID:
            return "sandbox"
        if key.startswith(INSTANCE_KEY_PREFIX):
            return "instance:" + self.runner.key_to_instance.get(key, "unknown")
        return "client"

    def _capacity_fault(
        self, region: str, params: dict[str, str]
    ) -> tuple[str, list[tuple[str, str]], bytes] | None:
        """Return an InsufficientInstanceCapacity response if this launch is faulted."""
        try:
            instance_type, az = launch_target(region, params)
        except Exception:  # e.g. an unknown region: let moto give its own answer
            return None
        if not self.faults.capacity_fails(instance_type, az):
            return None
        others = [
            z
            for z in offered_azs(region, instance_type)
            if z != az and not self.faults.capacity_fails(instance_type, z)
        ]
        message = (
            f"We currently do not have sufficient {instance_type} capacity in the Availability "
            f"Zone you requested ({az}). Our system will be working on provisioning additional "
            f"capacity. You can currently get {instance_type} capacity by not specifying an "
            "Availability Zone in your request"
            + (f" or choosing {', '.join(others)}." if others else ".")
        )
        return ec2_error("InsufficientInstanceCapacity", message)


def launch_target(region: str, params: dict[str, str]) -> tuple[str, str]:
    """Return the (instance type, AZ) a RunInstances request would land in, as moto places it."""
    from moto.ec2.models import ec2_backends

    backend = ec2_backends[ACCOUNT_ID][region]
    template: dict[str, Any] = {}
    lt_id = params.get("LaunchTemplate.LaunchTemplateId")
    lt_name = params.get("LaunchTemplate.LaunchTemplateName")
    if lt_id or lt_name:
        arg = {"LaunchTemplateId": lt_id} if lt_id else {"LaunchTemplateName": lt_name}
        if params.get("LaunchTemplate.Version"):
            arg["Version"] = params["LaunchTemplate.Version"]
        try:
            template = backend._get_template_from_args(arg).data or {}
        except Exception:
            template = {}
    instance_type = params.get("InstanceType") or template.get("InstanceType") or "m1.small"
    az = params.get("Placement.AvailabilityZone") or (template.get("Placement") or {}).get(
        "AvailabilityZone"
    )
    subnet_id = params.get("SubnetId") or params.get("NetworkInterface.1.SubnetId")
    if not subnet_id:
        nics = template.get("NetworkInterfaces") or [{}]
        subnet_id = nics[0].get("SubnetId") if isinstance(nics, list) and nics else None
    if not az and subnet_id:
        try:
            az = backend.get_subnet(subnet_id).availability_zone
        except Exception:
            az = None
    return instance_type, az or f"{region}a"


def offered_azs(region: str, instance_type: str) -> list[str]:
    """AZs of a region that offer an instance type (moto's offerings data)."""
    from moto.ec2.models import ec2_backends

    try:
        offers = ec2_backends[ACCOUNT_ID][region].describe_instance_type_offerings(
            "availability-zone", {"instance-type": [instance_type]}
        )
        return sorted(o["Location"] for o in offers)
    except Exception:
        return []
