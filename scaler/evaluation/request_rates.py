"""The request-rate forecasts a predictive job-level run is given, one per mode:

- `LearnedRates` (mode `predictive`): the learned model (`predictor.models.requests`),
  fitted on the node requests of the history before the run (what the cluster's own loop
  recorded: here a reactive run of that history, as Cluster Autoscaler ran before gpuscale
  came), fed each minute's requests and queue as the run goes; in a pool where its
  backtest does not beat the seasonal table it answers None, and the planner keeps the
  table;
- `TrueRates` (mode `predictive-true-rate`): the workload's true request intensity as the
  generator defines it (cycles, trend and the bursts drawn), in the units of the requests
  seen, its shape over the week the intensity's own mean by hour bucket: the ceiling of
  any rate forecast.

Both are told the minutes in order by the simulator (`RequestRates`); a run owns its copy.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime

import numpy as np
import pandas as pd

from predictor.models.requests import (
    HORIZON_MINUTES,
    RequestForecaster,
    RequestHistory,
    RequestRateForecast,
    SeasonalRequestTable,
    causal_tables,
)


def request_histories(fleet: pd.DataFrame, start: datetime) -> dict[str, RequestHistory]:
    """Per pool the request and queue series (`requested_gpus`, `pending_gpus`) of a job
    simulation's `fleet`, minute by minute from `start`."""
    return {
        str(pool): RequestHistory.of(
            start, rows["requested_gpus"].to_numpy(), rows["pending_gpus"].to_numpy()
        )
        for pool, rows in fleet.sort_values("ds").groupby("pool")
    }


@dataclass
class LearnedRates:
    """The learned model on each pool's history as the run extends it; its rates are
    divided by the seasonal table as it stands at each minute (refitted every hour on
    the hours before), as they were in training."""

    model: RequestForecaster
    histories: dict[str, RequestHistory]
    tables: dict[str, Callable[[int], SeasonalRequestTable]]

    @classmethod
    def of(cls, model: RequestForecaster, histories: Mapping[str, RequestHistory]) -> LearnedRates:
        copies = {
            n: RequestHistory.of(h.start, h.requested, h.pending) for n, h in histories.items()
        }
        return cls(model, copies, {n: causal_tables(h) for n, h in copies.items()})

    def observe(self, pool: str, requested_gpus: float, pending_gpus: float) -> None:
        self.histories[pool].append(requested_gpus, pending_gpus)

    def rate(self, pool: str, minute: int, boot_minutes: float) -> RequestRateForecast | None:
        if self.model.backtest is not None and not self.model.backtest.serves(pool):
            return None
        history = self.histories[pool]
        now = len(history)
        rate = self.model.predict(pool, history, now, boot_minutes, self.tables[pool](now))
        return self.model.forecast(pool, rate)


@dataclass
class TrueRates:
    """`intensity[pool][m]`: GPUs expected per minute at minute m of the run; `scale`:
    requests seen per GPU of intensity (fitted on the history before the run); `shape`:
    the intensity's mean per hour bucket."""

    intensity: Mapping[str, np.ndarray]
    scale: Mapping[str, float]
    shape: Mapping[str, tuple[float, ...]]

    def observe(self, pool: str, requested_gpus: float, pending_gpus: float) -> None:
        return None

    def rate(self, pool: str, minute: int, boot_minutes: float) -> RequestRateForecast | None:
        first = minute + round(boot_minutes)
        window = self.intensity[pool][first : first + HORIZON_MINUTES]
        if not window.size:
            return None
        return RequestRateForecast(float(window.mean()) * 60 * self.scale[pool], self.shape[pool])
