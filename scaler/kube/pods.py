"""One pod read from the API server as it is now: what a bind reads of a pod the scheduler
never showed, and what defragmentation reads again right before an eviction."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from kubernetes import client as k8s

from scaler.kube.errors import Refusal, kube_call


def pod_json_now(api: k8s.ApiClient, namespace: str, name: str) -> dict[str, Any] | None:
    """The pod in its JSON form; None when it is gone. Raises KubeError."""
    core = k8s.CoreV1Api(api)
    found = kube_call(
        f"read pod {namespace}/{name}",
        lambda: core.read_namespaced_pod(name, namespace),
        expect=(HTTPStatus.NOT_FOUND,),
    )
    return None if isinstance(found, Refusal) else api.sanitize_for_serialization(found)
