"""Kueue's queue as demand: the pending Workloads (kueue.x-k8s.io, v1beta2 or v1beta1).

A job Kueue manages stays suspended, without pods, until Kueue admits its Workload, so the
queue is where its demand shows first. Each pod set of a pending Workload (`count` pods of
its `template`) is read as a pending pod is (`kube_objects.read_pod`): whole GPUs, GPU
shares (the share annotation on the template) and MIG instances count as they would on
the pod, and the pod set targets pools as the pod would:

- a pod set whose quota is reserved (`status.admission`: flavors assigned while admission
  checks, such as a ProvisioningRequest, still wait) targets the node labels of the
  ResourceFlavor its GPU resource was assigned (`spec.nodeLabels`, merged into its node
  selector) and tolerates that flavor's tolerations, as Kueue will make its pods; it counts
  the pods reserved (`podSetAssignments[].count`, fewer than `count` when partial
  admission took `minCount` or more), else `count`;
- a pod set still waiting for quota counts `count` (Kueue tries the whole count before
  a partial admission's smaller ones) and targets the flavor Kueue would try first: the
  Workload's LocalQueue (`spec.queueName`, in its namespace) names a ClusterQueue
  (`spec.clusterQueue`), whose resource groups list flavors in order
  (`spec.resourceGroups[].flavors[]`); the first of them with a nominal quota above zero of
  every GPU resource the pod set asks (the GPU resource, each MIG resource), that exists,
  whose `nodeLabels` name a pool (the pool label) and meet the template's node selector
  and required node affinity on the keys they set (`Flavor.admits`), and whose
  `nodeTaints` (NoSchedule, NoExecute) the template's or the flavor's tolerations
  tolerate is taken as above;
- otherwise (no GPU asked, no such queue or flavor) the pool its template's node selector
  or node affinity names, else any pool; why the queue did not say is the pod set's
  `queue_problem`, which the collector logs once (`predictor.foundation.problem_log`).

The queue's flavor is the one Kueue tries first, not necessarily the one it will reserve:
Kueue moves on to the next flavor when the first lacks free quota (or, with flavor
fungibility, before borrowing or preempting), which depends on the usage of every queue in
the cohort; a flavor that only borrows (nominal quota zero) is passed over.

Pending means neither Admitted nor Finished, and active (`spec.active` not false), in
queues that are not stopped: a LocalQueue or ClusterQueue whose `spec.stopPolicy` is Hold
or HoldAndDrain reserves no quota and cancels reservations not yet admitted, so its
Workloads wait until someone restarts it. Nor is a Workload pending whose admission is
gated: a non-empty `kueue.x-k8s.io/admission-gated-by` annotation (comma-separated
controller names, which Kueue copies from the job onto the Workload when its
AdmissionGatedBy feature is on, the default from v0.19) keeps it out of Kueue's queues
until the controllers have all removed their names, which may take any time or never
happen; why is its `admission_gate`, which the collector logs once. An admitted Workload
is left out: its pods exist, or are being made, and are counted as pods, so nothing is
counted twice. A Workload's pod sets are admitted together (all or nothing), and its podset
topology request is read as Kueue's podset topology annotations are.

Kueue serves its kinds at v1beta2 from 0.15 on (its storage version from 0.16) and
deprecates v1beta1, which later releases stop serving; Kueue before 0.15 serves v1beta1
only. Every field read here is the same in both, so the objects are read at the newest
version the API server serves (`served_version`). The four kinds are kept in the process's
watched cluster cache (`watched_queue`: listed once, then watched), which the loop, the
service and the collector in one process share.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client as k8s
from kubernetes.utils import parse_quantity

from predictor.telemetry.kube_objects import (
    KUBE_NAMES,
    PREFERRED_TOPOLOGY_ANNOTATION,
    REQUIRED_TOPOLOGY_ANNOTATION,
    KubeNames,
    PodRequest,
    Taint,
    Toleration,
    read_pod,
    required_terms,
    requirement_holds,
)
from predictor.telemetry.watch_cache import ClusterCache, Reflector

GROUP = "kueue.x-k8s.io"
VERSIONS = ("v1beta2", "v1beta1")  # newest first
WORKLOADS = "workloads"
FLAVORS = "resourceflavors"
LOCAL_QUEUES = "localqueues"
CLUSTER_QUEUES = "clusterqueues"
QUEUE_KINDS = (WORKLOADS, FLAVORS, LOCAL_QUEUES, CLUSTER_QUEUES)
ADMISSION_GATE_ANNOTATION = "kueue.x-k8s.io/admission-gated-by"


@dataclass(frozen=True, slots=True)
class Flavor:
    """Where a ResourceFlavor puts pods: the node labels it selects, the taints it tolerates,
    the taints its nodes carry (`nodeTaints`, NoSchedule or NoExecute)."""

    node_labels: Mapping[str, str]
    tolerations: tuple[Mapping[str, Any], ...] = ()
    node_taints: tuple[Taint, ...] = ()

    def admits(self, pod: PodRequest, spec: Mapping[str, Any]) -> bool:
        """Whether Kueue's flavor assigner lets a pod set (`pod`, read from its template's
        `spec`) onto this flavor: every node taint tolerated by the pod set or the flavor,
        and the template's nodeSelector and required node affinity met by the flavor's
        node labels. Only the keys the flavor labels count, since the rest are the
        scheduler's to match among the flavor's nodes; a required term left with no
        expression on them matches every flavor (its terms are ORed)."""
        tolerations = [
            *pod.tolerations,
            *(Toleration(t.get("key"), t.get("operator"), t.get("value"), t.get("effect"))
              for t in self.tolerations),
        ]  # fmt: skip
        if not all(any(t.tolerates(taint) for t in tolerations) for taint in self.node_taints):
            return False
        labels = self.node_labels
        selector = _map(spec.get("nodeSelector"))
        if any(str(selector[k]) != v for k, v in labels.items() if k in selector):
            return False
        terms = [[e for e in t if e.get("key") in labels] for t in required_terms(spec) or []]
        if not terms or not all(terms):
            return True
        return any(all(requirement_holds(e, labels) for e in term) for term in terms)


@dataclass(frozen=True, slots=True)
class Queues:
    """Where Kueue's objects say a Workload's pods may go: the ResourceFlavors by name,
    each LocalQueue's ClusterQueue (by `namespace/name`), and per ClusterQueue, per
    resource, the flavors that hold a nominal quota of it above zero, in the order its
    resource groups list them; the queues that are stopped (`spec.stopPolicy` Hold or
    HoldAndDrain), a LocalQueue by `namespace/name`, a ClusterQueue by its name (which
    has no `/`)."""

    flavors: Mapping[str, Flavor] = field(default_factory=dict)
    local_queues: Mapping[str, str] = field(default_factory=dict)
    cluster_queues: Mapping[str, Mapping[str, tuple[str, ...]]] = field(default_factory=dict)
    stopped: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class QueuedPodSet:
    """`count` pods of one pod set of a pending Workload, `pod` being each of them."""

    workload: str  # namespace/name
    name: str
    count: int
    pod: PodRequest
    # Waiting for quota and asking GPUs, but its queue named no pool: why (it then counts
    # in the pool its template selects).
    queue_problem: str | None = None

    @property
    def gpus(self) -> float:
        """GPUs the pod set waits for, counted as its pods' (`PodRequest.gpu_demand`)."""
        return self.count * self.pod.gpu_demand


def _map(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _name(obj: Mapping[str, Any]) -> str:
    return str(_map(obj.get("metadata")).get("name") or "")


def read_flavors(flavors: Iterable[Mapping[str, Any]]) -> dict[str, Flavor]:
    """ResourceFlavors (JSON form) by name."""
    out = {}
    for obj in flavors:
        spec = _map(obj.get("spec"))
        labels = {str(k): str(v) for k, v in _map(spec.get("nodeLabels")).items()}
        tolerations = tuple(_map(t) for t in _list(spec.get("tolerations")))
        taints = tuple(
            Taint(str(t.get("key") or ""), t.get("value"), str(t.get("effect") or ""))
            for t in map(_map, _list(spec.get("nodeTaints")))
            if t.get("effect") in ("NoSchedule", "NoExecute")
        )
        out[_name(obj)] = Flavor(labels, tolerations, taints)
    return out


def _has_quota(quota: Mapping[str, Any]) -> bool:
    try:
        return parse_quantity(quota.get("nominalQuota") or 0) > 0
    except ValueError:
        return False


def _flavors_by_resource(cluster_queue: Mapping[str, Any]) -> dict[str, tuple[str, ...]]:
    """Per resource, the flavors of a ClusterQueue (JSON form) with nominal quota of it, in
    the order its resource groups list them (a resource is in one group only)."""
    out: dict[str, list[str]] = {}
    for group in map(_map, _list(_map(cluster_queue.get("spec")).get("resourceGroups"))):
        for flavor in map(_map, _list(group.get("flavors"))):
            for quota in map(_map, _list(flavor.get("resources"))):
                if _has_quota(quota):
                    out.setdefault(str(quota.get("name")), []).append(str(flavor.get("name")))
    return {resource: tuple(names) for resource, names in out.items()}


def read_queues(
    flavors: Iterable[Mapping[str, Any]],
    local_queues: Iterable[Mapping[str, Any]] = (),
    cluster_queues: Iterable[Mapping[str, Any]] = (),
) -> Queues:
    """ResourceFlavors, LocalQueues and ClusterQueues (JSON form), read as `Queues`."""
    local = {}
    stopped = set()
    for obj in local_queues:
        namespace = str(_map(obj.get("metadata")).get("namespace") or "default")
        key = f"{namespace}/{_name(obj)}"
        target = _map(obj.get("spec")).get("clusterQueue")
        if target:
            local[key] = str(target)
        if _is_stopped(obj):
            stopped.add(key)
    cluster = list(cluster_queues)
    return Queues(
        flavors=read_flavors(flavors),
        local_queues=local,
        cluster_queues={_name(obj): _flavors_by_resource(obj) for obj in cluster},
        stopped=frozenset(stopped | {_name(obj) for obj in cluster if _is_stopped(obj)}),
    )


def _is_stopped(queue: Mapping[str, Any]) -> bool:
    return _map(queue.get("spec")).get("stopPolicy") not in (None, "None")


def _held(workload: Mapping[str, Any], namespace: str, queues: Queues) -> bool:
    """Its LocalQueue, or the ClusterQueue that holds or would hold its quota, is stopped:
    Kueue reserves no quota there and cancels a reservation not yet admitted."""
    local = f"{namespace}/{_map(workload.get('spec')).get('queueName') or ''}"
    reserved_on = _map(_map(workload.get("status")).get("admission")).get("clusterQueue")
    cluster = str(reserved_on or queues.local_queues.get(local) or "")
    return local in queues.stopped or cluster in queues.stopped


def is_pending(workload: Mapping[str, Any]) -> bool:
    """Neither admitted nor finished, and active."""
    if _map(workload.get("spec")).get("active") is False:
        return False
    conditions = _list(_map(workload.get("status")).get("conditions"))
    done = {_map(c).get("type") for c in conditions if _map(c).get("status") == "True"}
    return not done & {"Admitted", "Finished"}


def admission_gate(workload: Mapping[str, Any]) -> str | None:
    """Why a pending Workload (JSON form) is not demand because its admission is gated, or
    None when it is not gated."""
    meta = _map(workload.get("metadata"))
    gates = str(_map(meta.get("annotations")).get(ADMISSION_GATE_ANNOTATION) or "")
    if not gates or not is_pending(workload):
        return None
    namespace = str(meta.get("namespace") or "default")
    return (
        f"Kueue Workload {namespace}/{meta.get('name') or ''}: admission gated by {gates}"
        f" ({ADMISSION_GATE_ANNOTATION}); not counted as demand until the gate is removed"
    )


def _assigned_flavor(
    assignment: Mapping[str, Any], flavors: Mapping[str, Flavor], names: KubeNames
) -> Flavor | None:
    """The flavor a reserved pod set's GPUs got (its GPU resource's, else any of its
    resources' where it asks no GPU resource)."""
    by_resource = {str(k): str(v) for k, v in _map(assignment.get("flavors")).items()}
    chosen = by_resource.get(names.gpu_resource)
    if chosen is None:
        mig = sorted(r for r in by_resource if r.startswith(names.mig_resource_prefix))
        chosen = by_resource[mig[0]] if mig else next(iter(sorted(by_resource.values())), None)
    return flavors.get(chosen) if chosen is not None else None


def _queue_flavor(
    workload: Mapping[str, Any],
    pod: PodRequest,
    spec: Mapping[str, Any],
    queues: Queues,
    names: KubeNames,
) -> tuple[Flavor | None, str | None]:
    """The flavor a pod set waiting for quota targets through its Workload's queue (see the
    module docstring), or why there is none; (None, None) when it asks no GPU."""
    asked = [names.gpu_resource] if pod.gpus else []
    asked += [f"{names.mig_resource_prefix}{profile}" for profile, _ in pod.mig]
    if not asked:
        return None, None
    queue = str(_map(workload.get("spec")).get("queueName") or "")
    if not queue:
        return None, "names no LocalQueue (spec.queueName)"
    local = f"{pod.namespace}/{queue}"
    if local not in queues.local_queues:
        return None, f"LocalQueue {local} not found"
    cluster_queue = queues.local_queues[local]
    if cluster_queue not in queues.cluster_queues:
        return None, f"ClusterQueue {cluster_queue} (of LocalQueue {local}) not found"
    quotas = queues.cluster_queues[cluster_queue]
    for name in quotas.get(asked[0], ()):
        flavor = queues.flavors.get(name)
        if (
            flavor is not None
            and all(name in quotas.get(resource, ()) for resource in asked[1:])
            and names.pool_label in flavor.node_labels
            and flavor.admits(pod, spec)
        ):
            return flavor, None
    return None, (
        f"no flavor of ClusterQueue {cluster_queue} with quota of {', '.join(asked)} names a"
        f" pool ({names.pool_label}) its template allows"
    )


def _pod(
    namespace: str, name: str, template: Mapping[str, Any], pod_set: Mapping[str, Any]
) -> dict[str, Any]:
    """The pod a pod set's `template` makes (JSON form), Kueue's topology request as the
    podset topology annotations."""
    annotations = dict(_map(_map(template.get("metadata")).get("annotations")))
    topology = _map(pod_set.get("topologyRequest"))
    if topology.get("required"):
        annotations[REQUIRED_TOPOLOGY_ANNOTATION] = str(topology["required"])
    elif topology.get("preferred"):
        annotations[PREFERRED_TOPOLOGY_ANNOTATION] = str(topology["preferred"])
    return {
        "metadata": {
            "namespace": namespace,
            "name": name,
            "labels": dict(_map(_map(template.get("metadata")).get("labels"))),
            "annotations": annotations,
        },
        "spec": dict(_map(template.get("spec"))),
        "status": {"phase": "Pending"},
    }


def _on_flavor(pod: dict[str, Any], flavor: Flavor) -> dict[str, Any]:
    """`pod` as Kueue makes it for `flavor`: its node labels selected, its taints tolerated."""
    spec = dict(pod["spec"])
    spec["nodeSelector"] = {**_map(spec.get("nodeSelector")), **flavor.node_labels}
    spec["tolerations"] = [*_list(spec.get("tolerations")), *flavor.tolerations]
    return {**pod, "spec": spec}


def queued_pod_sets(
    workload: Mapping[str, Any],
    queues: Queues,
    names: KubeNames = KUBE_NAMES,
) -> tuple[QueuedPodSet, ...]:
    """The pod sets of `workload` (JSON form) still waiting, each as its pods would be
    read; none when it is not pending (see the module docstring)."""
    if not is_pending(workload):
        return ()
    meta = _map(workload.get("metadata"))
    namespace = str(meta.get("namespace") or "default")
    name = str(meta.get("name") or "")
    if _held(workload, namespace, queues) or admission_gate(workload) is not None:
        return ()
    admission = _map(_map(workload.get("status")).get("admission"))
    assigned = {
        str(_map(a).get("name") or "main"): _map(a)
        for a in _list(admission.get("podSetAssignments"))
    }
    out = []
    for pod_set in map(_map, _list(_map(workload.get("spec")).get("podSets"))):
        set_name = str(pod_set.get("name") or "main")
        count = int(pod_set.get("count", 1) or 0)
        if set_name in assigned and assigned[set_name].get("count") is not None:
            # Partial admission (minCount) reserves fewer pods than asked; the job is
            # scaled down to the reserved count before its pods are made.
            count = int(assigned[set_name]["count"])
        if count <= 0:
            continue
        pod = _pod(namespace, f"{name}-{set_name}", _map(pod_set.get("template")), pod_set)
        request = read_pod(pod, names)
        problem = None
        if set_name in assigned:
            flavor = _assigned_flavor(assigned[set_name], queues.flavors, names)
        else:
            flavor, why = _queue_flavor(workload, request, pod["spec"], queues, names)
            if why is not None:
                problem = (
                    f"Kueue Workload {namespace}/{name}: {why}; its pods count in the pool"
                    f" their template selects ({request.wanted_pool or 'any'})"
                )
        if flavor is not None:
            request = read_pod(_on_flavor(pod, flavor), names)
        out.append(QueuedPodSet(f"{namespace}/{name}", set_name, count, request, problem))
    return tuple(out)


def served_version(custom: k8s.CustomObjectsApi, timeout: Any = None) -> str:
    """The newest of `VERSIONS` the API server serves Kueue's kinds at, asked with a one-item
    list of ResourceFlavors (a version it does not serve answers 404); the oldest when it
    serves none of the newer ones (a cluster without Kueue then answers 404 there)."""
    for version in VERSIONS[:-1]:
        try:
            custom.list_cluster_custom_object(
                GROUP, version, FLAVORS, limit=1, _request_timeout=timeout
            )
        except k8s.ApiException as exc:
            if exc.status == 404:
                continue
            raise
        return version
    return VERSIONS[-1]


@dataclass
class KueueList:
    """The list call of one of Kueue's kinds (`WORKLOADS`, `FLAVORS`, `LOCAL_QUEUES`,
    `CLUSTER_QUEUES`), every namespace's objects of a namespaced kind, and with watch=True
    its watch (for an informer: list, then watch), at the version the API server serves:
    asked at the first call, and again after a 404, when Kueue was upgraded past it."""

    custom: k8s.CustomObjectsApi
    plural: str
    version: str | None = None

    def __call__(self, **kwargs: Any) -> Any:
        if self.version is None:
            self.version = served_version(self.custom, kwargs.get("_request_timeout"))
        try:
            return self.custom.list_cluster_custom_object(
                GROUP, self.version, self.plural, **kwargs
            )
        except k8s.ApiException as exc:
            if exc.status == 404:
                self.version = None
            raise


def list_call(api: k8s.ApiClient, plural: str) -> KueueList:
    """The list call of one of Kueue's kinds (`KueueList`)."""
    return KueueList(k8s.CustomObjectsApi(api), plural)


def watched_queue(cache: ClusterCache) -> dict[str, Reflector[dict[str, Any]]]:
    """Kueue's kinds (`QUEUE_KINDS`) in the process's watched cluster cache, listed once
    and watched from the first reader's ask on, each at the version Kueue serves."""
    return {
        plural: cache.watch_kind(plural, list_call(cache.api, plural)) for plural in QUEUE_KINDS
    }
