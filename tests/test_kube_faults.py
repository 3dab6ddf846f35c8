"""The reconcile loop against a failing Kubernetes API: an API server that never answers or
answers 500 fails the pass within the request timeout (it never stalls the loop), nothing is
decided or done on a pass that could not read the cluster, and once the API answers again
the next pass acts exactly once. The API is the fake API server behind a proxy whose
behaviour the test switches."""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import pandas as pd
import pytest
from fake_kube import FakeKube
from live_fixtures import fast_policy, pool

from predictor.telemetry.store import TelemetryStore
from scaler.controller.config import LiveConfig
from scaler.controller.reconcile import Reconciler
from scaler.controller.system import LiveSystem
from scaler.kube.errors import KubeError

NOW = datetime(2025, 3, 1, 12, 0, 0)
TIMEOUT_S = 0.5


class FlakyApi:
    """A proxy in front of the fake API server: mode "ok" forwards, "error" answers 500,
    "hang" accepts the request and never answers."""

    def __init__(self, upstream: str) -> None:
        self.upstream = urlsplit(upstream)
        self.mode = "ok"
        self.release = threading.Event()  # ends hung requests at stop()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _any(self) -> None:
                if proxy.mode == "hang":
                    proxy.release.wait(30)
                    self.close_connection = True
                    return
                if proxy.mode == "error":
                    body = json.dumps(
                        {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                         "message": "etcdserver: request timed out", "code": 500}
                    ).encode()  # fmt: skip
                    self._answer(500, body)
                    return
                length = int(self.headers.get("Content-Length") or 0)
                sent = self.rfile.read(length) if length else None
                conn = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                conn.request(self.command, self.path, body=sent, headers=headers)
                reply = conn.getresponse()
                self._answer(reply.status, reply.read())
                conn.close()

            def _answer(self, code: int, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _any

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def stop(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def api() -> Iterator[FlakyApi]:
    fake = FakeKube().start()
    flaky = FlakyApi(fake.url)
    yield flaky
    flaky.stop()
    fake.stop()


def reconciler(tmp_path: Path, api: FlakyApi) -> Reconciler:
    cfg = LiveConfig(
        state_dir=tmp_path / "state",
        pools=[pool(min_size=1)],
        provider={"kind": "simulated", "simulated": {"initial_sizes": {"a100": 2}}},
        kubernetes={"host": api.url, "request_timeout_s": TIMEOUT_S, "pre_position": False},
        model={"name": "persistence"},
        policy=fast_policy(60.0),
        demand={"stale_after_s": 300},
        lease={"enabled": False},
    )
    ds = pd.date_range(end=NOW, periods=6, freq="60s")
    values = [8.0] * 5 + [40.0]
    TelemetryStore(cfg.state_dir).append(pd.DataFrame({"unique_id": "a100", "ds": ds, "y": values}))
    return Reconciler(LiveSystem.build(cfg), clock=lambda: NOW)


def target(r: Reconciler) -> int:
    (group,) = r.system.provider.node_groups()
    return group.target_size()


@pytest.mark.parametrize("mode", ["hang", "error"])
def test_a_failing_api_fails_the_pass_quickly_and_nothing_is_done(
    tmp_path: Path, api: FlakyApi, mode: str
) -> None:
    r = reconciler(tmp_path, api)
    api.mode = mode
    started = time.monotonic()
    with pytest.raises(KubeError) as failed:
        r.iterate(apply=True)
    # Bounded by the request timeout (and urllib3's retries), never a hang.
    assert time.monotonic() - started < 20 * TIMEOUT_S
    assert ("HTTP 500" in str(failed.value)) == (mode == "error")
    assert target(r) == 2
    assert r.system.log.pending() == [] and r.system.log.actions() == []


def test_the_loop_recovers_and_acts_once_when_the_api_answers_again(
    tmp_path: Path, api: FlakyApi
) -> None:
    r = reconciler(tmp_path, api)
    for mode in ("error", "hang", "error"):
        api.mode = mode
        with pytest.raises(KubeError):
            r.iterate(apply=True)
    api.mode = "ok"
    outcome = r.iterate(apply=True)
    assert outcome.errors == []
    desired = outcome.decision.desired["a100"]
    assert desired > 2 and target(r) == desired
    again = r.iterate(apply=True)  # the same step: nothing more to do
    assert target(r) == desired and not [a for a in again.actions if a["status"] == "done"]
    done = r.system.log.actions("done")
    assert [(a.kind, a.params["to"]) for a in done] == [("set_target", desired)]
