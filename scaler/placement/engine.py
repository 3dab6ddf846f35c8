"""The placement decision: which node and GPUs a job gets, as a pure function of state and job.

`place` filters the nodes that can hold the job (CPU, memory, GPU model, GPU count or
share, node selector, taints, spread), steers away from draining nodes while others fit,
and lets the policy choose among the rest. It never changes the state: the caller commits
a placement with `ClusterState.bind` (see `commit`). When nothing fits, the answer says
which constraint ruled the nodes out, so an operator can act on it.
"""

from __future__ import annotations

import numpy as np

from scaler.cluster.job import WHOLE_GPU_MILLI, Job
from scaler.cluster.snapshot import ClusterState
from scaler.placement.decision import Placement, Unschedulable
from scaler.placement.policies.base import Policy


def place(state: ClusterState, job: Job, policy: Policy) -> Placement | Unschedulable:
    """Choose a node and GPUs for `job`, or say why none can take it now."""
    problem = job.problem() or _never_fits(state, job)
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


def feasible(state: ClusterState, job: Job) -> np.ndarray:
    """Mask of nodes that can hold `job` now, without evicting anything."""
    fits = (state.cpu_free >= job.cpu_milli) & (state.mem_free >= job.memory_mib)
    if job.num_gpu:
        fits &= state.model_mask(job.gpu_models)
        if job.is_sharing:
            fits &= state.max_free >= job.gpu_milli
        else:
            fits &= state.full_free >= job.num_gpu
    return fits & admits(state, job)


def admits(state: ClusterState, job: Job) -> np.ndarray:
    """Mask of nodes whose labels, taints and spread rule let `job` in (resources aside)."""
    ok = np.ones(state.size, dtype=bool)
    if job.node_selector:
        ok &= [all(lab.get(k) == v for k, v in job.node_selector) for lab in state.labels]
    if state.tainted:
        ok &= [taints <= job.tolerations for taints in state.taints]
    if job.mode == "spread" and job.service in state.service_nodes:
        taken = list(state.service_nodes[job.service])
        ok[taken] = False
    return ok


def _never_fits(state: ClusterState, job: Job) -> str | None:
    """A request no node of this cluster could meet even when empty."""
    if job.num_gpu:
        if job.gpu_models and not set(job.gpu_models) & set(state.models):
            have = ", ".join(state.models) or "none"
            wanted = "|".join(sorted(job.gpu_models))
            return f"no node has GPU model {wanted} (the cluster has: {have})"
        most = int(state.gpu_count[state.model_mask(job.gpu_models)].max(initial=0))
        if job.num_gpu > most:
            return f"asks {job.num_gpu} GPUs but the largest allowed node has {most}"
    if job.cpu_milli > state.cpu_cap.max() or job.memory_mib > state.mem_cap.max():
        return "asks more CPU or memory than the largest node has"
    return None


def explain(state: ClusterState, job: Job) -> str:
    """Which constraint left no node, as counts narrowing down from all nodes."""
    steps: list[tuple[str, np.ndarray]] = [
        ("admit it (selector, taints, spread)", admits(state, job)),
        (f"have {job.cpu_milli}m CPU free", state.cpu_free >= job.cpu_milli),
        (f"have {job.memory_mib} MiB memory free", state.mem_free >= job.memory_mib),
    ]
    if job.num_gpu:
        steps.append(("have an allowed GPU model", state.model_mask(job.gpu_models)))
        if job.is_sharing:
            need = f"have a GPU with {job.gpu_milli}/{WHOLE_GPU_MILLI} free"
            steps.append((need, state.max_free >= job.gpu_milli))
        else:
            steps.append((f"have {job.num_gpu} idle GPUs", state.full_free >= job.num_gpu))
    left = np.ones(state.size, dtype=bool)
    parts = []
    for label, mask in steps:
        left &= mask
        parts.append(f"{int(left.sum())} {label}")
        if not left.any():
            break
    return f"no node fits now: of {state.size} nodes, " + ", then ".join(parts)
