"""The scale-up estimate: how many new nodes of each pool the pending jobs need.

Cluster Autoscaler's binpacking estimator, on our engine. Pending jobs (whole or shared
GPUs; gangs all or nothing) first try the nodes that exist and the nodes already booting;
the rest go, largest first, to the cheapest pool (price per GPU) whose node template can
hold them, and are packed there onto empty template nodes by the same placement policy
that places real jobs. A new node is opened only when a job fits none of those opened so
far, and never past the pool's `max_size`. The live loop (pending pods from Kubernetes)
and the job simulator (its queue) both call this; the planner takes the result as its
reactive floor.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from scaler.cluster.job import Job
from scaler.cluster.pools import NodePool
from scaler.cluster.predicates import never_fits
from scaler.cluster.snapshot import ClusterState
from scaler.cluster.templates import POOL_LABEL, template_node
from scaler.placement.decision import Unschedulable
from scaler.placement.engine import place
from scaler.placement.gang import place_gang
from scaler.placement.policies.base import Policy


@dataclass(frozen=True, slots=True)
class PoolEstimate:
    """`new_nodes` empty nodes of `pool`, beyond those booting, hold `jobs`; `nodes_used`
    counts the booting and new nodes that hold at least one of them."""

    pool: str
    new_nodes: int = 0
    jobs: tuple[str, ...] = ()
    nodes_used: int = 0


@dataclass(frozen=True)
class ScaleUpEstimate:
    pools: Mapping[str, PoolEstimate]
    on_existing: tuple[str, ...] = ()  # pending jobs that fit a node of the given state
    existing_nodes: tuple[str, ...] = ()  # the nodes of the given state they would go to
    unplaceable: Mapping[str, str] = field(default_factory=dict)  # job -> why no pool fits

    def new_nodes(self, pool: str) -> int:
        found = self.pools.get(pool)
        return found.new_nodes if found is not None else 0

    def to_dict(self) -> dict[str, object]:
        return {
            "new_nodes": {name: p.new_nodes for name, p in self.pools.items()},
            "on_existing": len(self.on_existing),
            "unplaceable": dict(self.unplaceable),
        }


def units(pending: Sequence[Job]) -> list[tuple[Job, ...]]:
    """Pending jobs as scheduling units: a gang's members together, others alone;
    largest first (GPU request, then CPU), as Cluster Autoscaler packs."""
    gangs: dict[str, list[Job]] = {}
    out: list[tuple[Job, ...]] = []
    for job in pending:
        if job.gang is None:
            out.append((job,))
        else:
            gangs.setdefault(job.gang, []).append(job)
    out.extend(tuple(members) for members in gangs.values())
    return sorted(out, key=lambda u: (-sum(j.gpu_request_milli for j in u), -u[0].cpu_milli))


def job_shape(job: Job) -> tuple[object, ...]:
    """What decides where `job` fits (not its id, priority, submission or predicted run
    time): jobs of one shape fit the same nodes."""
    return (
        job.cpu_milli,
        job.memory_mib,
        job.num_gpu,
        job.gpu_milli,
        job.gpu_models,
        job.qos,
        job.gang,
        job.mode,
        job.service,
        job.node_selector,
        job.tolerations,
        job.mig_profile,
        job.mig_count,
        job.topology_key,
        job.topology_required,
    )


def _fits(state: ClusterState, unit: tuple[Job, ...], policy: Policy) -> bool:
    """Place `unit` on `state` if it fits now (binding it), and say whether it did."""
    if len(unit) == 1:
        decided = place(state, unit[0], policy)
        if isinstance(decided, Unschedulable):
            return False
        state.bind(unit[0], decided.node_index, decided.gpus)
        return True
    gang = place_gang(state, unit, policy)
    if isinstance(gang, Unschedulable):
        return False
    jobs = {j.id: j for j in unit}
    for p in gang.placements:
        state.bind(jobs[p.job_id], p.node_index, p.gpus)
    return True


def estimate_scale_up(
    state: ClusterState | None,
    pending: Sequence[Job],
    pools: Sequence[NodePool],
    policy: Policy,
    *,
    booting: Mapping[str, int] | None = None,
    current: Mapping[str, int] | None = None,
    pool_label: str = POOL_LABEL,
) -> ScaleUpEstimate:
    """New nodes per pool for `pending` (see the module docstring). `state` holds the
    ready nodes and what runs there (None: none yet); `booting[pool]` nodes are on the
    way; `current[pool]` is the pool's size now (ready + booting), which with its
    `max_size` bounds the nodes it may still add. `state` is not changed."""
    booting = booting or {}
    current = current or {}
    scratch = state.copy() if state is not None and state.size else None
    templates: dict[str, ClusterState] = {}
    opened: dict[str, int] = {}
    placed_on: dict[str, list[str]] = {p.name: [] for p in pools}
    on_existing: list[str] = []
    unplaceable: dict[str, str] = {}
    by_price = sorted(pools, key=lambda p: (p.price_per_gpu_hour(), p.name))

    for pool in pools:
        room = max(pool.max_size - current.get(pool.name, booting.get(pool.name, 0)), 0)
        # A new node holds at least one pending job, so no pool needs more than that many.
        slots = booting.get(pool.name, 0) + min(room, len(pending))
        if slots == 0:
            continue
        templates[pool.name] = _empty_template(
            pool, slots, booting.get(pool.name, 0), pool_label
        ).copy()
        opened[pool.name] = booting.get(pool.name, 0)

    # Pods of one shape that did not fit the existing nodes never will in this estimate (it
    # only binds there, so the nodes only fill), as Cluster Autoscaler's equivalence groups
    # skip the pods of a controller after one did not fit: each is tried once.
    failed: set[tuple[object, ...]] = set()
    for unit in units(pending):
        shape = job_shape(unit[0]) if len(unit) == 1 else None
        if scratch is not None and shape not in failed and _fits(scratch, unit, policy):
            on_existing.extend(j.id for j in unit)
            continue
        if shape is not None:
            failed.add(shape)
        candidates = _pools_for(unit, by_price, templates)
        # Nodes opened so far (booting ones included) first, in any pool; then new ones.
        chosen = next(
            (
                p
                for p in candidates
                if _room_for(templates[p], unit) and _fits(templates[p], unit, policy)
            ),
            None,
        )
        if chosen is None:
            chosen = next(
                (p for p in candidates if _open_until_fit(templates[p], opened, p, unit, policy)),
                None,
            )
        if chosen is None:
            unplaceable[unit[0].id] = _why_not(unit, pools, templates)
        else:
            placed_on[chosen].extend(j.id for j in unit)

    estimates = {
        p.name: PoolEstimate(
            p.name,
            max(opened.get(p.name, 0) - booting.get(p.name, 0), 0),
            tuple(placed_on[p.name]),
            len({a.node for a in templates[p.name].jobs.values()}) if p.name in templates else 0,
        )
        for p in pools
    }
    existing = sorted({scratch.names[scratch.jobs[j].node] for j in on_existing}) if scratch else []
    return ScaleUpEstimate(estimates, tuple(on_existing), tuple(existing), unplaceable)


# A loop estimates again and again with the same pools and nearly the same sizes.
@functools.lru_cache(maxsize=256)
def _empty_template(pool: NodePool, slots: int, booting: int, pool_label: str) -> ClusterState:
    """`slots` empty nodes of `pool`, those past the first `booting` cordoned until a job
    needs one opened. Shared: callers change only a copy."""
    specs = [template_node(pool, f"{pool.name}/new-{i}", pool_label) for i in range(slots)]
    template = ClusterState.from_nodes(specs)
    template.set_cordoned(range(booting, slots))
    return template


def _pools_for(
    unit: tuple[Job, ...], by_price: Sequence[NodePool], templates: Mapping[str, ClusterState]
) -> list[str]:
    """Pools whose template could hold every member of `unit`, cheapest first."""
    return [
        p.name
        for p in by_price
        if p.name in templates
        and all(never_fits(templates[p.name], j) is None for j in unit)
        and all(_admitted(templates[p.name], j) for j in unit)
    ]


def _admitted(template: ClusterState, job: Job) -> bool:
    labels = template.labels[0]
    return all(labels.get(k) == v for k, v in job.node_selector) and (
        template.taints[0] <= job.tolerations
    )


def _open_until_fit(
    template: ClusterState,
    opened: dict[str, int],
    pool: str,
    unit: tuple[Job, ...],
    policy: Policy,
) -> bool:
    """Open cordoned template nodes one at a time until `unit` fits; if it never does,
    close them again (a unit that fits nowhere must not leave empty nodes counted). No
    placement is tried while the open nodes lack the unit's resources in all: a gang of k
    whole nodes is placed once, not k times."""
    before = opened[pool]
    while opened[pool] < template.size:
        template.set_cordoned([opened[pool]], False)
        opened[pool] += 1
        if _room_for(template, unit) and _fits(template, unit, policy):
            return True
    template.set_cordoned(range(before, opened[pool]))
    opened[pool] = before
    return False


def _room_for(template: ClusterState, unit: tuple[Job, ...]) -> bool:
    """Whether the open nodes of `template` have, in all, the GPU share, CPU and memory
    `unit` asks: short of that no placement can succeed, so none need be tried."""
    open_nodes = ~template.cordoned
    return (
        int(template.gpu_free[open_nodes].sum()) >= sum(j.gpu_request_milli for j in unit)
        and int(template.cpu_free[open_nodes].sum()) >= sum(j.cpu_milli for j in unit)
        and int(template.mem_free[open_nodes].sum()) >= sum(j.memory_mib for j in unit)
    )


def _why_not(
    unit: tuple[Job, ...],
    pools: Sequence[NodePool],
    templates: Mapping[str, ClusterState],
) -> str:
    if not templates:
        return "no pool may add a node (every pool is at its max_size)"
    reasons = []
    for pool in pools:
        template = templates.get(pool.name)
        if template is None:
            reasons.append(f"{pool.name}: at max_size {pool.max_size}")
            continue
        why = next((w for j in unit if (w := never_fits(template, j))), None)
        if why is None and not all(_admitted(template, j) for j in unit):
            why = "its node selector or tolerations exclude the pool"
        reasons.append(f"{pool.name}: {why or 'no room left under max_size'}")
    return "; ".join(reasons)
