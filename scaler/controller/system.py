"""The live system assembled from a `LiveConfig`: the cloud provider, the Kubernetes client,
the telemetry store, the decision log and the forecaster. `gpuscale scale` and
`gpuscale serve` both start from here, so they see the same cluster the same way."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from kubernetes import client as k8s

from predictor.foundation.errors import InputError
from predictor.telemetry.kubernetes import api_client
from predictor.telemetry.store import TelemetryStore
from predictor.telemetry.watch_cache import ClusterCache
from scaler.controller.config import KubernetesSection, LiveConfig, kube_names
from scaler.controller.journal import DecisionJournal
from scaler.controller.request_model import ServedRequestModel
from scaler.kube.timeouts import with_timeout
from scaler.planning.demand import ForecastModel
from scaler.providers.autoscaler import AutoscaledCloud
from scaler.providers.base import CloudProvider, ProviderError
from scaler.providers.karpenter import KarpenterCloud
from scaler.providers.stored_cloud import StoredCloud

T = TypeVar("T")


def kube_client(settings: KubernetesSection) -> k8s.ApiClient:
    """A plain `host` (kubectl proxy) first, else a kubeconfig, else the service account;
    every call bounded by `request_timeout_s`."""
    if settings.host is not None:
        api = k8s.ApiClient(k8s.Configuration(host=settings.host))
    else:
        api = api_client(settings)
    return with_timeout(api, settings.request_timeout_s)


def in_state_dir(config: LiveConfig, make: Callable[[Path], T], source: Path | None = None) -> T:
    """`make(state_dir)` (the store, a journal); a state_dir that cannot hold them (a
    file, a path under /proc, a read-only directory) is an `InputError` naming the
    config's field (`source`: the config file)."""
    try:
        return make(config.state_dir)
    except (OSError, sqlite3.Error) as exc:
        if isinstance(exc, FileExistsError):
            reason = "a file, not a directory"
        else:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise InputError(
            f"cannot keep state in {config.state_dir}: {reason}", path=source, column="state_dir"
        ) from None


def build_provider(config: LiveConfig, kube: k8s.ApiClient | None = None) -> CloudProvider:
    """The configured provider; static Karpenter NodePools and autoscaled pools are read
    (and set) through `kube`, the cluster's API client."""
    kind = config.provider.kind
    if kind == "aws":
        from scaler.providers.aws import AwsCloud

        assert config.provider.aws is not None  # the config validator made sure
        return AwsCloud(config.pools, config.provider.aws)
    if kind in ("karpenter", "autoscaler"):
        assert kube is not None and config.kubernetes is not None  # the validator made sure
        if kind == "autoscaler":
            return AutoscaledCloud(config.pools, kube, kube_names(config.kubernetes))
        assert config.provider.karpenter is not None
        return KarpenterCloud(config.pools, config.provider.karpenter, kube)
    sim = config.provider.simulated
    return StoredCloud(config.pools, sim, config.state_dir, initial_sizes=sim.initial_sizes)


@dataclass
class LiveSystem:
    config: LiveConfig
    provider: CloudProvider
    kube: k8s.ApiClient | None
    store: TelemetryStore
    log: DecisionJournal
    model: ForecastModel
    # The request-rate model (None: the planner keeps its seasonal table).
    requests: ServedRequestModel | None = None

    @classmethod
    def build(cls, config: LiveConfig, source: Path | None = None) -> LiveSystem:
        """The system `config` describes; what the config's checks could not tell before
        (a region or endpoint the credential chain supplies, a state_dir that cannot be
        written) is an `InputError` naming `source`, the config file, and the field."""
        kube = kube_client(config.kubernetes) if config.kubernetes is not None else None
        try:
            provider = build_provider(config, kube)
        except ProviderError as exc:
            # Nothing is asked of the cloud yet: what fails here is the configuration.
            raise InputError(str(exc), path=source, column="provider") from None
        return cls(
            config=config,
            provider=provider,
            kube=kube,
            store=in_state_dir(config, TelemetryStore, source),
            log=in_state_dir(config, DecisionJournal, source),
            model=ForecastModel.from_settings(config.model),
            requests=ServedRequestModel(config.model),
        )

    def read_through(self, cache: ClusterCache) -> None:
        """The provider reads the cluster from `cache`, the process's watched cluster
        cache, where it can (Karpenter's NodePools and NodeClaims, the nodes a node
        autoscaler sizes) instead of listing."""
        kinds = (KarpenterCloud, AutoscaledCloud)
        if isinstance(self.provider, kinds) and self.config.kubernetes is not None:
            self.provider.read_through(cache, self.config.kubernetes.request_timeout_s)

    def close(self) -> None:
        if self.kube is not None:
            self.kube.close()
