"""Price between equal fits: where a job fits nodes of several pools equally well, the
cheaper GPU takes it.

A node carries its pool's price (`NodeSpec.price_per_hour`, per GPU-hour in
`ClusterState.gpu_price`). Every scoring policy breaks its ties (equal scores; for
`gpuscale`, scores within its tolerance) with `cheapest` before its seeded node order, so
fit still comes first: a dearer node the policy fits better (a partly used GPU, a node
whose CPU would otherwise strand its GPUs) keeps the job, where the GPUs are paid for
anyway. A job that names GPU models (or a MIG profile) chose its GPU itself and is not
steered by price; nor is a CPU-only job, whose price is not its nodes' GPUs'. A node of
unknown price is never steered away from, as a node without topology labels is not.

With one price, or none (the placement benchmark's clusters), `cheapest` keeps every tied
node, and each decision is what it was without prices.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from scaler.cluster.job import Job
from scaler.cluster.snapshot import ClusterState

if TYPE_CHECKING:
    from scaler.placement.policies.base import Policy


def weighs_price(job: Job) -> bool:
    """Whether price may decide between equal fits for `job`: a GPU job that left the GPU
    model to the engine."""
    return job.num_gpu > 0 and not job.gpu_models and job.mig_profile is None


def cheapest(state: ClusterState, job: Job, tied: np.ndarray) -> np.ndarray:
    """The nodes of `tied` (fits the policy scores alike) at the lowest known GPU price,
    with those of unknown price; all of `tied` where price does not weigh."""
    if state.gpu_price is None or tied.size < 2 or not weighs_price(job):
        return tied
    price = state.gpu_price[tied]
    known = np.isfinite(price)
    if not known.any():
        return tied
    return tied[~known | (price == price[known].min())]


def explain_choice(
    state: ClusterState, job: Job, node: int, nodes: np.ndarray, policy: Policy
) -> str:
    """Why `policy` gave `job` `node` of the candidates `nodes`, in one sentence: its GPU,
    its price and, where price weighs, how it compares with the other GPUs that could hold
    the job. Every claim follows from the tie rule: a dearer node chosen over a cheaper one
    was the better fit, and the cheapest was at least as good a fit as any."""
    head = f"{state.names[node]} ({_gpu(state, node)}{_priced(state, node)})"
    if not policy.weighs_price:
        return f"{head}: the {policy.name} policy takes any node that fits, whatever its price"
    best = f"the {policy.name} policy's best fit"
    if job.mig_profile is not None:
        return f"{head}: {best}; the job asks for MIG {job.mig_profile}, so price is not weighed"
    if job.gpu_models:
        asked = ", ".join(sorted(job.gpu_models))
        return f"{head}: {best}; the job asks for {asked}, so price is not weighed"
    if job.num_gpu == 0:
        return f"{head}: {best}; a job without GPUs is not placed by GPU price"
    own = _price(state, node)
    others = [] if own is None else _other_prices(state, nodes, own)
    if not others:
        return f"{head}: {best}"
    cheaper = [text for price, text in others if price < own]
    if cheaper:
        return (
            f"{head}: {best}; it fits the job better here than on the nodes of cheaper GPUs"
            f" that could hold it ({', '.join(cheaper)})"
        )
    dearer = ", ".join(text for _, text in others)
    return (
        f"{head}: the cheapest GPU that can hold the job ({dearer} could too) and a best fit"
        f" of the {policy.name} policy, which gives equal fits to the cheaper GPU"
    )


def _price(state: ClusterState, node: int) -> float | None:
    if state.gpu_price is None or not np.isfinite(state.gpu_price[node]):
        return None
    return float(state.gpu_price[node])


def _gpu(state: ClusterState, node: int) -> str:
    return _model_name(state, int(state.model_id[node]))


def _model_name(state: ClusterState, model: int) -> str:
    return "no GPU" if model < 0 else state.models[model]


def _priced(state: ClusterState, node: int) -> str:
    price = _price(state, node)
    return "" if price is None else f", ${price:.2f} per GPU-hour"


def _other_prices(state: ClusterState, nodes: np.ndarray, own: float) -> list[tuple[float, str]]:
    """(price, "H100 at $12.29") of each known GPU price among `nodes` other than `own`,
    cheapest first (in numpy: a decision on thousands of nodes must stay well under 1 ms)."""
    assert state.gpu_price is not None
    price = state.gpu_price[nodes]
    other = np.isfinite(price) & (price != own)
    pairs = np.unique(np.stack([price[other], state.model_id[nodes][other]], axis=1), axis=0)
    return [(float(p), f"{_model_name(state, int(m))} at ${p:.2f}") for p, m in pairs.tolist()]
