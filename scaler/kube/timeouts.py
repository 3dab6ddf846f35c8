"""A Kubernetes client whose every call has a timeout.

The official client waits forever on a call made without `_request_timeout`, so an API
server that accepts the connection and never answers would stall the reconcile loop (and
the lease renewals and the service's re-lists) for good. Every call that names no timeout of
its own gets the default here, so it fails as a `KubeError` and the next pass starts over.
"""

from __future__ import annotations

from typing import Any

from kubernetes import client as k8s
from kubernetes.client import rest


class TimedRestClient(rest.RESTClientObject):
    def __init__(self, configuration: k8s.Configuration, timeout_s: float) -> None:
        super().__init__(configuration)
        self.timeout_s = timeout_s

    def request(  # the parent's signature, positional order included
        self,
        method: str,
        url: str,
        query_params: Any = None,
        headers: Any = None,
        body: Any = None,
        post_params: Any = None,
        _preload_content: bool = True,
        _request_timeout: Any = None,
    ) -> Any:
        timeout = self.timeout_s if _request_timeout is None else _request_timeout
        return super().request(
            method, url, query_params, headers, body, post_params, _preload_content, timeout
        )


def with_timeout(api: k8s.ApiClient, timeout_s: float) -> k8s.ApiClient:
    """`api`, its calls now bounded by `timeout_s` (connect and read) unless they say."""
    api.rest_client = TimedRestClient(api.configuration, timeout_s)
    return api
