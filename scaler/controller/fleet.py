"""The fleet as the loop sees it: the provider's nodes, joined to Kubernetes by providerID.

For each node the view knows its pool, whether it is booting or ready, its Kubernetes name
(when it has registered), whether real GPU jobs run on it (such a node is never chosen for
removal: a scale-down must not kill training), how many pods a drain would have to move,
and whether gpuscale cordoned it. It also counts, per pool, the GPUs real pods hold or
wait for, which sizes the placeholders. Placeholders, DaemonSet and mirror pods and
finished pods are not real work here.

Without Kubernetes the view has only the provider's nodes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from kubernetes import client as k8s

from predictor.telemetry.kube_objects import KubeNames, read_pod
from scaler.kube.errors import API_ERRORS, kube_error
from scaler.kube.nodes import (
    CORDONED_BY_GPUSCALE,
    cloud_node_name,
    goes_with_node,
    has_finished,
    is_placeholder,
)
from scaler.planning.planner import FleetState, PoolFleet
from scaler.providers.base import CloudProvider, NodeStatus


@dataclass(frozen=True, slots=True)
class NodeView:
    cloud_name: str
    pool: str
    status: NodeStatus
    launched_at: datetime
    kube_name: str | None = None
    busy: bool = False  # real GPU pods run here
    movable_pods: int = 0  # real pods a drain would evict
    cordoned_by_us: bool = False

    def to_dict(self) -> dict[str, object]:
        return {
            "node": self.cloud_name,
            "kube_node": self.kube_name,
            "status": str(self.status),
            "busy": self.busy,
            "movable_pods": self.movable_pods,
            "cordoned_by_gpuscale": self.cordoned_by_us,
        }


@dataclass(frozen=True)
class FleetView:
    """Nodes per pool, the providers' target sizes, and GPUs in real use per pool."""

    nodes: Mapping[str, tuple[NodeView, ...]]
    targets: Mapping[str, int]
    used_gpus: Mapping[str, int] = field(default_factory=dict)
    kubernetes: bool = False

    def all_nodes(self) -> list[NodeView]:
        return [n for nodes in self.nodes.values() for n in nodes]

    def removable(self, pool: str, unremovable: frozenset[str]) -> list[NodeView]:
        """Ready nodes the planner may count as idle or drainable now."""
        return [
            n
            for n in self.nodes.get(pool, ())
            if n.status is NodeStatus.READY
            and not n.busy
            and n.cloud_name not in unremovable
            and (n.kube_name is not None or not self.kubernetes)
        ]

    def fleet_state(
        self, at: datetime, unremovable: frozenset[str], lost: Mapping[str, int]
    ) -> FleetState:
        pools = []
        for pool, nodes in self.nodes.items():
            ready = sum(n.status is NodeStatus.READY for n in nodes)
            pools.append(
                PoolFleet(
                    pool=pool,
                    ready=ready,
                    booting=len(nodes) - ready,
                    removable=len(self.removable(pool, unremovable)),
                    lost=lost.get(pool, 0),
                )
            )
        return FleetState(at=at, pools=tuple(pools))

    def to_dict(self) -> dict[str, object]:
        return {
            "targets": dict(self.targets),
            "used_gpus": dict(self.used_gpus),
            "nodes": {pool: [n.to_dict() for n in nodes] for pool, nodes in self.nodes.items()},
        }


def observe_fleet(
    provider: CloudProvider,
    pools: Sequence[str],
    api: k8s.ApiClient | None,
    pool_label: str,
    gpu_resource: str,
    assume_idle: bool = False,
) -> FleetView:
    """Read the provider (after a refresh) and, when given, the cluster. Without a
    cluster, ready nodes count as idle only when `assume_idle` (a simulated cloud, where
    nothing runs); elsewhere they are treated as busy, since nothing can drain them."""
    provider.refresh()
    groups = {g.id(): g for g in provider.node_groups()}
    cloud_nodes = {pool: groups[pool].nodes() if pool in groups else [] for pool in pools}
    targets = {pool: groups[pool].target_size() if pool in groups else 0 for pool in pools}
    if api is None:
        nodes = {
            pool: tuple(
                NodeView(
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
        return FleetView(nodes, targets)

    names = KubeNames(gpu_resource=gpu_resource, pool_label=pool_label)
    core = k8s.CoreV1Api(api)
    try:
        kube_nodes = core.list_node().items
        pods = core.list_pod_for_all_namespaces().items
    except API_ERRORS as exc:
        raise kube_error("read nodes and pods", exc) from None
    by_cloud = {cloud_node_name(n): n for n in kube_nodes}
    pool_of_kube: dict[str, str] = {}
    for pool, found in cloud_nodes.items():
        for n in found:
            if n.name in by_cloud:
                pool_of_kube[by_cloud[n.name].metadata.name] = pool
    for n in kube_nodes:  # nodes the provider does not list still belong to their pool
        label = (n.metadata.labels or {}).get(pool_label)
        if label in cloud_nodes:
            pool_of_kube.setdefault(n.metadata.name, label)

    gpu_pods: dict[str, int] = {}
    movable: dict[str, int] = {}
    used: dict[str, int] = dict.fromkeys(pools, 0)
    for pod in pods:
        if is_placeholder(pod) or goes_with_node(pod) or has_finished(pod):
            continue
        request = read_pod(api.sanitize_for_serialization(pod), names)
        gpus = request.gpus
        node = pod.spec.node_name
        if node:
            movable[node] = movable.get(node, 0) + 1
            if gpus:
                gpu_pods[node] = gpu_pods.get(node, 0) + 1
            pool = pool_of_kube.get(node)
        else:
            pool = request.wanted_pool
        if gpus and pool in used:
            used[pool] += gpus

    nodes = {}
    for pool, found in cloud_nodes.items():
        views = []
        for n in found:
            kube = by_cloud.get(n.name)
            name = kube.metadata.name if kube is not None else None
            annotations = (kube.metadata.annotations or {}) if kube is not None else {}
            views.append(
                NodeView(
                    cloud_name=n.name,
                    pool=pool,
                    status=n.status,
                    launched_at=n.launched_at,
                    kube_name=name,
                    busy=bool(name and gpu_pods.get(name)),
                    movable_pods=movable.get(name, 0) if name else 0,
                    cordoned_by_us=CORDONED_BY_GPUSCALE in annotations,
                )
            )
        nodes[pool] = tuple(views)
    return FleetView(nodes, targets, used, kubernetes=True)
