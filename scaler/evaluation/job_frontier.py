"""The policies compared on one job stream, each one run of the job simulator: `reactive`
(Cluster Autoscaler), `headroom` (reactive plus k spare nodes per pool, the buffer teams
run instead of a forecast) and `predictive` at the product's setting of its knob and, for
a frontier, at other settings. The runs share the stream and the forecast outlooks and are
otherwise independent, so they can go to a process pool.

The matched view sets each predictive row against the baselines (reactive and headroom
rows): the cheapest one that waits no more (GPU-minutes waited), with the GPU-hours ours
saves, and the least-waiting one that pays no more (GPU-hours), with the wait ours cuts.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from functools import partial

import numpy as np
import pandas as pd

from predictor.foundation.errors import InputError
from predictor.models.forecast import Forecaster
from scaler.cluster.pools import NodePool
from scaler.evaluation.job_simulator import (
    DEFAULT_QUEUE,
    WARMUP,
    JobMode,
    JobSimResult,
    simulate_jobs,
)
from scaler.placement.queue import Order
from scaler.planning.planner import PlannerPolicy
from scaler.providers.simulated import SimulatedCloudConfig

HEADROOM_NODES = (1, 2, 3, 4)  # spare nodes per pool of the `headroom` rows
# Knobs of a frontier: the trace protocol's 0.001-0.1 and 0.2-0.3. At job level (the share
# of the requested GPUs' boot time they wait) 0.1-0.3 lie among the headroom rows'
# GPU-hours; 0.03 and below hold more spare than 4 nodes per pool.
FRONTIER_KNOBS = (0.001, 0.003, 0.01, 0.03, 0.1, 0.2, 0.3)
BASELINES = ("reactive", "headroom")

Row = dict[str, object]


@dataclass(frozen=True)
class JobRun:
    """One run of a comparison: a mode and its setting (spare nodes per pool for
    `headroom`, the job-level knob `job_wait_share` for `predictive`)."""

    mode: JobMode
    knob: float | None = None
    default: bool = False  # the predictive run at the product's setting


def job_runs(
    policy: PlannerPolicy, headroom: Sequence[int] = (), knobs: Sequence[float] = ()
) -> list[JobRun]:
    """reactive, headroom at each spare-node count, predictive at each knob and at the
    policy's own (marked default), in that order; knobs ascending."""
    runs = [JobRun("reactive")]
    runs += [JobRun("headroom", k) for k in sorted(set(headroom))]
    ours = policy.job_wait_share
    runs += [JobRun("predictive", k, default=k == ours) for k in sorted({*knobs, ours})]
    return runs


@dataclass(frozen=True)
class _Stream:
    """What every run of a comparison shares (sent once per run to a worker process)."""

    jobs: pd.DataFrame
    pools: tuple[NodePool, ...]
    begin: pd.Timestamp
    start: pd.Timestamp
    end: pd.Timestamp
    policy: PlannerPolicy
    outlooks: Mapping[str, np.ndarray]
    levels: tuple[float, ...]
    cloud: SimulatedCloudConfig | None
    queue: Order


def _simulate(stream: _Stream, run: JobRun) -> JobSimResult:
    policy = stream.policy
    if run.mode == "predictive" and run.knob is not None:
        policy = policy.with_knob(job_wait_share=run.knob)
    result = simulate_jobs(
        stream.jobs,
        stream.pools,
        run.mode,
        stream.begin,
        stream.start,
        stream.end,
        policy,
        stream.outlooks,
        stream.levels,
        stream.cloud,
        stream.queue,
        spare=int(run.knob or 0) if run.mode == "headroom" else 0,
    )
    return replace(result, default=run.default)


def _run_all(stream: _Stream, runs: Sequence[JobRun], workers: int) -> list[JobSimResult]:
    """The runs in order; on `workers` processes when more than one. Spawned, not
    forked: the parent has trained a model, and a forked child inherits its thread pools'
    locks."""
    if workers <= 1 or len(runs) <= 1:
        return [_simulate(stream, run) for run in runs]
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(min(workers, len(runs)), mp_context=context) as pool:
        return list(pool.map(partial(_simulate, stream), runs))


@dataclass(frozen=True)
class WorkloadComparison:
    results: tuple[JobSimResult, ...]  # in the order of `job_runs`
    start: pd.Timestamp
    end: pd.Timestamp
    gpus_per_node: Mapping[str, int]

    @property
    def reactive(self) -> JobSimResult:
        return next(r for r in self.results if r.mode == "reactive")

    @property
    def predictive(self) -> JobSimResult:
        """The predictive run at the product's setting."""
        return next(r for r in self.results if r.mode == "predictive" and r.default)

    def rows(self) -> list[Row]:
        return [r.row() for r in self.results]

    def best_headroom(self) -> JobSimResult | None:
        """The headroom run to set against the default predictive one: the cheapest that
        waits no more than it (GPU-minutes waited), else the least waiting."""
        headroom = [r for r in self.results if r.mode == "headroom"]
        if not headroom:
            return None
        rows = [r.row() for r in headroom]
        ours = self.predictive.row()
        cheapest = _cheapest(rows, float(ours["gpu_minutes_waited"]))
        best = cheapest or min(rows, key=lambda r: (r["gpu_minutes_waited"], r["gpu_hours"]))
        return headroom[rows.index(best)]


def compare_on_workload(
    jobs: pd.DataFrame,
    demand: pd.DataFrame,
    pools: Sequence[NodePool],
    forecaster: Forecaster,
    *,
    start: pd.Timestamp,
    end: pd.Timestamp,
    warmup: pd.Timedelta = WARMUP,
    policy: PlannerPolicy | None = None,
    cloud: SimulatedCloudConfig | None = None,
    levels: tuple[float, ...] = (0.5, 0.9, 0.99),
    queue: Order = DEFAULT_QUEUE,
    headroom: Sequence[int] = (),
    knobs: Sequence[float] = (),
    workers: int = 1,
) -> WorkloadComparison:
    """Reactive, headroom at each of `headroom` spare nodes per pool, and predictive at
    the policy's knob and each of `knobs`, on one job stream. The forecaster (a
    `Forecaster`) is fitted on the per-pool demand (`unique_id` = pool, GPUs, any
    resolution) before `start - warmup`; the warm-up days then run every mode (and the
    planner's margin) in, and jobs submitted in [start, end) are scored; the knobs are
    the policy's `job_wait_share`. `workers` > 1 runs them on that many processes."""
    policy = policy or PlannerPolicy()
    begin = start - warmup
    outlooks = _outlooks(demand, pools, forecaster, begin, warmup, levels)
    stream = _Stream(jobs, tuple(pools), begin, start, end, policy, outlooks, levels, cloud, queue)
    results = _run_all(stream, job_runs(policy, headroom, knobs), workers)
    return WorkloadComparison(tuple(results), start, end, {p.name: p.gpus_per_node for p in pools})


def _outlooks(
    demand: pd.DataFrame,
    pools: Sequence[NodePool],
    forecaster: Forecaster,
    begin: pd.Timestamp,
    warmup: pd.Timedelta,
    levels: tuple[float, ...],
) -> dict[str, np.ndarray]:
    """Per pool, the forecast outlook of every 10-minute step from `begin` (the model
    fitted on the demand before it)."""
    from predictor.data.series import STEP, regularize, resample
    from scaler.evaluation.replay import rolling_outlook

    stepped = regularize(resample(demand, STEP), fill="ffill").drop(columns="filled")
    if not (stepped["ds"] < begin).any():
        raise InputError(f"no demand before {begin} to fit the model on (warm-up {warmup})")
    model = forecaster.fit(stepped[stepped["ds"] < begin])
    lead = max(p.boot_steps(STEP.total_seconds()) for p in pools)
    outlooks: dict[str, np.ndarray] = {}
    for pool in pools:
        series = stepped[stepped["unique_id"] == pool.name].reset_index(drop=True)
        ds = series["ds"].to_numpy()
        first = int(np.searchsorted(ds, np.datetime64(begin)))
        if first < 1 or ds[first] != np.datetime64(begin):
            raise InputError(f"demand of pool {pool.name!r} does not cover {begin} on the grid")
        full = rolling_outlook(model, series, ds, first, list(range(1, lead + 2)), levels)
        outlooks[pool.name] = full[first:]
    return outlooks


# --------------------------------------------------------------------------- matched view


def row_label(row: Row) -> str:
    """`reactive`, `headroom 2`, `predictive 0.01`."""
    knob = row.get("knob")
    return str(row["mode"]) if knob is None else f"{row['mode']} {knob:g}"


def _cheapest(baselines: Sequence[Row], waited: float) -> Row | None:
    within = [r for r in baselines if r["gpu_minutes_waited"] <= waited]
    return min(within, key=lambda r: (r["gpu_hours"], r["gpu_minutes_waited"]), default=None)


def _least_waiting(baselines: Sequence[Row], gpu_hours: float) -> Row | None:
    within = [r for r in baselines if r["gpu_hours"] <= gpu_hours]
    return min(within, key=lambda r: (r["gpu_minutes_waited"], r["gpu_hours"]), default=None)


def _envelope(baselines: Sequence[Row]) -> tuple[np.ndarray, np.ndarray]:
    """The baselines' cost/wait frontier: GPU-hours ascending, each row waiting less than
    every cheaper one (GPU-hours, GPU-minutes waited)."""
    hours: list[float] = []
    waited: list[float] = []
    for r in sorted(baselines, key=lambda r: (r["gpu_hours"], r["gpu_minutes_waited"])):
        if not waited or float(r["gpu_minutes_waited"]) < waited[-1]:
            hours.append(float(r["gpu_hours"]))
            waited.append(float(r["gpu_minutes_waited"]))
    return np.asarray(hours), np.asarray(waited)


def _between(x: float, xs: np.ndarray, ys: np.ndarray) -> float | None:
    """ys at x, linear between the points (xs ascending); None outside them."""
    if not xs.size or not xs[0] <= x <= xs[-1]:
        return None
    return float(np.interp(x, xs, ys))


def matched_view(rows: Sequence[Row]) -> list[Row]:
    """Per predictive row: the cheapest baseline with no more GPU-minutes waited and the
    GPU-hours saving against it (1 - ours / its), the least-waiting baseline with no more
    GPU-hours and the wait reduction against it (1 - ours / its GPU-minutes waited), and
    the baselines that beat it on both at once (`dominated_by`). None where no baseline
    qualifies (and a reduction against a baseline that waited nothing).

    A single match jumps between settings (a row a hair dearer than `headroom 1` is
    matched, for its wait, with `reactive`), so the `envelope_*` fields read the baselines'
    frontier between its settings instead, linearly: its GPU-hours at our GPU-minutes
    waited and its GPU-minutes waited at our GPU-hours, with the saving and the reduction
    against those; None beyond the settings swept (a row dearer than every baseline is
    not compared with a buffer larger than the largest tried)."""
    baselines = [r for r in rows if r["mode"] in BASELINES]
    front_hours, front_waited = _envelope(baselines)
    out = []
    for ours in (r for r in rows if r["mode"] == "predictive"):
        hours, waited = float(ours["gpu_hours"]), float(ours["gpu_minutes_waited"])
        cheapest = _cheapest(baselines, waited)
        least = _least_waiting(baselines, hours)
        least_waited = None if least is None else float(least["gpu_minutes_waited"])
        same_wait = _between(waited, front_waited[::-1], front_hours[::-1])
        same_cost = _between(hours, front_hours, front_waited)
        out.append(
            {
                "knob": ours["knob"],
                "default": ours["default"],
                "gpu_hours": hours,
                "gpu_minutes_waited": waited,
                "cheapest_no_more_wait": None if cheapest is None else row_label(cheapest),
                "cheapest_gpu_hours": None if cheapest is None else cheapest["gpu_hours"],
                "gpu_hours_saving": None
                if cheapest is None
                else 1 - hours / float(cheapest["gpu_hours"]),
                "least_wait_no_more_cost": None if least is None else row_label(least),
                "least_wait_gpu_minutes_waited": least_waited,
                "wait_reduction": None if not least_waited else 1 - waited / least_waited,
                "dominated_by": [
                    row_label(b)
                    for b in baselines
                    if b["gpu_hours"] < hours and b["gpu_minutes_waited"] < waited
                ],
                "envelope_gpu_hours": same_wait,
                "envelope_saving": None if not same_wait else 1 - hours / same_wait,
                "envelope_gpu_minutes_waited": same_cost,
                "envelope_wait_reduction": None if not same_cost else 1 - waited / same_cost,
            }
        )
    return out
