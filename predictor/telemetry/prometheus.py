"""Prometheus as a telemetry source: DCGM exporter GPU metrics and kube-state-metrics GPU
requests, read through prometheus-api-client.

Each configured series is one PromQL expression. A live sample is an instant query
evaluated at the sample's timestamp; history is a range query on the collector's grid,
fetched in chunks that stay under the API's 11,000 points per series. Values are what
Prometheus answers under its own rules (a gauge holds its last scraped value for the
lookback window); results that are not finite numbers are left out.
"""

from __future__ import annotations

import logging
import string
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
import requests
from prometheus_api_client import PrometheusApiClientException, PrometheusConnect
from urllib3.util.retry import Retry

from predictor.telemetry.config import PrometheusSettings, PromSeries
from predictor.telemetry.sources import BackfillSource, MetricBatch, SourceError

log = logging.getLogger(__name__)


def _utc(at: pd.Timestamp) -> Any:
    """A timezone-aware datetime: the client calls .timestamp(), which reads a naive one
    as local time."""
    return at.tz_localize("UTC").to_pydatetime()


def _template_fields(template: str) -> list[str]:
    return [field for _, field, _, _ in string.Formatter().parse(template) if field]


def _series_of(series: PromSeries, results: Any) -> list[dict[str, Any]]:
    """The answer as a list of series; a scalar or string result (`scalar(...)`, `time()`)
    is [stamp, value], which has no series to store."""
    if isinstance(results, list) and all(isinstance(r, dict) for r in results):
        return results
    raise SourceError(
        f"series {series.metric!r}: the query answered {_short(results)}, not a list of"
        " series: it must return an instant vector (a range matrix for history), not a"
        " scalar or a string"
    )


def _samples(series: PromSeries, result: dict[str, Any]) -> list[tuple[float, float]]:
    """(stamp, value) pairs of one result, which must be [stamp, "number"] pairs."""
    samples = [result["value"]] if "value" in result else result.get("values", [])
    try:
        return [(float(stamp), float(text)) for stamp, text in samples]
    except (TypeError, ValueError):
        raise SourceError(
            f"series {series.metric!r}: a result's samples are not [stamp, number] pairs:"
            f" {_short(samples)}"
        ) from None


def _short(answer: Any) -> str:
    text = repr(answer)
    return text if len(text) <= 80 else text[:77] + "..."


def result_points(
    series: PromSeries, results: Sequence[dict[str, Any]], at: pd.Timestamp | None
) -> MetricBatch:
    """Prometheus API results -> a batch. Instant results (`value`) are stamped `at`;
    range results (`values`) keep their own timestamps (whole milliseconds). An answer of
    another shape is a SourceError naming the series."""
    fields = _template_fields(series.unique_id)
    rows: list[dict[str, Any]] = []
    for result in _series_of(series, results):
        labels = result.get("metric")
        labels = labels if isinstance(labels, dict) else {}
        missing = [f for f in fields if f not in labels]
        if missing:
            raise SourceError(
                f"series {series.metric!r}: result lacks label(s) {missing} used by its"
                f" unique_id template {series.unique_id!r}"
            )
        uid = series.unique_id.format_map(labels)
        kept = {name: labels.get(name, "") for name in series.labels}
        for stamp, value in _samples(series, result):
            if not np.isfinite(value):
                continue
            ds = at if at is not None else pd.Timestamp(round(stamp * 1000), unit="ms")
            rows.append({"unique_id": uid, "ds": ds, "y": value, **kept})
    columns = ["unique_id", "ds", "y", *series.labels]
    points = pd.DataFrame(rows, columns=columns)
    points["ds"] = pd.to_datetime(points["ds"])
    points["y"] = points["y"].astype("float64")
    duplicated = points.duplicated(["unique_id", "ds"])
    if duplicated.any():
        uid = points.loc[duplicated, "unique_id"].iloc[0]
        raise SourceError(
            f"series {series.metric!r}: several results map to unique_id {uid!r}; aggregate"
            " them in the query or add labels to the template"
        )
    return MetricBatch(series.metric, points)


class PrometheusSource(BackfillSource):
    """The configured PromQL series of one Prometheus server."""

    name = "prometheus"

    def __init__(self, settings: PrometheusSettings) -> None:
        self.settings = settings
        self.chunk_steps = settings.chunk_steps
        # Retries belong to the collector (with backoff and gap records), not to the
        # HTTP layer, so one outage is not retried twice over.
        self._client = PrometheusConnect(
            url=settings.url, retry=Retry(total=0), timeout=settings.timeout_s
        )

    def available(self) -> bool:
        try:
            return self._client.check_prometheus_connection()
        except requests.RequestException:
            return False

    def _ask(self, series: PromSeries, call: Any) -> list[dict[str, Any]]:
        try:
            return call()
        except (requests.RequestException, PrometheusApiClientException, ValueError) as exc:
            raise SourceError(f"{self.settings.url}: {series.metric}: {exc}") from exc

    def sample(self, at: pd.Timestamp) -> list[MetricBatch]:
        params = {"time": f"{_utc(at).timestamp():.3f}"}
        return [
            result_points(
                series,
                self._ask(series, lambda s=series: self._client.custom_query(s.query, params)),
                at,
            )
            for series in self.settings.series
        ]

    def history(
        self, start: pd.Timestamp, end: pd.Timestamp, step: pd.Timedelta
    ) -> list[MetricBatch]:
        seconds = step.total_seconds()
        if seconds != int(seconds) or seconds < 1:
            raise ValueError(f"history step must be whole seconds, not {step}")
        return [
            result_points(
                series,
                self._ask(
                    series,
                    lambda s=series: self._client.custom_query_range(
                        s.query, _utc(start), _utc(end), step=f"{int(seconds)}s"
                    ),
                ),
                None,
            )
            for series in self.settings.series
        ]

    def close(self) -> None:
        self._client.close()
