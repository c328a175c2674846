"""Failed sign-ins per name: after the limit, refused unchecked until the window ends."""

from __future__ import annotations

from dataclasses import replace

import pytest
from fastapi.testclient import TestClient

from console.auth import SESSION_COOKIE, MemorySignInFailures, Passwords, SignInThrottle
from console.runtime import Runtime
from console.settings import WebConsoleSettings
from producers.store import SessionStore
from schemas.errors import ConfigurationError
from tests.unit.console.conftest import PASSWORD, make_app, sign_in

LIMIT, WINDOW_S = 3, 600.0


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _console(
    store: SessionStore, settings: WebConsoleSettings, clock: _Clock
) -> tuple[TestClient, list[str]]:
    """A console counting failures on `clock`, and the names whose passwords it checked."""
    app = make_app(
        store,
        replace(settings, console_login_attempts=LIMIT, console_login_window_s=WINDOW_S),
        sign_in_failures=MemorySignInFailures(clock=clock),
    )
    rt: Runtime = app.state.console
    checked: list[str] = []
    verify = rt.passwords.verify

    def spying(username: str, password: str) -> bool:
        checked.append(username)
        return verify(username, password)

    rt.passwords.verify = spying  # type: ignore[method-assign]
    return TestClient(app), checked


def test_after_the_limit_a_name_is_refused_unchecked_until_its_window_ends(
    store: SessionStore, settings: WebConsoleSettings
) -> None:
    clock = _Clock()
    client, checked = _console(store, settings, clock)
    for _ in range(LIMIT):
        assert sign_in(client, password="guess").status_code == 401
    refused = sign_in(client)  # the right password, now
    assert refused.status_code == 429
    assert "Too many failed sign-ins" in refused.text and "10 minute(s)" in refused.text
    assert checked == ["alice"] * LIMIT  # the last one was not checked at all
    assert SESSION_COOKIE not in refused.cookies
    clock.now += WINDOW_S - 1
    assert sign_in(client).status_code == 429
    clock.now += 2
    assert sign_in(client).status_code == 303


def test_a_successful_sign_in_starts_the_count_again(
    store: SessionStore, settings: WebConsoleSettings
) -> None:
    client, _ = _console(store, settings, _Clock())
    for _ in range(LIMIT - 1):
        assert sign_in(client, password="guess").status_code == 401
    assert sign_in(client).status_code == 303
    browser = TestClient(client.app)  # another browser, not signed in
    for _ in range(LIMIT - 1):
        assert sign_in(browser, password="guess").status_code == 401
    assert sign_in(browser).status_code == 303


def test_names_that_are_no_operators_share_one_count_and_do_not_lock_an_operator(
    store: SessionStore, settings: WebConsoleSettings
) -> None:
    client, checked = _console(store, settings, _Clock())
    for n in range(LIMIT):
        assert sign_in(client, username=f"nobody{n}", password=PASSWORD).status_code == 401
    # Another unknown name is refused like a known one (no hint of which names exist) ...
    assert sign_in(client, username="eve", password=PASSWORD).status_code == 429
    assert "eve" not in checked
    # ... and the operator is not.
    assert sign_in(client).status_code == 303


def test_a_limit_of_zero_counts_nothing(store: SessionStore, settings: WebConsoleSettings) -> None:
    failures = MemorySignInFailures()
    app = make_app(store, replace(settings, console_login_attempts=0), sign_in_failures=failures)
    client = TestClient(app)
    for _ in range(12):
        assert sign_in(client, password="guess").status_code == 401
    assert sign_in(client).status_code == 303
    assert failures.blocked_for(app.state.console.throttle.bucket("alice"), 1) == 0


@pytest.mark.parametrize(("limit", "window_s"), [(-1, 60.0), (3, 0.0)])
def test_a_meaningless_limit_is_a_configuration_error(limit: int, window_s: float) -> None:
    with pytest.raises(ConfigurationError, match="sign-in limit"):
        SignInThrottle(MemorySignInFailures(), Passwords({}), limit=limit, window_s=window_s)


def test_a_bucket_names_a_digest_not_the_name() -> None:
    throttle = SignInThrottle(MemorySignInFailures(), Passwords({"alice": "x"}))
    assert "alice" not in throttle.bucket("alice")
    assert throttle.bucket("alice") != throttle.bucket("bob")
    assert throttle.bucket("bob") == throttle.bucket("carol")  # no operators: one count
