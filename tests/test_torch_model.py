"""The torch quantile network: deterministic under a seed, exact through the registry,
monotone quantiles, and a clear error where torch is missing. (Leakage and rolling/forecast
agreement are checked for every registered model in test_forecast_models.py.)"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from predictor.foundation.errors import InputError
from predictor.lifecycle.registry import ModelRegistry
from predictor.models import NetParams, build
from predictor.models.forecast import quantile_column
from scaler.evaluation.synthetic import generate, load_config

LEVELS = (0.5, 0.9, 0.99)
SMALL = NetParams(hidden=32, epochs=3, batch_size=256)


@pytest.fixture(scope="module")
def history() -> pd.DataFrame:
    trace = generate(load_config(), seed=3, days=4).trace().resampled()
    return trace.frame


def _forecast(model, history: pd.DataFrame) -> np.ndarray:
    start = history["ds"].max() - pd.Timedelta("6h")
    out = model.rolling(history, 3, start, LEVELS).frame
    return out[[quantile_column(q) for q in LEVELS]].to_numpy()


def test_same_seed_same_model_other_seed_another(history: pd.DataFrame) -> None:
    first = build("torch", horizons=(1, 3), params=SMALL).fit(history)
    again = build("torch", horizons=(1, 3), params=SMALL).fit(history)
    other = build("torch", horizons=(1, 3), params=NetParams(**{**vars(SMALL), "seed": 8}))
    other.fit(history)
    np.testing.assert_array_equal(_forecast(first, history), _forecast(again, history))
    assert not np.array_equal(_forecast(first, history), _forecast(other, history))
    assert first.device_used in ("cpu", "cuda")


def test_registry_round_trip_is_exact_and_quantiles_are_monotone(
    history: pd.DataFrame, tmp_path: Path
) -> None:
    model = build("torch", horizons=(1, 3, 6), params=SMALL).fit(history)
    record = ModelRegistry(tmp_path).save("torch", model, {"model": "torch"})
    loaded, _ = ModelRegistry(tmp_path).load("torch", record.version)
    before = _forecast(model, history)
    np.testing.assert_array_equal(before, _forecast(loaded, history))
    assert np.isfinite(before).all() and (np.diff(before, axis=1) >= 0).all()
    # an untrained horizon is answered too, its spread wider than the first horizon's
    ahead = loaded.forecast(history, [1, 12], LEVELS).frame
    spread = ahead.assign(s=ahead["q0.99"] - ahead["q0.5"]).groupby("horizon")["s"].mean()
    assert spread[12] > spread[1]


def test_missing_torch_is_an_input_error_naming_the_pin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(InputError, match=r"pip install torch==2\.13\.0"):
        build("torch")
