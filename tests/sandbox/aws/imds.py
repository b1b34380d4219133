"""Per-instance EC2 instance metadata service (IMDSv2 tokens, v1 allowed unless required).

Each running instance gets its own server on 127.0.0.1:<port>; its processes find it through
AWS_EC2_METADATA_SERVICE_ENDPOINT, the variable the AWS SDKs read for the IMDS address.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

TOKEN_HEADER = "X-aws-ec2-metadata-token"
TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"


@dataclass
class InstanceMetadata:
    """What IMDS knows about one instance; `instance_action` is set by a spot interruption."""

    instance_id: str
    instance_type: str
    region: str
    availability_zone: str
    image_id: str
    local_ipv4: str
    local_hostname: str
    reservation_id: str
    lifecycle: str  # "spot" or "on-demand"
    launch_time: str
    user_data: bytes | None
    http_tokens: str = "optional"
    account_id: str = "123456789012"
    security_groups: list[str] = field(default_factory=list)
    iam_role: str | None = None
    credentials: dict[str, str] = field(default_factory=dict)
    ami_launch_index: int = 0
    mac: str = "0e:00:00:00:00:01"
    instance_action: dict[str, str] | None = None
    _tokens: dict[str, float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def issue_token(self, ttl: int) -> str:
        """Create an IMDSv2 session token valid for ttl seconds."""
        token = secrets.token_urlsafe(40)
        with self._lock:
            self._tokens[token] = time.monotonic() + ttl
        return token

    def token_valid(self, token: str) -> bool:
        """Return whether a token was issued here and has not expired."""
        with self._lock:
            expiry = self._tokens.get(token)
        return expiry is not None and expiry > time.monotonic()

    def identity_document(self) -> dict[str, Any]:
        """Return the instance identity document as AWS formats it."""
        return {
            "accountId": self.account_id,
            "architecture": "x86_64",
            "availabilityZone": self.availability_zone,
            "billingProducts": None,
            "devpayProductCodes": None,
            "marketplaceProductCodes": None,
            "imageId": self.image_id,
            "instanceId": self.instance_id,
            "instanceType": self.instance_type,
            "kernelId": None,
            "pendingTime": self.launch_time,
            "privateIp": self.local_ipv4,
            "ramdiskId": None,
            "region": self.region,
            "version": "2017-09-30",
        }

    def meta_data(self) -> dict[str, Any]:
        """Return the /latest/meta-data tree (nested dicts are directories)."""
        tree: dict[str, Any] = {
            "ami-id": self.image_id,
            "ami-launch-index": str(self.ami_launch_index),
            "hostname": self.local_hostname,
            "instance-id": self.instance_id,
            "instance-life-cycle": self.lifecycle,
            "instance-type": self.instance_type,
            "local-hostname": self.local_hostname,
            "local-ipv4": self.local_ipv4,
            "mac": self.mac,
            "placement": {
                "availability-zone": self.availability_zone,
                "region": self.region,
            },
            "reservation-id": self.reservation_id,
            "security-groups": "\n".join(self.security_groups),
            "services": {"domain": "amazonaws.com", "partition": "aws"},
        }
        if self.instance_action is not None:
            tree["spot"] = {
                "instance-action": json.dumps(self.instance_action),
                "termination-time": self.instance_action["time"],
            }
        if self.iam_role:
            tree["iam"] = {
                "info": json.dumps(
                    {
                        "Code": "Success",
                        "InstanceProfileArn": f"arn:aws:iam::{self.account_id}:instance-profile/"
                        f"{self.iam_role}",
                        "InstanceProfileId": "AIPASANDBOX0000000000",
                    }
                ),
                "security-credentials": {self.iam_role: json.dumps(self.credentials)},
            }
        return tree


def _lookup(tree: dict[str, Any], parts: list[str]) -> Any:
    node: Any = tree
    for part in parts:
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _listing(node: dict[str, Any]) -> str:
    return "\n".join(k + "/" if isinstance(v, dict) else k for k, v in node.items())


class _Handler(BaseHTTPRequestHandler):
    server: ImdsServer
    protocol_version = "HTTP/1.1"
    server_version = "EC2ws"
    sys_version = ""

    def log_message(self, format: str, *args: Any) -> None:
        """Stay quiet: instance processes may poll IMDS often."""

    def _send(self, status: int, body: bytes | str, ctype: str = "text/plain") -> None:
        data = body.encode() if isinstance(body, str) else body
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_PUT(self) -> None:
        """Issue an IMDSv2 token."""
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        if self.path.rstrip("/") != "/latest/api/token":
            self._send(404, "Not Found")
            return
        try:
            ttl = int(self.headers.get(TTL_HEADER, ""))
        except ValueError:
            self._send(400, "Missing or invalid " + TTL_HEADER)
            return
        if not 1 <= ttl <= 21600:
            self._send(400, "Invalid " + TTL_HEADER)
            return
        token = self.server.meta.issue_token(ttl)
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header(TTL_HEADER, str(ttl))
        self.send_header("Content-Length", str(len(token)))
        self.end_headers()
        self.wfile.write(token.encode())

    def do_GET(self) -> None:
        """Serve meta-data, user-data and the identity document."""
        meta = self.server.meta
        token = self.headers.get(TOKEN_HEADER)
        if token is not None and not meta.token_valid(token):
            self._send(401, "Unauthorized")
            return
        if token is None and meta.http_tokens == "required":
            self._send(401, "Unauthorized")
            return
        path = self.path.split("?", 1)[0]
        parts = [p for p in path.split("/") if p]
        if parts in ([], ["latest"]):
            self._send(200, "latest\n" if not parts else "dynamic\nmeta-data\nuser-data")
            return
        if parts[0] != "latest":
            self._send(404, "Not Found")
            return
        section, rest = (parts[1], parts[2:]) if len(parts) > 1 else ("", [])
        if section == "user-data" and not rest:
            if meta.user_data is None:
                self._send(404, "Not Found")
            else:
                self._send(200, meta.user_data, "application/octet-stream")
            return
        if section == "dynamic":
            tree: dict[str, Any] = {
                "instance-identity": {
                    "document": json.dumps(meta.identity_document(), indent=2),
                }
            }
        elif section == "meta-data":
            tree = meta.meta_data()
        else:
            self._send(404, "Not Found")
            return
        node = _lookup(tree, rest)
        if node is None:
            self._send(404, "Not Found")
        elif isinstance(node, dict):
            self._send(200, _listing(node))
        else:
            ctype = "application/json" if node.startswith("{") else "text/plain"
            self._send(200, node, ctype)


class ImdsServer(ThreadingHTTPServer):
    """An IMDS endpoint for one instance, served on its own thread."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, host: str, port: int, meta: InstanceMetadata) -> None:
        super().__init__((host, port), _Handler)
        self.meta = meta
        self._thread = threading.Thread(
            target=self.serve_forever,
            kwargs={"poll_interval": 0.5},
            name=f"imds-{meta.instance_id}",
            daemon=True,
        )

    @property
    def endpoint(self) -> str:
        """The value for AWS_EC2_METADATA_SERVICE_ENDPOINT."""
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> None:
        """Serve in the background."""
        self._thread.start()

    def stop(self) -> None:
        """Stop serving and release the port."""
        self.shutdown()
        self.server_close()
