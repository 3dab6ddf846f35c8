"""Forecasting models by name: `build("gpuscale")` is the model the product deploys.

- `gpuscale`: quantile boosting with online conformal upper quantiles and a shrunk median
  (the default);
- `lightgbm`: the same boosting, uncalibrated (plain direct quantile LightGBM);
- `persistence`: every quantile is the last value;
- `seasonal-naive`: the same time on the latest day at least h back, with empirical error
  quantiles;
- `empirical`: the last value plus empirical quantiles of training h-step changes (the
  benchmark's baseline);
- `torch`: a global PyTorch quantile network (needs torch, imported when built);
- `torch-conformal`: the `gpuscale` calibration around that network;
- `selected`: per horizon and level, the best combination of other models, chosen on a
  validation tail of the training window and then online from the realised forecasts;
- `sharded`: one model per shard of series, fitted on a Dask cluster when given one.
"""

from __future__ import annotations

from collections.abc import Callable

from predictor.foundation.errors import InputError
from predictor.models.baselines import EmpiricalChange, Persistence, SeasonalNaive
from predictor.models.conformal import ConformalBoost
from predictor.models.forecast import Forecaster
from predictor.models.lgbm import BoostParams, QuantileBoost
from predictor.models.selection import Selected
from predictor.models.sharded import Sharded
from predictor.models.torch_model import ConformalTorch, NetParams, TorchQuantile

DEFAULT_MODEL = "gpuscale"

_BUILDERS: dict[str, Callable[..., Forecaster]] = {
    "gpuscale": ConformalBoost,
    "lightgbm": QuantileBoost,
    "persistence": Persistence,
    "seasonal-naive": SeasonalNaive,
    "empirical": EmpiricalChange,
    "torch": TorchQuantile,
    "torch-conformal": ConformalTorch,
    "selected": Selected,
    "sharded": Sharded,
}
MODEL_NAMES: tuple[str, ...] = tuple(_BUILDERS)


def builder_of(name: str) -> Callable[..., Forecaster]:
    """The class (or function) that `build(name)` calls."""
    try:
        return _BUILDERS[name]
    except KeyError:
        raise InputError(f"unknown model {name!r} (known: {', '.join(MODEL_NAMES)})") from None


def build(name: str, **params: object) -> Forecaster:
    """A new, unfitted model. `params` are the model's keyword arguments (e.g. `horizons`)."""
    builder = builder_of(name)
    try:
        return builder(**params)
    except TypeError as exc:
        raise InputError(f"model {name!r}: {exc}") from None


__all__ = [
    "DEFAULT_MODEL",
    "MODEL_NAMES",
    "BoostParams",
    "ConformalBoost",
    "ConformalTorch",
    "EmpiricalChange",
    "NetParams",
    "Persistence",
    "QuantileBoost",
    "SeasonalNaive",
    "Selected",
    "Sharded",
    "TorchQuantile",
    "build",
    "builder_of",
]
