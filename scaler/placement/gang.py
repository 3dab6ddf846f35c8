"""Gangs: a group of jobs placed all together or not at all (distributed training).

Members are placed one after another on a scratch copy of the state, largest first (the
hardest to fit go while the choice is widest); if any member fits nowhere the whole gang
is unschedulable and the real state is untouched. `commit_gang` binds all members or,
should one bind fail, none.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from scaler.cluster.job import Job
from scaler.cluster.snapshot import ClusterState
from scaler.placement.decision import Placement, Unschedulable
from scaler.placement.engine import place
from scaler.placement.policies.base import Policy


@dataclass(frozen=True, slots=True)
class GangPlacement:
    gang: str
    placements: tuple[Placement, ...]


def place_gang(
    state: ClusterState, members: Sequence[Job], policy: Policy
) -> GangPlacement | Unschedulable:
    """Placements for every member, or the reason the gang cannot start now."""
    if not members:
        raise ValueError("a gang needs at least one member")
    gangs = {m.gang for m in members}
    name = str(next(iter(gangs)))
    if len(gangs) != 1 or None in gangs:
        return Unschedulable(
            members[0].id, f"members name different gangs: {sorted(map(str, gangs))}"
        )
    scratch = state.copy()
    placements: list[Placement] = []
    ordered = sorted(members, key=lambda m: (-m.gpu_request_milli, -m.cpu_milli, m.id))
    for member in ordered:
        decision = place(scratch, member, policy)
        if isinstance(decision, Unschedulable):
            return Unschedulable(
                member.id,
                f"gang {name}: member {member.id} does not fit once {len(placements)} of "
                f"{len(members)} are placed ({decision.reason}); nothing was placed",
            )
        scratch.bind(member, decision.node_index, decision.gpus)
        placements.append(decision)
    by_id = {p.job_id: p for p in placements}
    return GangPlacement(name, tuple(by_id[m.id] for m in members))


def commit_gang(
    state: ClusterState, members: Sequence[Job], gang: GangPlacement, now_s: float = 0.0
) -> None:
    """Bind every member as placed; if one cannot be bound, undo the others and raise."""
    jobs = {m.id: m for m in members}
    bound: list[str] = []
    try:
        for p in gang.placements:
            state.bind(jobs[p.job_id], p.node_index, p.gpus, now_s)
            bound.append(p.job_id)
    except ValueError:
        for job_id in reversed(bound):
            state.release(job_id)
        raise
