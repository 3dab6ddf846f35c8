"""The simulated cloud passes the provider contract, and its failure modes behave."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta

import pytest
from provider_contract import ContractCloud, ProviderContract, contract_pools

from scaler.cluster.pools import NodePool
from scaler.providers.base import NodeStatus, ProviderError
from scaler.providers.simulated import SimulatedCloud, SimulatedCloudConfig


class TestSimulatedCloudContract(ProviderContract):
    def make(self, pools: Sequence[NodePool]) -> ContractCloud:
        cloud = SimulatedCloud(pools)

        def limit(pool: str, nodes: int | None) -> None:
            capacity = {p: n for p, n in cloud.config.capacity.items() if p != pool}
            cloud.reconfigure(capacity=capacity | ({} if nodes is None else {pool: nodes}))

        return ContractCloud(provider=cloud, wait=cloud.advance, limit=limit)


def _pool(**overrides: object) -> NodePool:
    fields: dict[str, object] = {
        "name": "gpu",
        "gpu_model": "A100",
        "gpus_per_node": 8,
        "price_per_hour": 10.0,
        "boot_seconds": 600.0,
        "max_size": 100,
    }
    fields.update(overrides)
    return NodePool.model_validate(fields)


def test_boot_delay_holds_nodes_booting_until_ready() -> None:
    cloud = SimulatedCloud([_pool()])
    (group,) = cloud.node_groups()
    group.increase_size(3)
    cloud.advance(599)
    assert {n.status for n in group.nodes()} == {NodeStatus.BOOTING}
    events = cloud.advance(1)
    assert [e.kind for e in events] == ["ready"] * 3
    assert {n.status for n in group.nodes()} == {NodeStatus.READY}


def test_failed_launches_vanish_at_boot_and_lower_the_target() -> None:
    cloud = SimulatedCloud([_pool()], SimulatedCloudConfig(seed=3, launch_failure_rate=0.5))
    (group,) = cloud.node_groups()
    group.increase_size(40)
    events = cloud.advance(601)
    failed = sum(e.kind == "launch_failed" for e in events)
    assert 10 < failed < 30
    assert group.target_size() == 40 - failed == len(group.nodes())


def test_capacity_limit_refuses_launches_beyond_it_until_room_is_given() -> None:
    cloud = SimulatedCloud([_pool()], SimulatedCloudConfig(capacity={"gpu": 5}))
    (group,) = cloud.node_groups()
    group.increase_size(8)
    assert group.target_size() == 8 and len(group.nodes()) == 5
    assert sum(e.kind == "no_capacity" for e in cloud.events) == 3
    cloud.reconfigure(capacity={"gpu": 6})  # one more fits; the others stay asked for
    assert group.target_size() == 8 and len(group.nodes()) == 6
    cloud.reconfigure(capacity={})
    assert group.target_size() == 8 and len(group.nodes()) == 8
    assert sum(e.kind == "launched" for e in cloud.events) == 8


def test_a_target_lowered_to_the_nodes_held_launches_nothing_when_room_returns() -> None:
    cloud = SimulatedCloud([_pool(min_size=3)], SimulatedCloudConfig(capacity={"gpu": 2}))
    (group,) = cloud.node_groups()
    group.increase_size(6)
    with pytest.raises(ProviderError, match="below min size 3"):
        group.decrease_target_size(4)  # 2 nodes held: a target of 2 is not below them
    group.decrease_target_size(3)
    cloud.reconfigure(capacity={})
    assert group.target_size() == 3 and len(group.nodes()) == 3
    assert sum(e.kind == "launched" for e in cloud.events) == 3


def test_spot_interruptions_follow_the_configured_rate() -> None:
    config = SimulatedCloudConfig(seed=1, spot_interruptions_per_hour=0.5)
    cloud = SimulatedCloud([_pool(capacity_type="spot")], config)
    (group,) = cloud.node_groups()
    group.increase_size(100)
    cloud.advance(600 + 3600)
    interrupted = sum(e.kind == "interrupted" for e in cloud.events)
    # P(reclaimed within an hour) = 1 - exp(-0.5) ~ 0.39
    assert 25 <= interrupted <= 55
    assert group.target_size() == 100 - interrupted


def test_on_demand_nodes_are_never_interrupted() -> None:
    config = SimulatedCloudConfig(seed=1, spot_interruptions_per_hour=5.0)
    cloud = SimulatedCloud([_pool()], config)
    (group,) = cloud.node_groups()
    group.increase_size(10)
    cloud.advance(10 * 3600)
    assert group.target_size() == 10


def test_same_seed_same_history_however_the_clock_moves() -> None:
    config = SimulatedCloudConfig(
        seed=7, launch_failure_rate=0.2, spot_interruptions_per_hour=1.0, boot_jitter_seconds=120
    )

    def history(tick: float) -> list[tuple[datetime, str, str]]:
        cloud = SimulatedCloud(contract_pools(), config)
        for group in cloud.node_groups():
            group.increase_size(3)
        elapsed = 0.0
        while elapsed < 7200:
            cloud.advance(tick)
            elapsed += tick
        return [(e.at, e.node, e.kind) for e in cloud.events]

    assert history(60) == history(900)
    assert history(60)[-1][0] <= datetime(2024, 1, 1) + timedelta(hours=2)
