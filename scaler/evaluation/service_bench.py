"""Load on the placement service over loopback: `gpuscale serve` in a subprocess (uvicorn,
one worker) over a fixed cluster, driven by `concurrency` keep-alive connections with one
request in flight on each. The cluster is first filled to `fill` of its GPUs with committed
placements, so the engine searches a fragmented cluster; the measured requests are
POST /v1/placements with `dry_run` (decided, not committed), so the state stays the same
for the whole run. Requests/s and latency percentiles are of the measured requests only;
client and server share the machine's cores.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess  # nosec B404
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import yaml

# The job shapes asked for (GPUs, thousandths of a GPU): whole, shared and multi-GPU jobs.
SHAPES = ((1, 1000), (1, 500), (1, 250), (2, 1000), (4, 1000), (8, 1000), (0, None))
# A variable's name, not a token.
TOKEN_ENV = "GPUSCALE_SERVICE__TOKEN"  # nosec B105


@dataclass(frozen=True)
class ServiceBenchResult:
    nodes: int
    gpus: int
    seconds: float
    concurrency: int
    requests: int
    requests_per_s: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    placed: int
    unschedulable: int
    errors: int
    filled_gpu_ratio: float

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


def job(i: int, *, dry_run: bool) -> dict[str, object]:
    gpus, milli = SHAPES[i % len(SHAPES)]
    body: dict[str, object] = {
        "id": f"bench-{i}",
        "cpu_milli": 4000,
        "memory_mib": 16384,
        "num_gpu": gpus,
        "dry_run": dry_run,
    }
    return body if milli is None else body | {"gpu_milli": milli}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_config(directory: Path, nodes: list[dict[str, object]]) -> Path:
    config = {
        "state_dir": str(directory / "state"),
        # The planner's pools play no part in placement; one is required.
        "pools": [
            {
                "name": "bench",
                "gpu_model": "A100",
                "gpus_per_node": 8,
                "cpu_milli_per_node": 96_000,
                "memory_mib_per_node": 1_048_576,
                "price_per_hour": 1.0,
                "max_size": 1,
            }
        ],
        "model": {"name": "persistence"},
        "placement": {"nodes": nodes, "sync_s": 0},
    }
    path = directory / "service.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


class Connection:
    """One keep-alive HTTP/1.1 connection, the way load generators such as wrk drive a
    server: requests written as prepared bytes, answers read by Content-Length. A general
    client (httpx) spent about 2 ms of CPU per request, more than the server did, and
    client and server share the machine's cores."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, port: int) -> Connection:
        return cls(*await asyncio.open_connection("127.0.0.1", port))

    async def request(
        self, method: str, path: str, token: str, body: dict[str, object] | None = None
    ) -> tuple[int, bytes]:
        payload = b"" if body is None else json.dumps(body).encode()
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n"
        )
        self.writer.write(head.encode() + payload)
        status_line, *headers = (await self.reader.readuntil(b"\r\n\r\n")).split(b"\r\n")
        length = 0
        for header in headers:
            name, _, value = header.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        return int(status_line.split(b" ", 2)[1]), await self.reader.readexactly(length)

    def close(self) -> None:
        self.writer.close()


async def _wait_ready(port: int, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gpuscale serve exited with {proc.returncode}")
        try:
            conn = await Connection.open(port)
            try:
                if (await conn.request("GET", "/readyz", ""))[0] == 200:
                    return
            finally:
                conn.close()
        except (OSError, asyncio.IncompleteReadError):
            pass
        await asyncio.sleep(0.1)
    raise RuntimeError(f"gpuscale serve not ready after {timeout_s:.0f} s")


async def _fill(port: int, token: str, gpus: int, fill: float) -> None:
    conn = await Connection.open(port)
    try:
        allocated, i = 0.0, 0
        while allocated < fill * gpus and i < 20 * gpus:
            code, _ = await conn.request("POST", "/v1/placements", token, job(i, dry_run=False))
            if code == 201:
                gpus_asked, milli = SHAPES[i % len(SHAPES)]
                allocated += gpus_asked * (milli or 0) / 1000
            i += 1
    finally:
        conn.close()


async def _drive(
    port: int,
    proc: subprocess.Popen,
    gpus: int,
    seconds: float,
    concurrency: int,
    fill: float,
    token: str,
) -> tuple[list[float], int, int, int, float]:
    await _wait_ready(port, proc, 60.0)
    await _fill(port, token, gpus, fill)
    latencies: list[float] = []
    counts = {"placed": 0, "unschedulable": 0, "errors": 0}
    stop_at = time.monotonic() + seconds

    async def worker(first: int) -> None:
        conn, k = await Connection.open(port), first
        try:
            while time.monotonic() < stop_at:
                started = time.perf_counter()
                try:
                    code, _ = await conn.request(
                        "POST", "/v1/placements", token, job(k, dry_run=True)
                    )
                except (OSError, asyncio.IncompleteReadError, ValueError):
                    counts["errors"] += 1
                    conn.close()
                    conn = await Connection.open(port)
                    continue
                latencies.append(time.perf_counter() - started)
                if code == 201:
                    counts["placed"] += 1
                elif code == 409:
                    counts["unschedulable"] += 1
                else:
                    counts["errors"] += 1
                k += concurrency
        finally:
            conn.close()

    started = time.monotonic()
    await asyncio.gather(*(worker(1_000_000 + w) for w in range(concurrency)))
    elapsed = time.monotonic() - started
    return latencies, counts["placed"], counts["unschedulable"], counts["errors"], elapsed


async def _metrics(port: int) -> str:
    conn = await Connection.open(port)
    try:
        return (await conn.request("GET", "/metrics", ""))[1].decode()
    finally:
        conn.close()


def run_service_bench(
    nodes: list[dict[str, object]],
    seconds: float = 10.0,
    concurrency: int = 16,
    fill: float = 0.5,
) -> ServiceBenchResult:
    """Start the service over `nodes` (PlacementNode fields), load it, stop it."""
    gpus = sum(int(n.get("gpus", 0)) for n in nodes)  # type: ignore[call-overload]
    token = os.urandom(16).hex()
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="gpuscale-bench-service-") as tmp:
        config = write_config(Path(tmp), nodes)
        env = os.environ | {TOKEN_ENV: token}
        command = [sys.executable, "-m", "scaler", "serve", "--config", str(config)]
        command += ["--port", str(port), "--log-level", "warning"]
        # Fixed argv, no shell.
        proc = subprocess.Popen(command, env=env)  # nosec B603
        try:
            latencies, placed, unschedulable, errors, elapsed = asyncio.run(
                _drive(port, proc, gpus, seconds, concurrency, fill, token)
            )
            metrics = asyncio.run(_metrics(port))
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
    ms = np.asarray(latencies) * 1000 if latencies else np.zeros(1)
    return ServiceBenchResult(
        nodes=len(nodes),
        gpus=gpus,
        seconds=round(elapsed, 3),
        concurrency=concurrency,
        requests=len(latencies),
        requests_per_s=round(len(latencies) / elapsed, 1),
        p50_ms=round(float(np.percentile(ms, 50)), 2),
        p90_ms=round(float(np.percentile(ms, 90)), 2),
        p99_ms=round(float(np.percentile(ms, 99)), 2),
        max_ms=round(float(ms.max()), 2),
        placed=placed,
        unschedulable=unschedulable,
        errors=errors,
        filled_gpu_ratio=round(_allocated_ratio(metrics), 3),
    )


def _allocated_ratio(metrics_text: str) -> float:
    for line in metrics_text.splitlines():
        if line.startswith("gpuscale_service_gpu_allocated_ratio "):
            return float(line.split()[1])
    return float("nan")


def openb_nodes(path: Path) -> list[dict[str, object]]:
    """The Alibaba openb node list as the service's fixed-cluster nodes."""
    from predictor.data.loaders import load_openb_nodes

    table = load_openb_nodes(path)
    return [
        {
            "name": str(row.sn),
            "gpus": int(row.gpu),
            "gpu_model": str(row.model),
            "cpu_milli": int(row.cpu_milli),
            "memory_mib": int(row.memory_mib),
        }
        for row in table.itertuples(index=False)
    ]
