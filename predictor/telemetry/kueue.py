"""Kueue's queue as demand: the pending Workloads (kueue.x-k8s.io/v1beta1).

A job Kueue manages stays suspended, without pods, until Kueue admits its Workload, so the
queue is where its demand shows first. Each pod set of a pending Workload (`count` pods of
its `template`) is read as a pending pod is (`kube_objects.read_pod`): whole GPUs, GPU
shares (the share annotation on the template) and MIG instances count as they would on
the pod, and the pod set targets pools as the pod would:

- a pod set whose quota is reserved (`status.admission`: flavors assigned while admission
  checks, such as a ProvisioningRequest, still wait) targets the node labels of the
  ResourceFlavor its GPU resource was assigned (`spec.nodeLabels`, merged into its node
  selector) and tolerates that flavor's tolerations, as Kueue will make its pods;
- otherwise the pool its template's node selector or node affinity names, else any pool.

Pending means neither Admitted nor Finished, and active (`spec.active` not false). An
admitted Workload is left out: its pods exist, or are being made, and are counted as pods,
so nothing is counted twice. A Workload's pod sets are admitted together (all or nothing),
and its podset topology request is read as Kueue's podset topology annotations are.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from kubernetes import client as k8s

from predictor.telemetry.kube_objects import (
    KUBE_NAMES,
    PREFERRED_TOPOLOGY_ANNOTATION,
    REQUIRED_TOPOLOGY_ANNOTATION,
    KubeNames,
    PodRequest,
    read_pod,
)

GROUP = "kueue.x-k8s.io"
VERSION = "v1beta1"
WORKLOADS = "workloads"
FLAVORS = "resourceflavors"


@dataclass(frozen=True, slots=True)
class Flavor:
    """Where a ResourceFlavor puts pods: the node labels it selects, the taints it tolerates."""

    node_labels: Mapping[str, str]
    tolerations: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True, slots=True)
class QueuedPodSet:
    """`count` pods of one pod set of a pending Workload, `pod` being each of them."""

    workload: str  # namespace/name
    name: str
    count: int
    pod: PodRequest

    @property
    def gpus(self) -> float:
        """GPUs the pod set waits for, counted as its pods' (`PodRequest.gpu_demand`)."""
        return self.count * self.pod.gpu_demand


def _map(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def read_flavors(flavors: Iterable[Mapping[str, Any]]) -> dict[str, Flavor]:
    """ResourceFlavors (JSON form) by name."""
    out = {}
    for obj in flavors:
        spec = _map(obj.get("spec"))
        labels = {str(k): str(v) for k, v in _map(spec.get("nodeLabels")).items()}
        tolerations = tuple(_map(t) for t in _list(spec.get("tolerations")))
        out[str(_map(obj.get("metadata")).get("name") or "")] = Flavor(labels, tolerations)
    return out


def is_pending(workload: Mapping[str, Any]) -> bool:
    """Neither admitted nor finished, and active."""
    if _map(workload.get("spec")).get("active") is False:
        return False
    conditions = _list(_map(workload.get("status")).get("conditions"))
    done = {_map(c).get("type") for c in conditions if _map(c).get("status") == "True"}
    return not done & {"Admitted", "Finished"}


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


def queued_pod_sets(
    workload: Mapping[str, Any],
    flavors: Mapping[str, Flavor],
    names: KubeNames = KUBE_NAMES,
) -> tuple[QueuedPodSet, ...]:
    """The pod sets of `workload` (JSON form) still waiting, each as its pods would be
    read; none when it is not pending (see the module docstring)."""
    if not is_pending(workload):
        return ()
    meta = _map(workload.get("metadata"))
    namespace = str(meta.get("namespace") or "default")
    name = str(meta.get("name") or "")
    admission = _map(_map(workload.get("status")).get("admission"))
    assigned = {
        str(_map(a).get("name") or "main"): _map(a)
        for a in _list(admission.get("podSetAssignments"))
    }
    out = []
    for pod_set in map(_map, _list(_map(workload.get("spec")).get("podSets"))):
        set_name = str(pod_set.get("name") or "main")
        template = _map(pod_set.get("template"))
        spec = dict(_map(template.get("spec")))
        flavor = (
            _assigned_flavor(assigned[set_name], flavors, names) if set_name in assigned else None
        )
        if flavor is not None:
            spec["nodeSelector"] = {**_map(spec.get("nodeSelector")), **flavor.node_labels}
            spec["tolerations"] = [*_list(spec.get("tolerations")), *flavor.tolerations]
        annotations = dict(_map(_map(template.get("metadata")).get("annotations")))
        topology = _map(pod_set.get("topologyRequest"))
        if topology.get("required"):
            annotations[REQUIRED_TOPOLOGY_ANNOTATION] = str(topology["required"])
        elif topology.get("preferred"):
            annotations[PREFERRED_TOPOLOGY_ANNOTATION] = str(topology["preferred"])
        pod = {
            "metadata": {
                "namespace": namespace,
                "name": f"{name}-{set_name}",
                "labels": dict(_map(_map(template.get("metadata")).get("labels"))),
                "annotations": annotations,
            },
            "spec": spec,
            "status": {"phase": "Pending"},
        }
        count = int(pod_set.get("count", 1) or 0)
        if count > 0:
            out.append(QueuedPodSet(f"{namespace}/{name}", set_name, count, read_pod(pod, names)))
    return tuple(out)


def list_workloads(api: k8s.ApiClient) -> Callable[..., Any]:
    """The list call of every namespace's Workloads (for an informer: list, then watch)."""
    return partial(k8s.CustomObjectsApi(api).list_cluster_custom_object, GROUP, VERSION, WORKLOADS)


def list_flavors(api: k8s.ApiClient) -> Callable[..., Any]:
    """The list call of the ResourceFlavors (cluster-scoped)."""
    return partial(k8s.CustomObjectsApi(api).list_cluster_custom_object, GROUP, VERSION, FLAVORS)
