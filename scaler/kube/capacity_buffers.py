"""Pre-positioning through CapacityBuffers: the node autoscaler holds the spare capacity.

Cluster Autoscaler (1.35+: 1.34 serves only v1alpha1; its capacity buffer controller and
pod injection enabled) and Karpenter (its CapacityBuffer feature gate) read
`CapacityBuffer` objects (autoscaling.x-k8s.io/v1beta1) and keep room for `replicas`
chunks shaped by the PodTemplate the buffer refers to, as if that many such pods were
pending: they are virtual pods, injected into the autoscaler's own simulation, so no pod
occupies a node and a real pod takes the room as it takes any free capacity. `limits`
caps the chunks' total requests (kubernetes/autoscaler,
cluster-autoscaler/proposals/buffers.md).

gpuscale owns, per pool, one PodTemplate `gpuscale-buffer-<pool>` shaped like one unit of
the pool's job mix (its GPUs, CPU and memory, a node selector for the pool, the GPU taint
tolerated) and one CapacityBuffer `gpuscale-<pool>` (active capacity, `podTemplateRef` to
it, `replicas`: how many units the plan's spare room holds, `limits`: the pool's GPUs at
its max size). `CapacityBuffers.changes` compares them with what the plan wants and
`apply` writes one change; an object already as wanted is never written, so a repeated
pass, or a restarted process, writes nothing. A buffer gpuscale made for a pool it no
longer plans is set to 0 replicas (the RBAC grants no delete).

gpuscale writes only the spec; whether the room is held shows in the status the
autoscaler writes back (`not_ready`): Cluster Autoscaler's buffer controller sets
`ReadyForProvisioning` False when it cannot turn the buffer into pods (a PodTemplate it
cannot read, limits it cannot apply) and `LimitedByQuotas` True when ResourceQuotas cut
its replicas, and its pod injection sets `Provisioning` False when it injects no pods.
Such a buffer holds less room than the plan counts on, while its spec is as planned, so
gpuscale writes nothing and reports it instead.

Where the pass reads the process's watched cluster cache, the buffers are kept there
(listed once, then watched, `ClusterCache.watch_kind`): a pass reads them, status
included, from memory; otherwise `current` lists them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Literal

from kubernetes import client as k8s
from pydantic import BaseModel, ConfigDict, Field

from predictor.telemetry.config import PLACEHOLDER_NAMESPACE
from predictor.telemetry.kube_objects import KUBE_NAMES
from predictor.telemetry.watch_cache import ClusterCache
from scaler.kube.errors import KubeError, Refusal, kube_call

GROUP = "autoscaling.x-k8s.io"
VERSION = "v1beta1"
PLURAL = "capacitybuffers"
ACTIVE_CAPACITY = "buffer.x-k8s.io/active-capacity"
POOL = KUBE_NAMES.pool_label  # labels gpuscale's own objects with their pool
SPEC_HASH = KUBE_NAMES.spec_hash_label
BUFFER_LABELS = {
    "app.kubernetes.io/managed-by": "gpuscale",
    "app.kubernetes.io/component": "capacity-buffer",
}
BUFFER_SELECTOR = ",".join(f"{k}={v}" for k, v in BUFFER_LABELS.items())
_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# Status conditions (cluster-autoscaler/capacitybuffer/constants.go) and the reason pod
# injection gives for a buffer of no replicas.
READY_FOR_PROVISIONING = "ReadyForProvisioning"
PROVISIONING = "Provisioning"
LIMITED_BY_QUOTAS = "LimitedByQuotas"
BUFFER_IS_EMPTY = "BufferIsEmpty"


class BufferSettings(BaseModel):
    """Where gpuscale's PodTemplates and CapacityBuffers live and what their pods ask."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    namespace: str = Field(default=PLACEHOLDER_NAMESPACE, pattern=_DNS_LABEL)
    image: str = "registry.k8s.io/pause:3.10"
    gpu_resource: str = KUBE_NAMES.gpu_resource
    node_pool_label: str = Field(default=POOL, description="node label naming the pool")


class BufferUnit(BaseModel):
    """One chunk of a pool's buffer: what one job of the pool's mix asks."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    gpus: int = Field(gt=0)
    cpu_milli: int = Field(default=0, ge=0)
    memory_mib: int = Field(default=0, ge=0)


class BufferDemand(BaseModel):
    """The buffer one pool should have: `replicas` units, capped at `limit_gpus` GPUs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    pool: str = Field(max_length=40, pattern=_DNS_LABEL)
    replicas: int = Field(ge=0)
    unit: BufferUnit
    limit_gpus: int = Field(ge=0, description="the pool's GPUs at its max size")
    reason: str = ""


def buffer_name(pool: str) -> str:
    return f"gpuscale-{pool}"


def template_name(pool: str) -> str:
    return f"gpuscale-buffer-{pool}"


def _labels(pool: str) -> dict[str, str]:
    return {**BUFFER_LABELS, POOL: pool}


def unit_template(settings: BufferSettings, pool: str, unit: BufferUnit) -> dict[str, Any]:
    """The PodTemplate of one unit of `pool`'s buffer, labelled with the hash of its pod."""
    gpus = str(unit.gpus)
    requests = {settings.gpu_resource: gpus}
    if unit.cpu_milli:
        requests["cpu"] = f"{unit.cpu_milli}m"
    if unit.memory_mib:
        requests["memory"] = f"{unit.memory_mib}Mi"
    spec: dict[str, Any] = {
        "nodeSelector": {settings.node_pool_label: pool},
        "tolerations": [
            {"key": settings.gpu_resource, "operator": "Exists", "effect": "NoSchedule"}
        ],
        "terminationGracePeriodSeconds": 0,
        "automountServiceAccountToken": False,
        "containers": [
            {
                "name": "unit",
                "image": settings.image,
                "resources": {"requests": requests, "limits": {settings.gpu_resource: gpus}},
            }
        ],
    }
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
    return {
        "apiVersion": "v1",
        "kind": "PodTemplate",
        "metadata": {
            "name": template_name(pool),
            "namespace": settings.namespace,
            "labels": {**_labels(pool), SPEC_HASH: digest},
        },
        "template": {"metadata": {"labels": _labels(pool)}, "spec": spec},
    }


def buffer_spec(settings: BufferSettings, demand: BufferDemand) -> dict[str, Any]:
    return {
        "provisioningStrategy": ACTIVE_CAPACITY,
        "podTemplateRef": {"name": template_name(demand.pool)},
        "replicas": demand.replicas,
        "limits": {settings.gpu_resource: str(demand.limit_gpus)},
    }


def capacity_buffer(settings: BufferSettings, demand: BufferDemand) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "CapacityBuffer",
        "metadata": {
            "name": buffer_name(demand.pool),
            "namespace": settings.namespace,
            "labels": _labels(demand.pool),
        },
        "spec": buffer_spec(settings, demand),
    }


def not_ready(buffer: Mapping[str, Any]) -> str | None:
    """Why the autoscaler does not hold the room a CapacityBuffer (JSON form) asks, as its
    status conditions say (see the module docstring), or None when they say nothing
    against it."""
    status = buffer.get("status") or {}
    conditions = {c.get("type"): c for c in status.get("conditions") or []}

    def holds(kind: str, value: str) -> bool:
        return (conditions.get(kind) or {}).get("status") == value

    def said(kind: str) -> str:
        c = conditions[kind]
        return f"{kind} {c.get('status')} ({c.get('reason') or '-'}): {c.get('message') or ''}"

    found = []
    if holds(READY_FOR_PROVISIONING, "False"):
        found.append(said(READY_FOR_PROVISIONING))
    elif holds(PROVISIONING, "False") and not (
        # Emptied on purpose: a buffer of 0 replicas holds what it asks.
        conditions[PROVISIONING].get("reason") == BUFFER_IS_EMPTY
        and not (buffer.get("spec") or {}).get("replicas")
    ):
        # Only for a ready buffer: for one not ready, pod injection repeats just that.
        found.append(said(PROVISIONING))
    if holds(LIMITED_BY_QUOTAS, "True"):
        found.append(said(LIMITED_BY_QUOTAS))
    return f"CapacityBuffer {buffer['metadata']['name']}: {'; '.join(found)}" if found else None


@dataclass(frozen=True)
class BufferChange:
    """What one pool's objects need: the PodTemplate made or updated (or neither), the
    buffer made (`replicas_from` None) or its spec set."""

    pool: str
    buffer: str
    replicas_from: int | None
    replicas_to: int
    template: Literal["create", "update"] | None
    spec: Mapping[str, Any]  # the buffer's spec as wanted
    limits_from: Mapping[str, Any] | None = None  # the spec's limits now (keys to drop)
    template_manifest: Mapping[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "pool": self.pool,
            "buffer": self.buffer,
            "from": self.replicas_from,
            "to": self.replicas_to,
            "template": self.template,
        }

    @property
    def summary(self) -> str:
        what = (
            f"created with {self.replicas_to} replicas"
            if self.replicas_from is None
            else f"replicas {self.replicas_from} -> {self.replicas_to}"
        )
        if self.template is not None:
            what += f"; PodTemplate {template_name(self.pool)} {self.template}d"
        return what


class CapacityBuffers:
    """Keeps gpuscale's PodTemplates and CapacityBuffers equal to the plan's demand."""

    def __init__(
        self,
        api: k8s.ApiClient,
        settings: BufferSettings | None = None,
        cache: ClusterCache | None = None,
        wait_s: float = 10.0,
    ) -> None:
        self.settings = settings or BufferSettings()
        self._core = k8s.CoreV1Api(api)
        self._custom = k8s.CustomObjectsApi(api)
        self._cache = cache  # the process's watched cache, if the pass reads one
        self._wait_s = wait_s  # how long the cache's first list of them is waited for

    def current(self) -> dict[str, dict[str, Any]]:
        """gpuscale's CapacityBuffers in its namespace, by name: the watched cache's (a
        watch down since is the cache's staleness), else listed now."""
        ns = self.settings.namespace
        what = f"list CapacityBuffers in {ns}"

        def list_buffers(**kwargs: Any) -> Any:
            return self._custom.list_namespaced_custom_object(
                GROUP, VERSION, ns, PLURAL, label_selector=BUFFER_SELECTOR, **kwargs
            )

        if self._cache is None:
            listing = kube_call(what, list_buffers)
            found = listing.get("items") or []
        else:
            kind = self._cache.watch_kind(PLURAL, list_buffers)
            if not kind.wait_listed(self._wait_s):
                raise KubeError(f"{what}: {kind.error or 'not listed yet'}")
            found = kind.objects()
        return {b["metadata"]["name"]: b for b in found}

    def changes(
        self, desired: Sequence[BufferDemand], existing: Mapping[str, Mapping[str, Any]]
    ) -> list[BufferChange]:
        """What differs between the buffers `existing` (as `current` lists them) and
        `desired` (reads only)."""
        pools = [d.pool for d in desired]
        if len(set(pools)) != len(pools):
            raise KubeError("a pool appears twice in the buffer spec")
        out = []
        for demand in desired:
            name = buffer_name(demand.pool)
            wanted_template = unit_template(self.settings, demand.pool, demand.unit)
            template = self._template_change(wanted_template)
            spec = buffer_spec(self.settings, demand)
            found = existing.get(name)
            now = (found or {}).get("spec") or {}
            if template is None and found is not None and _same_spec(now, spec):
                continue
            out.append(
                BufferChange(
                    pool=demand.pool,
                    buffer=name,
                    replicas_from=None if found is None else int(now.get("replicas") or 0),
                    replicas_to=demand.replicas,
                    template=template,
                    spec=spec,
                    limits_from=now.get("limits") if found is not None else None,
                    template_manifest=wanted_template if template else None,
                )
            )
        planned = {buffer_name(p) for p in pools}
        for name, found in sorted(existing.items()):
            spec = found.get("spec") or {}
            if name in planned or not spec.get("replicas"):
                continue
            pool = (found["metadata"].get("labels") or {}).get(POOL, name)
            out.append(
                BufferChange(pool, name, int(spec["replicas"]), 0, None, {**spec, "replicas": 0})
            )
        return out

    def apply(self, change: BufferChange) -> None:
        """Write one change; raises KubeError when the API server refuses it."""
        if change.template_manifest is not None:
            self._write_template(change.template_manifest)
        ns = self.settings.namespace
        if change.replicas_from is None:
            body = {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": "CapacityBuffer",
                "metadata": {
                    "name": change.buffer,
                    "namespace": ns,
                    "labels": _labels(change.pool),
                },
                "spec": dict(change.spec),
            }
            made = kube_call(
                f"create CapacityBuffer {change.buffer}",
                lambda: self._custom.create_namespaced_custom_object(
                    GROUP, VERSION, ns, PLURAL, body
                ),
                expect=(HTTPStatus.CONFLICT,),  # made meanwhile by another replica
            )
            if not isinstance(made, Refusal):
                return
        spec = dict(change.spec)
        dropped = {k: None for k in change.limits_from or {} if k not in spec.get("limits", {})}
        if dropped:  # a merge patch merges maps: drop the limits no longer wanted
            spec["limits"] = {**dropped, **spec.get("limits", {})}
        kube_call(
            f"set CapacityBuffer {change.buffer} to {change.replicas_to} replicas",
            lambda: self._custom.patch_namespaced_custom_object(
                GROUP, VERSION, ns, PLURAL, change.buffer, {"spec": spec}
            ),
        )

    def _template_change(self, wanted: Mapping[str, Any]) -> Literal["create", "update"] | None:
        name = wanted["metadata"]["name"]
        found = kube_call(
            f"read PodTemplate {name}",
            lambda: self._core.read_namespaced_pod_template(name, self.settings.namespace),
            expect=(HTTPStatus.NOT_FOUND,),
        )
        if isinstance(found, Refusal):
            return "create"
        labels = found.metadata.labels or {}
        return (
            None if labels.get(SPEC_HASH) == wanted["metadata"]["labels"][SPEC_HASH] else "update"
        )

    def _write_template(self, manifest: Mapping[str, Any]) -> None:
        name = manifest["metadata"]["name"]
        ns = self.settings.namespace
        made = kube_call(
            f"create PodTemplate {name}",
            lambda: self._core.create_namespaced_pod_template(ns, dict(manifest)),
            expect=(HTTPStatus.CONFLICT,),
        )
        if not isinstance(made, Refusal):
            return
        # It exists: make it the unit wanted. A JSON patch replaces the labels (with the
        # hash) and the pod template whole, where a merge would keep requests dropped.
        patch = [
            {"op": "replace", "path": "/metadata/labels", "value": manifest["metadata"]["labels"]},
            {"op": "replace", "path": "/template", "value": manifest["template"]},
        ]
        kube_call(
            f"update PodTemplate {name}",
            lambda: self._core.patch_namespaced_pod_template(name, ns, patch),
        )


def _same_spec(now: Mapping[str, Any], wanted: Mapping[str, Any]) -> bool:
    return all(now.get(key) == value for key, value in wanted.items())
