"""The model registry: round trip, versions, metadata, and nothing half-written."""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from predictor.data.loaders import load_trace
from predictor.foundation.errors import InputError
from predictor.lifecycle.registry import (
    DamagedVersion,
    ModelRegistry,
    Superseded,
    parse_reference,
)
from predictor.models import BoostParams, build


@pytest.fixture(scope="module")
def history(traces_dir: Path) -> pd.DataFrame:
    trace = load_trace(f"helios-vc:{traces_dir / 'helios-earth' / 'vcMod.csv.gz'}").resampled()
    return trace.frame[trace.frame["ds"] < pd.Timestamp("2020-05-06")]


def test_round_trip_gives_the_same_forecasts(tmp_path: Path, history: pd.DataFrame) -> None:
    model = build("gpuscale", horizons=(1, 3), params=BoostParams(n_estimators=20)).fit(
        history[history["ds"] < pd.Timestamp("2020-05-05")]
    )
    registry = ModelRegistry(tmp_path / "models")
    first = registry.save("gpuscale", model, {"model": "gpuscale", "horizons": [1, 3]})
    second = registry.save("gpuscale", model, {"model": "gpuscale"})
    assert (first.version, second.version) == (1, 2)
    assert [r.version for r in registry.versions("gpuscale")] == [1, 2]
    assert registry.names() == ["gpuscale"]

    loaded, record = registry.load("gpuscale")  # latest by default
    assert record.version == 2
    again, _ = registry.load("gpuscale", 1)
    start = pd.Timestamp("2020-05-05")
    expected = model.rolling(history, 3, start, (0.5, 0.9, 0.99)).frame
    for other in (loaded, again):
        got = other.rolling(history, 3, start, (0.5, 0.9, 0.99)).frame
        pd.testing.assert_frame_equal(got, expected)

    meta = json.loads((first.path / "metadata.json").read_text())
    assert meta["name"] == "gpuscale" and meta["version"] == 1 and meta["horizons"] == [1, 3]
    assert set(meta["libraries"]) >= {"python", "lightgbm", "torch", "pandas", "numpy", "gpuscale"}
    assert meta["artifact"]["format"] == "pickle" and len(meta["artifact"]["sha256"]) == 64
    # no staging folders left behind
    assert sorted(p.name for p in (tmp_path / "models" / "gpuscale").iterdir()) == ["1", "2"]


def test_damaged_artifacts_and_bad_names_are_refused(tmp_path: Path, history: pd.DataFrame) -> None:
    registry = ModelRegistry(tmp_path)
    record = registry.save("persistence", build("persistence").fit(history), {})
    artifact = record.path / "model.pkl"
    artifact.write_bytes(artifact.read_bytes()[:-3])
    with pytest.raises(InputError, match="checksum"):
        registry.load("persistence")
    with pytest.raises(InputError, match="no version 7"):
        registry.load("persistence", 7)
    with pytest.raises(InputError, match="no model named"):
        registry.load("missing")
    for bad in ("../escape", "", "a b", ".hidden"):
        with pytest.raises(InputError):
            registry.save(bad, build("persistence"), {})
    assert parse_reference("gpuscale:3") == ("gpuscale", 3)
    assert parse_reference("gpuscale") == ("gpuscale", None)
    with pytest.raises(InputError):
        parse_reference("gpuscale:latest")


def test_a_half_written_version_is_invisible(tmp_path: Path, history: pd.DataFrame) -> None:
    """A crash between staging and rename leaves a .tmp- folder that no reader lists."""
    registry = ModelRegistry(tmp_path)
    registry.save("persistence", build("persistence").fit(history), {})
    staging = tmp_path / "persistence" / ".tmp-crashed"
    staging.mkdir()
    (staging / "model.pkl").write_bytes(b"partial")
    assert [r.version for r in registry.versions("persistence")] == [1]
    model, _ = registry.load("persistence")
    out = model.forecast(history, [1], (0.5,)).frame
    assert np.isfinite(out["q0.5"]).all()
    assert registry.save("persistence", model, {}).version == 2


def test_a_save_after_a_version_is_refused_once_another_landed(
    tmp_path: Path, history: pd.DataFrame
) -> None:
    """A writer that read version 1 as served (a retrain, a promote) must not land over a
    version 2 saved meanwhile: it was never judged against it."""
    registry = ModelRegistry(tmp_path)
    model = build("persistence").fit(history)
    assert registry.save("p", model, {}, after=None).version == 1
    assert registry.save("p", model, {}, after=1).version == 2
    for stale in (None, 1):
        with pytest.raises(Superseded, match="p:2 was saved while this ran"):
            registry.save("p", model, {}, after=stale)
    assert [r.version for r in registry.versions("p")] == [1, 2]
    assert not list((tmp_path / "p").glob(".tmp-*"))  # the refused staging is gone
    assert registry.save("p", model, {}).version == 3  # no expectation: the next number


def _save_within(registry: ModelRegistry, name: str, model: object, seconds: float) -> int:
    """The version `save` stores, or a failure if it does not return in time (the save of
    a registry with a version folder lacking its metadata used to loop forever)."""
    saved: list[int] = []
    worker = threading.Thread(
        target=lambda: saved.append(registry.save(name, model, {}).version),  # type: ignore[arg-type]
        daemon=True,
    )
    worker.start()
    worker.join(seconds)
    assert saved, f"save did not return within {seconds} s"
    return saved[0]


def test_an_interrupted_copy_is_damaged_never_reused_and_never_served(
    tmp_path: Path, history: pd.DataFrame
) -> None:
    registry = ModelRegistry(tmp_path)
    model = build("persistence").fit(history)
    first = registry.save("persistence", model, {})
    copied = tmp_path / "persistence" / "2"
    copied.mkdir()
    (copied / "model.pkl").write_bytes((first.path / "model.pkl").read_bytes())

    assert _save_within(registry, "persistence", model, 30) == 3
    assert sorted(p.name for p in (tmp_path / "persistence").iterdir()) == ["1", "2", "3"]
    assert [v.version for v in registry.versions("persistence")] == [1, 3]
    damaged = [v for v in registry.scan("persistence") if isinstance(v, DamagedVersion)]
    assert [(d.version, d.file) for d in damaged] == [(2, copied / "metadata.json")]
    with pytest.raises(InputError, match="persistence:2 is damaged") as caught:
        registry.load("persistence", 2)
    assert caught.value.path == str(copied / "metadata.json")

    # While the damaged folder is the newest, the name serves nothing, rather than
    # silently serving the version before it.
    shutil.rmtree(tmp_path / "persistence" / "3")
    with pytest.raises(InputError, match="persistence:2 is damaged"):
        registry.served("persistence")
    with pytest.raises(InputError, match="persistence:2 is damaged"):
        registry.load("persistence")
    assert registry.load("persistence", 1)[1].version == 1


@pytest.mark.parametrize(
    ("damage", "file", "reason"),
    [
        (lambda v: (v / "metadata.json").write_text("{bad"), "metadata.json", "not valid JSON"),
        (lambda v: (v / "metadata.json").write_text("[1]"), "metadata.json", "not a JSON object"),
        (lambda v: (v / "model.pkl").unlink(), "model.pkl", "missing"),
    ],
)
def test_a_damaged_version_is_refused_naming_its_file(
    tmp_path: Path, history: pd.DataFrame, damage: Callable[[Path], object], file: str, reason: str
) -> None:
    registry = ModelRegistry(tmp_path)
    record = registry.save("persistence", build("persistence").fit(history), {})
    damage(record.path)
    assert registry.names() == ["persistence"]  # still listed, as damaged
    assert registry.versions("persistence") == []
    for read in (registry.load, registry.record, registry.served):
        with pytest.raises(InputError, match=reason) as caught:
            read("persistence")
        assert caught.value.path == str(record.path / file)
