"""Settings every process shares, and the writer's: typed, read from `MILPA_*` by the CLI."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Self

from producers.kafka_access import KafkaAccess
from projections.keys import Keys
from projections.redis_client import (
    AsyncClient,
    RedisAuth,
    SyncClient,
    async_client,
    sync_client,
)
from projections.requests import Durability
from schemas.errors import ConfigurationError
from schemas.secret_files import read_secret
from session_model.authority import Cutover
from session_model.keyed_ids import ID_KEY_MIN_BYTES
from session_model.modes import Mode, parse_mode

ENV_PREFIX = "MILPA_"


@dataclass(frozen=True)
class StackSettings:
    """What every process reads: where Kafka and Redis are, the names in them, the shared rules.

    Each reader's settings extend this one (`WriterSettings` here, `processors.settings.
    WorkerSettings`, `milpa_sessions.settings.ConsoleSettings`); `milpa_sessions.settings.Settings`
    is all of them, as the CLI reads it. Every field `x` is read from `MILPA_X`.
    """

    kafka_bootstrap: str = "127.0.0.1:9092"
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_prefix: str = "ms"
    events_topic: str = "sessions.events"
    decisions_topic: str = "sessions.decisions"
    questions_topic: str = "sessions.questions"
    deadletter_topic: str = "sessions.deadletter"
    snapshots_topic: str = "sessions.snapshots"  # compacted: each session's latest snapshot
    partitions: int = 6
    replication_factor: int = 1
    # min.insync.replicas of every topic `topics create` makes (None: the brokers' default): how
    # many replicas must hold a write before the broker acknowledges it to an acks=all producer.
    min_insync_replicas: int | None = None
    consumer_group: str = "milpa-projector"  # the workers' group (replay checks it is empty)
    # Directory of the `*.pem` public keys whose answers count as verified (writer and fold).
    trusted_keys_dir: Path | None = None
    # The fold's authority inputs, which every folding process must share (see the README,
    # "Authority"): the least supervised mode a session may start in without an operator's
    # signature, and the cut-over (`partition:offset,...`) before which unsigned authority
    # events are legacy records and believed as written.
    unsigned_start_mode: str = "ask"
    authority_cutover: str = ""
    # The compaction rule every writer of projections must agree on (the due index, the cut).
    compactor_max_turns: int = 40
    compactor_keep_recent: int = 12
    # Seconds an ended session's Redis projection is kept after its last event (None: for ever).
    # Its events stay in Kafka; `milpa-sessions replay --session ID` brings it back (README,
    # "Retention"). The workers' commits index ended sessions and their loops drop the due ones.
    projection_ttl_s: float | None = None
    # Snapshots of the sessions' hot state (`processors/snapshots.py`): a worker's round of a
    # partition every snapshot_interval_s seconds, or once snapshot_every events of it were
    # applied since its last round; 0 takes none (commits then track nothing for them, and
    # `replay` folds the whole log). Every process that commits projections must agree on it.
    snapshot_interval_s: float = 300.0
    snapshot_every: int = 100_000
    # Kafka security: the protocol (PLAINTEXT, or SASL_SSL with SCRAM on a secured cluster), the
    # user, a file holding its password, and the CA that signed the brokers' certificates.
    kafka_security_protocol: str = "PLAINTEXT"
    kafka_sasl_mechanism: str = "SCRAM-SHA-512"
    kafka_username: str = ""
    kafka_password_file: Path | None = None
    kafka_ca_file: Path | None = None
    # Redis ACL credentials and TLS: the user, a file holding its password (never the URL or an
    # environment variable: they end up in logs and process lists), and for rediss:// the CA.
    redis_username: str = ""
    redis_password_file: Path | None = None
    redis_ca_file: Path | None = None
    # Seconds a Redis connect or reply may take before the call fails (the CLI then exits with
    # one line; the worker retries with backoff), and a Kafka client's bootstrap and metadata.
    redis_timeout: float = 3.0
    kafka_timeout: float = 5.0
    # Redis Cluster: MILPA_REDIS_URL names one of its nodes. Every key of a partition lives in
    # one hash slot (`projections.keys`), and a batch goes to each master in one pipeline.
    redis_cluster: bool = False
    # Replicas that must acknowledge a projection write (Redis `WAIT`, on each master written)
    # before the writer moves on and Kafka offsets move past it (0: the master's reply is
    # enough, and a failover may lose the last writes); how long one WAIT may block.
    redis_wait_replicas: int = 0
    redis_wait_timeout_ms: int = 1000

    def kafka_access(self) -> KafkaAccess:
        """How to reach Kafka (the password read from its file now)."""
        password = _secret(self.kafka_password_file, "KAFKA_PASSWORD_FILE")
        return KafkaAccess(
            self.kafka_bootstrap,
            self.kafka_security_protocol.upper(),
            self.kafka_sasl_mechanism.upper(),
            self.kafka_username or None,
            password,
            self.kafka_ca_file,
        )

    def redis_auth(self) -> RedisAuth:
        """The Redis credentials (the password read from its file now)."""
        password = _secret(self.redis_password_file, "REDIS_PASSWORD_FILE")
        return RedisAuth(self.redis_username or None, password, self.redis_ca_file)

    def redis_async(self) -> AsyncClient:
        """An asyncio client of the projections' Redis (or Redis Cluster); create it in the loop
        that uses it."""
        return async_client(
            self.redis_url, self.redis_timeout, self.redis_auth(), cluster=self.redis_cluster
        )

    def redis_sync(self) -> SyncClient:
        """A synchronous client of the projections' Redis (or Redis Cluster)."""
        return sync_client(
            self.redis_url, self.redis_timeout, self.redis_auth(), cluster=self.redis_cluster
        )

    def redis_keys(self) -> Keys:
        """The projections' key names: the prefix, and the events topic's partitions."""
        return Keys(self.redis_prefix, partitions=self.partitions)

    def durability(self) -> Durability:
        """What a projection write waits for (ConfigurationError if the numbers are off)."""
        if self.redis_wait_replicas < 0 or self.redis_wait_timeout_ms < 1:
            raise ConfigurationError(
                f"{ENV_PREFIX}REDIS_WAIT_REPLICAS={self.redis_wait_replicas} (>= 0) and "
                f"{ENV_PREFIX}REDIS_WAIT_TIMEOUT_MS={self.redis_wait_timeout_ms} (>= 1)"
            )
        return Durability(self.redis_wait_replicas, self.redis_wait_timeout_ms)

    def start_mode(self) -> Mode:
        """`unsigned_start_mode` as a mode (ConfigurationError if it names none)."""
        mode = parse_mode(self.unsigned_start_mode)
        if mode is None:
            raise ConfigurationError(
                f"{ENV_PREFIX}UNSIGNED_START_MODE={self.unsigned_start_mode!r}: "
                "expected ask, acknowledge or auto"
            )
        return mode

    def topic_min_insync(self) -> int | None:
        """`min_insync_replicas`, within 1..replication_factor (ConfigurationError otherwise)."""
        n = self.min_insync_replicas
        if n is not None and not 1 <= n <= self.replication_factor:
            raise ConfigurationError(
                f"{ENV_PREFIX}MIN_INSYNC_REPLICAS={n}: must be between 1 and "
                f"{ENV_PREFIX}REPLICATION_FACTOR ({self.replication_factor})"
            )
        return n

    def cutover(self) -> Cutover:
        """`authority_cutover` as a cut-over (ConfigurationError if it does not parse)."""
        try:
            return Cutover.parse(self.authority_cutover)
        except ValueError as e:
            raise ConfigurationError(
                f"{ENV_PREFIX}AUTHORITY_CUTOVER={self.authority_cutover!r}: {e}"
            ) from e

    @classmethod
    def from_env(cls, environ: Mapping[str, str], **overrides: Any) -> Self:
        """Read `MILPA_<FIELD>` variables (e.g. MILPA_KAFKA_BOOTSTRAP); overrides win."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = environ.get(ENV_PREFIX + f.name.upper())
            if raw is not None and raw != "":
                values[f.name] = _convert(f.name, f.type, raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return replace(cls(), **values)

    def to_env(self) -> dict[str, str]:
        """The `MILPA_*` variables that reproduce these settings (for child processes)."""
        env: dict[str, str] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                env[ENV_PREFIX + f.name.upper()] = str(value)
        return env


@dataclass(frozen=True)
class WriterSettings(StackSettings):
    """What a writer reads (`SessionStore` over Kafka: agents, the CLI's writing commands)."""

    producer_id: str = "milpa-sessions"
    signing_key: Path | None = None  # the operator's private key the CLI signs answers with
    read_timeout: float = 10.0  # seconds a read waits for the projection to apply a write
    # Seconds kafka-python keeps trying to deliver an append before it gives the record up; the
    # append waits 10 s past it, so one that failed will not be written later (README). The
    # console may want it shorter: its writes hold a thread while Kafka is away.
    delivery_timeout: float = 120.0
    # The secret a transfer's event ids derive under (`SessionStore.transfer_open_todos`): give it
    # to the processes that run transfers, never to an agent's. Without one a random key per
    # process (a re-run of an interrupted transfer from another process then rests on its reads).
    id_key_file: Path | None = None

    def id_key(self) -> bytes | None:
        """The transfer ids' key: `id_key_file`'s bytes (stripped), or None without a file."""
        path = self.id_key_file
        if path is None:
            return None
        key = read_secret(path, "id key (MILPA_ID_KEY_FILE)").strip()
        if len(key) < ID_KEY_MIN_BYTES:
            raise ConfigurationError(
                f"MILPA_ID_KEY_FILE: the key in {path} is shorter than {ID_KEY_MIN_BYTES} bytes"
            )
        return key


def _secret(path: Path | None, name: str) -> str | None:
    """The secret held in `path` (stripped), or None without a file."""
    if path is None:
        return None
    try:
        return read_secret(path, f"secret of {ENV_PREFIX}{name}").decode().strip()
    except UnicodeDecodeError as e:
        raise ConfigurationError(f"{ENV_PREFIX}{name}: {path} is not UTF-8") from e


def _convert(name: str, type_: Any, raw: str) -> Any:
    kind = str(type_).removesuffix(" | None")  # an optional setting: set means its type
    try:
        if kind == "bool":
            if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError("expected true or false")
            return raw.lower() in ("1", "true", "yes")
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
        if "Path" in kind:
            return Path(raw)
    except ValueError as e:
        raise ConfigurationError(f"{ENV_PREFIX}{name.upper()}={raw!r}: {e}") from e
    return raw
