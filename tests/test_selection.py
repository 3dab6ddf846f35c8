"""Model selection: the offline choice is made on the training window's tail only, keeps the
prior unless a combination beats it by the margin and never loses to a single candidate
there when free; after training each forecast is the mix chosen online from the realised
forecasts up to its anchor only, exactly as the rule says."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from predictor.evaluation.backtest import baseline_quantile
from predictor.foundation.errors import InputError
from predictor.models import build
from predictor.models.direct import split_series, uncross
from predictor.models.forecast import quantile_column
from predictor.models.selection import Selected, SelectionRule, combinations, score_window
from scaler.evaluation.synthetic import generate, load_config

LEVELS = (0.5, 0.9, 0.99)
CANDIDATES = ("persistence", "empirical", "seasonal-naive")


@pytest.fixture(scope="module")
def history() -> pd.DataFrame:
    return generate(load_config(), seed=5, days=5).trace().resampled().frame


def fitted(
    history: pd.DataFrame, **settings: object
) -> tuple[Selected, pd.Timestamp, pd.DataFrame]:
    """`selected` over CANDIDATES fitted on all but the last day of `history`: the model,
    the split and the training frame."""
    split = history["ds"].max() - pd.Timedelta("1D")
    train = history[history["ds"] < split]
    return build("selected", candidates=CANDIDATES, **settings).fit(train), split, train


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


def _mix(frames: dict[str, pd.DataFrame], uid: str, weights: dict[str, float]) -> np.ndarray:
    """[target, level] of the weighted sum of the candidates' forecasts of `uid`."""
    cols = [quantile_column(q) for q in LEVELS]
    return sum(
        w * frames[n].loc[frames[n]["unique_id"] == uid, cols].to_numpy()
        for n, w in weights.items()
    )


def test_offline_choice_comes_from_the_training_tail_and_serves_until_errors_are_realised(
    history: pd.DataFrame,
) -> None:
    model, split, train = fitted(
        history,
        horizons=(1, 3),
        prior="mix",
        validation=0.2,
        shrink=0.0,
        margin=0.0,
    )
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
    # an unseen series has no validation forecasts: until `minimum` of its forecasts after
    # training are realised, it gets the pooled offline choice of the candidates refitted
    # on all of `train`
    unseen = history[history["unique_id"] == series[0]].assign(unique_id="new")
    out = model.rolling(unseen, 3, split, LEVELS).frame
    refits = {n: build(n).fit(train).rolling(unseen, 3, split, LEVELS).frame for n in CANDIDATES}
    pooled = {
        q: c["weights"]
        for c in chosen
        if c["series"] == "*" and c["horizon"] == 3
        for q in [c["level"]]
    }
    early = model.online.minimum + 3  # targets whose anchor has under `minimum` realised
    for j, q in enumerate(LEVELS):
        expected = _mix(refits, "new", pooled[q])[:early, j]
        mine = out[quantile_column(q)].to_numpy()[:early]
        if q == 0.5:  # the other levels may be uncrossed around the median
            np.testing.assert_allclose(mine, expected)


def test_online_choice_is_the_best_mix_over_the_realised_window(history: pd.DataFrame) -> None:
    """Each forecast after training takes, for all series at once, the mix with the lowest
    mean over the series of its pinball over their last `window` realised forecasts
    (validation forecasts first, then the refitted candidates' forecasts of targets at or
    before the anchor) relative to the baseline's, unless it beats the prior by less than
    the margin; checked against a direct computation, anchor by anchor."""
    h, window, margin = 3, 48, 0.1
    model, split, train = fitted(
        history,
        horizons=(1, h),
        prior="persistence",
        validation=0.3,
        online_validation=0.2,
        window=window,
        online_margin=margin,
    )
    assert model.trained_until == train["ds"].max()
    out = model.rolling(history, h, split, LEVELS).frame
    refits = {n: build(n).fit(train).rolling(history, h, split, LEVELS).frame for n in CANDIDATES}
    step = pd.Timedelta("10min")
    combos = model.combos
    series = sorted(history["unique_id"].unique())
    actual = {u: history[history["unique_id"] == u].set_index("ds")["y"] for u in series}
    targets = out.loc[out["unique_id"] == series[0], "ds"].reset_index(drop=True)
    switched = 0
    expected = {u: np.empty((len(targets), len(LEVELS))) for u in series}
    for j, q in enumerate(LEVELS):
        col = quantile_column(q)
        stacks = {
            u: np.stack([f.loc[f["unique_id"] == u, col].to_numpy() for f in refits.values()], 1)
            for u in series
        }
        for i, target in enumerate(targets):
            anchor = target - h * step
            realised = (targets <= anchor).to_numpy()
            score = np.zeros(len(combos))
            for u in series:
                seed = model.seeds[(u, h, q)]
                assert len(seed.actual) == window and seed.targets.max() <= train["ds"].max()
                # validation targets at or before the anchor (the first anchors lie in the
                # training window), then the targets since (all steps observed here)
                early = seed.targets <= anchor.to_datetime64()
                y = np.concatenate(
                    [seed.actual[early], actual[u].reindex(targets[realised]).to_numpy()]
                )
                # the baseline after training: y[t-h] plus the h-step change quantile of
                # all of `train`
                own = train.loc[train["unique_id"] == u, "y"].to_numpy()
                last = actual[u].reindex(targets[realised] - h * step).to_numpy()
                base = np.concatenate(
                    [seed.baseline[early], last + np.quantile(own[h:] - own[:-h], q)]
                )
                mixes = np.vstack([seed.forecasts[early], stacks[u][realised]]) @ combos.T
                # the seed alone fills `minimum`: every series is judged here
                loss = _pinball(y[:, None], mixes, q)[-window:].sum(axis=0)
                score += loss / _pinball(y, base, q)[-window:].sum()
            best = int(np.argmin(score))
            pick = best if score[best] < (1 - margin) * score[0] else 0
            switched += pick != 0
            for u in series:
                expected[u][i, j] = stacks[u][i] @ combos[pick]
    for u in series:
        mine = out.loc[out["unique_id"] == u, [quantile_column(q) for q in LEVELS]]
        np.testing.assert_allclose(mine.to_numpy(), uncross(expected[u], np.array(LEVELS)))
    assert switched > 0  # the test saw the rule leave the prior


def _pinball(y: np.ndarray, forecast: np.ndarray, q: float) -> np.ndarray:
    diff = y - forecast
    return np.maximum(q * diff, (q - 1) * diff)


def test_online_choice_reads_nothing_past_its_anchor(history: pd.DataFrame) -> None:
    model, split, _ = fitted(
        history,
        horizons=(1, 3),
        window=48,
        online_margin=0.0,
        prior="persistence",
    )
    target = split + pd.Timedelta("12h")
    anchor = target - 3 * pd.Timedelta("10min")
    before = model.rolling(history, 3, split, LEVELS).frame
    perturbed = history.copy()
    later = perturbed["ds"] > anchor
    perturbed.loc[later, "y"] = np.random.default_rng(3).integers(0, 300, int(later.sum()))
    after = model.rolling(perturbed, 3, split, LEVELS).frame
    cols = [quantile_column(q) for q in LEVELS]
    known = before["ds"] <= target
    np.testing.assert_array_equal(before.loc[known, cols], after.loc[known, cols])
    assert not np.array_equal(before.loc[~known, cols], after.loc[~known, cols])


def test_wide_margins_keep_the_prior(history: pd.DataFrame) -> None:
    model, split, train = fitted(
        history,
        horizons=(1,),
        prior="empirical",
        margin=0.99,
        online_margin=0.99,
        window=48,
    )
    assert all(c["weights"] == {"empirical": 1.0} for c in model.selection())
    mine = model.rolling(history, 1, split, LEVELS).frame
    alone = build("empirical").fit(train).rolling(history, 1, split, LEVELS).frame
    pd.testing.assert_frame_equal(mine, alone)


def test_bad_candidates_are_input_errors() -> None:
    with pytest.raises(InputError, match="unknown model"):
        build("selected", candidates=("prophet",))
    with pytest.raises(InputError, match="own candidate"):
        build("selected", candidates=("selected",))
    with pytest.raises(InputError, match="distinct"):
        build("selected", candidates=("empirical", "empirical"))
    with pytest.raises(InputError, match="prior"):
        build("selected", candidates=CANDIDATES, prior="lightgbm")


def test_models_show_prints_the_choice_and_the_registry_keeps_the_forecasts(
    history: pd.DataFrame, tmp_path
) -> None:
    from typer.testing import CliRunner

    from predictor.data.loaders import DemandTrace
    from predictor.lifecycle.registry import ModelRegistry
    from predictor.lifecycle.training import train
    from scaler.cli import app

    split = history["ds"].max() - pd.Timedelta("1D")
    early = history[history["ds"] < split]
    source = DemandTrace.from_frame(early, kind="series", unit="gpus", split=None)
    params = {"candidates": CANDIDATES, "horizons": (1, 3), "prior": "persistence", "window": 48}
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
    assert "last 48 realised forecasts" in " ".join(result.output.split())
    plain = CliRunner().invoke(app, ["models", "show", "picked", "--registry", str(registry)])
    settings = json.loads(plain.output)["settings"]
    assert settings["candidates"] == list(CANDIDATES)
    assert settings["online"]["window"] == 48 and settings["online"]["margin"] == 0.2
    # the online state travels with the model: the same forecasts after loading
    loaded, _ = ModelRegistry(registry).load("picked")
    for h in (1, 3):
        pd.testing.assert_frame_equal(
            loaded.rolling(history, h, split, LEVELS).frame,
            trained.model.rolling(history, h, split, LEVELS).frame,
        )
