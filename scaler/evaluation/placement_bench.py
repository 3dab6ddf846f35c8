"""The FGD paper's workload-inflation experiment (BENCHMARKS.md, `placement`).

One experiment = one pod list, one policy, one seed: the trace's pods in a seeded random
order, then copies of pods drawn uniformly with replacement (same seed) until the GPUs
requested would pass `ratio` (130%) of the cluster's GPUs. A trace that already asks for
more (a big trace on a small cluster) loses seeded random pods until it does not, as the
paper's artifact does. Pods are placed one at a time,
never deleted; a pod that fits nowhere fails and is skipped. The arrived share is the GPUs
requested by all pods seen so far over the cluster's GPUs; the allocated share is recorded
when the arrived share first reaches 100%, and at the end of the arrivals (the last pod
before 130% would be passed) for 130%.

Pods the loader accepts but this cluster can never run (more GPUs than any node has, an
unknown GPU model) fail like any other pod, with their reason counted in `failures`.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from predictor.foundation.errors import InputError
from scaler.cluster.job import Job
from scaler.cluster.limits import MAX_NODE_GPUS
from scaler.cluster.snapshot import ClusterState
from scaler.placement.decision import Placement
from scaler.placement.engine import place
from scaler.placement.mix import WorkloadMix
from scaler.placement.policies import make_policy

if TYPE_CHECKING:
    import pandas as pd

INFLATION_RATIO = 1.3
# Allocated share at each whole percent of arrived share, 0..130; arrivals stop just short
# of 130%, so the last point is the state at the end of arrivals.
CURVE_POINTS = 131
PUBLISHED_NAMES = {
    "Random": "random",
    "BestFit": "bestfit",
    "DotProd": "dotprod",
    "GpuPacking": "gpupacking",
    "GpuClustering": "gpuclustering",
    "FGD": "fgd",
}


@dataclass(frozen=True)
class Experiment:
    workload: str
    policy: str
    seed: int


@dataclass(frozen=True)
class ExperimentResult:
    experiment: Experiment
    alloc_at_100: float
    alloc_at_130: float
    failed_pods: int
    pods: int
    seconds: float
    nodes: int
    curve: tuple[float, ...]
    failures: dict[str, int] = field(default_factory=dict)
    # Wall time of one placement decision (the engine's `place`, binding aside), ms.
    decision_ms_p50: float = math.nan
    decision_ms_p99: float = math.nan

    def row(self) -> dict[str, object]:
        """The JSON row (contract fields first)."""
        return {
            "workload": self.experiment.workload,
            "policy": self.experiment.policy,
            "seed": self.experiment.seed,
            "alloc_at_100": round(self.alloc_at_100, 3),
            "alloc_at_130": round(self.alloc_at_130, 3),
            "failed_pods": self.failed_pods,
            "seconds": round(self.seconds, 3),
            "pods": self.pods,
            "nodes": self.nodes,
            "decision_ms_p50": round(self.decision_ms_p50, 4),
            "decision_ms_p99": round(self.decision_ms_p99, 4),
        }


def workload_name(path: str | Path) -> str:
    """`openb_pod_list_default.csv` -> `default`; other names keep their stem."""
    stem = Path(path).name.split(".")[0]
    return stem.removeprefix("openb_pod_list_")


def jobs_from_pods(pods: pd.DataFrame) -> list[Job]:
    """Jobs from an openb pod table (columns of `predictor.data.loaders.load_openb_pods`)."""
    return [
        Job(
            id=str(name),
            cpu_milli=int(cpu),
            memory_mib=int(mem),
            num_gpu=int(num),
            gpu_milli=int(milli),
            gpu_models=frozenset(m for m in str(spec).split("|") if m),
            qos=str(qos),
        )
        for name, cpu, mem, num, milli, spec, qos in zip(
            pods["name"],
            pods["cpu_milli"],
            pods["memory_mib"],
            pods["num_gpu"],
            pods["gpu_milli"],
            pods["gpu_spec"],
            pods["qos"],
            strict=True,
        )
    ]


def arrival_order(jobs: Sequence[Job], total_gpu_milli: int, seed: int, ratio: float) -> list[Job]:
    """The trace's jobs shuffled, then seeded copies until `ratio` of the GPUs would be passed
    (or seeded removals until it is not)."""
    rng = np.random.default_rng(seed)
    order = [jobs[i] for i in rng.permutation(len(jobs))]
    requested = sum(j.gpu_request_milli for j in order)
    limit = ratio * total_gpu_milli
    while requested > limit:
        requested -= order.pop(int(rng.integers(len(order)))).gpu_request_milli
    if not any(j.gpu_request_milli for j in jobs):
        return order
    copy = 0
    while True:
        base = jobs[int(rng.integers(len(jobs)))]
        if requested + base.gpu_request_milli > limit:
            return order
        requested += base.gpu_request_milli
        order.append(_copy(base, f"{base.id}~{copy}"))
        copy += 1


def _copy(job: Job, new_id: str) -> Job:
    return Job(
        id=new_id,
        cpu_milli=job.cpu_milli,
        memory_mib=job.memory_mib,
        num_gpu=job.num_gpu,
        gpu_milli=job.gpu_milli,
        gpu_models=job.gpu_models,
        qos=job.qos,
    )


def run_experiment(
    nodes: pd.DataFrame,
    pods: pd.DataFrame,
    experiment: Experiment,
    ratio: float = INFLATION_RATIO,
) -> ExperimentResult:
    """One workload-inflation experiment; `seconds` covers everything after loading."""
    start = time.perf_counter()
    state = ClusterState.from_frame(nodes)
    jobs = jobs_from_pods(pods)
    policy = make_policy(experiment.policy, mix=WorkloadMix.from_jobs(jobs), seed=experiment.seed)
    total = state.total_gpu_milli
    arrived = allocated = failed = 0
    curve = np.full(CURVE_POINTS, np.nan)
    next_point = 0
    at_100 = math.nan
    failures: Counter[str] = Counter()
    order = arrival_order(jobs, total, experiment.seed, ratio)
    decision_s = np.empty(len(order))
    for i, job in enumerate(order):
        arrived += job.gpu_request_milli
        began = time.perf_counter()
        decision = place(state, job, policy)
        decision_s[i] = time.perf_counter() - began
        if isinstance(decision, Placement):
            state.bind(job, decision.node_index, decision.gpus)
            allocated += job.gpu_request_milli
        else:
            failed += 1
            failures[_reason_kind(decision.reason)] += 1
        share = 100.0 * allocated / total
        while next_point < CURVE_POINTS and arrived * 100 >= next_point * total:
            curve[next_point] = share
            next_point += 1
        if math.isnan(at_100) and arrived >= total:
            at_100 = share
    curve[next_point:] = 100.0 * allocated / total
    return ExperimentResult(
        experiment=experiment,
        alloc_at_100=at_100,
        alloc_at_130=100.0 * allocated / total,
        failed_pods=failed,
        pods=len(jobs),
        seconds=time.perf_counter() - start,
        nodes=state.size,
        curve=tuple(float(x) for x in curve),
        failures=dict(failures),
        decision_ms_p50=float(np.median(decision_s)) * 1000 if order else math.nan,
        decision_ms_p99=float(np.percentile(decision_s, 99)) * 1000 if order else math.nan,
    )


def scaled_nodes(nodes: pd.DataFrame, count: int) -> pd.DataFrame:
    """The node list repeated (names suffixed `~r<copy>`) and cut to `count` nodes: the
    same mix of node kinds on a larger cluster, for the decision time at scale."""
    import pandas as pd

    if count <= 0:
        raise ValueError(f"a cluster needs at least one node, asked for {count}")
    copies = -(-count // len(nodes))
    frames = [nodes.assign(sn=nodes["sn"].astype(str) + f"~r{i}") for i in range(copies)]
    return pd.concat(frames, ignore_index=True).iloc[:count].reset_index(drop=True)


def _reason_kind(reason: str) -> str:
    """Group failure reasons: drop the per-pod details after a colon or parenthesis."""
    return reason.split(":")[0].split(" (")[0]


def run_matrix(
    nodes: pd.DataFrame,
    workloads: dict[str, pd.DataFrame],
    policies: Sequence[str],
    seeds: Sequence[int],
    workers: int = 1,
    on_result: Callable[[ExperimentResult], None] | None = None,
) -> list[ExperimentResult]:
    """Every (workload, policy, seed), in parallel processes when `workers` > 1."""
    experiments = [Experiment(w, p, s) for w in workloads for p in policies for s in seeds]
    results = []
    for result in _execute(nodes, workloads, experiments, workers):
        results.append(result)
        if on_result is not None:
            on_result(result)
    order = {e: i for i, e in enumerate(experiments)}
    return sorted(results, key=lambda r: order[r.experiment])


def _execute(
    nodes: pd.DataFrame,
    workloads: dict[str, pd.DataFrame],
    experiments: list[Experiment],
    workers: int,
) -> Iterator[ExperimentResult]:
    if workers <= 1:
        for e in experiments:
            yield run_experiment(nodes, workloads[e.workload], e)
        return
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = [
            pool.submit(run_experiment, nodes, workloads[e.workload], e) for e in experiments
        ]
        for future in as_completed(futures):
            yield future.result()


def load_anchors(path: str | Path) -> dict[tuple[str, str], tuple[float, float]]:
    """Published (alloc_at_100, alloc_at_130) by (workload, our policy name); a missing
    file, column or share (0..100) is an InputError naming it."""
    from predictor.data.loaders.csvfile import read_table

    table = read_table(
        path, ["workload", "policy", "alloc_at_100", "alloc_at_130"], text=["workload", "policy"]
    )
    return {
        (w, PUBLISHED_NAMES.get(p, p.lower())): (float(a), float(b))
        for w, p, a, b in zip(
            table.text("workload"),
            table.text("policy"),
            table.numbers("alloc_at_100", maximum=100),
            table.numbers("alloc_at_130", maximum=100),
            strict=True,
        )
    }


def check_nodes(nodes: pd.DataFrame, path: str | Path) -> None:
    """What the benchmark needs of a loaded node list beyond the loader's checks: every node
    within a node's GPU limit (NodeSpec would raise a bare ValueError) and some GPUs in all
    (the shares allocated are of the total)."""
    over = (nodes["gpu"] > MAX_NODE_GPUS).to_numpy()
    if over.any():
        row = int(over.argmax())
        raise InputError(
            f"{nodes['gpu'].iloc[row]} GPUs; a node holds 0 to {MAX_NODE_GPUS}",
            path=path,
            line=row + 2,  # load_openb_nodes keeps the file's rows in order after its header
            column="gpu",
        )
    if nodes["gpu"].sum() == 0:
        raise InputError("the nodes hold no GPUs: there is no share to allocate", path=path)
