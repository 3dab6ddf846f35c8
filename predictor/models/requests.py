"""The forecast the job-level planner consumes: GPUs that jobs will ask new nodes for.

The planner holds spare nodes for the node requests it cannot see yet (a gang of eight, a
job the fragments no longer hold). How much spare is worth its GPU-hours depends on how
many GPUs will be asked for in the hour the spare serves: the hour a boot ahead, when nodes
asked for now are ready. The seasonal answer is the hour-of-week mean of the requests seen
(`SeasonalRequestTable`, the baseline). What it misses is what the loop can see coming: a
burst already under way (recent request counts over several windows against the week's
rate), a queue building (GPUs pending now).

`RequestForecaster` learns that: one LightGBM booster with a Poisson objective (requests
are counts of whole-node GPUs) on every pool at once, features and target divided by the
pool's mean request rate, so an 8-GPU A100 pool and a 4-GPU T4 pool are one population and
a pool never seen is forecast from its own rate. It serves a pool only where its backtest
beat the seasonal table there (`RequestBacktest.serves`); elsewhere the planner keeps the
table.

Inputs are per-minute series per pool (`RequestHistory`): GPUs requested (rises of the
pool's node demand times its GPUs per node, a gang all at once) and GPUs pending. Nothing
at or after a forecast's anchor minute is read.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import numpy as np

from predictor.foundation.errors import InputError

# Look-back windows of the recent request rate (minutes): a burst shows within the hour,
# a busy day within six.
WINDOWS = (30, 60, 180, 360, 1440)
DAY_MINUTES = 24 * 60
WEEK_MINUTES = 7 * DAY_MINUTES
HORIZON_MINUTES = 60  # the hour a spare asked for now serves, from a boot ahead on
HOURS_PER_DAY = 24
BUCKETS = 2 * HOURS_PER_DAY  # hour of the day, weekday or weekend
PRIOR_HOURS = 6.0  # hours at the mean an hour's rate is shrunk with: one day is not its word
STEP_MINUTES = 10  # training anchors every demand step
FEATURES = (
    *(f"rate_{w}m" for w in WINDOWS),
    "rate_week",
    "pending",
    "seasonal",
    "hour_sin",
    "hour_cos",
    "weekend",
)
SEASONAL = FEATURES.index("seasonal")


def hour_bucket(at: datetime) -> int:
    """The hour-of-week bucket of `at`: its hour, plus 24 on Saturdays and Sundays (the
    seasonal table's and the planner's replay's alike)."""
    return at.hour + (HOURS_PER_DAY if at.weekday() >= 5 else 0)


@dataclass
class RequestHistory:
    """One pool's per-minute request and queue series from `start`, appended minute by
    minute; cumulative sums make every window's rate O(1)."""

    start: datetime
    requested: list[float] = field(default_factory=list)  # GPUs asked of new nodes
    pending: list[float] = field(default_factory=list)  # GPUs waiting at the minute
    _cumulative: list[float] = field(default_factory=lambda: [0.0])

    @classmethod
    def of(
        cls, start: datetime, requested: Sequence[float], pending: Sequence[float]
    ) -> RequestHistory:
        history = cls(start)
        for r, p in zip(requested, pending, strict=True):
            history.append(r, p)
        return history

    def append(self, requested: float, pending: float) -> None:
        self.requested.append(float(requested))
        self.pending.append(float(pending))
        self._cumulative.append(self._cumulative[-1] + float(requested))

    def __len__(self) -> int:
        return len(self.requested)

    def total(self, first: int, last: int) -> float:
        """GPUs requested in minutes [first, last) (clipped to the history)."""
        first, last = max(first, 0), min(max(last, 0), len(self))
        return self._cumulative[last] - self._cumulative[first] if last > first else 0.0

    def at(self, minute: int) -> datetime:
        return self.start + timedelta(minutes=minute)


@dataclass(frozen=True)
class SeasonalRequestTable:
    """GPUs requested per hour by hour bucket, shrunk toward the mean: the baseline."""

    per_hour: np.ndarray  # BUCKETS
    mean: float

    @classmethod
    def fit(cls, history: RequestHistory, until: int | None = None) -> SeasonalRequestTable:
        until = len(history) if until is None else until
        requested = np.zeros(BUCKETS)
        hours = np.zeros(BUCKETS)
        for first in range(0, until, 60):
            last = min(first + 60, until)
            bucket = hour_bucket(history.at(first))
            requested[bucket] += history.total(first, last)
            hours[bucket] += (last - first) / 60
        mean = float(requested.sum() / hours.sum()) if hours.sum() else 0.0
        rate = (requested + PRIOR_HOURS * mean) / (hours + PRIOR_HOURS)
        return cls(rate, mean)

    def rate(self, at: datetime) -> float:
        return float(self.per_hour[hour_bucket(at)])


def features(
    history: RequestHistory, minute: int, ahead_minutes: float, table: SeasonalRequestTable
) -> np.ndarray:
    """The features at anchor `minute` (data before it only) for the hour starting
    `ahead_minutes` later, divided by the pool's mean rate (`table.mean`)."""
    scale = max(table.mean, 1e-6)
    rates = [history.total(minute - w, minute) * 60 / w / scale for w in WINDOWS]
    week = min(minute, WEEK_MINUTES)
    rate_week = history.total(minute - week, minute) * 60 / max(week, 1) / scale
    pending = history.pending[minute - 1] / scale if minute >= 1 else 0.0
    target_at = history.at(minute) + timedelta(minutes=ahead_minutes)
    hour = target_at.hour + target_at.minute / 60
    return np.array(
        [
            *rates,
            rate_week,
            pending,
            table.rate(target_at) / scale,
            math.sin(2 * math.pi * hour / HOURS_PER_DAY),
            math.cos(2 * math.pi * hour / HOURS_PER_DAY),
            float(target_at.weekday() >= 5),
        ]
    )


def target(history: RequestHistory, minute: int, ahead_minutes: float) -> float:
    """GPUs requested per hour over the hour starting `ahead_minutes` after `minute`."""
    first = minute + round(ahead_minutes)
    return history.total(first, first + HORIZON_MINUTES) * 60 / HORIZON_MINUTES


@dataclass(frozen=True)
class RequestParams:
    """LightGBM settings: few shallow trees, the rows are a few thousand."""

    n_estimators: int = 30
    learning_rate: float = 0.05
    num_leaves: int = 2
    min_child_samples: int = 100
    seed: int = 7
    min_rows: int = 200  # fewer anchors than this hold too few bursts to learn from


def causal_tables(history: RequestHistory) -> Callable[[int], SeasonalRequestTable]:
    """The seasonal table as it stood at a minute (fitted on the whole hours before it),
    as the planner's own table stands then; one fit per hour."""
    cache: dict[int, SeasonalRequestTable] = {}

    def at(minute: int) -> SeasonalRequestTable:
        hour = minute // 60 * 60
        if hour not in cache:
            cache[hour] = SeasonalRequestTable.fit(history, hour)
        return cache[hour]

    return at


def _rows(
    pools: Mapping[str, tuple[RequestHistory, float]], first: int, last: int, later: float = 0.0
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Anchors every step in [first, last), from a day of history on (the table needs
    one), whose target hour (a boot plus `later` minutes ahead) lies inside the history;
    each row's rates are divided by the mean rate of the table as it stood then."""
    x, y, names = [], [], []
    for name, (history, boot) in pools.items():
        ahead = boot + later
        table_at = causal_tables(history)
        end = min(last, len(history) - round(ahead) - HORIZON_MINUTES + 1)
        for minute in range(max(first, DAY_MINUTES), end, STEP_MINUTES):
            table = table_at(minute)
            if table.mean <= 0:
                continue
            x.append(features(history, minute, ahead, table))
            y.append(target(history, minute, ahead) / table.mean)
            names.append(name)
    return np.asarray(x).reshape(len(y), len(FEATURES)), np.asarray(y), names


def poisson_deviance(actual: np.ndarray, predicted: np.ndarray) -> float:
    """Mean Poisson deviance (lower is better; 0 for a perfect forecast)."""
    predicted = np.maximum(predicted, 1e-9)
    with np.errstate(divide="ignore", invalid="ignore"):
        term = np.where(actual > 0, actual * np.log(actual / predicted), 0.0)
    return float(np.mean(2 * (term - (actual - predicted))))


@dataclass(frozen=True)
class RequestBacktest:
    """Poisson deviance per pool of the model and of the seasonal table on held-out
    anchors (rates divided by the pool's mean, so pools weigh alike)."""

    model: Mapping[str, float]
    seasonal: Mapping[str, float]
    anchors: int

    @property
    def better(self) -> bool:
        """The model beats the table on the pools together."""
        return sum(self.model.values()) < sum(self.seasonal.values())

    def serves(self, pool: str) -> bool:
        """Whether the model is to serve `pool`: only where it beat the table there (a
        deploy never plans on a model worse than the table); a pool it was not
        backtested on, where it beat the table on the pools together."""
        if pool in self.model:
            return self.model[pool] < self.seasonal[pool]
        return self.better

    def to_dict(self) -> dict[str, object]:
        return {
            "model_deviance": dict(self.model),
            "seasonal_deviance": dict(self.seasonal),
            "anchors": self.anchors,
            "better": self.better,
        }


def holdout_split(pools: Mapping[str, tuple[RequestHistory, float]], holdout: float) -> int:
    """The minute the held-out last `holdout` of the pools' common history starts."""
    return round(min(len(h) for h, _ in pools.values()) * (1 - holdout))


@dataclass(frozen=True)
class HeldOut:
    """The anchors in [first, last) for the hour starting a boot plus `later` minutes
    ahead, built once for every forecast judged on them (the table, a candidate, the
    served model); each judged by its Poisson deviance per pool."""

    x: np.ndarray
    y: np.ndarray
    names: list[str]

    @classmethod
    def of(
        cls,
        pools: Mapping[str, tuple[RequestHistory, float]],
        first: int,
        last: int,
        later: float = 0.0,
    ) -> HeldOut:
        return cls(*_rows(pools, first, last, later))

    def __len__(self) -> int:
        return len(self.y)

    def seasonal(self) -> dict[str, float]:
        """The seasonal table's deviance: the baseline every model is judged against."""
        return self._per_pool(self.x[:, SEASONAL] if len(self) else self.y)

    def model(self, forecaster: RequestForecaster) -> dict[str, float]:
        return self._per_pool(_predict(forecaster.booster, self.x) if len(self) else self.y)

    def _per_pool(self, predicted: np.ndarray) -> dict[str, float]:
        tags = np.asarray(self.names)
        return {
            n: poisson_deviance(self.y[tags == n], predicted[tags == n])
            for n in dict.fromkeys(self.names)
        }


@dataclass(frozen=True)
class RequestForecaster:
    """The fitted request-rate model (see the module docstring). `trained_until`: the end
    of the history it was fitted on (a backtest after it is out of sample)."""

    booster: object
    params: RequestParams
    backtest: RequestBacktest | None = None
    trained_until: datetime | None = None

    @classmethod
    def fit(
        cls,
        pools: Mapping[str, tuple[RequestHistory, float]],
        params: RequestParams | None = None,
        holdout: float = 0.25,
    ) -> RequestForecaster:
        """Fit on every pool's history (`pools[name] = (history, boot minutes)`), first on
        all but the last `holdout` of it to backtest against the seasonal table, then on
        all of it. Raises InputError on too little history."""
        params = params or RequestParams()
        length = min(len(h) for h, _ in pools.values())
        cut = holdout_split(pools, holdout)
        x, y, _ = _rows(pools, 0, cut)
        if len(y) < params.min_rows:
            raise InputError(
                f"the request forecast needs at least {params.min_rows} anchors of history"
                f" after its first day ({params.min_rows * STEP_MINUTES / 60:.0f} hours of"
                f" pool history); got {len(y)}"
            )
        backtest = None
        held = HeldOut.of(pools, cut, length)
        if len(held):
            before = cls(_booster(x, y, params), params)
            backtest = RequestBacktest(held.model(before), held.seasonal(), len(held))
        all_x, all_y, _ = _rows(pools, 0, length)
        end = max(h.at(len(h)) for h, _ in pools.values())
        return cls(_booster(all_x, all_y, params), params, backtest, end)

    def predict(
        self,
        history: RequestHistory,
        minute: int,
        ahead_minutes: float,
        table: SeasonalRequestTable,
    ) -> float:
        """GPUs per hour expected in the hour starting `ahead_minutes` after `minute`."""
        x = features(history, minute, ahead_minutes, table)[None, :]
        return float(_predict(self.booster, x)[0]) * max(table.mean, 1e-6)


def _booster(x: np.ndarray, y: np.ndarray, params: RequestParams):
    """Boosted from the seasonal table (its log as the base margin): the trees learn only
    how far the signals move the hour ahead off its seasonal rate, and with no signal the
    forecast is the table."""
    import lightgbm as lgb

    settings = {
        "objective": "poisson",
        "learning_rate": params.learning_rate,
        "num_leaves": params.num_leaves,
        "min_data_in_leaf": params.min_child_samples,
        "lambda_l2": 10.0,
        "seed": params.seed,
        "num_threads": 1,
        "verbosity": -1,
    }
    data = lgb.Dataset(x, y, init_score=_base(x))
    return lgb.train(settings, data, num_boost_round=params.n_estimators)


def _base(x: np.ndarray) -> np.ndarray:
    return np.log(np.maximum(x[:, SEASONAL], 1e-6))


def _predict(booster, x: np.ndarray) -> np.ndarray:
    return np.exp(booster.predict(x, raw_score=True) + _base(x))
