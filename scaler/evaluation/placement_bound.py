"""The ceiling of the workload-inflation experiment: the most GPU share any placement of
the arrived pods could allocate (BENCHMARKS.md, `placement: the ceiling`).

For one seed's arrival order (`placement_bench.arrival_order`), the pods seen when the
arrived share first reaches 100 % and all pods of the run (130 %) are each packed onto an
empty cluster by a mixed-integer model solved with HiGHS (`highspy`) under a time limit.
The solver's dual bound is the ceiling; its incumbent and the proven gap come with it.

The model is a relaxation of "place a subset of these pods on these nodes", so its dual
bound is a proven upper bound on what any policy, online or offline, allocates. What it
keeps exactly and what it relaxes:

- Pods are grouped into types (CPU, memory, GPU count, GPU share, allowed models) and
  nodes into types (CPU, memory, GPU count, model); `X[k, t]` (integer) is the number of
  type-t pods on type-k nodes, at most the type's count. A pod's type must be allowed on
  the node type: GPU model, enough GPUs, CPU and memory of one node.
- Kept exactly at the level of a node type: GPU-model constraints; GPU share packing per
  GPU (a GPU holds a multiset of shares summing to at most 1000: one continuous variable
  per maximal pattern of the workload's shares and node type, tied to the sharing pods
  placed there, and an integer count of the GPUs given to sharing pods); whole GPUs for
  multi-GPU pods drawn from the same GPUs.
- Relaxed: the nodes of one type are pooled, so CPU, memory and GPUs are summed over the
  type's nodes (a pod must fit one node of the type, but the pods on a type need not be
  packable node by node); valid per-node cuts take back part of that (at most q pods
  larger than 1/(q+1) of a node's CPU, memory or GPUs per node, q = 1..3). The number of
  GPUs packed in each pattern is continuous (the Gilmore-Gomory relaxation of the
  per-GPU packing). Pods may be left out freely: the online protocol must place a pod
  that fits somewhere, the model need not, so CPU-only pods (which allocate no GPU)
  are left out of it entirely. Where the workload's shares have more than
  `MAX_PATTERNS` maximal patterns, per-GPU packing falls back to its capacity relaxation
  (shares summed per GPU pool, at most q shares above 1000/(q+1) per GPU).

The cluster is taken empty (only capacities are read).

The protocol's ceiling adds the cuts of `arrival_cuts` (pods every policy that follows the
experiment's rules must place, and the failure chains of the arrival order): a proven
upper bound for every such policy, tighter than the offline one, which may leave out any
pod it likes.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from typing import TYPE_CHECKING

import highspy
import numpy as np

from scaler.cluster.job import WHOLE_GPU_MILLI, Job
from scaler.cluster.snapshot import ClusterState
from scaler.evaluation.arrival_cuts import (
    ArrivalCuts,
    NodeType,
    PodType,
    arrival_cuts,
    fits_empty,
    pod_type,
    takes_part,
)
from scaler.evaluation.placement_bench import INFLATION_RATIO, arrival_order, jobs_from_pods

if TYPE_CHECKING:
    import pandas as pd


class _QuietHighs(highspy.Highs):
    """A solver that never writes to stdout. `highspy.Highs()` prints its banner from
    `enableCallbacks`, which its constructor calls, before any option can be set; a
    banner in the middle of `bench placement --bound`'s table is noise to its users."""

    def enableCallbacks(self) -> object:
        self.setOptionValue("output_flag", False)
        return super().enableCallbacks()


TIME_LIMIT_S = 60.0
# Above this many maximal share patterns the per-GPU packing is relaxed to capacity.
MAX_PATTERNS = 20_000
# Per-node cuts: at most q items larger than 1/(q+1) of a node's (or GPU's) capacity.
CUT_DEPTH = 3
# HiGHS stops when incumbent and bound are this close (relative): 0.01 point of share.
MIP_REL_GAP = 1e-4


@dataclass(frozen=True)
class Ceiling:
    """One solve: GPU thousandths the model's incumbent places (`best_milli`, an
    allocation of the relaxed model, not necessarily of the real cluster) and the
    solver's proven upper bound (`bound_milli`, the ceiling)."""

    best_milli: float
    bound_milli: float
    total_milli: int
    seconds: float
    status: str
    pods: int
    exact_gpu_packing: bool
    forced_pods: int = 0  # with the protocol's cuts: the pods every policy places

    @property
    def best(self) -> float:
        return 100.0 * self.best_milli / self.total_milli

    @property
    def bound(self) -> float:
        return 100.0 * self.bound_milli / self.total_milli

    @property
    def gap(self) -> float:
        """Proven relative gap of the solve, (bound - best) / bound."""
        if self.bound_milli <= 0:
            return 0.0
        return max(0.0, (self.bound_milli - self.best_milli) / self.bound_milli)


@dataclass(frozen=True)
class BoundResult:
    """The ceilings at 100 % and 130 % of one workload and seed, as a placement row: the
    offline one (any placement of the arrived pods) and the protocol's (any policy that
    places each pod, in order, when some node can hold it)."""

    workload: str
    seed: int
    at_100: Ceiling | None  # None: the arrivals never reached 100 %
    at_130: Ceiling
    protocol_100: Ceiling | None = None
    protocol_130: Ceiling | None = None

    @property
    def policy(self) -> str:
        return "bound"

    @property
    def alloc_at_100(self) -> float:
        return self.at_100.bound if self.at_100 else math.nan

    @property
    def alloc_at_130(self) -> float:
        return self.at_130.bound

    @property
    def protocol_at_100(self) -> float:
        """The protocol's ceiling at 100 % (no higher than the offline one, also a bound)."""
        if self.at_100 is None:
            return math.nan
        if self.protocol_100 is None:
            return self.at_100.bound
        return min(self.protocol_100.bound, self.at_100.bound)

    @property
    def protocol_at_130(self) -> float:
        if self.protocol_130 is None:
            return self.at_130.bound
        return min(self.protocol_130.bound, self.at_130.bound)

    @property
    def seconds(self) -> float:
        solves = (self.at_100, self.at_130, self.protocol_100, self.protocol_130)
        return sum(c.seconds for c in solves if c is not None)

    @property
    def gap(self) -> float:
        """The larger proven gap of the offline solves."""
        return max(self.at_130.gap, self.at_100.gap if self.at_100 else 0.0)

    def row(self) -> dict[str, object]:
        """The JSON row: the bounds in the policy fields, the incumbents and gaps beside."""
        at_100 = self.at_100
        row: dict[str, object] = {
            "workload": self.workload,
            "policy": "bound",
            "seed": self.seed,
            "alloc_at_100": _up(at_100.bound) if at_100 else None,
            "alloc_at_130": _up(self.at_130.bound),
            "failed_pods": None,  # the model leaves pods out freely; not a placement
            "seconds": round(self.seconds, 3),
            "pods": self.at_130.pods,
            "best_at_100": round(at_100.best, 3) if at_100 else None,
            "best_at_130": round(self.at_130.best, 3),
            "gap_at_100": round(at_100.gap, 6) if at_100 else None,
            "gap_at_130": round(self.at_130.gap, 6),
            "bound_gap": round(self.gap, 6),
            "status_at_100": at_100.status if at_100 else None,
            "status_at_130": self.at_130.status,
            "exact_gpu_packing": self.at_130.exact_gpu_packing,
        }
        protocol = (
            ("100", self.protocol_100, self.protocol_at_100),
            ("130", self.protocol_130, self.protocol_at_130),
        )
        for point, solve, value in protocol:
            if solve is None:
                continue
            row[f"protocol_at_{point}"] = _up(value) if math.isfinite(value) else None
            row[f"protocol_gap_at_{point}"] = round(solve.gap, 6)
            row[f"forced_at_{point}"] = solve.forced_pods
        return row


def _up(value: float) -> float:
    """Round an upper bound to 3 decimals without going under it."""
    return math.ceil(value * 1000 - 1e-9) / 1000


def arrived_sets(order: Sequence[Job], total_milli: int) -> tuple[list[Job] | None, list[Job]]:
    """The pods seen when the arrived GPU share first reaches 100 % (None if it never
    does) and all of `order` (the run ends just short of 130 %), as the bench records."""
    arrived = 0
    for i, job in enumerate(order):
        arrived += job.gpu_request_milli
        if arrived >= total_milli:
            return list(order[: i + 1]), list(order)
    return None, list(order)


def run_bound(
    nodes: pd.DataFrame,
    pods: pd.DataFrame,
    workload: str,
    seed: int,
    time_limit_s: float = TIME_LIMIT_S,
    ratio: float = INFLATION_RATIO,
    protocol: bool = True,
) -> BoundResult:
    """The ceilings at 100 % and 130 % for one workload and seed: the offline one and,
    with `protocol`, the protocol's (one solve each)."""
    state = ClusterState.from_frame(nodes)
    order = arrival_order(jobs_from_pods(pods), state.total_gpu_milli, seed, ratio)
    first, everything = arrived_sets(order, state.total_gpu_milli)
    reached = first is not None
    return BoundResult(
        workload,
        seed,
        at_100=ceiling(state, first, time_limit_s) if reached else None,
        at_130=ceiling(state, everything, time_limit_s),
        protocol_100=ceiling(state, first, time_limit_s, protocol=True)
        if protocol and reached
        else None,
        protocol_130=ceiling(state, everything, time_limit_s, protocol=True) if protocol else None,
    )


def ceiling(
    state: ClusterState,
    jobs: Sequence[Job],
    time_limit_s: float = TIME_LIMIT_S,
    protocol: bool = False,
) -> Ceiling:
    """Solve the relaxation (module docstring) for `jobs` on the empty `state`; with
    `protocol`, `jobs` in arrival order and the protocol's cuts added."""
    start = time.perf_counter()
    nodes = node_types(state)
    cuts = arrival_cuts(nodes, jobs) if protocol else None
    model = _Model(nodes, pod_types(jobs), cuts)
    best, bound, status = model.solve(time_limit_s)
    return Ceiling(
        best_milli=best,
        # No allocation exceeds the cluster's GPUs (a bound not proven in time says more).
        bound_milli=min(bound, float(state.total_gpu_milli)),
        total_milli=state.total_gpu_milli,
        seconds=time.perf_counter() - start,
        status=status,
        pods=len(jobs),
        exact_gpu_packing=model.exact_packing,
        forced_pods=cuts.forced_pods if cuts else 0,
    )


def node_types(state: ClusterState) -> Counter[NodeType]:
    """GPU nodes by (CPU, memory, GPUs, model); GPU-less nodes hold no GPU pod."""
    types: Counter[NodeType] = Counter()
    for n in range(state.size):
        if state.gpu_count[n] > 0 and not state.cordoned[n]:
            model = state.models[state.model_id[n]]
            key = (int(state.cpu_cap[n]), int(state.mem_cap[n]), int(state.gpu_count[n]), model)
            types[key] += 1
    return types


def pod_types(jobs: Sequence[Job]) -> Counter[PodType]:
    """Valid GPU pods by (CPU, memory, GPUs, share, models); CPU-only pods allocate no GPU
    and the model may leave any pod out, so they play no part."""
    return Counter(pod_type(j) for j in jobs if takes_part(j))


def maximal_patterns(
    shares: Sequence[int], limit: int = MAX_PATTERNS
) -> list[tuple[int, ...]] | None:
    """Every multiset of `shares` (counts per share, in the given order) that fits one GPU
    and has no room for one more of the smallest; None when there are more than `limit`."""
    values = sorted(set(shares))
    smallest = values[0]
    found: list[tuple[int, ...]] = []

    def extend(i: int, left: int, counts: list[int]) -> bool:
        if i == len(values):
            if left < smallest:
                found.append(tuple(counts))
            return len(found) <= limit
        for c in range(left // values[i], -1, -1):
            if not extend(i + 1, left - c * values[i], [*counts, c]):
                return False
        return True

    if not extend(0, WHOLE_GPU_MILLI, []):
        return None
    order = [values.index(s) for s in shares]
    return [tuple(p[i] for i in order) for p in found]


class _Model:
    """The MIP (module docstring) in HiGHS's column/row form."""

    def __init__(
        self, nodes: Counter[NodeType], pods: Counter[PodType], cuts: ArrivalCuts | None = None
    ) -> None:
        self.lower: list[float] = []
        self.upper: list[float] = []
        self.cost: list[float] = []
        self.integer: list[int] = []
        self.rows: list[tuple[list[int], list[float], float]] = []  # indices, values, <= rhs
        shares = sorted({t[3] for t in pods if t[2] == 1 and t[3] < WHOLE_GPU_MILLI})
        patterns = maximal_patterns(shares) if shares else []
        self.exact_packing = patterns is not None
        by_type: dict[PodType, list[int]] = {t: [] for t in pods}
        for node, count in nodes.items():
            self._node_type(node, count, pods, shares, patterns, by_type)
        for t, columns in by_type.items():
            if columns:
                self.rows.append((columns, [1.0] * len(columns), float(pods[t])))
        if cuts is not None:
            self._arrival_cuts(cuts, by_type)

    def _arrival_cuts(self, cuts: ArrivalCuts, by_type: dict[PodType, list[int]]) -> None:
        """Forced pods as lower bounds on each type's placed count; each chain line as
        sum of the dominated types' GPUs - slope x the leader's count <= intercept."""
        for t, count in cuts.forced.items():
            columns = by_type.get(t, [])
            if count and columns:
                self.rows.append((columns, [-1.0] * len(columns), -float(count)))
        for chain in cuts.chains:
            dominated = [
                (c, float(u[2] * u[3])) for u in chain.dominated for c in by_type.get(u, [])
            ]
            if not dominated:
                continue
            leader = by_type.get(chain.leader, [])
            for intercept, slope in chain.lines:
                self.rows.append(
                    (
                        [c for c, _ in dominated] + leader,
                        [v for _, v in dominated] + [-slope] * len(leader),
                        intercept,
                    )
                )

    def _column(self, upper: float, cost: float = 0.0, integer: bool = True) -> int:
        self.lower.append(0.0)
        self.upper.append(upper)
        self.cost.append(cost)
        if integer:
            self.integer.append(len(self.cost) - 1)
        return len(self.cost) - 1

    def _node_type(
        self,
        node: NodeType,
        count: int,
        pods: Counter[PodType],
        shares: list[int],
        patterns: list[tuple[int, ...]] | None,
        by_type: dict[PodType, list[int]],
    ) -> None:
        cpu, mem, gpus, _ = node
        fits = [t for t in pods if fits_empty(t, node)]
        if not fits:
            return
        x = {t: self._column(float(pods[t]), float(t[2] * t[3])) for t in fits}
        for t, column in x.items():
            by_type[t].append(column)
        sharing = [t for t in fits if t[2] == 1 and t[3] < WHOLE_GPU_MILLI]
        whole = [t for t in fits if t not in sharing]
        shared_gpus = self._column(float(count * gpus)) if sharing else None
        # GPUs: whole GPUs of multi-GPU and one-GPU pods plus those given to sharing pods.
        indices = [x[t] for t in whole] + ([shared_gpus] if shared_gpus is not None else [])
        values = [float(t[2]) for t in whole] + ([1.0] if shared_gpus is not None else [])
        self.rows.append((indices, values, float(count * gpus)))
        for dim, capacity in ((0, cpu), (1, mem)):
            self.rows.append(
                ([x[t] for t in fits], [float(t[dim]) for t in fits], count * capacity)
            )
            self._cuts([(x[t], t[dim]) for t in fits], capacity, float(count))
        self._cuts([(x[t], t[2]) for t in whole], gpus, float(count))
        if shared_gpus is not None:
            self._share_packing(x, sharing, shares, patterns, shared_gpus, count * gpus)

    def _cuts(self, items: list[tuple[int, int]], capacity: int, per: float) -> None:
        """At most q items larger than capacity / (q + 1) fit one bin; `per` bins."""
        for q in range(1, CUT_DEPTH + 1):
            big = [column for column, size in items if size * (q + 1) > capacity]
            if big:
                self.rows.append((big, [1.0] * len(big), q * per))

    def _share_packing(
        self,
        x: dict[PodType, int],
        sharing: list[PodType],
        shares: list[int],
        patterns: list[tuple[int, ...]] | None,
        shared_gpus: int,
        gpus: int,
    ) -> None:
        if patterns is None:
            items = [(x[t], t[3]) for t in sharing]
            self.rows.append(
                (
                    [*(c for c, _ in items), shared_gpus],
                    [*(float(v) for _, v in items), -1000.0],
                    0.0,
                )
            )
            for q in range(1, CUT_DEPTH + 1):
                big = [c for c, v in items if v * (q + 1) > WHOLE_GPU_MILLI]
                if big:
                    self.rows.append(([*big, shared_gpus], [1.0] * len(big) + [-float(q)], 0.0))
            return
        present = {t[3] for t in sharing}
        used = [i for i, s in enumerate(shares) if s in present]
        # Patterns restricted to the shares this node type can take, without duplicates.
        kept = sorted({tuple(p[i] for i in used) for p in patterns})
        z = [self._column(float(gpus), integer=False) for _ in kept]
        self.rows.append(([*z, shared_gpus], [1.0] * len(z) + [-1.0], 0.0))
        for j, i in enumerate(used):
            pods = [x[t] for t in sharing if t[3] == shares[i]]
            slots = [(z[p], float(pattern[j])) for p, pattern in enumerate(kept) if pattern[j]]
            self.rows.append(
                (pods + [c for c, _ in slots], [1.0] * len(pods) + [-v for _, v in slots], 0.0)
            )

    def solve(self, time_limit_s: float) -> tuple[float, float, str]:
        """(incumbent, dual bound, HiGHS model status) in GPU thousandths. The LP
        relaxation is solved first and rounded down to a feasible start, so a solve cut
        short by its time limit still reports an incumbent near the bound."""
        if not self.cost:
            return 0.0, 0.0, "empty"
        began = time.perf_counter()
        lp = self._highs(time_limit_s, integer=False)
        lp.run()
        start = None
        if lp.getInfo().primal_solution_status:
            start = self.rounded(np.array(lp.getSolution().col_value))
        h = self._highs(max(1.0, time_limit_s - (time.perf_counter() - began)), integer=True)
        if start is not None:
            solution = highspy.HighsSolution()
            solution.col_value = start.tolist()
            h.setSolution(solution)
        h.run()
        info = h.getInfo()
        status = h.modelStatusToString(h.getModelStatus())
        best = float(info.objective_function_value) if info.primal_solution_status else 0.0
        if start is not None:
            best = max(best, float(np.dot(self.cost, start)))
        bound = float(info.mip_dual_bound)
        if not math.isfinite(bound):  # nothing proven in time: the trivial bound, all placed
            bound = float(np.dot(self.upper, self.cost))
        return best, max(bound, best), status

    def _highs(self, time_limit_s: float, integer: bool) -> highspy.Highs:
        h = _QuietHighs()
        h.setOptionValue("time_limit", float(time_limit_s))
        h.setOptionValue("mip_rel_gap", MIP_REL_GAP)
        h.setOptionValue("threads", 1)
        n = len(self.cost)
        h.addVars(n, np.array(self.lower), np.array(self.upper))
        h.changeColsCost(n, np.arange(n, dtype=np.int32), np.array(self.cost))
        if integer:
            h.changeColsIntegrality(
                len(self.integer),
                np.array(self.integer, dtype=np.int32),
                np.full(len(self.integer), highspy.HighsVarType.kInteger.value, dtype=np.uint8),
            )
        starts, indices, values, upper = [], [], [], []
        for cols, vals, rhs in self.rows:
            starts.append(len(indices))
            indices.extend(cols)
            values.extend(vals)
            upper.append(rhs)
        h.addRows(
            len(upper),
            np.full(len(upper), -highspy.kHighsInf),
            np.array(upper, dtype=np.float64),
            len(indices),
            np.array(starts, dtype=np.int32),
            np.array(indices, dtype=np.int32),
            np.array(values, dtype=np.float64),
        )
        h.changeObjectiveSense(highspy.ObjSense.kMaximize)
        return h

    def rounded(self, relaxed: np.ndarray) -> np.ndarray | None:
        """A feasible point below an LP solution: integer columns rounded down, then in
        each row still over its right-hand side the continuous columns with positive
        coefficients (the pattern counts) scaled down, then the integer ones (pods, which
        only ever have positive coefficients) reduced until it holds; None if a row is
        still over after that."""
        value = np.clip(relaxed, 0.0, np.array(self.upper))
        integer = np.zeros(value.size, dtype=bool)
        integer[self.integer] = True
        value[integer] = np.floor(value[integer] + 1e-6)
        for continuous_pass in (True, False):
            for cols, vals, rhs in self.rows:
                excess = float(np.dot(vals, value[cols])) - rhs
                if excess <= 1e-7:
                    continue
                for c, v in sorted(zip(cols, vals, strict=True), key=lambda cv: -cv[1]):
                    if v <= 0 or integer[c] == continuous_pass or value[c] <= 0:
                        continue
                    if continuous_pass:
                        cut = min(value[c], excess / v)
                    else:
                        cut = min(value[c], math.ceil(excess / v - 1e-9))
                    value[c] -= cut
                    excess -= cut * v
                    if excess <= 1e-7:
                        break
        for cols, vals, rhs in self.rows:
            if float(np.dot(vals, value[cols])) > rhs + 1e-6:
                return None
        return value


def run_bounds(
    nodes: pd.DataFrame,
    workloads: dict[str, pd.DataFrame],
    seeds: Sequence[int],
    time_limit_s: float = TIME_LIMIT_S,
    workers: int = 1,
    on_result: Callable[[BoundResult], None] | None = None,
) -> list[BoundResult]:
    """The ceiling of every (workload, seed), in parallel processes when `workers` > 1
    (each solve is single-threaded), in (workload, seed) order."""
    tasks = [(w, s) for w in workloads for s in seeds]
    results = []
    if workers <= 1:
        for w, s in tasks:
            results.append(run_bound(nodes, workloads[w], w, s, time_limit_s))
            if on_result is not None:
                on_result(results[-1])
        return results
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = [
            pool.submit(run_bound, nodes, workloads[w], w, s, time_limit_s) for w, s in tasks
        ]
        for future in as_completed(futures):
            results.append(future.result())
            if on_result is not None:
                on_result(results[-1])
    order = {t: i for i, t in enumerate(tasks)}
    return sorted(results, key=lambda r: order[(r.workload, r.seed)])
