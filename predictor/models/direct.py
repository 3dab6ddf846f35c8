"""The machinery every model shares: a long table becomes complete per-series arrays, and a
model only answers "quantiles of the step `horizon` after each of these anchors".

`rolling` and `forecast` of the `Forecaster` protocol are both that one question (every
anchor from `start - horizon` on, or only the last step), so a model cannot answer them
differently and cannot see past its anchor unless its `_quantiles` reads past it, which the
leakage tests check.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from predictor.data.series import STEP, regularize
from predictor.foundation.errors import InputError
from predictor.models.forecast import DemandForecast, quantile_column


@dataclass(frozen=True, eq=False)
class SeriesArrays:
    """One series on a complete regular grid. `observed[i]` is False where step i had no
    observation and was filled forward (never a training target nor a scored step)."""

    unique_id: str
    frame: pd.DataFrame  # ds, y and any exogenous columns, one row per step
    ds: np.ndarray  # datetime64[ns]
    y: np.ndarray
    observed: np.ndarray
    step: pd.Timedelta

    @property
    def size(self) -> int:
        return self.y.size

    def index_of(self, moment: pd.Timestamp) -> int:
        """Position of the first step at or after `moment`."""
        return int(np.searchsorted(self.ds, np.datetime64(pd.Timestamp(moment)), side="left"))


def infer_step(frame: pd.DataFrame) -> pd.Timedelta:
    """The grid step of a long table: its smallest positive gap (10 minutes when unknown)."""
    gaps = frame.groupby("unique_id", sort=False)["ds"].diff().dropna()
    gaps = gaps[gaps > pd.Timedelta(0)]
    return pd.Timedelta(gaps.min()) if len(gaps) else STEP


def split_series(history: pd.DataFrame) -> list[SeriesArrays]:
    """Check a long table and cut it into complete per-series arrays."""
    missing = {"unique_id", "ds", "y"} - set(history.columns)
    if missing:
        raise InputError(f"history lacks the column(s) {', '.join(sorted(missing))}")
    if history.empty:
        raise InputError("history has no rows")
    frame = history.sort_values(["unique_id", "ds"], kind="stable")
    frame = frame.drop(columns=[c for c in ("filled",) if c in frame]).reset_index(drop=True)
    step = infer_step(frame)
    off_grid = (frame["ds"] - frame["ds"].dt.floor(step)) != pd.Timedelta(0)
    if off_grid.any():
        raise InputError(
            f"history is not on a regular grid of {step} (first stray step "
            f"{frame['ds'][off_grid].iloc[0]}); resample it first (series.resample)"
        )
    full = regularize(frame, step, fill="ffill")
    out = []
    for uid, group in full.groupby("unique_id", sort=True):
        group = group.reset_index(drop=True)
        if group["y"].isna().all():
            raise InputError(f"series {uid!r} has no demand values")
        y = group["y"].to_numpy(dtype=float)
        observed = ~group["filled"].to_numpy(dtype=bool) & np.isfinite(y)
        y = pd.Series(y).ffill().bfill().to_numpy()
        out.append(
            SeriesArrays(
                unique_id=str(uid),
                frame=group.drop(columns="filled"),
                ds=group["ds"].to_numpy(dtype="datetime64[ns]"),
                y=y,
                observed=observed,
                step=step,
            )
        )
    return out


def check_request(horizons: Sequence[int], quantiles: Sequence[float]) -> None:
    if not horizons or any(int(h) != h or h < 1 for h in horizons):
        raise InputError(f"horizons must be whole steps >= 1, got {list(horizons)}")
    if not quantiles or any(not 0.0 < q < 1.0 for q in quantiles):
        raise InputError(f"quantiles must lie strictly between 0 and 1, got {list(quantiles)}")


def training_grid(
    horizons: Sequence[int], levels: Sequence[float], holdout: float
) -> tuple[tuple[int, ...], np.ndarray]:
    """A learned model's trained horizons and levels, checked and sorted (the holdout is the
    share of training history kept back for calibration)."""
    check_request(horizons, levels)
    if not 0.0 <= holdout < 1.0:
        raise InputError(f"holdout must be in [0, 1), got {holdout}")
    return tuple(sorted({int(h) for h in horizons})), np.array(sorted(set(levels)), dtype=float)


class DirectForecaster(ABC):
    """A model that forecasts each horizon directly from its anchor step."""

    name: str = "direct"

    def fit(self, history: pd.DataFrame) -> DirectForecaster:
        self._fit(split_series(history))
        return self

    @abstractmethod
    def _fit(self, series: list[SeriesArrays]) -> None: ...

    @abstractmethod
    def _quantiles(
        self, s: SeriesArrays, anchors: np.ndarray, horizon: int, levels: np.ndarray
    ) -> np.ndarray:
        """Array [anchor, level] of forecasts of y[anchor + horizon], from rows <= anchor
        (anchors are ascending; `levels` ascending)."""

    def _quantiles_of_all(
        self, asked: Sequence[tuple[SeriesArrays, np.ndarray]], horizon: int, levels: np.ndarray
    ) -> list[np.ndarray]:
        """`_quantiles` of every (series, anchors) pair asked in one call; a model whose
        forecast of one series reads the others' realised past overrides this."""
        return [self._quantiles(s, anchors, horizon, levels) for s, anchors in asked]

    def rolling(
        self,
        history: pd.DataFrame,
        horizon: int,
        start: pd.Timestamp,
        quantiles: Sequence[float],
    ) -> DemandForecast:
        check_request([horizon], quantiles)
        asked = []
        for s in split_series(history):
            first = max(s.index_of(start), horizon)
            if first < s.size:
                asked.append((s, np.arange(first - horizon, s.size - horizon)))
        return _collect(self._frames(asked, horizon, quantiles), quantiles)

    def forecast(
        self, history: pd.DataFrame, horizons: Sequence[int], quantiles: Sequence[float]
    ) -> DemandForecast:
        check_request(horizons, quantiles)
        series = split_series(history)
        last = [(s, np.array([s.size - 1])) for s in series]
        by_horizon = [self._frames(last, h, quantiles) for h in sorted({int(h) for h in horizons})]
        # series by series, horizons in order within each
        parts = [frames[i] for i in range(len(series)) for frames in by_horizon]
        return _collect(parts, quantiles)

    def _frames(
        self,
        asked: Sequence[tuple[SeriesArrays, np.ndarray]],
        horizon: int,
        quantiles: Sequence[float],
    ) -> list[pd.DataFrame]:
        levels = np.array(sorted(set(quantiles)), dtype=float)
        frames = []
        for (s, anchors), values in zip(
            asked, self._quantiles_of_all(asked, horizon, levels), strict=True
        ):
            values = uncross(values, levels)
            targets = s.ds[anchors] + np.timedelta64(horizon * s.step)
            frame = pd.DataFrame({"unique_id": s.unique_id, "ds": targets, "horizon": horizon})
            for j, q in enumerate(levels):
                frame[quantile_column(q)] = values[:, j]
            frames.append(frame)
        return frames


def uncross(values: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """Quantiles that never cross, anchored on the level nearest the median: levels above
    it are raised to at least the one below, levels under it lowered to at most the one
    above. The median itself is never moved by an upper quantile's error."""
    centre = int(np.argmin(np.abs(levels - 0.5)))
    out = values.copy()
    out[:, centre:] = np.maximum.accumulate(out[:, centre:], axis=1)
    out[:, : centre + 1] = np.minimum.accumulate(out[:, centre::-1], axis=1)[:, ::-1]
    return out


def _collect(parts: list[pd.DataFrame], quantiles: Sequence[float]) -> DemandForecast:
    levels = tuple(sorted(set(quantiles)))
    columns = ["unique_id", "ds", "horizon", *(quantile_column(q) for q in levels)]
    frame = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=columns)
    return DemandForecast(frame=frame[columns], quantiles=levels)
