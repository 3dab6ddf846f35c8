"""Which pods keep their node: Cluster Autoscaler's rules for what a scale-down may not
evict, in one function (`why_undrainable`) that the plan and the drain both ask.

A pod that goes with its node (a DaemonSet or mirror pod), has finished, is being deleted
already, or is one of gpuscale's placeholders never keeps a node. Of the others, as in
Cluster Autoscaler (its drainability rules), one keeps its node when it is

- annotated safe-to-evict "false";
- bare: no controller would recreate it;
- in kube-system, and no PodDisruptionBudget there covers it (`DrainRules.system_pods`,
  Cluster Autoscaler's `--skip-nodes-with-system-pods`);
- holding local storage, a hostPath or an emptyDir not in memory, that its
  safe-to-evict-local-volumes annotation does not name (`DrainRules.local_storage`,
  `--skip-nodes-with-local-storage`);

and safe-to-evict "true" lets a pod go past the last three. Whether a budget covers a
system pod is read from the cluster's budgets (`system_budgets`); how many pods it lets
go at once is the Eviction API's answer at the drain.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kubernetes import client as k8s

from predictor.telemetry.kube_objects import (
    SAFE_TO_EVICT_ANNOTATION,
    SAFE_TO_EVICT_LOCAL_VOLUMES_ANNOTATION,
    PodRequest,
    requirement_holds,
)
from scaler.kube.errors import kube_call

SYSTEM_NAMESPACE = "kube-system"


@dataclass(frozen=True, slots=True)
class DrainRules:
    """The rules a scale-down may turn off, on by default as in Cluster Autoscaler."""

    system_pods: bool = True  # a kube-system pod no budget covers keeps its node
    local_storage: bool = True  # a pod with local storage keeps its node


CLUSTER_AUTOSCALER_RULES = DrainRules()  # its flags' defaults


@dataclass(frozen=True)
class SystemBudgets:
    """The selectors of kube-system's PodDisruptionBudgets."""

    selectors: tuple[k8s.V1LabelSelector, ...] = ()

    def cover(self, pod: PodRequest) -> bool:
        labels = dict(pod.labels)
        return any(selector_matches(s, labels) for s in self.selectors)


NO_BUDGETS = SystemBudgets()


def why_undrainable(pod: PodRequest, rules: DrainRules, budgets: SystemBudgets) -> str | None:
    """Why no drain may take `pod` away, so its node must stay (see the module docstring);
    None for a pod that may go."""
    if pod.goes_with_node or pod.finished or pod.deleting or pod.placeholder:
        return None
    if not pod.safe_to_evict:
        return f'pod {pod.id} is annotated {SAFE_TO_EVICT_ANNOTATION}: "false"'
    if pod.evict_anyway:
        return None
    if pod.controller_uid is None:
        return f"pod {pod.id} has no controller to recreate it"
    if rules.system_pods and pod.namespace == SYSTEM_NAMESPACE and not budgets.cover(pod):
        return f"pod {pod.id} is a {SYSTEM_NAMESPACE} pod no PodDisruptionBudget covers"
    if rules.local_storage and pod.local_storage:
        volumes = ", ".join(pod.local_storage)
        return (
            f"pod {pod.id} has local storage ({volumes}) not named in"
            f" {SAFE_TO_EVICT_LOCAL_VOLUMES_ANNOTATION}"
        )
    return None


def undrainable(
    pods: Iterable[PodRequest], rules: DrainRules, budgets: SystemBudgets
) -> list[tuple[PodRequest, str]]:
    """The pods among `pods` that keep their node, each with why."""
    return [(p, why) for p in pods if (why := why_undrainable(p, rules, budgets)) is not None]


def system_budgets(api: k8s.ApiClient, pods: Iterable[PodRequest]) -> SystemBudgets:
    """kube-system's budgets, listed only when `pods` hold a kube-system pod (nothing
    else asks them). Raises KubeError."""
    if not any(p.namespace == SYSTEM_NAMESPACE for p in pods):
        return NO_BUDGETS
    found = budgets_in(api, SYSTEM_NAMESPACE)
    return SystemBudgets(tuple(b.spec.selector for b in found if b.spec is not None))


def budgets_in(api: k8s.ApiClient, namespace: str) -> list[k8s.V1PodDisruptionBudget]:
    """The PodDisruptionBudgets of `namespace`. Raises KubeError."""
    policy = k8s.PolicyV1Api(api)
    what = f"list PodDisruptionBudgets in {namespace}"
    return (
        kube_call(what, lambda: policy.list_namespaced_pod_disruption_budget(namespace)).items or []
    )


def selector_matches(selector: k8s.V1LabelSelector | None, labels: Mapping[str, str]) -> bool:
    """A LabelSelector; a null one selects nothing, an empty one everything."""
    if selector is None:
        return False
    if any(labels.get(k) != v for k, v in (selector.match_labels or {}).items()):
        return False
    requirements = (
        {"key": t.key, "operator": t.operator, "values": t.values}
        for t in selector.match_expressions or []
    )
    return all(requirement_holds(r, labels) for r in requirements)
