"""`gpuscale bench loop`: the reconcile loop and the extender at a cluster's size.

The fake API server of `loop_api` serves N nodes and M pods (`loop_cluster`) from a child
process over loopback. The loop starts as `gpuscale scale` starts: a simulated cloud whose
nodes are the GPU nodes of the cluster (their providerIDs name them; in memory, see
`_cloud`), a telemetry store with half an hour of demand, and the process's watched
cluster cache. Measured:

- the first list (the cache's pages of nodes and pods, read from raw JSON) and the first
  snapshot built from it;
- K dry-run passes (`Reconciler.iterate(apply=False)`, as `scale` without --apply), with
  churn between them (pods created, finished, changed; a node added), each pass started
  once the cache has the churn's last event: the pass's time, the part of it spent
  bringing the snapshot up to date, the rest (deciding: forecast, plan, scale-down check,
  journal), and the API server's requests during the pass and its churn, by verb; the
  first list and the passes also as the process's CPU time, which a machine shared with
  other work does not inflate as it inflates the wall-clock time;
- the process's peak RSS (the server's copy of the cluster is in the child);
- the extender's `filter` and `prioritize` per pod, as kube-scheduler calls them with
  `nodeCacheCapable: true` (node names only, every node a candidate), through the
  service's ASGI app in process (the same cache and snapshot), p50 and p99.
"""

from __future__ import annotations

import random
import resource
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from predictor.telemetry.store import TelemetryStore
from scaler.controller.config import LiveConfig, kube_names
from scaler.controller.reconcile import Reconciler
from scaler.controller.system import LiveSystem
from scaler.evaluation.loop_api import ApiProcess
from scaler.evaluation.loop_cluster import pod_object, pool_sizes
from scaler.kube.observed import ObservedCluster
from scaler.kube.watched import WatchedCluster, forget_watched, watched_cluster
from scaler.providers.simulated import SimulatedCloud

GPU_POOLS = ("a100", "h100")


@dataclass
class ExtenderFigures:
    pods: int
    candidates: int
    first_call_s: float  # the service's first state from the snapshot
    filter_p50_ms: float
    filter_p99_ms: float
    prioritize_p50_ms: float
    prioritize_p99_ms: float
    both_p50_ms: float  # filter then prioritize, one pod
    both_p99_ms: float
    both_cpu_p50_ms: float  # the process's CPU time for the pair (client and app alike)
    both_cpu_p99_ms: float


@dataclass
class LoopBenchResult:
    nodes: int
    pods: int
    gpu_pods: int
    pending_pods: int  # real pods waiting, at the first snapshot
    passes: int
    first_list_s: float  # every page of every kind, read
    first_list_cpu_s: float  # the process's CPU time over it (the machine shared or not)
    first_snapshot_s: float  # the snapshot built from the first list
    first_pass_s: float
    pass_median_s: float
    pass_p95_s: float
    pass_cpu_median_s: float  # the process's CPU time in a pass (all its threads)
    update_median_s: float  # bringing the snapshot up to date from the cache's deltas
    decide_median_s: float  # the rest of the pass
    decide_p95_s: float
    requests_per_pass: dict[str, float]  # by verb, during a pass and the churn before it
    lists_after_first: int  # list requests once the cache had listed: 0 is watch-only
    watch_events_per_pass: float
    churn_per_pass: dict[str, int]
    peak_rss_mib: float
    extender: ExtenderFigures | None = None
    pass_s: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _config(state_dir: Path, nodes: int, host: str | None) -> LiveConfig:
    sizes = pool_sizes(nodes)
    pools = [
        {
            "name": pool,
            "gpu_model": pool.upper(),
            "gpus_per_node": 8,
            "cpu_milli_per_node": 96_000,
            "memory_mib_per_node": 786_432,
            "price_per_hour": 32.0 if pool == "a100" else 98.0,
            "boot_seconds": 120,
            "min_size": 0,
            "max_size": 4 * nodes + 10,
        }
        for pool in GPU_POOLS
    ]
    raw: dict[str, Any] = {
        "state_dir": state_dir,
        "pools": pools,
        "provider": {
            "kind": "simulated",
            "simulated": {"initial_sizes": {p: sizes[p] for p in GPU_POOLS}},
        },
        "model": {"name": "persistence"},
        "policy": {"step_seconds": 60},
        "demand": {"stale_after_s": 600},
        "placement": {"sync_s": 3600},  # the extender's figures: one snapshot throughout
    }
    if host is not None:
        raw["kubernetes"] = {"host": host, "pre_position": "none", "request_timeout_s": 120}
    return LiveConfig.model_validate(raw)


def _cloud(config: LiveConfig) -> SimulatedCloud:
    """The simulated cloud in memory, its pools at their initial sizes, booted. The live
    system's own (`StoredCloud`) keeps its state in a file it reads and writes whole on
    every call, as a real cloud outlives the process: at 3,333 nodes that is a second of
    each pass, a cost of the stand-in cloud, which a real provider's API calls replace."""
    sim = config.provider.simulated
    cloud = SimulatedCloud(config.pools, sim, start=datetime.now(UTC).replace(tzinfo=None))
    for group in cloud.node_groups():
        size = sim.initial_sizes.get(group.id(), 0)
        if size:
            group.increase_size(size)
    cloud.advance(max((p.boot_seconds for p in config.pools), default=0.0) + 1.0)
    return cloud


def _seed_demand(config: LiveConfig, nodes: int, now: datetime) -> None:
    sizes = pool_sizes(nodes)
    ds = pd.date_range(end=pd.Timestamp(now).floor("60s"), periods=30, freq="60s")
    rng = np.random.default_rng(0)
    frames = [
        pd.DataFrame(
            {"unique_id": pool, "ds": ds, "y": sizes[pool] * 8 * rng.uniform(0.5, 0.7, len(ds))}
        )
        for pool in GPU_POOLS
    ]
    TelemetryStore(config.state_dir).append(pd.concat(frames, ignore_index=True))


def _timed(watched: WatchedCluster, spent: list[float]) -> Callable[..., ObservedCluster]:
    def observe(api: Any, names: Any) -> ObservedCluster:
        start = time.perf_counter()
        try:
            return watched(api, names)
        finally:
            spent.append(time.perf_counter() - start)

    return observe


def _verbs(counts: Counter[str]) -> Counter[str]:
    out: Counter[str] = Counter()
    for key, n in counts.items():
        out[key.rsplit(":", 1)[1]] += n
    return out


def _p(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def run_loop_bench(
    nodes: int,
    pods: int,
    passes: int = 10,
    seed: int = 0,
    extender_pods: int = 200,
    progress: Callable[[str], None] = lambda line: None,
) -> LoopBenchResult:
    with tempfile.TemporaryDirectory(prefix="gpuscale-bench-loop-") as tmp:
        state_dir = Path(tmp) / "state"
        cloud = _cloud(_config(state_dir, nodes, None))
        names_of = {g.id(): [n.name for n in g.nodes()] for g in cloud.node_groups()}
        progress(f"generating {nodes} nodes and {pods} pods in the API server's process")
        api = ApiProcess(nodes, pods, seed, names_of)
        config = _config(state_dir, nodes, api.url)
        system = replace(LiveSystem.build(config), provider=cloud)
        watched: WatchedCluster | None = None
        try:
            _seed_demand(config, nodes, datetime.now(UTC).replace(tzinfo=None))
            assert system.kube is not None and config.kubernetes is not None
            progress("first list")
            start = time.perf_counter()
            cpu = time.process_time()
            section = config.kubernetes
            watched = watched_cluster(
                system.kube, kube_names(section), 120, section.cache_stale_after_s
            )
            if not watched.cache.wait_listed(3600):
                raise RuntimeError(f"the first list did not land: {watched.status().errors}")
            first_list = time.perf_counter() - start
            first_list_cpu = time.process_time() - cpu
            start = time.perf_counter()
            pending = len(watched().real_pending)
            first_snapshot = time.perf_counter() - start
            lists_at_start = _verbs(api.counts())["list"]
            spent: list[float] = []
            reconciler = Reconciler(system, observe=_timed(watched, spent))
            start = time.perf_counter()
            reconciler.iterate(apply=False)
            first_pass = time.perf_counter() - start
            times: list[float] = []
            cpus: list[float] = []
            updates: list[float] = []
            requests: list[Counter[str]] = []
            events = 0
            churned: Counter[str] = Counter()
            for k in range(passes):
                before = _verbs(api.counts())
                seen_events = watched.cache.pods.counts.events + watched.cache.nodes.counts.events
                churn = api.churn()
                churned.update({k: v for k, v in churn.items() if k != "rv"})
                _caught_up(watched, churn["rv"])
                spent.clear()
                start = time.perf_counter()
                cpu = time.process_time()
                reconciler.iterate(apply=False)
                times.append(time.perf_counter() - start)
                cpus.append(time.process_time() - cpu)
                updates.append(sum(spent))
                requests.append(_verbs(api.counts()) - before)
                events += (
                    watched.cache.pods.counts.events + watched.cache.nodes.counts.events
                ) - seen_events
                progress(f"pass {k + 1}/{passes}: {times[-1]:.3f} s")
            lists_after = _verbs(api.counts())["list"] - lists_at_start
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            extender = None
            if extender_pods:
                progress(f"extender: {extender_pods} pods against {nodes} node names")
                extender = _extender(config, system, extender_pods, seed)
                peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            decides = [t - u for t, u in zip(times, updates, strict=True)]
            verbs = sorted({"list", "watch"} | {v for r in requests for v in r})
            return LoopBenchResult(
                nodes=nodes,
                pods=pods,
                gpu_pods=api.gpu_pods,
                pending_pods=pending,
                passes=passes,
                first_list_s=first_list,
                first_list_cpu_s=first_list_cpu,
                first_snapshot_s=first_snapshot,
                first_pass_s=first_pass,
                pass_median_s=statistics.median(times) if times else float("nan"),
                pass_p95_s=_p(times, 95),
                pass_cpu_median_s=statistics.median(cpus) if cpus else float("nan"),
                update_median_s=statistics.median(updates) if updates else float("nan"),
                decide_median_s=statistics.median(decides) if decides else float("nan"),
                decide_p95_s=_p(decides, 95),
                requests_per_pass={v: sum(r[v] for r in requests) / len(requests) for v in verbs}
                if requests
                else {},
                lists_after_first=lists_after,
                watch_events_per_pass=events / passes if passes else 0.0,
                churn_per_pass={k: v // max(passes, 1) for k, v in churned.items()},
                peak_rss_mib=peak,
                extender=extender,
                pass_s=times,
            )
        finally:
            if watched is not None:
                forget_watched(watched)
            system.close()
            api.stop()


def _caught_up(watched: WatchedCluster, rv: int, timeout_s: float = 120.0) -> None:
    """Wait until the cache has the churn's last event (the pods' watch delivers it)."""
    deadline = time.monotonic() + timeout_s
    while int(watched.cache.pods.version or 0) < rv:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the cache did not catch up with resourceVersion {rv}")
        time.sleep(0.002)


def _extender(config: LiveConfig, system: LiveSystem, count: int, seed: int) -> ExtenderFigures:
    """filter then prioritize for `count` pending GPU pods, every node a candidate."""
    from fastapi.testclient import TestClient

    from scaler.service import create_app

    app = create_app(config, system)  # the same process: the same cache and snapshot
    client = TestClient(app)
    start = time.perf_counter()
    ready = client.get("/readyz").json()
    first = time.perf_counter() - start
    if not ready.get("ready"):
        raise RuntimeError(f"the service is not ready: {ready}")
    state = app.state.context.cluster.state()
    names = list(state.names)
    # A seeded benchmark draw, not a secret.
    rng = random.Random(seed)  # nosec B311
    filters: list[float] = []
    ranks: list[float] = []
    cpus: list[float] = []
    for k in range(count):
        gpus = rng.choice((1, 1, 2, 4, 8))
        pod = pod_object(
            f"bench-{k}",
            "bench",
            node=None,
            cpu=str(gpus),
            memory="16Gi",
            gpus=gpus,
            pool=rng.choice(("a100", "h100", None)),
            owner=("Job", f"bench-{k}"),
        )
        pod["metadata"]["uid"] = f"bench-uid-{k}"
        start = time.perf_counter()
        cpu = time.process_time()
        found = client.post("/v1/extender/filter", json={"Pod": pod, "NodeNames": names})
        middle = time.perf_counter()
        passing = found.json().get("NodeNames") or []
        client.post("/v1/extender/prioritize", json={"Pod": pod, "NodeNames": passing})
        end = time.perf_counter()
        cpus.append((time.process_time() - cpu) * 1000)
        if found.status_code != 200:
            raise RuntimeError(f"filter answered {found.status_code}: {found.text[:200]}")
        filters.append((middle - start) * 1000)
        ranks.append((end - middle) * 1000)
    both = [f + r for f, r in zip(filters, ranks, strict=True)]
    return ExtenderFigures(
        pods=count,
        candidates=len(names),
        first_call_s=first,
        filter_p50_ms=_p(filters, 50),
        filter_p99_ms=_p(filters, 99),
        prioritize_p50_ms=_p(ranks, 50),
        prioritize_p99_ms=_p(ranks, 99),
        both_p50_ms=_p(both, 50),
        both_p99_ms=_p(both, 99),
        both_cpu_p50_ms=_p(cpus, 50),
        both_cpu_p99_ms=_p(cpus, 99),
    )
