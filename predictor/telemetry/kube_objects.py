"""Kubernetes objects as gpuscale reads them: one set of names, one reading of a pod and a node.

Where Kubernetes carries what gpuscale needs (the GPU resource, the GPU model label, the
GPU-share and GPU-index annotations, the pool label, the placeholder labels, the
annotation gpuscale marks a node it is removing with) is said once, in `KubeNames`; the
names Kubernetes and Cluster Autoscaler fix (mirror pods, safe-to-evict) once, here. What
a pod asks (whole GPUs and the share of each, CPU, memory, priority, the pool it wants,
whether it is one of gpuscale's placeholders, whether it goes with its node, whether it
has finished, whether it may be evicted, which controller recreates it) is read once, by
`read_pod`; a node's capacity and scheduling attributes by `read_node`. Telemetry counts
demand from these readings and the scaler turns them into the placement engine's jobs and
nodes (scaler.kube.objects), so the demand series, the live loop, the service and the
extender agree on every pod.

Both readings take an object in its JSON form: what the API server sends (and the
scheduler extender receives), what `ApiClient.sanitize_for_serialization` makes of the
client's models, or a pydantic model of that JSON (dumped by alias).

A pod's GPU demand (`PodRequest.gpu_demand`) is counted by one rule wherever demand is
counted (telemetry's pools, Kueue's queue, the live loop's pending and used GPUs, the
scaler's cluster model): whole GPUs, a shared GPU as its share, a MIG instance as the
share of a GPU's compute slices its profile holds (`mig_gpus`).

MIG and topology, read where they are and interpreted by the scaler (scaler.kube.objects):
a pod's `nvidia.com/mig-<profile>` requests (the GPU operator's "mixed" strategy) and
Kueue's podset topology annotations; a node's MIG instance counts (its allocatable
`nvidia.com/mig-<profile>`), gpuscale's MIG layout annotation, its physical GPU count and
memory (GPU feature discovery's labels), its GPUs' NVLink domains (a label or annotation,
else the configured domains of its GPU model) and its rack label.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from kubernetes.utils import parse_quantity

WHOLE_GPU_MILLI = 1000  # a GPU's share in thousandths (scaler.cluster.job's unit)
MIRROR_ANNOTATION = "kubernetes.io/config.mirror"  # static pods the kubelet runs
# Cluster Autoscaler's: "false" on a pod: never evict it; "true": evict it freely.
SAFE_TO_EVICT_ANNOTATION = "cluster-autoscaler.kubernetes.io/safe-to-evict"
# Cluster Autoscaler's: on a pod, the local volumes (comma-separated names) it may lose.
SAFE_TO_EVICT_LOCAL_VOLUMES_ANNOTATION = (
    "cluster-autoscaler.kubernetes.io/safe-to-evict-local-volumes"
)
FINISHED_PHASES = ("Succeeded", "Failed")
MIB = 2**20
MIG_COMPUTE_SLICES = 7  # of an A100, H100, H200 or B200: a `3g` profile holds 3 of them
# How a MIG profile's name starts for each count of compute slices it holds ("3g." for
# 3g.40gb): the one rule `mig_gpus` and the Prometheus demand queries both count by.
MIG_PROFILE_STARTS: tuple[tuple[int, str], ...] = tuple(
    (slices, f"{slices}g.") for slices in range(1, MIG_COMPUTE_SLICES + 1)
)
# Kueue's topology-aware scheduling: the node label whose value a pod set must share.
REQUIRED_TOPOLOGY_ANNOTATION = "kueue.x-k8s.io/podset-required-topology"
PREFERRED_TOPOLOGY_ANNOTATION = "kueue.x-k8s.io/podset-preferred-topology"


@dataclass(frozen=True)
class KubeNames:
    """Where Kubernetes objects carry what gpuscale needs; the defaults are the usual ones
    (NVIDIA's device plugin and GPU feature discovery, gpuscale's own annotations)."""

    gpu_resource: str = "nvidia.com/gpu"
    gpu_model_label: str = "nvidia.com/gpu.product"
    gpu_milli_annotation: str = "gpuscale.io/gpu-milli"  # pod: share of its one GPU, 1..1000
    gpus_annotation: str = "gpuscale.io/gpus"  # pod: the GPU indices its bind chose
    pool_label: str = "gpuscale.io/pool"  # node: its pool; pod selector: the pool it wants
    # node: gpuscale cordoned it to remove it (the value: when the removal started)
    removal_annotation: str = "gpuscale.io/removal-started"
    spec_hash_label: str = "gpuscale.io/spec-hash"  # placeholder pod: the hash of its spec
    # pod: "true" lets defragmentation evict it to move it (a priority class may, too)
    movable_label: str = "gpuscale.io/movable"
    # node: the moves defragmentation planned onto it, for the extender to steer them
    moves_annotation: str = "gpuscale.io/planned-moves"
    placeholder_labels: tuple[tuple[str, str], ...] = (
        ("app.kubernetes.io/managed-by", "gpuscale"),
        ("app.kubernetes.io/component", "placeholder"),
    )
    mig_resource_prefix: str = "nvidia.com/mig-"  # + profile: a MIG instance resource
    # node: its MIG instances by GPU and slice, e.g. 0=3g.40gb@4,2g.20gb@0;1=7g.80gb
    mig_layout_annotation: str = "gpuscale.io/mig-layout"
    gpu_count_label: str = "nvidia.com/gpu.count"  # node: physical GPUs, MIG ones included
    gpu_memory_label: str = "nvidia.com/gpu.memory"  # node: MiB per GPU
    # node label (or annotation): NVLink domains of its GPUs, e.g. 0-3_4-7 (nvswitch: one)
    gpu_domains_label: str = "gpuscale.io/gpu-domains"
    # GPU model -> its domains, for nodes whose label says none (e.g. an NVSwitch model)
    model_gpu_domains: tuple[tuple[str, str], ...] = ()
    rack_label: str = "cloud.provider.com/topology-rack"  # node: its rack (Kueue's example)

    def is_placeholder(self, labels: Mapping[str, str]) -> bool:
        """gpuscale's placeholder pods hold capacity ahead of demand; counted as demand,
        they would make the scaler chase its own headroom."""
        return all(labels.get(k) == v for k, v in self.placeholder_labels)

    @property
    def placeholder_selector(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.placeholder_labels)


KUBE_NAMES = KubeNames()


def mig_gpus(instances: Iterable[tuple[str, int]]) -> float:
    """GPU equivalents of MIG instances, (profile, count) pairs: a `Ng.XXgb` instance is
    N / 7 of a GPU. The measure is compute slices, not memory, because compute is what
    fills a GPU: an A100/H100/H200 has 7 compute slices and 8 memory slices, and seven 1g
    instances (7 x 1/7) take the whole GPU while they hold 7/8 of its memory; counted by
    memory, a full GPU would read 0.875. Where compute slices go unused (two 3g take every
    memory slice: 6/7) the count is a little under the GPUs taken. A profile not of the
    form `Ng.` counts zero; the A30 and RTX PRO 6000 (4 compute slices) are counted by 7
    too, so under-counted."""
    total = 0.0
    for profile, count in instances:
        for slices, start in MIG_PROFILE_STARTS:
            if profile.startswith(start):
                total += count * slices / MIG_COMPUTE_SLICES
    return total


@dataclass(frozen=True, slots=True)
class Taint:
    key: str
    value: str | None
    effect: str

    @property
    def text(self) -> str:
        """`key=value:Effect`, as the placement engine names taints."""
        return f"{self.key}={self.value or ''}:{self.effect}"

    @classmethod
    def from_text(cls, text: str) -> Taint:
        rest, _, effect = text.rpartition(":")
        key, _, value = rest.partition("=")
        return cls(key=key, value=value or None, effect=effect)


@dataclass(frozen=True, slots=True)
class Toleration:
    key: str | None = None
    operator: str | None = None  # Equal (the default) or Exists
    value: str | None = None
    effect: str | None = None

    def tolerates(self, taint: Any) -> bool:
        """Kubernetes' rule: an empty key with Exists tolerates every taint; an empty
        effect matches every effect; Exists ignores the value. `taint` is anything with
        key, value and effect."""
        if self.effect and self.effect != taint.effect:
            return False
        if not self.key:
            return self.operator == "Exists"
        if self.key != taint.key:
            return False
        if self.operator == "Exists":
            return True
        return (self.value or "") == (taint.value or "")


@dataclass(frozen=True, slots=True)
class PodRequest:
    """What one pod asks of the cluster, and what kind of pod it is."""

    namespace: str
    name: str
    phase: str
    labels: tuple[tuple[str, str], ...]
    node: str | None  # the node it is bound to
    gpus: int  # devices of the GPU resource
    gpu_milli: int  # share of each GPU in thousandths (1000: whole; 0: no GPU)
    cpu_milli: int
    memory_mib: int
    priority: int
    node_selector: tuple[tuple[str, str], ...]  # node labels it requires
    wanted_pool: str | None  # the pool it asks for, None: any (see `wanted_pool`)
    tolerations: tuple[Toleration, ...]
    placeholder: bool
    goes_with_node: bool  # a DaemonSet or mirror pod: never evicted, ends with its node
    safe_to_evict: bool  # False: annotated safe-to-evict "false", so no drain may evict it
    deleting: bool  # its deletion has begun (a deletionTimestamp)
    gpu_indices: tuple[int, ...] | None  # from the GPU index annotation, if readable
    share_problem: str | None = None  # a GPU-share annotation that is no share (read whole)
    mig: tuple[tuple[str, int], ...] = ()  # (MIG profile, instances) it asks
    # (node label, required) of Kueue's podset topology annotations, if any
    topology: tuple[str, bool] | None = None
    priority_class: str | None = None  # spec.priorityClassName
    # The owner that recreates it when it is evicted (the ownerReference marked controller):
    # its uid, and kind/name for people. None: nothing brings it back.
    controller_uid: str | None = None
    controller: str | None = None
    # Annotated safe-to-evict "true": a drain may evict it even with no controller (its
    # owner said losing it is fine, as Cluster Autoscaler reads the annotation).
    evict_anyway: bool = False
    # Its volumes that keep data on the node (a hostPath, an emptyDir not in memory), lost
    # when it is evicted, but those its safe-to-evict-local-volumes annotation names.
    local_storage: tuple[str, ...] = ()

    @property
    def id(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def finished(self) -> bool:
        return self.phase in FINISHED_PHASES

    @property
    def gpu_demand(self) -> float:
        """GPUs it takes: a shared GPU counted as its share, MIG instances in GPU
        equivalents (`mig_gpus`)."""
        return self.gpus * self.gpu_milli / WHOLE_GPU_MILLI + mig_gpus(self.mig)


@dataclass(frozen=True, slots=True)
class NodeFacts:
    """What one node offers, and its scheduling state."""

    name: str
    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    cpu_milli: int
    memory_mib: int
    gpus: int
    gpu_model: str
    pool: str | None
    taints: tuple[Taint, ...]
    unschedulable: bool  # cordoned
    ready: bool
    provider_id: str | None
    mig: tuple[tuple[str, int], ...] = ()  # (MIG profile, instances) it offers
    mig_layout: str | None = None  # the MIG layout annotation
    physical_gpus: int | None = None  # GPUs in all, MIG ones included (a GFD label)
    gpu_memory_mib: int | None = None
    gpu_domains: str | None = None  # NVLink domains of its GPUs, as written
    rack: str | None = None
    created: str | None = None  # metadata.creationTimestamp, as written

    @property
    def cloud_name(self) -> str:
        """The provider's name of the node: the last part of its providerID
        (`aws:///us-east-1a/i-0abc` -> `i-0abc`), or its name where there is none."""
        if self.provider_id:
            return self.provider_id.rstrip("/").rsplit("/", 1)[-1]
        return self.name


def as_json(obj: Any) -> Mapping[str, Any]:
    """The JSON form of a Kubernetes object given as JSON or as a pydantic model of it."""
    if isinstance(obj, Mapping):
        return obj
    dump = getattr(obj, "model_dump", None)
    if callable(dump):
        return dump(mode="json", by_alias=True)
    raise TypeError(f"not a Kubernetes object in JSON form: {type(obj).__name__}")


def _map(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _amount(container: Mapping[str, Any], resource: str) -> Decimal:
    resources = _map(container.get("resources"))
    # Only a limit given means a request of the limit (extended resources are often
    # given as a limit only).
    for table in (resources.get("requests"), resources.get("limits")):
        table = _map(table)
        if table.get(resource) is not None:
            return Decimal(parse_quantity(table[resource]))
    return Decimal(0)


def pod_requests(spec: Mapping[str, Any], resource: str) -> Decimal:
    """A pod's request of one resource: its containers together, or its largest init
    container if more (init containers run one at a time, before the others)."""
    main = sum((_amount(c, resource) for c in _list(spec.get("containers"))), Decimal(0))
    init = max((_amount(c, resource) for c in _list(spec.get("initContainers"))), default=0)
    return max(main, Decimal(init))


def _pools_named(expressions: Iterable[Any], pool_label: str) -> list[str]:
    for expr in expressions:
        expr = _map(expr)
        if expr.get("key") == pool_label and expr.get("operator") == "In" and expr.get("values"):
            return [str(v) for v in expr["values"]]
    return []


def requirement_holds(requirement: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """Whether node `labels` meet one NodeSelectorRequirement (a node affinity term's
    `matchExpressions` entry), as the scheduler reads it: Gt and Lt compare integers, and a
    value that is not one, or an operator it does not know, matches nothing."""
    key = requirement.get("key")
    operator = requirement.get("operator")
    values = [str(v) for v in _list(requirement.get("values"))]
    if operator == "In":
        return key in labels and labels[key] in values
    if operator == "NotIn":
        return key not in labels or labels[key] not in values
    if operator == "Exists":
        return key in labels
    if operator == "DoesNotExist":
        return key not in labels
    if operator in ("Gt", "Lt") and key in labels and len(values) == 1:
        try:
            have, bound = int(labels[key]), int(values[0])
        except ValueError:
            return False
        return have > bound if operator == "Gt" else have < bound
    return False


def required_terms(spec: Mapping[str, Any]) -> list[list[Mapping[str, Any]]] | None:
    """The `matchExpressions` of each required node-affinity term of a pod spec, or None
    without required node affinity."""
    affinity = _map(_map(spec.get("affinity")).get("nodeAffinity"))
    required = affinity.get("requiredDuringSchedulingIgnoredDuringExecution")
    if not isinstance(required, Mapping):
        return None
    terms = _list(required.get("nodeSelectorTerms"))
    return [[_map(e) for e in _list(_map(t).get("matchExpressions"))] for t in terms]


def _required_pools(spec: Mapping[str, Any], pool_label: str) -> list[list[str]] | None:
    """The pools each required node-affinity term allows ([] for a term that names none),
    or None without required node affinity."""
    terms = required_terms(spec)
    return None if terms is None else [_pools_named(t, pool_label) for t in terms]


def wanted_pool(spec: Mapping[str, Any], pool_label: str) -> str | None:
    """The pool a pod asks for: its nodeSelector, then required node affinity (`In` on the
    pool label, the first value of the first term, when every term names a pool: a term
    without one lets the pod go anywhere), then the heaviest preferred term. One pool per
    pod, so demand per pool adds up to the cluster's."""
    selector = _map(spec.get("nodeSelector"))
    if selector.get(pool_label):
        return str(selector[pool_label])
    required = _required_pools(spec, pool_label)
    if required:
        return required[0][0] if all(required) else None
    affinity = _map(_map(spec.get("affinity")).get("nodeAffinity"))
    preferred = sorted(
        (_map(t) for t in _list(affinity.get("preferredDuringSchedulingIgnoredDuringExecution"))),
        key=lambda term: -(term.get("weight") or 0),
    )
    for term in preferred:
        expressions = _list(_map(term.get("preference")).get("matchExpressions"))
        pools = _pools_named(expressions, pool_label)
        if pools:
            return pools[0]
    return None


def _node_selector(spec: Mapping[str, Any], pool_label: str) -> dict[str, str]:
    """The node labels a pod requires: its nodeSelector, plus the pool when its required
    node affinity allows exactly one (the same constraint, written the other way)."""
    selector = {str(k): str(v) for k, v in _map(spec.get("nodeSelector")).items()}
    required = _required_pools(spec, pool_label)
    if pool_label not in selector and required and all(required):
        pools = {p for term in required for p in term}
        if len(pools) == 1:
            selector[pool_label] = pools.pop()
    return selector


def _share(gpus: int, annotations: Mapping[str, Any], names: KubeNames) -> tuple[int, str | None]:
    """The share of each GPU, and why the annotation was not used when it was given but is
    no share. The annotation applies to a pod of one GPU only."""
    if gpus == 0:
        return 0, None
    asked = annotations.get(names.gpu_milli_annotation)
    if gpus != 1 or asked is None:
        return WHOLE_GPU_MILLI, None
    try:
        share = int(str(asked))
    except ValueError:
        share = -1
    if 0 < share <= WHOLE_GPU_MILLI:
        return share, None
    return WHOLE_GPU_MILLI, (
        f"annotation {names.gpu_milli_annotation} must be 1..{WHOLE_GPU_MILLI}, got {asked!r}"
    )


def _mig_requests(spec: Mapping[str, Any], prefix: str) -> tuple[tuple[str, int], ...]:
    """(profile, instances) of every MIG resource a pod asks, by profile."""
    resources = {
        str(name)
        for c in (*_list(spec.get("containers")), *_list(spec.get("initContainers")))
        for part in ("requests", "limits")
        for name in _map(_map(_map(c).get("resources")).get(part))
        if str(name).startswith(prefix)
    }
    asked = ((r.removeprefix(prefix), int(pod_requests(spec, r))) for r in sorted(resources))
    return tuple((profile, count) for profile, count in asked if count > 0)


def _topology(annotations: Mapping[str, Any]) -> tuple[str, bool] | None:
    for key, required in (
        (REQUIRED_TOPOLOGY_ANNOTATION, True),
        (PREFERRED_TOPOLOGY_ANNOTATION, False),
    ):
        if annotations.get(key):
            return str(annotations[key]), required
    return None


def _int_label(labels: Mapping[str, str], key: str) -> int | None:
    value = labels.get(key, "")
    return int(value) if value.isdigit() else None


def _indices(text: Any) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        return tuple(int(part) for part in str(text).split(","))
    except ValueError:
        return None


def read_pod(pod: Any, names: KubeNames = KUBE_NAMES) -> PodRequest:
    """What `pod` (JSON form, see the module docstring) asks, and what kind of pod it is."""
    obj = as_json(pod)
    meta = _map(obj.get("metadata"))
    spec = _map(obj.get("spec"))
    status = _map(obj.get("status"))
    labels = _map(meta.get("labels"))
    annotations = _map(meta.get("annotations"))
    owners = _list(meta.get("ownerReferences"))
    gpus = int(pod_requests(spec, names.gpu_resource))
    share, problem = _share(gpus, annotations, names)
    controller_uid, controller = _controller(owners)
    return PodRequest(
        namespace=str(meta.get("namespace") or "default"),
        name=str(meta.get("name") or ""),
        phase=str(status.get("phase") or "Pending"),
        labels=tuple(sorted((str(k), str(v)) for k, v in labels.items())),
        node=spec.get("nodeName") or None,
        gpus=gpus,
        gpu_milli=share,
        cpu_milli=int(pod_requests(spec, "cpu") * 1000),
        memory_mib=int(pod_requests(spec, "memory") / MIB),
        priority=int(spec.get("priority") or 0),
        node_selector=tuple(sorted(_node_selector(spec, names.pool_label).items())),
        wanted_pool=wanted_pool(spec, names.pool_label),
        tolerations=tuple(
            Toleration(t.get("key"), t.get("operator"), t.get("value"), t.get("effect"))
            for t in map(_map, _list(spec.get("tolerations")))
        ),
        placeholder=names.is_placeholder(labels),
        goes_with_node=MIRROR_ANNOTATION in annotations
        or any(_map(o).get("kind") == "DaemonSet" for o in owners),
        safe_to_evict=annotations.get(SAFE_TO_EVICT_ANNOTATION) != "false",
        deleting=meta.get("deletionTimestamp") is not None,
        gpu_indices=_indices(annotations.get(names.gpus_annotation)),
        share_problem=problem,
        mig=_mig_requests(spec, names.mig_resource_prefix),
        topology=_topology(annotations),
        priority_class=spec.get("priorityClassName") or None,
        controller_uid=controller_uid,
        controller=controller,
        evict_anyway=annotations.get(SAFE_TO_EVICT_ANNOTATION) == "true",
        local_storage=_local_storage(spec, annotations),
    )


def _local_storage(spec: Mapping[str, Any], annotations: Mapping[str, Any]) -> tuple[str, ...]:
    """The names of the pod's volumes on the node's own storage that its annotation does
    not let go, as Cluster Autoscaler reads them (names split at commas, as written)."""
    let_go = set(str(annotations.get(SAFE_TO_EVICT_LOCAL_VOLUMES_ANNOTATION) or "").split(","))
    kept = []
    for volume in map(_map, _list(spec.get("volumes"))):
        name = str(volume.get("name") or "")
        empty_dir = volume.get("emptyDir")
        on_node = volume.get("hostPath") is not None or (
            empty_dir is not None and _map(empty_dir).get("medium") != "Memory"
        )
        if on_node and name not in let_go:
            kept.append(name)
    return tuple(kept)


def _controller(owners: list[Any]) -> tuple[str | None, str | None]:
    """(uid, kind/name) of the ownerReference marked controller, or (None, None)."""
    for owner in map(_map, owners):
        if owner.get("controller") and owner.get("uid"):
            return str(owner["uid"]), f"{owner.get('kind', '')}/{owner.get('name', '')}"
    return None, None


def read_node(node: Any, names: KubeNames = KUBE_NAMES) -> NodeFacts:
    """What `node` (JSON form) offers: its allocatable resources (its capacity where it
    reports none), labels, taints and whether it is ready and schedulable."""
    obj = as_json(node)
    meta = _map(obj.get("metadata"))
    spec = _map(obj.get("spec"))
    status = _map(obj.get("status"))
    offered = _map(status.get("allocatable")) or _map(status.get("capacity"))
    labels = {str(k): str(v) for k, v in _map(meta.get("labels")).items()}

    def amount(resource: str) -> Decimal:
        value = offered.get(resource)
        return Decimal(parse_quantity(value)) if value is not None else Decimal(0)

    annotations = {str(k): str(v) for k, v in _map(meta.get("annotations")).items()}
    conditions = map(_map, _list(status.get("conditions")))
    return NodeFacts(
        name=str(meta.get("name") or ""),
        labels=labels,
        annotations=annotations,
        cpu_milli=int(amount("cpu") * 1000),
        memory_mib=int(amount("memory") / MIB),
        gpus=int(amount(names.gpu_resource)),
        gpu_model=labels.get(names.gpu_model_label, ""),
        pool=labels.get(names.pool_label),
        taints=tuple(
            Taint(str(t.get("key") or ""), t.get("value"), str(t.get("effect") or ""))
            for t in map(_map, _list(spec.get("taints")))
        ),
        unschedulable=bool(spec.get("unschedulable")),
        ready=any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions),
        provider_id=spec.get("providerID") or None,
        mig=tuple(
            (str(r).removeprefix(names.mig_resource_prefix), int(amount(str(r))))
            for r in sorted(offered)
            if str(r).startswith(names.mig_resource_prefix) and amount(str(r)) > 0
        ),
        mig_layout=annotations.get(names.mig_layout_annotation) or None,
        physical_gpus=_int_label(labels, names.gpu_count_label),
        gpu_memory_mib=_int_label(labels, names.gpu_memory_label),
        gpu_domains=labels.get(names.gpu_domains_label)
        or annotations.get(names.gpu_domains_label)
        or dict(names.model_gpu_domains).get(labels.get(names.gpu_model_label, ""))
        or None,
        rack=labels.get(names.rack_label) or None,
        created=meta.get("creationTimestamp") or None,
    )
