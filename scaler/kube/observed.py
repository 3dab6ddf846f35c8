"""The cluster as Kubernetes shows it now, on the one cluster model: one listing of nodes
and pods, one snapshot.

`observe_cluster` lists nodes and pods once and `observed_cluster` (pure) turns them into
an `ObservedCluster`:

- a `ClusterState` of the registered nodes: cordoned where `spec.unschedulable`, draining
  where gpuscale cordoned the node for its removal (the removal annotation);
- every bound pod that has not finished bound into it as a job, on the GPU indices our
  bind recorded (the GPU index annotation) when they are readable, else on the best-fitting
  GPUs (the scheduler already checked selectors and taints; only which GPUs is unknown).
  Pods that say which GPUs they hold are bound first, so a guess never takes their GPUs;
- DaemonSet and mirror pods are the node's overhead, not jobs: they go with their node, so
  the node offers what is left beside them and no scale-down check tries to move them;
- the pending pods (unbound, not finished) as jobs, placeholders flagged, and the GPUs the
  real ones wait for per pool, counted as telemetry counts them (`PodRequest.gpu_demand`:
  shares as shares, MIG instances in GPU equivalents), as are the GPUs real pods hold on
  each node;
- per node what the loop needs to remove it: its pool label, its provider's name, the real
  pods a drain would move (for `drainability.why_undrainable` to say whether one keeps the
  node) and whether real pods hold GPUs there; and kube-system's PodDisruptionBudgets,
  where a kube-system pod runs (whether a budget covers a system pod is one of the rules);
- the pods bound into the state (by job id), for what a job's pod says beyond the job (may
  it be moved, what recreates it), and the moves defragmentation planned onto each node;
- with Kueue (`scaler.kube.kueue.with_queue`), the jobs of the pending Workloads, which have
  no pods yet, apart from the pending pods.

Whatever reads the cluster to decide (the reconcile loop's fleet, its reactive floor, the
scale-down check, the placeholder sizing) reads this one snapshot.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kubernetes import client as k8s

from predictor.telemetry.kube_objects import (
    KUBE_NAMES,
    KubeNames,
    NodeFacts,
    PodRequest,
    Taint,
    read_node,
    read_pod,
)
from scaler.cluster.job import Job
from scaler.cluster.snapshot import ClusterState, NodeSpec
from scaler.kube.drainability import NO_BUDGETS, SystemBudgets, system_budgets
from scaler.kube.errors import kube_call
from scaler.kube.moves import PlannedMove, read_moves
from scaler.kube.objects import job_of, spec_of
from scaler.placement.policies.base import best_fit_gpus

UNFINISHED = "status.phase!=Succeeded,status.phase!=Failed"


@dataclass(frozen=True, slots=True)
class ObservedNode:
    """One registered node: where it belongs and what its removal would take."""

    name: str  # the Kubernetes name
    cloud_name: str  # the provider's name (from the providerID)
    pool: str | None  # its pool label
    cordoned: bool
    draining: bool  # cordoned by gpuscale for its removal
    gpu_pods: int = 0  # real pods holding GPUs here
    gpus_used: float = 0.0  # GPUs real pods hold here (shares as shares, MIG as equivalents)
    # The real pods a drain would evict (placeholders, DaemonSet and mirror pods aside), by id
    evicted: tuple[PodRequest, ...] = ()

    @property
    def busy(self) -> bool:
        """Real GPU jobs run here: a scale-down must never kill training."""
        return self.gpu_pods > 0

    @property
    def pods(self) -> tuple[str, ...]:
        return tuple(p.id for p in self.evicted)

    @property
    def movable_pods(self) -> int:
        return len(self.evicted)


@dataclass(frozen=True)
class ObservedCluster:
    state: ClusterState | None  # None: no node is registered
    nodes: Mapping[str, ObservedNode]  # by Kubernetes name, in the state's order
    specs: Mapping[str, NodeSpec]  # what each node offers beside its DaemonSet pods
    pending: tuple[Job, ...] = ()  # unbound pods, placeholders included (flagged)
    pending_pools: Mapping[str, str | None] = field(default_factory=dict)  # job -> pool wanted
    pending_gpus: Mapping[str | None, float] = field(default_factory=dict)  # real, per pool
    unbound: Mapping[str, str] = field(default_factory=dict)  # bound pod -> why not in state
    taints: frozenset[str] = frozenset()  # every node's scheduling taints
    bound_pods: Mapping[str, PodRequest] = field(default_factory=dict)  # by job id, in state
    moves: Mapping[str, tuple[PlannedMove, ...]] = field(default_factory=dict)  # by target
    queued: tuple[Job, ...] = ()  # pending Kueue Workloads' jobs (no pods yet), gangs
    queued_pools: Mapping[str, str | None] = field(default_factory=dict)  # job -> pool
    queued_gpus: Mapping[str | None, float] = field(default_factory=dict)  # per pool
    budgets: SystemBudgets = NO_BUDGETS  # kube-system's PodDisruptionBudgets
    # The CronJobs (JSON form) where the snapshot's source watches them; None: list them
    cron_jobs: tuple[Mapping[str, Any], ...] | None = None
    stale: str | None = None  # why the view may be out of date (a watch down): no scale-down

    @property
    def real_pending(self) -> tuple[Job, ...]:
        return tuple(j for j in self.pending if not j.placeholder)


def observed_cluster(
    nodes: Sequence[tuple[NodeFacts, str]],
    pods: Sequence[PodRequest],
    names: KubeNames = KUBE_NAMES,
    budgets: SystemBudgets = NO_BUDGETS,
) -> ObservedCluster:
    """The snapshot of `nodes` (each with its provider's name), `pods` and kube-system's
    `budgets` (see the module docstring). Nodes are in name order and pending jobs in id
    order, as the API server lists them, whatever order they are given in (a watched
    cache's snapshot is the same as a fresh list's)."""
    facts = {f.name: (f, cloud) for f, cloud in sorted(nodes, key=lambda fc: fc[0].name)}
    live = sorted((p for p in pods if not p.finished), key=lambda p: p.id)
    overhead: dict[str, tuple[int, int]] = {}
    for pod in live:
        if pod.node in facts and pod.goes_with_node:
            cpu, mem = overhead.get(pod.node, (0, 0))
            overhead[pod.node] = (cpu + pod.cpu_milli, mem + pod.memory_mib)
    specs = {name: offered(node, overhead.get(name, (0, 0))) for name, (node, _) in facts.items()}
    taints = frozenset(t for s in specs.values() for t in s.taints)
    node_taints = taints_of(node for node, _ in facts.values())

    on_node: dict[str, list[tuple[PodRequest, Job]]] = {}
    pending: list[Job] = []
    for pod in live:
        if pod.goes_with_node:
            continue
        job = job_of(pod, names, node_taints)
        if pod.node is None:
            pending.append(job)
        elif pod.node in facts:  # else bound to a node that has not registered (or has gone)
            on_node.setdefault(pod.node, []).append((pod, job))
    by_id = {p.id: p for p in live if p.node is None and not p.goes_with_node}
    pending_pods = {j.id: by_id[j.id] for j in pending}

    observed = {
        name: observed_node(node, cloud, [p for p, _ in on_node.get(name, ())], names)
        for name, (node, cloud) in facts.items()
    }
    state = None
    unbound: dict[str, str] = {}
    bound_pods: dict[str, PodRequest] = {}
    if specs:
        state = ClusterState.from_nodes(list(specs.values()))
        state.set_draining(i for i, n in enumerate(state.names) if observed[n].draining)
        for n, name in enumerate(state.names):
            pairs = on_node.get(name, [])
            unbound.update(bind_on_node(state, n, pairs))
            bound_pods.update((j.id, p) for p, j in pairs if j.id in state.jobs)
    moves = {name: tuple(read_moves(node.annotations, names)) for name, (node, _) in facts.items()}
    return ObservedCluster(
        state=state,
        nodes=observed,
        specs=specs,
        pending=tuple(pending),
        pending_pools={j.id: pending_pods[j.id].wanted_pool for j in pending},
        pending_gpus=pending_gpus(pending_pods.values()),
        unbound=unbound,
        taints=taints,
        bound_pods=bound_pods,
        moves={name: found for name, found in moves.items() if found},
        budgets=budgets,
    )


def offered(node: NodeFacts, overhead: tuple[int, int]) -> NodeSpec:
    """What `node` offers beside its DaemonSet and mirror pods' (cpu, memory)."""
    spec = spec_of(node)
    cpu, mem = overhead
    return replace(
        spec, cpu_milli=max(spec.cpu_milli - cpu, 0), memory_mib=max(spec.memory_mib - mem, 0)
    )


def pending_gpus(pods: Iterable[PodRequest]) -> dict[str | None, float]:
    """The GPUs the real pending pods wait for, per pool wanted."""
    out: dict[str | None, float] = {}
    for pod in pods:
        if not pod.placeholder:
            out[pod.wanted_pool] = out.get(pod.wanted_pool, 0.0) + pod.gpu_demand
    return out


def observed_node(
    node: NodeFacts, cloud: str, bound: Iterable[PodRequest], names: KubeNames
) -> ObservedNode:
    """`node` with the pods bound to it (DaemonSet and mirror pods aside)."""
    real = sorted((p for p in bound if not p.placeholder), key=lambda p: p.id)
    holding = [p for p in real if p.gpus or p.mig]
    return ObservedNode(
        name=node.name,
        cloud_name=cloud,
        pool=node.pool,
        cordoned=node.unschedulable,
        draining=names.removal_annotation in node.annotations,
        gpu_pods=len(holding),
        gpus_used=sum((p.gpu_demand for p in holding), 0.0),
        evicted=tuple(real),
    )


def taints_of(nodes: Iterable[NodeFacts]) -> list[Taint]:
    """Every node's taints, so each job's tolerations are matched against them."""
    seen: dict[str, Taint] = {}
    for node in nodes:
        for taint in node.taints:
            seen[taint.text] = taint
    return [seen[text] for text in sorted(seen)]


def bind_on_node(
    state: ClusterState, n: int, bound: Sequence[tuple[PodRequest, Job]]
) -> dict[str, str]:
    """Bind the jobs of the pods bound to node `n` into `state`: those whose recorded GPU
    indices are readable first, then best fit, each group in id order (so a node's binding
    depends on its own pods only, however they were listed); a job that does not fit (more
    than the node offers, a stale index) is left out, why."""
    unbound: dict[str, str] = {}

    def recorded(pod: PodRequest, job: Job) -> bool:
        held = job.mig_count if job.mig_profile is not None else job.num_gpu  # MIG: instances
        return pod.gpu_indices is not None and len(pod.gpu_indices) == held

    ordered = sorted(bound, key=lambda pj: (not recorded(*pj), pj[1].id))
    for pod, job in ordered:
        if job.id in state.jobs:
            continue
        gpus = pod.gpu_indices if recorded(pod, job) else None
        try:
            state.bind(job, n, gpus if gpus is not None else best_fit_gpus(state, job, n))
        except ValueError as exc:
            if gpus is None:
                unbound[job.id] = str(exc)
                continue
            try:  # the recorded GPUs are taken: the pod holds some GPUs there all the same
                state.bind(job, n, best_fit_gpus(state, job, n))
            except ValueError as again:
                unbound[job.id] = str(again)
    return unbound


# How a caller gets the snapshot: `observe_cluster`, or a listing shared within a process.
ObserveCluster = Callable[[k8s.ApiClient, KubeNames], ObservedCluster]


def observe_cluster(api: k8s.ApiClient, names: KubeNames = KUBE_NAMES) -> ObservedCluster:
    """List nodes and pods once (pods that have finished left out by the API server), and
    kube-system's budgets where a pod runs there, and return the snapshot. Raises
    KubeError when the API server cannot answer."""
    core = k8s.CoreV1Api(api)
    what = "read nodes and pods"
    raw_nodes = kube_call(what, core.list_node).items or []
    raw_pods = (
        kube_call(what, lambda: core.list_pod_for_all_namespaces(field_selector=UNFINISHED)).items
        or []
    )
    as_json = api.sanitize_for_serialization
    facts = [read_node(as_json(n), names) for n in raw_nodes]
    nodes = [(f, f.cloud_name) for f in facts]
    pods = [read_pod(as_json(p), names) for p in raw_pods]
    return observed_cluster(nodes, pods, names, system_budgets(api, pods))
