"""The trace replay follows BENCHMARKS.md to the letter, and runs on slices of real traces."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from predictor.data.loaders import load_trace
from predictor.models import build
from predictor.models.forecast import Forecaster
from scaler.evaluation.replay import (
    CesPolicy,
    OraclePolicy,
    ReplaySeries,
    StaticPolicy,
    horizon_mean_weights,
    replay,
)
from scaler.evaluation.scaling_bench import (
    BenchSettings,
    bench_trace,
    planner_run,
    prepare_trace,
    summarize,
)
from scaler.planning.planner import PlannerPolicy

STEP = pd.Timedelta("10min")


def empirical_model() -> Forecaster:
    """The benchmark's baseline quantile model: fast, and enough to drive the replay."""
    return build("empirical")


def series(
    demand: list[float], warmup: int = 1, start: int = 1, bound: list[float] | None = None
) -> ReplaySeries:
    d = np.asarray(demand, dtype=float)
    return ReplaySeries(
        trace="hand",
        series="s",
        ds=np.arange(d.size) * np.timedelta64(10, "m") + np.datetime64("2024-01-01"),
        demand=d,
        static=np.full(d.size, 10.0),
        bound=None if bound is None else np.asarray(bound, dtype=float),
        warmup=warmup,
        start=start,
        end=d.size,
        step=STEP,
    )


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


def test_replay_on_a_helios_vc_slice_beats_reactive_on_shortage(traces_dir: Path) -> None:
    spec = f"helios-vc:{traces_dir / 'helios-earth' / 'vcLJZ.csv.gz'}"
    trace = load_trace(spec, split="2020-05-29")
    settings = BenchSettings(lags=(0, 1), policy=PlannerPolicy(mode="hybrid", target_shortage=0.05))
    _, outcomes = bench_trace(trace, empirical_model, settings)
    rows = [o.row() for o in outcomes]
    assert {r["policy"] for r in rows} == {"static", "reactive", "ces", "oracle", "predictive"}
    assert all(r["steps"] == int(rows[0]["steps"]) for r in rows)
    by = {(r["policy"], r["lag_steps"]): r for r in rows}
    for lag in (0, 1):
        ours, reactive = by["predictive", lag], by["reactive", lag]
        assert ours["shortage_node_steps"] < reactive["shortage_node_steps"]
        assert by["oracle", lag]["shortage_node_steps"] == 0
        assert ours["provisioning_ratio"] < by["static", lag]["provisioning_ratio"]
    (summary,) = [s for s in summarize(rows) if s["lag_steps"] == 0]
    assert summary["series"] == "vcLJZ"
    assert summary["shortage_vs_reactive"] < 0


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
    import json

    from typer.testing import CliRunner

    from scaler.cli import app

    out = tmp_path / "scaling.json"
    args = [
        "bench", "scaling",
        "--trace", f"helios-vc:{traces_dir / 'helios-earth' / 'vcTJs.csv.gz'}",
        "--split", "2020-05-30", "--lag", "0", "--lag", "1",
        "--model", "empirical", "--target-shortage", "0.05", "--json", str(out),
    ]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    document = json.loads(out.read_text())
    assert document["suite"] == "scaling"
    fields = {
        "trace", "series", "lag_steps", "policy", "provisioning_ratio", "shortage_events",
        "shortage_node_steps", "scale_actions_per_day", "replay_seconds",
    }  # fmt: skip
    assert all(fields <= row.keys() for row in document["rows"])
    assert sorted((r["policy"], r["lag_steps"]) for r in document["rows"]) == sorted(
        (p, lag) for p in ("static", "reactive", "ces", "oracle", "predictive") for lag in (0, 1)
    )
    assert {s["lag_steps"] for s in document["summary"]} == {0, 1}


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
    assert json.loads(result.stdout) == json.loads((tmp_path / "summary.json").read_text())


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
