"""Leader election on a coordination.k8s.io/v1 Lease, so two replicas never act at once.

The protocol is client-go's: the leader writes its `holderIdentity` and a fresh
`renewTime` every `retry_s`; every write is a PUT carrying the resourceVersion it read,
so two replicas that race for the lease cannot both win (the API server answers 409 to
the second). A replica takes over only when the lease is free or has not changed for
`duration_s` by ITS OWN clock (it never compares another machine's timestamps with its
own, so clock skew cannot make it steal a live lease). A leader that has not renewed for
`renew_deadline_s` (< `duration_s`) stops acting before anyone else may start.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from http import HTTPStatus

from kubernetes import client as k8s

from scaler.controller.config import LeaseSection
from scaler.kube.errors import KubeError, Refusal, kube_call

log = logging.getLogger(__name__)


class NotLeader(RuntimeError):
    """This replica does not hold the lease (or could not renew it in time)."""


def _micro_time(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    def __init__(
        self,
        api: k8s.ApiClient,
        settings: LeaseSection,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.settings = settings
        self.identity = settings.identity
        self._api = k8s.CoordinationV1Api(api)
        self._clock = clock
        self._wall = wall
        self._renewed_at: float | None = None  # our clock, when we last renewed
        self._observed_version: str | None = None
        self._observed_at = 0.0  # our clock, when the lease last changed before our eyes
        self.holder: str | None = None  # the holder seen last
        self.transitions = 0

    # ---- queries -------------------------------------------------------------------------
    def is_leader(self) -> bool:
        """Whether this replica may act now (it renewed within the renew deadline)."""
        return (
            self._renewed_at is not None
            and self._clock() - self._renewed_at < self.settings.renew_deadline_s
        )

    def check(self) -> None:
        """Before an action: raise NotLeader unless this replica may act now."""
        if self.is_leader():
            return
        if self.holder == self.identity:
            raise NotLeader(
                f"lease {self.settings.name} not renewed within"
                f" {self.settings.renew_deadline_s:g} s"
            )
        raise NotLeader(f"lease {self.settings.name} is held by {self.holder or 'nobody'}")

    def run(self, stop: threading.Event) -> None:
        """Acquire and renew every `retry_s` until `stop` (a daemon thread, as client-go
        renews beside the work, so a long drain does not let the lease lapse)."""
        while not stop.is_set():
            self.try_acquire_or_renew()
            stop.wait(self.settings.retry_s)

    # ---- the protocol ----------------------------------------------------------------------
    def try_acquire_or_renew(self) -> bool:
        """One round: take the lease if it is free or expired, renew it if ours."""
        s = self.settings
        now = self._clock()
        try:
            lease = kube_call(
                "read lease",
                lambda: self._api.read_namespaced_lease(s.name, s.namespace),
                expect=(HTTPStatus.NOT_FOUND,),
            )
        except KubeError as exc:
            return self._failed(str(exc))
        if isinstance(lease, Refusal):
            return self._create(now)

        spec = lease.spec or k8s.V1LeaseSpec()
        version = lease.metadata.resource_version
        if version != self._observed_version:
            self._observed_version, self._observed_at = version, now
        holder = spec.holder_identity or None
        self.holder = holder
        self.transitions = spec.lease_transitions or 0
        ours = holder == self.identity
        duration = spec.lease_duration_seconds or s.duration_s
        if holder is not None and not ours and now < self._observed_at + duration:
            self._renewed_at = None
            return False
        stamp = self._wall()
        acquired = spec.acquire_time if ours and isinstance(spec.acquire_time, datetime) else stamp
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {
                "name": s.name,
                "namespace": s.namespace,
                "resourceVersion": version,
            },
            "spec": {
                "holderIdentity": self.identity,
                "leaseDurationSeconds": s.duration_s,
                "acquireTime": _micro_time(acquired),
                "renewTime": _micro_time(stamp),
                "leaseTransitions": self.transitions + (0 if ours else 1),
            },
        }
        try:
            updated = kube_call(
                "update lease",
                lambda: self._api.replace_namespaced_lease(s.name, s.namespace, body),
                expect=(HTTPStatus.CONFLICT,),
            )
        except KubeError as exc:
            return self._failed(str(exc))
        if isinstance(updated, Refusal):  # another replica wrote first: it won this round
            self._renewed_at = None
            return False
        if not ours:
            log.info("%s acquired lease %s/%s", self.identity, s.namespace, s.name)
        self._won(updated, now)
        return True

    def release(self) -> None:
        """Give the lease up (on shutdown) so another replica takes over at once."""
        if self._renewed_at is None:
            return
        s = self.settings
        try:
            lease = kube_call(
                "read lease", lambda: self._api.read_namespaced_lease(s.name, s.namespace)
            )
            if (lease.spec.holder_identity or None) != self.identity:
                return
            body = {
                "metadata": {
                    "name": s.name,
                    "namespace": s.namespace,
                    "resourceVersion": lease.metadata.resource_version,
                },
                "spec": {
                    "holderIdentity": None,
                    "leaseDurationSeconds": 1,
                    "renewTime": _micro_time(self._wall()),
                    "leaseTransitions": lease.spec.lease_transitions or 0,
                },
            }
            kube_call(
                "release lease",
                lambda: self._api.replace_namespaced_lease(s.name, s.namespace, body),
            )
        except KubeError as exc:
            log.warning("could not release lease %s: %s", s.name, exc)
        finally:
            self._renewed_at = None

    # ---- internals -------------------------------------------------------------------------
    def _create(self, now: float) -> bool:
        s = self.settings
        stamp = _micro_time(self._wall())
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": s.name, "namespace": s.namespace},
            "spec": {
                "holderIdentity": self.identity,
                "leaseDurationSeconds": s.duration_s,
                "acquireTime": stamp,
                "renewTime": stamp,
                "leaseTransitions": 0,
            },
        }
        try:
            created = kube_call(
                "create lease",
                lambda: self._api.create_namespaced_lease(s.namespace, body),
                expect=(HTTPStatus.CONFLICT,),
            )
        except KubeError as exc:
            return self._failed(str(exc))
        if isinstance(created, Refusal):  # created meanwhile by another replica
            return False
        log.info("%s acquired new lease %s/%s", self.identity, s.namespace, s.name)
        self._won(created, now)
        return True

    def _won(self, lease: k8s.V1Lease, now: float) -> None:
        self._renewed_at = now
        self._observed_version = lease.metadata.resource_version
        self._observed_at = now
        self.holder = self.identity
        self.transitions = (lease.spec.lease_transitions or 0) if lease.spec else 0

    def _failed(self, why: str) -> bool:
        # Keep leading until the renew deadline passes: one failed round is not a lost lease.
        log.warning("lease %s: %s", self.settings.name, why)
        return self.is_leader()
