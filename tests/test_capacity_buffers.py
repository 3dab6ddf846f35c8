"""CapacityBuffer mode end to end against the fake API server: the node autoscaler
(Cluster Autoscaler, played by the test) sizes the pool; `gpuscale scale --apply --once`
keeps one PodTemplate and one CapacityBuffer per pool whose replicas are the spare room
the plan provides, removes no node itself and writes nothing when nothing changed."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from fake_kube import FakeKube
from kubernetes import client as k8s
from live_fixtures import (
    fast_policy,
    pool,
    ready_gpu_node,
    run_pod,
    scale_app,
    write_config,
    write_demand,
)
from typer.testing import CliRunner

from scaler.controller.config import LiveConfig
from scaler.controller.journal import DecisionJournal
from scaler.controller.reconcile import Reconciler
from scaler.controller.system import LiveSystem
from scaler.kube.capacity_buffers import (
    BufferChange,
    BufferDemand,
    BufferSettings,
    BufferUnit,
    CapacityBuffers,
    not_ready,
)
from scaler.kube.watched import WatchedCluster, forget_watched

NAMESPACE = "gpuscale-system"
UNIT = {"num_gpu": 8, "cpu_milli": 8000, "memory_mib": 32768}  # whole-node jobs


def live(tmp_path: Path, fake: FakeKube, **kubernetes: Any) -> Path:
    return write_config(
        tmp_path / "live.yaml",
        {
            "state_dir": str(tmp_path / "state"),
            "pools": [pool(min_size=1, max_size=10)],
            "provider": {"kind": "autoscaler"},
            "kubernetes": {"host": fake.url, "pre_position": "capacity-buffer"} | kubernetes,
            "model": {"name": "persistence"},
            "policy": fast_policy(),
            "placement": {"mix": [UNIT]},
            "lease": {"identity": "e2e", "duration_s": 5, "renew_deadline_s": 4, "retry_s": 1},
        },
    )


def scale(config: Path, *args: str) -> dict[str, Any]:
    result = CliRunner().invoke(scale_app(), ["scale", "--config", str(config), "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


def buffer(fake: FakeKube) -> dict[str, Any]:
    return fake.get("capacitybuffers", "gpuscale-a100", NAMESPACE)


def writes(fake: FakeKube) -> list[tuple[str, str]]:
    """Requests that change PodTemplates or CapacityBuffers."""
    return [
        (m, p)
        for m, p in fake.requests
        if m in ("POST", "PUT", "PATCH", "DELETE")
        and ("podtemplates" in p or "capacitybuffers" in p)
    ]


def test_buffer_replicas_follow_the_plan_and_nothing_repeats(
    tmp_path: Path, fake: FakeKube
) -> None:
    state = tmp_path / "state"
    busy = ready_gpu_node(fake, "gpu-0")
    ready_gpu_node(fake, "gpu-1")
    run_pod(fake, "train-0", busy, gpus=8)  # real work on one node, the other idle
    config = live(tmp_path, fake)

    # Demand rises to five nodes' worth: a dry run plans the buffer and writes nothing.
    write_demand(state, "a100", [8.0] * 4 + [40.0])
    dry = scale(config, "--once")
    assert dry["plan"]["final_desired"] == {"a100": 5}
    (planned,) = dry["plan"]["capacity_buffers"]
    assert planned["replicas"] == 4  # 5 nodes planned, train-0's full: 4 whole nodes spare
    assert fake.objects("capacitybuffers") == [] and fake.objects("podtemplates") == []
    assert writes(fake) == []

    up = scale(config, "--apply", "--once")
    assert up["applied"] and up["errors"] == []
    (action,) = up["actions"]
    assert (action["action"], action["node"], action["status"]) == (
        "set_buffer",
        "gpuscale-a100",
        "done",
    )
    assert action["result"].startswith("created with 4 replicas; PodTemplate")
    made = buffer(fake)
    assert made["spec"] == {
        "provisioningStrategy": "buffer.x-k8s.io/active-capacity",
        "podTemplateRef": {"name": "gpuscale-buffer-a100"},
        "replicas": 4,
        "limits": {"nvidia.com/gpu": "80"},  # the pool's GPUs at max size
    }
    template = fake.get("podtemplates", "gpuscale-buffer-a100", NAMESPACE)["template"]
    assert template["spec"]["nodeSelector"] == {"gpuscale.io/pool": "a100"}
    (container,) = template["spec"]["containers"]
    assert container["resources"]["requests"] == {
        "nvidia.com/gpu": "8",
        "cpu": "8000m",
        "memory": "32768Mi",
    }
    # gpuscale resized nothing and holds no placeholder pod: the autoscaler provisions.
    assert [n["metadata"]["name"] for n in fake.objects("nodes")] == ["gpu-0", "gpu-1"]
    assert fake.objects("pods", NAMESPACE) == []

    # A restarted process (and any repeated pass) finds everything as planned.
    before = (buffer(fake)["metadata"]["resourceVersion"], len(writes(fake)))
    again = scale(config, "--apply", "--once")
    assert again["actions"] == [] and again["errors"] == []
    assert (buffer(fake)["metadata"]["resourceVersion"], len(writes(fake))) == before

    # The autoscaler brings the room up: the buffer still asks the same spare.
    for i in range(2, 5):
        ready_gpu_node(fake, f"gpu-{i}")
    steady = scale(config, "--apply", "--once")
    assert steady["plan"]["capacity_buffers"][0]["replicas"] == 4 and steady["actions"] == []

    # Demand falls to one node's worth: replicas drop to the room one node leaves (none);
    # the idle nodes are left to the autoscaler's scale-down, none cordoned or drained.
    write_demand(state, "a100", [8.0] * 5)
    down = scale(config, "--apply", "--once")
    assert down["plan"]["final_desired"] == {"a100": 1}
    assert down["plan"]["removals"] == []
    assert len(down["plan"]["left_to_autoscaler"]) == 4
    (shrink,) = down["actions"]
    assert shrink["result"].startswith("replicas 4 -> 0")
    assert buffer(fake)["spec"]["replicas"] == 0
    assert all(not n["spec"].get("unschedulable") for n in fake.objects("nodes"))
    assert not any(p.endswith("/eviction") for _, p in fake.requests)
    assert len(fake.objects("nodes")) == 5

    log = DecisionJournal(state)
    changes = [a for a in log.actions() if a.kind == "set_buffer"]
    made_then_shrunk = sorted(changes, key=lambda a: a.id)
    assert [(a.params["from"], a.params["to"], a.status) for a in made_then_shrunk] == [
        (None, 4, "done"),
        (4, 0, "done"),
    ]
    assert not log.pending()


def test_a_dry_run_of_the_loop_changes_nothing(tmp_path: Path, fake: FakeKube) -> None:
    ready_gpu_node(fake, "gpu-0")
    write_demand(tmp_path / "state", "a100", [8.0] * 4 + [24.0])
    config = live(tmp_path, fake)
    for _ in range(2):
        out = scale(config, "--once")
        assert out["plan"]["capacity_buffers"][0]["replicas"] == 3
    shown = CliRunner().invoke(scale_app(), ["scale", "--config", str(config), "--once"])
    assert shown.exit_code == 0, shown.output
    assert "capacity buffer a100: 3 x 8 GPUs" in shown.output
    assert writes(fake) == []
    assert fake.objects("capacitybuffers") == [] and fake.objects("leases") == []


class Crash(Exception):
    pass


def growing_pool(tmp_path: Path, fake: FakeKube) -> LiveConfig:
    """One ready node of a100 whose demand jumps to three nodes' worth: the plan wants a
    buffer of 3 units, under Cluster Autoscaler with CapacityBuffers."""
    ready_gpu_node(fake, "gpu-0")
    write_demand(tmp_path / "state", "a100", [8.0] * 4 + [24.0], step_s=60.0)
    return LiveConfig(
        state_dir=tmp_path / "state",
        pools=[pool(min_size=1)],
        provider={"kind": "autoscaler"},
        kubernetes={"host": fake.url, "pre_position": "capacity-buffer"},
        model={"name": "persistence"},
        policy=fast_policy(60.0),
        placement={"mix": [UNIT]},
        lease={"enabled": False},
    )


def test_a_buffer_change_interrupted_is_settled_and_made_once(
    tmp_path: Path, fake: FakeKube
) -> None:
    cfg = growing_pool(tmp_path, fake)

    def crash(at: str) -> None:
        if at == "journaled":
            raise Crash(at)

    with pytest.raises(Crash):
        Reconciler(LiveSystem.build(cfg), pause=crash).iterate(apply=True)
    log = DecisionJournal(cfg.state_dir)
    assert [a.status for a in log.actions()] == ["pending"]
    assert fake.objects("capacitybuffers") == []

    outcome = Reconciler(LiveSystem.build(cfg)).iterate(apply=True)
    assert [(a["action"], a["status"]) for a in outcome.actions] == [
        ("resolve set_buffer", "superseded"),
        ("set_buffer", "done"),
    ]
    assert buffer(fake)["spec"]["replicas"] == 3
    assert Reconciler(LiveSystem.build(cfg)).iterate(apply=True).actions == []


def condition(kind: str, status: str, reason: str, message: str = "") -> dict[str, str]:
    return {"type": kind, "status": status, "reason": reason, "message": message}


def test_a_buffer_the_autoscaler_does_not_hold_is_reported_and_logged_once(
    tmp_path: Path, fake: FakeKube, caplog: pytest.LogCaptureFixture
) -> None:
    """Cluster Autoscaler (the test) writes the buffer's status: while it says the buffer
    is not ready for provisioning, not provisioned or limited by quotas, each pass reports
    it, the change is logged once, and gpuscale writes nothing; a ready buffer is not."""
    cfg = growing_pool(tmp_path, fake)
    reconciler = Reconciler(LiveSystem.build(cfg))
    made = reconciler.iterate(apply=True)
    assert [a["action"] for a in made.actions] == ["set_buffer"]
    assert made.buffers_not_ready == {}

    def status(*conditions: dict[str, str]) -> None:
        fake.patch("capacitybuffers", "gpuscale-a100", {"status": None}, NAMESPACE)
        fake.patch(
            "capacitybuffers",
            "gpuscale-a100",
            {"status": {"conditions": list(conditions)}},
            NAMESPACE,
        )

    unreadable = condition(
        "ReadyForProvisioning",
        "False",
        "error",
        'Couldn\'t get pod template, error: podtemplates "gpuscale-buffer-a100" not found',
    )
    quota = condition(
        "LimitedByQuotas",
        "True",
        "ResourceQuotasAllocated",
        "Buffer replicas limited from 3 to 1 due to quotas: gpus",
    )
    status(unreadable, condition("Provisioning", "False", "NotReadyForProvisioning"))
    before = len(writes(fake))
    with caplog.at_level(logging.WARNING, logger="scaler.controller.reconcile"):
        for _ in range(2):
            outcome = reconciler.iterate(apply=True)
            assert outcome.actions == [] and outcome.errors == []
            assert outcome.to_dict()["capacity_buffers_not_ready"] == {
                "gpuscale-a100": "CapacityBuffer gpuscale-a100: ReadyForProvisioning False"
                ' (error): Couldn\'t get pod template, error: podtemplates "gpuscale-buffer-a100"'
                " not found"
            }
        status(condition("ReadyForProvisioning", "True", "AttributesSetSuccessfully"), quota)
        assert reconciler.iterate(apply=True).buffers_not_ready == {
            "gpuscale-a100": "CapacityBuffer gpuscale-a100: LimitedByQuotas True"
            " (ResourceQuotasAllocated): Buffer replicas limited from 3 to 1 due to quotas: gpus"
        }
        status(
            condition("ReadyForProvisioning", "True", "AttributesSetSuccessfully"),
            condition("Provisioning", "True", "FakePodsInjected"),
        )
        assert reconciler.iterate(apply=True).buffers_not_ready == {}
        assert reconciler.iterate(apply=True).buffers_not_ready == {}
    said = [r.getMessage() for r in caplog.records if r.name == "scaler.controller.reconcile"]
    assert [m.split(": ")[1] for m in said] == [
        "ReadyForProvisioning False (error)",
        "LimitedByQuotas True (ResourceQuotasAllocated)",
    ]
    assert len(writes(fake)) == before  # the status is the autoscaler's: nothing written


def test_an_emptied_buffer_the_autoscaler_does_not_provision_holds_what_it_asks() -> None:
    """Pod injection marks a buffer of 0 replicas BufferIsEmpty: nothing is missing unless
    the spec asks replicas (limits then left none)."""
    empty = {
        "metadata": {"name": "gpuscale-h100"},
        "spec": {"replicas": 0},
        "status": {"conditions": [condition("Provisioning", "False", "BufferIsEmpty", "0")]},
    }
    assert not_ready(empty) is None
    empty["spec"]["replicas"] = 2
    assert not_ready(empty) == "CapacityBuffer gpuscale-h100: Provisioning False (BufferIsEmpty): 0"
    assert not_ready({"metadata": {"name": "new"}, "spec": {"replicas": 2}}) is None


def client(fake: FakeKube) -> k8s.ApiClient:
    return k8s.ApiClient(k8s.Configuration(host=fake.url))


def demand(pool_name: str, replicas: int, gpus: int = 8) -> BufferDemand:
    return BufferDemand(
        pool=pool_name, replicas=replicas, unit=BufferUnit(gpus=gpus), limit_gpus=80
    )


def changes(buffers: CapacityBuffers, desired: list[BufferDemand]) -> list[BufferChange]:
    return buffers.changes(desired, buffers.current())


def test_a_changed_unit_updates_the_template_and_an_unplanned_pool_is_emptied(
    fake: FakeKube,
) -> None:
    buffers = CapacityBuffers(client(fake), BufferSettings())
    for change in changes(buffers, [demand("a100", 2), demand("h100", 1)]):
        buffers.apply(change)
    generation = fake.get("podtemplates", "gpuscale-buffer-a100", NAMESPACE)["metadata"]
    assert changes(buffers, [demand("a100", 2), demand("h100", 1)]) == []

    (change,) = changes(buffers, [demand("a100", 2, gpus=4), demand("h100", 1)])
    assert (change.template, change.replicas_from, change.replicas_to) == ("update", 2, 2)
    buffers.apply(change)
    template = fake.get("podtemplates", "gpuscale-buffer-a100", NAMESPACE)
    assert template["metadata"]["generation"] == generation["generation"] + 1
    (container,) = template["template"]["spec"]["containers"]
    assert container["resources"]["requests"] == {"nvidia.com/gpu": "4"}

    (emptied,) = changes(buffers, [demand("a100", 2, gpus=4)])
    assert (emptied.pool, emptied.replicas_to) == ("h100", 0)
    buffers.apply(emptied)
    assert fake.get("capacitybuffers", "gpuscale-h100", NAMESPACE)["spec"]["replicas"] == 0
    assert changes(buffers, [demand("a100", 2, gpus=4)]) == []


def base_config(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    return {"state_dir": str(tmp_path), "pools": [pool()], "model": {"name": "persistence"}} | extra


def test_pre_position_reads_the_old_booleans_and_the_setup_is_checked(tmp_path: Path) -> None:
    kube = {"host": "http://127.0.0.1:1"}
    for given, read in ((True, "placeholders"), (False, "none"), ("false", "none")):
        cfg = LiveConfig(**base_config(tmp_path, kubernetes=kube | {"pre_position": given}))
        assert cfg.kubernetes is not None and cfg.kubernetes.pre_position == read
    auto = LiveConfig(**base_config(tmp_path, provider={"kind": "autoscaler"}, kubernetes=kube))
    assert auto.provider.scale_down == "none" and not auto.provider.sets_sizes
    assert LiveConfig(**base_config(tmp_path)).provider.scale_down == "drain"
    refused = [
        ({"provider": {"kind": "autoscaler"}}, "needs a `kubernetes` section"),
        (
            {"provider": {"kind": "autoscaler", "scale_down": "drain"}, "kubernetes": kube},
            "scale_down must be none",
        ),
        (
            {
                "provider": {
                    "kind": "aws",
                    "aws": {"bindings": [{"pool": "a100", "auto_scaling_group": "g"}]},
                    "scale_down": "provider",
                }
            },
            "provider kind karpenter",
        ),
        ({"provider": {"kind": "karpenter"}, "kubernetes": kube}, "`karpenter` section"),
        (
            {
                "provider": {
                    "kind": "karpenter",
                    "karpenter": {"node_pools": [{"pool": "h100", "node_pool": "gpu"}]},
                },
                "kubernetes": kube,
            },
            "pools without a Karpenter NodePool: a100",
        ),
    ]
    for extra, says in refused:
        with pytest.raises(ValueError, match=says):
            LiveConfig(**base_config(tmp_path, **extra))


def test_the_buffer_unit_is_the_pools_largest_job() -> None:
    from scaler.cluster.pools import NodePool
    from scaler.controller.config import DEFAULT_MIX, mix_jobs
    from scaler.controller.reconcile import buffer_unit

    a100 = NodePool(name="a100", gpu_model="A100", gpus_per_node=8, price_per_hour=1, max_size=4)
    t4 = NodePool(name="t4", gpu_model="T4", gpus_per_node=4, price_per_hour=1, max_size=4)
    mix = mix_jobs(DEFAULT_MIX)
    assert (buffer_unit(a100, mix).num_gpu, buffer_unit(a100, mix).cpu_milli) == (8, 64000)
    assert buffer_unit(t4, mix).num_gpu == 4  # the 8-GPU job cannot run there
    assert buffer_unit(a100, mix, gpus_each=2).num_gpu == 2
    sharing = [j for j in mix if j.is_sharing]
    assert buffer_unit(a100, sharing).num_gpu == 1  # whole GPUs only


@contextmanager
def watched_loop(cfg: LiveConfig) -> Iterator[tuple[LiveSystem, WatchedCluster, Reconciler]]:
    """The loop as `gpuscale scale` runs it: its passes and its provider read the
    process's watched cluster cache."""
    from scaler.cli.live import _watched

    system = LiveSystem.build(cfg)
    watched = _watched(system)
    assert watched is not None
    try:
        yield system, watched, Reconciler(system, observe=watched)
    finally:
        forget_watched(watched)
        system.close()


def test_the_loop_reads_its_buffers_from_the_watched_cache(tmp_path: Path, fake: FakeKube) -> None:
    """`gpuscale scale` keeps its CapacityBuffers in the process's watched cluster cache:
    the first pass lists them once (and makes the buffer), later passes list none and
    still see what the autoscaler wrote between two passes (the watch delivered it)."""
    with watched_loop(growing_pool(tmp_path, fake)) as (_, watched, reconciler):
        made = reconciler.iterate(apply=True)
        assert [(a["action"], a["status"]) for a in made.actions] == [("set_buffer", "done")]
        assert fake.list_requests("capacitybuffers") == 1
        (kind,) = [k for k in watched.cache.kinds if k.kind == "capacitybuffers"]

        def cached() -> dict[str, Any]:
            deadline = time.monotonic() + 10
            while (found := kind.snapshot()[1].get(f"{NAMESPACE}/gpuscale-a100")) is None:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            return found

        cached()  # the buffer made shows in the cache: nothing more to write
        assert reconciler.iterate(apply=True).actions == []
        quota = condition("LimitedByQuotas", "True", "ResourceQuotasAllocated", "limited")
        status = {"status": {"conditions": [quota]}}
        fake.patch("capacitybuffers", "gpuscale-a100", status, NAMESPACE)
        deadline = time.monotonic() + 10
        while not (cached().get("status") or {}).get("conditions"):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        seen = reconciler.iterate(apply=True)
        assert seen.actions == []
        assert seen.buffers_not_ready == {
            "gpuscale-a100": "CapacityBuffer gpuscale-a100: LimitedByQuotas True"
            " (ResourceQuotasAllocated): limited"
        }
        assert fake.list_requests("capacitybuffers") == 1
        assert fake.watch_requests("capacitybuffers") >= 1


def test_the_autoscalers_nodes_are_read_from_the_watched_cache(
    tmp_path: Path, fake: FakeKube
) -> None:
    """Under Cluster Autoscaler the provider's refresh listed every node of the cluster
    each pass; handed the process's watched cache, only the cache's first list is made,
    and a node the autoscaler adds between passes joins the pool."""
    with watched_loop(growing_pool(tmp_path, fake)) as (system, _, reconciler):
        (group,) = system.provider.node_groups()
        reconciler.decide()
        assert [n.name for n in group.nodes()] == ["i-gpu-0"]
        ready_gpu_node(fake, "gpu-1")
        deadline = time.monotonic() + 10
        while len(group.nodes()) < 2:
            assert time.monotonic() < deadline, group.nodes()
            time.sleep(0.05)
            reconciler.decide()
        assert [n.name for n in group.nodes()] == ["i-gpu-0", "i-gpu-1"]
        assert fake.list_requests("nodes") == 1
        assert fake.watch_requests("nodes") >= 1
