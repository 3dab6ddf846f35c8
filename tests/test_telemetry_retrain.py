"""Backtest-gated retraining from the store, and the registry commands around it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from predictor.foundation.errors import InputError
from predictor.lifecycle.registry import ModelRegistry
from predictor.models.baselines import Persistence
from predictor.models.direct import SeriesArrays
from predictor.telemetry.store import TelemetryStore
from scaler.cli import app

DAY = 144  # 10-minute steps


def random_walk(start: str, regimes: list[tuple[int, float]], seed: int) -> pd.DataFrame:
    """GPU demand of one pool: a random walk whose step size changes by regime
    ((days, standard deviation of a 10-minute change) each)."""
    rng = np.random.default_rng(seed)
    changes = np.concatenate([rng.normal(0, sd, days * DAY) for days, sd in regimes])
    y = np.round(500 + np.cumsum(changes), 1)
    ds = pd.date_range(start, periods=y.size, freq="10min")
    return pd.DataFrame({"unique_id": "pool-a", "ds": ds, "y": y})


def store_with(path: Path, frame: pd.DataFrame) -> Path:
    TelemetryStore(path).append(frame, metric="gpu_demand", source="test")
    return path


def run(*args: str) -> dict:
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def retrain(state: Path, registry: Path) -> dict:
    return run(
        "retrain",
        "--state-dir",
        str(state),
        "--registry",
        str(registry),
        "--model",
        "empirical",
        "--backtest-steps",
        str(DAY),
    )


def test_a_better_candidate_is_promoted(tmp_path: Path) -> None:
    registry = tmp_path / "models"
    calm = store_with(tmp_path / "calm", random_walk("2026-01-01", [(4, 1.0)], seed=1))
    first = retrain(calm, registry)
    assert first["promoted"] and first["reason"] == "no model was served"
    assert first["stored_as"] == "gpuscale:1" and first["served"] is None

    # The cluster got busier: 10x larger moves. A candidate that learned them wins.
    busy = store_with(tmp_path / "busy", random_walk("2026-01-05", [(5, 10.0)], seed=2))
    second = retrain(busy, registry)
    assert second["promoted"], second["reason"]
    assert second["stored_as"] == "gpuscale:2"
    assert second["served"]["version"] == 1
    assert second["served"]["refitted"] is False  # version 1 was fitted before this window
    assert second["candidate"]["value"] < second["served"]["value"]
    assert second["candidate"]["steps"] == {"1": DAY, "3": DAY, "18": DAY}
    meta = ModelRegistry(registry).record("gpuscale").metadata
    assert meta["previous"] == 1
    assert meta["backtest"]["score"] == "pinball_q0.99"  # the planner's base quantile
    assert meta["backtest"]["served"]["value"] == second["served"]["value"]
    assert meta["training_window"][1] < meta["backtest"]["window"][0]


def test_a_worse_candidate_keeps_the_served_model(tmp_path: Path) -> None:
    registry = tmp_path / "models"
    busy = store_with(tmp_path / "busy", random_walk("2026-01-01", [(4, 10.0)], seed=3))
    assert retrain(busy, registry)["stored_as"] == "gpuscale:1"

    # Four calm days, then the busy regime returns in the window: a candidate fitted on
    # the calm days under-covers it; the served model does not.
    mixed = random_walk("2026-01-05", [(4, 1.0), (1, 10.0)], seed=4)
    outcome = retrain(store_with(tmp_path / "mixed", mixed), registry)
    assert not outcome["promoted"], outcome["reason"]
    assert outcome["stored_as"] == "gpuscale.rejected:1"
    assert outcome["candidate"]["value"] > outcome["served"]["value"]
    reg = ModelRegistry(registry)
    assert [r.version for r in reg.versions("gpuscale")] == [1]
    assert reg.record("gpuscale.rejected").metadata["decision"]["promoted"] is False

    listing = run("models", "list", "--registry", str(registry))
    assert [(r["name"], r["version"], r["serving"]) for r in listing] == [
        ("gpuscale", 1, True),
        ("gpuscale.rejected", 1, False),
    ]

    # An operator overrides the gate, then thinks better of it.
    promoted = run("models", "promote", "gpuscale.rejected:1", "--registry", str(registry))
    assert promoted["serving"] == "gpuscale:2"
    assert reg.record("gpuscale").metadata["copied_from"] == "gpuscale.rejected:1"
    back = run("models", "rollback", "gpuscale", "--registry", str(registry))
    assert back["serving"] == "gpuscale:3"
    restored = reg.record("gpuscale", 3).metadata
    assert restored["copied_from"] == "gpuscale:1"
    assert restored["backtest"] == reg.record("gpuscale", 1).metadata["backtest"]
    model_1, _ = reg.load("gpuscale", 1)
    model_3, _ = reg.load("gpuscale", 3)
    history = mixed.iloc[:300]
    pd.testing.assert_frame_equal(
        model_1.forecast(history, [1, 3], [0.99]).frame,
        model_3.forecast(history, [1, 3], [0.99]).frame,
    )
    # Nothing was served before version 1: no further rollback.
    result = CliRunner().invoke(
        app, ["models", "rollback", "gpuscale", "--registry", str(registry)]
    )
    assert result.exit_code != 0

    shown = CliRunner().invoke(app, ["models", "show", "gpuscale:2", "--registry", str(registry)])
    assert shown.exit_code == 0
    assert json.loads(shown.output)["decision"]["by"] == "promote"


def test_a_served_model_trained_into_the_window_is_judged_by_its_recipe(tmp_path: Path) -> None:
    """`train` fits on the whole history; a retrain straight after must not score that model
    on steps it was trained on. Its recipe is refitted before the window instead, so the
    same recipe on both sides ties (and a tie keeps the served model)."""
    registry = tmp_path / "models"
    state = store_with(tmp_path / "state", random_walk("2026-01-01", [(4, 3.0)], seed=7))
    trained = run(
        *("train", "--state-dir", str(state), "--registry", str(registry)),
        *("--model", "empirical", "--name", "gpuscale"),
    )
    assert trained["training_window"][1] >= "2026-01-04 23:50"
    outcome = retrain(state, registry)
    assert outcome["served"]["refitted"] is True
    assert outcome["served"]["value"] == outcome["candidate"]["value"]
    assert not outcome["promoted"]
    assert "recipe refitted before the window" in outcome["reason"]
    meta = ModelRegistry(registry).record("gpuscale.rejected").metadata
    assert meta["backtest"]["served"]["refitted"] is True


def test_retrain_needs_history_before_the_window(tmp_path: Path) -> None:
    state = store_with(tmp_path / "short", random_walk("2026-01-01", [(1, 1.0)], seed=5))
    result = CliRunner().invoke(
        app,
        [
            "retrain",
            "--state-dir",
            str(state),
            "--registry",
            str(tmp_path / "m"),
            "--backtest-steps",
            str(2 * DAY),
        ],
    )
    assert result.exit_code != 0
    assert not (tmp_path / "m").exists() or not ModelRegistry(tmp_path / "m").names()


class Outdated:
    """Stands for an artifact that the current code can no longer run."""

    name = "outdated"

    def rolling(self, *args: object, **kwargs: object) -> None:
        raise AttributeError("'ConformalBoost' object has no attribute 'gain'")


def test_a_served_model_that_cannot_run_is_replaced(tmp_path: Path) -> None:
    registry = ModelRegistry(tmp_path / "models")
    registry.save("gpuscale", Outdated(), {"model": "outdated"})  # type: ignore[arg-type]
    state = store_with(tmp_path / "state", random_walk("2026-01-01", [(3, 2.0)], seed=6))
    outcome = retrain(state, registry.root)
    assert outcome["promoted"] and outcome["stored_as"] == "gpuscale:2"
    assert "could not be backtested (AttributeError" in outcome["reason"]
    assert registry.record("gpuscale").metadata["previous"] == 1


def test_a_retrain_overtaken_by_another_does_not_land_over_it(tmp_path: Path) -> None:
    """Two nightly retrains overlap: both judge their candidate against version 1, the
    first promotes version 2, the second must not replace version 2 (never compared with
    it) nor record version 1 as what it displaced."""
    from predictor.lifecycle.retraining import RetrainPlan
    from predictor.lifecycle.retraining import retrain as run_retrain
    from predictor.models import build

    registry = ModelRegistry(tmp_path / "models")
    old = random_walk("2025-12-01", [(2, 2.0)], seed=0)
    registry.save("gpuscale", build("persistence").fit(old), {"model": "persistence"})
    state = store_with(tmp_path / "state", random_walk("2026-01-01", [(4, 2.0)], seed=1))
    plan = RetrainPlan(model="empirical", backtest_steps=DAY)
    overtaking = []

    def meanwhile(what: str) -> None:
        if what == "backtesting the candidate" and not overtaking:
            overtaking.append(run_retrain(TelemetryStore(state), registry, plan))

    late = run_retrain(TelemetryStore(state), registry, plan, on_step=meanwhile)
    assert overtaking[0].promoted and overtaking[0].record.version == 2
    assert not late.promoted
    assert late.record.name == "gpuscale.rejected"
    assert "gpuscale:2 was saved while this retrain ran" in late.reason
    assert late.record.metadata["decision"] == {
        "promoted": False,
        "reason": late.reason,
        "by": "retrain",
    }
    assert "previous" not in late.record.metadata
    assert [(r.version, r.metadata.get("previous")) for r in registry.versions("gpuscale")] == [
        (1, None),
        (2, 1),
    ]


class Diverged(Persistence):
    """Stands for a model whose forecasts went NaN on one series (a diverged net, a
    feature broken by a gap)."""

    name = "diverged"

    def _quantiles(
        self, s: SeriesArrays, anchors: np.ndarray, horizon: int, levels: np.ndarray
    ) -> np.ndarray:
        out = super()._quantiles(s, anchors, horizon, levels)
        return out * np.nan if s.unique_id == "pool-b" else out


def two_pools(days: int) -> pd.DataFrame:
    a = random_walk("2026-01-01", [(days, 2.0)], seed=8)
    return pd.concat([a, a.assign(unique_id="pool-b", y=a["y"] + 5)], ignore_index=True)


def test_a_served_model_forecasting_nan_is_replaced(tmp_path: Path) -> None:
    """Its mean pinball was NaN, `candidate < NaN` is false: it served forever."""
    registry = ModelRegistry(tmp_path / "models")
    registry.save("gpuscale", Diverged(), {"model": "diverged"})
    state = store_with(tmp_path / "state", two_pools(3))
    outcome = retrain(state, registry.root)
    assert outcome["promoted"] and outcome["stored_as"] == "gpuscale:2", outcome["reason"]
    assert "no finite q0.99 forecast at horizon 1 on 144 of 288 steps" in outcome["reason"]
    assert "(series pool-b)" in outcome["reason"]


def test_a_candidate_forecasting_nan_is_never_stored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With nothing served (or a served model that cannot run) a NaN candidate was promoted."""
    import predictor.lifecycle.retraining as retraining

    monkeypatch.setattr(retraining, "build", lambda name, **params: Diverged())
    state = store_with(tmp_path / "state", two_pools(3))
    registry = ModelRegistry(tmp_path / "models")
    plan = retraining.RetrainPlan(model="empirical", backtest_steps=DAY)
    with pytest.raises(InputError, match="the candidate cannot be judged, nothing was stored"):
        retraining.retrain(TelemetryStore(state), registry, plan)
    assert registry.names() == []


def test_models_list_refuses_a_registry_that_is_not_there(tmp_path: Path) -> None:
    from predictor.foundation.errors import InputError

    result = CliRunner().invoke(app, ["models", "list", "--registry", str(tmp_path / "modles")])
    assert isinstance(result.exception, InputError)
    assert result.exception.path == str(tmp_path / "modles")
    assert run("models", "list", "--registry", str(tmp_path)) == []  # there, but empty


def test_models_list_shows_a_damaged_version_and_show_refuses_it(tmp_path: Path) -> None:
    from predictor.foundation.errors import InputError
    from predictor.models import build

    registry = ModelRegistry(tmp_path)
    registry.save("gpuscale", build("persistence"), {"model": "persistence"})
    (tmp_path / "gpuscale" / "2").mkdir()  # an interrupted copy: no metadata.json
    rows = run("models", "list", "--registry", str(tmp_path))
    assert [(r["version"], r["serving"]) for r in rows] == [(1, False), (2, False)]
    assert rows[0]["damaged"] is None
    assert "gpuscale/2/metadata.json: missing" in rows[1]["damaged"]
    result = CliRunner().invoke(app, ["models", "show", "gpuscale:2", "--registry", str(tmp_path)])
    assert isinstance(result.exception, InputError)
    assert result.exception.path == str(tmp_path / "gpuscale" / "2" / "metadata.json")


def test_rollback_undoes_a_train_and_rejected_names_never_serve(tmp_path: Path) -> None:
    from predictor.foundation.errors import InputError

    state = store_with(tmp_path / "state", random_walk("2026-01-01", [(3, 1.0)], seed=7))
    registry = tmp_path / "models"
    for kind in ("persistence", "empirical"):
        run("train", "--state-dir", str(state), "--registry", str(registry),
            "--model", kind, "--name", "p")  # fmt: skip
    assert ModelRegistry(registry).record("p", 2).metadata["previous"] == 1
    back = run("models", "rollback", "p", "--registry", str(registry))
    assert back["serving"] == "p:3" and "to version 1" in back["reason"]
    restored = ModelRegistry(registry).record("p").metadata
    assert restored["model"] == "persistence" and restored["copied_from"] == "p:1"

    for args in (["promote", "p:1", "--to", "p.rejected"], ["rollback", "p.rejected"]):
        result = CliRunner().invoke(app, ["models", *args, "--registry", str(registry)])
        assert isinstance(result.exception, InputError), result.output
        assert "never serve" in str(result.exception)
    assert [r.version for r in ModelRegistry(registry).versions("p")] == [1, 2, 3]
    assert not (registry / "p.rejected").exists()


def test_retrain_refuses_a_step_that_is_not_positive(tmp_path: Path) -> None:
    from predictor.foundation.errors import InputError
    from predictor.lifecycle.retraining import RetrainPlan

    state = store_with(tmp_path / "state", random_walk("2026-01-01", [(2, 1.0)], seed=8))
    for step in ("0s", "-10min"):
        result = CliRunner().invoke(
            app,
            ["retrain", "--state-dir", str(state), "--registry", str(tmp_path / "m"),
             "--step", step],
        )  # fmt: skip
        assert result.exit_code == 2 and "must be positive" in result.output, result.output
    assert not (tmp_path / "m").exists()
    with pytest.raises(InputError, match="step must be positive"):
        RetrainPlan(step=pd.Timedelta(0))


def test_retrain_without_a_store_says_so_and_makes_none(tmp_path: Path) -> None:
    from predictor.foundation.errors import InputError

    result = CliRunner().invoke(
        app, ["retrain", "--state-dir", str(tmp_path), "--registry", str(tmp_path / "m")]
    )
    assert isinstance(result.exception, InputError)
    assert "no telemetry store here" in str(result.exception)
    assert list(tmp_path.iterdir()) == []
