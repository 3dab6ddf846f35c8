"""What the forecast is worth at trace level: the planner with and without its forecast rules
(`PlannerPolicy.forecast_rules`, the bench's `predictive-no-forecast` rows) on a series whose
jumps a forecast can know in advance."""

from __future__ import annotations

import numpy as np
import pandas as pd
from replay_fixtures import hand_series

from scaler.evaluation.replay import PlannerPolicyRun, ReplayOutcome, replay
from scaler.evaluation.scaling_bench import (
    NO_FORECAST,
    QUANTILES,
    PreparedSeries,
    baseline_runs,
    by_lag_and_knob,
    planner_run,
    summarize,
    sweep_runs,
    trace_pool,
    without_forecast,
)
from scaler.planning.planner import PlannerPolicy

LAG = 2
KNOB = 0.001


def jumping_demand(days: int = 6) -> np.ndarray:
    """10 nodes, and 20 for 6 steps every 36 steps: far too often for a buffer to wait out,
    so a rule that does not know them holds about 20 nodes throughout."""
    cycle = np.array([10.0] * 30 + [20.0] * 6)
    return np.tile(cycle, days * 4)


def outlook_of(future: np.ndarray, rows: int) -> np.ndarray:
    """[t, k-1, j]: every quantile of demand at t-1+k is `future[t-1+k]` (past the end, the
    last value): a forecast that knows what comes, as sure of it as of the past."""
    n = future.size
    at = np.minimum(np.arange(n)[:, None] - 1 + np.arange(1, rows + 1)[None, :], n - 1)
    values = future[np.maximum(at, 0)]
    return np.repeat(values[:, :, None], len(QUANTILES), axis=2)


def prepared(demand: np.ndarray, forecast_of: np.ndarray) -> PreparedSeries:
    """A bench series from day 3 on (two days warm the planner up), forecast by
    `outlook_of(forecast_of)`."""
    series = hand_series(demand, warmup=144, start=2 * 144, static=25.0)
    return PreparedSeries(
        series=series,
        units=demand,
        per_node=1,
        outlook=outlook_of(forecast_of, LAG + 1),
        ces_future=(demand.copy(), demand.copy()),
        ces_buffer=2,
        at=list(pd.DatetimeIndex(series.ds).to_pydatetime()),
        step=series.step,
    )


def targets(item: PreparedSeries, policy: PlannerPolicy) -> ReplayOutcome:
    run = PlannerPolicyRun(
        "predictive", policy, trace_pool(item, LAG), item.units, item.at, QUANTILES, item.outlook
    )
    return replay(item.series, run, LAG)


def test_the_tuned_plan_follows_the_forecast_and_without_it_ignores_it() -> None:
    # The same history, two forecasts: one that knows the jumps, one that only repeats the
    # last demand. Once tuned, the plan asks for different fleets; with the forecast rules
    # off it asks for the same one under both.
    demand = jumping_demand()
    knowing, flat = prepared(demand, demand), prepared(demand, np.r_[demand[0], demand[:-1]])
    policy = PlannerPolicy(target_shortage=KNOB)
    a, b = targets(knowing, policy), targets(flat, policy)
    assert not np.array_equal(a.paid, b.paid)
    # Knowing the jumps a boot ahead, it is ready for them and pays for them only then.
    assert a.shortage.sum() <= b.shortage.sum()
    assert a.paid.mean() < 0.9 * b.paid.mean()
    plain = without_forecast(policy)
    assert np.array_equal(targets(knowing, plain).paid, targets(flat, plain).paid)


def test_no_forecast_rows_price_what_the_forecast_adds_at_matched_shortage() -> None:
    item = prepared(jumping_demand(), jumping_demand())
    policy = PlannerPolicy(target_shortage=KNOB)
    outcomes = [*baseline_runs(item, LAG), *sweep_runs(item, LAG)]
    outcomes += [planner_run(item, LAG, policy), planner_run(item, LAG, without_forecast(policy))]
    rows = [o.row() for o in outcomes]
    assert [r["knob"] for r in rows if r["policy"] == NO_FORECAST] == [KNOB]
    (point,) = summarize(rows)
    # The forecast rule is chosen, so the two rows differ, and ours is the cheaper one at
    # matched shortage (each against the baselines' envelope at its own shortage).
    assert point["forecast_differs"] is True
    assert point["no_forecast_ratio"] > point["predictive_ratio"]
    assert point["forecast_gain"] == point["saving"] - point["no_forecast_saving"]
    assert point["forecast_gain"] > 0.05
    (total,) = by_lag_and_knob([point])
    assert (total["lag_steps"], total["knob"], total["forecast_points_differ"]) == (LAG, KNOB, 1)
    assert total["forecast_mean_gain"] == point["forecast_gain"]
