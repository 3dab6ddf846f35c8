"""Shared fixtures: where the shared real traces live, and the CI rule for service skips."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
TRACES = SHARED / "traces"


def require_service(reason: str) -> None:
    """Skip locally when a service or data set is missing; in CI that is a failure."""
    if os.environ.get("GPUSCALE_REQUIRE_SERVICES"):
        pytest.fail(f"required in CI: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def traces_dir() -> Path:
    if not TRACES.is_dir():
        require_service(f"shared traces not found at {TRACES}")
    return TRACES


@pytest.fixture(scope="module")
def moto() -> Iterator[Any]:
    """moto in server mode on 127.0.0.1, one per test module (fresh AWS state each)."""
    try:
        from moto_fixture import MotoServer
    except ImportError as exc:
        require_service(f"moto[server] is not installed: {exc}")
    server = MotoServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any]]:
    """A real Prometheus on 127.0.0.1 scraping one exporter the test module fills, every
    0.2 s: (server, exporter), one per test module."""
    import shutil

    from prometheus_fixture import GpuExporter, PrometheusServer

    if shutil.which("prometheus") is None:
        require_service("Debian's prometheus package is not installed")
    exporter = GpuExporter()
    server = PrometheusServer(tmp_path_factory.mktemp("prom"), [exporter.target], scrape_s=0.2)
    server.start()
    yield server, exporter
    server.stop()
    exporter.stop()


@pytest.fixture
def fake() -> Iterator[Any]:
    """The fake Kubernetes API server; it refuses evictions that a PodDisruptionBudget
    would, as the real one does."""
    from fake_kube import FakeKube, disruption_budget_policy

    kube = FakeKube().start()
    kube.eviction_policy = disruption_budget_policy(kube)
    yield kube
    kube.stop()
