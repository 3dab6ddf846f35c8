"""Model selection: the choice is made on the training window's tail only, never loses to
a single candidate there, and the forecast is exactly the chosen combination."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from predictor.errors import InputError
from predictor.forecast import quantile_column
from predictor.models import build
from predictor.models.selection import simplex_grid
from predictor.synthetic import generate, load_config

LEVELS = (0.5, 0.9, 0.99)
CANDIDATES = ("persistence", "empirical", "seasonal-naive")


@pytest.fixture(scope="module")
def history() -> pd.DataFrame:
    return generate(load_config(), seed=5, days=5).trace().resampled().frame


def test_simplex_grid_is_every_convex_combination_on_the_grid() -> None:
    grid = simplex_grid(3, 2)
    assert grid.shape == (6, 3)
    np.testing.assert_allclose(grid.sum(axis=1), 1.0)
    assert {tuple(r) for r in grid} >= {(1.0, 0.0, 0.0), (0.5, 0.5, 0.0)}


def test_choice_comes_from_the_training_tail_and_is_applied_exactly(
    history: pd.DataFrame,
) -> None:
    split = history["ds"].max() - pd.Timedelta("1D")
    train = history[history["ds"] < split]
    model = build("selected", candidates=CANDIDATES, horizons=(1, 3), margin=0.0).fit(train)
    begin, end = model.validation_window
    assert train["ds"].min() < begin <= end <= train["ds"].max() < split
    chosen = model.selection()
    series = sorted(history["unique_id"].unique())
    assert {c["series"] for c in chosen} == {*series, "*"}
    for c in chosen:
        assert sum(c["weights"].values()) == pytest.approx(1.0)
        if c["pinball"] is not None:
            singles = [c["pinball"][n] for n in CANDIDATES]  # margin 0: the best is kept
            assert c["pinball"]["chosen"] <= min(singles) + 1e-12
    # the forecast is the weighted sum of the candidates refitted on all of `train`
    out = model.rolling(history, 3, split, LEVELS).frame
    refits = {n: build(n).fit(train).rolling(history, 3, split, LEVELS).frame for n in CANDIDATES}
    uid = series[0]
    for q in LEVELS:
        w = next(
            c["weights"] for c in chosen if (c["series"], c["horizon"], c["level"]) == (uid, 3, q)
        )
        col = quantile_column(q)
        mine = out.loc[out["unique_id"] == uid, col].to_numpy()
        parts = sum(
            weight * refits[n].loc[refits[n]["unique_id"] == uid, col].to_numpy()
            for n, weight in w.items()
        )
        if q == 0.5:  # the other levels may be uncrossed around the median
            np.testing.assert_allclose(mine, parts)


def test_bad_candidates_are_input_errors() -> None:
    with pytest.raises(InputError, match="unknown model"):
        build("selected", candidates=("prophet",))
    with pytest.raises(InputError, match="own candidate"):
        build("selected", candidates=("selected",))
    with pytest.raises(InputError, match="distinct"):
        build("selected", candidates=("empirical", "empirical"))


def test_models_show_prints_the_choice(history: pd.DataFrame, tmp_path) -> None:
    from typer.testing import CliRunner

    from predictor.loaders import DemandTrace
    from predictor.registry import ModelRegistry
    from predictor.training import train
    from scaler.cli import app

    source = DemandTrace.from_frame(history, kind="series", unit="gpus", split=None)
    trained = train([source], "selected", params={"candidates": CANDIDATES, "horizons": (1, 3)})
    registry = tmp_path / "models"
    ModelRegistry(registry).save("picked", trained.model, trained.metadata)
    chosen = trained.metadata["settings"]["selection"]
    assert {c["horizon"] for c in chosen} == {1, 3}
    result = CliRunner().invoke(
        app,
        ["models", "show", "picked", "--selection", "--registry", str(registry)],
        env={"COLUMNS": "200"},
    )
    assert result.exit_code == 0, result.output
    assert "unseen series" in result.output and "seasonal-naive" in result.output
    plain = CliRunner().invoke(app, ["models", "show", "picked", "--registry", str(registry)])
    assert json.loads(plain.output)["settings"]["candidates"] == list(CANDIDATES)
