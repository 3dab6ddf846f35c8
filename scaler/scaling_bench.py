"""The `scaling` benchmark (BENCHMARKS.md): every trace series replayed through all five
policies at each boot lag, side by side, on the same forecasts.

Forecasts: the model is fitted on the training window minus its last `calibration_days`;
those days then warm up every policy (the predictive planner learns its safety margin from
genuine out-of-sample errors there), and only the test window is scored. Nothing at or
after a step is seen by a policy before that step is decided (the oracle excepted).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime

import numpy as np
import pandas as pd

from predictor.forecast import Forecaster
from predictor.loaders import DemandTrace
from predictor.series import regularize
from scaler.planner import PlannerPolicy
from scaler.pools import NodePool
from scaler.replay import (
    CesPolicy,
    OraclePolicy,
    PlannerPolicyRun,
    ReplayOutcome,
    ReplayPolicy,
    ReplaySeries,
    StaticPolicy,
    horizon_mean_weights,
    replay,
    rolling_outlook,
)

QUANTILES: tuple[float, ...] = (0.5, 0.9, 0.99)
CES_FUTURE = 30
# Horizons sampled for the CES rule's 30- and 60-step mean forecasts (interpolated between).
CES_HORIZONS: tuple[int, ...] = (1, 2, 3, 4, 6, 9, 12, 18, 24, 30, 36, 42, 48, 54, 60)
PHILLY_CES_BUFFER = 20
CES_BUFFER_SHARE = 0.06


@dataclass(frozen=True)
class BenchSettings:
    lags: tuple[int, ...] = (0, 1)
    gpus_per_node: int | None = None  # a generic series counts GPUs when set
    calibration_days: float = 7.0
    policy: PlannerPolicy = field(default_factory=PlannerPolicy)


def units_per_node(trace: DemandTrace, gpus_per_node: int | None) -> int:
    """How many demand units one node holds: Helios counts GPUs on 8-GPU nodes; a generic
    series counts nodes unless told it counts GPUs."""
    if trace.kind == "helios-vc":
        return 8
    if trace.kind == "series" and gpus_per_node:
        return gpus_per_node
    return 1


@dataclass(frozen=True)
class PreparedSeries:
    """One series ready to replay: demand in nodes, the raw units the planner reads, and the
    forecasts every policy that needs one shares."""

    series: ReplaySeries
    units: np.ndarray  # demand in the trace's unit (GPUs or nodes)
    per_node: int
    outlook: np.ndarray  # [t, i, j]: QUANTILES[j] at horizon `horizons[i]`, decided at t
    horizons: tuple[int, ...]
    ces_buffer: int
    at: list[datetime]
    step: pd.Timedelta


@dataclass(frozen=True)
class PreparedTrace:
    series: list[PreparedSeries]
    fit_seconds: float
    forecast_seconds: float


def prepare_trace(
    trace: DemandTrace,
    make_forecaster: Callable[[], Forecaster],
    settings: BenchSettings,
) -> PreparedTrace:
    """Fit the model on training minus the calibration days and forecast every series."""
    stepped = trace.resampled()
    frame = regularize(stepped.frame, fill="ffill").drop(columns="filled")
    step = pd.Timedelta(frame["ds"].diff().dropna().min())
    per_node = units_per_node(trace, settings.gpus_per_node)
    calibration = round(pd.Timedelta(days=settings.calibration_days) / step)

    layouts = {}
    for uid, group in frame.groupby("unique_id", sort=True):
        ds = group["ds"].to_numpy()
        start = int(np.searchsorted(ds, np.datetime64(stepped.test_start)))
        end = int(np.searchsorted(ds, np.datetime64(stepped.test_end), side="right"))
        if start >= end or start < 2:
            continue
        warmup = max(start - min(calibration, start // 2), 1)
        layouts[str(uid)] = (group.reset_index(drop=True), ds, warmup, start, end)
    if not layouts:
        return PreparedTrace([], 0.0, 0.0)

    fit_until = min(ds[warmup] for _, ds, warmup, _, _ in layouts.values())
    began = time.perf_counter()
    forecaster = make_forecaster().fit(frame[frame["ds"] < fit_until])
    fit_seconds = time.perf_counter() - began

    horizons = tuple(sorted({*range(1, max(settings.lags) + 2), *CES_HORIZONS}))
    prepared = []
    forecast_seconds = 0.0
    for uid, (group, ds, warmup, start, end) in layouts.items():
        units = group["y"].to_numpy(dtype=float)
        demand = np.ceil(units / per_node - 1e-9)
        capacity = (
            np.ceil(group["capacity"].to_numpy(dtype=float) / per_node - 1e-9)
            if "capacity" in group
            else None
        )
        static = capacity if capacity is not None else np.full(demand.size, demand[:start].max())
        began = time.perf_counter()
        outlook = rolling_outlook(forecaster, group, ds, warmup, horizons, QUANTILES)
        forecast_seconds += time.perf_counter() - began
        prepared.append(
            PreparedSeries(
                series=ReplaySeries(
                    trace=trace.label,
                    series=uid,
                    ds=ds,
                    demand=demand,
                    static=static,
                    bound=capacity if trace.kind == "philly" else None,
                    warmup=warmup,
                    start=start,
                    end=end,
                    step=step,
                ),
                units=units,
                per_node=per_node,
                outlook=outlook,
                horizons=horizons,
                ces_buffer=(
                    PHILLY_CES_BUFFER
                    if trace.kind == "philly"
                    else max(1, math.ceil(CES_BUFFER_SHARE * demand[:start].mean()))
                ),
                at=list(pd.DatetimeIndex(ds).to_pydatetime()),
                step=step,
            )
        )
    return PreparedTrace(prepared, fit_seconds, forecast_seconds)


def trace_pool(prepared: PreparedSeries, lag: int) -> NodePool:
    """The replay's single pool: nodes of `per_node` units that boot in `lag` steps."""
    return NodePool(
        name=prepared.series.series,
        gpu_model="any",
        gpus_per_node=prepared.per_node,
        price_per_hour=1.0,
        boot_seconds=lag * prepared.step.total_seconds(),
        max_size=10**9,
    )


def planner_run(prepared: PreparedSeries, lag: int, policy: PlannerPolicy) -> ReplayOutcome:
    """Our planner (`predictive` row, or any knob setting of it) over one series."""
    step_seconds = prepared.step.total_seconds()
    return replay(
        prepared.series,
        PlannerPolicyRun(
            "predictive",
            policy.model_copy(update={"step_seconds": step_seconds}),
            trace_pool(prepared, lag),
            prepared.units,
            prepared.at,
            QUANTILES,
            prepared.outlook[:, : lag + 1, :],
        ),
        lag,
    )


def baseline_runs(prepared: PreparedSeries, lag: int) -> list[ReplayOutcome]:
    """`static`, `reactive`, `ces` and `oracle` over one series."""
    s = prepared.series
    step_seconds = prepared.step.total_seconds()
    median = prepared.outlook[:, :, QUANTILES.index(0.5)] / prepared.per_node
    # The capacity the cluster really had was there all along, never booting.
    static = dataclasses.replace(replay(s, StaticPolicy(s.static), 0), lag=lag)
    policies: Sequence[ReplayPolicy] = (
        PlannerPolicyRun(
            "reactive",
            PlannerPolicy(
                mode="reactive",
                step_seconds=step_seconds,
                unneeded_steps=max(1, math.ceil(600 / step_seconds)),
            ),
            trace_pool(prepared, lag),
            prepared.units,
            prepared.at,
        ),
        CesPolicy(
            s.demand,
            future_mean=median @ horizon_mean_weights(prepared.horizons, CES_FUTURE),
            future_mean2=median @ horizon_mean_weights(prepared.horizons, 2 * CES_FUTURE),
            buffer=prepared.ces_buffer,
        ),
        OraclePolicy(s.demand, lag),
    )
    return [static, *(replay(s, policy, lag) for policy in policies)]


def bench_trace(
    trace: DemandTrace,
    make_forecaster: Callable[[], Forecaster],
    settings: BenchSettings,
) -> tuple[PreparedTrace, list[ReplayOutcome]]:
    """Replay every series of one trace under every policy and lag."""
    prepared = prepare_trace(trace, make_forecaster, settings)
    outcomes = []
    for item in prepared.series:
        for lag in settings.lags:
            outcomes += baseline_runs(item, lag)
            outcomes.append(planner_run(item, lag, settings.policy))
    return prepared, outcomes


def summarize(rows: Sequence[dict[str, object]]) -> list[dict[str, object]]:
    """Per series and lag, how `predictive` stands against the baselines: shortage against
    `reactive`, and the share of the provisioning distance between the best baseline and
    `oracle` it closes. The best baseline is the cheapest one whose shortage is no more than
    ours (a baseline that is cheaper only by leaving demand unserved is no bar to beat);
    when every baseline lacks more than ours, the one that lacks least."""
    out = []
    keys = sorted({(r["trace"], r["series"], r["lag_steps"]) for r in rows})
    for key in keys:
        group = {r["policy"]: r for r in rows if (r["trace"], r["series"], r["lag_steps"]) == key}
        if not {"predictive", "oracle", "reactive"} <= group.keys():
            continue
        ours, oracle = group["predictive"], group["oracle"]
        baselines = [group[p] for p in ("static", "reactive", "ces") if p in group]
        comparable = [
            b for b in baselines if b["shortage_node_steps"] <= ours["shortage_node_steps"]
        ]
        best = (
            min(comparable, key=lambda b: b["provisioning_ratio"])
            if comparable
            else min(baselines, key=lambda b: (b["shortage_node_steps"], b["provisioning_ratio"]))
        )
        distance = best["provisioning_ratio"] - oracle["provisioning_ratio"]
        closed = (
            (best["provisioning_ratio"] - ours["provisioning_ratio"]) / distance
            if distance > 1e-12
            else math.nan
        )
        out.append(
            {
                "trace": key[0],
                "series": key[1],
                "lag_steps": key[2],
                "best_baseline": best["policy"],
                "best_ratio": best["provisioning_ratio"],
                "oracle_ratio": oracle["provisioning_ratio"],
                "predictive_ratio": ours["provisioning_ratio"],
                "gap_closed": closed,
                "shortage_vs_reactive": ours["shortage_node_steps"]
                - group["reactive"]["shortage_node_steps"],
            }
        )
    return out
