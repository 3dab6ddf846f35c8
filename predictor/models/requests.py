"""The forecast the job-level planner consumes: GPUs that jobs will ask new nodes for.

The planner holds spare nodes for the node requests it cannot see yet (a gang of eight, a
job the fragments no longer hold). How much spare is worth its GPU-hours depends on how
many GPUs will be asked for in the hour the spare serves: the hour a boot ahead, when nodes
asked for now are ready. The seasonal answer is the hour-of-week mean of the requests seen
(`SeasonalRequestTable`, the baseline). What it misses is what the loop can see coming: a
burst already under way (recent request counts over several windows against the week's
rate), a queue building (GPUs pending now).

The table also carries its noise: 48 hour buckets, each seen on a few days only, and a
burst that fell into a bucket lifts it for weeks. Measured on the synthetic workload's
validation seeds 10 and 13 (`simulate --synthetic`), most of what a perfect rate forecast
is worth over the table is the smooth cycle under it, not the bursts: the spare sized on
the true intensity with its bursts taken out saves as much as on the whole of it. So each
pool's `DailyProfile` (a Poisson regression of its hourly requests on the hour of the day,
two harmonics, and weekday or weekend, with the hours far above the fit down-weighted so
that a burst does not shape it) gives the seasonal shape, relative to the pool's mean rate.

`RequestForecaster` learns the rest: one LightGBM booster with a Poisson objective
(requests are counts of whole-node GPUs) on every pool at once, boosted from the profile
(times the pool's mean rate as the table stands), features and target divided by the
pool's mean request rate, so an 8-GPU A100 pool and a 4-GPU T4 pool are one population and
a pool never seen is forecast from its own rate and the table's shape. It serves a pool
only where its backtest beat the seasonal table there (`RequestBacktest.serves`);
elsewhere the planner keeps the table.

Inputs are per-minute series per pool (`RequestHistory`): GPUs requested (rises of the
pool's node demand times its GPUs per node, a gang all at once) and GPUs pending. Nothing
at or after a forecast's anchor minute is read.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
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
HOUR_SIN, HOUR_COS, WEEKEND = (FEATURES.index(f) for f in ("hour_sin", "hour_cos", "weekend"))


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


PROFILE_HARMONICS = 2  # of the day: a peak and a shoulder, not every hour's noise
PROFILE_OUTLIER = 3.0  # hours this many standard deviations above the fit weigh less
PROFILE_RIDGE = 1e-3  # per hour, on the shape's coefficients: a flat day if nothing is seen


def _profile_design(hours: np.ndarray, weekend: np.ndarray) -> np.ndarray:
    angle = 2 * np.pi * hours / HOURS_PER_DAY
    harmonics = [f(k * angle) for k in range(1, PROFILE_HARMONICS + 1) for f in (np.cos, np.sin)]
    return np.column_stack([np.ones(len(hours)), *harmonics, weekend])


@dataclass(frozen=True)
class DailyProfile:
    """A pool's requests per hour as a smooth function of the hour of the day and the
    weekend (see the module docstring), relative to the mean rate of the hours it was
    fitted on: 1.0 is an hour at that mean."""

    coefficients: tuple[float, ...]

    @classmethod
    def fit(cls, history: RequestHistory, until: int | None = None) -> DailyProfile:
        """Fitted on the whole hours before minute `until` (all of them by default) by
        Newton steps on the Poisson likelihood, refitted with the hours far above it (a
        burst) down-weighted."""
        until = len(history) if until is None else until
        hours = until // 60
        y = np.array([history.total(h * 60, h * 60 + 60) for h in range(hours)])
        if hours == 0 or y.sum() <= 0:
            return cls((0.0,) * (2 + 2 * PROFILE_HARMONICS))
        mids = [history.at(h * 60 + 30) for h in range(hours)]
        x = _profile_design(
            np.array([m.hour + m.minute / 60 for m in mids]),
            np.array([float(m.weekday() >= 5) for m in mids]),
        )
        ridge = PROFILE_RIDGE * hours * np.diag([0.0] + [1.0] * (x.shape[1] - 1))
        # A request is a lump of GPUs (a gang at once): the spread of an hour's total.
        lump = float(y[y > 0].mean())
        coefficients = np.zeros(x.shape[1])
        coefficients[0] = math.log(y.mean())
        weights = np.ones(hours)
        for _ in range(3):
            for _ in range(20):
                mu = np.exp(x @ coefficients)
                gradient = x.T @ (weights * (y - mu)) - ridge @ coefficients
                hessian = (x * (weights * mu)[:, None]).T @ x + ridge
                coefficients = coefficients + np.linalg.solve(hessian, gradient)
            mu = np.exp(x @ coefficients)
            excess = (y - mu) / np.sqrt(mu * lump)
            weights = np.where(excess > PROFILE_OUTLIER, (PROFILE_OUTLIER / excess) ** 2, 1.0)
        coefficients[0] -= math.log(y.mean())
        return cls(tuple(float(c) for c in coefficients))

    def relative(self, hours: np.ndarray, weekend: np.ndarray) -> np.ndarray:
        """The rate at those hours of the day (weekend 1.0 or 0.0), relative to the mean."""
        return np.exp(_profile_design(hours, weekend) @ np.asarray(self.coefficients))

    def by_bucket(self) -> tuple[float, ...]:
        """The relative rate at the middle of each hour bucket (`hour_bucket`)."""
        middles = np.tile(np.arange(HOURS_PER_DAY) + 0.5, 2)
        weekend = np.repeat([0.0, 1.0], HOURS_PER_DAY)
        return tuple(float(r) for r in self.relative(middles, weekend))


@dataclass(frozen=True)
class RequestRateForecast:
    """What sizes a pool's job-level spare: `ahead`, the GPUs per hour jobs will ask of new
    nodes in the hour a boot ahead (the hour a spare asked for now serves); `by_bucket`,
    the rate's shape over the hour buckets (`hour_bucket`, relative, any scale), which
    scales every hour's replayed waits when the price of waiting is set (None: the
    seasonal table of the requests seen does)."""

    ahead: float
    by_bucket: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.by_bucket is not None and len(self.by_bucket) != BUCKETS:
            raise ValueError(f"a request rate's shape has {BUCKETS} hour buckets")


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
        return self._per_pool(_predict(forecaster, self.x, self.names) if len(self) else self.y)

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
    profiles: Mapping[str, DailyProfile] = field(default_factory=dict)
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
        rows = _rows(pools, 0, cut)
        if len(rows[1]) < params.min_rows:
            raise InputError(
                f"the request forecast needs at least {params.min_rows} anchors of history"
                f" after its first day ({params.min_rows * STEP_MINUTES / 60:.0f} hours of"
                f" pool history); got {len(rows[1])}"
            )
        backtest = None
        held = HeldOut.of(pools, cut, length)
        if len(held):
            before = cls._boosted(pools, cut, rows, params)
            backtest = RequestBacktest(held.model(before), held.seasonal(), len(held))
        # With nothing held out (a refit of a served model), the rows are those already built.
        every = rows if cut >= length else _rows(pools, 0, length)
        fitted = cls._boosted(pools, length, every, params)
        end = max(h.at(len(h)) for h, _ in pools.values())
        return replace(fitted, backtest=backtest, trained_until=end)

    def __setstate__(self, state: dict[str, object]) -> None:
        # A model registered before the profiles loads with none: it boosts from the table,
        # as it was trained to.
        self.__dict__.update({"profiles": {}, **state})

    @classmethod
    def _boosted(
        cls,
        pools: Mapping[str, tuple[RequestHistory, float]],
        until: int,
        rows: tuple[np.ndarray, np.ndarray, list[str]],
        params: RequestParams,
    ) -> RequestForecaster:
        """Profiles fitted on the minutes before `until`, the booster on `rows` (theirs)."""
        profiles = {name: DailyProfile.fit(h, until) for name, (h, _) in pools.items()}
        x, y, names = rows
        return cls(_booster(x, y, _base(x, names, profiles), params), params, profiles)

    def predict(
        self,
        pool: str,
        history: RequestHistory,
        minute: int,
        ahead_minutes: float,
        table: SeasonalRequestTable,
    ) -> float:
        """GPUs per hour expected in `pool` in the hour starting `ahead_minutes` after
        `minute`."""
        x = features(history, minute, ahead_minutes, table)[None, :]
        return float(_predict(self, x, [pool])[0]) * max(table.mean, 1e-6)

    def forecast(self, pool: str, rate: float) -> RequestRateForecast:
        """`rate` (`predict`'s) with the pool's daily profile as the week's shape (a pool
        without one, the table's)."""
        profile = self.profiles.get(pool)
        return RequestRateForecast(rate, None if profile is None else profile.by_bucket())


def _booster(x: np.ndarray, y: np.ndarray, base: np.ndarray, params: RequestParams):
    """Boosted from `base` (the profile's log, `_base`): the trees learn only how far the
    signals move the hour ahead off its seasonal rate, and with no signal the forecast is
    the profile."""
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
    data = lgb.Dataset(x, y, init_score=base)
    return lgb.train(settings, data, num_boost_round=params.n_estimators)


def _base(x: np.ndarray, names: Sequence[str], profiles: Mapping[str, DailyProfile]) -> np.ndarray:
    """Per row the log of its seasonal rate over the pool's mean: its pool's profile at the
    target hour, or the table's where the pool has none."""
    base = x[:, SEASONAL].copy()
    hours = np.arctan2(x[:, HOUR_SIN], x[:, HOUR_COS]) * HOURS_PER_DAY / (2 * np.pi) % HOURS_PER_DAY
    tags = np.asarray(names)
    for name, profile in profiles.items():
        rows = tags == name
        if rows.any():
            base[rows] = profile.relative(hours[rows], x[rows, WEEKEND])
    return np.log(np.maximum(base, 1e-6))


def _predict(forecaster: RequestForecaster, x: np.ndarray, names: Sequence[str]) -> np.ndarray:
    base = _base(x, names, forecaster.profiles)
    return np.exp(forecaster.booster.predict(x, raw_score=True) + base)
