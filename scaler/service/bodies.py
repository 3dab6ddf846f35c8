"""Request bodies a route may read: declared JSON, and at most `service.max_body_bytes`.
Others are refused before any route runs, in the JSON error body (`{"detail": ...}`) that
every other refusal has, as plain ASGI middleware (see `request_metrics` for why not
Starlette's `BaseHTTPMiddleware`).

- 415: a body whose Content-Type is not JSON (`application/json`, or a `+json` type), or
  that has none. FastAPI hands such a body to validation as bytes and answers 422 "Input
  should be a valid dictionary", which names no cause; without a Content-Type it leaves the
  body unparsed as well (its strict content type, a guard against cross-site requests).
- 413: a declared Content-Length above the limit, answered at once; a body that grows past
  it as it is read (chunked), from that read, as an HTTPException the app renders as
  JSON. Starlette's own limiter answers in plain text, and replaces any answer to a
  request that declared too much with that text.
"""

from __future__ import annotations

from collections.abc import Mapping

from fastapi import HTTPException, status
from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from scaler.service.request_metrics import ASGIApp, Message, Receive, Scope, Send

Refusal = tuple[int, str]


def is_json(content_type: str | None) -> bool:
    """Whether a Content-Type header declares JSON (parameters such as charset aside)."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    kind, _, subtype = media.partition("/")
    return kind == "application" and (subtype == "json" or subtype.endswith("+json"))


def too_large(max_bytes: int) -> Refusal:
    return status.HTTP_413_CONTENT_TOO_LARGE, (
        f"the body is larger than service.max_body_bytes ({max_bytes} bytes)"
    )


def refusal(headers: Mapping[str, str], max_bytes: int) -> Refusal | None:
    """Why a request's body is refused before it is read, from its headers alone; None
    for a request without a body or with an acceptable one."""
    length = headers.get("content-length")
    declared = int(length) if length is not None and length.strip().isdigit() else None
    if declared == 0 or (length is None and "transfer-encoding" not in headers):
        return None  # no body: nothing to declare
    if declared is not None and declared > max_bytes:
        return too_large(max_bytes)
    content_type = headers.get("content-type")
    if not is_json(content_type):
        got = f"not {content_type}" if content_type else "and it came without one"
        return (
            status.HTTP_415_UNSUPPORTED_MEDIA_TYPE,
            f"the body must be JSON sent as Content-Type: application/json, {got}",
        )
    return None


class BodyRules:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refused = refusal(Headers(scope=scope), self.max_bytes)
        if refused is not None:
            code, detail = refused
            await JSONResponse({"detail": detail}, status_code=code)(scope, receive, send)
            return
        await self.app(scope, self._counted(receive), send)

    def _counted(self, receive: Receive) -> Receive:
        """`receive`, refusing the read that takes the body past the limit."""
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    code, detail = too_large(self.max_bytes)
                    raise HTTPException(code, detail)
            return message

        return counted
