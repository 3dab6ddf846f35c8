"""The forecasting seam: every model fits on one long table and returns quantiles.

Long table (the format the Python forecasting ecosystem shares): one row per series and
step, columns `unique_id`, `ds` (timestamp at the start of the step), `y` (demand), plus
optional exogenous columns (for example `pending`). Steps are regular (see `series.STEP`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import pandas as pd

DEFAULT_QUANTILES: tuple[float, ...] = (0.5, 0.9, 0.99)


def quantile_column(q: float) -> str:
    """Column name of quantile q in a forecast frame: 0.9 -> 'q0.9'."""
    return f"q{q:g}"


@dataclass(frozen=True)
class DemandForecast:
    """Quantile forecasts: columns `unique_id`, `ds` (target step), `horizon` (steps ahead
    of the last observation used) and one `q<level>` column per quantile."""

    frame: pd.DataFrame
    quantiles: tuple[float, ...]

    def column(self, q: float) -> pd.Series:
        return self.frame[quantile_column(q)]


@runtime_checkable
class Forecaster(Protocol):
    """A model of demand. `fit` learns from history; the two predict methods never read an
    observation at or after the target time minus the horizon."""

    name: str

    def fit(self, history: pd.DataFrame) -> Forecaster: ...

    def forecast(
        self, history: pd.DataFrame, horizons: Sequence[int], quantiles: Sequence[float]
    ) -> DemandForecast:
        """Forecast the steps `horizons` after the last observation of each series."""
        ...

    def rolling(
        self,
        history: pd.DataFrame,
        horizon: int,
        start: pd.Timestamp,
        quantiles: Sequence[float],
    ) -> DemandForecast:
        """For every step t >= start in `history`, the forecast of y[t] made from data up to
        t - horizon only (a backtest or a replay in one vectorised call)."""
        ...


def trained_horizon(model: object) -> int | None:
    """The longest horizon (steps) `model` was trained for, or None for a model whose one
    rule serves every horizon alike (the baselines): beyond it a learned model only
    extrapolates (the boosted models by the square root of the horizon)."""
    horizons = getattr(model, "horizons", None)
    return max(horizons) if horizons else None
