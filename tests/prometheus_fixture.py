"""A real Prometheus for integration tests, and a small exporter for it to scrape.

`PrometheusServer` runs Debian's `prometheus` binary on 127.0.0.1 (a free port, a temporary
config and data directory), never as a system service. History is written beforehand with
`promtool tsdb create-blocks-from openmetrics`. `GpuExporter` serves DCGM exporter and
kube-state-metrics style gauges over prometheus-client's HTTP server; it publishes a whole
set of values at once, so one scrape never mixes two sets.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import requests
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

Labels = tuple[tuple[str, str], ...]  # sorted (name, value) pairs
Values = dict[str, dict[Labels, float]]  # metric family -> series -> value

DCGM_LABELS = ("gpu", "UUID", "modelName", "Hostname", "namespace", "pod")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def labels(**pairs: str) -> Labels:
    return tuple(sorted(pairs.items()))


class _Snapshot(Collector):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: Values = {}

    def publish(self, values: Values) -> None:
        with self._lock:
            self._values = {family: dict(series) for family, series in values.items()}

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self._lock:
            values = self._values
        for family, series in sorted(values.items()):
            names = sorted({name for key in series for name, _ in key})
            gauge = GaugeMetricFamily(family, f"{family} (test exporter)", labels=names)
            for key, value in sorted(series.items()):
                own = dict(key)
                gauge.add_metric([own.get(n, "") for n in names], value)
            yield gauge


class GpuExporter:
    """prometheus-client HTTP server on 127.0.0.1 serving whatever was last published."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._snapshot = _Snapshot()
        self.registry.register(self._snapshot)
        self._server, self._thread = start_http_server(0, addr="127.0.0.1", registry=self.registry)
        self.port = self._server.server_address[1]

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def publish(self, values: Values) -> None:
        self._snapshot.publish(values)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def write_openmetrics(
    path: Path, history: Mapping[str, Mapping[Labels, Iterable[tuple[int, float]]]]
) -> Path:
    """OpenMetrics text with explicit timestamps (seconds): family -> series -> samples."""
    lines = []
    for family, series in sorted(history.items()):
        lines.append(f"# TYPE {family} gauge")
        for key, samples in sorted(series.items()):
            label_text = ",".join(f'{k}="{v}"' for k, v in key)
            lines.extend(f"{family}{{{label_text}}} {value} {ts}" for ts, value in samples)
    lines.append("# EOF")
    path.write_text("\n".join(lines) + "\n")
    return path


@dataclass
class PrometheusServer:
    """Debian's prometheus binary on 127.0.0.1, scraping `targets` every `scrape_s`."""

    workdir: Path
    targets: list[str]
    scrape_s: float = 1.0
    port: int = 0

    def __post_init__(self) -> None:
        self.binary = shutil.which("prometheus") or "/usr/bin/prometheus"
        self.data_dir = self.workdir / "data"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.config = self.workdir / "prometheus.yml"
        self.config.write_text(
            "global:\n"
            f"  scrape_interval: {round(self.scrape_s * 1000)}ms\n"
            f"  scrape_timeout: {round(self.scrape_s * 1000)}ms\n"
            "scrape_configs:\n"
            "  - job_name: gpu\n"
            "    static_configs:\n"
            f"      - targets: [{', '.join(repr(t) for t in self.targets)}]\n"
        )
        self.port = self.port or free_port()
        self.log = self.workdir / "prometheus.log"
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def backfill(self, openmetrics: Path) -> None:
        """Write history as TSDB blocks into the data directory (before start)."""
        promtool = shutil.which("promtool") or "/usr/bin/promtool"
        subprocess.run(
            [
                promtool,
                "tsdb",
                "create-blocks-from",
                "openmetrics",
                "-q",
                str(openmetrics),
                str(self.data_dir),
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )

    def start(self, timeout_s: float = 30.0) -> None:
        with self.log.open("ab") as log:
            self._process = subprocess.Popen(
                [
                    self.binary,
                    f"--config.file={self.config}",
                    f"--storage.tsdb.path={self.data_dir}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--storage.tsdb.retention.time=30d",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"prometheus exited: {self.log.read_text()[-2000:]}")
            try:
                if requests.get(f"{self.url}/-/ready", timeout=1).ok:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"prometheus not ready after {timeout_s} s")

    def stop(self) -> None:
        if self._process is None:
            return
        self._process.terminate()
        try:
            self._process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait(timeout=5)
        self._process = None

    def query(self, promql: str) -> list[dict]:
        answer = requests.get(f"{self.url}/api/v1/query", params={"query": promql}, timeout=5)
        answer.raise_for_status()
        return answer.json()["data"]["result"]

    def wait_for(self, promql: str, predicate, timeout_s: float = 15.0) -> list[dict]:
        """Poll an instant query until `predicate(result)` holds."""
        deadline = time.monotonic() + timeout_s
        while True:
            result = self.query(promql)
            if predicate(result):
                return result
            if time.monotonic() > deadline:
                raise AssertionError(f"{promql}: still {result} after {timeout_s} s")
            time.sleep(0.1)
