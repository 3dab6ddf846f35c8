"""FGD's fragmentation measure, vectorised over nodes and computed incrementally.

For a node and a job shape m (FGD, ATC '23, Sec. 3): if the node cannot host m at all
(GPU model not allowed, too few GPUs with a share >= m's share, or too little CPU), every
free GPU share on it is a fragment for m; otherwise the fragments are the free shares of
the GPUs too small for m. A CPU-only shape cannot use any GPU, so for it every free share
counts. A node's fragmentation is the popularity-weighted sum over the typical mix.

How it is made fast: only a few numbers of a node matter for a shape of share v and count
k: `cnt_v` (GPUs with free >= v) and `high_v` (sum of the free shares >= v, what such a
shape can use), for each share v of the mix. Shapes with the same (share, count, models)
form a group whose members differ only in CPU; sorted by CPU, the popularity of the
members that fit is a cumulative table lookup. So a node's fragmentation is a short sum
over groups, and the state after a candidate placement is obtained from the current
`cnt`/`high` by a closed-form update instead of a recount. The current values are cached
per node (one row of counts per node, summed from a per-free-share table) and refreshed
only for nodes whose `version` changed, when a placement asks for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from scaler.cluster.job import WHOLE_GPU_MILLI, Job
from scaler.cluster.snapshot import ClusterState
from scaler.placement.copy_on_write import CopyOnWrite
from scaler.placement.mix import WorkloadMix


@dataclass
class NodeFragments(CopyOnWrite):
    """Cached per-node inputs and result of the fragmentation measure. Row n of `counts`
    is node n's `cnt` per shape group, then its `high` per group, then its free GPU total
    (`FragmentationModel.split` names the parts). A copy shares the arrays until either
    side refreshes a node (copy on write): what-if copies of a state (gangs, preemption,
    scale-down checks) mostly read them."""

    ARRAYS: ClassVar[tuple[str, ...]] = ("version", "counts", "frag")

    version: np.ndarray
    counts: np.ndarray
    frag: np.ndarray
    shared: bool = False


@dataclass(frozen=True)
class Candidates:
    """Candidate placements of one job: node, first GPU (sharing jobs; -1 otherwise), the
    node's fragmentation before and after, and its free GPU total after."""

    node: np.ndarray
    gpu: np.ndarray
    frag_before: np.ndarray
    frag_after: np.ndarray
    total_after: np.ndarray

    @property
    def delta(self) -> np.ndarray:
        return self.frag_after - self.frag_before


class FragmentationModel:
    """Fragmentation of nodes against one workload mix (see module docstring)."""

    def __init__(self, mix: WorkloadMix) -> None:
        self.mix = mix
        gpu = [(s, p) for s, p in zip(mix.shapes, mix.popularity, strict=True) if s.gpu_milli > 0]
        self.shares = np.array(sorted({s.gpu_milli for s, _ in gpu}), dtype=np.int64)
        self.cpu_levels = np.array(sorted({s.cpu_milli for s, _ in gpu}), dtype=np.int64)
        groups: dict[tuple[int, int, tuple[str, ...]], list[tuple[int, float]]] = {}
        for s, p in gpu:
            j = int(np.searchsorted(self.shares, s.gpu_milli))
            groups.setdefault((j, s.num_gpu, s.gpu_models), []).append((s.cpu_milli, p))
        keys = sorted(groups)
        self.group_share = np.array([k[0] for k in keys], dtype=np.int64)
        self.group_milli = self.shares[self.group_share]  # each group's GPU share
        self.group_count = np.array([k[1] for k in keys], dtype=np.int64)
        self.group_models = [frozenset(k[2]) for k in keys]
        # fit_pop[L, g]: popularity of group g's shapes whose CPU <= the L-th CPU level,
        # where L = number of CPU levels at or below a node's free CPU.
        fit_pop = np.zeros((len(self.cpu_levels) + 1, len(keys)))
        for g, k in enumerate(keys):
            for cpu, p in groups[k]:
                level = int(np.searchsorted(self.cpu_levels, cpu, side="left")) + 1
                fit_pop[level:, g] += p
        self.fit_pop = fit_pop
        self._access: dict[tuple[str, ...], np.ndarray] = {}
        self._weights: dict[tuple[str, ...], np.ndarray] = {}
        self._cache_key = ("fragments", id(self))
        # by_share[v]: what one GPU with free share v adds to a node's row of counts.
        share = np.arange(WHOLE_GPU_MILLI + 1)[:, None]
        usable = share >= self.group_milli[None, :]
        self.by_share = np.hstack([usable, np.where(usable, share, 0), share]).astype(np.int64)
        # What taking k idle GPUs takes off a row of counts (they count for every group).
        self._taken: dict[int, np.ndarray] = {}

    # ------------------------------------------------------------------ evaluation
    def access(self, models: list[str]) -> np.ndarray:
        """access[m, g]: group g may run on model m; the last row is 'no GPU model'."""
        key = tuple(models)
        if key not in self._access:
            table = np.ones((len(models) + 1, len(self.group_models)), dtype=bool)
            for g, allowed in enumerate(self.group_models):
                if allowed:
                    table[:-1, g] = [m in allowed for m in models]
                    table[-1, g] = False
            self._access[key] = table
        return self._access[key]

    def weights(self, models: list[str]) -> np.ndarray:
        """weights[m, L, g]: `fit_pop[L, g]` where group g may run on model m, else 0."""
        key = tuple(models)
        table = self._weights.get(key)
        if table is None:
            table = self.fit_pop[None, :, :] * self.access(models)[:, None, :]
            self._weights[key] = table
        return table

    def counts(self, gpu_free: np.ndarray) -> np.ndarray:
        """Rows of counts (see `NodeFragments`) for rows of free GPU shares."""
        return self.by_share[gpu_free].sum(axis=1)

    def split(self, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The `cnt`, `high` and total parts of rows of counts (views)."""
        groups = self.group_count.size
        return counts[:, :groups], counts[:, groups : 2 * groups], counts[:, 2 * groups]

    def evaluate(
        self,
        cpu_free: np.ndarray,
        model_id: np.ndarray,
        cnt: np.ndarray,
        high: np.ndarray,
        total: np.ndarray,
        weights: np.ndarray,
    ) -> np.ndarray:
        """Expected fragmented GPU share (thousandths) of each row's node state."""
        level = np.searchsorted(self.cpu_levels, cpu_free, side="right")
        weight = weights[model_id, level]
        weight *= cnt >= self.group_count
        return total - np.einsum("ij,ij->i", weight, high)

    def node_fragments(self, state: ClusterState, nodes: np.ndarray | None = None) -> NodeFragments:
        """The cached per-node values for `state`, refreshed where nodes changed: all of
        them, or only `nodes` (the rest stay as they were, to refresh when asked for)."""
        key = self._cache_key
        cache: NodeFragments | None = state.derived.get(key)
        if cache is None:
            cache = state.derived[key] = NodeFragments(
                version=np.full(state.size, -1),  # never computed
                counts=np.zeros((state.size, self.by_share.shape[1]), dtype=np.int64),
                frag=np.zeros(state.size),
            )
        if nodes is None:
            stale = (cache.version != state.version).nonzero()[0]
        else:
            stale = nodes[cache.version[nodes] != state.version[nodes]]
        if stale.size:
            cache.own()
            counts = self.counts(state.gpu_free[stale])
            cache.counts[stale] = counts
            cache.version[stale] = state.version[stale]
            cache.frag[stale] = self.evaluate(
                state.cpu_free[stale],
                state.model_id[stale],
                *self.split(counts),
                self.weights(state.models),
            )
        return cache

    def candidates(self, state: ClusterState, job: Job, nodes: np.ndarray) -> Candidates:
        """Fragmentation before/after placing `job` on each feasible node (and, for a
        GPU-sharing job, on each GPU of distinct free share that can hold it)."""
        cache = self.node_fragments(state, nodes)
        if job.is_sharing:
            node, gpu = sharing_slots(state, job, nodes)
            cnt, high, total = self.split(cache.counts[node])
            free = state.gpu_free[node, gpu][:, None]
            share = self.group_milli[None, :]
            d = job.gpu_milli
            was_low = free < share
            becomes_low = ~was_low & (free - d < share)
            cnt = cnt - becomes_low
            high = high - np.where(was_low, 0, d) - np.where(becomes_low, free - d, 0)
            total = total - d
        else:
            node = nodes
            gpu = np.full(node.size, -1)
            cnt, high, total = self.split(cache.counts[node] - self.taken(job.num_gpu))
        after = self.evaluate(
            state.cpu_free[node] - job.cpu_milli,
            state.model_id[node],
            cnt,
            high,
            total,
            self.weights(state.models),
        )
        return Candidates(node, gpu, cache.frag[node], after, total)

    def taken(self, gpus: int) -> np.ndarray:
        """What `gpus` idle GPUs placed on take off a row of counts."""
        row = self._taken.get(gpus)
        if row is None:
            groups = self.group_count.size
            whole = gpus * WHOLE_GPU_MILLI
            row = np.array([gpus] * groups + [whole] * groups + [whole], dtype=np.int64)
            self._taken[gpus] = row
        return row


def sharing_slots(
    state: ClusterState, job: Job, nodes: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(node, GPU) pairs where a GPU-sharing job fits, one per distinct free share on a node
    (GPUs with equal free share are interchangeable; the lowest index stands for them).
    Pairs come ordered by node position in `nodes`, then GPU index."""
    free = state.gpu_free[nodes]
    width = free.shape[1]
    earlier = state.derived.get(("earlier-gpus", width))
    if earlier is None:
        earlier = state.derived[("earlier-gpus", width)] = np.tri(width, k=-1, dtype=bool)
    # GPU g stands for its share unless a GPU h < g on the node has the same.
    repeated = ((free[:, :, None] == free[:, None, :]) & earlier).any(axis=2)
    pos, gpu = np.nonzero((free >= job.gpu_milli) & ~repeated)
    return nodes[pos], gpu
