"""The server-rendered pages: sign-in, the fleet overview, the inbox and a session.

Forms post to the page routes with the session's CSRF token in a hidden `csrf` field; a form is
checked with the API's own limits (`console.inputs`), and each act redirects back (303) with a
flash message saying what happened or what went wrong. The store's blocking reads run in the
thread pool, its writes on the writes' own threads (`Runtime.write`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import quote

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.responses import RedirectResponse, Response

from console import service
from console.auth import LOGIN_COOKIE, SESSION_COOKIE, Identity, cookie_name, csrf_matches
from console.charts import pauses_chart, reason_classes, tta_chart
from console.guards import PageCaller, identify, read_form, safe_next
from console.inputs import (
    Act,
    AnswerRequest,
    EndRequest,
    ModeRequest,
    OperationRequest,
    RevokeRequest,
    validated,
)
from console.problems import detail_of, logged_status
from console.runtime import Runtime, runtime
from schemas.errors import MilpaError, UnknownSessionError
from session_model.modes import Mode
from session_model.projection import Position

log = logging.getLogger(__name__)
router = APIRouter(include_in_schema=False)

FLASH_COOKIE = "milpa_console_flash"
_FLASH_SECONDS = 120
_LOGIN_FORM_SECONDS = 3600
MAX_USERNAME_CHARS = 256  # a longer name is no operator's: refused unchecked and uncounted


# -- rendering -------------------------------------------------------------------------------------


def render(
    request: Request,
    template: str,
    caller: Identity | None,
    context: Mapping[str, Any],
    status: int = 200,
) -> Response:
    """A page, with the flash message (read once) and what every page shows."""
    rt = runtime(request)
    flash = rt.cookies.loads(_cookie(request, FLASH_COOKIE), "flash", _FLASH_SECONDS)
    now = rt.deps.now()
    response = rt.templates.TemplateResponse(
        request,
        template,
        {
            "caller": caller,
            "csrf": caller.csrf if caller is not None else None,
            "flash": flash if isinstance(flash, dict) else None,
            "now_ms": int(now.timestamp() * 1000),
            "now": now,
            "signing": rt.deps.store.signer is not None,
            **context,
        },
        status_code=status,
    )
    if _cookie(request, FLASH_COOKIE) is not None:
        _delete_cookie(request, response, FLASH_COOKIE)
    return response


FLASH_CHARS = 400  # a flash rides in a cookie: browsers drop one over ~4 KB (and proxies 502)


def back(request: Request, to: str, kind: str, text: str) -> Response:
    """A 303 to `to` that shows `text` there once (its first `FLASH_CHARS` characters)."""
    response = RedirectResponse(to, status_code=303)
    if len(text) > FLASH_CHARS:
        text = text[: FLASH_CHARS - 1] + "…"
    flash = runtime(request).cookies.dumps({"kind": kind, "text": text}, "flash")
    _set_cookie(request, response, FLASH_COOKIE, flash, _FLASH_SECONDS)
    return response


def _cookie(request: Request, base: str) -> str | None:
    """The request's cookie of that name (`cookie_name`)."""
    return request.cookies.get(cookie_name(base, runtime(request).settings.console_cookie_secure))


def _set_cookie(request: Request, response: Response, base: str, value: str, age: float) -> None:
    rt = runtime(request)
    secure = rt.settings.console_cookie_secure
    if not secure and _through_tls(request) and rt.insecure_cookie_noticed():
        # The start-up warning saw a loopback address: a TLS proxy on this machine forwards.
        log.warning(
            "requests come over HTTPS (through a proxy: X-Forwarded-Proto) but "
            "MILPA_CONSOLE_COOKIE_SECURE is off: sign-in cookies are not marked Secure, so a "
            "browser also sends them over plain HTTP to this host; set it"
        )
    response.set_cookie(
        cookie_name(base, secure),
        value,
        max_age=int(age),
        path="/",
        httponly=True,
        samesite="lax",
        secure=secure,
    )


def _through_tls(request: Request) -> bool:
    """Whether the browser reached the console over HTTPS, directly or through a proxy."""
    forwarded = request.headers.get("x-forwarded-proto", "")
    return request.url.scheme == "https" or forwarded.split(",")[0].strip().lower() == "https"


def _delete_cookie(request: Request, response: Response, base: str) -> None:
    # (a `__Host-` cookie is deleted only by a Set-Cookie that is Secure too)
    secure = runtime(request).settings.console_cookie_secure
    response.delete_cookie(
        cookie_name(base, secure), path="/", httponly=True, samesite="lax", secure=secure
    )


def _field(form: FormData, name: str) -> str:
    value = form.get(name)
    return value if isinstance(value, str) else ""


# -- signing in and out ----------------------------------------------------------------------------


def _login_page(request: Request, next_path: str, error: str | None, status: int) -> Response:
    rt = runtime(request)
    token = secrets.token_urlsafe(24)
    response = render(
        request,
        "login.html",
        None,
        {"login_csrf": token, "next": next_path, "error": error},
        status,
    )
    _set_cookie(
        request, response, LOGIN_COOKIE, rt.cookies.dumps(token, "login"), _LOGIN_FORM_SECONDS
    )
    return response


@router.get("/login")
async def login_form(request: Request, next: str | None = None) -> Response:
    """The sign-in form."""
    if await run_in_threadpool(identify, request) is not None:
        return RedirectResponse(safe_next(next), status_code=303)
    return _login_page(request, safe_next(next), None, 200)


@router.post("/login")
async def login(request: Request) -> Response:
    """Check the password; on success a signed session cookie and a 303 to where they were going."""
    rt = runtime(request)
    form = await read_form(request)
    username, password = _field(form, "username").strip(), _field(form, "password")
    next_path = safe_next(_field(form, "next"))
    expected = rt.cookies.loads(_cookie(request, LOGIN_COOKIE), "login", _LOGIN_FORM_SECONDS)
    if not isinstance(expected, str) or not csrf_matches(expected, _field(form, "csrf")):
        return _login_page(request, next_path, "The sign-in form expired: please try again.", 400)
    if not username or not password or len(username) > MAX_USERNAME_CHARS:
        # Never checked, so never counted: names made up by the million must not fill every
        # bucket (and lock every operator out) at the price of one Redis call each.
        await asyncio.sleep(rt.settings.console_login_delay)
        return _login_page(request, next_path, "Unknown operator or wrong password.", 401)
    throttle = rt.throttle
    host = request.client.host if request.client is not None else None
    # An address that used up its attempts is refused before it takes a place among the password
    # checks (read, not counted): one address flooding must not hold the places every operator's
    # sign-in needs. Counting waits for a place, so a sign-in refused 503 counts against nobody.
    wait_s = await run_in_threadpool(throttle.refused_from, host)
    if wait_s > 0:
        log.warning("sign-in from %s refused: too many attempts (%.0f s left)", host, wait_s)
        return _too_many(request, next_path, "Too many sign-ins from this address", wait_s)
    with rt.passwords.admitted() as admitted:
        if not admitted:  # a flood holds every place: nothing is counted, nothing waits
            busy = _login_page(
                request, next_path, "Every password check is busy: try again in a moment.", 503
            )
            busy.headers["Retry-After"] = "1"
            return busy
        # Counted once admitted, the address's count first (its attempts racing past the read
        # above are refused here).
        wait_s = await run_in_threadpool(throttle.attempt_from, host)
        if wait_s > 0:  # neither the name's count nor the password is touched
            log.warning("sign-in from %s refused: too many attempts (%.0f s left)", host, wait_s)
            return _too_many(request, next_path, "Too many sign-ins from this address", wait_s)
        wait_s = await run_in_threadpool(throttle.attempt, username)  # counted before the check
        if wait_s > 0:  # the password is not even checked
            # Never the name: operators sometimes type their password into it. Its keyed bucket
            # tells one name's refusals from another's without telling the name.
            bucket = throttle.bucket(username)
            log.warning(
                "sign-in of name bucket %s refused: too many failures (%.0f s left)", bucket, wait_s
            )
            return _too_many(request, next_path, "Too many failed sign-ins with this name", wait_s)
        stored = await run_in_threadpool(_checked, rt, username, password)
    if stored is None:
        await asyncio.sleep(rt.settings.console_login_delay)  # slows down guessing
        return _login_page(request, next_path, "Unknown operator or wrong password.", 401)
    await run_in_threadpool(throttle.succeeded, username)
    value, _ = rt.cookies.issue(username, stored)
    response = RedirectResponse(next_path, status_code=303)
    _set_cookie(request, response, SESSION_COOKIE, value, rt.cookies.session_seconds)
    _delete_cookie(request, response, LOGIN_COOKIE)
    return response


def _checked(rt: Runtime, username: str, password: str) -> str | None:
    """The stored hash `password` matched, if it is `username`'s in the users file as it is now."""
    rt.users.refresh()
    return rt.passwords.verified(username, password)


def _too_many(request: Request, next_path: str, what: str, wait_s: float) -> Response:
    """The sign-in form again, 429 with `Retry-After`: `what`, and when to try again."""
    minutes = max(1, math.ceil(wait_s / 60))
    refused = _login_page(request, next_path, f"{what}: try again in {minutes} minute(s).", 429)
    refused.headers["Retry-After"] = str(math.ceil(wait_s))
    return refused


@router.post("/logout")
async def logout(request: Request, caller: PageCaller) -> Response:
    """Sign out: the session's cookie is dropped and refused from now on."""
    if caller.session_id is not None:
        await run_in_threadpool(runtime(request).cookies.revoke, caller.session_id)
    response = RedirectResponse("/login", status_code=303)
    _delete_cookie(request, response, SESSION_COOKIE)
    return response


# -- reading ---------------------------------------------------------------------------------------


@router.get("/")
async def overview(request: Request, caller: PageCaller) -> Response:
    """The fleet overview: counts, pauses by reason per hour, time to answer, waiting by reason."""
    rt = runtime(request)
    fleet = await run_in_threadpool(service.fleet, rt)
    statuses = sorted(fleet["by_status"])
    counts = {(row["status"], row["mode"]): row["count"] for row in fleet["sessions"]}
    rows = [*fleet["pauses_by_hour"], *fleet["time_to_answer"]]
    palette = reason_classes([row["reason"] for row in rows if row["count"]])
    context = {
        "fleet": fleet,
        "modes": [m.value for m in Mode],
        "statuses": statuses,
        "counts": counts,
        "pauses": pauses_chart(fleet["pauses_by_hour"], rt.deps.now(), palette=palette),
        "tta": tta_chart(fleet["time_to_answer"], palette=palette),
    }
    return render(request, "overview.html", caller, context)


@router.get("/inbox")
async def inbox(
    request: Request,
    caller: PageCaller,
    reason: str | None = None,
    after: str | None = None,
) -> Response:
    """Waiting questions across the fleet, soonest deadline first, updated live."""
    rt = runtime(request)
    try:
        cursor = service.parse_cursor(after)
    except ValueError:
        return back(request, "/inbox", "error", "That page link is not valid any more.")

    def read() -> tuple[dict[str, Any], dict[str, int]]:
        page = service.waiting(rt, reason, cursor, 50)
        return service.waiting_page_record(page), rt.deps.index.waiting_by_reason()

    page, reasons = await run_in_threadpool(read)
    context = {"page": page, "reasons": dict(sorted(reasons.items())), "reason": reason or ""}
    return render(request, "inbox.html", caller, context)


@router.get("/sessions")
async def find_session(request: Request, caller: PageCaller, id: str = "") -> Response:
    """Go to the session named in the header's search box."""
    session_id = id.strip()
    if not session_id:
        return RedirectResponse("/", status_code=303)
    return RedirectResponse(session_path(session_id), 303)


def session_path(session_id: str) -> str:
    """The session page's path, the id quoted whole (a `/`, `?` or `#` in it stays the id's)."""
    return f"/sessions/{quote(session_id, safe='')}"


@router.get("/sessions/{session_id}", name="session_page")
async def session_page(request: Request, caller: PageCaller, session_id: str) -> Response:
    """A session: state, the window, the timeline as sentences, decisions, and the forms to act."""
    rt = runtime(request)
    try:
        view = await run_in_threadpool(service.session_view, rt, session_id, service.PAGE_TIMELINE)
    except UnknownSessionError:
        missing = {"title": "No such session", "message": f"There is no session «{session_id}»."}
        return render(request, "error.html", caller, missing, 404)
    except MilpaError as e:
        # The API's status (half rebuilt 409, damaged 500, a backend away 503), and its log.
        failed = {"title": "The session cannot be read", "message": detail_of(e)}
        status = logged_status(e, "the session page ")
        return render(request, "error.html", caller, failed, status)
    question = view["question"]
    grantable = ""
    if question is not None:
        grantable = (
            service.grantable(question["id"], question["reason"], question.get("options") or ())
            or ""
        )
    context = {"s": view, "modes": [m.value for m in Mode], "grantable": grantable}
    return render(request, "session.html", caller, context)


# -- acting ----------------------------------------------------------------------------------------


def form_input(model: type[Act], form: FormData) -> Act:
    """A form's fields as `model`, under the API's very limits (`console.inputs.validated`): a
    field left out (or sent as a file) is absent, as in a JSON body; an optional one left empty
    is absent too, a required one left empty is the empty text."""
    data: dict[str, object] = {}
    for name, info in model.model_fields.items():
        value = form.get(name)
        if isinstance(value, str) and (value or info.is_required()):
            data[name] = value
    return validated(model, data)


async def _act(
    request: Request,
    session_id: str,
    model: type[Act],
    act: Callable[[Runtime, Act], Position],
    done: Callable[[Act], str],
) -> Response:
    """Check the form as the API checks its body, act, and go back saying what happened (a
    refused input, like a refused act, is a flash error: `invalid_request`)."""
    rt = runtime(request)
    form = await read_form(request)
    to = session_path(session_id)
    try:
        body = form_input(model, form)
        position = await rt.write(act, rt, body)
    except MilpaError as e:
        return back(request, to, "error", f"Not done ({e.code}): {detail_of(e)}")
    return back(request, to, "ok", f"{done(body)} (appended at {position}).")


@router.post("/sessions/{session_id}/answer")
async def answer(request: Request, caller: PageCaller, session_id: str) -> Response:
    """Answer the open question (a signature question only with the operation typed back)."""
    return await _act(
        request,
        session_id,
        AnswerRequest,
        lambda rt, b: service.answer(
            rt,
            caller,
            session_id,
            question_id=b.question_id,
            answer=b.answer,
            confirm=b.confirm,
            asked_seq=b.asked_seq,
        ),
        lambda b: f"Answered «{b.answer}» as {caller.principal.id}",
    )


@router.post("/sessions/{session_id}/grant")
async def grant(request: Request, caller: PageCaller, session_id: str) -> Response:
    """Grant an operation (signed with the console's operator key)."""
    return await _act(
        request,
        session_id,
        OperationRequest,
        lambda rt, b: service.grant(rt, caller, session_id, b.operation),
        lambda b: f"Granted «{b.operation.strip()}»",
    )


@router.post("/sessions/{session_id}/revoke")
async def revoke(request: Request, caller: PageCaller, session_id: str) -> Response:
    """Revoke a granted operation."""
    return await _act(
        request,
        session_id,
        RevokeRequest,
        lambda rt, b: service.revoke(rt, caller, session_id, b.operation),
        lambda b: f"Revoked «{b.operation.strip()}»",
    )


@router.post("/sessions/{session_id}/mode")
async def mode(request: Request, caller: PageCaller, session_id: str) -> Response:
    """Change the autonomy mode."""
    return await _act(
        request,
        session_id,
        ModeRequest,
        lambda rt, b: service.set_mode(rt, caller, session_id, b.mode.value),
        lambda b: f"Mode set to {b.mode.value}",
    )


@router.post("/sessions/{session_id}/end")
async def end(request: Request, caller: PageCaller, session_id: str) -> Response:
    """End the session."""
    return await _act(
        request,
        session_id,
        EndRequest,
        lambda rt, b: service.end(rt, caller, session_id, b.because),
        lambda b: "Session ended",
    )
