"""What a job asks of the cluster, and how to tell a request that can never be met."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from scaler.cluster.mig import profile_problem

WHOLE_GPU_MILLI = 1000

Mode = Literal["pack", "spread"]


@dataclass(frozen=True, slots=True)
class Job:
    """One schedulable unit (a pod).

    `gpu_milli` is the share of each GPU in thousandths: a GPU-sharing job asks `num_gpu` 1
    and `gpu_milli` < 1000; a job with `num_gpu` k > 1 takes k whole GPUs of one node.
    `gpu_models` lists the GPU models it may run on (empty: any). Higher `priority` wins;
    a `placeholder` only holds capacity and is the first to be evicted. `gang` names a
    group placed all or nothing; `mode="spread"` keeps the replicas of one `service` on
    different nodes. `predicted_gpu_s` (GPU-seconds) and `submitted_s` feed the queue.

    A MIG job asks `mig_count` instances of MIG profile `mig_profile` (`1g.10gb`, see
    scaler.cluster.mig) and no whole or shared GPU. `topology_key` names the node label
    whose value a gang's members must share (`topology_required`) or should share, as
    Kueue's topology-aware scheduling asks: a rack or zone label, or
    `kubernetes.io/hostname` for one node.
    """

    id: str
    cpu_milli: int = 0
    memory_mib: int = 0
    num_gpu: int = 0
    gpu_milli: int = 0
    gpu_models: frozenset[str] = frozenset()
    priority: int = 0
    qos: str = ""
    placeholder: bool = False
    gang: str | None = None
    mode: Mode = "pack"
    service: str | None = None
    node_selector: tuple[tuple[str, str], ...] = ()
    tolerations: frozenset[str] = frozenset()
    predicted_gpu_s: float | None = None
    submitted_s: float = 0.0
    mig_profile: str | None = None
    mig_count: int = 1
    topology_key: str | None = None
    topology_required: bool = False

    @property
    def is_sharing(self) -> bool:
        return self.num_gpu == 1 and 0 < self.gpu_milli < WHOLE_GPU_MILLI

    @property
    def gpu_request_milli(self) -> int:
        """GPUs asked in thousandths (the benchmark's 'arrived' measure)."""
        return self.num_gpu * self.gpu_milli

    def problem(self) -> str | None:
        """Why this request is malformed, or None. Checked before any node is scored."""
        for name in ("cpu_milli", "memory_mib", "num_gpu", "gpu_milli"):
            if getattr(self, name) < 0:
                return f"{name} is negative ({getattr(self, name)})"
        if self.gpu_milli > WHOLE_GPU_MILLI:
            return f"gpu_milli {self.gpu_milli} is above one whole GPU (1000)"
        if self.num_gpu == 0 and self.gpu_milli != 0:
            return f"asks a GPU share ({self.gpu_milli}) but no GPU"
        if self.num_gpu > 0 and self.gpu_milli == 0:
            return f"asks {self.num_gpu} GPU(s) with a zero share"
        if self.num_gpu > 1 and self.gpu_milli != WHOLE_GPU_MILLI:
            return f"asks {self.num_gpu} GPUs of share {self.gpu_milli}: only whole GPUs"
        if self.mode not in ("pack", "spread"):
            return f"unknown placement mode {self.mode!r}"
        if self.mode == "spread" and not self.service:
            return "spread mode needs a service id"
        if self.mig_profile is not None:
            return self._mig_problem()
        return None

    def _mig_problem(self) -> str | None:
        if why := profile_problem(str(self.mig_profile)):
            return why
        if self.mig_count < 1:
            return f"asks {self.mig_count} MIG instances"
        if self.num_gpu:
            return "asks whole or shared GPUs and MIG instances at once"
        if self.gpu_models:
            return "a MIG request names its GPU by its profile, not by gpu_models"
        return None
