"""The one scoring interface every placement policy implements, and the GPU pickers they share.

A policy receives the nodes that can hold the job (the engine has already checked CPU,
memory, GPU model, GPU count, labels, taints, spread and drain) and returns the node and
the GPU indices to use. Policies never change the state.

Ties are broken as the paper's artifact does: the first best node in a node order fixed
by the policy seed (the artifact shuffles node names once per run and its scheduler keeps
the first maximum). This matters: spreading tied jobs uniformly instead (stock
kube-scheduler) scatters CPU-only jobs over every node and costs the GPU-only baselines
and FGD 2 to 5 points. The random policy's draws come from a hash of the seed and the job
id, so every decision is a pure function of state and job and a run is reproducible.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from scaler.cluster.job import WHOLE_GPU_MILLI, Job
from scaler.cluster.snapshot import ClusterState

Choice = tuple[int, tuple[int, ...]]
# (scores, GPU index or -1) of each given node for a job; must depend on that node alone.
NodeScorer = Callable[[ClusterState, Job, np.ndarray], tuple[np.ndarray, np.ndarray]]
# Memoised job shapes per state before the memo is reset (a service sees unbounded shapes).
MAX_CACHED_SHAPES = 1024
# Tie-break orders kept per cluster size before they are dropped (each is cheap to redo).
MAX_CACHED_SIZES = 64


@dataclass
class NodeScores:
    """A policy's per-node score (and GPU) for one job shape, valid at `version`. A copy
    shares the arrays until either side scores a node again (copy on write): a what-if
    copy of a state carries every cached shape, and uses few of them."""

    version: np.ndarray
    score: np.ndarray
    gpu: np.ndarray
    shared: bool = False

    def copy(self) -> NodeScores:
        self.shared = True
        return NodeScores(self.version, self.score, self.gpu, True)

    def own(self) -> None:
        """Take private arrays before writing, if they are shared with a copy."""
        if self.shared:
            self.version, self.score, self.gpu = (
                self.version.copy(),
                self.score.copy(),
                self.gpu.copy(),
            )
            self.shared = False


class Policy(ABC):
    """Chooses a node and GPUs for a job among nodes that can hold it."""

    name: ClassVar[str]

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        # By cluster size: one policy places on states of several sizes in turn (the job
        # simulator's cluster, the estimator's pool templates).
        self._orders: dict[int, np.ndarray] = {}

    @abstractmethod
    def choose(self, state: ClusterState, job: Job, nodes: np.ndarray) -> Choice:
        """`nodes` is a non-empty array of node indices that all fit `job`."""

    # ------------------------------------------------------------------ helpers
    def draw(self, job: Job, count: int, salt: str = "") -> int:
        """A uniform-looking index in [0, count) fixed by (seed, job id, salt)."""
        digest = hashlib.blake2b(f"{self.seed}|{job.id}|{salt}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") % count

    def shape_key(self, job: Job) -> tuple[object, ...]:
        """What of a job a cached node score depends on (memory does not matter to FGD)."""
        return (job.cpu_milli, job.gpu_milli, job.num_gpu, job.gpu_models)

    def node_scores(
        self, state: ClusterState, job: Job, nodes: np.ndarray, scorer: NodeScorer
    ) -> tuple[np.ndarray, np.ndarray]:
        """`scorer` on `nodes`, memoised per job shape and node version, so after a
        placement only the changed node is scored again for each shape."""
        key = (id(self), *self.shape_key(job))
        entry: NodeScores | None = state.derived.get(key)
        if entry is None:
            if len(state.derived) >= MAX_CACHED_SHAPES:
                state.derived.clear()
            # A shape new to this state (the common case: shapes vary more than nodes)
            # is scored on `nodes` and answered without reading the memo back.
            score, gpu = scorer(state, job, nodes)
            size = state.size
            entry = NodeScores(np.full(size, -1), np.zeros(size), np.full(size, -1))
            entry.score[nodes], entry.gpu[nodes] = score, gpu
            entry.version[nodes] = state.version[nodes]
            state.derived[key] = entry
            return np.asarray(score, dtype=entry.score.dtype), np.asarray(gpu, entry.gpu.dtype)
        stale = nodes[entry.version[nodes] != state.version[nodes]]
        if stale.size:
            entry.own()
            entry.score[stale], entry.gpu[stale] = scorer(state, job, stale)
            entry.version[stale] = state.version[stale]
        return entry.score[nodes], entry.gpu[nodes]

    def rank(self, size: int) -> np.ndarray:
        """rank[n]: position of node n in this policy's seeded tie-break order."""
        order = self._orders.get(size)
        if order is None:
            if len(self._orders) >= MAX_CACHED_SIZES:
                self._orders.clear()
            order = self._orders[size] = np.random.default_rng(self.seed).permutation(size)
        return order

    def pick_best(self, state: ClusterState, nodes: np.ndarray, scores: np.ndarray) -> int:
        """The node with the highest score; ties go to the first in the seeded order."""
        best = nodes[scores == scores.max()]
        return int(best[np.argmin(self.rank(state.size)[best])])


def best_fit_gpus(state: ClusterState, job: Job, node: int) -> tuple[int, ...]:
    """A sharing job takes the fullest GPU that still holds it (lowest index on ties);
    a multi-GPU job takes the first idle GPUs by index."""
    if job.num_gpu == 0:
        return ()
    free = state.gpu_free[node, : state.gpu_count[node]]
    if job.is_sharing:
        slack = np.where(free >= job.gpu_milli, free, WHOLE_GPU_MILLI + 1)
        return (int(slack.argmin()),)
    return idle_gpus(state, job, node)


def idle_gpus(state: ClusterState, job: Job, node: int) -> tuple[int, ...]:
    free = state.gpu_free[node, : state.gpu_count[node]]
    return tuple(int(g) for g in (free == WHOLE_GPU_MILLI).nonzero()[0][: job.num_gpu])


def run_starts(values: np.ndarray) -> np.ndarray:
    """mask[i]: `values[i]` (1-D, non-empty) starts a run of equal values."""
    first = np.ones(values.size, dtype=bool)
    np.not_equal(values[1:], values[:-1], out=first[1:])
    return first
