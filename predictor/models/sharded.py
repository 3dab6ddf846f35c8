"""Training spread over a Dask cluster (`sharded`): one model per shard of series.

Series go to shards by a stable hash of their id, so a series the model has never seen
still has a shard; each shard's model is fitted as one task on a `dask.distributed`
worker (a `LocalCluster` in tests, a scheduler's address in production), and forecasts
route every series to its shard's model. Without a scheduler the shards are fitted one
after another in this process, with the same result: the shard models do not depend on
where they were fitted.

A global model sees all series; a shard's model sees its share, which with many series
(hundreds, the reason to distribute) costs little quality and divides the fit time by the
number of workers. dask is an optional extra, imported only when a scheduler is given.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import pandas as pd

from predictor.foundation.errors import InputError
from predictor.models.direct import DirectForecaster, SeriesArrays
from predictor.models.forecast import Forecaster

DASK_PIN = 'pip install "dask[distributed]"'


def shard_of(unique_id: str, shards: int) -> int:
    """The shard of a series: stable across processes and runs (not Python's hash)."""
    return zlib.crc32(unique_id.encode()) % shards


def fit_shard(model: str, params: dict[str, Any], history: pd.DataFrame) -> Forecaster:
    """One shard's fitted model (the task each worker runs)."""
    from predictor.models import build

    return build(model, **params).fit(history)


def dask_client(address: str) -> Any:
    """A client of the scheduler at `address`, or an InputError saying what is missing."""
    try:
        from distributed import Client
        from distributed.comm import resolve_address
    except ImportError:
        raise InputError(f"Dask training needs dask.distributed: {DASK_PIN}") from None
    try:
        # A malformed address must fail before a Client exists: a half-built one hangs 20 s
        # at exit trying to close, and prints a traceback.
        resolve_address(address)
    except ValueError as exc:
        raise InputError(f"not a Dask scheduler address, {address!r}: {exc}") from None
    except OSError as exc:
        raise InputError(f"cannot reach the Dask scheduler at {address!r}: {exc}") from None
    try:
        return Client(address, timeout="10s", set_as_default=False)
    except (OSError, TimeoutError) as exc:
        raise InputError(f"cannot reach the Dask scheduler at {address!r}: {exc}") from None


class Sharded(DirectForecaster):
    """`model` (a name for `build`, with `params`) fitted per shard of series, on the Dask
    scheduler at `scheduler` when given."""

    name = "sharded"

    def __init__(
        self,
        model: str = "lightgbm",
        shards: int = 4,
        *,
        scheduler: str | None = None,
        params: dict[str, Any] | None = None,
    ) -> None:
        from predictor.models import build

        if shards < 1:
            raise InputError(f"shards must be >= 1, got {shards}")
        if model == self.name:
            raise InputError("a sharded model cannot shard itself")
        self.model = model
        self.shards = shards
        self.scheduler = scheduler
        self.params = dict(params or {})
        build(model, **self.params)  # unknown names and bad parameters fail here
        self.models: dict[int, Forecaster] = {}

    @property
    def horizons(self) -> tuple[int, ...]:
        first = next(iter(self.models.values()), None)
        return tuple(getattr(first, "horizons", ()))

    @property
    def features(self) -> list[str]:
        first = next(iter(self.models.values()), None)
        return list(getattr(first, "features", []))

    def settings(self) -> dict[str, object]:
        first = next(iter(self.models.values()), None)
        inner = getattr(first, "settings", None)
        return {
            "model": self.model,
            "shards": self.shards,
            "scheduler": self.scheduler,
            "params": self.params,
            "model_settings": inner() if callable(inner) else {},
        }

    def _fit(self, series: list[SeriesArrays]) -> None:
        parts: dict[int, list[pd.DataFrame]] = {}
        for s in series:
            frame = s.frame[s.observed].assign(unique_id=s.unique_id)
            parts.setdefault(shard_of(s.unique_id, self.shards), []).append(frame)
        frames = {k: pd.concat(v, ignore_index=True) for k, v in sorted(parts.items())}
        if self.scheduler is None:
            self.models = {k: fit_shard(self.model, self.params, f) for k, f in frames.items()}
            return
        client = dask_client(self.scheduler)
        try:
            futures = {
                k: client.submit(fit_shard, self.model, self.params, f, pure=False)
                for k, f in frames.items()
            }
            self.models = dict(zip(futures, client.gather(list(futures.values())), strict=True))
        finally:
            client.close()

    def _quantiles(
        self, s: SeriesArrays, anchors: np.ndarray, horizon: int, levels: np.ndarray
    ) -> np.ndarray:
        if not self.models:
            raise InputError(f"model {self.name!r} is not fitted")
        shard = shard_of(s.unique_id, self.shards)
        # an unseen series in a shard no training series fell into: the first shard's model
        model = self.models.get(shard) or next(iter(self.models.values()))
        return model._quantiles(s, anchors, horizon, levels)  # type: ignore[attr-defined]
