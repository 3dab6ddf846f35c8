"""The live loop and the job simulator ask one scheduling simulation the same question.

The same running and pending jobs, once as pods on the fake Kubernetes API server (listed
by the loop's `observe_cluster` through the official client) and once in the job
simulator's own cluster (`simulator_snapshot`), give the same reactive demand and the same
scale-up estimate: "reactive" means one thing in the product and in its measurements.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
import pytest

from predictor.telemetry.kube_objects import KUBE_NAMES
from scaler.cluster.pools import NodePool
from scaler.evaluation.job_simulator import simulator_snapshot
from scaler.kube.observed import observe_cluster
from scaler.planning.reactive import reactive_demand

A100 = NodePool(name="a100", gpu_model="A100", gpus_per_node=8, price_per_hour=32, max_size=10)
T4 = NodePool(name="t4", gpu_model="T4", gpus_per_node=4, price_per_hour=4, max_size=10)
POOLS = [A100, T4]
READY = {"a100": 2, "t4": 1}
T0 = pd.Timestamp("2025-01-01")

# (name, pool, GPUs, share per GPU, running on ready node index or None for pending)
JOBS = [
    ("train", "a100", 8, 1000, 0),
    ("tune", "a100", 2, 1000, 1),
    ("infer", "t4", 1, 500, 0),
    ("big-0", "a100", 8, 1000, None),
    ("big-1", "a100", 8, 1000, None),
    ("small", "a100", 4, 1000, None),  # fits the 6 GPUs free on a100 node 1
    *((f"share-{i}", "t4", 1, 250, None) for i in range(20)),  # 5 GPUs of quarter shares
    ("t4-whole", "t4", 3, 1000, None),
]


def frame(running: bool) -> pd.DataFrame:
    rows = [
        {
            "job_id": name,
            "pool": pool,
            "gpus": gpus,
            "gpu_milli": milli,
            "cpu_milli": 1000,
            "memory_mib": 1024,
            "duration_min": 60,
            "submit": T0 + pd.Timedelta(seconds=i),
        }
        for i, (name, pool, gpus, milli, node) in enumerate(JOBS)
        if (node is not None) == running
    ]
    return pd.DataFrame(rows)


def kube_node(pool: NodePool, i: int) -> dict[str, Any]:
    name = f"{pool.name}-{i}"
    return {
        "metadata": {
            "name": name,
            "labels": {
                KUBE_NAMES.pool_label: pool.name,
                KUBE_NAMES.gpu_model_label: pool.gpu_model,
            },
        },
        "spec": {"providerID": f"sim:///{name}"},
        "status": {
            "allocatable": {
                "cpu": f"{pool.cpu_milli_per_node}m",
                "memory": f"{pool.memory_mib_per_node}Mi",
                KUBE_NAMES.gpu_resource: str(pool.gpus_per_node),
            },
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


def kube_pod(name: str, pool: str, gpus: int, milli: int, node: int | None) -> dict[str, Any]:
    requests = {"cpu": "1", "memory": "1Gi", KUBE_NAMES.gpu_resource: str(gpus)}
    spec: dict[str, Any] = {
        "containers": [{"name": "main", "resources": {"requests": requests, "limits": requests}}],
        "nodeSelector": {KUBE_NAMES.pool_label: pool},
    }
    if node is not None:
        spec["nodeName"] = f"{pool}-{node}"
    annotations = {KUBE_NAMES.gpu_milli_annotation: str(milli)} if milli < 1000 else {}
    return {
        "metadata": {"name": name, "namespace": "ml", "annotations": annotations},
        "spec": spec,
        "status": {"phase": "Running" if node is not None else "Pending"},
    }


@pytest.fixture
def live(fake) -> Any:
    from kubernetes import client as k8s

    for pool in POOLS:
        for i in range(READY[pool.name]):
            fake.create("nodes", kube_node(pool, i))
    for job in JOBS:
        fake.create("pods", kube_pod(*job), namespace="ml")
    configuration = k8s.Configuration()
    configuration.host = fake.url
    return observe_cluster(k8s.ApiClient(configuration))


def test_the_same_pending_pods_give_the_same_scale_up_estimate_live_and_simulated(live) -> None:
    sim = simulator_snapshot(POOLS, READY, frame(running=True), frame(running=False))
    assert live.state is not None
    assert len(live.real_pending) == len(sim.pending) == 24

    current = dict(READY)
    simulated = reactive_demand(
        sim.state, sim.pending, POOLS, sim.policy, booting={}, current=current
    )
    observed = reactive_demand(
        live.state, live.real_pending, POOLS, sim.policy, booting={}, current=current
    )

    assert observed.nodes == simulated.nodes

    def shape(demand: Any) -> dict[str, tuple[int, int, int]]:
        # Job ids differ (pods are namespace/name) and so may which of several identical
        # quarter shares lands on which new node; the counts may not.
        return {
            k: (e.new_nodes, e.nodes_used, len(e.jobs)) for k, e in demand.estimate.pools.items()
        }

    assert shape(observed) == shape(simulated)
    assert len(observed.estimate.on_existing) == len(simulated.estimate.on_existing)
    assert observed.estimate.unplaceable == simulated.estimate.unplaceable == {}
    # By hand: A100 node 0 is full and node 1 has 6 GPUs free, so "small" (4) goes there
    # and the two 8-GPU jobs need two new nodes. On T4 node 0 the 3-GPU job takes the
    # three idle GPUs (largest first), two quarter shares the half-used GPU 0, and the
    # other 18 quarters (4.5 GPUs) two new 4-GPU nodes.
    assert {p.name: simulated.estimate.new_nodes(p.name) for p in POOLS} == {"a100": 2, "t4": 2}
    assert simulated.nodes == {"a100": 4, "t4": 3}
