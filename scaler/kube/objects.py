"""Kubernetes objects as the placement engine sees them: a pod is a `Job`, a node a `NodeSpec`.

The one translation, used by the service, the scheduler extender and the reconcile loop,
over the one reading of pods and nodes (`predictor.telemetry.kube_objects`): a pod's whole
GPUs and the share of each (the GPU-share annotation), CPU, memory and priority; the GPU
model it selects becomes the job's GPU models, the other labels it selects (the pool
included) its node selector; the taints it tolerates, matched against the taints of the
nodes it may go to. A node's allocatable resources, model, labels, scheduling taints and
cordon make its spec.

MIG ("mixed" strategy): a pod asking `nvidia.com/mig-<profile>` is a MIG job of that
profile (its GPU-model selector stays a node selector: the profile names the GPU); a
node's MIG layout is its layout annotation, else its allocatable instance counts spread
over its MIG GPUs (scaler.cluster.mig), numbered after its whole GPUs. The "single"
strategy needs nothing here: each instance is a device of the GPU resource and the model
label names the profile. A node's NVLink domains and rack come from its labels, and a
pod's Kueue topology annotation becomes its job's topology.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from predictor.foundation.errors import InputError
from predictor.telemetry.kube_objects import (
    KUBE_NAMES,
    KubeNames,
    NodeFacts,
    PodRequest,
    Taint,
    Toleration,
    read_node,
    read_pod,
)
from scaler.cluster.job import Job
from scaler.cluster.mig import (
    MigLayout,
    family_of,
    layout_from_counts,
    layout_of,
    profile_problem,
)
from scaler.cluster.snapshot import NodeSpec
from scaler.cluster.topology import parse_gpu_domains

__all__ = [
    "KUBE_NAMES",
    "SCHEDULING_EFFECTS",
    "KubeNames",
    "Taint",
    "Toleration",
    "gpus_of",
    "job_of",
    "mig_layout",
    "node_spec",
    "parse_taint",
    "pod_job",
    "spec_of",
    "taint_text",
    "tolerates",
]

SCHEDULING_EFFECTS = ("NoSchedule", "NoExecute")  # PreferNoSchedule never rules a node out


def taint_text(taint: Any) -> str:
    """`key=value:Effect` of anything with key, value and effect."""
    return Taint(taint.key, taint.value, taint.effect).text


def parse_taint(text: str) -> Taint:
    """The inverse of `taint_text`."""
    return Taint.from_text(text)


def tolerates(toleration: Toleration, taint: Any) -> bool:
    return toleration.tolerates(taint)


def spec_of(node: NodeFacts) -> NodeSpec:
    """The spec of a node; ValueError names the node when its MIG layout or GPU domains
    cannot be read."""
    try:
        domains = parse_gpu_domains(node.gpu_domains, node.gpus) if node.gpu_domains else ()
    except ValueError as exc:
        raise ValueError(f"node {node.name}: {exc}") from None
    return NodeSpec(
        name=node.name,
        cpu_milli=node.cpu_milli,
        memory_mib=node.memory_mib,
        gpus=node.gpus,
        model=node.gpu_model,
        labels=tuple(sorted(node.labels.items())),
        taints=frozenset(t.text for t in node.taints if t.effect in SCHEDULING_EFFECTS),
        cordoned=node.unschedulable,
        mig=mig_layout(node),
        gpu_domains=domains if node.gpus else (),
        rack=node.rack,
    )


def mig_layout(node: NodeFacts) -> MigLayout | None:
    """The node's MIG instances: its layout annotation, else its instance counts (of the
    profiles a known family offers) spread over its MIG GPUs; None without either."""
    counts = {p: c for p, c in node.mig if profile_problem(p) is None}
    if node.mig_layout is None and not counts:
        return None
    try:
        if node.mig_layout is not None:
            return layout_of(node.mig_layout, node.gpu_model, node.gpu_memory_mib)
        family = family_of(counts, node.gpu_memory_mib, node.gpu_model)
        if family is None:
            raise ValueError(f"no MIG GPU family offers all of {', '.join(sorted(counts))}")
        physical = node.physical_gpus or 0
        mig_gpus = physical - node.gpus if physical > node.gpus else None
        return layout_from_counts(counts, family, mig_gpus, first_gpu=node.gpus)
    except ValueError as exc:
        raise ValueError(f"node {node.name}: MIG layout: {exc}") from None


def node_spec(node: Any, names: KubeNames = KUBE_NAMES) -> NodeSpec:
    """The spec of a node given in its JSON form (or a pydantic model of it)."""
    return spec_of(read_node(node, names))


def job_of(pod: PodRequest, names: KubeNames, taints: Iterable[Any] = ()) -> Job:
    """The job a pod's request is. `taints` are the candidate nodes' taints, so the job's
    tolerations can be matched against them exactly. A GPU-share annotation that is no
    share reads as the whole GPU (what the device plugin gives such a pod)."""
    selector = dict(pod.node_selector)
    mig = pod.mig[0] if pod.mig else None
    model = None if mig else selector.pop(names.gpu_model_label, None)
    tolerated = frozenset(
        taint_text(t)
        for t in taints
        if t.effect in SCHEDULING_EFFECTS and any(o.tolerates(t) for o in pod.tolerations)
    )
    return Job(
        id=pod.id,
        cpu_milli=pod.cpu_milli,
        memory_mib=pod.memory_mib,
        num_gpu=pod.gpus,
        gpu_milli=pod.gpu_milli,
        gpu_models=frozenset({model}) if model else frozenset(),
        priority=pod.priority,
        placeholder=pod.placeholder,
        node_selector=tuple(sorted(selector.items())),
        tolerations=tolerated,
        mig_profile=mig[0] if mig else None,
        mig_count=mig[1] if mig else 1,
        topology_key=pod.topology[0] if pod.topology else None,
        topology_required=bool(pod.topology and pod.topology[1]),
    )


def pod_job(pod: Any, names: KubeNames = KUBE_NAMES, taints: Iterable[Any] = ()) -> Job:
    """The job a pod (JSON form, or a pydantic model of it) is; a GPU-share annotation
    that is no share, or MIG instances of several profiles, are refused (InputError naming
    the annotation or the resources), so whoever asked can be told."""
    request = read_pod(pod, names)
    if request.share_problem is not None:
        raise InputError(request.share_problem, column=names.gpu_milli_annotation)
    if len(request.mig) > 1:
        asked = ", ".join(f"{names.mig_resource_prefix}{p}: {c}" for p, c in request.mig)
        raise InputError(
            f"the pod asks MIG instances of several profiles ({asked}): one only",
            column=f"{names.mig_resource_prefix}*",
        )
    return job_of(request, names, taints)


def gpus_of(pod: Any, names: KubeNames = KUBE_NAMES) -> tuple[int, ...] | None:
    """The GPU indices a bound pod was given (recorded by our bind), if any."""
    return read_pod(pod, names).gpu_indices
