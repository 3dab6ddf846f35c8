"""One `serve` process lists Kubernetes once per sync interval: the placement state (and so
the extender) and the plan read the same `SharedListing`."""

from __future__ import annotations

import warnings
from pathlib import Path

import pandas as pd
import pytest
from fake_kube import FakeKube
from kubernetes import client as k8s
from test_service import AUTH, live_config, node_json, pod_json

from predictor.telemetry.store import TelemetryStore
from scaler.kube.errors import KubeError
from scaler.kube.objects import KUBE_NAMES
from scaler.kube.observed import ObservedCluster, observed_cluster
from scaler.service import create_app
from scaler.service.listing import SharedListing

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # starlette's note about httpx versions
    from fastapi.testclient import TestClient


def cluster_lists(fake: FakeKube) -> tuple[int, int]:
    """How often nodes, and pods of every namespace, were listed."""
    gets = [path for method, path in fake.requests if method == "GET" and "watch=" not in path]
    nodes = sum(p.split("?")[0] == "/api/v1/nodes" for p in gets)
    pods = sum(p.split("?")[0] == "/api/v1/pods" for p in gets)
    return nodes, pods


def test_a_serve_process_lists_nodes_and_pods_once_per_interval(tmp_path: Path) -> None:
    fake = FakeKube().start()
    fake.create("nodes", node_json("gpu-1", 8, "A100"))
    fake.create("nodes", node_json("gpu-2", 8, "A100"))
    fake.create("pods", pod_json("busy", 6, uid="uid-busy", node="gpu-1"))
    config = live_config(tmp_path, kubernetes={"host": fake.url}, placement={"sync_s": 3600})
    # Every /v1/plan decides afresh: the plan must not list on its own.
    config = config.model_copy(
        update={"service": config.service.model_copy(update={"plan_cache_s": 0})}
    )
    end = pd.Timestamp.now(tz="UTC").tz_localize(None).floor("60s")
    TelemetryStore(config.state_dir).append(
        pd.DataFrame({"unique_id": "a100", "ds": pd.date_range(end=end, periods=6, freq="60s"),
                      "y": [8.0] * 6})
    )  # fmt: skip
    try:
        with TestClient(create_app(config)) as client:
            assert client.get("/readyz").status_code == 200
            assert client.get("/v1/plan").status_code == 200
            placed = client.post("/v1/placements", json={"id": "j", "num_gpu": 4}, headers=AUTH)
            assert placed.status_code == 201 and placed.json()["node"] == "gpu-2"
            args = {"Pod": pod_json("train", 4, uid="uid-train"), "NodeNames": ["gpu-1", "gpu-2"]}
            filtered = client.post("/v1/extender/filter", json=args).json()
            assert filtered["FailedNodes"] == {"gpu-1": "2 idle GPUs, job needs 4"}  # busy seen
            assert client.post("/v1/extender/prioritize", json=args).status_code == 200
            assert client.get("/v1/plan").status_code == 200
            assert client.get("/v1/forecasts").status_code == 200

            # The plan read the cluster: the same snapshot the placements were made on.
            decision = client.app.state.context.planning.decision()  # type: ignore[attr-defined]
            assert decision.fleet.cluster is not None
            assert decision.fleet.cluster.state.names == ["gpu-1", "gpu-2"]
            assert "ml/busy" in decision.fleet.cluster.state.jobs
            assert cluster_lists(fake) == (1, 1)
    finally:
        fake.stop()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def snapshot() -> ObservedCluster:
    return observed_cluster([], [])


def test_the_listing_is_taken_again_once_the_interval_has_passed() -> None:
    clock = Clock()
    calls: list[float] = []

    def observe(api: k8s.ApiClient, names: object) -> ObservedCluster:
        calls.append(clock.now)
        return snapshot()

    listing = SharedListing(30, clock, observe)
    api = k8s.ApiClient(k8s.Configuration(host="http://127.0.0.1:9"))
    assert listing.due()
    first = listing(api, KUBE_NAMES)
    clock.now = 29.9
    assert not listing.due() and listing.due(within_s=1.0)
    assert listing(api, KUBE_NAMES) is first  # both readers get the one listing
    clock.now = 30.0
    assert listing(api, KUBE_NAMES) is not first
    assert calls == [0.0, 30.0]
    other = k8s.ApiClient(k8s.Configuration(host="http://127.0.0.1:10"))
    listing(other, KUBE_NAMES)  # another client's cluster is its own listing
    assert calls == [0.0, 30.0, 30.0]


FAILURES = [KubeError("read nodes and pods: HTTP 500: boom"), ValueError("bad quantity")]


@pytest.mark.parametrize("failure", FAILURES, ids=["api-error", "unreadable-object"])
def test_a_failed_listing_is_not_retried_before_the_interval(failure: Exception) -> None:
    clock = Clock()
    calls: list[float] = []
    answers: list[Exception | ObservedCluster] = [failure, snapshot()]

    def observe(api: k8s.ApiClient, names: object) -> ObservedCluster:
        calls.append(clock.now)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    listing = SharedListing(30, clock, observe)
    api = k8s.ApiClient(k8s.Configuration(host="http://127.0.0.1:9"))
    for at in (0.0, 10.0, 29.0):
        clock.now = at
        with pytest.raises(
            KubeError, match=r"^read nodes and pods: (HTTP 500: boom|bad quantity)$"
        ):
            listing(api, KUBE_NAMES)
    assert calls == [0.0]  # a down API server is asked once per interval, not per request
    clock.now = 30.0
    assert isinstance(listing(api, KUBE_NAMES), ObservedCluster)
    assert calls == [0.0, 30.0]
