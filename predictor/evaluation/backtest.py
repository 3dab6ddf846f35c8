"""The `forecast` benchmark of BENCHMARKS.md: metrics as pure functions, and the harness.

Protocol: every series on 10-minute steps (maximum of the minutes inside a step); for every
test step t and horizon h, the forecast of y[t] is made from data up to t - h only (one
`rolling` call per model and horizon). Models are fitted on the training window. Traces
that share a test window share one model, fitted on all their series' training rows (a
global model), so no model ever trains on a step at or after any test step it forecasts.
Only steps with an observation at t and at t - h are scored.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd

from predictor.data.loaders import DemandTrace
from predictor.data.series import h_step_changes, regularize
from predictor.foundation.errors import InputError
from predictor.models.forecast import Forecaster, quantile_column

HORIZONS: tuple[int, ...] = (1, 3, 18)
QUANTILES: tuple[float, ...] = (0.5, 0.9, 0.99)
BASELINE_MODEL = "empirical"


def rmse(actual: np.ndarray, forecast: np.ndarray) -> float:
    return float(np.sqrt(np.mean((np.asarray(actual) - np.asarray(forecast)) ** 2)))


def pinball(actual: np.ndarray, quantile: np.ndarray, level: float) -> float:
    """Mean pinball (quantile) loss of forecasts of the `level` quantile."""
    diff = np.asarray(actual, dtype=float) - np.asarray(quantile, dtype=float)
    return float(np.mean(np.maximum(level * diff, (level - 1.0) * diff)))


def coverage(actual: np.ndarray, quantile: np.ndarray) -> float:
    """Share of steps whose actual value is at or below the forecast quantile."""
    return float(np.mean(np.asarray(actual) <= np.asarray(quantile)))


def below(actual: np.ndarray, quantile: np.ndarray) -> float:
    """Share of steps whose actual value is strictly below the forecast quantile. Demand
    that stays flat puts a point mass on the last value, so a correct quantile at level a
    has `below <= a <= coverage` rather than a coverage near a."""
    return float(np.mean(np.asarray(actual) < np.asarray(quantile)))


def baseline_quantile(
    train_y: np.ndarray, last: np.ndarray, horizon: int, level: float
) -> np.ndarray:
    """BENCHMARKS.md's baseline: y[t-h] plus the empirical `level` quantile of the h-step
    changes y[s] - y[s-h] over the training window (NaN pairs skipped)."""
    changes = h_step_changes(train_y, horizon)
    if changes.size == 0:
        raise InputError(f"training window too short for the {horizon}-step baseline")
    return np.asarray(last, dtype=float) + float(np.quantile(changes, level))


@dataclass(frozen=True)
class ForecastRow:
    """One row of the `forecast` suite (the contract's fields, then extras)."""

    trace: str
    series: str
    horizon_min: int
    model: str
    rmse: float
    rmse_persistence: float
    pinball_p90: float
    pinball_p99: float
    pinball_p90_baseline: float
    pinball_p99_baseline: float
    coverage_p90: float
    coverage_p99: float
    below_p90: float
    below_p99: float
    steps: int
    fit_seconds: float
    forecast_seconds: float

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def score(
    actual: np.ndarray,
    last: np.ndarray,
    q50: np.ndarray,
    q90: np.ndarray,
    q99: np.ndarray,
    base90: np.ndarray,
    base99: np.ndarray,
) -> dict[str, float]:
    """The metric fields of a row from aligned arrays over the scored steps."""
    return {
        "rmse": rmse(actual, q50),
        "rmse_persistence": rmse(actual, last),
        "pinball_p90": pinball(actual, q90, 0.9),
        "pinball_p99": pinball(actual, q99, 0.99),
        "pinball_p90_baseline": pinball(actual, base90, 0.9),
        "pinball_p99_baseline": pinball(actual, base99, 0.99),
        "coverage_p90": coverage(actual, q90),
        "coverage_p99": coverage(actual, q99),
        "below_p90": below(actual, q90),
        "below_p99": below(actual, q99),
    }


def group_by_window(traces: Sequence[DemandTrace]) -> list[list[DemandTrace]]:
    """Resampled traces grouped by test window (each group shares one fitted model)."""
    groups: dict[tuple[pd.Timestamp, pd.Timestamp], list[DemandTrace]] = {}
    seen: dict[str, str] = {}
    for trace in traces:
        for uid in trace.series_ids:
            if uid in seen:
                raise InputError(
                    f"series {uid!r} appears in two traces ({seen[uid]} and {trace.path})"
                )
            seen[uid] = trace.path
        stepped = trace.resampled()
        groups.setdefault((stepped.test_start, stepped.test_end), []).append(stepped)
    return list(groups.values())


def backtest_group(
    group: Sequence[DemandTrace],
    models: Mapping[str, Callable[[], Forecaster]],
    *,
    horizons: Sequence[int] = HORIZONS,
    on_step: Callable[[str], None] | None = None,
) -> list[ForecastRow]:
    """Rows for every series of traces that share one (resampled) test window."""
    start, end = group[0].test_start, group[0].test_end
    frame = pd.concat([t.frame for t in group], ignore_index=True)
    train = frame[frame["ds"] < start]
    if train.empty:
        raise InputError(f"no training data before the test start {start}")
    trace_of = {uid: t.label for t in group for uid in t.series_ids}
    grid = regularize(frame)  # missing steps stay NaN here: they are never scored
    observed = {
        str(uid): g.set_index("ds")["y"].astype(float) for uid, g in grid.groupby("unique_id")
    }
    rows: list[ForecastRow] = []
    for name, make in models.items():
        began = time.perf_counter()
        model = make().fit(train)
        fit_seconds = time.perf_counter() - began
        for h in horizons:
            began = time.perf_counter()
            out = model.rolling(frame, h, start, QUANTILES).frame
            seconds = time.perf_counter() - began
            for uid, fc in out.groupby("unique_id", sort=True):
                y = observed[str(uid)]
                fc = fc[(fc["ds"] >= start) & (fc["ds"] <= end)]
                rows.append(
                    _row(
                        trace_of[str(uid)],
                        str(uid),
                        name,
                        h,
                        fc,
                        y,
                        start,
                        fit_seconds,
                        seconds,
                    )
                )
            if on_step is not None:
                on_step(f"{name} h={h}")
    return rows


def _row(
    trace: str,
    uid: str,
    model: str,
    h: int,
    fc: pd.DataFrame,
    y: pd.Series,
    start: pd.Timestamp,
    fit_seconds: float,
    forecast_seconds: float,
) -> ForecastRow:
    step = pd.Timedelta(y.index.to_series().diff().min())
    target = pd.DatetimeIndex(fc["ds"])
    actual = y.reindex(target).to_numpy()
    last = y.reindex(target - h * step).to_numpy()
    keep = np.isfinite(actual) & np.isfinite(last)
    if not keep.any():
        raise InputError(f"series {uid!r}: no scorable step in the test window at h={h}")
    train_y = y[y.index < start].to_numpy()
    cols = {q: fc[quantile_column(q)].to_numpy()[keep] for q in QUANTILES}
    metrics = score(
        actual[keep],
        last[keep],
        cols[0.5],
        cols[0.9],
        cols[0.99],
        baseline_quantile(train_y, last[keep], h, 0.9),
        baseline_quantile(train_y, last[keep], h, 0.99),
    )
    return ForecastRow(
        trace=trace,
        series=uid,
        horizon_min=round(h * step / pd.Timedelta(minutes=1)),
        model=model,
        **metrics,
        steps=int(keep.sum()),
        fit_seconds=round(fit_seconds, 3),
        forecast_seconds=round(forecast_seconds, 3),
    )


# BENCHMARKS.md (revised 2026-12-01): a quantile at level a is calibrated when
# below <= a <= coverage; per horizon on average below_p90 <= 0.92, coverage_p90 >= 0.88,
# below_p99 <= 0.995, coverage_p99 >= 0.975.
TARGETS = {
    "ratio_mean": 0.85,
    "ratio_max": 1.05,
    "below_p90": 0.92,
    "coverage_p90": 0.88,
    "below_p99": 0.995,
    "coverage_p99": 0.975,
}


def summarize(rows: Sequence[Mapping[str, object]], model: str = "gpuscale") -> list[dict]:
    """Per horizon, over series: mean pinball ratios (ours / baseline), worst ratio, mean
    coverage, and series where RMSE is above persistence, with pass/fail on each target."""
    frame = pd.DataFrame([r for r in rows if r["model"] == model])
    if frame.empty:
        return []
    frame["ratio_p90"] = frame["pinball_p90"] / frame["pinball_p90_baseline"].clip(lower=1e-12)
    frame["ratio_p99"] = frame["pinball_p99"] / frame["pinball_p99_baseline"].clip(lower=1e-12)
    out = []
    for h, g in frame.groupby("horizon_min", sort=True):
        worst = float(max(g["ratio_p90"].max(), g["ratio_p99"].max()))
        above = g[g["rmse"] > g["rmse_persistence"] + 1e-9]["series"].tolist()
        rec = {
            "horizon_min": int(h),
            "series": len(g),
            "ratio_p90": float(g["ratio_p90"].mean()),
            "ratio_p99": float(g["ratio_p99"].mean()),
            "worst_ratio": worst,
            "coverage_p90": float(g["coverage_p90"].mean()),
            "coverage_p99": float(g["coverage_p99"].mean()),
            "below_p90": float(g["below_p90"].mean()),
            "below_p99": float(g["below_p99"].mean()),
            "rmse_ratio": float((g["rmse"] / g["rmse_persistence"].clip(lower=1e-12)).mean()),
            "rmse_above_persistence": above,
        }
        rec["met"] = bool(
            rec["ratio_p90"] <= TARGETS["ratio_mean"]
            and rec["ratio_p99"] <= TARGETS["ratio_mean"]
            and worst <= TARGETS["ratio_max"]
            and rec["below_p90"] <= TARGETS["below_p90"]
            and rec["coverage_p90"] >= TARGETS["coverage_p90"]
            and rec["below_p99"] <= TARGETS["below_p99"]
            and rec["coverage_p99"] >= TARGETS["coverage_p99"]
            and not above
        )
        out.append(rec)
    return out
