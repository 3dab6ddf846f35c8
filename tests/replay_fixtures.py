"""What the replay tests build on: hand-made series, and `gpuscale bench scaling` on a slice of
a real Helios VC."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from typer.testing import CliRunner, Result

from scaler.evaluation.replay import ReplaySeries

STEP = pd.Timedelta("10min")


def hand_series(
    demand: Sequence[float] | np.ndarray,
    warmup: int = 1,
    start: int = 1,
    bound: list[float] | None = None,
    static: float | None = 10.0,
) -> ReplaySeries:
    """A series of 10-minute steps from 2024-01-01, scored from `start` to its end."""
    d = np.asarray(demand, dtype=float)
    return ReplaySeries(
        trace="hand",
        series="s",
        ds=np.arange(d.size) * np.timedelta64(10, "m") + np.datetime64("2024-01-01"),
        demand=d,
        static=None if static is None else np.full(d.size, static),
        bound=None if bound is None else np.asarray(bound, dtype=float),
        warmup=warmup,
        start=start,
        end=d.size,
        step=STEP,
    )


def bench_vc_slice(traces_dir: Path, out: Path, *options: str) -> tuple[Result, dict[str, Any]]:
    """Run the benchmark on vcTJs from 2020-05-30 with the fast empirical model; `options`
    add lags, knobs and the like. Returns the CLI result and the JSON it wrote."""
    from scaler.cli import app

    args = [
        "bench", "scaling",
        "--trace", f"helios-vc:{traces_dir / 'helios-earth' / 'vcTJs.csv.gz'}",
        "--split", "2020-05-30", "--model", "empirical", *options, "--json", str(out),
    ]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return result, json.loads(out.read_text())
