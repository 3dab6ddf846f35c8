"""Fit a forecasting model on trace files or the telemetry store, backtest it, register it.

The backtest follows the `forecast` benchmark: the model is fitted on each source's
training window and scored on its test window (a trace's default window, or the last 25%
of the store's history). The model that is registered is then refitted on all the history,
as deployed models should be; its metadata keeps the backtest scores of the first fit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from predictor.data.loaders import DemandTrace, load_trace
from predictor.data.series import STEP
from predictor.evaluation.backtest import (
    HORIZONS,
    QUANTILES,
    backtest_group,
    group_by_window,
    summarize,
)
from predictor.foundation.errors import InputError
from predictor.lifecycle.registry import ModelRecord, ModelRegistry, check_served_name
from predictor.models import build
from predictor.models.forecast import Forecaster


def load_sources(
    traces: Sequence[str], state_dir: Path | None, split: str | None = None
) -> list[DemandTrace]:
    """Demand from trace specs (`KIND:PATH`) or from a store's state directory (exactly one
    of the two), at native resolution."""
    if bool(traces) == (state_dir is not None):
        raise InputError("give either --trace (one or more) or --state-dir, not both or neither")
    if traces:
        return [load_trace(spec, split=split) for spec in traces]
    assert state_dir is not None
    from predictor.lifecycle.retraining import load_history
    from predictor.telemetry.store import DEFAULT_METRIC, TelemetryStore

    history = load_history(TelemetryStore.existing(state_dir), DEFAULT_METRIC, STEP)
    return [
        DemandTrace.from_frame(
            history, kind="series", unit="gpus", path=str(state_dir), split=split
        )
    ]


def stepped_history(sources: Sequence[DemandTrace]) -> pd.DataFrame:
    """All sources on 10-minute steps as one long table (series ids must be unique)."""
    groups = group_by_window(sources)
    return pd.concat([t.frame for g in groups for t in g], ignore_index=True)


@dataclass(frozen=True)
class TrainedModel:
    model: Forecaster
    metadata: dict[str, Any]


def train(
    sources: Sequence[DemandTrace],
    model_name: str,
    *,
    horizons: Sequence[int] = HORIZONS,
    params: dict[str, Any] | None = None,
    on_step: Callable[[str], None] | None = None,
    dask_scheduler: str | None = None,
    shards: int = 4,
) -> TrainedModel:
    """Backtest `model_name` on the sources' test windows, then fit it on all history.

    With `dask_scheduler`, every fit is one model per shard of series (`shards`), fitted
    on that Dask cluster (see `models.sharded`)."""
    params = params or {}

    def make() -> Forecaster:
        if dask_scheduler is not None:
            return build(
                "sharded", model=model_name, shards=shards, scheduler=dask_scheduler, params=params
            )
        return build(model_name, **params)

    make()  # an unknown name or bad parameter fails before any work
    rows = []
    windows = []
    for group in group_by_window(sources):
        windows.append([str(group[0].test_start), str(group[0].test_end)])
        try:
            found = backtest_group(group, {model_name: make}, horizons=horizons, on_step=on_step)
        except InputError as exc:
            # The backtest fits on less than the sources hold: say where its history ends,
            # or "the longest has 74 steps" reads wrong to someone who gave 100.
            raise InputError(
                f"backtest fit on the history before {group[0].test_start} (the test start,"
                f" see --split): {exc}"
            ) from None
        rows += [r.to_dict() for r in found]
    history = stepped_history(sources)
    began = time.perf_counter()
    model = make().fit(history)
    fit_seconds = time.perf_counter() - began
    if on_step is not None:
        on_step("final fit")
    settings = getattr(model, "settings", None)
    metadata: dict[str, Any] = {
        "model": model_name,
        "params": params,
        "settings": settings() if callable(settings) else {},
        "training_window": [str(history["ds"].min()), str(history["ds"].max())],
        "series": sorted(str(u) for u in history["unique_id"].unique()),
        "features": list(getattr(model, "features", [])),
        "quantiles": list(QUANTILES),
        "horizons": list(getattr(model, "horizons", horizons)),
        "step": str(STEP),
        "sources": [f"{s.kind}:{s.path}" for s in sources],
        "fit_seconds": round(fit_seconds, 3),
        "dask": None if dask_scheduler is None else {"scheduler": dask_scheduler, "shards": shards},
        "backtest": {
            "test_windows": windows,
            "horizons": list(horizons),
            "rows": rows,
            "summary": summarize(rows, model_name),
        },
    }
    return TrainedModel(model, metadata)


def train_and_register(
    registry: ModelRegistry,
    name: str,
    sources: Sequence[DemandTrace],
    model_name: str,
    *,
    horizons: Sequence[int] = HORIZONS,
    params: dict[str, Any] | None = None,
    on_step: Callable[[str], None] | None = None,
    dask_scheduler: str | None = None,
    shards: int = 4,
) -> ModelRecord:
    """`train`, then store the model as the next version of `name` (nothing is written if
    anything before fails). The version it displaces is kept as `previous`, where a
    rollback returns to."""
    served = registry.served(check_served_name(name))  # a damaged one fails before any work
    trained = train(
        sources,
        model_name,
        horizons=horizons,
        params=params,
        on_step=on_step,
        dask_scheduler=dask_scheduler,
        shards=shards,
    )
    previous = None if served is None else served.version
    # Over the version read before fitting only: one saved meanwhile is not displaced
    # unrecorded (a rollback from this one would skip it).
    return registry.save(
        name, trained.model, {**trained.metadata, "previous": previous}, after=previous
    )
