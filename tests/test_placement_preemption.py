"""Preemption and gangs on hand-made clusters whose right answer is known."""

from __future__ import annotations

import numpy as np
import pytest
from placement_cluster import cluster, job

from scaler.placement import Placement, Unschedulable, commit, make_policy
from scaler.placement.gang import GangPlacement, commit_gang, place_gang
from scaler.placement.preemption import preempt

POLICY = make_policy("bestfit")


def two_nodes_with(left: list, right: list, now_s: float = 0.0):
    """Two 4-GPU nodes; `left`/`right` are (job, since_s) bound on GPUs in order."""
    state = cluster(("left", 32, 128, 4, "T4"), ("right", 32, 128, 4, "T4"))
    for node, jobs in enumerate((left, right)):
        gpu = 0
        for j, since in jobs:
            state.bind(j, node, range(gpu, gpu + j.num_gpu), since)
            gpu += j.num_gpu
    return state


def test_no_one_is_evicted_while_a_fit_exists() -> None:
    state = two_nodes_with([(job("low", 1, gpus=4, priority=0), 0.0)], [])
    decision = preempt(state, job("high", 1, gpus=2, priority=10), POLICY)
    assert isinstance(decision, Placement)
    assert decision.node == "right" and decision.evict == ()


def test_fewest_victims_win() -> None:
    state = two_nodes_with(
        [(job("l1", 1, gpus=2, priority=0), 0.0), (job("l2", 1, gpus=2, priority=0), 0.0)],
        [(job("r1", 1, gpus=4, priority=0), 0.0)],
    )
    decision = preempt(state, job("high", 1, gpus=4, priority=5), POLICY)
    assert isinstance(decision, Placement)
    assert decision.node == "right" and decision.evict == ("r1",)


def test_lowest_priority_victims_win() -> None:
    state = two_nodes_with(
        [(job("mid", 1, gpus=4, priority=5), 0.0)], [(job("low", 1, gpus=4, priority=1), 0.0)]
    )
    decision = preempt(state, job("high", 1, gpus=1, priority=9), POLICY)
    assert isinstance(decision, Placement) and decision.evict == ("low",)


def test_least_work_lost_wins() -> None:
    state = two_nodes_with(
        [(job("old", 1, gpus=4, priority=1), 0.0)], [(job("young", 1, gpus=4, priority=1), 900.0)]
    )
    decision = preempt(state, job("high", 1, gpus=2, priority=9), POLICY, now_s=1000.0)
    assert isinstance(decision, Placement) and decision.evict == ("young",)


def test_placeholders_go_first_and_only_as_many_as_needed() -> None:
    state = two_nodes_with(
        [(job("real", 1, gpus=4, priority=-5), 0.0)],
        [(job(f"ph{i}", 1, gpus=1, priority=0, placeholder=True), 0.0) for i in range(4)],
    )
    decision = preempt(state, job("train", 1, gpus=2, priority=0), POLICY)
    assert isinstance(decision, Placement)
    assert decision.node == "right" and len(decision.evict) == 2
    assert all(v.startswith("ph") for v in decision.evict)
    commit(state, job("train", 1, gpus=2, priority=0), decision)
    assert not set(decision.evict) & set(state.jobs)
    assert state.jobs["train"].node == 1 and "real" in state.jobs
    assert sorted(state.node_jobs[1]) == sorted(
        {"ph0", "ph1", "ph2", "ph3", "train"} - set(decision.evict)
    )


def test_equal_or_higher_priority_is_never_evicted() -> None:
    state = two_nodes_with(
        [(job("a", 1, gpus=4, priority=3), 0.0)], [(job("b", 1, gpus=4, priority=7), 0.0)]
    )
    decision = preempt(state, job("c", 1, gpus=1, priority=3), POLICY)
    assert isinstance(decision, Unschedulable)
    assert "evicting lower-priority jobs would not make room" in decision.reason
    # A placeholder never evicts anything, not even another placeholder.
    decision = preempt(state, job("p", 1, gpus=1, priority=99, placeholder=True), POLICY)
    assert isinstance(decision, Unschedulable)


def test_eviction_frees_the_right_gpus_for_a_sharing_job() -> None:
    state = two_nodes_with(
        [(job("keep", 30, gpus=4, priority=9), 0.0)],
        [(job("big", 1, gpus=3, priority=9), 0.0), (job("tiny", 1, gpus=1, priority=0), 0.0)],
    )
    decision = preempt(state, job("share", 1, gpus=1, share=400, priority=5), POLICY)
    assert isinstance(decision, Placement)
    assert decision.evict == ("tiny",) and decision.gpus == (3,)


def test_a_gang_is_placed_whole() -> None:
    state = cluster(("a", 32, 128, 4, "T4"), ("b", 32, 128, 4, "T4"))
    members = [job(f"w{i}", 4, gpus=2, gang="train") for i in range(4)]
    gang = place_gang(state, members, POLICY)
    assert isinstance(gang, GangPlacement) and len(gang.placements) == 4
    commit_gang(state, members, gang)
    assert state.allocated_gpu_milli == 8000 and sorted(state.jobs) == ["w0", "w1", "w2", "w3"]


def test_a_gang_is_never_half_placed() -> None:
    state = cluster(("a", 32, 128, 4, "T4"), ("b", 32, 128, 4, "T4"))
    state.bind(job("other", 1, gpus=1), 0, (0,))
    before = state.gpu_free.copy()
    members = [job(f"w{i}", 4, gpus=2, gang="train") for i in range(4)]
    decision = place_gang(state, members, POLICY)
    assert isinstance(decision, Unschedulable)
    assert "nothing was placed" in decision.reason and "3 of 4" in decision.reason
    assert np.array_equal(before, state.gpu_free) and list(state.jobs) == ["other"]


def test_commit_gang_undoes_everything_if_the_cluster_changed() -> None:
    state = cluster(("a", 32, 128, 4, "T4"), ("b", 32, 128, 4, "T4"))
    members = [job(f"w{i}", 4, gpus=2, gang="g") for i in range(4)]
    gang = place_gang(state, members, POLICY)
    assert isinstance(gang, GangPlacement)
    last = gang.placements[-1]
    state.bind(job("intruder", 1, gpus=1), last.node_index, last.gpus[:1])
    with pytest.raises(ValueError):
        commit_gang(state, members, gang)
    assert list(state.jobs) == ["intruder"]


def test_gang_members_must_share_a_gang() -> None:
    state = cluster(("a", 32, 128, 4, "T4"))
    decision = place_gang(state, [job("x", gang="g1"), job("y", gang="g2")], POLICY)
    assert isinstance(decision, Unschedulable) and "different gangs" in decision.reason
