"""The Kubernetes permissions gpuscale needs: one row per API method the code calls.

The Helm chart's RBAC (deploy/helm/gpuscale/templates/rbac.yaml) grants exactly what this
table derives for each component, and tests/test_deploy.py keeps the three in step: it scans
the source for every Kubernetes client method called (or handed to a watch) and fails when a
call is missing here, when a module that calls the API belongs to no component, or when the
chart grants more or less than the table says.

CustomObjectsApi's methods (CapacityBuffers, Karpenter's NodePools and NodeClaims, Kueue's
Workloads, ResourceFlavors, LocalQueues and ClusterQueues) name no resource, so
`CUSTOM_OBJECT_CALLS` says per module what they reach; `permissions_of` reads both tables.

`scope` is "cluster" when the call reaches any namespace or a cluster-scoped object
(ClusterRole), "namespace" when it only touches gpuscale's own namespace: the lease and the
placeholder pods (Role in the release namespace).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True, order=True)
class Permission:
    group: str  # "" is the core API group
    resource: str
    verb: str
    scope: Literal["cluster", "namespace"] = "cluster"


API_CALLS: dict[str, Permission] = {
    "list_node": Permission("", "nodes", "list"),
    "read_node": Permission("", "nodes", "get"),  # drain; defrag: the MIG manager's state
    # cordon, uncordon; defrag: its move notes, the MIG config label, the MIG layout note
    "patch_node": Permission("", "nodes", "patch"),
    "list_pod_for_all_namespaces": Permission("", "pods", "list"),
    # Scheduled jobs: the loop lists the CronJobs each pass, the collector beside it watches
    # them, and /v1/plan reads them as the loop does.
    "list_cron_job_for_all_namespaces": Permission("batch", "cronjobs", "list"),
    "read_namespaced_pod": Permission("", "pods", "get"),  # extender bind: the pod's requests
    "patch_namespaced_pod": Permission("", "pods", "patch"),  # extender bind: GPU annotation
    "create_namespaced_pod_binding": Permission("", "pods/binding", "create"),
    "create_namespaced_pod_eviction": Permission("", "pods/eviction", "create"),  # drain, defrag
    # drain and defrag: the budget refusing an eviction; the plan: kube-system's budgets
    "list_namespaced_pod_disruption_budget": Permission("policy", "poddisruptionbudgets", "list"),
    "read_priority_class": Permission("scheduling.k8s.io", "priorityclasses", "get"),
    "create_priority_class": Permission("scheduling.k8s.io", "priorityclasses", "create"),
    # Placeholder pods live in gpuscale's namespace only.
    "list_namespaced_pod": Permission("", "pods", "list", "namespace"),
    "create_namespaced_pod": Permission("", "pods", "create", "namespace"),
    "delete_namespaced_pod": Permission("", "pods", "delete", "namespace"),
    # Leader election.
    "read_namespaced_lease": Permission("coordination.k8s.io", "leases", "get", "namespace"),
    "create_namespaced_lease": Permission("coordination.k8s.io", "leases", "create", "namespace"),
    "replace_namespaced_lease": Permission("coordination.k8s.io", "leases", "update", "namespace"),
    # The PodTemplates of the CapacityBuffers' units, in gpuscale's namespace.
    "read_namespaced_pod_template": Permission("", "podtemplates", "get", "namespace"),
    "create_namespaced_pod_template": Permission("", "podtemplates", "create", "namespace"),
    "patch_namespaced_pod_template": Permission("", "podtemplates", "patch", "namespace"),
}

_BUFFERS = "autoscaling.x-k8s.io"
_KARPENTER = "karpenter.sh"
_KUEUE = "kueue.x-k8s.io"
_KUEUE_KINDS = ("workloads", "resourceflavors", "localqueues", "clusterqueues")

# CustomObjectsApi's methods name no resource: what each module reaches with them.
CUSTOM_OBJECT_CALLS: dict[str, dict[str, tuple[Permission, ...]]] = {
    "scaler/kube/capacity_buffers.py": {
        # and watch: the loop keeps them in its cluster cache (`watch_kind`)
        "list_namespaced_custom_object": (
            Permission(_BUFFERS, "capacitybuffers", "list", "namespace"),
        ),
        "create_namespaced_custom_object": (
            Permission(_BUFFERS, "capacitybuffers", "create", "namespace"),
        ),
        "patch_namespaced_custom_object": (
            Permission(_BUFFERS, "capacitybuffers", "patch", "namespace"),
        ),
    },
    "scaler/providers/karpenter.py": {
        # and watch: the loop and the service keep them in their cluster cache
        "list_cluster_custom_object": (
            Permission(_KARPENTER, "nodepools", "list"),
            Permission(_KARPENTER, "nodeclaims", "list"),
        ),
        "get_cluster_custom_object": (Permission(_KARPENTER, "nodepools", "get"),),
        "patch_cluster_custom_object": (Permission(_KARPENTER, "nodepools", "patch"),),
        # Karpenter drains and terminates the node of a NodeClaim deleted.
        "delete_cluster_custom_object": (Permission(_KARPENTER, "nodeclaims", "delete"),),
    },
    # Kueue's queue (Workloads, and the flavors and queues that say where they go): the
    # loop, the service and the collector watch it in the process's cluster cache; a pass
    # without one (`observe_cluster`) lists it.
    "scaler/kube/kueue.py": {
        "list_cluster_custom_object": tuple(
            Permission(_KUEUE, resource, "list") for resource in _KUEUE_KINDS
        ),
    },
    "predictor/telemetry/kueue.py": {
        "list_cluster_custom_object": tuple(
            Permission(_KUEUE, resource, verb)
            for resource in _KUEUE_KINDS
            for verb in ("list", "watch")
        ),
    },
}


def permissions_of(module: str, method: str) -> tuple[Permission, ...]:
    """What calling client method `method` in `module` needs."""
    custom = CUSTOM_OBJECT_CALLS.get(module, {})
    return custom[method] if method in custom else (API_CALLS[method],)


# The modules whose API calls each deployed component makes. The scaler pod runs the
# reconcile loop, reading the cluster through the process's watched cache
# (`predictor.telemetry.watch_cache`: list + watch), and beside it a collector reading
# demand from the API server (informers: list + watch); `gpuscale defrag` runs with the
# scaler's account (evictions, the move notes on nodes, the MIG manager's node labels). The
# service reads the cluster through the same kind of cache for placement, binds for
# kube-scheduler and observes the fleet for /v1/plan. The node collector (NVML) talks to no
# API server.
COMPONENT_MODULES: dict[str, tuple[str, ...]] = {
    "scaler": (
        "scaler/controller/leader.py",
        "scaler/kube/nodes.py",
        "scaler/kube/placeholders.py",
        "scaler/kube/observed.py",
        "scaler/kube/moves.py",
        "scaler/kube/evictions.py",
        "scaler/kube/drainability.py",
        "scaler/kube/pods.py",
        "scaler/kube/mig_manager.py",
        "scaler/kube/capacity_buffers.py",
        "scaler/providers/karpenter.py",
        "scaler/providers/autoscaler.py",
        "scaler/kube/kueue.py",
        "scaler/kube/cronjobs.py",
        "predictor/telemetry/kubernetes.py",
        "predictor/telemetry/kueue.py",
        "predictor/telemetry/scheduled_jobs.py",
        "predictor/telemetry/watch_cache.py",
    ),
    "service": (
        "scaler/service/cluster.py",
        "scaler/service/extender.py",
        "scaler/kube/pods.py",
        "scaler/kube/observed.py",
        "scaler/kube/drainability.py",
        "scaler/providers/karpenter.py",
        "scaler/providers/autoscaler.py",
        "scaler/kube/kueue.py",
        "predictor/telemetry/kueue.py",
        "scaler/kube/cronjobs.py",
        "predictor/telemetry/watch_cache.py",
    ),
    "collector": (),
}

# Modules a component only reads through: the service plans (/v1/plan) and lists the pools
# (/v1/nodepools) from the provider as the loop does, and changes nothing there.
READS_ONLY: dict[str, tuple[str, ...]] = {
    "service": ("scaler/providers/karpenter.py", "scaler/providers/autoscaler.py"),
}
READ_VERBS = frozenset({"get", "list", "watch"})
