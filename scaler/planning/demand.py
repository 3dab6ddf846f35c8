"""From the telemetry store to the planner's demand outlooks: read, check freshness, forecast.

`read_demand` takes the history of the configured demand series from the store on the
planner's step grid, with the step in progress as the last observation (its peak so far),
and says which series are missing or stale. `ForecastModel` holds the forecaster: the
latest registry version when a registry is configured, else a model fitted on the store's
history at start and refitted now and then. `outlooks` turns a forecast into the
planner's `DemandOutlook`s; when the model cannot forecast, the last observation stands
in for every quantile and the reading says so (the loop then never scales down on it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from predictor.data.series import regularize
from predictor.foundation.errors import InputError
from predictor.models.forecast import Forecaster, quantile_column
from predictor.telemetry.store import TelemetryStore
from scaler.cluster.pools import NodePool, serving_models
from scaler.controller.config import DemandSection, ModelSection
from scaler.planning.planner import DemandOutlook, PlannerPolicy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SeriesStatus:
    unique_id: str
    newest: pd.Timestamp | None  # newest raw point in the store
    age_s: float | None
    problem: str | None  # None: fresh

    def to_dict(self) -> dict[str, object]:
        return {
            "series": self.unique_id,
            "newest": None if self.newest is None else self.newest.isoformat(),
            "age_s": None if self.age_s is None else round(self.age_s, 3),
            "problem": self.problem,
        }


@dataclass(frozen=True, eq=False)
class DemandReading:
    """The demand history the decision is made on, and how trustworthy it is."""

    at: pd.Timestamp
    history: pd.DataFrame  # long table on the step grid (unique_id, ds, y)
    status: tuple[SeriesStatus, ...]

    @property
    def problems(self) -> list[str]:
        """Why the telemetry cannot justify a scale-down (empty: it can)."""
        found = [f"{s.unique_id}: {s.problem}" for s in self.status if s.problem]
        if not self.status:
            found.append("no demand series in the store")
        return found

    @property
    def last_step(self) -> pd.Timestamp | None:
        return None if self.history.empty else pd.Timestamp(self.history["ds"].max())

    def observed(self) -> dict[str, float]:
        """Demand of each series at its last observed step."""
        seen = self.history.dropna(subset=["y"]).sort_values("ds")
        return {str(k): float(v) for k, v in seen.groupby("unique_id")["y"].last().items()}


def read_demand(
    store: TelemetryStore,
    settings: DemandSection,
    step_seconds: float,
    now: pd.Timestamp,
) -> DemandReading:
    """History of the demand series over `settings.history_s` up to `now` (naive UTC),
    resampled to the planner's step (max per step)."""
    step = pd.Timedelta(seconds=step_seconds)
    start = now - pd.Timedelta(seconds=settings.history_s)
    stepped = store.query(settings.metric, settings.series, start=start, end=now, step=step)
    # Steps without an observation become explicit gaps (NaN), so the models see the
    # planner's grid rather than guessing it from the gaps between points.
    history = regularize(stepped, step)
    catalogue = store.series(settings.metric)
    pairs = zip(catalogue["unique_id"], catalogue["last"], strict=True)
    newest = {str(uid): pd.Timestamp(last) for uid, last in pairs}
    wanted = list(settings.series) if settings.series is not None else sorted(newest)
    status = []
    for uid in wanted:
        last = newest.get(uid)
        if last is None:
            status.append(SeriesStatus(uid, None, None, "no points in the store"))
            continue
        age = (now - last).total_seconds()
        problem = None
        if age > settings.stale_after_s:
            problem = f"stale: newest point {age:.0f} s old (limit {settings.stale_after_s:g} s)"
        elif uid not in set(history["unique_id"]):
            problem = "no points in the history window"
        status.append(SeriesStatus(uid, last, age, problem))
    return DemandReading(now, history, tuple(status))


@dataclass
class ForecastModel:
    """The forecaster the loop and the service use, and where it came from."""

    settings: ModelSection
    build: Callable[[], Forecaster]
    clock: Callable[[], float] = time.monotonic
    model: Forecaster | None = None
    source: str = "not loaded"
    fitted_at: float | None = None
    _from_registry: bool = field(default=False, repr=False)

    @classmethod
    def from_settings(cls, settings: ModelSection) -> ForecastModel:
        from predictor.models import build

        def make() -> Forecaster:
            return build(settings.name)

        make()  # an unknown model name fails at start, not at the first decision
        return cls(settings, make)

    def ready(self, history: pd.DataFrame) -> Forecaster:
        """The model to forecast with: loaded from the registry once, or fitted on
        `history` when it has not been or the refit interval has passed."""
        if self._from_registry and self.model is not None:
            return self.model
        if self.settings.registry is not None and self.model is None:
            from predictor.lifecycle.registry import ModelRegistry

            try:
                model, record = ModelRegistry(self.settings.registry).load(
                    self.settings.name, self.settings.version
                )
            except InputError as exc:
                log.warning("registry has no usable model (%s); fitting on the store", exc)
            else:
                self.model, self._from_registry = model, True
                self.source = f"registry {self.settings.registry} {record.name}:{record.version}"
                return model
        now = self.clock()
        due = self.fitted_at is None or now - self.fitted_at >= self.settings.refit_s
        if self.model is None or due:
            if history.empty:
                raise InputError("no demand history to fit the model on")
            fitted = self.build().fit(history)
            self.model, self.fitted_at = fitted, now
            self.source = (
                f"{self.settings.name} fitted on the store's history"
                f" ({len(history)} steps, up to {history['ds'].max()})"
            )
        assert self.model is not None
        return self.model


@dataclass(frozen=True, eq=False)
class Outlooks:
    outlooks: tuple[DemandOutlook, ...]
    forecast: pd.DataFrame  # the forecast frame (unique_id, ds, horizon, q...)
    problem: str | None  # why the forecast stood in with the last observation


def forecast_levels(policy: PlannerPolicy) -> tuple[float, ...]:
    return tuple(sorted({policy.median_quantile, 0.9, policy.base_quantile}))


def outlooks(
    reading: DemandReading,
    model: ForecastModel,
    pools: Sequence[NodePool],
    policy: PlannerPolicy,
    settings: DemandSection,
) -> Outlooks:
    """One outlook per demand series, over horizons 1 .. (longest boot in steps) + 1."""
    lead = max(p.boot_steps(policy.step_seconds) for p in pools)
    horizons = list(range(1, lead + 2))
    levels = forecast_levels(policy)
    observed = reading.observed()
    if not observed:
        return Outlooks((), _empty_forecast(levels), None)
    problem = None
    try:
        frame = model.ready(reading.history).forecast(reading.history, horizons, levels).frame
    except (InputError, ValueError) as exc:
        problem = f"forecast failed ({exc}); the last observation stands in"
        log.warning(problem)
        frame = _persistence(reading, horizons, levels, policy.step_seconds)
    configured = {uid: group.gpu_models for uid, group in settings.groups.items()}
    found = []
    for uid, value in sorted(observed.items()):
        rows = frame[frame["unique_id"] == uid].sort_values("horizon")
        if len(rows) < len(horizons):
            continue
        values = np.column_stack([rows[quantile_column(q)].to_numpy(dtype=float) for q in levels])
        models = serving_models(uid, configured, pools)
        found.append(DemandOutlook(uid, value, levels, np.maximum(values, 0.0), models))
    return Outlooks(tuple(found), frame, problem)


def _persistence(
    reading: DemandReading, horizons: list[int], levels: tuple[float, ...], step_s: float
) -> pd.DataFrame:
    rows = []
    last = reading.history.dropna(subset=["y"]).sort_values("ds").groupby("unique_id").last()
    for uid, row in last.iterrows():
        for h in horizons:
            entry = {"unique_id": uid, "ds": row["ds"] + pd.Timedelta(seconds=h * step_s)}
            entry["horizon"] = h
            entry.update({quantile_column(q): float(row["y"]) for q in levels})
            rows.append(entry)
    return pd.DataFrame(rows) if rows else _empty_forecast(levels)


def _empty_forecast(levels: tuple[float, ...]) -> pd.DataFrame:
    columns = ["unique_id", "ds", "horizon", *(quantile_column(q) for q in levels)]
    return pd.DataFrame(columns=columns)
