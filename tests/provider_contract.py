"""The provider contract: behaviour every node-pool provider must show, whatever the cloud.

A provider's test module subclasses `ProviderContract` and implements `make`, which builds
a provider with the given pools (min 0 and max 4 nodes here) on fresh infrastructure and
returns it with a `wait(seconds)` that lets boots complete (a simulated clock moves; a real
or emulated cloud may simply poll) and a `limit(pool, nodes)` that lets the cloud run at
most that many of the pool's nodes from now on, launches past it left unfulfilled as an
InsufficientInstanceCapacity leaves them (None: the limit is lifted and the cloud launches
what the target still asks). The simulated cloud passes it in test_providers.py, the AWS
provider against a moto server, static Karpenter NodePools against the fake API server.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest

from scaler.cluster.pools import NodePool
from scaler.providers.base import CloudProvider, NodeGroup, NodeStatus, ProviderError

BOOT_SECONDS = 120.0


def contract_pools() -> tuple[NodePool, ...]:
    return (
        NodePool(
            name="a100",
            gpu_model="A100",
            gpus_per_node=8,
            price_per_hour=32.0,
            boot_seconds=BOOT_SECONDS,
            min_size=0,
            max_size=4,
        ),
        NodePool(
            name="t4-spot",
            gpu_model="T4",
            gpus_per_node=4,
            price_per_hour=2.0,
            boot_seconds=BOOT_SECONDS,
            min_size=1,
            max_size=4,
            capacity_type="spot",
        ),
    )


@dataclass
class ContractCloud:
    provider: CloudProvider
    wait: Callable[[float], None]
    limit: Callable[[str, int | None], None]

    def group(self, name: str) -> NodeGroup:
        (group,) = [g for g in self.provider.node_groups() if g.id() == name]
        return group


class ProviderContract:
    def make(self, pools: Sequence[NodePool]) -> ContractCloud:
        raise NotImplementedError

    @pytest.fixture
    def cloud(self) -> ContractCloud:
        made = self.make(contract_pools())
        group = made.group("t4-spot")
        if group.target_size() < group.min_size():
            group.increase_size(group.min_size() - group.target_size())
        made.provider.refresh()
        return made

    def test_groups_mirror_pools(self, cloud: ContractCloud) -> None:
        groups = {g.id(): g for g in cloud.provider.node_groups()}
        assert set(groups) == {p.name for p in contract_pools()}
        for pool in contract_pools():
            group = groups[pool.name]
            assert isinstance(group, NodeGroup)
            assert group.template().gpu_model == pool.gpu_model
            assert group.template().gpus_per_node == pool.gpus_per_node
            assert (group.min_size(), group.max_size()) == (pool.min_size, pool.max_size)

    def test_increase_launches_nodes_that_become_ready(self, cloud: ContractCloud) -> None:
        group = cloud.group("a100")
        assert group.target_size() == 0 and group.nodes() == []
        group.increase_size(2)
        cloud.provider.refresh()
        assert group.target_size() == 2
        assert len(group.nodes()) == 2
        assert all(n.pool == "a100" for n in group.nodes())
        cloud.wait(BOOT_SECONDS + 1)
        cloud.provider.refresh()
        assert [n.status for n in group.nodes()] == [NodeStatus.READY] * 2

    @pytest.mark.parametrize("delta", [0, -1])
    def test_increase_must_be_positive(self, cloud: ContractCloud, delta: int) -> None:
        group = cloud.group("a100")
        with pytest.raises(ProviderError):
            group.increase_size(delta)
        assert group.target_size() == 0

    def test_increase_past_max_grows_to_max(self, cloud: ContractCloud) -> None:
        group = cloud.group("a100")
        group.increase_size(3)
        group.increase_size(2)
        assert group.target_size() == 4
        group.increase_size(1)  # at max already: nothing to do, nothing refused
        cloud.provider.refresh()
        assert group.target_size() == 4 and len(group.nodes()) == 4

    def test_delete_removes_exactly_the_named_nodes(self, cloud: ContractCloud) -> None:
        group = cloud.group("a100")
        group.increase_size(3)
        cloud.wait(BOOT_SECONDS + 1)
        cloud.provider.refresh()
        names = sorted(n.name for n in group.nodes())
        group.delete_nodes([names[1]])
        cloud.provider.refresh()
        assert sorted(n.name for n in group.nodes()) == [names[0], names[2]]
        assert group.target_size() == 2

    def test_delete_a_booting_node_cancels_it(self, cloud: ContractCloud) -> None:
        group = cloud.group("a100")
        group.increase_size(1)
        (node,) = group.nodes()
        group.delete_nodes([node.name])
        cloud.wait(BOOT_SECONDS + 1)
        cloud.provider.refresh()
        assert group.nodes() == [] and group.target_size() == 0

    def test_delete_refuses_unknown_repeated_or_foreign_nodes(self, cloud: ContractCloud) -> None:
        a100, t4 = cloud.group("a100"), cloud.group("t4-spot")
        a100.increase_size(2)
        t4.increase_size(1)
        cloud.provider.refresh()
        mine = [n.name for n in a100.nodes()]
        foreign = t4.nodes()[0].name
        for bad in (["no-such-node"], [mine[0], mine[0]], [mine[0], foreign]):
            with pytest.raises(ProviderError):
                a100.delete_nodes(bad)
        cloud.provider.refresh()
        assert sorted(n.name for n in a100.nodes()) == sorted(mine)

    def test_delete_below_min_is_refused(self, cloud: ContractCloud) -> None:
        group = cloud.group("t4-spot")
        assert group.target_size() == 1 == group.min_size()
        with pytest.raises(ProviderError):
            group.delete_nodes([group.nodes()[0].name])
        assert group.target_size() == 1

    def test_node_group_for_finds_the_owner(self, cloud: ContractCloud) -> None:
        group = cloud.group("a100")
        group.increase_size(1)
        cloud.provider.refresh()
        node = group.nodes()[0].name
        owner = cloud.provider.node_group_for(node)
        assert owner is not None and owner.id() == "a100"
        assert cloud.provider.node_group_for("no-such-node") is None

    def test_target_always_counts_held_nodes(self, cloud: ContractCloud) -> None:
        for group in cloud.provider.node_groups():
            room = group.max_size() - group.target_size()
            if room:
                group.increase_size(room)
        cloud.wait(BOOT_SECONDS / 2)
        cloud.provider.refresh()
        for group in cloud.provider.node_groups():
            assert group.target_size() == len(group.nodes()) == group.max_size()

    def test_a_growth_the_cloud_cannot_fulfil_stays_asked_for(self, cloud: ContractCloud) -> None:
        group = cloud.group("a100")
        cloud.limit("a100", 1)
        group.increase_size(3)
        cloud.provider.refresh()
        assert group.target_size() == 3 and len(group.nodes()) == 1
        cloud.limit("a100", None)  # capacity returns: the cloud launches what is asked
        cloud.provider.refresh()
        assert group.target_size() == 3 and len(group.nodes()) == 3

    def test_decrease_target_cancels_unfulfilled_launches_only(self, cloud: ContractCloud) -> None:
        group = cloud.group("a100")
        cloud.limit("a100", 1)
        group.increase_size(3)
        cloud.provider.refresh()
        (node,) = group.nodes()
        group.decrease_target_size(1)
        assert group.target_size() == 2
        group.decrease_target_size(1)
        cloud.provider.refresh()
        assert group.target_size() == 1 and [n.name for n in group.nodes()] == [node.name]
        cloud.limit("a100", None)  # capacity returns: nothing is left to launch
        cloud.wait(BOOT_SECONDS + 1)
        cloud.provider.refresh()
        assert group.target_size() == 1 and [n.name for n in group.nodes()] == [node.name]

    def test_decrease_target_below_held_nodes_is_refused(self, cloud: ContractCloud) -> None:
        group = cloud.group("a100")
        group.increase_size(1)  # a node held, booting or not, is not cancellable
        cloud.limit("a100", 1)
        group.increase_size(2)
        cloud.provider.refresh()
        held = sorted(n.name for n in group.nodes())
        assert group.target_size() == 3 and len(held) == 1
        for delta in (3, 0, -1):
            with pytest.raises(ProviderError):
                group.decrease_target_size(delta)
        cloud.provider.refresh()
        assert group.target_size() == 3 and sorted(n.name for n in group.nodes()) == held
        group.decrease_target_size(2)
        with pytest.raises(ProviderError):
            group.decrease_target_size(1)
        cloud.provider.refresh()
        assert group.target_size() == 1 and sorted(n.name for n in group.nodes()) == held
