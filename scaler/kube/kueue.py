"""Kueue's queue in the live loop: pending Workloads as the jobs they will become.

A pass reads Kueue's Workloads, ResourceFlavors, LocalQueues and ClusterQueues from the
process's watched cluster cache where it reads one (`watched_pod_sets`: listed once, then
watched), else lists them (`read_queue`), and reads the pod sets still waiting
(`predictor.telemetry.kueue.queued_pod_sets`:
pending, not admitted, not admission-gated, each pod set in the pool of the flavor its
quota is reserved on, else of the first flavor its queue would try, else the one its node
selector names; the collector beside the loop reads the queue the same way and logs, once,
why a queue named no pool or that a Workload's admission is gated, so the loop, which
would say it every pass, does not). `queued_jobs` makes each pod set `count` jobs of its
pod's shape, one gang per Workload (Kueue admits a Workload's pods all together): a
pending Workload of 2 pods x 8 GPUs is a gang of two 8-GPU jobs. `with_queue` adds them to
the cluster snapshot (`ObservedCluster.queued`), so the loop's scale-up estimate and
reactive floor see them before any of their pods exist. Admitted Workloads are not read:
their pods are in the snapshot already.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any

from kubernetes import client as k8s

from predictor.telemetry.kube_objects import KubeNames, Taint
from predictor.telemetry.kueue import (
    CLUSTER_QUEUES,
    FLAVORS,
    GROUP,
    LOCAL_QUEUES,
    WORKLOADS,
    QueuedPodSet,
    queued_pod_sets,
    read_queues,
    served_version,
    watched_queue,
)
from predictor.telemetry.watch_cache import ClusterCache
from scaler.cluster.job import Job
from scaler.kube.errors import KubeError, kube_call
from scaler.kube.objects import job_of
from scaler.kube.observed import ObserveCluster, ObservedCluster
from scaler.kube.watched import cache_of


def read_queue(api: k8s.ApiClient, names: KubeNames) -> list[QueuedPodSet]:
    """The pod sets of every pending Workload, listed now. Raises KubeError when the API
    server cannot answer (a cluster without Kueue's CRDs answers 404)."""
    custom = k8s.CustomObjectsApi(api)
    what = "read Kueue's Workloads, ResourceFlavors, LocalQueues and ClusterQueues"
    version = kube_call(what, lambda: served_version(custom))

    def items(plural: str) -> list[Any]:
        listing = kube_call(what, lambda: custom.list_cluster_custom_object(GROUP, version, plural))
        return listing.get("items") or []

    return _pod_sets(items, names)


def watched_pod_sets(cache: ClusterCache, names: KubeNames, wait_s: float) -> list[QueuedPodSet]:
    """The pod sets of every pending Workload, from `cache` (Kueue's kinds join it at the
    first ask, whose list is waited for up to `wait_s`). Raises KubeError while a kind has
    no first list (a cluster without Kueue's CRDs answers 404); a watch down since is the
    cache's staleness, which holds the pass's scale-downs."""
    kinds = watched_queue(cache)
    for kind in kinds.values():
        if not kind.wait_listed(wait_s):
            raise KubeError(f"read Kueue's {kind.kind}: {kind.error or 'not listed yet'}")
    return _pod_sets(lambda plural: kinds[plural].objects(), names)


def _pod_sets(items: Callable[[str], list[Any]], names: KubeNames) -> list[QueuedPodSet]:
    queues = read_queues(items(FLAVORS), items(LOCAL_QUEUES), items(CLUSTER_QUEUES))
    return [
        pod_set
        for workload in items(WORKLOADS)
        for pod_set in queued_pod_sets(workload, queues, names)
    ]


def queued_jobs(
    pod_sets: Iterable[QueuedPodSet], names: KubeNames, taints: Sequence[Taint] = ()
) -> list[Job]:
    """`count` jobs per pod set, named `<namespace>/<workload>/<pod set>-<i>`, the
    Workload's pod sets one gang."""
    out = []
    for pod_set in pod_sets:
        job = job_of(pod_set.pod, names, taints)
        for i in range(pod_set.count):
            out.append(
                replace(job, id=f"{pod_set.workload}/{pod_set.name}-{i}", gang=pod_set.workload)
            )
    return out


def with_queue(observe: ObserveCluster, wait_s: float = 10.0) -> ObserveCluster:
    """`observe`, with the pending Workloads' jobs in the snapshot it returns: read from
    the watched cache `observe` reads, if any (its first list waited for up to `wait_s`),
    else listed."""
    cache = cache_of(observe)

    def observe_with_queue(api: k8s.ApiClient, names: KubeNames) -> ObservedCluster:
        cluster = observe(api, names)
        if cache is None:
            pod_sets = read_queue(api, names)
        else:
            pod_sets = watched_pod_sets(cache, names, wait_s)
        taints = [Taint.from_text(t) for t in sorted(cluster.taints)]
        jobs = queued_jobs(pod_sets, names, taints)
        pools = {
            f"{p.workload}/{p.name}-{i}": p.pod.wanted_pool
            for p in pod_sets
            for i in range(p.count)
        }
        gpus: dict[str | None, float] = {}
        for p in pod_sets:
            gpus[p.pod.wanted_pool] = gpus.get(p.pod.wanted_pool, 0.0) + p.gpus
        return replace(cluster, queued=tuple(jobs), queued_pools=pools, queued_gpus=gpus)

    return observe_with_queue
