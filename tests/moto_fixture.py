"""moto in server mode for the AWS provider's tests, behind a small fault-injecting proxy.

`MotoServer` runs moto's threaded server on 127.0.0.1 (a free port); boto3 reaches it with
`endpoint_url`, as it would reach AWS, so nothing in boto3 is replaced. `AwsProxy` sits in
front of it and does what moto cannot:

- answers chosen calls with AWS error responses a given number of times (throttling, 5xx,
  a busy group), in each service's own wire format, and records every call it saw;
- plays the EKS control plane: after a node group's scaling config changes, it sets the
  desired capacity of the node group's Auto Scaling group, as EKS does (moto records the
  node group but launches nothing for it);
- plays a cloud out of capacity (`limit`): an Auto Scaling group runs at most so many
  instances, its desired capacity kept above them as InsufficientInstanceCapacity keeps
  it (moto launches every instance asked at once), until the limit is lifted and the
  group launches what it still asks. moto runs in this process, so the instances it
  launched past the limit are taken out of its group's record directly.
"""

from __future__ import annotations

import http.client
import json
import logging
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import boto3

REGION = "us-east-1"
CREDENTIALS = {"aws_access_key_id": "AKIAIOSFODNN7EXAMPLE", "aws_secret_access_key": "testing"}
_SCOPE = re.compile(r"Credential=[^/]+/\d+/[^/]+/([^/]+)/")
_EKS_PATHS = (
    (
        re.compile(r"^/clusters/[^/]+/node-groups/[^/]+/update-config$"),
        "POST",
        "UpdateNodegroupConfig",
    ),
    (re.compile(r"^/clusters/[^/]+/node-groups/[^/]+$"), "GET", "DescribeNodegroup"),
)


def session() -> boto3.session.Session:
    return boto3.session.Session(region_name=REGION, **CREDENTIALS)


class MotoServer:
    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)

    def start(self) -> MotoServer:
        self._server.start()
        return self

    @property
    def url(self) -> str:
        host, port = self._server.get_host_and_port()
        return f"http://{host}:{port}"

    def stop(self) -> None:
        self._server.stop()


@dataclass
class Fault:
    """Answer `action` with an AWS error `times` times, then let it through."""

    action: str
    code: str
    status: int
    times: int = 1
    message: str = "Rate exceeded"


@dataclass
class _Seen:
    calls: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


class AwsProxy:
    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.faults: list[Fault] = []
        self.seen = _Seen()
        self.capacity: dict[str, int] = {}  # Auto Scaling group -> most instances it can run
        self._lock = threading.Lock()
        handler = type("Handler", (_ProxyHandler,), {"proxy": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        direct = session()
        self._eks = direct.client("eks", endpoint_url=upstream)
        self._autoscaling = direct.client("autoscaling", endpoint_url=upstream)

    def start(self) -> AwsProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def reset(self) -> None:
        with self._lock:
            self.faults.clear()
            self.seen = _Seen()
            self.capacity.clear()

    def limit(self, asg: str, instances: int | None) -> None:
        """Let the group run at most `instances` from now on (None: as many as it asks)."""
        if instances is None:
            self.capacity.pop(asg, None)
            group = _moto_group(asg)
            group.set_desired_capacity(group.desired_capacity)  # launches what is missing
        else:
            self.capacity[asg] = instances
            self._hold_capacity()

    def _hold_capacity(self) -> None:
        """Take out of each limited group the instances moto launched past its limit,
        newest first, leaving its desired capacity as it was asked."""
        for name, limit in self.capacity.items():
            group = _moto_group(name)
            past = group.instance_states[limit:]
            if past:
                group.instance_states = group.instance_states[:limit]
                group.autoscaling_backend.ec2_backend.terminate_instances(
                    [state.instance.id for state in past]
                )

    def calls(self, action: str) -> int:
        return self.seen.calls.count(action)

    def _fault_for(self, action: str) -> Fault | None:
        with self._lock:
            self.seen.calls.append(action)
            for fault in self.faults:
                if fault.action == action and fault.times > 0:
                    fault.times -= 1
                    self.seen.failed.append(action)
                    return fault
        return None

    def _play_eks(self, path: str, body: bytes) -> None:
        """EKS applies a node group's desired size to its Auto Scaling group."""
        desired = json.loads(body or b"{}").get("scalingConfig", {}).get("desiredSize")
        if desired is None:
            return
        _, _, cluster, _, nodegroup, _ = path.split("/")
        described = self._eks.describe_nodegroup(clusterName=cluster, nodegroupName=nodegroup)
        for asg in described["nodegroup"]["resources"]["autoScalingGroups"]:
            self._autoscaling.set_desired_capacity(
                AutoScalingGroupName=asg["name"], DesiredCapacity=desired, HonorCooldown=False
            )


def _moto_group(name: str) -> Any:
    """The in-process moto Auto Scaling group called `name`."""
    from moto.autoscaling.models import autoscaling_backends

    for regions in autoscaling_backends.values():
        for backend in regions.values():
            if name in backend.autoscaling_groups:
                return backend.autoscaling_groups[name]
    raise KeyError(f"no Auto Scaling group {name} in moto")


def _action(service: str, method: str, path: str, body: bytes) -> str:
    if service == "eks":
        for pattern, verb, name in _EKS_PATHS:
            if verb == method and pattern.match(path):
                return name
        return f"{method} {path}"
    return parse_qs(body.decode()).get("Action", ["?"])[0]


def _error(service: str, fault: Fault, authorization: str) -> tuple[dict[str, str], bytes]:
    # A message that echoes request headers, as some AWS errors do: the provider must
    # scrub the credential material out of it.
    message = fault.message.replace("{authorization}", authorization)
    if service == "eks":
        body = json.dumps({"message": message}).encode()
        return {"Content-Type": "application/json", "x-amzn-ErrorType": fault.code}, body
    if service == "ec2":
        xml = (
            f"<Response><Errors><Error><Code>{fault.code}</Code><Message>{message}</Message>"
            "</Error></Errors><RequestID>fault</RequestID></Response>"
        )
    else:
        xml = (
            "<ErrorResponse><Error><Type>Sender</Type>"
            f"<Code>{fault.code}</Code><Message>{message}</Message></Error>"
            "<RequestId>fault</RequestId></ErrorResponse>"
        )
    return {"Content-Type": "text/xml"}, xml.encode()


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out in two writes
    proxy: AwsProxy

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _relay(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length)
        authorization = self.headers.get("Authorization", "")
        scope = _SCOPE.search(authorization)
        service = scope.group(1) if scope else "?"
        path = urlsplit(self.path).path
        action = _action(service, self.command, path, body)
        fault = self.proxy._fault_for(action)
        if fault is not None:
            headers, payload = _error(service, fault, authorization)
            self._answer(fault.status, headers, payload)
            return
        upstream = urlsplit(self.proxy.upstream)
        connection = http.client.HTTPConnection(upstream.hostname, upstream.port, timeout=30)
        try:
            forwarded = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
            connection.request(self.command, self.path, body=body, headers=forwarded)
            answer = connection.getresponse()
            payload = answer.read()
            headers = {
                k: v
                for k, v in answer.getheaders()
                if k.lower() not in ("transfer-encoding", "connection", "content-length")
            }
        finally:
            connection.close()
        if action == "UpdateNodegroupConfig" and answer.status == 200:
            self.proxy._play_eks(path, body)
        self.proxy._hold_capacity()  # what a call launched past a limit never came
        self._answer(answer.status, headers, payload)

    def _answer(self, status: int, headers: dict[str, str], payload: bytes) -> None:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_POST = do_PUT = do_DELETE = _relay
