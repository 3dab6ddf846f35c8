"""The watched cluster cache: listed once, then watched, and the snapshot kept from its
deltas is the snapshot a fresh list gives (against the fake API server, through the
official client)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kubernetes import client as k8s
from live_fixtures import pool

from predictor.telemetry.kube_objects import KUBE_NAMES
from predictor.telemetry.watch_cache import ClusterCache
from scaler.evaluation.loop_cluster import generate_cluster, node_object, pod_object
from scaler.kube.errors import KubeError
from scaler.kube.observed import ObservedCluster, observe_cluster
from scaler.kube.watched import WatchedCluster


def canonical(seen: ObservedCluster) -> dict[str, Any]:
    """Everything a pass reads of a snapshot, in a comparable form."""
    state = seen.state
    engine = None
    if state is not None:
        engine = {
            "names": list(state.names),
            "jobs": {j: (a.job, state.names[a.node], a.gpus) for j, a in state.jobs.items()},
            "cpu_free": state.cpu_free.tolist(),
            "mem_free": state.mem_free.tolist(),
            "gpu_free": state.gpu_free.tolist(),
            "full_free": state.full_free.tolist(),
            "max_free": state.max_free.tolist(),
            "shape_counts": state.shape_counts.tolist(),
            "draining": state.draining.tolist(),
            "cordoned": state.cordoned.tolist(),
            "node_jobs": [sorted(s) for s in state.node_jobs],
        }
    return {
        "state": engine,
        "nodes": dict(seen.nodes),
        "specs": dict(seen.specs),
        "pending": list(seen.pending),
        "pending_pools": dict(seen.pending_pools),
        "pending_gpus": {k: round(v, 9) for k, v in seen.pending_gpus.items()},
        "unbound": dict(seen.unbound),
        "taints": seen.taints,
        "bound_pods": dict(seen.bound_pods),
        "moves": dict(seen.moves),
        "budgets": seen.budgets,
    }


def converges(watched: WatchedCluster, api: k8s.ApiClient, timeout_s: float = 20.0) -> None:
    """The watched snapshot reaches the fresh list's (the watch delivers within moments)."""
    deadline = time.monotonic() + timeout_s
    fresh = canonical(observe_cluster(api))
    while True:
        mine = canonical(watched())
        if mine == fresh:
            return
        if time.monotonic() > deadline:
            differ = [k for k in fresh if fresh[k] != mine[k]]
            raise AssertionError(f"the watched snapshot differs in {differ}")
        time.sleep(0.05)
        fresh = canonical(observe_cluster(api))


@pytest.fixture
def cluster(fake) -> Iterator[tuple[Any, k8s.ApiClient, Callable[..., WatchedCluster]]]:
    api = k8s.ApiClient(k8s.Configuration(host=fake.url))
    caches: list[ClusterCache] = []

    def watch(**kwargs: Any) -> WatchedCluster:
        cache = ClusterCache(api, KUBE_NAMES, watch_timeout_s=kwargs.pop("watch_timeout_s", 30))
        for kind in cache.kinds:
            kind.page_size = 7  # many pages even for a small cluster
        caches.append(cache)
        cache.start()
        assert cache.wait_listed(10)
        return WatchedCluster(cache, **kwargs)

    yield fake, api, watch
    for cache in caches:
        cache.close()


def fill(fake: Any, nodes: int, pods: int, seed: int = 0) -> None:
    made = generate_cluster(nodes, pods, seed)
    for node in made.nodes:
        fake.create("nodes", node)
    for pod in made.pods:
        fake.create("pods", pod, pod["metadata"]["namespace"])


def test_the_first_list_is_paged_and_the_snapshot_is_the_fresh_lists(cluster) -> None:
    fake, api, watch = cluster
    fill(fake, 12, 300)
    watched = watch()
    assert fake.list_requests("pods") >= 300 // 7  # page by page
    converges(watched, api)
    lists = fake.list_requests("pods")
    watched()
    assert fake.list_requests("pods") == lists  # a pass reads the cache, not the server


def test_a_pod_bound_deleted_or_changed_between_passes_is_seen_by_the_next(cluster) -> None:
    fake, api, watch = cluster
    fill(fake, 6, 120)
    watched = watch()
    converges(watched, api)
    waiting = pod_object("late", "ml", node=None, cpu="1", memory="1Gi", gpus=2, pool="a100")
    fake.create("pods", waiting, "ml")
    converges(watched, api)
    assert "ml/late" in {j.id for j in watched().pending}
    node = next(n["metadata"]["name"] for n in fake.objects("nodes") if "a100" in str(n))
    fake.patch("pods", "late", {"spec": {"nodeName": node}, "status": {"phase": "Running"}}, "ml")
    converges(watched, api)
    seen = watched()
    assert seen.state is not None and seen.state.names[seen.state.jobs["ml/late"].node] == node
    fake.patch("pods", "late", {"metadata": {"annotations": {"gpuscale.io/gpus": "6,7"}}}, "ml")
    converges(watched, api)
    fake.patch("pods", "late", {"status": {"phase": "Succeeded"}}, "ml")  # leaves the view
    converges(watched, api)
    assert watched().state is not None and "ml/late" not in watched().state.jobs
    victim = next(p for p in fake.objects("pods") if p["metadata"]["name"].startswith("web-"))
    fake.delete("pods", victim["metadata"]["name"], victim["metadata"]["namespace"])
    converges(watched, api)
    fake.create("nodes", node_object("node-later", "h100", random.Random(0)))
    converges(watched, api)


def test_a_watch_answering_410_relists_and_converges(cluster) -> None:
    fake, api, watch = cluster
    fill(fake, 8, 160)
    watched = watch()
    converges(watched, api)
    lists = fake.list_requests("pods")
    fake.expire_watches()  # every version handed out is too old: 410 Gone
    # Changes while the cache was cut off are only known from a list.
    fake.create("pods", pod_object("meanwhile", "ml", node=None, cpu="1", memory="1Gi"), "ml")
    doomed = next(p for p in fake.objects("pods") if p["metadata"]["name"].startswith("web-"))
    fake.delete("pods", doomed["metadata"]["name"], doomed["metadata"]["namespace"])
    converges(watched, api)
    assert fake.list_requests("pods") > lists  # it listed again


def test_a_broken_watch_relists_and_converges_on_the_same_server(cluster) -> None:
    fake, api, watch = cluster
    fill(fake, 8, 160)
    watched = watch()
    converges(watched, api)
    lists = fake.list_requests("pods")
    fake.refusals["pods"] = 500  # the next list fails: the cache backs off and retries
    for kind in watched.cache.kinds:
        kind.stop()  # the open watches break
    fake.create("pods", pod_object("meanwhile", "ml", node=None, cpu="1", memory="1Gi"), "ml")
    time.sleep(0.3)
    fake.refusals.clear()
    converges(watched, api)
    assert fake.list_requests("pods") > lists
    deadline = time.monotonic() + 10  # every kind back (each after its own backoff)
    while watched.status().stale_s > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert watched.status().stale_s == 0 and watched().stale is None


def break_the_watches(fake, watched) -> None:
    """Every watch of `watched`'s cache breaks and cannot list again (pods answer 500);
    returns once the snapshot reads as stale (or after 10 s)."""
    fake.refusals["pods"] = 500
    for kind in watched.cache.kinds:
        kind.stop()
    deadline = time.monotonic() + 10
    while watched().stale is None and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_watch_down_past_the_bound_makes_the_snapshot_stale(cluster) -> None:
    fake, api, watch = cluster
    fill(fake, 4, 40)
    watched = watch(stale_after_s=0.2)
    converges(watched, api)
    break_the_watches(fake, watched)
    assert "cluster cache stale" in (watched().stale or "")
    fake.refusals.clear()
    converges(watched, api)
    deadline = time.monotonic() + 10
    while watched().stale is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert watched().stale is None


def test_no_snapshot_before_the_first_list(fake) -> None:
    api = k8s.ApiClient(k8s.Configuration(host=fake.url))
    fake.refusals["nodes"] = 403
    cache = ClusterCache(api, KUBE_NAMES)
    cache.start()
    try:
        with pytest.raises(KubeError, match="no first list"):
            WatchedCluster(cache)()
        fake.refusals.clear()
        assert cache.wait_listed(10)
        assert WatchedCluster(cache)().state is None  # listed: an empty cluster
    finally:
        cache.close()


def random_delta(fake: Any, rng: random.Random, serial: int) -> None:
    """One change of the kinds a cluster sees: a pod created (bound or pending, GPUs or
    not, a DaemonSet's), bound, finished, deleted or relabelled; a node added, cordoned,
    marked for removal, tainted or deleted."""
    pods = fake.objects("pods")
    nodes = [n["metadata"]["name"] for n in fake.objects("nodes")]
    roll = rng.random()
    if roll < 0.3 or not pods:
        gpus = rng.choice((0, 0, 1, 2, 8))
        node = rng.choice([*nodes, None]) if nodes else None
        owner = ("DaemonSet", "agent") if rng.random() < 0.05 else ("ReplicaSet", "web")
        pod = pod_object(
            f"p-{serial}",
            rng.choice(("ml", "kube-system")),
            node=node,
            cpu=rng.choice(("250m", "1", "4")),
            memory="1Gi",
            gpus=gpus,
            share=rng.choice((None, 500)) if gpus == 1 else None,
            pool=rng.choice((None, "a100")),
            owner=owner,
        )
        if gpus and rng.random() < 0.3:
            pod["metadata"]["annotations"]["gpuscale.io/gpus"] = ",".join(
                str(g) for g in rng.sample(range(8), gpus)
            )
        fake.create("pods", pod, pod["metadata"]["namespace"])
        return
    pod = rng.choice(pods)
    name, namespace = pod["metadata"]["name"], pod["metadata"]["namespace"]
    if roll < 0.45 and nodes and not pod["spec"].get("nodeName"):
        fake.patch("pods", name, {"spec": {"nodeName": rng.choice(nodes)}}, namespace)
    elif roll < 0.55:
        fake.patch("pods", name, {"status": {"phase": "Succeeded"}}, namespace)
    elif roll < 0.7:
        fake.delete("pods", name, namespace)
    elif roll < 0.8:
        fake.patch("pods", name, {"metadata": {"labels": {"v": str(serial)}}}, namespace)
    elif roll < 0.86 or not nodes:
        pool = rng.choice(("a100", "h100", "cpu"))
        fake.create("nodes", node_object(f"n-{serial}", pool, rng))
    else:
        node = rng.choice(nodes)
        change = rng.random()
        if change < 0.3:
            fake.patch("nodes", node, {"spec": {"unschedulable": True}})
        elif change < 0.55:
            mark = {KUBE_NAMES.removal_annotation: "2026-12-07T00:00:00Z"}
            fake.patch("nodes", node, {"metadata": {"annotations": mark}})
        elif change < 0.75:
            taint = {"key": "dedicated", "value": rng.choice(("a", "b")), "effect": "NoSchedule"}
            fake.patch("nodes", node, {"spec": {"taints": [taint]}})
        else:
            fake.delete("nodes", node)


def test_the_snapshot_after_1000_random_deltas_is_the_fresh_lists(cluster) -> None:
    """The property: whatever the deltas, in whatever order, the snapshot updated from
    them is the one rebuilt from a fresh list (checked along the way, and at the end)."""
    fake, api, watch = cluster
    fill(fake, 10, 150, seed=3)
    fake.create(
        "poddisruptionbudgets",
        {"metadata": {"name": "dns"}, "spec": {"selector": {"matchLabels": {"app": "web"}}}},
        "kube-system",
    )
    watched = watch()
    converges(watched, api)
    rng = random.Random(34)
    for serial in range(1000):
        random_delta(fake, rng, serial)
        if serial % 97 == 0:
            watched()  # a pass in between: what it updated is updated on from there
        if serial % 250 == 0:
            converges(watched, api)
    converges(watched, api)


def test_readyz_is_false_until_the_first_list_lands(fake, tmp_path) -> None:
    from fastapi.testclient import TestClient

    from scaler.controller.config import LiveConfig
    from scaler.service import create_app

    fill(fake, 4, 40)
    fake.refusals["nodes"] = 403  # the first list cannot land
    config = LiveConfig(
        state_dir=tmp_path / "state",
        pools=[pool()],
        model={"name": "persistence"},
        kubernetes={"host": fake.url},
        placement={"sync_s": 3600},  # a failure to read is not remembered for an hour
    )
    app = create_app(config)
    try:
        with TestClient(app) as client:
            answer = client.get("/readyz")
            assert answer.status_code == 503
            assert "no first list" in answer.json()["cluster_error"]
            fake.refusals.clear()
            deadline = time.monotonic() + 15
            while client.get("/readyz").status_code != 200:
                assert time.monotonic() < deadline, client.get("/readyz").json()
                time.sleep(0.1)
            assert client.get("/readyz").json()["cluster_error"] is None
    finally:
        from scaler.kube.watched import forget_watched, watched_cluster

        forget_watched(watched_cluster(app.state.context.system.kube, KUBE_NAMES))


def test_a_stale_cache_holds_the_loops_scale_downs_and_says_why(cluster, tmp_path) -> None:
    import pandas as pd
    from live_fixtures import fast_policy

    from predictor.telemetry.store import TelemetryStore
    from scaler.controller.config import LiveConfig
    from scaler.controller.reconcile import Reconciler
    from scaler.controller.system import LiveSystem

    fake, _, watch = cluster
    for i in range(4):  # the simulated cloud's four nodes, registered and idle
        fake.create("nodes", node_object(f"gpu-{i}", "a100", random.Random(i), f"a100-{i:06d}"))
    watched = watch(stale_after_s=0.2)
    config = LiveConfig(
        state_dir=tmp_path / "state",
        pools=[pool(min_size=0)],
        provider={"kind": "simulated", "simulated": {"initial_sizes": {"a100": 4}}},
        kubernetes={"host": fake.url, "pre_position": "none"},
        model={"name": "persistence"},
        policy=fast_policy(60.0),
        demand={"stale_after_s": 300},
    )
    end = pd.Timestamp.now(tz="UTC").tz_localize(None).floor("60s")
    ds = pd.date_range(end=end, periods=120, freq="60s")
    TelemetryStore(config.state_dir).append(pd.DataFrame({"unique_id": "a100", "ds": ds, "y": 8.0}))
    system = LiveSystem.build(config)
    try:
        loop = Reconciler(system, observe=watched)
        fresh = loop.decide()
        assert fresh.desired["a100"] < 4 and fresh.held == {}, fresh.plan.decisions
        break_the_watches(fake, watched)
        held = loop.decide()
        assert held.desired["a100"] == 4
        assert "cluster cache stale: a watch has been down" in held.held["a100"]
    finally:
        system.close()


def test_the_configured_stale_bound_reaches_the_loops_cache(fake, tmp_path) -> None:
    """`kubernetes.cache_stale_after_s` is the bound the loop's watched snapshot checks:
    at 0.2 s a broken watch makes the snapshot stale within moments (the default 60 s
    would not)."""
    from scaler.cli.live import _watched
    from scaler.controller.config import LiveConfig
    from scaler.controller.system import LiveSystem
    from scaler.kube.watched import forget_watched

    fill(fake, 4, 40)
    config = LiveConfig(
        state_dir=tmp_path / "state",
        pools=[pool()],
        model={"name": "persistence"},
        kubernetes={"host": fake.url, "pre_position": "none", "cache_stale_after_s": 0.2},
    )
    system = LiveSystem.build(config)
    watched = _watched(system)
    assert watched is not None
    try:
        assert watched.stale_after_s == 0.2 and watched().stale is None
        break_the_watches(fake, watched)
        assert "cluster cache stale: a watch has been down" in (watched().stale or "")
    finally:
        forget_watched(watched)
        system.close()


def test_the_kinds_a_pass_reads_beside_the_snapshot_come_from_the_observers_cache(
    cluster,
) -> None:
    """Kueue's kinds, CapacityBuffers and Karpenter's read the cache the loop's observer
    (or the service's listing of it) reads; an observer that lists afresh has none."""
    from scaler.kube.observed import observe_cluster
    from scaler.kube.watched import cache_of
    from scaler.service.listing import SharedListing

    _, _, watch = cluster
    watched = watch()
    assert cache_of(watched) is watched.cache
    assert cache_of(SharedListing(5.0, observe=watched)) is watched.cache
    assert cache_of(observe_cluster) is None and cache_of(SharedListing(5.0)) is None


def test_a_kind_joined_later_is_watched_and_counts_in_the_staleness(cluster) -> None:
    """A kind only some setups read (here CapacityBuffers) joins the running cache at its
    first ask: listed once, then watched; its watch down past the bound makes the
    snapshot stale as a pod watch would."""
    fake, api, watch = cluster
    watched = watch(stale_after_s=0.2)
    custom = k8s.CustomObjectsApi(api)

    def buffers(**kwargs: Any) -> Any:
        return custom.list_namespaced_custom_object(
            "autoscaling.x-k8s.io", "v1beta1", "ml", "capacitybuffers", **kwargs
        )

    kind = watched.cache.watch_kind("capacitybuffers", buffers)
    assert watched.cache.watch_kind("capacitybuffers", buffers) is kind
    assert kind.wait_listed(10) and kind.snapshot()[1] == {}
    spec = {"podTemplateRef": {"name": "unit"}, "replicas": 1}
    fake.create("capacitybuffers", {"metadata": {"name": "b"}, "spec": spec}, "ml")
    deadline = time.monotonic() + 10
    while "ml/b" not in kind.snapshot()[1]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert fake.list_requests("capacitybuffers") == 1
    fake.refusals["capacitybuffers"] = 500
    kind.stop()  # its watch breaks and cannot list again
    while watched().stale is None:
        assert time.monotonic() < deadline + 10
        time.sleep(0.05)
    assert "watch capacitybuffers" in (watched().stale or "")
    fake.refusals.clear()
    while watched().stale is not None:
        assert time.monotonic() < deadline + 20
        time.sleep(0.05)


def test_a_kind_joined_later_that_cannot_list_fails_only_its_reader(cluster) -> None:
    """A cluster without the CRD a setup reads (404): the reader of that kind fails, the
    snapshot of nodes and pods is still there."""
    from scaler.kube.capacity_buffers import BufferSettings, CapacityBuffers

    fake, api, watch = cluster
    fill(fake, 2, 10)
    watched = watch()
    fake.refusals["capacitybuffers"] = 404
    buffers = CapacityBuffers(api, BufferSettings(), watched.cache, wait_s=0.5)
    with pytest.raises(KubeError, match="list CapacityBuffers in gpuscale-system"):
        buffers.current()
    assert watched().state is not None and watched.status().listed
