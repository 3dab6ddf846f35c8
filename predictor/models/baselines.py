"""Reference models every benchmark runs next to ours (BENCHMARKS.md `forecast`).

- `persistence`: every quantile is the last observed value, y[t-h].
- `seasonal-naive`: the same time on the most recent day at least h steps back, plus the
  empirical quantiles of that rule's errors over the training window.
- `empirical`: the benchmark's baseline quantile, y[t-h] plus the empirical quantile of
  h-step changes y[s] - y[s-h] over the training window.

Training statistics are per series; a series the model was not fitted on takes them from
its own history before the first anchor asked for, so no later step leaks in.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from predictor.models.direct import DirectForecaster, SeriesArrays


class Persistence(DirectForecaster):
    """Tomorrow looks like now: every quantile is y[t-h]."""

    name = "persistence"

    def _fit(self, series: list[SeriesArrays]) -> None:
        pass

    def _quantiles(
        self, s: SeriesArrays, anchors: np.ndarray, horizon: int, levels: np.ndarray
    ) -> np.ndarray:
        return np.repeat(s.y[anchors][:, None], levels.size, axis=1)


class _OffsetBaseline(DirectForecaster):
    """A point rule plus per-series empirical quantiles of its errors on the training data."""

    def __init__(self) -> None:
        self._train: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def _fit(self, series: list[SeriesArrays]) -> None:
        self._train = {s.unique_id: (s.y.copy(), s.observed.copy()) for s in series}

    def _lag(self, s: SeriesArrays, horizon: int) -> int:
        """Steps back from the target to the observation the point rule copies (>= h)."""
        raise NotImplementedError

    def _quantiles(
        self, s: SeriesArrays, anchors: np.ndarray, horizon: int, levels: np.ndarray
    ) -> np.ndarray:
        lag = self._lag(s, horizon)
        if s.unique_id in self._train:
            y, observed = self._train[s.unique_id]
        else:
            y, observed = s.y[: anchors[0] + 1], s.observed[: anchors[0] + 1]
        errors = y[lag:] - y[:-lag] if y.size > lag else np.zeros(0)
        if errors.size:
            errors = errors[observed[lag:] & observed[:-lag]]
        offsets = np.quantile(errors, levels) if errors.size else np.zeros(levels.size)
        source = anchors + horizon - lag
        point = np.where(source >= 0, s.y[np.maximum(source, 0)], s.y[anchors])
        return point[:, None] + offsets[None, :]


class EmpiricalChange(_OffsetBaseline):
    """The benchmark baseline: y[t-h] + empirical quantile of training h-step changes."""

    name = "empirical"

    def _lag(self, s: SeriesArrays, horizon: int) -> int:
        return horizon


class SeasonalNaive(_OffsetBaseline):
    """Same time on the latest day at least h steps back, with its training error quantiles."""

    name = "seasonal-naive"

    def __init__(self, season: pd.Timedelta | str = "1D") -> None:
        super().__init__()
        self.season = pd.Timedelta(season)

    def _lag(self, s: SeriesArrays, horizon: int) -> int:
        period = max(round(self.season / s.step), 1)
        return period * -(-horizon // period)
