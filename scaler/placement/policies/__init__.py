"""Placement policies by name. `gpuscale` is ours and the default.

`make_policy(name, mix=..., seed=...)`: `mix` is the workload's typical job mix, which the
fragmentation-aware policies (`fgd`, `gpuscale`) need and the others ignore.
"""

from __future__ import annotations

from collections.abc import Callable

from scaler.placement.mix import WorkloadMix
from scaler.placement.policies.base import Choice, Policy
from scaler.placement.policies.classic import (
    BestFit,
    DotProduct,
    GpuClustering,
    GpuPacking,
    RandomPolicy,
)
from scaler.placement.policies.fgd import FGD
from scaler.placement.policies.gpuscale import GpuScale

DEFAULT_POLICY = GpuScale.name

PolicyFactory = Callable[[WorkloadMix | None, int], Policy]


def _plain(cls: type[Policy]) -> PolicyFactory:
    return lambda _mix, seed: cls(seed)


def _mixed(cls: type[FGD] | type[GpuScale]) -> PolicyFactory:
    def build(mix: WorkloadMix | None, seed: int) -> Policy:
        if mix is None:
            raise ValueError(f"policy {cls.name!r} needs the workload's typical job mix")
        return cls(mix, seed)

    return build


POLICIES: dict[str, PolicyFactory] = {
    RandomPolicy.name: _plain(RandomPolicy),
    BestFit.name: _plain(BestFit),
    DotProduct.name: _plain(DotProduct),
    GpuPacking.name: _plain(GpuPacking),
    GpuClustering.name: _plain(GpuClustering),
    FGD.name: _mixed(FGD),
    GpuScale.name: _mixed(GpuScale),
}


def make_policy(name: str, *, mix: WorkloadMix | None = None, seed: int = 0) -> Policy:
    try:
        factory = POLICIES[name]
    except KeyError:
        known = ", ".join(POLICIES)
        raise ValueError(f"unknown placement policy {name!r} (known: {known})") from None
    return factory(mix, seed)


__all__ = ["DEFAULT_POLICY", "POLICIES", "Choice", "Policy", "make_policy"]
