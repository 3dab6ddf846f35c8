"""How a failed Kubernetes API call is reported: one line naming the action and the API
server's own reason, never the client's configuration or headers.

`kube_call` is the one place a call's failure is sorted: the answers the caller expects
(404 where absent is fine, 409 where another writer got there first) come back as a
`Refusal` to act on; everything else, HTTP or transport, raises `KubeError`.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TypeVar, overload

import urllib3
from kubernetes.client import ApiException

API_ERRORS = (ApiException, urllib3.exceptions.HTTPError, OSError)

T = TypeVar("T")


class KubeError(RuntimeError):
    """The API server refused an action or could not be reached."""


@dataclass(frozen=True, slots=True)
class Refusal:
    """An API server's answer the caller said to expect (`kube_call`'s `expect`)."""

    status: int
    message: str

    def __str__(self) -> str:
        return f"HTTP {self.status}: {self.message}"


def _refusal(exc: ApiException) -> Refusal:
    message = exc.reason or "error"
    with contextlib.suppress(ValueError, AttributeError):  # a body that is not a Status
        message = json.loads(exc.body or "{}").get("message") or message
    return Refusal(exc.status, message)


def kube_error(what: str, exc: Exception) -> KubeError:
    if isinstance(exc, ApiException):
        return KubeError(f"{what}: {_refusal(exc)}")
    return KubeError(f"{what}: {type(exc).__name__}: {exc}")


@overload
def kube_call(what: str, request: Callable[[], T]) -> T: ...


@overload
def kube_call(what: str, request: Callable[[], T], *, expect: Collection[int]) -> T | Refusal: ...


def kube_call(what: str, request: Callable[[], T], *, expect: Collection[int] = ()) -> T | Refusal:
    """`request()`'s result, or a `Refusal` when the API server answers with a status in
    `expect`; any other failure raises `KubeError` naming `what`."""
    try:
        return request()
    except ApiException as exc:
        if exc.status in expect:
            return _refusal(exc)
        raise kube_error(what, exc) from None
    except API_ERRORS as exc:
        raise kube_error(what, exc) from None
