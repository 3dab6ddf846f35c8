"""Retraining from live history, gated by a backtest: a candidate replaces the served model
only when it forecasts the recent past better.

The served model of a name is the LATEST version of that name in the registry (what every
reader of the registry loads), so a model becomes served only by being appended to it:
- `retrain` fits a candidate on the store's history before a recent window, backtests the
  candidate and the served model on that same window, and appends the candidate to NAME if
  it scores better on the configured metric (default: pinball loss of the scaler's upper
  quantile), else to `NAME.rejected`. Either way its metadata keeps both scores.
- `promote` appends a copy of any stored version to NAME (a manual override).
- `rollback` appends a copy of the model NAME served before the current one.
Versions are never rewritten, so the registry is also the history of what was served. A
candidate lands only over the version it was judged against: when another retrain or a
promote saved one meanwhile, it goes to `NAME.rejected` instead.

Both sides are judged out of sample. A served model whose training reached into the window
(one that `gpuscale train` fitted on the whole history an hour ago, say) would be scored
on steps it has already seen, which flatters it and keeps a better candidate out; such a
model is judged by its recipe instead, its model kind and parameters from its metadata
refitted on the same history before the window as the candidate. A served model without
a recipe (older metadata) is judged as it is.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import pandas as pd

from predictor.data.series import STEP
from predictor.evaluation.backtest import pinball, rmse
from predictor.foundation.errors import InputError
from predictor.lifecycle.registry import (
    REJECTED_SUFFIX,
    ModelRecord,
    ModelRegistry,
    Superseded,
    check_served_name,
    parse_reference,
)
from predictor.models import build
from predictor.models.features import EXOGENOUS
from predictor.models.forecast import Forecaster, quantile_column
from predictor.telemetry.store import TelemetryStore

log = logging.getLogger(__name__)

Score = Literal["pinball", "rmse"]


@dataclass(frozen=True)
class RetrainPlan:
    """What to fit and how to judge it."""

    name: str = "gpuscale"  # registry name of the served model
    model: str = "gpuscale"  # model kind of the candidate (predictor.models.build)
    metric: str = "gpu_demand"  # store metric to forecast
    series: tuple[str, ...] | None = None  # unique_ids (default: all)
    step: pd.Timedelta = STEP
    backtest_steps: int = 144
    horizons: tuple[int, ...] = (1, 3, 18)
    quantile: float = 0.99  # the upper quantile the scaler plans with
    score: Score = "pinball"

    def __post_init__(self) -> None:
        if self.backtest_steps < 1:
            raise InputError(f"backtest_steps must be >= 1, got {self.backtest_steps}")
        if not self.horizons or any(h < 1 for h in self.horizons):
            raise InputError(f"horizons must be whole steps >= 1, got {list(self.horizons)}")
        if not 0.0 < self.quantile < 1.0:
            raise InputError(f"quantile must lie in (0, 1), got {self.quantile}")
        if self.step <= pd.Timedelta(0):
            raise InputError(f"step must be positive, got {self.step}")
        check_served_name(self.name)

    @property
    def score_name(self) -> str:
        return f"pinball_q{self.quantile:g}" if self.score == "pinball" else "rmse_median"


@dataclass(frozen=True)
class Scores:
    """A model's backtest on the window: the judged value (mean over horizons), and each
    horizon's value and scored steps."""

    value: float
    per_horizon: dict[int, float]
    steps: dict[int, int]

    def to_dict(self) -> dict[str, Any]:
        return {
            "value": self.value,
            "per_horizon": {str(h): v for h, v in self.per_horizon.items()},
            "steps": {str(h): n for h, n in self.steps.items()},
        }


@dataclass(frozen=True)
class RetrainOutcome:
    promoted: bool
    reason: str
    record: ModelRecord  # where the candidate was stored
    candidate: Scores
    current: Scores | None
    current_version: int | None
    window: tuple[pd.Timestamp, pd.Timestamp]
    current_refitted: bool = False  # the served model's recipe, refitted before the window
    extra: dict[str, Any] = field(default_factory=dict)


def load_history(
    store: TelemetryStore, metric: str, step: pd.Timedelta, series: Sequence[str] | None = None
) -> pd.DataFrame:
    """The metric as a long table on the grid of `step` (max per step), with the
    exogenous metrics the models know (capacity, running, pending) joined where the store
    has them for the same series."""
    ids = list(series) if series else None
    history = store.query(metric, ids, step=step)
    if history.empty:
        raise InputError(f"the store has no {metric!r} points" + (f" for {ids}" if ids else ""))
    for extra in EXOGENOUS:
        if extra == metric:
            continue
        values = store.query(extra, list(history["unique_id"].unique()), step=step)
        if not values.empty:
            history = history.merge(
                values.rename(columns={"y": extra}), on=["unique_id", "ds"], how="left"
            )
    return history


def backtest(
    model: Forecaster,
    history: pd.DataFrame,
    start: pd.Timestamp,
    plan: RetrainPlan,
) -> Scores:
    """The plan's score of `model` on every observed step from `start` on, per horizon (the
    forecast of y[t] from data up to t - h only), and their mean. A forecast that is not a
    number on any of those steps is refused: one NaN made the mean NaN, and a NaN compares
    false with everything, so the gate kept a NaN served model forever and promoted a NaN
    candidate whenever the served one could not be scored."""
    levels = sorted({0.5, plan.quantile})
    column = quantile_column(plan.quantile if plan.score == "pinball" else 0.5)
    actual = history[["unique_id", "ds", "y"]]
    per_horizon, steps = {}, {}
    for h in plan.horizons:
        frame = model.rolling(history, h, start, levels).frame
        scored = frame.merge(actual, on=["unique_id", "ds"], how="inner")
        scored = scored[scored["ds"] >= start]
        if scored.empty:
            raise InputError(f"nothing to score at horizon {h} in the window from {start}")
        y, forecast = scored["y"].to_numpy(), scored[column].to_numpy(dtype=float)
        broken = ~np.isfinite(forecast)
        if broken.any():
            names = ", ".join(sorted(map(str, scored["unique_id"][broken].unique())))
            raise InputError(
                f"no finite {column} forecast at horizon {h} on"
                f" {int(broken.sum())} of {broken.size} steps of the window (series {names})"
            )
        value = (
            pinball(y, forecast, plan.quantile) if plan.score == "pinball" else rmse(y, forecast)
        )
        per_horizon[h], steps[h] = value, len(scored)
    return Scores(float(np.mean(list(per_horizon.values()))), per_horizon, steps)


def retrain(
    store: TelemetryStore,
    registry: ModelRegistry,
    plan: RetrainPlan,
    on_step: Any = None,
) -> RetrainOutcome:
    """Fit, backtest against the served model, store, and promote only if better."""
    current = registry.served(plan.name)  # a damaged served version fails before any work
    history = load_history(store, plan.metric, plan.step, plan.series)
    end = history["ds"].max()
    start = end - plan.step * (plan.backtest_steps - 1)
    train = history[history["ds"] < start]
    if train.empty:
        raise InputError(
            f"no history before the backtest window ({plan.backtest_steps} steps of"
            f" {plan.step} from {start}); collect longer or shorten --backtest-steps"
        )
    if on_step:
        on_step("fitting the candidate")
    candidate = build(plan.model).fit(train)
    if on_step:
        on_step("backtesting the candidate")
    try:
        candidate_scores = backtest(candidate, history, start, plan)
    except InputError as exc:
        raise InputError(f"the candidate cannot be judged, nothing was stored: {exc}") from None
    current_scores, unusable, refitted = None, None, False
    if current is not None:
        try:
            served, refitted = _judged_form(registry, current, train, start, on_step)
            if on_step:
                on_step("backtesting the served model")
            current_scores = backtest(served, history, start, plan)
        except Exception as exc:  # an artifact or recipe this code can no longer run
            unusable = f"{type(exc).__name__}: {exc}"
            log.warning("served %s:%d cannot be backtested: %s", plan.name, current.version, exc)
    served_as = "" if not refitted else " (its recipe refitted before the window it was trained on)"
    if current is None:
        promoted, reason = True, "no model was served"
    elif current_scores is None:
        promoted = True
        reason = f"the served version {current.version} could not be backtested ({unusable})"
    elif candidate_scores.value < current_scores.value:
        promoted = True
        reason = (
            f"{plan.score_name} {candidate_scores.value:.4g} beats the served version"
            f" {current.version}'s {current_scores.value:.4g}{served_as}"
        )
    else:
        promoted = False
        reason = (
            f"{plan.score_name} {candidate_scores.value:.4g} does not beat the served version"
            f" {current.version}'s {current_scores.value:.4g}{served_as}"
        )
    metadata = {
        "model": plan.model,
        "params": {},
        "metric": plan.metric,
        "series": sorted(map(str, train["unique_id"].unique())),
        "step": str(plan.step),
        "training_window": [train["ds"].min(), train["ds"].max()],
        "features": list(getattr(candidate, "features", [])),
        "settings": candidate.settings() if hasattr(candidate, "settings") else {},
        "backtest": {
            "window": [start, end],
            "horizons": list(plan.horizons),
            "score": plan.score_name,
            "candidate": candidate_scores.to_dict(),
            "served": None
            if current_scores is None
            else {"version": current.version, "refitted": refitted, **current_scores.to_dict()},
        },
        "decision": {"promoted": promoted, "reason": reason, "by": "retrain"},
    }
    served_version = None if current is None else current.version
    if promoted:
        try:
            # Only over the version it was judged against: a second retrain (or a promote)
            # that landed meanwhile was never compared with this candidate.
            record = registry.save(
                plan.name, candidate, {**metadata, "previous": served_version}, after=served_version
            )
        except Superseded as exc:
            promoted = False
            judged = "no served model" if current is None else f"version {current.version}"
            reason = (
                f"{plan.name}:{exc.newest} was saved while this retrain ran, and the candidate"
                f" was judged against {judged} only, so it does not replace it ({reason})"
            )
            metadata["decision"] = {"promoted": False, "reason": reason, "by": "retrain"}
    if not promoted:
        record = registry.save(plan.name + REJECTED_SUFFIX, candidate, metadata)
    return RetrainOutcome(
        promoted,
        reason,
        record,
        candidate_scores,
        current_scores,
        None if current is None else current.version,
        (start, end),
        current_refitted=refitted,
    )


def _judged_form(
    registry: ModelRegistry,
    current: ModelRecord,
    train: pd.DataFrame,
    start: pd.Timestamp,
    on_step: Any,
) -> tuple[Forecaster, bool]:
    """The served model as the gate judges it: itself, or, when its training reached into
    the window from `start`, its recipe refitted on `train`; and whether it was refitted."""
    window = current.metadata.get("training_window") or [None, None]
    kind = current.metadata.get("model")
    if window[1] is None or pd.Timestamp(window[1]) < start or not kind:
        return registry.load(current.name, current.version)[0], False
    if on_step:
        on_step("refitting the served model's recipe before the window")
    return build(kind, **(current.metadata.get("params") or {})).fit(train), True


def promote(registry: ModelRegistry, reference: str, to: str | None = None) -> ModelRecord:
    """Serve a stored version: append a copy of it to its served name (`to`, or the name
    without `.rejected`)."""
    name, version = parse_reference(reference)
    model, source = registry.load(name, version)
    target = check_served_name(to or name.removesuffix(REJECTED_SUFFIX))
    served_now = registry.served(target)
    served_version = None if served_now is None else served_now.version
    metadata = {
        **_inherited(source.metadata),
        "decision": {
            "promoted": True,
            "reason": f"promoted by hand from {name}:{source.version}",
            "by": "promote",
        },
        "copied_from": f"{name}:{source.version}",
        "previous": served_version,
    }
    return registry.save(target, model, metadata, after=served_version)


def rollback(registry: ModelRegistry, name: str) -> ModelRecord:
    """Serve again the model `name` served before its current one (a copy appended as the
    newest version). Repeated rollbacks walk further back."""
    current = registry.record(check_served_name(name))
    previous = current.metadata.get("previous")
    if previous is None:
        raise InputError(f"{name}:{current.version} has no earlier served model to return to")
    model, target = registry.load(name, previous)
    metadata = {
        **_inherited(target.metadata),
        "decision": {
            "promoted": True,
            "reason": f"rollback from version {current.version} to version {previous}",
            "by": "rollback",
        },
        "copied_from": f"{name}:{previous}",
        # A later rollback continues from what preceded the version restored here.
        "previous": target.metadata.get("previous"),
    }
    return registry.save(name, model, metadata, after=current.version)


def _inherited(metadata: dict[str, Any]) -> dict[str, Any]:
    """The metadata a copy keeps: what the model is and how it scored, not the registry's
    own bookkeeping (name, version, creation, checksum, libraries)."""
    own = {"name", "version", "created", "artifact", "libraries", "decision", "copied_from"}
    return {k: v for k, v in metadata.items() if k not in own}
