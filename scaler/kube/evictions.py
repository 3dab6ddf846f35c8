"""Evictions through the Eviction API, as the drain and defragmentation ask them.

An eviction is refused, not failed, when a PodDisruptionBudget stands in the way (429) or
two budgets cover the pod (500); the refusal names the budget (listed only to say which:
the API server's answer stands either way). `dry_run` asks the same question without
evicting (`dryRun=All`), so a caller can learn before it disrupts anything. `uid` makes
the eviction a precondition on the pod read (409 when the name now holds another pod, as
a StatefulSet's pod comes back under its name), so a caller never evicts a pod it did
not decide on.
"""

from __future__ import annotations

from dataclasses import dataclass
from http import HTTPStatus

from kubernetes import client as k8s

from predictor.telemetry.kube_objects import KUBE_NAMES, KubeNames, PodRequest, read_pod
from scaler.kube.drainability import budgets_in, selector_matches
from scaler.kube.errors import KubeError, Refusal, kube_call
from scaler.kube.pods import pod_json_now


@dataclass(frozen=True, slots=True)
class BlockingPod:
    namespace: str
    name: str
    reason: str
    budget: str | None = None  # the PodDisruptionBudget that refused its eviction


def request_eviction(
    api: k8s.ApiClient, pod: PodRequest, dry_run: bool = False, uid: str | None = None
) -> BlockingPod | None:
    """Evict `pod` through the Eviction API (PodDisruptionBudgets respected), or with
    `dry_run` only ask whether it would be allowed; with `uid`, only the pod of that uid.
    A BlockingPod naming the refusal and the budget behind it; None when allowed (or the
    pod is already gone). Any other failure raises KubeError."""
    core = k8s.CoreV1Api(api)
    ns, name = pod.namespace, pod.name
    delete_options = (
        None if uid is None else k8s.V1DeleteOptions(preconditions=k8s.V1Preconditions(uid=uid))
    )
    eviction = k8s.V1Eviction(
        metadata=k8s.V1ObjectMeta(name=name, namespace=ns), delete_options=delete_options
    )
    options = {"dry_run": "All"} if dry_run else {}
    # 429: a budget refuses; 500: two budgets cover the pod; 404: already gone; 409: the
    # name holds a pod of another uid.
    answer = kube_call(
        f"evict {ns}/{name}",
        lambda: core.create_namespaced_pod_eviction(name, ns, eviction, **options),
        expect=(
            HTTPStatus.NOT_FOUND,
            HTTPStatus.CONFLICT,
            HTTPStatus.TOO_MANY_REQUESTS,
            HTTPStatus.INTERNAL_SERVER_ERROR,
        ),
    )
    if not isinstance(answer, Refusal) or answer.status == HTTPStatus.NOT_FOUND:
        return None
    if answer.status == HTTPStatus.CONFLICT:
        return BlockingPod(ns, name, f"{answer} (another pod of that name now)")
    return BlockingPod(ns, name, str(answer), _budget_of(api, pod))


def read_pod_now(
    api: k8s.ApiClient, namespace: str, name: str, names: KubeNames = KUBE_NAMES
) -> tuple[PodRequest, str] | None:
    """The pod as it is now and its uid (for `request_eviction`); None when it is gone.
    Raises KubeError."""
    found = pod_json_now(api, namespace, name)
    if found is None:
        return None
    return read_pod(found, names), found["metadata"]["uid"]


def _budget_of(api: k8s.ApiClient, pod: PodRequest) -> str | None:
    labels = dict(pod.labels)
    try:
        budgets = budgets_in(api, pod.namespace)
    except KubeError:
        return None  # naming the budget is a courtesy; the refusal stands anyway
    names = sorted(b.metadata.name for b in budgets if selector_matches(b.spec.selector, labels))
    return ", ".join(names) or None
