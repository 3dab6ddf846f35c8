"""`gpuscale train`, `forecast` and `bench forecast` end to end on a slice of a real trace."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from scaler.cli import app

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()


def gpuscale(*args: str) -> subprocess.CompletedProcess[str]:
    """The real console entry point (with its InputError -> exit 2 handling)."""
    return subprocess.run(
        [sys.executable, "-m", "scaler", *args], capture_output=True, text=True, cwd=REPO
    )


@pytest.fixture(scope="module")
def vc_slice(traces_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The first five days of a Helios VC, in the Helios file format (in a temp dir)."""
    frame = pd.read_csv(traces_dir / "helios-earth" / "vcTJs.csv.gz", nrows=5 * 1440)
    path = tmp_path_factory.mktemp("trace") / "vcTJs.csv.gz"
    with gzip.open(path, "wt") as handle:
        frame.to_csv(handle, index=False)
    return path


def test_train_then_forecast_with_table_json_and_picture(vc_slice: Path, tmp_path: Path) -> None:
    registry = tmp_path / "models"
    spec = f"helios-vc:{vc_slice}"
    result = runner.invoke(app, ["train", "--trace", spec, "--registry", str(registry), "--json"])
    assert result.exit_code == 0, result.output
    meta = json.loads(result.output)
    assert (meta["name"], meta["version"], meta["model"]) == ("gpuscale", 1, "gpuscale")
    assert meta["series"] == ["vcTJs"] and meta["quantiles"] == [0.5, 0.9, 0.99]
    assert {r["horizon_min"] for r in meta["backtest"]["rows"]} == {10, 30, 180}
    assert "running_headroom" in meta["features"] and "lightgbm" in meta["libraries"]

    plot = tmp_path / "out" / "forecast.png"
    result = runner.invoke(
        app,
        ["forecast", "--model", "gpuscale:1", "--trace", spec, "--registry", str(registry),
         "--horizon", "1", "--horizon", "6", "--json", "--plot", str(plot)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["version"] == 1
    assert [(f["series"], f["horizon"]) for f in out["forecasts"]] == [("vcTJs", 1), ("vcTJs", 6)]
    for f in out["forecasts"]:
        assert f["q0.5"] <= f["q0.9"] <= f["q0.99"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in plot.parent.iterdir()) == ["forecast.png"]

    table = runner.invoke(app, ["forecast", "--trace", spec, "--registry", str(registry)])
    assert table.exit_code == 0 and "vcTJs" in table.output


def test_bench_forecast_writes_the_contract_rows(vc_slice: Path, tmp_path: Path) -> None:
    out = tmp_path / "fc.json"
    result = runner.invoke(
        app,
        ["bench", "forecast", "--trace", f"helios-vc:{vc_slice}", "--split", "2020-05-04",
         "--models", "gpuscale", "--models", "persistence", "--models", "empirical",
         "--json", str(out)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    document = json.loads(out.read_text())
    assert document["suite"] == "forecast"
    assert len(document["rows"]) == 3 * 3
    assert {r["model"] for r in document["rows"]} == {"gpuscale", "persistence", "empirical"}
    assert [s["horizon_min"] for s in document["summary"]] == [10, 30, 180]
    assert "against the targets" in result.output


def test_bad_input_exits_2_and_writes_nothing(vc_slice: Path, tmp_path: Path) -> None:
    registry = tmp_path / "models"
    cases = [
        ["train", "--trace", f"helios-vc:{tmp_path / 'missing.csv'}"],
        ["train", "--trace", "nonsense"],
        ["train", "--trace", f"helios-vc:{vc_slice}", "--model", "prophet"],
        ["train", "--trace", f"helios-vc:{vc_slice}", "--state-dir", str(tmp_path)],
        ["train", "--state-dir", str(tmp_path / "nostore")],
        ["train", "--trace", f"helios-vc:{vc_slice}", "--name", "../x"],
        ["forecast", "--model", "gpuscale", "--trace", f"helios-vc:{vc_slice}"],
    ]
    for args in cases:
        done = gpuscale(*args, "--registry", str(registry))
        assert done.returncode == 2, (args, done.stderr)
        assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, done.stderr
    assert not registry.exists()
    assert not (tmp_path / "nostore").exists()


def test_train_from_the_telemetry_store(vc_slice: Path, tmp_path: Path) -> None:
    from predictor.data.loaders import load_trace
    from predictor.telemetry.store import TelemetryStore

    state = tmp_path / "state"
    TelemetryStore(state).import_traces([load_trace(f"helios-vc:{vc_slice}")])
    registry = tmp_path / "models"
    result = runner.invoke(
        app,
        ["train", "--state-dir", str(state), "--model", "lightgbm", "--name", "store-model",
         "--registry", str(registry), "--json"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    meta = json.loads(result.output)
    assert meta["name"] == "store-model" and meta["series"] == ["vcTJs"]
    assert "pending" in meta["features"]  # exogenous metrics joined from the store
    assert meta["backtest"]["test_windows"][0][0].startswith("2020-05-04")


def _walk_file(folder: Path, steps: int) -> Path:
    """A `series` trace of an integer random walk on 10-minute steps."""
    ds = pd.date_range("2024-01-01", periods=steps, freq="10min")
    moves = np.random.default_rng(1).integers(-1, 2, steps)
    path = folder / f"walk{steps}.csv"
    frame = pd.DataFrame({"timestamp": ds.strftime("%Y-%m-%dT%H:%M"), "value": 40 + moves.cumsum()})
    frame.to_csv(path, index=False)
    return path


def _one_error_line(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, done.stderr
    return done.stderr.strip()


@pytest.mark.parametrize(("steps", "split"), [(4, None), (8, None), (300, "2024-01-01T02:00")])
def test_train_on_too_few_rows_says_the_minimum_in_one_line(
    tmp_path: Path, steps: int, split: str | None
) -> None:
    """4 or 8 rows, or an early --split, left some horizon a row or none, and LightGBM
    ended in a fatal log line and a traceback (exit 1): now the model's own minimum."""
    registry = tmp_path / "models"
    trace = f"series:{_walk_file(tmp_path, steps)}"
    args = ["train", "--trace", trace, "--registry", str(registry)]
    message = _one_error_line(gpuscale(*args, *(["--split", split] if split else [])))
    before = {4: "00:20", 8: "00:50", 300: "02:00"}[steps]
    held = {4: 2, 8: 5, 300: 12}[steps]
    assert message == (
        f"error: backtest fit on the history before 2024-01-01 {before}:00 (the test start, see"
        " --split): history is too short to train the 72-step horizon: a series needs at least"
        f" 98 steps of 10 min, the longest has {held} (training rows for that horizon: 0, at"
        " least 2 needed)"
    )
    assert not registry.exists()


@pytest.fixture(scope="module")
def walk_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(trace, registry) of the default model trained on 300 steps: horizons up to 72."""
    folder = tmp_path_factory.mktemp("walk")
    trace, registry = _walk_file(folder, 300), folder / "models"
    result = runner.invoke(
        app, ["train", "--trace", f"series:{trace}", "--registry", str(registry), "--json"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["horizons"][-1] == 72
    return trace, registry


def _forecast(walk_model: tuple[Path, Path], *args: str) -> subprocess.CompletedProcess[str]:
    trace, registry = walk_model
    return gpuscale("forecast", "--trace", f"series:{trace}", "--registry", str(registry), *args)


def test_a_horizon_beyond_the_trained_ones_is_refused_unless_extended(
    walk_model: tuple[Path, Path],
) -> None:
    """It printed an extrapolated number at 1008 steps, exit 0, without a word."""
    assert _one_error_line(_forecast(walk_model, "--horizon", "1008")) == (
        "error: gpuscale v1 was trained for horizons up to 72 steps, not 1008"
        " (--extend-horizon extrapolates them, with a warning)"
    )
    trained = _forecast(walk_model, "--horizon", "72", "--json")
    assert trained.returncode == 0 and trained.stderr == "", trained.stderr
    extended = _forecast(walk_model, "--horizon", "6", "--horizon", "1008", "--extend-horizon",
                         "--json")  # fmt: skip
    assert extended.returncode == 0, extended.stderr
    assert extended.stderr == (
        "warning: gpuscale v1 was trained for horizons up to 72 steps, not 1008:"
        " extrapolated from 72 steps (--extend-horizon)\n"
    )
    horizons = [f["horizon"] for f in json.loads(extended.stdout)["forecasts"]]
    assert horizons == [6, 1008]


@pytest.mark.parametrize("horizon", ["2000", "0"])
def test_a_horizon_off_the_range_is_one_line(walk_model: tuple[Path, Path], horizon: str) -> None:
    """--horizon 2000 printed typer's five-line usage box; the week's cap stays, with
    --extend-horizon too (a trillion steps allocated its arrays first)."""
    for extend in ([], ["--extend-horizon"]):
        assert _one_error_line(_forecast(walk_model, "--horizon", horizon, *extend)) == (
            f"error: --horizon must be 1 to 1008 steps of 10 min (a week), got {horizon}"
        )
