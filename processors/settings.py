"""What the long-running processes read: the projector worker and the standalone scheduler."""

from __future__ import annotations

from dataclasses import dataclass

from producers.settings import ENV_PREFIX, StackSettings
from schemas.errors import ConfigurationError


@dataclass(frozen=True)
class WorkerSettings(StackSettings):
    """The worker's (and scheduler's) batching, commit, metrics and lifecycle knobs."""

    # Records per fetch, folded and committed together: a larger batch shares each session's one
    # Redis script among more of its events (docs/PERFORMANCE.md: 500 -> 4000 records).
    batch_max_records: int = 4000
    fetch_max_wait: float = 0.02  # seconds the broker may hold a fetch that finds no data
    # Bytes a fetch waits for (at most fetch_max_wait) before the broker answers. 1: answer with
    # whatever is there, the lowest latency. Below saturation every batch costs the worker the
    # same few milliseconds however few records it holds; a larger value makes fewer, larger
    # batches at low rates, for up to fetch_max_wait more latency (docs/PERFORMANCE.md).
    fetch_min_bytes: int = 1
    # Sessions whose folded state a worker keeps between batches (beyond it the older half is
    # dropped and read back from Redis when their events come): its memory, a few KB per session.
    cache_sessions: int = 100_000
    # The same for each process of a rebuild (`milpa-sessions replay`, also `--live`): the states
    # of the sessions it folds, as it folds the whole topic.
    rebuild_cache_sessions: int = 200_000
    commit_interval: float = 0.5  # seconds between offset commits (of batches fully applied)
    commit_every: int = 10_000  # or after this many records
    scheduler_enabled: bool = True  # the in-worker scheduler (expiry and compaction events)
    # Closings from a timer process of the worker's own (false: from the worker's event loop,
    # where a deadline waits behind the batch being folded; see processors/timer_process.py).
    scheduler_timer_process: bool = True
    # The timer process's scheduling: SCHED_FIFO at this priority (0: none), else this nice value
    # (0: none); where the OS does not permit it, it runs at normal priority and logs why.
    scheduler_timer_realtime_priority: int = 10
    scheduler_timer_nice: int = -10
    # Seconds without the timer process's heartbeat after which the worker ends it as hung and
    # starts another (no deadline closes while a timer hangs).
    scheduler_timer_hang_s: float = 10.0
    metrics_port: int = 0  # Prometheus text on metrics_host:port/metrics (0: off)
    metrics_host: str = "127.0.0.1"  # the metrics' bind address: loopback unless said otherwise
    # The health endpoints beside the metrics (`processors/health.py`): `/livez` fails when the
    # event loop has not run for this long, `/readyz` also when records waited this long with no
    # batch finished.
    stall_s: float = 30.0
    # How often a worker reads again the state a parked partition waits on (a session whose
    # stored state did not decode): once it reads (rebuilt), the partition is read again.
    park_retry_s: float = 10.0
    # How long a stopping worker or scheduler may take after SIGTERM before it exits regardless
    # (what it had not committed is redelivered), and how long one waits at start-up for Kafka
    # and Redis (0: for ever, printing a status line every startup_status_every seconds).
    shutdown_grace: float = 10.0
    # How long a revocation waits for the batches in hand (Redis or the broker refusing, retried)
    # before the worker stops instead: the group's rebalance waits for every member's
    # revocation, so one worker's refused output would hold up the whole fleet. What it had not
    # finished is read again from the committed offsets. Keep it below the group's rebalance
    # timeout (Faust: 60 s).
    revoke_grace: float = 10.0
    startup_timeout: float = 0.0
    startup_status_every: float = 10.0

    def cache_limit(self) -> int:
        """`cache_sessions`, at least 1 (ConfigurationError otherwise)."""
        return _at_least_one("CACHE_SESSIONS", self.cache_sessions)

    def park_retry(self) -> float:
        """`park_retry_s`, above 0 (ConfigurationError otherwise)."""
        if not self.park_retry_s > 0:
            raise ConfigurationError(
                f"{ENV_PREFIX}PARK_RETRY_S={self.park_retry_s}: must be above 0"
            )
        return self.park_retry_s

    def rebuild_cache_limit(self) -> int:
        """`rebuild_cache_sessions`, at least 1 (ConfigurationError otherwise)."""
        return _at_least_one("REBUILD_CACHE_SESSIONS", self.rebuild_cache_sessions)


def _at_least_one(name: str, value: int) -> int:
    if value < 1:
        raise ConfigurationError(f"{ENV_PREFIX}{name}={value}: must be at least 1")
    return value
