"""The request-rate model's lifecycle: its history read from the telemetry store, and
retraining gated by a backtest against both the served model and the seasonal table.

The planner's job-level spare is sized on the node requests of each pool: rises of the
pool's node demand, a gang all at once (`scaler.planning.request_log`). The store keeps
what the collector sampled, `gpu_demand` and `pending` per pool, so the same requests are
read off it: each minute's rise of the pool's demand in whole nodes, times its GPUs per
node. That is the history `RequestForecaster` learns from and, in the loop, the recent
requests it forecasts from.

A candidate is promoted (appended to NAME, which makes it the served model) only when, on
the held-out last quarter of the history, its Poisson deviance is below the seasonal
table's on the pools together, and below the served model's on the same anchors. A served
model whose training reached into that quarter is judged by its recipe (its parameters)
refitted on the history before it, so neither side is scored on hours it has seen. So a
deploy never plans on a model worse than the table, nor on one worse than what it served.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import numpy as np
import pandas as pd

from predictor.foundation.errors import InputError
from predictor.lifecycle.registry import REJECTED_SUFFIX, ModelRecord, ModelRegistry, Superseded
from predictor.models.requests import (
    HORIZON_MINUTES,
    HeldOut,
    RequestForecaster,
    RequestHistory,
    RequestParams,
    holdout_split,
)
from predictor.telemetry.store import TelemetryStore

REQUESTS_NAME = "requests"  # the registry name the loop serves the request model from
HISTORY_DAYS = 28  # what a retrain reads: four of every hour of the week
HOLDOUT = 0.25  # the last quarter of the history is the backtest
RECENT_DAYS = 14  # what the loop forecasts from: the week window, and a table of two weeks


@dataclass(frozen=True)
class PoolShape:
    """What the request history needs of a pool: its node size and its boot."""

    gpus_per_node: int
    boot_minutes: float


def store_histories(
    store: TelemetryStore,
    pools: Mapping[str, PoolShape],
    end: datetime | None = None,
    days: float = HISTORY_DAYS,
) -> dict[str, RequestHistory]:
    """Per pool with `gpu_demand` in the store, its requests and queue minute by minute
    over the `days` before `end` (default: the newest point): GPUs asked of new nodes
    (rises of the demand in whole nodes, times the node's GPUs) and GPUs pending. A minute
    with no sample keeps the minute before."""
    until = pd.Timestamp(end) if end is not None else None
    start = None if until is None else until - pd.Timedelta(days=days)
    demand = store.query("gpu_demand", list(pools), start, until, step="1min")
    if demand.empty:
        return {}
    if until is None:
        until = demand["ds"].max()
        demand = demand[demand["ds"] >= until - pd.Timedelta(days=days)]
    pending = store.query(
        "pending", list(pools), until - pd.Timedelta(days=days), until, step="1min"
    )
    histories = {}
    for pool, rows in demand.groupby("unique_id"):
        shape = pools[str(pool)]
        first = rows["ds"].min()
        grid = pd.date_range(first, until, freq="min")
        gpus = rows.set_index("ds")["y"].reindex(grid).ffill().to_numpy()
        nodes = np.ceil(np.maximum(gpus, 0.0) / shape.gpus_per_node - 1e-9)
        rises = np.maximum(np.diff(nodes, prepend=nodes[0]), 0.0) * shape.gpus_per_node
        waiting = pending[pending["unique_id"] == pool].set_index("ds")["y"]
        queued = waiting.reindex(grid).ffill().fillna(0.0).to_numpy()
        histories[str(pool)] = RequestHistory.of(first.to_pydatetime(), rises, queued)
    return histories


@dataclass(frozen=True)
class RequestRetrainOutcome:
    promoted: bool
    reason: str
    record: ModelRecord  # where the candidate was stored
    candidate: Mapping[str, float]  # Poisson deviance per pool, held-out quarter
    seasonal: Mapping[str, float]
    served: Mapping[str, float] | None
    served_version: int | None
    hour_after: Mapping[str, Mapping[str, float]]  # the hour after: deviance per side

    def to_dict(self) -> dict[str, Any]:
        return {
            "promoted": self.promoted,
            "reason": self.reason,
            "stored_as": f"{self.record.name}:{self.record.version}",
            "horizon": "the hour from a boot ahead",
            "deviance": {
                "candidate": dict(self.candidate),
                "seasonal": dict(self.seasonal),
                "served": None if self.served is None else dict(self.served),
            },
            "served_version": self.served_version,
            "hour_after": {side: dict(v) for side, v in self.hour_after.items()},
        }


def retrain_requests(
    store: TelemetryStore,
    registry: ModelRegistry,
    pools: Mapping[str, PoolShape],
    name: str = REQUESTS_NAME,
    params: RequestParams | None = None,
    end: datetime | None = None,
) -> RequestRetrainOutcome:
    """Fit a request model on the store's last `HISTORY_DAYS`, judge it (module docstring)
    and store it under `name` if promoted, else under `name.rejected`."""
    current = registry.served(name)
    histories = store_histories(store, pools, end)
    if not histories:
        raise InputError(f"the store has no gpu_demand points for the pools {sorted(pools)}")
    inputs = {p: (h, pools[p].boot_minutes) for p, h in histories.items()}
    candidate = RequestForecaster.fit(inputs, params, HOLDOUT)
    if candidate.backtest is None:
        raise InputError("the request model's history leaves no hours to backtest on")
    length = min(len(h) for h in histories.values())
    cut = holdout_split(inputs, HOLDOUT)
    held_from = min(h.at(cut) for h in histories.values())
    seasonal = dict(candidate.backtest.seasonal)
    mine = dict(candidate.backtest.model)
    served = None
    if current is not None:
        incumbent = _judged_form(registry, current, inputs, cut, held_from)
        served = HeldOut.of(inputs, cut, length).model(incumbent)
    better_than_table = candidate.backtest.better
    better_than_served = served is None or sum(mine.values()) < sum(served.values())
    reason = (
        f"Poisson deviance {sum(mine.values()):.4g} against the seasonal table's"
        f" {sum(seasonal.values()):.4g}"
        + ("" if served is None else f" and the served version's {sum(served.values()):.4g}")
    )
    promoted = better_than_table and better_than_served
    if not better_than_table:
        reason = f"does not beat the seasonal table: {reason}"
    elif not better_than_served:
        reason = f"does not beat the served version {current.version}: {reason}"
    else:
        reason = f"beats the table{'' if served is None else ' and the served model'}: {reason}"
    hour_after = HeldOut.of(inputs, cut, length, HORIZON_MINUTES)
    later = {"candidate": hour_after.model(candidate), "seasonal": hour_after.seasonal()}
    metadata = {
        "model": "requests",
        "params": vars(candidate.params),
        "pools": {p: vars(s) for p, s in pools.items() if p in histories},
        "training_window": [
            min(h.start for h in histories.values()),
            candidate.trained_until,
        ],
        "backtest": {
            "held_out_from": held_from,
            "candidate": mine,
            "seasonal": seasonal,
            "served": served,
            "hour_after": later,
        },
        "decision": {"promoted": promoted, "reason": reason, "by": "retrain-requests"},
    }
    version = None if current is None else current.version
    record = None
    if promoted:
        try:
            record = registry.save(
                name, candidate, {**metadata, "previous": version}, after=version
            )
        except Superseded as exc:
            promoted = False
            reason = f"{name}:{exc.newest} was saved while this retrain ran ({reason})"
    if record is None:
        record = registry.save(name + REJECTED_SUFFIX, candidate, metadata)
    return RequestRetrainOutcome(promoted, reason, record, mine, seasonal, served, version, later)


def _judged_form(
    registry: ModelRegistry,
    current: ModelRecord,
    inputs: Mapping[str, tuple[RequestHistory, float]],
    cut: int,
    held_from: datetime,
) -> RequestForecaster:
    """The served model as judged: itself when its training ended before the held-out
    quarter, else its parameters refitted on the history before it."""
    model, _ = registry.load(current.name, current.version)
    if not isinstance(model, RequestForecaster):
        raise InputError(f"{current.name}:{current.version} is not a request model")
    if model.trained_until is not None and model.trained_until <= held_from:
        return model
    before = {
        p: (RequestHistory.of(h.start, h.requested[:cut], h.pending[:cut]), boot)
        for p, (h, boot) in inputs.items()
    }
    return RequestForecaster.fit(before, model.params, holdout=0.0)


def recent_history(
    store: TelemetryStore, pools: Mapping[str, PoolShape], now: datetime
) -> dict[str, RequestHistory]:
    """What the loop forecasts from: the store's requests over the `RECENT_DAYS` up to
    `now` (the model's longest window, and the seasonal table its rates are divided by)."""
    return store_histories(store, pools, now, days=RECENT_DAYS)
