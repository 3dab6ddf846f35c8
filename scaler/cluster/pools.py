"""Node pools: what a node of each pool offers and costs, and how big a pool may grow.

A pool is the unit the planner sizes and a provider scales (an Auto Scaling group, an EKS
node group, a simulated group). Pools are read from YAML and validated at start; an error
names the pool and the field, so a bad config never reaches a running loop.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike
from pydantic import BaseModel, ConfigDict, Field, model_validator

from predictor.foundation.config_files import read_yaml, validated

CapacityType = Literal["on-demand", "spot"]
# Node counts come out of float arithmetic (GPUs / GPUs per node, a share of demand) with
# residues: 16.000000000000004 GPUs of 8-GPU nodes are 2 nodes, not 3.
NODE_RESIDUE = 1e-9


def whole_nodes(nodes: float) -> int:
    """The whole nodes a float node count needs, its float residue not counted."""
    return math.ceil(nodes - NODE_RESIDUE)


def whole_nodes_each(nodes: ArrayLike) -> np.ndarray:
    """`whole_nodes` of every element, kept as floats (the replays' node series)."""
    return np.ceil(np.asarray(nodes, dtype=float) - NODE_RESIDUE)


class NodePool(BaseModel):
    """One group of identical nodes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1)
    gpu_model: str = Field(min_length=1, description="e.g. A100, H100, V100M32")
    gpus_per_node: int = Field(gt=0)
    cpu_milli_per_node: int = Field(default=64_000, ge=0)
    memory_mib_per_node: int = Field(default=512 * 1024, ge=0)
    price_per_hour: float = Field(ge=0, description="price of one node for one hour")
    power_watts: float = Field(default=0.0, ge=0, description="draw of one busy node")
    boot_seconds: float = Field(default=600.0, ge=0, description="request to ready")
    min_size: int = Field(default=0, ge=0)
    max_size: int = Field(ge=0)
    capacity_type: CapacityType = "on-demand"

    @model_validator(mode="after")
    def _sizes(self) -> NodePool:
        if self.max_size < self.min_size:
            raise ValueError(f"max_size {self.max_size} is below min_size {self.min_size}")
        return self

    @property
    def is_spot(self) -> bool:
        return self.capacity_type == "spot"

    def boot_steps(self, step_seconds: float) -> int:
        """Whole decision steps from request to ready (a node ready mid-step serves from the
        next step, since a step's demand is its peak minute)."""
        return math.ceil(self.boot_seconds / step_seconds - 1e-9)

    def price_per_gpu_hour(self) -> float:
        return self.price_per_hour / self.gpus_per_node

    def watts_per_gpu(self) -> float:
        return self.power_watts / self.gpus_per_node


class PoolSet(BaseModel):
    """The pools of one cluster; names are unique."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    pools: tuple[NodePool, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> PoolSet:
        seen: set[str] = set()
        for pool in self.pools:
            if pool.name in seen:
                raise ValueError(f"pool name {pool.name!r} appears twice")
            seen.add(pool.name)
        return self

    def by_name(self) -> dict[str, NodePool]:
        return {pool.name: pool for pool in self.pools}


def parse_pools(
    data: object, *, source: str | Path | None = None, text: str | None = None
) -> tuple[NodePool, ...]:
    """Validate a mapping `{pools: [...]}` (or a bare list of pools); errors name the field,
    for example `pools.1.max_size`, and its line when `text` is the YAML it came from."""
    if isinstance(data, list):
        data = {"pools": data}
    return validated(PoolSet, data, source, text).pools


def load_pools(path: str | Path) -> tuple[NodePool, ...]:
    """Read pools from a YAML file."""
    document = read_yaml(path)
    return parse_pools(document.data, source=document.path, text=document.text)


def serving_models(
    group: str, configured: Mapping[str, Iterable[str]], pools: Iterable[NodePool]
) -> frozenset[str] | None:
    """The GPU models whose pools may serve a demand group: as configured for it (empty:
    any); else, for a group named like a pool (demand measured per pool), that pool's
    model; else any (None)."""
    if group in configured:
        return frozenset(configured[group]) or None
    named = [pool.gpu_model for pool in pools if pool.name == group]
    return frozenset(named) or None
