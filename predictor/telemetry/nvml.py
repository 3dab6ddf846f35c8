"""NVML as a telemetry source: the GPUs of this node, read through nvidia-ml-py (`pynvml`).

Series and labels match the DCGM exporter's (`{Hostname}/{gpu}`; Hostname, gpu, UUID,
modelName; frame buffer in MiB), so a node agent and Prometheus describe a GPU the same
way. On a machine without the library, the driver or a GPU the source says so once and
reports itself unavailable; nothing raises.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import pandas as pd

from predictor.telemetry.config import NvmlSettings
from predictor.telemetry.sources import MetricBatch, Source, SourceError

log = logging.getLogger(__name__)

MIB = 2**20


@dataclass(frozen=True)
class GpuReading:
    index: int
    uuid: str
    model: str
    util_percent: float | None  # None where the GPU does not report it (e.g. MIG)
    memory_used_mib: float
    memory_total_mib: float
    processes: int

    @property
    def memory_free_mib(self) -> float:
        return self.memory_total_mib - self.memory_used_mib


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlSource(Source):
    """Utilisation, frame buffer and running processes of every GPU NVML sees."""

    name = "nvml"
    fixed_availability = True

    def __init__(self, settings: NvmlSettings) -> None:
        self.settings = settings
        self._nvml: ModuleType | None = None
        self.reason: str | None = None  # why NVML is unavailable, once known

    def available(self) -> bool:
        if self._nvml is not None:
            return True
        if self.reason is not None:
            return False
        try:
            import pynvml
        except ImportError:
            self.reason = "nvidia-ml-py is not installed"
        else:
            try:
                pynvml.nvmlInit()
                self._nvml = pynvml
            except pynvml.NVMLError as exc:
                self.reason = f"no NVIDIA driver or GPU here ({exc})"
        if self.reason is not None:
            log.warning(
                "NVML unavailable: %s; GPU metrics of this node are not sampled", self.reason
            )
            return False
        return True

    def read(self) -> list[GpuReading]:
        """One reading per GPU; raises SourceError when NVML is unavailable or fails."""
        if not self.available():
            raise SourceError(f"NVML unavailable: {self.reason}")
        nvml = self._nvml
        assert nvml is not None
        try:
            readings = []
            for index in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                memory = nvml.nvmlDeviceGetMemoryInfo(handle)
                try:
                    util: float | None = float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
                except nvml.NVMLError_NotSupported:
                    util = None
                readings.append(
                    GpuReading(
                        index=index,
                        uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
                        model=_text(nvml.nvmlDeviceGetName(handle)),
                        util_percent=util,
                        memory_used_mib=memory.used / MIB,
                        memory_total_mib=memory.total / MIB,
                        processes=len(nvml.nvmlDeviceGetComputeRunningProcesses(handle)),
                    )
                )
            return readings
        except nvml.NVMLError as exc:
            raise SourceError(f"NVML: {exc}") from exc

    def sample(self, at: pd.Timestamp) -> list[MetricBatch]:
        readings = self.read()
        host = self.settings.hostname
        labels = pd.DataFrame(
            {
                "unique_id": [f"{host}/{r.index}" for r in readings],
                "ds": pd.Series([at] * len(readings), dtype="datetime64[ns]"),
                "Hostname": host,
                "gpu": [str(r.index) for r in readings],
                "UUID": [r.uuid for r in readings],
                "modelName": [r.model for r in readings],
            }
        )
        values = {
            "gpu_util": [r.util_percent for r in readings],
            "gpu_fb_used_mib": [r.memory_used_mib for r in readings],
            "gpu_fb_free_mib": [r.memory_free_mib for r in readings],
            "gpu_fb_total_mib": [r.memory_total_mib for r in readings],
            "gpu_processes": [r.processes for r in readings],
        }
        batches = []
        for metric, column in values.items():
            points = labels.assign(y=pd.Series(column, dtype="float64")).dropna(subset=["y"])
            cols = ["unique_id", "ds", "y", "Hostname", "gpu", "UUID", "modelName"]
            batches.append(MetricBatch(metric, points[cols]))
        return batches

    def close(self) -> None:
        if self._nvml is not None:
            self._nvml.nvmlShutdown()
            self._nvml = None
