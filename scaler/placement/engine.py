"""The placement decision: which node and GPUs a job gets, as a pure function of state and job.

`candidates` filters the nodes that can hold the job (CPU, memory, GPU model, GPU count or
share, node selector, taints, spread, cordon) and steers away from draining nodes while
others fit; `place` lets the policy choose among them. The kube-scheduler extender ranks
with the same `candidates`, so its top node is `place`'s. Neither changes the state: the
caller commits a placement with `ClusterState.bind` (see `commit`). When nothing fits, the
answer says which constraint ruled the nodes out, so an operator can act on it.
"""

from __future__ import annotations

import numpy as np

from scaler.cluster.job import Job
from scaler.cluster.predicates import explain, feasible, never_fits
from scaler.cluster.snapshot import ClusterState
from scaler.placement.decision import Placement, Unschedulable
from scaler.placement.policies.base import Policy


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
    return staying if staying.size else nodes


def place(state: ClusterState, job: Job, policy: Policy) -> Placement | Unschedulable:
    """Choose a node and GPUs for `job`, or say why none can take it now."""
    problem = job.problem() or never_fits(state, job)
    if problem:
        return Unschedulable(job.id, problem)
    nodes = candidates(state, job)
    if nodes.size == 0:
        return Unschedulable(job.id, explain(state, job))
    node, gpus = policy.choose(state, job, nodes)
    return Placement(job.id, state.names[node], node, gpus, policy.name)


def commit(state: ClusterState, job: Job, placement: Placement, now_s: float = 0.0) -> None:
    """Apply a placement: evict its victims, then bind the job."""
    for victim in placement.evict:
        state.release(victim)
    state.bind(job, placement.node_index, placement.gpus, now_s)
