"""Pools a node autoscaler sizes (Cluster Autoscaler, Karpenter's dynamic NodePools):
gpuscale observes them and never resizes them.

Each pool's nodes are the Kubernetes nodes carrying its pool label (`kubernetes.pool_label`;
`karpenter.sh/nodepool` names a Karpenter NodePool), booting until Ready, named as the
fleet names a node (the instance id its providerID ends in, else its name). A pool's target
is its node count. The autoscaler adds nodes for pending pods and for the capacity
gpuscale asks through CapacityBuffers or placeholder pods, and removes them by its own
scale-down (consolidation): `increase_size`, `decrease_target_size` and `delete_nodes`
refuse, and the loop, whose config says so (`provider.scale_down: none`), never asks.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

from kubernetes import client as k8s

from predictor.telemetry.kube_objects import KUBE_NAMES, KubeNames, read_node
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
        try:
            listing = kube_call("list nodes", self._core.list_node)
        except KubeError as exc:
            raise ProviderError(str(exc)) from None
        found: dict[str, list[Node]] = {name: [] for name in self._groups}
        as_json = self._core.api_client.sanitize_for_serialization
        for raw in listing.items or []:
            obj = as_json(raw)
            facts = read_node(obj, self._names)
            if facts.pool not in found:
                continue
            launched = kube_time(obj.get("metadata", {}).get("creationTimestamp"))
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
