"""Static Karpenter NodePools as node groups: gpuscale sets `spec.replicas`.

A static NodePool (karpenter.sh/v1 with `spec.replicas`, Karpenter's StaticCapacity
feature gate) keeps that many NodeClaims whatever the pods ask: Karpenter launches the
missing ones and, when replicas drop, deletes NodeClaims of its own choosing (unlaunched,
then empty ones), draining their nodes as it terminates them (kubernetes-sigs/karpenter,
designs/static-capacity.md). Each pool is bound to one such NodePool.

- The target is `spec.replicas`, set (never incremented from a stale read: the NodePool
  is read again right before each change); the bounds are the pool's, and Karpenter's
  `limits.nodes` where the NodePool has one.
- A pool's nodes are its NodeClaims (label `karpenter.sh/nodepool`) not being deleted,
  booting until their Ready condition holds, each named as the fleet names nodes: the
  instance id its providerID ends in, or the NodeClaim's name before it has launched.
- Removing named nodes deletes their NodeClaims (Karpenter's termination cordons and drains
  each, honouring PodDisruptionBudgets, and ends its instance) and then lowers replicas by
  as many. In that order: lowered first, Karpenter could delete NodeClaims of its choosing
  before ours went; deleted first, ours no longer count as running when the lower
  number arrives, so Karpenter has nothing more to remove.
- Replicas above the NodeClaims (ones Karpenter could not launch for want of capacity, and
  retries) can be lowered as far as the NodeClaims that exist, so Karpenter deletes none.

Failures of the API server become `ProviderError`, as a cloud's do.

Once `read_through` hands it the process's watched cluster cache (`scale` and `serve` do),
a refresh reads the NodePools and NodeClaims from there (listed once, then watched)
instead of listing them each pass; the read right before a change still asks the API
server.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from http import HTTPStatus
from typing import Any

from kubernetes import client as k8s
from kubernetes.utils import parse_quantity
from pydantic import BaseModel, ConfigDict, Field, model_validator

from predictor.telemetry.watch_cache import ClusterCache
from scaler.cluster.pools import NodePool
from scaler.kube.errors import KubeError, kube_call
from scaler.providers.base import Node, NodeStatus, ProviderError, kube_time
from scaler.providers.pool_group import CloudStateGroup

GROUP = "karpenter.sh"
VERSION = "v1"
NODE_POOL_LABEL = "karpenter.sh/nodepool"  # on a NodeClaim and its node: the NodePool
_KINDS = {"nodepools": "NodePools", "nodeclaims": "NodeClaims"}  # plural: as errors say it


class KarpenterPoolBinding(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    pool: str = Field(min_length=1)
    node_pool: str = Field(min_length=1, description="a static NodePool (spec.replicas)")


class KarpenterSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    node_pools: tuple[KarpenterPoolBinding, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> KarpenterSettings:
        pools = [b.pool for b in self.node_pools]
        if len(set(pools)) != len(pools):
            raise ValueError("a pool is bound twice")
        node_pools = [b.node_pool for b in self.node_pools]
        if len(set(node_pools)) != len(node_pools):
            raise ValueError("a NodePool is bound to two pools")
        return self


@dataclass(frozen=True, slots=True)
class _Claim:
    name: str  # the NodeClaim's
    node: str  # as the fleet names the node (see the module docstring)
    ready: bool
    created: datetime


@dataclass(frozen=True, slots=True)
class _PoolState:
    replicas: int
    node_limit: int | None
    claims: tuple[_Claim, ...]


def read_claim(obj: Mapping[str, Any]) -> _Claim:
    meta = obj.get("metadata") or {}
    status = obj.get("status") or {}
    provider_id = str(status.get("providerID") or "")
    conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
    return _Claim(
        name=str(meta.get("name") or ""),
        node=provider_id.rstrip("/").rsplit("/", 1)[-1] if provider_id else str(meta["name"]),
        ready=conditions.get("Ready") == "True",
        created=kube_time(meta.get("creationTimestamp")),
    )


def _claims(objects: Sequence[Mapping[str, Any]]) -> dict[str, tuple[_Claim, ...]]:
    """NodeClaims not being deleted, by NodePool."""
    out: dict[str, list[_Claim]] = {}
    for obj in objects:
        meta = obj.get("metadata") or {}
        owner = (meta.get("labels") or {}).get(NODE_POOL_LABEL)
        if owner and meta.get("deletionTimestamp") is None:
            out.setdefault(owner, []).append(read_claim(obj))
    return {pool: tuple(sorted(found, key=lambda c: c.name)) for pool, found in out.items()}


def _node_limit(node_pool: Mapping[str, Any]) -> int | None:
    # limits is a ResourceList: nodes is a quantity ("2k", "1e3"), not only digits.
    limit = ((node_pool.get("spec") or {}).get("limits") or {}).get("nodes")
    return None if limit is None else math.floor(parse_quantity(limit))


class KarpenterCloud:
    """A `CloudProvider` over static Karpenter NodePools."""

    def __init__(
        self, pools: Sequence[NodePool], settings: KarpenterSettings, api: k8s.ApiClient
    ) -> None:
        by_name = {p.name: p for p in pools}
        unknown = [b.pool for b in settings.node_pools if b.pool not in by_name]
        if unknown:
            raise ProviderError(f"bound pools not in the pool list: {', '.join(unknown)}")
        self._custom = k8s.CustomObjectsApi(api)
        self._groups = {
            b.pool: KarpenterNodeGroup(self, by_name[b.pool], b.node_pool)
            for b in settings.node_pools
        }
        self._cache: ClusterCache | None = None
        self._wait_s = 10.0

    def read_through(self, cache: ClusterCache, wait_s: float) -> None:
        """Refresh from `cache`, the process's watched cluster cache, from now on (its first
        list of NodePools and of NodeClaims waited for up to `wait_s`)."""
        self._cache, self._wait_s = cache, wait_s

    # CloudProvider ---------------------------------------------------------------------
    def name(self) -> str:
        return "karpenter"

    def node_groups(self) -> list[KarpenterNodeGroup]:
        return list(self._groups.values())

    def node_group_for(self, node_name: str) -> KarpenterNodeGroup | None:
        for group in self._groups.values():
            if group._claim(node_name) is not None:
                return group
        return None

    def refresh(self) -> None:
        """Every NodePool and every NodeClaim: from the watched cache, else two lists."""
        by_name = {p["metadata"]["name"]: p for p in self._objects("nodepools")}
        claims = _claims(self._objects("nodeclaims"))
        for group in self._groups.values():
            found = by_name.get(group.node_pool)
            if found is None:
                raise ProviderError(f"{group.id()}: no NodePool {group.node_pool}")
            group._state = group._state_of(found, claims.get(group.node_pool, ()))

    # Calls -----------------------------------------------------------------------------
    def _call(self, what: str, request: Any, expect: Sequence[int] = ()) -> Any:
        try:
            return kube_call(what, request, expect=expect)
        except KubeError as exc:
            raise ProviderError(str(exc)) from None

    def _objects(self, plural: str, fresh: bool = False) -> list[dict[str, Any]]:
        """Every object of `plural` (nodepools, nodeclaims): the watched cache's unless
        `fresh` or there is none, else listed now."""

        def list_them(**kwargs: Any) -> Any:
            return self._custom.list_cluster_custom_object(GROUP, VERSION, plural, **kwargs)

        what = f"list {_KINDS[plural]}"
        if self._cache is None or fresh:
            return self._call(what, list_them).get("items") or []
        kind = self._cache.watch_kind(plural, list_them)
        if not kind.wait_listed(self._wait_s):
            raise ProviderError(f"{what}: {kind.error or 'not listed yet'}")
        return kind.objects()

    def _read(self, group: KarpenterNodeGroup) -> _PoolState:
        node_pool = self._call(
            f"{group.id()}: read NodePool {group.node_pool}",
            lambda: self._custom.get_cluster_custom_object(
                GROUP, VERSION, "nodepools", group.node_pool
            ),
        )
        claims = _claims(self._objects("nodeclaims", fresh=True))
        return group._state_of(node_pool, claims.get(group.node_pool, ()))

    def _set_replicas(self, group: KarpenterNodeGroup, replicas: int) -> None:
        self._call(
            f"{group.id()}: set replicas of NodePool {group.node_pool} to {replicas}",
            lambda: self._custom.patch_cluster_custom_object(
                GROUP, VERSION, "nodepools", group.node_pool, {"spec": {"replicas": replicas}}
            ),
        )

    def _delete_claim(self, group: KarpenterNodeGroup, name: str) -> None:
        self._call(
            f"{group.id()}: delete NodeClaim {name}",
            lambda: self._custom.delete_cluster_custom_object(GROUP, VERSION, "nodeclaims", name),
            expect=(HTTPStatus.NOT_FOUND,),  # gone already
        )


class KarpenterNodeGroup(CloudStateGroup[_PoolState]):
    """One pool backed by a static NodePool (a `NodeGroup`)."""

    def __init__(self, cloud: KarpenterCloud, pool: NodePool, node_pool: str) -> None:
        super().__init__(pool)
        self._cloud = cloud
        self.node_pool = node_pool

    def max_size(self) -> int:
        limit = self._current().node_limit
        return self._pool.max_size if limit is None else min(self._pool.max_size, limit)

    def target_size(self) -> int:
        return self._current().replicas

    def _max_reason(self) -> str:
        limit = self._current().node_limit
        if limit is None or limit >= self._pool.max_size:
            return super()._max_reason()
        return f"limits.nodes of NodePool {self.node_pool}"

    def delete_nodes(self, names: Sequence[str]) -> None:
        target = self._shrunk_target(names)
        claims = {n: self._claim(n) for n in names}

        def delete(node: str) -> None:
            claim = claims[node]
            assert claim is not None
            self._cloud._delete_claim(self, claim.name)

        try:
            self._remove_each(names, delete, "deleted")
            self._cloud._set_replicas(self, target)
        finally:
            self._reload()

    def nodes(self) -> list[Node]:
        boot = timedelta(seconds=self._pool.boot_seconds)
        return [
            Node(
                name=c.node,
                pool=self.id(),
                status=NodeStatus.READY if c.ready else NodeStatus.BOOTING,
                launched_at=c.created,
                ready_at=None if c.ready else c.created + boot,
            )
            for c in self._current().claims
        ]

    # Internals used by the cloud ---------------------------------------------------------
    def _state_of(self, node_pool: Mapping[str, Any], claims: Sequence[_Claim]) -> _PoolState:
        replicas = (node_pool.get("spec") or {}).get("replicas")
        if replicas is None:
            raise ProviderError(
                f"{self.id()}: NodePool {self.node_pool} is not static (no spec.replicas):"
                " Karpenter sizes it; use provider kind autoscaler for it"
            )
        return _PoolState(int(replicas), _node_limit(node_pool), tuple(claims))

    def _read(self) -> _PoolState:
        return self._cloud._read(self)

    def _set_target(self, target: int) -> None:
        self._cloud._set_replicas(self, target)

    def _holds(self, name: str) -> bool:
        return self._claim(name) is not None

    def _claim(self, node: str) -> _Claim | None:
        for claim in self._current().claims:
            if node in (claim.node, claim.name):
                return claim
        return None
