"""What a running console holds: its dependencies, credentials, live hub and templates."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Literal, Protocol, TypeVar, TypeVarTuple, Unpack

import anyio.to_thread
from anyio import CapacityLimiter
from fastapi import Request
from fastapi.templating import Jinja2Templates

from console.auth import (
    CookieSigner,
    Passwords,
    ServiceToken,
    SignInFailures,
    SignInThrottle,
    SignOuts,
    Tokens,
    WatchedFile,
)
from console.live import Hub, QuestionSource
from console.settings import WebConsoleSettings
from producers.store import SessionStore
from projections.analytics import PausesByHour, TimeToAnswer
from projections.said_once import SaidOnce
from session_model.ports import WaitingIndex

HERE = Path(__file__).resolve().parent
# Writes' own threads: each holds one until Kafka acknowledges (while down: its delivery time-out).
WRITE_THREADS = 8

T = TypeVar("T")
Args = TypeVarTuple("Args")


def _utc_now() -> datetime:
    return datetime.now(UTC)


class AnalyticsReader(Protocol):
    """What the overview reads from the analytics counters (`projections.analytics.Analytics`)."""

    def pauses(
        self, since: timedelta | None, now: datetime, by: Literal["hour"]
    ) -> tuple[PausesByHour, ...]:
        """Pauses per UTC hour and reason in the window."""
        ...

    def time_to_answer(self) -> tuple[TimeToAnswer, ...]:
        """The time-to-answer histogram per reason."""
        ...


@dataclass(frozen=True)
class ConsoleDeps:
    """The adapters the console runs over (the CLI builds them from settings)."""

    store: SessionStore  # its signer is the console's operator key
    index: WaitingIndex
    analytics: AnalyticsReader | None = None
    source: QuestionSource | None = None  # the questions feed the live stream relays
    now: Callable[[], datetime] = field(default=_utc_now)
    sign_outs: SignOuts | None = None  # shared by the replicas (None: this process's own)
    sign_in_failures: SignInFailures | None = None  # shared likewise (None: this process's own)
    # Seconds, for intervals: when the users file is looked at again for a change.
    monotonic: Callable[[], float] = field(default=time.monotonic)


class Once:
    """True the first time it is called, False ever after."""

    def __init__(self) -> None:
        self._done = False

    def __call__(self) -> bool:
        """Whether this is the first call."""
        first, self._done = not self._done, True
        return first


@dataclass(frozen=True)
class Runtime:
    """Everything a request handler needs, kept on `app.state.console`."""

    deps: ConsoleDeps
    settings: WebConsoleSettings
    passwords: Passwords
    users: WatchedFile[dict[str, str]]  # read again when it changes (`refresh`, off the loop)
    throttle: SignInThrottle
    tokens: Tokens
    tokens_file: WatchedFile[dict[str, ServiceToken]]  # as `users`
    cookies: CookieSigner
    hub: Hub
    templates: Jinja2Templates
    writes: CapacityLimiter = field(default_factory=lambda: CapacityLimiter(WRITE_THREADS))
    insecure_cookie_noticed: Once = field(default_factory=Once)  # warned once
    unreadable_said: SaidOnce = field(default_factory=SaidOnce)  # damaged entries and parts logged

    async def write(self, act: Callable[[Unpack[Args]], T], *args: *Args) -> T:
        """`act(*args)`, a write, on one of the writes' threads (waiting for one without holding
        any: reads, sign-ins and streams keep the shared pool)."""
        return await anyio.to_thread.run_sync(act, *args, limiter=self.writes)


def runtime(request: Request) -> Runtime:
    """The console's runtime, from the app serving `request`."""
    found = request.app.state.console
    assert isinstance(found, Runtime)
    return found
