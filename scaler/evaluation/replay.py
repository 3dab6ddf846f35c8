"""Trace replay: a demand series through a scaling policy, exactly as BENCHMARKS.md defines it.

At the start of step t a policy sees demand up to t-1 and sets a target fleet size. Nodes
added at step t are ready from step t+L; nodes removed at step t stop at once (booting
nodes go first, newest first). ready[t] is the nodes ready during step t and
shortage[t] = max(0, d[t] - ready[t]). Nodes are paid from the step they are requested
until they are removed, booting included. The fleet never exceeds the trace's capacity
bound where it has one.

Policies: `static` (the capacity the cluster really had), `reactive` (Cluster
Autoscaler), `ces` (the Helios CES rule on our median forecast), `oracle` (perfect
foresight) and `predictive` (ours: the same `planner.plan` the live loop calls); and what
teams run instead, swept over their setting: `headroom` and `headroom-percent` (Cluster
Autoscaler with spare nodes, `ReactiveRule` on padded demand) and `rolling-max`
(`rolling_max_targets`). These baselines are plain functions of the demand, not product.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import pandas as pd

from predictor.models.forecast import Forecaster, quantile_column
from scaler.cluster.pools import NodePool, whole_nodes, whole_nodes_each
from scaler.planning.planner import (
    DemandOutlook,
    FleetCapacity,
    PlannerMemory,
    PlannerPolicy,
    PoolCapacity,
    plan,
)

DAY = pd.Timedelta("1D")


@dataclass(frozen=True)
class ReplaySeries:
    """One demand series on regular steps, in nodes.

    Policies run from index `warmup` (so their memories are warm) and are scored on
    `[start, end)`; `static` is the fleet the cluster really had; `bound` caps the fleet
    (None: unbounded).
    """

    trace: str
    series: str
    ds: np.ndarray  # datetime64[ns]
    demand: np.ndarray
    static: np.ndarray | None
    bound: np.ndarray | None
    warmup: int
    start: int
    end: int
    step: pd.Timedelta

    def __post_init__(self) -> None:
        n = self.demand.size
        if not 1 <= self.warmup <= self.start < self.end <= n:
            raise ValueError(
                f"replay of {self.series}: need 1 <= warmup {self.warmup} <= start "
                f"{self.start} < end {self.end} <= {n} steps"
            )


class ReplayPolicy(Protocol):
    """Sets the target fleet size at step t, knowing demand up to t-1 (policies other than
    `oracle` must not read demand at or after t)."""

    name: str

    def target(self, t: int, ready: int, booting: int) -> int: ...


@dataclass(frozen=True)
class ReplayOutcome:
    series: ReplaySeries
    policy: str
    lag: int
    paid: np.ndarray  # fleet after each test step's decision (ready + booting)
    ready: np.ndarray
    shortage: np.ndarray
    actions: int
    seconds: float
    # The policy's setting: `knob` (the swept value; None for a policy without one) and the
    # protocol's extra fields of a swept row (e.g. `window_steps`, `buffer_nodes`).
    setting: dict[str, float] = field(default_factory=dict)
    # Over the warm-up steps before the test window, what a team tuning a buffer by hand
    # would have seen of it: its share of short steps and its provisioning ratio (None
    # without warm-up steps).
    warmup_short_share: float | None = None
    warmup_ratio: float | None = None

    def row(self) -> dict[str, object]:
        """The benchmark row (BENCHMARKS.md `scaling` fields, plus extras)."""
        s = self.series
        demand = s.demand[s.start : s.end]
        days = (s.end - s.start) * s.step / DAY
        return {
            "trace": s.trace,
            "series": s.series,
            "lag_steps": self.lag,
            "policy": self.policy,
            "knob": None,
            **self.setting,
            "provisioning_ratio": float(self.paid.sum() / demand.sum()),
            "shortage_events": int((self.shortage > 0).sum()),
            "shortage_node_steps": float(self.shortage.sum()),
            "scale_actions_per_day": float(self.actions / days),
            "steps": int(s.end - s.start),
            "step_minutes": float(s.step / pd.Timedelta(minutes=1)),
            "test_start": str(pd.Timestamp(s.ds[s.start])),
            "test_end": str(pd.Timestamp(s.ds[s.end - 1])),
            "mean_demand": float(demand.mean()),
            "mean_fleet": float(self.paid.mean()),
            "replay_seconds": round(self.seconds, 4),
            "warmup_short_share": self.warmup_short_share,
            "warmup_provisioning_ratio": self.warmup_ratio,
        }


def replay(
    series: ReplaySeries,
    policy: ReplayPolicy,
    lag: int,
    setting: dict[str, float] | None = None,
) -> ReplayOutcome:
    """Run `policy` over the series with boot lag `lag` steps; `setting` labels its row."""
    if lag < 0:
        raise ValueError("lag must be >= 0")
    began = time.perf_counter()
    demand, bound = series.demand, series.bound
    steps = series.end - series.warmup
    paid = np.zeros(steps)
    ready_out = np.zeros(steps)
    actions = 0
    ready = 0
    booting = [0] * lag  # booting[k]: nodes that become ready at step t + 1 + k
    for t in range(series.warmup, series.end):
        if lag:
            ready += booting[0]
            booting = [*booting[1:], 0]
        in_flight = sum(booting)
        target = max(int(policy.target(t, ready, in_flight)), 0)
        if bound is not None:
            target = min(target, int(bound[t]))
        total = ready + in_flight
        if target > total:
            if lag == 0:
                ready += target - total
            else:
                booting[lag - 1] += target - total
        elif target < total:
            excess = total - target
            for k in range(lag - 1, -1, -1):  # newest launches first, then ready nodes
                take = min(excess, booting[k])
                booting[k] -= take
                excess -= take
            ready -= excess
        paid[t - series.warmup] = target
        ready_out[t - series.warmup] = ready
        if t >= series.start:
            actions += target != total
    shortage = np.maximum(demand[series.warmup : series.end] - ready_out, 0.0)
    test = series.start - series.warmup
    # The fleet starts empty: its first `lag` warm-up steps are short under any policy.
    early = min(lag, test)
    warm, warm_short, warm_paid = (
        demand[series.warmup + early : series.start],
        shortage[early:test],
        paid[early:test],
    )
    return ReplayOutcome(
        series=series,
        policy=policy.name,
        lag=lag,
        paid=paid[test:],
        ready=ready_out[test:],
        shortage=shortage[test:],
        actions=actions,
        seconds=time.perf_counter() - began,
        setting=dict(setting or {}),
        warmup_short_share=float((warm_short > 0).mean()) if warm.size else None,
        warmup_ratio=float(warm_paid.sum() / warm.sum()) if warm.sum() > 0 else None,
    )


# --------------------------------------------------------------------------- policies


@dataclass
class StaticPolicy:
    """The capacity the cluster really had."""

    fleet: np.ndarray
    name: str = "static"

    def target(self, t: int, ready: int, booting: int) -> int:
        return math.ceil(self.fleet[t])


@dataclass
class OraclePolicy:
    """Perfect foresight: every node requested exactly `lag` steps before it is needed."""

    demand: np.ndarray
    lag: int
    name: str = "oracle"

    def target(self, t: int, ready: int, booting: int) -> int:
        return math.ceil(self.demand[t : t + self.lag + 1].max())


@dataclass
class PlannedTargets:
    """A baseline whose every target is a function of the demand before its step, computed
    ahead (`targets[t]` may read demand up to t-1 only)."""

    name: str
    targets: np.ndarray

    def target(self, t: int, ready: int, booting: int) -> int:
        return int(self.targets[t])


def rolling_max_targets(demand: np.ndarray, window: int, buffer: int) -> np.ndarray:
    """[t]: the maximum demand of steps t-window..t-1 plus `buffer` nodes (0 at t = 0)."""
    if window < 1:
        raise ValueError("window must be >= 1")
    seen = pd.Series(demand, dtype=float).rolling(window, min_periods=1).max().shift(1)
    return whole_nodes_each(seen.fillna(0.0).to_numpy()) + buffer


def spare_nodes(demand: np.ndarray, share: float) -> np.ndarray:
    """ceil(share x demand) nodes per step (a `CapacityBuffer` with `percentage`), the
    product's float residue (0.1 x 30 = 3.0000000000000004) not counted as a node."""
    return whole_nodes_each(share * demand)


@dataclass
class ReactiveRule:
    """Cluster Autoscaler on demand in nodes, exactly as the planner's reactive mode sizes
    one pool: scale up to the demand seen at t-1, and remove a node only once it has been
    unneeded for `unneeded_steps` (the fleet never goes below the peak demand of that time,
    counted from `warmup`, unless it already is below).

    `wanted` is the demand it serves: the demand itself, or the demand padded with spare
    nodes (`headroom`: + k; `headroom-percent`: + ceil(p x demand)) as overprovisioning
    placeholders or a `CapacityBuffer` are pods Cluster Autoscaler sees beside the real ones.
    """

    name: str
    wanted: np.ndarray
    unneeded_steps: int
    warmup: int
    _keep: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # [t]: peak of wanted[t-u..t-1], only over steps the rule has seen (from warmup-1)
        seen = np.array(self.wanted, dtype=float)  # a copy: the demand stays as it was
        seen[: max(self.warmup - 1, 0)] = -np.inf
        window = max(self.unneeded_steps, 1)
        self._keep = pd.Series(seen).rolling(window, min_periods=1).max().shift(1).to_numpy()

    def target(self, t: int, ready: int, booting: int) -> int:
        seen = whole_nodes(self.wanted[t - 1])
        keep = whole_nodes(self._keep[t])
        return max(seen, min(ready + booting, keep))


@dataclass
class CesPolicy:
    """The Helios CES rule (SC '21, HeliosArtifact CES_Philly.py) under this protocol.

    On a step whose fleet fell short of demand it scales to demand + buffer and keeps the
    fleet for `keep` steps; it scales down to demand + buffer only when the recent trend
    (mean of the `history` steps before the last vs the last) and the forecast (mean of
    the next `future` steps' median forecast vs the last demand) both point down, and the
    forecast does not rise further out (next 2 * `future` steps).
    """

    demand: np.ndarray
    future_mean: np.ndarray  # [t]: mean median forecast of steps t..t+future-1, made at t-1
    future_mean2: np.ndarray  # the same over t..t+2*future-1
    buffer: int
    keep: int = 10
    history: int = 2
    history_threshold: float = 0.1
    future_threshold: float = 0.0
    decrease_threshold: int = 1
    name: str = "ces"
    _started: bool = field(default=False, init=False)
    _stable_until: int = field(default=-1, init=False)

    def target(self, t: int, ready: int, booting: int) -> int:
        last = float(self.demand[t - 1])
        if not self._started:
            self._started = True
            return math.ceil(last) + self.buffer
        fleet = ready + booting
        if fleet < last:
            fleet = math.ceil(last) + self.buffer
            self._stable_until = t + self.keep
        past = self.demand[max(t - 1 - self.history, 0) : t - 1]
        history_trend = float(past.mean()) - last if past.size else 0.0
        future = float(self.future_mean[t])
        future_trend = last - future
        if (
            history_trend >= self.history_threshold
            and future_trend >= self.future_threshold
            and t >= self._stable_until
            and not future < float(self.future_mean2[t])
        ):
            self._stable_until = t
            lower = min(fleet, math.ceil(last) + self.buffer)
            if fleet - lower >= self.decrease_threshold:
                fleet = lower
        return fleet


@dataclass
class PlannerPolicyRun:
    """`planner.plan` on one pool of one-unit nodes, fed with precomputed forecasts: the
    replay shell of the same decision code the live loop runs."""

    name: str
    policy: PlannerPolicy
    pool: NodePool
    demand: np.ndarray
    at: Sequence[object]  # datetime per step
    levels: tuple[float, ...] = ()
    outlook: np.ndarray | None = None  # [t, k-1, j]: quantile j of demand at t-1+k
    memory: PlannerMemory | None = field(default=None, init=False)

    def target(self, t: int, ready: int, booting: int) -> int:
        values = self.outlook[t] if self.outlook is not None else np.empty((0, 0))
        outlook = DemandOutlook(
            group="demand", observed=float(self.demand[t - 1]), levels=self.levels, values=values
        )
        fleet = FleetCapacity(at=self.at[t], pools=(PoolCapacity(self.pool.name, ready, booting),))
        decided = plan([outlook], fleet, [self.pool], self.policy, self.memory)
        self.memory = decided.memory
        return decided.desired[self.pool.name]


# --------------------------------------------------------------------------- forecasts


def rolling_outlook(
    forecaster: Forecaster,
    history: pd.DataFrame,
    ds: np.ndarray,
    first: int,
    horizons: Sequence[int],
    quantiles: Sequence[float],
) -> np.ndarray:
    """Array [t, i, j]: quantile j of demand at step t-1+horizons[i], forecast from data up
    to t-1, for decisions t >= `first` (one rolling backtest per horizon; `history` holds
    one series). Targets past the data repeat the nearest shorter horizon's forecast."""
    index = pd.DatetimeIndex(ds)
    out = np.full((ds.size, len(horizons), len(quantiles)), np.nan)
    start = pd.Timestamp(ds[first])
    cols = [quantile_column(q) for q in quantiles]
    for i, k in enumerate(horizons):
        frame = forecaster.rolling(history, k, start, quantiles).frame
        pos = index.get_indexer(pd.DatetimeIndex(frame["ds"]))
        decision = pos - (k - 1)  # the target t-1+k is decided at step t
        ok = (pos >= 0) & (decision >= 0)
        out[decision[ok], i, :] = frame[cols].to_numpy(dtype=float)[ok]
    for i in range(1, len(horizons)):
        gap = np.isnan(out[:, i, :])
        out[:, i, :][gap] = out[:, i - 1, :][gap]
    return out


def horizon_mean_weights(horizons: Sequence[int], span: int) -> np.ndarray:
    """Weights w with `forecasts @ w` = the mean forecast over horizons 1..span, linearly
    interpolated between the sampled `horizons` (which must include 1 and reach span)."""
    grid = np.arange(1, span + 1)
    eye = np.eye(len(horizons))
    rows = np.array([np.interp(grid, horizons, eye[i]) for i in range(len(horizons))])
    return rows.mean(axis=1)
