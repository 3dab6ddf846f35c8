"""Nodes a pool would add: its node template, as the engine sees a node; and the price a
node of a pool carries.

Cluster Autoscaler estimates a scale-up on copies of a node group's `TemplateNodeInfo`;
ours are `NodeSpec`s built from the pool's economics, labelled with the pool so a job that
asks for a pool (node selector) lands only there.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from predictor.telemetry.kube_objects import KUBE_NAMES
from scaler.cluster.pools import NodePool
from scaler.cluster.snapshot import NodeSpec

POOL_LABEL = KUBE_NAMES.pool_label


def template_node(
    pool: NodePool, name: str, pool_label: str = POOL_LABEL, model_label: str | None = None
) -> NodeSpec:
    """An empty node of `pool` named `name`; with `model_label`, labelled with its GPU
    model too, as GPU feature discovery labels a Kubernetes node."""
    labels = {pool_label: pool.name}
    if model_label is not None and pool.gpu_model:
        labels[model_label] = pool.gpu_model
    return NodeSpec(
        name=name,
        cpu_milli=pool.cpu_milli_per_node,
        memory_mib=pool.memory_mib_per_node,
        gpus=pool.gpus_per_node,
        model=pool.gpu_model,
        labels=tuple(sorted(labels.items())),
    )


def with_pool_price(
    spec: NodeSpec, prices: Mapping[str, float], pool_label: str = POOL_LABEL
) -> NodeSpec:
    """`spec` carrying the hourly price of the pool its `pool_label` names (`prices`: by
    pool name), which the placement engine weighs between equal fits; unchanged where the
    label names no priced pool. Applied where a cluster is assembled, so nodes from
    every source (a fixed list, Kubernetes, a provider's templates) are priced alike."""
    price = prices.get(spec.label(pool_label) or "")
    return spec if price is None else replace(spec, price_per_hour=price)
