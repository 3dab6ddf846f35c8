"""Defragmentation plans: a bounded list of job moves that frees whole nodes or whole GPUs.

Goal `nodes` (so the scaler can remove nodes): nodes are tried cheapest first (fewest jobs,
then least GPU held); a node is evacuated only if every one of its jobs finds a place on
another node within the remaining move budget, chosen by the placement policy among the
nodes already in use (a node idle before the plan is never a target: filling it would only
move the empty node elsewhere). Goal
`gpus` (so multi-GPU jobs fit): partly used GPUs are tried the same way, moving their
GPU-sharing jobs onto the fullest other partly used GPU that holds them (possibly on the
same node); moving onto an idle GPU would only shift the hole, so it is never done.

Every target is chosen by the placement engine on a scratch state that already contains
the earlier moves, so a move never lands on a node that cannot hold the job when the
moves are applied in order (`apply_plan` checks it again and raises otherwise). A move
says what it frees: the GPU or node that becomes empty with it. Draining nodes are never
chosen as targets.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

from scaler.cluster.job import WHOLE_GPU_MILLI, Job
from scaler.cluster.predicates import feasible
from scaler.cluster.snapshot import Allocation, ClusterState
from scaler.placement.engine import choose
from scaler.placement.policies.base import Policy

Goal = Literal["nodes", "gpus"]


@dataclass(frozen=True, slots=True)
class Move:
    job_id: str
    source: str
    target: str
    target_gpus: tuple[int, ...]
    frees: str  # "" when the move alone frees nothing; else e.g. "node n3" or "GPU 2 of n3"


@dataclass(frozen=True, slots=True)
class DefragPlan:
    goal: Goal
    moves: tuple[Move, ...]
    freed_nodes: tuple[str, ...]
    freed_gpus: tuple[tuple[str, int], ...]


def plan_defrag(
    state: ClusterState,
    policy: Policy,
    goal: Goal = "nodes",
    max_moves: int = 10,
    movable: Callable[[Job], bool] = lambda job: True,
) -> DefragPlan:
    """Greedy plan of at most `max_moves` moves toward `goal` (see module docstring)."""
    if goal not in ("nodes", "gpus"):
        raise ValueError(f"unknown defragmentation goal {goal!r}")
    scratch = state.copy()
    moves: list[Move] = []
    freed_nodes: list[str] = []
    freed_gpus: list[tuple[str, int]] = []
    # Freed nodes must stay empty; for whole nodes, idle ones too (see the docstring).
    reserved = np.zeros(state.size, dtype=bool)
    if goal == "nodes":
        reserved[[n for n in range(state.size) if state.is_empty(n)]] = True
    received: set[tuple[int, int | None]] = set()  # targets are not emptied in turn
    for node, gpu in _units(scratch, goal):
        if (node, gpu) in received:
            continue
        jobs = _jobs_in(scratch, node, gpu)
        budget = max_moves - len(moves)
        if not jobs or len(jobs) > budget or not all(movable(scratch.jobs[j].job) for j in jobs):
            continue
        trial = scratch.copy()
        planned = _evacuate(trial, policy, jobs, node, gpu, reserved)
        if planned is None:
            continue
        scratch = trial
        name = state.names[node]
        planned[-1] = replace(
            planned[-1], frees=f"node {name}" if gpu is None else f"GPU {gpu} of {name}"
        )
        moves.extend(planned)
        for m in planned:
            target = scratch.node_index(m.target)
            received.add((target, None) if gpu is None else (target, m.target_gpus[0]))
        if gpu is None:
            freed_nodes.append(name)
            reserved[node] = True
        else:
            freed_gpus.append((name, gpu))
    return DefragPlan(goal, tuple(moves), tuple(freed_nodes), tuple(freed_gpus))


def apply_plan(state: ClusterState, plan: DefragPlan, now_s: float = 0.0) -> None:
    """Carry out the moves in order; raises ValueError (state unchanged) if one no longer fits."""
    trial = state.copy()
    for move in plan.moves:
        allocation = trial.release(move.job_id)
        trial.bind(allocation.job, trial.node_index(move.target), move.target_gpus, now_s)
    for move in plan.moves:
        allocation = state.release(move.job_id)
        state.bind(allocation.job, state.node_index(move.target), move.target_gpus, now_s)


def _units(state: ClusterState, goal: Goal) -> list[tuple[int, int | None]]:
    """(node, GPU or None) to try emptying, cheapest first."""
    units: list[tuple[tuple[int, int], tuple[int, int | None]]] = []
    for node in range(state.size):
        if state.draining[node] or state.is_empty(node):
            continue
        allocations = state.jobs_on(node)
        if goal == "nodes":
            held = sum(len(a.gpus) * a.job.gpu_milli for a in allocations)
            units.append(((len(allocations), held), (node, None)))
            continue
        for gpu in range(int(state.gpu_count[node])):
            used = WHOLE_GPU_MILLI - int(state.gpu_free[node, gpu])
            if 0 < used < WHOLE_GPU_MILLI:
                count = sum(gpu in _gpus_of(a) for a in allocations)
                units.append(((count, used), (node, gpu)))
    units.sort(key=lambda u: u[0])
    return [u[1] for u in units]


def _jobs_in(state: ClusterState, node: int, gpu: int | None) -> list[str]:
    return [a.job.id for a in state.jobs_on(node) if gpu is None or gpu in _gpus_of(a)]


def _gpus_of(allocation: Allocation) -> tuple[int, ...]:
    """The whole or shared GPUs a job holds (a MIG job's indices are its instances)."""
    return () if allocation.job.mig_profile is not None else allocation.gpus


def _evacuate(
    state: ClusterState,
    policy: Policy,
    jobs: list[str],
    node: int,
    gpu: int | None,
    reserved: np.ndarray,
) -> list[Move] | None:
    """Move `jobs` off `node` (or off one GPU of it) inside `state`; None if one cannot go."""
    moves = []
    for job_id in sorted(jobs, key=lambda j: -state.jobs[j].job.gpu_request_milli):
        allocation = state.release(job_id)
        job = allocation.job
        fits = feasible(state, job) & ~state.draining & ~reserved
        if gpu is None:
            fits[node] = False
            targets = np.flatnonzero(fits)
            choice = choose(state, job, targets, policy) if targets.size else None
        else:
            choice = _partly_used_gpu(state, job, fits, (node, gpu))
        if choice is None:
            return None
        target, gpus = choice
        state.bind(job, target, gpus)
        moves.append(
            Move(job_id, state.names[allocation.node], state.names[target], tuple(gpus), "")
        )
    return moves


def _partly_used_gpu(
    state: ClusterState, job: Job, fits: np.ndarray, source: tuple[int, int]
) -> tuple[int, tuple[int, ...]] | None:
    """The fullest partly used GPU (other than `source`) on a fitting node that holds `job`."""
    free = np.where(fits[:, None], state.gpu_free, -1)
    free[source] = -1
    usable = (free >= job.gpu_milli) & (free < WHOLE_GPU_MILLI)
    if not usable.any():
        return None
    slack = np.where(usable, free, WHOLE_GPU_MILLI + 1)
    node, gpu = np.unravel_index(int(np.argmin(slack)), slack.shape)
    return int(node), (int(gpu),)
