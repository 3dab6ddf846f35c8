"""The collector: samples the configured sources on a fixed grid into the telemetry store.

Every source runs in its own thread on the same grid (multiples of the interval since the
epoch, so the points of all sources line up and a restart lands on the same timestamps,
which the store's upsert makes idempotent). A source that fails is retried with backoff;
if it stays down, the sample it owed is recorded as a gap and the others carry on. On
start, sources that keep history (Prometheus) are backfilled from where the store stops,
or over the configured window when it has nothing from them.

With the Kubernetes source come the scheduled jobs (`scheduled_jobs`): the GPUs CronJobs
will ask for in the next hour, per pool, a source of its own so that a cluster that does
not let the collector read CronJobs still records its pools' demand.

The collector exposes its own health through prometheus-client: points written, source
errors, gaps, and the lag of each source (seconds since its newest point).
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pandas as pd
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from predictor.foundation.errors import InputError
from predictor.telemetry.config import CollectorConfig
from predictor.telemetry.sources import (
    BackfillSource,
    MetricBatch,
    RetryPolicy,
    Source,
    SourceError,
    chunk_ranges,
    with_retries,
)
from predictor.telemetry.store import TelemetryStore

log = logging.getLogger(__name__)

# What a store that cannot take a write raises: input it refuses (a unit conflict), a
# database locked past its busy timeout or damaged, a disk that is full.
_STORE_ERRORS = (InputError, sqlite3.Error, OSError)

Clock = Callable[[], pd.Timestamp]


def utc_now() -> pd.Timestamp:
    return pd.Timestamp.now(tz="UTC").tz_localize(None)


@dataclass
class CollectorMetrics:
    """The collector's own metrics, in a registry of their own (no process globals)."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.points = Counter(
            "gpuscale_collector_points_written",
            "Points written to the store",
            ["source", "metric"],
            registry=r,
        )
        self.errors = Counter(
            "gpuscale_collector_source_errors",
            "Samples a source failed to deliver after its retries",
            ["source"],
            registry=r,
        )
        self.gaps = Counter(
            "gpuscale_collector_gaps", "Gaps recorded in the store", ["source"], registry=r
        )
        self.up = Gauge(
            "gpuscale_collector_source_up",
            "1 when the last sample succeeded",
            ["source"],
            registry=r,
        )
        self.lag = Gauge(
            "gpuscale_collector_lag_seconds",
            "Seconds from the newest point written by a source to now",
            ["source"],
            registry=r,
        )

    # All interfaces by default: Prometheus scrapes the pod IP.
    def serve(self, port: int, addr: str = "0.0.0.0") -> Callable[[], None]:  # nosec B104
        """Serve /metrics over HTTP; returns the function that stops it."""
        server, thread = start_http_server(port, addr=addr, registry=self.registry)

        def stop() -> None:
            server.shutdown()
            server.server_close()
            thread.join(timeout=5)

        return stop


@dataclass(frozen=True)
class SampleOutcome:
    source: str
    at: pd.Timestamp
    points: int
    error: str | None = None


class Collector:
    """Moves points from sources into the store; see the module docstring."""

    def __init__(
        self,
        store: TelemetryStore,
        sources: Sequence[Source],
        interval: pd.Timedelta,
        retry: RetryPolicy,
        metrics: CollectorMetrics | None = None,
        clock: Clock = utc_now,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.store = store
        self.interval = pd.Timedelta(interval)
        self.retry = retry
        self.metrics = metrics or CollectorMetrics()
        self.clock = clock
        self.sleep = sleep
        self._newest: dict[str, pd.Timestamp] = {}
        self._down: dict[str, int] = {}  # source -> consecutive failed samples
        self.sources = [s for s in sources if self._keep(s)]
        for source in self.sources:
            self.metrics.lag.labels(source.name).set_function(
                lambda name=source.name: self._lag_seconds(name)
            )

    @staticmethod
    def _keep(source: Source) -> bool:
        if source.fixed_availability and not source.available():
            # The source has said why, once; a second message would only repeat it.
            log.debug("source %s left out: not available on this machine", source.name)
            return False
        return True

    def _lag_seconds(self, name: str) -> float:
        newest = self._newest.get(name)
        return float("nan") if newest is None else (self.clock() - newest).total_seconds()

    def grid_floor(self, moment: pd.Timestamp) -> pd.Timestamp:
        return moment.floor(self.interval)

    # ---- writing ------------------------------------------------------------------------
    def _write(self, source: Source, batches: list[MetricBatch]) -> int:
        """Write one answer of a source in one transaction, so a sample is stored whole or
        not at all (a gap is recorded for one that was not: never a value inside a gap)."""
        kept = [batch for batch in batches if len(batch)]
        if not kept:
            return 0
        written = self.store.append_metrics(
            [(batch.metric, batch.points) for batch in kept], source=source.name
        )
        for batch in kept:
            self.metrics.points.labels(source.name, batch.metric).inc(len(batch))
            newest = batch.points["ds"].max()
            if source.name not in self._newest or newest > self._newest[source.name]:
                self._newest[source.name] = newest
        return written

    def _gap(self, source: Source, start: pd.Timestamp, end: pd.Timestamp, reason: str) -> None:
        try:
            self.store.record_gap(source.name, start, end, reason)
        except _STORE_ERRORS as exc:
            # The store that could not take the points may not take the gap either; the
            # sampling goes on, and the error count says what was lost.
            log.error("cannot record the gap of %s %s..%s: %s", source.name, start, end, exc)
            return
        self.metrics.gaps.labels(source.name).inc()

    # ---- backfill -----------------------------------------------------------------------
    def backfill(
        self,
        window: pd.Timedelta,
        now: pd.Timestamp | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> int:
        """History of every backfill source up to the grid point before `now`, starting
        after its newest stored point (or `window` ago when it has none). A chunk that
        cannot be fetched is a gap, and so is the rest of that source's range: a source
        that is down is not asked again chunk by chunk. Returns points written."""
        now = now or self.clock()
        end = self.grid_floor(now) - self.interval
        plans = []
        for source in self.sources:
            if not isinstance(source, BackfillSource) or window <= pd.Timedelta(0):
                continue
            start = end - window
            stored = self.store.series()
            mine = stored[stored["source"] == source.name]
            if len(mine):
                start = max(start, mine["last"].max() + self.interval)
            plans.append((source, chunk_ranges(start, end, self.interval, source.chunk_steps)))
        total_chunks = sum(len(chunks) for _, chunks in plans)
        done = written = 0
        for source, chunks in plans:
            for first, last in chunks:
                try:
                    batches = with_retries(
                        lambda s=source, a=first, b=last: s.history(a, b, self.interval),
                        self.retry,
                        f"backfill {source.name} {first}..{last}",
                        self.sleep,
                    )
                except SourceError as exc:
                    log.error("backfill of %s stopped at %s: %s", source.name, first, exc)
                    self.metrics.errors.labels(source.name).inc()
                    self._gap(source, first, end, f"backfill failed: {exc}")
                    done += len(chunks) - chunks.index((first, last))
                    break
                written += self._write(source, batches)
                done += 1
                if progress is not None:
                    progress(done, total_chunks)
        return written

    # ---- live samples -------------------------------------------------------------------
    def collect(self, source: Source, at: pd.Timestamp) -> SampleOutcome:
        """Sample one source at grid point `at` (with retries) and write what it gave; if it
        failed, or the store refused it, say why (the caller records the gap)."""
        try:
            batches = with_retries(
                lambda: source.sample(at), self.retry, f"sample {source.name}", self.sleep
            )
        except SourceError as exc:
            return self._failed(source, at, str(exc))
        except Exception as exc:
            # A source's bug or an answer it could not read: one sample lost, not every
            # later one (the source's thread would end, its up gauge frozen at 1).
            return self._failed(source, at, f"{type(exc).__name__}: {exc}", unexpected=True)
        try:
            written = self._write(source, batches)
        except _STORE_ERRORS as exc:
            return self._failed(source, at, f"store refused the sample: {exc}")
        failures = self._down.pop(source.name, 0)
        if failures:
            log.warning("source %s is back after %d failed samples", source.name, failures)
        self.metrics.up.labels(source.name).set(1)
        return SampleOutcome(source.name, at, written)

    def _failed(
        self, source: Source, at: pd.Timestamp, error: str, unexpected: bool = False
    ) -> SampleOutcome:
        """Count a failed sample; the first of a run is logged (with the traceback when the
        failure was no SourceError), the rest only counted."""
        failures = self._down.get(source.name, 0) + 1
        self._down[source.name] = failures
        if failures == 1:
            log.error(
                "source %s is down: %s; recording gaps until it returns",
                source.name,
                error,
                exc_info=unexpected,
            )
        self.metrics.errors.labels(source.name).inc()
        self.metrics.up.labels(source.name).set(0)
        return SampleOutcome(source.name, at, 0, error)

    def collect_once(self, now: pd.Timestamp | None = None) -> list[SampleOutcome]:
        """One sample of every source at the current grid point; failures become gaps."""
        at = self.grid_floor(now or self.clock())
        outcomes = []
        for source in self.sources:
            outcome = self.collect(source, at)
            if outcome.error is not None:
                self._gap(source, at, at, outcome.error)
            outcomes.append(outcome)
        return outcomes

    def _serve(self, source: Source, stop: threading.Event, at: pd.Timestamp) -> None:
        while True:
            delay = (at - self.clock()).total_seconds()
            if stop.wait(max(delay, 0.0)):
                return
            outcome = self.collect(source, at)
            # Next: the following grid point, or if sampling ran past it, the latest one
            # that has passed (sampled at once); any in between were missed.
            following = max(at + self.interval, self.grid_floor(self.clock()))
            last_missed = following - self.interval
            if outcome.error is not None:
                self._gap(source, at, last_missed, outcome.error)
            elif last_missed > at:
                self._gap(source, at + self.interval, last_missed, "sampling overran the interval")
            at = following

    def run(self, stop: threading.Event, start_at: pd.Timestamp | None = None) -> None:
        """Sample every source on the grid until `stop` is set (one thread per source),
        from grid point `start_at` (default: the next one)."""
        first = start_at if start_at is not None else self.grid_floor(self.clock()) + self.interval
        threads = [
            threading.Thread(
                target=self._serve,
                args=(source, stop, first),
                name=f"collect-{source.name}",
                daemon=True,
            )
            for source in self.sources
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()


def build_sources(config: CollectorConfig) -> list[Source]:
    """The sources a config names, in a fixed order (history first)."""
    sources: list[Source] = []
    prometheus = config.prometheus_settings()
    if prometheus is not None:
        from predictor.telemetry.prometheus import PrometheusSource

        sources.append(PrometheusSource(prometheus))
    if config.kubernetes is not None:
        from predictor.telemetry.kubernetes import KubernetesSource
        from predictor.telemetry.scheduled_jobs import ScheduledJobsSource

        sources.append(KubernetesSource(config.kubernetes))
        # The CronJobs' GPUs due in the next hour (`gpu_scheduled`), a source of its own:
        # a cluster whose RBAC does not let it read CronJobs still records its demand.
        sources.append(ScheduledJobsSource(config.kubernetes))
    if config.nvml is not None:
        from predictor.telemetry.nvml import NvmlSource

        sources.append(NvmlSource(config.nvml))
    return sources
