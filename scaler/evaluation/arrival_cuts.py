"""What the experiment's own rules imply about every policy's placement (BENCHMARKS.md,
`placement: the ceiling`): the cuts that turn the offline ceiling into the protocol's.

The workload-inflation protocol places pods one at a time in a fixed order, never deletes
one, and places a pod whenever some node can hold it. Two facts follow for any policy that
plays by these rules, whatever its scoring:

- **Forced pods.** A pod fails only if, when it arrives, every node that could hold it
  when empty is blocked: short of its CPU, its memory, or its GPUs (no GPU with its share
  free; fewer idle GPUs than it asks). Blocking a node costs at least so much of one
  resource, and the pods arrived before it hold no more than their requests. If even a
  fractional choice of blocking modes over the node types cannot be paid for with those
  requests (a small LP), the pod is placed by every policy. Requests only grow along the
  order, so the first pods of each type are forced up to the first one whose blocking the
  earlier requests could pay for; a binary search finds it.
- **Failure chains.** Once a pod of type t fails, every later pod of t fails, and so does
  every later pod of a type u that t dominates (u asks at least t's CPU and memory, a
  larger share or whole GPUs, no model t could not use): the nodes only fill. So if x_t
  pods of t are placed, they are its first x_t, and the GPUs placed of the dominated types
  are at most those they asked for before the (x_t + 1)-th pod of t arrived: a
  nondecreasing step function of x_t, bounded here by lines of its upper concave hull.

Both are relaxations of what the rules imply, so the ceiling they tighten is still a
proven upper bound for every policy that follows the protocol (not for one that refuses
a pod it could place).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np

from scaler.cluster.job import WHOLE_GPU_MILLI, Job

PodType = tuple[int, int, int, int, frozenset[str]]  # CPU, memory, GPUs, share, models
NodeType = tuple[int, int, int, str]  # CPU, memory, GPUs, model
# Lines of each chain's hull kept as rows: more are tighter, fewer keep the MIP small.
CHAIN_LINES = 16


@dataclass(frozen=True)
class Chain:
    """GPU thousandths placed of the `dominated` types <= intercept + slope x placed of
    `leader`, for each (intercept, slope) of `lines`."""

    leader: PodType
    dominated: tuple[PodType, ...]
    lines: tuple[tuple[float, float], ...]


@dataclass(frozen=True)
class ArrivalCuts:
    """The forced count of each pod type and the failure chains of one arrival order."""

    forced: dict[PodType, int]
    chains: tuple[Chain, ...]

    @property
    def forced_pods(self) -> int:
        return sum(self.forced.values())


def pod_type(job: Job) -> PodType:
    return (job.cpu_milli, job.memory_mib, job.num_gpu, job.gpu_milli, job.gpu_models)


def takes_part(job: Job) -> bool:
    """A valid GPU pod: CPU-only pods allocate no GPU, and the ceilings leave them out."""
    return job.num_gpu > 0 and job.problem() is None


def is_sharing(t: PodType) -> bool:
    return t[2] == 1 and 0 < t[3] < WHOLE_GPU_MILLI


def fits_empty(t: PodType, node: NodeType) -> bool:
    """The pod type fits one empty node of this type."""
    cpu, mem, gpus, model = node
    return t[0] <= cpu and t[1] <= mem and t[2] <= gpus and (not t[4] or model in t[4])


def dominates(t: PodType, u: PodType, models: Sequence[str]) -> bool:
    """Every node too full for a pod of t is too full for a pod of u."""
    if u == t or u[0] < t[0] or u[1] < t[1]:
        return False
    allowed_t = set(t[4] or models)
    if not set(u[4] or models) <= allowed_t:
        return False
    if is_sharing(t):
        return not is_sharing(u) or u[3] >= t[3]
    return not is_sharing(u) and u[2] >= t[2]


def arrival_cuts(
    nodes: Counter[NodeType], jobs: Sequence[Job], lines: int = CHAIN_LINES
) -> ArrivalCuts:
    """The cuts (module docstring) of GPU pods `jobs`, in arrival order, on empty `nodes`."""
    positions: dict[PodType, list[int]] = defaultdict(list)
    for i, job in enumerate(jobs):
        if takes_part(job):
            positions[pod_type(job)].append(i)
    # Requests held before position i: prefix sums over every pod (CPU-only ones too).
    held = np.zeros((len(jobs) + 1, 3))
    held[1:] = np.cumsum([(j.cpu_milli, j.memory_mib, j.gpu_request_milli) for j in jobs], axis=0)
    sharing = {t[3] for t in positions if is_sharing(t)}
    blocking = _Blocking(nodes, sharing)
    forced = {t: _forced(blocking, t, [held[p] for p in where]) for t, where in positions.items()}
    models = sorted({n[3] for n in nodes})
    gpu_at = np.zeros(len(jobs) + 1)
    chains = []
    for t, where in positions.items():
        dominated = tuple(u for u in positions if dominates(t, u, models))
        if not dominated:
            continue
        mask = np.zeros(len(jobs))
        for u in dominated:
            mask[positions[u]] = u[2] * u[3]
        gpu_at[1:] = np.cumsum(mask)
        # f(x): GPUs of the dominated types asked before the (x+1)-th pod of t; f(m): all.
        steps = np.append(gpu_at[where], gpu_at[-1])
        chains.append(Chain(t, dominated, _hull_lines(steps, lines)))
    return ArrivalCuts(forced, tuple(chains))


def _forced(blocking: _Blocking, t: PodType, held: list[np.ndarray]) -> int:
    """How many of t's pods (their held requests in order) arrive before any could fail."""
    lo, hi = 0, len(held)  # the first pod whose nodes the earlier requests could block
    while lo < hi:
        mid = (lo + hi) // 2
        if blocking.affordable(t, held[mid]):
            hi = mid
        else:
            lo = mid + 1
    return lo


class _Blocking:
    """The LP "can requests of (CPU, memory, GPU thousandths) block every node a pod of
    type t could use": per node type, a count blocked by each resource covering its nodes,
    each resource's cost within what is held."""

    def __init__(self, nodes: Counter[NodeType], sharing: set[int]) -> None:
        self.nodes = nodes
        values = sorted(sharing | {WHOLE_GPU_MILLI})
        self.smallest = values[0]
        # reachable[v]: some multiset of the per-GPU amounts sums to exactly v.
        reachable = np.zeros(2 * WHOLE_GPU_MILLI + 1, dtype=bool)
        reachable[0] = True
        for v in values:
            for s in range(v, reachable.size):
                reachable[s] |= reachable[s - v]
        self.reachable = reachable
        self.cache: dict[PodType, _CoverLP | None] = {}

    def _gpu_cost(self, t: PodType, gpus: int) -> float:
        if is_sharing(t):
            # Every GPU holds more than 1000 - share: the least sum of amounts above it.
            above = np.flatnonzero(self.reachable[WHOLE_GPU_MILLI - t[3] + 1 :])
            return gpus * float(WHOLE_GPU_MILLI - t[3] + 1 + above[0])
        return (gpus - t[2] + 1) * float(self.smallest)  # too few idle GPUs left

    def _cover(self, t: PodType) -> _CoverLP | None:
        """The LP of t's eligible node types, built once per type (None: no node fits)."""
        if t not in self.cache:
            eligible = [n for n in self.nodes if fits_empty(t, n)]
            costs = [(n[0] - t[0] + 1, n[1] - t[1] + 1, self._gpu_cost(t, n[2])) for n in eligible]
            counts = [self.nodes[n] for n in eligible]
            self.cache[t] = (
                _CoverLP(np.array(costs, dtype=float), np.array(counts, dtype=float))
                if eligible
                else None
            )
        return self.cache[t]

    def affordable(self, t: PodType, held: np.ndarray) -> bool:
        cover = self._cover(t)
        if cover is None:
            return True  # nothing can hold it: it fails whatever was placed
        return cover.feasible(held)


class _CoverLP:
    """Is there y >= 0 with sum_r y[k, r] >= counts[k] and sum_k costs[k, r] y[k, r] <=
    budget[r]? Nodes of one type may be split over resources. Built once; each query only
    moves the budget rows' bounds."""

    def __init__(self, costs: np.ndarray, counts: np.ndarray) -> None:
        import highspy

        k, r = costs.shape
        self.resources = r
        h = highspy.Highs()
        h.setOptionValue("output_flag", False)
        h.setOptionValue("threads", 1)
        h.addVars(k * r, np.zeros(k * r), np.full(k * r, highspy.kHighsInf))
        # Rows 0..r-1: each resource's cost (column k * r + j is y[k, j]); then per node
        # type the count it must cover.
        starts, indices, values = [], [], []
        for j in range(r):
            starts.append(len(indices))
            indices.extend(range(j, k * r, r))
            values.extend(costs[:, j])
        for i in range(k):
            starts.append(len(indices))
            indices.extend(range(i * r, (i + 1) * r))
            values.extend([1.0] * r)
        lower = np.concatenate([np.full(r, -highspy.kHighsInf), counts])
        upper = np.concatenate([np.zeros(r), np.full(k, highspy.kHighsInf)])
        h.addRows(
            r + k,
            lower,
            upper,
            len(indices),
            np.array(starts, dtype=np.int32),
            np.array(indices, dtype=np.int32),
            np.array(values, dtype=np.float64),
        )
        self.highs = h
        # Kept for the queries, which the binary searches make thousands of times.
        self._infinity = highspy.kHighsInf
        self._optimal = highspy.HighsModelStatus.kOptimal

    def feasible(self, budget: np.ndarray) -> bool:
        for j in range(self.resources):
            self.highs.changeRowBounds(j, -self._infinity, float(budget[j]))
        self.highs.run()
        return self.highs.getModelStatus() == self._optimal


def _hull_lines(steps: np.ndarray, lines: int) -> tuple[tuple[float, float], ...]:
    """At most `lines` lines (intercept, slope) of the upper concave hull of the points
    (x, steps[x]): each lies on or above every point, so any of them bounds f."""
    hull: list[int] = []
    for x in range(steps.size):
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            # b is under the chord from a to x: not on the upper hull.
            if (steps[b] - steps[a]) * (x - a) <= (steps[x] - steps[a]) * (b - a):
                hull.pop()
            else:
                break
        hull.append(x)
    if len(hull) == 1:
        return ((float(steps[0]), 0.0),)
    segments = [
        (float(steps[a]), float(steps[b] - steps[a]) / (b - a), a) for a, b in pairwise(hull)
    ]
    picked = np.unique(np.linspace(0, len(segments) - 1, min(lines, len(segments))).astype(int))
    return tuple((value - slope * a, slope) for value, slope, a in (segments[i] for i in picked))
