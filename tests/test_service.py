"""The FastAPI service: placements match the engine's, the kube-scheduler extender verbs
take the scheduler's own JSON (fixtures written from k8s.io/kube-scheduler/extender/v1:
Go field names, full v1.Pod and v1.NodeList) and answer as the engine decides, mutating
calls need the bearer token, and no request, however malformed, gets a 5xx."""

from __future__ import annotations

import asyncio
import json
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from fake_kube import FakeKube
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from live_fixtures import pool

from predictor.telemetry.store import TelemetryStore
from scaler.controller.config import LiveConfig
from scaler.controller.system import LiveSystem
from scaler.kube.objects import KubeNames, node_spec, parse_taint, pod_job
from scaler.placement import ClusterState, Job, NodeSpec, Placement, make_policy, place
from scaler.placement.engine import commit
from scaler.service import create_app
from scaler.service.cluster import LiveCluster, workload_mix
from scaler.service.context import on_engine
from scaler.service.models import KubeNode, KubePod

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # starlette's note about httpx versions
    from fastapi.testclient import TestClient

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
FIXED_NODES = [
    {"name": "a-1", "pool": "a100", "gpus": 8, "gpu_model": "A100", "cpu_milli": 96_000,
     "memory_mib": 1_048_576},
    {"name": "a-2", "pool": "a100", "gpus": 8, "gpu_model": "A100", "cpu_milli": 96_000,
     "memory_mib": 1_048_576},
    {"name": "t-1", "pool": "t4", "gpus": 4, "gpu_model": "T4", "cpu_milli": 48_000,
     "memory_mib": 196_608},
]  # fmt: skip


def live_config(tmp_path: Path, **extra: Any) -> LiveConfig:
    return LiveConfig(
        state_dir=tmp_path / "state",
        pools=[pool(min_size=2, max_size=6)],
        model={"name": "persistence"},
        policy={"step_seconds": 60, "drop_hold_steps": 0},
        service={"token": TOKEN, "max_body_bytes": 64 * 1024},
        **extra,
    )


@pytest.fixture
def fixed(tmp_path: Path) -> Iterator[TestClient]:
    """A service over a fixed three-node cluster (no Kubernetes), simulated cloud."""
    config = live_config(tmp_path, placement={"nodes": FIXED_NODES})
    with TestClient(create_app(config)) as client:
        yield client


def engine_state(config_nodes: list[dict]) -> tuple[ClusterState, Any]:
    """The placement engine on its own, configured as the service configures it."""
    config = LiveConfig(state_dir="unused", pools=[pool()])
    mix = workload_mix(config.placement.mix)
    specs = [
        NodeSpec(
            n["name"],
            n["cpu_milli"],
            n["memory_mib"],
            n["gpus"],
            n["gpu_model"],
            (("gpuscale.io/pool", n["pool"]),),
        )
        for n in config_nodes
    ]
    return ClusterState.from_nodes(specs), make_policy("gpuscale", mix=mix)


# ---------------------------------------------------------------------- /v1/placements


def test_mutating_calls_need_the_bearer_token(fixed: TestClient) -> None:
    job = {"id": "j", "num_gpu": 1}
    missing = fixed.post("/v1/placements", json=job)
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
    wrong = fixed.post("/v1/placements", json=job, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    basic = fixed.post("/v1/placements", json=job, headers={"Authorization": "Basic czNjcmV0"})
    assert basic.status_code == 401
    assert fixed.delete("/v1/placements/j").status_code == 401
    assert fixed.post("/v1/placements", json=job, headers=AUTH).status_code == 201


def test_no_token_configured_turns_mutating_calls_off(tmp_path: Path) -> None:
    config = live_config(tmp_path, placement={"nodes": FIXED_NODES})
    config = config.model_copy(
        update={"service": config.service.model_copy(update={"token": None})}
    )
    with TestClient(create_app(config)) as client:
        answer = client.post("/v1/placements", json={"id": "j"}, headers=AUTH)
        assert answer.status_code == 401 and "no API token" in answer.json()["detail"]


def test_placements_are_the_engines_decisions_in_sequence(fixed: TestClient) -> None:
    state, policy = engine_state(FIXED_NODES)
    jobs = [
        {"id": "big", "num_gpu": 8, "cpu_milli": 32_000, "memory_mib": 65_536},
        {"id": "t4", "num_gpu": 2, "gpu_models": ["T4"]},
        {"id": "share", "num_gpu": 1, "gpu_milli": 500, "cpu_milli": 4_000},
        {"id": "pair", "num_gpu": 2, "cpu_milli": 8_000},
        {"id": "cpu", "cpu_milli": 2_000, "memory_mib": 1024},
        {"id": "share-2", "num_gpu": 1, "gpu_milli": 300},
    ]
    for body in jobs:
        answer = fixed.post("/v1/placements", json=body, headers=AUTH)
        assert answer.status_code == 201, answer.text
        got = answer.json()
        share = body.get("gpu_milli", 1000) if body.get("num_gpu") else 0
        job = Job(
            id=body["id"],
            cpu_milli=body.get("cpu_milli", 0),
            memory_mib=body.get("memory_mib", 0),
            num_gpu=body.get("num_gpu", 0),
            gpu_milli=share,
            gpu_models=frozenset(body.get("gpu_models", [])),
        )
        expected = place(state, job, policy)
        assert isinstance(expected, Placement)
        commit(state, job, expected)
        assert (got["node"], got["gpus"]) == (expected.node, list(expected.gpus)), body["id"]
        assert got["committed"] is True and got["policy"] == "gpuscale"


def test_engine_calls_stay_on_the_event_loop_unless_the_sources_are_due(tmp_path: Path) -> None:
    """Placement is decided on the event loop, with no thread hop; only a call that must
    first re-list the cluster's sources (network I/O under the lock) goes to the pool."""
    now = [0.0]
    config = live_config(tmp_path, placement={"sync_s": 30})
    cluster = LiveCluster(LiveSystem.build(config), clock=lambda: now[0])

    async def ran_off_the_loop() -> list[bool]:
        loop_thread = threading.get_ident()
        seen = []
        for advance in (0.0, 10.0, 18.5, 1.0):  # never listed; listed 10 s, 28.5 s, 29.5 s ago
            now[0] += advance
            thread = await on_engine(cluster, lambda: (cluster.state(), threading.get_ident()))
            seen.append(thread[1] != loop_thread)
        return seen

    assert asyncio.run(ran_off_the_loop()) == [True, False, False, True]


def test_a_job_that_cannot_fit_gets_409_with_the_reason(fixed: TestClient) -> None:
    too_big = fixed.post("/v1/placements", json={"id": "x", "num_gpu": 16}, headers=AUTH)
    assert too_big.status_code == 409
    assert too_big.json()["detail"] == {
        "job_id": "x",
        "reason": "asks 16 GPUs but the largest allowed node has 8",
    }
    for i in range(2):
        fixed.post("/v1/placements", json={"id": f"f{i}", "num_gpu": 8}, headers=AUTH)
    full = fixed.post("/v1/placements", json={"id": "y", "num_gpu": 8, "gpu_models": ["A100"]},
                      headers=AUTH)  # fmt: skip
    assert full.status_code == 409
    assert full.json()["detail"]["reason"].startswith("no node fits now: of 3 nodes")
    again = fixed.post("/v1/placements", json={"id": "f0", "num_gpu": 1}, headers=AUTH)
    assert again.status_code == 409 and "already placed" in again.json()["detail"]["reason"]


def test_dry_run_commits_nothing_and_delete_releases(fixed: TestClient) -> None:
    body = {"id": "d", "num_gpu": 8, "gpu_models": ["A100"]}
    dry = fixed.post("/v1/placements", json=body | {"dry_run": True}, headers=AUTH)
    real = fixed.post("/v1/placements", json=body, headers=AUTH)
    assert dry.json()["committed"] is False and real.json()["committed"] is True
    assert dry.json()["node"] == real.json()["node"]
    released = fixed.delete("/v1/placements/d", headers=AUTH)
    assert released.status_code == 200 and released.json()["gpus"] == list(range(8))
    assert fixed.delete("/v1/placements/d", headers=AUTH).status_code == 404


def test_fixed_nodes_carry_the_model_label_so_a_selector_finds_them(fixed: TestClient) -> None:
    """A fixed node is labelled with its GPU model as GPU feature discovery labels a
    Kubernetes node: a placement selecting the model by label lands where the extender
    sends a pod with the same selector, and a model no node has fits nowhere."""
    t4 = {"nvidia.com/gpu.product": "T4"}
    pod = pod_json("infer", 2, uid="uid-infer")
    pod["spec"]["nodeSelector"] = t4
    args = {"Pod": pod, "Nodes": None, "NodeNames": [n["name"] for n in FIXED_NODES]}
    assert fixed.post("/v1/extender/filter", json=args).json()["NodeNames"] == ["t-1"]
    body = {"id": "infer", "num_gpu": 2, "node_selector": t4, "dry_run": True}
    answer = fixed.post("/v1/placements", json=body, headers=AUTH)
    assert answer.status_code == 201 and answer.json()["node"] == "t-1", answer.text
    both = body | {"node_selector": t4 | {"gpuscale.io/pool": "t4"}}
    assert fixed.post("/v1/placements", json=both, headers=AUTH).json()["node"] == "t-1"
    h100 = body | {"node_selector": {"nvidia.com/gpu.product": "H100"}}
    assert fixed.post("/v1/placements", json=h100, headers=AUTH).status_code == 409


def test_an_unconstrained_job_goes_to_the_cheaper_pool_with_its_reason(tmp_path: Path) -> None:
    """The issue's case through the API: an 8-GPU job that names no GPU model went to the
    idle H100 node ($98.32 an hour) beside an idle A100 node ($32.77) that could hold it.
    Each node carries its pool's price (by its pool label); the answer says why. (Named
    so that, unpriced, the seeded order takes the H100 node.)"""
    h100 = pool("h100") | {"gpu_model": "H100", "price_per_hour": 98.32}
    pools = [h100, pool("a100") | {"price_per_hour": 32.77}]
    nodes = [
        {"name": name, "pool": p["name"], "gpus": 8, "gpu_model": p["gpu_model"],
         "cpu_milli": 96_000, "memory_mib": 1_048_576}
        for name, p in zip(("gpu-1", "gpu-2"), pools, strict=True)
    ]  # fmt: skip
    config = live_config(tmp_path, placement={"nodes": nodes}).model_copy(
        update={"pools": LiveConfig(state_dir="unused", pools=pools).pools}
    )
    body = {"id": "train", "num_gpu": 8, "cpu_milli": 64_000, "dry_run": True}
    with TestClient(create_app(config)) as client:
        cheap = client.post("/v1/placements", json=body, headers=AUTH).json()
        asked = client.post("/v1/placements", json=body | {"gpu_models": ["H100"]}, headers=AUTH)
    assert cheap["node"] == "gpu-2"
    assert cheap["explanation"] == (
        "gpu-2 (A100, $4.10 per GPU-hour): the cheapest GPU that can hold the job (H100 at"
        " $12.29 could too) and a best fit of the gpuscale policy, which gives equal fits to"
        " the cheaper GPU"
    )
    assert asked.json()["node"] == "gpu-1"
    assert asked.json()["explanation"].endswith("the job asks for H100, so price is not weighed")


def test_the_providers_nodes_are_their_pools_template_labelled_alike(tmp_path: Path) -> None:
    """Without a fixed list or Kubernetes, the simulated cloud's nodes (min size 2) are
    the pool's template, labelled with pool and model."""
    with TestClient(create_app(live_config(tmp_path))) as client:
        selector = {"gpuscale.io/pool": "a100", "nvidia.com/gpu.product": "A100"}
        body = {"id": "j", "num_gpu": 8, "node_selector": selector}
        first = client.post("/v1/placements", json=body, headers=AUTH)
        second = client.post("/v1/placements", json=body | {"id": "k"}, headers=AUTH)
        assert first.status_code == second.status_code == 201, first.text
        assert first.json()["node"] != second.json()["node"]
        third = client.post("/v1/placements", json=body | {"id": "l"}, headers=AUTH)
        assert third.status_code == 409  # two nodes of eight GPUs


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"num_gpu": 1}, "id"),
        ({"id": "j", "num_gpu": "two"}, "num_gpu"),
        ({"id": "j", "num_gpu": -1}, "num_gpu"),
        ({"id": "j", "num_gpu": 1, "gpu_milli": 1500}, "gpu_milli"),
        ({"id": "j", "num_gpu": 2, "gpu_milli": 500}, "gpu_milli"),
        ({"id": "j", "gpu_milli": 500}, "gpu_milli"),
        ({"id": "j", "mode": "scatter"}, "mode"),
        ({"id": "j", "colour": "red"}, "colour"),
        ({"id": "", "num_gpu": 1}, "id"),
        # A pod's id (namespace/name): the extender's bind of that pod would take it over.
        ({"id": "ml/train", "num_gpu": 1}, "id"),
        # Strict types: a client's mistake is not read as 1 GPU or as "may preempt".
        ({"id": "j", "num_gpu": True}, "num_gpu"),
        ({"id": "j", "preempt": "yes"}, "preempt"),
        ({"id": "j", "tolerations": ["garbage"]}, "tolerations"),
        ({"id": "j", "num_gpu": 65}, "num_gpu"),
    ],
)
def test_invalid_placements_get_422_naming_the_field(
    fixed: TestClient, body: dict, field: str
) -> None:
    answer = fixed.post("/v1/placements", json=body, headers=AUTH)
    assert answer.status_code == 422
    assert field in answer.json()["detail"][0]["loc"]


def test_malformed_and_oversized_bodies_are_refused_with_4xx(fixed: TestClient) -> None:
    headers = AUTH | {"Content-Type": "application/json"}
    assert fixed.post("/v1/placements", content=b"{nope", headers=headers).status_code == 400
    assert fixed.post("/v1/placements", content=b"[1, 2]", headers=headers).status_code == 422
    huge = {"id": "h", "gpu_models": ["A100"] * 20_000}
    assert fixed.post("/v1/placements", json=huge, headers=AUTH).status_code == 413
    assert fixed.post("/v1/extender/filter", json={"Pod": {"x": "y" * 100_000}}).status_code == 413


JSON_BODY = {"Content-Type": "application/json"}


@pytest.mark.parametrize("path", ["/v1/placements", "/v1/extender/filter"])
def test_a_body_that_is_not_json_gets_the_documented_400(fixed: TestClient, path: str) -> None:
    """Invalid JSON got FastAPI's 422 though the OpenAPI document promises 400 for a body
    that is not JSON (as bodies that are not UTF-8, or nested too deep, already got)."""
    assert "400" in fixed.get("/openapi.json").json()["paths"][path]["post"]["responses"]
    answer = fixed.post(path, content=b"{nope", headers=AUTH | JSON_BODY)
    assert answer.status_code == 400
    assert answer.json() == {
        "detail": "the body is not JSON: Expecting property name enclosed in double quotes"
        " at character 1"
    }
    not_utf8 = fixed.post(path, content=b'{"id": "\xff"}', headers=AUTH | JSON_BODY)
    assert not_utf8.status_code == 400 and isinstance(not_utf8.json()["detail"], str)


def test_a_body_over_the_limit_gets_413_in_json(fixed: TestClient) -> None:
    """The 413 was Starlette's plain text `Content Too Large`, where every other error is
    JSON; declared up front or found while a chunked body is read, it is JSON now."""
    expected = {"detail": "the body is larger than service.max_body_bytes (65536 bytes)"}
    huge = {"id": "h", "gpu_models": ["A100"] * 20_000}
    declared = fixed.post("/v1/placements", json=huge, headers=AUTH)
    chunks = (b"x" * 1024 for _ in range(100))  # no Content-Length: sent chunked
    streamed = fixed.post("/v1/placements", content=chunks, headers=AUTH | JSON_BODY)
    for answer in (declared, streamed):
        assert answer.status_code == 413, answer.text
        assert answer.headers["content-type"] == "application/json"
        assert answer.json() == expected


@pytest.mark.parametrize(
    ("content_type", "reason"),
    [
        ("text/plain", "not text/plain"),
        ("application/x-www-form-urlencoded", "not application/x-www-form-urlencoded"),
        (None, "and it came without one"),
    ],
)
def test_a_body_not_sent_as_json_gets_415(
    fixed: TestClient, content_type: str | None, reason: str
) -> None:
    """A `text/plain` body got 422 "Input should be a valid dictionary", naming no cause."""
    headers = AUTH | ({"Content-Type": content_type} if content_type else {})
    body = json.dumps({"id": "j", "num_gpu": 1}).encode()
    for path in ("/v1/placements", "/v1/extender/filter"):
        answer = fixed.post(path, content=body, headers=headers)
        assert answer.status_code == 415, answer.text
        assert answer.json() == {
            "detail": f"the body must be JSON sent as Content-Type: application/json, {reason}"
        }


def test_json_content_types_with_parameters_or_a_suffix_are_json(fixed: TestClient) -> None:
    body = json.dumps({"id": "j", "num_gpu": 1, "dry_run": True}).encode()
    for content_type in ("application/json; charset=utf-8", "application/vnd.api+json"):
        headers = AUTH | {"Content-Type": content_type}
        assert fixed.post("/v1/placements", content=body, headers=headers).status_code == 201


def test_a_404_quotes_a_long_id_truncated(fixed: TestClient) -> None:
    """A 404 echoed a 5,000-character id back whole; it quotes as much as an id can be
    (253 characters, a Kubernetes name) and says how long it was."""
    answer = fixed.delete("/v1/placements/" + "x" * 5000, headers=AUTH)
    assert answer.status_code == 404
    assert answer.json() == {"detail": f"no placed job {'x' * 253!r}... (5000 characters)"}
    short = fixed.delete("/v1/placements/gone", headers=AUTH)
    assert short.json() == {"detail": "no placed job 'gone'"}


# ---------------------------------------------------------------------- forecasts and plan


def test_forecasts_plan_nodepools_health_metrics_and_docs(tmp_path: Path) -> None:
    config = live_config(tmp_path, placement={"nodes": FIXED_NODES})
    end = pd.Timestamp.now(tz="UTC").tz_localize(None).floor("60s")
    ds = pd.date_range(end=end, periods=6, freq="60s")
    TelemetryStore(config.state_dir).append(
        pd.DataFrame({"unique_id": "a100", "ds": ds, "y": [8.0] * 5 + [40.0]})
    )
    with TestClient(create_app(config)) as client:
        forecasts = client.get("/v1/forecasts").json()
        (series,) = forecasts["series"]
        assert series["series"] == "a100" and series["observed"] == 40.0
        assert series["problem"] is None and series["gpu_models"] == ["A100"]
        assert series["horizons"][0]["q0.99"] == 40.0  # persistence
        assert forecasts["problems"] == []

        plan = client.get("/v1/plan").json()
        (a100,) = plan["pools"]
        assert (a100["current"], a100["desired"], a100["action"]) == (2, 5, "scale_up")
        assert a100["reason"].startswith("add 3")
        assert plan["capacity_buffers"] == []  # no Kubernetes: nothing pre-positioned

        (pool_info,) = client.get("/v1/nodepools").json()
        assert (pool_info["name"], pool_info["target_size"], pool_info["ready"]) == ("a100", 2, 2)
        assert pool_info["min_size"] == 2 and len(pool_info["nodes"]) == 2

        assert client.get("/healthz").json() == {"status": "ok"}
        assert client.get("/readyz").status_code == 200
        metrics = client.get("/metrics").text
        assert 'gpuscale_service_requests_total{code="200",method="GET",route="/v1/plan"}' in (
            metrics
        )
        assert "gpuscale_service_nodes 3.0" in metrics
        paths = client.get("/openapi.json").json()["paths"]
        assert {"/v1/placements", "/v1/extender/filter", "/v1/extender/bind", "/v1/plan"} <= set(
            paths
        )


# ---------------------------------------------------------------------- the extender


def node_json(name: str, gpus: int, model: str, *, taints: list[dict] | None = None) -> dict:
    cpu, memory = ("96", "1Ti") if model == "A100" else ("48", "192Gi")
    return {
        "metadata": {
            "name": name,
            "labels": {"gpuscale.io/pool": model.lower(), "nvidia.com/gpu.product": model},
        },
        "spec": {"providerID": f"aws:///us-east-1a/i-{name}"}
        | ({"taints": taints} if taints else {}),
        "status": {
            "allocatable": {"cpu": cpu, "memory": memory, "nvidia.com/gpu": str(gpus)}
            | {"pods": "110"},
            "capacity": {"cpu": cpu, "memory": memory, "nvidia.com/gpu": str(gpus)},
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


INFER_TAINT = {"key": "dedicated", "value": "infer", "effect": "NoSchedule"}


def pod_json(
    name: str, gpus: int, *, uid: str, tolerate: bool = False, node: str | None = None
) -> dict:
    """A v1.Pod as the API server (and so kube-scheduler) serialises it."""
    spec: dict[str, Any] = {
        "schedulerName": "default-scheduler",
        "priority": 0,
        "nodeSelector": {"nvidia.com/gpu.product": "A100"},
        "containers": [
            {
                "name": "main",
                "image": "nvcr.io/nvidia/pytorch:24.01-py3",
                "resources": {
                    "requests": {"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": str(gpus)},
                    "limits": {"nvidia.com/gpu": str(gpus)},
                },
            }
        ],
        "tolerations": [
            {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute",
             "tolerationSeconds": 300},
            *([{"key": "dedicated", "operator": "Equal", "value": "infer", "effect": "NoSchedule"}]
              if tolerate else []),
        ],
    }  # fmt: skip
    if node:
        spec["nodeName"] = node
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "ml", "uid": uid, "labels": {"app": name}},
        "spec": spec,
        "status": {"phase": "Running" if node else "Pending", "qosClass": "Burstable"},
    }


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[TestClient, FakeKube]]:
    """The service in front of the fake API server: four GPU nodes, one half full."""
    fake = FakeKube().start()
    fake.create("nodes", node_json("gpu-1", 8, "A100"))
    fake.create("nodes", node_json("gpu-2", 8, "A100"))
    fake.create("nodes", node_json("gpu-3", 4, "T4"))
    fake.create("nodes", node_json("gpu-4", 8, "A100", taints=[INFER_TAINT]))
    fake.create("pods", pod_json("busy", 6, uid="uid-busy", node="gpu-1"))
    fake.create("pods", pod_json("train", 4, uid="uid-train"))
    config = live_config(tmp_path, kubernetes={"host": fake.url}, placement={"sync_s": 0})
    try:
        with TestClient(create_app(config)) as client:
            yield client, fake
    finally:
        fake.stop()


def test_the_plan_shows_the_capacity_buffers_the_loop_would_set(tmp_path: Path) -> None:
    fake = FakeKube().start()
    fake.create("nodes", node_json("gpu-1", 8, "A100"))
    fake.create("nodes", node_json("gpu-2", 8, "A100"))
    fake.create("pods", pod_json("busy", 8, uid="uid-busy", node="gpu-1"))
    config = live_config(
        tmp_path,
        provider={"kind": "autoscaler"},
        kubernetes={"host": fake.url, "pre_position": "capacity-buffer"},
        placement={"sync_s": 0, "mix": [{"num_gpu": 8, "cpu_milli": 8000, "memory_mib": 32768}]},
    )
    end = pd.Timestamp.now(tz="UTC").tz_localize(None).floor("60s")
    ds = pd.date_range(end=end, periods=6, freq="60s")
    TelemetryStore(config.state_dir).append(
        pd.DataFrame({"unique_id": "a100", "ds": ds, "y": [8.0] * 5 + [40.0]})
    )
    try:
        with TestClient(create_app(config)) as client:
            plan = client.get("/v1/plan").json()
    finally:
        fake.stop()
    (buffer,) = plan["capacity_buffers"]
    # Five nodes planned, busy's node full: four whole nodes of room, as replicas of the
    # pool's 8-GPU unit; nothing was written (the plan is a dry run).
    assert (buffer["pool"], buffer["replicas"], buffer["unit"]["gpus"]) == ("a100", 4, 8)
    assert fake.objects("capacitybuffers") == []


CANDIDATES = ["gpu-1", "gpu-2", "gpu-3", "gpu-4"]


def test_filter_with_node_names_answers_as_kube_scheduler_expects(
    cluster: tuple[TestClient, FakeKube],
) -> None:
    client, _ = cluster
    args = {"Pod": pod_json("train", 4, uid="uid-train"), "Nodes": None, "NodeNames": CANDIDATES}
    answer = client.post("/v1/extender/filter", json=args)
    assert answer.status_code == 200
    result = answer.json()
    assert set(result) == {"NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"}
    assert result["NodeNames"] == ["gpu-2"]
    assert result["FailedNodes"] == {"gpu-1": "2 idle GPUs, job needs 4"}  # preemption may help
    assert result["FailedAndUnresolvableNodes"] == {
        "gpu-3": "node has GPU model T4, job wants A100",
        "gpu-4": "node selector, taints or spread rule exclude this node",
    }
    assert result["Error"] == ""
    tolerant = args | {"Pod": pod_json("train", 4, uid="uid-train", tolerate=True)}
    assert client.post("/v1/extender/filter", json=tolerant).json()["NodeNames"] == [
        "gpu-2",
        "gpu-4",
    ]


def test_filter_with_full_nodes_echoes_the_passing_nodes_unchanged(
    cluster: tuple[TestClient, FakeKube],
) -> None:
    client, fake = cluster
    items = fake.objects("nodes")
    args = {
        "Pod": pod_json("train", 4, uid="uid-train", tolerate=True),
        "Nodes": {"kind": "NodeList", "apiVersion": "v1", "metadata": {"resourceVersion": "9"},
                  "items": items},
    }  # fmt: skip
    result = client.post("/v1/extender/filter", json=args).json()
    assert "NodeNames" not in result
    assert result["Nodes"]["items"] == [
        n for n in items if n["metadata"]["name"] in ("gpu-2", "gpu-4")
    ]
    assert result["Nodes"]["metadata"] == {"resourceVersion": "9"}
    assert sorted(result["FailedNodes"]) == ["gpu-1"]


def test_prioritize_ranks_the_engines_choice_first(cluster: tuple[TestClient, FakeKube]) -> None:
    client, fake = cluster
    pod = pod_json("train", 4, uid="uid-train", tolerate=True)
    args = {"Pod": pod, "NodeNames": CANDIDATES}
    scores = client.post("/v1/extender/prioritize", json=args).json()
    assert [s["Host"] for s in scores] == CANDIDATES
    assert all(set(s) == {"Host", "Score"} and 0 <= s["Score"] <= 10 for s in scores)
    by_host = {s["Host"]: s["Score"] for s in scores}
    assert by_host["gpu-1"] == by_host["gpu-3"] == 0  # cannot take it now
    assert sorted(by_host.values(), reverse=True)[:2] == [10, 9]

    # The engine alone, on the same nodes and pods, places the pod on the top node.
    names = KubeNames()
    nodes = [KubeNode.model_validate(n) for n in fake.objects("nodes")]
    state = ClusterState.from_nodes([node_spec(n, names) for n in nodes])
    _, policy = engine_state(FIXED_NODES)
    busy = pod_job(KubePod.model_validate(fake.get("pods", "busy", "ml")), names)
    state.bind(busy, state.names.index("gpu-1"), range(6))
    taints = [parse_taint(t) for t in sorted({t for ts in state.taints for t in ts})]
    expected = place(state, pod_job(KubePod.model_validate(pod), names, taints), policy)
    assert isinstance(expected, Placement)
    assert by_host[expected.node] == 10


def test_bind_needs_the_token_then_binds_with_the_engines_gpus(
    cluster: tuple[TestClient, FakeKube],
) -> None:
    client, fake = cluster
    pod = pod_json("train", 4, uid="uid-train")
    client.post("/v1/extender/filter", json={"Pod": pod, "NodeNames": CANDIDATES})
    binding = {"PodName": "train", "PodNamespace": "ml", "PodUID": "uid-train", "Node": "gpu-2"}
    assert client.post("/v1/extender/bind", json=binding).status_code == 401
    answer = client.post("/v1/extender/bind", json=binding, headers=AUTH)
    assert answer.status_code == 200 and answer.json() == {"Error": ""}
    bound = fake.get("pods", "train", "ml")
    assert bound["spec"]["nodeName"] == "gpu-2"
    assert bound["metadata"]["annotations"]["gpuscale.io/gpus"] == "0,1,2,3"

    # The state saw it: an 8-GPU pod no longer fits gpu-2.
    big = pod_json("big", 8, uid="uid-big")
    result = client.post("/v1/extender/filter", json={"Pod": big, "NodeNames": ["gpu-2"]}).json()
    assert result["FailedNodes"] == {"gpu-2": "4 idle GPUs, job needs 8"}

    # A pod the scheduler never showed and the API server does not know: an Error, not 5xx.
    ghost = binding | {"PodName": "ghost", "PodUID": "uid-ghost"}
    answer = client.post("/v1/extender/bind", json=ghost, headers=AUTH)
    assert answer.status_code == 200 and "unknown" in answer.json()["Error"]
    full = binding | {"PodName": "big", "PodUID": "uid-big"}
    client.post("/v1/extender/filter", json={"Pod": big, "NodeNames": ["gpu-2"]})
    assert (
        "cannot bind to gpu-2"
        in client.post("/v1/extender/bind", json=full, headers=AUTH).json()["Error"]
    )


def test_extender_input_errors_name_the_field(cluster: tuple[TestClient, FakeKube]) -> None:
    client, _ = cluster
    pod = pod_json("train", 4, uid="uid-train")
    pod["spec"]["containers"][0]["resources"]["requests"]["cpu"] = "lots"
    answer = client.post("/v1/extender/filter", json={"Pod": pod, "NodeNames": CANDIDATES})
    assert answer.status_code == 422
    loc = answer.json()["detail"][0]["loc"]
    assert loc[-5:] == ["containers", 0, "resources", "requests", "cpu"]
    share = pod_json("s", 1, uid="u")
    share["metadata"]["annotations"] = {"gpuscale.io/gpu-milli": "2000"}
    answer = client.post("/v1/extender/filter", json={"Pod": share, "NodeNames": CANDIDATES})
    assert (
        answer.status_code == 422 and "gpuscale.io/gpu-milli" in answer.json()["detail"][0]["loc"]
    )
    missing = client.post("/v1/extender/bind", json={"PodName": "x"}, headers=AUTH)
    assert missing.status_code == 422 and missing.json()["detail"][0]["loc"] == ["body", "Node"]


# ---------------------------------------------------------------------- never a 5xx

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
QUANTITY = st.one_of(
    st.text(max_size=6),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.sampled_from(["1e309", "-1", "9" * 40, "1Ei", "0.5", "100m", "NaN", "Infinity"]),
)
FUZZ = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
VERBS = ["/v1/placements", "/v1/extender/filter", "/v1/extender/prioritize", "/v1/extender/bind"]


@pytest.mark.parametrize("body", ["Infinity", "NaN", '{"job": -Infinity}', "[1e999]"])
def test_non_finite_numbers_are_a_422_not_a_500(fixed: TestClient, body: str) -> None:
    headers = AUTH | {"Content-Type": "application/json"}
    for path in VERBS:
        answer = fixed.post(path, content=body, headers=headers)
        assert answer.status_code == 422, (path, answer.status_code, answer.text)
        assert "Infinity" not in answer.text and "NaN" not in answer.text


@FUZZ
@given(path=st.sampled_from(VERBS), body=JSON)
def test_arbitrary_json_never_gets_a_5xx(fixed: TestClient, path: str, body: Any) -> None:
    headers = AUTH | {"Content-Type": "application/json"}
    answer = fixed.post(path, content=json.dumps(body), headers=headers)
    assert answer.status_code < 500, answer.text


@FUZZ
@given(
    cpu=QUANTITY,
    gpus=QUANTITY,
    memory=QUANTITY,
    share=st.one_of(st.none(), st.text(max_size=5), st.integers(-5, 5000).map(str)),
    priority=st.integers(-(2**40), 2**40),
)
def test_odd_pods_never_get_a_5xx(
    fixed: TestClient, cpu: Any, gpus: Any, memory: Any, share: Any, priority: int
) -> None:
    pod = pod_json("odd", 1, uid="uid-odd")
    requests = {"cpu": cpu, "memory": memory, "nvidia.com/gpu": gpus}
    pod["spec"]["containers"][0]["resources"] = {"requests": requests}
    pod["spec"]["priority"] = priority
    if share is not None:
        pod["metadata"]["annotations"] = {"gpuscale.io/gpu-milli": share}
    for verb in ("filter", "prioritize"):
        args = {"Pod": pod, "NodeNames": ["a-1", "t-1", "nowhere"]}
        answer = fixed.post(f"/v1/extender/{verb}", json=args)
        assert answer.status_code < 500, answer.text
    binding = {"PodName": "odd", "PodNamespace": "ml", "PodUID": "uid-odd", "Node": "a-1"}
    answer = fixed.post("/v1/extender/bind", json=binding, headers=AUTH)
    assert answer.status_code < 500, answer.text
    if answer.json().get("Error") == "":
        assert fixed.delete("/v1/placements/ml/odd", headers=AUTH).status_code == 200


def test_an_unreachable_api_server_is_not_ready_and_named(tmp_path: Path) -> None:
    from prometheus_fixture import free_port

    gone = f"http://127.0.0.1:{free_port()}"
    config = live_config(tmp_path, kubernetes={"host": gone, "request_timeout_s": 1})
    with TestClient(create_app(config)) as client:
        ready = client.get("/readyz")
        assert ready.status_code == 503 and "read nodes and pods" in ready.json()["cluster_error"]
        job = client.post("/v1/placements", json={"id": "j", "num_gpu": 1}, headers=AUTH)
        assert job.status_code == 409 and job.json()["detail"]["reason"] == "no nodes known yet"
        plan = client.get("/v1/plan")  # the loop's dependency is down: 503 with the reason
        assert plan.status_code == 503 and "read nodes and pods" in plan.json()["detail"]
