"""The web console's settings: the writer's, plus where it listens and who may sign in."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from producers.settings import WriterSettings


@dataclass(frozen=True)
class WebConsoleSettings(WriterSettings):
    """What the web console reads; every field `x` is read from `MILPA_X` (`from_env`).

    The console writes as an operator (`signing_key` is its operator key: it signs verified
    answers, grants and relaxed modes), so it extends the writer's settings.
    """

    console_host: str = "127.0.0.1"
    console_port: int = 8780
    # Operators, one per line `username:<argon2id hash>` (`console.auth.hash_password`); `#`
    # starts a comment. Read again within a second or so of a change (a file that cannot be
    # read then keeps the operators read before, with a warning).
    console_users_file: Path | None = None
    # Services' bearer tokens, one per line `<principal-name>:<sha256 hex of the token>`.
    console_tokens_file: Path | None = None
    # The secret signing session cookies; without one a random secret per process (sessions do
    # not survive a restart, and two replicas do not accept each other's cookies).
    console_secret_file: Path | None = None
    console_cookie_secure: bool = False  # set behind TLS: the cookie is then sent over HTTPS only
    # Behind TLS, on a host name that serves nothing over plain HTTP (any port): how long
    # browsers are to come back over HTTPS only (Strict-Transport-Security). 0: not sent.
    console_hsts_seconds: int = 0
    console_session_hours: float = 12.0  # a sign-in lasts this long
    # Live streams (`/api/v1/events`) one caller may hold at once (an operator's tabs count
    # together; each holds a queue and a task): past it a 429. 0: no limit.
    console_streams_per_caller: int = 16
    console_login_delay: float = 0.5  # seconds a failed sign-in waits before it is answered
    # After this many failed sign-ins of one name within console_login_window_s seconds (counted
    # from the first), that name's sign-ins are refused unchecked until the window ends. Names
    # that are no operator's share one count. 0: no limit.
    console_login_attempts: int = 10
    console_login_window_s: float = 900.0
    # Sign-in attempts from one client address (the TCP peer's: X-Forwarded-For is not trusted;
    # an IPv6 address counts by its /64) within console_login_window_s seconds, successful or
    # not (one refused 503, every password check busy, is not counted), counted before the
    # name's: past it, that address is refused unchecked until the window ends. Behind a reverse
    # proxy every client shares the proxy's address. 0: no limit.
    console_login_source_attempts: int = 100
