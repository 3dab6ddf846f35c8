"""Scheduled jobs as a telemetry source: the GPUs CronJobs will ask for in the next hour.

CronJobs are read from the process's watched cluster cache (`watch_cache.shared_cache`,
listed once page by page, then watched; the same one the loop and the Kubernetes source
read), so a sample reads what the API server keeps current. Each sample is one point per
pool, `gpu_scheduled`: the GPUs of the CronJob runs due after the sample's time up to
`HORIZON` ahead (`cronjobs.scheduled_runs`: suspended CronJobs fire nothing, serial ones
count their next run only, runs that have fired count as their pods instead). Runs whose
template names no pool are the series `unpooled`, as pending pods are; a pool whose CronJobs
fire nothing within the hour reads 0. It is an input, not demand: the scaler reads the
CronJobs themselves to hold nodes for a run, and the series lets the forecaster and people
see what was known ahead.

Where the API server refuses to list CronJobs (403: the service account's RBAC grants no
`list` on batch/cronjobs; 404: the API server serves no batch/v1 CronJobs) the source
records nothing, says why once, and lists again at each sample, so a grant made later is
taken up there (the cache's own watch asks again every half minute). A schedule that cannot
be read leaves its CronJob out, said once while it lasts.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import pandas as pd
from kubernetes import client as k8s

from predictor.foundation.problem_log import ProblemLog
from predictor.telemetry.config import KubernetesSettings
from predictor.telemetry.cronjobs import ScheduledRuns, scheduled_runs
from predictor.telemetry.kubernetes import UNPOOLED, api_client, kube_names
from predictor.telemetry.sources import MetricBatch, Source, SourceError
from predictor.telemetry.watch_cache import (
    API_ERRORS,
    ClusterCache,
    Reflector,
    release_shared,
    shared_cache,
)

log = logging.getLogger(__name__)

METRIC = "gpu_scheduled"
HORIZON = timedelta(hours=1)
REFUSED = (403, 404)  # not allowed, or not served: not an outage


def scheduled_batches(scheduled: ScheduledRuns, at: pd.Timestamp) -> list[MetricBatch]:
    """One point per pool of the CronJobs read (`ScheduledRuns.gpus_by_pool`), stamped
    `at`; none when no CronJob asks GPUs."""
    by_pool = scheduled.gpus_by_pool()
    pools = sorted(by_pool, key=lambda p: (p is None, p or ""))
    points = pd.DataFrame(
        {
            "unique_id": [p if p is not None else UNPOOLED for p in pools],
            "ds": pd.Series([at] * len(pools), dtype="datetime64[ns]"),
            "y": pd.Series([by_pool[p] for p in pools], dtype="float64"),
            "unit": "gpus",
        }
    )
    return [MetricBatch(METRIC, points)] if len(points) else []


class ScheduledJobsSource(Source):
    """`gpu_scheduled` per pool, from the CronJobs watched (see the module docstring)."""

    name = "cronjobs"

    def __init__(
        self,
        settings: KubernetesSettings,
        client: k8s.ApiClient | None = None,
        horizon: timedelta = HORIZON,
    ) -> None:
        self.settings = settings
        self.horizon = horizon
        self._client = client or api_client(settings)
        self._names = kube_names(settings)
        self._cache: ClusterCache | None = None
        self._refusal = ProblemLog(log)
        self._schedules = ProblemLog(log)

    @property
    def cron_jobs(self) -> Reflector[Mapping[str, Any]] | None:
        """The watched CronJobs (kept as their JSON), once started."""
        return None if self._cache is None else self._cache.cronjobs

    def available(self) -> bool:
        try:
            k8s.BatchV1Api(self._client).list_cron_job_for_all_namespaces(
                limit=1, _request_timeout=self.settings.request_timeout_s
            )
            return True
        except (k8s.ApiException, OSError, ValueError):
            return False

    def start(self) -> None:
        """Read the process's watched cache (started here, or shared with the loop's); its
        first list of CronJobs is waited for here, so the first sample has them."""
        settings = self.settings
        self._cache = shared_cache(
            self._client, self._names, settings.watch_timeout_s, settings.request_timeout_s
        )
        self._cache.cronjobs.wait_listed(settings.request_timeout_s)

    def _read(self) -> list[Mapping[str, Any]] | None:
        """The CronJobs: the watched cache's, else (one-shot, or refused so far) listed
        now; None where the API server refuses to list them (`REFUSED`), said once while
        it lasts. Any other failure raises SourceError."""
        kind = self.cron_jobs
        if kind is None or kind.refused is not None:
            if kind is None:
                timeout = self.settings.request_timeout_s
                kind = ClusterCache(self._client, self._names, request_timeout_s=timeout).cronjobs
            try:
                kind.list()
            except k8s.ApiException as exc:
                if exc.status in REFUSED:
                    self._refusal.report(
                        [
                            f"CronJobs are not read (HTTP {exc.status}: the service account"
                            " may not list batch/cronjobs, or the API server serves none):"
                            " scheduled GPU demand is not recorded"
                        ]
                    )
                    return None
                raise SourceError(f"list cronjobs: {exc}") from exc
            except API_ERRORS as exc:
                raise SourceError(f"list cronjobs: {exc}") from exc
        elif not kind.listed or kind.down_since is not None:
            # A cache that is not being kept current is not an observation.
            raise SourceError(kind.error or "cronjobs not listed yet")
        self._refusal.report([])
        return kind.objects()

    def sample(self, at: pd.Timestamp) -> list[MetricBatch]:
        cron_jobs = self._read()
        if cron_jobs is None:
            return []
        now = pd.Timestamp(at).to_pydatetime()
        scheduled = scheduled_runs(cron_jobs, now, self.horizon, self._names)
        self._schedules.report(scheduled.problems)
        return scheduled_batches(scheduled, at)

    def close(self) -> None:
        if self._cache is not None:
            release_shared(self._cache)  # the loop's watches, where it shares them, go on
            self._cache = None
        self._client.close()
