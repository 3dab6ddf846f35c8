"""`gpuscale generate` and `gpuscale store import | show`, end to end."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from predictor.data.loaders import load_trace
from predictor.foundation.errors import InputError
from predictor.telemetry.store import TelemetryStore
from scaler.cli import app

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()


def gpuscale(*args: str) -> subprocess.CompletedProcess[str]:
    """The real console entry point (with its InputError -> exit 2 handling)."""
    return subprocess.run(
        [sys.executable, "-m", "scaler", *args], capture_output=True, text=True, cwd=REPO
    )


def test_generate_writes_files_that_load_back(tmp_path: Path) -> None:
    out = tmp_path / "gen"
    result = runner.invoke(
        app, ["generate", "--out", str(out), "--seed", "5", "--days", "3", "--json"]
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["files"] == ["demand.csv", "jobs.csv", "pools.yaml"]
    assert sorted(p.name for p in out.iterdir()) == summary["files"]  # no temporary leftovers
    trace = load_trace(f"series:{out / 'demand.csv'}", unit="gpus")
    assert trace.series_ids == ["a100", "h100", "t4"]
    assert len(trace.frame) == 3 * 3 * 1440
    assert (
        summary["pools"]["a100"]["max_gpus"] == trace.frame.query("unique_id == 'a100'")["y"].max()
    )
    pools = yaml.safe_load((out / "pools.yaml").read_text())["pools"]
    assert [p["name"] for p in pools] == ["a100", "h100", "t4"]
    scaler_pools = pytest.importorskip("scaler.cluster.pools")
    assert [p.gpus_per_node for p in scaler_pools.load_pools(out / "pools.yaml")] == [8, 8, 4]
    # the same seed writes the same bytes
    again = tmp_path / "again"
    runner.invoke(app, ["generate", "--out", str(again), "--seed", "5", "--days", "3"])
    for name in summary["files"]:
        assert (again / name).read_bytes() == (out / name).read_bytes()


def test_store_import_and_show(traces_dir: Path, tmp_path: Path) -> None:
    with gzip.open(traces_dir / "helios-earth" / "vcTJs.csv.gz", "rt") as source:
        lines = [next(source) for _ in range(1441)]
    helios = tmp_path / "vcTJs.csv"
    helios.write_text("".join(lines))
    state = tmp_path / "state"
    args = ["store", "import", "--state-dir", str(state), "--trace", f"helios-vc:{helios}"]
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["points"] == 4 * 144
    assert runner.invoke(app, args).exit_code == 0  # again: nothing duplicated
    assert TelemetryStore(state).count() == 144
    shown = runner.invoke(app, ["store", "show", "--state-dir", str(state), "--json"])
    series = json.loads(shown.output)["series"]
    demand = next(s for s in series if s["metric"] == "gpu_demand")
    assert demand["series"] == "vcTJs" and demand["points"] == 144
    assert demand["labels"]["unit"] == "gpus" and demand["last"] == "2020-05-01T23:50:00"
    table = runner.invoke(app, ["store", "show", "--state-dir", str(state)])
    assert table.exit_code == 0 and "vcTJs" in table.output


def test_bad_trace_writes_nothing(tmp_path: Path) -> None:
    good = tmp_path / "good.csv"
    good.write_text("timestamp,value\n2024-01-01T00:00,1\n2024-01-01T00:10,2\n")
    bad = tmp_path / "bad.csv"
    bad.write_text("timestamp,value\n2024-01-01T00:00,1\n2024-01-01T00:10,-2\n")
    state = tmp_path / "state"
    args = ["store", "import", "--state-dir", str(state), "--trace", f"series:{good}"]
    result = runner.invoke(app, [*args, "--trace", f"series:{bad}"])
    assert isinstance(result.exception, InputError)
    assert not state.exists() or TelemetryStore(state).count() == 0
    # through the console entry point: one line on stderr, exit code 2
    process = gpuscale(*args, "--trace", f"series:{bad}")
    assert process.returncode == 2
    assert (
        process.stderr.strip()
        == f"error: {bad}:3, column 'value': value '-2' is below the minimum 0"
    )
    assert not state.exists() or TelemetryStore(state).count() == 0


def test_bad_options(tmp_path: Path) -> None:
    result = runner.invoke(
        app, ["store", "import", "--state-dir", str(tmp_path), "--trace", "x:y", "--step", "soon"]
    )
    assert result.exit_code == 2 and "--step" in result.output
    result = runner.invoke(app, ["store", "show", "--state-dir", str(tmp_path / "absent")])
    assert isinstance(result.exception, InputError)
    assert "no telemetry store here" in str(result.exception)
    config = tmp_path / "bad.yaml"
    config.write_text("start: 2024-01-01\ndays: -1\npools: []\nstreams: []\n")
    result = runner.invoke(app, ["generate", "--out", str(tmp_path), "--config", str(config)])
    assert isinstance(result.exception, InputError) and result.exception.column == "days"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--days", "0.0001"], "--days 0.0001: input should be greater than or equal to"),
        (["--days", "nan"], "--days nan: input should be a finite number"),
        (["--days", "inf"], "--days inf: input should be a finite number"),
        (["--days", "1e9"], "--days 1e+09: input should be less than or equal to 365"),
        (["--seed", "-1"], "Invalid value for '--seed'"),
    ],
)
def test_generate_refuses_a_span_or_seed_out_of_range_and_writes_nothing(
    tmp_path: Path, options: list[str], message: str
) -> None:
    """The config's own bounds on `days` hold for --days too (0.0001 wrote header-only files
    and then failed; 1e9 asked for a 10 TiB array); a negative seed was numpy's traceback."""
    out = tmp_path / "gen"
    result = runner.invoke(app, ["generate", "--out", str(out), *options], env={"COLUMNS": "200"})
    if isinstance(result.exception, InputError):  # main() makes it one line and exit 2
        refused = str(result.exception)
    else:
        assert result.exit_code == 2, result.output
        refused = result.output
    assert message in refused
    assert not out.exists()
