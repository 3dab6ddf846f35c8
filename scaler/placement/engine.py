"""The placement decision: which node and GPUs a job gets, as a pure function of state and job.

`candidates` filters the nodes that can hold the job (CPU, memory, GPU model, GPU count or
share or MIG instances, node selector, taints, spread, cordon) and steers away from
draining nodes while others fit; then, where nodes say so, a multi-GPU job toward nodes
that hold it within one NVLink / NVSwitch domain, and every job toward racks already in
use, so whole domains and racks stay free for the large jobs (a node or rack without
topology labels is never steered away from). `choose` picks among them: the policy (which
breaks its ties by GPU price first, `scaler.placement.price`), or for a MIG job the slice
fragmentation (`scaler.placement.mig`); `place` is both, and its placement says in words
why that node (`Placement.explanation`). The kube-scheduler extender ranks with the same
`candidates`, so its top node is `place`'s. Neither changes the state: the caller commits
a placement with `ClusterState.bind` (see `commit`). When nothing fits, the answer says
which constraint ruled the nodes out, so an operator can act on it.
"""

from __future__ import annotations

import numpy as np

from scaler.cluster.job import Job
from scaler.cluster.predicates import domain_room, explain, feasible, never_fits
from scaler.cluster.snapshot import ClusterState
from scaler.placement.decision import Placement, Unschedulable
from scaler.placement.mig import choose_instances
from scaler.placement.policies.base import Choice, Policy
from scaler.placement.price import explain_choice


def candidates(state: ClusterState, job: Job, among: np.ndarray | None = None) -> np.ndarray:
    """The node indices a policy chooses among for `job`: those that can take it now (of
    `among`, where given), only the non-draining ones while any of them fit."""
    fits = feasible(state, job)
    if among is not None:
        allowed = np.zeros(state.size, dtype=bool)
        allowed[among] = True
        fits &= allowed
    nodes = np.flatnonzero(fits)
    staying = nodes[~state.draining[nodes]]
    nodes = staying if staying.size else nodes
    if state.gpu_domain is not None and job.num_gpu > 1 and nodes.size:
        within = nodes[domain_room(state, nodes) >= job.num_gpu]
        nodes = within if within.size else nodes
    if state.rack_id is not None and state.rack_jobs is not None and nodes.size:
        rack = state.rack_id[nodes]
        used = nodes[(rack < 0) | (state.rack_jobs[np.maximum(rack, 0)] > 0)]
        nodes = used if used.size else nodes
    return nodes


def choose(state: ClusterState, job: Job, nodes: np.ndarray, policy: Policy) -> Choice:
    """The node of `nodes` (non-empty, all can hold `job`) and the GPUs (a MIG job: the
    instances) it gets."""
    if job.mig_profile is not None:
        return choose_instances(state, job, nodes, policy.rank(state.size))
    return policy.choose(state, job, nodes)


def place(
    state: ClusterState, job: Job, policy: Policy, among: np.ndarray | None = None
) -> Placement | Unschedulable:
    """Choose a node (of `among`, where given) and GPUs for `job`, or say why none can
    take it now."""
    problem = job.problem() or never_fits(state, job)
    if problem:
        return Unschedulable(job.id, problem)
    nodes = candidates(state, job, among)
    if nodes.size == 0:
        return Unschedulable(job.id, explain(state, job))
    node, gpus = choose(state, job, nodes, policy)
    why = explain_choice(state, job, node, nodes, policy)
    return Placement(job.id, state.names[node], node, gpus, policy.name, explanation=why)


def commit(state: ClusterState, job: Job, placement: Placement, now_s: float = 0.0) -> None:
    """Apply a placement: evict its victims, then bind the job."""
    for victim in placement.evict:
        state.release(victim)
    state.bind(job, placement.node_index, placement.gpus, now_s)
