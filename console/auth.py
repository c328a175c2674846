"""Who is calling: operators' argon2id passwords, services' bearer tokens, signed cookie sessions.

An operator signs in with a password checked against an argon2id hash and gets a signed,
time-limited cookie naming them and carrying a CSRF token made at sign-in; a service sends
`Authorization: Bearer <token>`, matched by its sha256. Nothing here logs a secret.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import ipaddress
import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Literal, Protocol, TypeVar

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError, VerifyMismatchError
from itsdangerous import BadSignature, URLSafeTimedSerializer

from schemas.errors import ConfigurationError
from schemas.secret_files import read_secret
from session_model.principal import Principal

log = logging.getLogger(__name__)
V = TypeVar("V")

SESSION_COOKIE = "milpa_console"
LOGIN_COOKIE = "milpa_console_login"
HOST_PREFIX = "__Host-"


def cookie_name(base: str, secure: bool) -> str:
    """The name a cookie goes by: behind TLS (`console_cookie_secure`) with the `__Host-`
    prefix, so that browsers take it only from this host over HTTPS, with no Domain and Path `/`
    (a sibling subdomain or a plain-HTTP page cannot plant one)."""
    return HOST_PREFIX + base if secure else base


_HEX = frozenset("0123456789abcdef")


@dataclass(frozen=True, slots=True)
class Identity:
    """An authenticated caller: the principal it acts as, and how it proved who it is."""

    principal: Principal
    via: Literal["cookie", "bearer"]
    csrf: str | None = None  # the cookie session's CSRF token (None for a bearer token)
    session_id: str | None = None  # the cookie session's id (what signing out revokes)
    # May make a session less supervised (grant, relax its mode, sign a call, say the yes that
    # grants or confirms a target): an operator, or a service whose token has the `operator` scope.
    relaxes: bool = False

    @property
    def name(self) -> str:
        """The principal id without its channel prefix (`alice` for `operator:alice`)."""
        return self.principal.id.partition(":")[2] or self.principal.id


@dataclass(frozen=True, slots=True)
class CookieSession:
    """What a session cookie holds once its signature and age were checked."""

    username: str
    session_id: str
    csrf: str
    credential: str  # the fingerprint of the password hash it was issued under


def hash_password(password: str) -> str:
    """An argon2id hash of `password` for the users file (`username:<hash>`)."""
    if not password:
        raise ValueError("an empty password cannot be hashed for sign-in")
    return PasswordHasher().hash(password)


def token_digest(token: str) -> str:
    """The sha256 hex digest of a bearer token, as the tokens file stores it."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def operator_principal(username: str) -> Principal:
    """The verified principal of a signed-in operator."""
    return Principal(f"operator:{username}", verified=True)


def service_principal(name: str) -> Principal:
    """The verified principal of a service holding a bearer token."""
    return Principal(f"service:{name}", verified=True)


def _entries(path: Path, what: str) -> list[tuple[int, str, str]]:
    """`name:value` lines of a credentials file (blank lines and `#` comments skipped)."""
    try:
        text = read_secret(path, f"{what} file").decode()
    except UnicodeDecodeError as e:
        raise ConfigurationError(f"the {what} file {path} is not UTF-8") from e
    found: list[tuple[int, str, str]] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.partition(":")
        name, value = name.strip(), value.strip()
        if not sep or not name or not value or any(c.isspace() for c in name):
            # The line is not echoed: it may hold a secret.
            raise ConfigurationError(f"{path}:{number}: expected `name:value` in the {what} file")
        found.append((number, name, value))
    return found


def load_users(path: Path | None) -> dict[str, str]:
    """Operators' argon2 hashes by username (none without a file)."""
    if path is None:
        return {}
    users: dict[str, str] = {}
    for number, name, value in _entries(path, "users"):
        if not value.startswith("$argon2"):
            raise ConfigurationError(f"{path}:{number}: {name}'s password is not an argon2 hash")
        users[name] = value
    return users


OPERATOR_SCOPE = "operator"


@dataclass(frozen=True, slots=True)
class ServiceToken:
    """A service's token as the tokens file holds it (`name:<sha256 hex>[:operator]`): its digest,
    and whether the service may make sessions less supervised (the `operator` scope)."""

    digest: str
    operator: bool = False


def load_tokens(path: Path | None) -> dict[str, ServiceToken]:
    """Services' tokens by principal name (none without a file)."""
    if path is None:
        return {}
    tokens: dict[str, ServiceToken] = {}
    for number, name, value in _entries(path, "tokens"):
        digest, _, scope = value.partition(":")
        digest = digest.lower()
        if len(digest) != 64 or not set(digest) <= _HEX:
            raise ConfigurationError(f"{path}:{number}: {name}'s token is not a sha256 hex digest")
        if scope not in ("", OPERATOR_SCOPE):
            raise ConfigurationError(
                f"{path}:{number}: {name}'s scope is neither empty nor `{OPERATOR_SCOPE}`"
            )
        tokens[name] = ServiceToken(digest, scope == OPERATOR_SCOPE)
    return tokens


class Passwords:
    """Checks operators' passwords against their argon2 hashes, `concurrent` at a time.

    Why a bound: each argon2id check takes its memory cost (64 MiB by default) for its length, and
    sign-ins need no authentication; unbounded, a flood of them is a flood of 64 MiB allocations.
    A check that finds no free slot within `wait_s` fails like a wrong password. `admitted()` keeps
    sign-ins beyond `concurrent + queue` from waiting at all: each waiting one holds a thread of
    the pool every handler shares, so a flood would stall the whole console.
    """

    def __init__(
        self,
        users: Mapping[str, str],
        hasher: PasswordHasher | None = None,
        *,
        concurrent: int = 2,
        wait_s: float = 5.0,
        queue: int = 6,
    ) -> None:
        self._users = dict(users)
        self._hasher = hasher or PasswordHasher()
        # An unknown user is checked against this, so the answer takes as long as for a known one.
        self._dummy = self._hasher.hash(secrets.token_urlsafe(16))
        self._slots = threading.BoundedSemaphore(concurrent)
        self._wait_s = wait_s
        self._places = threading.BoundedSemaphore(concurrent + queue)

    def __len__(self) -> int:
        return len(self._users)

    def replace(self, users: Mapping[str, str]) -> None:
        """Check passwords against `users` from now on (a check in flight keeps its hash)."""
        self._users = dict(users)

    def hash_of(self, username: str) -> str | None:
        """`username`'s stored argon2 hash (None for no operator)."""
        return self._users.get(username)

    @contextlib.contextmanager
    def admitted(self) -> Iterator[bool]:
        """A place among the checks running or waiting, if one is free now (False: busy)."""
        if not self._places.acquire(blocking=False):
            log.warning("a sign-in was refused: every password check is busy")
            yield False
            return
        try:
            yield True
        finally:
            self._places.release()

    def verify(self, username: str, password: str) -> bool:
        """Whether `password` is `username`'s (slow on purpose: argon2id)."""
        return self.verified(username, password) is not None

    def verified(self, username: str, password: str) -> str | None:
        """The stored hash `password` matched, if it is `username`'s (slow on purpose: argon2id).

        The hash itself, not a yes: the users file may be read again while it is checked, and a
        session must hold the fingerprint of the hash its password was checked against.
        """
        stored = self._users.get(username)
        if not self._slots.acquire(timeout=self._wait_s):
            # Never the name: operators sometimes type their password into it.
            log.warning("a sign-in was refused: every password check is busy")
            return None
        try:
            ok = self._hasher.verify(stored or self._dummy, password)
        except (VerifyMismatchError, VerificationError, InvalidHashError):
            return None
        finally:
            self._slots.release()
        return stored if ok else None


@dataclass(frozen=True, slots=True)
class FileStamp:
    """What tells a file's new content from its old without reading it."""

    device: int
    inode: int  # a file replaced by a rename (`passwd`, a mounted secret's swap) is a new inode
    size: int
    mtime_ns: int
    ctime_ns: int  # changed by any write, even one that puts the old mtime back


MISSING = FileStamp(0, 0, -1, 0, 0)  # the stamp of a file that cannot be found
SETTLED_NS = 2_000_000_000  # coarser than any file system's timestamps, FAT's 2 s included


def file_stamp(path: Path) -> FileStamp:
    """The stamp of the file at `path` now (`MISSING` if it cannot be found)."""
    try:
        st = path.stat()
    except OSError:
        return MISSING
    return FileStamp(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def settled(stamp: FileStamp, now_ns: int) -> bool:
    """Whether a stamp will change with the file's next write: its last change is older than the
    timestamps' tick (a write in the tick the file was read in could leave the stamp as it was,
    as with git's racy index entries)."""
    return now_ns - max(stamp.mtime_ns, stamp.ctime_ns) >= SETTLED_NS


USERS_RECHECK_SECONDS = 1.0  # how often, at most, a credentials file is looked at for a change

_Loaded = TypeVar("_Loaded", bound=Mapping[str, Any])


class WatchedFile(Generic[_Loaded]):
    """A credentials file behind what checks callers: read now (a bad file stops the console),
    then read again when it changed, so a changed password, a removed operator or a withdrawn
    token holds without a restart.

    Why a stamp, looked at once per `recheck_s` at most: every request that authenticates asks,
    and a `stat` is cheap where a read and a parse are not. A file that fails to read or parse
    after a change keeps the entries read before (a half-edited file must not lock everyone out)
    and is warned about once per version, by its path only (its lines hold names and secrets'
    digests). `refresh` blocks: call it off the event loop.
    """

    def __init__(
        self,
        path: Path | None,
        load: Callable[[Path | None], _Loaded],
        apply: Callable[[_Loaded], None],
        *,
        what: str,
        entries: str,
        recheck_s: float = USERS_RECHECK_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self._load = load
        self._apply = apply
        self._what = what
        self._entries_are = entries
        self._recheck_s = recheck_s
        self._clock = clock
        self._lock = threading.Lock()
        self._stamp: FileStamp | None = None  # of the version read last (None: read it again)
        self._refused: FileStamp | None = None  # the version last warned about
        self._next = clock() + recheck_s
        stamp = file_stamp(path) if path is not None else MISSING
        self._entries = load(path)  # at start a bad file is a ConfigurationError
        apply(self._entries)
        self._stamped(stamp)

    def _stamped(self, stamp: FileStamp) -> None:
        # Taken before the read, kept only once settled: a write made while it was read, or in
        # the same tick, is read again at the next look.
        self._stamp = stamp if settled(stamp, time.time_ns()) else None

    def refresh(self) -> bool:
        """Read the file again if it may have changed since it was last read (at most once per
        `recheck_s`); whether its entries changed."""
        if self.path is None or self._clock() < self._next:
            return False
        if not self._lock.acquire(blocking=False):
            return False  # another request is reading it: this one goes on with what is known
        try:
            self._next = self._clock() + self._recheck_s
            stamp = file_stamp(self.path)
            if stamp == self._stamp:
                return False
            self._stamped(stamp)
            try:
                entries = self._load(self.path)
            except ConfigurationError:
                if stamp != self._refused:
                    self._refused = stamp
                    # Not the error's text: it may name an operator or a service.
                    log.warning(
                        "the %s %s changed but cannot be read: the %s read before stay until it "
                        "is fixed",
                        self._what,
                        self.path,
                        self._entries_are,
                    )
                return False
            self._refused = None
            if entries == self._entries:
                return False
            self._entries = entries
            self._apply(entries)
            log.info(
                "the %s %s was read again: %d %s",
                self._what,
                self.path,
                len(entries),
                self._entries_are,
            )
            return True
        finally:
            self._lock.release()


def users_file(
    path: Path | None, passwords: Passwords, *, clock: Callable[[], float] = time.monotonic
) -> WatchedFile[dict[str, str]]:
    """The users file behind `passwords` (operators' argon2 hashes), read again when it changes."""
    return WatchedFile(
        path, load_users, passwords.replace, what="users file", entries="operators", clock=clock
    )


def tokens_file(
    path: Path | None, tokens: Tokens, *, clock: Callable[[], float] = time.monotonic
) -> WatchedFile[dict[str, ServiceToken]]:
    """The tokens file behind `tokens` (services' token digests), read again when it changes."""
    return WatchedFile(
        path, load_tokens, tokens.replace, what="tokens file", entries="tokens", clock=clock
    )


class Tokens:
    """Matches bearer tokens by their sha256 digest."""

    def __init__(self, tokens: Mapping[str, ServiceToken | str]) -> None:
        self.replace(tokens)

    def replace(self, tokens: Mapping[str, ServiceToken | str]) -> None:
        """Match these tokens from now on (a check in flight keeps what it read)."""
        entries = {
            n: t if isinstance(t, ServiceToken) else ServiceToken(t) for n, t in tokens.items()
        }
        # One assignment: a concurrent check reads either the old pair or the new one.
        self._table = (
            tuple((name, t.digest.encode("ascii")) for name, t in entries.items()),
            frozenset(name for name, t in entries.items() if t.operator),
        )

    def __len__(self) -> int:
        return len(self._table[0])

    def caller(self, token: str) -> Identity | None:
        """The service a token belongs to, with its scope, if any (every digest compared in
        constant time)."""
        presented = token_digest(token).encode("ascii")
        digests, operators = self._table
        found: str | None = None
        for name, digest in digests:
            if hmac.compare_digest(presented, digest):
                found = name
        if found is None:
            return None
        return Identity(service_principal(found), "bearer", relaxes=found in operators)


class SignOuts(Protocol):
    """Signed-out sessions, seen by every replica of the console (`projections.sign_outs`)."""

    def add(self, session_id: str, ttl_s: float) -> None:
        """Remember a signed-out session for `ttl_s` seconds (as long as its cookie could live)."""
        ...

    def __contains__(self, session_id: object) -> bool:
        """Whether the session was signed out."""
        ...


def _drop_lapsed(entries: OrderedDict[str, V], now: float, lapses: Callable[[V], float]) -> None:
    """Drop the entries lapsed by `now`, oldest first, up to the first one still alive.

    Entries are added in the order they lapse when they all last as long (each is moved to the
    end when it gets a new time): each call costs a step per entry it drops, not a scan of all
    (a scan per call made 20,000 sign-in attempts in one window take 11 s, under the lock every
    request shares). An `OrderedDict`: a plain dict's first key is found past the slots of the
    keys deleted before it. An entry lapsed behind a longer-lived one stays until it is read
    (and treated as lapsed) or reached.
    """
    while entries:
        value = next(iter(entries.values()))
        if lapses(value) > now:
            return
        entries.popitem(last=False)


class MemorySignOuts:
    """Signed-out sessions of this process only (a console without Redis, and tests)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        # session id -> when its cookie would expire anyway
        self._until: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()
        self._clock = clock

    def add(self, session_id: str, ttl_s: float) -> None:
        """Remember it `ttl_s` seconds."""
        now = self._clock()
        with self._lock:
            _drop_lapsed(self._until, now, lambda t: t)
            self._until.pop(session_id, None)
            self._until[session_id] = now + ttl_s

    def __contains__(self, session_id: object) -> bool:
        with self._lock:
            until = self._until.get(session_id) if isinstance(session_id, str) else None
        return until is not None and until > self._clock()


class SignInFailures(Protocol):
    """Sign-in attempts per bucket (of names, or a client address's), seen by every console
    replica (`projections.sign_ins`)."""

    def attempt(self, bucket: str, limit: int, window_s: float) -> float:
        """Count an attempt (a window of `window_s` starts with a bucket's first); 0 if it may
        go on, else the seconds left of the window (more than `limit` counted in it)."""
        ...

    def cleared(self, bucket: str) -> None:
        """Forget the bucket's attempts (a sign-in succeeded)."""
        ...

    def over(self, bucket: str, limit: int) -> float:
        """Without counting: the seconds left of the bucket's window if it already holds `limit`
        attempts (the next would be refused), else 0."""
        ...


class MemorySignInFailures:
    """Sign-in attempts counted in this process only (a console without Redis, and tests)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._counts: OrderedDict[str, tuple[int, float]] = OrderedDict()  # bucket -> (n, until)
        self._lock = threading.Lock()
        self._clock = clock

    def attempt(self, bucket: str, limit: int, window_s: float) -> float:
        """One more attempt in the bucket's window (a new window if none is open)."""
        now = self._clock()
        with self._lock:
            counts = self._counts
            _drop_lapsed(counts, now, lambda c: c[1])
            count, until = counts.get(bucket, (0, now + window_s))
            if until <= now:  # lapsed behind a younger window of another length: a new one
                del counts[bucket]
                count, until = 0, now + window_s
            counts[bucket] = (count + 1, until)
        return 0.0 if count + 1 <= limit else until - now

    def cleared(self, bucket: str) -> None:
        """Forget the bucket's attempts."""
        with self._lock:
            self._counts.pop(bucket, None)

    def over(self, bucket: str, limit: int) -> float:
        """The seconds left of the bucket's window if it holds `limit` attempts, else 0."""
        now = self._clock()
        with self._lock:
            count, until = self._counts.get(bucket, (0, now))
        return until - now if count >= limit and until > now else 0.0


BUCKETS = 1 << 16  # sign-in counts: names are spread over this many by a keyed hash
SOURCE_PREFIX = "src-"  # a client address's bucket: this, then 64 bits of a keyed hash


def source_of(host: str) -> str:
    """What a client address is counted as: an IPv4 address as itself (an IPv4-mapped IPv6 one
    too), an IPv6 address by its /64 (one host's share: its addresses within are free to pick),
    anything else (a name, a test client's) as written."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return f"{int(ip) >> 64:016x}::/64"
    return str(ip)


class SignInThrottle:
    """Refuses sign-ins, unchecked, once too many were tried within `window_s` seconds: from one
    client address (`source_limit` attempts), or of one name (`limit` failed attempts; a success
    starts the name's count again).

    Why per name: the fixed delay of a failed sign-in slows one client; many clients in parallel
    guess as fast as the password checks run. Each attempt is counted before its password is
    checked, in one step, so attempts sent in parallel get no more checks than `limit`. Names,
    operators' or not, are counted alike in `BUCKETS` buckets by a hash keyed with the console's
    secret: the answers tell nothing about which names exist, the counts take bounded memory, and
    nobody without the secret can pick names that share an operator's bucket. The price, as with
    any lockout: whoever fails a name's sign-ins `limit` times keeps its operator out until the
    window ends.

    Why per source too, counted first: one client trying many names gets `source_limit` checks
    per window in all, not `limit` per name, and once refused it counts against no name (so it
    locks out at most `source_limit / limit` names per window). Every attempt counts, successful
    or not: one operator's own password must not reset the count for guessing others'. But only
    once it got a place among the password checks (`Passwords.admitted`): one refused at once in
    a flood (503) checks nothing, and must not use up its address's attempts (an operator's own
    retries included). The address is the TCP peer's (`X-Forwarded-For` is not trusted: behind a
    reverse proxy every client shares the proxy's address, and the limit). Each address has its
    own count, named by a hash keyed with the secret (no address is stored).
    """

    def __init__(
        self,
        failures: SignInFailures,
        key: bytes,
        *,
        limit: int = 10,
        window_s: float = 900.0,
        source_limit: int = 100,
    ) -> None:
        if limit < 0 or source_limit < 0 or window_s <= 0:
            raise ConfigurationError(
                f"sign-in limit {limit} per name and {source_limit} per source within {window_s} "
                "s: each limit must be 0 (none) or more, the window positive"
            )
        self.failures = failures
        self._key = hmac.new(key, b"milpa sign-in buckets", hashlib.sha256).digest()
        self._source_key = hmac.new(key, b"milpa sign-in sources", hashlib.sha256).digest()
        self.limit = limit
        self.window_s = window_s
        self.source_limit = source_limit

    def bucket(self, username: str) -> str:
        """Where a name's attempts are counted."""
        digest = hmac.new(self._key, username.encode(), hashlib.sha256).digest()
        return f"{int.from_bytes(digest[:4], 'big') % BUCKETS:04x}"

    def source_bucket(self, host: str) -> str:
        """Where a client address's attempts are counted (`source_of` it)."""
        digest = hmac.new(self._source_key, source_of(host).encode(), hashlib.sha256).digest()
        return f"{SOURCE_PREFIX}{digest[:8].hex()}"

    def attempt_from(self, host: str | None) -> float:
        """Count an attempt from this client address (before its name's): 0 if it may go on,
        else the seconds until it may try again. Without an address (a Unix socket's peer)
        there is nothing to count."""
        if not self.source_limit or not host:
            return 0.0
        return self.failures.attempt(self.source_bucket(host), self.source_limit, self.window_s)

    def refused_from(self, host: str | None) -> float:
        """Without counting: the seconds until this address may try again if it used up its
        attempts (it is refused before it takes a place among the password checks), else 0."""
        if not self.source_limit or not host:
            return 0.0
        return self.failures.over(self.source_bucket(host), self.source_limit)

    def attempt(self, username: str) -> float:
        """Count an attempt of this name: 0 if its password may be checked, else the seconds
        until it may try again."""
        if not self.limit:
            return 0.0
        return self.failures.attempt(self.bucket(username), self.limit, self.window_s)

    def succeeded(self, username: str) -> None:
        """The operator signed in: their name's count starts again (not their address's)."""
        if self.limit:
            self.failures.cleared(self.bucket(username))


class CookieSigner:
    """Signed, time-limited cookie values: sessions, the sign-in form's token, flash messages.

    Why a session holds a fingerprint of its operator's password hash: a changed password (a new
    hash in the users file, read again when it changes) must end the sign-ins made with the old
    one, as signing out does. The fingerprint is keyed with the secret, so the cookie, readable by
    its holder, gives nothing to check guesses against.
    """

    def __init__(
        self, secret: str | bytes, session_seconds: float, sign_outs: SignOuts | None = None
    ) -> None:
        self._serializer = URLSafeTimedSerializer(secret)
        key = secret.encode() if isinstance(secret, str) else secret
        self._credential_key = hmac.new(key, b"milpa session credential", hashlib.sha256).digest()
        self.session_seconds = session_seconds
        self._sign_outs: SignOuts = sign_outs if sign_outs is not None else MemorySignOuts()

    def dumps(self, value: Any, purpose: str) -> str:
        """Sign a JSON-able value for one purpose (a cookie of another purpose never reads it)."""
        return self._serializer.dumps(value, salt=purpose)

    def loads(self, text: str | None, purpose: str, max_age: float) -> Any:
        """The value signed for `purpose` at most `max_age` seconds ago, else None."""
        if not text:
            return None
        try:
            return self._serializer.loads(text, salt=purpose, max_age=int(max_age))
        except BadSignature:  # also SignatureExpired
            return None

    def credential(self, password_hash: str) -> str:
        """The fingerprint a session holds of its operator's stored password hash."""
        digest = hmac.new(self._credential_key, password_hash.encode(), hashlib.sha256)
        return digest.hexdigest()[:16]

    def issue(self, username: str, password_hash: str) -> tuple[str, CookieSession]:
        """A new session for `username`, signed in with the password `password_hash` stores: the
        cookie value and what it holds."""
        session = CookieSession(
            username,
            secrets.token_urlsafe(16),
            secrets.token_urlsafe(32),
            self.credential(password_hash),
        )
        value = {
            "u": session.username,
            "sid": session.session_id,
            "csrf": session.csrf,
            "cred": session.credential,
        }
        return self.dumps(value, "session"), session

    def read(
        self, text: str | None, password_hash: Callable[[str], str | None]
    ) -> CookieSession | None:
        """The session a cookie holds, if it is genuine, young enough, not signed out, and its
        operator's password is still the one it was issued under (`password_hash(username)`, None
        for no operator)."""
        value = self.loads(text, "session", self.session_seconds)
        if not isinstance(value, dict):
            return None
        username, sid, csrf = value.get("u"), value.get("sid"), value.get("csrf")
        credential = value.get("cred")
        if not (
            isinstance(username, str)
            and isinstance(sid, str)
            and isinstance(csrf, str)
            and isinstance(credential, str)
        ):
            return None
        stored = password_hash(username)
        if stored is None or not hmac.compare_digest(
            self.credential(stored).encode(), credential.encode()
        ):
            return None
        if sid in self._sign_outs:
            return None
        return CookieSession(username, sid, csrf, credential)

    def signed_out(self, session_id: str) -> bool:
        """Whether this session was signed out (by any replica sharing the sign-outs)."""
        return session_id in self._sign_outs

    def revoke(self, session_id: str) -> None:
        """Sign a session out: its cookie is refused from now on (by every replica sharing the
        sign-outs) until it would have expired anyway."""
        self._sign_outs.add(session_id, self.session_seconds)


def csrf_matches(expected: str | None, presented: str | None) -> bool:
    """Whether a presented CSRF token is the session's (constant-time comparison)."""
    if not expected or not presented:
        return False
    return hmac.compare_digest(expected.encode("utf-8"), presented.encode("utf-8"))


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, else None."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None
