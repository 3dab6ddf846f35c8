"""What every route depends on: the service's parts, and bearer-token auth for the routes
that change state (FastAPI dependencies, so a route declares what it needs)."""

from __future__ import annotations

import hmac
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, TypeVar

from fastapi import Depends, HTTPException, Request, status
from fastapi.concurrency import run_in_threadpool
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from scaler.controller.config import LiveConfig
from scaler.controller.system import LiveSystem
from scaler.service.cluster import LiveCluster
from scaler.service.extender import Extender
from scaler.service.metrics import ServiceMetrics
from scaler.service.planning import PlanDesk


@dataclass
class ServiceContext:
    config: LiveConfig
    system: LiveSystem
    cluster: LiveCluster
    extender: Extender
    planning: PlanDesk
    metrics: ServiceMetrics
    token: str | None  # None: every mutating call is refused


# The dependencies are coroutines although they never await: FastAPI runs a plain `def`
# dependency in the thread pool, and three thread hops per request cost more than placing.
async def context(request: Request) -> ServiceContext:
    return request.app.state.context


Context = Annotated[ServiceContext, Depends(context)]

T = TypeVar("T")


async def on_engine(cluster: LiveCluster, decide: Callable[[], T]) -> T:
    """Run a decision of the placement engine. It is CPU-bound and takes a fraction of a
    millisecond, so it runs on the event loop: the hop to the thread pool and back, and the
    threads queueing for the GIL and the cluster's lock, cost more than placing (2.5 x the
    placements per second under load without them). When the cluster must first re-list
    its sources, a network round trip made under the lock, the call goes to the thread pool
    so that the loop never waits on I/O. "Must" looks a second ahead: a re-listing falling
    due between this check and the call would otherwise run on the loop."""
    if cluster.sync_due(within_s=1.0):
        return await run_in_threadpool(decide)
    return decide()


_bearer = HTTPBearer(auto_error=False, description="the service's API token")


def _check(ctx: ServiceContext, credentials: HTTPAuthorizationCredentials | None) -> None:
    challenge = {"WWW-Authenticate": "Bearer"}
    if ctx.token is None:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "this service has no API token configured: calls that change state are off",
            headers=challenge,
        )
    if credentials is None or credentials.scheme.lower() != "bearer":
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED, "a bearer token is required", headers=challenge
        )
    # Constant-time: the comparison must not tell how much of a guess was right.
    if not hmac.compare_digest(credentials.credentials.encode(), ctx.token.encode()):
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "invalid token", headers=challenge)


async def require_token(
    ctx: Context,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    _check(ctx, credentials)


async def require_bind_token(
    ctx: Context,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    """kube-scheduler cannot send a bearer token; `service.bind_needs_token: false` lets
    the bind verb in without one."""
    if ctx.config.service.bind_needs_token:
        _check(ctx, credentials)


Authorized = Depends(require_token)
BindAuthorized = Depends(require_bind_token)
