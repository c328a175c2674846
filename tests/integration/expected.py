"""The reference: what the pure fold says every projection must be."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from producers.kafka_log import KafkaEventLog
from projections.analytics import Analytics
from projections.indexes import index_changes
from projections.keys import Keys
from projections.memory import InMemoryProjectionStore
from projections.redis_store import RedisProjectionStore
from schemas.events import Event
from session_model.fold import step
from session_model.projection import Position, SessionUpdate
from session_model.questions import QuestionChange, WaitingQuestion, step_changes
from session_model.session import History, HistoryRecord, Session, Turn
from session_model.signing import TrustedKeys
from session_model.timeline import translate


@dataclass
class Expected:
    """One session as the fold computes it from its events."""

    state: Session
    history: list[Turn] = field(default_factory=list)
    timeline: list[dict[str, object]] = field(default_factory=list)
    changes: list[QuestionChange] = field(default_factory=list)  # the questions feed's records
    facts: list[HistoryRecord] = field(default_factory=list)  # calls, decisions, rejections, ...
    # What its steps add to the counters, by `Keys.counter_field` (the counter hash's name and
    # the field: the same in every partition; `Keys.counter_of` names a partition's shard).
    counters: Counter[str] = field(default_factory=Counter)


_ANYWHERE = Keys("", partitions=1)  # where the counters are named before a session is placed
_NOWHERE = Position(0, 0)


def expected_projections(events: Iterable[Event], keys: TrustedKeys) -> dict[str, Expected]:
    """Fold every session's events (in the order given) into the expected projection."""
    out: dict[str, Expected] = {}
    for event in events:
        sid = event.session_id
        current = out.setdefault(sid, Expected(Session(sid)))
        before = current.state.question
        result = step(current.state, event, keys)
        current.state = result.state
        one = SessionUpdate(sid, None, _NOWHERE, result.state, (result,))
        for key, name, n in index_changes(one, _ANYWHERE, None).counters:
            current.counters[_ANYWHERE.counter_field(key, name)] += n
        current.changes.extend(step_changes(result, before))
        outcome = result.outcome
        if outcome.turn is not None:
            current.history.append(outcome.turn)
        current.facts.extend(
            f for f in (outcome.fact, outcome.decision, outcome.rejection) if f is not None
        )
        current.timeline.extend(translate(result))
    return out


def expected_feed(expected: dict[str, Expected]) -> set[tuple[str, int, str]]:
    """(session, question seq, status) of every questions-feed record the fold implies."""
    return {(c.session_id, c.seq, c.status.value) for e in expected.values() for c in e.changes}


def decided(expected: dict[str, Expected]) -> list[tuple[str, int, str]]:
    """(session, seq, source event id) of every decision the fold made, sorted."""
    return sorted(
        (sid, d.seq, d.event_id) for sid, exp in expected.items() for d in exp.state.decisions
    )


def expected_counters(expected: dict[str, Expected], keys: Keys) -> dict[str, dict[str, int]]:
    """Every analytics counter hash (key -> field -> count) that committing each step exactly
    once leaves: events folded, pauses, outcomes, time to answer, rejections, downgrades, all
    time and by hour (`projections.indexes.index_changes` of each step, summed)."""
    out: defaultdict[str, Counter[str]] = defaultdict(Counter)
    for sid, exp in expected.items():
        partition = keys.partition_of(sid)  # each session counts in its partition's shard
        for counter_field, n in exp.counters.items():
            key, name = keys.counter_of(counter_field, partition)
            out[key][name] += n
    return {key: dict(counts) for key, counts in out.items()}


def stored_counters(store: RedisProjectionStore) -> dict[str, dict[str, int]]:
    """Every shard of every analytics counter hash under the store's prefix, in the generations
    the partitions are in, as Redis holds it."""
    client = store.client
    store.refresh_generations()
    return {
        key.decode(): {f.decode(): int(n) for f, n in client.hgetall(key).items()}
        for generation in store.keys.in_use()
        for key in client.scan_iter(match=store.keys.stats_pattern(generation), count=1000)
    }


def waiting_index(store: RedisProjectionStore | InMemoryProjectionStore) -> list[WaitingQuestion]:
    """Every entry of the waiting-questions index, page after page, in index order."""
    page = store.waiting(limit=500)
    items = list(page.items)
    while page.next is not None:
        page = store.waiting(after=page.next, limit=500)
        items += page.items
    assert len(items) == page.total, (len(items), page.total)
    return items


def assert_counters_exact(store: RedisProjectionStore, expected: dict[str, Expected]) -> None:
    """The analytics counters, the fleet counts and the waiting index in Redis are what one
    application of every step leaves: nothing counted twice, nothing lost.

    Each partition's shard of each counter is compared; the reference indexes are those of the
    in-memory store given each session's last state once; the pause and rejection totals are
    also checked, as the analytics reader adds them up, against the sessions' own counts (the
    fold's, not the commit's derivation)."""
    counters = expected_counters(expected, store.keys)
    stored = stored_counters(store)
    differ = sorted(k for k in counters.keys() | stored.keys() if counters.get(k) != stored.get(k))
    assert not differ, [(k, stored.get(k), counters.get(k)) for k in differ[:5]]
    pauses: Counter[str] = Counter()
    rejections: Counter[str] = Counter()
    for exp in expected.values():
        pauses.update(exp.state.pauses)
        rejections.update(exp.state.rejection_counts())
    analytics = Analytics(store.client, store.keys)  # as readers see them: shards added up
    assert analytics.counter("pauses") == dict(pauses)
    assert analytics.counter("rejections") == dict(rejections)
    reference = InMemoryProjectionStore()  # each session's last state, committed once
    reference.commit(
        [SessionUpdate(sid, None, _NOWHERE, e.state, ()) for sid, e in expected.items()]
    )
    assert store.fleet() == reference.fleet()
    assert store.waiting_by_reason() == reference.waiting_by_reason()
    assert waiting_index(store) == waiting_index(reference)


def _normalised(entries: Sequence[dict[str, object]]) -> list[object]:
    # The store keeps JSON; compare in that form.
    return [json.loads(json.dumps(e, ensure_ascii=False, default=str)) for e in entries]


def assert_projection_matches(store: RedisProjectionStore, expected: dict[str, Expected]) -> None:
    """Every session's state, history (turns and facts) and timeline in Redis equal the
    fold's, exactly."""
    mismatched = []
    for sid, exp in expected.items():
        actual = store.load(sid)
        if actual != exp.state:
            mismatched.append(f"{sid}: state differs")
            continue
        if store.history(sid) != exp.history:
            mismatched.append(f"{sid}: history differs")
        if store.facts(sid) != History(sid).extended(exp.state.seq, exp.facts):
            mismatched.append(f"{sid}: facts differ")
        if _normalised(store.timeline(sid)) != _normalised(exp.timeline):
            mismatched.append(f"{sid}: timeline differs")
    assert not mismatched, f"{len(mismatched)} of {len(expected)} differ: {mismatched[:5]}"
    assert sorted(expected) == sorted(set(store.ids()) & set(expected))


class RecordingLog:
    """A Kafka log that also remembers what it appended, in order (the test's reference)."""

    def __init__(self, log: KafkaEventLog) -> None:
        self.log = log
        self.events: list[Event] = []
        self.positions: dict[str, Position] = {}

    def append(self, event: Event) -> Position:
        """Append and remember."""
        position = self.log.append(event)
        self.events.append(event)
        self.positions[event.session_id] = position
        return position

    def append_many(self, events: Sequence[Event]) -> list[Position]:
        """Append several and remember them."""
        positions = self.log.append_many(events)
        self.events.extend(events)
        for e, p in zip(events, positions, strict=True):
            self.positions[e.session_id] = p
        return positions
