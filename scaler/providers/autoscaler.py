"""Pools a node autoscaler sizes (Cluster Autoscaler, Karpenter's dynamic NodePools):
gpuscale observes them and never resizes them.

Each pool's nodes are the Kubernetes nodes carrying its pool label (`kubernetes.pool_label`;
`karpenter.sh/nodepool` names a Karpenter NodePool), booting until Ready, named as the
fleet names a node (the instance id its providerID ends in, else its name). A pool's target
is its node count. The autoscaler adds nodes for pending pods and for the capacity
gpuscale asks through CapacityBuffers or placeholder pods, and removes them by its own
scale-down (consolidation): `increase_size`, `decrease_target_size` and `delete_nodes`
refuse, and the loop, whose config says so (`provider.scale_down: none`), never asks.

Once `read_through` hands it the process's watched cluster cache (`scale` and `serve` do), a
refresh reads the nodes from there instead of listing every node of the cluster each pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

from kubernetes import client as k8s

from predictor.telemetry.kube_objects import KUBE_NAMES, KubeNames, NodeFacts, read_node
from predictor.telemetry.watch_cache import ClusterCache
from scaler.cluster.pools import NodePool
from scaler.kube.errors import KubeError, kube_call
from scaler.providers.base import Node, NodeStatus, ProviderError, kube_time
from scaler.providers.pool_group import PoolGroup


class AutoscaledCloud:
    """A read-only `CloudProvider` over the pools' Kubernetes nodes."""

    def __init__(
        self, pools: Sequence[NodePool], api: k8s.ApiClient, names: KubeNames = KUBE_NAMES
    ) -> None:
        self._core = k8s.CoreV1Api(api)
        self._names = names
        self._groups = {p.name: AutoscaledGroup(p) for p in pools}
        self._cache: ClusterCache | None = None
        self._wait_s = 0.0

    def read_through(self, cache: ClusterCache, wait_s: float) -> None:
        """Refresh from `cache`, the process's watched cluster cache, from now on (its first
        list of nodes waited for up to `wait_s`)."""
        self._cache, self._wait_s = cache, wait_s

    def name(self) -> str:
        return "autoscaler"

    def node_groups(self) -> list[AutoscaledGroup]:
        return list(self._groups.values())

    def node_group_for(self, node_name: str) -> AutoscaledGroup | None:
        for group in self._groups.values():
            if group._holds(node_name):
                return group
        return None

    def refresh(self) -> None:
        found: dict[str, list[Node]] = {name: [] for name in self._groups}
        for facts in self._nodes():
            if facts.pool not in found:
                continue
            launched = kube_time(facts.created)
            boot = timedelta(seconds=self._groups[facts.pool].template().boot_seconds)
            found[facts.pool].append(
                Node(
                    name=facts.cloud_name,
                    pool=facts.pool,
                    status=NodeStatus.READY if facts.ready else NodeStatus.BOOTING,
                    launched_at=launched,
                    ready_at=None if facts.ready else launched + boot,
                )
            )
        for name, group in self._groups.items():
            group._nodes = sorted(found[name], key=lambda n: n.name)

    def _nodes(self) -> list[NodeFacts]:
        """Every node of the cluster: the watched cache's, else listed now."""
        if self._cache is not None:
            if not self._cache.nodes.wait_listed(self._wait_s):
                raise ProviderError(f"list nodes: {self._cache.nodes.error or 'not listed yet'}")
            return self._cache.nodes.objects()
        try:
            listing = kube_call("list nodes", self._core.list_node)
        except KubeError as exc:
            raise ProviderError(str(exc)) from None
        as_json = self._core.api_client.sanitize_for_serialization
        return [read_node(as_json(raw), self._names) for raw in listing.items or []]


class AutoscaledGroup(PoolGroup):
    """One pool the node autoscaler sizes (a `NodeGroup` that only reports)."""

    def __init__(self, pool: NodePool) -> None:
        super().__init__(pool)
        self._nodes: list[Node] = []

    def target_size(self) -> int:
        return len(self._nodes)

    def increase_size(self, delta: int) -> None:
        raise ProviderError(f"{self.id()}: the node autoscaler sizes this pool")

    def decrease_target_size(self, delta: int) -> None:
        raise ProviderError(f"{self.id()}: the node autoscaler sizes this pool")

    def delete_nodes(self, names: Sequence[str]) -> None:
        raise ProviderError(f"{self.id()}: the node autoscaler removes this pool's nodes")

    def nodes(self) -> list[Node]:
        return list(self._nodes)

    def _holds(self, name: str) -> bool:
        return any(n.name == name for n in self._nodes)
