"""The one scoring interface every placement policy implements, and the GPU pickers they share.

A policy receives the nodes that can hold the job (the engine has already checked CPU,
memory, GPU model, GPU count, labels, taints, spread and drain) and returns the node and
the GPU indices to use. Policies never change the state.

Ties are broken by GPU price first, where the job leaves its GPU model to us and nodes say
their pool's price (`scaler.placement.price`), then as the paper's artifact does: the first
best node in a node order fixed by the policy seed (the artifact shuffles node names once
per run and its scheduler keeps the first maximum). This matters: spreading tied jobs
uniformly instead (stock kube-scheduler) scatters CPU-only jobs over every node and costs
the GPU-only baselines and FGD 2 to 5 points. The random policy's draws come from a hash
of the seed and the job id, so every decision is a pure function of state and job and a
run is reproducible.
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
from scaler.placement.copy_on_write import CopyOnWrite
from scaler.placement.price import cheapest

Choice = tuple[int, tuple[int, ...]]
# (scores, GPU index or -1) of each given node for a job; must depend on that node alone,
# and of it only on what `node_states` names.
NodeScorer = Callable[[ClusterState, Job, np.ndarray], tuple[np.ndarray, np.ndarray]]
NodeState = tuple[str | None, int, int, bytes]  # GPU model (None: no GPU), free CPU, memory, GPUs
# Memoised job shapes per state before the memo is reset (a service sees unbounded shapes).
MAX_CACHED_SHAPES = 1024
# Scores memoised per (job shape, node state) before that memo is reset.
MAX_CACHED_NODE_STATES = 1 << 16
# Most nodes scored at once through the node-state memo: its keys cost a little per node,
# so a larger batch (a shape new to a cluster, or a cluster that only fills, as in the
# placement bench, where nodes seldom return to a state) is scored as one array instead.
MAX_MEMO_BATCH = 4
# Tie-break orders kept per cluster size before they are dropped (each is cheap to redo).
MAX_CACHED_SIZES = 64


@dataclass
class NodeScores(CopyOnWrite):
    """A policy's per-node score (and GPU) for one job shape, valid at `version`. A copy
    shares the arrays until either side scores a node again (copy on write): a what-if
    copy of a state carries every cached shape, and uses few of them."""

    ARRAYS: ClassVar[tuple[str, ...]] = ("version", "score", "gpu")

    version: np.ndarray
    score: np.ndarray
    gpu: np.ndarray
    shared: bool = False


class Policy(ABC):
    """Chooses a node and GPUs for a job among nodes that can hold it."""

    name: ClassVar[str]
    # Whether its ties go to the cheaper GPU (`tie_break`); the random baseline has none.
    weighs_price: ClassVar[bool] = True

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        # By cluster size: one policy places on states of several sizes in turn (the job
        # simulator's cluster, the estimator's pool templates).
        self._orders: dict[int, np.ndarray] = {}
        # (job shape, node state) -> (score, GPU): nodes keep coming back to the same
        # state (empty, one job of a kind, ...), in one cluster and across what-if copies
        # and pool templates, so most nodes to score again were scored so before.
        self._by_node_state: dict[tuple[tuple[object, ...], NodeState], tuple[float, int]] = {}

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
        placement only the changed node is scored again for each shape; and a few nodes
        to score again are looked up by their state first."""
        shape = self.shape_key(job)
        key = (id(self), *shape)
        entry: NodeScores | None = state.derived.get(key)
        if entry is None:
            if len(state.derived) >= MAX_CACHED_SHAPES:
                state.derived.clear()
            size = state.size
            entry = NodeScores(np.full(size, -1), np.zeros(size), np.full(size, -1))
            state.derived[key] = entry
            stale = nodes
        else:
            stale = nodes[entry.version[nodes] != state.version[nodes]]
        if stale.size:
            entry.own()
            if stale.size <= MAX_MEMO_BATCH:
                entry.score[stale], entry.gpu[stale] = self._by_state(
                    state, job, shape, stale, scorer
                )
            else:
                entry.score[stale], entry.gpu[stale] = scorer(state, job, stale)
            entry.version[stale] = state.version[stale]
        return entry.score[nodes], entry.gpu[nodes]

    def _by_state(
        self,
        state: ClusterState,
        job: Job,
        shape: tuple[object, ...],
        nodes: np.ndarray,
        scorer: NodeScorer,
    ) -> tuple[list[float], list[int]]:
        """Scores and GPUs of `nodes`, from the node-state memo where known."""
        memo = self._by_node_state
        if len(memo) >= MAX_CACHED_NODE_STATES:
            memo.clear()
        keys = [(shape, node) for node in node_states(state, nodes)]
        missing = [i for i, k in enumerate(keys) if k not in memo]
        if missing:
            score, gpu = scorer(state, job, nodes[missing])
            for i, s, g in zip(missing, score.tolist(), gpu.tolist(), strict=True):
                memo[keys[i]] = (s, g)
        found = [memo[k] for k in keys]
        return [s for s, _ in found], [g for _, g in found]

    def rank(self, size: int) -> np.ndarray:
        """rank[n]: position of node n in this policy's seeded tie-break order."""
        order = self._orders.get(size)
        if order is None:
            if len(self._orders) >= MAX_CACHED_SIZES:
                self._orders.clear()
            order = self._orders[size] = np.random.default_rng(self.seed).permutation(size)
        return order

    def pick_best(
        self, state: ClusterState, job: Job, nodes: np.ndarray, scores: np.ndarray
    ) -> int:
        """The node with the highest score; ties as `tie_break` breaks them."""
        return self.tie_break(state, job, nodes[scores == scores.max()])

    def tie_break(self, state: ClusterState, job: Job, tied: np.ndarray) -> int:
        """The node of `tied` (non-empty; nodes the policy fits `job` on equally well)
        that takes the job: of those at the cheapest GPU price (`price.cheapest`), the
        first in the seeded order."""
        tied = cheapest(state, job, tied)
        return int(tied[np.argmin(self.rank(state.size)[tied])])


def node_states(state: ClusterState, nodes: np.ndarray) -> list[NodeState]:
    """What a node-local scorer may read of each node: its GPU model, free CPU and memory,
    and free GPU shares (by index)."""
    models = state.models
    rows = state.gpu_free[nodes]
    width = rows.shape[1] * rows.itemsize
    raw = rows.tobytes()
    return [
        (models[m] if m >= 0 else None, cpu, mem, raw[i * width : (i + 1) * width])
        for i, (m, cpu, mem) in enumerate(
            zip(
                state.model_id[nodes].tolist(),
                state.cpu_free[nodes].tolist(),
                state.mem_free[nodes].tolist(),
                strict=True,
            )
        )
    ]


def best_fit_gpus(state: ClusterState, job: Job, node: int) -> tuple[int, ...]:
    """A sharing job takes the fullest GPU that still holds it (lowest index on ties);
    a multi-GPU job takes idle GPUs as `idle_gpus` does; a MIG job the first free
    instances of its profile."""
    if job.mig_profile is not None:
        return tuple(state.mig_free(node, job.mig_profile)[: job.mig_count])
    if job.num_gpu == 0:
        return ()
    free = state.gpu_free[node, : state.gpu_count[node]]
    if job.is_sharing:
        slack = np.where(free >= job.gpu_milli, free, WHOLE_GPU_MILLI + 1)
        return (int(slack.argmin()),)
    return idle_gpus(state, job, node)


def idle_gpus(state: ClusterState, job: Job, node: int) -> tuple[int, ...]:
    """The first idle GPUs by index; on a node with NVLink domains, those of the domain
    with the fewest idle GPUs that holds the job (so whole domains stay free), else of as
    few domains as will hold it."""
    count = state.gpu_count[node]
    idle = (state.gpu_free[node, :count] == WHOLE_GPU_MILLI).nonzero()[0]
    if state.gpu_domain is not None and state.gpu_domain[node, :count].max(initial=-1) >= 0:
        return domain_gpus(state.gpu_domain[node, :count], idle, job.num_gpu)
    return tuple(int(g) for g in idle[: job.num_gpu])


def domain_gpus(domain: np.ndarray, idle: np.ndarray, k: int) -> tuple[int, ...]:
    """`k` of the `idle` GPUs of a node whose GPU g is in NVLink domain `domain[g]` (-1:
    a domain of its own): all from the domain with the fewest idle GPUs that has `k`, or
    else from the domains with the most idle GPUs first."""
    groups: dict[int, list[int]] = {}
    for g in idle.tolist():
        groups.setdefault(int(domain[g]) if domain[g] >= 0 else -1 - g, []).append(g)
    ranked = sorted(groups.values(), key=lambda gpus: (len(gpus), gpus[0]))
    for gpus in ranked:
        if len(gpus) >= k:
            return tuple(gpus[:k])
    taken = [g for gpus in sorted(ranked, key=lambda gpus: -len(gpus)) for g in gpus][:k]
    return tuple(sorted(taken))


def run_starts(values: np.ndarray) -> np.ndarray:
    """mask[i]: `values[i]` (1-D, non-empty) starts a run of equal values."""
    first = np.ones(values.size, dtype=bool)
    np.not_equal(values[1:], values[:-1], out=first[1:])
    return first
