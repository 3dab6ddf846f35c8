"""Kubernetes objects as the placement engine sees them: a pod is a `Job`, a node a `NodeSpec`.

The one translation, used by the service, the scheduler extender and the reconcile loop,
over the one reading of pods and nodes (`predictor.telemetry.kube_objects`): a pod's whole
GPUs and the share of each (the GPU-share annotation), CPU, memory and priority; the GPU
model it selects becomes the job's GPU models, the other labels it selects (the pool
included) its node selector; the taints it tolerates, matched against the taints of the
nodes it may go to. A node's allocatable resources, model, labels, scheduling taints and
cordon make its spec.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

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
from scaler.cluster.snapshot import NodeSpec

__all__ = [
    "KUBE_NAMES",
    "SCHEDULING_EFFECTS",
    "KubeNames",
    "Taint",
    "Toleration",
    "gpus_of",
    "job_of",
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
    return NodeSpec(
        name=node.name,
        cpu_milli=node.cpu_milli,
        memory_mib=node.memory_mib,
        gpus=node.gpus,
        model=node.gpu_model,
        labels=tuple(sorted(node.labels.items())),
        taints=frozenset(t.text for t in node.taints if t.effect in SCHEDULING_EFFECTS),
        cordoned=node.unschedulable,
    )


def node_spec(node: Any, names: KubeNames = KUBE_NAMES) -> NodeSpec:
    """The spec of a node given in its JSON form (or a pydantic model of it)."""
    return spec_of(read_node(node, names))


def job_of(pod: PodRequest, names: KubeNames, taints: Iterable[Any] = ()) -> Job:
    """The job a pod's request is. `taints` are the candidate nodes' taints, so the job's
    tolerations can be matched against them exactly. A GPU-share annotation that is no
    share reads as the whole GPU (what the device plugin gives such a pod)."""
    selector = dict(pod.node_selector)
    model = selector.pop(names.gpu_model_label, None)
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
    )


def pod_job(pod: Any, names: KubeNames = KUBE_NAMES, taints: Iterable[Any] = ()) -> Job:
    """The job a pod (JSON form, or a pydantic model of it) is; a GPU-share annotation
    that is no share is refused (ValueError), so whoever asked can be told."""
    request = read_pod(pod, names)
    if request.share_problem is not None:
        raise ValueError(request.share_problem)
    return job_of(request, names, taints)


def gpus_of(pod: Any, names: KubeNames = KUBE_NAMES) -> tuple[int, ...] | None:
    """The GPU indices a bound pod was given (recorded by our bind), if any."""
    return read_pod(pod, names).gpu_indices
