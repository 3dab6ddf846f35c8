"""Preemption: make room for a job by evicting lower-priority ones, only when it fits nowhere.

A job may evict jobs of strictly lower priority; a placeholder (capacity held ahead of
demand) may be evicted by any real job. Among all nodes the cheapest victim set wins,
compared in this order:

1. fewest real victims (evicting a placeholder costs nothing: that is what it is for),
2. lowest highest-priority among the real victims,
3. least work lost (GPU-seconds the real victims have run),
4. fewest placeholders.

On each node the set is built greedily in that preference order until the job fits, then
every victim that turns out unnecessary is put back, so no set is larger than it must be.
"""

from __future__ import annotations

import numpy as np

from scaler.cluster.job import WHOLE_GPU_MILLI, Job
from scaler.cluster.predicates import admits, mig_offered
from scaler.cluster.snapshot import Allocation, ClusterState
from scaler.placement.decision import Placement, Unschedulable
from scaler.placement.engine import choose, place
from scaler.placement.policies.base import Policy

Cost = tuple[int, int, float, int]


def preempt(
    state: ClusterState, job: Job, policy: Policy, now_s: float = 0.0
) -> Placement | Unschedulable:
    """Place `job`; if no node can take it as things stand, evict the cheapest victims."""
    direct = place(state, job, policy)
    if isinstance(direct, Placement) or job.problem() is not None:
        return direct
    best: tuple[Cost, int, list[Allocation]] | None = None
    allowed = admits(state, job)
    if job.mig_profile is not None:
        allowed &= mig_offered(state, job.mig_profile) >= job.mig_count
    elif job.num_gpu:
        allowed &= state.model_mask(job.gpu_models)
    for node in np.flatnonzero(allowed):
        victims = _victims_on(state, job, int(node), now_s)
        if victims is None:
            continue
        cost = _cost(victims, now_s)
        if best is None or cost < best[0]:
            best = (cost, int(node), victims)
    if best is None:
        return Unschedulable(
            job.id, f"{direct.reason}; evicting lower-priority jobs would not make room either"
        )
    _, node, victims = best
    scratch = state.copy()
    for victim in victims:
        scratch.release(victim.job.id)
    _, gpus = choose(scratch, job, np.array([node]), policy)
    return Placement(
        job.id,
        state.names[node],
        node,
        gpus,
        policy.name,
        evict=tuple(v.job.id for v in victims),
    )


def can_evict(job: Job, victim: Job) -> bool:
    if job.placeholder:
        return False
    return victim.placeholder or victim.priority < job.priority


def _preference(victim: Allocation, now_s: float) -> tuple[bool, int, float]:
    return (not victim.job.placeholder, victim.job.priority, victim.gpu_seconds(now_s))


def _cost(victims: list[Allocation], now_s: float) -> Cost:
    real = [v for v in victims if not v.job.placeholder]
    return (
        len(real),
        max((v.job.priority for v in real), default=-(2**62)),
        sum(v.gpu_seconds(now_s) for v in real),
        len(victims) - len(real),
    )


def _victims_on(state: ClusterState, job: Job, node: int, now_s: float) -> list[Allocation] | None:
    """The smallest cheap set of evictable jobs on `node` after which `job` fits, or None."""
    evictable = sorted(
        (a for a in state.jobs_on(node) if can_evict(job, a.job)),
        key=lambda a: _preference(a, now_s),
    )
    chosen: list[Allocation] = []
    for victim in evictable:
        if _fits_without(state, job, node, chosen):
            break
        chosen.append(victim)
    if not _fits_without(state, job, node, chosen):
        return None
    for victim in reversed(list(chosen)):
        rest = [v for v in chosen if v is not victim]
        if _fits_without(state, job, node, rest):
            chosen = rest
    return chosen


def _fits_without(state: ClusterState, job: Job, node: int, victims: list[Allocation]) -> bool:
    cpu = state.cpu_free[node] + sum(v.job.cpu_milli for v in victims)
    mem = state.mem_free[node] + sum(v.job.memory_mib for v in victims)
    if cpu < job.cpu_milli or mem < job.memory_mib:
        return False
    if job.mig_profile is not None:
        freed = sum(len(v.gpus) for v in victims if v.job.mig_profile == job.mig_profile)
        return len(state.mig_free(node, job.mig_profile)) + freed >= job.mig_count
    if not job.num_gpu:
        return True
    free = state.gpu_free[node, : state.gpu_count[node]].copy()
    for v in victims:
        if v.job.mig_profile is None:  # a MIG job's indices are instances, not GPUs
            free[list(v.gpus)] += v.job.gpu_milli
    if job.is_sharing:
        return bool((free >= job.gpu_milli).any())
    return int((free == WHOLE_GPU_MILLI).sum()) >= job.num_gpu
