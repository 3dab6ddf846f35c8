"""The reconcile loop's /metrics: what the dashboard and the alert rules read, from real
passes on the simulated cloud."""

from __future__ import annotations

import socket
import urllib.request
from datetime import datetime
from pathlib import Path

import pandas as pd
from live_fixtures import fast_policy, pool
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from predictor.telemetry.store import TelemetryStore
from scaler.controller.config import LiveConfig
from scaler.controller.metrics import LoopMetrics
from scaler.controller.reconcile import Reconciler
from scaler.controller.system import LiveSystem

NOW = datetime(2025, 3, 1, 12, 0, 0)


def samples(metrics: LoopMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def reconciler(tmp_path: Path, values: list[float]) -> Reconciler:
    cfg = LiveConfig(
        state_dir=tmp_path / "state",
        pools=[pool(min_size=1)],
        provider={"kind": "simulated", "simulated": {"initial_sizes": {"a100": 2}}},
        model={"name": "persistence"},
        policy=fast_policy(60.0),
        demand={"stale_after_s": 300},
    )
    ds = pd.date_range(end=NOW, periods=len(values), freq="60s")
    TelemetryStore(cfg.state_dir).append(pd.DataFrame({"unique_id": "a100", "ds": ds, "y": values}))
    return Reconciler(LiveSystem.build(cfg), clock=lambda: NOW)


def test_a_scale_up_pass_shows_demand_forecast_fleet_and_decision(tmp_path: Path) -> None:
    r = reconciler(tmp_path, [8.0] * 5 + [40.0])
    metrics = LoopMetrics()
    outcome = r.iterate(apply=True)
    metrics.observe(outcome, {"a100": 8})
    got = samples(metrics)
    assert got[("gpuscale_scaler_demand_gpus", (("group", "a100"),))] == 40.0
    assert got[("gpuscale_scaler_forecast_gpus", (("group", "a100"), ("quantile", "0.5")))] > 0
    assert got[("gpuscale_scaler_pool_nodes", (("kind", "current"), ("pool", "a100")))] == 2
    assert got[("gpuscale_scaler_pool_nodes", (("kind", "desired"), ("pool", "a100")))] == 5
    assert got[("gpuscale_scaler_pool_capacity_gpus", (("pool", "a100"),))] == 16
    assert got[("gpuscale_scaler_actions_total", (("action", "set_target"), ("status", "done")))]
    assert got[("gpuscale_scaler_passes_total", (("result", "ok"),))] == 1
    assert got[("gpuscale_scaler_input_problems", ())] == 0
    (decision,) = [k for k in got if k[0] == "gpuscale_scaler_decision"]
    labels = dict(decision[1])
    assert labels["action"] == "scale_up" and labels["reason"].startswith("add 3")
    assert got[decision] == 3


def test_one_decision_series_per_pool_and_failed_passes_counted(tmp_path: Path) -> None:
    r = reconciler(tmp_path, [8.0] * 5 + [40.0])
    metrics = LoopMetrics()
    metrics.observe(r.iterate(apply=True), {"a100": 8})
    r2 = reconciler(tmp_path / "other", [8.0] * 6)
    metrics.observe(r2.iterate(apply=True), {"a100": 8})
    metrics.failed_pass()
    got = samples(metrics)
    assert len([k for k in got if k[0] == "gpuscale_scaler_decision"]) == 1
    assert got[("gpuscale_scaler_passes_total", (("result", "failed"),))] == 1


def test_serves_over_http() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    metrics = LoopMetrics()
    metrics.failed_pass()
    stop = metrics.serve(port, addr="127.0.0.1")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            assert b'gpuscale_scaler_passes_total{result="failed"} 1.0' in reply.read()
    finally:
        stop()
