"""Model selection: the choice is made on the training window's tail only, keeps the prior
unless a combination beats it by the margin, never loses to a single candidate there when
free, and the forecast is exactly the chosen combination."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from predictor.backtest import baseline_quantile
from predictor.errors import InputError
from predictor.forecast import quantile_column
from predictor.models import build
from predictor.models.direct import split_series
from predictor.models.selection import SelectionRule, combinations, score_window
from predictor.synthetic import generate, load_config

LEVELS = (0.5, 0.9, 0.99)
CANDIDATES = ("persistence", "empirical", "seasonal-naive")


@pytest.fixture(scope="module")
def history() -> pd.DataFrame:
    return generate(load_config(), seed=5, days=5).trace().resampled().frame


def test_combinations_start_with_the_prior_and_hold_every_grid_vector_once() -> None:
    prior = np.array([0.0, 1.0, 0.0])
    combos = combinations(prior, 2)
    np.testing.assert_array_equal(combos[0], prior)
    np.testing.assert_allclose(combos.sum(axis=1), 1.0)
    assert len({tuple(r.round(9)) for r in combos}) == len(combos) == 7  # 6 on the grid + 1/3s
    assert {(0.5, 0.5, 0.0), (1.0, 0.0, 0.0)} <= {tuple(r) for r in combos}
    assert np.isclose(combos, 1 / 3).all(axis=1).any()


def test_rule_keeps_the_prior_unless_beaten_by_the_margin_and_shrinks_to_the_pool() -> None:
    # combination 0 is the prior; "a" is better with 2 and "b" with 1, by 30% each
    ratios = {
        ("a", 1, 0.9): np.array([1.0, 0.9, 0.7]),
        ("b", 1, 0.9): np.array([1.0, 0.7, 1.0]),
    }
    free = SelectionRule(shrink=0.0, margin=0.0).choose(ratios)
    assert free[("a", 1, 0.9)] == 2 and free[("b", 1, 0.9)] == 1
    assert free[("*", 1, 0.9)] == 1  # pooled means 1.0, 0.8, 0.85
    pooled = SelectionRule(shrink=1.0, margin=0.0).choose(ratios)
    assert pooled[("a", 1, 0.9)] == pooled[("b", 1, 0.9)] == pooled[("*", 1, 0.9)] == 1
    # a pooled gain of 20% is under a 25% margin: the prior stays everywhere
    cautious = SelectionRule(shrink=1.0, margin=0.25).choose(ratios)
    assert set(cautious.values()) == {0}
    with pytest.raises(InputError, match="margin"):
        SelectionRule(shrink=0.5, margin=1.0)
    with pytest.raises(InputError, match="shrink"):
        SelectionRule(shrink=1.5, margin=0.1)


def test_validation_is_scored_as_the_benchmark_scores(history: pd.DataFrame) -> None:
    cut = history["ds"].max() - pd.Timedelta("1D")
    early = history[history["ds"] < cut]
    models = [build(n).fit(early) for n in ("persistence", "empirical")]
    frames = {3: [m.rolling(history, 3, cut, LEVELS).frame for m in models]}
    scored = score_window(split_series(history), frames, cut, LEVELS)
    uid = sorted(history["unique_id"].unique())[0]
    s = scored[(uid, 3, 0.99)]
    one = history[history["unique_id"] == uid].set_index("ds")["y"]
    last = s.forecasts[:, 0]  # persistence forecasts the last value
    expected = baseline_quantile(one[one.index < cut].to_numpy(), last, 3, 0.99)
    np.testing.assert_allclose(s.baseline, expected)
    assert (s.forecasts[:, 1] >= s.forecasts[:, 0]).all()  # empirical p99 above the last value
    # the ratio of a single candidate is its pinball over the baseline's
    ratio = s.ratios(np.array([[1.0, 0.0]]))[0]
    assert ratio == pytest.approx(s.pinball(np.array([[1.0, 0.0]]))[0] / s.baseline_pinball())


def test_choice_comes_from_the_training_tail_and_is_applied_exactly(
    history: pd.DataFrame,
) -> None:
    split = history["ds"].max() - pd.Timedelta("1D")
    train = history[history["ds"] < split]
    model = build(
        "selected",
        candidates=CANDIDATES,
        horizons=(1, 3),
        prior="mix",
        validation=0.2,
        shrink=0.0,
        margin=0.0,
    ).fit(train)
    begin, end = model.validation_window
    assert train["ds"].min() < begin <= end <= train["ds"].max() < split
    chosen = model.selection()
    series = sorted(history["unique_id"].unique())
    assert {c["series"] for c in chosen} == {*series, "*"}
    for c in chosen:
        assert sum(c["weights"].values()) == pytest.approx(1.0)
        if c["pinball"] is not None:
            singles = [c["pinball"][n] for n in CANDIDATES]  # margin 0: the best is kept
            assert c["pinball"]["baseline"] > 0
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


def test_a_wide_margin_keeps_the_prior(history: pd.DataFrame) -> None:
    model = build(
        "selected", candidates=CANDIDATES, horizons=(1,), prior="empirical", margin=0.99
    ).fit(history)
    assert model.models.keys() == {"empirical"}  # only the prior is ever used, so refitted
    assert all(c["weights"] == {"empirical": 1.0} for c in model.selection())


def test_bad_candidates_are_input_errors() -> None:
    with pytest.raises(InputError, match="unknown model"):
        build("selected", candidates=("prophet",))
    with pytest.raises(InputError, match="own candidate"):
        build("selected", candidates=("selected",))
    with pytest.raises(InputError, match="distinct"):
        build("selected", candidates=("empirical", "empirical"))
    with pytest.raises(InputError, match="prior"):
        build("selected", candidates=CANDIDATES, prior="lightgbm")


def test_models_show_prints_the_choice(history: pd.DataFrame, tmp_path) -> None:
    from typer.testing import CliRunner

    from predictor.loaders import DemandTrace
    from predictor.registry import ModelRegistry
    from predictor.training import train
    from scaler.cli import app

    source = DemandTrace.from_frame(history, kind="series", unit="gpus", split=None)
    params = {"candidates": CANDIDATES, "horizons": (1, 3), "prior": "persistence"}
    trained = train([source], "selected", params=params)
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
