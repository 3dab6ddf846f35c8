"""The placement decision: which node and GPUs a job gets, as a pure function of state and job.

`place` filters the nodes that can hold the job (CPU, memory, GPU model, GPU count or
share, node selector, taints, spread), steers away from draining nodes while others fit,
and lets the policy choose among the rest. It never changes the state: the caller commits
a placement with `ClusterState.bind` (see `commit`). When nothing fits, the answer says
which constraint ruled the nodes out, so an operator can act on it.
"""

from __future__ import annotations

import numpy as np

from scaler.cluster.job import Job
from scaler.cluster.predicates import explain, feasible, never_fits
from scaler.cluster.snapshot import ClusterState
from scaler.placement.decision import Placement, Unschedulable
from scaler.placement.policies.base import Policy


def place(state: ClusterState, job: Job, policy: Policy) -> Placement | Unschedulable:
    """Choose a node and GPUs for `job`, or say why none can take it now."""
    problem = job.problem() or never_fits(state, job)
    if problem:
        return Unschedulable(job.id, problem)
    fits = feasible(state, job)
    nodes = np.flatnonzero(fits)
    if nodes.size == 0:
        return Unschedulable(job.id, explain(state, job))
    staying = nodes[~state.draining[nodes]]
    if staying.size:
        nodes = staying
    node, gpus = policy.choose(state, job, nodes)
    return Placement(job.id, state.names[node], node, gpus, policy.name)


def commit(state: ClusterState, job: Job, placement: Placement, now_s: float = 0.0) -> None:
    """Apply a placement: evict its victims, then bind the job."""
    for victim in placement.evict:
        state.release(victim)
    state.bind(job, placement.node_index, placement.gpus, now_s)
