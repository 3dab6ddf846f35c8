"""Forecasting models on slices of real traces: no leakage, one answer per question,
quantiles that never cross, series and horizons the model was not trained on; the online
calibration of the default model on integer demand and across a change of regime."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from predictor.data.loaders import load_trace
from predictor.foundation.errors import InputError
from predictor.models import MODEL_NAMES, BoostParams, build
from predictor.models.conformal import online_quantile
from predictor.models.forecast import Forecaster, quantile_column

LEVELS = (0.5, 0.9, 0.99)
SMALL = BoostParams(n_estimators=25, min_child_samples=40)


def _model(name: str) -> Forecaster:
    if name in ("gpuscale", "lightgbm"):
        return build(name, horizons=(1, 3, 6), params=SMALL)
    return build(name)


@pytest.fixture(scope="module")
def helios(traces_dir: Path) -> pd.DataFrame:
    """Six days of two Helios VCs on 10-minute steps (with running and pending)."""
    frames = []
    for vc in ("vcTJs", "vc8Sj"):
        trace = load_trace(f"helios-vc:{traces_dir / 'helios-earth' / f'{vc}.csv.gz'}").resampled()
        frames.append(trace.frame[trace.frame["ds"] < pd.Timestamp("2020-05-07")])
    return pd.concat(frames, ignore_index=True)


SPLIT = pd.Timestamp("2020-05-05")


@pytest.fixture(scope="module")
def fitted(helios: pd.DataFrame) -> dict[str, Forecaster]:
    train = helios[helios["ds"] < SPLIT]
    return {name: _model(name).fit(train) for name in MODEL_NAMES}


@pytest.mark.parametrize("name", MODEL_NAMES)
@pytest.mark.parametrize("horizon", [1, 3, 5])
def test_no_forecast_reads_past_its_anchor(
    helios: pd.DataFrame, fitted: dict[str, Forecaster], name: str, horizon: int
) -> None:
    """Perturb every value after t - h (demand and exogenous alike): the forecast of t
    must not move."""
    model = fitted[name]
    series = helios[helios["unique_id"] == "vcTJs"].reset_index(drop=True)
    target = pd.Timestamp("2020-05-06 09:00")
    anchor = target - horizon * pd.Timedelta("10min")
    before = model.rolling(series, horizon, SPLIT, LEVELS).frame
    perturbed = series.copy()
    later = perturbed["ds"] > anchor
    rng = np.random.default_rng(horizon)
    for column in ("y", "running", "pending", "capacity"):
        perturbed.loc[later, column] = rng.integers(0, 200, int(later.sum())).astype(float)
    after = model.rolling(perturbed, horizon, SPLIT, LEVELS).frame
    cols = [quantile_column(q) for q in LEVELS]
    row_before = before.loc[before["ds"] == target, cols].to_numpy()
    row_after = after.loc[after["ds"] == target, cols].to_numpy()
    assert row_before.shape == (1, 3)
    np.testing.assert_array_equal(row_before, row_after)
    # ... while forecasts of later targets, which may read the perturbed steps, do move
    # (for the models that read recent values at all)
    if name != "seasonal-naive":
        late = before["ds"] > target + pd.Timedelta("1h")
        assert not np.array_equal(before.loc[late, cols], after.loc[late, cols])


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_forecast_from_the_end_equals_the_rolling_forecast(
    helios: pd.DataFrame, fitted: dict[str, Forecaster], name: str
) -> None:
    model = fitted[name]
    anchor = pd.Timestamp("2020-05-06 12:00")
    cut = helios[helios["ds"] <= anchor]
    ahead = model.forecast(cut, [1, 3], LEVELS).frame
    cols = [quantile_column(q) for q in LEVELS]
    for h in (1, 3):
        rolled = model.rolling(helios, h, SPLIT, LEVELS).frame
        target = anchor + h * pd.Timedelta("10min")
        for uid in ("vcTJs", "vc8Sj"):
            a = ahead[(ahead["unique_id"] == uid) & (ahead["horizon"] == h)]
            r = rolled[(rolled["unique_id"] == uid) & (rolled["ds"] == target)]
            assert a["ds"].tolist() == [target]
            np.testing.assert_allclose(a[cols].to_numpy(), r[cols].to_numpy(), rtol=1e-9)


@pytest.mark.parametrize("name", ["gpuscale", "lightgbm", "empirical"])
def test_quantiles_never_cross_and_cover_the_requested_range(
    helios: pd.DataFrame, fitted: dict[str, Forecaster], name: str
) -> None:
    out = fitted[name].rolling(helios, 3, SPLIT, (0.99, 0.5, 0.9, 0.75)).frame
    values = out[[quantile_column(q) for q in (0.5, 0.75, 0.9, 0.99)]].to_numpy()
    assert np.isfinite(values).all()
    assert (np.diff(values, axis=1) >= 0).all()
    assert out["ds"].min() == SPLIT and (out["horizon"] == 3).all()


def test_gpuscale_serves_untrained_horizons_and_unseen_series(
    traces_dir: Path, helios: pd.DataFrame, fitted: dict[str, Forecaster]
) -> None:
    model = fitted["gpuscale"]
    other = load_trace(f"helios-vc:{traces_dir / 'helios-earth' / 'vcvlY.csv.gz'}").resampled()
    unseen = other.frame[other.frame["ds"] < pd.Timestamp("2020-05-07")]
    out = model.forecast(pd.concat([helios, unseen]), [2, 4, 12], LEVELS).frame
    assert sorted(out["unique_id"].unique()) == ["vc8Sj", "vcTJs", "vcvlY"]
    assert np.isfinite(out[[quantile_column(q) for q in LEVELS]].to_numpy()).all()
    # the p99 spread grows with the horizon
    spread = out.assign(s=out["q0.99"] - out["q0.5"]).groupby("horizon")["s"].mean()
    assert spread[12] > spread[2]


def test_gpuscale_median_never_strays_far_from_persistence(
    helios: pd.DataFrame, fitted: dict[str, Forecaster]
) -> None:
    """The median is persistence plus a shrunk correction: with lambda 0 it IS the last
    value, and it never moves by more than the boosted median correction itself."""
    out = fitted["gpuscale"].rolling(helios, 1, SPLIT, LEVELS).frame
    last = helios.set_index(["unique_id", "ds"])["y"]
    prev = last.reindex(
        pd.MultiIndex.from_arrays([out["unique_id"], out["ds"] - pd.Timedelta("10min")])
    ).to_numpy()
    moved = np.abs(out["q0.5"].to_numpy() - prev)
    assert np.median(moved) == 0.0


def test_bad_requests_are_input_errors(helios: pd.DataFrame, fitted: dict[str, Forecaster]) -> None:
    with pytest.raises(InputError, match="unknown model"):
        build("prophet")
    with pytest.raises(InputError):
        build("gpuscale", holdout=1.5)
    with pytest.raises(InputError, match="quantiles"):
        fitted["gpuscale"].forecast(helios, [1], (0.5, 1.0))
    with pytest.raises(InputError, match="horizons"):
        fitted["persistence"].forecast(helios, [0], (0.5,))
    with pytest.raises(InputError, match="column"):
        fitted["gpuscale"].forecast(helios.drop(columns="y"), [1], (0.5,))
    with pytest.raises(InputError, match="not fitted"):
        build("lightgbm").forecast(helios, [1], (0.5,))


def _walk(steps: int) -> pd.DataFrame:
    """A short integer random walk on 10-minute steps."""
    moves = np.random.default_rng(3).integers(-1, 2, steps)
    ds = pd.date_range("2024-01-01", periods=steps, freq="10min")
    return pd.DataFrame({"unique_id": "walk", "ds": ds, "y": 40.0 + np.cumsum(moves)})


@pytest.mark.parametrize(("name", "minimum"), [("lightgbm", 6 + 2), ("gpuscale", 10)])
def test_the_shortest_history_a_boosted_model_trains_on_is_its_stated_minimum(
    name: str, minimum: int
) -> None:
    """Horizons up to 6 need 6 steps plus the 2 rows LightGBM's bagging needs (at
    subsample 0.8), before the holdout: 10 steps keep 8 of them out of a quarter's holdout.
    One step fewer is an InputError naming that minimum, raised before any booster is
    fitted: LightGBM's own error for an empty bag is a fatal log line and a traceback."""
    model = _model(name)
    assert SMALL.minimum_rows == 2
    assert getattr(model, "core", model).minimum_steps() == minimum
    model.fit(_walk(minimum))
    with pytest.raises(InputError) as caught:
        _model(name).fit(_walk(minimum - 1))
    assert str(caught.value) == (
        f"history is too short to train the 6-step horizon: a series needs at least {minimum}"
        f" steps of 10 min, the longest has {minimum - 1} (training rows for that horizon: 1,"
        " at least 2 needed)"
    )


def _tracked(
    realised: np.ndarray,
    lattice: bool,
    horizon: int,
    spread_gain: float,
    floor: np.ndarray | None = None,
) -> np.ndarray:
    n = realised.size
    return online_quantile(
        realised,
        np.full(n, 0.3),
        np.ones(n),
        np.full(n, lattice),
        0.9,
        horizon,
        window=2016,
        minimum=50,
        gain=0.02,
        spread_gain=spread_gain,
        fallback=1.0,
        floor=floor,
    )


def test_a_quantile_of_integer_demand_sits_on_its_atom_and_is_calibrated() -> None:
    """Demand that mostly does not move: the p90 is a whole number, mostly the last value
    itself, and below <= 0.9 <= coverage; where demand is not whole, nothing is rounded."""
    rng = np.random.default_rng(3)
    realised = rng.choice([0.0, 8.0, -8.0], size=3000, p=[0.93, 0.04, 0.03])
    q = _tracked(realised, True, 3, 0.5)[500:]
    actual = realised[500:]
    assert np.array_equal(q, np.round(q))
    assert np.mean(q == 0.0) > 0.5
    assert np.mean(actual < q) <= 0.9 <= np.mean(actual <= q)
    continuous = _tracked(realised, False, 3, 0.5)[500:]
    assert not np.array_equal(continuous, np.round(continuous))


def test_the_tracking_step_follows_the_spread_after_a_calm_spell_begins() -> None:
    """3-hour residuals that were volatile and turn calm: a step scaled by the residuals'
    spread brings the p90 down within days; a fixed small step still covers every step."""
    rng = np.random.default_rng(3)
    realised = np.concatenate([rng.normal(0, 8, 600), rng.normal(0, 1, 1800)]).round()
    calm = slice(600, 1200)
    scaled = _tracked(realised, True, 18, 0.5)
    fixed = _tracked(realised, True, 18, 0.0)
    assert np.mean(realised[calm] < scaled[calm]) <= 0.9
    assert np.mean(realised[calm] < fixed[calm]) == 1.0


def test_a_quantile_lifted_to_the_level_below_is_tracked_as_issued() -> None:
    """A median that now and then sits far above the p90's own value (the uncrossing lifts
    the p90 to it): the issued p90, at least that floor, lies above demand 90 % of the
    time; tracking the value under the floor and lifting it afterwards covers the floor's
    steps on top of its own 90 %."""
    rng = np.random.default_rng(3)
    realised = rng.normal(0, 4, 3000)
    floor = np.where(rng.random(3000) < 0.25, 12.0, -np.inf)
    issued = _tracked(realised, False, 18, 0.5, floor)
    lifted = np.maximum(_tracked(realised, False, 18, 0.5), floor)
    actual, later = realised[500:], slice(500, None)
    assert np.all(issued >= floor)
    assert abs(np.mean(actual < issued[later]) - 0.9) < 0.005
    assert np.mean(actual < lifted[later]) > 0.915
