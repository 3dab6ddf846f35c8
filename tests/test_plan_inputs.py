"""`gpuscale plan` refuses a bad forecast file or option by name (file, line, column or
option) before it plans, and reads quantile columns by their level's value."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from predictor.foundation.errors import InputError
from scaler.cli import app

POOLS = (
    "pools:\n"
    "  - {name: a100, gpu_model: A100, gpus_per_node: 8, price_per_hour: 32, max_size: 20}\n"
    "  - {name: t4, gpu_model: T4, gpus_per_node: 4, price_per_hour: 4, max_size: 20}\n"
)
GOOD = "unique_id,horizon,q0.5,q0.99\na100,1,10,20\na100,2,10,30\n"


def plan(tmp_path: Path, forecast: str, *options: str) -> tuple[int, str]:
    """Exit code and message as the console entry point gives them (an InputError is one
    line and exit 2 there)."""
    (tmp_path / "pools.yaml").write_text(POOLS)
    (tmp_path / "f.csv").write_text(forecast)
    args = ["plan", "--pools", str(tmp_path / "pools.yaml"), "--forecast", str(tmp_path / "f.csv")]
    result = CliRunner().invoke(app, [*args, "--observed", "a100=10", *options, "--json"])
    if isinstance(result.exception, InputError):
        return 2, str(result.exception)
    return result.exit_code, result.output


@pytest.mark.parametrize(
    ("forecast", "where"),
    [
        ("", "f.csv:1: empty file"),
        ("unique_id,horizon,q0.5,q0.99\n", "f.csv:2: no data rows"),
        ("unique_id,horizon,q0.5,q0.99\na100,abc,1,2\n", "f.csv:2, column 'horizon': not a number"),
        (
            "unique_id,horizon,q0.5,q0.99\na100,1,1,2\na100,,1,2\n",
            "f.csv:3, column 'horizon': missing value",
        ),
        (
            "unique_id,horizon,q0.5,q0.99\na100,1.5,1,2\n",
            "f.csv:2, column 'horizon': not a whole number",
        ),
        (
            "unique_id,horizon,q0.5,q0.99\na100,0,1,2\n",
            "f.csv:2, column 'horizon': value '0' is below",
        ),
        ("unique_id,horizon,q0.5,q0.99\n ,1,1,2\n", "f.csv:2, column 'unique_id': missing value"),
        (
            "unique_id,horizon,q0.5,q0.99\na100,1,1,2\n\na100,2,1,2\n",
            "f.csv:3, column 'unique_id': missing value",
        ),
        (
            "unique_id,horizon,q0.5,q0.99\na100,1,1,2\na100,1e300,1,2\n",
            "f.csv:3, column 'horizon': value '1e+300' is above the maximum 2",
        ),
        ("unique_id,horizon,q0.5,q0.99\na100,1,1,x\n", "f.csv:2, column 'q0.99': not a number"),
        (
            "unique_id,horizon,q0.5,q0.99\na100,1,1,inf\n",
            "f.csv:2, column 'q0.99': not a finite number",
        ),
        ("unique_id,horizon,q0.5,q0.99\na100,1,nan,2\n", "f.csv:2, column 'q0.5': missing value"),
        (
            "unique_id,horizon,q0.5,q0.99\na100,1,1,-2\n",
            "f.csv:2, column 'q0.99': value '-2' is below",
        ),
        ("unique_id,horizon,q0.5,qfoo\na100,1,1,2\n", "f.csv:1, column 'qfoo': not a q<level>"),
        ("unique_id,horizon,quantity\na100,1,1\n", "f.csv:1, column 'quantity': not a q<level>"),
        ("unique_id,horizon,q0.5,q1.5\na100,1,1,2\n", "f.csv:1, column 'q1.5': not a q<level>"),
        ("unique_id,horizon,q0.5,q0.50\na100,1,1,2\n", "f.csv:1, column 'q0.50': a second column"),
        ("unique_id,horizon,q0.5,q0.9\na100,1,1,2\n", "f.csv:1: no q0.99 column"),
        ("unique_id,q0.5,q0.99\na100,1,2\n", "f.csv:1, column 'horizon': missing column"),
    ],
)
def test_a_bad_forecast_file_is_refused_at_its_line_and_column(
    tmp_path: Path, forecast: str, where: str
) -> None:
    code, message = plan(tmp_path, forecast)
    assert code == 2
    assert where in message and "\n" not in message


def test_quantile_columns_are_matched_by_value_and_the_policys_levels_are_required(
    tmp_path: Path,
) -> None:
    padded = GOOD.replace("q0.5,q0.99", "q0.50,q0.990")
    at = ("--at", "2024-01-01T10:00")
    code, output = plan(tmp_path, padded, *at)
    assert code == 0, output
    assert json.loads(output) == json.loads(plan(tmp_path, GOOD, *at)[1])
    (tmp_path / "policy.yaml").write_text("base_quantile: 0.95\n")
    code, message = plan(tmp_path, GOOD, "--policy", str(tmp_path / "policy.yaml"))
    assert code == 2 and "no q0.95 column" in message
    # Reactive mode plans on no forecast quantile: none is required.
    assert plan(tmp_path, GOOD.replace("q0.99", "q0.9"), "--mode", "reactive")[0] == 0


def test_a_group_named_like_a_missing_value_is_that_name(tmp_path: Path) -> None:
    """Groups named NA and None are planned as those names, not refused as missing."""
    forecast = "unique_id,horizon,q0.5,q0.99\nNA,1,10,20\nNone,1,1,2\n"
    observed = ("--observed", "NA=10", "--observed", "None=1", "--at", "2024-01-01T10:00")
    code, output = plan(tmp_path, forecast, *observed)
    assert code == 0, output
    (a100,) = [d for d in json.loads(output)["decisions"] if d["pool"] == "a100"]
    assert "NA: forecast" in a100["reason"] and "None: forecast" in a100["reason"]


@pytest.mark.parametrize(
    ("options", "option"),
    [
        (["--at", "banana"], "--at"),
        (["--at", ""], "--at"),
        (["--fleet", "a100=-3"], "--fleet"),
        (["--fleet", "a100=2+-1"], "--fleet"),
        (["--fleet", "a100=1", "--fleet", "a100=5"], "--fleet"),
        (["--fleet", "nope=1"], "--fleet"),
        (["--group-models", "a100=NOPE"], "--group-models"),
        (["--observed", "a100=nan"], "--observed"),
        (["--observed", "a100"], "--observed"),
    ],
)
def test_a_bad_option_is_refused_by_name(tmp_path: Path, options: list[str], option: str) -> None:
    code, message = plan(tmp_path, GOOD, *options)
    assert code == 2
    assert f"Invalid value for {option}" in message


def test_good_options_plan(tmp_path: Path) -> None:
    code, output = plan(
        tmp_path, GOOD, "--at", "2024-01-01T10:00", "--fleet", "a100=2+1", "--group-models", "a100="
    )
    assert code == 0, output
    document = json.loads(output)
    assert document["at"].startswith("2024-01-01T10:00")
    assert {d["pool"]: d["current"] for d in document["decisions"]} == {"a100": 3, "t4": 0}


def test_a_forecast_is_read_like_every_csv_input(tmp_path: Path) -> None:
    """Other columns (`ds`) are left alone and a gzip file reads as its text."""
    at = ("--at", "2024-01-01T10:00")
    expected = json.loads(plan(tmp_path, GOOD, *at)[1])
    with_ds = "ds," + GOOD.replace("\na", "\n2024-01-01,a")
    assert json.loads(plan(tmp_path, with_ds, *at)[1]) == expected
    (tmp_path / "f.csv.gz").write_bytes(gzip.compress(GOOD.encode()))
    args = ["--pools", str(tmp_path / "pools.yaml"), "--forecast", str(tmp_path / "f.csv.gz")]
    result = CliRunner().invoke(app, ["plan", *args, "--observed", "a100=10", *at, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == expected
