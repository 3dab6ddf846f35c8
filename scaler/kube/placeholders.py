"""Pre-positioning: placeholder pods that hold GPUs warm until real jobs take them.

This is Cluster Autoscaler's overprovisioning pattern. Each placeholder runs the pause
image, requests GPUs on one pool's nodes and has a PriorityClass below every real
workload's (value -10, and it never preempts anything itself), so kube-scheduler evicts it
the moment a real job needs its GPUs, and the job starts on a node that is already up.

`Placeholders.reconcile` makes the cluster match a desired spec, idempotently: placeholder
names are fixed by pool and index (`gpuscale-placeholder-<pool>-<i>`, largest first) and
each pod carries a hash of its spec, so a second run, or a run by a restarted process,
finds nothing to do; missing placeholders (never made, or preempted) are created, surplus
ones deleted, and ones whose size changed are replaced (a pod's requests cannot be changed
in place).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from kubernetes import client as k8s
from pydantic import BaseModel, ConfigDict, Field

from predictor.telemetry.config import PLACEHOLDER_NAMESPACE
from predictor.telemetry.kube_objects import KUBE_NAMES, SAFE_TO_EVICT_ANNOTATION
from scaler.kube.errors import API_ERRORS, KubeError, Refusal, kube_call, kube_error

POOL = KUBE_NAMES.pool_label
SPEC_HASH = KUBE_NAMES.spec_hash_label
PLACEHOLDER_LABELS = dict(KUBE_NAMES.placeholder_labels)
PLACEHOLDER_SELECTOR = KUBE_NAMES.placeholder_selector
_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


class PlaceholderSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    namespace: str = Field(default=PLACEHOLDER_NAMESPACE, pattern=_DNS_LABEL)
    priority_class: str = Field(default="gpuscale-placeholder", min_length=1)
    priority: int = Field(default=-10, lt=0, description="below every real workload's")
    image: str = "registry.k8s.io/pause:3.10"
    gpu_resource: str = KUBE_NAMES.gpu_resource
    node_pool_label: str = Field(default=POOL, description="node label naming the pool")
    cpu_milli: int = Field(default=10, ge=0)
    memory_mib: int = Field(default=16, ge=0)


class PlaceholderDemand(BaseModel):
    """How many placeholders of how many GPUs each to keep in one pool (a pool may have
    placeholders of several sizes, one demand each)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    pool: str = Field(max_length=40, pattern=_DNS_LABEL)
    count: int = Field(ge=0)
    gpus: int = Field(gt=0, description="GPUs each placeholder holds")


@dataclass(frozen=True, slots=True)
class PlaceholderChanges:
    created: tuple[str, ...] = ()
    replaced: tuple[str, ...] = ()
    deleted: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()  # wanted, but the old pod of that name is still going

    @property
    def empty(self) -> bool:
        return not (self.created or self.replaced or self.deleted or self.waiting)


def placeholder_name(pool: str, index: int) -> str:
    return f"gpuscale-placeholder-{pool}-{index}"


def placeholder_pod(settings: PlaceholderSettings, pool: str, index: int, gpus: int) -> dict:
    """The pod manifest of one placeholder (labelled with the hash of everything it asks)."""
    gpu = str(gpus)
    spec: dict[str, Any] = {
        "priorityClassName": settings.priority_class,
        "terminationGracePeriodSeconds": 0,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "nodeSelector": {settings.node_pool_label: pool},
        "tolerations": [
            {"key": settings.gpu_resource, "operator": "Exists", "effect": "NoSchedule"}
        ],
        "containers": [
            {
                "name": "pause",
                "image": settings.image,
                "resources": {
                    "requests": {
                        "cpu": f"{settings.cpu_milli}m",
                        "memory": f"{settings.memory_mib}Mi",
                        settings.gpu_resource: gpu,
                    },
                    "limits": {settings.gpu_resource: gpu},
                },
            }
        ],
    }
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": placeholder_name(pool, index),
            "namespace": settings.namespace,
            "labels": {**PLACEHOLDER_LABELS, POOL: pool, SPEC_HASH: digest},
            "annotations": {SAFE_TO_EVICT_ANNOTATION: "true"},
        },
        "spec": spec,
    }


def priority_class(settings: PlaceholderSettings) -> dict:
    return {
        "apiVersion": "scheduling.k8s.io/v1",
        "kind": "PriorityClass",
        "metadata": {"name": settings.priority_class, "labels": dict(PLACEHOLDER_LABELS)},
        "value": settings.priority,
        "globalDefault": False,
        "preemptionPolicy": "Never",
        "description": "gpuscale placeholder pods: hold warm GPU capacity, preempted by any job",
    }


class Placeholders:
    """Keeps the cluster's placeholder pods equal to a desired spec."""

    def __init__(self, api: k8s.ApiClient, settings: PlaceholderSettings | None = None) -> None:
        self.settings = settings or PlaceholderSettings()
        self._core = k8s.CoreV1Api(api)
        self._scheduling = k8s.SchedulingV1Api(api)

    def ensure_priority_class(self) -> None:
        found = kube_call(
            "read the placeholder PriorityClass",
            lambda: self._scheduling.read_priority_class(self.settings.priority_class),
            expect=(HTTPStatus.NOT_FOUND,),
        )
        if not isinstance(found, Refusal):
            return
        kube_call(
            "create the placeholder PriorityClass",
            lambda: self._scheduling.create_priority_class(priority_class(self.settings)),
            expect=(HTTPStatus.CONFLICT,),  # made meanwhile by another replica
        )

    def current(self) -> dict[str, k8s.V1Pod]:
        """The placeholder pods that exist now, by name."""
        ns = self.settings.namespace
        try:
            pods = self._core.list_namespaced_pod(ns, label_selector=PLACEHOLDER_SELECTOR)
        except API_ERRORS as exc:
            raise kube_error(f"list placeholders in {ns}", exc) from None
        return {pod.metadata.name: pod for pod in pods.items}

    def reconcile(self, desired: Sequence[PlaceholderDemand]) -> PlaceholderChanges:
        kinds = [(d.pool, d.gpus) for d in desired]
        if len(set(kinds)) != len(kinds):
            raise KubeError("a pool and size appear twice in the placeholder spec")
        self.ensure_priority_class()
        # A pool's placeholders are numbered largest first, so the same sizes always give
        # the same names and a pass that changes nothing writes nothing.
        sizes: dict[str, list[int]] = {}
        for d in sorted(desired, key=lambda d: (d.pool, -d.gpus)):
            sizes.setdefault(d.pool, []).extend([d.gpus] * d.count)
        wanted = {
            placeholder_name(pool, i): placeholder_pod(self.settings, pool, i, gpus)
            for pool, held in sizes.items()
            for i, gpus in enumerate(held)
        }
        existing = self.current()
        created: list[str] = []
        replaced: list[str] = []
        deleted: list[str] = []
        waiting: list[str] = []
        for name in sorted(existing.keys() - wanted.keys()):
            if existing[name].metadata.deletion_timestamp is None:
                self._delete(name)
                deleted.append(name)
        for name, manifest in sorted(wanted.items()):
            pod = existing.get(name)
            if pod is not None and pod.metadata.deletion_timestamp is not None:
                waiting.append(name)
                continue
            if pod is not None and _up_to_date(pod, manifest):
                continue
            if pod is not None:
                self._delete(name)
            if self._create(manifest):
                (replaced if pod is not None else created).append(name)
            else:
                waiting.append(name)
        return PlaceholderChanges(tuple(created), tuple(replaced), tuple(deleted), tuple(waiting))

    def _delete(self, name: str) -> None:
        kube_call(
            f"delete placeholder {name}",
            lambda: self._core.delete_namespaced_pod(
                name, self.settings.namespace, grace_period_seconds=0
            ),
            expect=(HTTPStatus.NOT_FOUND,),
        )

    def _create(self, manifest: dict) -> bool:
        """False when a pod of that name still exists (being deleted, or made by another
        replica): the next reconcile sees it."""
        made = kube_call(
            f"create placeholder {manifest['metadata']['name']}",
            lambda: self._core.create_namespaced_pod(self.settings.namespace, manifest),
            expect=(HTTPStatus.CONFLICT,),
        )
        return not isinstance(made, Refusal)


def _up_to_date(pod: k8s.V1Pod, manifest: dict) -> bool:
    """Same spec, and still holding its GPUs: a placeholder that failed or was evicted by
    the kubelet has stopped holding anything and is replaced."""
    labels = pod.metadata.labels or {}
    finished = pod.status is not None and pod.status.phase in ("Succeeded", "Failed")
    return labels.get(SPEC_HASH) == manifest["metadata"]["labels"][SPEC_HASH] and not finished
