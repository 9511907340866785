"""Every failure leaves the server as OpenAI's error body: ``{"error": {message, type, param,
code}}``, so clients' error handling works unchanged whatever went wrong."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from conveyor.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger("conveyor.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
          413: "invalid_request_error", 429: "rate_limit_error", 500: "internal_server_error",
          503: "server_overloaded"}


class APIError(Exception):
    """An error to answer with; raised anywhere in a request handler."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=_TYPES.get(status, "invalid_request_error"),
                              param=param, code=code)
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(ErrorResponse(error=self.info).model_dump(), status_code=self.status,
                            headers=self.headers)


def bad_request(message: str, param: str | None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param, code)


_RANGE_ERRORS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal",
                 "too_long", "too_short", "string_too_long")
# pydantic's names of a union's branches, as they appear in an error's loc
_BRANCHES = ("str", "int", "float", "bool", "constrained-str")


def _validation_error(exc: RequestValidationError) -> APIError:
    """Pydantic's first complaint, with the top-level body field as ``param``. Of a union's
    complaints (one a branch) the one that is not a type mismatch says what is wrong, e.g. a
    list too long rather than "should be a valid string"."""
    errors = exc.errors() or [{"loc": (), "msg": "invalid request", "type": ""}]
    first = next((e for e in errors if not str(e.get("type", "")).endswith("_type")), errors[0])
    kind = first.get("type", "")
    if kind == "json_invalid":
        return bad_request(f"malformed JSON in the request body: {first.get('msg')}", None,
                           "invalid_json")
    loc = [str(part) for part in first.get("loc", ())
           if not (isinstance(part, str) and ("[" in part or part in _BRANCHES))]
    field = loc[1] if len(loc) > 1 and loc[0] in ("body", "query") else None
    where = ".".join(loc[1:]) if field else "request body"
    named = getattr(first.get("ctx", {}).get("error"), "param", None)  # a whole-body check's
    if field is None and named is not None:
        return bad_request(str(first["ctx"]["error"]), named, "unsupported_parameter")
    if kind == "missing":
        return bad_request(f"{where}: field required", field, "missing_required_parameter")
    code = "invalid_value" if kind in _RANGE_ERRORS else "invalid_type"
    return bad_request(f"{where}: {first.get('msg')}", field, code)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail), headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in a request handler")
        return APIError(500, f"internal error: {type(exc).__name__}",
                        code="internal_error").response()
