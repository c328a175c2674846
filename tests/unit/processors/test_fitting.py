"""Decisions, question changes and dead letters too large for a produce request are cut."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from aiokafka.record.default_records import DefaultRecordBatchBuilder

from processors.fitting import KEPT_CHARS, KEPT_KEY_BYTES, MAX_RECORD_BYTES, fit, fit_dead_letter
from processors.ports import RawRecord
from processors.worker import ProjectionWorker
from producers.decisions import decision_record
from producers.questions import change_record
from schemas.codec import EventCodec
from session_model.intake import Refusal
from session_model.principal import Principal
from session_model.projection import BatchFolder
from session_model.questions import QuestionChange, QuestionStatus
from session_model.session import Decision

CODEC = EventCodec()
AT = datetime(2026, 1, 1, tzinfo=UTC)
BIG = 600_000  # characters: two such texts are more than a produce request holds


def _decision(question: str, why: str) -> Decision:
    return Decision(
        question_id="perm:deploy",
        question=question,
        answer="yes",
        by=Principal("operator:alice", verified=True),
        executor="console",
        reason="permission",
        why=why,
        seq=7,
        event_id="e7",
        decided_at=AT,
    )


def test_a_decision_that_fits_is_encoded_whole_and_not_cut() -> None:
    record = decision_record("s1", _decision("Deploy?", '{"env": "prod"}'))
    value, cut = fit(record, CODEC.encode_decision)
    assert not cut and value == CODEC.encode_decision(record)


def test_a_decision_too_large_for_a_request_is_cut_to_fit_its_ids_whole() -> None:
    record = decision_record("s1", _decision("q" * BIG, "w" * BIG))
    assert len(CODEC.encode_decision(record)) > MAX_RECORD_BYTES
    value, cut = fit(record, CODEC.encode_decision)
    assert cut and len(value) <= MAX_RECORD_BYTES
    read = CODEC.decode_decision(value)
    assert (read["session_id"], read["question_id"], read["event_id"]) == (
        "s1",
        "perm:deploy",
        "e7",
    )
    assert read["answer"] == "yes" and read["by"] == {"id": "operator:alice", "verified": True}
    assert read["question"].startswith("q" * KEPT_CHARS)
    assert f"cut: {BIG} characters in all" in read["question"] and "cut" in read["why"]


def test_a_question_change_too_large_is_cut_options_included() -> None:
    change = QuestionChange(
        session_id="s1",
        status=QuestionStatus.OPEN,
        question_id="q1",
        question="q" * BIG,
        options=tuple(f"option {i} " + "o" * 20_000 for i in range(100)),
        reason="style",
        why=None,
        expires_at=None,
        asked_at=AT,
        seq=3,
        mode="ask",
        goal="g" * BIG,
        event_id="e3",
        at=AT,
    )
    record = change_record(change)
    value, cut = fit(record, CODEC.encode_question_change)
    assert cut and len(value) <= MAX_RECORD_BYTES
    read = CODEC.decode_question_change(value)
    assert read["question_id"] == "q1" and read["event_id"] == "e3"
    assert len(read["options"]) == 64 and read["options"][0].startswith("option 0 ")


def test_a_refused_record_that_fits_is_dead_lettered_whole() -> None:
    value = b"x" * (MAX_RECORD_BYTES - 10)
    assert fit_dead_letter(b"k" * 10, value) == (b"k" * 10, value, "")
    assert fit_dead_letter(None, b"") == (None, b"", "")


def test_a_refused_record_near_the_broker_limit_is_cut_and_says_what_it_was() -> None:
    key, value = b"s-1", bytes(range(256)) * 4095  # 1,048,320 bytes: the broker took it
    kept_key, kept, cut = fit_dead_letter(key, value)
    assert kept_key == key
    assert len(kept_key) + len(kept) == MAX_RECORD_BYTES
    assert value.startswith(kept)
    assert cut == f"key:3,value:{len(value)}"


def test_a_huge_key_is_cut_too() -> None:
    key, value = b"k" * 900_000, b"v" * 200_000
    kept_key, kept, cut = fit_dead_letter(key, value)
    assert kept_key == b"k" * KEPT_KEY_BYTES
    assert kept == value  # the value fits beside the cut key
    assert cut == "key:900000,value:200000"


class _SizedSink:
    """A dead-letter sink that refuses what aiokafka's producer would (its default request size)."""

    def __init__(self) -> None:
        self.published: list[tuple[bytes | None, bytes, list[tuple[str, bytes]]]] = []

    async def publish(
        self, key: bytes | None, value: bytes, headers: Sequence[tuple[str, bytes]]
    ) -> None:
        size = DefaultRecordBatchBuilder.estimate_size_in_bytes(key, value, list(headers))
        if size > 1_048_576:
            raise AssertionError(f"{size} bytes: the producer would refuse this dead letter")
        self.published.append((key, value, list(headers)))

    async def publish_many(self, records: Sequence[Any]) -> None:
        for key, value, headers in records:
            await self.publish(key, value, headers)


def test_a_dead_letter_with_the_longest_reason_still_fits_a_produce_request() -> None:
    sink = _SizedSink()
    worker = ProjectionWorker(None, BatchFolder(), sink, _SizedSink())  # type: ignore[arg-type]
    raw = RawRecord(b"s-1", b"\x00" * 1_048_400, 0, 7, "sessions.events")
    detail = "\U0001f600" * 10_000  # 4 bytes a character in UTF-8
    asyncio.run(worker._dead_letter(raw, Refusal("key_mismatch", detail)))
    ((key, _, headers),) = sink.published
    assert key == b"s-1"
    found = dict(headers)
    assert len(found["milpa-error"]) <= 4096
    assert found["milpa-error"].decode().startswith("key_mismatch: \U0001f600")  # whole characters
    assert found["milpa-cut"] == b"key:3,value:1048400"
    assert found["milpa-source"] == b"sessions.events:0:7"
