"""Admission order and defragmentation plans on hand-made clusters."""

from __future__ import annotations

import numpy as np
import pytest
from placement_cluster import cluster, job

from scaler.controller.defrag_plan import units, without_units
from scaler.placement import ClusterState, Job, make_policy
from scaler.placement.defrag import DefragPlan, apply_plan, plan_defrag
from scaler.placement.queue import QueuePolicy, admission_order, admit

POLICY = make_policy("bestfit")


def ids(jobs: list[Job]) -> list[str]:
    return [j.id for j in jobs]


PENDING = [
    job("long", 1, gpus=8, submitted_s=0.0, predicted_gpu_s=8 * 36_000, priority=1),
    job("short", 1, gpus=1, submitted_s=100.0, predicted_gpu_s=600),
    job("hold", 1, gpus=1, submitted_s=50.0, placeholder=True, priority=-100),
    job("urgent", 1, gpus=2, submitted_s=200.0, predicted_gpu_s=7200, priority=5),
    job("unknown", 1, gpus=1, submitted_s=150.0),
]


def test_fifo_and_priority_orders() -> None:
    assert ids(admission_order(PENDING, 300.0, QueuePolicy("fifo"))) == [
        "long", "short", "unknown", "urgent", "hold",
    ]  # fmt: skip
    assert ids(admission_order(PENDING, 300.0, QueuePolicy("priority"))) == [
        "urgent", "long", "short", "unknown", "hold",
    ]  # fmt: skip


def test_shortest_predicted_gpu_time_first_then_the_starved() -> None:
    early = admission_order(PENDING, 300.0, QueuePolicy("qssf", starvation_s=3600))
    # An unknown job counts as the median prediction (7200 GPU-s), tied with "urgent".
    assert ids(early) == ["short", "unknown", "urgent", "long", "hold"]
    late = admission_order(PENDING, 3650.0, QueuePolicy("qssf", starvation_s=3600))
    assert ids(late)[0] == "long"  # waited an hour: no longer overtaken
    assert ids(late)[-1] == "hold"  # placeholders always last


def test_queue_policy_validation() -> None:
    with pytest.raises(ValueError, match="unknown queue order"):
        QueuePolicy("lifo")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        QueuePolicy("qssf", starvation_s=0)


def test_admit_backfills_in_order_without_touching_the_state() -> None:
    state = cluster(("a", 32, 128, 4, "T4"))
    result = admit(state, PENDING, POLICY, QueuePolicy("qssf"), now_s=300.0)
    # short (1) + unknown (1) + urgent (2) fill the node; long (8) never fits; hold waits.
    assert [p.job_id for p in result.placed] == ["short", "unknown", "urgent"]
    assert [u.job_id for u in result.waiting] == ["long", "hold"]
    assert state.jobs == {}


def fragmented() -> ClusterState:
    """Three 4-GPU nodes: a holds one whole-GPU job, b one, c two; d is a CPU-poor node."""
    state = cluster(
        ("a", 32, 128, 4, "T4"),
        ("b", 32, 128, 4, "T4"),
        ("c", 32, 128, 4, "T4"),
        ("d", 2, 8, 4, "T4"),
    )
    state.bind(job("a1", 4, gpus=1), 0, (0,))
    state.bind(job("b1", 4, gpus=1), 1, (0,))
    state.bind(job("c1", 4, gpus=1), 2, (0,))
    state.bind(job("c2", 4, gpus=1), 2, (1,))
    return state


def check_plan(state: ClusterState, plan: DefragPlan) -> None:
    """Replay the plan move by move: each target holds its job, each claim is true."""
    replay = state.copy()
    for move in plan.moves:
        allocation = replay.release(move.job_id)
        target = replay.node_index(move.target)
        assert target != allocation.node or move.target_gpus != allocation.gpus
        replay.bind(allocation.job, target, move.target_gpus)  # raises if it cannot hold it
        if move.frees.startswith("node "):
            assert replay.is_empty(replay.node_index(move.frees.removeprefix("node ")))
        elif move.frees:
            gpu, node = move.frees.removeprefix("GPU ").split(" of ")
            assert replay.gpu_free[replay.node_index(node), int(gpu)] == 1000


def test_defrag_empties_the_cheapest_nodes_within_the_budget() -> None:
    state = fragmented()
    plan = plan_defrag(state, POLICY, goal="nodes", max_moves=2)
    check_plan(state, plan)
    assert len(plan.moves) == 2 and len(plan.freed_nodes) == 2
    assert set(plan.freed_nodes) <= {"a", "b", "c"}
    # Nothing moves onto d: it lacks the CPU the jobs need.
    assert all(m.target != "d" for m in plan.moves)
    # Nor onto a node freed earlier in the same plan.
    assert not {m.target for m in plan.moves} & set(plan.freed_nodes)
    apply_plan(state, plan)
    assert all(state.is_empty(state.node_index(n)) for n in plan.freed_nodes)
    assert state.allocated_gpu_milli == 4000


def test_defrag_never_moves_a_job_that_fits_nowhere_else() -> None:
    state = cluster(("a", 32, 128, 4, "T4"), ("b", 8, 16, 4, "T4"))
    state.bind(job("big", 30, gpus=1), 0, (0,))
    state.bind(job("small", 1, gpus=1), 1, (0,))
    plan = plan_defrag(state, POLICY, goal="nodes", max_moves=5)
    check_plan(state, plan)
    assert [m.job_id for m in plan.moves] == ["small"] and plan.freed_nodes == ("b",)


def test_defrag_respects_draining_and_budget() -> None:
    state = fragmented()
    state.set_draining([2])
    plan = plan_defrag(state, POLICY, goal="nodes", max_moves=1)
    check_plan(state, plan)
    assert len(plan.moves) == 1 and all(m.target != "c" for m in plan.moves)
    assert plan_defrag(state, POLICY, max_moves=0).moves == ()


def test_defrag_frees_whole_gpus() -> None:
    state = cluster(("a", 32, 128, 2, "T4"), ("b", 32, 128, 2, "T4"))
    state.bind(job("s1", 1, gpus=1, share=300), 0, (0,))
    state.bind(job("s2", 1, gpus=1, share=300), 0, (1,))
    state.bind(job("s3", 1, gpus=1, share=300), 1, (0,))
    plan = plan_defrag(state, POLICY, goal="gpus", max_moves=2)
    check_plan(state, plan)
    assert len(plan.moves) == 2 and len(plan.freed_gpus) == 2
    # A sharing job is never parked on an idle GPU (that would only move the hole).
    assert all((m.target, m.target_gpus) != ("b", (1,)) for m in plan.moves)
    apply_plan(state, plan)
    assert int((state.gpu_free == 1000).sum()) == 3 and state.allocated_gpu_milli == 900


def test_defrag_gpus_leaves_what_cannot_combine() -> None:
    state = cluster(("a", 32, 128, 2, "T4"))
    state.bind(job("s1", 1, gpus=1, share=600), 0, (0,))
    state.bind(job("s2", 1, gpus=1, share=600), 0, (1,))
    assert plan_defrag(state, POLICY, goal="gpus", max_moves=4).moves == ()


def test_a_plan_without_a_unit_keeps_the_others_and_what_they_free() -> None:
    """The plan carried out when a refused eviction stops one unit: the other units' moves,
    still valid in order, and only the nodes or GPUs they free."""
    nodes = fragmented()
    plan = plan_defrag(nodes, POLICY, goal="nodes", max_moves=2)
    first, second = units(plan.moves)
    kept = without_units(plan, {first[0]})
    assert kept.moves == tuple(plan.moves[i] for i in second)
    assert kept.freed_nodes == plan.freed_nodes[1:] and kept.freed_gpus == ()
    check_plan(nodes, kept)
    gpus = cluster(("a", 32, 128, 2, "T4"), ("b", 32, 128, 2, "T4"))
    gpus.bind(job("s1", 1, gpus=1, share=300), 0, (0,))
    gpus.bind(job("s2", 1, gpus=1, share=300), 0, (1,))
    gpus.bind(job("s3", 1, gpus=1, share=300), 1, (0,))
    plan = plan_defrag(gpus, POLICY, goal="gpus", max_moves=2)
    first, second = units(plan.moves)
    kept = without_units(plan, {second[-1]})
    assert kept.moves == tuple(plan.moves[i] for i in first)
    assert kept.freed_gpus == plan.freed_gpus[:1] and kept.freed_nodes == ()
    check_plan(gpus, kept)


def test_apply_plan_refuses_a_stale_plan() -> None:
    state = fragmented()
    plan = plan_defrag(state, POLICY, goal="nodes", max_moves=1)
    move = plan.moves[0]
    target = state.node_index(move.target)
    state.bind(job("squatter", 1, gpus=1), target, move.target_gpus)
    before = state.gpu_free.copy()
    with pytest.raises(ValueError):
        apply_plan(state, plan)
    assert np.array_equal(before, state.gpu_free)


def test_defrag_never_fills_an_idle_node_to_empty_another() -> None:
    # a's job fits on b (in use) and on e (idle): only b is a target; with b full, nothing.
    state = cluster(("a", 32, 128, 4, "T4"), ("b", 32, 128, 4, "T4"), ("e", 32, 128, 4, "T4"))
    state.bind(job("a1", 4, gpus=1), 0, (0,))
    state.bind(job("b1", 4, gpus=2), 1, (0, 1))
    for policy in ("bestfit", "dotprod", "gpuclustering", "random"):
        plan = plan_defrag(state, make_policy(policy), goal="nodes", max_moves=4)
        check_plan(state, plan)
        assert all(m.target != "e" for m in plan.moves), policy
    state.bind(job("b2", 4, gpus=2), 1, (2, 3))
    assert plan_defrag(state, POLICY, goal="nodes", max_moves=4).moves == ()
