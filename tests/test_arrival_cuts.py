"""The protocol's ceiling: pods every policy must place, failure chains along the arrival
order, hand-made orders whose protocol optimum is known, and random small instances on
which no policy of the product ever allocates more than it."""

from __future__ import annotations

import numpy as np
import pytest

from scaler.cluster.job import Job
from scaler.cluster.snapshot import ClusterState, NodeSpec
from scaler.evaluation.arrival_cuts import arrival_cuts, dominates, pod_type
from scaler.evaluation.placement_bound import ceiling, node_types
from scaler.placement.decision import Placement
from scaler.placement.engine import place
from scaler.placement.mix import WorkloadMix
from scaler.placement.policies import POLICIES, make_policy


def cluster(*nodes: tuple[int, int, int, str]) -> ClusterState:
    return ClusterState.from_nodes(
        [
            NodeSpec(f"n{i}", cpu, mem, gpus, model)
            for i, (cpu, mem, gpus, model) in enumerate(nodes)
        ]
    )


def pod(name: str, cpu: int, gpus: int, milli: int, models: str = "") -> Job:
    allowed = frozenset(m for m in models.split("|") if m)
    return Job(name, cpu, 1, gpus, milli, allowed)


def both(state: ClusterState, order: list[Job]) -> tuple[float, float]:
    """(offline ceiling, protocol ceiling) in % of the cluster's GPUs."""
    return ceiling(state, order).bound, ceiling(state, order, protocol=True).bound


def test_a_pod_arriving_on_an_empty_cluster_is_placed_first() -> None:
    # One GPU: the 300-share pod comes first and every policy places it, so the whole-GPU
    # pod behind it fails; offline, the whole one alone fills the GPU.
    state = cluster((8000, 64, 1, "T4"))
    order = [pod("small", 100, 1, 300), pod("whole", 100, 1, 1000)]
    assert both(state, order) == pytest.approx((100.0, 30.0))
    cuts = arrival_cuts(node_types(state), order)
    assert cuts.forced == {pod_type(order[0]): 1, pod_type(order[1]): 0}


def test_a_failed_pod_fails_what_it_dominates_after_it() -> None:
    # A CPU-only pod leaves 15 of 4000 cores: a second 10-core pod could already be
    # blocked by CPU, so only the first 600-share pod is forced. But once a 600 fails the
    # whole-GPU pod after it fails too: the protocol allocates at most 2 x 600 of 2 GPUs.
    # (Memory plentiful: the blocking LP may split a node over resources.)
    state = cluster((4000, 100_000, 2, "T4"))
    order = [pod("cpu", 3985, 0, 0)] + [pod(f"a{i}", 10, 1, 600) for i in range(3)]
    order.append(pod("whole", 10, 1, 1000))
    cuts = arrival_cuts(node_types(state), order)
    assert cuts.forced[pod_type(order[1])] == 1
    assert [c.dominated for c in cuts.chains] == [(pod_type(order[-1]),)]
    assert both(state, order) == pytest.approx((80.0, 60.0))


def test_dominance_follows_what_blocks_a_node() -> None:
    models = ["A100", "T4"]
    share = pod_type(pod("s", 100, 1, 500))
    assert dominates(share, pod_type(pod("bigger", 200, 1, 700)), models)
    assert dominates(share, pod_type(pod("whole", 100, 2, 1000)), models)
    assert not dominates(share, pod_type(pod("smaller", 100, 1, 400)), models)
    assert not dominates(share, pod_type(pod("less cpu", 50, 1, 700)), models)
    whole = pod_type(pod("w", 100, 2, 1000, "A100"))
    assert dominates(whole, pod_type(pod("w4", 100, 4, 1000, "A100")), models)
    assert not dominates(whole, pod_type(pod("any model", 100, 4, 1000)), models)
    assert not dominates(whole, pod_type(pod("share", 100, 1, 900, "A100")), models)


def protocol_run(state: ClusterState, order: list[Job], policy_name: str) -> float:
    """The experiment's loop on an explicit order: % of GPUs a policy allocates."""
    policy = make_policy(policy_name, mix=WorkloadMix.from_jobs(order), seed=0)
    placed = 0
    for job in order:
        decision = place(state, job, policy)
        if isinstance(decision, Placement):
            state.bind(job, decision.node_index, decision.gpus)
            placed += job.gpu_request_milli
    return 100.0 * placed / state.total_gpu_milli


def random_instance(rng: np.random.Generator) -> tuple[list[tuple[int, int, int, str]], list[Job]]:
    nodes = [
        (int(rng.choice([8000, 16000, 32000])), 64, int(rng.choice([1, 2, 4, 8])), str(m))
        for m in rng.choice(["T4", "A100"], size=int(rng.integers(2, 5)))
    ]
    order = []
    for i in range(int(rng.integers(8, 30))):
        gpus = int(rng.choice([0, 1, 1, 1, 2, 4, 8]))
        milli = int(rng.choice([200, 300, 500, 700, 1000])) if gpus == 1 else 1000
        cpu = int(rng.choice([1000, 2000, 4000, 8000, 12000]))
        order.append(
            pod(f"p{i}", cpu, gpus, 0 if gpus == 0 else milli, str(rng.choice(["", "", "T4"])))
        )
    return nodes, order


@pytest.mark.parametrize("seed", range(24))
def test_no_policy_allocates_more_than_the_protocol_ceiling(seed: int) -> None:
    rng = np.random.default_rng(seed)
    nodes, order = random_instance(rng)
    bound = ceiling(cluster(*nodes), order, protocol=True).bound
    for name in POLICIES:
        assert protocol_run(cluster(*nodes), order, name) <= bound + 1e-9, name
