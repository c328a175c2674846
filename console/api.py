"""The JSON API under `/api/v1`: the waiting questions, the fleet, sessions, the operator's acts.

Read handlers are plain functions (FastAPI runs them in its thread pool: the store's calls block
on Redis); a write runs on the writes' own threads (`Runtime.write`: it blocks until Kafka
acknowledges, and must not hold the pool every request shares). Errors are problem details
(`console.problems`). A write answers 202 with the log position of what it appended.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool
from starlette.types import Receive, Scope, Send

from console import service
from console.auth import Identity
from console.guards import ApiCaller, identify
from console.inputs import (
    MAX_LATEST,
    AnswerRequest,
    EndRequest,
    ModeRequest,
    OperationRequest,
    RevokeRequest,
)
from console.live import TooManyStreamsError, event_stream
from console.problems import Problem
from console.runtime import runtime

router = APIRouter(prefix="/api/v1", tags=["operator API"])
# `/openapi.json`, served here instead of by FastAPI (`openapi_url=None`): to the API's callers.
document = APIRouter(include_in_schema=False)


class Accepted(BaseModel):
    """Where the write was appended (`partition:offset`)."""

    position: str


@router.get("/questions")
def questions(
    caller: ApiCaller,
    request: Request,
    reason: str | None = None,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
) -> dict[str, Any]:
    """Waiting questions across the fleet, soonest deadline first (`after`: a page's `next`)."""
    try:
        cursor = service.parse_cursor(after)
    except ValueError as e:
        raise Problem(422, "invalid_request", f"after: not a cursor ({e})") from e
    return service.waiting_page_record(service.waiting(runtime(request), reason, cursor, limit))


@router.get("/questions/reasons")
def question_reasons(caller: ApiCaller, request: Request) -> dict[str, int]:
    """How many questions wait, per reason code."""
    return dict(sorted(runtime(request).deps.index.waiting_by_reason().items()))


@router.get("/fleet")
def fleet(caller: ApiCaller, request: Request) -> dict[str, Any]:
    """Sessions by status and mode, waiting by reason, pauses per hour (24 h), time to answer."""
    return service.fleet(runtime(request))


@router.get("/sessions/{session_id}")
def session(caller: ApiCaller, request: Request, session_id: str) -> dict[str, Any]:
    """A session: goal, mode, status, plan, todos, permissions, open question, decisions."""
    return service.session(runtime(request), session_id)


@router.get("/sessions/{session_id}/window")
def window(caller: ApiCaller, request: Request, session_id: str) -> list[dict[str, str]]:
    """The messages the model is sent: summary, briefing, unsummarised turns."""
    return service.window(runtime(request), session_id)


@router.get("/sessions/{session_id}/timeline")
def timeline(
    caller: ApiCaller,
    request: Request,
    session_id: str,
    since: Annotated[int, Query(ge=0)] = 0,
    latest: Annotated[int | None, Query(ge=1, le=MAX_LATEST)] = None,
) -> list[dict[str, Any]]:
    """Timeline entries with `seq > since`, each with a readable `sentence`; with `latest`, only
    the last that many (read alone: what a long session's recent page costs)."""
    return service.timeline(runtime(request), session_id, since, latest)


@router.post("/sessions/{session_id}/answer", status_code=202)
async def answer(
    caller: ApiCaller, request: Request, session_id: str, body: AnswerRequest
) -> Accepted:
    """Answer the open question as the caller (verified, signed with the console's key)."""
    rt = runtime(request)
    act = functools.partial(
        service.answer,
        rt,
        caller,
        session_id,
        question_id=body.question_id,
        answer=body.answer,
        confirm=body.confirm,
        asked_seq=body.asked_seq,
    )
    position = await rt.write(act)
    return Accepted(position=str(position))


@router.post("/sessions/{session_id}/grant", status_code=202)
async def grant(
    caller: ApiCaller, request: Request, session_id: str, body: OperationRequest
) -> Accepted:
    """Grant an operation in the session (an operator's signed act)."""
    rt = runtime(request)
    position = await rt.write(service.grant, rt, caller, session_id, body.operation)
    return Accepted(position=str(position))


@router.post("/sessions/{session_id}/revoke", status_code=202)
async def revoke(
    caller: ApiCaller, request: Request, session_id: str, body: RevokeRequest
) -> Accepted:
    """Revoke a granted operation."""
    rt = runtime(request)
    position = await rt.write(service.revoke, rt, caller, session_id, body.operation)
    return Accepted(position=str(position))


@router.post("/sessions/{session_id}/mode", status_code=202)
async def mode(caller: ApiCaller, request: Request, session_id: str, body: ModeRequest) -> Accepted:
    """Change the autonomy mode (a less strict one is signed)."""
    rt = runtime(request)
    position = await rt.write(service.set_mode, rt, caller, session_id, body.mode.value)
    return Accepted(position=str(position))


@router.post("/sessions/{session_id}/end", status_code=202)
async def end(caller: ApiCaller, request: Request, session_id: str, body: EndRequest) -> Accepted:
    """End the session."""
    rt = runtime(request)
    position = await rt.write(service.end, rt, caller, session_id, body.because)
    return Accepted(position=str(position))


@router.get(
    "/events",
    response_class=StreamingResponse,
    responses={200: {"content": {"text/event-stream": {}}}},
)
async def events(caller: ApiCaller, request: Request) -> StreamingResponse:
    """Server-Sent Events: `question` (a question change), `resync` (reload), keepalives.

    A caller (an operator in every tab, or a service) holds at most
    `console_streams_per_caller` of them at once: one more is a 429 `too_many_streams`.
    """
    rt = runtime(request)
    limit = rt.settings.console_streams_per_caller
    try:
        sub = rt.hub.subscribe(caller.principal.id, limit)
    except TooManyStreamsError as e:
        raise Problem(
            429,
            "too_many_streams",
            f"{caller.name} already holds {limit} live streams: close one first",
            headers={"Retry-After": "30"},
        ) from e
    return _HeldStream(
        event_stream(
            rt.hub,
            request.is_disconnected,
            still_signed_in=functools.partial(_still_signed_in, request, caller),
            sub=sub,
        ),
        release=functools.partial(rt.hub.unsubscribe, sub),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
    )


class _HeldStream(StreamingResponse):
    """A stream that detaches its subscriber however it ends, even never iterated (a client
    gone before the first byte): its caller's count must not keep it."""

    def __init__(self, content: AsyncIterator[str], release: Callable[[], None], **kw: Any):
        super().__init__(content, **kw)
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


async def _still_signed_in(request: Request, caller: Identity) -> bool:
    """Whether a stream's caller still holds, read as a request's credentials are (off the
    loop): a cookie session not signed out, its operator's password unchanged in the users file;
    a bearer token still in the tokens file."""
    found = await run_in_threadpool(identify, request)
    if found is None:
        return False
    if caller.via == "cookie":
        return found.session_id == caller.session_id
    return found.principal == caller.principal


@document.get("/openapi.json")
def openapi(caller: ApiCaller, request: Request) -> JSONResponse:
    """The API's OpenAPI document, authenticated like the API (401 problem without)."""
    return JSONResponse(request.app.openapi())
