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

import math
import multiprocessing
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace

import numpy as np
import pandas as pd

from predictor.foundation.errors import InputError
from predictor.models.forecast import Forecaster
from predictor.models.requests import BUCKETS, RequestForecaster, RequestHistory, hour_bucket
from scaler.cluster.job import WHOLE_GPU_MILLI
from scaler.cluster.pools import NodePool
from scaler.evaluation.job_simulator import (
    DEFAULT_QUEUE,
    HEADROOM_MODES,
    PREDICTIVE_MODES,
    WARMUP,
    JobMode,
    JobSimResult,
    RequestRates,
    ScheduledRun,
    simulate_jobs,
)
from scaler.evaluation.request_rates import LearnedRates, TrueRates, request_histories
from scaler.placement.queue import Order
from scaler.planning.job_spare import RateModel
from scaler.planning.planner import PlannerPolicy
from scaler.providers.simulated import SimulatedCloudConfig

HEADROOM_NODES = tuple(range(1, 9))  # spare nodes per pool of the `headroom` rows
# Knobs of a frontier: the trace protocol's 0.001-0.1 and 0.2-0.3. At job level (the share
# of the requested GPUs' boot time they wait) 0.1-0.3 lie among the headroom rows'
# GPU-hours; 0.03 and below hold more spare than 4 nodes per pool.
FRONTIER_KNOBS = (0.001, 0.003, 0.01, 0.03, 0.1, 0.2, 0.3)
# The planner without its learned parts, each at these knobs (where the frontier's
# default and its neighbours lie): what the request forecast is worth is read against them.
ABLATIONS: tuple[JobMode, ...] = ("predictive-seasonal", "predictive-flat", "predictive-true-rate")
ABLATION_KNOBS = (0.1, 0.2, 0.3, 0.5)
BASELINES = ("reactive", "headroom", "headroom-tuned")
# The week a careful team tunes its per-pool headroom on, before the scored window.
TUNING_WINDOW = pd.Timedelta(days=7)
MIN_TUNING_WINDOW = pd.Timedelta(days=1)  # less holds no day's cycle to tune on
TUNED_POINTS = 6  # per-pool settings run on the scored window, spread over the prices

Row = dict[str, object]


@dataclass(frozen=True)
class JobRun:
    """One run of a comparison: a mode and its setting (spare nodes per pool for
    `headroom`, the job-level knob `job_wait_share` for the predictive modes, a spare
    count per pool for `headroom-tuned`)."""

    mode: JobMode
    knob: float | None = None
    default: bool = False  # the predictive run at the product's setting
    spares: tuple[tuple[str, int], ...] = ()  # headroom-tuned


def job_runs(
    policy: PlannerPolicy,
    headroom: Sequence[int] = (),
    knobs: Sequence[float] = (),
    ablations: Sequence[JobMode] = (),
    ablation_knobs: Sequence[float] = (),
) -> list[JobRun]:
    """reactive, headroom at each spare-node count, predictive at each knob and at the
    policy's own (marked default), then each ablation at each of `ablation_knobs` and the
    policy's own; knobs ascending."""
    runs = [JobRun("reactive")]
    runs += [JobRun("headroom", k) for k in sorted(set(headroom))]
    ours = policy.job_wait_share
    runs += [JobRun("predictive", k, default=k == ours) for k in sorted({*knobs, ours})]
    runs += [JobRun(m, k) for m in ablations for k in sorted({*ablation_knobs, ours})]
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
    # The request-rate sources (`request_rates`): the learned model and the history it
    # continues, and the true intensity (from `begin`) in the requests' units.
    requests: RequestForecaster | None = None
    histories: Mapping[str, RequestHistory] = field(default_factory=dict)
    intensity: Mapping[str, np.ndarray] | None = None
    intensity_scale: Mapping[str, float] = field(default_factory=dict)
    intensity_shape: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    scheduled: tuple[ScheduledRun, ...] = ()


# How each predictive mode scales its spare, and whether it is told of scheduled runs.
_RATE_MODEL: dict[str, RateModel] = {
    "predictive": "forecast",
    "predictive-seasonal": "seasonal",
    "predictive-flat": "flat",
    "predictive-true-rate": "forecast",
}
_TOLD_OF_SCHEDULED = frozenset({"predictive", "predictive-true-rate"})


def _rates(stream: _Stream, mode: JobMode) -> RequestRates | None:
    if mode == "predictive" and stream.requests is not None:
        return LearnedRates.of(stream.requests, stream.histories)
    if mode == "predictive-true-rate":
        if stream.intensity is None:
            raise InputError("predictive-true-rate needs the workload's true request intensity")
        return TrueRates(stream.intensity, stream.intensity_scale, stream.intensity_shape)
    return None


def _simulate(stream: _Stream, run: JobRun) -> JobSimResult:
    policy = stream.policy
    predictive = run.mode in PREDICTIVE_MODES
    if predictive:
        if run.knob is not None:
            policy = policy.with_knob(job_wait_share=run.knob)
        policy = policy.model_copy(update={"request_rate": _RATE_MODEL[run.mode]})
    spare: int | dict[str, int] = dict(run.spares) if run.spares else int(run.knob or 0)
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
        spare=spare if run.mode in HEADROOM_MODES else 0,
        rates=_rates(stream, run.mode) if predictive else None,
        scheduled=stream.scheduled if run.mode in _TOLD_OF_SCHEDULED else (),
    )
    return replace(result, default=run.default)


def _run_all(stream: _Stream, runs: Sequence[JobRun], workers: int) -> list[JobSimResult]:
    """The runs on one stream in order (see `_run_pairs`)."""
    return _run_pairs([(stream, run) for run in runs], workers)


def _run_pairs(pairs: Sequence[tuple[_Stream, JobRun]], workers: int) -> list[JobSimResult]:
    """Each run on its stream, in order; on `workers` processes when more than one.
    Spawned, not forked: the parent has trained a model, and a forked child inherits its
    thread pools' locks."""
    if workers <= 1 or len(pairs) <= 1:
        return [_simulate(stream, run) for stream, run in pairs]
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(min(workers, len(pairs)), mp_context=context) as pool:
        return list(pool.map(_simulate, *zip(*pairs, strict=True)))


@dataclass(frozen=True)
class WorkloadComparison:
    results: tuple[JobSimResult, ...]  # in the order of `job_runs`, headroom-tuned last
    start: pd.Timestamp
    end: pd.Timestamp
    gpus_per_node: Mapping[str, int]
    requests: RequestForecaster | None = None  # the learned request forecast, if any

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
    ablations: Sequence[JobMode] = (),
    ablation_knobs: Sequence[float] = ABLATION_KNOBS,
    tuned_headroom: bool = False,
    intensity: pd.DataFrame | None = None,
    learn_requests: bool = True,
    workers: int = 1,
) -> WorkloadComparison:
    """Reactive, headroom at each of `headroom` spare nodes per pool, predictive at the
    policy's knob and each of `knobs`, each of `ablations` at `ablation_knobs`, and with
    `tuned_headroom` the per-pool headroom a team tunes on the week before `start` (as
    much of it as the jobs cover after the warm-up; none under a day), on one job
    stream. The forecaster (a `Forecaster`) is fitted on the per-pool demand
    (`unique_id` = pool, GPUs, any resolution) before `start - warmup`; so is the learned
    request forecast (`learn_requests`), on the node requests a reactive run of that
    history saw. The warm-up days then run every mode (and the planner's margin) in, and
    jobs submitted in [start, end) are scored; the knobs are the policy's
    `job_wait_share`. Jobs marked `scheduled` are announced ahead to the modes told of
    them. `intensity` (as `SyntheticWorkload.intensity`) is what `predictive-true-rate`
    sizes on. `workers` > 1 runs them on that many processes."""
    policy = policy or PlannerPolicy()
    begin = start - warmup
    outlooks = _outlooks(demand, pools, forecaster, begin, warmup, levels)
    first = pd.Timestamp(demand["ds"].min())
    history: JobSimResult | None = None
    if (learn_requests or ablations) and first < begin:
        # The node requests of the history before the run, as the loop records them; a
        # reactive run: the cluster autoscaler a team ran before.
        history = simulate_jobs(jobs, pools, "reactive", first, first, begin, policy, queue=queue)
    histories = {} if history is None else request_histories(history.fleet, first.to_pydatetime())
    model = None
    if learn_requests and histories:
        boots = {p.name: p.boot_seconds / 60 for p in pools}
        try:
            model = RequestForecaster.fit({n: (h, boots[n]) for n, h in histories.items()})
        except InputError:
            model = None  # too little history to learn from: the seasonal table serves
    rates, scale, shape = _true_intensity(intensity, histories, first, begin)
    stream = _Stream(
        jobs,
        tuple(pools),
        begin,
        start,
        end,
        policy,
        outlooks,
        levels,
        cloud,
        queue,
        model,
        histories,
        rates,
        scale,
        shape,
        scheduled_runs(jobs, pools, begin),
    )
    runs = [(stream, run) for run in job_runs(policy, headroom, knobs, ablations, ablation_knobs)]
    # The week before the scored window, or as much of it as the jobs cover.
    week = min(TUNING_WINDOW, begin - first)
    tuned_headroom = tuned_headroom and week >= MIN_TUNING_WINDOW
    tuning = replace(stream, begin=start - week - warmup, start=start - week, end=start)
    tried = [JobRun("reactive"), *(JobRun("headroom", k) for k in HEADROOM_NODES)]
    results = _run_pairs([*runs, *((tuning, r) for r in tried if tuned_headroom)], workers)
    if tuned_headroom:
        results, on_week = results[: len(runs)], results[len(runs) :]
        results += _run_all(stream, tuned_settings(on_week, TUNED_POINTS), workers)
    return WorkloadComparison(
        tuple(results), start, end, {p.name: p.gpus_per_node for p in pools}, model
    )


def tuned_settings(week: Sequence[JobSimResult], points: int) -> list[JobRun]:
    """The per-pool headroom a careful team would pick from `week` (reactive and
    headroom runs of the week before the scored window): at each price of a GPU-minute
    waited, each pool's spare count cheapest in its GPU-hours plus priced waits; the
    distinct settings those prices give, `points` of them spread from the least spare
    to the most."""
    tried = {0 if r.mode == "reactive" else int(r.knob or 0): r.by_pool() for r in week}
    pools = sorted(next(iter(tried.values())))
    settings: list[tuple[tuple[str, int], ...]] = []
    for price in np.geomspace(0.01, 1000.0, 121):  # GPU-minutes waited worth a GPU-hour
        setting = tuple(
            (pool, min(tried, key=lambda k: tried[k][pool][0] + tried[k][pool][1] / price))
            for pool in pools
        )
        if setting not in settings:
            settings.append(setting)
    settings = [s for s in settings if any(k for _, k in s)]  # all zero is reactive
    if len(settings) > points:
        settings = [settings[round(i)] for i in np.linspace(0, len(settings) - 1, points)]
    return [JobRun("headroom-tuned", spares=s) for s in settings]


def _true_intensity(
    intensity: pd.DataFrame | None,
    histories: Mapping[str, RequestHistory],
    first: pd.Timestamp,
    begin: pd.Timestamp,
) -> tuple[dict[str, np.ndarray] | None, dict[str, float], dict[str, tuple[float, ...]]]:
    """Per pool the true intensity from `begin` on (GPUs a minute), the requests the
    history before `begin` saw per GPU of intensity there (the units they are seen in),
    and the intensity's mean per hour bucket over all of it (its shape over the week)."""
    if intensity is None:
        return None, {}, {}
    arrays, scale, shape = {}, {}, {}
    for pool, rows in intensity.sort_values("ds").groupby("unique_id"):
        ds, y = rows["ds"], rows["y"].to_numpy(dtype=float)
        before = y[((ds >= first) & (ds < begin)).to_numpy()].sum()
        seen = sum(histories[str(pool)].requested) if str(pool) in histories else 0.0
        arrays[str(pool)] = y[(ds >= begin).to_numpy()]
        scale[str(pool)] = seen / before if before > 0 else 1.0
        buckets = np.fromiter((hour_bucket(t) for t in ds), dtype=int, count=len(ds))
        means = pd.Series(y).groupby(buckets).mean().reindex(range(BUCKETS))
        shape[str(pool)] = tuple(float(m) for m in means.fillna(means.mean()))
    return arrays, scale, shape


def scheduled_runs(
    jobs: pd.DataFrame, pools: Sequence[NodePool], begin: pd.Timestamp
) -> tuple[ScheduledRun, ...]:
    """The jobs marked `scheduled` from `begin` on as runs announced ahead (a CronJob's
    next run times and pod template are read before it fires): their whole nodes."""
    if "scheduled" not in jobs:
        return ()
    runs = jobs[jobs["scheduled"].astype(bool) & (jobs["submit"] >= begin)]
    per_node = {p.name: p.gpus_per_node for p in pools}
    return tuple(
        ScheduledRun(
            (submit - begin) / pd.Timedelta(minutes=1),
            str(pool),
            max(1, math.ceil(gpus * milli / WHOLE_GPU_MILLI / per_node[str(pool)])),
        )
        for submit, pool, gpus, milli in zip(
            runs["submit"], runs["pool"], runs["gpus"], runs["gpu_milli"], strict=True
        )
        if str(pool) in per_node
    )


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
    """`reactive`, `headroom 2`, `predictive 0.01`, `headroom-tuned a100=2,t4=1`."""
    if row.get("spares"):
        spares = ",".join(f"{pool}={k}" for pool, k in sorted(row["spares"].items()))
        return f"{row['mode']} {spares}"
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


def ablation_view(rows: Sequence[Row]) -> list[Row]:
    """Per predictive row and ablation mode: the ablation's line between its knob points
    read at our GPU-minutes waited (its GPU-hours there, and our saving against them) and
    at our GPU-hours (its GPU-minutes waited there, and our wait reduction); None beyond
    its points. What the learned request forecast is worth, as a figure."""
    out = []
    ours = [r for r in rows if r["mode"] == "predictive"]
    for mode in sorted({str(r["mode"]) for r in rows} & set(ABLATIONS)):
        hours, waited = _envelope([r for r in rows if r["mode"] == mode])
        for row in ours:
            h, w = float(row["gpu_hours"]), float(row["gpu_minutes_waited"])
            same_wait = _between(w, waited[::-1], hours[::-1])
            same_cost = _between(h, hours, waited)
            out.append(
                {
                    "against": mode,
                    "knob": row["knob"],
                    "default": row["default"],
                    "gpu_hours_at_same_wait": same_wait,
                    "gpu_hours_saving": None if not same_wait else 1 - h / same_wait,
                    "gpu_minutes_waited_at_same_cost": same_cost,
                    "wait_reduction": None if not same_cost else 1 - w / same_cost,
                }
            )
    return out
