"""Analytics on the real stack: pause counters in Redis, `stats` CLI, the worker's `/metrics`.

Questions with every reason code (and none → `unspecified`) are asked through Kafka; some are
answered, some left to the worker's scheduler to expire, the rest stay open. The counters the
commit script keeps must say exactly that, through the reader, the CLI and Prometheus, and must
not move when a crashed worker's uncommitted tail, or the whole topic, is delivered again.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import asdict
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from cryptography.hazmat.primitives import serialization
from prometheus_client.parser import text_string_to_metric_families

from deploy.harness import end_offsets, free_port, wait_for
from milpa_sessions.cli import main
from milpa_sessions.settings import Settings
from producers.kafka_log import KafkaEventLog
from producers.store import SessionStore, deadline_in
from projections.analytics import Analytics, Count, PausesByReason
from projections.redis_store import RedisProjectionStore
from session_model.policy import permission_question, signature_question, target_question
from session_model.principal import Principal
from session_model.session import Question
from session_model.signing import Signer
from tests.integration.conftest import committed_offsets, with_keys

pytestmark = pytest.mark.integration

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

EXPECTED = (
    PausesByReason("permission", pauses=3, answered=1, expired=1, still_open=1),
    PausesByReason("signature", pauses=2, answered=1, expired=0, still_open=1),
    PausesByReason("target_not_named", pauses=1, answered=0, expired=1, still_open=0),
    PausesByReason("unspecified", pauses=2, answered=1, expired=0, still_open=1),
)


def _scrape(port: int) -> Samples | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except (urllib.error.URLError, ConnectionError):
        return None
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _sample(samples: Samples | None, name: str, **labels: str) -> float:
    if samples is None:
        return -1.0
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


OPERATOR = Signer.generate("ops-analytics")


def _trusting(settings: Settings, directory: Path) -> Settings:
    """`settings` whose workers trust `OPERATOR` (its public key written into `directory`)."""
    (directory / f"{OPERATOR.key_id}.pem").write_bytes(
        OPERATOR.private_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return with_keys(settings, trusted_keys_dir=directory)


def _ended(projections: RedisProjectionStore, sid: str) -> bool:
    session = projections.load(sid)
    return session is not None and session.ended


def _cli(settings: Settings, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), env=settings.to_env())
    return result.exit_code, result.output


def _ask_the_scenario(
    kafka_log: KafkaEventLog, projections: RedisProjectionStore, prefix: str, worker: Any
) -> list[str]:
    """The questions behind `EXPECTED`; returns the session ids once all of it is projected."""
    agent = SessionStore(kafka_log, projections, producer="it-agent", read_timeout=60)
    loose = SessionStore(kafka_log, projections, producer="it-agent", checks=False, read_timeout=60)
    human = SessionStore(
        kafka_log, projections, producer="console", signer=OPERATOR, read_timeout=60
    )
    sids = [f"{prefix}-{n}" for n in range(7)]
    for sid in sids:
        agent.start(sid, "analytics")
    for sid in sids:
        agent.load(sid)  # the worker is up and projecting: deadlines from now on are honest
    soon = deadline_in(datetime.now(UTC), 1.5)
    s0, s1, s2, s3, s4, s5, s6 = sids
    # permission: answered, expired, open
    agent.ask(s0, permission_question("deploy", {"env": "prod"}))
    agent.answer(s0, "perm:deploy", "yes", Principal("cli:ops@laptop"))
    agent.ask(s1, permission_question("drop", {"table": "t"}, expires_at=soon))
    agent.ask(s2, permission_question("migrate", {}))
    # signature: a second pause of s0, left open; one signed by the operator
    agent.ask(s0, signature_question("release", {"v": 2}))
    agent.ask(s3, signature_question("tag", {"v": 1}))
    agent.load(s3)  # the operator answers what it sees
    human.answer(s3, "sign:tag", "approved", Principal("actor:member:7", verified=True))
    # target_not_named: expired
    agent.ask(s4, target_question("rm", "/srv/data", "Remove /srv/data?", expires_at=soon))
    # no reason → unspecified: one open, one answered
    agent.ask(s5, Question(id="q-open", question="Carry on?", options=("yes", "no")))
    agent.ask(s6, Question(id="q-which", question="Which branch?"))
    # answered by an unsigned "verified" claim: stored unverified, a downgrade
    agent.answer(s6, "q-which", "main", Principal("actor:member:9", verified=True))
    loose.answer(s5, "not-the-open-one", "yes", Principal("cli:ops@laptop"))  # stale_question
    for sid in sids:
        agent.load(sid)
    loose.load(s5)
    try:
        wait_for(lambda: _ended(projections, s1) and _ended(projections, s4), timeout=30)
    except TimeoutError:
        still = [sid for sid in (s1, s4) if not _ended(projections, sid)]
        raise AssertionError(
            f"{still}: window still open at {datetime.now(UTC)}, deadline {soon}; the worker's"
            f" scheduler never closed it\n{worker.log()[-3000:]}"
        ) from None
    return sids


def _counter_hashes(projections: RedisProjectionStore) -> dict[str, dict[Any, Any]]:
    """Every analytics counter except the folded-events progress counter (the probe moves it)."""
    client = projections.client
    pattern = projections.keys.stats_pattern()
    return {
        k.decode(): client.hgetall(k)
        for k in client.scan_iter(match=pattern, count=1000)
        if not k.decode().endswith(":stats:events")
    }


def _folded(projections: RedisProjectionStore) -> int:
    return Analytics(projections.client, projections.keys).folded()


def test_pauses_by_reason_and_outcome_through_redis_the_cli_and_metrics(
    settings: Settings,
    kafka_log: KafkaEventLog,
    projections: RedisProjectionStore,
    start_worker: Any,
    tmp_path: Path,
) -> None:
    port = free_port()
    settings = _trusting(settings, tmp_path)
    worker = start_worker(with_keys(settings, metrics_port=port))
    _ask_the_scenario(kafka_log, projections, "an", worker)
    analytics = Analytics(projections.client, projections.keys)
    now = datetime.now(UTC)

    # The reader: all time and the last 24 hours say the same (everything was asked just now).
    assert analytics.pauses(None, now) == EXPECTED
    assert analytics.pauses(timedelta(hours=24), now, "reason") == EXPECTED
    assert analytics.pauses(timedelta(minutes=5), now) == EXPECTED
    hourly = analytics.pauses(timedelta(hours=24), now, "hour")
    per_reason: dict[str, int] = {}
    for h in hourly:
        assert now - timedelta(hours=2) < h.hour <= now
        per_reason[h.reason] = per_reason.get(h.reason, 0) + h.count
    assert per_reason == {r.reason: r.pauses for r in EXPECTED}
    outcomes = {(o.outcome, o.reason): o.count for o in analytics.pauses(None, now, "outcome")}
    assert outcomes == {
        ("answered", "permission"): 1,
        ("answered", "signature"): 1,
        ("answered", "unspecified"): 1,
        ("expired", "permission"): 1,
        ("expired", "target_not_named"): 1,
        ("still_open", "permission"): 1,
        ("still_open", "signature"): 1,
        ("still_open", "unspecified"): 1,
    }
    tta: dict[str, int] = {}
    for row in analytics.time_to_answer():
        tta[row.reason] = tta.get(row.reason, 0) + row.count
        if row.count:  # answered within seconds of being asked
            assert row.le_seconds is not None and row.le_seconds <= 30, row
    assert tta == {"permission": 1, "signature": 1, "unspecified": 1}
    assert analytics.rejections() == (Count("stale_question", 1),)
    assert analytics.downgrades() == (Count("principal", 1),)

    # The CLI, JSON and tables.
    code, raw = _cli(settings, "--json", "stats", "pauses", "--since", "24h", "--by", "reason")
    assert code == 0, raw
    assert json.loads(raw) == [asdict(r) for r in EXPECTED]
    code, raw = _cli(settings, "--json", "stats", "pauses", "--since", "all", "--by", "outcome")
    assert code == 0, raw
    assert {(r["outcome"], r["reason"]): r["count"] for r in json.loads(raw)} == outcomes
    code, raw = _cli(settings, "--json", "stats", "pauses", "--since", "30m", "--by", "hour")
    assert code == 0, raw
    assert sum(r["count"] for r in json.loads(raw)) == 8
    code, table = _cli(settings, "stats", "pauses", "--since", "7d")
    assert code == 0, table
    for r in EXPECTED:
        assert r.reason in table
    assert "still open" in table
    code, raw = _cli(settings, "--json", "stats", "tta")
    assert code == 0 and sum(r["count"] for r in json.loads(raw)) == 3, raw
    code, raw = _cli(settings, "--json", "stats", "rejections")
    assert code == 0, raw
    assert json.loads(raw) == {
        "rejections": [{"name": "stale_question", "count": 1}],
        "downgrades": [{"name": "principal", "count": 1}],
    }
    code, out = _cli(settings, "stats", "pauses", "--since", "yesterday")
    assert code == 2 and "Invalid value for '--since'" in out

    # Prometheus, scraped over HTTP from the worker process.
    def metrics_caught_up() -> bool:
        m = _scrape(port)
        lag = [v for (name, _), v in (m or {}).items() if name == "milpa_consumer_lag"]
        return (
            m is not None
            and all(_sample(m, "milpa_pauses_total", reason=r.reason) == r.pauses for r in EXPECTED)
            and _sample(m, "milpa_scheduler_closings_total") >= 2
            and _sample(m, "milpa_decisions_published_total") == 5
            and bool(lag)
            and all(v == 0 for v in lag)
        )

    try:
        wait_for(metrics_caught_up, timeout=30)
    except TimeoutError:
        raise AssertionError(f"metrics: {_scrape(port)}\n{worker.log()[-4000:]}") from None
    m = _scrape(port)
    assert _sample(m, "milpa_events_total", outcome="applied") > 0
    assert _sample(m, "milpa_events_total", outcome="rejected") == 1
    assert _sample(m, "milpa_rejections_total", code="stale_question") == 1
    assert _sample(m, "milpa_principal_downgrades_total") == 1
    assert _sample(m, "milpa_batches_total") > 0
    assert _sample(m, "milpa_batch_size_count") == _sample(m, "milpa_batches_total")
    assert _sample(m, "milpa_batch_size_sum") == _sample(m, "milpa_records_total")
    # How far it trails the log: every batch timed (kafka-python stamps each record), readable
    # within the minute the scenario took.
    # (A batch is counted from its fold on and made readable at its commit: one folded ahead of
    # the one committing may be in flight, should the scheduler append meanwhile.)
    batches = _sample(m, "milpa_batches_total")
    assert _sample(m, "milpa_batch_fetched_lag_ms_count") == batches
    assert batches - 2 <= _sample(m, "milpa_batch_visible_lag_ms_count") <= batches
    for lag in ("milpa_batch_fetched_lag_ms", "milpa_batch_visible_lag_ms"):
        assert 0 < _sample(m, f"{lag}_sum") < 60_000 * _sample(m, f"{lag}_count"), lag
    assert _sample(m, "milpa_redis_round_trips_total") > 0
    assert _sample(m, "milpa_dead_lettered_total") == 0
    closings = _sample(m, "milpa_scheduler_closings_total")
    assert _sample(m, "milpa_expiry_lateness_ms_count") == closings > 0
    assert _sample(m, "milpa_expiry_lateness_ms_bucket", le="+Inf") == closings
    assert _sample(m, "milpa_expiry_lateness_ms_bucket", le="10.0") <= closings


def _end_offsets(settings: Settings) -> dict[int, int]:
    return end_offsets(settings.kafka_access().kafka_python(), settings.events_topic)


def _group_caught_up(settings: Settings) -> bool:
    """The group committed every record of the topic (acks follow the Redis commit)."""
    ends = _end_offsets(settings)
    committed = committed_offsets(settings)
    return all(committed.get(p, 0) >= end for p, end in ends.items() if end > 0)


@pytest.mark.fault_load
def test_counters_are_not_counted_twice_after_a_kill_nine_or_a_full_redelivery(  # noqa: PLR0917
    settings: Settings,
    kafka_log: KafkaEventLog,
    projections: RedisProjectionStore,
    start_worker: Any,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    settings = _trusting(settings, tmp_path)
    # Faust reads these from the environment: the killed member leaves the group after 6 s
    # (the broker's minimum) instead of a minute, so the restart gets its partitions sooner.
    monkeypatch.setenv("BROKER_SESSION_TIMEOUT", "6")
    monkeypatch.setenv("BROKER_HEARTBEAT_INTERVAL", "1")
    first = start_worker(settings)
    _ask_the_scenario(kafka_log, projections, "crash", first)
    first.kill9()  # right after applying: the group's offsets likely trail what Redis holds
    before = _counter_hashes(projections)
    folded_before = _folded(projections)
    now = datetime.now(UTC)
    analytics = Analytics(projections.client, projections.keys)
    assert analytics.pauses(None, now) == EXPECTED
    committed = committed_offsets(settings)
    uncommitted = {
        p: end - committed.get(p, 0)
        for p, end in _end_offsets(settings).items()
        if end > committed.get(p, 0)
    }

    # Restart in the same group: Kafka redelivers the uncommitted tail; the marks refuse it.
    port = free_port()
    second = start_worker(with_keys(settings, metrics_port=port))
    probe = SessionStore(kafka_log, projections, producer="it-agent", read_timeout=60)
    probe.start("crash-probe", "the restarted worker is consuming")  # counts nothing
    probe.load("crash-probe")
    wait_for(lambda: _group_caught_up(settings), timeout=90)
    wait_for(lambda: _scrape(port) is not None, timeout=30)
    assert _counter_hashes(projections) == before
    assert _folded(projections) == folded_before + 1  # the probe's start, nothing redelivered
    assert analytics.pauses(timedelta(hours=24), now) == EXPECTED
    m = _scrape(port)
    print(f"uncommitted at the crash (partition: records): {uncommitted}")
    redelivered = _sample(m, "milpa_redelivered_total")
    assert redelivered >= sum(uncommitted.values()), (uncommitted, m)
    assert _sample(m, "milpa_records_total") == redelivered + 1  # + the probe
    assert _sample(m, "milpa_events_total", outcome="applied") == 1
    assert not any(name == "milpa_pauses_total" for name, _ in m or {})
    second.stop()

    # A fresh consumer group re-reads the whole topic into the same Redis: still no change.
    fresh = with_keys(
        settings, consumer_group=f"{settings.consumer_group}-again", metrics_port=port
    )
    total = sum(_end_offsets(settings).values())
    third = start_worker(fresh)

    def replayed() -> bool:
        # Records are counted as a batch is taken, redeliveries once it is folded: wait for the
        # group's commit too, which follows the whole batch.
        return _sample(_scrape(port), "milpa_records_total") >= total and _group_caught_up(fresh)

    try:
        wait_for(replayed, timeout=90)
    except TimeoutError:
        raise AssertionError(f"metrics: {_scrape(port)}\n{third.log()[-4000:]}") from None
    m = _scrape(port)
    assert _sample(m, "milpa_redelivered_total") == _sample(m, "milpa_records_total") == total
    assert _sample(m, "milpa_events_total", outcome="applied") == 0
    assert not any(name == "milpa_pauses_total" for name, _ in m or {})
    assert _counter_hashes(projections) == before
    assert _folded(projections) == folded_before + 1
    assert analytics.pauses(None, datetime.now(UTC)) == EXPECTED
    assert analytics.rejections() == (Count("stale_question", 1),)
