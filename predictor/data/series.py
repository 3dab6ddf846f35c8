"""Regular demand steps: the 10-minute grid every forecast and scaling decision works on.

A step is labelled by its start and holds the MAXIMUM of the minutes inside it, for demand,
capacity and exogenous columns alike: a job must find capacity at its peak minute, so an
average would hide exactly the shortage the scaler exists to avoid (BENCHMARKS.md).

`resample` keeps a step that has no observation absent rather than inventing a value; code
that needs a complete grid (lag features, replays) calls `regularize`, which makes the
missing steps explicit and, only if asked, fills them and marks them as filled.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import pandas as pd

STEP = pd.Timedelta("10min")
KEYS = ["unique_id", "ds"]


def resample(frame: pd.DataFrame, step: pd.Timedelta = STEP) -> pd.DataFrame:
    """Long table -> one row per series and step (label = step start, epoch-aligned), every
    other column aggregated by its maximum; steps with no observation are left out."""
    step = pd.Timedelta(step)
    stepped = frame.assign(ds=frame["ds"].dt.floor(step))
    out = stepped.groupby(KEYS, sort=True, as_index=False, observed=True).max()
    return out[list(frame.columns)]


def regularize(
    frame: pd.DataFrame,
    step: pd.Timedelta = STEP,
    *,
    fill: Literal["none", "ffill"] = "none",
) -> pd.DataFrame:
    """Every step from each series' first to last observation, in order.

    Missing steps get NaN values (`fill="none"`), or the last observed values
    (`fill="ffill"`: for models whose lag features cannot take NaN; a step that was never
    observed must not be scored, so the boolean column `filled` marks them). The frame must
    already be on the grid of `step` (see `resample`).
    """
    step = pd.Timedelta(step)
    parts = []
    for uid, group in frame.groupby("unique_id", sort=True):
        grid = pd.date_range(group["ds"].iloc[0], group["ds"].iloc[-1], freq=step)
        full = group.set_index("ds").reindex(grid)
        full.index.name = "ds"
        full["unique_id"] = uid
        parts.append(full.reset_index())
    if not parts:
        out = frame.iloc[0:0].copy()
        if fill == "ffill":
            out["filled"] = pd.Series(dtype=bool)
        return out
    out = pd.concat(parts, ignore_index=True).reindex(columns=list(frame.columns))
    if fill == "ffill":
        values = [c for c in out.columns if c not in KEYS]
        out["filled"] = out[values].isna().all(axis=1)
        out[values] = out.groupby("unique_id", sort=False)[values].ffill()
    return out


def gaps(frame: pd.DataFrame, step: pd.Timedelta = STEP) -> pd.DataFrame:
    """Spans where a series has no observation: `unique_id`, `start` (first missing step),
    `end` (last missing step), `steps` (how many are missing)."""
    step = pd.Timedelta(step)
    ordered = frame.sort_values(KEYS)
    delta = ordered.groupby("unique_id", sort=False)["ds"].diff()
    holes = ordered[delta > step]
    before = holes["ds"] - delta[delta > step]
    return pd.DataFrame(
        {
            "unique_id": holes["unique_id"].to_numpy(),
            "start": (before + step).to_numpy(),
            "end": (holes["ds"] - step).to_numpy(),
            "steps": (delta[delta > step] // step - 1).astype("int64").to_numpy(),
        }
    )


def h_step_changes(y: np.ndarray, horizon: int) -> np.ndarray:
    """The changes y[t] - y[t-h] where both ends are observed (unobserved steps are NaN)."""
    y = np.asarray(y, dtype=float)
    changes = y[horizon:] - y[:-horizon]
    return changes[np.isfinite(changes)]
