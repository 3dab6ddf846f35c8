"""Static Karpenter NodePools as node groups, against the fake API server with Karpenter's
static provisioning played by tests/fake_karpenter.py: the provider contract, the bounds
Karpenter's `limits.nodes` adds, a dynamic NodePool refused, and the live loop setting
replicas and handing the node it removes to Karpenter (no cordon or eviction of its own)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

import pandas as pd
import pytest
from fake_karpenter import NODE_POOL_LABEL, FakeKarpenter, node_pool
from fake_kube import FakeKube
from kubernetes import client as k8s
from live_fixtures import fast_policy, pool, run_pod
from provider_contract import BOOT_SECONDS, ContractCloud, ProviderContract, contract_pools

from predictor.telemetry.store import TelemetryStore
from scaler.cluster.pools import NodePool
from scaler.controller.config import LiveConfig
from scaler.controller.journal import DecisionJournal
from scaler.controller.reconcile import Reconciler
from scaler.controller.system import LiveSystem
from scaler.providers.base import NodeStatus, ProviderError
from scaler.providers.karpenter import KarpenterCloud, KarpenterSettings

NOW = datetime(2025, 3, 1, 12, 0, 0)


def client(fake: FakeKube) -> k8s.ApiClient:
    return k8s.ApiClient(k8s.Configuration(host=fake.url))


def settings(pools: Sequence[NodePool]) -> KarpenterSettings:
    return KarpenterSettings(node_pools=[{"pool": p.name, "node_pool": p.name} for p in pools])


class TestKarpenterContract(ProviderContract):
    @pytest.fixture(autouse=True)
    def _cluster(self, fake: FakeKube) -> None:
        self.fake = fake

    def make(self, pools: Sequence[NodePool]) -> ContractCloud:
        karpenter = FakeKarpenter(self.fake, boot_s=BOOT_SECONDS)
        for p in pools:
            self.fake.create("nodepools", node_pool(p.name, replicas=0))
        cloud = KarpenterCloud(pools, settings(pools), client(self.fake))
        return ContractCloud(provider=cloud, wait=karpenter.advance, limit=karpenter.limit)


def test_node_limit_bounds_the_group_and_a_dynamic_node_pool_is_refused(fake: FakeKube) -> None:
    a100, t4 = contract_pools()
    fake.create("nodepools", node_pool("a100", replicas=0, limits={"nodes": 2}))
    dynamic = node_pool("t4-spot", replicas=0)
    del dynamic["spec"]["replicas"]
    fake.create("nodepools", dynamic)
    only_a100 = KarpenterCloud([a100], settings([a100]), client(fake))
    only_a100.refresh()
    (group,) = only_a100.node_groups()
    assert (group.min_size(), group.max_size()) == (0, 2)
    group.increase_size(3)  # as far as limits.nodes allows
    assert fake.get("nodepools", "a100")["spec"]["replicas"] == 2
    # limits.nodes is a quantity (a ResourceList's), written however the user likes.
    fake.patch("nodepools", "a100", {"spec": {"limits": {"nodes": "1k"}}})
    only_a100.refresh()
    assert group.max_size() == a100.max_size
    both = KarpenterCloud([a100, t4], settings([a100, t4]), client(fake))
    with pytest.raises(ProviderError, match="NodePool t4-spot is not static"):
        both.refresh()
    with pytest.raises(ProviderError, match="no NodePool"):
        KarpenterCloud(
            [a100], KarpenterSettings(node_pools=[{"pool": "a100", "node_pool": "x"}]), client(fake)
        ).refresh()


def test_nodes_are_named_by_instance_and_booting_until_ready(fake: FakeKube) -> None:
    (a100, _) = contract_pools()
    karpenter = FakeKarpenter(fake, boot_s=BOOT_SECONDS)
    fake.create("nodepools", node_pool("a100", replicas=0))
    cloud = KarpenterCloud([a100], settings([a100]), client(fake))
    (group,) = cloud.node_groups()
    group.increase_size(2)
    assert fake.get("nodepools", "a100")["spec"]["replicas"] == 2
    nodes = group.nodes()
    assert {n.status for n in nodes} == {NodeStatus.BOOTING}
    assert all(n.name.startswith("i-") and n.ready_at is not None for n in nodes)
    karpenter.advance(BOOT_SECONDS)
    cloud.refresh()
    assert {n.status for n in group.nodes()} == {NodeStatus.READY}
    registered = {n["spec"]["providerID"].rsplit("/", 1)[-1] for n in fake.objects("nodes")}
    assert registered == {n.name for n in nodes}


class KarpenterLoop:
    """The live loop over one static NodePool `gpu-a100` (one node) on the fake API server."""

    def __init__(self, tmp_path: Path, fake: FakeKube, **spec: object) -> None:
        self.karpenter = FakeKarpenter(fake, boot_s=0.0)
        labels = {"gpuscale.io/pool": "a100", "nvidia.com/gpu.product": "A100"}
        fake.create("nodepools", node_pool("gpu-a100", replicas=1, labels=labels, **spec))
        self.karpenter.advance(1)
        self.cfg = LiveConfig(
            state_dir=tmp_path / "state",
            pools=[pool(min_size=1)],
            provider={
                "kind": "karpenter",
                "karpenter": {"node_pools": [{"pool": "a100", "node_pool": "gpu-a100"}]},
            },
            kubernetes={"host": fake.url, "pre_position": "none"},
            model={"name": "persistence"},
            policy=fast_policy(60.0),
            lease={"enabled": False},
        )

    def demand(self, values: list[float]) -> None:
        ds = pd.date_range(end=NOW, periods=len(values), freq="60s")
        TelemetryStore(self.cfg.state_dir).append(
            pd.DataFrame({"unique_id": "a100", "ds": ds, "y": values})
        )

    def loop(self) -> Reconciler:
        return Reconciler(LiveSystem.build(self.cfg), clock=lambda: NOW)


def test_the_loop_plans_within_the_node_pools_limit_and_says_so(
    tmp_path: Path, fake: FakeKube
) -> None:
    """limits.nodes 2 under a pool max of 16: the plan stops at 2 and names it, and the
    action reports the target reached (it said "1 -> 3" when the cloud stopped at 2)."""
    run = KarpenterLoop(tmp_path, fake, limits={"nodes": 2})
    run.demand([8.0] * 5 + [24.0])
    up = run.loop().iterate(apply=True)
    (decision,) = up.decision.plan.decisions
    assert (decision.desired, decision.inputs["max_size"]) == (2, 2)
    assert [(a["action"], a["result"]) for a in up.actions] == [("set_target", "target 1 -> 2")]
    assert fake.get("nodepools", "gpu-a100")["spec"]["replicas"] == 2


def test_the_loop_sets_replicas_and_hands_the_node_it_removes_to_karpenter(
    tmp_path: Path, fake: FakeKube
) -> None:
    run = KarpenterLoop(tmp_path, fake)
    cfg, karpenter, demand, loop = run.cfg, run.karpenter, run.demand, run.loop
    assert cfg.provider.scale_down == "provider"

    demand([8.0] * 5 + [24.0])
    up = loop().iterate(apply=True)
    assert [(a["action"], a["result"]) for a in up.actions] == [("set_target", "target 1 -> 3")]
    assert fake.get("nodepools", "gpu-a100")["spec"]["replicas"] == 3
    karpenter.advance(1)  # the new NodeClaims launch and their nodes register
    (busy, *idle) = sorted(n["metadata"]["name"] for n in fake.objects("nodes"))
    run_pod(fake, "train-0", busy, gpus=8)
    assert loop().iterate(apply=True).actions == []  # set, not incremented: nothing more

    demand([8.0] * 6)
    down = loop().iterate(apply=True)
    removed = [a for a in down.actions if a["action"] == "remove_node"]
    assert [a["status"] for a in removed] == ["done", "done"]
    assert fake.get("nodepools", "gpu-a100")["spec"]["replicas"] == 1
    assert [n["metadata"]["name"] for n in fake.objects("nodes")] == [busy]
    (claim,) = fake.objects("nodeclaims")
    assert claim["status"]["nodeName"] == busy  # the busy node's NodeClaim stayed
    # Karpenter drained the nodes: gpuscale cordoned nothing and evicted nothing.
    assert not any(p.endswith("/eviction") for _, p in fake.requests)
    assert not any(m == "PATCH" and "/api/v1/nodes/" in p for m, p in fake.requests)
    assert not DecisionJournal(cfg.state_dir).pending()
    assert {n["metadata"]["name"] for n in fake.objects("nodes")}.isdisjoint(idle)
    assert fake.get("nodes", busy)["metadata"]["labels"][NODE_POOL_LABEL] == "gpu-a100"


def test_the_loop_reads_node_pools_and_claims_from_the_watched_cache(
    tmp_path: Path, fake: FakeKube
) -> None:
    """`gpuscale scale` hands its provider the process's watched cluster cache: the first
    pass lists the NodePools and the NodeClaims once, later passes list neither and still
    see a NodePool changed and a NodeClaim launched between two passes."""
    import time

    from scaler.cli.live import _watched
    from scaler.kube.watched import forget_watched

    run = KarpenterLoop(tmp_path, fake)
    run.demand([8.0] * 6)
    system = LiveSystem.build(run.cfg)
    watched = _watched(system)
    assert watched is not None
    try:
        loop = Reconciler(system, observe=watched, clock=lambda: NOW)
        (group,) = system.provider.node_groups()
        loop.decide()
        assert (len(group.nodes()), group.max_size()) == (1, 10)
        kinds = ("nodepools", "nodeclaims")
        lists = {plural: fake.list_requests(plural) for plural in kinds}
        assert lists == {"nodepools": 1, "nodeclaims": 1}
        # Someone else raises replicas and caps the pool; Karpenter launches the claim.
        fake.patch("nodepools", "gpu-a100", {"spec": {"replicas": 2, "limits": {"nodes": 2}}})
        run.karpenter.advance(1)
        deadline = time.monotonic() + 10
        while (len(group.nodes()), group.max_size()) != (2, 2):
            assert time.monotonic() < deadline, (len(group.nodes()), group.max_size())
            time.sleep(0.05)
            loop.decide()
        assert {plural: fake.list_requests(plural) for plural in kinds} == lists
        for plural in kinds:
            assert fake.watch_requests(plural) >= 1, plural
    finally:
        forget_watched(watched)
        system.close()
