"""Features for direct multi-horizon forecasting, built for a whole series in one pass.

A forecast of step t at horizon h is made at its anchor s = t - h. Every feature of anchor s
is a function of the observations at steps <= s only (trailing windows and backward
differences), plus the calendar of the target step t, which is known in advance. Values are
divided by the series' scale (its typical one-step move) so that one global model serves
series of 8 GPUs and of 400 nodes alike.

Inputs are one series on a complete regular grid (see `series.regularize`): columns `ds`,
`y` and, where the source has them, `capacity`, `running` and `pending`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

EXOGENOUS: tuple[str, ...] = ("capacity", "running", "pending")
# Steps since the last move are capped: beyond ~a week the exact count carries no signal.
SINCE_CAP = 1000


@dataclass(frozen=True)
class FeatureSpec:
    """Which lags (in steps) and trailing windows (in steps) describe an anchor."""

    lags: tuple[int, ...] = (1, 2, 3, 6, 12, 18, 36, 72, 144)
    windows: tuple[int, ...] = (6, 18, 36, 144, 432)

    def names(self, exogenous: Sequence[str]) -> list[str]:
        """Feature columns, in the order `anchor_features` + `target_calendar` make them."""
        cols = [f"d{k}" for k in self.lags]
        for w in self.windows:
            cols += [
                f"mad{w}",
                f"up{w}",
                f"down{w}",
                f"moving{w}",
                f"below_max{w}",
                f"above_min{w}",
            ]
        cols += ["since_up", "since_down", "level"]
        if "capacity" in exogenous:
            cols += ["headroom", "utilisation"]
        if "pending" in exogenous:
            cols += ["pending", "pending_share", "pending_d1", "pending_max36"]
        if "running" in exogenous and "capacity" in exogenous:
            cols += ["running_headroom"]
        return cols + list(CALENDAR)


CALENDAR: tuple[str, ...] = ("tod_sin", "tod_cos", "dow", "weekend")
_WINDOW_KINDS: tuple[str, ...] = ("mad", "up", "down", "moving", "below_max", "above_min")


def series_scale(y: np.ndarray) -> float:
    """Typical size of a one-step move: the mean absolute step change, floored at 2% of the
    mean level (and at 0.05) so that a flat series still has a usable unit."""
    y = np.asarray(y, dtype=float)
    moves = np.abs(np.diff(y))
    moves = moves[np.isfinite(moves)]
    level = np.nanmean(np.abs(y)) if np.isfinite(y).any() else 0.0
    typical = float(moves.mean()) if moves.size else 0.0
    return max(typical, 0.02 * float(level), 0.05)


def causal_scale(y: np.ndarray) -> np.ndarray:
    """`series_scale` of the steps up to and including each step (for a series the model has
    not seen: no future step may set the unit of an earlier forecast)."""
    y = np.asarray(y, dtype=float)
    moves = np.abs(np.diff(y, prepend=y[:1]))
    moves[~np.isfinite(moves)] = 0.0
    count = np.arange(1, y.size + 1)
    typical = np.cumsum(moves) / np.maximum(count - 1, 1)
    level = np.cumsum(np.nan_to_num(np.abs(y))) / count
    return np.maximum(np.maximum(typical, 0.02 * level), 0.05)


def _lagdiff(x: np.ndarray, k: int) -> np.ndarray:
    out = np.full(x.size, np.nan)
    if k < x.size:
        out[k:] = x[k:] - x[:-k]
    return out


def _rolling(x: np.ndarray, window: int, how: str) -> np.ndarray:
    return getattr(pd.Series(x).rolling(window, min_periods=1), how)().to_numpy()


def _steps_since(event: np.ndarray) -> np.ndarray:
    n = event.size
    last = pd.Series(np.where(event, np.arange(n), np.nan)).ffill().to_numpy()
    since = np.arange(n) - last
    return np.where(np.isnan(since), SINCE_CAP, np.minimum(since, SINCE_CAP))


def anchor_features(
    group: pd.DataFrame, scale: np.ndarray, spec: FeatureSpec, exogenous: Sequence[str]
) -> pd.DataFrame:
    """Features of every step of one series as an anchor (row i uses rows <= i only).

    `scale` is the unit per step (an array, or a constant broadcast). Exogenous columns in
    `exogenous` that the frame lacks come out as NaN, which the gradient boosting handles.
    """
    y = group["y"].to_numpy(dtype=float)
    n = y.size
    scale = np.broadcast_to(np.asarray(scale, dtype=float), (n,))
    cols: dict[str, np.ndarray] = {}
    for k in spec.lags:
        cols[f"d{k}"] = _lagdiff(y, k) / scale
    step = _lagdiff(y, 1)
    rise = np.nan_to_num(np.maximum(step, 0.0))
    fall = np.nan_to_num(np.maximum(-step, 0.0))
    moving = (np.nan_to_num(np.abs(step)) > 0).astype(float)
    for w in spec.windows:
        cols[f"mad{w}"] = _rolling(rise + fall, w, "mean") / scale
        cols[f"up{w}"] = _rolling(rise, w, "max") / scale
        cols[f"down{w}"] = _rolling(fall, w, "max") / scale
        cols[f"moving{w}"] = _rolling(moving, w, "mean")
        cols[f"below_max{w}"] = (y - _rolling(y, w, "max")) / scale
        cols[f"above_min{w}"] = (y - _rolling(y, w, "min")) / scale
    cols["since_up"] = _steps_since(rise > 0)
    cols["since_down"] = _steps_since(fall > 0)
    cols["level"] = y / scale

    def column(name: str) -> np.ndarray:
        if name in group:
            return group[name].to_numpy(dtype=float)
        return np.full(n, np.nan)

    if "capacity" in exogenous:
        capacity = column("capacity")
        cols["headroom"] = (capacity - y) / scale
        cols["utilisation"] = y / np.maximum(capacity, 1.0)
    if "pending" in exogenous:
        pending = column("pending")
        cols["pending"] = pending / scale
        cols["pending_share"] = pending / np.maximum(y, 1.0)
        cols["pending_d1"] = _lagdiff(pending, 1) / scale
        cols["pending_max36"] = _rolling(pending, 36, "max") / scale
    if "running" in exogenous and "capacity" in exogenous:
        cols["running_headroom"] = (column("capacity") - column("running")) / scale
    return pd.DataFrame(cols)


def target_calendar(ds: pd.DatetimeIndex | pd.Series) -> pd.DataFrame:
    """Time of day (on the circle) and day of week of the target steps."""
    ds = pd.DatetimeIndex(ds)
    day = ((ds.hour * 60 + ds.minute) / 1440.0).to_numpy()
    dow = ds.dayofweek.to_numpy()
    return pd.DataFrame(
        {
            "tod_sin": np.sin(2 * np.pi * day),
            "tod_cos": np.cos(2 * np.pi * day),
            "dow": dow.astype(float),
            "weekend": (dow >= 5).astype(float),
        }
    )


def design_matrix(
    anchored: pd.DataFrame, ds: np.ndarray, anchors: np.ndarray, horizon: int, step: pd.Timedelta
) -> pd.DataFrame:
    """Rows of `anchored` (from `anchor_features`) at `anchors`, with the calendar of their
    targets `ds[anchor] + horizon * step`."""
    rows = anchored.iloc[anchors].reset_index(drop=True)
    target = pd.DatetimeIndex(ds[anchors]) + horizon * step
    return pd.concat([rows, target_calendar(target)], axis=1)
