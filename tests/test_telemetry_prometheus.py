"""Integration: a real Prometheus (Debian's binary, started here) with backfilled history and
a live exporter of DCGM and kube-state-metrics gauges; `gpuscale collect` reads it through
prometheus-api-client into the store."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import requests
from conftest import require_service
from prometheus_client.parser import text_string_to_metric_families
from prometheus_fixture import (
    GpuExporter,
    Labels,
    PrometheusServer,
    Values,
    free_port,
    labels,
    write_openmetrics,
)
from typer.testing import CliRunner

from predictor.telemetry.store import TelemetryStore
from scaler.cli import app

pytestmark = pytest.mark.integration

GPUS = (  # Hostname, gpu, UUID, modelName, frame buffer MiB
    ("node-a", "0", "GPU-a0", "NVIDIA A100-SXM4-80GB", 81920),
    ("node-a", "1", "GPU-a1", "NVIDIA A100-SXM4-80GB", 81920),
    ("node-b", "0", "GPU-b0", "NVIDIA H100 80GB HBM3", 81559),
)
PHASES = ("Pending", "Running", "Succeeded", "Failed", "Unknown")


@dataclass(frozen=True)
class ClusterState:
    """What the exporter shows at one moment."""

    util: tuple[float, ...]  # per GPU
    fb_used: tuple[float, ...]
    pods: tuple[tuple[str, tuple[int, ...], str], ...]  # (pod, GPUs per container, phase)

    def gpus(self, *phases: str) -> float:
        return float(sum(sum(c) for _, c, phase in self.pods if phase in phases))

    def values(self, extra: Labels = ()) -> Values:
        out: Values = {
            "DCGM_FI_DEV_GPU_UTIL": {},
            "DCGM_FI_DEV_FB_USED": {},
            "DCGM_FI_DEV_FB_FREE": {},
            "kube_pod_container_resource_requests": {},
            "kube_pod_status_phase": {},
        }
        for i, (host, gpu, uuid, model, total) in enumerate(GPUS):
            key = labels(
                Hostname=host, gpu=gpu, UUID=uuid, modelName=model, namespace="ml", pod=f"job-{i}"
            )
            key = tuple(sorted(key + extra))
            out["DCGM_FI_DEV_GPU_UTIL"][key] = self.util[i]
            out["DCGM_FI_DEV_FB_USED"][key] = self.fb_used[i]
            out["DCGM_FI_DEV_FB_FREE"][key] = total - self.fb_used[i]
        for pod, containers, phase in self.pods:
            for c, gpus in enumerate(containers):
                key = labels(
                    namespace="ml",
                    pod=pod,
                    container=f"c{c}",
                    node="node-a",
                    resource="nvidia_com_gpu",
                    unit="integer",
                )
                out["kube_pod_container_resource_requests"][tuple(sorted(key + extra))] = gpus
            for p in PHASES:
                key = tuple(sorted(labels(namespace="ml", pod=pod, phase=p) + extra))
                out["kube_pod_status_phase"][key] = float(p == phase)
        return out

    def expected(self) -> dict[str, dict[str, float]]:
        """Metric -> unique_id -> value, as the collector's default series name them."""
        out: dict[str, dict[str, float]] = {
            "gpu_util": {},
            "gpu_fb_used_mib": {},
            "gpu_fb_free_mib": {},
            "gpu_demand": {"cluster": self.gpus("Running", "Pending")},
            "running": {"cluster": self.gpus("Running")},
            "pending": {"cluster": self.gpus("Pending")},
        }
        for i, (host, gpu, _, _, total) in enumerate(GPUS):
            out["gpu_util"][f"{host}/{gpu}"] = self.util[i]
            out["gpu_fb_used_mib"][f"{host}/{gpu}"] = self.fb_used[i]
            out["gpu_fb_free_mib"][f"{host}/{gpu}"] = total - self.fb_used[i]
        return out


def history_states(start: int, end: int, seed: int) -> dict[int, ClusterState]:
    """A state per second from start to end: random utilisation and memory, and pods that
    start pending, run, and finish."""
    rng = np.random.default_rng(seed)
    states = {}
    span = end - start
    for t in range(start, end + 1):
        k = t - start
        states[t] = ClusterState(
            util=tuple(float(v) for v in rng.integers(0, 101, len(GPUS))),
            fb_used=tuple(float(v) for v in rng.integers(0, 80000, len(GPUS))),
            pods=(
                ("train-1", (1, 1), "Running"),
                ("train-2", (4,), "Pending" if k < span // 2 else "Running"),
                ("train-3", (8,), "Running" if k < 3 * span // 4 else "Succeeded"),
                ("cpu-only", (0,), "Running"),
            ),
        )
    return states


def write_history(states: dict[int, ClusterState], path: Path, job: Labels) -> Path:
    history: dict[str, dict[Labels, list[tuple[int, float]]]] = {}
    for t, state in sorted(states.items()):
        for family, series in state.values(job).items():
            for key, value in series.items():
                history.setdefault(family, {}).setdefault(key, []).append((t, value))
    return write_openmetrics(path, history)


def expected_frame(points: dict[int, ClusterState], metric: str) -> pd.DataFrame:
    rows = [
        (uid, pd.Timestamp(t, unit="s"), value)
        for t, state in points.items()
        for uid, value in state.expected()[metric].items()
    ]
    frame = pd.DataFrame(rows, columns=["unique_id", "ds", "y"])
    return frame.sort_values(["unique_id", "ds"], ignore_index=True)


@pytest.fixture
def exporter() -> Iterator[GpuExporter]:
    server = GpuExporter()
    yield server
    server.stop()


def prometheus_for(tmp_path: Path, exporter: GpuExporter) -> PrometheusServer:
    if shutil.which("prometheus") is None or shutil.which("promtool") is None:
        require_service("Debian's prometheus package (prometheus, promtool) is not installed")
    return PrometheusServer(tmp_path / "prometheus", [exporter.target], scrape_s=1.0)


def job_labels(exporter: GpuExporter) -> Labels:
    # Scraped series carry these; history written with them continues the same series.
    return labels(job="gpu", instance=exporter.target)


def write_config(path: Path, url: str, **extra: object) -> Path:
    config = {
        "interval_s": 1,
        "retry": {"attempts": 2, "base_delay_s": 0.1},
        "prometheus": {"url": url, "backfill_s": 900, "chunk_steps": 250, **extra},
    }
    path.write_text(json.dumps(config))
    return path


def stored(store: TelemetryStore, metric: str) -> pd.DataFrame:
    return store.query(metric)[["unique_id", "ds", "y"]]


def test_backfill_and_live_samples_are_stored_point_for_point(
    tmp_path: Path, exporter: GpuExporter
) -> None:
    prometheus = prometheus_for(tmp_path, exporter)
    now = int(time.time())
    history_end = now - 1
    history = history_states(history_end - 600, history_end, seed=5)
    # The exporter goes on showing the last state of the history until it changes.
    live = history[history_end]
    exporter.publish(live.values())
    prometheus.backfill(write_history(history, tmp_path / "history.om", job_labels(exporter)))
    prometheus.start()
    try:
        up = f'up{{instance="{exporter.target}"}}'
        prometheus.wait_for(up, lambda r: bool(r) and r[0]["value"][1] == "1")
        config = write_config(tmp_path / "collect.yaml", prometheus.url)
        state_dir = tmp_path / "state"
        args = ["collect", "--once", "--json", "--config", str(config)]
        first = CliRunner().invoke(app, [*args, "--state-dir", str(state_dir)])
        assert first.exit_code == 0, first.output
        report = json.loads(first.output)
        tick_1 = int(pd.Timestamp(report["samples"][0]["at"]).timestamp())
        assert report["samples"][0]["error"] is None
        assert report["backfilled_points"] > 0

        # The cluster changes: new utilisation, train-2 finishes, a 3-GPU job is queued.
        changed = ClusterState(
            util=(7.0, 99.0, 50.0),
            fb_used=(1024.0, 70000.0, 40960.0),
            pods=(("train-1", (1, 1), "Running"), ("train-4", (3,), "Pending")),
        )
        exporter.publish(changed.values())
        selector = 'DCGM_FI_DEV_GPU_UTIL{Hostname="node-a",gpu="1",job="gpu"}'
        prometheus.wait_for(selector, lambda r: bool(r) and r[0]["value"][1] == "99")
        raw = prometheus.query(f"{selector}[30s]")[0]["values"]
        scraped_at = min(float(ts) for ts, v in raw if v == "99")
        time.sleep(max(0.0, np.ceil(scraped_at) - time.time()) + 0.05)
        second = CliRunner().invoke(app, [*args, "--state-dir", str(state_dir)])
        assert second.exit_code == 0, second.output
        tick_2 = int(pd.Timestamp(json.loads(second.output)["samples"][0]["at"]).timestamp())
    finally:
        prometheus.stop()

    assert tick_2 > tick_1 >= history_end
    # What Prometheus was shown at each grid second: the history, then the last history
    # state until the change was scraped, then the changed state.
    shown = dict(history)
    for t in range(history_end + 1, tick_2 + 1):
        shown[t] = changed if t >= scraped_at else live
    store = TelemetryStore(state_dir)
    for metric in live.expected():
        pd.testing.assert_frame_equal(
            stored(store, metric), expected_frame(shown, metric), check_exact=True
        )
    assert len(shown) == 600 + 1 + (tick_2 - history_end)
    series = store.series("gpu_util").set_index("unique_id")
    assert series.loc["node-b/0", "labels"]["modelName"] == "NVIDIA H100 80GB HBM3"
    assert series.loc["node-a/1", "labels"]["UUID"] == "GPU-a1"
    assert set(series["source"]) == {"prometheus"}
    assert store.gaps().empty


def _metric_value(text: str, name: str, **want: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in want.items()):
                return sample.value
    raise AssertionError(f"{name} {want} not in /metrics")


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def test_prometheus_outage_is_a_gap_and_the_collector_resumes(
    tmp_path: Path, exporter: GpuExporter
) -> None:
    prometheus = prometheus_for(tmp_path, exporter)
    now = int(time.time())
    history = history_states(now - 120, now - 1, seed=9)
    live = history[now - 1]
    exporter.publish(live.values())
    prometheus.backfill(write_history(history, tmp_path / "history.om", job_labels(exporter)))
    prometheus.start()
    state_dir = tmp_path / "state"
    store = TelemetryStore(state_dir)
    config = write_config(tmp_path / "collect.yaml", prometheus.url)
    metrics_port = free_port()
    log_path = tmp_path / "collect.log"
    with log_path.open("wb") as log:
        daemon = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "scaler",
                "collect",
                "--config",
                str(config),
                "--state-dir",
                str(state_dir),
                "--metrics-port",
                str(metrics_port),
                "--metrics-addr",
                "127.0.0.1",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"

    def newest() -> pd.Timestamp:
        points = store.query("gpu_util") if store.path.exists() else pd.DataFrame()
        return points["ds"].max() if len(points) else pd.Timestamp(0)

    try:
        started = pd.Timestamp(time.time(), unit="s")
        _wait(lambda: newest() >= started + pd.Timedelta("2s"), 30, "live samples")
        assert store.count("gpu_util") >= 3 * 120  # the backfilled history is there too

        prometheus.stop()
        stopped = pd.Timestamp(time.time(), unit="s")
        _wait(lambda: len(store.gaps("prometheus")) >= 3, 20, "gaps while Prometheus is down")
        text = requests.get(metrics_url, timeout=5).text
        errors = _metric_value(text, "gpuscale_collector_source_errors_total", source="prometheus")
        assert errors >= 3
        assert _metric_value(text, "gpuscale_collector_source_up", source="prometheus") == 0
        assert _metric_value(text, "gpuscale_collector_lag_seconds", source="prometheus") >= 2

        prometheus.start()
        restarted = pd.Timestamp(time.time(), unit="s")
        _wait(lambda: newest() >= restarted + pd.Timedelta("2s"), 30, "samples after restart")
        text = requests.get(metrics_url, timeout=5).text
        assert _metric_value(text, "gpuscale_collector_source_up", source="prometheus") == 1
        assert _metric_value(text, "gpuscale_collector_lag_seconds", source="prometheus") < 3
        written = _metric_value(
            text, "gpuscale_collector_points_written_total", source="prometheus", metric="gpu_util"
        )
        assert written >= store.count("gpu_util") - 3  # the daemon wrote all of them
    finally:
        daemon.send_signal(signal.SIGTERM)
        code = daemon.wait(timeout=20)
        prometheus.stop()
    output = log_path.read_text()
    assert code == 0, output
    assert "source prometheus is down" in output
    assert "source prometheus is back" in output

    gaps = store.gaps("prometheus")
    assert (gaps["start"] >= stopped.floor("s") - pd.Timedelta("1s")).all()
    assert (gaps["end"] <= restarted.ceil("s") + pd.Timedelta("2s")).all()
    points = store.query("gpu_util")
    for gap in gaps.itertuples():
        inside = points[(points["ds"] >= gap.start) & (points["ds"] <= gap.end)]
        assert inside.empty, f"a value was stored inside the gap {gap.start}..{gap.end}"
    # Every point after the history is what the exporter showed.
    after = points[points["ds"] > pd.Timestamp(now - 1, unit="s")]
    expected = live.expected()["gpu_util"]
    assert len(after) > 0
    assert (after["y"] == after["unique_id"].map(expected)).all()

    # Retraining works on what was collected, gap and all.
    registry = tmp_path / "models"
    retrained = CliRunner().invoke(
        app,
        [
            *("retrain", "--state-dir", str(state_dir), "--registry", str(registry), "--json"),
            *("--metric", "gpu_util", "--step", "1s", "--backtest-steps", "20"),
            *("--horizons", "1,3", "--model", "empirical"),
        ],
    )
    assert retrained.exit_code == 0, retrained.output
    outcome = json.loads(retrained.output)
    assert outcome["promoted"] and outcome["stored_as"] == "gpuscale:1"
    # Three GPUs, 20 steps each, less the steps inside the gap that were never observed.
    assert 0 < outcome["candidate"]["steps"]["1"] <= 3 * 20


def test_a_scalar_answer_is_a_failed_sample_naming_the_series(
    tmp_path: Path, exporter: GpuExporter
) -> None:
    prometheus = prometheus_for(tmp_path, exporter)
    exporter.publish(history_states(0, 0, seed=3)[0].values())
    prometheus.start()
    series = [
        {"metric": "util", "query": "max(DCGM_FI_DEV_GPU_UTIL)", "unique_id": "cluster"},
        # scalar() answers [stamp, value], no series: it read as a list of results.
        {"metric": "gpus", "query": "scalar(count(DCGM_FI_DEV_GPU_UTIL))", "unique_id": "all"},
    ]
    try:
        prometheus.wait_for("DCGM_FI_DEV_GPU_UTIL", bool)
        config = write_config(tmp_path / "collect.yaml", prometheus.url, series=series)
        state_dir = tmp_path / "state"
        args = ["collect", "--once", "--json", "--config", str(config), "--state-dir"]
        result = CliRunner().invoke(app, [*args, str(state_dir)])
    finally:
        prometheus.stop()
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit)  # no traceback
    [sample] = json.loads(result.output)["samples"]
    assert sample["error"].startswith("series 'gpus': the query answered [")
    assert "not a list of series" in sample["error"]
    store = TelemetryStore(state_dir)
    assert list(store.gaps("prometheus")["reason"]) == [sample["error"]]
    assert store.query("util", start=pd.Timestamp(sample["at"])).empty  # the sample whole or not
