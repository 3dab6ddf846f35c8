"""The `scaling` benchmark (BENCHMARKS.md): every trace series replayed at each boot lag
through `static`, `reactive`, `ces`, `oracle`, `predictive` and `predictive-no-forecast`
(the same planner with no forecast-driven rule; one row of each per knob) and the
baselines teams run instead, each swept over its setting (`headroom`, `headroom-percent`,
`rolling-max`, `ces` at multiples of its buffer), side by side on the same forecasts; each
predictive point is then set against the cheapest baseline with no more shortage.

Forecasts: the model is fitted on the training window minus its last `calibration_days`;
those days then warm up every policy (the predictive planner learns its safety margin from
genuine out-of-sample errors there), and only the test window is scored. Nothing at or
after a step is seen by a policy before that step is decided (the oracle excepted).

The protocol's step is 10 minutes. `step_minutes` replays the same trace on finer steps
(e.g. 1 minute, the resolution of the public traces) to measure how fast the policies run
over it: the model still forecasts 10-minute steps, and a decision at minute t uses the
forecasts made at the start of its 10-minute step, i.e. from data up to the last complete
step before it (never newer data than the minute-level policy may see).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime

import numpy as np
import pandas as pd

from predictor.data.loaders import DemandTrace
from predictor.data.series import STEP, regularize
from predictor.foundation.errors import InputError
from predictor.models.forecast import Forecaster
from scaler.cluster.pools import NodePool, whole_nodes, whole_nodes_each
from scaler.evaluation.replay import (
    CesPolicy,
    OraclePolicy,
    PlannedTargets,
    PlannerPolicyRun,
    ReactiveRule,
    ReplayOutcome,
    ReplayPolicy,
    ReplaySeries,
    StaticPolicy,
    horizon_mean_weights,
    replay,
    rolling_max_targets,
    rolling_outlook,
    spare_nodes,
)
from scaler.planning.buffer_tuning import RuleRecord, cheapest_within
from scaler.planning.planner import PlannerPolicy

QUANTILES: tuple[float, ...] = (0.5, 0.9, 0.99)
CES_FUTURE = 30
# Horizons sampled for the CES rule's 30- and 60-step mean forecasts (interpolated between).
CES_HORIZONS: tuple[int, ...] = (1, 2, 3, 4, 6, 9, 12, 18, 24, 30, 36, 42, 48, 54, 60)
PHILLY_CES_BUFFER = 20
CES_BUFFER_SHARE = 0.06
# The swept baselines' settings (BENCHMARKS.md `scaling`).
HEADROOM_NODES: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
HEADROOM_SHARES: tuple[float, ...] = (0.02, 0.05, 0.1, 0.2, 0.3, 0.5)
ROLLING_WINDOWS: tuple[int, ...] = (3, 6, 12, 36)
ROLLING_BUFFERS: tuple[int, ...] = (0, 2, 5, 10, 20)
CES_MULTIPLES: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0)
# Our planner with its forecast rules off (`PlannerPolicy.forecast_rules`): what the
# forecast adds is `predictive` against it.
NO_FORECAST = "predictive-no-forecast"
# Rows that are no baseline to match: ours (with or without the forecast), and the
# physical limit.
NOT_BASELINES = frozenset({"predictive", NO_FORECAST, "oracle"})


@dataclass(frozen=True)
class BenchSettings:
    lags: tuple[int, ...] = (0, 1)
    gpus_per_node: int | None = None  # a generic series counts GPUs when set
    calibration_days: float = 7.0
    policy: PlannerPolicy = field(default_factory=PlannerPolicy)
    step_minutes: int | None = None  # replay step; None: the protocol's (the model's) step
    knobs: tuple[float, ...] = ()  # `predictive` rows' target_shortage; (): the policy's own

    def planner_policies(self) -> list[PlannerPolicy]:
        """One planner policy per `predictive` row."""
        if not self.knobs:
            return [self.policy]
        return [self.policy.with_knob(target_shortage=k) for k in self.knobs]


def units_per_node(trace: DemandTrace, gpus_per_node: int | None) -> int:
    """How many demand units one node holds: Helios counts GPUs on 8-GPU nodes; a generic
    series counts nodes unless told it counts GPUs."""
    if trace.kind == "helios-vc":
        return 8
    if trace.kind == "series" and gpus_per_node:
        return gpus_per_node
    return 1


@dataclass(frozen=True)
class PreparedSeries:
    """One series ready to replay: demand in nodes, the raw units the planner reads, and the
    forecasts every policy that needs one shares."""

    series: ReplaySeries
    units: np.ndarray  # demand in the trace's unit (GPUs or nodes)
    per_node: int
    outlook: np.ndarray  # [t, k-1, j]: QUANTILES[j] of demand at step t-1+k, decided at t
    ces_future: tuple[np.ndarray, np.ndarray]  # [t]: CesPolicy's future_mean, future_mean2
    ces_buffer: int
    at: list[datetime]
    step: pd.Timedelta


@dataclass(frozen=True)
class PreparedTrace:
    series: list[PreparedSeries]
    fit_seconds: float
    forecast_seconds: float


def prepare_trace(
    trace: DemandTrace,
    make_forecaster: Callable[[], Forecaster],
    settings: BenchSettings,
) -> PreparedTrace:
    """Fit the model on training minus the calibration days and forecast every series."""
    # Every series is put on the protocol's step; its step is that one, not a diff over the
    # stacked frame (negative where one series ends and the next begins).
    step = STEP
    stepped = trace.resampled(step)
    frame = regularize(stepped.frame, step, fill="ffill").drop(columns="filled")
    per_node = units_per_node(trace, settings.gpus_per_node)
    calibration = round(pd.Timedelta(days=settings.calibration_days) / step)
    fine = _fine_frames(trace, step, settings.step_minutes)

    layouts = {}
    for uid, group in frame.groupby("unique_id", sort=True):
        ds = group["ds"].to_numpy()
        start = int(np.searchsorted(ds, np.datetime64(stepped.test_start)))
        end = int(np.searchsorted(ds, np.datetime64(stepped.test_end), side="right"))
        if start >= end or start < 2:
            continue
        warmup = max(start - min(calibration, start // 2), 1)
        layouts[str(uid)] = (group.reset_index(drop=True), ds, warmup, start, end)
    if not layouts:
        return PreparedTrace([], 0.0, 0.0)
    per_step = 1 if fine is None else step // fine.step  # the lag counts replay steps
    test_steps = {uid: (end - start) * per_step for uid, (*_, start, end) in layouts.items()}
    _check_lag(max(settings.lags), test_steps)

    fit_until = min(ds[warmup] for _, ds, warmup, _, _ in layouts.values())
    began = time.perf_counter()
    forecaster = make_forecaster().fit(frame[frame["ds"] < fit_until])
    fit_seconds = time.perf_counter() - began

    rows = max(settings.lags) + 1
    horizons = tuple(sorted({*range(1, rows + 1), *CES_HORIZONS}))
    prepared = []
    forecast_seconds = 0.0
    for uid, (group, ds, warmup, start, end) in layouts.items():
        began = time.perf_counter()
        outlook = rolling_outlook(forecaster, group, ds, warmup, horizons, QUANTILES)
        forecast_seconds += time.perf_counter() - began
        median = outlook[:, :, QUANTILES.index(0.5)]
        ces_future = (
            median @ horizon_mean_weights(horizons, CES_FUTURE),
            median @ horizon_mean_weights(horizons, 2 * CES_FUTURE),
        )
        replay_step = step
        if fine is not None:
            group, outlook, ces_future, (warmup, start, end) = _on_fine_steps(
                fine, uid, ds, step, outlook[:, :rows, :], ces_future, warmup
            )
            ds, replay_step = group["ds"].to_numpy(), fine.step
        units = group["y"].to_numpy(dtype=float)
        demand = whole_nodes_each(units / per_node)
        capacity = (
            whole_nodes_each(group["capacity"].to_numpy(dtype=float) / per_node)
            if "capacity" in group
            else None
        )
        static = capacity if capacity is not None else np.full(demand.size, demand[:start].max())
        prepared.append(
            PreparedSeries(
                series=ReplaySeries(
                    trace=trace.label,
                    series=uid,
                    ds=ds,
                    demand=demand,
                    static=static,
                    bound=capacity if trace.kind == "philly" else None,
                    warmup=warmup,
                    start=start,
                    end=end,
                    step=replay_step,
                ),
                units=units,
                per_node=per_node,
                outlook=outlook[:, :rows, :],
                ces_future=(ces_future[0] / per_node, ces_future[1] / per_node),
                ces_buffer=(
                    PHILLY_CES_BUFFER
                    if trace.kind == "philly"
                    else max(1, math.ceil(CES_BUFFER_SHARE * demand[:start].mean()))
                ),
                at=list(pd.DatetimeIndex(ds).to_pydatetime()),
                step=replay_step,
            )
        )
    return PreparedTrace(prepared, fit_seconds, forecast_seconds)


def _check_lag(lag: int, test_steps: dict[str, int]) -> None:
    """Refuse, before the forecasts (one per step and horizon up to the lag: minutes for a
    long one), a boot lag no shorter than a series' test window: no node requested there
    would be ready inside it, so no step is left to score."""
    for uid, steps in test_steps.items():
        if lag >= steps:
            raise InputError(
                f"a boot lag of {lag} steps (--lag) leaves nothing to score in the {steps}-step"
                f" test window of series {uid}"
            )


@dataclass(frozen=True)
class FineFrames:
    """The trace on the finer replay steps, with its test window on those steps."""

    frame: pd.DataFrame
    step: pd.Timedelta
    test_start: pd.Timestamp
    test_end: pd.Timestamp


def _fine_frames(
    trace: DemandTrace, step: pd.Timedelta, step_minutes: int | None
) -> FineFrames | None:
    """The trace on `step_minutes` steps, or None to replay on the model's own step."""
    if step_minutes is None:
        return None
    fine = pd.Timedelta(minutes=step_minutes)
    if fine > step or step % fine:
        raise InputError(
            f"replay step {step_minutes} min must divide the {step.total_seconds() / 60:g}-min "
            "step the model forecasts"
        )
    if fine == step:
        return None
    stepped = trace.resampled(fine)
    frame = regularize(stepped.frame, fine, fill="ffill").drop(columns="filled")
    return FineFrames(frame, fine, stepped.test_start, stepped.test_end)


def _on_fine_steps(
    fine: FineFrames,
    uid: str,
    ds: np.ndarray,
    step: pd.Timedelta,
    outlook: np.ndarray,
    ces_future: tuple[np.ndarray, np.ndarray],
    warmup: int,
) -> tuple[pd.DataFrame, np.ndarray, tuple[np.ndarray, np.ndarray], tuple[int, int, int]]:
    """Move one series' forecasts from model steps onto the fine replay steps.

    A decision at fine step t sees data up to t-1; the newest model forecast it may use was
    made at the start of t's model step b(t) from the steps before it. Row k-1 (demand at
    t-1+k) takes that forecast's row for the model step holding t-1+k: a forecast of a
    model step's peak minute bounds each of its minutes.
    """
    group = fine.frame[fine.frame["unique_id"] == uid].reset_index(drop=True)
    fine_ds = group["ds"].to_numpy()
    block = ((fine_ds - ds[0]) // step.to_timedelta64()).astype(np.int64)
    block = np.clip(block, 0, ds.size - 1)
    n, rows = fine_ds.size, outlook.shape[1]
    t = np.arange(n)
    fine_outlook = np.empty((n, rows, outlook.shape[2]))
    for k in range(1, rows + 1):
        ahead = block[np.minimum(t - 1 + k, n - 1)] - block
        fine_outlook[:, k - 1, :] = outlook[block, np.minimum(ahead, rows - 1), :]
    mapped = (ces_future[0][block], ces_future[1][block])
    fine_warmup = max(int(np.searchsorted(fine_ds, ds[warmup])), 1)
    start = int(np.searchsorted(fine_ds, np.datetime64(fine.test_start)))
    end = int(np.searchsorted(fine_ds, np.datetime64(fine.test_end), side="right"))
    return group, fine_outlook, mapped, (fine_warmup, start, end)


def trace_pool(prepared: PreparedSeries, lag: int) -> NodePool:
    """The replay's single pool: nodes of `per_node` units that boot in `lag` steps."""
    return NodePool(
        name=prepared.series.series,
        gpu_model="any",
        gpus_per_node=prepared.per_node,
        price_per_hour=1.0,
        boot_seconds=lag * prepared.step.total_seconds(),
        max_size=10**9,
    )


def planner_run(prepared: PreparedSeries, lag: int, policy: PlannerPolicy) -> ReplayOutcome:
    """Our planner (`predictive` row, or any knob setting of it; `predictive-no-forecast`
    where the policy's forecast rules are off) over one series."""
    step_seconds = prepared.step.total_seconds()
    return replay(
        prepared.series,
        PlannerPolicyRun(
            "predictive" if policy.forecast_rules else NO_FORECAST,
            policy.model_copy(update={"step_seconds": step_seconds}),
            trace_pool(prepared, lag),
            prepared.units,
            prepared.at,
            QUANTILES,
            prepared.outlook[:, : lag + 1, :],
        ),
        lag,
        {"knob": policy.target_shortage},
    )


def unneeded_steps(step: pd.Timedelta) -> int:
    """Cluster Autoscaler's 10-minute scale-down-unneeded-time, in replay steps."""
    return max(1, math.ceil(600 / step.total_seconds()))


def _ces(prepared: PreparedSeries, buffer: int) -> CesPolicy:
    return CesPolicy(
        prepared.series.demand,
        future_mean=prepared.ces_future[0],
        future_mean2=prepared.ces_future[1],
        buffer=buffer,
    )


def baseline_runs(prepared: PreparedSeries, lag: int) -> list[ReplayOutcome]:
    """`static`, `reactive`, `ces` and `oracle` over one series."""
    s = prepared.series
    step_seconds = prepared.step.total_seconds()
    # The capacity the cluster really had was there all along, never booting.
    static = dataclasses.replace(replay(s, StaticPolicy(s.static), 0), lag=lag)
    policies: Sequence[ReplayPolicy] = (
        PlannerPolicyRun(
            "reactive",
            PlannerPolicy(
                mode="reactive",
                step_seconds=step_seconds,
                unneeded_steps=unneeded_steps(prepared.step),
            ),
            trace_pool(prepared, lag),
            prepared.units,
            prepared.at,
        ),
        _ces(prepared, prepared.ces_buffer),
        OraclePolicy(s.demand, lag),
    )
    return [static, *(replay(s, policy, lag) for policy in policies)]


def sweep_runs(prepared: PreparedSeries, lag: int) -> list[ReplayOutcome]:
    """What teams run instead of a forecast, one row per setting: the buffers
    (`buffer_sweep_runs`) and `ces` at multiples of its buffer (knob: the buffer in nodes)."""
    out = buffer_sweep_runs(prepared.series, lag, unneeded_steps(prepared.step))
    for m in CES_MULTIPLES:
        buffer = whole_nodes(m * prepared.ces_buffer)
        out.append(
            replay(
                prepared.series,
                _ces(prepared, buffer),
                lag,
                {"knob": buffer, "buffer_multiple": m},
            )
        )
    return out


def buffer_sweep_runs(s: ReplaySeries, lag: int, unneeded: int) -> list[ReplayOutcome]:
    """The spare-capacity buffers, one row per setting: `headroom` (reactive plus k spare
    nodes), `headroom-percent` (plus ceil(p x demand)) and `rolling-max` (peak of the last W
    steps plus b); they need nothing but the demand."""

    def reactive_on(name: str, wanted: np.ndarray, knob: float) -> ReplayOutcome:
        return replay(s, ReactiveRule(name, wanted, unneeded, s.warmup), lag, {"knob": knob})

    out = [reactive_on("headroom", s.demand + k, k) for k in HEADROOM_NODES]
    out += [
        reactive_on("headroom-percent", s.demand + spare_nodes(s.demand, p), p)
        for p in HEADROOM_SHARES
    ]
    out += [
        replay(
            s,
            PlannedTargets("rolling-max", rolling_max_targets(s.demand, w, b)),
            lag,
            {"knob": b, "window_steps": w, "buffer_nodes": b},
        )
        for w in ROLLING_WINDOWS
        for b in ROLLING_BUFFERS
    ]
    return out


def bench_trace(
    trace: DemandTrace,
    make_forecaster: Callable[[], Forecaster],
    settings: BenchSettings,
) -> tuple[PreparedTrace, list[ReplayOutcome]]:
    """Replay every series of one trace under every policy, setting and lag."""
    prepared = prepare_trace(trace, make_forecaster, settings)
    outcomes = []
    for item in prepared.series:
        for lag in settings.lags:
            outcomes += baseline_runs(item, lag)
            outcomes += sweep_runs(item, lag)
            for p in settings.planner_policies():
                outcomes.append(planner_run(item, lag, p))
                outcomes.append(planner_run(item, lag, without_forecast(p)))
    return prepared, outcomes


def without_forecast(policy: PlannerPolicy) -> PlannerPolicy:
    """The same planner with no forecast-driven rule (the `predictive-no-forecast` row)."""
    return policy.model_copy(update={"forecast_rules": False})


Row = dict[str, object]


def lower_envelope(baselines: Sequence[Row]) -> list[Row]:
    """The baselines' cost/shortage frontier: by shortage node-steps, each row cheaper than
    every row with no more shortage (the cheapest baseline at each shortage level)."""
    out: list[Row] = []
    for row in sorted(baselines, key=lambda r: (r["shortage_node_steps"], r["provisioning_ratio"])):
        if not out or row["provisioning_ratio"] < out[-1]["provisioning_ratio"]:
            out.append(row)
    return out


def matched_baseline(envelope: Sequence[Row], row: Row) -> tuple[Row | None, float | None]:
    """The cheapest baseline of `envelope` short on no more node-steps than `row`, and the
    saving of `row` against it, 1 - its ratio / the baseline's (None, None: none is)."""
    shortage = float(row["shortage_node_steps"])
    within = [r for r in envelope if r["shortage_node_steps"] <= shortage]
    if not within:
        return None, None
    match = within[-1]
    return match, 1 - float(row["provisioning_ratio"]) / float(match["provisioning_ratio"])


def tuned_buffer(baselines: Sequence[Row], knob: float) -> Row | None:
    """The buffer a team would have tuned by hand the week before: the planner's own choice
    (`cheapest_within`) made on the warm-up steps, the baseline row cheapest there among
    those short on no more than `knob` of them (when none is, the one short least often,
    cheapest among those). Chosen on the warm-up alone, it is then judged on the test
    window like our planner."""
    # Over one series the warm-up ratio orders rows as their nodes paid do; sorted by
    # label, a tie goes to the first label.
    seen = sorted(
        (r for r in baselines if r.get("warmup_provisioning_ratio") is not None), key=row_label
    )
    if not seen:
        return None
    records = [
        RuleRecord(i, float(r["warmup_short_share"]), float(r["warmup_provisioning_ratio"]), 0)
        for i, r in enumerate(seen)
    ]
    return seen[cheapest_within(records, knob).rule]


def row_label(row: Row) -> str:
    """A row's policy and setting in a few characters (`rolling-max W12+5`, `headroom 4`)."""
    if row.get("window_steps") is not None:
        return f"{row['policy']} W{row['window_steps']}+{row['buffer_nodes']}"
    knob = row.get("knob")
    return str(row["policy"]) if knob is None else f"{row['policy']} {knob:g}"


def summarize(rows: Sequence[Row]) -> list[Row]:
    """Cost at matched shortage: per series and lag, each `predictive` point against its
    matched baseline (the cheapest row of any baseline, `static` and `reactive` included,
    `oracle` not, with no more shortage node-steps); saving = 1 - ours / matched. Also the
    realised share of short steps, which the knob promises."""
    groups: dict[tuple[object, object, object], list[Row]] = {}
    for r in rows:
        groups.setdefault((r["trace"], r["series"], r["lag_steps"]), []).append(r)
    out = []
    for key in sorted(groups):
        group = groups[key]
        baselines = [r for r in group if r["policy"] not in NOT_BASELINES]
        envelope = lower_envelope(baselines)
        by_policy = {r["policy"]: r for r in group if r.get("knob") is None}
        reactive, oracle = by_policy.get("reactive"), by_policy.get("oracle")
        no_forecast = {r["knob"]: r for r in group if r["policy"] == NO_FORECAST}
        for ours in (r for r in group if r["policy"] == "predictive"):
            match, saving = matched_baseline(envelope, ours)
            tuned = tuned_buffer(baselines, float(ours["knob"]))
            out.append(
                {
                    "trace": key[0],
                    "series": key[1],
                    "lag_steps": key[2],
                    "knob": ours["knob"],
                    "predictive_ratio": ours["provisioning_ratio"],
                    "predictive_events": ours["shortage_events"],
                    "predictive_node_steps": ours["shortage_node_steps"],
                    "steps": ours["steps"],
                    "short_share": ours["shortage_events"] / ours["steps"],
                    "matched": None if match is None else row_label(match),
                    "matched_policy": None if match is None else match["policy"],
                    "matched_knob": None if match is None else match.get("knob"),
                    "matched_window_steps": None if match is None else match.get("window_steps"),
                    "matched_ratio": None if match is None else match["provisioning_ratio"],
                    "matched_events": None if match is None else match["shortage_events"],
                    "matched_node_steps": None if match is None else match["shortage_node_steps"],
                    "saving": saving,
                    "reactive_node_steps": None
                    if reactive is None
                    else reactive["shortage_node_steps"],
                    "oracle_ratio": None if oracle is None else oracle["provisioning_ratio"],
                    **_against_tuned(ours, tuned, envelope),
                    **_against_no_forecast(ours, saving, no_forecast.get(ours["knob"]), envelope),
                }
            )
    return out


# What `_against_no_forecast` reports, all None where the run had no such row.
_NO_FORECAST_FIELDS = (
    "no_forecast_ratio",
    "no_forecast_events",
    "no_forecast_node_steps",
    "no_forecast_saving",
    "forecast_gain",
    "forecast_differs",
)


def _against_no_forecast(
    ours: Row, saving: float | None, plain: Row | None, envelope: Sequence[Row]
) -> Row:
    """A predictive point next to the same planner without its forecast rules at the same
    knob: that row's cost and shortage, its own saving against the envelope at its shortage
    (`no_forecast_saving`), and what the forecast is worth at matched shortage,
    `forecast_gain` = saving - no_forecast_saving (each priced against the same envelope at
    its own shortage, as `tuned_matched_saving` is); `forecast_differs`: whether the two
    rows differ at all in cost or shortage (where they do not, the forecast changed no
    decision that mattered)."""
    if plain is None:
        return dict.fromkeys(_NO_FORECAST_FIELDS)
    _, plain_saving = matched_baseline(envelope, plain)
    fields = ("provisioning_ratio", "shortage_events", "shortage_node_steps")
    return {
        "no_forecast_ratio": plain["provisioning_ratio"],
        "no_forecast_events": plain["shortage_events"],
        "no_forecast_node_steps": plain["shortage_node_steps"],
        "no_forecast_saving": plain_saving,
        "forecast_gain": None if saving is None or plain_saving is None else saving - plain_saving,
        "forecast_differs": any(ours[f] != plain[f] for f in fields),
    }


def in_band_if_calibrated(knob: float, steps: int) -> float:
    """The chance that a policy short on each step independently with probability `knob`
    lands in the band [knob / 2, 2 x knob] over `steps` steps: its short steps are then
    Poisson with mean knob x steps. At three short steps per 1,000 over ten days the band
    holds 3 to 8 of 1,440 steps and a calibrated policy misses it on about one series in
    five; short steps come in bursts (a jump short for two steps), which widens the count
    and misses more, so this is the most a calibrated policy can be expected to reach."""
    mean = knob * steps
    low, high = math.ceil(steps * knob / 2 - 1e-9), math.floor(steps * knob * 2 + 1e-9)
    term, total = math.exp(-mean), 0.0  # P(X = 0), then P(X = k) by the ratio mean / k
    for k in range(high + 1):
        if k:
            term *= mean / k
        if k >= low:
            total += term
    return total


# What `_against_tuned` reports, all None where no buffer was tuned.
_TUNED_FIELDS = (
    "tuned",
    "tuned_ratio",
    "tuned_events",
    "tuned_node_steps",
    "tuned_short_share",
    "tuned_saving",
    "tuned_matched_saving",
    "no_worse_on_both",
)


def _against_tuned(ours: Row, tuned: Row | None, envelope: Sequence[Row]) -> Row:
    """A predictive point next to the buffer tuned on the warm-up (`tuned_buffer`): its
    label, test ratio and shortage, our saving against it, which side is no worse on both
    cost and shortage node-steps (`ours`, `tuned`, `both` when equal, None when each wins
    one), and its own saving against the test window's envelope at its shortage
    (`tuned_matched_saving`, at most 0: it is one of the baselines), the yardstick for
    ours: how far from the best setting in hindsight a setting chosen the week before
    lands."""
    if tuned is None:
        return dict.fromkeys(_TUNED_FIELDS)
    _, tuned_matched_saving = matched_baseline(envelope, tuned)
    ratio, short = float(ours["provisioning_ratio"]), float(ours["shortage_node_steps"])
    their_ratio, their_short = (
        float(tuned["provisioning_ratio"]),
        float(tuned["shortage_node_steps"]),
    )
    ours_no_worse = ratio <= their_ratio and short <= their_short
    theirs_no_worse = their_ratio <= ratio and their_short <= short
    return {
        "tuned": row_label(tuned),
        "tuned_ratio": their_ratio,
        "tuned_events": tuned["shortage_events"],
        "tuned_node_steps": their_short,
        "tuned_short_share": tuned["shortage_events"] / tuned["steps"],
        "tuned_saving": 1 - ratio / their_ratio,
        "tuned_matched_saving": tuned_matched_saving,
        "no_worse_on_both": {
            (True, True): "both",
            (True, False): "ours",
            (False, True): "tuned",
        }.get((ours_no_worse, theirs_no_worse)),
    }


def in_band(knob: float, share: object) -> bool:
    """What the knob promises: a realised share of short steps in [knob / 2, 2 x knob]."""
    return share is not None and knob / 2 <= float(share) <= 2 * knob


def mean_of(points: Sequence[Row], key: str) -> float | None:
    """The mean of `key` over the points that have one (None when none has)."""
    values = [float(p[key]) for p in points if p.get(key) is not None]
    return float(np.mean(values)) if values else None


def overview(summary: Sequence[Row]) -> list[Row]:
    """Per trace, lag and knob, over its series: how many points a baseline matches, the
    mean and worst saving over those, and the share of series whose realised share of
    short steps lies in [knob / 2, 2 x knob] (what the knob promises), next to the share a
    calibrated policy would be expected to reach (`in_band_if_calibrated`); and against
    the buffer tuned on the warm-up, its mean saving against the envelope at its own
    shortage (`tuned_mean_saving`, to read next to ours), the share of series where its
    short steps kept the knob's band (`tuned_in_band`), the points where ours is no
    worse on both cost and shortage (`ours_no_worse`) and where it is (`tuned_no_worse`;
    equal points count in both); and against the planner without its forecast rules, its
    mean saving against the envelope (`no_forecast_mean_saving`), the mean of ours less it
    (`forecast_mean_gain`) and the points where the two differ (`forecast_points_differ`)."""
    groups: dict[tuple[str, int, float], list[Row]] = {}
    for s in summary:
        key = (str(s["trace"]), int(s["lag_steps"]), float(s["knob"]))
        groups.setdefault(key, []).append(s)
    out = []
    for (trace, lag, knob), points in sorted(groups.items()):
        savings = [float(p["saving"]) for p in points if p["saving"] is not None]
        kept = [in_band(knob, p["short_share"]) for p in points]
        out.append(
            {
                "trace": trace,
                "lag_steps": lag,
                "knob": knob,
                "series": len(points),
                "matched": len(savings),
                "mean_saving": mean_of(points, "saving"),
                "worst_saving": min(savings) if savings else None,
                "share_in_band": float(np.mean(kept)),
                "calibrated_in_band": float(
                    np.mean([in_band_if_calibrated(knob, int(p["steps"])) for p in points])
                ),
                "tuned_mean_saving": mean_of(points, "tuned_matched_saving"),
                "tuned_in_band": float(
                    np.mean([in_band(knob, p.get("tuned_short_share")) for p in points])
                ),
                "ours_no_worse": sum(p.get("no_worse_on_both") in ("ours", "both") for p in points),
                "tuned_no_worse": sum(
                    p.get("no_worse_on_both") in ("tuned", "both") for p in points
                ),
                **_forecast_worth(points),
            }
        )
    return out


def _forecast_worth(points: Sequence[Row]) -> Row:
    """Over some predictive points: the planner without its forecast rules against the
    envelope, what the forecast adds at matched shortage, and on how many points it
    changed the outcome at all."""
    return {
        "no_forecast_mean_saving": mean_of(points, "no_forecast_saving"),
        "forecast_mean_gain": mean_of(points, "forecast_gain"),
        "forecast_points_differ": sum(bool(p.get("forecast_differs")) for p in points),
    }


def by_lag_and_knob(summary: Sequence[Row]) -> list[Row]:
    """Per lag and knob, over every series of every trace: ours against the envelope
    (`mean_saving`), against the buffer tuned the week before (`mean_over_tuned`, the mean
    of saving - tuned_matched_saving: how much cheaper ours is than that team's buffer,
    both priced against the same envelope) and against itself without the forecast
    (`_forecast_worth`): the figures BENCHMARKS.md's targets are read from."""
    groups: dict[tuple[int, float], list[Row]] = {}
    for s in summary:
        groups.setdefault((int(s["lag_steps"]), float(s["knob"])), []).append(s)
    out = []
    for (lag, knob), points in sorted(groups.items()):
        over_tuned = [
            {"gap": float(p["saving"]) - float(p["tuned_matched_saving"])}
            for p in points
            if p["saving"] is not None and p.get("tuned_matched_saving") is not None
        ]
        out.append(
            {
                "lag_steps": lag,
                "knob": knob,
                "points": len(points),
                "mean_saving": mean_of(points, "saving"),
                "tuned_mean_saving": mean_of(points, "tuned_matched_saving"),
                "mean_over_tuned": mean_of(over_tuned, "gap"),
                **_forecast_worth(points),
            }
        )
    return out
