"""How far below the baselines' hindsight envelope any policy can get on demand with no memory.

`bench scaling` sets each predictive point against the cheapest baseline with no more
shortage: some forty buffer settings, the cheapest picked on the test window itself. This
yardstick asks how much of that any causal policy can reach. Each series' demand is replaced
by random walks whose changes are drawn independently from the series' own step changes
before its test window (in absolute value: demand is never negative), and on each walk the
best causal policy for such demand is matched against the same swept buffers, exactly as the
benchmark matches ours (`static` and `ces` are left out: a walk has no capacity record and no
forecast, and a smaller envelope only favours the policy).

Why that policy is the best one, at a boot lag of 0: a step is short by how far its demand
exceeds the fleet set at its start, from the past alone, and a walk's next change is
independent of its past. So what a step costs and lacks depends only on the spare held above
the last demand, and the cheapest way to be short on a given share of steps is to hold the
same spare on every step, mixing the two spares that bracket the share so that it is met
exactly, chosen from the law of the changes, which this policy is given and a real one would
have to learn. (Exact up to the floor at zero.) Where even it costs more than the envelope, a
forecast of such demand would too: the margin a planner can win is what real demand holds
beyond a random walk (bursts that cluster, hours that differ).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from scaler.evaluation.replay import PlannedTargets, ReactiveRule, ReplaySeries, replay
from scaler.evaluation.scaling_bench import (
    ROLLING_WINDOWS,
    Row,
    buffer_sweep_runs,
    in_band,
    lower_envelope,
    matched_baseline,
    row_label,
)

# Steps replayed before the scored ones, so that every rolling window is full.
WALK_WARMUP = max(ROLLING_WINDOWS)
# The benchmark's bar on a set of points: none dearer than its match, 3 % less on average.
BAR_MEAN_SAVING = 0.03


def changes_before_test(series: ReplaySeries) -> np.ndarray:
    """The series' step changes (nodes) before its test window: the law of its walks."""
    changes = np.diff(series.demand[: series.start])
    if changes.size == 0:
        raise ValueError(f"series {series.series}: no steps before its test window")
    return changes


def memoryless_walk(
    changes: np.ndarray, start: float, steps: int, rng: np.random.Generator
) -> np.ndarray:
    """`steps` steps of demand from `start`, each change drawn independently from `changes`
    (in absolute value: demand is never negative)."""
    return np.abs(start + np.cumsum(rng.choice(changes, size=steps)))


def ideal_spares(
    changes: np.ndarray, knob: float, steps: int, rng: np.random.Generator
) -> np.ndarray:
    """Per step, the spare nodes (over the last demand) of the best causal policy short on a
    share `knob` of steps of a walk with these changes: the least spare s whose chance of a
    change above it is within the knob, and s - 1 on the share of steps that brings the
    expected share of short steps to the knob exactly. A spare may be negative: a knob above
    the chance of any rise buys holding less than the last demand."""
    ordered = np.sort(changes)

    def short_chance(spare: int) -> float:
        return 1.0 - np.searchsorted(ordered, spare, side="right") / ordered.size

    spare = int(np.floor(ordered[0])) - 1  # short on every step
    while short_chance(spare) > knob:
        spare += 1
    above, at = short_chance(spare - 1), short_chance(spare)
    lower_share = (knob - at) / (above - at) if above > knob else 0.0
    return np.where(rng.random(steps) < lower_share, spare - 1, spare)


def walk_points(
    series: ReplaySeries, knobs: Sequence[float], walk: int, unneeded: int
) -> list[Row]:
    """Walk number `walk` of `series`: the best causal policy at each knob (boot lag 0)
    against the cheapest swept buffer (`reactive` included) with no more shortage; no
    points where the walk stays at zero."""
    rng = np.random.default_rng([walk, zlib.crc32(f"{series.trace}/{series.series}".encode())])
    changes = changes_before_test(series)
    steps = WALK_WARMUP + series.end - series.start
    demand = memoryless_walk(changes, float(series.demand[series.start - 1]), steps, rng)
    if not demand[WALK_WARMUP:].any():
        return []  # a walk that stays at zero asks for nothing: no cost ratio to compare
    walked = ReplaySeries(
        trace=series.trace,
        series=series.series,
        ds=pd.date_range(end=series.ds[series.end - 1], periods=steps, freq=series.step).to_numpy(),
        demand=demand,
        static=None,
        bound=None,
        warmup=1,
        start=WALK_WARMUP,
        end=steps,
        step=series.step,
    )
    reactive = replay(walked, ReactiveRule("reactive", demand, unneeded, walked.warmup), 0)
    baselines = [reactive.row(), *(o.row() for o in buffer_sweep_runs(walked, 0, unneeded))]
    envelope = lower_envelope(baselines)
    last = np.concatenate(([0.0], demand[:-1]))  # the demand a target at step t has seen
    points = []
    for knob in knobs:
        targets = np.maximum(last + ideal_spares(changes, knob, steps, rng), 0)
        ours = replay(walked, PlannedTargets("ideal", targets), 0).row()
        match, saving = matched_baseline(envelope, ours)
        points.append(
            {
                "trace": series.trace,
                "series": series.series,
                "walk": walk,
                "knob": knob,
                "ideal_ratio": ours["provisioning_ratio"],
                "ideal_events": ours["shortage_events"],
                "ideal_node_steps": ours["shortage_node_steps"],
                "short_share": ours["shortage_events"] / ours["steps"],
                "matched": None if match is None else row_label(match),
                "matched_ratio": None if match is None else match["provisioning_ratio"],
                "saving": saving,
            }
        )
    return points


@dataclass(frozen=True)
class WalkCeiling:
    """The best causal policy on `walks` memoryless walks of every series: its points, per
    knob the mean and worst saving, the share of matched points dearer than their match and
    the share in the knob's band, and over the walks the sets (walk w of every series, every
    knob) on which the benchmark's bar held: no point dearer, 3 % less on average."""

    walks: int
    points: list[Row]
    by_knob: list[Row]
    runs_meeting_bar: int

    def document(self) -> Row:
        return {
            "walks": self.walks,
            "lag_steps": 0,
            "runs_meeting_bar": self.runs_meeting_bar,
            "by_knob": self.by_knob,
            "points": self.points,
        }


def walk_ceiling(
    series: Sequence[tuple[ReplaySeries, int]], knobs: Sequence[float], walks: int
) -> WalkCeiling:
    """`series`: each with Cluster Autoscaler's unneeded time in its steps."""
    points = [
        p
        for s, unneeded in series
        for walk in range(walks)
        for p in walk_points(s, knobs, walk, unneeded)
    ]
    by_knob = []
    for knob in knobs:
        mine = [p for p in points if p["knob"] == knob]
        savings = [float(p["saving"]) for p in mine if p["saving"] is not None]
        by_knob.append(
            {
                "knob": knob,
                "points": len(mine),
                "matched": len(savings),
                "mean_saving": float(np.mean(savings)) if savings else None,
                "worst_saving": min(savings) if savings else None,
                "share_dearer": float(np.mean([s < -1e-9 for s in savings])) if savings else None,
                "share_in_band": float(np.mean([in_band(knob, p["short_share"]) for p in mine]))
                if mine
                else None,
            }
        )
    held = 0
    for walk in range(walks):
        savings = [
            float(p["saving"]) for p in points if p["walk"] == walk and p["saving"] is not None
        ]
        held += bool(savings) and min(savings) >= -1e-9 and np.mean(savings) >= BAR_MEAN_SAVING
    return WalkCeiling(walks, points, by_knob, held)
