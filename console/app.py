"""The app factory: `create_app(deps, settings)` wires the API, pages, auth and the live feed."""

from __future__ import annotations

import contextlib
import logging
import re
import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import quote

from fastapi import FastAPI, Request
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from starlette.responses import HTMLResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from console import api, pages
from console.auth import (
    CookieSigner,
    MemorySignInFailures,
    Passwords,
    SignInThrottle,
    Tokens,
    tokens_file,
    users_file,
)
from console.guards import CsrfRefused, LoginRequired, login_redirect
from console.inputs import MAX_BODY_BYTES
from console.live import Hub, feeding
from console.problems import install as install_problems
from console.runtime import HERE, ConsoleDeps, Runtime
from console.settings import WebConsoleSettings
from schemas.errors import ConfigurationError
from schemas.secret_files import read_secret
from session_model.narration import short_instant
from session_model.policy import APPROVAL, written_out

__all__ = ["ConsoleDeps", "create_app"]

log = logging.getLogger(__name__)

_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'; "
    "object-src 'none'"
)
_HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (b"content-security-policy", _CSP.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"same-origin"),
)


class SecurityHeaders:
    """Adds a strict CSP and friends to every response; no caching except for static files."""

    def __init__(self, app: ASGIApp, hsts_seconds: int = 0) -> None:
        self.app = app
        hsts = (b"strict-transport-security", f"max-age={hsts_seconds}".encode())
        self.headers = _HEADERS + ((hsts,) if hsts_seconds > 0 else ())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass the request on, adding headers to the response's start."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        static = str(scope.get("path", "")).startswith("/static/")

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                names = {name.lower() for name, _ in headers}
                headers.extend(h for h in self.headers if h[0] not in names)
                if not static and b"cache-control" not in names:
                    headers.append((b"cache-control", b"no-store"))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)


def _secret(settings: WebConsoleSettings) -> str:
    path = settings.console_secret_file
    if path is None:
        log.warning(
            "MILPA_CONSOLE_SECRET_FILE is not set: signing cookies with a random secret made "
            "now; sign-ins do not survive a restart and replicas do not share them"
        )
        return secrets.token_urlsafe(32)
    try:
        secret = read_secret(path, "console secret (MILPA_CONSOLE_SECRET_FILE)").decode().strip()
    except UnicodeDecodeError as e:
        raise ConfigurationError(f"MILPA_CONSOLE_SECRET_FILE: {path} is not UTF-8") from e
    if len(secret) < 32:
        raise ConfigurationError(
            f"MILPA_CONSOLE_SECRET_FILE: the secret in {path} is shorter than 32 characters"
        )
    return secret


_REGEX_SYNTAX = frozenset("^$\\.*+?()[]{}|/")


def pattern_literal(text: str) -> str:
    """`text` as an HTML `pattern` that matches exactly it."""
    # Browsers compile patterns in unicode mode, where escaping anything but a syntax character
    # is an error (and an invalid pattern constrains nothing): escape those only.
    return "".join("\\" + c if c in _REGEX_SYNTAX else c for c in text)


_REASON_CLASS = re.compile(r"[a-z0-9_-]+")


def reason_class(reason: object) -> str:
    """The CSS class of a question's reason: `reason-<reason>`, or `reason-other` for one that is
    not lower-case letters, digits, `_` and `-` only."""
    # A reason is the agent's text: as a class it must stay one class, of the `reason-` kind (a
    # space in it would add any class it names). console.js's `reasonClass` is the same rule.
    if isinstance(reason, str) and _REASON_CLASS.fullmatch(reason):
        return f"reason-{reason}"
    return "reason-other"


def path_segment(value: object) -> str:
    """`value` as one URL path segment: every `/` escaped too (Jinja's `urlencode` keeps it, so a
    session id `x/../y` would link to session `y`)."""
    return quote(str(value), safe="")


def visible(value: object) -> str:
    """`value` as `written_out` writes it, line breaks kept (see there)."""
    return written_out(str(value), keep="\n")


def _templates() -> Jinja2Templates:
    templates = Jinja2Templates(directory=HERE / "templates")
    templates.env.filters["instant"] = short_instant
    templates.env.filters["pattern_literal"] = pattern_literal
    templates.env.filters["reason_class"] = reason_class
    templates.env.filters["segment"] = path_segment
    templates.env.filters["visible"] = visible
    templates.env.globals["APPROVAL"] = APPROVAL
    return templates


def create_app(deps: ConsoleDeps, settings: WebConsoleSettings) -> FastAPI:
    """The console's ASGI app over `deps`; reads the users, tokens and secret files now (and the
    users and tokens files again whenever they change)."""
    passwords = Passwords({})
    users = users_file(settings.console_users_file, passwords, clock=deps.monotonic)
    tokens = Tokens({})
    tokens_watch = tokens_file(settings.console_tokens_file, tokens, clock=deps.monotonic)
    if not passwords and not tokens:
        log.warning("no operators (MILPA_CONSOLE_USERS_FILE) and no tokens: nobody can sign in")
    if deps.store.signer is None:
        log.warning(
            "the console has no operator key (MILPA_SIGNING_KEY): answers are not signed "
            "(the fold stores them unverified), and grants, relaxed modes and signature "
            "questions are refused"
        )
    hours = settings.console_session_hours
    if hours <= 0:
        raise ConfigurationError(f"MILPA_CONSOLE_SESSION_HOURS={hours}: must be positive")
    hub = Hub()
    secret = _secret(settings)
    rt = Runtime(
        deps=deps,
        settings=settings,
        passwords=passwords,
        users=users,
        throttle=SignInThrottle(
            deps.sign_in_failures or MemorySignInFailures(),
            secret.encode(),
            limit=settings.console_login_attempts,
            window_s=settings.console_login_window_s,
            source_limit=settings.console_login_source_attempts,
        ),
        tokens=tokens,
        tokens_file=tokens_watch,
        cookies=CookieSigner(secret, hours * 3600, deps.sign_outs),
        hub=hub,
        templates=_templates(),
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with feeding(deps.source, hub):
            yield

    app = FastAPI(
        title="milpa-sessions operator console",
        summary="Waiting questions, the fleet, sessions, and the operator's acts.",
        version="1",
        openapi_url=None,  # served by `api.document`, to authenticated callers only
        docs_url=None,
        redoc_url=None,
        lifespan=lifespan,
        max_body_size=MAX_BODY_BYTES,
    )
    app.state.console = rt
    install_problems(app)
    app.add_exception_handler(LoginRequired, _on_login_required)
    app.add_exception_handler(CsrfRefused, _on_csrf_refused)
    app.include_router(api.router)
    app.include_router(api.document)
    app.include_router(pages.router)
    app.mount("/static", StaticFiles(directory=Path(HERE / "static")), name="static")
    app.add_middleware(SecurityHeaders, hsts_seconds=settings.console_hsts_seconds)
    return app


async def _on_login_required(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, LoginRequired)
    return login_redirect(exc.next_path)


async def _on_csrf_refused(request: Request, exc: Exception) -> Response:
    return HTMLResponse(
        "<!doctype html><title>Refused</title><h1>Refused</h1><p>This form was not sent by "
        "this console (its CSRF token is missing or stale). Reload the page and try again.</p>"
        '<p><a href="/">Back to the console</a></p>',
        status_code=403,
    )
