"""Signing in, cookies, bearer tokens and CSRF: refused calls append nothing."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Literal

import pytest
from argon2 import PasswordHasher
from fastapi.testclient import TestClient

from console import auth
from console.auth import (
    LOGIN_COOKIE,
    MISSING,
    SESSION_COOKIE,
    SETTLED_NS,
    CookieSigner,
    FileStamp,
    MemorySignInFailures,
    MemorySignOuts,
    Passwords,
    ServiceToken,
    Tokens,
    bearer_token,
    hash_password,
    load_tokens,
    load_users,
    settled,
    token_digest,
    users_file,
)
from console.settings import WebConsoleSettings
from milpa_sessions import console_cli
from milpa_sessions.console_cli import write_user
from producers.store import SessionStore
from schemas.errors import ConfigurationError
from session_model.principal import Principal
from tests.unit.console.conftest import (
    BEARER,
    PASSWORD,
    login_csrf,
    make_app,
    page_csrf,
    seed,
    sign_in,
)


def _records(store: SessionStore) -> int:
    return len(store.log.records)  # type: ignore[attr-defined]


# -- signing in ------------------------------------------------------------------------------------


def test_sign_in_sets_a_session_cookie_and_redirects_to_where_the_operator_was_going(
    client: TestClient,
) -> None:
    assert client.get("/inbox", follow_redirects=False).headers["location"] == (
        "/login?next=%2Finbox"
    )
    form = client.get("/login?next=/inbox")
    assert 'name="next" value="/inbox"' in form.text
    response = client.post(
        "/login",
        data={
            "username": "alice",
            "password": PASSWORD,
            "csrf": login_csrf(form.text),
            "next": "/inbox",
        },
        follow_redirects=False,
    )
    assert response.status_code == 303
    assert response.headers["location"] == "/inbox"
    cookie = response.headers["set-cookie"]
    assert SESSION_COOKIE in cookie and "HttpOnly" in cookie and "SameSite=lax" in cookie
    page = client.get("/inbox")
    assert page.status_code == 200
    assert '<span id="principal"' in page.text and "operator:alice" in page.text


@pytest.mark.parametrize(
    ("username", "password"), [("alice", "wrong"), ("mallory", PASSWORD), ("alice", "")]
)
def test_a_wrong_password_or_unknown_operator_is_refused_alike(
    client: TestClient, username: str, password: str
) -> None:
    response = sign_in(client, username, password)
    assert response.status_code == 401
    assert "Unknown operator or wrong password." in response.text
    assert SESSION_COOKIE not in client.cookies
    assert client.get("/", follow_redirects=False).status_code == 303


def test_a_sign_in_without_the_forms_token_is_refused(client: TestClient) -> None:
    response = client.post(
        "/login", data={"username": "alice", "password": PASSWORD}, follow_redirects=False
    )
    assert response.status_code == 400
    assert SESSION_COOKIE not in client.cookies


def test_a_sign_in_with_a_non_ascii_form_token_is_refused_not_a_server_error(
    client: TestClient,
) -> None:
    client.get("/login")  # the form's cookie
    response = client.post(
        "/login",
        data={"username": "alice", "password": PASSWORD, "csrf": "tökén"},
        follow_redirects=False,
    )
    assert response.status_code == 400
    assert SESSION_COOKIE not in client.cookies


@pytest.mark.parametrize("field", ["csrf", "username", "password", "next"])
def test_a_form_field_that_decodes_to_a_lone_surrogate_is_a_400_not_a_500(
    client: TestClient, field: str
) -> None:
    """A multipart part may name its charset: `unicode_escape` turns `\\ud800` into a lone
    surrogate, which no later `.encode()` takes."""
    form = client.get("/login")
    fields = {"username": "alice", "password": PASSWORD, "csrf": login_csrf(form.text)}
    fields[field] = "\\ud800"
    body = (
        "".join(
            f'--X\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'
            for name, value in fields.items()
        )
        + "--X--\r\n"
    )
    response = client.post(
        "/login",
        content=body.encode(),
        headers={"content-type": "multipart/form-data; boundary=X; charset=unicode_escape"},
        follow_redirects=False,
    )
    assert response.status_code == 400
    assert SESSION_COOKIE not in client.cookies


def test_sign_in_never_redirects_off_site(client: TestClient) -> None:
    form = client.get("/login")
    response = client.post(
        "/login",
        data={
            "username": "alice",
            "password": PASSWORD,
            "csrf": login_csrf(form.text),
            "next": "//evil.example/x",
        },
        follow_redirects=False,
    )
    assert response.headers["location"] == "/"


def test_signing_out_revokes_the_cookie_even_if_it_is_sent_again(operator: TestClient) -> None:
    cookie = operator.cookies[SESSION_COOKIE]
    csrf = page_csrf(operator)
    response = operator.post("/logout", data={"csrf": csrf}, follow_redirects=False)
    assert response.status_code == 303
    operator.cookies.set(SESSION_COOKIE, cookie)
    assert operator.get("/api/v1/questions").status_code == 401


def test_behind_tls_the_cookies_are_host_prefixed_secure_and_hsts_is_sent(
    store: SessionStore, settings: WebConsoleSettings, tmp_path: Path
) -> None:
    secret = tmp_path / "secret"
    secret.write_text("s" * 40)
    settings = replace(settings, console_secret_file=secret)  # both apps accept its cookies
    app = make_app(store, replace(settings, console_cookie_secure=True, console_hsts_seconds=600))
    with TestClient(app, base_url="https://console.example") as client:
        response = sign_in(client)
        assert response.status_code == 303
        assert response.headers["strict-transport-security"] == "max-age=600"
        cookies = response.headers.get_list("set-cookie")
        session = next(c for c in cookies if c.startswith(f"__Host-{SESSION_COOKIE}="))
        assert "Secure" in session and "Path=/" in session and "Domain" not in session
        deleted = next(c for c in cookies if c.startswith(f"__Host-{LOGIN_COOKIE}="))
        assert "Max-Age=0" in deleted and "Secure" in deleted  # or a browser keeps it
        value = client.cookies[f"__Host-{SESSION_COOKIE}"]
        assert client.get("/api/v1/questions").status_code == 200
        client.cookies.clear()
        # The name without its prefix is not a session there (one planted over HTTP, or by a
        # sibling subdomain, cannot be): nor the other way round below.
        client.cookies.set(SESSION_COOKIE, value)
        assert client.get("/api/v1/questions").status_code == 401
    plain = make_app(store, settings)
    with TestClient(plain) as client:
        client.cookies.set(f"__Host-{SESSION_COOKIE}", value)
        response = client.get("/api/v1/questions")
        assert response.status_code == 401
        assert "strict-transport-security" not in response.headers
        client.cookies.clear()
        client.cookies.set(SESSION_COOKIE, value)  # (the same value is a session under its name)
        assert client.get("/api/v1/questions").status_code == 200


def test_a_console_behind_a_local_tls_proxy_without_secure_cookies_warns_once(
    store: SessionStore, settings: WebConsoleSettings, caplog: pytest.LogCaptureFixture
) -> None:
    # Listening on loopback, the start-up warning stays quiet; the requests say TLS is in front.
    app = make_app(store, settings)
    with TestClient(app) as client, caplog.at_level(logging.WARNING, logger="console.pages"):
        assert sign_in(client).status_code == 303  # plain HTTP: nothing to say
        assert not [r for r in caplog.records if r.name == "console.pages"]
        client.headers["X-Forwarded-Proto"] = "https"
        for _ in range(2):
            client.cookies.clear()
            assert sign_in(client).status_code == 303
    (warned,) = [r for r in caplog.records if r.name == "console.pages"]
    assert "MILPA_CONSOLE_COOKIE_SECURE is off" in warned.getMessage()


def test_signing_out_needs_the_csrf_token(operator: TestClient) -> None:
    assert operator.post("/logout", follow_redirects=False).status_code == 403
    assert operator.get("/api/v1/questions").status_code == 200


# -- unauthenticated calls -------------------------------------------------------------------------


def test_the_api_answers_401_problem_json_and_appends_nothing(
    client: TestClient, store: SessionStore
) -> None:
    seed(store)
    before = _records(store)
    response = client.post(
        "/api/v1/sessions/s-a/answer", json={"question_id": "perm:rm", "answer": "yes"}
    )
    assert response.status_code == 401
    assert response.headers["content-type"] == "application/problem+json"
    assert response.json()["code"] == "unauthenticated"
    assert response.headers["www-authenticate"].startswith("Bearer")
    assert _records(store) == before
    for path in ("/api/v1/questions", "/api/v1/fleet", "/api/v1/sessions/s-a", "/api/v1/events"):
        assert client.get(path).status_code == 401, path


def test_an_unauthenticated_form_post_redirects_and_appends_nothing(
    client: TestClient, store: SessionStore
) -> None:
    seed(store)
    before = _records(store)
    response = client.post(
        "/sessions/s-a/end", data={"because": "x", "csrf": "x"}, follow_redirects=False
    )
    assert response.status_code == 303
    assert response.headers["location"].startswith("/login")
    assert _records(store) == before


def test_a_forged_or_expired_cookie_is_not_a_session(client: TestClient) -> None:
    client.cookies.set(SESSION_COOKIE, "eyJ1IjoiYWxpY2UifQ.forged.sig")
    assert client.get("/api/v1/questions").status_code == 401
    expired = CookieSigner("s" * 32, session_seconds=-1)
    value, _ = expired.issue("alice", "$argon2id$alice")
    assert expired.read(value, {"alice": "$argon2id$alice"}.get) is None


# -- CSRF ------------------------------------------------------------------------------------------


def test_a_cookie_write_without_the_csrf_token_is_refused_403_and_appends_nothing(
    operator: TestClient, store: SessionStore
) -> None:
    seed(store)
    before = _records(store)
    body = {"question_id": "perm:rm", "answer": "yes", "asked_seq": 2}
    response = operator.post("/api/v1/sessions/s-a/answer", json=body)
    assert response.status_code == 403
    assert response.json()["code"] == "csrf_failed"
    wrong = operator.post(
        "/api/v1/sessions/s-a/answer", json=body, headers={"X-CSRF-Token": "guess"}
    )
    assert wrong.status_code == 403
    form = operator.post("/sessions/s-a/answer", data=body, follow_redirects=False)
    assert form.status_code == 403
    assert _records(store) == before
    ok = operator.post(
        "/api/v1/sessions/s-a/answer", json=body, headers={"X-CSRF-Token": page_csrf(operator)}
    )
    assert ok.status_code == 202
    assert _records(store) == before + 2  # the grant a yes to «perm:rm» carries, and the answer


def test_each_sign_in_has_its_own_csrf_token(client: TestClient) -> None:
    sign_in(client)
    first = page_csrf(client)
    client.cookies.clear()
    sign_in(client)
    assert page_csrf(client) != first


# -- bearer tokens ---------------------------------------------------------------------------------


def test_a_bearer_token_needs_no_csrf_and_answers_as_its_service(
    client: TestClient, store: SessionStore
) -> None:
    seed(store)
    response = client.post(
        "/api/v1/sessions/s-a/answer",
        json={"question_id": "perm:rm", "answer": "no"},
        headers=BEARER,
    )
    assert response.status_code == 202, response.text
    decision = store.load("s-a").decisions[-1]
    assert decision.by == Principal("service:deployer", verified=True)


def test_a_wrong_bearer_token_is_401_even_with_a_valid_cookie(operator: TestClient) -> None:
    response = operator.get("/api/v1/questions", headers={"Authorization": "Bearer nope"})
    assert response.status_code == 401


# -- credentials files and helpers -----------------------------------------------------------------


def test_passwords_verify_argon2id_hashes(alice_hash: str) -> None:
    assert alice_hash.startswith("$argon2id$")
    passwords = Passwords({"alice": alice_hash})
    assert passwords.verify("alice", PASSWORD)
    assert not passwords.verify("alice", PASSWORD + "!")
    assert not passwords.verify("bob", PASSWORD)
    assert not Passwords({"eve": "$argon2id$garbage"}).verify("eve", "x")
    with pytest.raises(ValueError, match="empty"):
        hash_password("")


class _HeldHasher(PasswordHasher):
    """Counts the checks running at once; each waits inside until `release` is set."""

    def __init__(self) -> None:
        super().__init__(time_cost=1, memory_cost=8, parallelism=1)
        self.release = threading.Event()
        self.running = self.most = 0
        self.lock = threading.Lock()

    def verify(self, hash: str | bytes, password: str | bytes) -> Literal[True]:
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            assert self.release.wait(10)
            return super().verify(hash, password)
        finally:
            with self.lock:
                self.running -= 1


def _until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_password_checks_run_two_at_a_time_and_a_check_with_no_slot_fails() -> None:
    hasher = _HeldHasher()
    users = {"alice": hasher.hash("pw")}
    passwords = Passwords(users, hasher, concurrent=2, wait_s=10)
    results: list[bool] = []
    threads = [
        threading.Thread(target=lambda: results.append(passwords.verify("alice", "pw")))
        for _ in range(6)
    ]
    for t in threads:
        t.start()
    _until(lambda: hasher.running == 2)
    time.sleep(0.05)
    assert hasher.running == 2  # the other four wait for a slot
    busy = Passwords(users, hasher, concurrent=2, wait_s=0.01)
    held = [threading.Thread(target=busy.verify, args=("alice", "pw")) for _ in range(2)]
    for t in held:
        t.start()
    _until(lambda: hasher.running == 4)
    assert not busy.verify("alice", "pw")  # no slot within 10 ms: refused like a wrong password
    hasher.release.set()
    for t in (*threads, *held):
        t.join()
    assert results == [True] * 6


def test_a_sign_in_refused_for_want_of_a_password_check_logs_no_name(
    caplog: pytest.LogCaptureFixture,
) -> None:
    hasher = _HeldHasher()
    typed = "Tr0ub4dor&3-typed-as-a-name"
    busy = Passwords({"alice": hasher.hash("pw")}, hasher, concurrent=1, wait_s=0.01)
    held = threading.Thread(target=busy.verify, args=("alice", "pw"))
    held.start()
    try:
        _until(lambda: hasher.running == 1)
        with caplog.at_level(logging.DEBUG):
            assert not busy.verify(typed, "pw")
    finally:
        hasher.release.set()
        held.join()
    assert [r.getMessage() for r in caplog.records] == [
        "a sign-in was refused: every password check is busy"
    ]


def test_tokens_match_by_sha256() -> None:
    tokens = Tokens({"ci": token_digest("abc")})
    found = tokens.caller("abc")
    assert found is not None and found.principal == Principal("service:ci", verified=True)
    assert found.via == "bearer" and not found.relaxes
    assert tokens.caller("abd") is None
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("bearer  abc ") == "abc"
    assert bearer_token("Basic abc") is None
    assert bearer_token("Bearer ") is None


def test_credentials_files_are_read_strictly_without_echoing_secrets(
    tmp_path: Path, alice_hash: str
) -> None:
    users = tmp_path / "users"
    users.write_text(f"alice:{alice_hash}\n# a comment\n\n")
    assert load_users(users) == {"alice": alice_hash}
    users.write_text("bob:plaintext-password\n")
    with pytest.raises(ConfigurationError, match="not an argon2 hash") as raised:
        load_users(users)
    assert "plaintext-password" not in str(raised.value)
    users.write_text("just-a-secret-line\n")
    with pytest.raises(ConfigurationError, match=r"users:1: expected") as raised:
        load_users(users)
    assert "just-a-secret-line" not in str(raised.value)
    tokens = tmp_path / "tokens"
    tokens.write_text(f"ci:{token_digest('t').upper()}\nops:{token_digest('u')}:operator\n")
    assert load_tokens(tokens) == {
        "ci": ServiceToken(token_digest("t")),
        "ops": ServiceToken(token_digest("u"), operator=True),
    }
    tokens.write_text("ci:raw-token\n")
    with pytest.raises(ConfigurationError, match="sha256"):
        load_tokens(tokens)
    tokens.write_text(f"ci:{token_digest('t')}:admin\n")
    with pytest.raises(ConfigurationError, match="scope"):
        load_tokens(tokens)
    with pytest.raises(ConfigurationError, match="cannot read"):
        load_users(tmp_path / "missing")
    assert load_users(None) == {} and load_tokens(None) == {}


def test_a_secret_file_keeps_cookies_valid_across_apps(
    tmp_path: Path, store: SessionStore, settings: WebConsoleSettings
) -> None:
    secret = tmp_path / "secret"
    secret.write_text("k" * 40)
    with_secret = replace(settings, console_secret_file=secret)
    with TestClient(make_app(store, with_secret)) as first:
        sign_in(first)
        cookie = first.cookies[SESSION_COOKIE]
    with TestClient(make_app(store, with_secret)) as second:
        second.cookies.set(SESSION_COOKIE, cookie)
        assert second.get("/api/v1/questions").status_code == 200
    short = tmp_path / "short"
    short.write_text("tooshort")
    with pytest.raises(ConfigurationError, match="shorter than 32"):
        make_app(store, replace(settings, console_secret_file=short))


def test_a_password_change_ends_the_sign_ins_made_with_the_old_one(
    tmp_path: Path, store: SessionStore, settings: WebConsoleSettings
) -> None:
    # `passwd` while the console is down, then a start. The secret is kept, so only the changed
    # password can tell the old sign-ins from the new.
    secret = tmp_path / "secret"
    secret.write_text("k" * 40)
    with_secret = replace(settings, console_secret_file=secret)
    with TestClient(make_app(store, with_secret)) as before:
        assert sign_in(before).status_code == 303
        old_cookie = before.cookies[SESSION_COOKIE]
    assert with_secret.console_users_file is not None
    write_user(with_secret.console_users_file, "alice", hash_password("a new passphrase"))
    with TestClient(make_app(store, with_secret)) as after:
        after.cookies.set(SESSION_COOKIE, old_cookie)
        assert after.get("/api/v1/questions").status_code == 401
        assert after.get("/inbox", follow_redirects=False).status_code == 303  # to sign in
        after.cookies.clear()
        assert sign_in(after, password=PASSWORD).status_code == 401
        assert sign_in(after, password="a new passphrase").status_code == 303
        new_cookie = after.cookies[SESSION_COOKIE]
        assert after.get("/api/v1/questions").status_code == 200
    with TestClient(make_app(store, with_secret)) as restarted:
        restarted.cookies.set(SESSION_COOKIE, new_cookie)
        assert restarted.get("/api/v1/questions").status_code == 200


def test_a_changed_password_or_a_removed_operator_holds_without_a_restart(
    store: SessionStore, settings: WebConsoleSettings
) -> None:
    now = [0.0]
    app = make_app(store, settings, monotonic=lambda: now[0])
    users = settings.console_users_file
    assert users is not None
    with TestClient(app) as client:
        assert sign_in(client).status_code == 303
        assert client.get("/api/v1/questions").status_code == 200
        write_user(users, "alice", hash_password("a new passphrase"))  # `passwd`
        now[0] += 1.0  # the file is looked at once a second at most
        assert client.get("/api/v1/questions").status_code == 401  # the old sign-in is refused
        assert client.get("/inbox", follow_redirects=False).status_code == 303  # to sign in
        client.cookies.clear()
        assert sign_in(client, password=PASSWORD).status_code == 401
        assert sign_in(client, password="a new passphrase").status_code == 303
        assert client.get("/api/v1/questions").status_code == 200
        users.write_text("# nobody now\n")
        now[0] += 1.0
        assert client.get("/api/v1/questions").status_code == 401  # alice was removed
        client.cookies.clear()
        assert sign_in(client, password="a new passphrase").status_code == 401


def test_a_users_file_that_cannot_be_read_after_a_change_keeps_the_operators_read_before(
    store: SessionStore,
    settings: WebConsoleSettings,
    alice_hash: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    app = make_app(store, settings, monotonic=lambda: now[0])
    users = settings.console_users_file
    assert users is not None
    with TestClient(app) as client, caplog.at_level(logging.DEBUG):
        assert sign_in(client).status_code == 303
        users.write_text(f"alice:{PASSWORD}\nbob {alice_hash}\n")  # half-edited: no hash, no `:`
        for _ in range(3):
            now[0] += 1.0
            assert client.get("/api/v1/questions").status_code == 200  # nobody is locked out
        client.cookies.clear()
        assert sign_in(client).status_code == 303  # alice signs in as before
        warned = [r for r in caplog.records if r.name == "console.auth"]
        assert [(r.levelno, r.getMessage()) for r in warned] == [
            (
                logging.WARNING,
                f"the users file {users} changed but cannot be read: the operators read before "
                "stay until it is fixed",
            )
        ]
        logged = " ".join(f"{r.getMessage()} {r.args}" for r in caplog.records)
        assert not [s for s in ("alice", "bob", PASSWORD, alice_hash, "$argon2") if s in logged]
        new_hash = hash_password("a new passphrase")
        users.write_text(f"alice:{new_hash}\n")  # fixed: read again
        now[0] += 1.0
        assert client.get("/api/v1/questions").status_code == 401
        client.cookies.clear()
        assert sign_in(client, password="a new passphrase").status_code == 303


def test_the_users_file_is_looked_at_once_a_second_at_most(
    tmp_path: Path, alice_hash: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "users"
    path.write_text(f"alice:{alice_hash}\n")
    now = [0.0]
    passwords = Passwords({})
    users = users_file(path, passwords, clock=lambda: now[0])
    assert passwords.hash_of("alice") == alice_hash
    looked: list[Path] = []
    stamp = auth.file_stamp

    def counting(at: Path) -> FileStamp:
        looked.append(at)
        return stamp(at)

    monkeypatch.setattr(auth, "file_stamp", counting)
    write_user(path, "bob", alice_hash)
    now[0] = 0.99
    assert not any(users.refresh() for _ in range(100))
    assert looked == [] and passwords.hash_of("bob") is None
    now[0] = 1.0
    assert users.refresh() and passwords.hash_of("bob") == alice_hash
    assert not users.refresh() and looked == [path]  # once in the second
    assert not users_file(None, Passwords({})).refresh()  # no file: nothing to look at


def test_a_users_file_is_read_again_while_its_stamp_may_hide_a_change(
    tmp_path: Path, alice_hash: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write in the timestamps' tick of the last read may leave the stamp as it was (as with
    git's racy index entries): such a stamp is not trusted until it settled."""
    path = tmp_path / "users"
    path.write_text(f"alice:{alice_hash}\n")
    now = [0.0]
    passwords = Passwords({})
    fresh = FileStamp(1, 2, 3, time.time_ns(), time.time_ns())
    monkeypatch.setattr(auth, "file_stamp", lambda at: fresh)
    users = users_file(path, passwords, clock=lambda: now[0])
    path.write_text(f"bob:{alice_hash}\n")  # the very same stamp
    now[0] += 1.0
    assert users.refresh() and passwords.hash_of("bob") == alice_hash
    old = FileStamp(1, 2, 3, 0, 0)  # settled
    monkeypatch.setattr(auth, "file_stamp", lambda at: old)
    now[0] += 1.0
    assert not users.refresh()  # the same content
    path.write_text(f"carol:{alice_hash}\n")
    now[0] += 1.0
    assert not users.refresh() and passwords.hash_of("carol") is None  # trusted: not read
    assert settled(old, SETTLED_NS) and not settled(old, SETTLED_NS - 1)
    assert not settled(fresh, time.time_ns())


def test_a_users_file_gone_after_a_change_keeps_the_operators_and_is_read_when_back(
    tmp_path: Path, alice_hash: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "users"
    path.write_text(f"alice:{alice_hash}\n")
    now = [0.0]
    passwords = Passwords({})
    users = users_file(path, passwords, clock=lambda: now[0])
    path.unlink()
    assert auth.file_stamp(path) == MISSING
    with caplog.at_level(logging.WARNING, logger="console.auth"):
        for _ in range(3):
            now[0] += 1.0
            assert not users.refresh()
    assert len([r for r in caplog.records if r.name == "console.auth"]) == 1
    assert passwords.hash_of("alice") == alice_hash
    write_user(path, "bob", alice_hash)
    now[0] += 1.0
    assert users.refresh()
    assert passwords.hash_of("alice") is None and passwords.hash_of("bob") == alice_hash
    with pytest.raises(ConfigurationError, match="cannot read"):
        users_file(path.with_name("nowhere"), passwords)  # at start, a missing file stops it


def test_a_session_holds_a_keyed_fingerprint_of_its_password_hash() -> None:
    signer = CookieSigner("s" * 32, 3600)
    value, session = signer.issue("alice", "$argon2id$old")
    assert session.credential == signer.credential("$argon2id$old")
    assert len(session.credential) == 16 and "old" not in session.credential
    assert signer.read(value, {"alice": "$argon2id$old"}.get) == session
    assert signer.read(value, {"alice": "$argon2id$new"}.get) is None  # changed password
    assert signer.read(value, {"bob": "$argon2id$old"}.get) is None  # no operator any more
    other_secret = CookieSigner("t" * 32, 3600)
    assert other_secret.credential("$argon2id$old") != session.credential
    # A cookie of before the fingerprint (or without it) is no session.
    bare = signer.dumps({"u": "alice", "sid": "s", "csrf": "c"}, "session")
    assert signer.read(bare, {"alice": "$argon2id$old"}.get) is None


def test_a_sign_out_is_refused_by_every_replica_sharing_the_sign_outs() -> None:
    shared = MemorySignOuts()
    one, two = CookieSigner("s" * 32, 3600, shared), CookieSigner("s" * 32, 3600, shared)
    users = {"alice": "$argon2id$alice"}.get
    value, session = one.issue("alice", "$argon2id$alice")
    assert two.read(value, users) == session
    one.revoke(session.session_id)
    assert two.read(value, users) is None and two.signed_out(session.session_id)
    alone = CookieSigner("s" * 32, 3600)  # a process of its own does not see it
    assert alone.read(value, users) == session


def test_a_remembered_sign_out_lapses_when_its_cookie_would_have() -> None:
    now = [100.0]
    sign_outs = MemorySignOuts(clock=lambda: now[0])
    sign_outs.add("sid", ttl_s=60)
    assert "sid" in sign_outs and "other" not in sign_outs
    now[0] += 61
    assert "sid" not in sign_outs


def test_lapsed_sign_in_counts_and_sign_outs_are_dropped_as_new_ones_come() -> None:
    now = [0.0]
    failures = MemorySignInFailures(clock=lambda: now[0])
    sign_outs = MemorySignOuts(clock=lambda: now[0])
    for i in range(1000):  # a flood of addresses, and of sign-outs, within one window
        failures.attempt(f"src-{i}", 1, 60.0)
        sign_outs.add(f"sid-{i}", 60.0)
    now[0] = 61.0
    failures.attempt("src-late", 1, 60.0)
    sign_outs.add("sid-late", 60.0)
    assert list(failures._counts) == ["src-late"]
    assert list(sign_outs._until) == ["sid-late"]


def test_a_count_lapsed_behind_a_longer_window_starts_a_new_one() -> None:
    now = [0.0]
    failures = MemorySignInFailures(clock=lambda: now[0])
    assert failures.attempt("long", 1, 1000.0) == 0.0
    assert failures.attempt("short", 1, 10.0) == 0.0
    now[0] = 20.0  # "short" lapsed; "long", older, has not
    assert failures.attempt("short", 1, 10.0) == 0.0
    now[0] = 21.0
    assert failures.attempt("short", 1, 10.0) == 9.0
    assert failures.attempt("long", 1, 1000.0) == 979.0


def test_a_place_among_the_password_checks_is_given_at_once_or_not_at_all() -> None:
    passwords = Passwords({}, concurrent=1, queue=1)
    with passwords.admitted() as first, passwords.admitted() as second:
        assert first and second
        with passwords.admitted() as third:
            assert not third  # no wait: a flood must not hold the pool's threads
    with passwords.admitted() as again:
        assert again  # the places were given back


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("192.168.1.20", False),
        ("console.example", False),
    ],
)
def test_the_console_warns_of_plain_http_off_loopback_only(
    host: str, loopback: bool, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, "milpa_sessions.console_cli"):
        console_cli.warn_if_plain(host, secure=True)
        assert caplog.records == []  # behind TLS: nothing to say
        console_cli.warn_if_plain(host, secure=False)
    assert bool(caplog.records) is not loopback
    assert all("over plain HTTP" in r.getMessage() for r in caplog.records)
