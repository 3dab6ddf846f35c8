"""The reconcile loop: read the store, forecast, plan, act. One call of `iterate` is one pass.

Every pass recomputes the desired state from scratch, from what the store, the cloud and
the cluster say now, so the loop is safe to kill and restart at any moment:

- Sizes are SET, never incremented: a pool grows by `desired - target`, with the
  provider's target counting nodes still booting, so a decision taken twice (before and
  after a restart) launches once.
- A target the cloud has not fulfilled (an InsufficientInstanceCapacity, a NodeClaim
  Karpenter could not launch) is lowered to the nodes the pool holds once the plan wants
  fewer (`lowered_targets`): left at its peak, the cloud would launch the rest when
  capacity returns, for the loop to remove as surplus. No node goes by it: the nodes a
  pass takes out are chosen and removed as they always are.
- Every action is journaled as pending before it is carried out and completed after. A
  restart resolves what it finds pending against the cloud (a size already reached is
  marked done, anything else is re-planned) before deciding anything.
- Node removals resume: a node gpuscale cordoned is the first candidate again, and any
  node carrying its cordon marker that is no longer to go is uncordoned (in every
  scale-down mode, in a pool no longer configured too).
- Missing or stale telemetry, or a forecast that failed, never leads to a scale-down: the
  pool holds its size and the decision records why.
- Pods waiting now are capacity needed now: the reactive floor (Cluster Autoscaler's
  scale-up estimate on the one cluster model, `planning.reactive`, as the job simulator
  computes it) raises any pool the forecast left short of them.
- Each rise of a pool's reactive demand between two passes is a node request, a gang all
  at once (`planning.request_log`, as the job simulator keeps them). The planner state
  keeps the requests of the current demand step with the last pass's demand, so a restart
  loses none; the planner sizes each pool's job-level spare on them
  (`GroupNeed.spare_nodes`), and the reactive floor holds that spare on top of what real
  and pending pods need, as the job simulator does every minute.
- A ready node counts as removable only when the scale-down check finds its pods,
  placeholders aside, room elsewhere; a node running real GPU pods never does. Nodes go in
  the one removal order (`removal_order`).
- Placeholders hold the room the plan provides beyond real use, shaped like the configured
  job mix packed onto the pool's nodes (or `kubernetes.placeholder_gpus` GPUs each). With
  `pre_position: capacity-buffer` one CapacityBuffer per pool asks the node autoscaler for
  that room instead, in units of the pool's largest job, and each change of its replicas
  is journaled like a resize; a buffer whose status says the autoscaler does not hold
  that room (`capacity_buffers.not_ready`) is reported in the pass's outcome and logged
  once, while it lasts.
- Where the node autoscaler sizes the pools (`provider.kind: autoscaler`) gpuscale never
  resizes them and removes no node: the surplus the plan finds is left to the autoscaler's
  scale-down (no buffer or placeholder holds room on it). With `provider.scale_down:
  provider` (static Karpenter NodePools) the provider drains the nodes it takes out.
- Scheduled jobs are known demand: the CronJobs' runs due within a pool's boot time plus
  one demand step (`scaler.kube.cronjobs`, read each pass as Kueue's queue is) are the
  pool's `DemandOutlook.scheduled`, so the nodes of a run are ready when it fires. Where
  the API server refuses to list CronJobs (the RBAC grants it no list) the loop plans
  without them and says so once; where it fails to answer, scale-downs are held, as for
  missing telemetry; a schedule that cannot be read leaves its CronJob out, said once.
- The planner's memory advances once per demand step: passes within one step all plan
  from the memory at the start of that step, so repeating a pass repeats its decision.
  Where a pass finds none (a fresh state directory, the Lease just taken), or one from
  before a gap of more than a step, it rebuilds it from the store's history
  (`warm_start`): the first pass plans what a replay of that history plans at its step.

Every decision is stored with its inputs (telemetry status, outlook, fleet) and its
outcome in the decision log. With leader election, no action starts unless this replica
holds the lease.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pandas as pd
from pydantic import ValidationError

from predictor.foundation.problem_log import ProblemLog
from predictor.models.requests import RequestRateForecast
from predictor.telemetry.kube_objects import KubeNames, read_pod
from scaler.cluster.job import Job
from scaler.cluster.pools import NodePool
from scaler.cluster.snapshot import ClusterState
from scaler.cluster.templates import template_node
from scaler.controller.config import KubernetesSection, kube_names, mix_jobs, workload_mix
from scaler.controller.fleet import FleetNode, ObservedFleet, observe_fleet
from scaler.controller.leader import LeaderElector, NotLeader
from scaler.controller.removal_order import removal_order
from scaler.controller.system import LiveSystem
from scaler.controller.warm_start import WarmStart, rebuild, stale_state
from scaler.kube.capacity_buffers import (
    BufferDemand,
    BufferSettings,
    BufferUnit,
    CapacityBuffers,
    not_ready,
    unit_template,
)
from scaler.kube.cronjobs import read_scheduled, scheduled_nodes
from scaler.kube.drainability import CLUSTER_AUTOSCALER_RULES
from scaler.kube.errors import KubeError, Refusal
from scaler.kube.kueue import with_queue
from scaler.kube.nodes import DrainSettings, NodeRemoval, RemovalOutcome, RemovalStatus
from scaler.kube.objects import job_of, parse_taint
from scaler.kube.observed import ObserveCluster, ObservedNode, observe_cluster
from scaler.kube.placeholders import (
    PlaceholderDemand,
    Placeholders,
    PlaceholderSettings,
    placeholder_pod,
)
from scaler.kube.watched import cache_of
from scaler.placement.decision import Unschedulable
from scaler.placement.engine import commit, place
from scaler.placement.estimator import ScaleUpEstimate
from scaler.placement.policies import make_policy
from scaler.placement.policies.base import Policy
from scaler.planning.demand import DemandReading, Outlooks, outlooks, read_demand
from scaler.planning.job_spare import ScheduledNodes
from scaler.planning.planner import (
    CapacityPlan,
    DemandOutlook,
    FleetCapacity,
    PlannerMemory,
    PlannerPolicy,
    plan,
)
from scaler.planning.reactive import (
    ReactiveDemand,
    ReactiveFloor,
    reactive_demand,
    reactive_floor,
    with_floor,
)
from scaler.planning.request_log import RequestLog
from scaler.providers.base import ProviderError

log = logging.getLogger(__name__)

# Where a pass may stop for good (a crash test's hook): after journaling an action, after
# carrying it out (before its journal entry is completed), and after cordoning the nodes it
# removes (before the first is drained and deleted).
PAUSE_POINTS = ("journaled", "acted", "cordoned")
PLANNER_KEY = "planner"
# The id of the applied decision whose pass is under way; its outcome ends it.
DECIDING_KEY = "deciding"
KNOWN_KEY = "known_nodes"
UNREMOVABLE_KEY = "unremovable"


# The kinds of action the loop journals, and settles after a restart.
SCALE_ACTIONS = frozenset({"set_target", "lower_target", "remove_node", "uncordon", "set_buffer"})


def utc_now() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


@dataclass(frozen=True)
class PlannerState:
    """The planner's memory across passes: `base` at the start of demand step `step`,
    `latest` after the newest pass in it; `requests`: the node requests seen in the passes
    of `step` (`base` has not taken them in; `latest` has) and the newest pass's demand."""

    step: str | None = None
    base: PlannerMemory | None = None
    latest: PlannerMemory | None = None
    # None: none seen yet, or a state pickled before requests were kept (it loads with
    # the class's default).
    requests: RequestLog | None = None

    def memory_for(self, step: str) -> PlannerMemory | None:
        return self.base if step == self.step else self.latest

    def requests_for(self, step: str) -> RequestLog:
        """The requests a pass in `step` gives the planner (with its own rises added): a
        new step's memory has taken in those of the step before."""
        requests = self.requests or RequestLog()
        return requests if step == self.step else requests.taken()

    def after(self, step: str, memory: PlannerMemory, requests: RequestLog) -> PlannerState:
        base = self.base if step == self.step else self.latest
        return PlannerState(step, base, memory, requests)


@dataclass(frozen=True, slots=True)
class TargetCut:
    """A pool's cloud target lowered from `target` to `to`: the nodes it `holds`, or the
    `wanted` nodes of the plan where more."""

    pool: str
    target: int
    to: int
    holds: int
    wanted: int

    def to_dict(self) -> dict[str, object]:
        return {
            "pool": self.pool,
            "from": self.target,
            "to": self.to,
            "holds": self.holds,
            "wanted": self.wanted,
        }


@dataclass(frozen=True, slots=True)
class Removal:
    pool: str
    cloud_name: str
    kube_name: str | None
    booting: bool
    pods: tuple[str, ...] = ()  # the pods the scale-down check found room for, by id

    def to_dict(self) -> dict[str, object]:
        return {
            "pool": self.pool,
            "node": self.cloud_name,
            "kube_node": self.kube_name,
            "booting": self.booting,
        }

    def action_entry(self) -> dict[str, Any]:
        """The start of the pass's record of removing it (its status and result follow)."""
        return {"action": "remove_node", "node": self.cloud_name, "kube_node": self.kube_name}


@dataclass(frozen=True)
class PendingFloor:
    """The reactive floor of a pass (`planning.reactive`), how many real pods wait and how
    many jobs of pending Kueue Workloads (no pods yet) are counted with them."""

    reactive: ReactiveFloor
    pending: int
    queued: int = 0

    @property
    def floor(self) -> Mapping[str, int]:
        return self.reactive.floor

    @property
    def demand(self) -> ReactiveDemand:
        return self.reactive.demand

    def to_dict(self) -> dict[str, object]:
        return {"pending_pods": self.pending, "queued_jobs": self.queued} | self.reactive.to_dict()


@dataclass(frozen=True, eq=False)
class PassDecision:
    """What one pass decided, with everything it decided on."""

    at: datetime
    step: str
    reading: DemandReading
    outlook: Outlooks
    fleet: ObservedFleet
    plan: CapacityPlan
    desired: Mapping[str, int]  # scale-downs the telemetry cannot justify held, floor applied
    held: Mapping[str, str]
    removals: tuple[Removal, ...]
    placeholders: tuple[PlaceholderDemand, ...]
    planner_state: PlannerState
    forecast_source: str
    reactive: PendingFloor | None = None
    buffers: tuple[BufferDemand, ...] = ()
    # Surplus nodes the plan would take out, left to the node autoscaler (scale_down: none).
    left_to_autoscaler: tuple[Removal, ...] = ()
    lowered: tuple[TargetCut, ...] = ()  # targets above the nodes held, no longer wanted
    scheduled_problem: str | None = None  # the CronJobs could not be read: why
    warm_start: WarmStart | None = None  # the planner state was rebuilt from the store: how
    request_source: str | None = None  # the request-rate model served, or why the table is

    @property
    def problems(self) -> list[str]:
        return (
            self.reading.problems
            + ([self.outlook.problem] if self.outlook.problem else [])
            + ([self.scheduled_problem] if self.scheduled_problem else [])
        )

    @property
    def job_spare(self) -> Mapping[str, int]:
        """Job-level spare nodes held per pool on top of real and pending pods' demand."""
        return self.reactive.reactive.spare if self.reactive is not None else {}

    def inputs(self) -> dict[str, Any]:
        return {
            "at": self.at.isoformat(),
            "step": self.step,
            "telemetry": [s.to_dict() for s in self.reading.status],
            "problems": self.problems,
            "forecast_source": self.forecast_source,
            "request_source": self.request_source,
            "outlooks": [
                {
                    "group": o.group,
                    "observed": o.observed,
                    "levels": list(o.levels),
                    "values": o.values.tolist(),
                    "gpu_models": None if o.gpu_models is None else sorted(o.gpu_models),
                    "requests": None
                    if o.requests is None
                    else {
                        "minutes_ago": list(o.requests.minutes_ago),
                        "nodes": list(o.requests.nodes),
                    },
                    "request_rate": None if o.request_rate is None else o.request_rate.ahead,
                    "scheduled": None
                    if o.scheduled is None
                    else {
                        "minutes_ahead": list(o.scheduled.minutes_ahead),
                        "nodes": list(o.scheduled.nodes),
                    },
                }
                for o in self.outlook.outlooks
            ],
            "fleet": self.fleet.to_dict(),
            "reactive": self.reactive.to_dict() if self.reactive is not None else None,
        }

    def to_dict(self) -> dict[str, Any]:
        """The plan and what the pass will do (what `gpuscale scale --json` prints)."""
        return {
            **self.plan.to_dict(),
            "step": self.step,
            "problems": self.problems,
            "forecast_source": self.forecast_source,
            "request_source": self.request_source,
            "targets": dict(self.fleet.targets),
            "final_desired": dict(self.desired),
            "held": dict(self.held),
            "reactive": self.reactive.to_dict() if self.reactive is not None else None,
            "lowered_targets": [c.to_dict() for c in self.lowered],
            "removals": [r.to_dict() for r in self.removals],
            "left_to_autoscaler": [r.to_dict() for r in self.left_to_autoscaler],
            "placeholders": [p.model_dump() for p in self.placeholders],
            "capacity_buffers": [b.model_dump() for b in self.buffers],
            "warm_start": None if self.warm_start is None else self.warm_start.to_dict(),
            "sizing": self.sizing(),
        }

    def sizing(self) -> dict[str, str]:
        """How each demand group's need was sized (`GroupNeed.sizing`): its tuned rule, the
        job-level spare, the forecast bound, or the reactive fallback of a store with too
        little history."""
        return {n.group: n.sizing for n in self.plan.needs}


# ------------------------------------------------------------------ pure decision helpers


def within_cloud_limits(pools: Sequence[NodePool], limits: Mapping[str, int]) -> list[NodePool]:
    """The pools with each `max_size` lowered to the cloud's own maximum for its group
    (`limits`, by pool), never below its `min_size`."""
    return [
        p
        if limits.get(p.name, p.max_size) >= p.max_size
        else p.model_copy(update={"max_size": max(p.min_size, limits[p.name])})
        for p in pools
    ]


def hold_scale_downs(plan: CapacityPlan, problems: Sequence[str]) -> tuple[dict[str, int], dict]:
    """Desired sizes with every scale-down held when the inputs cannot justify one."""
    desired = dict(plan.desired)
    held: dict[str, str] = {}
    if not problems:
        return desired, held
    why = "scale-down held: " + "; ".join(problems)
    for d in plan.decisions:
        if d.desired < d.current:
            desired[d.pool] = d.current
            held[d.pool] = why
    return desired, held


def lowered_targets(
    fleet: ObservedFleet, desired: Mapping[str, int], held: Mapping[str, str]
) -> list[TargetCut]:
    """The targets to lower: each pool's whose cloud target is above both the nodes it
    holds (booting ones included) and the plan's `desired`, lowered to the larger of those.
    Only the launches the cloud has not made are cancelled; the surplus among the nodes
    held goes through the pass's removals, node by node. A pool whose scale-down is held
    (`hold_scale_downs`) keeps its target: the inputs that cannot justify fewer nodes
    cannot justify asking for fewer either."""
    cuts = []
    for pool, target in fleet.targets.items():
        if pool not in desired or pool in held:
            continue
        holds = len(fleet.nodes.get(pool, ()))
        to = max(desired[pool], holds)
        if to < target:
            cuts.append(TargetCut(pool, target, to, holds, desired[pool]))
    return cuts


def pending_demand(
    fleet: ObservedFleet, pools: Sequence[NodePool], placement: Policy, pool_label: str
) -> ReactiveDemand:
    """The nodes the pods running and waiting now need (`planning.reactive`, as the job
    simulator computes it): `reactive_demand` packs the pending ones onto the ready nodes,
    the booting ones and new template nodes of the fleet the loop observed. The jobs of
    pending Kueue Workloads wait with them, each Workload a gang."""
    cluster = fleet.cluster
    pending = (*cluster.real_pending, *cluster.queued) if cluster is not None else ()
    # A node that has registered is in the cluster state; only the others are on the way.
    booting = {pool: sum(n.unregistered for n in nodes) for pool, nodes in fleet.nodes.items()}
    return reactive_demand(
        cluster.state if cluster is not None else None,
        pending,
        pools,
        placement,
        booting=booting,
        current=fleet.sizes(),
        pool_label=pool_label,
    )


def pending_floor(
    fleet: ObservedFleet,
    fleet_state: FleetCapacity,
    demand: ReactiveDemand,
    pools: Sequence[NodePool],
    policy: PlannerPolicy,
    spare: Mapping[str, int],
) -> PendingFloor:
    """The sizes the pending pods (`demand`, from `pending_demand`) need at least, with
    the job-level `spare` nodes per pool on top (`planning.reactive.reactive_floor`)."""
    cluster = fleet.cluster
    pods = len(cluster.real_pending) if cluster is not None else 0
    queued = len(cluster.queued) if cluster is not None else 0
    floor = reactive_floor(demand, fleet_state, pools, policy, spare=spare)
    return PendingFloor(floor, pods, queued)


def with_requests(
    outlooks: Sequence[DemandOutlook],
    requests: RequestLog,
    pools: Sequence[NodePool],
    at: datetime,
) -> tuple[DemandOutlook, ...]:
    """The outlooks with the node requests of the pool each is named like (a series named
    otherwise is no one pool's, and keeps the step-level spare)."""
    names = {p.name for p in pools}
    return tuple(
        replace(o, requests=requests.requests(o.group, at)) if o.group in names else o
        for o in outlooks
    )


def with_scheduled(
    outlooks: Sequence[DemandOutlook], scheduled: Mapping[str, ScheduledNodes]
) -> tuple[DemandOutlook, ...]:
    """The outlooks with the nodes scheduled jobs will ask of the pool each is named like
    (`scaler.kube.cronjobs.scheduled_nodes`); a series named otherwise is no one pool's."""
    return tuple(
        replace(o, scheduled=scheduled[o.group]) if o.group in scheduled else o for o in outlooks
    )


def with_request_rates(
    outlooks: Sequence[DemandOutlook], rates: Mapping[str, RequestRateForecast]
) -> tuple[DemandOutlook, ...]:
    """The outlooks with the forecast request rate of the pool each is named like."""
    return tuple(
        replace(o, request_rate=rates[o.group]) if o.group in rates else o for o in outlooks
    )


def job_spares(planned: CapacityPlan, pools: Sequence[NodePool]) -> dict[str, int]:
    """The job-level spare nodes the plan sizes, per pool (the need of the series named
    like it, `with_requests`)."""
    names = {p.name for p in pools}
    return {
        n.group: n.spare_nodes
        for n in planned.needs
        if n.group in names and n.spare_nodes is not None
    }


def choose_removals(
    fleet: ObservedFleet, pool: str, count: int, unremovable: frozenset[str]
) -> list[FleetNode]:
    """The nodes of `pool` to take out, in the one removal order (`removal_order`)."""
    return [c.key for c in removal_order(fleet.removal_candidates(pool, unremovable), count)]


def within_cap(removals: Sequence[Removal], max_nodes: int) -> list[Removal]:
    """The removals a pass carries out: the first `max_nodes` registered nodes in the
    removal order, and every node not registered (no pod there to drain). The rest of
    the surplus waits for a later pass, checked again on what the cluster shows then."""
    kept, drained = [], 0
    for removal in removals:
        if removal.kube_name is not None:
            if drained == max_nodes:
                continue
            drained += 1
        kept.append(removal)
    return kept


def stale_cordons(fleet: ObservedFleet, removals: Sequence[Removal]) -> list[ObservedNode]:
    """The nodes carrying gpuscale's cordon marker that this pass does not remove, to be
    uncordoned: whatever the scale-down mode now and whether their pool is still configured,
    the marker says gpuscale made the cordon, and nobody else would undo it. A node of a
    configured pool whose instance the provider no longer lists is left as it is: its
    removal went through, and the Node object is on its way out."""
    if fleet.cluster is None:
        return []
    removing = {r.kube_name for r in removals}
    listed = {n.cloud_name for n in fleet.all_nodes()}
    return [
        n
        for n in fleet.cluster.nodes.values()
        if n.draining
        and n.name not in removing
        and (n.pool not in fleet.nodes or n.cloud_name in listed)
    ]


def pool_room(
    fleet: ObservedFleet,
    pool: NodePool,
    desired: int,
    removed: frozenset[str],
    pool_label: str,
) -> ClusterState | None:
    """The pool's nodes after this pass, with what real pods hold there: the nodes that stay
    (registered ones as Kubernetes shows them, a node gpuscale cordoned and now keeps
    uncordoned; the others as the pool's template) and a template node for each node the
    plan adds. None when the pool will have no node."""
    cluster = fleet.cluster
    state = cluster.state if cluster is not None else None
    index = {name: i for i, name in enumerate(state.names)} if state is not None else {}
    kept = [n for n in fleet.nodes.get(pool.name, ()) if n.cloud_name not in removed]
    specs = []
    held = []
    for n in kept:
        if cluster is not None and state is not None and n.kube_name in index:
            spec = cluster.specs[n.kube_name]
            specs.append(replace(spec, cordoned=spec.cordoned and not n.cordoned_by_us))
            real = [a for a in state.jobs_on(index[n.kube_name]) if not a.job.placeholder]
            held.extend((len(specs) - 1, a) for a in real)
        else:
            specs.append(template_node(pool, n.cloud_name, pool_label))
    added = max(desired - len(kept), 0)
    specs.extend(template_node(pool, f"{pool.name}/new-{i}", pool_label) for i in range(added))
    if not specs:
        return None
    room = ClusterState.from_nodes(specs)
    for node, allocation in held:
        room.bind(allocation.job, node, allocation.gpus)
    return room


def placeholder_shapes(
    pool: NodePool, mix: Sequence[Job], gpus_each: int | None = None
) -> list[Job]:
    """The jobs a pool's placeholders stand in for: the GPU jobs of the workload mix that
    may run on the pool's GPU model, or, with `gpus_each`, jobs of that many whole GPUs
    (at most a node's)."""
    if gpus_each is not None:
        return [Job("shape", num_gpu=min(gpus_each, pool.gpus_per_node), gpu_milli=1000)]
    return [j for j in mix if j.num_gpu and (not j.gpu_models or pool.gpu_model in j.gpu_models)]


def pack_placeholders(
    room: ClusterState,
    pending: Sequence[Job],
    shapes: Sequence[Job],
    like: Job,
    policy: Policy,
) -> list[int]:
    """GPUs of each placeholder that fills `room`: the pending jobs take theirs first; then
    the shapes are placed, largest first and each as often as it appears in `shapes`, round
    after round until none fits, as `like` (the placeholder pod's selector and tolerations).
    A placeholder holds the GPUs one shaped job took; the GPUs shared by sharing shapes are
    held by one-GPU placeholders. Largest first. `room` is changed."""
    for job in sorted(pending, key=lambda j: (-j.gpu_request_milli, j.id)):
        decided = place(room, job, policy)
        if not isinstance(decided, Unschedulable):
            commit(room, job, decided)
    order = sorted(shapes, key=lambda j: (-j.gpu_request_milli, -j.cpu_milli, -j.memory_mib))
    full: set[int] = set()  # shapes that no longer fit anywhere (room only shrinks)
    sizes: list[int] = []
    shared: set[tuple[int, int]] = set()
    made = 0
    while len(full) < len(order):
        for i, shape in enumerate(order):
            if i in full:
                continue
            job = replace(
                shape,
                id=f"placeholder-{made}",
                node_selector=like.node_selector,
                tolerations=like.tolerations,
                placeholder=True,
            )
            made += 1
            decided = place(room, job, policy)
            if isinstance(decided, Unschedulable):
                full.add(i)
                continue
            commit(room, job, decided)
            if job.is_sharing:
                shared.add((decided.node_index, decided.gpus[0]))
            else:
                sizes.append(job.num_gpu)
    return sorted(sizes + [1] * len(shared), reverse=True)


@dataclass(frozen=True, slots=True)
class SpareRoom:
    """What a pass works out the room its plan provides beyond what real pods use or wait
    for from, for placeholders and CapacityBuffers alike: the planned node count per pool,
    the nodes the pass lets go, the scale-up estimate (which pending pods go where), the
    job mix and policy it packs with, the placeholder size if one is fixed, and the
    job-level spare nodes the planned count holds per pool."""

    fleet: ObservedFleet
    desired: Mapping[str, int]
    removed: frozenset[str]
    estimate: ScaleUpEstimate | None
    mix: Sequence[Job]
    policy: Policy
    names: KubeNames
    gpus_each: int | None = None
    job_spare: Mapping[str, int] = field(default_factory=dict)

    def packed(self, pool: NodePool, shapes: Sequence[Job], pod: Any) -> list[int] | None:
        """GPUs of each unit of `shapes` that fits onto the pool's nodes after this pass
        (`pool_room`) once the pending pods bound for the pool have taken theirs
        (`pack_placeholders`), each placed as `pod` (its selector and tolerations) would
        be; None where the pool has no room to hold."""
        planned = self.desired.get(pool.name, 0)
        room = pool_room(self.fleet, pool, planned, self.removed, self.names.pool_label)
        if room is None:
            return None
        cluster = self.fleet.cluster
        taints = [parse_taint(t) for t in sorted(cluster.taints)] if cluster is not None else []
        like = job_of(read_pod(pod, self.names), self.names, taints)
        pending = pending_for(self.fleet, pool.name, self.estimate)
        return pack_placeholders(room, pending, shapes, like, self.policy)


def placeholder_demand(
    spare: SpareRoom, pools: Sequence[NodePool], settings: PlaceholderSettings
) -> list[PlaceholderDemand]:
    """Placeholders holding the room the plan provides beyond what real pods use or wait
    for, so the capacity bought ahead of demand stays warm until jobs preempt them: per
    pool, the job mix packed into the spare room (`SpareRoom.packed`)."""
    out = []
    for pool in pools:
        sizes = spare.packed(
            pool,
            placeholder_shapes(pool, spare.mix, spare.gpus_each),
            placeholder_pod(settings, pool.name, 0, 1),
        )
        if sizes is None:
            continue
        for gpus in sorted(set(sizes), reverse=True):
            out.append(PlaceholderDemand(pool=pool.name, count=sizes.count(gpus), gpus=gpus))
    return out


def pending_for(fleet: ObservedFleet, pool: str, estimate: ScaleUpEstimate | None) -> list[Job]:
    """The waiting pods bound for `pool`: those the scale-up estimate sends to its new
    nodes and those that ask for it. They take their room before any spare is held."""
    cluster = fleet.cluster
    if cluster is None:
        return []
    going = set(estimate.pools[pool].jobs) if estimate is not None else set()
    going |= {j for j, p in cluster.pending_pools.items() if p == pool}
    return [j for j in cluster.real_pending if j.id in going]


def buffer_unit(pool: NodePool, mix: Sequence[Job], gpus_each: int | None = None) -> Job:
    """The job one unit of a pool's CapacityBuffer stands for: `gpus_each` whole GPUs (at
    most a node's), else the largest whole-GPU job of the mix that one of the pool's nodes
    can run. The largest needs its room in one place and smaller jobs fit in that room,
    while a buffer counted in smaller units could be met by scattered GPUs the large jobs
    cannot use. One GPU where the mix has no such job."""
    if gpus_each is not None:
        return placeholder_shapes(pool, mix, gpus_each)[0]
    fits = [
        j
        for j in placeholder_shapes(pool, mix)
        if not j.is_sharing
        and j.num_gpu <= pool.gpus_per_node
        and j.cpu_milli <= pool.cpu_milli_per_node
        and j.memory_mib <= pool.memory_mib_per_node
    ]
    if not fits:
        return Job("unit", num_gpu=1, gpu_milli=1000)
    return max(fits, key=lambda j: (j.num_gpu, j.cpu_milli, j.memory_mib))


def buffer_demand(
    spare: SpareRoom, pools: Sequence[NodePool], settings: BufferSettings
) -> list[BufferDemand]:
    """Per pool, the CapacityBuffer that asks the node autoscaler for the room the plan
    provides beyond what real pods use or wait for: as many units of the pool's job
    (`buffer_unit`) as fit into the spare room (`SpareRoom.packed`). The node autoscaler
    sees the pending pods itself, and provisions for the units on top. Capped at the
    pool's GPUs at its max size."""
    out = []
    for pool in pools:
        shape = buffer_unit(pool, spare.mix, spare.gpus_each)
        unit = BufferUnit(
            gpus=shape.num_gpu, cpu_milli=shape.cpu_milli, memory_mib=shape.memory_mib
        )
        template = unit_template(settings, pool.name, unit)["template"]
        units = len(spare.packed(pool, [shape], template) or [])
        planned = spare.desired.get(pool.name, 0)
        held = spare.job_spare.get(pool.name, 0)
        out.append(
            BufferDemand(
                pool=pool.name,
                replicas=units,
                unit=unit,
                limit_gpus=pool.max_size * pool.gpus_per_node,
                reason=f"{units} x {unit.gpus} GPUs free on the {planned} node(s) planned"
                + (f" ({held} of them job-level spare)" if held else "")
                + ", beyond real pods and those waiting",
            )
        )
    return out


# ------------------------------------------------------------------ the loop


@dataclass
class PassOutcome:
    decision: PassDecision
    applied: bool
    decision_id: int | None = None
    actions: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    placeholders: dict[str, list[str]] | None = None
    # CapacityBuffer name -> why the autoscaler does not hold its room (what its status says)
    buffers_not_ready: dict[str, str] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "decision_id": self.decision_id,
            "applied": self.applied,
            "plan": self.decision.to_dict(),
            "actions": self.actions,
            "placeholder_changes": self.placeholders,
            "capacity_buffers_not_ready": self.buffers_not_ready,
            "errors": self.errors,
        }


class Reconciler:
    """One pass at a time; `iterate(apply=False)` is a dry run that changes nothing."""

    def __init__(
        self,
        system: LiveSystem,
        elector: LeaderElector | None = None,
        pause: Callable[[str], None] = lambda point: None,
        clock: Callable[[], datetime] = utc_now,
        observe: ObserveCluster = observe_cluster,
    ) -> None:
        self.system = system
        self.config = system.config
        self.elector = elector
        self.pause = pause
        self.clock = clock
        self.observe = observe  # `serve` shares one listing with its placement state
        self.identity = elector.identity if elector is not None else "local"
        self._dry_state: PlannerState | None = None  # a dry run's memory stays in memory
        # The loop reads the buffers every pass; a buffer not ready is said when it shows.
        self._buffer_problems = ProblemLog(log)
        # And the CronJobs: a refusal, a failure or a schedule it cannot read, likewise.
        self._scheduled_problems = ProblemLog(log)
        # The last warm start (its step and groups, the state and its account): `serve`
        # decides afresh every few seconds from a state it does not keep.
        self._warm: tuple[tuple[str, tuple[str, ...]], PlannerState, WarmStart] | None = None

    # ---- deciding ------------------------------------------------------------------------
    def decide(self, state: PlannerState | None = None) -> PassDecision:
        """Read, forecast and plan; act on nothing."""
        cfg = self.config
        now = self.clock()
        if state is None:
            state = self._dry_state or self.system.log.load(PLANNER_KEY, PlannerState())
        reading = read_demand(
            self.system.store, cfg.demand, cfg.policy.step_seconds, pd.Timestamp(now)
        )
        outlook = outlooks(reading, self.system.model, cfg.pools, cfg.policy, cfg.demand)
        kube = cfg.kubernetes
        names = kube_names(kube)
        placement = make_policy(
            cfg.placement.policy, mix=workload_mix(cfg.placement.mix), seed=cfg.placement.seed
        )
        unremovable = self._unremovable(now)
        fleet = observe_fleet(
            self.system.provider,
            [p.name for p in cfg.pools],
            self.system.kube,
            names,
            assume_idle=self.system.provider.name() == "simulated",
            observe=(
                with_queue(self.observe, kube.request_timeout_s)
                if kube is not None and kube.kueue
                else self.observe
            ),
            rules=kube.drain.rules() if kube is not None else CLUSTER_AUTOSCALER_RULES,
        ).with_removal_checks(placement, unremovable)
        # Planned within what the cloud allows now, so the plan (and its reason) is what a
        # growth can reach: an ASG's MaxSize or a NodePool's limits may be below max_size.
        pools = within_cloud_limits(
            cfg.pools, {g.id(): g.max_size() for g in self.system.provider.node_groups()}
        )
        known: dict[str, list[str]] = self.system.log.load(KNOWN_KEY, {})
        current = {pool: {n.cloud_name for n in nodes} for pool, nodes in fleet.nodes.items()}
        lost = {pool: len(set(known.get(pool, [])) - seen) for pool, seen in current.items()}
        step = str(reading.last_step or pd.Timestamp(now).floor(f"{cfg.policy.step_seconds}s"))
        fleet_state = fleet.fleet_state(now, unremovable, lost)
        state, warm = self._warm_started(state, reading, outlook.outlooks, pools, step)
        requests = state.requests_for(step)
        demand = None
        if fleet.cluster is not None:
            demand = pending_demand(fleet, pools, placement, names.pool_label)
            requests = requests.observe(demand, now)
            # The outlooks as the planner gets them, and the decision records them.
            outlook = replace(
                outlook, outlooks=with_requests(outlook.outlooks, requests, pools, now)
            )
            if self.system.requests is not None:
                rates = self.system.requests.rates(self.system.store, pools, now, step)
                outlook = replace(outlook, outlooks=with_request_rates(outlook.outlooks, rates))
        scheduled_problem = None
        if kube is not None and self.system.kube is not None:
            watched = None if fleet.cluster is None else fleet.cluster.cron_jobs
            scheduled, scheduled_problem = self._scheduled(now, pools, names, watched)
            if scheduled is not None:
                outlook = replace(outlook, outlooks=with_scheduled(outlook.outlooks, scheduled))
        memory = state.memory_for(step)
        planned = plan(outlook.outlooks, fleet_state, pools, cfg.policy, memory)
        problems = reading.problems + ([outlook.problem] if outlook.problem else [])
        if scheduled_problem is not None:
            problems.append(scheduled_problem)
        if fleet.cluster is not None and fleet.cluster.stale is not None:
            problems.append(fleet.cluster.stale)  # the watched cache may be out of date
        desired, held = hold_scale_downs(planned, problems)
        reactive = None
        if demand is not None:
            # Pods waiting now need capacity whatever the forecast said (or failed to say),
            # and the job-level spare rides on top of them.
            reactive = pending_floor(
                fleet, fleet_state, demand, pools, cfg.policy, job_spares(planned, pools)
            )
            desired = with_floor(desired, reactive.floor)
        removals: list[Removal] = []
        for pool in pools:
            surplus = len(fleet.nodes.get(pool.name, ())) - desired[pool.name]
            for node in choose_removals(fleet, pool.name, surplus, unremovable):
                removals.append(
                    Removal(pool.name, node.cloud_name, node.kube_name, node.booting, node.pods)
                )
        # Whoever removes them, no spare room is held on the nodes the plan lets go.
        removed = frozenset(r.cloud_name for r in removals)
        estimate = reactive.demand.estimate if reactive is not None else None
        placeholders: list[PlaceholderDemand] = []
        buffers: list[BufferDemand] = []
        if kube is not None and self.system.kube is not None:
            spare = SpareRoom(
                fleet,
                desired,
                removed=removed,
                estimate=estimate,
                mix=mix_jobs(cfg.placement.mix),
                policy=placement,
                names=names,
                gpus_each=kube.placeholder_gpus,
                job_spare=reactive.reactive.spare if reactive is not None else {},
            )
            if kube.pre_position == "placeholders":
                placeholders = placeholder_demand(spare, pools, kube.placeholders)
            elif kube.pre_position == "capacity-buffer":
                buffers = buffer_demand(spare, pools, kube.capacity_buffers)
        lowered = lowered_targets(fleet, desired, held) if cfg.provider.sets_sizes else []
        left: list[Removal] = []
        if cfg.provider.scale_down == "none":
            removals, left = [], removals
        elif kube is not None:
            removals = within_cap(removals, kube.drain.max_nodes)
        return PassDecision(
            at=now,
            step=step,
            reading=reading,
            outlook=outlook,
            fleet=fleet,
            plan=planned,
            desired=desired,
            held=held,
            removals=tuple(removals),
            placeholders=tuple(placeholders),
            planner_state=state.after(step, planned.memory, requests),
            forecast_source=self.system.model.source,
            request_source=None if self.system.requests is None else self.system.requests.source,
            reactive=reactive,
            buffers=tuple(buffers),
            left_to_autoscaler=tuple(left),
            lowered=tuple(lowered),
            scheduled_problem=scheduled_problem,
            warm_start=warm,
        )

    def _warm_started(
        self,
        state: PlannerState,
        reading: DemandReading,
        live: Sequence[DemandOutlook],
        pools: Sequence[NodePool],
        step: str,
    ) -> tuple[PlannerState, WarmStart | None]:
        """`state`, or where it cannot serve this step (`warm_start.stale_state`) the one
        rebuilt from the store's history, with the account of the rebuild."""
        groups = tuple(sorted(o.group for o in live))
        why = stale_state(
            state.step, state.memory_for(step), step, groups, self.config.policy.step_seconds
        )
        if why is None or not groups:
            return state, None
        key = (step, groups)
        if self._warm is None or self._warm[0] != key:
            replayed, warm = rebuild(
                reading, self.system.model.model, live, pools, self.config.policy, why
            )
            rebuilt = PlannerState(step, replayed.memory, replayed.memory, RequestLog())
            self._warm = (key, rebuilt, warm)
        return self._warm[1], self._warm[2]

    def _scheduled(
        self,
        now: datetime,
        pools: Sequence[NodePool],
        names: KubeNames,
        watched: Sequence[Mapping[str, Any]] | None = None,
    ) -> tuple[dict[str, ScheduledNodes] | None, str | None]:
        """The nodes the CronJobs' runs will ask of each pool (`scaler.kube.cronjobs`), or
        None; and, where the API server failed to answer, why (a problem that holds
        scale-downs: a run due soon may be among what was not read). A refusal to list
        (RBAC, or no CronJobs served) is no problem of the pass: the loop plans without
        scheduled jobs, and says so once."""
        assert self.system.kube is not None
        step = self.config.policy.step_seconds
        horizon = timedelta(seconds=max((p.boot_seconds for p in pools), default=0.0) + step)
        try:
            found = read_scheduled(self.system.kube, names, now, horizon, watched)
        except KubeError as exc:
            problem = f"scheduled jobs unknown: {exc}"
            self._scheduled_problems.report([problem])
            return None, problem
        if isinstance(found, Refusal):
            self._scheduled_problems.report(
                [
                    f"CronJobs are not read ({found}): scheduled jobs are not planned for;"
                    " grant list on batch/cronjobs (the Helm chart does)"
                ]
            )
            return None, None
        self._scheduled_problems.report(found.problems)
        return scheduled_nodes(found.runs, pools, now, step), None

    # ---- one pass -------------------------------------------------------------------------
    def iterate(self, apply: bool) -> PassOutcome:
        """Decide and, with `apply`, act. Raises NotLeader when this replica may not act."""
        log_ = self.system.log
        if not apply:
            decision = self.decide()
            self._dry_state = decision.planner_state
            decision_id = log_.record(
                self.identity,
                False,
                decision.inputs(),
                decision.to_dict(),
                outcome={"dry_run": True},
            )
            return PassOutcome(decision, applied=False, decision_id=decision_id)

        self._check_leader()
        resolved = self.resolve_journal()
        self.settle_interrupted()
        decision = self.decide(log_.load(PLANNER_KEY, PlannerState()))
        decision_id = log_.record(
            self.identity,
            True,
            decision.inputs(),
            decision.to_dict(),
            state={PLANNER_KEY: decision.planner_state},
            mark=DECIDING_KEY,
        )
        outcome = PassOutcome(decision, applied=True, decision_id=decision_id, actions=resolved)
        try:
            self._act(decision, decision_id, outcome)
        except NotLeader as exc:
            outcome.errors.append(f"stopped: {exc}")
        finally:
            removed = {a["node"] for a in outcome.actions if a.get("status") == "done"}
            known = {
                pool: sorted(n.cloud_name for n in nodes if n.cloud_name not in removed)
                for pool, nodes in decision.fleet.nodes.items()
            }
            log_.save(KNOWN_KEY, known)
            log_.finish(decision_id, outcome.to_dict() | {"plan": None})
        return outcome

    def resolve_journal(self) -> list[dict[str, Any]]:
        """Settle scale actions a killed process left pending, against the cloud's state
        now. `gpuscale defrag` journals into the same state directory when it runs beside
        the loop; its moves and repartitions are its own to settle (a repartition may still
        be under way at the MIG manager while the loop restarts)."""
        pending = [a for a in self.system.log.pending() if a.kind in SCALE_ACTIONS]
        if not pending:
            return []
        provider = self.system.provider
        provider.refresh()
        groups = {g.id(): g for g in provider.node_groups()}
        settled = []
        for action in pending:
            if action.kind in ("set_target", "lower_target") and action.pool in groups:
                target = groups[action.pool].target_size()
                wanted = int(action.params["to"])
                # A growth is there at or above its target, a lowering at or below it.
                applied = target >= wanted if action.kind == "set_target" else target <= wanted
                if applied:
                    status, why = "done", f"found applied after a restart (target {target})"
                else:
                    status = "superseded"
                    why = f"not applied before a restart (target {target}); re-planned"
            else:
                status, why = "superseded", "interrupted by a restart; re-planned"
            self.system.log.complete(action.id, status, why)
            settled.append(
                {"action": f"resolve {action.kind}", "node": action.target, "status": status}
                | {"result": why}
            )
        return settled

    def settle_interrupted(self) -> None:
        """Give the decision of a pass a kill interrupted its outcome (after
        `resolve_journal` has settled its actions): superseded, with how each of its
        actions ended. This pass plans afresh from what the cloud shows now."""
        log_ = self.system.log
        last = log_.load(DECIDING_KEY)
        entry = log_.decision(last) if last is not None else None
        if entry is None or entry.outcome is not None:
            return
        actions = [
            {"action": a.kind, "node": a.target, "status": a.status, "result": a.result}
            for a in log_.actions(decision_ids=[entry.id])
        ]
        log.info("decision %d was interrupted: superseded by the next pass", entry.id)
        log_.finish(
            entry.id,
            {
                "superseded": True,
                "reason": "the pass was interrupted (the process stopped); its actions were"
                " settled against the cloud and the next pass planned afresh",
                "actions": actions,
            },
        )

    # ---- acting ---------------------------------------------------------------------------
    def _act(self, decision: PassDecision, decision_id: int, outcome: PassOutcome) -> None:
        groups = {g.id(): g for g in self.system.provider.node_groups()}
        provider = self.config.provider
        for pool in self.config.pools:
            target = decision.fleet.targets.get(pool.name, 0)
            wanted = decision.desired[pool.name]
            if provider.sets_sizes and wanted > target and pool.name in groups:
                outcome.actions.append(self._grow(decision_id, groups[pool.name], target, wanted))
        # Before the removals, which take the target on from the nodes held to what the
        # plan wants, one node at a time.
        for cut in decision.lowered:
            if cut.pool in groups:
                outcome.actions.append(self._lower(decision_id, groups[cut.pool], cut))
        self._remove_all(decision_id, decision.removals, outcome)
        for node in stale_cordons(decision.fleet, decision.removals):
            outcome.actions.append(self._uncordon(decision_id, node))
        kube = self.config.kubernetes
        if kube is not None and self.system.kube is not None:
            self._pre_position(decision, decision_id, outcome, kube)
        outcome.errors.extend(a["result"] for a in outcome.actions if a["status"] == "failed")

    def _pre_position(
        self,
        decision: PassDecision,
        decision_id: int,
        outcome: PassOutcome,
        kube: KubernetesSection,
    ) -> None:
        assert self.system.kube is not None
        if kube.pre_position == "capacity-buffer":
            self._set_buffers(decision, decision_id, kube.capacity_buffers, outcome)
        elif kube.pre_position == "placeholders":
            self._check_leader()
            try:
                changes = Placeholders(self.system.kube, kube.placeholders).reconcile(
                    decision.placeholders
                )
            except (KubeError, ValidationError) as exc:
                outcome.errors.append(f"placeholders: {exc}")
            else:
                outcome.placeholders = {
                    "created": list(changes.created),
                    "replaced": list(changes.replaced),
                    "deleted": list(changes.deleted),
                    "waiting": list(changes.waiting),
                }

    def _set_buffers(
        self,
        decision: PassDecision,
        decision_id: int,
        settings: BufferSettings,
        outcome: PassOutcome,
    ) -> None:
        """Bring each pool's PodTemplate and CapacityBuffer to the plan, one journaled
        action per buffer that differs (none when all are as planned), and report the
        buffers whose status says the autoscaler does not hold their room."""
        assert self.system.kube is not None and self.config.kubernetes is not None
        buffers = CapacityBuffers(
            self.system.kube,
            settings,
            cache_of(self.observe),  # from the watched cache the pass reads, if any
            self.config.kubernetes.request_timeout_s,
        )
        self._check_leader()
        try:
            existing = buffers.current()
            changes = buffers.changes(decision.buffers, existing)
        except KubeError as exc:
            outcome.actions.append(
                {"action": "set_buffer", "node": None, "status": "failed"} | {"result": str(exc)}
            )
            return
        outcome.buffers_not_ready = {
            name: why for name, found in sorted(existing.items()) if (why := not_ready(found))
        }
        self._buffer_problems.report(outcome.buffers_not_ready.values())
        reasons = {b.pool: b.reason for b in decision.buffers}
        log_ = self.system.log
        for change in changes:
            self._check_leader()
            action = log_.begin(
                decision_id, change.pool, "set_buffer", change.buffer, change.to_dict()
            )
            self.pause("journaled")
            entry: dict[str, Any] = {"action": "set_buffer", "node": change.buffer}
            try:
                buffers.apply(change)
            except KubeError as exc:
                log_.complete(action, "failed", str(exc))
                outcome.actions.append(entry | {"status": "failed", "result": str(exc)})
                continue
            self.pause("acted")
            why = change.summary
            if change.pool in reasons:
                why += f" ({reasons[change.pool]})"
            log_.complete(action, "done", why)
            outcome.actions.append(entry | {"status": "done", "result": why})

    def _grow(self, decision_id: int, group: Any, target: int, wanted: int) -> dict[str, Any]:
        self._check_leader()
        pool = group.id()
        log_ = self.system.log
        action = log_.begin(decision_id, pool, "set_target", pool, {"from": target, "to": wanted})
        self.pause("journaled")
        try:
            group.increase_size(wanted - target)
        except ProviderError as exc:
            log_.complete(action, "failed", str(exc))
            return {"action": "set_target", "node": pool, "status": "failed", "result": str(exc)}
        self.pause("acted")
        reached = group.target_size()  # the cloud's own maximum may have stopped it short
        why = f"target {target} -> {reached}"
        if reached < wanted:
            why += f" ({wanted} asked; the group's max is {group.max_size()})"
        log_.complete(action, "done", why)
        return {"action": "set_target", "node": pool, "status": "done", "result": why}

    def _lower(self, decision_id: int, group: Any, cut: TargetCut) -> dict[str, Any]:
        self._check_leader()
        log_ = self.system.log
        params = {"from": cut.target, "to": cut.to}
        action = log_.begin(decision_id, cut.pool, "lower_target", cut.pool, params)
        self.pause("journaled")
        entry: dict[str, Any] = {"action": "lower_target", "node": cut.pool}
        try:
            group.decrease_target_size(cut.target - cut.to)
        except ProviderError as exc:
            log_.complete(action, "failed", str(exc))
            return entry | {"status": "failed", "result": str(exc)}
        self.pause("acted")
        why = (
            f"target {cut.target} -> {group.target_size()} (launches not fulfilled: the group"
            f" holds {cut.holds} nodes, {cut.wanted} wanted)"
        )
        log_.complete(action, "done", why)
        return entry | {"status": "done", "result": why}

    def _remove_all(
        self, decision_id: int, removals: Sequence[Removal], outcome: PassOutcome
    ) -> None:
        """Take the pass's nodes out. Those gpuscale drains are all cordoned before the
        first drain starts, so what one drain evicts, or a new pod, lands on no node about
        to go; they are then drained together and each deleted once empty
        (`NodeRemoval.finish_all`), or skipped when pods arrived since the scale-down
        check, each journaled as it ends. The others the provider deletes."""
        kube = self.config.kubernetes
        drains = self.config.provider.scale_down == "drain"
        if not (drains and kube is not None and self.system.kube is not None):
            outcome.actions.extend(self._delete(decision_id, r) for r in removals)
            return
        removing = NodeRemoval(
            self.system.kube,
            self.system.provider,
            DrainSettings(kube.drain.timeout_s, kube.drain.poll_s, kube.drain.rules()),
            names=kube_names(kube),
            may_act=self._check_leader,  # a drain outlasts a lease: asked all along
        )
        cordoned: list[tuple[Removal, int]] = []
        try:
            for removal in removals:
                if removal.kube_name is None:  # not registered: nothing there to drain
                    outcome.actions.append(self._delete(decision_id, removal))
                    continue
                self._check_leader()
                action = self._begin_removal(decision_id, removal)
                try:
                    refused = removing.prepare(removal.kube_name)
                except KubeError as exc:
                    outcome.actions.append(self._settle(removing, removal, action, exc))
                    continue
                if refused is None:
                    cordoned.append((removal, action))
                else:
                    outcome.actions.append(self._settle(removing, removal, action, refused))
            if cordoned:
                self.pause("cordoned")
            waiting = {r.kube_name: (r, action) for r, action in cordoned}
            draining = [(r.kube_name or "", frozenset(r.pods)) for r, _ in cordoned]
            for name, result in removing.finish_all(draining):
                removal, action = waiting[name]
                cordoned.remove((removal, action))
                outcome.actions.append(self._settle(removing, removal, action, result))
        except NotLeader as lost:
            self._abandon(removing, cordoned, lost)
            raise

    def _abandon(
        self, removing: NodeRemoval, cordoned: Sequence[tuple[Removal, int]], lost: NotLeader
    ) -> None:
        """The lease is lost mid-removal: the nodes this pass cordoned and did not remove
        serve again, before anything more is evicted or deleted (the new leader plans
        them afresh), and their actions are closed as stopped."""
        for removal, action in cordoned:
            why = f"stopped: {lost}"
            try:
                removing.uncordon(removal.kube_name or "")
            except KubeError as exc:
                why += f"; left cordoned: {exc}"
            self.system.log.complete(action, "failed", why)

    def _begin_removal(self, decision_id: int, removal: Removal) -> int:
        action = self.system.log.begin(
            decision_id, removal.pool, "remove_node", removal.cloud_name, removal.to_dict()
        )
        self.pause("journaled")
        return action

    def _settle(
        self,
        removing: NodeRemoval,
        removal: Removal,
        action: int,
        result: RemovalOutcome | Exception,
    ) -> dict[str, Any]:
        """Journal how a drained removal ended; a node that did not go serves again."""
        assert removal.kube_name is not None
        entry = removal.action_entry()
        if isinstance(result, Exception):
            status, why = "failed", str(result)
        else:
            status, why = _status_of(result.status), result.reason
            if result.status is not RemovalStatus.REMOVED:
                if result.blocking:
                    entry["blocking"] = [
                        {"pod": f"{b.namespace}/{b.name}", "budget": b.budget, "reason": b.reason}
                        for b in result.blocking
                    ]
                try:
                    removing.uncordon(removal.kube_name)
                except KubeError as exc:
                    status, why = "failed", f"{why}; then {exc}"
                # Pods that arrived are checked next pass; a refusal or block lasts a while.
                if result.status is not RemovalStatus.SKIPPED:
                    self._mark_unremovable(removal.cloud_name)
        self.pause("acted")
        self.system.log.complete(action, status, why)
        return entry | {"status": status, "result": why}

    def _delete(self, decision_id: int, removal: Removal) -> dict[str, Any]:
        """A node the provider takes out as it is: not registered, or drained by the
        provider itself (scale_down: provider), or no cluster to drain it in."""
        self._check_leader()
        action = self._begin_removal(decision_id, removal)
        entry = removal.action_entry()
        try:
            group = self.system.provider.node_group_for(removal.cloud_name)
            if group is None:
                status, why = "done", "the cloud no longer holds it"
            else:
                group.delete_nodes([removal.cloud_name])
                status, why = "done", f"deleted from node group {group.id()}"
        except (ProviderError, KubeError) as exc:
            status, why = "failed", str(exc)
        self.pause("acted")
        self.system.log.complete(action, status, why)
        return entry | {"status": status, "result": why}

    def _uncordon(self, decision_id: int, node: ObservedNode) -> dict[str, Any]:
        self._check_leader()
        assert self.system.kube is not None
        log_ = self.system.log
        action = log_.begin(decision_id, node.pool or "", "uncordon", node.cloud_name, {})
        self.pause("journaled")
        try:
            names = kube_names(self.config.kubernetes)
            NodeRemoval(self.system.kube, self.system.provider, names=names).uncordon(node.name)
        except KubeError as exc:
            log_.complete(action, "failed", str(exc))
            return {"action": "uncordon", "node": node.cloud_name, "status": "failed"} | {
                "result": str(exc)
            }
        self.pause("acted")
        why = "no longer to be removed"
        log_.complete(action, "done", why)
        return {"action": "uncordon", "node": node.cloud_name, "status": "done", "result": why}

    # ---- state ------------------------------------------------------------------------------
    def _check_leader(self) -> None:
        if self.elector is not None:
            self.elector.check()

    def _unremovable(self, now: datetime) -> frozenset[str]:
        until: dict[str, float] = self.system.log.load(UNREMOVABLE_KEY, {})
        stamp = now.timestamp()
        return frozenset(node for node, t in until.items() if t > stamp)

    def _mark_unremovable(self, cloud_name: str) -> None:
        kube = self.config.kubernetes
        seconds = kube.drain.unremovable_s if kube is not None else 0.0
        until: dict[str, float] = self.system.log.load(UNREMOVABLE_KEY, {})
        now = self.clock().timestamp()
        until = {node: t for node, t in until.items() if t > now}
        until[cloud_name] = now + seconds
        self.system.log.save(UNREMOVABLE_KEY, until)


def _status_of(status: RemovalStatus) -> str:
    return {
        RemovalStatus.REMOVED: "done",
        RemovalStatus.BLOCKED: "blocked",
        RemovalStatus.REFUSED: "failed",
        RemovalStatus.SKIPPED: "skipped",
    }[status]
