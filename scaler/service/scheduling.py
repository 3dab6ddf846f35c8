"""The kube-scheduler extender over the placement engine: pods become jobs, nodes become
node specs (`scaler.kube.objects`), and filter / prioritize / bind answer with the engine's
own decisions.

- filter: a node passes when the engine finds it feasible for the pod now. A node that
  could never hold the pod (selector or taints, GPU model, too few GPUs or CPU or memory
  in all) is reported as unresolvable, so the scheduler does not try preemption there;
  one that is only full now is a plain failure.
- prioritize: the engine's policy ranks the candidates the way `place` would choose among
  them (`engine.candidates`: feasible, non-draining while any fit): its first choice
  scores 10 (MaxExtenderPriority), the next 9, ... and the rest 0, so the scheduler's top
  node is the engine's placement.
- bind: the engine chooses the GPU indices on the node the scheduler picked.

Everything here is a pure function of a `ClusterState`, a job and the policy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from scaler.cluster.predicates import admits, feasible, full_now, never_on
from scaler.placement import ClusterState, Job, Placement, Policy, Unschedulable
from scaler.placement.engine import candidates as engine_candidates
from scaler.placement.engine import choose

MAX_EXTENDER_PRIORITY = 10


@dataclass(frozen=True)
class FilterResult:
    passing: list[str]
    failed: dict[str, str]
    unresolvable: dict[str, str]


def filter_nodes(state: ClusterState, job: Job, candidates: Sequence[str]) -> FilterResult:
    """Split the candidates into those that can take the job now and those that cannot,
    with why; names the state does not know fail."""
    index = {name: i for i, name in enumerate(state.names)}
    problem = job.problem()
    passing: list[str] = []
    failed: dict[str, str] = {}
    unresolvable: dict[str, str] = {}
    if problem is not None:
        why = f"the pod's request is malformed: {problem}"
        return FilterResult([], {}, dict.fromkeys(candidates, why))
    fits = feasible(state, job)
    known = [(name, index.get(name)) for name in candidates]
    bad = [n for _, n in known if n is not None and not fits[n]]
    reasons = dict(zip(bad, why_not(state, job, bad), strict=True))
    for name, n in known:
        if n is None:
            failed[name] = "node unknown to gpuscale"
        elif fits[n]:
            passing.append(name)
        else:
            never, why = reasons[n]
            (unresolvable if never else failed)[name] = why
    return FilterResult(passing, failed, unresolvable)


def why_not(state: ClusterState, job: Job, nodes: Sequence[int]) -> list[tuple[bool, str]]:
    """(never, why) for each of `nodes` that cannot take `job` now: `never_on`'s reason
    where it could never hold it, else `full_now`'s. The same reasons, read off whole-
    cluster masks once rather than node by node (the filter at 5,000 candidates)."""
    if job.mig_profile is not None:  # per node: instance counts differ by layout
        admitted = admits(state, job)
        out = []
        for n in nodes:
            never = never_on(state, job, n, admitted)
            out.append((True, never) if never else (False, full_now(state, job, n)))
        return out
    admitted = admits(state, job).tolist()
    cordoned = state.cordoned.tolist()
    small = ((state.cpu_cap < job.cpu_milli) | (state.mem_cap < job.memory_mib)).tolist()
    model_ok = state.model_mask(job.gpu_models).tolist() if job.num_gpu else None
    wanted = "|".join(sorted(job.gpu_models))
    out: list[tuple[bool, str]] = []
    for n in nodes:
        if cordoned[n]:
            out.append((True, "node is cordoned"))
        elif not admitted[n]:
            out.append((True, "node selector, taints or spread rule exclude this node"))
        elif model_ok is not None and not model_ok[n]:
            have = state.models[state.model_id[n]] if state.model_id[n] >= 0 else "none"
            out.append((True, f"node has GPU model {have}, job wants {wanted}"))
        elif job.num_gpu and state.gpu_count[n] < job.num_gpu:
            out.append((True, f"node has {state.gpu_count[n]} GPUs, job needs {job.num_gpu}"))
        elif small[n]:
            out.append((True, "node has less CPU or memory in all than the job asks"))
        else:
            out.append((False, full_now(state, job, n)))
    return out


def rank(
    state: ClusterState, job: Job, policy: Policy, candidates: Sequence[str]
) -> list[tuple[str, int]]:
    """Scores 0..10 for the candidates: the policy's choice among the engine's candidates
    (`engine.candidates`, those `place` chooses among) first, then its choice among the
    rest, and so on for the top ten; once the non-draining ones are ranked, the draining
    ones follow."""
    index = {name: i for i, name in enumerate(state.names)}
    scores = dict.fromkeys(candidates, 0)
    if job.problem() is not None:
        return list(scores.items())
    unranked = np.array(sorted({index[c] for c in candidates if c in index}), dtype=np.int64)
    pool = engine_candidates(state, job, unranked)
    for score in range(MAX_EXTENDER_PRIORITY, 0, -1):
        if pool.size == 0:
            pool = engine_candidates(state, job, unranked)
            if pool.size == 0:
                break
        node, _ = choose(state, job, pool, policy)
        scores[state.names[node]] = score
        pool, unranked = pool[pool != node], unranked[unranked != node]
    return list(scores.items())


def place_on(state: ClusterState, job: Job, policy: Policy, node: str) -> Placement | Unschedulable:
    """The GPUs the policy gives `job` on `node` (the node the scheduler chose)."""
    if job.problem() is not None:
        return Unschedulable(job.id, job.problem() or "")
    if node not in state.names:
        return Unschedulable(job.id, f"node {node} is unknown to gpuscale")
    n = state.names.index(node)
    if not feasible(state, job)[n]:
        return Unschedulable(job.id, never_on(state, job, n) or full_now(state, job, n))
    chosen, gpus = choose(state, job, np.array([n]), policy)
    return Placement(job.id, node, chosen, gpus, policy.name)
