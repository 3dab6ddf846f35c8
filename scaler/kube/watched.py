"""The loop's cluster snapshot kept from the process's watched cache, change by change.

`WatchedCluster` is an `ObserveCluster` over a `ClusterCache`
(`predictor.telemetry.watch_cache`): each call takes the cache's changes since the last
one and updates its snapshot from them, the same snapshot `observed_cluster` builds from a
fresh list (tests hold the two equal), at the cost of what changed:

- a pod created, changed, bound, finished or deleted: its job is made again (`job_of`, the
  one pod -> job translation) and only the nodes it left or joined are bound again, each
  from its own pods (`observed.bind_on_node`), where the engine's state is changed in place;
- a node's labels, annotations or cordon: its entry; what it offers (allocatable, or its
  DaemonSet pods' overhead) or the set of nodes: the engine's state is laid out again in
  name order, the nodes that did not change keeping their rows and jobs, the others bound
  afresh; a change of the taints any node carries makes every job again (a job's
  tolerations are matched against them).

Each call hands out a copy of the state (callers may fork it; the next update changes the
cache's own) and, when nothing changed, the same snapshot as before. Before the cache's
first list has landed the call raises `KubeError` (a pass fails as a failed list did; the
service is not ready); while a watch has been down longer than `stale_after_s` the snapshot
says so (`ObservedCluster.stale`), and the loop holds scale-downs for it.
"""

from __future__ import annotations

import gc
import threading
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from kubernetes import client as k8s

from predictor.telemetry.kube_objects import KubeNames, NodeFacts, PodRequest, Taint
from predictor.telemetry.watch_cache import (
    SYSTEM_NAMESPACE,
    CacheStatus,
    ClusterCache,
    cache_key,
    release_shared,
    shared_cache,
)
from scaler.cluster.job import Job
from scaler.cluster.snapshot import Allocation, ClusterState, NodeSpec
from scaler.kube.drainability import NO_BUDGETS, SystemBudgets
from scaler.kube.errors import KubeError
from scaler.kube.moves import PlannedMove, read_moves
from scaler.kube.objects import job_of
from scaler.kube.observed import (
    ObservedCluster,
    ObservedNode,
    bind_on_node,
    observed_node,
    offered,
    pending_gpus,
    taints_of,
)


class NotListed(KubeError):
    """The cache's first list has not landed: nothing to read yet (ask again soon)."""


# The default of `kubernetes.cache_stale_after_s`: a watch down longer than this, the view
# may miss what a scale-down needs.
STALE_AFTER_S = 60.0


def label_selector(raw: Mapping[str, Any]) -> k8s.V1LabelSelector:
    """A LabelSelector's JSON form as the client's model (what `SystemBudgets` matches)."""
    expressions = [
        k8s.V1LabelSelectorRequirement(
            key=str(e.get("key") or ""),
            operator=str(e.get("operator") or ""),
            values=e.get("values"),
        )
        for e in raw.get("matchExpressions") or []
    ]
    return k8s.V1LabelSelector(
        match_labels=raw.get("matchLabels") or None, match_expressions=expressions or None
    )


class WatchedCluster:
    """See the module docstring; call it as `observe_cluster` is called."""

    def __init__(
        self, cache: ClusterCache, stale_after_s: float = STALE_AFTER_S, wait_s: float = 0.0
    ) -> None:
        self.cache = cache
        self.names: KubeNames = cache.names
        self.stale_after_s = stale_after_s
        self.wait_s = wait_s  # how long a call waits for the first list
        self._lock = threading.Lock()
        self._serials: dict[str, int] = {}
        self._facts: dict[str, NodeFacts] = {}
        self._pods: dict[str, PodRequest] = {}  # unfinished, by id
        self._jobs: dict[str, Job] = {}  # of every pod but DaemonSet and mirror pods
        self._on_node: dict[str, set[str]] = {}  # node -> pods bound there (jobs)
        self._agents: dict[str, set[str]] = {}  # node -> its DaemonSet and mirror pods
        self._pending: dict[str, PodRequest] = {}
        self._taints: list[Taint] = []
        self._specs: dict[str, NodeSpec] = {}
        self._observed: dict[str, ObservedNode] = {}
        self._moves: dict[str, tuple[PlannedMove, ...]] = {}
        self._state: ClusterState | None = None
        self._unbound: dict[str, str] = {}
        self._bound_pods: dict[str, PodRequest] = {}
        self._budgets = NO_BUDGETS
        self._system_pods = 0  # kube-system's: the budgets are read only where one runs
        self._cron_jobs: tuple[Mapping[str, Any], ...] | None = ()
        self._snapshot: ObservedCluster | None = None

    def status(self) -> CacheStatus:
        return self.cache.status()

    def __call__(
        self, api: k8s.ApiClient | None = None, names: KubeNames | None = None
    ) -> ObservedCluster:
        if names is not None and names != self.names:
            raise ValueError("the watched cluster is read with other object conventions")
        status = self.cache.status()
        if not status.listed and self.wait_s > 0:
            self.cache.wait_listed(self.wait_s)
            status = self.cache.status()
        if not status.listed:
            why = "; ".join(status.errors) or "not listed yet"
            raise NotListed(f"read nodes and pods: the cluster cache has no first list ({why})")
        with self._lock:
            snapshot = self._refresh()
        stale = None
        if status.stale_s > self.stale_after_s:
            stale = (
                f"cluster cache stale: a watch has been down {status.stale_s:.0f} s"
                f" ({'; '.join(status.errors)})"
            )
        elif self.cache.budgets.refused is not None and self._system_pods:
            # Whether a budget covers a kube-system pod is unknown: no drain is justified.
            stale = (
                f"kube-system's PodDisruptionBudgets not readable ({self.cache.budgets.refused})"
            )

        return snapshot if snapshot.stale == stale else replace(snapshot, stale=stale)

    # ---- updating ------------------------------------------------------------------------
    def _changes(self, kind: Any) -> tuple[dict[str, Any] | None, bool]:
        """(the kind's changes since the last call, None: take all of it), whether any."""
        before = self._serials.get(kind.kind)
        if before is None:
            self._serials[kind.kind] = kind.serial  # what changes after it comes again
            return None, True
        serial, changes = kind.changes_since(before)
        self._serials[kind.kind] = serial
        return changes, changes is None or bool(changes)

    def _refresh(self) -> ObservedCluster:
        cache = self.cache
        node_changes, nodes_moved = self._changes(cache.nodes)
        pod_changes, pods_moved = self._changes(cache.pods)
        budget_changes, budgets_moved = self._changes(cache.budgets)
        _, cron_moved = self._changes(cache.cronjobs)
        if not (nodes_moved or pods_moved or budgets_moved or cron_moved) and self._snapshot:
            return self._snapshot

        dirty: set[str] = set()  # nodes whose pods are bound again
        touched: set[str] = set()  # nodes whose own entry (and what they offer) is read again
        released: set[str] = set()  # jobs that left the nodes they were bound on
        if pod_changes is None:
            _, everything = cache.pods.snapshot()
            pod_changes = {k: everything.get(k) for k in {*self._pods, *everything}}
        for key, pod in pod_changes.items():
            self._drop_pod(key, dirty, touched, released)
            if pod is not None and not pod.finished:
                self._add_pod(pod, dirty, touched)

        names_changed = self._state is None
        if node_changes is None:
            _, everything = cache.nodes.snapshot()
            node_changes = {
                k: everything.get(k) for k in {*(f"/{n}" for n in self._facts), *everything}
            }
        for key, node in node_changes.items():
            name = key.lstrip("/")
            if node is None:
                names_changed |= self._facts.pop(name, None) is not None
                for job_id in self._on_node.get(name, ()):  # bound to a node now gone
                    self._unbound.pop(job_id, None)
                    self._bound_pods.pop(job_id, None)
            else:
                names_changed |= name not in self._facts
                self._facts[name] = node
            touched.add(name)
        if node_changes:
            taints = taints_of(self._facts.values())
            if [t.text for t in taints] != [t.text for t in self._taints]:
                self._taints = taints
                self._jobs = {i: job_of(p, self.names, taints) for i, p in self._jobs_pods()}
                dirty.update(self._facts)

        respec: set[str] = set()
        for name in touched:
            node = self._facts.get(name)
            if node is None:
                self._specs.pop(name, None)
                self._observed.pop(name, None)
                self._moves.pop(name, None)
                continue
            spec = offered(node, self._overhead(name))
            if self._specs.get(name) != spec:
                respec.add(name)
                self._specs[name] = spec
            found = tuple(read_moves(node.annotations, self.names))
            if found:
                self._moves[name] = found
            else:
                self._moves.pop(name, None)
        if names_changed or respec:
            self._lay_out(respec)
            dirty.update(respec)
        state = self._state
        if state is not None:
            for job_id in released:
                if job_id in state.jobs:
                    state.release(job_id)
            index = {name: i for i, name in enumerate(state.names)} if dirty or touched else {}
            for name in dirty & self._facts.keys():
                n = index[name]
                for job_id in list(state.node_jobs[n]):
                    state.release(job_id)
                pairs = [(self._pods[i], self._jobs[i]) for i in self._on_node.get(name, ())]
                for _, job in pairs:
                    self._unbound.pop(job.id, None)
                    self._bound_pods.pop(job.id, None)
                self._unbound.update(bind_on_node(state, n, pairs))
                self._bound_pods.update((j.id, p) for p, j in pairs if j.id in state.jobs)
            for name in (dirty | touched) & self._facts.keys():
                bound = (self._pods[i] for i in self._on_node.get(name, ()))
                entry = observed_node(
                    self._facts[name], self._facts[name].cloud_name, bound, self.names
                )
                self._observed[name] = entry
                n = index[name]
                if state.draining[n] != entry.draining:
                    state.set_draining([n], entry.draining)
        if budgets_moved or budget_changes is None or pods_moved:
            self._budgets = self._read_budgets()
        if cron_moved or cache.cronjobs.refused:
            refused = cache.cronjobs.refused is not None  # the loop lists, and says why not
            self._cron_jobs = None if refused else tuple(cache.cronjobs.objects())
        self._snapshot = self._assemble()
        # The cache's objects and each snapshot live long and hold no cycles (refcounts
        # free them): out of the cyclic collector's reach, its full collections no longer
        # walk 150,000 pods, which took most of a state copy's time and stalled the
        # extender's answers by a tenth of a second and more at 5,000 nodes.
        gc.freeze()
        return self._snapshot

    def _jobs_pods(self) -> Iterable[tuple[str, PodRequest]]:
        return ((i, p) for i, p in self._pods.items() if not p.goes_with_node)

    def _drop_pod(self, key: str, dirty: set[str], touched: set[str], released: set[str]) -> None:
        old = self._pods.pop(key, None)
        if old is None:
            return
        self._system_pods -= old.namespace == SYSTEM_NAMESPACE
        if old.goes_with_node:
            if old.node is not None:
                self._agents.get(old.node, set()).discard(key)
                touched.add(old.node)
            return
        self._jobs.pop(key, None)
        if old.node is None:
            self._pending.pop(key, None)
            return
        self._on_node.get(old.node, set()).discard(key)
        self._unbound.pop(key, None)
        self._bound_pods.pop(key, None)
        released.add(key)
        dirty.add(old.node)

    def _add_pod(self, pod: PodRequest, dirty: set[str], touched: set[str]) -> None:
        key = pod.id
        self._pods[key] = pod
        self._system_pods += pod.namespace == SYSTEM_NAMESPACE
        if pod.goes_with_node:
            if pod.node is not None:
                self._agents.setdefault(pod.node, set()).add(key)
                touched.add(pod.node)
            return
        self._jobs[key] = job_of(pod, self.names, self._taints)
        if pod.node is None:
            self._pending[key] = pod
            return
        self._on_node.setdefault(pod.node, set()).add(key)
        dirty.add(pod.node)

    def _overhead(self, name: str) -> tuple[int, int]:
        agents = [self._pods[i] for i in self._agents.get(name, ())]
        return sum(p.cpu_milli for p in agents), sum(p.memory_mib for p in agents)

    def _lay_out(self, respec: set[str]) -> None:
        """The engine's state over the current nodes in name order: the nodes whose spec
        did not change keep their rows and jobs; the others start empty (bound after)."""
        old = self._state
        names = sorted(self._facts)
        if not names:
            self._state = None
            return
        state = ClusterState.from_nodes([self._specs[n] for n in names])
        if old is not None:
            before = {name: i for i, name in enumerate(old.names)}
            kept = [(before[n], i) for i, n in enumerate(names) if n in before and n not in respec]
            _carry(old, state, kept)
        self._state = state
        known = set(old.names) if old is not None else set()
        respec.update(n for n in names if n not in known)  # new nodes: bind their pods

    def _read_budgets(self) -> SystemBudgets:
        """kube-system's budgets, where a kube-system pod runs (as `system_budgets`)."""
        if self._system_pods == 0:
            return NO_BUDGETS
        _, found = self.cache.budgets.snapshot()
        return SystemBudgets(tuple(label_selector(s) for s in found.values() if s))

    def _assemble(self) -> ObservedCluster:
        state = self._state
        order = state.names if state is not None else []
        pending = tuple(self._jobs[i] for i in sorted(self._pending))
        specs = {n: self._specs[n] for n in order}
        return ObservedCluster(
            state=None if state is None else state.copy(),
            nodes={n: self._observed[n] for n in order},
            specs=specs,
            pending=pending,
            pending_pools={j.id: self._pending[j.id].wanted_pool for j in pending},
            pending_gpus=pending_gpus(self._pending[j.id] for j in pending),
            unbound=dict(self._unbound),
            taints=frozenset(t for s in specs.values() for t in s.taints),
            bound_pods=dict(self._bound_pods),
            moves={n: self._moves[n] for n in order if n in self._moves},
            budgets=self._budgets,
            cron_jobs=self._cron_jobs,
        )


def _carry(old: ClusterState, new: ClusterState, kept: list[tuple[int, int]]) -> None:
    """Move the rows and jobs of the `kept` nodes ((old index, new index) pairs, same spec)
    from `old`, which is discarded after, into the freshly laid out `new`."""
    if not kept:
        return
    src = [o for o, _ in kept]
    dst = [n for _, n in kept]
    width = min(old.gpu_free.shape[1], new.gpu_free.shape[1])
    for name in ("cpu_free", "mem_free", "full_free", "max_free", "shape_counts", "draining"):
        getattr(new, name)[dst] = getattr(old, name)[src]
    new.gpu_free[dst, :width] = old.gpu_free[src, :width]
    for o, n in kept:
        new.node_jobs[n] = old.node_jobs[o]
        if o in old.mig_used and n in new.mig_used:
            new.mig_used[n] = old.mig_used[o]
    moved = dict(kept)
    if len(kept) == old.size and all(o == n for o, n in kept):
        new.jobs = old.jobs  # nodes only added after the old ones: every job stays put
    else:
        for job_id, a in old.jobs.items():
            n = moved.get(a.node)
            if n is not None:
                new.jobs[job_id] = a if n == a.node else Allocation(a.job, n, a.gpus, a.since_s)
    if new.rack_jobs is not None and new.rack_id is not None:
        for n, jobs in enumerate(new.node_jobs):
            if new.rack_id[n] >= 0:
                new.rack_jobs[new.rack_id[n]] += len(jobs)
    for allocation in new.jobs.values():
        if allocation.job.service:
            new.service_nodes.setdefault(allocation.job.service, Counter())[allocation.node] += 1


def cache_of(observe: object) -> ClusterCache | None:
    """The watched cache an observer reads (a `WatchedCluster`, or the service's listing of
    one), where a pass reads the kinds only some setups need (Kueue's, CapacityBuffers,
    Karpenter's); None for an observer that lists afresh, beside which they are listed too."""
    cache = getattr(observe, "cache", None)
    return cache if isinstance(cache, ClusterCache) else None


_WATCHED: dict[tuple[str, KubeNames], WatchedCluster] = {}
_WATCHED_LOCK = threading.Lock()


def watched_cluster(
    api: k8s.ApiClient,
    names: KubeNames,
    request_timeout_s: float = 10.0,
    stale_after_s: float = STALE_AFTER_S,
) -> WatchedCluster:
    """The process's watched cluster on the API server `api` talks to (its cache started):
    `scale` and `serve` in one process read one snapshot of one cache, stale past the
    bound of the config they share (`kubernetes.cache_stale_after_s`). It holds one hold
    of the process's cache, which a collector in the process may share too."""
    key = cache_key(api, names)
    with _WATCHED_LOCK:
        found = _WATCHED.get(key)
        if found is None:
            cache = shared_cache(api, names, request_timeout_s=request_timeout_s)
            found = _WATCHED[key] = WatchedCluster(cache)
        found.stale_after_s = stale_after_s
        return found


def forget_watched(watched: WatchedCluster) -> None:
    """The process's loop ends: `watched` gives its hold of the cache back (the cache
    stops unless a collector still reads it); a later call makes a new one."""
    with _WATCHED_LOCK:
        keys = [k for k, v in _WATCHED.items() if v is watched]
        for key in keys:
            del _WATCHED[key]
    if keys:
        release_shared(watched.cache)
