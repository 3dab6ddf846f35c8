"""Can this node hold this job? The one set of scheduling predicates.

The engine, the extender's filter, preemption, defragmentation, the scale-up estimate and
the scale-down check all ask here, so a node one of them rules out is ruled out by all.
A node is a candidate when it admits the job (selector, taints, spread rule, not
cordoned) and has the job's CPU, memory and GPUs (model, count or share; for a MIG job,
free instances of its profile) free now.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from scaler.cluster.job import WHOLE_GPU_MILLI, Job
from scaler.cluster.snapshot import ClusterState


def feasible(state: ClusterState, job: Job) -> np.ndarray:
    """Mask of nodes that can hold `job` now, without evicting anything."""
    fits = (state.cpu_free >= job.cpu_milli) & (state.mem_free >= job.memory_mib)
    if job.mig_profile is not None:
        fits &= mig_room(state, job)
    elif job.num_gpu:
        fits &= state.model_mask(job.gpu_models)
        if job.is_sharing:
            fits &= state.max_free >= job.gpu_milli
        else:
            fits &= state.full_free >= job.num_gpu
    return fits & admits(state, job)


def mig_room(state: ClusterState, job: Job) -> np.ndarray:
    """mask[n]: node n has the MIG job's count of free instances of its profile."""
    room = np.zeros(state.size, dtype=bool)
    for n in state.mig:
        room[n] = len(state.mig_free(n, str(job.mig_profile))) >= job.mig_count
    return room


def mig_offered(state: ClusterState, profile: str) -> np.ndarray:
    """offered[n]: how many MIG instances of `profile` node n has, taken or not."""
    offered = np.zeros(state.size, dtype=np.int64)
    for n, layout in state.mig.items():
        offered[n] = sum(inst.profile == profile for inst in layout.instances)
    return offered


def domain_room(state: ClusterState, nodes: np.ndarray) -> np.ndarray:
    """The most idle GPUs within one NVLink domain of each of `nodes` (a node without
    domains: all its idle GPUs; a GPU outside every domain of its node: a domain alone)."""
    room = state.full_free[nodes]
    if state.gpu_domain is None:
        return room
    rows = state.gpu_domain[nodes]
    labelled = (rows >= 0).any(axis=1)
    if not labelled.any():
        return room
    idle = state.gpu_free[nodes] == WHOLE_GPU_MILLI
    best = (idle & (rows < 0)).any(axis=1).astype(np.int64)
    for d in range(int(rows.max()) + 1):
        best = np.maximum(best, (idle & (rows == d)).sum(axis=1))
    return np.where(labelled, best, room)


def admits(state: ClusterState, job: Job) -> np.ndarray:
    """Mask of nodes whose labels, taints, spread rule and cordon let `job` in (resources
    aside)."""
    ok = ~state.cordoned
    if job.node_selector:
        ok &= _memo(
            state,
            ("selects", job.node_selector),
            lambda: [all(lab.get(k) == v for k, v in job.node_selector) for lab in state.labels],
        )
    if state.tainted:
        ok &= _memo(
            state,
            ("tolerates", job.tolerations),
            lambda: [taints <= job.tolerations for taints in state.taints],
        )
    if job.mode == "spread" and job.service in state.service_nodes:
        taken = list(state.service_nodes[job.service])
        ok[taken] = False
    return ok


def _memo(
    state: ClusterState, key: tuple[object, ...], mask: Callable[[], list[bool]]
) -> np.ndarray:
    """A mask of what never changes within a state (its nodes' labels and taints), computed
    once per state and key: asked per job and per node (the extender's filter, the scale-up
    estimate), a list over every node's labels each time was most of a pass at 1,000 nodes."""
    found = state.derived.get(key)
    if found is None:
        found = state.derived[key] = np.asarray(mask(), dtype=bool)
    return found


def never_fits(state: ClusterState, job: Job) -> str | None:
    """A request no node of this cluster could meet even when empty."""
    if job.mig_profile is not None:
        most = int(mig_offered(state, job.mig_profile).max(initial=0))
        if most == 0:
            return f"no node has MIG instances of profile {job.mig_profile}"
        if job.mig_count > most:
            return (
                f"asks {job.mig_count} MIG {job.mig_profile} instances, a node has {most} at most"
            )
    elif job.num_gpu:
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
        ("admit it (selector, taints, spread, cordon)", admits(state, job)),
    ]
    # What the job does not ask narrows nothing; "8 have 0m CPU free" read as 8 full nodes.
    if job.cpu_milli:
        steps.append((f"have {job.cpu_milli}m CPU free", state.cpu_free >= job.cpu_milli))
    if job.memory_mib:
        steps.append((f"have {job.memory_mib} MiB memory free", state.mem_free >= job.memory_mib))
    if job.mig_profile is not None:
        need = f"have {job.mig_count} free MIG {job.mig_profile} instance(s)"
        steps.append((need, mig_room(state, job)))
    elif job.num_gpu:
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


def never_on(
    state: ClusterState, job: Job, n: int, admitted: np.ndarray | None = None
) -> str | None:
    """Why node `n` could never hold `job`, even empty (None: it could). `admitted`:
    `admits(state, job)`, where the caller asks for many nodes."""
    if state.cordoned[n]:
        return "node is cordoned"
    if not (admits(state, job) if admitted is None else admitted)[n]:
        return "node selector, taints or spread rule exclude this node"
    if job.mig_profile is not None:
        offered = int(mig_offered(state, job.mig_profile)[n])
        if offered < job.mig_count:
            return f"node has {offered} MIG {job.mig_profile} instances, job needs {job.mig_count}"
    elif job.num_gpu:
        if not state.model_mask(job.gpu_models)[n]:
            have = state.models[state.model_id[n]] if state.model_id[n] >= 0 else "none"
            wanted = "|".join(sorted(job.gpu_models))
            return f"node has GPU model {have}, job wants {wanted}"
        if state.gpu_count[n] < job.num_gpu:
            return f"node has {state.gpu_count[n]} GPUs, job needs {job.num_gpu}"
    if state.cpu_cap[n] < job.cpu_milli or state.mem_cap[n] < job.memory_mib:
        return "node has less CPU or memory in all than the job asks"
    return None


def full_now(state: ClusterState, job: Job, n: int) -> str:
    """What node `n` lacks for `job` now (it could hold it empty)."""
    if state.cpu_free[n] < job.cpu_milli:
        return f"{state.cpu_free[n]}m CPU free, job needs {job.cpu_milli}m"
    if state.mem_free[n] < job.memory_mib:
        return f"{state.mem_free[n]} MiB memory free, job needs {job.memory_mib} MiB"
    if job.mig_profile is not None:
        free = len(state.mig_free(n, job.mig_profile))
        return f"{free} free MIG {job.mig_profile} instances, job needs {job.mig_count}"
    if job.is_sharing:
        return f"no GPU has {job.gpu_milli}/{WHOLE_GPU_MILLI} free"
    return f"{state.full_free[n]} idle GPUs, job needs {job.num_gpu}"
