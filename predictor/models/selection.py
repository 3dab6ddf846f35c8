"""Model selection (`selected`): per series, horizon and quantile level, a convex combination
(mean of quantiles with weights) of candidate models, chosen offline by an inner backtest on
the training window and then online, at each forecast, from the forecasts realised since.

Offline choice. Every candidate is fitted on the history before a validation tail (the last
`validation` share of the time span) and forecasts that tail at each horizon (each step
from data up to t - h only, as in the benchmark). Every combination with weights on a grid
of step 1/`grid` and the equal mix of all candidates is scored per series,
horizon and level by its pinball loss relative to the benchmark's baseline quantile on the
same steps (last value plus the training quantile of h-step changes), so that each series
counts alike, as in the benchmark's mean ratio. A series' score of a combination is its
own ratio shrunk toward the mean ratio over all series (weight `shrink`), and the best
combination displaces the `prior` (one candidate, or "mix": the equal mix) only where it
beats it by the relative `margin`: the validation tail holds a few days, a noisy judge of
a p99. The pooled choice (shrink 1) serves series the model has not seen. Every candidate
is then refitted on the whole history. Nothing after the history `fit` receives is read,
so a benchmark's test window stays unseen.

Online choice. A forecast made after training (anchor t, target t + h) takes, per horizon
and level, one combination for all the series forecast together: the one with the lowest
mean, over the series, of its summed pinball loss over the series' last `window` realised
forecasts relative to the baseline's on the same forecasts (targets at or before t,
observed at the target and h steps before it, as the benchmark scores): first the
forecasts of the last stretch of training by candidates fitted before its last
`online_validation` share (the seed, kept in the model), then the refitted candidates' own
forecasts of the targets after training. Pooling is what keeps one series' rare events
from flipping its choice back and forth (a nearly idle series judges a p99 on a handful of
jumps), as the offline choice pools. The choice displaces the prior only where it beats it
by the relative `online_margin`; a series counts once it has `OnlineRule.minimum` realised
forecasts and a baseline loss above zero, and with none to count the offline choice
serves. So the choice at t is a function of data up to t only, and `rolling` and
`forecast` give the same answer at the same anchor for the same series. Horizons and
levels that were not validated are seeded by the nearest validated ones (horizon in
sqrt(h)); the offline weights likewise.

How the rule's own settings were chosen without looking at a benchmark's test windows, and
what they gave there, is recorded in models/README.md ("How `selected` was validated").
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from predictor.data.series import h_step_changes
from predictor.foundation.errors import InputError
from predictor.models.direct import DirectForecaster, SeriesArrays, uncross
from predictor.models.forecast import Forecaster, quantile_column

# (series, horizon in steps, level); series "*" is the pooled choice
Key = tuple[str, int, float]


@dataclass(frozen=True)
class SelectionRule:
    """How validation ratios become a choice: `shrink` is the weight of the mean ratio over
    series in a series' score (1: one choice for all series), `margin` the relative gain
    over the prior (combination 0) that another combination must show."""

    shrink: float
    margin: float

    def __post_init__(self) -> None:
        if not 0.0 <= self.shrink <= 1.0:
            raise InputError(f"shrink must be in [0, 1], got {self.shrink}")
        if not 0.0 <= self.margin < 1.0:
            raise InputError(f"margin must be in [0, 1), got {self.margin}")

    def choose(self, ratios: Mapping[Key, np.ndarray]) -> dict[Key, int]:
        """The index of the chosen combination per series, horizon and level (and pooled
        per horizon and level under series "*"), from each combination's validation
        pinball ratio to the baseline."""
        groups: dict[tuple[int, float], list[np.ndarray]] = {}
        for (_, h, q), r in ratios.items():
            groups.setdefault((h, q), []).append(r)
        pooled = {hq: np.mean(np.stack(rs), axis=0) for hq, rs in groups.items()}
        out = {("*", h, q): self._pick(mean) for (h, q), mean in pooled.items()}
        for (uid, h, q), own in ratios.items():
            out[(uid, h, q)] = self._pick((1.0 - self.shrink) * own + self.shrink * pooled[(h, q)])
        return out

    def _pick(self, score: np.ndarray) -> int:
        best = int(np.argmin(score))
        return best if score[best] < (1.0 - self.margin) * score[0] else 0


@dataclass(frozen=True)
class OnlineRule:
    """How realised losses become a choice at each anchor, one choice for all the series
    forecast together: per series, each combination's pinball over its last `window`
    realised forecasts relative to the baseline's over the same forecasts (so each series
    counts alike, as in the benchmark's mean ratio), averaged over the series with at
    least `minimum` realised forecasts and a baseline loss above zero; the best combination
    is kept only where it beats the prior (combination 0) by the relative `margin`. With no
    series to judge, no choice (-1), and the offline choice stands."""

    window: int
    margin: float
    minimum: int = 36  # six hours of 10-minute steps: fewer are no judge of a p99

    def __post_init__(self) -> None:
        if self.window < 1:
            raise InputError(f"window must be >= 1 step, got {self.window}")
        if not 0.0 <= self.margin < 1.0:
            raise InputError(f"online margin must be in [0, 1), got {self.margin}")

    def windowed(
        self, losses: np.ndarray, base: np.ndarray, known: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Summed `losses` [forecast, combination] and `base` [forecast] of one series'
        realised forecasts (in time order) over the window at each moment, of which the
        first `known[i]` are realised at moment i; and how many the window holds."""
        total = np.vstack([np.zeros((1, losses.shape[1])), np.cumsum(losses, axis=0)])
        total_base = np.concatenate([[0.0], np.cumsum(base)])
        first = np.maximum(known - self.window, 0)
        return total[known] - total[first], total_base[known] - total_base[first], known - first

    def choose(self, scores: np.ndarray, judged: np.ndarray) -> np.ndarray:
        """The index of the chosen combination at each moment from the summed relative
        `scores` [moment, combination] of `judged` series."""
        best = np.argmin(scores, axis=1)
        beats = scores[np.arange(best.size), best] < (1.0 - self.margin) * scores[:, 0]
        return np.where(judged == 0, -1, np.where(beats, best, 0))


@dataclass(frozen=True)
class Realised:
    """One series' candidate forecasts [step, level, candidate] at the anchors asked, and
    the forecasts realised after training with their actuals, baseline quantiles [step,
    level] and target moments."""

    at_anchor: np.ndarray
    actual: np.ndarray
    forecasts: np.ndarray
    baseline: np.ndarray
    targets: np.ndarray


# Settled on the pseudo-test windows (models/README.md), then frozen.
DEFAULT_CANDIDATES: tuple[str, ...] = ("gpuscale", "lightgbm", "torch")
DEFAULT_PRIOR = "lightgbm"
DEFAULT_VALIDATION = 0.35
DEFAULT_RULE = SelectionRule(shrink=1.0, margin=0.4)
DEFAULT_ONLINE = OnlineRule(window=144, margin=0.2)
DEFAULT_ONLINE_VALIDATION = DEFAULT_VALIDATION
EQUAL_MIX = "mix"


def combinations(prior: np.ndarray, grid: int) -> np.ndarray:
    """Weight vectors [combination, candidate]: the `prior` first, then every other vector
    of non-negative multiples of 1/grid summing to 1 and the equal mix."""
    count = prior.size
    rows = [c for c in itertools.product(range(grid + 1), repeat=count) if sum(c) == grid]
    others = np.vstack([np.array(rows, dtype=float) / grid, np.full(count, 1.0 / count)])
    others = others[~np.isclose(others, prior).all(axis=1)]
    others = others[np.unique(others.round(12), axis=0, return_index=True)[1]]
    return np.vstack([prior, others])


def pinball_rows(actual: np.ndarray, values: np.ndarray, level: float) -> np.ndarray:
    """Pinball loss of each entry of `values` [step, column] against `actual` [step]."""
    diff = actual[:, None] - values
    return np.maximum(level * diff, (level - 1.0) * diff)


def pinball_columns(actual: np.ndarray, values: np.ndarray, level: float) -> np.ndarray:
    """Mean pinball loss of each column of `values` [step, column] against `actual`."""
    return np.mean(pinball_rows(actual, values, level), axis=0)


@dataclass(frozen=True)
class Scored:
    """One series, horizon and level over a scored window: the actual values, each
    candidate's forecast [step, candidate] and the benchmark's baseline quantile."""

    actual: np.ndarray
    forecasts: np.ndarray
    baseline: np.ndarray
    level: float
    targets: np.ndarray  # datetime64 of each step

    def tail(self, count: int) -> Scored:
        """The last `count` steps."""
        return Scored(
            actual=self.actual[-count:],
            forecasts=self.forecasts[-count:],
            baseline=self.baseline[-count:],
            level=self.level,
            targets=self.targets[-count:],
        )

    def pinball(self, weights: np.ndarray) -> np.ndarray:
        """Pinball loss of each combination (rows of `weights`)."""
        return pinball_columns(self.actual, self.forecasts @ weights.T, self.level)

    def baseline_pinball(self) -> float:
        return float(pinball_columns(self.actual, self.baseline[:, None], self.level)[0])

    def ratios(self, weights: np.ndarray) -> np.ndarray:
        """Pinball of each combination relative to the baseline's."""
        return self.pinball(weights) / max(self.baseline_pinball(), 1e-12)


def score_window(
    series: Sequence[SeriesArrays],
    forecasts: Mapping[int, Sequence[pd.DataFrame]],
    start: pd.Timestamp,
    levels: Sequence[float],
) -> dict[Key, Scored]:
    """Candidates' rolling forecasts (per horizon, one frame per candidate) from `start` on,
    scored as the benchmark scores them: steps observed at t and t - h only, the baseline
    from the h-step changes before `start`."""
    out: dict[Key, Scored] = {}
    for s in series:
        actual = pd.Series(np.where(s.observed, s.y, np.nan), index=pd.DatetimeIndex(s.ds))
        before_start = actual[actual.index < start].to_numpy()
        for h, frames in forecasts.items():
            parts = [f[f["unique_id"] == s.unique_id].set_index("ds") for f in frames]
            target = parts[0].index[parts[0].index >= start]
            changes = h_step_changes(before_start, h)
            if target.empty or changes.size == 0:
                continue
            y = actual.reindex(target).to_numpy()
            last = actual.reindex(target - h * s.step).to_numpy()
            keep = np.isfinite(y) & np.isfinite(last)
            if not keep.any():
                continue
            for q in levels:
                column = quantile_column(q)
                stack = np.stack([p[column].reindex(target).to_numpy()[keep] for p in parts], 1)
                out[(s.unique_id, h, float(q))] = Scored(
                    actual=y[keep],
                    forecasts=stack,
                    baseline=last[keep] + float(np.quantile(changes, q)),
                    level=float(q),
                    targets=target.to_numpy()[keep],
                )
    return out


class Selected(DirectForecaster):
    """The backtested combination of `candidates` per series, horizon and level, chosen
    offline on the training tail and online from the realised forecasts after it.

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
        prior: str = DEFAULT_PRIOR,
        validation: float = DEFAULT_VALIDATION,
        grid: int = 4,
        shrink: float = DEFAULT_RULE.shrink,
        margin: float = DEFAULT_RULE.margin,
        window: int = DEFAULT_ONLINE.window,
        online_margin: float = DEFAULT_ONLINE.margin,
        online_validation: float = DEFAULT_ONLINE_VALIDATION,
        params: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        if not candidates or len(set(candidates)) != len(candidates):
            raise InputError(f"candidates must be distinct model names, got {list(candidates)}")
        if not horizons or any(int(h) != h or h < 1 for h in horizons):
            raise InputError(f"horizons must be whole steps >= 1, got {list(horizons)}")
        if not levels or any(not 0.0 < q < 1.0 for q in levels):
            raise InputError(f"levels must lie strictly between 0 and 1, got {list(levels)}")
        for share in (validation, online_validation):
            if not 0.0 < share < 1.0:
                raise InputError(f"validation shares must be in (0, 1), got {share}")
        if grid < 1:
            raise InputError(f"grid must be >= 1, got {grid}")
        self.rule = SelectionRule(shrink=shrink, margin=margin)
        self.online = OnlineRule(window=int(window), margin=online_margin)
        self.candidates = tuple(candidates)
        self.prior = prior
        self.horizons = tuple(sorted({int(h) for h in horizons}))
        self.levels = np.array(sorted(set(levels)), dtype=float)
        self.validation = validation
        self.online_validation = online_validation
        self.grid = grid
        self.params = {k: dict(v) for k, v in (params or {}).items()}
        for name in self.candidates:
            if name == self.name:
                raise InputError("selected cannot be its own candidate")
            self._build(name)  # unknown names and bad parameters fail here
        if prior != EQUAL_MIX and prior not in self.candidates:
            raise InputError(f"prior must be a candidate or {EQUAL_MIX!r}, got {prior!r}")
        count = len(self.candidates)
        self.combos = combinations(
            np.full(count, 1.0 / count)
            if prior == EQUAL_MIX
            else np.eye(count)[self.candidates.index(prior)],
            grid,
        )
        self.validation_window: tuple[pd.Timestamp, pd.Timestamp] | None = None
        # the offline choice: weights[(series or "*", horizon, level)] -> weight per candidate
        self.weights: dict[Key, np.ndarray] = {}
        # scores[(series, horizon, level)] -> validation pinball per candidate, of the
        # chosen combination ("chosen") and of the baseline ("baseline")
        self.scores: dict[Key, dict[str, float]] = {}
        # the last `window` validation forecasts per series, horizon and level, which the
        # online choice counts as realised before the first forecast after training
        self.seeds: dict[Key, Scored] = {}
        # changes[(series, horizon, level)] -> the training quantile of h-step changes: the
        # baseline the online choice scales each series' losses by
        self.changes: dict[Key, float] = {}
        self.trained_until: pd.Timestamp | None = None
        self.models: dict[str, Forecaster] = {}

    def _build(self, name: str) -> Forecaster:
        from predictor.models import build, builder_of

        kwargs = dict(self.params.get(name, {}))
        if "horizons" in inspect.signature(builder_of(name)).parameters:
            kwargs.setdefault("horizons", self.horizons)
        return build(name, **kwargs)

    @staticmethod
    def _history(series: Sequence[SeriesArrays]) -> pd.DataFrame:
        return pd.concat(
            [s.frame[s.observed].assign(unique_id=s.unique_id) for s in series], ignore_index=True
        )

    def validate(
        self, series: Sequence[SeriesArrays], share: float | None = None
    ) -> dict[Key, Scored]:
        """Every candidate fitted before the validation tail (the last `share` of the time
        span, by default `validation`) of `series` and scored on it (the default share sets
        `validation_window`)."""
        history = self._history(series)
        first, last = history["ds"].min(), history["ds"].max()
        tail = self.validation if share is None else share
        cut = (last - tail * (last - first)).ceil(series[0].step)
        early = history[history["ds"] < cut]
        if early.empty or cut > last:
            raise InputError("history is too short to hold out a validation tail")
        if share is None:
            self.validation_window = (cut, last)
        levels = self.levels.tolist()
        frames: dict[int, list[pd.DataFrame]] = {h: [] for h in self.horizons}
        for name in self.candidates:
            model = self._build(name).fit(early)
            for h in self.horizons:
                frames[h].append(model.rolling(history, h, cut, levels).frame)
        return score_window(series, frames, cut, levels)

    def _fit(self, series: list[SeriesArrays]) -> None:
        scored = self.validate(series)
        combos = self.combos
        picks = self.rule.choose({k: s.ratios(combos) for k, s in scored.items()})
        self.weights = {k: combos[i] for k, i in picks.items()}
        singles = np.eye(len(self.candidates))
        for k, s in scored.items():
            chosen = float(s.pinball(self.weights[k][None, :])[0])
            self.scores[k] = {
                **dict(zip(self.candidates, s.pinball(singles).tolist(), strict=True)),
                "chosen": chosen,
                "baseline": s.baseline_pinball(),
            }
        if self.online_validation != self.validation:
            scored = self.validate(series, self.online_validation)
        self.seeds = {k: s.tail(self.online.window) for k, s in scored.items()}
        history = self._history(series)
        self.trained_until = history["ds"].max()
        self.changes = {
            (s.unique_id, h, float(q)): float(np.quantile(changes, q))
            for s in series
            for h in self.horizons
            if (changes := h_step_changes(np.where(s.observed, s.y, np.nan), h)).size
            for q in self.levels
        }
        # the online choice may take any candidate
        self.models = {name: self._build(name).fit(history) for name in self.candidates}

    def _nearest(self, horizon: int, level: float) -> tuple[int, float]:
        trained = np.array(self.horizons)
        h = int(trained[np.argmin(np.abs(np.sqrt(trained) - np.sqrt(horizon)))])
        return h, float(self.levels[np.argmin(np.abs(self.levels - level))])

    def _weight(self, uid: str, horizon: int, level: float) -> np.ndarray:
        key = (uid, *self._nearest(horizon, level))
        return self.weights[key] if key in self.weights else self.weights[("*", *key[1:])]

    def _quantiles(
        self, s: SeriesArrays, anchors: np.ndarray, horizon: int, levels: np.ndarray
    ) -> np.ndarray:
        return self._quantiles_of_all([(s, anchors)], horizon, levels)[0]

    def _quantiles_of_all(
        self, asked: Sequence[tuple[SeriesArrays, np.ndarray]], horizon: int, levels: np.ndarray
    ) -> list[np.ndarray]:
        if not self.models:
            raise InputError(f"model {self.name!r} is not fitted")
        combos = self.combos
        realised = [self._realised(s, anchors, horizon, levels) for s, anchors in asked]
        # every anchor moment of the call, and per series how many of its realised
        # forecasts (seed first) are known at each
        moments = np.unique(np.concatenate([s.ds[anchors] for s, anchors in asked]))
        out = [np.empty((anchors.size, levels.size)) for _, anchors in asked]
        for j, q in enumerate(levels):
            scores = np.zeros((moments.size, len(combos)))
            counted = np.zeros(moments.size, dtype=int)
            for (s, _), r in zip(asked, realised, strict=True):
                losses, base, known = self._losses(s.unique_id, r, horizon, j, float(q), moments)
                window, base_window, count = self.online.windowed(losses, base, known)
                judged = (count >= self.online.minimum) & (base_window > 0.0)
                scores[judged] += window[judged] / base_window[judged, None]
                counted += judged
            picks = self.online.choose(scores, counted)
            for i, (s, anchors) in enumerate(asked):
                at = picks[np.searchsorted(moments, s.ds[anchors])]
                offline = self._weight(s.unique_id, horizon, float(q))
                weights = np.where(at[:, None] >= 0, combos[at], offline[None, :])
                out[i][:, j] = np.sum(realised[i].at_anchor[:, j] * weights, axis=1)
        return out

    def _losses(
        self, uid: str, r: Realised, horizon: int, j: int, level: float, moments: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Pinball losses [forecast, combination] and the baseline's [forecast] of one
        series' realised forecasts at level `levels[j]`, the seed first, and how many of
        them are realised at each of `moments`."""
        combos = self.combos
        losses = pinball_rows(r.actual, r.forecasts[:, j] @ combos.T, level)
        base = pinball_rows(r.actual, r.baseline[:, j : j + 1], level)[:, 0]
        known = np.searchsorted(r.targets, moments, side="right")
        seed = self.seeds.get((uid, *self._nearest(horizon, level)))
        if seed is None:
            return losses, base, known
        return (
            np.vstack([pinball_rows(seed.actual, seed.forecasts @ combos.T, seed.level), losses]),
            np.concatenate(
                [pinball_rows(seed.actual, seed.baseline[:, None], seed.level)[:, 0], base]
            ),
            known + np.searchsorted(seed.targets, moments, side="right"),
        )

    def _realised(
        self, s: SeriesArrays, anchors: np.ndarray, horizon: int, levels: np.ndarray
    ) -> Realised:
        """The candidates' forecasts at `anchors`, and of the targets realised after
        training by the last anchor (scored as the benchmark scores: observed at t and
        t - h; only the last `window` before the first anchor and those after it can count)
        with the baseline's quantiles for them."""
        rows = np.arange(s.size)
        done = rows[
            (rows >= horizon)
            & (rows <= anchors[-1])
            & (s.ds > np.datetime64(self.trained_until))
            & s.observed
            & np.roll(s.observed, horizon)
        ]
        before_first = int(np.searchsorted(done, anchors[0], side="right"))
        done = done[max(before_first - self.online.window, 0) :]
        asked = np.union1d(anchors, done - horizon)
        # [anchor, level, candidate], uncrossed as in the candidates' own forecasts
        parts = np.stack(
            [
                uncross(self.models[n]._quantiles(s, asked, horizon, levels), levels)  # type: ignore[attr-defined]
                for n in self.candidates
            ],
            axis=2,
        )
        change = np.array([self._change(s.unique_id, horizon, float(q)) for q in levels])
        return Realised(
            at_anchor=parts[np.searchsorted(asked, anchors)],
            actual=s.y[done],
            forecasts=parts[np.searchsorted(asked, done - horizon)],
            baseline=s.y[done - horizon][:, None] + change[None, :],
            targets=s.ds[done],
        )

    def _change(self, uid: str, horizon: int, level: float) -> float:
        """The training quantile of h-step changes behind the baseline; NaN for a series
        not seen in training (its losses then have no scale and do not vote)."""
        return self.changes.get((uid, *self._nearest(horizon, level)), np.nan)

    def selection(self) -> list[dict[str, object]]:
        """The offline choice per series, horizon and level with its validation scores
        (pinball of every candidate, of the chosen combination and of the baseline), for
        the registry metadata."""
        return [
            {
                "series": uid,
                "horizon": h,
                "level": q,
                "weights": {n: float(x) for n, x in zip(self.candidates, w, strict=True) if x},
                "pinball": self.scores.get((uid, h, q)),
            }
            for (uid, h, q), w in sorted(self.weights.items())
        ]

    def settings(self) -> dict[str, object]:
        window = self.validation_window
        return {
            "candidates": list(self.candidates),
            "horizons": list(self.horizons),
            "levels": self.levels.tolist(),
            "prior": self.prior,
            "validation": self.validation,
            "validation_window": None if window is None else [str(t) for t in window],
            "grid": self.grid,
            "shrink": self.rule.shrink,
            "margin": self.rule.margin,
            "online": {
                "window": self.online.window,
                "margin": self.online.margin,
                "minimum": self.online.minimum,
                "validation": self.online_validation,
                "trained_until": None if self.trained_until is None else str(self.trained_until),
            },
            "params": self.params,
            "selection": self.selection(),
        }
