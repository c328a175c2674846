"""The one typed settings object: read from the environment by the CLI, passed in elsewhere."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from schemas.errors import ConfigurationError

ENV_PREFIX = "MILPA_"


@dataclass(frozen=True, slots=True)
class Settings:
    """Where the stack is and how the pipeline behaves. Defaults point at a local stack."""

    kafka_bootstrap: str = "127.0.0.1:9092"
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_prefix: str = "ms"
    events_topic: str = "sessions.events"
    decisions_topic: str = "sessions.decisions"
    deadletter_topic: str = "sessions.deadletter"
    partitions: int = 6
    replication_factor: int = 1
    consumer_group: str = "milpa-projector"
    producer_id: str = "milpa-sessions"
    # Records per fetch, folded and committed together: a larger batch shares each session's one
    # Redis script among more of its events (docs/PERFORMANCE.md: 500 -> 4000 records).
    batch_max_records: int = 4000
    fetch_max_wait: float = 0.02  # seconds the broker may hold a fetch that finds no data
    commit_interval: float = 0.5
    commit_every: int = 10_000
    compactor_max_turns: int = 40
    compactor_keep_recent: int = 12
    scheduler_enabled: bool = True
    trusted_keys_dir: Path | None = None
    signing_key: Path | None = None
    metrics_port: int = 0
    read_timeout: float = 10.0
    # Seconds a Redis connect or reply may take before the call fails (the CLI then exits with
    # one line; the worker retries with backoff), and a Kafka client's bootstrap and metadata.
    redis_timeout: float = 3.0
    kafka_timeout: float = 5.0
    # How long a stopping worker or scheduler may take after SIGTERM before it exits regardless
    # (what it had not committed is redelivered), and how long one waits at start-up for Kafka
    # and Redis (0: for ever, printing a status line every startup_status_every seconds).
    shutdown_grace: float = 10.0
    startup_timeout: float = 0.0
    startup_status_every: float = 10.0

    @classmethod
    def from_env(cls, environ: Mapping[str, str], **overrides: Any) -> Settings:
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


def _convert(name: str, type_: Any, raw: str) -> Any:
    kind = str(type_)
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
