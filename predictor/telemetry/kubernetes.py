"""Kubernetes as a telemetry source: GPU demand and capacity per node pool.

Nodes and pods are read from the process's watched cluster cache (`watch_cache.shared_cache`:
listed once, then watched from the list's resourceVersion, re-listed on 410 Gone), so a
long-running collector reads a cache the API server keeps current instead of polling it,
and a collector in the process of the reconcile loop or the service reads their cache: one
list and one watch of each kind for all of them. The objects are read once, from their raw
JSON, by the readers the scaler uses (`kube_objects.read_node`, `read_pod`). A one-shot
sample lists them (the same reads, no watch).

Demand of a pool, as in the Helios traces, is the GPUs of its running pods plus the GPUs of
pending pods that want it; a pod sharing a GPU (the GPU-share annotation) counts as its
share, so pods are read as the scaler reads them (`kube_objects`). A pod asking MIG
instances (`nvidia.com/mig-<profile>`, the GPU operator's "mixed" strategy) counts in GPU
equivalents (`kube_objects.mig_gpus`, the rule the live loop and Kueue's queue count by),
as does a node's capacity in instances. A pod runs in the pool
of its node; a pending pod wants the pool its nodeSelector or node affinity names on the
pool label (the first one it names, so each pod is counted once and the pools add up to
the cluster). Pending pods that name no pool, and running pods on unlabelled nodes, are
counted in the series `unpooled`.

With `kueue`, Kueue's pending Workloads, its ResourceFlavors, LocalQueues and
ClusterQueues are watched too: the GPUs of the Workloads' pod sets (`kueue.queued_pod_sets`)
are pending demand of the pools they target (the flavor their quota is reserved on, else
the first their queue would try), before any of their pods exist, and are also stored on
their own as `queued` (the queue, an input the forecaster may use). Admitted Workloads
count through their pods. Why a Workload's queue names no pool, or that its admission is
gated, is logged when it first shows, not at every sample.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import pandas as pd
import yaml
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.config.config_exception import ConfigException

from predictor.foundation.errors import InputError
from predictor.foundation.problem_log import ProblemLog
from predictor.telemetry.config import KubernetesSettings
from predictor.telemetry.kube_objects import (
    KubeNames,
    NodeFacts,
    PodRequest,
    mig_gpus,
    read_pod,
)
from predictor.telemetry.kueue import (
    CLUSTER_QUEUES,
    FLAVORS,
    LOCAL_QUEUES,
    WORKLOADS,
    QueuedPodSet,
    admission_gate,
    queued_pod_sets,
    read_queues,
    watched_queue,
)
from predictor.telemetry.sources import MetricBatch, Source, SourceError
from predictor.telemetry.watch_cache import (
    API_ERRORS,
    ClusterCache,
    Reflector,
    release_shared,
    shared_cache,
)

log = logging.getLogger(__name__)

UNPOOLED = "unpooled"


@dataclass(frozen=True)
class GpuNode:
    name: str
    pool: str
    gpu_model: str
    allocatable_gpus: float  # whole GPUs, and MIG instances in GPU equivalents
    schedulable: bool  # Ready and not cordoned


@dataclass(frozen=True)
class GpuPod:
    namespace: str
    name: str
    phase: str
    gpus: float  # a shared GPU counts as its share, MIG instances as GPU equivalents
    node: str | None
    wanted_pool: str | None  # from nodeSelector / node affinity; None: any pool


@dataclass(frozen=True)
class PoolDemand:
    pool: str
    running: float  # GPUs; shared GPUs count as their shares
    pending: float  # of pending pods
    capacity: float  # allocatable GPUs (and MIG GPU equivalents) of schedulable nodes
    nodes: int
    gpu_model: str
    queued: float = 0.0  # of pending Kueue Workloads (no pods yet)

    @property
    def demand(self) -> float:
        return self.running + self.pending + self.queued


def api_client(settings: KubernetesSettings) -> k8s.ApiClient:
    """The official client configured as in a cluster: from a kubeconfig when one is
    given, else from the pod's service account."""
    try:
        if settings.kubeconfig is not None:
            return _kubeconfig_client(settings)
        configuration = k8s.Configuration()
        k8s_config.load_incluster_config(client_configuration=configuration)
        return k8s.ApiClient(configuration)
    except (ConfigException, OSError) as exc:
        raise InputError(
            f"cannot configure the Kubernetes client: {exc}",
            path=settings.kubeconfig,
        ) from exc


def _kubeconfig_client(settings: KubernetesSettings) -> k8s.ApiClient:
    try:
        return k8s_config.new_client_from_config(
            config_file=str(settings.kubeconfig), context=settings.context
        )
    except (yaml.YAMLError, TypeError):
        # The client's loader indexes whatever YAML it parsed: a file that is not a
        # mapping of clusters, contexts and users fails there with a TypeError.
        raise InputError(
            "cannot configure the Kubernetes client: not a kubeconfig (a YAML mapping of"
            " clusters, contexts and users)",
            path=settings.kubeconfig,
        ) from None


def kube_names(settings: KubernetesSettings) -> KubeNames:
    """The object conventions a collector's settings name (the rest at their defaults)."""
    return KubeNames(
        gpu_resource=settings.gpu_resource,
        gpu_model_label=settings.gpu_model_label,
        gpu_milli_annotation=settings.gpu_milli_annotation,
        pool_label=settings.pool_label,
    )


def gpu_node(facts: NodeFacts) -> GpuNode:
    """A node as telemetry counts it: its whole GPUs and its MIG instances in GPU
    equivalents."""
    return GpuNode(
        name=facts.name,
        pool=facts.pool or UNPOOLED,
        gpu_model=facts.gpu_model,
        allocatable_gpus=facts.gpus + mig_gpus(facts.mig),
        schedulable=facts.ready and not facts.unschedulable,
    )


def parse_pod(pod: Mapping[str, Any], names: KubeNames) -> GpuPod:
    """A pod in its JSON form, as telemetry counts it (`gpu_pod`)."""
    return gpu_pod(read_pod(pod, names))


def gpu_pod(request: PodRequest) -> GpuPod:
    """A pod as telemetry counts it: its GPUs with a shared GPU counted as its share and
    MIG instances as GPU equivalents, and none for gpuscale's own placeholders."""
    return GpuPod(
        namespace=request.namespace,
        name=request.name,
        phase=request.phase,
        gpus=0.0 if request.placeholder else request.gpu_demand,
        node=request.node,
        wanted_pool=request.wanted_pool,
    )


def pool_demand(
    nodes: Iterable[GpuNode], pods: Iterable[GpuPod], queued: Iterable[QueuedPodSet] = ()
) -> list[PoolDemand]:
    """Demand and capacity per pool; every pool that has nodes or is wanted appears.
    `queued`: the pod sets of pending Kueue Workloads, in the pool each targets."""
    by_node = {node.name: node for node in nodes}
    running: dict[str, float] = {}
    pending: dict[str, float] = {}
    waiting: dict[str, float] = {}
    for pod in pods:
        if pod.gpus == 0 or pod.phase not in ("Running", "Pending"):
            continue
        node = by_node.get(pod.node) if pod.node else None
        pool = node.pool if node is not None else pod.wanted_pool or UNPOOLED
        target = running if pod.phase == "Running" else pending
        target[pool] = target.get(pool, 0.0) + pod.gpus
    for pod_set in queued:
        if pod_set.gpus and not pod_set.pod.placeholder:
            pool = pod_set.pod.wanted_pool or UNPOOLED
            waiting[pool] = waiting.get(pool, 0.0) + pod_set.gpus
    pools = sorted({n.pool for n in by_node.values()} | set(running) | set(pending) | set(waiting))
    out = []
    for pool in pools:
        members = [n for n in by_node.values() if n.pool == pool]
        out.append(
            PoolDemand(
                pool=pool,
                running=running.get(pool, 0.0),
                pending=pending.get(pool, 0.0),
                capacity=sum(n.allocatable_gpus for n in members if n.schedulable),
                nodes=len(members),
                gpu_model=",".join(sorted({n.gpu_model for n in members if n.gpu_model})),
                queued=waiting.get(pool, 0.0),
            )
        )
    return out


def demand_batches(
    pools: list[PoolDemand], at: pd.Timestamp, queue: bool = False
) -> list[MetricBatch]:
    """One batch per metric, one point per pool, stamped `at`. The names match those the
    store gives trace columns (gpu_demand, running, pending, capacity); pending counts
    the queued Workloads' GPUs too, and with `queue` they are also a metric of their own
    (`queued`)."""
    columns = {
        "gpu_demand": [p.demand for p in pools],
        "running": [p.running for p in pools],
        "pending": [p.pending + p.queued for p in pools],
        "capacity": [p.capacity for p in pools],
        "nodes": [p.nodes for p in pools],
    }
    if queue:
        columns["queued"] = [p.queued for p in pools]
    base = pd.DataFrame(
        {
            "unique_id": [p.pool for p in pools],
            "ds": pd.Series([at] * len(pools), dtype="datetime64[ns]"),
            "gpu_model": [p.gpu_model for p in pools],
            "unit": "gpus",
        }
    )
    batches = []
    for metric, values in columns.items():
        points = base.assign(y=pd.Series(values, dtype="float64"))
        if metric == "nodes":
            points = points.assign(unit="nodes")
        batches.append(MetricBatch(metric, points[["unique_id", "ds", "y", "gpu_model", "unit"]]))
    return batches


class KubernetesSource(Source):
    """GPU demand, capacity and node count per pool, from the nodes and unfinished pods
    (and with `kueue`, Kueue's queue) of the process's watched cluster cache, once started;
    a one-shot sample lists them."""

    name = "kubernetes"

    def __init__(self, settings: KubernetesSettings, client: k8s.ApiClient | None = None) -> None:
        self.settings = settings
        self._client = client or api_client(settings)
        self._names = kube_names(settings)
        self._cache: ClusterCache | None = None
        if settings.kueue:
            self._queue_problems = ProblemLog(log)

    def available(self) -> bool:
        try:
            k8s.CoreV1Api(self._client).list_node(
                limit=1, _request_timeout=self.settings.request_timeout_s
            )
            return True
        except API_ERRORS:
            return False

    def start(self) -> None:
        """Read the process's watched cache (started here, or shared with the loop's); its
        first list is waited for here, so the first sample has data (if it fails, the
        watches keep trying)."""
        settings = self.settings
        self._cache = shared_cache(
            self._client, self._names, settings.watch_timeout_s, settings.request_timeout_s
        )
        self._kinds(self._cache)  # Kueue's kinds join the cache now
        self._cache.wait_listed(settings.request_timeout_s)

    def _kinds(self, cache: ClusterCache) -> dict[str, Reflector[Any]]:
        """What a sample reads of `cache`: nodes, pods and, with `kueue`, Kueue's kinds."""
        kinds: dict[str, Reflector[Any]] = {"nodes": cache.nodes, "pods": cache.pods}
        if self.settings.kueue:
            kinds.update(watched_queue(cache))
        return kinds

    def _read(self) -> dict[str, list[Any]]:
        """Each kind's objects: the watched cache's, else listed now."""
        cache = self._cache
        if cache is None:
            cache = ClusterCache(
                self._client, self._names, request_timeout_s=self.settings.request_timeout_s
            )
            for kind in self._kinds(cache).values():
                try:
                    kind.list()
                except API_ERRORS as exc:
                    raise SourceError(f"list {kind.kind}: {exc}") from exc
        kinds = self._kinds(cache)
        for kind in kinds.values():
            if not kind.listed or kind.down_since is not None:
                # A cache that is not being kept current is not an observation.
                raise SourceError(kind.error or f"{kind.kind} not listed yet")
        return {name: kind.objects() for name, kind in kinds.items()}

    def sample(self, at: pd.Timestamp) -> list[MetricBatch]:
        read = self._read()
        queued: list[QueuedPodSet] = []
        if self.settings.kueue:
            # A Workload is read against the flavors and queues as they are now.
            queues = read_queues(read[FLAVORS], read[LOCAL_QUEUES], read[CLUSTER_QUEUES])
            workloads = read[WORKLOADS]
            for workload in workloads:
                queued.extend(queued_pod_sets(workload, queues, self._names))
            self._queue_problems.report(
                [*(p.queue_problem for p in queued), *map(admission_gate, workloads)]
            )
        pools = pool_demand(map(gpu_node, read["nodes"]), map(gpu_pod, read["pods"]), queued)
        return demand_batches(pools, at, queue=self.settings.kueue)

    def close(self) -> None:
        if self._cache is not None:
            release_shared(self._cache)  # the loop's watches, where it shares them, go on
            self._cache = None
        self._client.close()
