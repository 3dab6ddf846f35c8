"""The collector's own rules: retries with backoff, gaps instead of values, sources that work
go on, backfill resumes where the store stops; and config validation."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from prometheus_client import generate_latest
from typer.testing import CliRunner

from predictor.foundation.errors import InputError
from predictor.telemetry.collector import Collector, CollectorMetrics, build_sources
from predictor.telemetry.config import POOL_METRICS, load_config
from predictor.telemetry.kubernetes import PoolDemand, demand_batches
from predictor.telemetry.prometheus import PrometheusSource
from predictor.telemetry.sources import (
    BackfillSource,
    MetricBatch,
    RetryPolicy,
    Source,
    SourceError,
    chunk_ranges,
)
from predictor.telemetry.store import TelemetryStore
from scaler.cli import app

T0 = pd.Timestamp("2026-01-01 00:00:00")
STEP = pd.Timedelta("15s")


def points(uid: str, stamps: list[pd.Timestamp], values: list[float]) -> pd.DataFrame:
    return pd.DataFrame({"unique_id": uid, "ds": stamps, "y": values})


class Steady(Source):
    """Always answers: y = minutes since T0."""

    name = "steady"

    def available(self) -> bool:
        return True

    def sample(self, at: pd.Timestamp) -> list[MetricBatch]:
        return [
            MetricBatch("gpu_demand", points("pool-a", [at], [(at - T0) / pd.Timedelta("1min")]))
        ]


class Flaky(Source):
    """Fails while `down` is set; counts attempts."""

    name = "flaky"

    def __init__(self) -> None:
        self.down = True
        self.attempts = 0

    def available(self) -> bool:
        return not self.down

    def sample(self, at: pd.Timestamp) -> list[MetricBatch]:
        self.attempts += 1
        if self.down:
            raise SourceError("connection refused")
        return [MetricBatch("gpu_util", points("node/0", [at], [50.0]))]


class History(BackfillSource):
    """Keeps y = seconds since T0 on every grid point; can fail from a given time on."""

    name = "history"
    chunk_steps = 4

    def __init__(self, fail_from: pd.Timestamp | None = None) -> None:
        self.calls: list[tuple[pd.Timestamp, pd.Timestamp]] = []
        self.fail_from = fail_from

    def available(self) -> bool:
        return True

    def sample(self, at: pd.Timestamp) -> list[MetricBatch]:
        return self.history(at, at, STEP)

    def history(self, start, end, step) -> list[MetricBatch]:
        self.calls.append((start, end))
        if self.fail_from is not None and end >= self.fail_from:
            raise SourceError("timeout")
        stamps = list(pd.date_range(start, end, freq=step))
        values = [(s - T0).total_seconds() for s in stamps]
        return [MetricBatch("gpu_demand", points("cluster", stamps, values))]


def test_retry_policy_backs_off_exponentially_to_a_cap() -> None:
    policy = RetryPolicy(attempts=6, base_delay_s=0.5, factor=2, max_delay_s=3)
    assert list(policy.delays()) == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_chunk_ranges_cover_the_grid_without_overlap() -> None:
    ranges = chunk_ranges(T0 + pd.Timedelta("5s"), T0 + pd.Timedelta("150s"), STEP, 4)
    assert ranges == [
        (T0 + pd.Timedelta("15s"), T0 + pd.Timedelta("60s")),
        (T0 + pd.Timedelta("75s"), T0 + pd.Timedelta("120s")),
        (T0 + pd.Timedelta("135s"), T0 + pd.Timedelta("150s")),
    ]


def test_a_down_source_is_retried_recorded_as_a_gap_and_does_not_stop_others(
    tmp_path: Path,
) -> None:
    store = TelemetryStore(tmp_path)
    flaky, sleeps = Flaky(), []
    metrics = CollectorMetrics()
    collector = Collector(
        store,
        [Steady(), flaky],
        STEP,
        RetryPolicy(attempts=3, base_delay_s=0.5),
        metrics,
        clock=lambda: T0 + pd.Timedelta("61s"),
        sleep=sleeps.append,
    )
    outcomes = collector.collect_once()
    assert [(o.source, o.points, o.error) for o in outcomes] == [
        ("steady", 1, None),
        ("flaky", 0, "connection refused"),
    ]
    assert flaky.attempts == 3 and sleeps == [0.5, 1.0]
    gaps = store.gaps()
    assert list(gaps["source"]) == ["flaky"]
    assert gaps["start"].iloc[0] == gaps["end"].iloc[0] == T0 + pd.Timedelta("60s")
    assert store.query("gpu_util").empty  # nothing made up for the down source
    assert list(store.query("gpu_demand")["y"]) == [1.0]

    flaky.down = False
    collector.collect_once(T0 + pd.Timedelta("75s"))
    assert list(store.query("gpu_util")["ds"]) == [T0 + pd.Timedelta("75s")]
    text = generate_latest(metrics.registry).decode()
    assert 'gpuscale_collector_source_errors_total{source="flaky"} 1.0' in text
    assert 'gpuscale_collector_gaps_total{source="flaky"} 1.0' in text
    assert 'gpuscale_collector_points_written_total{metric="gpu_demand",source="steady"} 2.0' in (
        text
    )
    assert 'gpuscale_collector_source_up{source="flaky"} 1.0' in text
    # The clock says 61 s; steady's newest point is 75 s: lag -14 s.
    assert 'gpuscale_collector_lag_seconds{source="steady"} -14.0' in text


class Broken(Steady):
    """Answers, except that the samples at `broken` raise what no source should (a bug, an
    answer it could not read)."""

    name = "broken"

    def __init__(self, broken: set[pd.Timestamp]) -> None:
        self.broken = broken

    def sample(self, at: pd.Timestamp) -> list[MetricBatch]:
        if at in self.broken:
            raise AttributeError("'int' object has no attribute 'get'")
        return super().sample(at)


def test_a_source_that_raises_unexpectedly_loses_that_sample_not_the_rest(
    tmp_path: Path,
) -> None:
    store = TelemetryStore(tmp_path)
    interval = pd.Timedelta("1s")
    start = pd.Timestamp.now(tz="UTC").tz_localize(None).ceil(interval)
    broken = Broken({start + interval})
    metrics = CollectorMetrics()
    collector = Collector(store, [broken], interval, RetryPolicy(attempts=1), metrics)
    stop = threading.Event()
    runner = threading.Thread(target=collector.run, args=(stop, start))
    runner.start()
    time.sleep((start - pd.Timestamp.now(tz="UTC").tz_localize(None)).total_seconds() + 3.5)
    stop.set()
    runner.join(timeout=5)
    stamps = set(store.query("gpu_demand")["ds"])
    # The sampling thread lived on: the samples after the broken one were taken.
    assert {start, start + 2 * interval, start + 3 * interval} <= stamps
    assert start + interval not in stamps
    gaps = store.gaps("broken")
    assert list(gaps["start"]) == [start + interval]
    assert gaps["reason"].iloc[0] == "AttributeError: 'int' object has no attribute 'get'"
    text = generate_latest(metrics.registry).decode()
    assert 'gpuscale_collector_source_errors_total{source="broken"} 1.0' in text
    assert 'gpuscale_collector_source_up{source="broken"} 1.0' in text


class TwoMetrics(Steady):
    """One sample, two metrics: gpu_demand and capacity of pool-a, in GPUs."""

    name = "two"

    def sample(self, at: pd.Timestamp) -> list[MetricBatch]:
        gpus = points("pool-a", [at], [8.0]).assign(unit="gpus")
        return [MetricBatch("gpu_demand", gpus), MetricBatch("capacity", gpus)]


def test_a_sample_the_store_refuses_is_written_not_at_all_and_recorded_as_a_gap(
    tmp_path: Path,
) -> None:
    store = TelemetryStore(tmp_path)
    # capacity of pool-a imported in nodes: the sample's capacity (in GPUs) is refused.
    store.append(
        points("pool-a", [T0], [2.0]), metric="capacity", source="trace", labels={"unit": "nodes"}
    )
    metrics = CollectorMetrics()
    collector = Collector(store, [TwoMetrics()], STEP, RetryPolicy(attempts=1), metrics)
    [outcome] = collector.collect_once(T0 + STEP)
    assert outcome.error is not None and "stored in nodes, not gpus" in outcome.error
    # Nothing of the sample: gpu_demand, written first, is not there either.
    assert store.query("gpu_demand").empty
    assert list(store.gaps("two")["start"]) == [T0 + STEP]
    text = generate_latest(metrics.registry).decode()
    assert 'gpuscale_collector_source_up{source="two"} 0.0' in text
    assert 'points_written_total{metric="gpu_demand"' not in text


def test_backfill_resumes_after_the_newest_stored_point(tmp_path: Path) -> None:
    store = TelemetryStore(tmp_path)
    history = History()
    collector = Collector(store, [history], STEP, RetryPolicy(attempts=1))
    now = T0 + pd.Timedelta("10min")
    written = collector.backfill(pd.Timedelta("2min"), now)
    assert written == 9  # 7m45s .. 9m45s: the grid point before now's, 2 min back
    first = store.query("gpu_demand")
    assert first["ds"].min() == T0 + pd.Timedelta("7min45s")
    assert first["ds"].max() == T0 + pd.Timedelta("9min45s")
    assert [len(pd.date_range(a, b, freq=STEP)) for a, b in history.calls] == [4, 4, 1]
    history.calls.clear()
    collector.backfill(pd.Timedelta("2min"), now + pd.Timedelta("1min"))
    assert history.calls == [(T0 + pd.Timedelta("10min"), T0 + pd.Timedelta("10min45s"))]
    stored = store.query("gpu_demand")
    assert (stored["y"] == (stored["ds"] - T0).dt.total_seconds()).all()
    assert stored["ds"].diff().dropna().eq(STEP).all()  # one unbroken grid


def test_backfill_that_fails_records_the_rest_as_a_gap(tmp_path: Path) -> None:
    store = TelemetryStore(tmp_path)
    history = History(fail_from=T0 + pd.Timedelta("9min"))
    collector = Collector(store, [history], STEP, RetryPolicy(attempts=2, base_delay_s=0))
    collector.backfill(pd.Timedelta("2min"), T0 + pd.Timedelta("10min"))
    assert len(history.calls) == 1 + 2  # first chunk, then the failing one twice, then stop
    [gap] = store.gaps("history").itertuples()
    assert (gap.start, gap.end) == (T0 + pd.Timedelta("8min45s"), T0 + pd.Timedelta("9min45s"))
    assert gap.reason.startswith("backfill failed: timeout")
    assert store.query("gpu_demand")["ds"].max() == T0 + pd.Timedelta("8min30s")


def test_the_daemon_samples_on_the_grid_and_stops(tmp_path: Path) -> None:
    store = TelemetryStore(tmp_path)
    interval = pd.Timedelta("1s")
    flaky = Flaky()
    collector = Collector(store, [Steady(), flaky], interval, RetryPolicy(attempts=1))
    stop = threading.Event()
    runner = threading.Thread(target=collector.run, args=(stop,))
    runner.start()
    time.sleep(2.5)
    stop.set()
    runner.join(timeout=5)
    assert not runner.is_alive()
    demand = store.query("gpu_demand")
    assert len(demand) >= 2
    assert (demand["ds"] == demand["ds"].dt.floor("1s")).all()
    assert len(store.gaps("flaky")) == len(demand)  # one gap per sample it owed


def test_config_errors_name_the_field_and_line(tmp_path: Path) -> None:
    path = tmp_path / "collect.yaml"
    path.write_text("interval_s: 15\nprometheus:\n  url: prometheus:9090\n")
    with pytest.raises(InputError) as err:
        load_config(path)
    assert err.value.line == 3
    assert "prometheus.url" in str(err.value) and str(path) in str(err.value)
    path.write_text("interval_s: 15\nkubernetes:\n  pool_lable: x\n")
    with pytest.raises(InputError, match="Extra inputs") as err:
        load_config(path)
    assert err.value.column == "kubernetes.pool_lable" and err.value.line == 3
    path.write_text("interval_s: [\n")
    with pytest.raises(InputError, match="not valid YAML"):
        load_config(path)


@pytest.mark.parametrize(
    ("text", "column", "reason"),
    [
        # Each ran: a URL without a host or with no port failed every sample as an
        # outage; an interval or backfill past pandas' timedeltas was a traceback at start.
        ('prometheus:\n  url: "http://"\n', "prometheus.url", "names no host"),
        ("prometheus:\n  url: http://prometheus:90x0\n", "prometheus.url", "no valid port"),
        ("interval_s: 100000000000\nnvml: {}\n", "interval_s", "less than or equal"),
        (
            "prometheus:\n  url: http://prometheus:9090\n  backfill_s: 100000000000\n",
            "prometheus.backfill_s",
            "less than or equal",
        ),
    ],
)
def test_config_values_that_could_never_run_are_refused(
    tmp_path: Path, text: str, column: str, reason: str
) -> None:
    path = tmp_path / "collect.yaml"
    path.write_text(text)
    with pytest.raises(InputError, match=reason) as err:
        load_config(path)
    assert err.value.column == column and err.value.path == str(path)


def test_environment_overrides_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "collect.yaml"
    path.write_text("interval_s: 15\nprometheus:\n  url: http://prometheus:9090\n")
    monkeypatch.setenv("GPUSCALE_INTERVAL_S", "30")
    monkeypatch.setenv("GPUSCALE_PROMETHEUS__TIMEOUT_S", "2.5")
    config = load_config(path)
    assert config.interval_s == 30
    assert config.prometheus is not None
    assert (config.prometheus.url, config.prometheus.timeout_s) == ("http://prometheus:9090", 2.5)
    assert [s.metric for s in config.prometheus.series] == [
        "gpu_util",
        "gpu_fb_used_mib",
        "gpu_fb_free_mib",
        "gpu_demand",
        "running",
        "pending",
    ]


def test_with_the_kubernetes_source_the_prometheus_defaults_leave_it_the_pools_demand(
    tmp_path: Path, fake: Any
) -> None:
    # Both sources wrote `gpu_demand`: the Kubernetes one per pool, the Prometheus defaults
    # as one `cluster` series, and the scaler plans every series of the metric: the same
    # pods twice over.
    path = tmp_path / "collect.yaml"
    kubeconfig = fake.write_kubeconfig(tmp_path / "kubeconfig")
    path.write_text(
        f"prometheus:\n  url: http://prometheus:9090\nkubernetes:\n  kubeconfig: {kubeconfig}\n"
    )
    config = load_config(path)
    prometheus = config.prometheus_settings()
    assert prometheus is not None
    assert [s.metric for s in prometheus.series] == [
        "gpu_util",
        "gpu_fb_used_mib",
        "gpu_fb_free_mib",
    ]
    sources = build_sources(config)
    try:
        assert isinstance(sources[0], PrometheusSource) and sources[0].settings == prometheus
    finally:
        for source in sources:
            source.close()
    # What the Kubernetes source writes is what the defaults leave out.
    pool = PoolDemand("a100", running=8, pending=0, capacity=16, nodes=2, gpu_model="A100")
    written = {b.metric for b in demand_batches([pool], T0, queue=True)}
    assert written == POOL_METRICS


def test_a_prometheus_series_of_a_pool_metric_beside_the_kubernetes_source_is_refused(
    tmp_path: Path,
) -> None:
    path = tmp_path / "collect.yaml"
    series = (
        "  series:\n"
        "    - {metric: gpu_util, query: DCGM_FI_DEV_GPU_UTIL}\n"
        "    - {metric: pending, query: sum(kube_pod_info), unique_id: all}\n"
    )
    path.write_text(f"prometheus:\n  url: http://prometheus:9090\n{series}kubernetes: {{}}\n")
    with pytest.raises(InputError, match="'pending' is written per pool by the kubernetes") as err:
        load_config(path)
    assert err.value.column == "prometheus.series.1.metric" and err.value.line == 5
    # Renamed, it is a series of its own; without the Kubernetes source, it is the demand.
    path.write_text(
        "prometheus:\n  url: http://prometheus:9090\n"
        f"{series.replace('metric: pending', 'metric: pending_ksm')}kubernetes: {{}}\n"
    )
    assert load_config(path).prometheus_settings() is not None
    path.write_text(f"prometheus:\n  url: http://prometheus:9090\n{series}")
    config = load_config(path)
    assert config.prometheus_settings() == config.prometheus


def test_collect_refuses_a_state_dir_or_metrics_port_it_cannot_use_before_any_sample(
    tmp_path: Path,
) -> None:
    config = tmp_path / "collect.yaml"
    config.write_text("nvml: {}\n")
    a_file = tmp_path / "state"
    a_file.write_text("")
    args = ["collect", "--once", "--config", str(config), "--state-dir"]
    result = CliRunner().invoke(app, [*args, str(a_file)])
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.replace("│", " ").split())
    assert "--state-dir: cannot keep the telemetry store in" in said
    assert "a file, not a folder" in said

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        state_dir = tmp_path / "store"
        result = CliRunner().invoke(
            app,
            [*args, str(state_dir), "--metrics-port", str(port), "--metrics-addr", "127.0.0.1"],
        )
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.replace("│", " ").split())
    assert f"--metrics-port: cannot serve /metrics on 127.0.0.1:{port}" in said
    assert TelemetryStore(state_dir).gaps().empty  # nothing sampled
