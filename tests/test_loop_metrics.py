"""The reconcile loop's /metrics: what the dashboard and the alert rules read, from real
passes on the simulated cloud."""

from __future__ import annotations

import socket
import urllib.request
from datetime import datetime
from pathlib import Path

import pandas as pd
from fake_kube import FakeKube
from kubernetes import client as k8s
from live_fixtures import fast_policy, pool
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from predictor.telemetry.store import TelemetryStore
from scaler.controller.config import LeaseSection, LiveConfig
from scaler.controller.leader import LeaderElector
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


# What a pass decided, the series an ex-leader's alerts and panels must not see.
DECIDED = {
    "gpuscale_scaler_input_problems",
    "gpuscale_scaler_demand_gpus",
    "gpuscale_scaler_forecast_gpus",
    "gpuscale_scaler_needed_gpus",
    "gpuscale_scaler_pool_nodes",
    "gpuscale_scaler_job_spare_nodes",
    "gpuscale_scaler_pool_used_gpus",
    "gpuscale_scaler_pool_capacity_gpus",
    "gpuscale_scaler_decision",
}
# Those a pass on the simulated cloud sets: no cluster, so no pods' use.
SET_HERE = DECIDED - {"gpuscale_scaler_pool_used_gpus"}


def names(metrics: LoopMetrics) -> set[str]:
    return {name for name, _ in samples(metrics)}


def test_a_replica_that_stands_by_exports_none_of_its_last_decision(tmp_path: Path) -> None:
    leads = [True]
    metrics = LoopMetrics(lambda: leads[0])
    metrics.observe(reconciler(tmp_path, [8.0] * 5 + [40.0]).iterate(apply=True), {"a100": 8})
    assert names(metrics) >= SET_HERE
    assert samples(metrics)[("gpuscale_scaler_leader", ())] == 1

    leads[0] = False  # the lease lapsed: hidden at the next scrape, before the loop notices
    assert names(metrics) & DECIDED == set()
    got = samples(metrics)
    assert got[("gpuscale_scaler_leader", ())] == 0
    assert got[("gpuscale_scaler_passes_total", (("result", "ok"),))] == 1  # counters stay
    assert got[("gpuscale_scaler_last_pass_timestamp_seconds", ())] == NOW.timestamp()

    metrics.stand_by()  # the loop sees it stands by
    leads[0] = True  # and leads again: nothing of its old turn until it has decided anew
    assert names(metrics) & DECIDED == set()
    metrics.observe(reconciler(tmp_path / "b", [8.0] * 6).iterate(apply=True), {"a100": 8})
    assert names(metrics) >= SET_HERE
    assert len([k for k in samples(metrics) if k[0] == "gpuscale_scaler_decision"]) == 1


def test_the_leader_gauge_follows_the_lease(tmp_path: Path, fake: FakeKube) -> None:
    now = [0.0]
    lease = LeaseSection(
        name="scaler", namespace="ops", duration_s=10, renew_deadline_s=8, retry_s=2
    )
    a, b = (
        LeaderElector(
            k8s.ApiClient(k8s.Configuration(host=fake.url)),
            lease.model_copy(update={"identity": identity}),
            clock=lambda: now[0],
        )
        for identity in ("a", "b")
    )
    on_a, on_b = LoopMetrics(a.is_leader), LoopMetrics(b.is_leader)
    assert a.try_acquire_or_renew() and not b.try_acquire_or_renew()
    outcome = reconciler(tmp_path, [8.0] * 5 + [40.0]).iterate(apply=True)
    on_a.observe(outcome, {"a100": 8})
    assert samples(on_a)[("gpuscale_scaler_leader", ())] == 1
    assert samples(on_b)[("gpuscale_scaler_leader", ())] == 0
    assert names(on_b) & DECIDED == set()  # the standby never decided

    now[0] = 20.0  # a stopped renewing; b takes over
    assert b.try_acquire_or_renew()
    on_b.observe(outcome, {"a100": 8})
    assert samples(on_a)[("gpuscale_scaler_leader", ())] == 0
    assert names(on_a) & DECIDED == set()
    assert samples(on_b)[("gpuscale_scaler_leader", ())] == 1 and names(on_b) >= SET_HERE


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
