"""What `gpuscale plan` reads besides the pools: the forecast file and the NAME=VALUE options,
each checked where it is read so that a bad one is refused by name, never planned on."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

import pandas as pd
import typer

from predictor.data.loaders.csvfile import CsvTable, read_table
from predictor.models.forecast import quantile_column
from scaler.cluster.pools import NodePool
from scaler.planning.planner import PoolCapacity

KEYS = ("unique_id", "horizon")
# A column named like a quantile is read as one; any other column (`ds`, ...) is left alone.
QUANTILE = re.compile(r"q(.*)")
WHOLE = re.compile(r"\s*\d+\s*")


def read_forecast(path: Path, needed: Sequence[float]) -> pd.DataFrame:
    """The forecast file as `unique_id`, int `horizon` and one `quantile_column(level)` per
    q<level> column (q0.50 is q0.5: levels are matched by value), each value a finite
    number of GPUs >= 0; `needed` are the levels the policy reads."""
    table = read_table(path, KEYS, matching=QUANTILE, text=["unique_id"])
    levels = _levels(table)
    for level in needed:
        if level not in levels.values():
            raise table.header_error(f"no q{level:g} column: the policy plans on that quantile")
    # A group's horizons run 1, 2, ... without gaps, so none exceeds the file's rows: a
    # larger one (1e300, which no int holds) is refused at its line, not after as a gap.
    rows = len(table.frame)
    out = pd.DataFrame(
        {
            "unique_id": table.text("unique_id"),
            "horizon": table.numbers("horizon", integer=True, minimum=1, maximum=rows).astype(int),
        }
    )
    for column, level in levels.items():
        out[quantile_column(level)] = table.numbers(column)
    return out


def _levels(table: CsvTable) -> dict[str, float]:
    """Column -> quantile level, for every column named q<something>."""
    levels: dict[str, float] = {}
    for column in table.frame.columns:
        match = QUANTILE.fullmatch(column)
        if match is None:
            continue
        try:
            level = float(match.group(1))
        except ValueError:
            level = math.nan
        if not 0 < level < 1:
            raise table.header_error("not a q<level> column with 0 < level < 1", column)
        if level in levels.values():
            raise table.header_error(f"a second column for quantile {level:g}", column)
        levels[column] = level
    if not levels:
        raise table.header_error("the forecast has no q<level> columns")
    return levels


def pairs(items: Sequence[str], option: str) -> dict[str, str]:
    """NAME=VALUE options, each name at most once (a repeat would silently win)."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"{item!r} must be NAME=VALUE", param_hint=option)
        if key in out:
            raise typer.BadParameter(f"{key} is given twice", param_hint=option)
        out[key] = value
    return out


def observed_gpus(items: Sequence[str]) -> dict[str, float]:
    """--observed GROUP=GPUS: a finite demand >= 0 per group."""
    out = {}
    for group, value in pairs(items, "--observed").items():
        try:
            gpus = float(value)
        except ValueError:
            gpus = math.nan
        if not 0 <= gpus < math.inf:
            raise typer.BadParameter(
                f"{group}={value!r}: GPUS is a finite number >= 0", param_hint="--observed"
            )
        out[group] = gpus
    return out


def fleet(items: Sequence[str], pools: Sequence[NodePool], pools_file: Path) -> list[PoolCapacity]:
    """--fleet POOL=READY[+BOOTING] per pool (0 for a pool not named)."""
    counts = pairs(items, "--fleet")
    unknown = set(counts) - {p.name for p in pools}
    if unknown:
        raise typer.BadParameter(
            f"names pools not in {pools_file}: {sorted(unknown)}", param_hint="--fleet"
        )
    out = []
    for pool in pools:
        spec = counts.get(pool.name, "0")
        ready, _, booting = spec.partition("+")
        # WHOLE takes digits only: `-3` and `2+-1` are refused, not planned as negative nodes
        if not WHOLE.fullmatch(ready) or not WHOLE.fullmatch(booting or "0"):
            raise typer.BadParameter(
                f"{pool.name}={spec!r}: READY[+BOOTING] are whole numbers >= 0",
                param_hint="--fleet",
            )
        out.append(PoolCapacity(pool.name, int(ready), int(booting or 0)))
    return out


def group_models(items: Sequence[str], pools: Sequence[NodePool]) -> dict[str, list[str]]:
    """--group-models GROUP=MODEL[|MODEL...] (GROUP= : any model): each model one a pool has,
    else the group would be left without a pool and its demand unplanned."""
    have = {p.gpu_model for p in pools}
    out = {}
    for group, spec in pairs(items, "--group-models").items():
        models = spec.split("|") if spec else []
        missing = [m for m in models if m not in have]
        if missing:
            raise typer.BadParameter(
                f"{group}: no pool has GPU model {', '.join(missing)} (pools have "
                f"{', '.join(sorted(have))})",
                param_hint="--group-models",
            )
        out[group] = models
    return out


def decision_time(at: str) -> datetime:
    """--at: a date and time (pandas reads a blank one as NaT, which plans at no time)."""
    try:
        when = pd.Timestamp(at)
    except ValueError:
        when = pd.NaT
    if when is pd.NaT:
        raise typer.BadParameter(f"{at!r} is not a date and time", param_hint="--at")
    return when.to_pydatetime()
