"""The reconcile loop on the simulated cloud (no cloud account, no cluster): dry run, sizes
set rather than incremented, a pass repeated or interrupted never acts twice, stale or
missing telemetry never scales down, every decision logged; the config names bad fields."""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from live_fixtures import fast_policy, pool, write_config

from predictor.foundation.errors import InputError
from predictor.telemetry.store import TelemetryStore
from scaler.cluster.pools import NodePool
from scaler.controller.config import LiveConfig, load_live_config
from scaler.controller.fleet import FleetView, NodeView
from scaler.controller.journal import DecisionLog
from scaler.controller.reconcile import (
    PlannerState,
    Reconciler,
    choose_removals,
    hold_scale_downs,
    placeholder_demand,
)
from scaler.controller.system import LiveSystem
from scaler.kube.placeholders import PlaceholderDemand
from scaler.planning.planner import CapacityPlan, PlannerMemory, PoolDecision
from scaler.providers.base import NodeStatus

NOW = datetime(2025, 3, 1, 12, 0, 0)


class Crash(Exception):
    """Stands in for a kill at a pause point."""


def config(tmp_path: Path, nodes: int = 2, **extra: Any) -> LiveConfig:
    return LiveConfig(
        state_dir=tmp_path / "state",
        pools=[pool(min_size=1)],
        provider={"kind": "simulated", "simulated": {"initial_sizes": {"a100": nodes}}},
        model={"name": "persistence"},
        policy=fast_policy(60.0),
        demand={"stale_after_s": 300},
        **extra,
    )


def demand(cfg: LiveConfig, values: list[float], end: datetime = NOW) -> None:
    ds = pd.date_range(end=end, periods=len(values), freq="60s")
    TelemetryStore(cfg.state_dir).append(pd.DataFrame({"unique_id": "a100", "ds": ds, "y": values}))


def reconciler(cfg: LiveConfig, system: LiveSystem | None = None, **kw: Any) -> Reconciler:
    return Reconciler(system or LiveSystem.build(cfg), clock=lambda: NOW, **kw)


def target(r: Reconciler) -> int:
    (group,) = r.system.provider.node_groups()
    return group.target_size()


def test_a_dry_run_decides_logs_and_changes_nothing(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    demand(cfg, [8.0] * 5 + [40.0])
    r = reconciler(cfg)
    outcome = r.iterate(apply=False)
    assert outcome.decision.desired == {"a100": 5}
    assert outcome.decision.plan.decisions[0].reason.startswith("add 3")
    assert target(r) == 2
    (logged,) = DecisionLog(cfg.state_dir).decisions()
    assert not logged.applied and logged.outcome == {"dry_run": True}
    assert logged.inputs["outlooks"][0]["observed"] == 40.0
    assert logged.plan["final_desired"] == {"a100": 5}


def test_sizes_are_set_so_a_repeated_pass_launches_nothing_more(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    demand(cfg, [8.0] * 5 + [40.0])
    r = reconciler(cfg)
    first = r.iterate(apply=True)
    assert [(a["action"], a["result"]) for a in first.actions] == [("set_target", "target 2 -> 5")]
    assert target(r) == 5
    again = reconciler(cfg, r.system).iterate(apply=True)  # a restarted process, same cloud
    assert again.actions == [] and target(r) == 5
    launched = [e for e in r.system.provider.cloud.events if e.kind == "launched"]
    assert len(launched) == 5
    # Both passes planned from the memory at the start of the same demand step.
    state = DecisionLog(cfg.state_dir).load("planner")
    assert state.step == first.decision.step == again.decision.step
    assert state.base is None


@pytest.mark.parametrize("point", ["journaled", "acted"])
def test_an_interrupted_scale_up_is_settled_not_repeated(tmp_path: Path, point: str) -> None:
    cfg = config(tmp_path)
    demand(cfg, [8.0] * 5 + [40.0])
    system = LiveSystem.build(cfg)

    def crash(at: str) -> None:
        if at == point:
            raise Crash(at)

    with pytest.raises(Crash):
        reconciler(cfg, system, pause=crash).iterate(apply=True)
    log = DecisionLog(cfg.state_dir)
    assert [a.status for a in log.actions()] == ["pending"]

    outcome = reconciler(cfg, system).iterate(apply=True)
    statuses = [(a["action"], a["status"]) for a in outcome.actions]
    if point == "journaled":
        assert statuses == [("resolve set_target", "superseded"), ("set_target", "done")]
    else:
        assert statuses == [("resolve set_target", "done")]
    assert target(reconciler(cfg, system)) == 5
    assert sum(e.kind == "launched" for e in system.provider.cloud.events) == 5
    assert log.pending() == []


def test_stale_telemetry_never_scales_down(tmp_path: Path) -> None:
    cfg = config(tmp_path, nodes=5)
    demand(cfg, [8.0] * 6, end=NOW - timedelta(minutes=10))  # newest point 600 s old
    r = reconciler(cfg)
    outcome = r.iterate(apply=True)
    d = outcome.decision
    assert d.plan.desired == {"a100": 1}  # the planner alone would shrink to one node
    assert d.desired == {"a100": 5} and d.removals == ()
    assert "stale: newest point 600 s old (limit 300 s)" in d.held["a100"]
    assert outcome.actions == [] and target(r) == 5
    (logged,) = DecisionLog(cfg.state_dir).decisions()
    assert logged.inputs["problems"] == ["a100: stale: newest point 600 s old (limit 300 s)"]
    assert logged.plan["held"]["a100"].startswith("scale-down held")


def test_missing_telemetry_holds_too_and_fresh_telemetry_scales_down(tmp_path: Path) -> None:
    cfg = config(tmp_path, nodes=5)
    system = LiveSystem.build(cfg)
    empty = reconciler(cfg, system).iterate(apply=True)
    assert empty.decision.desired == {"a100": 5}
    assert "no demand series in the store" in empty.decision.held["a100"]

    demand(cfg, [8.0] * 6)
    down = reconciler(cfg, system).iterate(apply=True)
    assert down.decision.desired == {"a100": 1}
    assert [a["status"] for a in down.actions] == ["done"] * 4
    assert target(reconciler(cfg, system)) == 1


def test_choose_removals_prefers_booting_then_resumed_then_idle_nodes() -> None:
    t = NOW

    def node(name: str, status: NodeStatus, minutes: int, **kw: Any) -> NodeView:
        return NodeView(name, "a100", status, t + timedelta(minutes=minutes), kube_name=name, **kw)

    nodes = (
        node("busy", NodeStatus.READY, 0, busy=True),
        node("pods", NodeStatus.READY, 1, movable_pods=2),
        node("idle-old", NodeStatus.READY, 2),
        node("idle-new", NodeStatus.READY, 3),
        node("resumed", NodeStatus.READY, 4, movable_pods=3, cordoned_by_us=True),
        node("booting", NodeStatus.BOOTING, 5),
        node("backoff", NodeStatus.READY, 6),
    )
    fleet = FleetView({"a100": nodes}, {"a100": 7}, kubernetes=True)
    order = [n.cloud_name for n in choose_removals(fleet, "a100", 10, frozenset({"backoff"}))]
    assert order == ["booting", "resumed", "idle-new", "idle-old", "pods"]
    assert [n.cloud_name for n in choose_removals(fleet, "a100", 2, frozenset())] == [
        "booting",
        "resumed",
    ]


def test_placeholders_hold_the_planned_gpus_real_pods_do_not_use() -> None:
    pools = [
        NodePool(name="a100", gpu_model="A100", gpus_per_node=8, price_per_hour=1, max_size=9),
        NodePool(name="t4", gpu_model="T4", gpus_per_node=4, price_per_hour=1, max_size=9),
    ]
    got = placeholder_demand(pools, {"a100": 5, "t4": 1}, {"a100": 12, "t4": 6}, None)
    assert got == [
        PlaceholderDemand(pool="a100", count=3, gpus=8),  # 40 - 12 = 28 GPUs: 3 whole nodes
        PlaceholderDemand(pool="t4", count=0, gpus=4),
    ]
    assert placeholder_demand(pools, {"a100": 5}, {"a100": 12}, 2)[0].count == 14


def test_hold_scale_downs_keeps_scale_ups() -> None:
    decisions = (
        PoolDecision("a", 4, 2, "scale_down", "surplus", {}),
        PoolDecision("b", 1, 3, "scale_up", "need", {}),
    )
    plan = CapacityPlan(NOW, "predictive", {"a": 2, "b": 3}, decisions, (), PlannerMemory())
    assert hold_scale_downs(plan, []) == ({"a": 2, "b": 3}, {})
    desired, held = hold_scale_downs(plan, ["x: stale"])
    assert desired == {"a": 4, "b": 3} and list(held) == ["a"]


def test_planner_memory_advances_once_per_demand_step() -> None:
    m1, m2, m3 = PlannerMemory(step=1), PlannerMemory(step=2), PlannerMemory(step=3)
    state = PlannerState().after("s1", m1)
    assert state.memory_for("s1") is None  # a repeat in s1 plans from its start
    state = state.after("s1", m2)
    assert (state.base, state.latest) == (None, m2)
    state = state.after("s2", m3)  # a new step starts from the last memory of s1
    assert state.memory_for("s2") is m2 and state.latest is m3


def test_config_errors_name_the_field_and_line(tmp_path: Path) -> None:
    bad = pool()
    bad["max_size"] = -1
    path = write_config(tmp_path / "bad.yaml", {"state_dir": "s", "pools": [bad]})
    path.write_text(path.read_text())  # JSON text: one field per line
    with pytest.raises(InputError) as caught:
        load_live_config(path)
    assert caught.value.column == "pools.0.max_size"
    assert (
        caught.value.line is not None
        and '"max_size": -1' in path.read_text().splitlines()[caught.value.line - 1]
    )
    aws = write_config(
        tmp_path / "aws.yaml",
        {"state_dir": "s", "pools": [pool()], "provider": {"kind": "aws"}},
    )
    with pytest.raises(InputError, match="needs an `aws` section"):
        load_live_config(aws)


def test_environment_overrides_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_config(tmp_path / "c.yaml", {"state_dir": "s", "pools": [pool()]})
    monkeypatch.setenv("GPUSCALE_RECONCILE_INTERVAL_S", "7")
    monkeypatch.setenv("GPUSCALE_LEASE__IDENTITY", "pod-1")
    monkeypatch.setenv("GPUSCALE_SERVICE__TOKEN", "t0ken")
    cfg = load_live_config(path)
    assert cfg.reconcile_interval_s == 7.0 and cfg.lease.identity == "pod-1"
    assert cfg.service.bearer_token() == "t0ken"


def test_placeholder_pods_are_not_demand() -> None:
    """The Kubernetes telemetry source must not count the loop's own placeholders, or the
    scaler would chase its own headroom."""
    from predictor.telemetry import kubernetes as source
    from predictor.telemetry.kube_objects import KUBE_NAMES
    from scaler.kube.placeholders import PLACEHOLDER_LABELS, PlaceholderSettings, placeholder_pod

    assert dict(KUBE_NAMES.placeholder_labels) == PLACEHOLDER_LABELS  # one set of labels
    held = placeholder_pod(PlaceholderSettings(), "a100", 0, 8)
    job = {
        "metadata": {"name": "train", "namespace": "ml"},
        "spec": {
            "nodeSelector": {"gpuscale.io/pool": "a100"},
            "containers": [{"name": "m", "resources": {"limits": {"nvidia.com/gpu": "4"}}}],
        },
        "status": {"phase": "Pending"},
    }
    pods = [source.parse_pod(p, KUBE_NAMES) for p in (held, job)]
    assert pods[0].gpus == 0
    (a100,) = source.pool_demand([], pods)
    assert (a100.pool, a100.pending) == ("a100", 4)
