"""Forecast benchmark metrics against hand computation, and the harness on real traces."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from predictor.data.loaders import DemandTrace, load_trace
from predictor.evaluation.backtest import (
    backtest_group,
    baseline_quantile,
    below,
    coverage,
    group_by_window,
    pinball,
    rmse,
    summarize,
)
from predictor.foundation.errors import InputError
from predictor.models import BoostParams, build

CONTRACT = {
    "trace",
    "series",
    "horizon_min",
    "model",
    "rmse",
    "rmse_persistence",
    "pinball_p90",
    "pinball_p99",
    "pinball_p90_baseline",
    "pinball_p99_baseline",
    "coverage_p90",
    "coverage_p99",
    "below_p90",
    "below_p99",
}


def test_metrics_match_hand_computation() -> None:
    actual = np.array([10.0, 12.0, 9.0, 15.0])
    forecast = np.array([11.0, 12.0, 10.0, 12.0])
    assert rmse(actual, forecast) == pytest.approx(np.sqrt((1 + 0 + 1 + 9) / 4))
    # p90: under-forecast by 3 costs 0.9 * 3; over-forecasts by 1 cost 0.1 each
    assert pinball(actual, forecast, 0.9) == pytest.approx((0.1 + 0 + 0.1 + 2.7) / 4)
    assert pinball(actual, forecast, 0.5) == pytest.approx((0.5 + 0 + 0.5 + 1.5) / 4)
    assert coverage(actual, forecast) == pytest.approx(3 / 4)  # equality counts as covered
    assert below(actual, forecast) == pytest.approx(2 / 4)  # equality is not below


def test_baseline_quantile_is_last_value_plus_training_change_quantile() -> None:
    train = np.array([0.0, 1.0, 3.0, 3.0, 7.0, np.nan, 8.0])
    # 2-step changes over training, NaN pairs skipped: 3, 2, 4, (nan), 1
    last = np.array([5.0, 6.0])
    expected = last + np.quantile([3.0, 2.0, 4.0, 1.0], 0.9)
    assert baseline_quantile(train, last, 2, 0.9) == pytest.approx(expected)
    with pytest.raises(InputError):
        baseline_quantile(np.array([1.0]), last, 2, 0.9)


def _helios_slice(traces_dir: Path, vc: str, days: int = 9) -> DemandTrace:
    full = load_trace(f"helios-vc:{traces_dir / 'helios-earth' / f'{vc}.csv.gz'}")
    frame = full.frame[full.frame["ds"] < full.frame["ds"].min() + pd.Timedelta(days=days)]
    return DemandTrace.from_frame(frame, kind="helios-vc", unit="gpus", split="2020-05-07")


def test_bench_rows_on_a_slice_of_real_traces(traces_dir: Path) -> None:
    traces = [_helios_slice(traces_dir, "vcTJs"), _helios_slice(traces_dir, "vchbv")]
    groups = group_by_window(traces)
    assert len(groups) == 1  # same window: one global model
    small = BoostParams(n_estimators=30, min_child_samples=50)
    models = {
        "gpuscale": lambda: build("gpuscale", horizons=(1, 3, 18), params=small),
        "empirical": lambda: build("empirical"),
        "persistence": lambda: build("persistence"),
    }
    rows = [r.to_dict() for r in backtest_group(groups[0], models)]
    assert len(rows) == 2 * 3 * 3
    assert {(r["series"], r["horizon_min"], r["model"]) for r in rows} == {
        (s, h, m) for s in ("vcTJs", "vchbv") for h in (10, 30, 180) for m in models
    }
    for r in rows:
        assert set(r) >= CONTRACT
        assert r["steps"] == 3 * 144  # May 7-9, every step scored
        assert all(np.isfinite(float(r[k])) for k in CONTRACT - {"trace", "series", "model"})
    for r in rows:
        if r["model"] == "empirical":  # the baseline scored as a model is the baseline
            assert r["pinball_p90"] == pytest.approx(r["pinball_p90_baseline"])
            assert r["pinball_p99"] == pytest.approx(r["pinball_p99_baseline"])
        if r["model"] == "persistence":
            assert r["rmse"] == pytest.approx(r["rmse_persistence"])
    summary = summarize(rows)
    assert [s["horizon_min"] for s in summary] == [10, 30, 180]
    assert all(s["series"] == 2 for s in summary)


def test_philly_persistence_matches_the_published_harness_check(traces_dir: Path) -> None:
    trace = load_trace(f"philly:{traces_dir / 'philly' / 'philly_node_sequence.csv.gz'}")
    rows = backtest_group(
        group_by_window([trace])[0], {"persistence": lambda: build("persistence")}
    )
    by_horizon = {r.horizon_min: r.rmse_persistence for r in rows}
    assert by_horizon[10] == pytest.approx(10.33, rel=0.01)
    assert by_horizon[180] == pytest.approx(21.31, rel=0.01)
    assert all(r.steps == 14 * 144 for r in rows)


def test_a_series_in_two_traces_is_refused(traces_dir: Path) -> None:
    one = _helios_slice(traces_dir, "vcTJs")
    with pytest.raises(InputError, match="two traces"):
        group_by_window([one, one])
