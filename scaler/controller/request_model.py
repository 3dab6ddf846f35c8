"""The request-rate model as the loop serves it: the registry's served version of
`model.requests`, loaded once, asked once a demand step for each pool's GPUs per hour in
the hour a boot ahead, with its daily profile as the week's shape
(`DemandOutlook.request_rate`, which sizes the job-level spare).

It forecasts from the store's recent requests (`predictor.lifecycle.request_training`),
in the units the collector's samples give, and only for the pools its backtest beat the
seasonal table on (`RequestBacktest.serves`). With no registry, no served version, a
version that cannot be read, or too little history, the pass gets no rate and the planner
keeps its own seasonal table; `source` says which.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime

from predictor.lifecycle.request_training import PoolShape, recent_history
from predictor.models.requests import (
    DAY_MINUTES,
    RequestForecaster,
    RequestRateForecast,
    SeasonalRequestTable,
)
from predictor.telemetry.store import TelemetryStore
from scaler.cluster.pools import NodePool
from scaler.controller.config import ModelSection

log = logging.getLogger(__name__)


@dataclass
class ServedRequestModel:
    settings: ModelSection
    model: RequestForecaster | None = None
    source: str = "not loaded"
    _loaded: bool = field(default=False, repr=False)
    _step: str | None = field(default=None, repr=False)
    _rates: dict[str, RequestRateForecast] = field(default_factory=dict, repr=False)

    def load(self) -> None:
        self._loaded = True
        if self.settings.registry is None:
            self.source = "seasonal table (no model registry)"
            return
        from predictor.lifecycle.registry import ModelRegistry

        name = self.settings.requests
        try:
            registry = ModelRegistry(self.settings.registry)
            if registry.served(name) is None:
                self.source = f"seasonal table (the registry serves no {name!r})"
                return
            model, record = registry.load(name)
        except Exception as exc:  # a damaged or foreign artifact: plan on the table, say why
            self.source = f"seasonal table ({name!r} cannot be loaded: {exc})"
            log.warning("request model %s not served: %s", name, exc)
            return
        if not isinstance(model, RequestForecaster):
            self.source = f"seasonal table ({name}:{record.version} is not a request model)"
            return
        self.model = model
        self.source = f"{name}:{record.version}"

    def rates(
        self, store: TelemetryStore, pools: Sequence[NodePool], now: datetime, step: str
    ) -> dict[str, RequestRateForecast]:
        """Per pool served, the GPUs per hour jobs will ask of new nodes in the hour a boot
        after `now`, and the week's shape; recomputed once per demand `step`."""
        if not self._loaded:
            self.load()
        if self.model is None:
            return {}
        if step == self._step:
            return self._rates
        shapes = {p.name: PoolShape(p.gpus_per_node, p.boot_seconds / 60) for p in pools}
        found = {}
        for name, history in recent_history(store, shapes, now).items():
            served = self.model.backtest is None or self.model.backtest.serves(name)
            if not served or len(history) < DAY_MINUTES:
                continue
            table = SeasonalRequestTable.fit(history)
            if table.mean <= 0:
                continue
            boot = shapes[name].boot_minutes
            rate = self.model.predict(name, history, len(history), boot, table)
            found[name] = self.model.forecast(name, rate)
        self._step, self._rates = step, found
        return found
