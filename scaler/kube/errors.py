"""How a failed Kubernetes API call is reported: one line naming the action and the API
server's own reason, never the client's configuration or headers."""

from __future__ import annotations

import contextlib
import json

import urllib3
from kubernetes.client import ApiException

API_ERRORS = (ApiException, urllib3.exceptions.HTTPError, OSError)


class KubeError(RuntimeError):
    """The API server refused an action or could not be reached."""


def kube_error(what: str, exc: Exception) -> KubeError:
    if isinstance(exc, ApiException):
        message = exc.reason or "error"
        with contextlib.suppress(ValueError, AttributeError):  # a body that is not a Status
            message = json.loads(exc.body or "{}").get("message") or message
        return KubeError(f"{what}: HTTP {exc.status}: {message}")
    return KubeError(f"{what}: {type(exc).__name__}: {exc}")
