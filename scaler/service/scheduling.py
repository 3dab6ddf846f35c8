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
    fits = feasible(state, job) if problem is None else np.zeros(state.size, dtype=bool)
    admitted = admits(state, job)  # once, not once per node that fails
    passing: list[str] = []
    failed: dict[str, str] = {}
    unresolvable: dict[str, str] = {}
    for name in candidates:
        n = index.get(name)
        if problem is not None:
            unresolvable[name] = f"the pod's request is malformed: {problem}"
        elif n is None:
            failed[name] = "node unknown to gpuscale"
        elif fits[n]:
            passing.append(name)
        else:
            never = never_on(state, job, n, admitted)
            if never:
                unresolvable[name] = never
            else:
                failed[name] = full_now(state, job, n)
    return FilterResult(passing, failed, unresolvable)


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
