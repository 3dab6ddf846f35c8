"""Global gradient-boosted quantile models of the h-step change, one per horizon and level.

The target is the change y[s+h] - y[s] divided by the series' scale (its typical one-step
move): demand is close to a random walk, so the change is what there is to learn, and the
division makes series of 8 GPUs and of 400 nodes one population for a single model.
Horizons that were not trained are interpolated between the trained ones at the same anchor
(spread grows roughly like the square root of the horizon); levels that were not trained
are interpolated between the trained levels.

LightGBM is driven directly rather than through mlforecast: one booster per horizon and
level on features cut at the anchor (`predictor.models.features`) is the whole model, and the
leakage guarantee lives in that one cut, which a wrapper's own lag machinery would bypass.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd

from predictor.foundation.errors import InputError
from predictor.models.direct import DirectForecaster, SeriesArrays, training_grid
from predictor.models.features import (
    EXOGENOUS,
    FeatureSpec,
    anchor_features,
    causal_scale,
    design_matrix,
    series_scale,
)


@dataclass(frozen=True)
class BoostParams:
    """LightGBM settings (few trees, small leaves: the signal is weak and the tails thin)."""

    n_estimators: int = 300
    learning_rate: float = 0.03
    num_leaves: int = 15
    min_child_samples: int = 300
    subsample: float = 0.8
    colsample_bytree: float = 0.8
    max_bin: int = 127
    seed: int = 7
    # One thread: on a small shared machine OpenMP threads mostly wait on each other.
    threads: int = 1

    @property
    def minimum_rows(self) -> int:
        """The fewest training rows a booster can be fitted on: every round bags
        floor(subsample * rows) of them, and an empty bag is fatal to LightGBM."""
        return math.ceil(1.0 / self.subsample)

    def lightgbm(self, level: float) -> dict[str, object]:
        return {
            "objective": "quantile",
            "alpha": level,
            "learning_rate": self.learning_rate,
            "num_leaves": self.num_leaves,
            "min_data_in_leaf": self.min_child_samples,
            "bagging_fraction": self.subsample,
            "bagging_freq": 1,
            "feature_fraction": self.colsample_bytree,
            "max_bin": self.max_bin,
            "seed": self.seed,
            "num_threads": self.threads,
            "deterministic": True,
            "force_row_wise": True,
            "verbosity": -1,
        }


class QuantileBoost(DirectForecaster):
    """Direct quantile LightGBM on the scaled h-step change (the plain `lightgbm` model).

    `holdout` keeps the last share of every series' history out of training, so that a
    wrapper can calibrate on genuinely out-of-sample errors there (see `calibration_from`).
    """

    name = "lightgbm"

    def __init__(
        self,
        horizons: Sequence[int] = (1, 3, 18),
        levels: Sequence[float] = (0.5, 0.9, 0.99),
        *,
        holdout: float = 0.0,
        params: BoostParams | None = None,
        spec: FeatureSpec | None = None,
    ) -> None:
        self.horizons, self.levels = training_grid(horizons, levels, holdout)
        self.holdout = holdout
        self.params = params or BoostParams()
        self.spec = spec or FeatureSpec()
        self.exogenous: tuple[str, ...] = ()
        self.scales: dict[str, float] = {}
        self.calibration_from: dict[str, pd.Timestamp] = {}
        self.training_window: tuple[pd.Timestamp, pd.Timestamp] | None = None
        self.training_rows: dict[int, int] = {}
        self._boosters: dict[tuple[int, float], object] = {}

    @property
    def features(self) -> list[str]:
        return self.spec.names(self.exogenous)

    def settings(self) -> dict[str, object]:
        """What the registry records about this model."""
        return {
            "horizons": list(self.horizons),
            "levels": self.levels.tolist(),
            "holdout": self.holdout,
            "params": asdict(self.params),
            "features": self.features,
        }

    def _fit(self, series: list[SeriesArrays]) -> None:
        import lightgbm as lgb

        self.exogenous = tuple(c for c in EXOGENOUS if any(c in s.frame for s in series))
        parts: dict[int, list[tuple[pd.DataFrame, np.ndarray]]] = {h: [] for h in self.horizons}
        firsts, lasts = [], []
        for s in series:
            scale = series_scale(s.y[s.observed])
            self.scales[s.unique_id] = scale
            cut = s.size - round(s.size * self.holdout)
            self.calibration_from[s.unique_id] = pd.Timestamp(s.ds[min(cut, s.size - 1)])
            firsts.append(pd.Timestamp(s.ds[0]))
            lasts.append(pd.Timestamp(s.ds[cut - 1]))
            anchored = anchor_features(s.frame, scale, self.spec, self.exogenous)
            for h in self.horizons:
                anchors = np.arange(0, max(cut - h, 0))
                anchors = anchors[s.observed[anchors] & s.observed[anchors + h]]
                if anchors.size == 0:
                    continue
                x = design_matrix(anchored, s.ds, anchors, h, s.step)
                z = (s.y[anchors + h] - s.y[anchors]) / scale
                parts[h].append((x, z))
        rows = {h: sum(c[1].size for c in chunks) for h, chunks in parts.items()}
        self._check_rows(rows, max(s.size for s in series), series[0].step)
        self.training_window = (min(firsts), max(lasts))
        for h, chunks in parts.items():
            x = pd.concat([c[0] for c in chunks], ignore_index=True)[self.features]
            z = np.concatenate([c[1] for c in chunks])
            self.training_rows[h] = int(z.size)
            data = lgb.Dataset(x, z, free_raw_data=False)
            for level in self.levels:
                self._boosters[(h, float(level))] = lgb.train(
                    self.params.lightgbm(float(level)), data, self.params.n_estimators
                )

    def minimum_steps(self) -> int:
        """The shortest series that trains every horizon on its own: before the holdout,
        the longest horizon must leave `BoostParams.minimum_rows` anchors with a target."""
        need = self.horizons[-1] + self.params.minimum_rows
        steps = need
        while steps - round(steps * self.holdout) < need:  # holdout < 1: this ends
            steps += 1
        return steps

    def _check_rows(self, rows: Mapping[int, int], longest: int, step: pd.Timedelta) -> None:
        """Refuse, before any booster is fitted, a history that leaves some horizon fewer
        training rows than LightGBM needs (its own error is a fatal log line and a
        traceback). The longest short horizon is named: it is the one that binds."""
        short = [h for h, n in rows.items() if n < self.params.minimum_rows]
        if not short:
            return
        h = max(short)
        raise InputError(
            f"history is too short to train the {h}-step horizon: a series needs at least"
            f" {self.minimum_steps()} steps of {_duration(step)}, the longest has {longest}"
            f" (training rows for that horizon: {rows[h]}, at least"
            f" {self.params.minimum_rows} needed)"
        )

    def unit(self, s: SeriesArrays) -> np.ndarray:
        """The scale of every step of `s`: fitted series keep their training scale; a new
        series takes the causal scale of its own history."""
        if s.unique_id in self.scales:
            return np.full(s.size, self.scales[s.unique_id])
        return causal_scale(s.y)

    def offsets(
        self, s: SeriesArrays, anchors: np.ndarray, horizon: int, levels: np.ndarray
    ) -> np.ndarray:
        """Scaled change forecasts [anchor, level] (levels and horizons interpolated)."""
        if not self._boosters:
            raise InputError(f"model {self.name!r} is not fitted")
        anchored = anchor_features(s.frame, self.unit(s), self.spec, self.exogenous)
        trained = np.array(self.horizons)
        if horizon in self.horizons:
            return self._levels(anchored, s, anchors, horizon, levels)
        if horizon > trained[-1]:
            far = self._levels(anchored, s, anchors, int(trained[-1]), levels)
            return far * np.sqrt(horizon / trained[-1])
        if horizon < trained[0]:
            near = self._levels(anchored, s, anchors, int(trained[0]), levels)
            return near * np.sqrt(horizon / trained[0])
        upper = int(trained[np.searchsorted(trained, horizon)])
        lower = int(trained[np.searchsorted(trained, horizon) - 1])
        w = (np.sqrt(horizon) - np.sqrt(lower)) / (np.sqrt(upper) - np.sqrt(lower))
        return (1 - w) * self._levels(anchored, s, anchors, lower, levels) + w * self._levels(
            anchored, s, anchors, upper, levels
        )

    def _levels(
        self,
        anchored: pd.DataFrame,
        s: SeriesArrays,
        anchors: np.ndarray,
        horizon: int,
        levels: np.ndarray,
    ) -> np.ndarray:
        x = design_matrix(anchored, s.ds, anchors, horizon, s.step)[self.features]
        fitted = np.stack(
            [self._boosters[(horizon, float(q))].predict(x) for q in self.levels], axis=1
        )
        fitted = np.sort(fitted, axis=1)
        if fitted.shape[1] == 1:
            return np.repeat(fitted, levels.size, axis=1)
        return _interp_rows(fitted, self.levels, levels)

    def _quantiles(
        self, s: SeriesArrays, anchors: np.ndarray, horizon: int, levels: np.ndarray
    ) -> np.ndarray:
        scale = self.unit(s)[anchors]
        return s.y[anchors, None] + scale[:, None] * self.offsets(s, anchors, horizon, levels)


def _duration(step: pd.Timedelta) -> str:
    """A step as the trace formats count it ("10 min"), not as pandas prints it."""
    return f"{step / pd.Timedelta(minutes=1):g} min"


def _interp_rows(values: np.ndarray, at: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """Row-wise linear interpolation of `values[:, k]` (known at levels `at`) at `levels`,
    constant beyond the ends."""
    out = np.empty((values.shape[0], levels.size))
    for j, q in enumerate(levels):
        k = int(np.clip(np.searchsorted(at, q), 1, at.size - 1))
        lo, hi = at[k - 1], at[k]
        w = float(np.clip((q - lo) / (hi - lo), 0.0, 1.0))
        out[:, j] = (1 - w) * values[:, k - 1] + w * values[:, k]
    return out
