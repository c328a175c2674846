"""RFC 9457 problem details: every API error as `application/problem+json`, never a traceback."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from console.inputs import error_detail, error_lines
from schemas.errors import (
    BackendError,
    CorruptProjectionError,
    EncodeError,
    InvalidCall,
    MilpaError,
    NoOpenQuestionError,
    QuestionOpenError,
    SessionEndedError,
    SessionRestoringError,
    UnauthorizedError,
    UnknownSessionError,
)

log = logging.getLogger(__name__)

PROBLEM_JSON = "application/problem+json"

# Checked in order: the first class an error is an instance of gives its status.
_STATUS: tuple[tuple[type[MilpaError], int], ...] = (
    (SessionRestoringError, 409),  # half rebuilt until a restore ends: no retry cures it alone
    (CorruptProjectionError, 500),  # damaged: no retry cures it, a rebuild does
    (SessionEndedError, 409),  # late_answer (a subclass) too
    (NoOpenQuestionError, 409),
    (QuestionOpenError, 409),
    (UnknownSessionError, 404),
    (UnauthorizedError, 403),
    (InvalidCall, 422),
    (EncodeError, 422),  # a value the event's schema cannot hold (caught before it is appended)
    (BackendError, 503),
)
_GENERIC_CODES = {401: "unauthenticated", 403: "forbidden", 404: "not_found", 405: "not_allowed"}


class Problem(Exception):  # noqa: N818 - it is a problem, raised
    """An API error with its status, a stable code and a human-readable detail."""

    def __init__(
        self,
        status: int,
        code: str,
        detail: str,
        extra: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.code = code
        self.detail = detail
        self.extra = dict(extra or {})
        self.headers = dict(headers or {})


def problem_response(
    status: int,
    code: str,
    detail: str,
    extra: Mapping[str, Any] | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    """A problem-details response `{type, title, status, detail, code}` (plus extensions)."""
    body: dict[str, Any] = {
        "type": f"urn:milpa-sessions:problem:{code}",
        "title": HTTPStatus(status).phrase,
        "status": status,
        "detail": detail,
        "code": code,
        **(extra or {}),
    }
    return JSONResponse(body, status_code=status, media_type=PROBLEM_JSON, headers=headers)


def status_of(error: MilpaError) -> int:
    """The HTTP status an error of the project's hierarchy is answered with."""
    for kind, status in _STATUS:
        if isinstance(error, kind):
            return status
    return 500


def detail_of(error: MilpaError) -> str:
    """What the caller is told about an error (a backend failure stays vague: it names hosts)."""
    if isinstance(error, CorruptProjectionError):  # (the log has its text)
        return (
            "what is stored of this session cannot be read by this console, and trying again "
            "will not help: if the console is older than the workers, upgrade it; otherwise an "
            "operator rebuilds the session with `milpa-sessions replay --session ID --force`"
        )
    if isinstance(error, BackendError) and not isinstance(error, SessionRestoringError):
        return "the event log or the projection store is unavailable; try again shortly"
    return str(error) or error.code


def logged_status(error: MilpaError, where: str = "") -> int:
    """`status_of(error)`, the error logged whole when it is the server's (5xx): what the
    answer's `detail_of` leaves out."""
    status = status_of(error)
    if status >= 500:
        log.warning("%sanswered %s (%s): %s", where, status, error.code, error)
    return status


def from_error(error: MilpaError) -> JSONResponse:
    """The problem response for an error of the project's hierarchy."""
    return problem_response(logged_status(error), error.code, detail_of(error))


async def _on_problem(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, Problem)
    return problem_response(exc.status, exc.code, exc.detail, exc.extra, exc.headers)


async def _on_milpa(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, MilpaError)
    return from_error(exc)


async def _on_validation(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    errors = error_lines(exc.errors())
    detail = error_detail(errors)
    return problem_response(422, "invalid_request", detail, {"errors": errors})


async def _on_http(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    code = _GENERIC_CODES.get(exc.status_code, "http_error")
    detail = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
    return problem_response(exc.status_code, code, detail, headers=exc.headers)


async def _on_unexpected(request: Request, exc: Exception) -> Response:
    log.error("unexpected error answering %s %s", request.method, request.url.path, exc_info=exc)
    return problem_response(500, "internal_error", "the console failed; the error is logged")


def install(app: FastAPI) -> None:
    """Answer every error the app raises with a problem response."""
    app.add_exception_handler(Problem, _on_problem)
    app.add_exception_handler(MilpaError, _on_milpa)
    app.add_exception_handler(RequestValidationError, _on_validation)
    app.add_exception_handler(StarletteHTTPException, _on_http)
    app.add_exception_handler(Exception, _on_unexpected)
