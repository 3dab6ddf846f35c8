"""Warm start: a pass that finds no planner state (a fresh state directory, a Lease taken
afresh) plans what a replay of the store's history plans at that step. The replay here is
the benchmark's own (`scaler.evaluation.replay`: `replay` over `PlannerPolicyRun`, with
`rolling_outlook` forecasts), one pool at a time, none of the loop's code."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from fake_kube import FakeKube
from kubernetes import client as k8s
from prometheus_client import generate_latest

from predictor.telemetry.store import TelemetryStore
from scaler.controller.config import LeaseSection, LiveConfig
from scaler.controller.leader import LeaderElector
from scaler.controller.metrics import LoopMetrics
from scaler.controller.reconcile import PassDecision, Reconciler
from scaler.controller.system import LiveSystem
from scaler.controller.warm_start import job_requests, stale_state
from scaler.evaluation.replay import PlannerPolicyRun, ReplaySeries, replay, rolling_outlook
from scaler.planning.demand import forecast_levels
from scaler.planning.planner import GroupMemory, PlannerMemory
from scaler.service.planning import PlanDesk

STEP = pd.Timedelta(minutes=10)
POOLS = [
    {"name": "a100", "gpu_model": "A100", "gpus_per_node": 8, "price_per_hour": 32.77,
     "boot_seconds": 480, "min_size": 2, "max_size": 64},
    {"name": "h100", "gpu_model": "H100", "gpus_per_node": 8, "price_per_hour": 98.32,
     "boot_seconds": 720, "min_size": 0, "max_size": 32},
    {"name": "t4", "gpu_model": "T4", "gpus_per_node": 4, "price_per_hour": 3.91,
     "boot_seconds": 300, "min_size": 1, "max_size": 60},
]  # fmt: skip
LEVEL = {"a100": 70.0, "h100": 30.0, "t4": 20.0}


def demand(days: float, seed: int = 0) -> pd.DataFrame:
    """Days of 10-minute demand per pool, ending at a fixed past time: a daily swing,
    noise and bursts (whole GPUs)."""
    rng = np.random.default_rng(seed)
    n = int(days * pd.Timedelta("1D") / STEP)
    ds = pd.date_range(end=pd.Timestamp("2024-01-15") - STEP, periods=n, freq=STEP)
    hours = np.asarray(ds.hour + ds.minute / 60)
    frames = []
    for name, level in LEVEL.items():
        swing = level * (1 + 0.4 * np.sin(2 * np.pi * (hours - 8) / 24))
        bursts = rng.binomial(1, 0.02, n) * rng.integers(8, 40, n)
        y = np.round(np.maximum(swing + rng.normal(0, level * 0.08, n) + bursts, 0))
        frames.append(pd.DataFrame({"unique_id": name, "ds": ds, "y": y}))
    return pd.concat(frames, ignore_index=True)


def config(state_dir: Path, **extra: object) -> LiveConfig:
    return LiveConfig.model_validate(
        {
            "state_dir": str(state_dir),
            "pools": POOLS,
            "provider": {
                "kind": "simulated",
                "simulated": {"seed": 0, "initial_sizes": {"a100": 4, "h100": 1, "t4": 2}},
            },
            "demand": {"metric": "gpu_demand", "history_s": 1e9, "stale_after_s": 1e9},
            # The empirical baseline fits in a blink; the warm start rolls whichever model
            # the loop serves the same way.
            "model": {"name": "empirical"},
            "policy": {"mode": "predictive"},
            **extra,
        }
    )


def replayed_targets(system: LiveSystem, history: pd.DataFrame) -> dict[str, int]:
    """Each pool's target at the step after the history's last, as the benchmark replay of
    the history by the same planner (the loop's policy, the loop's fitted model) sets it."""
    cfg = system.config
    forecaster = system.model.model
    assert forecaster is not None
    levels = forecast_levels(cfg.policy)
    lead = max(p.boot_steps(cfg.policy.step_seconds) for p in cfg.pools)
    horizons = list(range(1, lead + 2))
    out = {}
    for pool in cfg.pools:
        series = history[history["unique_id"] == pool.name].sort_values("ds")
        y = series["y"].to_numpy(dtype=float)
        n = y.size
        # One step past the data: the decision taken once all of it is seen.
        ds = pd.date_range(series["ds"].iloc[0], periods=n + 1, freq=STEP).to_numpy()
        outlook = rolling_outlook(forecaster, series, ds, 1, horizons, levels)
        last = forecaster.forecast(series, horizons, levels).frame.sort_values("horizon")
        outlook[n] = last[[f"q{q:g}" for q in levels]].to_numpy(dtype=float)
        run = PlannerPolicyRun(
            "predictive",
            cfg.policy,
            pool,
            np.append(y, np.nan),
            list(pd.DatetimeIndex(ds).to_pydatetime()),
            levels,
            np.maximum(outlook, 0.0),
        )
        test = ReplaySeries(
            "store", pool.name, ds, np.append(y, 0.0), None, None, 1, 1, n + 1, STEP
        )
        outcome = replay(test, run, pool.boot_steps(cfg.policy.step_seconds))
        out[pool.name] = int(outcome.paid[-1])
    return out


@pytest.fixture(scope="module")
def history() -> pd.DataFrame:
    return demand(14)


def stored(state_dir: Path, history: pd.DataFrame) -> Path:
    TelemetryStore(state_dir).append(history)
    return state_dir


def test_a_fresh_state_dir_plans_what_the_replay_of_the_store_plans(
    tmp_path: Path, history: pd.DataFrame
) -> None:
    system = LiveSystem.build(config(stored(tmp_path / "state", history)))
    try:
        outcome = Reconciler(system).iterate(apply=False)
        decision = outcome.decision
        assert decision.warm_start is not None
        assert decision.warm_start.steps == 14 * 144 - 1
        assert decision.sizing() == {"a100": "tuned", "h100": "tuned", "t4": "tuned"}
        expected = replayed_targets(system, history)
        assert dict(decision.desired) == expected
        # Not the raw bound of a fresh planner: the tuned rule sized every pool.
        for p in decision.plan.decisions:
            assert "tuned spare capacity" in p.reason, p.reason
        # A second pass in the same step plans from the rebuilt state: the same targets.
        again = Reconciler(system).iterate(apply=False).decision
        assert dict(again.desired) == expected
    finally:
        system.close()


def test_too_little_history_says_so_and_falls_back_to_the_demand_seen(tmp_path: Path) -> None:
    short = demand(0.5)  # 72 steps: fewer than the 144 the tuned rule needs
    system = LiveSystem.build(config(stored(tmp_path / "state", short)))
    try:
        outcome = Reconciler(system).iterate(apply=False)
        decision = outcome.decision
        assert decision.sizing() == {g: "reactive-fallback" for g in ("a100", "h100", "t4")}
        # Which sizing applies is in the loop's metrics and in the service's /v1/plan.
        metrics = LoopMetrics()
        metrics.observe(outcome, {p["name"]: p["gpus_per_node"] for p in POOLS})
        scraped = generate_latest(metrics.registry).decode()
        assert (
            'gpuscale_scaler_group_sizing{group="a100",sizing="reactive-fallback"} 1.0' in scraped
        )
        assert "gpuscale_scaler_warm_start_steps 71.0" in scraped
        shown = PlanDesk(system).plan()
        assert shown.sizing == decision.sizing()
        assert shown.warm_start is not None and shown.warm_start["steps"] == 71
        last = short.sort_values("ds").groupby("unique_id")["y"].last()
        for p in decision.plan.decisions:
            # 72 steps, less the lead rows not yet scored (1 for a100 and t4, 2 for h100)
            steps = 69 if p.pool == "h100" else 70
            assert f"too little history to tune the spare ({steps} of 144 steps)" in p.reason
            gpus = next(x["gpus_per_node"] for x in POOLS if x["name"] == p.pool)
            floor = next(x["min_size"] for x in POOLS if x["name"] == p.pool)
            assert decision.desired[p.pool] == max(-(-int(last[p.pool]) // gpus), floor)
        assert decision.to_dict()["sizing"]["a100"] == "reactive-fallback"
    finally:
        system.close()


class Replica:
    """A replica of the loop: its own state directory (its own claim in the chart) with
    the same store history, and an elector on a clock the test moves."""

    def __init__(self, fake: FakeKube, name: str, root: Path, history: pd.DataFrame) -> None:
        self.now = 0.0
        lease = LeaseSection(
            identity=name, name="scaler", namespace="ops", duration_s=10, renew_deadline_s=8,
            retry_s=2,
        )  # fmt: skip
        api = k8s.ApiClient(k8s.Configuration(host=fake.url))
        self.elector = LeaderElector(api, lease, clock=lambda: self.now)
        self.system = LiveSystem.build(config(stored(root / name, history)))
        self.loop = Reconciler(self.system, self.elector)

    def pass_as_leader(self, at: float) -> PassDecision:
        from scaler.cli.live import own_loop_state

        self.now = at
        assert self.elector.try_acquire_or_renew()
        own_loop_state(self.system.log, self.elector.transitions)
        return self.loop.iterate(apply=True).decision


def test_after_a_lease_change_the_new_leader_plans_what_the_replay_plans(
    fake: FakeKube, tmp_path: Path, history: pd.DataFrame
) -> None:
    a, b = Replica(fake, "a", tmp_path, history), Replica(fake, "b", tmp_path, history)
    try:
        first = a.pass_as_leader(0.0)
        expected = replayed_targets(a.system, history)
        assert first.warm_start is not None and dict(first.desired) == expected
        again = a.pass_as_leader(1.0)  # a's own state, kept: no rebuild
        assert again.warm_start is None and dict(again.desired) == expected
        a.elector.release()
        took = b.pass_as_leader(2.0)  # b takes the Lease: its state from the store
        assert took.warm_start is not None and dict(took.desired) == expected
        b.elector.release()
        # a takes it back after b's turn: the state a kept is from before it, so a starts
        # afresh (`own_loop_state`) and rebuilds from the store.
        back = a.pass_as_leader(3.0)
        assert a.elector.transitions == 2  # b took it at 1: a last led at 0
        assert back.warm_start is not None
        assert dict(back.desired) == expected
    finally:
        a.system.close()
        b.system.close()


def test_a_state_from_before_a_gap_is_rebuilt() -> None:
    memory = PlannerMemory(groups={"a100": GroupMemory()})
    step = "2024-01-15 00:00:00"
    assert stale_state("2024-01-14 23:50:00", memory, step, ["a100"], 600) is None
    assert stale_state(step, memory, step, ["a100"], 600) is None
    assert "3 steps from" in (stale_state("2024-01-14 23:30:00", memory, step, ["a100"], 600) or "")
    assert "-1 steps from" in (
        stale_state("2024-01-15 00:10:00", memory, step, ["a100"], 600) or ""
    )
    assert "groups" in (stale_state(step, memory, step, ["a100", "h100"], 600) or "")
    assert "no planner state" in (stale_state(None, None, step, ["a100"], 600) or "")


def test_the_stores_demand_gives_each_step_its_node_request() -> None:
    asked = job_requests(np.array([np.nan, 8.0, 20.0, 17.0, 17.0, 40.0]), 8)
    assert [r.nodes for r in asked] == [(), (), (2,), (), (), (2,)]  # 1, 3, 3, 3, 5 nodes
    assert all(r.minutes_ago == ((0.0,) if r.nodes else ()) for r in asked)
