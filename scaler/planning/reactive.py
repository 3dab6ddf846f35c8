"""Reactive demand: what Cluster Autoscaler would ask for now, on the one cluster model.

A pool needs the ready nodes that run real work plus the booting and new nodes its pending
jobs pack onto (`placement.estimator`). The live loop (pending pods) and the job simulator
(its queue) both turn that into the planner's reactive outlooks here, so "reactive" means
the same in both; the predictive plan takes it as a floor, since a job waiting now needs
capacity whatever the forecast said. Where the planner sizes a job-level spare on the
nodes jobs ask for (`planning.request_log`, `GroupNeed.spare_nodes`), both hold it on top
of reactive demand (`ReactiveDemand.with_spare`), as Cluster Autoscaler provisions a
`CapacityBuffer`'s replicas on top of the pending pods.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from scaler.cluster.job import Job
from scaler.cluster.pools import NodePool
from scaler.cluster.snapshot import ClusterState
from scaler.cluster.templates import POOL_LABEL
from scaler.placement.estimator import ScaleUpEstimate, estimate_scale_up
from scaler.placement.policies.base import Policy
from scaler.planning.planner import (
    CapacityPlan,
    DemandOutlook,
    FleetCapacity,
    PlannerMemory,
    PlannerPolicy,
    plan,
)


@dataclass(frozen=True)
class ReactiveDemand:
    nodes: Mapping[str, int]  # nodes each pool needs now
    estimate: ScaleUpEstimate

    def outlooks(self, pools: Sequence[NodePool]) -> tuple[DemandOutlook, ...]:
        """One outlook per pool, served by that pool's GPU model only."""
        return tuple(
            DemandOutlook(
                p.name,
                float(self.nodes.get(p.name, 0) * p.gpus_per_node),
                gpu_models=frozenset({p.gpu_model}),
            )
            for p in pools
        )

    def with_spare(self, spare: Mapping[str, int]) -> ReactiveDemand:
        """This demand with `spare` nodes per pool on top (pools not named: none)."""
        return ReactiveDemand(
            {pool: n + spare.get(pool, 0) for pool, n in self.nodes.items()}, self.estimate
        )

    def rises(self, before: Mapping[str, int]) -> dict[str, int]:
        """The nodes each pool's demand rose by since `before` (pools seen then only): the
        whole nodes jobs asked for in between, a gang all at once, which the planner sizes
        job-level spare on (`planning.job_spare`)."""
        return {
            pool: nodes - before[pool]
            for pool, nodes in self.nodes.items()
            if pool in before and nodes > before[pool]
        }


def busy_nodes(
    state: ClusterState | None, also: Sequence[str] = (), pool_label: str = POOL_LABEL
) -> dict[str, int]:
    """Ready nodes per pool that run at least one real (non-placeholder) job, or are named
    in `also` (nodes pending jobs are about to take)."""
    counts: dict[str, int] = {}
    if state is None:
        return counts
    taken = set(also)
    for n in range(state.size):
        real = any(not state.jobs[j].job.placeholder for j in state.node_jobs[n])
        if real or state.names[n] in taken:
            pool = state.labels[n].get(pool_label)
            if pool is not None:
                counts[pool] = counts.get(pool, 0) + 1
    return counts


def reactive_demand(
    state: ClusterState | None,
    pending: Sequence[Job],
    pools: Sequence[NodePool],
    policy: Policy,
    *,
    booting: Mapping[str, int],
    current: Mapping[str, int],
    pool_label: str = POOL_LABEL,
) -> ReactiveDemand:
    """Nodes per pool: ready nodes that run real jobs or take a pending one, plus the
    booting and new nodes the other pending jobs need."""
    real = [j for j in pending if not j.placeholder]
    estimate = estimate_scale_up(
        state, real, pools, policy, booting=booting, current=current, pool_label=pool_label
    )
    busy = busy_nodes(state, estimate.existing_nodes, pool_label)
    nodes = {p.name: busy.get(p.name, 0) + estimate.pools[p.name].nodes_used for p in pools}
    return ReactiveDemand(nodes, estimate)


@dataclass(frozen=True)
class ReactiveFloor:
    """What the pending jobs need now, the reactive plan made of it (with the job-level
    spare on top), and the floor it puts under a predictive plan's sizes."""

    demand: ReactiveDemand
    plan: CapacityPlan
    floor: Mapping[str, int]  # pools the pending jobs or the spare make grow or keep
    spare: Mapping[str, int] = field(default_factory=dict)  # job-level spare nodes held

    def to_dict(self) -> dict[str, object]:
        return {
            "nodes": dict(self.demand.nodes),
            "estimate": self.demand.estimate.to_dict(),
            "spare_nodes": dict(self.spare),
            "floor": dict(self.floor),
        }


def reactive_floor(
    demand: ReactiveDemand,
    fleet: FleetCapacity,
    pools: Sequence[NodePool],
    policy: PlannerPolicy,
    memory: PlannerMemory | None = None,
    spare: Mapping[str, int] | None = None,
) -> ReactiveFloor:
    """The sizes the pending jobs need at least: the planner in reactive mode, never
    scaling down, on `demand` plus the job-level `spare` nodes per pool. Pools it grows get
    a floor; where the pending jobs fit the fleet, the floor would be today's size and keep
    the plan from ever removing an idle node, so only a pool that holds a spare gets one
    there, its demand plus spare: the idle nodes beyond that may go, the spare stays."""
    spare = dict(spare or {})
    held = demand.with_spare(spare)
    reactive = policy.model_copy(update={"mode": "reactive", "scale_down_enabled": False})
    planned = plan(held.outlooks(pools), fleet, pools, reactive, memory)
    floor = {
        d.pool: d.desired if d.action == "scale_up" else min(d.desired, held.nodes.get(d.pool, 0))
        for d in planned.decisions
        if d.action == "scale_up" or spare.get(d.pool, 0) > 0
    }
    return ReactiveFloor(demand, planned, floor, spare)


def with_floor(desired: Mapping[str, int], floor: Mapping[str, int]) -> dict[str, int]:
    """The larger of a plan's size and the reactive floor, per pool."""
    return {pool: max(size, floor.get(pool, 0)) for pool, size in desired.items()}
