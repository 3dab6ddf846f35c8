"""Where a MIG job goes: which free instances of its profile, on which node.

The instances of a partitioned GPU are fixed (the node's layout), so the choice is among
the free instances of the job's profile. The measure is the slice fragmentation of
`scaler.cluster.mig.waste`: an instance is cheap where its slices were of little use to
other shapes anyway (a GPU already partly taken) and dear where it breaks room a large
profile had (the idle GPU a 7g, or a repartition, could still use). A node's cost is the
growth of that measure over the instances the job takes (one after another, each the
cheapest then); the cheapest node wins, ties going to the policy's seeded node order and
then to the lowest instance index. Node costs are cached per node version and profile.
"""

from __future__ import annotations

from functools import cache

import numpy as np

from scaler.cluster.job import Job
from scaler.cluster.mig import MigLayout, waste
from scaler.cluster.snapshot import ClusterState

Choice = tuple[int, tuple[int, ...]]


def choose_instances(state: ClusterState, job: Job, nodes: np.ndarray, rank: np.ndarray) -> Choice:
    """The node of `nodes` (all have room for `job`) and the instance indices it takes."""
    key = ("mig", job.mig_profile, job.mig_count)
    cached: dict[int, tuple[int, float, tuple[int, ...]]] = state.derived.setdefault(key, {})
    best: tuple[tuple[float, int], int, tuple[int, ...]] | None = None
    for n in nodes.tolist():
        entry = cached.get(n)
        if entry is None or entry[0] != state.version[n]:
            entry = (int(state.version[n]), *node_cost(state, job, n))
            cached[n] = entry
        order = (entry[1], int(rank[n]))
        if best is None or order < best[0]:
            best = (order, n, entry[2])
    if best is None:
        raise ValueError("no node to choose from")
    return best[1], best[2]


def node_cost(state: ClusterState, job: Job, node: int) -> tuple[float, tuple[int, ...]]:
    """The growth of node `node`'s slice fragmentation if `job` takes the cheapest free
    instances of its profile there, and their indices."""
    layout = state.mig[node]
    masks = instance_masks(layout)
    table = waste(layout.family)
    used = gpu_usage(layout, masks, state.mig_used[node])
    free = state.mig_free(node, str(job.mig_profile))
    taken: list[int] = []
    cost = 0.0
    for _ in range(job.mig_count):
        gpu_of = layout.instances
        growth = [table[used[gpu_of[k].gpu] | masks[k]] - table[used[gpu_of[k].gpu]] for k in free]
        pick = int(np.argmin(growth))
        k = free.pop(pick)
        cost += growth[pick]
        used[gpu_of[k].gpu] |= masks[k]
        taken.append(k)
    return cost, tuple(sorted(taken))


def gpu_usage(layout: MigLayout, masks: tuple[int, ...], used: np.ndarray) -> dict[int, int]:
    """The slices taken on each MIG GPU of a layout, as bits."""
    usage = dict.fromkeys(layout.gpus, 0)
    for k in np.flatnonzero(used).tolist():
        usage[layout.instances[k].gpu] |= masks[k]
    return usage


@cache
def instance_masks(layout: MigLayout) -> tuple[int, ...]:
    return layout.masks()
