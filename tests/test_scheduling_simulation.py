"""The one scheduling simulation: the scale-up estimate and the scale-down check."""

from __future__ import annotations

from scaler.cluster.job import Job
from scaler.cluster.pools import NodePool
from scaler.cluster.snapshot import ClusterState, NodeSpec
from scaler.cluster.templates import POOL_LABEL, template_node
from scaler.placement import make_policy
from scaler.placement.estimator import estimate_scale_up
from scaler.placement.scale_down import check_removals

A100 = NodePool(name="a100", gpu_model="A100", gpus_per_node=8, price_per_hour=32.0, max_size=10)
T4 = NodePool(name="t4", gpu_model="T4", gpus_per_node=4, price_per_hour=4.0, max_size=3)
POLICY = make_policy("bestfit")


def gpu_job(name: str, gpus: int, milli: int = 1000, **kw) -> Job:
    return Job(name, cpu_milli=1000, memory_mib=1024, num_gpu=gpus, gpu_milli=milli, **kw)


def test_shared_gpu_jobs_pack_onto_one_new_node() -> None:
    pending = [gpu_job(f"s{i}", 1, 250, gpu_models=frozenset({"T4"})) for i in range(16)]
    est = estimate_scale_up(None, pending, [A100, T4], POLICY)
    assert est.new_nodes("t4") == 1  # 16 quarter-GPUs = 4 GPUs = one 4-GPU node
    assert est.new_nodes("a100") == 0
    assert not est.unplaceable


def test_a_pending_sharing_job_asks_for_a_node() -> None:
    est = estimate_scale_up(None, [gpu_job("tiny", 1, 100)], [A100, T4], POLICY)
    assert est.new_nodes("t4") == 1  # the cheapest pool per GPU that holds it


def test_jobs_fit_existing_and_booting_nodes_first() -> None:
    state = ClusterState.from_nodes([template_node(A100, "a-0")])
    state.bind(gpu_job("run", 6), 0, range(6))
    pending = [gpu_job("two", 2, gpu_models=frozenset({"A100"}))]
    assert estimate_scale_up(state, pending, [A100], POLICY).on_existing == ("two",)
    pending = [gpu_job("four", 4, gpu_models=frozenset({"A100"}))]
    est = estimate_scale_up(state, pending, [A100], POLICY, booting={"a100": 1})
    assert est.new_nodes("a100") == 0  # the booting node takes it
    est = estimate_scale_up(state, pending, [A100], POLICY)
    assert est.new_nodes("a100") == 1


def test_gang_takes_whole_new_nodes_all_or_nothing() -> None:
    gang = [gpu_job(f"g{i}", 8, gang="train") for i in range(3)]
    est = estimate_scale_up(None, gang, [A100], POLICY)
    assert est.new_nodes("a100") == 3
    small = NodePool(name="a100", gpu_model="A100", gpus_per_node=8, price_per_hour=32, max_size=2)
    est = estimate_scale_up(None, gang, [small], POLICY)
    assert est.new_nodes("a100") == 0 and "g0" in est.unplaceable


def test_pool_selector_and_max_size_bound_the_estimate() -> None:
    pending = [gpu_job(f"j{i}", 4, node_selector=((POOL_LABEL, "t4"),)) for i in range(5)]
    est = estimate_scale_up(None, pending, [A100, T4], POLICY, current={"t4": 1})
    assert est.new_nodes("t4") == 2 and est.new_nodes("a100") == 0
    assert len(est.unplaceable) == 3


def test_node_whose_jobs_fit_elsewhere_is_removable_and_one_whose_do_not_is_kept() -> None:
    nodes = [template_node(A100, f"a-{i}") for i in range(3)]
    state = ClusterState.from_nodes(nodes)
    state.bind(gpu_job("big", 6), 0, range(6))
    state.bind(gpu_job("small", 2), 1, range(2))
    state.bind(Job("hold", num_gpu=8, gpu_milli=1000, placeholder=True), 2, range(8))
    checks = {c.node: c for c in check_removals(state, [1, 0, 2], POLICY)}
    assert checks["a-1"].removable and checks["a-1"].moves == (("small", "a-0"),)
    # a-0 now needs 8 GPUs elsewhere: a-1 is going, a-2 holds only a placeholder.
    assert checks["a-0"].removable
    assert sorted(checks["a-0"].moves) == [("big", "a-2"), ("small", "a-2")]
    assert not checks["a-2"].removable  # a-0's job now lives there in the simulation
    assert state.jobs["small"].node == 1  # the real state is untouched


def test_cordoned_node_takes_nothing() -> None:
    nodes = [
        NodeSpec("n0", 4000, 8192, 8, "A100", cordoned=True),
        NodeSpec("n1", 4000, 8192, 8, "A100"),
    ]
    state = ClusterState.from_nodes(nodes)
    state.bind(gpu_job("x", 1), 1, [0])
    assert not check_removals(state, [1], POLICY)[0].removable
