"""The trace replay follows BENCHMARKS.md to the letter, and runs on slices of real traces."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from replay_fixtures import STEP, bench_vc_slice
from replay_fixtures import hand_series as series

from predictor.data.loaders import load_trace
from predictor.foundation.errors import InputError
from predictor.models import build
from predictor.models.forecast import Forecaster
from scaler.cluster.pools import NodePool
from scaler.evaluation.replay import (
    CesPolicy,
    OraclePolicy,
    PlannerPolicyRun,
    ReactiveRule,
    ReplayOutcome,
    StaticPolicy,
    horizon_mean_weights,
    replay,
)
from scaler.evaluation.scaling_bench import (
    CES_MULTIPLES,
    HEADROOM_NODES,
    HEADROOM_SHARES,
    NOT_BASELINES,
    ROLLING_BUFFERS,
    ROLLING_WINDOWS,
    BenchSettings,
    PreparedSeries,
    bench_trace,
    in_band_if_calibrated,
    overview,
    planner_run,
    prepare_trace,
    summarize,
    sweep_runs,
)
from scaler.planning.planner import PlannerPolicy


def empirical_model() -> Forecaster:
    """The benchmark's baseline quantile model: fast, and enough to drive the replay."""
    return build("empirical")


@dataclass
class Scripted:
    """Targets fixed in advance; records what the replay showed it."""

    targets: list[int]
    name: str = "scripted"

    def __post_init__(self) -> None:
        self.seen: list[tuple[int, int, int]] = []

    def target(self, t: int, ready: int, booting: int) -> int:
        self.seen.append((t, ready, booting))
        return self.targets[t]


def test_lag_one_nodes_serve_from_the_next_step_and_are_paid_from_the_request() -> None:
    s = series([0, 2, 5, 5, 1])
    policy = Scripted([0, 2, 5, 5, 1])
    out = replay(s, policy, lag=1)
    assert out.paid.tolist() == [2, 5, 5, 1]
    assert out.ready.tolist() == [0, 2, 5, 1]  # removal is instant, additions one step late
    assert out.shortage.tolist() == [2, 3, 0, 0]
    assert out.actions == 3
    assert policy.seen[:3] == [(1, 0, 0), (2, 2, 0), (3, 5, 0)]


def test_removal_cancels_booting_nodes_before_ready_ones() -> None:
    s = series([0, 0, 0, 0, 0])
    out = replay(s, Scripted([0, 4, 6, 3, 3]), lag=2)
    # Step 2: 4 booting (ready at 3), 2 more booting (ready at 4); step 3: 4 are ready,
    # the target 3 cancels the 2 still booting and one ready node.
    assert out.ready.tolist() == [0, 0, 3, 3]


def test_fleet_never_exceeds_the_capacity_bound() -> None:
    s = series([0, 9, 9, 9], bound=[5, 5, 5, 5])
    out = replay(s, Scripted([9, 9, 9, 9]), lag=0)
    assert out.paid.max() == 5
    assert out.shortage.tolist() == [4, 4, 4]


def test_oracle_is_short_nowhere_and_pays_the_lead() -> None:
    rng = np.random.default_rng(1)
    demand = np.clip(np.cumsum(rng.integers(-5, 6, size=300)) + 60, 0, None).astype(float)
    s = series(demand.tolist(), warmup=1, start=10)
    for lag in (0, 1, 3):
        out = replay(s, OraclePolicy(demand, lag), lag)
        assert out.shortage.sum() == 0
        expected = sum(demand[t : t + lag + 1].max() for t in range(10, demand.size))
        assert out.paid.sum() == expected


def test_static_holds_the_real_capacity() -> None:
    out = replay(series([3, 4, 12, 5], start=2), StaticPolicy(np.full(4, 10.0)), lag=1)
    assert out.paid.tolist() == [10, 10]
    assert out.shortage.tolist() == [2, 0]


@pytest.mark.parametrize(("lag", "short", "ratio"), [(0, 2 / 4, 40 / 35), (1, 2 / 3, 30 / 31)])
def test_the_warm_up_is_scored_apart_from_the_test_window(
    lag: int, short: float, ratio: float
) -> None:
    """Steps 1-4 warm up, 5-7 are the test; the fleet starts empty, so a lag's first steps
    are left out of the warm-up's score."""
    s = series([3, 4, 12, 5, 14, 6, 2, 8], warmup=1, start=5)
    out = replay(s, StaticPolicy(np.full(8, 10.0)), lag=lag)
    assert out.shortage.tolist() == [0, 0, 0]  # the test window only: 6, 2, 8
    row = out.row()
    assert row["warmup_short_share"] == pytest.approx(short)
    assert row["warmup_provisioning_ratio"] == pytest.approx(ratio)
    assert replay(series([3, 4, 5]), StaticPolicy(np.full(3, 10.0)), 0).warmup_ratio is None


def test_ces_scales_to_demand_plus_buffer_after_a_shortage_and_keeps() -> None:
    demand = [10.0, 10, 20, 20, 12, 11, 10, 9, 8, 7, 6, 5]
    flat = np.full(len(demand), 0.0)  # the forecast points down
    ces = CesPolicy(np.asarray(demand), flat, flat, buffer=2, keep=3)
    out = replay(series(demand), ces, lag=0)
    fleet = out.paid.tolist()
    assert fleet[0] == 12  # first step: demand seen + buffer
    assert fleet[2] == 22  # step 3 saw step 2 short (20 > 12): 20 + 2
    assert fleet[3:5] == [22, 22]  # kept for 3 steps though demand falls
    assert fleet[-1] == 8  # later it follows the falling demand down to demand + buffer


def test_horizon_mean_weights_interpolate_between_sampled_horizons() -> None:
    horizons = [1, 2, 4, 8]
    w = horizon_mean_weights(horizons, 8)
    line = np.array([float(h) for h in horizons])  # forecast = horizon
    assert line @ w == pytest.approx(4.5)
    assert w.sum() == pytest.approx(1.0)


def test_philly_static_matches_an_independent_computation(traces_dir: Path) -> None:
    """The harness check of BENCHMARKS.md: static provisions 1.450 x demand, never short."""
    raw = pd.read_csv(traces_dir / "philly" / "philly_node_sequence.csv.gz", parse_dates=["time"])
    window = raw.set_index("time").resample("10min").max().loc["2017-12-01":"2017-12-14 23:50"]
    independent = window["total"].sum() / window["active"].sum()
    assert independent == pytest.approx(1.450, abs=0.0073)

    prepared = prepare_trace(
        load_trace(f"philly:{traces_dir / 'philly' / 'philly_node_sequence.csv.gz'}"),
        empirical_model,
        BenchSettings(lags=(0,)),
    )
    (item,) = prepared.series
    row = replay(item.series, StaticPolicy(item.series.static), 0).row()
    assert row["provisioning_ratio"] == pytest.approx(independent, rel=1e-9)
    assert row["shortage_node_steps"] == 0
    assert row["steps"] == 14 * 144


@pytest.fixture(scope="module")
def vclJZ_bench(traces_dir: Path) -> tuple[PreparedSeries, list[ReplayOutcome]]:
    """One Helios VC slice through the whole bench at L = 0 and 1 (one replay each)."""
    spec = f"helios-vc:{traces_dir / 'helios-earth' / 'vcLJZ.csv.gz'}"
    trace = load_trace(spec, split="2020-05-29")
    policy = PlannerPolicy(mode="hybrid", target_shortage=0.05)
    settings = BenchSettings(lags=(0, 1), policy=policy, knobs=(0.01, 0.05))
    prepared, outcomes = bench_trace(trace, empirical_model, settings)
    (item,) = prepared.series
    return item, outcomes


def test_replay_on_a_helios_vc_slice_beats_reactive_on_shortage(
    vclJZ_bench: tuple[PreparedSeries, list[ReplayOutcome]],
) -> None:
    _, outcomes = vclJZ_bench
    rows = [o.row() for o in outcomes]
    assert {r["policy"] for r in rows} == {
        "static", "reactive", "ces", "oracle", "predictive", "predictive-no-forecast",
        "headroom", "headroom-percent", "rolling-max",
    }  # fmt: skip
    assert all(r["steps"] == int(rows[0]["steps"]) for r in rows)
    swept = len(HEADROOM_NODES) + len(HEADROOM_SHARES) + len(CES_MULTIPLES)
    swept += len(ROLLING_WINDOWS) * len(ROLLING_BUFFERS)
    # per lag: 4 baselines, the sweeps, 2 knobs with and without the forecast
    assert len(rows) == 2 * (4 + swept + 2 * 2)
    by = {(r["policy"], r["knob"], r["lag_steps"]): r for r in rows}
    for lag in (0, 1):
        ours, reactive = by["predictive", 0.05, lag], by["reactive", None, lag]
        # At a loose knob the tuned spare capacity may be none: never short more than reactive.
        assert ours["shortage_node_steps"] <= reactive["shortage_node_steps"]
        assert by["predictive", 0.01, lag]["shortage_node_steps"] <= ours["shortage_node_steps"]
        assert by["oracle", None, lag]["shortage_node_steps"] == 0
        assert ours["provisioning_ratio"] < by["static", None, lag]["provisioning_ratio"]
        # more headroom: never cheaper, never shorter
        headroom = [by["headroom", k, lag] for k in HEADROOM_NODES]
        ratios = [r["provisioning_ratio"] for r in headroom]
        assert ratios == sorted(ratios)
        short = [r["shortage_node_steps"] for r in headroom]
        assert short == sorted(short, reverse=True)
    summary = summarize(rows)
    assert {(s["knob"], s["lag_steps"]) for s in summary} == {
        (k, lag) for k in (0.01, 0.05) for lag in (0, 1)
    }
    for s in summary:
        assert s["series"] == "vcLJZ"
        if s["saving"] is not None:
            assert s["matched_node_steps"] <= s["predictive_node_steps"]


def test_the_reactive_rule_is_the_planners_reactive_mode(
    vclJZ_bench: tuple[PreparedSeries, list[ReplayOutcome]],
) -> None:
    """`headroom` is reactive plus spare nodes: with none it is the `reactive` row exactly, on
    the trace slice and on a hand-made series with a 3-step unneeded time and a capacity cap."""
    item, outcomes = vclJZ_bench
    s = item.series
    for lag in (0, 1):
        (reactive,) = [o for o in outcomes if o.policy == "reactive" and o.lag == lag]
        rule = replay(s, ReactiveRule("headroom", s.demand, 1, s.warmup), lag)
        assert np.array_equal(rule.paid, reactive.paid)

    demand = [3.0, 5, 9, 2, 2, 2, 7, 1, 1, 1, 1, 12, 12, 4, 0, 0, 6]
    hand = series(demand, warmup=2, start=3, bound=[10.0] * 8 + [8.0] * 9)
    pool = NodePool(name="p", gpu_model="any", gpus_per_node=1, price_per_hour=1.0, max_size=99)
    at = list(pd.DatetimeIndex(hand.ds).to_pydatetime())
    for lag in (0, 1, 2):
        planner = PlannerPolicyRun(
            "reactive",
            PlannerPolicy(mode="reactive", unneeded_steps=3),
            pool.model_copy(update={"boot_seconds": lag * 600.0}),
            hand.demand,
            at,
        )
        rule = ReactiveRule("headroom", hand.demand, 3, hand.warmup)
        assert replay(hand, rule, lag).paid.tolist() == replay(hand, planner, lag).paid.tolist()


# --------------------------------------------------- an independent replay of the baselines


def independent_replay(
    demand: np.ndarray,
    decide: object,
    warmup: int,
    start: int,
    lag: int,
    bound: np.ndarray | None = None,
) -> tuple[float, int, float]:
    """BENCHMARKS.md `scaling`, node by node: `decide(t, fleet)` sets the target (fleet =
    nodes paid after step t-1); each node remembers the step it was requested, new nodes
    go last and nodes leave from the end (the newest first), a node serves once `lag` steps
    have passed since its request. Returns (provisioning ratio, events, node-steps)."""
    nodes: list[int] = []
    paid = short = 0.0
    events = 0
    for t in range(warmup, demand.size):
        want = max(int(decide(t, len(nodes))), 0)
        if bound is not None:
            want = min(want, int(bound[t]))
        while len(nodes) < want:
            nodes.append(t)
        del nodes[want:]
        if t >= start:
            ready = sum(1 for asked in nodes if asked + lag <= t)
            lack = max(demand[t] - ready, 0.0)
            paid += len(nodes)
            short += lack
            events += lack > 0
    return paid / demand[start:].sum(), events, short


def ceil_share(demand: np.ndarray, share: float) -> np.ndarray:
    """ceil(share x demand) in exact integer arithmetic."""
    num, den = Fraction(share).limit_denominator(1000).as_integer_ratio()
    return np.array([-(-int(d) * num // den) for d in demand], dtype=float)


def independent_ces(
    demand: np.ndarray, future: np.ndarray, future2: np.ndarray, buffer: int
) -> object:
    """The Helios CES rule written out from its description (keep 10 steps after a
    scale-up; history 2; scale down only when the trend and the forecast both point down)."""
    state = {"started": False, "stable_until": -1}

    def decide(t: int, fleet: int) -> int:
        last = demand[t - 1]
        if not state["started"]:
            state["started"] = True
            return math.ceil(last) + buffer
        if fleet < last:
            fleet = math.ceil(last) + buffer
            state["stable_until"] = t + 10
        before = demand[max(t - 3, 0) : t - 1]
        trend = (sum(before) / len(before) - last) if len(before) else 0.0
        if (
            trend >= 0.1
            and last - future[t] >= 0
            and t >= state["stable_until"]
            and future[t] >= future2[t]
        ):
            state["stable_until"] = t
            fleet = min(fleet, math.ceil(last) + buffer)
        return fleet

    return decide


def independent_rows(
    demand: np.ndarray,
    warmup: int,
    start: int,
    lag: int,
    bound: np.ndarray | None,
    ces: tuple[np.ndarray, np.ndarray, int] | None = None,
) -> dict[tuple[str, float, int | None], tuple[float, int, float]]:
    """Every swept baseline, keyed (policy, knob, window); Cluster Autoscaler's unneeded
    time is one step (10 minutes), so reactive is "the demand seen last step"."""
    seen = pd.Series(demand).shift(1).fillna(0).to_numpy()

    def run(targets: np.ndarray) -> tuple[float, int, float]:
        return independent_replay(demand, lambda t, _: targets[t], warmup, start, lag, bound)

    out = {}
    for k in HEADROOM_NODES:
        out["headroom", k, None] = run(seen + k)
    for p in HEADROOM_SHARES:
        out["headroom-percent", p, None] = run(seen + ceil_share(seen, p))
    for w in ROLLING_WINDOWS:
        peak = np.array([max(demand[max(t - w, 0) : t], default=0) for t in range(demand.size)])
        for b in ROLLING_BUFFERS:
            out["rolling-max", b, w] = run(peak + b)
    if ces is not None:
        future, future2, base = ces
        for m in CES_MULTIPLES:
            buffer = math.ceil(m * base)
            decide = independent_ces(demand, future, future2, buffer)
            out["ces", buffer, None] = independent_replay(demand, decide, warmup, start, lag, bound)
    return out


def assert_rows_match(
    outcomes: list[ReplayOutcome],
    expected: dict[tuple[str, float, int | None], tuple[float, int, float]],
) -> None:
    got = {}
    for o in outcomes:
        row = o.row()
        key = (row["policy"], row["knob"], row.get("window_steps"))
        got[key] = (row["provisioning_ratio"], row["shortage_events"], row["shortage_node_steps"])
    assert got.keys() == expected.keys()
    for key, (ratio, events, node_steps) in expected.items():
        assert got[key][0] == pytest.approx(ratio, rel=1e-12), key
        assert got[key][1:] == (events, node_steps), key


def hand_prepared(demand: list[float], bound: list[float] | None = None) -> PreparedSeries:
    s = series(demand, warmup=3, start=6, bound=bound)
    n = s.demand.size
    rng = np.random.default_rng(7)
    return PreparedSeries(
        series=s,
        units=s.demand,
        per_node=1,
        outlook=np.zeros((n, 2, 3)),
        ces_future=(s.demand + rng.normal(0, 2, n), s.demand + rng.normal(0, 2, n)),
        ces_buffer=3,
        at=list(pd.DatetimeIndex(s.ds).to_pydatetime()),
        step=STEP,
    )


@pytest.mark.parametrize("lag", [0, 1, 2])
@pytest.mark.parametrize("capped", [False, True])
def test_swept_baselines_match_an_independent_replay_on_a_hand_made_series(
    lag: int, capped: bool
) -> None:
    rng = np.random.default_rng(3)
    walk = np.clip(np.cumsum(rng.integers(-6, 7, size=160)) + 30, 0, None)
    demand = (walk + 8 * (rng.random(160) < 0.05)).astype(float).tolist()  # and some bursts
    bound = [45.0] * 80 + [38.0] * 80 if capped else None
    item = hand_prepared(demand, bound)
    s = item.series
    expected = independent_rows(
        s.demand, s.warmup, s.start, lag, s.bound, (*item.ces_future, item.ces_buffer)
    )
    outcomes = sweep_runs(item, lag)
    assert_rows_match(outcomes, expected)
    rolling = [o.row() for o in outcomes if o.policy == "rolling-max"]
    assert all(r["buffer_nodes"] == r["knob"] for r in rolling)
    assert {r["window_steps"] for r in rolling} == set(ROLLING_WINDOWS)
    ces = [o.row() for o in outcomes if o.policy == "ces"]
    assert [(r["buffer_multiple"], r["knob"]) for r in ces] == [(0.5, 2), (1, 3), (2, 6), (4, 12)]


def test_swept_baselines_match_an_independent_replay_on_a_helios_slice(
    vclJZ_bench: tuple[PreparedSeries, list[ReplayOutcome]],
) -> None:
    item, outcomes = vclJZ_bench
    s = item.series
    swept = {"headroom", "headroom-percent", "rolling-max"}
    for lag in (0, 1):
        mine = [o for o in outcomes if o.lag == lag and (o.policy in swept or o.setting)]
        mine = [o for o in mine if o.policy not in NOT_BASELINES]
        ces = (*item.ces_future, item.ces_buffer)
        assert_rows_match(mine, independent_rows(s.demand, s.warmup, s.start, lag, None, ces))


def test_cost_at_matched_shortage_is_set_against_the_cheapest_baseline_with_no_more() -> None:
    def row(lag: int, policy: str, ratio: float, short: float, knob: float | None = None) -> dict:
        return {
            "trace": "t", "series": "s", "lag_steps": lag, "policy": policy, "knob": knob,
            "provisioning_ratio": ratio, "shortage_events": int(short // 2),
            "shortage_node_steps": short, "steps": 100,
        }  # fmt: skip

    rows = [
        row(0, "static", 1.45, 0),
        row(0, "reactive", 1.0, 300),
        row(0, "headroom", 1.10, 20, 2),
        row(0, "rolling-max", 1.08, 20, 5) | {"window_steps": 12, "buffer_nodes": 5},
        row(0, "ces", 1.20, 5, 40),
        row(0, "oracle", 1.0, 0),  # the physical limit, no baseline
        row(0, "predictive", 1.05, 25, 0.01),
        row(0, "predictive", 1.30, 4, 0.001),
        row(0, "predictive", 1.00, 400, 0.1),
        row(1, "reactive", 1.0, 300),
        row(1, "headroom", 1.5, 30, 32),
        row(1, "predictive", 1.2, 10, 0.01),
    ]
    summary = {(s["lag_steps"], s["knob"]): s for s in summarize(rows)}
    assert summary.keys() == {(0, 0.01), (0, 0.001), (0, 0.1), (1, 0.01)}
    point = summary[0, 0.01]
    assert (point["matched_policy"], point["matched_knob"]) == ("rolling-max", 5)
    assert point["matched_window_steps"] == 12 and point["matched"] == "rolling-max W12+5"
    assert point["matched_ratio"] == 1.08 and point["matched_node_steps"] == 20
    assert point["saving"] == pytest.approx(1 - 1.05 / 1.08)
    assert point["short_share"] == pytest.approx(12 / 100)
    assert point["reactive_node_steps"] == 300 and point["oracle_ratio"] == 1.0
    # 4 node-steps short: only static lacks no more (oracle does not count)
    assert summary[0, 0.001]["matched_policy"] == "static"
    assert summary[0, 0.001]["saving"] == pytest.approx(1 - 1.30 / 1.45)
    # more shortage than every baseline: the cheapest of all, reactive, and a loss of 0
    assert summary[0, 0.1]["matched"] == "reactive" and summary[0, 0.1]["saving"] == 0
    # no baseline lacks as little: no match
    assert summary[1, 0.01]["matched"] is None and summary[1, 0.01]["saving"] is None

    totals = {(o["lag_steps"], o["knob"]): o for o in overview(list(summary.values()))}
    assert totals[0, 0.1]["share_in_band"] == 0.0  # 200 / 100 steps short, not 5-20 %
    assert totals[0, 0.01]["matched"] == 1 and totals[1, 0.01]["matched"] == 0
    assert totals[1, 0.01]["mean_saving"] is None
    # 100 steps at a knob of 0.01: a calibrated policy is short once on average, and the
    # band (1 or 2 short steps) holds P(1) + P(2) of a Poisson count of mean 1
    assert totals[0, 0.01]["calibrated_in_band"] == pytest.approx(math.exp(-1) * 1.5)


def test_the_tuned_buffer_is_chosen_on_the_warm_up_and_judged_on_the_test() -> None:
    def row(policy: str, knob: float | None, test: tuple, warm: tuple | None) -> dict:
        return {
            "trace": "t", "series": "s", "lag_steps": 0, "policy": policy, "knob": knob,
            "provisioning_ratio": test[0], "shortage_node_steps": test[1],
            "shortage_events": test[1], "steps": 1000,
            "warmup_short_share": None if warm is None else warm[0],
            "warmup_provisioning_ratio": None if warm is None else warm[1],
        }  # fmt: skip

    rows = [
        row("reactive", None, (1.0, 90), (0.05, 1.0)),
        row("headroom", 1, (1.2, 12), (0.004, 1.2)),  # cheapest within 0.005 on the warm-up
        row("headroom", 2, (1.3, 2), (0.0, 1.3)),
        row("rolling-max", 3, (1.1, 5), (0.006, 1.1)) | {"window_steps": 6, "buffer_nodes": 3},
        row("predictive", 0.005, (1.15, 6), None),  # cheaper and short less than headroom 1
        row("predictive", 0.0001, (1.4, 3), None),  # none within: headroom 2, short least
    ]
    summary = {s["knob"]: s for s in summarize(rows)}
    point = summary[0.005]
    assert point["matched"] == "rolling-max W6+3"  # the test window's envelope, as before
    assert point["tuned"] == "headroom 1" and point["tuned_node_steps"] == 12
    assert point["tuned_saving"] == pytest.approx(1 - 1.15 / 1.2)
    assert point["no_worse_on_both"] == "ours"
    # headroom 1 is short 12 node-steps; the test window's cheapest with no more is
    # rolling-max W6+3 (5 node-steps, 1.1)
    assert point["tuned_matched_saving"] == pytest.approx(1 - 1.2 / 1.1)
    assert summary[0.0001]["tuned"] == "headroom 2"
    assert summary[0.0001]["no_worse_on_both"] == "tuned"
    # a series with no warm-up score: the same fields, every tuned one None
    unseen = [r | {"warmup_short_share": None, "warmup_provisioning_ratio": None} for r in rows]
    blind = summarize(unseen)[0]
    assert blind.keys() == point.keys()
    tuned_fields = [k for k in blind if k.startswith("tuned") or k == "no_worse_on_both"]
    assert len(tuned_fields) == 8 and all(blind[k] is None for k in tuned_fields)
    totals = {o["knob"]: o for o in overview(list(summary.values()))}
    assert (totals[0.005]["ours_no_worse"], totals[0.005]["tuned_no_worse"]) == (1, 0)
    assert (totals[0.0001]["ours_no_worse"], totals[0.0001]["tuned_no_worse"]) == (0, 1)
    assert totals[0.0001]["tuned_mean_saving"] == pytest.approx(0.0)  # on the envelope


def test_a_calibrated_policy_misses_the_band_often_at_low_knobs() -> None:
    """The yardstick for the knob's band: at 0.003 over ten days (1,440 steps) 3 to 8 short
    steps are in it, which a Poisson count of mean 4.32 hits about 77 % of the time; at 0.1
    nearly always."""
    mean = 0.003 * 1440
    hit = sum(math.exp(-mean) * mean**k / math.factorial(k) for k in range(3, 9))
    assert in_band_if_calibrated(0.003, 1440) == pytest.approx(hit)
    assert 0.76 < in_band_if_calibrated(0.003, 1440) < 0.78
    assert in_band_if_calibrated(0.1, 1440) > 0.999
    assert in_band_if_calibrated(0.001, 1440) < in_band_if_calibrated(0.01, 1440)


def test_no_decision_reads_demand_at_or_after_its_step(traces_dir: Path) -> None:
    """Change the future: every decision before the change stays the same."""
    spec = f"helios-vc:{traces_dir / 'helios-earth' / 'vcMod.csv.gz'}"
    trace = load_trace(spec, split="2020-05-30")
    settings = BenchSettings(lags=(1,))
    (item,) = prepare_trace(trace, empirical_model, settings).series

    base = planner_run(item, 1, settings.policy)
    cut = item.series.start + 100
    units = item.units.copy()
    units[cut:] = units[cut:] * 3 + 40
    changed = type(item)(**{**item.__dict__, "units": units})
    after = planner_run(changed, 1, settings.policy)
    n = cut - item.series.start
    assert np.array_equal(base.paid[: n + 1], after.paid[: n + 1])
    assert not np.array_equal(base.paid, after.paid)


def test_gpuscale_bench_scaling_writes_the_row_contract(traces_dir: Path, tmp_path: Path) -> None:
    # Lag 3 too: a GPU node that pulls its image and loads a model serves 20-30 minutes on.
    lags = (0, 1, 3)
    result, document = bench_vc_slice(
        traces_dir, tmp_path / "scaling.json", "--lag", "0", "--lag", "1", "--lag", "3",
        "--knob", "0.2", "--knob", "0.05",
    )  # fmt: skip
    assert "cost at matched shortage" in result.output
    assert "over 6 points" in result.output and "the buffer tuned the week before" in result.output
    assert document["suite"] == "scaling"
    fields = {
        "trace", "series", "lag_steps", "policy", "knob", "provisioning_ratio", "shortage_events",
        "shortage_node_steps", "scale_actions_per_day", "replay_seconds",
    }  # fmt: skip
    assert all(fields <= row.keys() for row in document["rows"])
    unswept = [(r["policy"], r["lag_steps"]) for r in document["rows"] if r["knob"] is None]
    assert sorted(unswept) == sorted(
        (p, lag) for p in ("static", "reactive", "ces", "oracle") for lag in lags
    )
    ours = [(r["knob"], r["lag_steps"]) for r in document["rows"] if r["policy"] == "predictive"]
    assert sorted(ours) == [(k, lag) for k in (0.05, 0.2) for lag in lags]
    # Beside each predictive point, the same planner with no forecast-driven rule.
    plain = {
        (r["knob"], r["lag_steps"]): r
        for r in document["rows"]
        if r["policy"] == "predictive-no-forecast"
    }
    assert sorted(plain) == sorted(ours)
    for s in document["summary"]:
        other = plain[s["knob"], s["lag_steps"]]
        differs = (s["predictive_ratio"], s["predictive_node_steps"]) != (
            other["provisioning_ratio"],
            other["shortage_node_steps"],
        ) or s["predictive_events"] != other["shortage_events"]
        assert s["forecast_differs"] is differs
        assert s["no_forecast_ratio"] == other["provisioning_ratio"]
        if s["saving"] is not None and s["no_forecast_saving"] is not None:
            assert s["forecast_gain"] == s["saving"] - s["no_forecast_saving"]
    assert "what the forecast adds" in result.output
    assert {(o["knob"], o["lag_steps"]) for o in document["by_lag_knob"]} == set(ours)
    rolling = [r for r in document["rows"] if r["policy"] == "rolling-max"]
    assert len(rolling) == len(lags) * len(ROLLING_WINDOWS) * len(ROLLING_BUFFERS)
    assert all(r["knob"] == r["buffer_nodes"] and r["window_steps"] for r in rolling)
    assert sorted((s["knob"], s["lag_steps"]) for s in document["summary"]) == sorted(ours)
    for s in document["summary"]:
        assert {"matched", "matched_ratio", "matched_node_steps", "saving", "short_share"} <= (
            s.keys()
        )
        assert s["tuned"] is not None and s["tuned_matched_saving"] <= 0  # it is a baseline
    assert {(o["knob"], o["lag_steps"]) for o in document["overview"]} == set(ours)


def test_bench_scaling_takes_knobs_or_one_target_shortage_not_both() -> None:
    from typer.testing import CliRunner

    from scaler.cli import app

    args = ["bench", "scaling", "--trace", "series:x.csv", "--knob", "0.01"]
    result = CliRunner().invoke(app, [*args, "--target-shortage", "0.01"])
    assert result.exit_code != 0
    assert "not both" in result.output


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (
            ["bench", "scaling", "--trace", "series:x.csv", "--target-shortage", "0"],
            "--target-shortage",
        ),
        (["bench", "scaling", "--trace", "series:x.csv", "--knob", "1.5"], "--knob"),
        (
            ["plan", "--pools", "p.yaml", "--trace", "series:x.csv", "--target-shortage", "1"],
            "--target-shortage",
        ),
        (["simulate", "--trace", "series:x.csv", "--knob", "1", "--out", "OUT"], "--knob"),
        (
            ["simulate", "--trace", "series:x.csv", "--target-shortage", "-0.1", "--out", "OUT"],
            "--target-shortage",
        ),
        (["simulate", "--synthetic", "--frontier", "--knob", "0", "--out", "OUT"], "--knob"),
        (["simulate", "--synthetic", "--wait-share", "1.5", "--out", "OUT"], "--wait-share"),
    ],
)
def test_a_knob_outside_its_range_is_refused_by_name(
    args: list[str], option: str, tmp_path: Path
) -> None:
    from typer.testing import CliRunner

    from scaler.cli import app

    out = str(tmp_path / "out")  # nothing may be written, but never into the checkout
    result = CliRunner().invoke(app, [out if a == "OUT" else a for a in args])
    assert result.exit_code == 2, result.output
    assert option in result.output and "not a share" in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert not Path(out).exists()


def test_gpuscale_simulate_draws_the_fleet_and_the_frontier(
    traces_dir: Path, tmp_path: Path
) -> None:
    from typer.testing import CliRunner

    from scaler.cli import app

    args = [
        "simulate", "--trace", f"helios-vc:{traces_dir / 'helios-earth' / 'vcMod.csv.gz'}",
        "--split", "2020-05-30", "--model", "empirical", "--knob", "0.01", "--knob", "0.1",
        "--out", str(tmp_path), "--json",
    ]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    for name in ("fleet.png", "frontier.png", "summary.json"):
        assert (tmp_path / name).stat().st_size > 1000
    # stdout is the document alone (the progress goes to stderr)
    document = json.loads(result.stdout)
    assert document == json.loads((tmp_path / "summary.json").read_text())
    assert {r["policy"] for r in document["sweeps"]} == {
        "headroom", "headroom-percent", "rolling-max", "ces"
    }  # fmt: skip
    assert sorted(m["knob"] for m in document["matched"]) == [0.01, 0.1]  # the frontier


def test_replay_on_one_minute_steps_uses_only_forecasts_made_before_the_minute(
    traces_dir: Path,
) -> None:
    """`step_minutes=1`: the minutes are replayed, each decision on the forecasts made at the
    start of its 10-minute step; changing the future leaves every earlier decision as it was."""
    spec = f"helios-vc:{traces_dir / 'helios-earth' / 'vcMod.csv.gz'}"
    trace = load_trace(spec, split="2020-05-31")
    coarse = prepare_trace(trace, empirical_model, BenchSettings((1,), calibration_days=2)).series[
        0
    ]
    settings = BenchSettings((1,), calibration_days=2, step_minutes=1)
    (item,) = prepare_trace(trace, empirical_model, settings).series
    s = item.series
    assert s.step == pd.Timedelta("1min")
    assert s.end - s.start == 10 * (coarse.series.end - coarse.series.start)
    # Minute t of 10-minute step b uses the forecast made at b: row 0 is b's, and at the
    # step's last minute row 1 (minute t+1) is the next step's forecast made at b.
    b = coarse.series.start + 3
    t = s.start + 30
    assert np.array_equal(
        item.outlook[t : t + 10, 0, :], np.repeat(coarse.outlook[b : b + 1, 0], 10, 0)
    )
    assert np.array_equal(item.outlook[t + 9, 1], coarse.outlook[b, 1])
    assert np.array_equal(item.outlook[t + 8, 1], coarse.outlook[b, 0])

    base = planner_run(item, 1, settings.policy)
    cut = s.start + 500
    units = item.units.copy()
    units[cut:] = units[cut:] * 3 + 40
    after = planner_run(type(item)(**{**item.__dict__, "units": units}), 1, settings.policy)
    n = cut - s.start
    assert np.array_equal(base.paid[: n + 1], after.paid[: n + 1])
    assert not np.array_equal(base.paid, after.paid)
    assert replay(s, OraclePolicy(s.demand, 1), 1).shortage.sum() == 0
    assert base.row()["step_minutes"] == 1.0


def test_a_replay_step_that_does_not_divide_the_model_step_is_refused(traces_dir: Path) -> None:
    from predictor.foundation.errors import InputError

    trace = load_trace(f"helios-vc:{traces_dir / 'helios-earth' / 'vcMod.csv.gz'}")
    with pytest.raises(InputError, match="must divide"):
        prepare_trace(trace, empirical_model, BenchSettings(step_minutes=3))


def _two_series_csv(path: Path, days: int = 6) -> Path:
    """Two series on the same 10-minute steps, `a` stacked before `b` (a long `series`
    file, as `gpuscale generate` writes)."""
    ds = pd.date_range("2024-01-01", periods=days * 144, freq="10min")
    wave = 20 + 10 * np.sin(np.arange(ds.size) * 2 * np.pi / 144)
    frame = pd.concat(
        pd.DataFrame({"series_id": uid, "timestamp": ds, "value": wave * scale})
        for uid, scale in (("a", 1.0), ("b", 2.0))
    )
    frame.to_csv(path, index=False)
    return path


def test_a_multi_series_file_is_replayed_on_each_series_own_step(tmp_path: Path) -> None:
    """Each series keeps its 10-minute step and the warm-up it would have alone (the step
    was once a diff over the stacked series, negative where `a` ends and `b` begins)."""
    path = _two_series_csv(tmp_path / "two.csv")
    trace = load_trace(f"series:{path}", split="2024-01-05")
    settings = BenchSettings((1,), calibration_days=2)
    prepared = prepare_trace(trace, empirical_model, settings).series
    assert [p.series.series for p in prepared] == ["a", "b"]
    for item in prepared:
        s = item.series
        assert s.step == STEP
        assert (s.warmup, s.start, s.end) == (288, 576, 864)  # 2 days of warm-up, 2 of test
        assert planner_run(item, 1, settings.policy).row()["steps"] == 288


def test_a_lag_that_leaves_no_test_step_to_score_is_refused_before_forecasting(
    tmp_path: Path,
) -> None:
    trace = load_trace(f"series:{_two_series_csv(tmp_path / 'two.csv')}", split="2024-01-05")

    def unfitted() -> Forecaster:
        raise AssertionError("the lag is checked before any model is built")

    with pytest.raises(InputError, match=r"boot lag of 288 steps \(--lag\).*288-step test"):
        prepare_trace(trace, unfitted, BenchSettings((0, 288), calibration_days=2))


def test_simulate_synthetic_days_is_held_to_what_trains() -> None:
    """--days 2 was allowed and failed after the workload was drawn (the default model had
    no 12-hour horizon to train on); a span past the config's bound is refused too."""
    from typer.testing import CliRunner

    from scaler.cli import app

    args = ["simulate", "--synthetic", "--out", "OUT"]
    result = CliRunner().invoke(app, [*args, "--days", "2"], env={"COLUMNS": "200"})
    assert result.exit_code == 2 and "Invalid value for '--days'" in result.output
    result = CliRunner().invoke(app, [*args, "--days", "1e9"])
    assert isinstance(result.exception, InputError) and "--days 1e+09" in str(result.exception)
    assert not Path("OUT").exists()
