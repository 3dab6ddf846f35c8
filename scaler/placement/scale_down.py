"""The scale-down check: could this node's work go elsewhere? (Cluster Autoscaler's rule.)

A candidate node is removable when every job on it, placeholders aside (they only hold
capacity and are deleted with the node), can be placed on some other node that stays;
placeholders elsewhere do not stand in the way, since real jobs preempt them. The
candidates are tried in the order given on one scratch copy of the cluster: a node found
removable is cordoned there and its jobs are bound where they would go, so two removals
never count on the same free room and a later candidate carries what moved onto it.
The real state is not changed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from scaler.cluster.snapshot import ClusterState
from scaler.placement.decision import Unschedulable
from scaler.placement.engine import place
from scaler.placement.policies.base import Policy


@dataclass(frozen=True, slots=True)
class RemovalCheck:
    """Whether node `node` may go; `moves` says where each of its jobs would run."""

    node: str
    removable: bool
    reason: str
    moves: tuple[tuple[str, str], ...] = ()


def check_removals(
    state: ClusterState, candidates: Sequence[int], policy: Policy
) -> list[RemovalCheck]:
    """One check per candidate node index, in order (see the module docstring)."""
    scratch = state.copy()
    for job_id in [j for j, a in scratch.jobs.items() if a.job.placeholder]:
        scratch.release(job_id)  # real jobs preempt placeholders: their room counts as free
    checks = []
    for node in candidates:
        trial = scratch.copy()
        trial.set_cordoned([node])
        moves: list[tuple[str, str]] = []
        blocked = None
        for allocation in sorted(
            trial.jobs_on(node), key=lambda a: (-a.job.gpu_request_milli, a.job.id)
        ):
            trial.release(allocation.job.id)
            decided = place(trial, allocation.job, policy)
            if isinstance(decided, Unschedulable):
                blocked = f"job {allocation.job.id} fits no other node ({decided.reason})"
                break
            trial.bind(allocation.job, decided.node_index, decided.gpus, allocation.since_s)
            moves.append((allocation.job.id, decided.node))
        name = state.names[node]
        if blocked is not None:
            checks.append(RemovalCheck(name, False, blocked))
            continue
        scratch = trial
        why = f"its {len(moves)} job(s) fit elsewhere" if moves else "runs no job"
        checks.append(RemovalCheck(name, True, why, tuple(moves)))
    return checks
