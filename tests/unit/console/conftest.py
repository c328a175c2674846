"""The console over the in-memory store: an app, an operator, a service token, signed-in clients."""

from __future__ import annotations

import itertools
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI

with warnings.catch_warnings():
    # Starlette 1.x asks for httpx2 and warns once, on import, when it finds httpx (the pinned
    # dev dependency); the client works the same.
    warnings.filterwarnings("ignore", message="Using `httpx` with `starlette.testclient`")
    from fastapi.testclient import TestClient

from console.app import ConsoleDeps, create_app
from console.auth import hash_password, token_digest
from console.settings import WebConsoleSettings
from producers.store import SessionStore
from projections.analytics import PausesByHour, TimeToAnswer
from session_model.policy import signature_question
from session_model.session import Question
from tests.unit.builders import OPERATOR

NOW = datetime(2026, 3, 1, 10, 0, 0, tzinfo=UTC)
PASSWORD = "correct horse battery staple"
TOKEN = "svc-token-0123456789abcdef"  # deployer's: the `operator` scope
READER_TOKEN = "svc-token-reader-0123456789"  # bridge's: answers only


def at(seconds: float) -> str:
    """An `expires_at` `seconds` after NOW."""
    return (NOW + timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class FakeAnalytics:
    """Fixed analytics counters (the Redis reader's shape)."""

    hours: tuple[PausesByHour, ...] = ()
    tta: tuple[TimeToAnswer, ...] = ()
    calls: list[tuple[Any, ...]] = field(default_factory=list)

    def pauses(self, since: timedelta | None, now: datetime, by: str) -> tuple[PausesByHour, ...]:
        self.calls.append((since, now, by))
        return self.hours

    def time_to_answer(self) -> tuple[TimeToAnswer, ...]:
        return self.tta


@pytest.fixture(scope="session")
def alice_hash() -> str:
    return hash_password(PASSWORD)


@pytest.fixture
def settings(tmp_path: Path, alice_hash: str) -> WebConsoleSettings:
    users = tmp_path / "users"
    users.write_text(f"# operators\nalice:{alice_hash}\n\n")
    tokens = tmp_path / "tokens"
    tokens.write_text(
        f"deployer:{token_digest(TOKEN)}:operator\nbridge:{token_digest(READER_TOKEN)}\n"
    )
    return WebConsoleSettings(
        console_users_file=users, console_tokens_file=tokens, console_login_delay=0.0
    )


@pytest.fixture
def store() -> SessionStore:
    counter = itertools.count(1)
    return SessionStore.in_memory(
        signer=OPERATOR, clock=lambda: NOW, new_id=lambda: f"ev-{next(counter)}"
    )


@pytest.fixture
def analytics() -> FakeAnalytics:
    hour = NOW.replace(minute=0)
    return FakeAnalytics(
        hours=(
            PausesByHour(hour - timedelta(hours=2), "permission", 3),
            PausesByHour(hour, "permission", 1),
            PausesByHour(hour, "signature", 2),
        ),
        tta=(
            TimeToAnswer("permission", "le_5s", 5, 4),
            TimeToAnswer("permission", "le_60s", 60, 1),
        ),
    )


def make_app(store: SessionStore, settings: WebConsoleSettings, **deps: Any) -> FastAPI:
    """The console over `store` (its projection is the waiting index)."""
    deps.setdefault("now", lambda: NOW)
    return create_app(ConsoleDeps(store=store, index=store.projections, **deps), settings)  # type: ignore[arg-type]


@pytest.fixture
def app(store: SessionStore, settings: WebConsoleSettings, analytics: FakeAnalytics) -> FastAPI:
    return make_app(store, settings, analytics=analytics)


@pytest.fixture
def client(app: FastAPI) -> Iterator[TestClient]:
    with TestClient(app) as c:
        yield c


def login_csrf(html: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', html)
    assert found, "the page has no csrf field"
    return found.group(1)


def sign_in(client: TestClient, username: str = "alice", password: str = PASSWORD) -> Any:
    """Post the sign-in form (as a browser would, after loading it)."""
    form = client.get("/login")
    return client.post(
        "/login",
        data={"username": username, "password": password, "csrf": login_csrf(form.text)},
        follow_redirects=False,
    )


def page_csrf(client: TestClient) -> str:
    """The CSRF token of the signed-in session (from a page's meta tag)."""
    found = re.search(r'<meta name="csrf-token" content="([^"]+)"', client.get("/inbox").text)
    assert found
    return found.group(1)


@pytest.fixture
def operator(client: TestClient) -> TestClient:
    """A client signed in as alice."""
    assert sign_in(client).status_code == 303
    return client


BEARER = {"Authorization": f"Bearer {TOKEN}"}
BRIDGE = {"Authorization": f"Bearer {READER_TOKEN}"}


def seed(store: SessionStore) -> None:
    """Three waiting sessions (deadlines: s-b soonest, s-a, s-c none) and one running."""
    store.start("s-a", "clean the cache")
    store.ask("s-a", Question("perm:rm", "Allow «rm»?", ("yes", "no"), "{}", at(600), "permission"))
    store.start("s-b", "ship the release")
    store.set_plan("s-b", "build then deploy")
    store.set_todo("s-b", "t1", "build", "done")
    store.record_turn("s-b", "user", "please ship")
    store.ask("s-b", signature_question("deploy", {"env": "prod", "tag": "v2"}, at(60)))
    store.start("s-c", "write docs")
    store.ask("s-c", Question("q-c", "Which tone?", ("formal", "casual"), None, None, "style"))
    store.start("s-d", "idle")
