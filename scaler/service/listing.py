"""One listing of the cluster per sync interval for a whole `serve` process.

With Kubernetes as the source of nodes the listing is the process's watched cache
(`scaler.kube.watched`): the snapshot is read from memory, at most once per `sync_s`, and
until the cache's first list has landed every read asks again (the service is not ready).

The placement state (`LiveCluster`) and the plan (`PlanDesk`, through the reconcile loop's
fleet view) both read the cluster as `observe_cluster` shows it; they share this cache, so
a process lists nodes and pods at most once per `placement.sync_s` however many callers
ask. A failed listing is remembered for the interval too: an API server that is down is
asked again after `sync_s`, not on every request.

The snapshot is shared: its `state` must be read, never changed (callers copy it first).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kubernetes import client as k8s

from predictor.telemetry.watch_cache import ClusterCache
from scaler.kube.errors import KubeError
from scaler.kube.objects import KubeNames
from scaler.kube.observed import ObserveCluster, ObservedCluster, observe_cluster
from scaler.kube.watched import NotListed, cache_of


@dataclass(frozen=True, slots=True)
class _Listing:
    at: float  # the cache's clock
    key: tuple[int, KubeNames]  # which client and conventions listed it
    cluster: ObservedCluster | None
    error: str = ""  # why it failed (raised afresh to each caller until the next listing)


class SharedListing:
    """`observe_cluster`, listed at most once per `sync_s` (an `ObserveCluster`)."""

    def __init__(
        self,
        sync_s: float,
        clock: Callable[[], float] = time.monotonic,
        observe: ObserveCluster = observe_cluster,
    ) -> None:
        self._sync_s = sync_s
        self._clock = clock
        self._observe = observe
        self._lock = threading.Lock()
        self._last: _Listing | None = None

    @property
    def cache(self) -> ClusterCache | None:
        """The watched cache it reads, where the plan reads Kueue's queue too."""
        return cache_of(self._observe)

    def due(self, within_s: float = 0.0) -> bool:
        """Whether a read in the next `within_s` seconds lists the cluster (network I/O)."""
        last = self._last
        return last is None or self._clock() + within_s - last.at >= self._sync_s

    def __call__(self, api: k8s.ApiClient, names: KubeNames) -> ObservedCluster:
        """The cluster as last listed, listed again once `sync_s` has passed; raises the
        listing's KubeError (the same one until `sync_s` has passed)."""
        key = (id(api), names)
        with self._lock:
            if self.due() or self._last is None or self._last.key != key:
                now = self._clock()
                try:
                    self._last = _Listing(now, key, self._observe(api, names))
                except NotListed:
                    raise  # a watched cache still listing: asked again on the next read
                except KubeError as exc:
                    self._last = _Listing(now, key, None, str(exc))
                except ValueError as exc:  # an object the API server gave is unreadable
                    self._last = _Listing(now, key, None, f"read nodes and pods: {exc}")
            last = self._last
        if last.cluster is None:
            raise KubeError(last.error)
        return last.cluster
