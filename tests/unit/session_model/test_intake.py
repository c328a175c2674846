"""One admission rule for every reader of the events topic: decode, key, session id, partition."""

from __future__ import annotations

import os
from collections import Counter

import pytest
from kafka.partitioner.default import murmur2 as kafka_murmur2

from projections.keys import Keys
from projections.memory import InMemoryProjectionStore
from projections.projector import Projector
from projections.requests import commit_call
from schemas import codec as codec_module
from schemas.codec import EventCodec
from session_model import intake
from session_model.canonical import argument_digest
from session_model.fold import Kind
from session_model.intake import Intake, Refusal
from session_model.partitioning import murmur2, partition_for
from session_model.projection import (
    BatchFolder,
    Folded,
    Position,
    Record,
    foreign_records,
    redelivered_decisions,
)
from tests.unit.builders import answer, ask, started, tool, turn

CODEC = EventCodec()


@pytest.mark.parametrize("length", range(21))
def test_murmur2_is_kafkas(length: int) -> None:
    for _ in range(20):
        data = os.urandom(length)
        assert murmur2(data) == kafka_murmur2(data) & 0xFFFFFFFF


def test_partition_for_follows_the_default_partitioner() -> None:
    for sid in ("s1", "migrate-inventory", "ñandú", "x" * 100):
        expected = (kafka_murmur2(sid.encode()) & 0x7FFFFFFF) % 6
        assert partition_for(sid, 6) == expected


def _home(sid: str, partitions: int = 6) -> int:
    return partition_for(sid, partitions)


def test_a_valid_record_in_its_partition_is_admitted() -> None:
    event = turn("user", "hi", session_id="s1")
    admitted = Intake(CODEC, 6).admit(b"s1", CODEC.encode(event), _home("s1"), 41)
    assert admitted == Record(event, Position(_home("s1"), 41))


@pytest.mark.parametrize(
    ("key", "value", "code"),
    [
        (b"s1", None, intake.NO_VALUE),
        (b"s1", b"\x00\xffnot avro", intake.UNDECODABLE),
        (b"s2", "encoded", intake.KEY_MISMATCH),
        (None, "encoded", intake.KEY_MISMATCH),
    ],
)
def test_refusals_have_stable_codes(key: bytes | None, value: object, code: str) -> None:
    raw = CODEC.encode(turn("user", "hi", session_id="s1")) if value == "encoded" else value
    refusal = Intake(CODEC, 6).admit(key, raw, _home("s1"), 0)  # type: ignore[arg-type]
    assert isinstance(refusal, Refusal)
    assert refusal.code == code
    assert refusal.reason.startswith(f"{code}: ")


def test_an_empty_session_id_is_refused() -> None:
    value = CODEC.encode(turn("user", "hi", session_id=""))
    refusal = Intake(CODEC, None).admit(b"", value, 0, 0)
    assert isinstance(refusal, Refusal) and refusal.code == intake.NO_SESSION_ID


@pytest.mark.parametrize("sid", ["\x00checkpoint:3", "two\nlines", "tab\there", "del\x7f"])
def test_a_session_id_with_a_control_character_is_refused(sid: str) -> None:
    value = CODEC.encode(turn("user", "hi", session_id=sid))
    refusal = Intake(CODEC, None).admit(sid.encode(), value, 0, 0)
    assert isinstance(refusal, Refusal) and refusal.code == intake.BAD_SESSION_ID
    assert repr(sid[:64]) in refusal.detail


def test_a_session_id_of_any_printable_text_is_admitted() -> None:
    sid = "ß-会话 with spaces/and:colons{}"
    value = CODEC.encode(turn("user", "hi", session_id=sid))
    assert isinstance(Intake(CODEC, None).admit(sid.encode(), value, 0, 0), Record)


def test_a_record_outside_its_keys_partition_is_refused_only_when_the_count_is_known() -> None:
    value = CODEC.encode(turn("user", "hi", session_id="s1"))
    elsewhere = (_home("s1") + 1) % 6
    refusal = Intake(CODEC, 6).admit(b"s1", value, elsewhere, 3)
    assert isinstance(refusal, Refusal) and refusal.code == intake.WRONG_PARTITION
    assert str(_home("s1")) in refusal.detail
    assert isinstance(Intake(CODEC, None).admit(b"s1", value, elsewhere, 3), Record)


def test_the_fold_never_compares_a_mark_with_another_partitions_position() -> None:
    # s1 is projected from partition 2 up to offset 10; a record of partition 5 at offset 99 (or
    # at offset 3, which compared across partitions looked "already applied") is never folded.
    records = [Record(e, Position(2, i)) for i, e in enumerate([started(), turn("user", "a")])]
    (base,) = BatchFolder().fold({}, records)
    known = {"s1": Folded(base.state, base.mark)}
    strays = [Record(turn("user", "x"), Position(5, 99)), Record(turn("user", "y"), Position(1, 0))]
    own = Record(turn("user", "b"), Position(2, 2))
    (update,) = BatchFolder().fold(known, [strays[0], own, strays[1]])
    assert update.mark == Position(2, 2)
    assert [s.event.event_id for s in update.steps] == [own.event.event_id]
    assert foreign_records(known, [strays[0], own, strays[1]]) == tuple(strays)


def test_a_new_sessions_partition_is_its_first_records() -> None:
    first = Record(started(), Position(3, 0))
    stray = Record(turn("user", "x"), Position(4, 0))
    own = Record(turn("user", "y"), Position(3, 1))
    (update,) = BatchFolder().fold({}, [first, stray, own])
    assert update.mark == Position(3, 1) and len(update.steps) == 2
    assert foreign_records({}, [first, stray, own]) == (stray,)


def test_redelivered_decisions_ignore_other_partitions() -> None:
    records = [
        Record(e, Position(1, i)) for i, e in enumerate([started(), ask("q1"), answer("q1")])
    ]
    (update,) = BatchFolder().fold({}, records)
    known = {"s1": Folded(update.state, update.mark)}
    assert len(redelivered_decisions(known, records)) == 1
    moved = [Record(r.event, Position(0, r.position.offset)) for r in records]
    assert redelivered_decisions(known, moved) == ()


def test_the_projector_counts_foreign_records_and_never_applies_them() -> None:
    store = InMemoryProjectionStore()
    projector = Projector(store, BatchFolder())
    projector.project([Record(started(), Position(0, 0))])
    stray = Record(turn("user", "stray"), Position(1, 5))
    own = Record(turn("user", "own"), Position(0, 1))
    projector.project([stray, own])
    assert projector.refused == Counter({intake.WRONG_PARTITION: 1})
    folded = store.folded(["s1"])["s1"]
    assert folded.mark == Position(0, 1)
    assert folded.state.seq == 2  # started + the own turn, not the stray


def _tool_call_with_arguments_text(monkeypatch: pytest.MonkeyPatch, text: str) -> bytes:
    """A `tool_called` record whose arguments are `text` on the wire (a writer of its own)."""
    with monkeypatch.context() as patched:
        patched.setattr(codec_module, "canonical_json", lambda _: text)
        return CODEC.encode(tool("make", arguments={"x": 1}, session_id="s1"))


def test_arguments_nested_deeper_than_python_recurses_are_refused_not_raised(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    deep = '{"a":' * 5000 + "1" + "}" * 5000  # orjson refuses it; json.loads recurses too deep
    raw = _tool_call_with_arguments_text(monkeypatch, deep)
    admitted = Intake(CODEC, 6).admit(b"s1", raw, _home("s1"), 7)
    assert isinstance(admitted, Refusal)
    assert admitted.code == intake.UNDECODABLE and "arguments are not JSON" in admitted.detail


def test_whatever_decoding_raises_is_a_refusal(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(data: bytes) -> None:
        raise MemoryError("a decoder bug")

    codec = EventCodec()
    monkeypatch.setattr(codec, "decode", broken)
    admitted = Intake(codec, 6).admit(b"s1", b"anything", _home("s1"), 7)
    assert admitted == Refusal(intake.DECODER_FAILED, "MemoryError while decoding: a decoder bug")


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ('{"a":"\\udc80"}', "arguments are not JSON"),  # a lone surrogate: no UTF-8
        ('{"a":' * 200 + "1" + "}" * 200, "nest deeper than 128"),  # orjson reads it
        ('{"a":' * 128 + "[" * 5 + "]" * 5 + "}" * 128, "nest deeper than 128"),
    ],
)
def test_arguments_the_projection_could_not_write_back_are_refused(
    monkeypatch: pytest.MonkeyPatch, text: str, why: str
) -> None:
    raw = _tool_call_with_arguments_text(monkeypatch, text)
    admitted = Intake(CODEC, 6).admit(b"s1", raw, _home("s1"), 7)
    assert isinstance(admitted, Refusal)
    assert admitted.code == intake.UNDECODABLE and why in admitted.detail


def test_arguments_as_deep_as_allowed_are_folded_and_written(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    many = ",".join(["[]"] * 300)  # more brackets than levels: the depth itself is measured
    text = '{"a":' * 125 + '{"b":[' + many + "]}" + "}" * 125  # 125 + 1 + 1 + 1 = 128 levels
    raw = _tool_call_with_arguments_text(monkeypatch, text)
    admitted = Intake(CODEC, 6).admit(b"s1", raw, _home("s1"), 7)
    assert isinstance(admitted, Record)
    begun = Record(started(session_id="s1"), Position(_home("s1"), 6))
    (update,) = BatchFolder().fold({}, [begun, admitted])
    assert [s.outcome.kind for s in update.steps] == [Kind.APPLIED, Kind.APPLIED]
    commit_call(Keys("t", partitions=6), update, None)  # its Redis arguments made
    assert argument_digest(admitted.event.payload["arguments"])
