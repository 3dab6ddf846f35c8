"""The FastAPI application: placement, the kube-scheduler extender, forecasts and the plan.

`create_app(config)` wires the parts (the live system of the reconcile loop, the placement
state, the extender, the plan desk) into routers. Bad input is always a 4xx with a JSON
body: a body that is not JSON 400, one not declared JSON 415 and one above
`service.max_body_bytes` 413 (`bodies`, before any route runs), other invalid input 422
naming the offending field; a failing dependency (the cloud, the API server) is a 503
with its reason.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from predictor.foundation.errors import InputError
from scaler.controller.config import LiveConfig, kube_names
from scaler.controller.system import LiveSystem
from scaler.kube.errors import KubeError
from scaler.kube.watched import watched_cluster
from scaler.providers.base import ProviderError
from scaler.service.bodies import BodyRules
from scaler.service.cluster import LiveCluster
from scaler.service.context import ServiceContext
from scaler.service.extender import Extender
from scaler.service.listing import SharedListing
from scaler.service.metrics import ServiceMetrics
from scaler.service.models import Refused
from scaler.service.planning import PlanDesk
from scaler.service.request_metrics import RequestMetrics
from scaler.service.routers import extender, health, outlook, placements

DESCRIPTION = """Placement and forecasts for GPU clusters.

Calls that change state (`POST`/`DELETE /v1/placements`, `POST /v1/extender/bind`) need
`Authorization: Bearer <token>`. The extender endpoints speak the kube-scheduler's
ExtenderArgs / ExtenderFilterResult / HostPriorityList / ExtenderBindingArgs JSON.
"""


def create_app(config: LiveConfig, system: LiveSystem | None = None) -> FastAPI:
    system = system or LiveSystem.build(config)
    # One snapshot of the cluster per sync interval, for the placement state and the plan:
    # read from the process's watched cache (listed once, then watched) when Kubernetes is
    # the source of nodes.
    listing = SharedListing(config.placement.sync_s)
    if system.kube is not None and config.kubernetes is not None and not config.placement.nodes:
        watched = watched_cluster(
            system.kube,
            kube_names(config.kubernetes),
            config.kubernetes.request_timeout_s,
            config.kubernetes.cache_stale_after_s,
        )
        listing = SharedListing(config.placement.sync_s, observe=watched)
        # A small cluster's first list lands in moments: serve it from the first request.
        # A large one's takes longer than a probe waits; /readyz says when it has landed.
        watched.cache.wait_listed(config.kubernetes.request_timeout_s)
        system.read_through(watched.cache)  # /v1/plan and /v1/nodepools read the provider
    cluster = LiveCluster(system, listing=listing)
    metrics = ServiceMetrics()

    def node_count() -> float:
        state = cluster.state()
        return 0.0 if state is None else float(state.size)

    def allocated() -> float:
        with cluster.lock:
            state = cluster.state()
            if state is None or state.total_gpu_milli == 0:
                return 0.0
            return state.allocated_gpu_milli / state.total_gpu_milli

    metrics.watch_cluster(node_count, allocated)
    app = FastAPI(
        title="gpuscale",
        version="0.1.0",
        description=DESCRIPTION,
        # Answers any route can give, declared so clients (and schemathesis) know them.
        responses={
            400: {"model": Refused, "description": "the body is not JSON"},
            413: {
                "model": Refused,
                "description": "the body is larger than service.max_body_bytes",
            },
            415: {"model": Refused, "description": "the body is not sent as application/json"},
            503: {"description": "the cloud provider or the Kubernetes API cannot be reached"},
        },
    )
    app.state.context = ServiceContext(
        config=config,
        system=system,
        cluster=cluster,
        extender=Extender(cluster),
        planning=PlanDesk(system, observe=listing),
        metrics=metrics,
        token=config.service.bearer_token(),
    )
    for router in (placements.router, extender.router, outlook.router, health.router):
        app.include_router(router)

    # Added first, so it runs inside the metrics: refused bodies are counted too.
    app.add_middleware(BodyRules, max_bytes=config.service.max_body_bytes)
    app.add_middleware(RequestMetrics, metrics=metrics)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        not_json = not_json_reason(exc.errors())
        if not_json is not None:  # as FastAPI answers a body it cannot decode at all
            return JSONResponse({"detail": not_json}, status_code=400)
        # The offending input is not echoed: it may be a secret, or a value JSON cannot
        # carry (a body of `Infinity` made the default handler fail with a 500).
        errors = [{k: e[k] for k in ("type", "loc", "msg") if k in e} for e in exc.errors()]
        return JSONResponse({"detail": errors}, status_code=422)

    @app.exception_handler(InputError)
    async def bad_input(request: Request, exc: InputError) -> JSONResponse:
        loc = ["body", exc.column] if exc.column else ["body"]
        detail = [{"type": "value_error", "loc": loc, "msg": exc.reason}]
        return JSONResponse({"detail": detail}, status_code=422)

    @app.exception_handler(KubeError)
    @app.exception_handler(ProviderError)
    async def dependency_down(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=503)

    return app


def not_json_reason(errors: Sequence[Mapping[str, Any]]) -> str | None:
    """What is wrong with a body that does not parse as JSON (FastAPI reports it as a
    validation error, a 422, where the document promises 400), or None."""
    for error in errors:
        if error.get("type") == "json_invalid":
            where = tuple(error.get("loc", ()))[-1:]
            at = f" at character {where[0]}" if where and isinstance(where[0], int) else ""
            cause = (error.get("ctx") or {}).get("error") or error.get("msg", "")
            return f"the body is not JSON: {cause}{at}"
    return None
