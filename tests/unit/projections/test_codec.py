"""The stored forms of a session: state, event ids and timeline entries, exactly."""

from __future__ import annotations

import base64
import json
import random
import uuid
import zlib
from dataclasses import fields
from datetime import UTC, datetime

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from projections.codec import (
    DEFLATE_FROM,
    DEFLATED,
    NOT_IN_STATE,
    STATE_VERSION,
    STORED_FIELDS,
    decisions_from_json,
    entry_from_json,
    entry_to_json,
    history_from_json,
    pack_event_ids,
    session_from_blob,
    session_to_blob,
    summary_from_stored,
    summary_to_stored,
    turn_from_json,
    turn_to_json,
    unpack_event_ids,
)
from projections.layout import STATE_INLINE
from schemas.errors import CorruptProjectionError, ProjectionError
from session_model.fold import fold, step
from session_model.modes import Mode
from session_model.principal import Principal
from session_model.session import (
    CallFact,
    Decision,
    ExecutionFact,
    InheritedFrom,
    Observation,
    OpenCard,
    Question,
    Rejection,
    Session,
    Todo,
    Turn,
    latest_artifacts,
)
from session_model.timeline import translate
from tests.unit.session_model.test_properties import SID, event_sequences

AT = datetime(2026, 3, 1, 9, 30, 15, 123000, tzinfo=UTC)


def _round_trip(s: Session) -> Session:
    return session_from_blob(session_to_blob(s), s.id, s.turns, s.event_ids, s.summary)


def _as_json(entry: object) -> object:
    """What a timeline entry is after a trip through JSON (tuples become lists, and so on)."""
    return json.loads(json.dumps(entry, ensure_ascii=False, default=str))


def _everything() -> Session:
    """A session in which every stored field differs from its default; unicode throughout."""
    question = Question(
        "q2",
        "¿Borrar «/tmp/x»? 🗑",
        ("sí", "no"),
        '{"operation": "rm", "target": "/tmp/x"}',
        "2026-03-01T10:00:00+01:00",
        "target_not_named",
        9,
        AT,
    )
    return Session(
        id="sesión-ünïcode-🙂",
        started=True,
        goal="migrar el módulo «Inventario»\nline two",
        parent_id="parent-1",
        mode=Mode.AUTO,
        turns=(Turn("user", "hola", 2),),
        turn_count=3,
        plan="plan: ① read ② change",
        plan_version=2,
        tool_calls=4,
        mutations=2,
        todos=(
            Todo("t1", "leer", "done", 2, 1, "in_progress", "planned", 0, 1, 1),
            Todo(
                "t2",
                "cambiar",
                "blocked",
                1,
                None,
                None,
                "inherited-origin",
                1,
                2,
                2,
                replaces="t0",
                inherited_from=InheritedFrom("other", 3, "discovered"),
                transferred_to="target",
            ),
            Todo("t3", "", "weird-status", 5, 4, "weird-before", "retrospective", 2, 2, 1),
        ),
        permissions=("deploy", "rm"),
        removed_options=("force",),
        run_first=("lint",),
        obligation_declared=True,
        summary="so far: 🙂",
        compacted_through=2,
        question=question,
        closed_question=Question("q1", "Ship?", (), None, None, None, 5, None),
        decisions=(
            Decision(
                "q1",
                "Ship?",
                "yes",
                Principal("actor:member:42", verified=True),
                "exec-1",
                "permission",
                "because",
                6,
                "e6",
                affirmative=True,
                decided_at=AT,
                asked_at=AT,
            ),
            Decision("q0", "Go?", "", None, None, None, None, 4, "e4", expired_at=AT),
            Decision("q9", "Hm?", "no", Principal("cli:rod@laptop"), None, None, None, 7, "e7"),
        ),
        ended_because="the window closed",
        open_work=(
            OpenCard("t2", "blocked", 1, "transferred", 1, "target"),
            OpenCard("t3", "pending", 5, "open", 0),
        ),
        seq=12,
        rejections=(
            Rejection(8, "e8", "session.turn", "invalid", "agent-1", AT),
            Rejection(10, "e10", "session.question_answered", "stale", "ui", AT, Principal("x")),
        ),
        pauses={"permission": 2, "target_not_named": 1},
        skipped=1,
        downgrades=1,
        calls=(
            CallFact(3, "make", "ok: 3 files", True, True, "repo:1", "pass", "obs-1"),
            CallFact(4, "grep", "", False, False),
        ),
        executions=(
            ExecutionFact(5, "deploy", "ab" * 32, "svc:1", "exec-1"),
            ExecutionFact(6, "rm", "cd" * 32),
        ),
        observations=(
            Observation("obs-1", 7, True, ("repo:1",), ("test:a",), "ci"),
            Observation("obs-2", 8, False),
        ),
        event_ids=frozenset({"e1", str(uuid.uuid4())}),
        signed_ids=frozenset({"grant-1", str(uuid.uuid4())}),
    )


# -- state -------------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(event_sequences())
def test_any_folded_session_survives_the_stored_form_unchanged(events: list) -> None:
    state = fold(SID, events)
    assert _round_trip(state) == state


def test_the_stored_form_covers_every_field_of_session() -> None:
    stored = STORED_FIELDS
    assert len(stored) == len(set(stored))
    assert set(stored) | NOT_IN_STATE == {f.name for f in fields(Session)}
    assert not set(stored) & NOT_IN_STATE


def test_an_empty_session_is_a_version_byte_and_nothing_else() -> None:
    blob = session_to_blob(Session("s1"))
    assert blob == bytes([STATE_VERSION]) + b"[0]"
    assert _round_trip(Session("s1")) == Session("s1")


def test_a_session_with_every_field_set_survives_unchanged() -> None:
    s = _everything()
    again = _round_trip(s)
    assert again == s
    assert again.question is not None and again.question.asked_at == AT
    assert again.decisions[0].by == Principal("actor:member:42", verified=True)
    assert again.decisions[2].by == Principal("cli:rod@laptop", verified=False)
    assert again.todos[1].inherited_from == InheritedFrom("other", 3, "discovered")
    assert isinstance(again.pauses, dict) and again.pauses == s.pauses
    # Fields the decoder fills in from outside the blob.
    assert again.id == s.id and again.turns == s.turns and again.event_ids == s.event_ids


def test_the_state_of_an_idle_session_is_small() -> None:
    """started + plan + one todo: what the memory figure stores 100,000 times."""
    s = Session(
        "c008e91d-c765-5ed5-888a-322bec3eaf61",
        started=True,
        goal="goal of session 0: migrate module 0",
        plan="plan 0: read, change, test",
        plan_version=1,
        todos=(Todo("t1", "read the module", "pending", 1, None, None, "planned", 0, 1, 1),),
        seq=3,
    )
    blob = session_to_blob(s)
    assert blob.startswith(bytes([STATE_VERSION]) + b"[63,")  # the first six fields present
    assert len(blob) <= 126  # two 63-byte chunks in the state hash
    assert _round_trip(s) == s


def _old(n: int, result: str = "ok") -> Session:
    """A session holding `n` calls since its summary, a third of them naming one of 37 files."""
    calls = tuple(
        CallFact(
            i, "make", f"step {i}: {result}", True, False, f"file:m_{i % 37}.py" if i % 3 else None
        )
        for i in range(n)
    )
    return Session(
        "s1",
        started=True,
        seq=n,
        calls=calls,
        artifacts=latest_artifacts(calls),  # as the fold orders them
        tools={"make": n},
    )


def test_a_state_too_long_for_chunks_is_stored_deflated() -> None:
    s = _old(40)
    blob = session_to_blob(s)
    assert blob[:2] == bytes([STATE_VERSION, DEFLATED])
    plain = orjson.dumps(orjson.loads(zlib.decompress(blob[2:])))
    assert len(plain) >= STATE_INLINE and len(blob) < len(plain) // 3
    assert _round_trip(s) == s
    assert session_to_blob(s) == blob  # the same bytes every time: rebuilds match


def test_a_state_that_fits_in_chunks_is_never_deflated() -> None:
    s = _old(4)
    blob = session_to_blob(s)
    assert blob[:2] == bytes([STATE_VERSION]) + b"[" and len(blob) <= STATE_INLINE
    assert _round_trip(s) == s


def test_a_damaged_deflated_state_is_a_projection_error() -> None:
    blob = session_to_blob(_old(40))
    for damaged in (blob[:-3], blob[:2] + b"junk", blob[:10] + bytes([blob[10] ^ 1]) + blob[11:]):
        with pytest.raises(CorruptProjectionError, match="cannot be read"):
            session_from_blob(damaged, "s1", ())


def test_a_state_of_another_layout_is_refused_with_a_clear_error() -> None:
    with pytest.raises(CorruptProjectionError, match="layout 123"):
        session_from_blob(b'{"v":1,"id":"s1"}', "s1", ())
    with pytest.raises(CorruptProjectionError, match="layout 9"):
        session_from_blob(bytes([9]) + b"[0]", "s1", ())
    with pytest.raises(CorruptProjectionError, match="no state of layout"):
        session_from_blob(b"", "s1", ())


def test_a_damaged_state_is_a_projection_error() -> None:
    blob = session_to_blob(_everything())
    for damaged in (blob[:-5], bytes([STATE_VERSION]) + b"[3]", bytes([STATE_VERSION]) + b"{}"):
        with pytest.raises(CorruptProjectionError):
            session_from_blob(damaged, "s1", ())


# -- summaries ---------------------------------------------------------------------------------

_FACTS = "\n".join(
    f'{{"tool":"make","artifact":"file:src/m_{i % 37}.py","result":"step {i}: ok","seq":{i}}}'
    for i in range(200)
)


def test_a_long_summary_is_stored_deflated_and_reads_back() -> None:
    summary = "Goal: ship 🙂\n\nOperational facts:\n" + _FACTS
    stored = summary_to_stored(summary)
    assert stored[0] == DEFLATED and len(stored) < len(summary.encode()) // 4
    assert summary_from_stored(stored, "s1") == summary
    assert summary_to_stored(summary) == stored  # the same bytes every time: rebuilds match


@pytest.mark.parametrize(
    "summary",
    ["", "so far: 🙂", "x" * (DEFLATE_FROM - 1), "ÿ leading y-diaeresis", "\x00\x01"],
)
def test_a_short_summary_is_its_utf8_text(summary: str) -> None:
    assert summary_to_stored(summary) == summary.encode()
    assert summary_from_stored(summary.encode(), "s1") == summary


def test_a_summary_deflate_does_not_shrink_is_its_utf8_text() -> None:
    summary = base64.b85encode(random.Random(0).randbytes(100)).decode()  # 125 random characters
    assert summary_to_stored(summary) == summary.encode()


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=400))
def test_any_summary_round_trips(summary: str) -> None:
    assert summary_from_stored(summary_to_stored(summary), "s1") == summary


def test_a_damaged_summary_is_a_projection_error() -> None:
    stored = summary_to_stored("facts " * 100)
    for damaged in (stored[:-3], bytes([DEFLATED]) + b"junk", b"\xc3"):
        with pytest.raises(CorruptProjectionError, match="summary"):
            summary_from_stored(damaged, "s1")


# -- turns -------------------------------------------------------------------------------------


def test_turns_round_trip() -> None:
    t = Turn("assistant", "línea 1\nlínea 2 🙂", 7)
    assert turn_from_json(turn_to_json(t)) == t


# -- event ids ---------------------------------------------------------------------------------


def test_canonical_uuids_take_sixteen_bytes_each() -> None:
    ids = [str(uuid.uuid4()), str(uuid.uuid1()), str(uuid.uuid5(uuid.NAMESPACE_URL, "x"))]
    packed = pack_event_ids(ids)
    assert len(packed) == 48
    assert unpack_event_ids(packed) == ids


@pytest.mark.parametrize(
    "event_id",
    [
        "e1",
        "",
        "x" * 127,
        "x" * 128,
        "y" * 5000,
        "évènement-ñ-🙂",
        "00000000-0000-0000-0000-000000000000",  # the nil UUID: not RFC 4122, kept as text
        "6BA7B810-9DAD-11D1-80B4-00C04FD430C8",  # upper case: kept exactly as written
        "{6ba7b810-9dad-11d1-80b4-00c04fd430c8}",
        "6ba7b8109dad11d180b400c04fd430c8",
        "6ba7b810-9dad-11d1-c0b4-00c04fd430c8",  # variant bits 11: not RFC 4122
        "6ba7b810-9dad-11d1-80b4-00c04fd430cg",  # not hex
        "6ba7b810-9dad-11d1-80b4 00c04fd430c8",
        "6ba7b810 9dad-11d1-80b4-00c04fd430c8",
        "6ba7b81-09dad-11d1-80b4-00c04fd430c8",
        " 6ba7b810-9dad-11d1-80b4-00c04fd430c",
    ],
)
def test_any_other_id_is_kept_exactly(event_id: str) -> None:
    ids = [str(uuid.uuid4()), event_id, str(uuid.uuid4())]
    assert unpack_event_ids(pack_event_ids(ids)) == ids


def test_only_canonical_rfc4122_uuids_are_packed() -> None:
    canonical = "6ba7b810-9dad-11d1-80b4-00c04fd430c8"
    assert len(pack_event_ids([canonical])) == 16
    assert len(pack_event_ids([canonical.upper()])) == 37


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.text(max_size=200), st.uuids().map(str)), max_size=40))
def test_any_ids_round_trip_in_order(ids: list[str]) -> None:
    assert unpack_event_ids(pack_event_ids(ids)) == ids


def test_ids_packed_apart_and_concatenated_read_as_one_stream() -> None:
    a, b = ["e1", str(uuid.uuid4())], ["ü" * 200, str(uuid.uuid4()), "e3"]
    assert unpack_event_ids(pack_event_ids(a) + pack_event_ids(b)) == a + b


@pytest.mark.parametrize(
    "damaged",
    [
        pack_event_ids(["2f1c3b9e-8d4a-4c5e-9f6b-1a2b3c4d5e6f"])[:-1],
        pack_event_ids(["abc"])[:-1],
        pack_event_ids(["x" * 300])[:3],
        bytes([0xC1]),
        bytes([0x02, 0xFF, 0xFE]),
    ],
)
def test_damaged_ids_are_a_projection_error(damaged: bytes) -> None:
    with pytest.raises(CorruptProjectionError):
        unpack_event_ids(damaged)


# -- timeline entries --------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(event_sequences())
def test_every_timeline_entry_the_fold_makes_round_trips(events: list) -> None:
    state = Session(SID)
    for event in events:
        result = step(state, event)
        state = result.state
        for entry in translate(result):
            stored = entry_to_json(entry, SID)
            assert b"\n" not in stored
            # Every entry the timeline makes has a shape (else it is stored whole, and bigger):
            # a new field in session_model/timeline.py needs a new shape here.
            assert stored.startswith(b"["), entry
            assert entry_from_json(stored, SID) == _as_json(entry)


def test_an_announced_entry_is_stored_in_its_shape_and_round_trips() -> None:
    entry = {
        "session": SID,
        "kind": "announced",
        "seq": 7,
        "operation": "deploy",
        "arguments": '{"env":"prod"}',
    }
    stored = entry_to_json(entry, SID)
    assert stored.startswith(b"[")
    assert entry_from_json(stored, SID) == entry


def _card(**changes: object) -> dict[str, object]:
    card: dict[str, object] = {
        "id": "t1",
        "text": "read the module",
        "to": "pending",
        "from": None,
        "version": 1,
        "origin": "planned",
        "inherited_from": None,
    }
    return {"session": "s1", "kind": "card", "seq": 3, "card": {**card, **changes}}


def test_known_shapes_are_stored_as_short_arrays_without_the_session() -> None:
    stored = entry_to_json(_card(), "s1")
    # "from" (null for a new card) is stored after "origin", so that it is trimmed
    assert stored == b'[1,3,"t1","read the module",0,1,0]'
    assert entry_from_json(stored, "s1") == _card()
    plan = {
        "session": "s1",
        "kind": "plan",
        "seq": 2,
        "plan": {"text": "p", "version": 1, "supersedes": None},
    }
    assert entry_to_json(plan, "s1") == b'[0,2,"p",1]'
    assert entry_from_json(b'[0,2,"p",1]', "s1") == plan


@pytest.mark.parametrize(
    "entry",
    [
        _card(origin="custom-origin", to="in_progress", **{"from": "pending"}),
        _card(inherited_from={"session": "src", "version": 2, "origin": "planned"}),
        _card(text="línea 1\nlínea 2\u2028 🙂"),
        {
            "session": "s1",
            "kind": "activity",
            "seq": 4,
            "state": "thinking",
            "role": "user",
            "content": "multi\nline\r\n\u2028🙂",
        },
        {
            "session": "s1",
            "kind": "activity",
            "seq": 5,
            "state": "tool",
            "tool": "make",
            "ok": True,
            "mutating": False,
            "result": "",
        },
        {
            "session": "s1",
            "kind": "waiting",
            "seq": 6,
            "question": {
                "id": "q1",
                "question": "¿Sí?",
                "options": ["yes", "no"],
                "why": None,
                "reason": None,
                "expires_at": None,
            },
        },
        {
            "session": "s1",
            "kind": "answered",
            "seq": 7,
            "question_id": "q1",
            "answer": "yes",
            "by": {"id": "actor:member:42", "verified": True},
            "executor": None,
        },
        {
            "session": "s1",
            "kind": "open-work",
            "seq": 8,
            "todos": [
                {"id": "t1", "status": "blocked", "version": 2, "disposition": "open"},
            ],
        },
        {"session": "s1", "kind": "ended", "seq": 9, "because": None},
    ],
)
def test_entries_of_known_kinds_round_trip(entry: dict[str, object]) -> None:
    stored = entry_to_json(entry, "s1")
    assert b"\n" not in stored and stored.startswith(b"[")
    assert entry_from_json(stored, "s1") == _as_json(entry)


@pytest.mark.parametrize(
    "entry",
    [
        # a field the shapes do not know (a newer timeline): kept whole
        {**_card(), "extra": 1},
        # a nested dict with other keys
        {"session": "s1", "kind": "plan", "seq": 2, "plan": {"text": "p", "version": 1}},
        {"session": "s1", "kind": "plan", "seq": 2, "plan": None},
        # a vocabulary field holding a number would read back as a word
        _card(to=2),
        # a kind no shape knows
        {"session": "s1", "kind": "future-kind", "seq": 3, "anything": [1, {"a": None}]},
        # keys in another order
        {"kind": "ended", "session": "s1", "seq": 9, "because": "x"},
    ],
)
def test_entries_of_other_shapes_are_kept_as_objects(entry: dict[str, object]) -> None:
    stored = entry_to_json(entry, "s1")
    assert stored.startswith(b"{") and b'"session"' not in stored
    assert entry_from_json(stored, "s1") == _as_json(entry)


def test_an_entry_of_another_session_keeps_its_session() -> None:
    entry = _card()
    stored = entry_to_json(entry, "other")
    assert orjson.loads(stored)["session"] == "s1"
    assert entry_from_json(stored, "other") == entry


@pytest.mark.parametrize("damaged", [b"[99,1]", b"[1]", b"[1,3,1,2,3,4,5,6,7,8,9]", b"nope", b"3"])
def test_a_damaged_entry_is_a_projection_error(damaged: bytes) -> None:
    with pytest.raises(CorruptProjectionError):
        entry_from_json(damaged, "s1")


def test_stored_bytes_that_cannot_be_decoded_are_a_corrupt_projection_not_redis_away() -> None:
    # Readers retry a `ProjectionError` (Redis away) and skip a `CorruptProjectionError`: a read
    # again returns the same bytes. It is still a `ProjectionError` (one hierarchy).
    assert issubclass(CorruptProjectionError, ProjectionError)
    with pytest.raises(CorruptProjectionError, match="decisions"):
        decisions_from_json("s1", [b"nope"])
    with pytest.raises(CorruptProjectionError, match="history"):
        history_from_json("s1", 3, [[b"nope"]])
