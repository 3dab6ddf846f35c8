"""NVML source: clean unavailability without the library or a driver; a real GPU read where
one exists (marked `gpu`: it skips elsewhere and is no CI failure)."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import pandas as pd
import pytest

from predictor.telemetry.collector import Collector
from predictor.telemetry.config import NvmlSettings
from predictor.telemetry.nvml import NvmlSource
from predictor.telemetry.sources import RetryPolicy, SourceError
from predictor.telemetry.store import TelemetryStore

AT = pd.Timestamp("2026-01-01 00:00:00")


def nvml_works() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:
        return False


def test_without_the_library_the_source_is_unavailable_and_says_so_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    source = NvmlSource(NvmlSettings(hostname="node-a"))
    with caplog.at_level(logging.INFO):
        assert not source.available()
        assert not source.available()
        with pytest.raises(SourceError, match="nvidia-ml-py is not installed"):
            source.sample(AT)
        # A collector leaves it out and carries on without it.
        store = TelemetryStore(tmp_path / "state")
        collector = Collector(store, [source], pd.Timedelta("15s"), RetryPolicy())
        assert collector.sources == []
        assert collector.collect_once(AT) == []
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert messages == [
        "NVML unavailable: nvidia-ml-py is not installed; GPU metrics of this node are not sampled"
    ]
    assert store.gaps().empty


def test_without_a_driver_the_source_is_unavailable() -> None:
    if nvml_works():
        pytest.skip("an NVIDIA driver is present here")
    source = NvmlSource(NvmlSettings(hostname="node-a"))
    assert not source.available()
    assert source.reason is not None and "no NVIDIA driver or GPU" in source.reason
    with pytest.raises(SourceError):
        source.read()
    source.close()  # nothing to shut down, and no error


@pytest.mark.gpu
def test_reads_a_real_gpu(tmp_path: Path) -> None:
    if not nvml_works():
        pytest.skip("no NVIDIA GPU and driver here")
    source = NvmlSource(NvmlSettings(hostname="gpu-node"))
    try:
        assert source.available()
        readings = source.read()
        batches = {b.metric: b.points for b in source.sample(AT)}
    finally:
        source.close()
    assert readings, "NVML sees no GPU"
    for r in readings:
        assert r.uuid.startswith(("GPU-", "MIG-"))
        assert r.model
        assert r.memory_total_mib > 0
        assert 0 <= r.memory_used_mib <= r.memory_total_mib
        assert r.util_percent is None or 0 <= r.util_percent <= 100
        assert r.processes >= 0
    total = batches["gpu_fb_total_mib"]
    assert list(total["unique_id"]) == [f"gpu-node/{r.index}" for r in readings]
    assert list(total["UUID"]) == [r.uuid for r in readings]
    assert (total["ds"] == AT).all()
    store = TelemetryStore(tmp_path / "state")
    collector = Collector(store, [NvmlSource(NvmlSettings())], pd.Timedelta("1s"), RetryPolicy())
    [outcome] = collector.collect_once()
    assert outcome.error is None and outcome.points == 5 * len(readings)
    report = [r.__dict__ for r in readings]
    print("NVML read:", json.dumps(report))
    if os.environ.get("OUT"):  # the device machine brings $OUT back
        Path(os.environ["OUT"], "nvml_reading.json").write_text(json.dumps(report, indent=2))
