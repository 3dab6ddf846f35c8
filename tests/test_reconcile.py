"""The reconcile loop on the simulated cloud (no cloud account, no cluster): dry run, sizes
set rather than incremented, a pass repeated or interrupted never acts twice, stale or
missing telemetry never scales down, every decision logged; the config names bad fields."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from live_fixtures import fast_policy, pool, write_config

from predictor.foundation.errors import InputError
from predictor.telemetry.kube_objects import KUBE_NAMES, read_node, read_pod
from predictor.telemetry.store import TelemetryStore
from scaler.cli.live import _report
from scaler.cluster.pools import NodePool
from scaler.controller.config import LiveConfig, load_live_config
from scaler.controller.fleet import FleetNode, ObservedFleet
from scaler.controller.journal import DecisionJournal
from scaler.controller.reconcile import (
    PlannerState,
    Reconciler,
    SpareRoom,
    choose_removals,
    hold_scale_downs,
    lowered_targets,
    placeholder_demand,
)
from scaler.controller.removal_order import RemovalCandidate, removal_order
from scaler.controller.system import LiveSystem
from scaler.kube.observed import observed_cluster
from scaler.kube.placeholders import PlaceholderDemand, PlaceholderSettings, placeholder_pod
from scaler.placement import Job, make_policy
from scaler.planning.planner import CapacityPlan, PlannerMemory, PoolDecision
from scaler.planning.request_log import RequestLog
from scaler.providers.base import NodeStatus

NOW = datetime(2025, 3, 1, 12, 0, 0)
POOL_LABEL = "gpuscale.io/pool"


class Crash(Exception):
    """Stands in for a kill at a pause point."""


def config(
    tmp_path: Path,
    nodes: int = 2,
    boot_s: float = 0.0,
    scale_down: str | None = None,
    capacity: dict[str, int] | None = None,
    **extra: Any,
) -> LiveConfig:
    return LiveConfig(
        state_dir=tmp_path / "state",
        pools=[pool(min_size=1) | {"boot_seconds": boot_s}],
        provider={
            "kind": "simulated",
            "simulated": {"initial_sizes": {"a100": nodes}, "capacity": capacity or {}},
            "scale_down": scale_down,
        },
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
    (logged,) = DecisionJournal(cfg.state_dir).decisions()
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
    launched = [e for e in r.system.provider.events if e.kind == "launched"]
    assert len(launched) == 5
    # Both passes planned from the memory at the start of the same demand step.
    state = DecisionJournal(cfg.state_dir).load("planner")
    assert state.step == first.decision.step == again.decision.step
    # The first pass found no state: the memory at the start of its step was rebuilt from
    # the store's 5 steps before it (the warm start).
    assert first.decision.warm_start is not None and again.decision.warm_start is None
    assert state.base is not None and state.base.step == 5


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
    log = DecisionJournal(cfg.state_dir)
    assert [a.status for a in log.actions()] == ["pending"]

    # A new process: the simulated cloud is read back from the state directory.
    restarted = LiveSystem.build(cfg)
    outcome = reconciler(cfg, restarted).iterate(apply=True)
    statuses = [(a["action"], a["status"]) for a in outcome.actions]
    if point == "journaled":
        assert statuses == [("resolve set_target", "superseded"), ("set_target", "done")]
    else:
        assert statuses == [("resolve set_target", "done")]
    assert target(reconciler(cfg, restarted)) == 5
    launched = [e for s in (system, restarted) for e in s.provider.events if e.kind == "launched"]
    assert len(launched) == 5
    assert log.pending() == []


def test_a_restart_leaves_defragmentations_pending_actions_to_it(tmp_path: Path) -> None:
    from scaler.controller.defrag_journal import REPARTITION

    cfg = config(tmp_path)
    demand(cfg, [8.0] * 6)
    log = DecisionJournal(cfg.state_dir)
    decision = log.record("defrag", True, {}, {})
    asked = log.begin(decision, "a100", REPARTITION, "gpu-3", {"config_to": "all-1g.10gb"})
    scale = log.begin(decision, "a100", "set_target", "a100", {"from": 2, "to": 3})
    outcome = reconciler(cfg).iterate(apply=True)
    assert ("resolve set_target", "superseded") in [
        (a["action"], a["status"]) for a in outcome.actions
    ]
    # The MIG manager may still be applying it: `gpuscale defrag` settles it, not the loop.
    assert [a.id for a in log.pending()] == [asked]
    assert {a.id: a.status for a in log.actions()}[scale] == "superseded"


def out_of_capacity(tmp_path: Path) -> tuple[LiveConfig, LiveSystem]:
    """A pool grown from 2 to 5 nodes by a pass, the cloud out of capacity at 3: the
    target stays at 5, as an Auto Scaling group's after InsufficientInstanceCapacity."""
    cfg = config(tmp_path, capacity={"a100": 3})
    demand(cfg, [8.0] * 5 + [40.0])
    system = LiveSystem.build(cfg)
    up = reconciler(cfg, system).iterate(apply=True)
    assert [(a["action"], a["result"]) for a in up.actions] == [("set_target", "target 2 -> 5")]
    (group,) = system.provider.node_groups()
    assert group.target_size() == 5 and len(group.nodes()) == 3
    return cfg, system


LATER = NOW + timedelta(minutes=6)


@pytest.mark.parametrize(("falls_to", "wanted", "removed"), [(8.0, 1, 2), (32.0, 4, 0)])
def test_a_target_the_cloud_could_not_fulfil_is_lowered_once_demand_falls(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], falls_to: float, wanted: int, removed: int
) -> None:
    """Left at its peak, the target would have the cloud launch the rest once capacity
    returned, for the loop to remove again as surplus. The pass after demand falls lowers
    it to the nodes held (or the plan's size, where more), then removes the surplus."""
    cfg, system = out_of_capacity(tmp_path)
    (group,) = system.provider.node_groups()
    demand(cfg, [falls_to] * 6, end=LATER)
    dry = Reconciler(system, clock=lambda: LATER).iterate(apply=False)
    to = max(wanted, 3)
    assert [c.to_dict() for c in dry.decision.lowered] == [
        {"pool": "a100", "from": 5, "to": to, "holds": 3, "wanted": wanted}
    ]
    assert dry.decision.to_dict()["lowered_targets"][0]["to"] == to
    _report(dry, as_json=False)
    shown = capsys.readouterr().out
    assert f"lower target a100: 5 -> {to} (launches not fulfilled: the group holds 3" in shown
    assert group.target_size() == 5  # a dry run changes nothing

    down = Reconciler(system, clock=lambda: LATER).iterate(apply=True)
    assert [(a["action"], a["status"]) for a in down.actions] == [("lower_target", "done")] + [
        ("remove_node", "done")
    ] * removed
    assert down.actions[0]["result"] == (
        f"target 5 -> {to} (launches not fulfilled: the group holds 3 nodes, {wanted} wanted)"
    )
    assert group.target_size() == wanted
    (lowered,) = [a for a in system.log.actions() if a.kind == "lower_target"]
    assert (lowered.params, lowered.status) == ({"from": 5, "to": to}, "done")

    cloud = system.provider
    launched = sum(e.kind == "launched" for e in cloud.events)
    cloud.reconfigure(capacity={})  # capacity returns: only what the plan wants comes
    assert sum(e.kind == "launched" for e in cloud.events) == launched + wanted - 3 + removed
    assert group.target_size() == len(group.nodes()) == wanted
    again = Reconciler(system, clock=lambda: LATER).iterate(apply=True)
    assert again.actions == []


@pytest.mark.parametrize("point", ["journaled", "acted"])
def test_an_interrupted_lowering_is_settled_not_repeated(tmp_path: Path, point: str) -> None:
    cfg, system = out_of_capacity(tmp_path)
    (group,) = system.provider.node_groups()
    demand(cfg, [8.0] * 6, end=LATER)

    def crash(at: str) -> None:
        if at == point:
            raise Crash(at)

    with pytest.raises(Crash):
        Reconciler(system, clock=lambda: LATER, pause=crash).iterate(apply=True)
    (pending,) = system.log.pending()
    assert (pending.kind, pending.params) == ("lower_target", {"from": 5, "to": 3})

    outcome = Reconciler(system, clock=lambda: LATER).iterate(apply=True)
    statuses = [(a["action"], a["status"]) for a in outcome.actions]
    removals = [("remove_node", "done")] * 2
    if point == "journaled":
        resolved = [("resolve lower_target", "superseded"), ("lower_target", "done")]
    else:
        resolved = [("resolve lower_target", "done")]
    assert statuses == resolved + removals
    assert group.target_size() == len(group.nodes()) == 1
    assert system.log.pending() == []


def test_only_targets_above_the_nodes_held_and_the_plan_are_lowered() -> None:
    def nodes(pool: str, count: int) -> tuple[FleetNode, ...]:
        return tuple(FleetNode(f"{pool}-{i}", pool, NodeStatus.READY, NOW) for i in range(count))

    fleet = ObservedFleet(
        {p: nodes(p, 2) for p in ("short", "planned", "held", "met", "growing")},
        {"short": 5, "planned": 5, "held": 5, "met": 2, "growing": 3},
    )
    desired = {"short": 1, "planned": 4, "held": 2, "met": 1, "growing": 6}
    cuts = lowered_targets(fleet, desired, {"held": "scale-down held: stale"})
    assert [(c.pool, c.target, c.to) for c in cuts] == [("short", 5, 2), ("planned", 5, 4)]


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
    (logged,) = DecisionJournal(cfg.state_dir).decisions()
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

    def node(name: str, status: NodeStatus, minutes: int, **kw: Any) -> FleetNode:
        kw.setdefault("kube_name", name)
        return FleetNode(name, "a100", status, t + timedelta(minutes=minutes), **kw)

    nodes = (
        node("busy", NodeStatus.READY, 0, busy=True),
        node("pods", NodeStatus.READY, 1, movable_pods=2),
        node("idle-old", NodeStatus.READY, 2),
        node("idle-new", NodeStatus.READY, 3),
        node("resumed", NodeStatus.READY, 4, movable_pods=3, cordoned_by_us=True),
        node("booting", NodeStatus.BOOTING, 5, kube_name=None),  # not registered yet
        node("backoff", NodeStatus.READY, 6),
        node("joined", NodeStatus.BOOTING, 7, busy=True),  # registered, runs training
    )
    fleet = ObservedFleet({"a100": nodes}, {"a100": 8}, kubernetes=True)
    order = [n.cloud_name for n in choose_removals(fleet, "a100", 10, frozenset({"backoff"}))]
    assert order == ["booting", "resumed", "idle-new", "idle-old", "pods"]
    assert [n.cloud_name for n in choose_removals(fleet, "a100", 2, frozenset())] == [
        "booting",
        "resumed",
    ]


def test_the_removal_order_needs_no_kubernetes() -> None:
    """What the job simulator calls: any clock, any key."""
    order = removal_order(
        [
            RemovalCandidate("old-idle", 1.0),
            RemovalCandidate("new-idle", 5.0),
            RemovalCandidate("kept", 9.0, removable=False),
            RemovalCandidate("pods", 7.0, movable_pods=1),
            RemovalCandidate("ours", 0.0, cordoned_by_us=True, movable_pods=4),
            RemovalCandidate("boot-old", 2.0, booting=True),
            RemovalCandidate("boot-new", 8.0, booting=True),
            RemovalCandidate("boot-kept", 9.5, booting=True, removable=False),
        ]
    )
    assert [c.key for c in order] == [
        "boot-new",
        "boot-old",
        "ours",
        "new-idle",
        "old-idle",
        "pods",
    ]
    assert removal_order([RemovalCandidate("a", 0.0)], count=0) == []


def kube_node(name: str, pool: str = "a100", gpus: int = 8, cpu: str = "96") -> dict:
    return {
        "metadata": {"name": name, "labels": {POOL_LABEL: pool, "nvidia.com/gpu.product": "A100"}},
        "spec": {"providerID": f"sim:///{name}"},
        "status": {
            "allocatable": {"cpu": cpu, "memory": "1Ti", "nvidia.com/gpu": str(gpus)},
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


def kube_pod(
    name: str,
    node: str | None,
    *,
    gpus: int = 0,
    cpu: str = "1",
    share: int | None = None,
    pool: str | None = None,
) -> dict:
    requests = {"cpu": cpu, "memory": "1Gi"} | ({"nvidia.com/gpu": str(gpus)} if gpus else {})
    spec: dict[str, Any] = {"containers": [{"name": "main", "resources": {"requests": requests}}]}
    if node is not None:
        spec["nodeName"] = node
    if pool is not None:
        spec["nodeSelector"] = {POOL_LABEL: pool}
    annotations = {"gpuscale.io/gpu-milli": str(share)} if share is not None else {}
    owner = {
        "apiVersion": "apps/v1",
        "kind": "ReplicaSet",
        "name": "x",
        "uid": "u",
        "controller": True,
    }
    return {
        "metadata": {
            "name": name,
            "namespace": "ml",
            "annotations": annotations,
            "ownerReferences": [owner],
        },
        "spec": spec,
        "status": {"phase": "Running" if node else "Pending"},
    }


def fleet_of(pool: str, nodes: list[dict], pods: list[dict]) -> ObservedFleet:
    """The fleet the loop would see: every node ready, registered under its own name."""
    cluster = observed_cluster(
        [(read_node(n), n["metadata"]["name"]) for n in nodes], [read_pod(p) for p in pods]
    )
    views = tuple(
        FleetNode(
            n["metadata"]["name"], pool, NodeStatus.READY, NOW, kube_name=n["metadata"]["name"]
        )
        for n in nodes
    )
    return ObservedFleet({pool: views}, {pool: len(views)}, kubernetes=True, cluster=cluster)


def test_placeholders_pack_the_job_mix_onto_the_room_the_plan_provides() -> None:
    a100 = NodePool(name="a100", gpu_model="A100", gpus_per_node=8, price_per_hour=1, max_size=9)
    # 6 GPUs run on n1, 1 on n2: room for 2 + 7 GPUs there, and 3 whole new nodes.
    fleet = fleet_of(
        "a100",
        [kube_node("n1"), kube_node("n2")],
        [kube_pod("train", "n1", gpus=6), kube_pod("infer", "n2", gpus=1)],
    )

    def demand(mix: list[Job], gpus_each: int | None = None, **kw: Any) -> list[PlaceholderDemand]:
        spare = SpareRoom(
            fleet,
            {"a100": 5},
            removed=frozenset(),
            estimate=None,
            mix=mix,
            policy=make_policy("bestfit"),
            names=KUBE_NAMES,
            gpus_each=gpus_each,
            **kw,
        )
        return placeholder_demand(spare, [a100], PlaceholderSettings())

    # Whole-node placeholders fit only the new nodes: 33 free GPUs, but no 8 together on
    # n1 or n2 (a GPU sum divided by 8 would ask for 4 and one could never be scheduled).
    assert demand([], gpus_each=8) == [PlaceholderDemand(pool="a100", count=3, gpus=8)]
    # A mix of 4- and 1-GPU jobs (one each): every free GPU is held, none bigger than 4.
    mix = [Job("m4", num_gpu=4, gpu_milli=1000), Job("m1", num_gpu=1, gpu_milli=1000)]
    held = demand(mix)
    assert sum(d.count * d.gpus for d in held) == 33
    assert {d.gpus for d in held} == {4, 1} and all(d.pool == "a100" for d in held)
    assert [d.gpus for d in held] == sorted((d.gpus for d in held), reverse=True)
    # Sharing jobs: the GPUs they share are held by one-GPU placeholders.
    half = [Job("half", num_gpu=1, gpu_milli=500)]
    assert demand(half) == [PlaceholderDemand(pool="a100", count=33, gpus=1)]
    # n2 goes and nothing is added: 2 GPUs left on n1, no room for 4 together.
    assert (
        placeholder_demand(
            SpareRoom(
                fleet,
                {"a100": 1},
                removed=frozenset({"n2"}),
                estimate=None,
                mix=[],
                policy=make_policy("bestfit"),
                names=KUBE_NAMES,
                gpus_each=4,
            ),
            [a100],
            PlaceholderSettings(),
        )
        == []
    )


def test_pending_pods_take_their_room_before_placeholders() -> None:
    a100 = NodePool(name="a100", gpu_model="A100", gpus_per_node=8, price_per_hour=1, max_size=9)
    fleet = fleet_of(
        "a100",
        [kube_node("n1")],
        [kube_pod("wait", None, gpus=2, pool="a100"), kube_pod("other", None, gpus=4, pool="t4")],
    )
    spare = SpareRoom(
        fleet,
        {"a100": 1},
        removed=frozenset(),
        estimate=None,
        mix=[Job("m1", num_gpu=1, gpu_milli=1000)],
        policy=make_policy("bestfit"),
        names=KUBE_NAMES,
    )
    held = placeholder_demand(spare, [a100], PlaceholderSettings())
    assert held == [PlaceholderDemand(pool="a100", count=6, gpus=1)]  # 8 less the pending 2


def test_an_idle_node_a_pending_pod_fits_only_on_is_kept() -> None:
    """As in Cluster Autoscaler, pending pods that fit now are placed before the scale-down
    check: n2 is idle, but the 4-GPU pod waiting for the pool fits only there (n1 has one
    GPU free), so n2 may not go; a pod that would fit n1 as well leaves n2 removable."""
    policy = make_policy("bestfit")
    nodes = [kube_node("n1"), kube_node("n2")]
    train = kube_pod("train", "n1", gpus=7)

    def fleet(*pods: dict) -> ObservedFleet:
        seen = fleet_of("a100", nodes, [train, *pods])
        busy = tuple(replace(n, busy=n.cloud_name == "n1") for n in seen.nodes["a100"])
        return replace(seen, nodes={"a100": busy}).with_removal_checks(policy, frozenset())

    def checked(*pods: dict) -> FleetNode:
        return {n.cloud_name: n for n in fleet(*pods).all_nodes()}["n2"]

    assert checked().drainable is True
    wait = kube_pod("wait", None, gpus=4, pool="a100")
    kept = checked(wait)
    assert kept.drainable is False and "job ml/wait fits no other node" in kept.check
    assert fleet(wait).removable("a100", frozenset()) == []
    assert checked(kube_pod("small", None, gpus=1, pool="a100")).drainable is True
    # A placeholder holding n2 does not stand in the way: the pod preempts it.
    placeholder = placeholder_pod(PlaceholderSettings(), "a100", 0, 8)
    placeholder["spec"]["nodeName"] = "n2"
    placeholder["status"] = {"phase": "Running"}
    assert checked(placeholder).drainable is True
    assert checked(placeholder, wait).drainable is False
    # Pods that cannot both fit: the first in FIFO order (by id here) takes n2's room.
    two = checked(kube_pod("a-big", None, gpus=8, pool="a100"), kube_pod("b", None, gpus=4))
    assert two.drainable is False and "ml/a-big" in two.check


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
    none = RequestLog()
    state = PlannerState().after("s1", m1, none)
    assert state.memory_for("s1") is None  # a repeat in s1 plans from its start
    state = state.after("s1", m2, none)
    assert (state.base, state.latest) == (None, m2)
    state = state.after("s2", m3, none)  # a new step starts from the last memory of s1
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


# ---- the live loop on the one cluster model, against the fake API server ---------------


def kube_cluster(
    tmp_path: Path,
    fake: Any,
    nodes: int,
    gpus: float = 8.0,
    mix: list[dict] | None = None,
    boot_s: float = 0.0,
    scale_down: str | None = None,
    **kube: Any,
) -> Reconciler:
    """The loop on the simulated cloud with `nodes` ready a100 nodes, each registered in
    the fake API server under its cloud name (8 GPUs, 96 CPUs); demand of `gpus` GPUs; the
    placement mix `mix` (default: the configured default); nodes added boot `boot_s`."""
    placement = {"mix": mix} if mix is not None else {}
    cfg = config(
        tmp_path,
        nodes=nodes,
        boot_s=boot_s,
        scale_down=scale_down,
        kubernetes={"host": fake.url, "drain": {"timeout_s": 0.5, "poll_s": 0.02}} | kube,
        lease={"enabled": False},
        placement=placement,
    )
    demand(cfg, [8.0] * 5 + [gpus])
    r = reconciler(cfg)
    (group,) = r.system.provider.node_groups()
    for node in sorted(n.name for n in group.nodes()):
        fake.create("nodes", kube_node(node))
    return r


def kube_names_of(r: Reconciler) -> list[str]:
    (group,) = r.system.provider.node_groups()
    return sorted(n.name for n in group.nodes())


def test_a_pending_gpu_sharing_pod_scales_up_the_live_loop(tmp_path: Path, fake: Any) -> None:
    """The forecast sees one node's worth of demand, but a pod asking a quarter of a GPU
    waits and no node has a GPU free: the reactive floor (the scale-up estimate on the
    pool's template) adds a node, as Cluster Autoscaler would."""
    r = kube_cluster(tmp_path, fake, nodes=1, pre_position=False)
    (node,) = kube_names_of(r)
    fake.create("pods", kube_pod("train", node, gpus=8))
    calm = r.iterate(apply=False).decision
    assert calm.desired == {"a100": 1} and calm.reactive is not None
    assert calm.reactive.floor == {}

    fake.create("pods", kube_pod("notebook", None, gpus=1, share=250, pool="a100"))
    outcome = r.iterate(apply=True)
    d = outcome.decision
    assert d.plan.desired == {"a100": 1}  # the forecast alone would not grow
    assert d.reactive is not None and d.reactive.floor == {"a100": 2}
    assert d.desired == {"a100": 2}
    assert d.reactive.demand.estimate.pools["a100"].jobs == ("ml/notebook",)
    assert [(a["action"], a["result"]) for a in outcome.actions] == [
        ("set_target", "target 1 -> 2")
    ]
    assert target(r) == 2
    logged = DecisionJournal(r.config.state_dir).decisions()[0]  # newest first
    assert logged.plan["reactive"]["pending_pods"] == 1
    assert logged.plan["reactive"]["estimate"]["new_nodes"] == {"a100": 1}
    assert logged.inputs["reactive"]["floor"] == {"a100": 2}
    assert logged.inputs["fleet"]["used_gpus"] == {"a100": 8.25}  # the share, not a GPU

    # The same pod fits a node with a GPU to share: no new node.
    fake.delete("pods", "train", "ml")
    fake.create("pods", kube_pod("train", node, gpus=7))
    again = r.iterate(apply=False).decision
    assert again.reactive is not None and again.reactive.floor == {}
    assert again.reactive.demand.estimate.on_existing == ("ml/notebook",)


def test_a_node_whose_pods_fit_elsewhere_goes_and_one_whose_pods_do_not_stays(
    tmp_path: Path, fake: Any
) -> None:
    """Demand wants one node of three. The first runs training (never a candidate); the
    second's pods (11 CPUs) fit on the first; the third runs a 90-CPU pod no other node has
    room for, so the scale-down check keeps it: one node goes, not two."""
    r = kube_cluster(tmp_path, fake, nodes=3, pre_position=False)
    busy, light, heavy = kube_names_of(r)
    fake.create("pods", kube_pod("train", busy, gpus=8, cpu="80"))
    fake.create("pods", kube_pod("web", light, cpu="1"))
    fake.create("pods", kube_pod("cache", light, cpu="10"))
    fake.create("pods", kube_pod("db", heavy, cpu="90"))

    outcome = r.iterate(apply=True)
    d = outcome.decision
    views = {n.cloud_name: n for n in d.fleet.all_nodes()}
    assert views[busy].busy and views[busy].drainable is None  # never checked
    assert views[light].drainable is True and "fit elsewhere" in views[light].check
    assert views[heavy].drainable is False and "job ml/db fits no other node" in views[heavy].check
    assert d.plan.decisions[0].inputs["removable"] == 1
    assert d.desired == {"a100": 2}
    assert [r_.cloud_name for r_ in d.removals] == [light]
    (removed,) = [a for a in outcome.actions if a["action"] == "remove_node"]
    assert (removed["node"], removed["status"]) == (light, "done")
    assert kube_names_of(r) == [busy, heavy] and target(r) == 2
    assert sorted(p["metadata"]["name"] for p in fake.objects("pods", "ml")) == ["db", "train"]

    # The moved pods run again on the busy node: the heavy one still cannot go.
    fake.create("pods", kube_pod("web", busy, cpu="1"))
    fake.create("pods", kube_pod("cache", busy, cpu="10"))
    fake.delete("nodes", light)
    after = r.iterate(apply=True).decision
    assert after.desired == {"a100": 2} and after.removals == ()


def test_placeholders_in_the_live_loop_follow_the_mix(tmp_path: Path, fake: Any) -> None:
    """Two nodes wanted, one runs a 6-GPU job: the mix (whole 2-GPU jobs) is packed onto
    the two GPUs left there and the new node."""
    r = kube_cluster(tmp_path, fake, nodes=1, gpus=16.0, mix=[{"num_gpu": 2}])
    (node,) = kube_names_of(r)
    fake.create("pods", kube_pod("train", node, gpus=6))
    outcome = r.iterate(apply=True)
    assert outcome.decision.desired == {"a100": 2}
    assert list(outcome.decision.placeholders) == [PlaceholderDemand(pool="a100", count=5, gpus=2)]
    made = fake.objects("pods", "gpuscale-system")
    assert len(made) == 5
    assert {
        p["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/gpu"] for p in made
    } == {"2"}


def test_a_node_with_a_pod_no_drain_may_take_is_not_removable(tmp_path: Path, fake: Any) -> None:
    """Demand wants one node of three; the two idle ones run a bare pod (nothing would
    recreate it) and one annotated safe-to-evict "false". Neither may go, as in Cluster
    Autoscaler, and the plan says which pod keeps each."""
    r = kube_cluster(tmp_path, fake, nodes=3, pre_position=False)
    busy, bare, pinned = kube_names_of(r)
    fake.create("pods", kube_pod("train", busy, gpus=8))
    notebook = kube_pod("notebook", bare)
    del notebook["metadata"]["ownerReferences"]
    fake.create("pods", notebook)
    guarded = kube_pod("guarded", pinned)
    guarded["metadata"]["annotations"] = {"cluster-autoscaler.kubernetes.io/safe-to-evict": "false"}
    fake.create("pods", guarded)

    dry = r.iterate(apply=False).decision
    nodes = {n["node"]: n for n in dry.fleet.to_dict()["nodes"]["a100"]}  # what --json shows
    assert nodes[bare]["drainable"] is False
    assert nodes[bare]["check"] == "pod ml/notebook has no controller to recreate it"
    assert nodes[pinned]["drainable"] is False
    assert nodes[pinned]["check"] == (
        'pod ml/guarded is annotated cluster-autoscaler.kubernetes.io/safe-to-evict: "false"'
    )
    assert dry.plan.decisions[0].inputs["removable"] == 0 and dry.removals == ()

    applied = r.iterate(apply=True)
    assert [a for a in applied.actions if a["action"] == "remove_node"] == []
    assert kube_names_of(r) == [busy, bare, pinned]
    assert not any(n["spec"].get("unschedulable") for n in fake.objects("nodes"))


def test_a_system_pod_no_budget_covers_or_local_storage_keeps_a_node_unless_configured(
    tmp_path: Path, fake: Any
) -> None:
    """Demand wants one node of three; the idle ones run a kube-system pod no budget covers
    and a pod with an emptyDir on disk. As in Cluster Autoscaler (its flags'
    defaults), neither node may go and the plan names the pod and why; with
    `kubernetes.drain.skip_nodes_with_system_pods` and `skip_nodes_with_local_storage`
    false, both go."""
    r = kube_cluster(tmp_path, fake, nodes=3, pre_position=False)
    busy, system, local = kube_names_of(r)
    fake.create("pods", kube_pod("train", busy, gpus=8))
    coredns = kube_pod("coredns", system)
    coredns["metadata"]["namespace"] = "kube-system"
    fake.create("pods", coredns)
    cache = kube_pod("cache", local)
    cache["spec"]["volumes"] = [{"name": "scratch", "emptyDir": {}}]
    fake.create("pods", cache)

    dry = r.iterate(apply=False).decision
    nodes = {n["node"]: n for n in dry.fleet.to_dict()["nodes"]["a100"]}
    assert nodes[system]["drainable"] is False
    assert nodes[system]["check"] == (
        "pod kube-system/coredns is a kube-system pod no PodDisruptionBudget covers"
    )
    assert nodes[local]["drainable"] is False
    assert nodes[local]["check"] == (
        "pod ml/cache has local storage (scratch) not named in"
        " cluster-autoscaler.kubernetes.io/safe-to-evict-local-volumes"
    )
    assert dry.plan.decisions[0].inputs["removable"] == 0 and dry.removals == ()

    kube = r.config.kubernetes
    assert kube is not None
    drain = kube.drain.model_copy(
        update={"skip_nodes_with_system_pods": False, "skip_nodes_with_local_storage": False}
    )
    off = r.config.model_copy(update={"kubernetes": kube.model_copy(update={"drain": drain})})
    applied = reconciler(off, replace(r.system, config=off)).iterate(apply=True)
    removed = [a["node"] for a in applied.actions if a["action"] == "remove_node"]
    assert sorted(removed) == sorted([system, local])
    assert all(a["status"] == "done" for a in applied.actions)
    assert kube_names_of(r) == [busy]


def test_the_drain_asks_the_rules_again_of_the_pods_there_now(tmp_path: Path, fake: Any) -> None:
    """At plan time a budget covers the idle node's kube-system pod, so the node may go;
    the budget is deleted before the drain. The drain asks the same rules of the cluster
    as it is then: nothing is evicted, the node serves again, and the action says why."""
    r = kube_cluster(tmp_path, fake, nodes=2, pre_position=False)
    busy, idle = kube_names_of(r)
    fake.create("pods", kube_pod("train", busy, gpus=8))
    coredns = kube_pod("coredns", idle)
    coredns["metadata"] |= {"namespace": "kube-system", "labels": {"k8s-app": "kube-dns"}}
    fake.create("pods", coredns)
    selector = {"matchLabels": {"k8s-app": "kube-dns"}}
    fake.create(
        "poddisruptionbudgets",
        {"metadata": {"name": "coredns", "namespace": "kube-system"},
         "spec": {"maxUnavailable": 1, "selector": selector}},
    )  # fmt: skip

    def budget_deleted(at: str) -> None:
        if at == "journaled":
            fake.delete("poddisruptionbudgets", "coredns", "kube-system")

    outcome = reconciler(r.config, r.system, pause=budget_deleted).iterate(apply=True)
    assert [x.cloud_name for x in outcome.decision.removals] == [idle]
    (removal,) = [a for a in outcome.actions if a["action"] == "remove_node"]
    assert removal["status"] == "blocked"
    assert removal["blocking"] == [
        {
            "pod": "kube-system/coredns",
            "budget": None,
            "reason": "pod kube-system/coredns is a kube-system pod no PodDisruptionBudget covers",
        }
    ]
    assert [p["metadata"]["name"] for p in fake.objects("pods", "kube-system")] == ["coredns"]
    assert kube_names_of(r) == [busy, idle]
    assert not fake.get("nodes", idle)["spec"].get("unschedulable")


def test_a_registered_node_the_cloud_calls_booting_is_checked_like_a_ready_one(
    tmp_path: Path, fake: Any
) -> None:
    """Two of four nodes are still booting in the cloud's eyes; one of them has registered
    (an instance a lifecycle hook holds, a NodeClaim not yet Ready) and already runs
    training. Two must go: the unregistered booting node (no pod can run there) and the
    idle ready one; the registered booting node is busy and stays, its pod untouched."""
    r = kube_cluster(tmp_path, fake, nodes=2, pre_position=False, boot_s=3600)
    first, idle = kube_names_of(r)
    fake.create("pods", kube_pod("train", first, gpus=8))
    (group,) = r.system.provider.node_groups()
    group.increase_size(2)
    registered, unregistered = sorted(
        n.name for n in group.nodes() if n.status is NodeStatus.BOOTING
    )
    fake.create("nodes", kube_node(registered))
    fake.create("pods", kube_pod("early", registered, gpus=8))

    outcome = r.iterate(apply=True)
    d = outcome.decision
    views = {n.cloud_name: n for n in d.fleet.all_nodes()}
    assert views[registered].booting and views[registered].busy
    assert d.desired == {"a100": 2}
    assert sorted(x.cloud_name for x in d.removals) == sorted([idle, unregistered])
    done = [a["node"] for a in outcome.actions if a["action"] == "remove_node"]
    assert sorted(done) == sorted([idle, unregistered])
    assert all(a["status"] == "done" for a in outcome.actions)
    assert kube_names_of(r) == sorted([first, registered])
    assert sorted(p["metadata"]["name"] for p in fake.objects("pods", "ml")) == ["early", "train"]
    assert not fake.get("nodes", registered)["spec"].get("unschedulable")


def test_a_node_someone_else_cordoned_is_neither_removed_nor_uncordoned(
    tmp_path: Path, fake: Any
) -> None:
    """Demand wants one node of two; the idle one is under an operator's cordon. It is not
    chosen (the plan says why) and stays cordoned after the pass."""
    r = kube_cluster(tmp_path, fake, nodes=2, pre_position=False)
    busy, held = kube_names_of(r)
    fake.create("pods", kube_pod("train", busy, gpus=8))
    fake.patch("nodes", held, {"spec": {"unschedulable": True}})

    outcome = r.iterate(apply=True)
    (view,) = [n for n in outcome.decision.fleet.to_dict()["nodes"]["a100"] if n["node"] == held]
    assert view["drainable"] is False and "cordoned by someone else" in view["check"]
    assert outcome.decision.removals == () and outcome.actions == []
    assert kube_names_of(r) == [busy, held]
    assert fake.get("nodes", held)["spec"]["unschedulable"] is True


@pytest.mark.parametrize("scale_down", ["drain", "none"])
def test_every_node_gpuscale_cordoned_and_keeps_is_uncordoned(
    tmp_path: Path, fake: Any, scale_down: str
) -> None:
    """gpuscale's cordon marker is left on a node of the pool (a removal a restart cut
    short, now busy) and on a node of a pool no longer configured (the config changed, or
    the mode: scale_down none now). Nobody else would undo those cordons: the pass does."""
    r = kube_cluster(tmp_path, fake, nodes=1, pre_position=False, scale_down=scale_down)
    (node,) = kube_names_of(r)
    fake.create("pods", kube_pod("train", node, gpus=8))
    fake.create("nodes", kube_node("old-v100", pool="v100"))
    marker = {"metadata": {"annotations": {KUBE_NAMES.removal_annotation: "2025-03-01T11:00:00"}}}
    for name in (node, "old-v100"):
        fake.patch("nodes", name, marker | {"spec": {"unschedulable": True}})

    outcome = r.iterate(apply=True)
    uncordoned = sorted(a["node"] for a in outcome.actions if a["action"] == "uncordon")
    assert uncordoned == sorted([node, "old-v100"])
    assert all(a["status"] == "done" for a in outcome.actions)
    for name in (node, "old-v100"):
        after = fake.get("nodes", name)
        assert not after["spec"].get("unschedulable")
        assert KUBE_NAMES.removal_annotation not in (after["metadata"].get("annotations") or {})


def test_a_pass_cordons_every_node_it_removes_before_draining_and_skips_one_pods_reached(
    tmp_path: Path, fake: Any
) -> None:
    """Demand wants one node of three; the two light ones go in one pass. Both are
    cordoned before the first eviction, so nothing one drain evicts can land on the other.
    A pod that reaches the second after the decision (before its cordon) was never checked
    to fit elsewhere: that node is skipped and serves again, the pod untouched."""
    r = kube_cluster(tmp_path, fake, nodes=3, pre_position=False)
    busy, *light = kube_names_of(r)
    fake.create("pods", kube_pod("train", busy, gpus=8, cpu="80"))
    for i, node in enumerate(light):
        fake.create("pods", kube_pod(f"web-{i}", node))
    first, second = (x.cloud_name for x in r.iterate(apply=False).decision.removals)
    journaled = []

    def a_pod_arrives(point: str) -> None:
        journaled.append(point == "journaled")
        if journaled[-1] and sum(journaled) == 2:  # the second removal, not yet cordoned
            fake.create("pods", kube_pod("late", second))

    r.pause = a_pod_arrives
    outcome = r.iterate(apply=True)
    statuses = {a["node"]: a["status"] for a in outcome.actions if a["action"] == "remove_node"}
    assert statuses == {first: "done", second: "skipped"}
    (skipped,) = [a for a in outcome.actions if a["node"] == second]
    assert "pods arrived since the scale-down check: ml/late" in skipped["result"]
    cordon_second = next(
        i for i, (m, p) in enumerate(fake.requests) if m == "PATCH" and p.endswith(second)
    )
    first_eviction = next(i for i, (m, p) in enumerate(fake.requests) if p.endswith("/eviction"))
    assert cordon_second < first_eviction
    assert kube_names_of(r) == sorted([busy, second])
    left = fake.get("nodes", second)
    assert not left["spec"].get("unschedulable")
    assert KUBE_NAMES.removal_annotation not in (left["metadata"].get("annotations") or {})
    on_second = [p["metadata"]["name"] for p in fake.objects("pods", "ml")]
    assert "late" in on_second and f"web-{light.index(second)}" in on_second
    assert r.system.log.load("unremovable", {}) == {}  # checked afresh next pass


def test_a_pass_removes_at_most_max_nodes_registered_nodes(tmp_path: Path, fake: Any) -> None:
    """Four idle nodes of five are surplus, the cap is two: two go this pass, the others
    are left serving (not cordoned) for the next pass to check again."""
    drain = {"timeout_s": 0.5, "poll_s": 0.02, "max_nodes": 2}
    r = kube_cluster(tmp_path, fake, nodes=5, pre_position=False, drain=drain)
    busy = kube_names_of(r)[0]
    fake.create("pods", kube_pod("train", busy, gpus=8))
    outcome = r.iterate(apply=True)
    d = outcome.decision
    assert d.desired == {"a100": 1} and len(d.removals) == 2
    assert [a["status"] for a in outcome.actions] == ["done", "done"]
    kept = kube_names_of(r)
    assert len(kept) == 3
    assert not any(fake.get("nodes", n)["spec"].get("unschedulable") for n in kept)
    assert len(r.iterate(apply=True).decision.removals) == 2


def test_a_leader_that_loses_its_lease_mid_drain_stops_and_uncordons(
    tmp_path: Path, fake: Any
) -> None:
    """Two light nodes go in one pass; the lease lapses while the first drains (its pod's
    budget refuses the eviction, so the drain polls). The drain stops at its next round:
    nothing more is evicted, the provider is not asked, and both cordoned nodes serve
    again."""
    from kubernetes import client as k8s

    from scaler.controller.config import LeaseSection
    from scaler.controller.leader import LeaderElector

    r = kube_cluster(tmp_path, fake, nodes=3, pre_position=False)
    busy, *light = kube_names_of(r)
    fake.create("pods", kube_pod("train", busy, gpus=8, cpu="80"))
    for i, node in enumerate(light):
        fake.create("pods", kube_pod(f"web-{i}", node))
    first = r.iterate(apply=False).decision.removals[0].kube_name
    guarded = f"web-{light.index(first)}"
    fake.patch("pods", guarded, {"metadata": {"labels": {"app": "guarded"}}}, "ml")
    fake.create(
        "poddisruptionbudgets",
        {
            "metadata": {"name": "guarded", "namespace": "ml"},
            "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "guarded"}}},
        },
    )
    now = [0.0]
    lease = LeaseSection(identity="me", duration_s=15, renew_deadline_s=10)
    elector = LeaderElector(k8s.ApiClient(k8s.Configuration(host=fake.url)), lease, lambda: now[0])
    assert elector.try_acquire_or_renew()
    r.elector = elector
    budgets = fake.eviction_policy

    def lapse_on_refusal(pod: dict) -> Any:
        refused = budgets(pod)
        if refused is not None:
            now[0] = 60.0  # no renewal came: the renew deadline has passed
        return refused

    fake.eviction_policy = lapse_on_refusal
    (group,) = r.system.provider.node_groups()
    outcome = r.iterate(apply=True)
    assert any("stopped" in e for e in outcome.errors)
    assert group.target_size() == 3
    running = {p["metadata"]["name"] for p in fake.objects("pods", "ml")}
    assert running == {"train", "web-0", "web-1"}
    for node in light:
        after = fake.get("nodes", node)
        assert not after["spec"].get("unschedulable")
        assert KUBE_NAMES.removal_annotation not in (after["metadata"].get("annotations") or {})
    assert r.system.log.pending() == []
