"""The reference: what the pure fold says every projection must be."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from producers.kafka_log import KafkaEventLog
from projections.redis_store import RedisProjectionStore
from schemas.events import Event
from session_model.fold import step
from session_model.projection import Position
from session_model.questions import QuestionChange, step_changes
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


def expected_projections(events: Iterable[Event], keys: TrustedKeys) -> dict[str, Expected]:
    """Fold every session's events (in the order given) into the expected projection."""
    out: dict[str, Expected] = {}
    for event in events:
        sid = event.session_id
        current = out.setdefault(sid, Expected(Session(sid)))
        before = current.state.question
        result = step(current.state, event, keys)
        current.state = result.state
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
