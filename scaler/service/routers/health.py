"""Probes and metrics."""

from __future__ import annotations

from fastapi import APIRouter, Response, status
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from scaler.service.context import Context

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> dict[str, str]:
    """The process answers."""
    return {"status": "ok"}


@router.get("/readyz")
def readyz(ctx: Context, response: Response) -> dict[str, object]:
    """Ready when the placement state knows nodes (503 until then, as probes expect)."""
    ready = ctx.cluster.ready()
    if not ready:
        response.status_code = status.HTTP_503_SERVICE_UNAVAILABLE
    return {"ready": ready, "cluster_error": ctx.cluster.error}


@router.get("/metrics", response_class=Response)
def metrics(ctx: Context) -> Response:
    return Response(generate_latest(ctx.metrics.registry), media_type=CONTENT_TYPE_LATEST)
