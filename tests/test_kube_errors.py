"""`kube_call`, the one sorting of a failed API call: the statuses the caller expects come
back as a Refusal carrying the API server's message; any other status, and a transport
failure, is a KubeError naming the action."""

from __future__ import annotations

import json
from collections.abc import Callable
from http import HTTPStatus

import pytest
import urllib3
from kubernetes.client import ApiException

from scaler.kube.errors import KubeError, Refusal, kube_call


def refused(status: int, message: str = 'pods "x" not found') -> ApiException:
    exc = ApiException(status=status, reason=HTTPStatus(status).phrase)
    exc.body = json.dumps({"kind": "Status", "message": message})
    return exc


def failing(exc: Exception) -> Callable[[], None]:
    def request() -> None:
        raise exc

    return request


def test_an_answer_passes_through() -> None:
    assert kube_call("read pod ml/x", lambda: 42, expect=(HTTPStatus.NOT_FOUND,)) == 42


def test_an_expected_status_is_a_refusal_with_the_servers_message() -> None:
    answer = kube_call("read pod ml/x", failing(refused(404)), expect=(HTTPStatus.NOT_FOUND,))
    assert answer == Refusal(404, 'pods "x" not found')
    assert str(answer) == 'HTTP 404: pods "x" not found'
    conflict = kube_call("create lease", failing(refused(409, "exists")), expect=(409,))
    assert isinstance(conflict, Refusal) and conflict.status == HTTPStatus.CONFLICT


def test_any_other_failure_is_a_kube_error_naming_the_action() -> None:
    with pytest.raises(KubeError, match=r'^read pod ml/x: HTTP 404: pods "x" not found$'):
        kube_call("read pod ml/x", failing(refused(404)))  # 404 not expected here
    with pytest.raises(KubeError, match=r"^create lease: HTTP 500: boom$"):
        kube_call("create lease", failing(refused(500, "boom")), expect=(409,))
    with pytest.raises(KubeError, match=r"^list nodes: MaxRetryError: "):
        kube_call("list nodes", failing(urllib3.exceptions.MaxRetryError(None, "/", "refused")))
    with pytest.raises(KubeError, match=r"^list nodes: ConnectionRefusedError: "):
        kube_call("list nodes", failing(ConnectionRefusedError("refused")))
    body = ApiException(status=403, reason="Forbidden")
    body.body = "<html>not a Status</html>"
    with pytest.raises(KubeError, match=r"^bind: HTTP 403: Forbidden$"):
        kube_call("bind", failing(body))
