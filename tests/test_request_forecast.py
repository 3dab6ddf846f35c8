"""The request-rate forecast (`predictor.models.requests`): causal features, the seasonal
baseline, the backtest that gates it, and the rates a predictive job-level run is given."""

from __future__ import annotations

import copy
import pickle
from datetime import datetime

import numpy as np
import pytest

from predictor.foundation.errors import InputError
from predictor.models.requests import (
    DailyProfile,
    RequestBacktest,
    RequestForecaster,
    RequestHistory,
    SeasonalRequestTable,
    features,
    poisson_deviance,
)
from scaler.evaluation.request_rates import LearnedRates, TrueRates

MONDAY = datetime(2024, 1, 1)


def bursty(days: int, seed: int = 0) -> RequestHistory:
    """8-GPU requests at a rate that doubles in the afternoon and quintuples in bursts of
    six hours that start every other day at 06:00: what only recent counts reveal."""
    rng = np.random.default_rng(seed)
    minutes = np.arange(days * 1440)
    hour = (minutes % 1440) / 60
    rate = 0.02 * np.where((hour >= 13) & (hour < 18), 2.0, 1.0)
    burst = ((minutes // 1440) % 2 == 1) & (hour >= 6) & (hour < 12)
    rate = rate * np.where(burst, 5.0, 1.0)
    requested = 8.0 * rng.poisson(rate)
    return RequestHistory.of(MONDAY, requested, np.zeros(minutes.size))


def test_features_read_nothing_at_or_after_the_anchor() -> None:
    history = bursty(3)
    table = SeasonalRequestTable.fit(history, 2000)
    before = features(history, 2000, 10.0, table)
    changed = RequestHistory.of(
        MONDAY, [*history.requested[:2000], *[800.0] * 2320], history.pending
    )
    assert np.array_equal(features(changed, 2000, 10.0, table), before)
    assert history.total(0, 60) == sum(history.requested[:60])


def test_the_model_learns_what_the_table_misses_and_serves_where_it_beats_it() -> None:
    model = RequestForecaster.fit({"a100": (bursty(12), 10.0), "t4": (bursty(12, 1), 5.0)})
    assert model.backtest is not None
    assert model.backtest.better
    assert all(model.backtest.serves(p) for p in ("a100", "t4"))
    # In a burst under way the forecast rises above the table's seasonal rate, and above
    # its own forecast for the same hour the day before, when none ran.
    history = bursty(14, 2)
    table = SeasonalRequestTable.fit(history, 12 * 1440)
    in_burst = 13 * 1440 + 9 * 60  # day 13 (odd): a burst from 06:00 to 12:00
    forecast = model.predict("a100", history, in_burst, 10.0, table)
    assert forecast > 1.05 * table.rate(history.at(in_burst + 10))
    assert forecast > model.predict("a100", history, in_burst - 1440, 10.0, table)


def test_a_model_worse_than_the_table_is_not_served() -> None:
    model = RequestForecaster.fit({"a100": (bursty(12), 10.0)})
    worse = RequestBacktest({"a100": 2.0, "t4": 0.5}, {"a100": 1.0, "t4": 0.6}, 100)
    assert not worse.serves("a100") and worse.serves("t4")
    assert not RequestBacktest({"a100": 2.0}, {"a100": 1.0}, 100).better
    gated = RequestForecaster(model.booster, model.params, model.profiles, worse)
    history = bursty(3)
    rates = LearnedRates.of(gated, {"a100": history, "t4": history})
    assert rates.rate("a100", 0, 10.0) is None  # the planner keeps its seasonal table
    assert rates.rate("t4", 0, 10.0) is not None
    rates.observe("a100", 16.0, 3.0)
    assert len(rates.histories["a100"]) == len(history) + 1
    assert len(history) == 3 * 1440  # the run's copy grows, not the history it came from


def test_the_daily_profile_follows_the_cycle_and_a_burst_does_not_shape_it() -> None:
    # A smooth day (peak at 15:00, twice the trough) for two weeks, and one six-hour burst
    # at ten times the rate on the first Tuesday morning.
    minutes = np.arange(14 * 1440)
    hour = (minutes % 1440) / 60
    rate = 0.1 * (1 + 0.5 * np.cos(2 * np.pi * (hour - 15) / 24))
    burst = (minutes >= 1440 + 6 * 60) & (minutes < 1440 + 12 * 60)
    requested = 8.0 * np.random.default_rng(3).poisson(rate * np.where(burst, 10.0, 1.0))
    history = RequestHistory.of(MONDAY, requested, np.zeros(minutes.size))
    profile = DailyProfile.fit(history)
    at = np.array([3.0, 9.0, 15.0])
    peak_to_trough = (
        profile.relative(at[2:], np.zeros(1))[0] / profile.relative(at[:1], np.zeros(1))[0]
    )
    assert 2.4 < peak_to_trough < 3.6  # the true 1.5 / 0.5 = 3
    # The burst lifts the seasonal table's 9:00 (one day of six in its bucket) well above
    # the mean rate; the profile keeps 9:00 near it, where the cycle is.
    table = SeasonalRequestTable.fit(history)
    mean = float(requested.sum()) / len(requested) * 60
    assert table.rate(history.at(9 * 60)) > 1.3 * mean
    assert profile.relative(at[1:2], np.zeros(1))[0] < 1.15
    # Its shape over the week, as the spare's price is set on it: bucket 15 is weekday
    # 15:00-16:00, bucket 24 + 3 Saturday's and Sunday's 3:00-4:00.
    week = profile.by_bucket()
    assert len(week) == 48 and week[15] > 2 * week[3]
    assert week[24 + 3] == pytest.approx(profile.relative(np.array([3.5]), np.ones(1))[0])


def test_a_model_registered_before_the_profiles_forecasts_from_the_table() -> None:
    model = RequestForecaster.fit({"a100": (bursty(12), 10.0)})
    legacy = copy.copy(model)
    del legacy.__dict__["profiles"]  # as a model pickled before the field existed
    old = pickle.loads(pickle.dumps(legacy))
    assert old.profiles == {}
    history = bursty(14, 2)
    table = SeasonalRequestTable.fit(history, 12 * 1440)
    assert old.predict("a100", history, 12 * 1440, 10.0, table) > 0
    assert old.forecast("a100", 1.0).by_bucket is None  # the table's


def test_too_little_history_names_the_minimum() -> None:
    with pytest.raises(InputError, match="at least 200 anchors"):
        RequestForecaster.fit({"a100": (bursty(2), 10.0)})


def test_poisson_deviance_is_zero_for_a_perfect_forecast_and_grows_off_it() -> None:
    actual = np.array([0.0, 1.0, 4.0])
    assert poisson_deviance(actual, actual) == pytest.approx(0.0, abs=1e-6)
    assert poisson_deviance(actual, actual + 1) > 0


def test_the_true_rate_is_the_intensity_of_the_hour_a_boot_ahead_in_the_requests_units() -> None:
    intensity = np.concatenate([np.full(70, 0.1), np.full(120, 0.4)])
    shape = tuple(float(b) for b in range(1, 49))
    rates = TrueRates({"a100": intensity}, {"a100": 0.5}, {"a100": shape})
    ahead = rates.rate("a100", 60, 10.0)
    assert ahead is not None and ahead.ahead == pytest.approx(0.4 * 60 * 0.5)
    assert ahead.by_bucket == shape
    assert rates.rate("a100", 0, 10.0).ahead == pytest.approx(0.1 * 60 * 0.5)
    assert rates.rate("a100", 500, 10.0) is None  # past the intensity known
