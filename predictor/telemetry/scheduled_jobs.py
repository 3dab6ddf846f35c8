"""Scheduled jobs as a telemetry source: the GPUs CronJobs will ask for in the next hour.

CronJobs are listed once and then watched (an informer, `kubernetes.Informer`, listing
page by page), so a sample reads a cache the API server keeps current. Each sample is one
point per pool, `gpu_scheduled`: the GPUs of the CronJob runs due after the sample's time
up to `HORIZON` ahead (`cronjobs.scheduled_runs`: suspended CronJobs fire nothing, serial
ones count their next run only, runs that have fired count as their pods instead). Runs
whose template names no pool are the series `unpooled`, as pending pods are; a pool whose
CronJobs fire nothing within the hour reads 0. It is an input, not demand: the scaler
reads the CronJobs themselves to hold nodes for a run, and the series lets the forecaster
and people see what was known ahead.

Where the API server refuses to list CronJobs (403: the service account's RBAC grants no
`list` on batch/cronjobs; 404: the API server serves no batch/v1 CronJobs) the source
records nothing, says why once, and asks again at each sample, so a grant made later is
taken up. A schedule that cannot be read leaves its CronJob out, said once while it lasts.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from datetime import timedelta

import pandas as pd
from kubernetes import client as k8s

from predictor.foundation.problem_log import ProblemLog
from predictor.telemetry.config import KubernetesSettings
from predictor.telemetry.cronjobs import ScheduledRuns, scheduled_runs
from predictor.telemetry.kubernetes import UNPOOLED, Informer, api_client, kube_names
from predictor.telemetry.paging import paged
from predictor.telemetry.sources import MetricBatch, Source, SourceError

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
        batch = k8s.BatchV1Api(self._client)
        # Kept as they come (JSON form): a CronJob's runs depend on the time it is sampled.
        self.cron_jobs = Informer(
            "cronjobs",
            paged(batch.list_cron_job_for_all_namespaces),
            self._client.sanitize_for_serialization,
            settings,
        )
        self._names = kube_names(settings)
        self._refusal = ProblemLog(log)
        self._schedules = ProblemLog(log)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watching = False  # start() was called: keep a watch once the list is allowed

    def available(self) -> bool:
        try:
            k8s.BatchV1Api(self._client).list_cron_job_for_all_namespaces(
                limit=1, _request_timeout=self.settings.request_timeout_s
            )
            return True
        except (k8s.ApiException, OSError, ValueError):
            return False

    def _listed(self) -> bool:
        """List the CronJobs; False where the API server refuses to (`REFUSED`), which is
        said once while it lasts. Any other failure raises SourceError."""
        try:
            self.cron_jobs.sync()
        except SourceError as exc:
            cause = exc.__cause__
            if isinstance(cause, k8s.ApiException) and cause.status in REFUSED:
                self._refusal.report(
                    [
                        f"CronJobs are not read (HTTP {cause.status}: the service account may"
                        " not list batch/cronjobs, or the API server serves none): scheduled"
                        " GPU demand is not recorded"
                    ]
                )
                return False
            raise
        self._refusal.report([])
        return True

    def start(self) -> None:
        """List the CronJobs and keep them watched in the background (the first list here,
        so the first sample has them; a refused or failed one is tried again at samples,
        or by the watch thread)."""
        self._watching = True
        with contextlib.suppress(SourceError):
            if not self._listed():
                return
        self._start_watch()

    def _start_watch(self) -> None:
        self._thread = threading.Thread(
            target=self.cron_jobs.run, args=(self._stop,), name="watch-cronjobs", daemon=True
        )
        self._thread.start()

    def sample(self, at: pd.Timestamp) -> list[MetricBatch]:
        if self._thread is None:
            # One-shot, or the list was refused so far: list now.
            if not self._listed():
                return []
            if self._watching:
                self._start_watch()
        elif self.cron_jobs.error is not None:
            raise SourceError(self.cron_jobs.error)
        now = pd.Timestamp(at).to_pydatetime()
        scheduled = scheduled_runs(self.cron_jobs.items(), now, self.horizon, self._names)
        self._schedules.report(scheduled.problems)
        return scheduled_batches(scheduled, at)

    def close(self) -> None:
        self._stop.set()
        self.cron_jobs.stop()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        self._client.close()
