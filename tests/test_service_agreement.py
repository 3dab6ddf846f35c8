"""The extender and `POST /v1/placements` are one placement engine: the same cluster, built
twice, given the same jobs (once as placement requests, once as pods through kube-scheduler's
filter -> prioritize -> bind, taking the top-scored node as the scheduler does) puts every
job on the same node and GPUs, and refuses the same jobs. The extender side runs on the same
fixed node list, and on the same nodes listed from a (fake) Kubernetes API server, where the
binds come back as pods on their nodes each time the service re-lists."""

from __future__ import annotations

import random
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fake_kube import FakeKube
from placement_cluster import cluster, job
from test_service import AUTH, live_config

from scaler.cluster.job import WHOLE_GPU_MILLI
from scaler.placement import Placement, make_policy, place
from scaler.service import create_app
from scaler.service.scheduling import rank

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # starlette's note about httpx versions
    from fastapi.testclient import TestClient

NAMESPACE = "ml"


@dataclass(frozen=True)
class Node:
    name: str
    pool: str
    gpus: int
    model: str
    cores: int
    memory_gib: int
    zone: str


NODES = [
    Node("a-1", "a100", 8, "A100", 96, 1024, "b"),
    Node("a-2", "a100", 8, "A100", 96, 1024, "a"),
    Node("t-1", "t4", 4, "T4", 48, 192, "a"),
    Node("t-2", "t4", 4, "T4", 48, 192, "b"),
    Node("c-1", "cpu", 0, "", 32, 128, "a"),
]


@dataclass(frozen=True)
class Ask:
    """One job, said once as a placement request and once as a pod."""

    name: str
    cpu_milli: int = 1000
    memory_mib: int = 4096
    gpus: int = 0
    share: int = WHOLE_GPU_MILLI  # per GPU, thousandths; a share only with one GPU
    model: str | None = None
    zone: str | None = None

    @property
    def id(self) -> str:
        return f"{NAMESPACE}/{self.name}"

    def request(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.name,  # the API's ids have no namespace: those are the pods'
            "cpu_milli": self.cpu_milli,
            "memory_mib": self.memory_mib,
            "num_gpu": self.gpus,
        }
        if self.gpus == 1 and self.share < WHOLE_GPU_MILLI:
            body["gpu_milli"] = self.share
        if self.model:
            body["gpu_models"] = [self.model]
        if self.zone:
            body["node_selector"] = {"zone": self.zone}
        return body

    def pod(self) -> dict[str, Any]:
        """A v1.Pod as the API server (and so kube-scheduler) serialises it."""
        requests = {"cpu": f"{self.cpu_milli}m", "memory": f"{self.memory_mib}Mi"}
        limits = {}
        if self.gpus:
            requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = str(self.gpus)
        selector = {"zone": self.zone} if self.zone else {}
        if self.model:
            selector["nvidia.com/gpu.product"] = self.model
        annotations = (
            {"gpuscale.io/gpu-milli": str(self.share)}
            if self.gpus == 1 and self.share < WHOLE_GPU_MILLI
            else {}
        )
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": self.name,
                "namespace": NAMESPACE,
                "uid": f"uid-{self.name}",
                "labels": {"app": self.name},
                "annotations": annotations,
            },
            "spec": {
                "schedulerName": "default-scheduler",
                "priority": 0,
                "nodeSelector": selector,
                "containers": [
                    {
                        "name": "main",
                        "image": "nvcr.io/nvidia/pytorch:24.01-py3",
                        "resources": {"requests": requests, "limits": limits},
                    }
                ],
            },
            "status": {"phase": "Pending", "qosClass": "Burstable"},
        }


# Whole GPUs, shared GPUs, a GPU model, a zone selector, CPU-only, and ones no node takes.
CHOSEN = [
    Ask("train-4", 8000, 32768, gpus=4),
    Ask("infer-half", 4000, 16384, gpus=1, share=500),
    Ask("t4-share", 2000, 8192, gpus=1, share=300, model="T4"),
    Ask("zone-b-pair", 8000, 32768, gpus=2, zone="b"),
    Ask("share-70", 2000, 8192, gpus=1, share=700),
    Ask("cpu-only", 2000, 2048),
    Ask("full-a100", 32000, 131072, gpus=8, model="A100"),
    Ask("t4-zone-a", 1000, 4096, gpus=1, share=250, model="T4", zone="a"),
    Ask("t4-four", 8000, 32768, gpus=4, model="T4"),
    Ask("too-many", 8000, 32768, gpus=16),
    Ask("no-such-model", 1000, 4096, gpus=1, model="H100"),
    Ask("zone-c", 1000, 4096, zone="c"),
    Ask("cpu-big", 30000, 65536, zone="a"),
]


def random_asks(seed: int, count: int) -> list[Ask]:
    rng = random.Random(seed)
    asks = []
    for i in range(count):
        gpus = rng.choice([0, 1, 1, 1, 2, 4])
        asks.append(
            Ask(
                f"r{i}",
                cpu_milli=rng.choice([500, 2000, 4000, 8000]),
                memory_mib=rng.choice([1024, 8192, 32768]),
                gpus=gpus,
                share=rng.choice([250, 500, 1000]) if gpus == 1 else WHOLE_GPU_MILLI,
                model=rng.choice([None, None, "A100", "T4"]) if gpus else None,
                zone=rng.choice([None, None, "a", "b"]),
            )
        )
    return asks


def fixed_nodes() -> list[dict[str, Any]]:
    return [
        {
            "name": n.name,
            "pool": n.pool,
            "gpus": n.gpus,
            "gpu_model": n.model,
            "cpu_milli": n.cores * 1000,
            "memory_mib": n.memory_gib * 1024,
            "labels": {"zone": n.zone},
        }
        for n in NODES
    ]


def node_object(n: Node) -> dict[str, Any]:
    """The same node as a v1.Node: the fixed list's fields as labels and allocatable."""
    labels = {"gpuscale.io/pool": n.pool, "zone": n.zone}
    allocatable = {"cpu": str(n.cores), "memory": f"{n.memory_gib}Gi", "pods": "110"}
    if n.gpus:
        labels["nvidia.com/gpu.product"] = n.model
        allocatable["nvidia.com/gpu"] = str(n.gpus)
    return {
        "metadata": {"name": n.name, "labels": labels},
        "spec": {"providerID": f"aws:///us-east-1a/i-{n.name}"},
        "status": {
            "allocatable": allocatable,
            "capacity": allocatable,
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


Decision = tuple[str, list[int]] | None  # the node and GPU indices, or none takes it


def through_placements(client: TestClient, ask: Ask) -> Decision:
    answer = client.post("/v1/placements", json=ask.request(), headers=AUTH)
    if answer.status_code == 409:
        return None
    assert answer.status_code == 201, answer.text
    return answer.json()["node"], answer.json()["gpus"]


def through_the_scheduler(client: TestClient, ask: Ask, fake: FakeKube | None) -> Decision:
    """kube-scheduler's cycle with the extender: filter, prioritize the passing nodes, bind
    to the top-scored one."""
    pod = ask.pod()
    if fake is not None:
        fake.create("pods", pod)
    names = [n.name for n in NODES]
    filtered = client.post("/v1/extender/filter", json={"Pod": pod, "NodeNames": names})
    assert filtered.status_code == 200, filtered.text
    result = filtered.json()
    assert result["Error"] == ""
    passing = result["NodeNames"]
    assert set(passing) | set(result["FailedNodes"]) | set(
        result["FailedAndUnresolvableNodes"]
    ) == set(names)
    if not passing:
        return None
    scored = client.post("/v1/extender/prioritize", json={"Pod": pod, "NodeNames": passing})
    assert scored.status_code == 200, scored.text
    scores = {s["Host"]: s["Score"] for s in scored.json()}
    top = max(passing, key=lambda name: scores[name])
    assert scores[top] == 10, scores  # the engine's choice is among the passing nodes
    binding = {
        "PodName": ask.name,
        "PodNamespace": NAMESPACE,
        "PodUID": f"uid-{ask.name}",
        "Node": top,
    }
    bound = client.post("/v1/extender/bind", json=binding, headers=AUTH)
    assert bound.status_code == 200 and bound.json() == {"Error": ""}, bound.text
    cluster_ = client.app.state.context.cluster  # type: ignore[attr-defined]
    with cluster_.lock:
        allocation = cluster_.state().jobs[ask.id]
    gpus = list(allocation.gpus)
    if fake is not None:
        on_server = fake.get("pods", ask.name, NAMESPACE)
        assert on_server["spec"]["nodeName"] == top
        recorded = on_server["metadata"].get("annotations", {}).get("gpuscale.io/gpus", "")
        assert recorded == ",".join(map(str, gpus))
    return top, gpus


@pytest.fixture
def placements(tmp_path: Path) -> Iterator[TestClient]:
    config = live_config(tmp_path / "placements", placement={"nodes": fixed_nodes()})
    with TestClient(create_app(config)) as client:
        yield client


@pytest.fixture(params=["fixed", "kubernetes"])
def scheduler(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[TestClient, FakeKube | None]]:
    """The extender's service: on the same fixed node list, or on the same nodes listed
    from the API server (re-listed on every call, so each bind is read back from its pod)."""
    if request.param == "fixed":
        config = live_config(tmp_path / "extender", placement={"nodes": fixed_nodes()})
        with TestClient(create_app(config)) as client:
            yield client, None
        return
    fake = FakeKube().start()
    for n in NODES:
        fake.create("nodes", node_object(n))
    config = live_config(
        tmp_path / "extender", kubernetes={"host": fake.url}, placement={"sync_s": 0}
    )
    try:
        with TestClient(create_app(config)) as client:
            yield client, fake
    finally:
        fake.stop()


@pytest.mark.parametrize("asks", [CHOSEN, random_asks(7, 40)], ids=["chosen", "random"])
def test_the_extender_and_placements_put_every_job_on_the_same_node_and_gpus(
    placements: TestClient,
    scheduler: tuple[TestClient, FakeKube | None],
    asks: list[Ask],
) -> None:
    extender, fake = scheduler
    placed = refused = 0
    for ask in asks:
        direct = through_placements(placements, ask)
        scheduled = through_the_scheduler(extender, ask, fake)
        assert scheduled == direct, ask
        placed += direct is not None
        refused += direct is None
    assert placed >= len(asks) // 2 and refused >= 1  # the sequence fills and overflows nodes


def test_rank_puts_the_node_place_chooses_first_and_draining_nodes_last() -> None:
    state = cluster(("a", 16, 64, 4, "T4"), ("b", 16, 64, 4, "T4"), ("c", 16, 64, 4, "T4"))
    policy = make_policy("bestfit")
    state.bind(job("busy-a", gpus=2), 0, (0, 1))
    state.bind(job("busy-c", gpus=3), 2, (0, 1, 2))
    state.set_draining([2])  # the best fit, but leaving: placement steers away from it
    new = job("new", gpus=1)
    chosen = place(state, new, policy)
    assert isinstance(chosen, Placement) and chosen.node == "a"
    scores = dict(rank(state, new, policy, ["c", "b", "a", "ghost"]))
    assert scores == {"a": 10, "b": 9, "c": 8, "ghost": 0}
