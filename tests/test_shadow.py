"""Shadow mode: passes recorded beside a cluster that scales reactively, and the report's
figures checked against replays computed here with the benchmark's own code
(`scaler.evaluation.replay`), none of the report's."""

from __future__ import annotations

import itertools
import json
import math
from datetime import datetime, timedelta
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from fake_kube import FakeKube
from live_fixtures import fast_policy, ready_gpu_node
from live_fixtures import pool as pool_of
from typer.testing import CliRunner

from predictor.models import build
from predictor.telemetry.store import TelemetryStore
from scaler.cli import app
from scaler.controller.config import LiveConfig, ModelSection, load_live_config
from scaler.controller.reconcile import Reconciler
from scaler.controller.shadow import ShadowLog, ShadowPass
from scaler.controller.system import LiveSystem
from scaler.evaluation.replay import (
    PlannedTargets,
    PlannerPolicyRun,
    ReplaySeries,
    replay,
    rolling_outlook,
)
from scaler.evaluation.shadow_day import shadow_day, stepped_demand
from scaler.evaluation.shadow_report import shadow_report
from scaler.planning.demand import forecast_levels

REPO = Path(__file__).resolve().parents[1]
STEP = pd.Timedelta(minutes=10)
HISTORY_DAYS = 2.0
STEPS = 24
MIN_SIZE = {"a100": 2, "h100": 0, "t4": 1}  # deploy/live-simulated.yaml's


def live() -> LiveConfig:
    shipped = load_live_config(REPO / "deploy" / "live-simulated.yaml")
    # The empirical baseline fits in a blink; the loop forecasts with whichever it serves.
    return shipped.model_copy(update={"model": ModelSection(name="empirical")})


@pytest.fixture(scope="module")
def played(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[ShadowPass]]:
    state = tmp_path_factory.mktemp("shadow") / "state"
    day = shadow_day(live(), state, seed=3, history_days=HISTORY_DAYS, steps=STEPS)
    assert day.passes == STEPS
    return state, ShadowLog(state).passes()


def test_each_pass_records_what_gpuscale_would_set_and_what_the_cluster_had(
    played: tuple[Path, list[ShadowPass]],
) -> None:
    _, passes = played
    assert len(passes) == STEPS
    gaps = {(b.at - a.at).total_seconds() for a, b in itertools.pairwise(passes)}
    assert gaps == {600.0}
    demand = stepped_demand(None, 3, HISTORY_DAYS + STEPS / 144, 600)
    for p in passes:
        assert [s.pool for s in p.pools] == ["a100", "h100", "t4"]
        seen = demand[demand["ds"] == pd.Timestamp(p.at)].set_index("unique_id")["y"]
        for s in p.pools:
            assert s.demand_gpus == seen[s.pool]
            # The reactive cluster asked for what the step's demand needs (min size kept).
            assert s.target == max(math.ceil(s.demand_gpus / s.gpus_per_node), MIN_SIZE[s.pool])
            short = max(s.demand_gpus - s.ready * s.gpus_per_node, 0.0)
            assert s.pending_gpus == short and s.pending_pods is None
            assert s.used_gpus == min(s.demand_gpus, s.ready * s.gpus_per_node)
            assert (len(s.waited_s) == 1) == (short > 0)
    # With two days in the store, the tuned rule sized every pool from the first pass.
    assert {s.sizing for p in passes for s in p.pools} == {"tuned"}


def test_the_recorded_plan_is_the_planner_replayed_on_the_same_demand(
    played: tuple[Path, list[ShadowPass]],
) -> None:
    """Each pass's would-set size is the benchmark replay's target at that step: the same
    planner on the store's history and the day's demand, the same model's forecasts."""
    _, passes = played
    cfg = live()
    demand = stepped_demand(None, 3, HISTORY_DAYS + STEPS / 144, 600)
    start = pd.Timestamp(demand["ds"].min()) + pd.Timedelta(days=HISTORY_DAYS)
    history = demand[demand["ds"] < start]
    forecaster = build("empirical").fit(history)
    levels = forecast_levels(cfg.policy)
    lead = max(p.boot_steps(cfg.policy.step_seconds) for p in cfg.pools)
    horizons = list(range(1, lead + 2))
    cols = [f"q{q:g}" for q in levels]
    for pool in cfg.pools:
        series = demand[demand["unique_id"] == pool.name].sort_values("ds").reset_index(drop=True)
        y = series["y"].to_numpy(dtype=float)
        n = y.size
        ds = pd.date_range(series["ds"].iloc[0], periods=n + 1, freq=STEP)
        outlook = rolling_outlook(forecaster, series, ds.to_numpy(), 1, horizons, levels)
        first = int(np.flatnonzero(ds == start)[0])
        for s in range(first, n):  # each pass forecast on the history up to its step
            seen = series.iloc[: s + 1]
            made = forecaster.forecast(seen, horizons, levels).frame.sort_values("horizon")
            outlook[s + 1] = made[cols].to_numpy(dtype=float)
        run = PlannerPolicyRun(
            "predictive",
            cfg.policy,
            pool,
            np.append(y, np.nan),
            list(ds.to_pydatetime()),
            levels,
            np.maximum(outlook, 0.0),
        )
        test = ReplaySeries("day", pool.name, ds.to_numpy(), np.append(y, 0), None, None, 1, 1,
                            n + 1, STEP)  # fmt: skip
        outcome = replay(test, run, pool.boot_steps(cfg.policy.step_seconds))
        replayed = outcome.paid[first:].astype(int).tolist()
        recorded = [next(x for x in p.pools if x.pool == pool.name).would_set for p in passes]
        assert recorded == replayed, pool.name


def test_the_report_equals_an_independent_replay_of_the_recorded_demand(
    played: tuple[Path, list[ShadowPass]],
) -> None:
    _, passes = played
    report = shadow_report(passes)
    assert report.passes == STEPS and report.hours == pytest.approx(STEPS / 6)
    for pool in report.pools:
        rows = [next(x for x in p.pools if x.pool == pool.pool) for p in passes]
        gpus = rows[0].gpus_per_node
        lag = math.ceil(rows[0].boot_seconds / 600)
        d = np.array([r.demand_gpus for r in rows])
        hours = 600 / 3600
        # The actual fleet: paid nodes and ready GPUs short of demand, pass by pass.
        paid = sum(r.nodes * gpus * hours for r in rows)
        short = sum(max(r.demand_gpus - r.ready * gpus, 0) * hours for r in rows)
        assert pool.actual.gpu_hours == pytest.approx(paid)
        assert pool.actual.short_gpu_hours == pytest.approx(short)
        # gpuscale's sizes through the benchmark replay, from the cluster's first fleet: a
        # dummy step, `lag` steps holding the ready nodes, then the passes.
        ready0 = rows[0].ready
        targets = [0] + [ready0] * lag + [r.would_set for r in rows]
        demand = np.concatenate([np.zeros(1 + lag), d / gpus])
        size = demand.size
        ds = pd.date_range("2024-01-01", periods=size, freq=STEP).to_numpy()
        series = ReplaySeries("shadow", pool.pool, ds, demand, None, None, 1, 1 + lag, size, STEP)
        out = replay(series, PlannedTargets("gpuscale", np.array(targets)), lag)
        assert pool.gpuscale.gpu_hours == pytest.approx(out.paid.sum() * gpus * hours)
        assert pool.gpuscale.short_gpu_hours == pytest.approx(out.shortage.sum() * gpus * hours)
        assert pool.gpuscale.short_share == pytest.approx((out.shortage > 0).mean())
        assert pool.demand_gpu_hours == pytest.approx(d.sum() * hours)


def test_report_command_writes_markdown_html_png_and_json(
    played: tuple[Path, list[ShadowPass]], tmp_path: Path
) -> None:
    state, passes = played
    out = tmp_path / "report"
    result = CliRunner().invoke(app, ["report", "--state-dir", str(state), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "| a100 | actual |" in result.output and "| a100 | gpuscale |" in result.output
    assert (out / "report.md").read_text().count("![frontier](shadow-frontier.png)") == 1
    assert "<table>" in (out / "report.html").read_text()
    assert (out / "shadow-frontier.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = CliRunner().invoke(
        app, ["report", "--state-dir", str(state), "--out", str(out), "--json"]
    )
    figures = json.loads(result.output)
    report = shadow_report(passes)
    assert figures["pools"][0]["gpuscale"]["gpu_hours"] == report.pools[0].gpuscale.gpu_hours
    missing = CliRunner().invoke(app, ["report", "--state-dir", str(tmp_path / "none")])
    assert missing.exit_code != 0


def test_scale_shadow_records_a_pass_and_acts_on_nothing(tmp_path: Path) -> None:
    state = tmp_path / "state"
    TelemetryStore(state).append(stepped_demand(None, 3, 1.0, 600))
    shipped = (REPO / "deploy" / "live-simulated.yaml").read_text()
    config = tmp_path / "live.yaml"
    config.write_text(
        shipped.replace("state_dir: .gpuscale/state", f"state_dir: {state}").replace(
            "model: {name: gpuscale}", "model: {name: empirical}"
        )
    )
    runner = CliRunner()
    refused = runner.invoke(app, ["scale", "--config", str(config), "--shadow", "--apply"])
    assert refused.exit_code == 2 and "--shadow acts on nothing" in refused.output
    result = runner.invoke(app, ["scale", "--config", str(config), "--once", "--shadow"])
    assert result.exit_code == 0, result.output
    (recorded,) = ShadowLog(state).passes()
    assert [p.pool for p in recorded.pools] == ["a100", "h100", "t4"]
    a100 = recorded.pools[0]
    assert (a100.ready, a100.target) == (4, 4)  # the cloud as it was: nothing was acted on
    assert a100.would_set >= 2 and a100.sizing == "reactive-fallback"  # a day: 143 steps


def test_with_the_cluster_seen_waiting_pods_are_timed_from_the_pass_that_first_saw_them(
    tmp_path: Path, fake: FakeKube
) -> None:
    """Cluster Autoscaler sizes the pool (`provider: autoscaler`); the shadow passes read
    the pods: two wait on the a100 pool, one of them starts between the passes."""
    cfg = LiveConfig(
        state_dir=tmp_path / "state",
        pools=[pool_of(min_size=1, max_size=12) | {"boot_seconds": 600}],
        provider={"kind": "autoscaler"},
        kubernetes={"host": fake.url},
        model={"name": "persistence"},
        policy=fast_policy(60.0),
        lease={"enabled": False},
    )
    node = ready_gpu_node(fake, "gpu-0")
    eight_gpus = {"containers": [{"name": "main", "resources": {"requests": {
        "cpu": "8", "memory": "32Gi", "nvidia.com/gpu": "8"}}}]}  # fmt: skip
    fake.create("pods", {"metadata": {"name": "train", "namespace": "ml"},
                         "spec": eight_gpus | {"nodeName": node},
                         "status": {"phase": "Running"}})  # fmt: skip
    for name in ("wait-0", "wait-1"):
        fake.create("pods", {"metadata": {"name": name, "namespace": "ml"},
                             "spec": eight_gpus | {"nodeSelector": {"gpuscale.io/pool": "a100"}},
                             "status": {"phase": "Pending"}})  # fmt: skip
    start = datetime(2025, 3, 3, 14, 0, 0)
    log = ShadowLog(cfg.state_dir)
    system = LiveSystem.build(cfg)
    seen = []
    try:
        for minute in (0, 1):
            at = start + timedelta(minutes=minute)
            ds = pd.date_range(end=pd.Timestamp(at), periods=3, freq="60s")
            system.store.append(pd.DataFrame({"unique_id": "a100", "ds": ds, "y": 24.0}))
            decision = Reconciler(system, clock=lambda at=at: at).iterate(apply=False).decision
            seen.append(log.record(decision, cfg.pools).pools[0])
            if minute == 0:  # wait-0 starts on a node the autoscaler brought
                fake.delete("pods", "wait-0", "ml")
    finally:
        system.close()
    first, second = seen
    assert (first.pending_pods, first.pending_gpus, first.waited_s) == (2, 16.0, (0.0, 0.0))
    assert first.used_gpus == 8.0 and first.demand_gpus == 24.0
    assert (second.pending_pods, second.waited_s) == (1, (60.0,))
