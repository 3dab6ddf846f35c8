"""`/v1/forecasts`, `/v1/plan` and `/v1/nodepools`: what the loop sees and would do."""

from __future__ import annotations

from fastapi import APIRouter

from scaler.service.context import Context
from scaler.service.models import ForecastResponse, NodePoolResponse, PlanResponse

router = APIRouter(prefix="/v1", tags=["forecasts and plan"])


@router.get("/forecasts", response_model=ForecastResponse)
def forecasts(ctx: Context) -> ForecastResponse:
    """Demand quantiles per series and horizon, with the telemetry's freshness."""
    return ctx.planning.forecasts()


@router.get("/plan", response_model=PlanResponse)
def capacity_plan(ctx: Context) -> PlanResponse:
    """The reconcile loop's decision now (a dry run): sizes, reasons, removals, placeholders."""
    return ctx.planning.plan()


@router.get("/nodepools", response_model=list[NodePoolResponse])
def nodepools(ctx: Context) -> list[NodePoolResponse]:
    """Every pool: template, bounds, target size and nodes."""
    return ctx.planning.nodepools()
