"""Sign-in attempts per client address and per name: after the limit, refused unchecked until the
window ends."""

from __future__ import annotations

import logging
import re
from dataclasses import replace

import pytest
from fastapi.testclient import TestClient

from console.auth import (
    BUCKETS,
    SESSION_COOKIE,
    MemorySignInFailures,
    SignInThrottle,
    source_of,
)
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
    store: SessionStore,
    settings: WebConsoleSettings,
    failures: MemorySignInFailures,
    *,
    source_limit: int = 100,
) -> tuple[TestClient, list[tuple[str, int]]]:
    """A console counting attempts in `failures`; the names whose passwords it checked, each
    with its bucket's count at that moment."""
    app = make_app(
        store,
        replace(
            settings,
            console_login_attempts=LIMIT,
            console_login_window_s=WINDOW_S,
            console_login_source_attempts=source_limit,
        ),
        sign_in_failures=failures,
    )
    rt: Runtime = app.state.console
    checked: list[tuple[str, int]] = []
    verified = rt.passwords.verified

    def spying(username: str, password: str) -> str | None:
        bucket = rt.throttle.bucket(username)
        checked.append((username, failures._counts.get(bucket, (0, 0.0))[0]))
        return verified(username, password)

    rt.passwords.verified = spying  # type: ignore[method-assign]
    return TestClient(app), checked


def test_after_the_limit_a_name_is_refused_unchecked_until_its_window_ends(
    store: SessionStore, settings: WebConsoleSettings
) -> None:
    clock = _Clock()
    client, checked = _console(store, settings, MemorySignInFailures(clock=clock))
    for _ in range(LIMIT):
        assert sign_in(client, password="guess").status_code == 401
    refused = sign_in(client)  # the right password, now
    assert refused.status_code == 429
    assert "Too many failed sign-ins" in refused.text and "10 minute(s)" in refused.text
    assert refused.headers["Retry-After"] == "600"
    # Each check came after its attempt was counted; the last attempt was not checked at all.
    assert checked == [("alice", n) for n in range(1, LIMIT + 1)]
    assert SESSION_COOKIE not in refused.cookies
    clock.now += WINDOW_S - 1
    assert sign_in(client).status_code == 429
    clock.now += 2
    assert sign_in(client).status_code == 303


def test_an_attempt_is_counted_before_its_password_is_checked() -> None:
    # So that attempts sent in parallel get no more password checks than the limit.
    failures = MemorySignInFailures()
    assert [failures.attempt("b", LIMIT, WINDOW_S) for _ in range(LIMIT)] == [0.0] * LIMIT
    assert failures.attempt("b", LIMIT, WINDOW_S) > 0  # no failure was reported in between
    failures.cleared("b")
    assert failures.attempt("b", LIMIT, WINDOW_S) == 0


def test_a_successful_sign_in_starts_the_count_again(
    store: SessionStore, settings: WebConsoleSettings
) -> None:
    client, _ = _console(store, settings, MemorySignInFailures())
    for _ in range(LIMIT - 1):
        assert sign_in(client, password="guess").status_code == 401
    assert sign_in(client).status_code == 303
    browser = TestClient(client.app)  # another browser, not signed in
    for _ in range(LIMIT - 1):
        assert sign_in(browser, password="guess").status_code == 401
    assert sign_in(browser).status_code == 303


def test_a_name_that_is_no_operator_is_answered_as_an_operator_s_would_be(
    store: SessionStore, settings: WebConsoleSettings
) -> None:
    client, checked = _console(store, settings, MemorySignInFailures())
    for n in range(LIMIT):  # other names' failures do not count for eve
        assert sign_in(client, username=f"nobody{n}", password="guess").status_code == 401
    for _ in range(LIMIT):
        assert sign_in(client, username="eve", password=PASSWORD).status_code == 401
    assert sign_in(client, username="eve", password=PASSWORD).status_code == 429
    assert [name for name, _ in checked].count("eve") == LIMIT
    assert sign_in(client).status_code == 303  # and alice is not locked by either


def test_a_refused_sign_in_logs_no_submitted_name(
    store: SessionStore, settings: WebConsoleSettings, caplog: pytest.LogCaptureFixture
) -> None:
    # Operators sometimes type their password into the name field.
    typed = "Tr0ub4dor&3-typed-as-a-name"
    client, _ = _console(store, settings, MemorySignInFailures())
    with caplog.at_level(logging.DEBUG):
        for _ in range(LIMIT):
            assert sign_in(client, username=typed, password="guess").status_code == 401
        assert sign_in(client, username=typed, password="guess").status_code == 429
    rt: Runtime = client.app.state.console  # type: ignore[attr-defined]
    refusals = [r.getMessage() for r in caplog.records if "too many failures" in r.getMessage()]
    assert len(refusals) == 1 and rt.throttle.bucket(typed) in refusals[0]
    assert not [r for r in caplog.records if typed in r.getMessage() or typed in str(r.args)]


def test_a_limit_of_zero_counts_nothing(store: SessionStore, settings: WebConsoleSettings) -> None:
    failures = MemorySignInFailures()
    unlimited = replace(settings, console_login_attempts=0, console_login_source_attempts=0)
    app = make_app(store, unlimited, sign_in_failures=failures)
    client = TestClient(app)
    for _ in range(12):
        assert sign_in(client, password="guess").status_code == 401
    assert sign_in(client).status_code == 303
    assert not failures._counts  # nothing was counted


@pytest.mark.parametrize(
    ("limit", "source_limit", "window_s"), [(-1, 9, 60.0), (3, -1, 60.0), (3, 9, 0.0)]
)
def test_a_meaningless_limit_is_a_configuration_error(
    limit: int, source_limit: int, window_s: float
) -> None:
    with pytest.raises(ConfigurationError, match="sign-in limit"):
        SignInThrottle(
            MemorySignInFailures(),
            b"k" * 32,
            limit=limit,
            window_s=window_s,
            source_limit=source_limit,
        )


def test_a_meaningless_source_limit_setting_stops_the_console(
    store: SessionStore, settings: WebConsoleSettings
) -> None:
    parsed = WebConsoleSettings.from_env({"MILPA_CONSOLE_LOGIN_SOURCE_ATTEMPTS": "7"})
    assert parsed.console_login_source_attempts == 7
    assert WebConsoleSettings().console_login_source_attempts == 100
    with pytest.raises(ConfigurationError, match="MILPA_CONSOLE_LOGIN_SOURCE_ATTEMPTS"):
        WebConsoleSettings.from_env({"MILPA_CONSOLE_LOGIN_SOURCE_ATTEMPTS": "many"})
    with pytest.raises(ConfigurationError, match="-1 per source"):
        make_app(store, replace(settings, console_login_source_attempts=-1))


SOURCE_LIMIT = 5


def test_after_the_source_limit_an_address_is_refused_unchecked_whatever_the_name(
    store: SessionStore, settings: WebConsoleSettings
) -> None:
    clock = _Clock()
    failures = MemorySignInFailures(clock=clock)
    client, checked = _console(store, settings, failures, source_limit=SOURCE_LIMIT)
    for n in range(SOURCE_LIMIT):  # a name each: no name's limit is reached
        assert sign_in(client, username=f"name{n}", password="guess").status_code == 401
    names = dict(failures._counts)
    refused = sign_in(client)  # alice, the right password, from the same address
    assert refused.status_code == 429
    assert "Too many sign-ins from this address" in refused.text
    assert "10 minute(s)" in refused.text and refused.headers["Retry-After"] == "600"
    assert SESSION_COOKIE not in refused.cookies
    assert len(checked) == SOURCE_LIMIT  # alice's password was not checked
    rt: Runtime = client.app.state.console  # type: ignore[attr-defined]
    assert rt.throttle.bucket("alice") not in failures._counts  # nor her name counted
    assert sign_in(client, username="name0", password="guess").status_code == 429
    assert {b: c for b, c in failures._counts.items() if not b.startswith("src-")} == {
        b: c for b, c in names.items() if not b.startswith("src-")
    }
    elsewhere = TestClient(client.app, client=("192.0.2.7", 50000))  # another address
    assert sign_in(elsewhere).status_code == 303
    clock.now += WINDOW_S + 1
    assert sign_in(client).status_code == 303


def test_a_success_does_not_start_the_address_s_count_again(
    store: SessionStore, settings: WebConsoleSettings
) -> None:
    # Else one operator's own password would buy its holder more guesses at others'.
    client, checked = _console(store, settings, MemorySignInFailures(), source_limit=SOURCE_LIMIT)
    for _ in range(SOURCE_LIMIT // 2):
        assert sign_in(client, username="bob", password="guess").status_code == 401
        assert sign_in(client).status_code == 303
        client.cookies.clear()  # signed out (by dropping the cookie)
    assert sign_in(client, username="bob", password="guess").status_code == 401
    assert sign_in(client).status_code == 429
    assert len(checked) == SOURCE_LIMIT


def test_a_source_limit_of_zero_leaves_the_name_s_limit(
    store: SessionStore, settings: WebConsoleSettings
) -> None:
    failures = MemorySignInFailures()
    client, checked = _console(store, settings, failures, source_limit=0)
    for n in range(3 * LIMIT):
        assert sign_in(client, username=f"name{n}", password="guess").status_code == 401
    assert len(checked) == 3 * LIMIT
    assert not [b for b in failures._counts if b.startswith("src-")]
    for _ in range(LIMIT):
        sign_in(client, password="guess")
    assert sign_in(client).status_code == 429  # the name's limit still holds


def test_addresses_are_counted_by_a_keyed_hash_an_ipv6_one_by_its_64() -> None:
    one = SignInThrottle(MemorySignInFailures(), b"a" * 32)
    other = SignInThrottle(MemorySignInFailures(), b"b" * 32)  # another console secret
    bucket = one.source_bucket("192.0.2.7")
    assert re.fullmatch(r"src-[0-9a-f]{16}", bucket) and "192" not in bucket
    assert bucket == one.source_bucket("::ffff:192.0.2.7")  # IPv4-mapped: the same client
    assert bucket != other.source_bucket("192.0.2.7")
    assert bucket != one.source_bucket("192.0.2.8")
    assert one.source_bucket("2001:db8:1:2::1") == one.source_bucket("2001:db8:1:2:ffff::9")
    assert one.source_bucket("2001:db8:1:2::1") != one.source_bucket("2001:db8:1:3::1")
    assert source_of("2001:db8:1:2:3:4:5:6") == "20010db800010002::/64"
    assert source_of("testclient") == "testclient"
    assert one.source_bucket("alice") != one.bucket("alice")
    assert one.attempt_from(None) == 0 and not one.failures._counts  # type: ignore[attr-defined]


def test_buckets_come_from_a_keyed_hash_of_the_name() -> None:
    one = SignInThrottle(MemorySignInFailures(), b"a" * 32)
    other = SignInThrottle(MemorySignInFailures(), b"b" * 32)  # another console secret
    names = [f"name{n}" for n in range(200)]
    buckets = {one.bucket(n) for n in names}
    assert len(buckets) > 190 and all(0 <= int(b, 16) < BUCKETS for b in buckets)
    assert one.bucket("alice") == one.bucket("alice")
    assert [one.bucket(n) for n in names] != [other.bucket(n) for n in names]


def test_a_sign_in_that_is_never_checked_is_never_counted(
    store: SessionStore, settings: WebConsoleSettings
) -> None:
    # Made-up names with no password cost no password check: counted, they could fill every
    # bucket and lock every operator out.
    failures = MemorySignInFailures()
    client, checked = _console(store, settings, failures)
    for _ in range(LIMIT + 2):
        assert sign_in(client, password="").status_code == 401
        assert sign_in(client, username="x" * 300).status_code == 401
    assert not failures._counts and not checked
    assert sign_in(client).status_code == 303


def test_sign_ins_past_the_password_checks_places_are_503_and_count_nothing(
    store: SessionStore, settings: WebConsoleSettings
) -> None:
    """A flood holds every place: the next sign-in neither waits (a pool thread) nor counts."""
    failures = MemorySignInFailures()
    client, checked = _console(store, settings, failures)
    rt: Runtime = client.app.state.console  # type: ignore[attr-defined]
    held = [rt.passwords.admitted() for _ in range(8)]  # 2 running + 6 waiting: every place
    assert all(place.__enter__() for place in held)
    try:
        refused = sign_in(client)
        assert refused.status_code == 503
        assert refused.headers["Retry-After"] == "1"
        assert checked == [] and not failures._counts  # neither the address nor the name
    finally:
        for place in held:
            place.__exit__(None, None, None)
    assert sign_in(client).status_code == 303  # a place is free again: checked, signed in


def test_sign_ins_refused_503_do_not_use_up_the_address_s_attempts(
    store: SessionStore, settings: WebConsoleSettings
) -> None:
    """An operator retrying through a flood is not refused 429 once the places free up."""
    failures = MemorySignInFailures()
    client, checked = _console(store, settings, failures, source_limit=SOURCE_LIMIT)
    rt: Runtime = client.app.state.console  # type: ignore[attr-defined]
    held = [rt.passwords.admitted() for _ in range(8)]  # 2 running + 6 waiting: every place
    assert all(place.__enter__() for place in held)
    try:
        for _ in range(2 * SOURCE_LIMIT):
            assert sign_in(client).status_code == 503
    finally:
        for place in held:
            place.__exit__(None, None, None)
    assert not failures._counts and checked == []
    assert sign_in(client).status_code == 303  # admitted and checked: counted, and signed in
    assert [b for b in failures._counts if b.startswith("src-")] == [
        rt.throttle.source_bucket("testclient")
    ]


def test_an_address_that_used_up_its_attempts_is_refused_without_taking_a_place(
    store: SessionStore, settings: WebConsoleSettings
) -> None:
    """A flood from one address must not hold the places other operators' sign-ins need: once
    over its limit it is refused 429 before admission (read, not counted), even with every place
    held."""
    failures = MemorySignInFailures()
    client, checked = _console(store, settings, failures, source_limit=SOURCE_LIMIT)
    for n in range(SOURCE_LIMIT):
        assert sign_in(client, username=f"name{n}", password="guess").status_code == 401
    rt: Runtime = client.app.state.console  # type: ignore[attr-defined]
    source = rt.throttle.source_bucket("testclient")
    assert failures._counts[source][0] == SOURCE_LIMIT
    held = [rt.passwords.admitted() for _ in range(8)]  # 2 running + 6 waiting: every place
    assert all(place.__enter__() for place in held)
    try:
        refused = sign_in(client)
        assert refused.status_code == 429  # not 503: it took no place
        assert "Too many sign-ins from this address" in refused.text
    finally:
        for place in held:
            place.__exit__(None, None, None)
    assert failures._counts[source][0] == SOURCE_LIMIT  # the refusal counted nothing
    assert len(checked) == SOURCE_LIMIT
