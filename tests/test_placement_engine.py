"""The placement engine on hand-made clusters whose right answer is known."""

from __future__ import annotations

import numpy as np
import pytest
from placement_cluster import cluster, job, run

from scaler.controller.config import DEFAULT_MIX, workload_mix
from scaler.placement import (
    ClusterState,
    Job,
    NodeSpec,
    Placement,
    Policy,
    Unschedulable,
    make_policy,
    place,
)


def test_whole_gpus_go_to_a_node_with_enough_idle_gpus() -> None:
    state = cluster(("small", 16, 64, 2, "T4"), ("big", 64, 256, 8, "V100"))
    decision = place(state, job("j", 4, gpus=4), make_policy("bestfit"))
    assert isinstance(decision, Placement)
    assert decision.node == "big" and len(decision.gpus) == 4


def test_sharing_job_takes_a_share_of_one_gpu_and_release_gives_it_back() -> None:
    state = cluster(("n", 16, 64, 2, "T4"))
    policy = make_policy("bestfit")
    first = run(state, a := job("a", 1, gpus=1, share=300), place(state, a, policy))
    run(state, b := job("b", 1, gpus=1, share=500), place(state, b, policy))
    # Best fit stacks the second share on the GPU the first one already uses.
    assert state.gpu_free[0].tolist() == [200, 1000] or state.gpu_free[0].tolist() == [1000, 200]
    assert state.allocated_gpu_milli == 800
    state.release("a")
    assert state.allocated_gpu_milli == 500
    assert first.gpus[0] in (0, 1)
    assert state.cpu_free[0] == 15_000


def test_place_does_not_change_the_state() -> None:
    state = cluster(("n0", 8, 32, 2, "T4"), ("n1", 8, 32, 2, "T4"))
    before = (state.cpu_free.copy(), state.gpu_free.copy(), state.version.copy())
    for name in ("random", "bestfit", "dotprod", "gpupacking", "gpuclustering"):
        assert isinstance(
            place(state, job("x", 2, gpus=1, share=500), make_policy(name)), Placement
        )
    assert np.array_equal(before[0], state.cpu_free)
    assert np.array_equal(before[1], state.gpu_free)
    assert np.array_equal(before[2], state.version)
    assert state.jobs == {}


def test_bad_requests_are_unschedulable_with_a_clear_reason() -> None:
    state = cluster(("n0", 96, 384, 8, "G2"), ("n1", 96, 384, 8, "G2"))
    policy = make_policy("bestfit")
    cases = {
        "nine": (job("nine", 1, gpus=9), "asks 9 GPUs but the largest allowed node has 8"),
        "negative": (Job("negative", 1000, 1024, 1, -100), "gpu_milli is negative (-100)"),
        "model": (
            job("model", 1, gpus=1, gpu_models=frozenset({"H100"})),
            "no node has GPU model H100",
        ),
        "huge": (job("huge", 200), "asks more CPU or memory than the largest node has"),
        "split": (Job("split", 1000, 1024, 2, 500), "only whole GPUs"),
    }
    for name, (bad, reason) in cases.items():
        decision = place(state, bad, policy)
        assert isinstance(decision, Unschedulable), name
        assert decision.job_id == name
        assert reason in decision.reason, decision.reason
    assert state.allocated_gpu_milli == 0


def test_full_cluster_says_which_constraint_ruled_nodes_out() -> None:
    state = cluster(("n0", 8, 32, 1, "T4"))
    run(state, a := job("a", 7, gpus=1, share=500), place(state, a, make_policy("bestfit")))
    decision = place(state, job("b", 2, gpus=1, share=200), make_policy("bestfit"))
    assert isinstance(decision, Unschedulable)
    assert "0 have 2000m CPU free" in decision.reason


def test_draining_nodes_are_avoided_while_others_fit() -> None:
    state = cluster(("leaving", 16, 64, 4, "T4"), ("staying", 16, 64, 4, "T4"))
    policy = make_policy("bestfit")
    run(state, a := job("a", 1, gpus=2), place(state, a, policy))
    fuller = state.jobs["a"].node
    state.set_draining([fuller])
    # Best fit alone would stack on the fuller node; drain awareness sends it elsewhere.
    decision = run(state, b := job("b", 1, gpus=1), place(state, b, policy))
    assert decision.node_index != fuller
    # Once no other node fits, the draining node is still used rather than failing.
    run(state, c := job("c", 1, gpus=3), place(state, c, policy))
    last = run(state, d := job("d", 1, gpus=2), place(state, d, policy))
    assert last.node_index == fuller


def test_spread_puts_replicas_of_a_service_on_different_nodes() -> None:
    state = cluster(*[(f"n{i}", 32, 128, 4, "T4") for i in range(3)])
    policy = make_policy("bestfit")
    nodes = []
    for i in range(3):
        replica = job(f"r{i}", 1, gpus=1, mode="spread", service="api")
        nodes.append(run(state, replica, place(state, replica, policy)).node)
    assert sorted(nodes) == ["n0", "n1", "n2"]
    fourth = place(state, job("r3", 1, gpus=1, mode="spread", service="api"), policy)
    assert isinstance(fourth, Unschedulable)
    assert "0 admit it (selector, taints, spread, cordon)" in fourth.reason
    # Pack mode (or another service) may share a node.
    assert isinstance(place(state, job("p", 1, gpus=1, service="api"), policy), Placement)
    assert isinstance(
        place(state, job("o", 1, gpus=1, mode="spread", service="other"), policy), Placement
    )
    # Spread without a service is a malformed request.
    bad = place(state, job("s", 1, mode="spread"), policy)
    assert isinstance(bad, Unschedulable) and "service" in bad.reason


def test_selectors_and_taints() -> None:
    state = ClusterState.from_nodes(
        [
            NodeSpec("plain", 8000, 8192, 1, "T4"),
            NodeSpec(
                "tainted",
                8000,
                8192,
                1,
                "T4",
                labels=(("zone", "b"),),
                taints=frozenset({"gpu=reserved:NoSchedule"}),
            ),
        ]
    )
    policy = make_policy("bestfit")
    want_b = job("b", 1, gpus=1, node_selector=(("zone", "b"),))
    assert isinstance(place(state, want_b, policy), Unschedulable)
    tolerant = job(
        "t",
        1,
        gpus=1,
        node_selector=(("zone", "b"),),
        tolerations=frozenset({"gpu=reserved:NoSchedule"}),
    )
    decision = place(state, tolerant, policy)
    assert isinstance(decision, Placement) and decision.node == "tainted"
    decision = place(state, job("any", 1, gpus=1), policy)
    assert isinstance(decision, Placement) and decision.node == "plain"


def test_gpu_model_constraint() -> None:
    state = cluster(("t4", 16, 64, 2, "T4"), ("v100", 16, 64, 2, "V100M32"))
    decision = place(
        state,
        job("j", 1, gpus=1, gpu_models=frozenset({"V100M16", "V100M32"})),
        make_policy("bestfit"),
    )
    assert isinstance(decision, Placement) and decision.node == "v100"


def test_bind_refuses_what_does_not_fit() -> None:
    state = cluster(("n", 4, 8, 1, "T4"))
    with pytest.raises(ValueError, match="does not fit"):
        state.bind(job("cpu", 5), 0, ())
    with pytest.raises(ValueError, match="cannot hold"):
        state.bind(job("gpu", 1, gpus=1), 0, (1,))
    state.bind(job("a", 1, gpus=1, share=600), 0, (0,))
    with pytest.raises(ValueError, match="cannot hold"):
        state.bind(job("b", 1, gpus=1, share=600), 0, (0,))
    with pytest.raises(ValueError, match="already bound"):
        state.bind(job("a", 1), 0, ())


# ---- price between equal fits ------------------------------------------------------------

# The case: an idle H100 node at $98.32 an hour beside an idle A100 node at $32.77.
PRICED = (("h100", "H100", 98.32), ("a100", "A100", 32.77))
SCORING = ("gpuscale", "fgd", "bestfit", "dotprod", "gpupacking", "gpuclustering")


def priced_cluster(priced: bool = True) -> ClusterState:
    return ClusterState.from_nodes(
        [
            NodeSpec(name, 96_000, 1_048_576, 8, model, price_per_hour=price if priced else None)
            for name, model, price in PRICED
        ]
    )


def scoring_policy(name: str) -> Policy:
    """The policy as the service makes it, with its default job mix."""
    return make_policy(name, mix=workload_mix(DEFAULT_MIX))


def eight_gpus(job_id: str = "train", **extra: object) -> Job:
    return Job(job_id, 64_000, 262_144, 8, 1000, **extra)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", SCORING)
def test_an_unconstrained_job_takes_the_cheaper_gpu_between_equal_fits(name: str) -> None:
    """Every scoring policy fits the 8-GPU job on either idle node equally well, and its
    seeded order took the H100 node: priced, the A100 node at a third of the price."""
    unpriced = place(priced_cluster(priced=False), eight_gpus(), scoring_policy(name))
    assert isinstance(unpriced, Placement) and unpriced.node == "h100"
    decision = place(priced_cluster(), eight_gpus(), scoring_policy(name))
    assert isinstance(decision, Placement) and decision.node == "a100"
    assert decision.explanation == (
        "a100 (A100, $4.10 per GPU-hour): the cheapest GPU that can hold the job (H100 at"
        f" $12.29 could too) and a best fit of the {name} policy, which gives equal fits to"
        " the cheaper GPU"
    )


def test_a_job_that_asks_for_a_gpu_model_is_not_steered_by_price() -> None:
    decision = place(
        priced_cluster(), eight_gpus(gpu_models=frozenset({"H100", "A100"})), scoring_policy("fgd")
    )
    assert isinstance(decision, Placement) and decision.node == "h100"
    assert decision.explanation == (
        "h100 (H100, $12.29 per GPU-hour): the fgd policy's best fit; the job asks for A100,"
        " H100, so price is not weighed"
    )


def test_a_better_fit_on_a_dearer_gpu_keeps_the_job() -> None:
    """Half an H100 is in use, and paid for: the other half takes the next half-GPU job
    rather than an idle A100 it would fragment."""
    state = priced_cluster()
    state.bind(Job("half", 4_000, 16_384, 1, 500), 0, (0,))
    decision = place(state, Job("other-half", 4_000, 16_384, 1, 500), scoring_policy("gpuscale"))
    assert isinstance(decision, Placement) and (decision.node, decision.gpus) == ("h100", (0,))
    assert decision.explanation == (
        "h100 (H100, $12.29 per GPU-hour): the gpuscale policy's best fit; it fits the job"
        " better here than on the nodes of cheaper GPUs that could hold it (A100 at $4.10)"
    )


def test_a_node_of_unknown_price_is_not_steered_away_from() -> None:
    """Only a known price is weighed: an unpriced node stays among the equal fits (here
    first in the seeded order), as a node without topology labels does."""
    specs = [
        NodeSpec("h100", 96_000, 1_048_576, 8, "H100"),
        NodeSpec("a100", 96_000, 1_048_576, 8, "A100", price_per_hour=32.77),
    ]
    decision = place(ClusterState.from_nodes(specs), eight_gpus(), scoring_policy("gpuscale"))
    assert isinstance(decision, Placement) and decision.node == "h100"
    assert decision.explanation == "h100 (H100): the gpuscale policy's best fit"
