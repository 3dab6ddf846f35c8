"""GPU demand per node pool from the Kubernetes API: the real `kubernetes` client against the
fake API server (tests/fake_kube.py), configured from a kubeconfig as in a cluster."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest
from fake_kube import FakeKube
from kubernetes import client as k8s
from typer.testing import CliRunner

from predictor.telemetry.collector import Collector
from predictor.telemetry.config import KubernetesSettings
from predictor.telemetry.kubernetes import (
    UNPOOLED,
    GpuNode,
    GpuPod,
    KubernetesSource,
    api_client,
    pool_demand,
)
from predictor.telemetry.sources import RetryPolicy, SourceError
from predictor.telemetry.store import TelemetryStore
from scaler.cli import app
from scaler.kube.observed import observe_cluster

POOL = "gpuscale.io/pool"
MODEL = "nvidia.com/gpu.product"
AT = pd.Timestamp("2026-01-01 00:00:00")


def node(name: str, pool: str, model: str, gpus: int, *, cordoned: bool = False) -> dict:
    return {
        "metadata": {"name": name, "labels": {POOL: pool, MODEL: model}},
        "spec": {"unschedulable": cordoned},
        "status": {
            "allocatable": {"nvidia.com/gpu": str(gpus), "cpu": "96", "memory": "1Ti"},
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


def pod(
    name: str,
    gpus: tuple[int, ...],
    phase: str,
    *,
    node_name: str | None = None,
    selector: dict | None = None,
    affinity: dict | None = None,
    init_gpus: int = 0,
) -> dict:
    def container(i: int, n: int) -> dict:
        amounts = {"nvidia.com/gpu": str(n)} if n else {}
        return {
            "name": f"c{i}",
            "image": "trainer:1",
            "resources": {"requests": {"cpu": "1", **amounts}, "limits": amounts},
        }

    spec: dict = {"containers": [container(i, n) for i, n in enumerate(gpus)]}
    if init_gpus:
        spec["initContainers"] = [container(9, init_gpus)]
    if node_name:
        spec["nodeName"] = node_name
    if selector:
        spec["nodeSelector"] = selector
    if affinity:
        spec["affinity"] = affinity
    return {"metadata": {"name": name, "namespace": "ml"}, "spec": spec, "status": {"phase": phase}}


def required_pools(*pools: str) -> dict:
    expr = {"key": POOL, "operator": "In", "values": list(pools)}
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [expr]}]
            }
        }
    }


def preferred_pool(pool: str) -> dict:
    term = {"matchExpressions": [{"key": POOL, "operator": "In", "values": [pool]}]}
    return {
        "nodeAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 50, "preference": term}]
        }
    }


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[FakeKube, KubernetesSettings]]:
    """Two pools: a100 (2 nodes of 8 GPUs, one cordoned) and h100 (1 node of 4 GPUs)."""
    fake = FakeKube().start()
    for obj in (
        node("a100-1", "a100", "NVIDIA-A100-SXM4-80GB", 8),
        node("a100-2", "a100", "NVIDIA-A100-SXM4-80GB", 8, cordoned=True),
        node("h100-1", "h100", "NVIDIA-H100-80GB-HBM3", 4),
    ):
        fake.create("nodes", obj)
    for obj in (
        pod("train-a", (2, 2), "Running", node_name="a100-1"),
        pod("train-b", (2,), "Running", node_name="h100-1"),
        pod("queued-a", (8,), "Pending", selector={POOL: "a100"}),
        pod("queued-h", (2,), "Pending", affinity=required_pools("h100", "a100")),
        pod("queued-pref", (1,), "Pending", affinity=preferred_pool("h100"), init_gpus=2),
        pod("queued-any", (1,), "Pending"),
        pod("done", (8,), "Succeeded", node_name="a100-1"),
        pod("cpu-only", (0,), "Running", node_name="a100-1"),
    ):
        fake.create("pods", obj)
    settings = KubernetesSettings(
        kubeconfig=fake.write_kubeconfig(tmp_path / "kubeconfig"),
        watch_timeout_s=30,
        request_timeout_s=5,
    )
    yield fake, settings
    fake.stop()


def demand_of(source: KubernetesSource) -> dict[str, dict[str, float]]:
    """metric -> pool -> value, from one sample."""
    return {
        batch.metric: dict(zip(batch.points["unique_id"], batch.points["y"], strict=True))
        for batch in source.sample(AT)
    }


def wait_for_demand(source: KubernetesSource, want: dict[str, float], timeout_s: float = 10):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            got = demand_of(source)["gpu_demand"]
        except SourceError:
            got = {}
        if got == want:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"demand {got}, wanted {want}")
        time.sleep(0.05)


def test_pool_demand_is_running_plus_pending_of_each_pool() -> None:
    nodes = [
        GpuNode("n1", "a", "A100", 8, schedulable=True),
        GpuNode("n2", "a", "A100", 8, schedulable=False),
        GpuNode("n3", "b", "H100", 4, schedulable=True),
    ]
    pods = [
        GpuPod("ml", "r1", "Running", 3, "n1", None),
        GpuPod("ml", "r2", "Running", 2, "n3", "a"),  # runs where it runs, whatever it asked
        GpuPod("ml", "p1", "Pending", 4, None, "b"),
        GpuPod("ml", "p2", "Pending", 1, "n2", None),  # bound, not yet running
        GpuPod("ml", "p3", "Pending", 2, None, "c"),  # a pool with no nodes yet
        GpuPod("ml", "s1", "Succeeded", 8, "n1", None),
        GpuPod("ml", "f1", "Failed", 8, "n1", None),
        GpuPod("ml", "q1", "Pending", 0.25, None, "b"),  # a quarter of one GPU
    ]
    by_pool = {p.pool: p for p in pool_demand(nodes, pods)}
    assert {k: (v.running, v.pending, v.demand) for k, v in by_pool.items()} == {
        "a": (3, 1, 4),
        "b": (2, 4.25, 6.25),
        "c": (0, 2, 2),
    }
    assert (by_pool["a"].capacity, by_pool["a"].nodes) == (8, 2)
    assert (by_pool["c"].capacity, by_pool["c"].nodes) == (0, 0)
    assert sum(p.demand for p in by_pool.values()) == 12.25  # each pod counted once


def test_one_shot_sample_lists_nodes_and_pods(cluster) -> None:
    fake, settings = cluster
    source = KubernetesSource(settings)
    try:
        assert source.available()
        got = demand_of(source)
    finally:
        source.close()
    # a100: 4 running + 8 pending; h100: 2 running + 2 (required, first of two pools)
    # + 2 (preferred; its init container needs 2); unpooled: 1 pending with no preference
    assert got["gpu_demand"] == {"a100": 12.0, "h100": 6.0, UNPOOLED: 1.0}
    assert got["running"] == {"a100": 4.0, "h100": 2.0, UNPOOLED: 0.0}
    assert got["pending"] == {"a100": 8.0, "h100": 4.0, UNPOOLED: 1.0}
    assert got["capacity"] == {"a100": 8.0, "h100": 4.0, UNPOOLED: 0.0}  # a100-2 is cordoned
    assert got["nodes"] == {"a100": 2.0, "h100": 1.0, UNPOOLED: 0.0}
    assert fake.watch_requests("pods") == 0


def test_a_shared_gpu_counts_as_its_share(cluster) -> None:
    """A pod of one GPU with the GPU-share annotation holds that share of it: a pending
    pod asking 250 milli adds 0.25 GPU to its pool's demand, a running one at 500 its half;
    an annotation that is no share reads as the whole GPU."""
    fake, settings = cluster

    def shared(name: str, share: str, phase: str, **kw) -> dict:
        made = pod(name, (1,), phase, **kw)
        made["metadata"]["annotations"] = {"gpuscale.io/gpu-milli": share}
        return made

    fake.create("pods", shared("notebook", "250", "Pending", selector={POOL: "h100"}))
    fake.create("pods", shared("serve", "500", "Running", node_name="a100-1"))
    fake.create("pods", shared("odd", "lots", "Pending", selector={POOL: "a100"}))
    source = KubernetesSource(settings)
    try:
        got = demand_of(source)
    finally:
        source.close()
    # Before: a100 4 running + 8 pending; h100 2 running + 4 pending (see above).
    assert got["pending"] == {"a100": 9.0, "h100": 4.25, UNPOOLED: 1.0}
    assert got["running"] == {"a100": 4.5, "h100": 2.0, UNPOOLED: 0.0}
    assert got["gpu_demand"] == {"a100": 13.5, "h100": 6.25, UNPOOLED: 1.0}


def test_mig_pods_count_in_gpu_equivalents(cluster) -> None:
    """A pod asking `nvidia.com/mig-<profile>` instances (the GPU operator's mixed
    strategy) holds N/7 of a GPU per `Ng` instance, in running and pending demand alike;
    a node's MIG instances count the same way in its capacity."""
    fake, settings = cluster

    def mig_pod(name: str, resources: dict[str, str], phase: str, **kw) -> dict:
        made = pod(name, (0,), phase, **kw)
        made["spec"]["containers"][0]["resources"] = {"limits": resources}
        return made

    # a100-mig: two MIG GPUs as all-balanced makes them (2 x 1g, a 2g and a 3g each).
    mig_node = node("a100-mig", "a100", "NVIDIA-A100-SXM4-80GB", 0)
    mig_node["status"]["allocatable"] |= {
        "nvidia.com/mig-1g.10gb": "4", "nvidia.com/mig-2g.20gb": "2",
        "nvidia.com/mig-3g.40gb": "2",
    }  # fmt: skip
    fake.create("nodes", mig_node)
    fake.create("pods", mig_pod("infer", {"nvidia.com/mig-3g.40gb": "1"}, "Running",
                                node_name="a100-mig"))  # fmt: skip
    fake.create("pods", mig_pod("tune", {"nvidia.com/mig-1g.10gb": "2"}, "Pending",
                                selector={POOL: "h100"}))  # fmt: skip
    fake.create("pods", mig_pod("big", {"nvidia.com/mig-7g.80gb": "1"}, "Pending",
                                selector={POOL: "a100"}))  # fmt: skip
    source = KubernetesSource(settings)
    try:
        got = demand_of(source)
    finally:
        source.close()
    # Before: a100 4 running + 8 pending, capacity 8; h100 2 running + 4 pending.
    assert got["running"]["a100"] == pytest.approx(4 + 3 / 7)
    assert got["pending"]["a100"] == pytest.approx(8 + 1.0)  # a 7g is a whole GPU
    assert got["pending"]["h100"] == pytest.approx(4 + 2 / 7)
    assert got["gpu_demand"]["a100"] == pytest.approx(12 + 3 / 7 + 1)
    # (4 x 1 + 2 x 2 + 2 x 3) / 7 = 2: what the node's instances hold, its two GPUs full.
    assert got["capacity"]["a100"] == pytest.approx(8 + 2.0)

    # The live loop's listing counts by the same rule: its pending GPUs per pool are the
    # collector's pending demand, MIG pods included, and the 3g holds 3/7 of its node.
    with api_client(settings) as api:
        observed = observe_cluster(api)
    pending = {UNPOOLED if pool is None else pool: g for pool, g in observed.pending_gpus.items()}
    assert pending == pytest.approx(got["pending"])
    assert pending == pytest.approx({"a100": 8 + 1.0, "h100": 4 + 2 / 7, UNPOOLED: 1.0})
    assert observed.nodes["a100-mig"].gpus_used == pytest.approx(3 / 7)


def test_a_renamed_share_annotation_is_read_by_the_collector(cluster) -> None:
    """The collector's settings name the GPU-share annotation, as the scaler's do: a
    cluster that asks shares under another name is counted in shares all the same."""
    fake, settings = cluster
    made = pod("notebook", (1,), "Pending", selector={POOL: "h100"})
    made["metadata"]["annotations"] = {"example.com/share": "250"}
    fake.create("pods", made)
    renamed = settings.model_copy(update={"gpu_milli_annotation": "example.com/share"})
    for which, pending in ((settings, 5.0), (renamed, 4.25)):
        source = KubernetesSource(which)
        try:
            assert demand_of(source)["pending"]["h100"] == pending
        finally:
            source.close()


def test_watched_demand_follows_pod_changes(cluster) -> None:
    fake, settings = cluster
    source = KubernetesSource(settings)
    source.start()
    try:
        wait_for_demand(source, {"a100": 12.0, "h100": 6.0, UNPOOLED: 1.0})
        lists_after_sync = fake.list_requests("pods")
        core = k8s.CoreV1Api(api_client(settings))
        # The scheduler binds queued-a to a100-2's neighbour and it starts: still a100.
        fake.patch("pods", "queued-a", {"spec": {"nodeName": "a100-1"}}, "ml")
        fake.patch("pods", "queued-a", {"status": {"phase": "Running"}}, "ml")
        # train-b finishes and is deleted; a new 4-GPU job is queued for h100.
        core.delete_namespaced_pod("train-b", "ml")
        core.create_namespaced_pod("ml", pod("new-h", (4,), "Pending", selector={POOL: "h100"}))
        wait_for_demand(source, {"a100": 12.0, "h100": 8.0, UNPOOLED: 1.0})
        running = demand_of(source)["running"]
        assert running == {"a100": 12.0, "h100": 0.0, UNPOOLED: 0.0}
        # Watched, not polled: no list since the first one.
        assert fake.list_requests("pods") == lists_after_sync
        assert fake.watch_requests("pods") >= 1

        # The API server loses its watch history: the informer gets 410 Gone, re-lists.
        fake.expire_watches()
        fake.create("pods", pod("late", (2,), "Pending", selector={POOL: "a100"}))
        fake.delete("pods", "queued-any", "ml")
        wait_for_demand(source, {"a100": 14.0, "h100": 8.0})
        assert fake.list_requests("pods") > lists_after_sync
    finally:
        started = time.monotonic()
        source.close()
        assert time.monotonic() - started < 3  # watches stop promptly


def test_the_collector_and_the_loop_in_one_process_share_one_watch(cluster, tmp_path) -> None:
    """`collect` beside `scale` in one process: both read the process's watched cache, so
    the API server serves one list and one watch of nodes and of pods, and a change reaches
    the collector's samples and the loop's snapshot alike; the collector closing leaves
    the loop its watches."""
    from live_fixtures import pool

    from scaler.cli.live import _watched
    from scaler.controller.config import LiveConfig
    from scaler.controller.system import LiveSystem
    from scaler.kube.watched import forget_watched

    fake, settings = cluster
    source = KubernetesSource(settings)
    source.start()
    config = LiveConfig(
        state_dir=tmp_path / "state",
        pools=[pool()],
        model={"name": "persistence"},
        kubernetes={"kubeconfig": settings.kubeconfig, "pre_position": "none"},
    )
    system = LiveSystem.build(config)
    watched = _watched(system)
    assert watched is not None
    try:
        assert watched.cache is source._cache
        wait_for_demand(source, {"a100": 12.0, "h100": 6.0, UNPOOLED: 1.0})
        assert {j.id for j in watched().pending} >= {"ml/queued-a", "ml/queued-any"}
        fake.create("pods", pod("late", (2,), "Pending", selector={POOL: "a100"}))
        fake.create("nodes", node("h100-2", "h100", "NVIDIA-H100-80GB-HBM3", 4))
        wait_for_demand(source, {"a100": 14.0, "h100": 6.0, UNPOOLED: 1.0})
        deadline = time.monotonic() + 10
        while "ml/late" not in {j.id for j in watched().pending}:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert "h100-2" in watched().nodes
        for kind in ("nodes", "pods"):
            assert (fake.list_requests(kind), fake.watch_requests(kind)) == (1, 1), kind
        source.close()
        fake.delete("pods", "late", "ml")
        deadline = time.monotonic() + 10
        while "ml/late" in {j.id for j in watched().pending}:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        source.close()
        forget_watched(watched)
        system.close()


def test_api_server_down_is_a_source_error_and_a_gap(cluster, tmp_path: Path) -> None:
    fake, settings = cluster
    source = KubernetesSource(settings)
    store = TelemetryStore(tmp_path / "state")
    collector = Collector(
        store, [source], pd.Timedelta("15s"), RetryPolicy(attempts=2, base_delay_s=0.01)
    )
    try:
        [ok] = collector.collect_once(AT)
        assert ok.error is None and ok.points == 15  # 5 metrics x 3 series
        fake.stop()
        [down] = collector.collect_once(AT + pd.Timedelta("15s"))
    finally:
        source.close()
    assert down.error is not None and "list nodes" in down.error
    gaps = store.gaps("kubernetes")
    assert list(gaps["start"]) == [AT + pd.Timedelta("15s")]
    assert list(store.query("gpu_demand")["ds"].unique()) == [AT]


def test_collect_once_writes_demand_per_pool(cluster, tmp_path: Path) -> None:
    _, settings = cluster
    config = tmp_path / "collect.yaml"
    config.write_text(
        json.dumps(
            {"interval_s": 60, "kubernetes": {"kubeconfig": str(settings.kubeconfig)}},
        )
    )
    state_dir = tmp_path / "state"
    result = CliRunner().invoke(
        app, ["collect", "--once", "--json", "--config", str(config), "--state-dir", str(state_dir)]
    )
    assert result.exit_code == 0, result.output
    # The scheduled jobs (CronJobs, none here) come with the Kubernetes source.
    sample, scheduled = json.loads(result.output)["samples"]
    assert sample["source"] == "kubernetes" and sample["error"] is None
    assert scheduled["source"] == "cronjobs" and scheduled["error"] is None
    at = pd.Timestamp(sample["at"])
    assert at == at.floor("60s")
    store = TelemetryStore(state_dir)
    demand = store.query("gpu_demand")
    assert dict(zip(demand["unique_id"], demand["y"], strict=True)) == {
        "a100": 12.0,
        "h100": 6.0,
        UNPOOLED: 1.0,
    }
    labels = store.series("gpu_demand").set_index("unique_id")["labels"]
    assert labels["a100"] == {"gpu_model": "NVIDIA-A100-SXM4-80GB", "unit": "gpus"}


def test_fake_api_server_serves_cordon_drain_binding_and_leases(cluster) -> None:
    """The paths a later drain and leader election use, through the real client."""
    fake, settings = cluster
    api = api_client(settings)
    core, leases = k8s.CoreV1Api(api), k8s.CoordinationV1Api(api)
    core.patch_node("a100-1", {"spec": {"unschedulable": True}})  # cordon
    assert fake.get("nodes", "a100-1")["spec"]["unschedulable"] is True
    on_node = core.list_pod_for_all_namespaces(field_selector="spec.nodeName=a100-1")
    assert sorted(p.metadata.name for p in on_node.items) == ["cpu-only", "done", "train-a"]

    fake.eviction_policy = lambda pod: (
        (429, "Cannot evict pod as it would violate the pod's disruption budget.")
        if pod["metadata"]["name"] == "train-a"
        else None
    )
    eviction = k8s.V1Eviction(metadata=k8s.V1ObjectMeta(name="cpu-only", namespace="ml"))
    core.create_namespaced_pod_eviction("cpu-only", "ml", eviction)
    with pytest.raises(k8s.ApiException) as refused:
        blocked = k8s.V1Eviction(metadata=k8s.V1ObjectMeta(name="train-a", namespace="ml"))
        core.create_namespaced_pod_eviction("train-a", "ml", blocked)
    assert refused.value.status == 429
    assert [p["metadata"]["name"] for p in fake.objects("pods", "ml")].count("cpu-only") == 0

    binding = k8s.V1Binding(
        metadata=k8s.V1ObjectMeta(name="queued-h"),
        target=k8s.V1ObjectReference(kind="Node", name="h100-1"),
    )
    core.create_namespaced_pod_binding("queued-h", "ml", binding, _preload_content=False)
    assert fake.get("pods", "queued-h", "ml")["spec"]["nodeName"] == "h100-1"

    spec = k8s.V1LeaseSpec(holder_identity="replica-1", lease_duration_seconds=15)
    lease = k8s.V1Lease(metadata=k8s.V1ObjectMeta(name="gpuscale"), spec=spec)
    created = leases.create_namespaced_lease("kube-system", lease)
    with pytest.raises(k8s.ApiException) as exists:
        leases.create_namespaced_lease("kube-system", lease)
    assert exists.value.status == 409
    created.spec.holder_identity = "replica-2"
    leases.replace_namespaced_lease("gpuscale", "kube-system", created)
    with pytest.raises(k8s.ApiException) as stale:  # the old resourceVersion lost the race
        leases.replace_namespaced_lease("gpuscale", "kube-system", created)
    assert stale.value.status == 409
    current = leases.read_namespaced_lease("gpuscale", "kube-system")
    assert current.spec.holder_identity == "replica-2"
    api.close()
