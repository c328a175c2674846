"""Composing settings into the real adapters (the only place that knows all of them)."""

from __future__ import annotations

from pathlib import Path

from processors.keys import Keys
from processors.redis_store import RedisProjectionStore
from producers.kafka_log import KafkaEventLog
from producers.settings import Settings
from producers.store import SessionStore
from schemas.errors import ConfigurationError
from session_model.signing import Signer, TrustedKeys


def trusted_keys(settings: Settings) -> TrustedKeys:
    """The answering keys the fold trusts: every `*.pem` public key in `trusted_keys_dir`."""
    directory = settings.trusted_keys_dir
    if directory is None:
        return TrustedKeys.none()
    if not directory.is_dir():
        raise ConfigurationError(f"trusted keys directory {directory} does not exist")
    return TrustedKeys.from_pem_files(sorted(directory.glob("*.pem")))


def signer(settings: Settings) -> Signer | None:
    """The answering key of this surface, if configured (its file stem is the key id)."""
    path: Path | None = settings.signing_key
    return Signer.from_pem_file(path) if path is not None else None


def projection_store(settings: Settings) -> RedisProjectionStore:
    """The Redis projection store under the configured key prefix."""
    return RedisProjectionStore.from_url(
        settings.redis_url, Keys(settings.redis_prefix), settings.compactor_max_turns
    )


def session_store(settings: Settings, *, producer: str | None = None) -> SessionStore:
    """A `SessionStore` writing to Kafka and reading the Redis projections."""
    log = KafkaEventLog(
        settings.kafka_bootstrap, settings.events_topic, client_id=producer or settings.producer_id
    )
    return SessionStore(
        log,
        projection_store(settings),
        producer=producer or settings.producer_id,
        signer=signer(settings),
        read_timeout=settings.read_timeout,
    )
