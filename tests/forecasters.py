"""A small forecaster for the scaler's tests: the last observation plus the empirical
quantiles of h-step changes seen in training (the `forecast` benchmark's baseline quantile).
It obeys the Forecaster protocol, so the replay can be tested without the product's model."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from predictor.forecast import DemandForecast, quantile_column


class ChangeQuantileForecaster:
    name = "change-quantile"

    def __init__(self) -> None:
        self._train: dict[str, np.ndarray] = {}

    def fit(self, history: pd.DataFrame) -> ChangeQuantileForecaster:
        self._train = {
            str(uid): g.sort_values("ds")["y"].to_numpy(dtype=float)
            for uid, g in history.groupby("unique_id")
        }
        return self

    def _offsets(self, uid: str, horizon: int, quantiles: Sequence[float]) -> np.ndarray:
        y = self._train[uid]
        return np.quantile(y[horizon:] - y[:-horizon], quantiles)

    def forecast(
        self, history: pd.DataFrame, horizons: Sequence[int], quantiles: Sequence[float]
    ) -> DemandForecast:
        rows = []
        for uid, g in history.groupby("unique_id"):
            g = g.sort_values("ds")
            last, y = g["ds"].iloc[-1], float(g["y"].iloc[-1])
            step = g["ds"].diff().median()
            for h in horizons:
                row = {"unique_id": uid, "ds": last + h * step, "horizon": h}
                for q, off in zip(quantiles, self._offsets(str(uid), h, quantiles), strict=True):
                    row[quantile_column(q)] = y + off
                rows.append(row)
        return DemandForecast(pd.DataFrame(rows), tuple(quantiles))

    def rolling(
        self,
        history: pd.DataFrame,
        horizon: int,
        start: pd.Timestamp,
        quantiles: Sequence[float],
    ) -> DemandForecast:
        parts = []
        for uid, g in history.groupby("unique_id"):
            g = g.sort_values("ds")
            base = g["y"].shift(horizon)
            keep = (g["ds"] >= start) & base.notna()
            part = pd.DataFrame(
                {"unique_id": uid, "ds": g["ds"][keep].to_numpy(), "horizon": horizon}
            )
            for q, off in zip(quantiles, self._offsets(str(uid), horizon, quantiles), strict=True):
                part[quantile_column(q)] = base[keep].to_numpy() + off
            parts.append(part)
        return DemandForecast(pd.concat(parts, ignore_index=True), tuple(quantiles))
