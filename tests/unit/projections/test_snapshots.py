"""Snapshot records and the rebuild plan (`projections.snapshots`), without I/O."""

from __future__ import annotations

import tracemalloc
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings

from projections.codec import (
    DEFLATED,
    STATE_VERSION,
    pack_event_ids,
    session_to_blob,
    summary_to_stored,
    turn_to_json,
)
from projections.requests import Restored, Retired
from projections.snapshots import (
    CORRUPT,
    GONE,
    LAYOUT,
    TRUST,
    UNREADABLE,
    Chosen,
    UnusableSnapshot,
    checkpoint_key,
    checkpoint_record,
    chosen_snapshots,
    plan,
    recovered,
    restored,
    snapshot_record,
    stub_record,
)
from schemas.codec import EventCodec, SchemaRegistry
from session_model.authority import Authority, Cutover, kafka_form, trust_fingerprint
from session_model.fold import fold, step
from session_model.modes import Mode
from session_model.projection import Expired, Position
from session_model.session import Session
from session_model.signing import Signer, TrustedKeys
from tests.unit.builders import OPERATOR, fresh_ids, started, tool, trusted, turn
from tests.unit.session_model.test_properties import SID, event_sequences

CODEC = EventCodec()
# The trust the rebuilds of these tests fold under, and another (the operator's key trusted).
OURS = trust_fingerprint(TrustedKeys.none(), Mode.ASK, Cutover())
OTHER = trust_fingerprint(trusted(), Mode.ASK, Cutover())


def _raw(s: Session, mark: str, counters: dict[bytes, bytes] | None = None) -> tuple[Any, ...]:
    """What `requests.raw_states` returns for a stored session."""
    chunks = [*s.event_ids.older, s.event_ids.current] if len(s.event_ids) else []
    return (
        session_to_blob(s),
        mark.encode(),
        [turn_to_json(t) for t in s.turns],
        [pack_event_ids(sorted(c)) for c in chunks],
        None if s.summary is None else summary_to_stored(s.summary),
        counters or {},
        None,
    )


def _numbered(
    records: list[tuple[int, bytes | None, bytes | None]],
) -> list[tuple[int, int, bytes | None, bytes | None]]:
    """(partition, key, value) records with their offsets on the snapshots topic."""
    return [(p, at, key, value) for at, (p, key, value) in enumerate(records)]


def _snapshot(
    sid: str, offset: int, partition: int = 0, trust: str = OURS, **changes: Any
) -> bytes:
    record = snapshot_record(
        sid, _raw(fold(sid, []).evolve(started=True), f"{partition}:{offset}"), 7, trust=trust
    )
    return CODEC.encode_snapshot({**record, **changes})


def _checkpoint(partition: int, offset: int, trust: str = OURS, **changes: Any) -> bytes:
    record = checkpoint_record(partition, offset, 9, trust=trust)
    return CODEC.encode_checkpoint({**record, **changes})


@settings(max_examples=60, deadline=None)
@given(event_sequences())
def test_any_folded_session_survives_a_snapshot_unchanged(events: list) -> None:
    state = fold(SID, events)
    counters = {b"pauses\tpermission": b"2", b"events\tfolded": b"31"}
    record = snapshot_record(SID, _raw(state, "3:41", counters), 1_700_000_000_000, trust=OURS)
    back = restored(CODEC.decode_snapshot(CODEC.encode_snapshot(record)), OURS)
    assert back.folded.state == state
    assert back.mark == Position(3, 41)
    assert back.counters == {"pauses\tpermission": 2, "events\tfolded": 31}
    assert back.taken_at_ms == 1_700_000_000_000


def test_a_summary_stored_deflated_travels_as_its_text() -> None:
    summary = "Goal: g\n\nOperational facts:\n" + ",".join(f'{{"seq":{i}}}' for i in range(300))
    state = fold(SID, []).evolve(started=True, summary=summary)
    assert summary_to_stored(summary)[0] == DEFLATED
    record = snapshot_record(SID, _raw(state, "0:7"), 1, trust=OURS)
    assert record["summary"] == summary  # the schema's string: the text, not the stored bytes
    back = restored(CODEC.decode_snapshot(CODEC.encode_snapshot(record)), OURS)
    assert back.folded.state == state


def test_a_snapshot_of_another_layout_or_session_is_unusable() -> None:
    record = CODEC.decode_snapshot(_snapshot("a", 5))
    with pytest.raises(Exception) as raised:
        restored({**record, "layout": STATE_VERSION + 1}, OURS)
    assert getattr(raised.value, "reason", None) == LAYOUT
    got = plan(
        _numbered([(0, b"b", CODEC.encode_snapshot(record))]), [0], CODEC, trust=OURS
    )  # under another key
    assert got.ignored == {UNREADABLE: 1} and got.starts == {0: 0}
    with pytest.raises(Exception) as raised:
        restored({**record, "state": bytes([STATE_VERSION]) + b"[not json"}, OURS)
    assert getattr(raised.value, "reason", None) == UNREADABLE


def test_a_partition_starts_after_its_latest_checkpoint_and_restores_its_sessions() -> None:
    records = [
        (0, b"a", _snapshot("a", 3)),
        (0, checkpoint_key(0), _checkpoint(0, 4)),
        (0, b"a", _snapshot("a", 9)),
        (0, checkpoint_key(0), _checkpoint(0, 10)),
        (1, b"b", _snapshot("b", 2, partition=1)),
        (1, checkpoint_key(1), _checkpoint(1, 6)),
    ]
    got = plan(_numbered(records), [0, 1, 2], CODEC, trust=OURS)
    assert got.starts == {0: 11, 1: 7, 2: 0}  # partition 2: no checkpoint, the whole log
    assert {p: {s: r.mark for s, r in m.items()} for p, m in got.sessions.items()} == {
        0: {"a": 9},
        1: {"b": 2},
    }
    assert not got.ignored


def test_a_late_older_snapshot_does_not_replace_a_newer_one() -> None:
    records = [(0, b"a", _snapshot("a", 9)), (0, b"a", _snapshot("a", 4))]
    assert plan(_numbered(records), [0], CODEC, trust=OURS).sessions[0]["a"].mark == 9


def test_a_late_older_snapshot_does_not_replace_a_newer_one_of_other_trust_or_layout() -> None:
    """A stale owner's late write stays stale when the newer snapshot it would replace is one
    this rebuild cannot use: the session is folded from the log, not from the older one (whose
    partition's checkpoint may already cover the events between the two)."""
    for newer in (
        _snapshot("a", 12, trust=OTHER),
        CODEC.encode_snapshot(
            {**CODEC.decode_snapshot(_snapshot("a", 12)), "layout": STATE_VERSION + 1}
        ),
    ):
        records = [
            (0, b"a", _snapshot("a", 9)),
            (0, b"a", newer),
            (0, b"a", _snapshot("a", 10)),  # the stale owner's, late
            (0, checkpoint_key(0), _checkpoint(0, 11)),
        ]
        got = plan(_numbered(records), [0], CODEC, trust=OURS)
        assert got.starts == {0: 0} and got.restored_count() == 0
        assert sum(got.ignored.values()) == 1


def test_unusable_records_are_counted_and_their_partition_is_folded_from_zero() -> None:
    records = [
        (0, b"a", _snapshot("a", 3)),
        (0, b"c", b"\xc3\x01 garbage"),
        (0, checkpoint_key(0), _checkpoint(0, 4)),
        (1, b"b", _snapshot("b", 2, partition=1, layout=STATE_VERSION + 1)),
        (1, checkpoint_key(1), _checkpoint(1, 6)),
        (2, checkpoint_key(2), _checkpoint(2, 6, layout=STATE_VERSION + 1)),
        (3, checkpoint_key(3), b"junk"),
    ]
    got = plan(_numbered(records), [0, 1, 2, 3], CODEC, trust=OURS)
    assert got.ignored == {CORRUPT: 2, LAYOUT: 2}
    assert got.starts == {0: 0, 1: 0, 2: 0, 3: 0}
    assert set(got.sessions[0]) == {"a"}  # still restored: its records are skipped by its mark
    assert len(got.messages) == 4


def test_a_tombstone_forgets_a_snapshot() -> None:
    records = [
        (0, b"a", _snapshot("a", 3)),
        (0, b"a", None),
        (0, checkpoint_key(0), _checkpoint(0, 4)),
    ]
    got = plan(_numbered(records), [0], CODEC, trust=OURS)
    assert got.restored_count() == 0 and got.starts == {0: 5}


def test_one_session_starts_after_its_own_snapshot() -> None:
    records = [
        (0, b"a", _snapshot("a", 3)),
        (0, b"z", _snapshot("z", 8)),
        (0, checkpoint_key(0), _checkpoint(0, 9)),
    ]
    got = plan(_numbered(records), [0], CODEC, session_id="a", trust=OURS)
    assert got.starts == {0: 4} and set(got.sessions[0]) == {"a"}
    assert plan(_numbered(records), [0], CODEC, session_id="nobody", trust=OURS).starts == {0: 0}


def test_an_unusable_record_replaced_by_a_usable_one_is_not_counted() -> None:
    records = [
        (0, b"a", b"\xc3\x01 garbage"),
        (0, checkpoint_key(0), b"junk"),
        (0, b"a", _snapshot("a", 3)),
        (0, checkpoint_key(0), _checkpoint(0, 4)),
    ]
    got = plan(_numbered(records), [0], CODEC, trust=OURS)
    assert not got.ignored and got.starts == {0: 5} and set(got.sessions[0]) == {"a"}


def test_the_plan_keeps_where_each_latest_snapshot_is_and_not_its_state() -> None:
    """A fleet's plan must not hold every session's state: planning 400 snapshots of 40 KB each
    (16 MB of states) keeps a few hundred bytes per session."""
    summary = "Goal: g\n" + "x" * 40_000
    records = []
    for i in range(400):
        sid = f"s{i}"
        state = fold(sid, []).evolve(started=True, summary=summary)
        raw = _raw(state, f"0:{i}")
        value = CODEC.encode_snapshot(snapshot_record(sid, raw, 1, trust=OURS))
        records.append((0, sid.encode(), value))
    numbered = _numbered(records)
    tracemalloc.start()
    try:
        got = plan(numbered, [0], CODEC, trust=OURS)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert got.sessions[0]["s7"] == Chosen(at=7, mark=7) and got.restored_count() == 400
    assert peak < 2_000_000, f"planning held {peak:,} bytes"


def test_the_chosen_snapshots_are_read_again_and_what_is_no_longer_there_is_gone() -> None:
    older, newer = _snapshot("a", 3), _snapshot("a", 9)
    garbled = CODEC.decode_snapshot(_snapshot("c", 4))
    records = [
        (0, b"a", older),
        (0, b"b", _snapshot("b", 5)),
        (0, b"a", newer),
        (0, b"c", CODEC.encode_snapshot({**garbled, "state": bytes([STATE_VERSION]) + b"[x"})),
        (1, b"d", _snapshot("d", 2, partition=1)),
    ]
    got = plan(_numbered(records), [0, 1], CODEC, trust=OURS)
    assert not got.ignored  # the states are not read yet
    assert got.sessions == {
        0: {"a": Chosen(2, 9), "b": Chosen(1, 5), "c": Chosen(3, 4)},
        1: {"d": Chosen(4, 2)},
    }
    # Read again without "b" (compacted away since: a newer snapshot of it landed after the plan).
    again = [r for r in _numbered(records) if r[2] != b"b"]
    found = list(chosen_snapshots(again, got.sessions, CODEC, trust=OURS))
    restored_marks = {
        (p, r.folded.state.id): r.mark.offset for p, r in found if not isinstance(r, Exception)
    }
    assert restored_marks == {(0, "a"): 9, (1, "d"): 2}
    unusable = {(p, r.reason) for p, r in found if isinstance(r, UnusableSnapshot)}
    assert unusable == {(0, UNREADABLE), (0, GONE)}
    assert len(found) == 4


# -- a fold resumed from a snapshot equals the whole fold ------------------------------------------

GOLDEN = Path(__file__).resolve().parents[2] / "fixtures" / "golden"
SCHEMAS = Path(__file__).resolve().parents[3] / "schemas"


def _resumed(sid: str, events: list[Any], cut: int, keys: Any) -> Session:
    """Fold `events[:cut]`, snapshot it (through Avro), restore it, fold the rest onto it."""
    before = fold(sid, events[:cut], keys)
    record = snapshot_record(sid, _raw(before, f"0:{cut}"), 1, trust=OURS)
    state = restored(CODEC.decode_snapshot(CODEC.encode_snapshot(record)), OURS).folded.state
    auth = Authority(keys)
    for event in events[cut:]:
        state = step(state, event, auth).state
    return state


@pytest.mark.parametrize("version", sorted(p.parent.name for p in GOLDEN.glob("*/expected.json")))
def test_every_golden_log_resumed_from_a_snapshot_at_any_event_equals_its_whole_fold(
    version: str,
) -> None:
    events = sorted(
        (CODEC.decode(p.read_bytes()) for p in (GOLDEN / version).glob("session.*.bin")),
        key=lambda e: e.event_id,
    )
    assert len(events) >= 10
    keys = trusted()
    sid = events[0].session_id
    whole = fold(sid, events, keys)
    assert whole.seq > 0
    for cut in range(len(events) + 1):
        assert _resumed(sid, events, cut, keys) == whole, f"{version}: cut after {cut} events"


def test_a_long_generated_session_resumed_from_snapshots_equals_its_whole_fold() -> None:
    fresh_ids()
    events: list[Any] = [started("a week of builds")]
    for i in range(1, 3000):
        if i % 2:
            artifact = {"artifact": f"file:m{i % 37}.py"} if i % 3 == 0 else {}
            events.append(
                tool(("pytest", "make", "git")[i % 3], f"step {i}", i % 8 == 1, extra=artifact)
            )
        else:
            events.append(turn("assistant", f"thinking about step {i}"))
        if i % 500 == 0:
            events.append(events[-40])  # a late retry of an event: still recognised after a restore
    keys = trusted()
    whole = fold("s1", events, keys)
    for cut in (1, 64, 65, 257, 1000, 2345, len(events)):
        assert _resumed("s1", events, cut, keys) == whole, f"cut after {cut}"


def test_a_checkpoint_tombstone_forgets_the_checkpoint() -> None:
    records = [
        (0, b"a", _snapshot("a", 3)),
        (0, checkpoint_key(0), _checkpoint(0, 4)),
        (0, checkpoint_key(0), None),
    ]
    assert plan(_numbered(records), [0], CODEC, trust=OURS).starts == {0: 0}


def test_a_snapshot_or_checkpoint_that_is_no_event_of_its_partition_is_not_believed() -> None:
    # Each would skip events the log holds: restored at an offset past the log's end, or in
    # another partition than the one it was written to.
    ends = {0: 20, 1: 20}
    records = [
        (0, b"a", _snapshot("a", 2**63 - 1)),  # past the end
        (0, b"b", _snapshot("b", 5, partition=1)),  # written to 0, says 1
        (0, b"c", _snapshot("c", 7)),  # fine
        (1, checkpoint_key(1), _checkpoint(1, 2**63 - 1)),
    ]
    got = plan(_numbered(records), [0, 1], CODEC, ends=ends, trust=OURS)
    assert got.ignored == {UNREADABLE: 3}
    assert got.starts == {0: 0, 1: 0}  # both folded from the start
    assert {s: r.mark for s, r in got.sessions[0].items()} == {"c": 7}


# -- the trust a snapshot was folded under ---------------------------------------------------------


def test_a_snapshot_or_checkpoint_of_other_trust_inputs_is_ignored_counted_and_folded_again() -> (
    None
):
    """A state folded while another key was trusted may hold grants that key signed: a rebuild
    under other keys folds its session (its partition from offset 0) instead of restoring it."""
    records = [
        (0, b"a", _snapshot("a", 3, trust=OTHER)),
        (0, checkpoint_key(0), _checkpoint(0, 4)),
        (1, b"b", _snapshot("b", 2, partition=1)),
        (1, checkpoint_key(1), _checkpoint(1, 6, trust=OTHER)),
        (2, b"c", _snapshot("c", 5, partition=2)),
        (2, checkpoint_key(2), _checkpoint(2, 7)),
    ]
    got = plan(_numbered(records), [0, 1, 2], CODEC, trust=OURS)
    assert got.ignored == {TRUST: 2}
    assert got.starts == {0: 0, 1: 0, 2: 8}  # only partition 2 is all of this trust
    assert {p: set(m) for p, m in got.sessions.items()} == {1: {"b"}, 2: {"c"}}
    assert any(OTHER in line and "a:" in line for line in got.messages)
    # The same records for a rebuild under the other trust: only its own are used.
    other = plan(_numbered(records), [0, 1, 2], CODEC, trust=OTHER)
    assert other.ignored == {TRUST: 4}
    assert other.starts == {0: 0, 1: 0, 2: 0}
    assert {p: set(m) for p, m in other.sessions.items()} == {0: {"a"}}
    # One session's rebuild starts from its snapshot only if it is of its trust.
    one = plan(_numbered(records), [0], CODEC, session_id="a", trust=OURS)
    assert one.starts == {0: 0} and one.restored_count() == 0 and one.ignored == {TRUST: 1}
    assert plan(_numbered(records), [0], CODEC, session_id="a", trust=OTHER).starts == {0: 4}


def test_a_snapshot_or_checkpoint_written_before_they_named_their_trust_is_ignored() -> None:
    """Records of schema v4 (no `trust`): of unknown trust, so folded once more after the
    upgrade."""
    older = EventCodec(SchemaRegistry(SCHEMAS / "released" / "v4"))
    snapshot = CODEC.decode_snapshot(_snapshot("a", 3))
    checkpoint = CODEC.decode_checkpoint(_checkpoint(0, 4))
    del snapshot["trust"], snapshot["expired_at_ms"], checkpoint["trust"]
    records = [
        (0, b"a", older.encode_snapshot(snapshot)),
        (0, checkpoint_key(0), older.encode_checkpoint(checkpoint)),
    ]
    assert CODEC.decode_snapshot(records[0][2])["trust"] is None  # read at its default
    got = plan(_numbered(records), [0], CODEC, trust=OURS)
    assert got.ignored == {TRUST: 2} and got.starts == {0: 0} and got.restored_count() == 0
    with pytest.raises(Exception) as raised:
        restored(CODEC.decode_snapshot(records[0][2]), OURS)
    assert getattr(raised.value, "reason", None) == TRUST


def test_the_trust_fingerprint_names_the_keys_the_start_mode_and_the_cutover() -> None:
    base = trust_fingerprint(trusted(), Mode.ASK, Cutover({0: 10}, "topic-1"))
    assert len(base) == 32 and int(base, 16) >= 0
    other_key = Signer("ops-2", Ed25519PrivateKey.from_private_bytes(bytes(range(1, 33))))
    both = TrustedKeys({**other_key.trusted_keys().keys, **OPERATOR.trusted_keys().keys})
    same_id_other_key = TrustedKeys({OPERATOR.key_id: other_key.trusted_keys().keys["ops-2"]})
    renamed = TrustedKeys({"renamed": OPERATOR.trusted_keys().keys[OPERATOR.key_id]})
    # Equal inputs, however built, name the same trust.
    assert trust_fingerprint(trusted(), Mode.ASK, Cutover({0: 10}, "topic-1")) == base
    both_reversed = TrustedKeys(dict(reversed(list(both.keys.items()))))
    assert trust_fingerprint(both, Mode.ASK, Cutover()) == trust_fingerprint(
        both_reversed, Mode.ASK, Cutover()
    )
    # An empty cut-over is none, whatever topic it names.
    assert trust_fingerprint(trusted(), Mode.ASK, Cutover({}, "topic-1")) == trust_fingerprint(
        trusted(), Mode.ASK, Cutover()
    )
    # An offset of 0 makes nothing legacy: as if the partition were not named.
    assert trust_fingerprint(trusted(), Mode.ASK, Cutover({0: 10, 1: 0}, "topic-1")) == base
    # One topic id, in Kafka's tools' form or as a UUID (either passes the start-up check).
    uid = uuid.UUID("427d9b50-9c6d-4355-b212-107766bd4038")
    assert trust_fingerprint(
        trusted(), Mode.ASK, Cutover({0: 10}, kafka_form(uid))
    ) == trust_fingerprint(trusted(), Mode.ASK, Cutover({0: 10}, str(uid).upper()))
    # Any other input, another trust.
    others = [
        trust_fingerprint(TrustedKeys.none(), Mode.ASK, Cutover({0: 10}, "topic-1")),
        trust_fingerprint(both, Mode.ASK, Cutover({0: 10}, "topic-1")),
        trust_fingerprint(same_id_other_key, Mode.ASK, Cutover({0: 10}, "topic-1")),
        trust_fingerprint(renamed, Mode.ASK, Cutover({0: 10}, "topic-1")),
        trust_fingerprint(trusted(), Mode.AUTO, Cutover({0: 10}, "topic-1")),
        trust_fingerprint(trusted(), Mode.ASK, Cutover({0: 11}, "topic-1")),
        trust_fingerprint(trusted(), Mode.ASK, Cutover({0: 10}, "topic-2")),
        trust_fingerprint(trusted(), Mode.ASK, Cutover()),
    ]
    assert len({base, *others}) == len(others) + 1


# -- retired sessions' stubs -------------------------------------------------------------------

AT = datetime(2026, 3, 1, 12, 0, 0, 250_000, tzinfo=UTC)


def _stub(sid: str, offset: int, partition: int = 0, trust: str = OURS) -> bytes:
    gone = Retired(Expired(sid, AT, Position(partition, offset)), {"pauses\tsignature": 2})
    return CODEC.encode_snapshot(stub_record(gone, 11, trust=trust))


def test_a_stub_brings_back_the_tombstone_and_the_counters_and_is_small() -> None:
    counters = {"pauses\tpermission": 3, "events\tfolded": 1_234_567}
    gone = Retired(Expired("s-1", AT, Position(2, 41)), counters)
    value = CODEC.encode_snapshot(stub_record(gone, 1_700_000_000_000, trust=OURS))
    record = CODEC.decode_snapshot(value)
    assert record["offset"] == 41 and record["partition"] == 2 and record["state"] == b""
    assert recovered(record, OURS) == gone
    assert len(value) < 160  # no state: its id, mark, trust and counters (108 bytes here)
    with pytest.raises(UnusableSnapshot) as raised:
        recovered(CODEC.decode_snapshot(_stub("s-1", 41, trust=OTHER)), OURS)
    assert raised.value.reason == TRUST
    with pytest.raises(UnusableSnapshot) as raised:
        restored(record, OURS)  # as a session: it has none
    assert raised.value.reason == UNREADABLE


def test_a_full_snapshot_is_recovered_as_the_session() -> None:
    got = recovered(CODEC.decode_snapshot(_snapshot("a", 3)), OURS)
    assert isinstance(got, Restored) and got.folded.state.id == "a"


def test_a_stub_replaces_the_session_s_snapshot_in_the_plan_and_is_restored_as_retired() -> None:
    records = [
        (0, b"a", _snapshot("a", 3)),
        (0, b"b", _snapshot("b", 5)),
        (0, b"a", _stub("a", 3)),  # a's last state, then its stub at the same mark
        (0, checkpoint_key(0), _checkpoint(0, 6)),
    ]
    got = plan(_numbered(records), [0], CODEC, trust=OURS)
    assert got.sessions == {0: {"a": Chosen(2, 3), "b": Chosen(1, 5)}} and got.starts == {0: 7}
    back = [g for _, g in chosen_snapshots(_numbered(records), got.sessions, CODEC, trust=OURS)]
    retired = [g for g in back if isinstance(g, Retired)]
    assert [r.session_id for r in retired] == ["a"] and retired[0].expired.at == AT
    assert [g.folded.state.id for g in back if isinstance(g, Restored)] == ["b"]


def test_a_later_full_snapshot_of_a_restored_session_replaces_its_stub() -> None:
    """`replay --session` restores an expired session; its next snapshot (the same or a later
    mark) stands over the stub."""
    records = [(0, b"a", _stub("a", 3)), (0, b"a", _snapshot("a", 3))]
    got = plan(_numbered(records), [0], CODEC, trust=OURS)
    assert got.sessions == {0: {"a": Chosen(1, 3)}}


def test_a_stub_below_the_session_s_latest_snapshot_is_a_stale_write_and_ignored() -> None:
    records = [(0, b"a", _snapshot("a", 9)), (0, b"a", _stub("a", 3))]
    got = plan(_numbered(records), [0], CODEC, trust=OURS)
    assert got.sessions == {0: {"a": Chosen(0, 9)}} and got.ignored == {}
