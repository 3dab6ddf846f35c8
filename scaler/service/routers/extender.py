"""The kube-scheduler extender verbs (urlPrefix .../v1/extender, filterVerb `filter`,
prioritizeVerb `prioritize`, bindVerb `bind`)."""

from __future__ import annotations

from fastapi import APIRouter

from scaler.service.context import BindAuthorized, Context, on_engine
from scaler.service.models import (
    ExtenderArgs,
    ExtenderBindingArgs,
    ExtenderBindingResult,
    ExtenderFilterResult,
    HostPriority,
)

router = APIRouter(prefix="/v1/extender", tags=["kube-scheduler extender"])


@router.post("/filter", response_model=ExtenderFilterResult, response_model_exclude_none=True)
async def filter_nodes(args: ExtenderArgs, ctx: Context) -> ExtenderFilterResult:
    """ExtenderArgs in, ExtenderFilterResult out: the candidates the pod fits now."""
    result = await on_engine(ctx.cluster, lambda: ctx.extender.filter(args))
    ctx.metrics.extender.labels("filter", "error" if result.Error else "ok").inc()
    return result


@router.post("/prioritize", response_model=list[HostPriority])
async def prioritize_nodes(args: ExtenderArgs, ctx: Context) -> list[HostPriority]:
    """ExtenderArgs in, HostPriorityList out: the engine's ranking, 10 for its choice."""
    scores = await on_engine(ctx.cluster, lambda: ctx.extender.prioritize(args))
    ctx.metrics.extender.labels("prioritize", "ok").inc()
    return scores


@router.post(
    "/bind",
    response_model=ExtenderBindingResult,
    dependencies=[BindAuthorized],
    responses={401: {"description": "no bearer token, or not the service's"}},
)
def bind_pod(args: ExtenderBindingArgs, ctx: Context) -> ExtenderBindingResult:
    """ExtenderBindingArgs in, ExtenderBindingResult out: GPUs chosen, pod bound."""
    # A plain function, run in the thread pool: binding is a call to the API server.
    result = ctx.extender.bind(args)
    ctx.metrics.extender.labels("bind", "error" if result.Error else "ok").inc()
    return result
