"""Gangs: a group of jobs placed all together or not at all (distributed training).

Members are placed one after another on a scratch copy of the state, largest first (the
hardest to fit go while the choice is widest); if any member fits nowhere the whole gang
is unschedulable and the real state is untouched. `commit_gang` binds all members or,
should one bind fail, none.

A gang whose members name a `topology_key` (Kueue's podset-required-topology or
podset-preferred-topology: a node label such as a rack or zone label, or
`kubernetes.io/hostname`) is placed within one value of that label: the domains that have
the free GPU, CPU and memory for all members in all are tried tightest first (least free
GPU, then CPU), as Kueue's topology-aware scheduling fits best, and the first that holds
every member wins. Where none does, a required topology leaves the gang unschedulable
with the reason; a preferred one places it as if it asked nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from scaler.cluster.job import Job
from scaler.cluster.snapshot import ClusterState
from scaler.placement.decision import Placement, Unschedulable
from scaler.placement.engine import place
from scaler.placement.policies.base import Policy

HOSTNAME_LABEL = "kubernetes.io/hostname"  # a node without it is its own domain, by name


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
    asks = {(m.topology_key, m.topology_required) for m in members}
    if len(asks) != 1:
        return Unschedulable(
            members[0].id,
            f"gang {name}: members ask different topologies: {sorted(map(str, asks))}",
        )
    key, required = asks.pop()
    ordered = sorted(members, key=lambda m: (-m.gpu_request_milli, -m.cpu_milli, m.id))
    if key is not None:
        found = _in_one_domain(state, ordered, policy, key)
        if isinstance(found, list):
            return _gang(name, members, found)
        if required:
            return Unschedulable(
                ordered[0].id, f"gang {name} requires one {key}: {found}; nothing was placed"
            )
    placed = _place_all(state, ordered, policy, None)
    if isinstance(placed, Unschedulable):
        return Unschedulable(placed.job_id, f"gang {name}: {placed.reason}; nothing was placed")
    return _gang(name, members, placed)


def _gang(name: str, members: Sequence[Job], placements: list[Placement]) -> GangPlacement:
    by_id = {p.job_id: p for p in placements}
    return GangPlacement(name, tuple(by_id[m.id] for m in members))


def _place_all(
    state: ClusterState, ordered: Sequence[Job], policy: Policy, among: np.ndarray | None
) -> list[Placement] | Unschedulable:
    """Every member placed in turn on a scratch copy (on nodes of `among`, where given)."""
    scratch = state.copy()
    placements: list[Placement] = []
    for member in ordered:
        decision = place(scratch, member, policy, among)
        if isinstance(decision, Unschedulable):
            return Unschedulable(
                member.id,
                f"member {member.id} does not fit once {len(placements)} of "
                f"{len(ordered)} are placed ({decision.reason})",
            )
        scratch.bind(member, decision.node_index, decision.gpus)
        placements.append(decision)
    return placements


def _in_one_domain(
    state: ClusterState, ordered: Sequence[Job], policy: Policy, key: str
) -> list[Placement] | str:
    """The members placed within one value of node label `key`, or why no value holds them."""
    domains: dict[str, list[int]] = {}
    for n, labels in enumerate(state.labels):
        value = labels.get(key) or (state.names[n] if key == HOSTNAME_LABEL else None)
        if value is not None:
            domains.setdefault(value, []).append(n)
    if not domains:
        return f"no node has the label {key}"
    need = (
        sum(m.gpu_request_milli for m in ordered),
        sum(m.cpu_milli for m in ordered),
        sum(m.memory_mib for m in ordered),
    )
    roomy: list[tuple[tuple[int, int, int], str, np.ndarray]] = []
    for value, nodes in domains.items():
        at = np.array(nodes)
        free = (int(state.gpu_free[at].sum()), int(state.cpu_free[at].sum()))
        mem = int(state.mem_free[at].sum())
        if free[0] >= need[0] and free[1] >= need[1] and mem >= need[2]:
            roomy.append(((*free, mem), value, at))
    if not roomy:
        return f"none of its {len(domains)} {key} values has the free GPU, CPU and memory in all"
    first = ""
    for _, value, at in sorted(roomy, key=lambda d: (d[0], d[1])):
        placed = _place_all(state, ordered, policy, at)
        if isinstance(placed, list):
            return placed
        first = first or f"{key}={value}: {placed.reason}"
    return (
        f"of its {len(domains)} {key} values, {len(roomy)} have the room in all but none"
        f" holds every member (tightest, {first})"
    )


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
