"""The server's errors: `APIError` (status, OpenAI error type, offending field),
what an exception of the request path becomes, and the handlers that write every
error, request validation included, as an OpenAI error body."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from laneserve.core.engine_core import EngineDeadError, QueueFullError
from laneserve.entrypoints.middleware import error_json
from laneserve.frontend.async_llm import EngineStoppedError


class APIError(Exception):
    def __init__(
        self, status: int, message: str, kind: str = "BadRequestError", param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def error_for(e: BaseException) -> APIError:
    """The HTTP error an exception of the request path becomes."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, QueueFullError):
        return APIError(503, str(e), "ServiceUnavailableError")
    if isinstance(e, (EngineDeadError, EngineStoppedError)):
        return APIError(503, str(e), "ServiceUnavailableError")
    if isinstance(e, ValueError):
        return APIError(400, str(e))
    return APIError(500, f"internal error: {e}", "InternalServerError")


# a request failed during generation by what it asked for (its constraint, a field the
# worker could not read): the client's error, as the constraint's 400 would have been
_REQUEST_FAULTS = ("structured_outputs", "request rejected", "the request could not be read")


def request_failure(message: str) -> APIError:
    """The error of a request that failed while it was generated."""
    if any(marker in message for marker in _REQUEST_FAULTS):
        return APIError(
            400, message, param="structured_outputs" if "structured" in message else None
        )
    return APIError(500, message, "InternalServerError")


def _error_response(e: APIError) -> Response:
    body = error_json(e.message, e.kind, e.status, e.param)
    return Response(body, status_code=e.status, media_type="application/json")


def _is_field(part: object) -> bool:
    """A field name or list index in pydantic's error location; not the body itself
    nor the union member tags (`str`, `function-after[...]`, `list[int]`)."""
    if isinstance(part, int):
        return True
    tags = {"body", "str", "int", "float", "bool", "list", "dict", "none"}
    return isinstance(part, str) and part.isidentifier() and part not in tags


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> Response:
        return _error_response(e)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError) -> Response:
        errors = e.errors()
        # NOTE: a union reports one error per member; our own checks say most
        first = next((x for x in errors if x.get("type") == "value_error"), None) or (
            errors[0] if errors else {}
        )
        loc = ".".join(str(x) for x in first.get("loc", ()) if _is_field(x))
        if first.get("type") == "json_invalid":
            return _error_response(APIError(400, "the request body is not valid JSON"))
        return _error_response(
            APIError(
                400, f"{loc or 'body'}: {first.get('msg', 'invalid request')}", param=loc or None
            )
        )

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, e: HTTPException) -> Response:
        return _error_response(APIError(e.status_code, str(e.detail), "HTTPError"))
