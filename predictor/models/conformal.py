"""The model the product deploys (`gpuscale`): quantile boosting, calibrated online.

Two boosted models of the scaled h-step change (see `lgbm.QuantileBoost`): one trained
without the last `holdout` of the history, whose errors on that holdout are genuinely
out-of-sample, and (with `refit`) one trained on all of it, which forecasts every step
after the history it was fitted on: the most recent days are the most informative ones.

Upper quantiles: the boosted quantile plus a shift learnt from the model's own recent
out-of-sample errors on the same series and horizon (online split conformal with quantile
tracking, see `online_quantile`): residuals of the holdout model on the holdout, then of the
deployed model as the targets of later anchors become known. Coverage thus follows a
series that changes regime, which a model calibrated once on its training window cannot do.
On demand in whole units (nodes, GPUs) they are whole numbers, as its quantiles are.

Median: persistence plus a shrunk correction, y[s] + lambda * scale * f_0.5(x), lambda
chosen at every anchor from a small grid on all out-of-sample errors known by then; lambda
is 0 (exactly persistence) unless a correction beat persistence there by `margin`. Demand
is close to a random walk, and a confident median that is wrong costs the scaler more than
persistence does.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from predictor.foundation.errors import InputError
from predictor.models.direct import DirectForecaster, SeriesArrays
from predictor.models.lgbm import BoostParams, QuantileBoost

SHRINK_GRID: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)


def online_quantile(
    realised: np.ndarray,
    forecast: np.ndarray,
    scale: np.ndarray,
    lattice: np.ndarray,
    level: float,
    horizon: int,
    window: int,
    minimum: int,
    gain: float,
    spread_gain: float,
    fallback: float,
    floor: np.ndarray | None = None,
) -> np.ndarray:
    """The `level` quantile of the change at every anchor i of a span (demand units): the
    boosted change `forecast[i]` plus scale[i] times a shift learnt from the scaled
    residuals (realised - forecast) / scale whose targets are known at i.

    The shift is the `level` quantile (higher order statistic) of the finite residuals
    [i-h-window+1 .. i-h] plus an integral correction theta, online quantile tracking (the
    "I" of conformal PID control, Angelopoulos, Candes and Tibshirani, 2023): once the
    target of anchor j = i - h is known, theta follows the pinball loss's subgradient,
    down by step * (1 - level) when the realised change fell below the quantile, up by
    step * level when above it, and not at all when it fell exactly on it.

    The step is `spread_gain * (1 - level)` times the spread of the window's residuals
    (mean absolute deviation from the running median), and at least `gain`. One step in
    scaled units would be large for a 10-minute change, which rarely moves, and small for a
    3-hour one, whose errors come in long bursts and whose shift must move by several units
    when the series turns calm or busy (the PID paper scales its step by the scores' range
    in the same way).

    Where the demand is integer-valued (`lattice[i]`) the quantile is rounded to whole
    units, as a quantile of integer demand is: demand that does not move puts a point mass
    on the last value, and a quantile on that atom is calibrated (below <= level <=
    coverage) where a continuous one just above it covers the atom every time. With the
    zero subgradient on the atom, the long-run share of steps below the quantile is at most
    `level` and the share at or below it at least `level`. With fewer than `minimum`
    residuals in the window the shift is `fallback`.

    `floor` (demand units, per anchor) is the quantile of the next level down that the
    forecast's uncrossing lifts this one to (`direct.uncross`). The quantile returned and
    tracked is the one issued, at least the floor: tracking the value under the floor would
    count a step that the floor covered as a miss, and push the shift up until the issued
    quantile (the floor where it binds) lies above demand more often than `level`.
    """
    n = realised.size
    residuals = (realised - forecast) / scale
    series = pd.Series(residuals)
    rolled = series.rolling(window, min_periods=minimum)
    base = rolled.quantile(level, interpolation="higher").to_numpy()
    deviation = (series - rolled.median()).abs().rolling(window, min_periods=minimum).mean()
    step = np.fmax(gain, spread_gain * (1.0 - level) * deviation.to_numpy())
    out = forecast + scale * fallback
    lowest = np.full(n, -np.inf) if floor is None else floor
    theta = 0.0
    for i in range(n):
        j = i - horizon
        if j >= 0 and np.isfinite(base[j]):
            if np.isfinite(realised[j]):
                miss = realised[j] - out[j]
                theta -= step[j] * ((miss < 0) * (1.0 - level) - (miss > 0) * level)
            out[i] = forecast[i] + scale[i] * (base[j] + theta)
        if lattice[i]:
            out[i] = np.round(out[i])
        out[i] = max(out[i], lowest[i])
    return out


def shrink_choice(
    target: np.ndarray, correction: np.ndarray, margin: float, minimum: int
) -> np.ndarray:
    """lambda[i] from SHRINK_GRID minimising the squared error of lambda * correction
    against target over positions <= i (all of them: a median correction must prove itself
    on a long record); 0 unless it beats lambda = 0 by `margin` (relative), and 0 where
    fewer than `minimum` finite targets are known."""
    known = np.isfinite(target) & np.isfinite(correction)
    count = np.cumsum(known)
    sums_arr = np.stack(
        [np.cumsum(np.where(known, (target - lam * correction) ** 2, 0.0)) for lam in SHRINK_GRID],
        axis=1,
    )
    best = np.argmin(sums_arr, axis=1)
    gain = sums_arr[np.arange(best.size), best] < (1.0 - margin) * sums_arr[:, 0]
    lam = np.where(gain & (count >= minimum), np.asarray(SHRINK_GRID)[best], 0.0)
    return lam


class ConformalBoost(DirectForecaster):
    """`QuantileBoost` with online conformal upper quantiles and a shrunk median.

    `horizons` are trained (others are interpolated); `window` anchors of residuals feed the
    conformal shift (and at least `min_residuals` of them, else the pooled holdout shift is
    used); `gain` is the least quantile-tracking step and `spread_gain` the step per unit
    of the residuals' spread (see `online_quantile`); `margin` the relative gain a median
    correction must show over persistence.
    """

    name = "gpuscale"
    # Artifacts pickled before the spread-scaled step have no instance value.
    spread_gain: float = 0.5

    def __init__(
        self,
        horizons: Sequence[int] = (1, 3, 6, 18, 36, 72),
        levels: Sequence[float] = (0.5, 0.9, 0.99),
        *,
        holdout: float = 0.25,
        window: int = 2016,
        min_residuals: int = 50,
        margin: float = 0.05,
        gain: float = 0.02,
        spread_gain: float = 0.5,
        refit: bool = True,
        params: BoostParams | None = None,
    ) -> None:
        if not 0.0 < holdout < 1.0:
            raise InputError(f"holdout must be in (0, 1), got {holdout}")
        if window < 2 or min_residuals < 1 or min_residuals > window:
            raise InputError("window must be >= 2 and min_residuals in [1, window]")
        self.core = QuantileBoost(horizons, levels, holdout=holdout, params=params)
        self.window = window
        self.min_residuals = min_residuals
        self.margin = margin
        self.gain = gain
        self.spread_gain = spread_gain
        self.full = QuantileBoost(horizons, levels, holdout=0.0, params=params) if refit else None
        self.fit_end: dict[str, pd.Timestamp] = {}
        self._fallback: dict[int, np.ndarray] = {}

    @property
    def horizons(self) -> tuple[int, ...]:
        return self.core.horizons

    @property
    def features(self) -> list[str]:
        return self.core.features

    @property
    def training_window(self) -> tuple[pd.Timestamp, pd.Timestamp] | None:
        return self.core.training_window

    def settings(self) -> dict[str, object]:
        return {
            **self.core.settings(),
            "window": self.window,
            "min_residuals": self.min_residuals,
            "margin": self.margin,
            "gain": self.gain,
            "spread_gain": self.spread_gain,
        }

    def _fit(self, series: list[SeriesArrays]) -> None:
        self.core._fit(series)
        if self.full is not None:
            self.full._fit(series)
        self.fit_end = {s.unique_id: pd.Timestamp(s.ds[-1]) + s.step for s in series}
        # Shifts for a series with no residual history yet: the pooled held-out residuals.
        for h in self.core.horizons:
            pooled = []
            for s in series:
                cut = s.index_of(self.core.calibration_from[s.unique_id])
                anchors = np.arange(cut, s.size - h)
                if anchors.size:
                    pooled.append(self._residuals(s, anchors, h, self.core.levels))
            stacked = np.concatenate(pooled) if pooled else np.zeros((0, self.core.levels.size))
            fallback = np.zeros(self.core.levels.size)
            for j, q in enumerate(self.core.levels):
                col = stacked[:, j][np.isfinite(stacked[:, j])]
                fallback[j] = np.quantile(col, q, method="higher") if col.size else 0.0
            self._fallback[h] = fallback

    def _residuals(
        self, s: SeriesArrays, anchors: np.ndarray, h: int, levels: np.ndarray
    ) -> np.ndarray:
        scale = self.core.unit(s)[anchors]
        z = (s.y[anchors + h] - s.y[anchors]) / scale
        z[~(s.observed[anchors + h] & s.observed[anchors])] = np.nan
        return z[:, None] - self.core.offsets(s, anchors, h, levels)

    def _fallback_shift(self, h: int, levels: np.ndarray) -> np.ndarray:
        trained = np.array(self.core.horizons)
        nearest = int(trained[np.argmin(np.abs(np.sqrt(trained) - np.sqrt(h)))])
        base = self._fallback[nearest] * np.sqrt(h / nearest)
        return np.interp(levels, self.core.levels, base)

    def _quantiles(
        self, s: SeriesArrays, anchors: np.ndarray, horizon: int, levels: np.ndarray
    ) -> np.ndarray:
        h = horizon
        # A series the model was not fitted on is out-of-sample from its first step.
        cal = (
            s.index_of(self.core.calibration_from[s.unique_id])
            if s.unique_id in (self.core.calibration_from)
            else 0
        )
        # The span starts where calibration starts (or earlier, at the first anchor asked
        # for), so the online state at an anchor never depends on which anchors were asked.
        first = min(cal, int(anchors[0]))
        span = np.arange(first, int(anchors[-1]) + 1)
        scale = self.core.unit(s)[span]
        offsets = self.core.offsets(s, span, h, levels)
        if self.full is not None:
            end = s.index_of(self.fit_end[s.unique_id]) if s.unique_id in self.fit_end else 0
            later = span >= end
            if later.any():
                offsets[later] = self.full.offsets(s, span[later], h, levels)
        # Realised change of every anchor in the span whose target is known (inside the
        # span's own data: position j + h <= last anchor asked for) and out-of-sample.
        realised = np.full(span.size, np.nan)
        known = (span + h <= anchors[-1]) & (span >= cal)
        idx = span[known]
        ok = s.observed[idx] & s.observed[idx + h]
        realised[np.flatnonzero(known)] = np.where(ok, s.y[idx + h] - s.y[idx], np.nan)
        # Whole units at an anchor where every value observed so far was whole.
        whole = np.logical_and.accumulate(~s.observed | (s.y == np.round(s.y)))[span]

        pos = anchors - first
        out = np.empty((anchors.size, levels.size))
        fallback = self._fallback_shift(h, levels)
        # Levels above the one nearest the median are lifted to the level below them when
        # the forecast is uncrossed: each is tracked as issued, with that level as its floor.
        centre = int(np.argmin(np.abs(levels - 0.5)))
        change = np.zeros(span.size)
        for j, q in enumerate(levels):
            floor = change if j > centre else None
            if q == 0.5:
                lam = shrink_choice(
                    realised / scale, offsets[:, j], self.margin, self.min_residuals
                )
                # lambda at anchor i is chosen from targets known by then (anchors <= i - h)
                lam_at = np.concatenate([np.zeros(h), lam[:-h]])[: span.size] if h else lam
                change = scale * (lam_at * offsets[:, j])
            else:
                change = online_quantile(
                    realised,
                    scale * offsets[:, j],
                    scale,
                    whole,
                    q,
                    h,
                    self.window,
                    self.min_residuals,
                    self.gain,
                    self.spread_gain,
                    fallback[j],
                    floor,
                )
            out[:, j] = change[pos]
        return s.y[anchors, None] + out
