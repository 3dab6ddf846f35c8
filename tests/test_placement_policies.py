"""Scoring policies: the fragmentation measure against its definition, and known choices."""

from __future__ import annotations

import numpy as np
import pytest
from placement_cluster import cluster, job, run

from scaler.cluster.predicates import feasible
from scaler.placement import POLICIES, ClusterState, Placement, WorkloadMix, make_policy, place
from scaler.placement.fragmentation import FragmentationModel
from scaler.placement.mix import JobShape
from scaler.placement.policies.leftover import expected_leftover


def reference_fragmentation(state: ClusterState, node: int, mix: WorkloadMix) -> float:
    """FGD's definition, written out one shape at a time."""
    free = state.gpu_free[node, : state.gpu_count[node]]
    model = state.models[state.model_id[node]] if state.model_id[node] >= 0 else ""
    total = 0.0
    for shape, p in zip(mix.shapes, mix.popularity, strict=True):
        hostable = (
            shape.gpu_milli > 0
            and (not shape.gpu_models or model in shape.gpu_models)
            and (free >= shape.gpu_milli).sum() >= shape.num_gpu
            and state.cpu_free[node] >= shape.cpu_milli
        )
        total += p * (free[free < shape.gpu_milli].sum() if hostable else free.sum())
    return total


MIX = WorkloadMix(
    shapes=(
        JobShape(4000, 500, 1),
        JobShape(8000, 1000, 1),
        JobShape(2000, 250, 1, ("T4",)),
        JobShape(16000, 1000, 4),
        JobShape(12000, 0, 0),
        JobShape(6000, 700, 1, ("V100",)),
    ),
    popularity=(0.3, 0.25, 0.15, 0.1, 0.15, 0.05),
    memory_mib=(8192.0, 16384.0, 4096.0, 65536.0, 32768.0, 8192.0),
)


def random_state(seed: int) -> ClusterState:
    rng = np.random.default_rng(seed)
    state = cluster(
        *[
            (
                f"n{i}",
                int(rng.choice([16, 32, 64])),
                256,
                int(rng.choice([1, 2, 4, 8])),
                str(rng.choice(["T4", "V100"])),
            )
            for i in range(30)
        ],
        ("cpu-only", 64, 256, 0, ""),
    )
    policy = make_policy("random", seed=seed)
    for k in range(120):
        share = int(rng.choice([0, 100, 250, 500, 700, 1000]))
        gpus = 0 if share == 0 else (int(rng.choice([1, 1, 2])) if share == 1000 else 1)
        new = job(f"j{k}", float(rng.choice([1, 2, 4, 8])), gpus=gpus, share=share)
        decision = place(state, new, policy)
        if isinstance(decision, Placement):
            run(state, new, decision)
    return state


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_fragmentation_matches_the_definition(seed: int) -> None:
    state = random_state(seed)
    model = FragmentationModel(MIX)
    cached = model.node_fragments(state).frag
    expected = [reference_fragmentation(state, n, MIX) for n in range(state.size)]
    assert np.allclose(cached, expected)
    assert cached.max() > 0


@pytest.mark.parametrize("share,gpus", [(250, 1), (500, 1), (1000, 1), (1000, 2), (0, 0)])
def test_fragmentation_after_a_placement_matches_a_recount(share: int, gpus: int) -> None:
    state = random_state(4)
    model = FragmentationModel(MIX)
    new = job("new", 2, gpus=gpus, share=share)
    nodes = np.flatnonzero(feasible(state, new))
    found = model.candidates(state, new, nodes)
    assert found.node.size >= nodes.size > 0
    for node, gpu, after in zip(found.node, found.gpu, found.frag_after, strict=True):
        trial = state.copy()
        trial.derived.clear()
        free = np.flatnonzero(trial.gpu_free[node, : trial.gpu_count[node]] == 1000)
        trial.bind(new, int(node), (int(gpu),) if new.is_sharing else tuple(free[:gpus]))
        assert after == pytest.approx(reference_fragmentation(trial, int(node), MIX))


def test_cached_fragmentation_follows_changes() -> None:
    state = random_state(5)
    model = FragmentationModel(MIX)
    model.node_fragments(state)
    node = next(n for n in range(state.size) if state.full_free[n] > 0)
    state.bind(job("late", 1, gpus=1), node, (int(np.argmax(state.gpu_free[node] == 1000)),))
    assert model.node_fragments(state).frag[node] == pytest.approx(
        reference_fragmentation(state, node, MIX)
    )


@pytest.mark.parametrize("name", ["fgd", "gpuscale"])
def test_memoised_scores_choose_as_a_fresh_policy(name: str) -> None:
    """Scores memoised per node version, per node state (jobs leave, nodes come back to
    earlier states) and across copies of a state give the choices of a policy that has
    nothing memoised."""
    rng = np.random.default_rng(7)
    state = random_state(6)
    policy = make_policy(name, mix=MIX, seed=3)
    running: list[str] = []
    placed = 0
    for k in range(300):
        if running and rng.random() < 0.45:
            state.release(running.pop(int(rng.integers(len(running)))))
            continue
        share = int(rng.choice([0, 250, 500, 1000]))
        gpus = 0 if share == 0 else (int(rng.choice([1, 2])) if share == 1000 else 1)
        new = job(f"m{k}", float(rng.choice([1, 2, 4])), gpus=gpus, share=share)
        fresh = state.copy()
        fresh.derived.clear()
        expected = place(fresh, new, make_policy(name, mix=MIX, seed=3))
        decision = place(state, new, policy)
        assert decision == expected
        if isinstance(decision, Placement):
            run(state, new, decision)
            running.append(new.id)
            placed += 1
        if k % 25 == 0:
            state = state.copy()  # a what-if copy shares the memoised arrays until written
    assert placed > 100


def test_workload_mix_keeps_the_popular_shapes() -> None:
    jobs = [job(f"a{i}", 4, gpus=1) for i in range(90)] + [
        job(f"b{i}", 2, gpus=1, share=500) for i in range(9)
    ]
    jobs.append(job("rare", 64, gpus=8))
    mix = WorkloadMix.from_jobs(jobs, coverage=0.95)
    assert mix.shapes == (JobShape(4000, 1000, 1), JobShape(2000, 500, 1))
    assert mix.popularity == pytest.approx((90 / 99, 9 / 99))


def test_fgd_fills_the_gpu_whose_leftover_would_be_a_fragment() -> None:
    state = cluster(("n", 32, 128, 2, "T4"))
    run(
        state,
        first := job("first", 1, gpus=1, share=500),
        place(state, first, make_policy("bestfit")),
    )
    used = state.jobs["first"].gpus[0]
    mix = WorkloadMix(
        (JobShape(1000, 500, 1), JobShape(1000, 1000, 1)), (0.5, 0.5), (1024.0, 1024.0)
    )
    decision = place(state, job("second", 1, gpus=1, share=500), make_policy("fgd", mix=mix))
    # On the half-used GPU nothing is left over; on the idle one a 500 fragment would be.
    assert isinstance(decision, Placement) and decision.gpus == (used,)


def test_gpuscale_sends_cpu_hungry_jobs_where_cpu_is_spare() -> None:
    # An 8-GPU node with 12 cores per GPU and a 2-GPU node with 52: the GPU jobs of the mix
    # need 11 cores per GPU, so a 32-core CPU-only job belongs on the 2-GPU node.
    state = cluster(("g2", 96, 384, 8, "G2"), ("t4", 104, 512, 2, "T4"))
    mix = WorkloadMix(
        (JobShape(11000, 1000, 1), JobShape(32000, 0, 0)), (0.8, 0.2), (32768.0, 65536.0)
    )
    decision = place(state, job("cpu", 32), make_policy("gpuscale", mix=mix))
    assert isinstance(decision, Placement) and decision.node == "t4"


# 600s are half the GPU jobs, 400s a quarter, whole GPUs the rest: a GPU with 600 free
# is soon filled, one with 200 free never is.
SIX_FOUR = WorkloadMix(
    (JobShape(2000, 600, 1), JobShape(2000, 400, 1), JobShape(4000, 1000, 1)),
    (0.5, 0.25, 0.25),
    (1024.0, 1024.0, 1024.0),
)


def test_expected_leftover_of_a_mix() -> None:
    leftover = expected_leftover(SIX_FOUR)
    free = np.arange(1001)
    # Below the smallest sharing job nothing ever fits; an idle GPU goes to a whole job.
    assert np.array_equal(leftover[:400], free[:400]) and leftover[1000] == 0
    assert np.all((leftover >= 0) & (leftover <= free))
    # 600 free is mostly filled by a 600 job; 400 free waits for the rarer 400s.
    assert leftover[600] < 0.25 * 600 and leftover[600] < leftover[400]
    assert expected_leftover(SIX_FOUR) is leftover and not leftover.flags.writeable
    whole_only = WorkloadMix(
        (JobShape(4000, 1000, 1), JobShape(8000, 1000, 2)), (0.5, 0.5), (1.0, 1.0)
    )
    assert not expected_leftover(whole_only).any()


def test_gpuscale_leaves_free_shares_the_mix_can_still_fill() -> None:
    # FGD weighs the next job only: 200 left is lost to every job, but a second GPU with
    # 600 free is lost to the whole-GPU jobs, so it stacks the 400 jobs. The expected
    # leftover sees that nothing ever fills the 200 and the popular 600 jobs fill a 600.
    state = cluster(("n", 32, 128, 2, "T4"))
    run(
        state,
        first := job("first", 2, gpus=1, share=400),
        place(state, first, make_policy("bestfit")),
    )
    used = state.jobs["first"].gpus[0]
    second = job("second", 2, gpus=1, share=400)
    fgd = place(state, second, make_policy("fgd", mix=SIX_FOUR))
    ours = place(state, second, make_policy("gpuscale", mix=SIX_FOUR))
    assert isinstance(fgd, Placement) and fgd.gpus == (used,)
    assert isinstance(ours, Placement) and ours.gpus == (1 - used,)


def test_baselines_make_their_documented_choices() -> None:
    state = cluster(("a", 64, 256, 4, "T4"), ("b", 64, 256, 4, "T4"), ("c", 64, 256, 4, "T4"))
    run(state, x := job("x", 8, gpus=2), place(state, x, make_policy("bestfit")))
    busy = state.jobs["x"].node
    # Best fit and GPU packing both stack on the node already in use.
    for name in ("bestfit", "gpupacking", "dotprod"):
        decision = place(state, job("y", 1, gpus=1), make_policy(name))
        assert isinstance(decision, Placement) and decision.node_index == busy, name
    # GPU clustering prefers a node already running jobs of the same shape...
    run(state, s := job("s", 1, gpus=1, share=300), place(state, s, make_policy("gpupacking")))
    shared_node = state.jobs["s"].node
    decision = place(state, job("t", 1, gpus=1, share=300), make_policy("gpuclustering"))
    assert isinstance(decision, Placement) and decision.node_index == shared_node
    # ... and GPU packing fills the partly used GPU before an idle one.
    decision = place(state, job("u", 1, gpus=1, share=500), make_policy("gpupacking"))
    assert isinstance(decision, Placement)
    assert (decision.node_index, decision.gpus) == (shared_node, state.jobs["s"].gpus)


def test_random_policy_is_reproducible_and_spreads() -> None:
    state = cluster(*[(f"n{i}", 8, 32, 1, "T4") for i in range(20)])
    nodes = {
        place(state, job(f"j{i}", 1, gpus=1), make_policy("random", seed=7)).node for i in range(40)
    }  # type: ignore[union-attr]
    again = {
        place(state, job(f"j{i}", 1, gpus=1), make_policy("random", seed=7)).node for i in range(40)
    }  # type: ignore[union-attr]
    assert nodes == again and len(nodes) > 5


def test_registry() -> None:
    assert list(POLICIES) == [
        "random",
        "bestfit",
        "dotprod",
        "gpupacking",
        "gpuclustering",
        "fgd",
        "gpuscale",
    ]
    with pytest.raises(ValueError, match="unknown placement policy"):
        make_policy("nope")
    with pytest.raises(ValueError, match="typical job mix"):
        make_policy("fgd")
