"""The cluster the placement service answers for, kept in memory.

Nodes come from the config's fixed list, else from Kubernetes (the process's one listing,
`SharedListing`, taken at most every `placement.sync_s` and shared with the plan: the
loop's snapshot of the registered nodes, cordoned and draining ones marked, with the pods
bound to them on the GPU indices our bind recorded), else from the provider's nodes with
their pool's template. Fixed and template nodes carry the pool and GPU model labels a
Kubernetes node carries, so a job selecting either by label is placed on them as the
extender places it; a node whose pool label names a configured pool carries its price,
which the engine weighs between equal fits. Nodes the scheduler sends that the source
did not list are learned until the next listing. Jobs the service placed itself (`POST
/v1/placements`, extender binds not yet seen on a pod) are kept and bound again whenever
the state is rebuilt.

One lock guards it all: the engine's state is not thread-safe, and calls come from the
event loop and from the thread pool (a re-listing of the sources, the extender's bind, the
metrics' gauges).
"""

from __future__ import annotations

import gc
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kubernetes import client as k8s

from scaler.cluster.mig import MigInstance, layout_of
from scaler.cluster.templates import template_node, with_pool_price
from scaler.cluster.topology import parse_gpu_domains
from scaler.controller.config import kube_names, workload_mix
from scaler.controller.system import LiveSystem
from scaler.kube.errors import KubeError
from scaler.kube.moves import PlannedMove
from scaler.kube.objects import node_spec
from scaler.kube.observed import ObservedCluster
from scaler.kube.pods import pod_json_now
from scaler.placement import (
    ClusterState,
    Job,
    NodeSpec,
    Placement,
    Unschedulable,
    commit,
    make_policy,
    place,
    preempt,
)
from scaler.service.listing import SharedListing
from scaler.service.models import KubeNode, KubePod

POD_CACHE = 4096  # pods remembered between filter and bind (the scheduler's in flight)


@dataclass(frozen=True)
class Bound:
    job: Job
    node: str
    gpus: tuple[int, ...]


class LiveCluster:
    def __init__(
        self,
        system: LiveSystem,
        clock: Callable[[], float] = time.monotonic,
        listing: SharedListing | None = None,
    ) -> None:
        config = system.config
        self.system = system
        self.settings = config.placement
        self.names = kube_names(config.kubernetes)
        self.pool_label = self.names.pool_label
        self.policy = make_policy(
            self.settings.policy, mix=workload_mix(self.settings.mix), seed=self.settings.seed
        )
        self._clock = clock
        self._listing = listing or SharedListing(self.settings.sync_s, clock)
        self._lock = threading.RLock()
        self._specs: dict[str, NodeSpec] = {}  # as the source lists them
        self._learned: dict[str, NodeSpec] = {}  # sent by the scheduler, not (yet) listed
        self._observed: dict[str, Bound] = {}  # from Kubernetes pods
        self._draining: frozenset[str] = frozenset()  # gpuscale is removing them
        self._placed: dict[str, Bound] = {}  # by this service
        self._state: ClusterState | None = None
        self._seen: ObservedCluster | None = None  # the listing the state was built from
        self._synced_at: float | None = None
        self._pods: OrderedDict[str, KubePod] = OrderedDict()
        self.error: str | None = None

    # ---- reading ---------------------------------------------------------------------------
    @property
    def lock(self) -> threading.RLock:
        return self._lock

    def state(self) -> ClusterState | None:
        """The current state (re-synced when due); None while no node is known."""
        with self._lock:
            self._sync_if_due()
            if self._state is None and (self._specs or self._learned):
                self._rebuild()
            return self._state

    def ready(self) -> bool:
        return self.state() is not None

    def planned_moves(self) -> Mapping[str, tuple[PlannedMove, ...]]:
        """The moves defragmentation noted on the nodes, as last listed (none unless the
        nodes come from Kubernetes)."""
        with self._lock:
            return {} if self._seen is None else self._seen.moves

    # ---- changing ---------------------------------------------------------------------------
    def place(
        self, job: Job, *, allow_preemption: bool, dry_run: bool
    ) -> Placement | Unschedulable:
        with self._lock:
            state = self.state()
            if state is None:
                return Unschedulable(job.id, "no nodes known yet")
            if job.id in state.jobs:
                return Unschedulable(job.id, f"job {job.id} is already placed")
            decided = (preempt if allow_preemption else place)(state, job, self.policy)
            if isinstance(decided, Placement) and not dry_run:
                commit(state, job, decided)
                for victim in decided.evict:
                    self._placed.pop(victim, None)
                    self._observed.pop(victim, None)
                self._placed[job.id] = Bound(job, decided.node, decided.gpus)
            return decided

    def mig_instances(self, job: Job, placement: Placement) -> list[tuple[int, MigInstance]]:
        """The MIG instances (index, instance) a MIG job's placement takes; [] otherwise."""
        with self._lock:
            state = self.state()
            if job.mig_profile is None or state is None:
                return []
            layout = state.mig[placement.node_index]
            return [(k, layout.instances[k]) for k in placement.gpus]

    def release(self, job_id: str) -> Bound | None:
        with self._lock:
            state = self.state()
            bound = self._placed.pop(job_id, None) or self._observed.pop(job_id, None)
            if bound is None:
                return None
            if state is not None and job_id in state.jobs:
                allocation = state.release(job_id)
                gpus = allocation.gpus
                if allocation.job.mig_profile is not None:  # instance indices: their GPUs
                    layout = state.mig[allocation.node]
                    gpus = tuple(sorted({layout.instances[k].gpu for k in gpus}))
                return Bound(bound.job, bound.node, gpus)
            return bound

    def record_bind(self, job: Job, placement: Placement) -> None:
        """An extender bind the engine decided: hold its GPUs until the pod is seen."""
        with self._lock:
            state = self.state()
            if state is None:
                return
            if job.id in state.jobs:
                state.release(job.id)
            commit(state, job, placement)
            self._placed[job.id] = Bound(job, placement.node, placement.gpus)

    def upsert_nodes(self, nodes: Sequence[KubeNode]) -> None:
        """Nodes the scheduler sent (nodeCacheCapable false): learn those the source did
        not list (the source's own view wins: a listed node's spec is what it offers beside
        its DaemonSet pods, which the scheduler's copy does not say)."""
        with self._lock:
            self._sync_if_due()  # a listing due now would forget what is learned here
            changed = False
            for node in nodes:
                spec = node_spec(node, self.names)
                if spec.name not in self._specs and self._learned.get(spec.name) != spec:
                    self._learned[spec.name] = spec
                    changed = True
            if changed:
                self._rebuild()

    def remember_pod(self, pod: KubePod) -> None:
        with self._lock:
            key = pod.metadata.uid or f"{pod.metadata.namespace}/{pod.metadata.name}"
            self._pods[key] = pod
            self._pods.move_to_end(key)
            while len(self._pods) > POD_CACHE:
                self._pods.popitem(last=False)

    def pod(self, uid: str, namespace: str, name: str) -> KubePod | None:
        """A pod seen in a filter or prioritize call, else read from the API server."""
        with self._lock:
            found = self._pods.get(uid) or self._pods.get(f"{namespace}/{name}")
        if found is not None or self.system.kube is None:
            return found
        raw = pod_json_now(self.system.kube, namespace, name)
        return None if raw is None else KubePod.model_validate(raw)

    # ---- internals --------------------------------------------------------------------------
    def sync_due(self, within_s: float = 0.0) -> bool:
        """Whether a read in the next `within_s` seconds re-lists the cluster's sources:
        network I/O to the API server or the cloud, where every other call here is in
        memory."""
        if self._kube() is not None:
            return self._listing.due(within_s)
        if self._synced_at is None:
            return True
        if self.settings.nodes:
            return False
        return self._clock() + within_s - self._synced_at >= self.settings.sync_s

    def _kube(self) -> k8s.ApiClient | None:
        """The API server, when it is the source of nodes."""
        return None if self.settings.nodes else self.system.kube

    def _sync_if_due(self) -> None:
        """Adopt a new listing (Kubernetes: the shared one, when it is newer than the
        state's) or re-read the fixed list or the provider when due."""
        kube = self._kube()
        if kube is None and not self.sync_due():
            return
        now = self._clock()
        try:
            if kube is not None:
                seen = self._listing(kube, self.names)
                if seen is self._seen:
                    return
                specs, observed, draining = _from_listing(seen)
                self._seen = seen
            else:
                specs, observed, draining = self._read_sources(), {}, frozenset()
        except (KubeError, ValueError) as exc:
            self.error = str(exc)
            self._synced_at = now  # try again after sync_s, not on every request
            return
        self.error = None
        self._synced_at = now
        for job_id in observed:
            self._placed.pop(job_id, None)  # the pod now says where it runs
        forgotten = bool(self._learned)
        self._learned.clear()  # the listing is newer than what the scheduler sent
        if (
            forgotten
            or self._state is None
            or ((specs, observed, draining) != (self._specs, self._observed, self._draining))
        ):
            self._specs, self._observed, self._draining = specs, observed, draining
            self._rebuild()

    def _read_sources(self) -> dict[str, NodeSpec]:
        """The fixed list's nodes, else the provider's; labelled with their pool and GPU
        model as a Kubernetes node is, so a job selecting either by label finds them."""
        if not self.settings.nodes:
            return self._read_provider()
        specs = {}
        for n in self.settings.nodes:
            labels = dict(n.labels)
            if n.pool:
                labels[self.pool_label] = n.pool
            if n.gpu_model:
                labels[self.names.gpu_model_label] = n.gpu_model
            if n.rack:
                labels[self.names.rack_label] = n.rack
            specs[n.name] = NodeSpec(
                name=n.name,
                cpu_milli=n.cpu_milli,
                memory_mib=n.memory_mib,
                gpus=n.gpus,
                model=n.gpu_model,
                labels=tuple(sorted(labels.items())),
                mig=layout_of(n.mig_layout, n.gpu_model) if n.mig_layout else None,
                gpu_domains=parse_gpu_domains(n.gpu_domains, n.gpus) if n.gpu_domains else (),
                rack=n.rack or labels.get(self.names.rack_label),
            )
        return specs

    def _read_provider(self) -> dict[str, NodeSpec]:
        provider = self.system.provider
        provider.refresh()
        return {
            node.name: template_node(
                group.template(), node.name, self.pool_label, self.names.gpu_model_label
            )
            for group in provider.node_groups()
            for node in group.nodes()
        }

    def _rebuild(self) -> None:
        """A fresh engine state from the nodes, with every known job bound again (pods
        first, then the service's own placements); a job that no longer fits is left out
        of the state, not failed."""
        specs = {**self._learned, **self._specs}
        if not specs:
            self._state = None
            return
        # By name: the policies break ties by node index, so the same nodes must give the
        # same state however their source listed them (config order, API server order, the
        # scheduler's node list arriving later).
        prices = {pool.name: pool.price_per_hour for pool in self.system.config.pools}
        nodes = [
            with_pool_price(spec, prices, self.pool_label)
            for spec in sorted(specs.values(), key=lambda s: s.name)
        ]
        listed = self._seen.state if self._seen is not None and not self._learned else None
        if listed is not None and listed.names == [n.name for n in nodes]:
            # The listing's own state holds these nodes with the pods bound as the engine
            # bound them: a copy, priced, is the same state without binding 150,000 pods
            # again (what a rebuild cost at 5,000 nodes each time the cluster changed).
            state = listed.copy()
            state.set_prices(nodes)
            known: tuple[Bound, ...] = tuple(self._placed.values())
        else:
            state = ClusterState.from_nodes(nodes)
            known = (*self._observed.values(), *self._placed.values())
        index = {name: i for i, name in enumerate(state.names)}
        state.set_draining(index[name] for name in self._draining if name in index)
        for bound in known:
            n = index.get(bound.node)
            if n is None or bound.job.id in state.jobs or bound.job.problem() is not None:
                continue
            try:
                state.bind(bound.job, n, bound.gpus)
            except ValueError:
                continue
        self._state = state
        gc.freeze()  # long-lived and acyclic, as the watched snapshot (scaler.kube.watched)


def _from_listing(
    cluster: ObservedCluster,
) -> tuple[dict[str, NodeSpec], dict[str, Bound], frozenset[str]]:
    """The nodes, the jobs bound on them and the draining nodes of the loop's snapshot."""
    state = cluster.state
    if state is None:
        return {}, {}, frozenset()
    observed = {a.job.id: Bound(a.job, state.names[a.node], a.gpus) for a in state.jobs.values()}
    draining = frozenset(name for i, name in enumerate(state.names) if state.draining[i])
    return dict(cluster.specs), observed, draining
