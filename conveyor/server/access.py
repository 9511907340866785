"""Who may call what, how big a request may be, and whether the server would take it at all:
three ASGI middlewares in front of the app.

Plain ASGI rather than Starlette's ``BaseHTTPMiddleware``, which would buffer streamed responses
and hide a client's disconnect from the handlers that watch for it.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Callable

from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from conveyor.server.errors import APIError

DEFAULT_MAX_BODY_BYTES = 16 * 2**20
# for load balancers and Prometheus, as vLLM leaves them
OPEN_PATHS = ("/health", "/ping", "/metrics")
DASHBOARD_PATHS = ("/dashboard", "/v1/engine/")  # the page and the feeds it shows (prompts)
# The page and its scripts hold no data: a browser, which cannot send the key with a page
# load, gets them without it, and the page then sends the key (from /dashboard#key=KEY) with
# each feed request.
PAGE_PATHS = ("/dashboard", "/dashboard/")


def with_cors(app: ASGIApp, settings) -> ASGIApp:
    """``app`` behind Starlette's CORS middleware as the ServerConfig's --allowed-* flags say
    (vLLM's): outermost, so that a browser's preflight is answered before the key is asked."""
    return CORSMiddleware(app, allow_origins=settings.allowed_origins,
                          allow_methods=settings.allowed_methods,
                          allow_headers=settings.allowed_headers,
                          allow_credentials=settings.allow_credentials)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def _answer(send: Send, error: APIError) -> None:
    response = error.response()
    await response({"type": "http"}, _no_receive, send)


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}


class ApiKeyGuard:
    """With a key: every route but /health, /metrics and the dashboard's page and static files
    needs ``Authorization: Bearer KEY`` (compared in constant time), else 401. Without one, the
    dashboard and its feeds (they show prompt text) are served only when ``dashboard_open`` (a
    loopback host or --dashboard-public), else 403."""

    def __init__(self, app: ASGIApp, api_key: str | None, dashboard_open: bool) -> None:
        self.app = app
        self.expected = None if api_key is None else api_key.encode()
        self.dashboard_open = dashboard_open

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        page = scope["path"] in PAGE_PATHS or scope["path"].startswith("/dashboard/static/")
        if self.expected is not None and not page:
            scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(),
                                                                       self.expected):
                return await _answer(send, APIError(
                    401, "missing or incorrect API key: send it as 'Authorization: Bearer KEY'",
                    None, "invalid_api_key", {"WWW-Authenticate": "Bearer"}))
        elif (self.expected is None and not self.dashboard_open
              and scope["path"].startswith(DASHBOARD_PATHS)):
            return await _answer(send, APIError(
                403, "the dashboard shows prompt text: it is served on a non-loopback host only "
                "with --api-key or --dashboard-public", None, "dashboard_not_public"))
        await self.app(scope, receive, send)


class BodyLimit:
    """Refuse a request body over ``max_bytes`` with 413, by its Content-Length when it has one,
    else by counting while reading it (chunked uploads)."""

    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self, size: int | str) -> APIError:
        return APIError(413, f"the request body is {size} bytes; the most this server takes is "
                        f"{self.max_bytes}", None, "request_too_large")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await _answer(send, self._too_large(int(length)))
        # Read the body up to the limit here, then hand it on as one message; what the app
        # receives after it (a disconnect) comes from the client as before.
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left while sending
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await _answer(send, self._too_large(f"more than {self.max_bytes}"))
            if not message.get("more_body", False):
                break
        body, sent = b"".join(chunks), False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class AdmissionGate:
    """Refuse a generation request at once when the server would refuse it anyway (queue full,
    too many in flight, engine dead), before its body is read, parsed and tokenized: under a
    burst of hundreds that work is most of what a refusal costs. Requests that pass are still
    counted exactly when queued."""

    def __init__(self, app: ASGIApp, paths: tuple[str, ...],
                 refusal: Callable[[], APIError | None]) -> None:
        self.app = app
        self.paths = paths
        self.refusal = refusal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in self.paths:
            error = self.refusal()
            if error is not None:
                return await _answer(send, error)
        await self.app(scope, receive, send)
