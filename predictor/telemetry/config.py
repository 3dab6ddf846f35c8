"""Collector configuration: a YAML file plus environment variables, validated at start.

Environment variables override the file: `GPUSCALE_INTERVAL_S=30`,
`GPUSCALE_PROMETHEUS__URL=http://prometheus:9090` (nested fields joined by `__`). A source
is sampled when its section is present. An invalid value is reported as an `InputError`
that names the file and the field, so a bad config never reaches a running loop.

The Prometheus source's default demand series (`gpu_demand`, `running`, `pending`, one
`cluster` series each) read kube-state-metrics and count a pod as the Kubernetes source
does (`kube_objects.pod_requests` and `mig_gpus`): per resource, its containers' requests
summed or its largest init container's if more; a MIG instance of N compute slices as N/7
of a GPU; gpuscale's placeholders left out, by their namespace and, where
kube-state-metrics exports pod labels (its `--metric-labels-allowlist` naming the
placeholder label keys), by those labels. One difference remains: a pod sharing a GPU
(the GPU-share annotation) is counted whole, since PromQL cannot turn an annotation's
value into a number. Beside the Kubernetes source, which writes the same metrics per pool,
they are left out (`CollectorConfig.prometheus_settings`).
"""

from __future__ import annotations

import re
import socket
from pathlib import Path
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from predictor.foundation.config_files import FieldError, FileSettings, load_model
from predictor.telemetry.kube_objects import KUBE_NAMES, MIG_COMPUTE_SLICES, MIG_PROFILE_STARTS
from predictor.telemetry.sources import RetryPolicy

# DCGM exporter series carry pod labels that come and go with the pods on a GPU; keeping
# only the GPU's identity makes one stable series per GPU (max of one value is the value).
_GPU_LABELS = "Hostname, gpu, UUID, modelName"


# Where the scaler's placeholder pods live: they hold headroom, they are not demand, and
# counting them would make the scaler chase its own pre-positioned capacity.
PLACEHOLDER_NAMESPACE = "gpuscale-system"

# kube-state-metrics' request families: a pod's containers, and its init containers (which
# run one at a time before the others, so the largest of them counts, not their sum).
_CONTAINER_REQUESTS = "kube_pod_container_resource_requests"
_INIT_REQUESTS = "kube_pod_init_container_resource_requests"

# Bounds that keep the grid's arithmetic within pandas' timestamps (a backfill_s of 1e11
# was an OutOfBoundsTimedelta traceback at start) and the backfill within reason.
MAX_INTERVAL_S = 24 * 3600
MAX_BACKFILL_S = 366 * 24 * 3600


def _ksm_name(name: str) -> str:
    """How kube-state-metrics spells a Kubernetes name in a label name or value (a resource,
    `label_<key>` of kube_pod_labels): every character but letters, digits and underscores
    as an underscore, so nvidia.com/mig-3g.40gb is nvidia_com_mig_3g_40gb."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def _in_gpus(metric: str) -> str:
    """PromQL: the series of `metric` (a kube-state-metrics request family) that ask GPUs,
    in GPU equivalents: the GPU resource whole, a MIG instance of N compute slices as N/7
    (`mig_gpus`' rule, from its constants). A union: the branches never share a resource."""
    whole = f'{metric}{{resource="{_ksm_name(KUBE_NAMES.gpu_resource)}"}}'
    mig = (
        f'{metric}{{resource=~"{_ksm_name(KUBE_NAMES.mig_resource_prefix + start)}.*"}}'
        f" * {slices} / {MIG_COMPUTE_SLICES}"
        for slices, start in MIG_PROFILE_STARTS
    )
    return " or ".join((whole, *mig))


def _pod_gpus() -> str:
    """PromQL: GPU equivalents per pod and resource, as `pod_requests` counts them: its
    containers' requests summed, or its largest init container's if more. Each side is
    labelled apart first: `or` drops a right-hand series whose labels a left-hand one has,
    and a comparison drops a pod missing on either side. A container's request is taken
    once however many kube-state-metrics replicas export it (unsharded replicas, run for
    availability, each export every series; their copies differ only in target labels)."""
    containers = (
        "sum by (namespace, pod, resource) (max by (namespace, pod, container, resource)"
        f" ({_in_gpus(_CONTAINER_REQUESTS)}))"
    )
    init = f"max by (namespace, pod, resource) ({_in_gpus(_INIT_REQUESTS)})"
    return (
        "max by (namespace, pod, resource) ("
        f'label_replace({containers}, "part", "containers", "", "")'
        f' or label_replace({init}, "part", "init", "", ""))'
    )


def _counted_pods(phases: str, exclude_namespace: str) -> str:
    """PromQL: 1 per pod whose phase matches `phases`, but gpuscale's placeholders: those
    in their namespace, and those with the placeholder labels where kube-state-metrics
    exports them (kube_pod_labels has `label_<key>` only for keys its
    --metric-labels-allowlist names; where it has none, or no kube_pod_labels at all, the
    `unless` drops nothing)."""
    placeholder = ", ".join(
        f'label_{_ksm_name(key)}="{value}"' for key, value in KUBE_NAMES.placeholder_labels
    )
    return (
        f'max by (namespace, pod) (kube_pod_status_phase{{phase=~"{phases}",'
        f'namespace!="{exclude_namespace}"}} == 1)'
        f" unless on (namespace, pod) kube_pod_labels{{{placeholder}}}"
    )


def pod_gpu_requests(phases: str, exclude_namespace: str = PLACEHOLDER_NAMESPACE) -> str:
    """PromQL: GPUs asked by pods whose phase matches the regex `phases`, summed over the
    cluster (kube-state-metrics), counted as the Kubernetes source counts them (init
    containers, MIG instances, placeholders left out) but for a shared GPU, counted whole
    (see the module docstring). The `or` branch yields 0 only while kube-state-metrics is
    being scraped and no such pod exists, so its outage stays a gap, never a 0."""
    return (
        f"sum({_pod_gpus()} * on (namespace, pod) group_left ()"
        f" ({_counted_pods(phases, exclude_namespace)}))"
        " or on () (0 * count(kube_pod_status_phase))"
    )


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PromSeries(_Section):
    """One series family: a PromQL expression and how its results are named."""

    metric: str = Field(min_length=1, description="metric name in the store")
    query: str = Field(min_length=1, description="PromQL, evaluated instant or over a range")
    unique_id: str = Field(
        default="{Hostname}/{gpu}",
        description="series name: a Python format string over the result's labels",
    )
    labels: tuple[str, ...] = Field(
        default=("Hostname", "gpu", "UUID", "modelName"),
        description="result labels stored with the series (those present)",
    )


DEFAULT_SERIES: tuple[PromSeries, ...] = (
    PromSeries(metric="gpu_util", query=f"max by ({_GPU_LABELS}) (DCGM_FI_DEV_GPU_UTIL)"),
    PromSeries(metric="gpu_fb_used_mib", query=f"max by ({_GPU_LABELS}) (DCGM_FI_DEV_FB_USED)"),
    PromSeries(metric="gpu_fb_free_mib", query=f"max by ({_GPU_LABELS}) (DCGM_FI_DEV_FB_FREE)"),
    # The Helios demand definition: GPUs of running plus pending pods.
    PromSeries(
        metric="gpu_demand",
        query=pod_gpu_requests("Running|Pending"),
        unique_id="cluster",
        labels=(),
    ),
    PromSeries(metric="running", query=pod_gpu_requests("Running"), unique_id="cluster", labels=()),
    PromSeries(metric="pending", query=pod_gpu_requests("Pending"), unique_id="cluster", labels=()),
)


class PrometheusSettings(_Section):
    url: str = Field(pattern=r"^https?://", description="base URL of the Prometheus HTTP API")
    timeout_s: float = Field(default=10.0, gt=0)
    backfill_s: int = Field(
        default=6 * 3600,
        ge=0,
        le=MAX_BACKFILL_S,
        description="history fetched on start when the store has none (at most a year)",
    )
    chunk_steps: int = Field(
        default=1000, ge=1, le=11_000, description="grid points per range query (API max 11000)"
    )
    series: tuple[PromSeries, ...] = DEFAULT_SERIES

    @field_validator("url")
    @classmethod
    def _host_and_port(cls, url: str) -> str:
        # "http://" or "http://prometheus:90x0" passed the scheme pattern and failed every
        # sample, forever, as an outage.
        parts = urlsplit(url)
        try:
            parts.port  # noqa: B018 - reading it is the check
        except ValueError:
            raise ValueError(f"{url!r} has no valid port") from None
        if not parts.hostname:
            raise ValueError(f"{url!r} names no host")
        return url.rstrip("/")


class KubernetesSettings(_Section):
    kubeconfig: Path | None = Field(
        default=None, description="kubeconfig file; none: the in-cluster service account"
    )
    context: str | None = None
    pool_label: str = Field(default=KUBE_NAMES.pool_label, description="node label naming the pool")
    gpu_model_label: str = Field(default=KUBE_NAMES.gpu_model_label)
    gpu_resource: str = Field(default=KUBE_NAMES.gpu_resource)
    gpu_milli_annotation: str = Field(
        default=KUBE_NAMES.gpu_milli_annotation, description="pod annotation asking a GPU share"
    )
    kueue: bool = Field(
        default=False,
        description="count pending Kueue Workloads (kueue.x-k8s.io, v1beta2 or v1beta1, the newest"
        " served) as demand of the pools they target, before their pods exist",
    )
    watch_timeout_s: int = Field(default=300, ge=1, description="server-side watch timeout")
    request_timeout_s: float = Field(default=10.0, gt=0)


class NvmlSettings(_Section):
    hostname: str = Field(default_factory=socket.gethostname, min_length=1)


class RetrySettings(_Section):
    attempts: int = Field(default=3, ge=1)
    base_delay_s: float = Field(default=0.5, ge=0)
    factor: float = Field(default=2.0, ge=1)
    max_delay_s: float = Field(default=10.0, ge=0)

    def policy(self) -> RetryPolicy:
        return RetryPolicy(self.attempts, self.base_delay_s, self.factor, self.max_delay_s)


# What the Kubernetes source writes, one series per pool (`kubernetes.demand_batches`). The
# scaler plans every series of its demand metric; a Prometheus series of one of these
# metrics beside them (the default `cluster` one) would count the same pods twice.
POOL_METRICS = frozenset({"gpu_demand", "running", "pending", "capacity", "nodes", "queued"})


class CollectorConfig(FileSettings):
    """What `gpuscale collect` samples, how often, and how hard it retries. With both the
    Kubernetes and the Prometheus source, the pools' demand is the Kubernetes source's: the
    default Prometheus series leave its metrics out (`prometheus_settings`), and series set
    by hand may not write them."""

    interval_s: int = Field(
        default=15,
        ge=1,
        le=MAX_INTERVAL_S,
        description="seconds between samples (at most a day); also the backfill grid",
    )
    prometheus: PrometheusSettings | None = None
    kubernetes: KubernetesSettings | None = None
    nvml: NvmlSettings | None = None
    retry: RetrySettings = RetrySettings()

    @model_validator(mode="after")
    def _one_source_per_pool_metric(self) -> CollectorConfig:
        if self.prometheus is None or self.kubernetes is None:
            return self
        if "series" not in self.prometheus.model_fields_set:
            return self
        for i, series in enumerate(self.prometheus.series):
            if series.metric in POOL_METRICS:
                raise FieldError(
                    f"prometheus.series.{i}.metric",
                    f"{series.metric!r} is written per pool by the kubernetes source too;"
                    " the scaler would count the same demand twice: rename it, or leave it"
                    " to one source",
                )
        return self

    def prometheus_settings(self) -> PrometheusSettings | None:
        """The Prometheus source's settings as sampled: the default series without the
        Kubernetes source's metrics when it is sampled too."""
        if self.prometheus is None or self.kubernetes is None:
            return self.prometheus
        if "series" in self.prometheus.model_fields_set:
            return self.prometheus  # checked to write none of them
        kept = tuple(s for s in self.prometheus.series if s.metric not in POOL_METRICS)
        return self.prometheus.model_copy(update={"series": kept})


def load_config(path: Path) -> CollectorConfig:
    """Read and validate a collector config file; errors name the file, the line and the
    field."""
    return load_model(CollectorConfig, path)
