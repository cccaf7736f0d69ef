"""OpenAI-style errors: every refusal is a response `{"error": {"message", "type", "param", "code"}}`."""
from __future__ import annotations

from typing import Any, Callable

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

# Status -> OpenAI error type, as their API reports them.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after: float | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {}
        if self.retry_after is not None:
            headers["Retry-After"] = str(max(1, int(round(self.retry_after))))
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param, code)


def exception_handlers(log_of: Callable[[Request], Any]) -> dict:
    """Starlette handlers giving every failure the OpenAI error body: unknown paths and wrong methods, our
    own refusals, and anything unexpected (logged through `log_of(request)`, answered as a bare 500)."""

    async def http_error(request: Request, exc: HTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return ApiError(exc.status_code, str(exc.detail), None, code).response()

    async def api_error(request: Request, exc: ApiError) -> Response:
        return exc.response()

    async def unexpected(request: Request, exc: Exception) -> Response:
        log_of(request).exception("unhandled error", path=request.url.path)
        return ApiError(500, "internal server error", None, "internal_error").response()

    return {HTTPException: http_error, ApiError: api_error, Exception: unexpected}
