"""The fleet as the loop sees it: the provider's nodes, joined to Kubernetes by providerID.

For each node the view knows its pool, whether it is booting or ready, its Kubernetes name
(when it has registered: then it is checked before it goes, booting or not), whether real
GPU jobs run on it (such a node is never chosen for removal: a scale-down must not kill
training), how many pods a drain would have to move, whether gpuscale cordoned it, and
whether it may go at all: a node someone else cordoned is theirs, and one with a pod no
drain may take (`drainability.why_undrainable`: one nothing would recreate, one not safe
to evict, a kube-system pod no budget covers, one with local storage) is not drainable,
as in Cluster Autoscaler. Once `with_removal_checks` has run it knows, for the others,
whether the scale-down check found their pods room elsewhere (with the pending pods that
fit now already placed, as Cluster Autoscaler does). It also counts, per pool, the GPUs
real pods hold or wait for (shared GPUs as their shares; pending Kueue Workloads' too).
What Kubernetes shows comes from the one cluster snapshot (`scaler.kube.observed`), kept
in the view for the loop's reactive floor and placeholder sizing.

Without Kubernetes the view has only the provider's nodes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime

from kubernetes import client as k8s

from predictor.telemetry.kube_objects import KUBE_NAMES, KubeNames
from scaler.cluster.job import Job
from scaler.cluster.snapshot import ClusterState
from scaler.controller.removal_order import RemovalCandidate, removal_order
from scaler.kube.drainability import (
    CLUSTER_AUTOSCALER_RULES,
    DrainRules,
    SystemBudgets,
    undrainable,
)
from scaler.kube.nodes import OTHERS_CORDON
from scaler.kube.observed import (
    ObserveCluster,
    ObservedCluster,
    ObservedNode,
    observe_cluster,
)
from scaler.placement.decision import Placement
from scaler.placement.engine import commit, place
from scaler.placement.estimator import job_shape
from scaler.placement.policies.base import Policy
from scaler.placement.queue import QueuePolicy, admission_order
from scaler.placement.scale_down import check_removals
from scaler.planning.planner import FleetCapacity, PoolCapacity
from scaler.providers.base import CloudProvider, NodeStatus

FIFO = QueuePolicy(order="fifo")  # how kube-scheduler's queue offers pending pods a node


@dataclass(frozen=True, slots=True)
class FleetNode:
    cloud_name: str
    pool: str
    status: NodeStatus
    launched_at: datetime
    kube_name: str | None = None
    busy: bool = False  # real GPU pods run here
    movable_pods: int = 0  # real pods a drain would evict
    pods: tuple[str, ...] = ()  # which (ids): the pods its scale-down check found room for
    cordoned_by_us: bool = False
    drainable: bool | None = None  # may it go (the scale-down check, or a reason before it)
    check: str = ""  # why, in its words

    @property
    def booting(self) -> bool:
        return self.status is NodeStatus.BOOTING

    @property
    def unregistered(self) -> bool:
        """Booting and not registered in Kubernetes: no pod can run there yet, so it alone
        may go unchecked. A node the cloud still calls booting (an instance held by a
        lifecycle hook, a NodeClaim not yet Ready) that has registered may run pods
        already, and is checked like a ready one."""
        return self.booting and self.kube_name is None

    def to_dict(self) -> dict[str, object]:
        return {
            "node": self.cloud_name,
            "kube_node": self.kube_name,
            "status": str(self.status),
            "busy": self.busy,
            "movable_pods": self.movable_pods,
            "cordoned_by_gpuscale": self.cordoned_by_us,
            "drainable": self.drainable,
            "check": self.check,
        }


@dataclass(frozen=True)
class ObservedFleet:
    """Nodes per pool, the providers' target sizes, and GPUs in real use per pool."""

    nodes: Mapping[str, tuple[FleetNode, ...]]
    targets: Mapping[str, int]
    used_gpus: Mapping[str, float] = field(default_factory=dict)
    kubernetes: bool = False
    cluster: ObservedCluster | None = None

    def all_nodes(self) -> list[FleetNode]:
        return [n for nodes in self.nodes.values() for n in nodes]

    def removable(self, pool: str, unremovable: frozenset[str]) -> list[FleetNode]:
        """Nodes past booting, or registered, that the planner may count as idle or
        drainable now (the unregistered ones may always go)."""
        return [
            n
            for n in self.nodes.get(pool, ())
            if not n.unregistered
            and not n.busy
            and n.drainable is not False
            and n.cloud_name not in unremovable
            and (n.kube_name is not None or not self.kubernetes)
        ]

    def removal_candidates(self, pool: str, unremovable: frozenset[str]) -> list[RemovalCandidate]:
        """The pool's nodes for `removal_order`, each keyed by its FleetNode."""
        removable = {n.cloud_name for n in self.removable(pool, unremovable)}
        return [
            RemovalCandidate(
                key=n,
                launched_at=n.launched_at,
                booting=n.unregistered,
                removable=n.unregistered or n.cloud_name in removable,
                cordoned_by_us=n.cordoned_by_us,
                movable_pods=n.movable_pods,
            )
            for n in self.nodes.get(pool, ())
        ]

    def with_removal_checks(self, policy: Policy, unremovable: frozenset[str]) -> ObservedFleet:
        """The view with every registered node that could go checked (booting or not): may
        its pods, placeholders aside, go elsewhere? As in Cluster Autoscaler, the pending
        pods that fit now are placed first (see `with_pending`), so an idle node a pending
        pod is about to take is not removed under it. The nodes are then tried in the
        removal order on one scratch copy of the cluster, so the ones that pass may all go
        together."""
        if self.cluster is None or self.cluster.state is None:
            return self
        state = self.cluster.state
        index = {name: i for i, name in enumerate(state.names)}
        order = [
            c.key
            for pool in self.nodes
            for c in removal_order(self.removal_candidates(pool, unremovable))
            if not c.booting and c.key.kube_name in index
        ]
        about_to_run = with_pending(state, self.cluster.real_pending, policy)
        checks = check_removals(about_to_run, [index[n.kube_name] for n in order], policy)
        found = {c.node: c for c in checks}
        nodes = {
            pool: tuple(
                replace(n, drainable=found[n.kube_name].removable, check=found[n.kube_name].reason)
                if n.kube_name in found
                else n
                for n in views
            )
            for pool, views in self.nodes.items()
        }
        return replace(self, nodes=nodes)

    def booting(self) -> dict[str, int]:
        return {pool: sum(n.booting for n in nodes) for pool, nodes in self.nodes.items()}

    def sizes(self) -> dict[str, int]:
        """Nodes per pool now, booting ones included."""
        return {pool: len(nodes) for pool, nodes in self.nodes.items()}

    def fleet_state(
        self, at: datetime, unremovable: frozenset[str], lost: Mapping[str, int]
    ) -> FleetCapacity:
        pools = []
        for pool, nodes in self.nodes.items():
            # A registered node counts with the ready ones: it goes only once checked.
            ready = sum(not n.unregistered for n in nodes)
            pools.append(
                PoolCapacity(
                    pool=pool,
                    ready=ready,
                    booting=len(nodes) - ready,
                    removable=len(self.removable(pool, unremovable)),
                    lost=lost.get(pool, 0),
                )
            )
        return FleetCapacity(at=at, pools=tuple(pools))

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "targets": dict(self.targets),
            "used_gpus": dict(self.used_gpus),
            "nodes": {pool: [n.to_dict() for n in nodes] for pool, nodes in self.nodes.items()},
        }
        if self.cluster is not None:
            out["pending_pods"] = len(self.cluster.real_pending)
            out["unbound_pods"] = dict(self.cluster.unbound)
        return out


def with_pending(state: ClusterState, pending: Sequence[Job], policy: Policy) -> ClusterState:
    """A copy of `state` with every pending job that fits now bound where the engine would
    place it, offered a node in FIFO admission order as the scheduler's queue offers pods.
    Placeholders are left out first: a real pod preempts them, so their room is free to
    it (and the scale-down check would leave them out anyway)."""
    scratch = state.copy()
    for job_id in [j for j, a in scratch.jobs.items() if a.job.placeholder]:
        scratch.release(job_id)
    failed: set[tuple[object, ...]] = (
        set()
    )  # shapes that found no room: placing only fills the nodes
    for job in admission_order(pending, 0.0, FIFO):
        shape = job_shape(job)
        if shape in failed:
            continue
        decided = place(scratch, job, policy)
        if isinstance(decided, Placement):
            commit(scratch, job, decided)
        else:
            failed.add(shape)
    return scratch


def observe_fleet(
    provider: CloudProvider,
    pools: Sequence[str],
    api: k8s.ApiClient | None,
    names: KubeNames = KUBE_NAMES,
    assume_idle: bool = False,
    observe: ObserveCluster = observe_cluster,
    rules: DrainRules = CLUSTER_AUTOSCALER_RULES,
) -> ObservedFleet:
    """Read the provider (after a refresh) and, when given, the cluster (with `observe`:
    a process that reads the cluster elsewhere too passes its shared listing), a node
    with a pod `rules` say no drain may take not drainable. Without a cluster, ready nodes
    count as idle only when `assume_idle` (a simulated cloud, where nothing runs);
    elsewhere they are treated as busy, since nothing can drain them."""
    provider.refresh()
    groups = {g.id(): g for g in provider.node_groups()}
    cloud_nodes = {pool: groups[pool].nodes() if pool in groups else [] for pool in pools}
    targets = {pool: groups[pool].target_size() if pool in groups else 0 for pool in pools}
    if api is None:
        nodes = {
            pool: tuple(
                FleetNode(
                    n.name,
                    pool,
                    n.status,
                    n.launched_at,
                    busy=n.status is NodeStatus.READY and not assume_idle,
                )
                for n in found
            )
            for pool, found in cloud_nodes.items()
        }
        return ObservedFleet(nodes, targets)

    cluster = observe(api, names)
    by_cloud = {n.cloud_name: n for n in cluster.nodes.values()}
    pool_of_kube: dict[str, str] = {}
    for pool, found in cloud_nodes.items():
        for n in found:
            if n.name in by_cloud:
                pool_of_kube[by_cloud[n.name].name] = pool
    for n in cluster.nodes.values():  # nodes the provider does not list still belong
        if n.pool in cloud_nodes:
            pool_of_kube.setdefault(n.name, n.pool)

    used: dict[str, float] = dict.fromkeys(pools, 0.0)
    for name, pool in pool_of_kube.items():
        used[pool] += cluster.nodes[name].gpus_used
    for waiting in (cluster.pending_gpus, cluster.queued_gpus):
        for wanted, gpus in waiting.items():
            if wanted in used:
                used[wanted] += gpus

    nodes = {}
    for pool, found in cloud_nodes.items():
        views = []
        for n in found:
            kube = by_cloud.get(n.name)
            kept = _kept(kube, rules, cluster.budgets) if kube is not None else None
            views.append(
                FleetNode(
                    cloud_name=n.name,
                    pool=pool,
                    status=n.status,
                    launched_at=n.launched_at,
                    kube_name=kube.name if kube is not None else None,
                    busy=kube is not None and kube.busy,
                    movable_pods=kube.movable_pods if kube is not None else 0,
                    pods=kube.pods if kube is not None else (),
                    cordoned_by_us=kube is not None and kube.draining,
                    drainable=False if kept else None,
                    check=kept or "",
                )
            )
        nodes[pool] = tuple(views)
    return ObservedFleet(nodes, targets, used, kubernetes=True, cluster=cluster)


def _kept(node: ObservedNode, rules: DrainRules, budgets: SystemBudgets) -> str | None:
    """Why `node` may not go, whatever the scale-down check would say: someone else
    cordoned it (theirs to undo; gpuscale neither takes it nor uncordons it), or a pod
    there may not be drained (the first, by id)."""
    if node.cordoned and not node.draining:
        return OTHERS_CORDON
    kept = undrainable(node.evicted, rules, budgets)
    return kept[0][1] if kept else None
