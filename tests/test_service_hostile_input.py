"""What a broken or hostile client cannot do to the placement service: take its memory or
CPU with one node, leave GPUs reserved twice, or have a node outlive what the cluster's
source lists. Each answer is a 4xx (or the extender's Error) and the state stays whole."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from test_service import AUTH, FIXED_NODES, live_config

from scaler.service.app import create_app


@pytest.fixture
def fixed(tmp_path: Path) -> Iterator[TestClient]:
    config = live_config(tmp_path, placement={"nodes": FIXED_NODES})
    with TestClient(create_app(config)) as client:
        yield client


def gpu_pod(name: str, gpus: str, uid: str) -> dict[str, Any]:
    resources = {"requests": {"nvidia.com/gpu": gpus}, "limits": {"nvidia.com/gpu": gpus}}
    return {
        "metadata": {"name": name, "namespace": "ml", "uid": uid},
        "spec": {"containers": [{"name": "main", "resources": resources}]},
    }


def sent_node(name: str, allocatable: dict[str, str], **meta: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, **meta}, "status": {"allocatable": allocatable}}


def filter_with(client: TestClient, *nodes: dict[str, Any]) -> Any:
    pod = gpu_pod("p", "1", "u-p")
    return client.post("/v1/extender/filter", json={"Pod": pod, "Nodes": {"items": list(nodes)}})


@pytest.mark.parametrize(
    ("node", "said"),
    [
        # Per-node state is dense: a billion GPUs on one node would be allocated.
        (sent_node("big", {"nvidia.com/gpu": "1000000000"}), "a node holds 0 to 64"),
        # A layout searched for: a hundred thousand MIG instances took minutes of CPU.
        (sent_node("mig", {"nvidia.com/mig-1g.10gb": "100000"}), "at most 64 GPUs"),
        (
            sent_node(
                "bad-layout",
                {"nvidia.com/mig-1g.10gb": "7"},
                annotations={"gpuscale.io/mig-layout": "garbage!!"},
            ),
            "node bad-layout: MIG layout",
        ),
    ],
)
def test_a_node_the_model_cannot_take_is_a_422_naming_it(
    fixed: TestClient, node: dict, said: str
) -> None:
    answer = filter_with(fixed, node)
    assert answer.status_code == 422, answer.text
    detail = answer.json()["detail"][0]
    assert detail["loc"] == ["body", "Nodes"] and said in detail["msg"]
    assert detail["type"] == "value_error"
    assert fixed.get("/healthz").status_code == 200


def test_a_node_listed_twice_in_one_call_is_refused(fixed: TestClient) -> None:
    one, eight = (sent_node("dup", {"nvidia.com/gpu": n}) for n in ("1", "8"))
    answer = filter_with(fixed, one, eight)
    assert answer.status_code == 422 and "dup" in answer.json()["detail"][0]["msg"]


@pytest.mark.parametrize(("where", "value"), [("pod", "500m"), ("pod", "1.5"), ("node", "1500m")])
def test_a_fraction_of_an_extended_resource_is_refused_not_truncated(
    fixed: TestClient, where: str, value: str
) -> None:
    """Kubernetes takes whole numbers of extended resources only: `500m` GPUs read as none
    would pass every node and bind no GPU."""
    pod = gpu_pod("p", value if where == "pod" else "1", "u-p")
    node = sent_node("n", {"nvidia.com/gpu": value if where == "node" else "8"})
    answer = fixed.post("/v1/extender/filter", json={"Pod": pod, "Nodes": {"items": [node]}})
    assert answer.status_code == 422
    assert "extended resource" in answer.json()["detail"][0]["msg"]


def test_a_preferred_affinity_weight_that_is_no_number_is_a_422(fixed: TestClient) -> None:
    pod = gpu_pod("w", "1", "u-w")
    preferred = [{"weight": "x", "preference": {}}, {"weight": 3, "preference": {}}]
    pod["spec"]["affinity"] = {
        "nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": preferred}
    }
    for verb in ("filter", "prioritize"):
        answer = fixed.post(f"/v1/extender/{verb}", json={"Pod": pod, "NodeNames": ["t-1"]})
        assert answer.status_code == 422 and "weight" in answer.json()["detail"][0]["loc"]


def test_pods_asking_several_mig_profiles_are_told_which_resources(fixed: TestClient) -> None:
    pod = gpu_pod("m", "0", "u-m")
    pod["spec"]["containers"][0]["resources"] = {
        "limits": {"nvidia.com/mig-1g.10gb": "1", "nvidia.com/mig-2g.20gb": "1"}
    }
    answer = fixed.post("/v1/extender/filter", json={"Pod": pod, "NodeNames": ["t-1"]})
    assert answer.status_code == 422
    assert answer.json()["detail"][0]["loc"] == ["body", "nvidia.com/mig-*"]


def allocated_gpus(client: TestClient) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("gpuscale_service_gpu_allocated_ratio "):
            return float(line.split()[1]) * 20  # of the fixed cluster's 20 GPUs
    raise AssertionError("no allocated ratio exported")


def test_a_bind_retry_that_fails_keeps_what_the_first_bind_holds(fixed: TestClient) -> None:
    """The retry released the first bind's GPUs before deciding; when it failed they read
    as free, the next job took them, and a rebuild gave them back to the pod as well."""
    pod = gpu_pod("p1", "4", "u1")
    fixed.post("/v1/extender/filter", json={"Pod": pod, "NodeNames": ["t-1"]})
    bind = {"PodName": "p1", "PodNamespace": "ml", "PodUID": "u1", "Node": "t-1"}
    assert fixed.post("/v1/extender/bind", json=bind, headers=AUTH).json() == {"Error": ""}
    retry = fixed.post("/v1/extender/bind", json=bind | {"Node": "ghost"}, headers=AUTH)
    assert "cannot bind to ghost" in retry.json()["Error"]
    assert allocated_gpus(fixed) == 4
    other = {"id": "q", "num_gpu": 4, "gpu_models": ["T4"]}
    assert fixed.post("/v1/placements", json=other, headers=AUTH).status_code == 409


def test_a_node_the_scheduler_sent_is_forgotten_at_the_next_listing(tmp_path: Path) -> None:
    """Nodes the filter learns (anyone may call it: kube-scheduler sends no token) last
    until the source lists the cluster again, not until something else changes."""
    config = live_config(tmp_path, placement={"sync_s": 0})  # the provider's nodes
    with TestClient(create_app(config)) as client:
        labels = {"nvidia.com/gpu.product": "Z9"}
        evil = sent_node("evil", {"cpu": "96", "memory": "100Gi", "nvidia.com/gpu": "8"})
        evil["metadata"]["labels"] = labels
        assert filter_with(client, evil).status_code == 200
        job = {"id": "victim", "num_gpu": 8, "gpu_models": ["Z9"]}
        answer = client.post("/v1/placements", json=job, headers=AUTH)
        assert answer.status_code == 409, answer.text


def test_a_dry_run_is_counted_apart_from_placements(fixed: TestClient) -> None:
    ask = {"id": "d", "num_gpu": 1, "dry_run": True}
    assert fixed.post("/v1/placements", json=ask, headers=AUTH).status_code == 201
    counted = {
        line.split("{")[1].split("}")[0]: float(line.split()[-1])
        for line in fixed.get("/metrics").text.splitlines()
        if line.startswith("gpuscale_service_placements_total{")
    }
    assert counted == {'outcome="dry_run"': 1.0}
