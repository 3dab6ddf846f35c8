"""Expected leftover: how much of a GPU's free share will most likely never be given out.

FGD values a GPU's free share by the chance that the *next* job of the mix cannot use it.
On the openb mix that misjudges the shares sharing jobs leave: a 530 left by a 470 job
counts as four-fifths fragmented (most jobs ask more), so FGD puts a 320 job there (210
left: fragmentation falls) rather than on an idle GPU (680 left, three-quarters
fragmented). Yet the next 470 would have filled the 530 (60 left) and a 650 the 680, while
only the scarce 50-160 jobs fit a 210, and the 190s that 810 jobs leave compete for them.

`expected_leftover(mix)[f]` is the share (thousandths) that a GPU with free share `f` still
has free once the cluster is full, estimated on the mix itself: its GPU jobs, drawn by
popularity, arrive at a cluster of plain GPUs (no nodes, CPU or GPU models) until they ask
for `DEMAND` times its GPUs; a whole-GPU job takes idle GPUs, a sharing job the GPU whose
expected leftover grows least (the tightest on ties). Each time a sharing job leaves a GPU
with `f` free, what that GPU has free at the end is one sample of the value at `f`. The
first round places by FGD's one-step view (`f` times the chance that the next GPU job
cannot use it), each later one by the mean of all samples so far: pooling the rounds keeps
the values from swinging (a free share that one round's values make look cheap is created
often, found costly, then avoided and left unseen in the next). Free shares seen fewer than
`MIN_VISITS` times are interpolated between their neighbours. A pure function of the mix:
the same mix always gives the same table, computed once per mix.
"""

from __future__ import annotations

import functools

import numpy as np

from scaler.cluster.job import WHOLE_GPU_MILLI
from scaler.placement.mix import WorkloadMix

# The simulated cluster and how far past its size it is asked: leftovers are what stays
# free once demand has filled it, so it is run to saturation.
GPUS = 4000
DEMAND = 1.3
ROUNDS = 4
RUNS_PER_ROUND = 2
MIN_VISITS = 40
SEED = 0

Kind = tuple[int, int]  # (share per GPU, GPUs); a sharing job is (share < 1000, 1)


@functools.lru_cache(maxsize=32)
def expected_leftover(mix: WorkloadMix) -> np.ndarray:
    """Leftover (thousandths) by free share 0..1000 of a GPU; read-only. All zeros for a
    mix without sharing jobs (every GPU is then taken whole or not at all)."""
    kinds, weights = gpu_jobs(mix)
    sharing = np.array([k == 1 and s < WHOLE_GPU_MILLI for s, k in kinds], dtype=bool)
    values = np.zeros(WHOLE_GPU_MILLI + 1)
    if sharing.any():
        shares = np.array([s for s, _ in kinds])[sharing]
        values = one_step(shares, weights[sharing], float(weights[~sharing].sum()))
        mean_ask = float(sum(w * s * k for w, (s, k) in zip(weights, kinds, strict=True)))
        draws = int(2 * DEMAND * GPUS * WHOLE_GPU_MILLI / mean_ask) + 16  # more than will fit
        rng = np.random.default_rng(SEED)
        total = np.zeros(WHOLE_GPU_MILLI + 1)
        visits = np.zeros(WHOLE_GPU_MILLI + 1)
        for _ in range(ROUNDS):
            for _ in range(RUNS_PER_ROUND):
                arrivals = rng.choice(len(kinds), size=draws, p=weights).tolist()
                t, v = fill(kinds, arrivals, values, GPUS)
                total += t
                visits += v
            values = smoothed(total, visits, int(shares.min()))
    values.setflags(write=False)
    return values


def gpu_jobs(mix: WorkloadMix) -> tuple[list[Kind], np.ndarray]:
    """The mix's GPU job kinds with their popularity among GPU jobs."""
    kinds: list[Kind] = []
    weights: list[float] = []
    for shape, p in zip(mix.shapes, mix.popularity, strict=True):
        if shape.num_gpu:
            whole = shape.num_gpu > 1 or shape.gpu_milli >= WHOLE_GPU_MILLI
            kinds.append((WHOLE_GPU_MILLI if whole else shape.gpu_milli, shape.num_gpu))
            weights.append(p)
    if not kinds:
        return [], np.zeros(0)
    w = np.array(weights)
    return kinds, w / w.sum()


def one_step(shares: np.ndarray, weights: np.ndarray, whole: float) -> np.ndarray:
    """FGD's view of one GPU: free share times the chance the next GPU job cannot use it."""
    free = np.arange(WHOLE_GPU_MILLI + 1)
    usable = (shares[None, :] <= free[:, None]) @ weights
    usable[WHOLE_GPU_MILLI] += whole
    values = free * (1.0 - usable)
    values[WHOLE_GPU_MILLI] = 0.0
    return values


def fill(
    kinds: list[Kind], arrivals: list[int], values: np.ndarray, gpus: int
) -> tuple[np.ndarray, np.ndarray]:
    """Place `arrivals` (indices into `kinds`) on `gpus` plain GPUs until they ask for
    `DEMAND` times the GPUs; per free share left by a sharing job, the sum of those GPUs'
    final free shares and how many times it was left."""
    whole = WHOLE_GPU_MILLI
    limit = DEMAND * gpus * whole
    # Per sharing kind, the free shares it may take, best first (least growth, tightest).
    choices: list[list[int] | None] = []
    for share, count in kinds:
        if count == 1 and share < whole:
            free = np.arange(share, whole + 1)
            choices.append(free[np.lexsort((free, values[free - share] - values[free]))].tolist())
        else:
            choices.append(None)
    free_of: list[int] = []  # free share of each GPU a sharing job opened
    holding: dict[int, list[int]] = {}  # free share -> GPUs (opened ones) with it
    idle = gpus
    left_gpu: list[int] = []
    left_share: list[int] = []
    asked = 0
    for kind in arrivals:
        share, count = kinds[kind]
        asked += share * count
        if asked > limit:
            break
        order = choices[kind]
        if order is None:
            if idle >= count:
                idle -= count
            continue
        gpu = -1
        for free in order:
            if free == whole:
                if idle:
                    idle -= 1
                    gpu = len(free_of)
                    free_of.append(whole)
                    break
            elif holding.get(free):
                gpu = holding[free].pop()
                break
        if gpu < 0:
            continue
        free_of[gpu] -= share
        holding.setdefault(free_of[gpu], []).append(gpu)
        left_gpu.append(gpu)
        left_share.append(free_of[gpu])
    final = np.array(free_of, dtype=float)[np.array(left_gpu, dtype=np.int64)]
    shares = np.array(left_share, dtype=np.int64)
    return (
        np.bincount(shares, weights=final, minlength=whole + 1),
        np.bincount(shares, minlength=whole + 1).astype(float),
    )


def smoothed(total: np.ndarray, visits: np.ndarray, smallest: int) -> np.ndarray:
    """Mean final free share per free share, where seen `MIN_VISITS` times; a share below
    the `smallest` sharing job's stays whole; in between, linear between the known ones
    (an idle GPU is left to whole-GPU jobs)."""
    free = np.arange(WHOLE_GPU_MILLI + 1)
    seen = (visits >= MIN_VISITS) & (free >= smallest) & (free < WHOLE_GPU_MILLI)
    known = seen | (free < smallest)
    mean = np.where(seen, total / np.maximum(visits, 1), free)
    return np.interp(free, np.append(free[known], WHOLE_GPU_MILLI), np.append(mean[known], 0.0))
