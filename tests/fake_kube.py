"""A small fake Kubernetes API server for tests: the real `kubernetes` client talks to it.

No API server can be installed on the build machines, so this serves the REST paths the
product uses, with the semantics the client relies on: lists carry a resourceVersion,
`?watch=true` streams newline-separated JSON events over chunked HTTP from a given
resourceVersion (410 Gone once it has been compacted), PUT checks optimistic concurrency,
PATCH takes merge, strategic-merge (treated as merge) and JSON patches (a merge patch
naming a resourceVersion is checked as a PUT is), pods have a `status`, `eviction` (with
`?dryRun=All`) and `binding` subresources, and leases live in coordination.k8s.io/v1.
Lists honour `limit` and `continue` as the API server pages them (the continue token
names where the next page starts and the resourceVersion of the first page, which every
page reports). batch/v1 CronJobs are served with their API server defaults; their
schedules are not parsed, so a test can show how a reader meets one it cannot read.
Resources are declared in one table, so another kind is a line. Custom resources
(CapacityBuffer, Karpenter's NodePool and NodeClaim, Kueue's Workload, ResourceFlavor,
LocalQueue and ClusterQueue) are served at /apis/<group>/<version>/[namespaces/<ns>/]<plural>
(Kueue's at v1beta2 and v1beta1, as Kueue 0.15 and later serve them; `unserved` takes a
version away) as a CRD's objects are, for CustomObjectsApi: defaults and validation rules
of their CRDs (`admission`), a `status` subresource, and a generation counting changes of the spec.
`on_write` hooks let a test play a controller that reacts to writes.
Set `faults` (an `ApiFaults`) and requests over HTTP fail now and then: 500s, and answers
held past the client's timeout; set `refusals` and every request on a kind fails the same
way (403 Forbidden, as RBAC refuses an account it grants nothing there, or an outage).

Tests drive it two ways: through the client, as the product does, and directly
(`create`, `patch`, `delete`, `get`, `objects`) to play the rest of the cluster.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import itertools
import json
import random
import socket
import threading
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

Obj = dict[str, Any]


@dataclass(frozen=True)
class ResourceKind:
    prefix: str  # "/api/v1" or "/apis/<group>/<version>"
    plural: str
    kind: str
    namespaced: bool
    # A custom resource whose CRD declares the status subresource: over HTTP, writes to the
    # object leave its status alone and writes to /status change nothing else.
    status_subresource: bool = False
    # Other versions a CRD serves the same objects at ("/apis/<group>/<version>").
    also_at: tuple[str, ...] = ()

    @property
    def api_version(self) -> str:
        return self.prefix.removeprefix("/api/").removeprefix("/apis/")


KUEUE_V1BETA2 = "/apis/kueue.x-k8s.io/v1beta2"
KUEUE_V1BETA1 = "/apis/kueue.x-k8s.io/v1beta1"

RESOURCES = (
    ResourceKind("/api/v1", "nodes", "Node", namespaced=False),
    ResourceKind("/api/v1", "pods", "Pod", namespaced=True),
    ResourceKind("/api/v1", "namespaces", "Namespace", namespaced=False),
    ResourceKind("/api/v1", "events", "Event", namespaced=True),
    ResourceKind("/api/v1", "configmaps", "ConfigMap", namespaced=True),
    ResourceKind("/apis/coordination.k8s.io/v1", "leases", "Lease", namespaced=True),
    ResourceKind("/apis/policy/v1", "poddisruptionbudgets", "PodDisruptionBudget", True),
    ResourceKind("/apis/scheduling.k8s.io/v1", "priorityclasses", "PriorityClass", False),
    ResourceKind("/apis/apps/v1", "deployments", "Deployment", namespaced=True),
    ResourceKind("/api/v1", "podtemplates", "PodTemplate", namespaced=True),
    ResourceKind("/apis/batch/v1", "cronjobs", "CronJob", namespaced=True),
    # Custom resources, served as the API server serves a CRD's objects (the official
    # client reaches them through CustomObjectsApi): Cluster Autoscaler's CapacityBuffer,
    # Karpenter's NodePool and NodeClaim, Kueue's Workload, ResourceFlavor, LocalQueue and
    # ClusterQueue.
    ResourceKind(
        "/apis/autoscaling.x-k8s.io/v1beta1", "capacitybuffers", "CapacityBuffer", True, True
    ),
    ResourceKind("/apis/karpenter.sh/v1", "nodepools", "NodePool", False, True),
    ResourceKind("/apis/karpenter.sh/v1", "nodeclaims", "NodeClaim", False, True),
    # Kueue 0.15 and later serve v1beta2 (stored) and the deprecated v1beta1.
    *(
        ResourceKind(KUEUE_V1BETA2, plural, kind, namespaced, status, also_at=(KUEUE_V1BETA1,))
        for plural, kind, namespaced, status in (
            ("workloads", "Workload", True, True),
            ("resourceflavors", "ResourceFlavor", False, False),
            ("localqueues", "LocalQueue", True, True),
            ("clusterqueues", "ClusterQueue", False, True),
        )
    ),
)

# What a CRD's schema and validation rules make the API server do with a custom object on
# create (old None) and update: fill in defaults in place, or refuse it (422).
Admission = Callable[["Obj", "Obj | None"], None]

# An eviction policy returns None to allow the eviction, or (HTTP code, message) to refuse
# it, as a PodDisruptionBudget makes the real API server answer 429.
EvictionPolicy = Callable[[Obj], tuple[int, str] | None]


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message

    def status(self) -> Obj:
        return status_object(self.code, self.reason, self.message)


def status_object(code: int, reason: str, message: str) -> Obj:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Success" if code < 400 else "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


@dataclass
class ApiFaults:
    """Faults injected into requests made over HTTP (watches, and tests' direct calls, are
    left alone), drawn per request from a seeded generator. `error_rate`: answer 500 without
    acting. `timeout_rate`: hold the answer for `hold_s` (set it past the client's timeout)
    and then drop the connection; for `applied_share` of these the request took effect
    first, as when an answer is lost on the way back. `injected` counts them by kind."""

    error_rate: float = 0.0
    timeout_rate: float = 0.0
    applied_share: float = 0.0
    hold_s: float = 1.0
    seed: int = 0
    injected: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._lock = threading.Lock()  # handler threads draw; one sequence per seed

    def draw(self) -> str | None:
        """None, "error", "timeout" (not acted on) or "answer_lost" (acted on)."""
        with self._lock:
            x = self._rng.random()
            if x < self.error_rate:
                kind = "error"
            elif x < self.error_rate + self.timeout_rate:
                kind = "answer_lost" if self._rng.random() < self.applied_share else "timeout"
            else:
                return None
            self.injected[kind] += 1
            return kind


@dataclass(frozen=True)
class Event:
    resource_version: int
    kind: ResourceKind
    type: str
    object: Obj
    before: Obj | None = None  # a MODIFIED object as it was (selector transitions)


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (strategic merge patches are applied the same way: the
    fields the product patches, such as labels, taints and spec.unschedulable, agree)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def json_patch(target: Obj, operations: list[Obj]) -> Obj:
    """RFC 6902 operations add, replace, remove and test."""
    doc = copy.deepcopy(target)
    for op in operations:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        parent: Any = doc
        for part in parts[:-1]:
            parent = parent[int(part)] if isinstance(parent, list) else parent.setdefault(part, {})
        last = parts[-1]
        kind = op["op"]
        if kind == "test":
            current = parent[int(last)] if isinstance(parent, list) else parent.get(last)
            if current != op["value"]:
                raise ApiError(422, "Invalid", f"test failed at {op['path']}")
        elif kind in ("add", "replace"):
            if isinstance(parent, list):
                if last == "-":
                    parent.append(op["value"])
                elif kind == "add":
                    parent.insert(int(last), op["value"])
                else:
                    parent[int(last)] = op["value"]
            else:
                parent[last] = op["value"]
        elif kind == "remove":
            if isinstance(parent, list):
                del parent[int(last)]
            else:
                parent.pop(last, None)
        else:
            raise ApiError(422, "Invalid", f"unsupported JSON patch op {kind!r}")
    return doc


def _field(obj: Obj, dotted: str) -> str:
    value: Any = obj
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return "" if value is None else str(value)


def selector_matches(obj: Obj, label_selector: str, field_selector: str) -> bool:
    """Equality-based label and field selectors (`a=b`, `a==b`, `a!=b`, `a`, `!a`)."""
    labels = obj.get("metadata", {}).get("labels") or {}
    for term in filter(None, (t.strip() for t in label_selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key) != value:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    for term in filter(None, (t.strip() for t in field_selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if _field(obj, key) == value:
                return False
        else:
            key, value = term.replace("==", "=").split("=", 1)
            if _field(obj, key) != value:
                return False
    return True


_NOT_ASKED = ("apiVersion", "kind", "metadata", "status")


def _check_version(plural: str, current: Obj, written: Obj) -> None:
    """Optimistic concurrency: a write naming a resourceVersion other than the stored
    object's is refused with 409 (one naming none is applied as it comes)."""
    wanted = (written.get("metadata") or {}).get("resourceVersion")
    if wanted and wanted != current["metadata"]["resourceVersion"]:
        name = current["metadata"]["name"]
        raise ApiError(
            409,
            "Conflict",
            f'Operation cannot be fulfilled on {plural} "{name}": the object has '
            "been modified; please apply your changes to the latest version",
        )


def _invalid(kind: str, obj: Obj, message: str) -> ApiError:
    name = obj.get("metadata", {}).get("name", "")
    return ApiError(422, "Invalid", f'{kind} "{name}" is invalid: {message}')


def _count(obj: Obj, kind: str, path: str, value: Any) -> None:
    """An integer field of a custom object that must be >= 0 when given."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise _invalid(kind, obj, f"{path}: Invalid value: {value!r}: must be an integer >= 0")


def capacity_buffer_admission(obj: Obj, old: Obj | None) -> None:
    """autoscaling.x-k8s.io/v1beta1 CapacityBuffer (the CRD in kubernetes/autoscaler,
    cluster-autoscaler/apis/config/crd): spec required, provisioningStrategy defaulted to
    active capacity, exactly one of podTemplateRef and scalableRef, a podTemplateRef with
    replicas or limits, replicas and percentage >= 0."""
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        raise _invalid("CapacityBuffer", obj, "spec: Required value")
    spec.setdefault("provisioningStrategy", "buffer.x-k8s.io/active-capacity")
    template, scalable = spec.get("podTemplateRef"), spec.get("scalableRef")
    if (template is None) == (scalable is None):
        raise _invalid("CapacityBuffer", obj, "spec: exactly one of podTemplateRef, scalableRef")
    if template is not None and not (template.get("name") or ""):
        raise _invalid("CapacityBuffer", obj, "spec.podTemplateRef.name: Required value")
    if template is not None and spec.get("replicas") is None and spec.get("limits") is None:
        raise _invalid("CapacityBuffer", obj, "spec: podTemplateRef needs replicas or limits")
    for field_ in ("replicas", "percentage"):
        _count(obj, "CapacityBuffer", f"spec.{field_}", spec.get(field_))


def node_pool_admission(obj: Obj, old: Obj | None) -> None:
    """karpenter.sh/v1 NodePool: a template is required, replicas >= 0, and a NodePool
    cannot turn static (replicas set) or dynamic once made."""
    spec = obj.get("spec")
    if not isinstance(spec, dict) or not isinstance(spec.get("template"), dict):
        raise _invalid("NodePool", obj, "spec.template: Required value")
    _count(obj, "NodePool", "spec.replicas", spec.get("replicas"))
    if old is not None and ("replicas" in spec) != ("replicas" in old.get("spec", {})):
        raise _invalid(
            "NodePool",
            obj,
            "spec: Cannot transition NodePool between static (replicas set) and dynamic"
            " (replicas unset) provisioning modes",
        )


def workload_admission(obj: Obj, old: Obj | None) -> None:
    """Kueue's Workload (v1beta2 and v1beta1 alike): 1 to 8 pod sets, each with a template
    and a count >= 0 (1 by default), named "main" by default, a minCount from 1 to count; a Workload
    holding quota (QuotaReserved) with an admission assigns every pod set."""
    pod_sets = obj.get("spec", {}).get("podSets")
    if not isinstance(pod_sets, list) or not 1 <= len(pod_sets) <= 8:
        raise _invalid("Workload", obj, "spec.podSets: 1 to 8 items required")
    for i, pod_set in enumerate(pod_sets):
        pod_set.setdefault("name", "main")
        pod_set.setdefault("count", 1)
        if not isinstance(pod_set.get("template"), dict):
            raise _invalid("Workload", obj, f"spec.podSets[{i}].template: Required value")
        _count(obj, "Workload", f"spec.podSets[{i}].count", pod_set["count"])
        least = pod_set.get("minCount")
        if least is not None and not (isinstance(least, int) and 1 <= least <= pod_set["count"]):
            raise _invalid(
                "Workload", obj, "minCount should be positive and less or equal to count"
            )
    status = obj.get("status") or {}
    reserved = any(
        c.get("type") == "QuotaReserved" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )
    assigned = (status.get("admission") or {}).get("podSetAssignments")
    if reserved and "admission" in status and len(assigned or []) != len(pod_sets):
        raise _invalid(
            "Workload", obj, "podSetAssignments must have the same number of podSets as the spec"
        )


def _stop_policy(kind: str, obj: Obj) -> None:
    """A queue's spec.stopPolicy: None by default, else Hold or HoldAndDrain."""
    spec = obj.setdefault("spec", {})
    spec.setdefault("stopPolicy", "None")
    if spec["stopPolicy"] not in ("None", "Hold", "HoldAndDrain"):
        raise _invalid(kind, obj, f"spec.stopPolicy: Unsupported value: {spec['stopPolicy']!r}")


def cluster_queue_admission(obj: Obj, old: Obj | None) -> None:
    """Kueue's ClusterQueue (v1beta2 and v1beta1 alike): each resource group covers 1 or more
    resources and lists 1 or more flavors, each with as many resource quotas as the group
    covers (the CRD's validation rule; Kueue's webhook also wants them in the same order);
    stopPolicy defaulted."""
    _stop_policy("ClusterQueue", obj)
    for i, group in enumerate(obj.get("spec", {}).get("resourceGroups") or []):
        covered = group.get("coveredResources") or []
        flavors = group.get("flavors") or []
        if not covered or not flavors:
            raise _invalid(
                "ClusterQueue", obj, f"spec.resourceGroups[{i}]: coveredResources and flavors"
            )
        for j, flavor in enumerate(flavors):
            if len(flavor.get("resources") or []) != len(covered):
                raise _invalid(
                    "ClusterQueue",
                    obj,
                    f"spec.resourceGroups[{i}].flavors[{j}]: flavors must have the same"
                    " number of resources as the coveredResources",
                )


def local_queue_admission(obj: Obj, old: Obj | None) -> None:
    """Kueue's LocalQueue (v1beta2 and v1beta1 alike): spec.clusterQueue cannot change once set;
    stopPolicy defaulted."""
    _stop_policy("LocalQueue", obj)
    before = (old or {}).get("spec", {}).get("clusterQueue")
    if before and obj.get("spec", {}).get("clusterQueue") != before:
        raise _invalid("LocalQueue", obj, "spec.clusterQueue: field is immutable")


def cron_job_admission(obj: Obj, old: Obj | None) -> None:
    """batch/v1 CronJob: a schedule and a job template with a pod template required; the
    defaults the API server fills in (suspend false, concurrencyPolicy Allow, history
    limits 3 and 1). The schedule's syntax is left unchecked (see the module docstring)."""
    spec = obj.get("spec")
    if not isinstance(spec, dict) or not isinstance(spec.get("schedule"), str):
        raise _invalid("CronJob", obj, "spec.schedule: Required value")
    template = (spec.get("jobTemplate") or {}).get("spec") or {}
    if not isinstance(template.get("template"), dict):
        raise _invalid("CronJob", obj, "spec.jobTemplate.spec.template: Required value")
    spec.setdefault("suspend", False)
    spec.setdefault("concurrencyPolicy", "Allow")
    if spec["concurrencyPolicy"] not in ("Allow", "Forbid", "Replace"):
        policy = spec["concurrencyPolicy"]
        raise _invalid("CronJob", obj, f"spec.concurrencyPolicy: Unsupported value: {policy!r}")
    spec.setdefault("successfulJobsHistoryLimit", 3)
    spec.setdefault("failedJobsHistoryLimit", 1)
    _count(obj, "CronJob", "spec.jobTemplate.spec.parallelism", template.get("parallelism"))
    _count(obj, "CronJob", "spec.jobTemplate.spec.completions", template.get("completions"))


CRD_ADMISSION: dict[str, Admission] = {
    "capacitybuffers": capacity_buffer_admission,
    "nodepools": node_pool_admission,
    "workloads": workload_admission,
    "clusterqueues": cluster_queue_admission,
    "localqueues": local_queue_admission,
    "podtemplates": lambda obj, old: None,  # the generation counts template changes
    "cronjobs": cron_job_admission,  # defaults; the generation counts spec changes
}


class FakeKube:
    """The cluster state and the HTTP server around it; start() binds 127.0.0.1."""

    def __init__(self, resources: tuple[ResourceKind, ...] = RESOURCES) -> None:
        self.resources = resources
        self._objects: dict[tuple[str, str, str], Obj] = {}  # (plural, namespace, name)
        self._events: list[Event] = []
        self._compacted = 0
        self._rv = itertools.count(1)
        self._last_rv = 0
        self._changed = threading.Condition()
        self._closing = False
        self._connections: set[socket.socket] = set()
        self._generation = 0  # bumped by expire_watches(): open watches end
        self.eviction_policy: EvictionPolicy = lambda pod: None
        self.faults: ApiFaults | None = None
        self.admission: dict[str, Admission] = dict(CRD_ADMISSION)  # by plural
        # Called after every write with (event type, plural, object): tests play the
        # controllers that react to writes (Karpenter launching a NodePool's NodeClaims).
        self.on_write: list[Callable[[str, str, Obj], None]] = []
        self._released = threading.Event()  # set at stop(): held answers end
        self.requests: list[tuple[str, str]] = []  # (method, path?query) as received
        # Versions a test takes away ("/apis/<group>/<version>"): every path under them
        # answers 404, as for a CRD that does not serve that version (an older or newer
        # release of the controller that owns it).
        self.unserved: set[str] = set()
        # Plurals a test makes the server refuse over HTTP, with the status it answers:
        # 403 as for an account whose RBAC grants nothing on them, 500 as for an outage.
        self.refusals: dict[str, int] = {}
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ---- lifecycle -------------------------------------------------------------------
    def start(self) -> FakeKube:
        handler = type("Handler", (_Handler,), {"kube": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        # A short poll interval: shutdown() waits up to one interval, and tests stop often.
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._released.set()
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        # Kept-alive connections would go on being served: a stopped server is gone.
        for connection in list(self._connections):
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
        if self._thread is not None:
            self._thread.join(timeout=5)

    @property
    def url(self) -> str:
        assert self._server is not None, "start() the fake API server first"
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def write_kubeconfig(self, path: Path) -> Path:
        """A kubeconfig pointing at this server, as `kubectl` would write it."""
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "tester", "user": {"token": "fake-token"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "tester"}}],
            "current-context": "fake",
        }
        path.write_text(json.dumps(config))  # JSON is YAML
        return path

    # ---- state, used by tests directly and by the HTTP handler -------------------------
    def kind(self, plural: str) -> ResourceKind:
        for kind in self.resources:
            if kind.plural == plural:
                return kind
        raise ApiError(404, "NotFound", f"the server could not find resource {plural!r}")

    def _record(self, kind: ResourceKind, type_: str, obj: Obj, before: Obj | None = None) -> None:
        rv = int(obj["metadata"]["resourceVersion"])
        self._events.append(Event(rv, kind, type_, copy.deepcopy(obj), before))
        self._changed.notify_all()
        for react in self.on_write:
            react(type_, kind.plural, copy.deepcopy(obj))

    def _next_rv(self) -> str:
        self._last_rv = next(self._rv)
        return str(self._last_rv)

    def create(self, plural: str, obj: Obj, namespace: str | None = None) -> Obj:
        kind = self.kind(plural)
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        if kind.namespaced:
            meta["namespace"] = namespace or meta.get("namespace") or "default"
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if not meta.get("name"):
            raise ApiError(422, "Invalid", "metadata.name: Required value")
        key = (plural, meta.get("namespace", ""), meta["name"])
        with self._changed:
            if key in self._objects:
                raise ApiError(409, "AlreadyExists", f'{plural} "{meta["name"]}" already exists')
            if plural in self.admission:
                self.admission[plural](obj, None)
                meta["generation"] = 1
            obj["kind"] = kind.kind
            obj["apiVersion"] = kind.api_version
            meta["uid"] = str(uuid.uuid4())
            meta["creationTimestamp"] = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            meta["resourceVersion"] = self._next_rv()
            if plural == "pods":
                obj.setdefault("status", {}).setdefault("phase", "Pending")
            self._objects[key] = obj
            self._record(kind, "ADDED", obj)
            return copy.deepcopy(obj)

    def get(self, plural: str, name: str, namespace: str = "") -> Obj:
        with self._changed:
            _, key = self._existing(plural, name, namespace)
            return copy.deepcopy(self._objects[key])

    def objects(self, plural: str, namespace: str | None = None) -> list[Obj]:
        with self._changed:
            return [
                copy.deepcopy(o)
                for (p, ns, _), o in sorted(self._objects.items())
                if p == plural and (namespace is None or ns == namespace)
            ]

    def replace(self, plural: str, name: str, obj: Obj, namespace: str = "") -> Obj:
        with self._changed:
            kind, key = self._existing(plural, name, namespace)
            _check_version(plural, self._objects[key], obj)
            return self._store_update(kind, key, obj)

    def patch(self, plural: str, name: str, patch: Any, namespace: str = "", *, json_ops=False):
        """A JSON patch, or a merge patch; a merge patch naming a resourceVersion is
        applied only to that version (409 otherwise), as the API server does."""
        with self._changed:
            kind, key = self._existing(plural, name, namespace)
            current = self._objects[key]
            if json_ops:
                updated = json_patch(current, patch)
            else:
                _check_version(plural, current, patch)
                updated = merge_patch(current, patch)
            return self._store_update(kind, key, updated)

    def _existing(
        self, plural: str, name: str, namespace: str
    ) -> tuple[ResourceKind, tuple[str, str, str]]:
        """Kind and key of a stored object, 404 when there is none (call with the lock held)."""
        kind = self.kind(plural)
        key = (plural, namespace if kind.namespaced else "", name)
        if key not in self._objects:
            raise ApiError(404, "NotFound", f'{plural} "{name}" not found')
        return kind, key

    def _store_update(self, kind: ResourceKind, key: tuple[str, str, str], obj: Obj) -> Obj:
        current = self._objects[key]
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        for fixed in ("name", "namespace", "uid", "creationTimestamp"):
            if fixed in current["metadata"]:
                meta[fixed] = current["metadata"][fixed]
        if kind.plural in self.admission:
            self.admission[kind.plural](obj, current)
            # The generation counts changes of what the object asks (not its metadata or
            # status), as the API server counts them for custom resources.
            asked = {k: v for k, v in obj.items() if k not in _NOT_ASKED}
            before = {k: v for k, v in current.items() if k not in _NOT_ASKED}
            generation = int(current["metadata"].get("generation") or 1)
            meta["generation"] = generation + (asked != before)
        obj["kind"] = kind.kind
        obj["apiVersion"] = kind.api_version
        meta["resourceVersion"] = self._next_rv()
        self._objects[key] = obj
        self._record(kind, "MODIFIED", obj, current)
        return copy.deepcopy(obj)

    def delete(self, plural: str, name: str, namespace: str = "") -> Obj:
        with self._changed:
            kind, key = self._existing(plural, name, namespace)
            obj = self._objects.pop(key)
            obj["metadata"]["resourceVersion"] = self._next_rv()
            self._record(kind, "DELETED", obj)
            return copy.deepcopy(obj)

    def evict(
        self, name: str, namespace: str, dry_run: bool = False, uid: str | None = None
    ) -> Obj:
        """The pods/eviction subresource: refused as `eviction_policy` says, else the pod
        is deleted (`dry_run`, as `?dryRun=All`: only checked, nothing deleted; `uid`, the
        eviction's deleteOptions.preconditions: 409 when the pod has another)."""
        pod = self.get("pods", name, namespace)
        if uid is not None and pod["metadata"]["uid"] != uid:
            raise ApiError(
                409, "Conflict", f"Precondition failed: UID in precondition: {uid}, UID in"
                f" object meta: {pod['metadata']['uid']}"
            )  # fmt: skip
        refusal = self.eviction_policy(pod)
        if refusal is not None:
            code, message = refusal
            raise ApiError(code, HTTPStatus(code).phrase.replace(" ", ""), message)
        if not dry_run:
            self.delete("pods", name, namespace)
        return status_object(201, "", "")

    def compact(self) -> None:
        """Forget the event history, as etcd compaction does: older watches get 410 Gone."""
        with self._changed:
            self._compacted = self._last_rv
            self._events.clear()

    def expire_watches(self) -> None:
        """End every open watch and make every version handed out so far too old, as an
        API server restart after a compaction does: clients must re-list (410 Gone)."""
        with self._changed:
            self._next_rv()
            self._compacted = self._last_rv
            self._events.clear()
            self._generation += 1
            self._changed.notify_all()

    def watch_requests(self, plural: str) -> int:
        return sum(
            1 for m, p in self.requests if m == "GET" and f"/{plural}?" in p and "watch=" in p
        )

    def list_requests(self, plural: str) -> int:
        return sum(
            1
            for m, p in self.requests
            if m == "GET" and (p.endswith(f"/{plural}") or f"/{plural}?" in p) and "watch=" not in p
        )

    def list_state(self, kind: ResourceKind, namespace: str | None, labels: str, fields: str):
        with self._changed:
            items = [
                copy.deepcopy(o)
                for (p, ns, _), o in sorted(self._objects.items())
                if p == kind.plural
                and (namespace is None or ns == namespace)
                and selector_matches(o, labels, fields)
            ]
            return items, str(self._last_rv)

    def page(self, items: list[Obj], rv: str, query: dict) -> tuple[list[Obj], Obj]:
        """One page of a list (`limit`, `continue`) and its list metadata. Every page reports
        the first page's resourceVersion, as the API server's do; a token from before a
        compaction is refused (410), as the API server refuses one it can no longer serve."""
        after: tuple[str, str] | None = None
        token = query.get("continue")
        if token:
            try:
                state = json.loads(base64.urlsafe_b64decode(token.encode()))
                rv, after = str(state["rv"]), (str(state["after"][0]), str(state["after"][1]))
            except (ValueError, KeyError, IndexError, TypeError):
                raise ApiError(400, "BadRequest", "continue key is not valid") from None
            if int(rv) < self._compacted:
                raise ApiError(
                    410,
                    "Expired",
                    "The provided continue parameter is too old to display a consistent list"
                    " result. You can start a new list without the continue parameter.",
                )

        def key(obj: Obj) -> tuple[str, str]:
            meta = obj["metadata"]
            return meta.get("namespace") or "", meta["name"]

        if after is not None:
            items = [o for o in items if key(o) > after]
        metadata: Obj = {"resourceVersion": rv}
        limit = int(query.get("limit") or 0)
        if 0 < limit < len(items):
            state = {"rv": rv, "after": list(key(items[limit - 1]))}
            metadata["continue"] = base64.urlsafe_b64encode(json.dumps(state).encode()).decode()
            metadata["remainingItemCount"] = len(items) - limit
            items = items[:limit]
        return items, metadata

    def events_after(
        self,
        kind: ResourceKind,
        since: int,
        namespace: str | None,
        labels: str,
        fields: str,
        timeout: float,
        generation: int,
    ) -> list[Event] | None:
        """Events of `kind` newer than `since`, waiting up to `timeout` for one; None when
        `since` has been compacted away, the watch was expired or the server is closing."""
        with self._changed:
            if since < self._compacted or generation != self._generation:
                return None
            found: list[Event] = []

            def collect() -> bool:
                found.extend(
                    seen
                    for e in self._events
                    if e.resource_version > since
                    and e.kind == kind
                    and (namespace is None or e.object["metadata"].get("namespace") == namespace)
                    and (seen := _as_selected(e, labels, fields)) is not None
                )
                return bool(found) or self._closing or generation != self._generation

            self._changed.wait_for(collect, timeout=timeout)
            if self._closing or generation != self._generation:
                return None
            return found


def _as_selected(event: Event, labels: str, fields: str) -> Event | None:
    """`event` as a watch with these selectors sees it, as the API server sends it: a
    change that takes an object out of the selection is DELETED, one that brings it in
    ADDED (a pod that finishes leaves a watch of unfinished pods)."""
    now = selector_matches(event.object, labels, fields)
    if event.type != "MODIFIED" or event.before is None:
        return event if now else None
    was = selector_matches(event.before, labels, fields)
    if now and was:
        return event
    if now or was:
        return replace(event, type="ADDED" if now else "DELETED")
    return None


# The RBAC verb of each HTTP method on one object (a GET of a collection lists or watches).
_VERBS = {"GET": "get", "POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body are two writes: no 40 ms delayed ACK
    kube: FakeKube
    _lose_answer: float | None = None  # set per request: act, then hold the answer this long

    def setup(self) -> None:
        super().setup()
        self.kube._connections.add(self.connection)

    def finish(self) -> None:
        self.kube._connections.discard(self.connection)
        super().finish()

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet: pytest shows failures, not access logs

    # ---- routing ------------------------------------------------------------------------
    def _route(self) -> tuple[ResourceKind, str | None, str | None, str | None, dict]:
        """-> (kind, namespace or None, name or None, subresource or None, query)."""
        parts = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        segments = [s for s in parts.path.split("/") if s]
        if segments[:2] == ["api", "v1"]:
            prefix, rest = "/api/v1", segments[2:]
        elif segments[:1] == ["apis"] and len(segments) >= 3:
            prefix, rest = "/" + "/".join(segments[:3]), segments[3:]
        else:
            raise ApiError(404, "NotFound", f"no route for {parts.path}")
        namespace = None
        if len(rest) >= 3 and rest[0] == "namespaces":
            namespace, rest = rest[1], rest[2:]
        if not rest:
            raise ApiError(404, "NotFound", f"no route for {parts.path}")
        kind = self.kube.kind(rest[0])
        if prefix in self.kube.unserved or prefix not in (kind.prefix, *kind.also_at):
            raise ApiError(404, "NotFound", f"no route for {parts.path}")
        name = rest[1] if len(rest) > 1 else None
        sub = rest[2] if len(rest) > 2 else None
        refused = self.kube.refusals.get(kind.plural)
        if refused == 403:
            verb = _VERBS.get(self.command, self.command.lower())
            if self.command == "GET" and name is None:
                verb = "watch" if query.get("watch") else "list"
            group = kind.api_version.rpartition("/")[0]
            raise ApiError(
                403,
                "Forbidden",
                f'{kind.plural} is forbidden: User "system:serviceaccount:gpuscale:tester"'
                f' cannot {verb} resource "{kind.plural}" in API group "{group}"',
            )
        if refused is not None:
            raise ApiError(refused, HTTPStatus(refused).phrase.replace(" ", ""), "refused")
        return kind, namespace, name, sub, query

    def _body(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(length) or b"null")

    def _inject(self, faults: ApiFaults) -> bool:
        """Draw a fault for this request and apply it; True when the request ends here."""
        fault = faults.draw()
        if fault == "error":
            self.rfile.read(int(self.headers.get("Content-Length") or 0))  # keep-alive
            self._send(500, status_object(500, "InternalError", "injected fault"))
            return True
        if fault == "timeout":
            self._hold(faults.hold_s)
            return True
        if fault == "answer_lost":
            self._lose_answer = faults.hold_s
        return False

    def _hold(self, seconds: float) -> None:
        """Answer nothing for `seconds`, then drop the connection (a timeout, as the client
        sees it)."""
        self.kube._released.wait(seconds)
        self.close_connection = True

    def _send(self, code: int, payload: Obj) -> None:
        if self._lose_answer is not None:
            self._hold(self._lose_answer)
            return
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _handle(self, method: str) -> None:
        self.kube.requests.append((method, self.path))
        self._lose_answer = None
        try:
            kind, namespace, name, sub, query = self._route()
            ns = namespace or ""
            # Go's ParseBool: older clients send "True".
            watching = query.get("watch") in ("1", "t", "T", "true", "TRUE", "True")
            faults = self.kube.faults
            if faults is not None and not watching and self._inject(faults):
                return
            if method == "GET" and name is None:
                if watching:
                    self._watch(kind, namespace, query)
                    return
                items, rv = self.kube.list_state(
                    kind, namespace, query.get("labelSelector", ""), query.get("fieldSelector", "")
                )
                items, metadata = self.kube.page(items, rv, query)
                self._send(
                    200,
                    {
                        "kind": kind.kind + "List",
                        "apiVersion": kind.api_version,
                        "metadata": metadata,
                        "items": items,
                    },
                )
            elif method == "GET":
                self._send(200, self.kube.get(kind.plural, name, ns))
            elif method == "POST" and sub == "eviction":
                options = (self._body() or {}).get("deleteOptions") or {}
                uid = (options.get("preconditions") or {}).get("uid")
                dry_run = query.get("dryRun") == "All"
                self._send(201, self.kube.evict(name or "", ns, dry_run=dry_run, uid=uid))
            elif method == "POST" and sub == "binding":
                target = self._body()["target"]["name"]
                self.kube.patch(kind.plural, name or "", {"spec": {"nodeName": target}}, ns)
                self._send(201, status_object(201, "", ""))
            elif method == "POST":
                body = self._body()
                if kind.status_subresource:
                    body.pop("status", None)  # set through /status only
                self._send(201, self.kube.create(kind.plural, body, namespace))
            elif method == "PUT":
                body = self._body()
                if kind.status_subresource:
                    current = self.kube.get(kind.plural, name or "", ns)
                    if sub == "status":
                        version = body.get("metadata", {}).get("resourceVersion")
                        current["metadata"]["resourceVersion"] = version  # still checked
                        body = {**current, "status": body.get("status")}
                    else:
                        body = {**body, "status": current.get("status")}
                self._send(200, self.kube.replace(kind.plural, name or "", body, ns))
            elif method == "PATCH":
                json_ops = self.headers.get("Content-Type", "").startswith("application/json-patch")
                body = self._body()
                if kind.status_subresource:
                    body = _status_split(body, json_ops, status=sub == "status")
                self._send(
                    200, self.kube.patch(kind.plural, name or "", body, ns, json_ops=json_ops)
                )
            elif method == "DELETE":
                self._send(200, self.kube.delete(kind.plural, name or "", ns))
            else:
                raise ApiError(405, "MethodNotAllowed", method)
        except ApiError as exc:
            self._send(exc.code, exc.status())

    def _watch(self, kind: ResourceKind, namespace: str | None, query: dict) -> None:
        labels = query.get("labelSelector", "")
        fields = query.get("fieldSelector", "")
        timeout = float(query.get("timeoutSeconds", 60))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def emit(type_: str, obj: Obj) -> None:
            line = json.dumps({"type": type_, "object": obj}).encode() + b"\n"
            self.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
            self.wfile.flush()

        generation = self.kube._generation
        start = query.get("resourceVersion", "")
        if start in ("", "0"):
            # No version: the current state as ADDED events first, as the API server does.
            items, rv = self.kube.list_state(kind, namespace, labels, fields)
            for item in items:
                emit("ADDED", item)
            since = int(rv)
        else:
            since = int(start)
        deadline = threading.Event()
        timer = threading.Timer(timeout, deadline.set)
        timer.start()
        try:
            while not deadline.is_set():
                events = self.kube.events_after(
                    kind, since, namespace, labels, fields, 0.2, generation
                )
                if events is None:
                    if since < self.kube._compacted:
                        gone = status_object(410, "Expired", f"too old resource version: {since}")
                        emit("ERROR", gone)
                    break
                for event in events:
                    emit(event.type, event.object)
                    since = event.resource_version
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client stopped watching
        finally:
            timer.cancel()
            self.close_connection = True

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_PUT(self) -> None:
        self._handle("PUT")

    def do_PATCH(self) -> None:
        self._handle("PATCH")

    def do_DELETE(self) -> None:
        self._handle("DELETE")


def _status_split(patch: Any, json_ops: bool, status: bool) -> Any:
    """The part of a patch a write may make: only the status through /status, everything
    but the status otherwise."""
    if json_ops:
        return [op for op in patch if op["path"].startswith("/status") == status]
    if status:
        return {"status": patch["status"]} if "status" in patch else {}
    return {k: v for k, v in patch.items() if k != "status"}


def label_selector_matches(selector: Obj | None, labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels and matchExpressions); a null selector selects nothing,
    an empty one everything, as for a policy/v1 PodDisruptionBudget."""
    if selector is None:
        return False
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for term in selector.get("matchExpressions") or []:
        key, operator, values = term["key"], term["operator"], term.get("values") or []
        if operator == "In" and labels.get(key) not in values:
            return False
        if operator == "NotIn" and key in labels and labels[key] in values:
            return False
        if operator == "Exists" and key not in labels:
            return False
        if operator == "DoesNotExist" and key in labels:
            return False
    return True


def disruption_budget_policy(kube: FakeKube) -> EvictionPolicy:
    """The API server's PodDisruptionBudget check for `kube.eviction_policy`: a pod that is
    not running (pending, finished) or already being deleted bypasses budgets; a pod under
    two budgets cannot be evicted (500); otherwise the eviction is refused with 429 unless
    the budget's healthy pods, less this one, still meet minAvailable (or the matching pods
    less maxUnavailable). Percentages round up, as the disruption controller's do."""

    def healthy(pod: Obj) -> bool:
        status = pod.get("status") or {}
        ready = [c for c in status.get("conditions") or [] if c.get("type") == "Ready"]
        return status.get("phase") == "Running" and all(c.get("status") == "True" for c in ready)

    def scaled(value: int | str, total: int) -> int:
        if isinstance(value, str) and value.endswith("%"):
            return -(-int(value[:-1]) * total // 100)
        return int(value)

    def policy(pod: Obj) -> tuple[int, str] | None:
        meta = pod["metadata"]
        if (pod.get("status") or {}).get("phase") != "Running" or meta.get("deletionTimestamp"):
            return None
        labels = meta.get("labels") or {}
        budgets = [
            b
            for b in kube.objects("poddisruptionbudgets", meta["namespace"])
            if label_selector_matches(b.get("spec", {}).get("selector"), labels)
        ]
        if not budgets:
            return None
        if len(budgets) > 1:
            return 500, (
                "This pod has more than one PodDisruptionBudget, which the eviction "
                "subresource does not support."
            )
        spec = budgets[0]["spec"]
        covered = [
            p
            for p in kube.objects("pods", meta["namespace"])
            if label_selector_matches(spec.get("selector"), p["metadata"].get("labels") or {})
        ]
        if "minAvailable" in spec:
            desired = scaled(spec["minAvailable"], len(covered))
        elif "maxUnavailable" in spec:
            desired = len(covered) - scaled(spec["maxUnavailable"], len(covered))
        else:
            desired = 0
        if sum(healthy(p) for p in covered) - 1 < desired:
            return 429, "Cannot evict pod as it would violate the pod's disruption budget."
        return None

    return policy
