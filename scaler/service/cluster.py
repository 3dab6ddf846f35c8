"""The cluster the placement service answers for, kept in memory.

Nodes come from the config's fixed list, else from Kubernetes (re-listed at most every
`placement.sync_s`, with the pods bound to them and the GPU indices our bind recorded on
them), else from the provider's nodes with their pool's template. Jobs the service placed
itself (`POST /v1/placements`, extender binds not yet seen on a pod) are kept and bound
again whenever the state is rebuilt. One lock guards it all: the engine's state is not
thread-safe, and calls come from the event loop and from the thread pool (a re-listing of
the sources, the extender's bind, the metrics' gauges).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from http import HTTPStatus

from kubernetes import client as k8s

from scaler.controller.config import workload_mix
from scaler.controller.system import LiveSystem
from scaler.kube.errors import KubeError, Refusal, kube_call
from scaler.kube.objects import KubeNames, gpus_of, node_spec, pod_job
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
from scaler.placement.policies.base import best_fit_gpus
from scaler.service.models import KubeNode, KubePod

POD_CACHE = 4096  # pods remembered between filter and bind (the scheduler's in flight)


@dataclass(frozen=True)
class Bound:
    job: Job
    node: str
    gpus: tuple[int, ...] | None  # None: not known (a pod bound by someone else)


class LiveCluster:
    def __init__(self, system: LiveSystem, clock: Callable[[], float] = time.monotonic) -> None:
        config = system.config
        self.system = system
        self.settings = config.placement
        kube = config.kubernetes
        self.names = KubeNames(
            gpu_resource=kube.gpu_resource if kube else "nvidia.com/gpu",
            gpu_model_label=kube.gpu_model_label if kube else "nvidia.com/gpu.product",
            gpu_milli_annotation=kube.gpu_milli_annotation if kube else "gpuscale.io/gpu-milli",
            gpus_annotation=kube.gpus_annotation if kube else "gpuscale.io/gpus",
        )
        self.pool_label = kube.pool_label if kube else "gpuscale.io/pool"
        self.policy = make_policy(
            self.settings.policy, mix=workload_mix(self.settings.mix), seed=self.settings.seed
        )
        self._clock = clock
        self._lock = threading.RLock()
        self._specs: dict[str, NodeSpec] = {}
        self._observed: dict[str, Bound] = {}  # from Kubernetes pods
        self._placed: dict[str, Bound] = {}  # by this service
        self._state: ClusterState | None = None
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
            if self._state is None and self._specs:
                self._rebuild()
            return self._state

    def ready(self) -> bool:
        return self.state() is not None

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

    def release(self, job_id: str) -> Bound | None:
        with self._lock:
            state = self.state()
            bound = self._placed.pop(job_id, None) or self._observed.pop(job_id, None)
            if bound is None:
                return None
            if state is not None and job_id in state.jobs:
                allocation = state.release(job_id)
                return Bound(bound.job, bound.node, allocation.gpus)
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
        """Nodes the scheduler sent (nodeCacheCapable false): learn new or changed ones."""
        with self._lock:
            changed = False
            for node in nodes:
                spec = node_spec(node, self.names)
                if self._specs.get(spec.name) != spec:
                    self._specs[spec.name] = spec
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
        core = k8s.CoreV1Api(self.system.kube)
        raw = kube_call(
            f"read pod {namespace}/{name}",
            lambda: core.read_namespaced_pod(name, namespace),
            expect=(HTTPStatus.NOT_FOUND,),
        )
        if isinstance(raw, Refusal):
            return None
        return KubePod.model_validate(self.system.kube.sanitize_for_serialization(raw))

    # ---- internals --------------------------------------------------------------------------
    def sync_due(self, within_s: float = 0.0) -> bool:
        """Whether a read in the next `within_s` seconds re-lists the cluster's sources:
        network I/O to the API server or the cloud, where every other call here is in
        memory."""
        if self._synced_at is None:
            return True
        if not self._follows_a_source():
            return False
        return self._clock() + within_s - self._synced_at >= self.settings.sync_s

    def _sync_if_due(self) -> None:
        if not self.sync_due():
            return
        now = self._clock()
        try:
            specs, observed = self._read_sources()
        except (KubeError, ValueError) as exc:
            self.error = str(exc)
            self._synced_at = now  # try again after sync_s, not on every request
            return
        self.error = None
        self._synced_at = now
        for job_id in observed:
            self._placed.pop(job_id, None)  # the pod now says where it runs
        if specs != self._specs or observed != self._observed or self._state is None:
            self._specs, self._observed = specs, observed
            self._rebuild()

    def _follows_a_source(self) -> bool:
        return not self.settings.nodes

    def _read_sources(self) -> tuple[dict[str, NodeSpec], dict[str, Bound]]:
        if self.settings.nodes:
            specs = {}
            for n in self.settings.nodes:
                labels = {**n.labels, **({self.pool_label: n.pool} if n.pool else {})}
                specs[n.name] = NodeSpec(
                    name=n.name,
                    cpu_milli=n.cpu_milli,
                    memory_mib=n.memory_mib,
                    gpus=n.gpus,
                    model=n.gpu_model,
                    labels=tuple(sorted(labels.items())),
                )
            return specs, {}
        if self.system.kube is not None:
            return self._read_kubernetes(self.system.kube)
        return self._read_provider(), {}

    def _read_kubernetes(self, api: k8s.ApiClient) -> tuple[dict[str, NodeSpec], dict[str, Bound]]:
        core = k8s.CoreV1Api(api)
        what = "list nodes and pods"
        nodes = kube_call(what, core.list_node).items
        pods = kube_call(
            what,
            lambda: core.list_pod_for_all_namespaces(
                field_selector="status.phase!=Succeeded,status.phase!=Failed"
            ),
        ).items
        specs = {}
        for raw in nodes:
            node = KubeNode.model_validate(api.sanitize_for_serialization(raw))
            specs[node.metadata.name] = node_spec(node, self.names)
        observed = {}
        for raw in pods:
            if not raw.spec or not raw.spec.node_name or raw.spec.node_name not in specs:
                continue
            pod = KubePod.model_validate(api.sanitize_for_serialization(raw))
            if pod.status.phase in ("Succeeded", "Failed"):
                continue
            job = pod_job(pod, self.names)
            observed[job.id] = Bound(job, raw.spec.node_name, gpus_of(pod, self.names))
        return specs, observed

    def _read_provider(self) -> dict[str, NodeSpec]:
        provider = self.system.provider
        provider.refresh()
        specs = {}
        for group in provider.node_groups():
            pool = group.template()
            for node in group.nodes():
                specs[node.name] = NodeSpec(
                    name=node.name,
                    cpu_milli=pool.cpu_milli_per_node,
                    memory_mib=pool.memory_mib_per_node,
                    gpus=pool.gpus_per_node,
                    model=pool.gpu_model,
                    labels=((self.pool_label, pool.name),),
                )
        return specs

    def _rebuild(self) -> None:
        """A fresh engine state from the nodes, with every known job bound again (pods
        first, then the service's own placements); a job that no longer fits is left out
        of the state, not failed."""
        if not self._specs:
            self._state = None
            return
        # By name: the policies break ties by node index, so the same nodes must give the
        # same state however their source listed them (config order, API server order, the
        # scheduler's node list arriving later).
        state = ClusterState.from_nodes(sorted(self._specs.values(), key=lambda s: s.name))
        index = {name: i for i, name in enumerate(state.names)}
        for bound in (*self._observed.values(), *self._placed.values()):
            n = index.get(bound.node)
            if n is None or bound.job.id in state.jobs or bound.job.problem() is not None:
                continue
            gpus = bound.gpus
            if gpus is None or len(gpus) != bound.job.num_gpu:
                # Placed by someone else: the scheduler already checked selectors and
                # taints; only which GPUs it holds is unknown.
                gpus = best_fit_gpus(state, bound.job, n)
            try:
                state.bind(bound.job, n, gpus)
            except ValueError:
                continue
        self._state = state
