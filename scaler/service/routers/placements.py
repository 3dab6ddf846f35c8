"""`/v1/placements`: a job in, a node and GPU indices out (or why it cannot fit)."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, status

from scaler.placement import Placement
from scaler.service.context import Authorized, Context, on_engine
from scaler.service.models import (
    MAX_NAME,
    JobRequest,
    PlacementResponse,
    ReleaseResponse,
    Unplaceable,
    UnplaceableAnswer,
)

# The most of a client's id an error message quotes back: an id the service could have
# placed is at most MAX_NAME long, and a 5,000-character one was echoed whole.
ECHO_LIMIT = MAX_NAME


def echoed(text: str, limit: int = ECHO_LIMIT) -> str:
    """`text` quoted as an error message quotes a client's input: whole up to `limit`
    characters, else its start and how long it was."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"


router = APIRouter(
    prefix="/v1/placements",
    tags=["placements"],
    responses={401: {"description": "no bearer token, or not the service's"}},
)


@router.post(
    "",
    response_model=PlacementResponse,
    status_code=status.HTTP_201_CREATED,
    dependencies=[Authorized],
    responses={
        409: {"model": UnplaceableAnswer, "description": "no node can take the job now"},
        422: {"description": "the request is malformed (the field is named)"},
    },
)
async def create_placement(request: JobRequest, ctx: Context) -> PlacementResponse:
    """Place a job with the configured policy and commit it (unless `dry_run`)."""
    job = request.to_job()
    decided = await on_engine(
        ctx.cluster,
        lambda: ctx.cluster.place(job, allow_preemption=request.preempt, dry_run=request.dry_run),
    )
    if not isinstance(decided, Placement):
        outcome = "unschedulable"
    else:
        outcome = "dry_run" if request.dry_run else "placed"  # only commits count as placed
    ctx.metrics.placements.labels(outcome).inc()
    if not isinstance(decided, Placement):
        detail = Unplaceable(job_id=decided.job_id, reason=decided.reason).model_dump()
        raise HTTPException(status.HTTP_409_CONFLICT, detail)
    instances = ctx.cluster.mig_instances(job, decided)
    return PlacementResponse.of(decided, instances, committed=not request.dry_run)


@router.delete(
    "/{job_id:path}",
    response_model=ReleaseResponse,
    dependencies=[Authorized],
    responses={404: {"description": "no job of that id is placed"}},
)
async def delete_placement(job_id: str, ctx: Context) -> ReleaseResponse:
    """Release a job's node and GPUs (it finished or was moved)."""
    released = await on_engine(ctx.cluster, lambda: ctx.cluster.release(job_id))
    if released is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no placed job {echoed(job_id)}")
    return ReleaseResponse(job_id=job_id, node=released.node, gpus=list(released.gpus or ()))
