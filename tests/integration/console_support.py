"""The operator console on the real stack, for the API and browser tests.

`console_stack` starts a worker that trusts the console's operator key and a `milpa-sessions
console` process holding that key, with one operator (alice) and one service token (bot).
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import pytest

from console.auth import hash_password
from milpa_sessions.console_cli import write_user
from milpa_sessions.demo import console_process
from milpa_sessions.keyfiles import write_key_pair
from milpa_sessions.settings import Settings
from producers.kafka_log import KafkaEventLog
from producers.store import SessionStore
from projections.redis_store import RedisProjectionStore
from session_model.signing import Signer

OPERATOR_KEY = "operator-console"


@dataclass
class ConsoleStack:
    """A running console, its credentials, and an agent's writer on the same topics."""

    url: str
    settings: Settings
    username: str
    password: str
    token: str
    agent: SessionStore
    log: Path

    def client(self) -> httpx.Client:
        """An HTTP client on the console (no cookies yet)."""
        return httpx.Client(base_url=self.url, timeout=30, follow_redirects=False)

    def login(self, client: httpx.Client) -> str:
        """Sign `client` in as the operator; returns the session's CSRF token."""
        form = client.get("/login")
        assert form.status_code == 200, form.text
        login_csrf = _field(form.text, r'name="csrf" value="([^"]+)"')
        done = client.post(
            "/login",
            data={
                "username": self.username,
                "password": self.password,
                "csrf": login_csrf,
                "next": "/inbox",
            },
        )
        assert done.status_code == 303, done.text
        page = client.get("/inbox")
        assert page.status_code == 200, page.text
        return _field(page.text, r'<meta name="csrf-token" content="([^"]+)"')


def _field(text: str, pattern: str) -> str:
    found = re.search(pattern, text)
    assert found is not None, f"{pattern!r} not in the page"
    return found.group(1)


@pytest.fixture
def console_stack(
    settings: Settings,
    tmp_path: Path,
    start_worker: object,
    kafka_log: KafkaEventLog,
    projections: RedisProjectionStore,
) -> Iterator[ConsoleStack]:
    """A worker trusting the console's key, and the console serving on a free port."""
    private, trusted = write_key_pair(Signer.generate(OPERATOR_KEY), tmp_path / "keys")
    folded = replace(settings, trusted_keys_dir=trusted)
    start_worker(folded)  # type: ignore[operator]
    password, token = secrets.token_urlsafe(12), secrets.token_urlsafe(24)
    users, tokens, secret = tmp_path / "users", tmp_path / "tokens", tmp_path / "secret"
    write_user(users, "alice", hash_password(password))
    tokens.write_text(f"bot:{hashlib.sha256(token.encode()).hexdigest()}\n")
    secret.write_text(secrets.token_urlsafe(32))
    console_settings = replace(
        folded,
        signing_key=private,
        console_users_file=users,
        console_tokens_file=tokens,
        console_secret_file=secret,
        console_port=0,
    )
    log = tmp_path / "console.log"
    agent = SessionStore(kafka_log, projections, producer="it-agent", read_timeout=60.0)
    with console_process(console_settings, log) as url:
        yield ConsoleStack(url, folded, "alice", password, token, agent, log)
