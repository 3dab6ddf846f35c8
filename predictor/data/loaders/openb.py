"""Alibaba GPU cluster trace v2023 (openb): the node list and the pod lists of the FGD paper.

Pods are validated against the rules the placement benchmark relies on: a CPU-only pod asks
no GPU share, a GPU-sharing pod asks one GPU and a share below 1000, a multi-GPU pod asks
whole GPUs. Optional columns (absent from some re-sampled pod lists) read as empty.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from predictor.data.loaders.csvfile import read_table

WHOLE_GPU_MILLI = 1000
POD_TIMES = ("creation_time", "deletion_time", "scheduled_time")


def load_openb_nodes(path: str | Path) -> pd.DataFrame:
    """Columns `sn` (str, unique), `cpu_milli`, `memory_mib`, `gpu` (int64, >= 0),
    `model` (str; required on a node with GPUs)."""
    table = read_table(
        path, ["sn", "cpu_milli", "memory_mib", "gpu", "model"], text=["sn", "model"]
    )
    sn = table.text("sn")
    table.check_unique(sn, "sn")
    gpu = table.numbers("gpu", integer=True)
    model = table.text("model", required=False)
    no_model = (gpu > 0) & (model == "")
    if no_model.any():
        raise table.error("a node with GPUs needs a GPU model", _first(no_model), "model")
    return pd.DataFrame(
        {
            "sn": sn,
            "cpu_milli": table.numbers("cpu_milli", integer=True).astype("int64"),
            "memory_mib": table.numbers("memory_mib", integer=True).astype("int64"),
            "gpu": gpu.astype("int64"),
            "model": model,
        }
    ).reset_index(drop=True)


def load_openb_pods(path: str | Path) -> pd.DataFrame:
    """Columns `name` (str, unique), `cpu_milli`, `memory_mib`, `num_gpu` (>= 0; no node
    size is assumed here: a pod larger than every node fails at placement, as the benchmark
    protocol counts it), `gpu_milli` (0..1000) as int64, `gpu_spec` (str, models separated
    by `|`, "" = any),
    `qos` and `pod_phase` (str, "" when absent), and `creation_time`, `deletion_time`,
    `scheduled_time` (float seconds, NaN when absent or empty)."""
    table = read_table(
        path,
        ["name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli"],
        optional=["gpu_spec", "qos", "pod_phase", *POD_TIMES],
        text=["name", "gpu_spec", "qos", "pod_phase"],
    )
    present = table.frame.columns
    name = table.text("name")
    table.check_unique(name, "name")
    num_gpu = table.numbers("num_gpu", integer=True)
    gpu_milli = table.numbers("gpu_milli", integer=True, maximum=WHOLE_GPU_MILLI)
    rules = (
        ((num_gpu == 0) & (gpu_milli != 0), "a pod without GPUs must ask gpu_milli 0"),
        ((num_gpu == 1) & (gpu_milli == 0), "a pod with a GPU must ask gpu_milli above 0"),
        (
            (num_gpu > 1) & (gpu_milli != WHOLE_GPU_MILLI),
            "a multi-GPU pod must ask whole GPUs (gpu_milli 1000)",
        ),
    )
    for broken, message in rules:
        if broken.any():
            raise table.error(message, _first(broken), "gpu_milli")
    spec = table.text("gpu_spec", required=False) if "gpu_spec" in present else ""
    if isinstance(spec, pd.Series):
        empty_part = spec.str.contains(r"^\||\|$|\|\|", regex=True)
        if empty_part.any():
            raise table.error(
                f"empty GPU model in {spec.iloc[_first(empty_part)]!r}",
                _first(empty_part),
                "gpu_spec",
            )
    frame = pd.DataFrame(
        {
            "name": name,
            "cpu_milli": table.numbers("cpu_milli", integer=True).astype("int64"),
            "memory_mib": table.numbers("memory_mib", integer=True).astype("int64"),
            "num_gpu": num_gpu.astype("int64"),
            "gpu_milli": gpu_milli.astype("int64"),
            "gpu_spec": spec,
        }
    )
    for column in ("qos", "pod_phase"):
        frame[column] = table.text(column, required=False) if column in present else ""
    for column in POD_TIMES:
        frame[column] = table.numbers(column, required=False) if column in present else float("nan")
    return frame.reset_index(drop=True)


def _first(mask: pd.Series) -> int:
    return int(mask.to_numpy().argmax())
