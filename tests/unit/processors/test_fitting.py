"""Decisions, question changes and dead letters too large for a produce request are cut."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from aiokafka.record.default_records import DefaultRecordBatchBuilder
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from processors.fitting import (
    FLOOR_CHARS,
    IDS,
    KEPT_CHARS,
    KEPT_KEY_BYTES,
    KEPT_OPTIONS,
    MAX_RECORD_BYTES,
    fit,
    fit_dead_letter,
    fit_key,
)
from processors.ports import RawRecord
from processors.worker import ProjectionWorker
from producers.decisions import decision_record
from producers.questions import change_record
from schemas.codec import EventCodec
from session_model.cutting import cut_text
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
    asyncio.run(worker._dead_letter([(raw, Refusal("key_mismatch", detail))]))
    ((key, _, headers),) = sink.published
    assert key == b"s-1"
    found = dict(headers)
    assert len(found["milpa-error"]) <= 4096
    assert found["milpa-error"].decode().startswith("key_mismatch: \U0001f600")  # whole characters
    assert found["milpa-cut"] == b"key:3,value:1048400"
    assert found["milpa-source"] == b"sessions.events:0:7"


# What aiokafka's producer refuses (MessageSizeTooLargeError): more than its max_request_size.
REQUEST_BYTES = 1_048_576
HALF = 600_000  # characters: one such string fits an event, two do not fit one record
_MARKER = re.compile(r" \[…cut: (\d+) characters in all, whole in the session's history\]$")


class _RequestSink:
    """A decisions or questions sink that refuses what aiokafka's producer would."""

    def __init__(self) -> None:
        self.published: list[tuple[bytes | None, bytes]] = []

    async def publish_many(self, records: Sequence[Any]) -> None:
        for key, value, headers in records:
            size = DefaultRecordBatchBuilder.estimate_size_in_bytes(key, value, list(headers))
            if size > REQUEST_BYTES:
                raise AssertionError(f"{size} bytes: the producer would refuse this record")
            self.published.append((key, value))


def _answered(
    *, reason: str = "permission", executor: str = "console", by: str = "operator:alice"
) -> Decision:
    return Decision(
        question_id="perm:deploy",
        question="Deploy?",
        answer="yes",
        by=Principal(by),
        executor=executor,
        reason=reason,
        why=None,
        seq=9,
        event_id="e9",
        decided_at=AT,
    )


def test_a_decision_whose_reason_and_executor_are_huge_is_published() -> None:
    """The reviewer's poison pill: each event fits the broker, the decision (1.2 MB) did not."""
    sink = _RequestSink()
    worker = ProjectionWorker(None, BatchFolder(), _RequestSink(), sink)  # type: ignore[arg-type]
    decision = _answered(reason="r" * HALF, executor="x" * HALF)
    sent = worker._decisions_out((), [("s1", decision)])  # as after a redelivery
    assert sent is not None
    asyncio.run(sent)
    ((key, value),) = sink.published
    assert key == b"s1" and worker.stats.records_cut == 1
    read = CODEC.decode_decision(value)
    assert (read["session_id"], read["question_id"], read["event_id"], read["seq"]) == (
        "s1",
        "perm:deploy",
        "e9",
        9,
    )
    assert read["answer"] == "yes" and read["by"]["id"] == "operator:alice"
    assert read["reason"].startswith("r" * KEPT_CHARS) and f"cut: {HALF} " in read["reason"]
    assert read["executor"].startswith("x" * KEPT_CHARS) and f"cut: {HALF} " in read["executor"]


def test_an_answered_question_change_with_a_huge_reason_and_principal_is_published() -> None:
    sink = _RequestSink()
    worker = ProjectionWorker(  # type: ignore[arg-type]
        None, BatchFolder(), _RequestSink(), _RequestSink(), questions=sink
    )
    change = QuestionChange(
        session_id="s1",
        status=QuestionStatus.ANSWERED,
        question_id="q1",
        question="Deploy?",
        options=("yes", "no"),
        reason="r" * HALF,
        why=None,
        expires_at=None,
        asked_at=AT,
        seq=3,
        mode="ask",
        goal="ship it",
        event_id="e4",
        at=AT,
        answer="yes",
        by=Principal("p" * HALF),
    )
    sent = worker._questions_out((), [change])
    assert sent is not None
    asyncio.run(sent)
    ((key, value),) = sink.published
    read = CODEC.decode_question_change(value)
    assert key == b"s1" and (read["status"], read["seq"], read["event_id"]) == ("answered", 3, "e4")
    assert read["by"]["id"] == "p" * HALF  # an id: whole, the reason made room
    assert read["reason"] == cut_text("r" * HALF, KEPT_CHARS)


def test_a_long_session_id_is_cut_in_the_key() -> None:
    """Key and value both hold the session id: the key is cut, the value fits whole."""
    sink = _RequestSink()
    worker = ProjectionWorker(None, BatchFolder(), _RequestSink(), sink)  # type: ignore[arg-type]
    sid = "s" * 450_000
    decision = _answered(reason="r" * 150_000)
    sent = worker._decisions_out((), [(sid, decision)])
    assert sent is not None
    asyncio.run(sent)
    ((key, value),) = sink.published
    assert key == fit_key(sid) == sid.encode()[:KEPT_KEY_BYTES]
    assert CODEC.decode_decision(value) == decision_record(sid, decision)
    assert fit_key("s1") == b"s1" and worker.stats.records_cut == 0


def test_ids_are_cut_last_and_always_alike() -> None:
    """Ids no writer makes, that even texts at their floor leave no room for."""
    sid, principal = "s" * 700_000, "p" * 700_000
    record = decision_record(sid, _answered(reason="r" * 1_000, by=principal))
    value, cut = fit(record, CODEC.encode_decision)
    read = CODEC.decode_decision(value)
    assert cut and len(value) <= MAX_RECORD_BYTES
    assert read["session_id"] == cut_text(sid, KEPT_CHARS)
    assert read["by"]["id"] == cut_text(principal, KEPT_CHARS)
    assert read["reason"] == cut_text("r" * 1_000, FLOOR_CHARS)
    assert read["question_id"] == "perm:deploy" and read["event_id"] == "e9"
    assert read["executor"] == "console"


def _kept(text: str, whole: str) -> int | None:
    """How many characters of `whole` a published string kept (None: all, not cut)."""
    if text == whole:
        return None
    marker = _MARKER.search(text)
    assert marker is not None and int(marker.group(1)) == len(whole), text[-200:]
    kept = text[: marker.start()]
    assert whole.startswith(kept) and len(kept) < len(whole)
    return len(kept)


def _strings(record: Mapping[str, Any]) -> dict[str, str]:
    """Every string of a record by a path (`by.id`, `options.3`)."""
    found: dict[str, str] = {}
    for name, value in record.items():
        if isinstance(value, str):
            found[name] = value
        elif isinstance(value, list):
            found.update({f"{name}.{i}": v for i, v in enumerate(value)})
        elif isinstance(value, dict):
            found.update({f"{name}.{k}": v for k, v in value.items() if isinstance(v, str)})
    return found


def _check_fitted(record: dict[str, Any], value: bytes, cut: bool, read: dict[str, Any]) -> None:
    """What `fit` promises of any record (see the module's docstring)."""
    assert len(value) <= MAX_RECORD_BYTES
    whole = CODEC.encode_decision if "decided_at" in record else CODEC.encode_question_change
    assert cut == (len(whole(record)) > MAX_RECORD_BYTES)
    for name, whole_value in record.items():
        if not isinstance(whole_value, str | dict | list):
            assert read[name] == whole_value, name  # seqs, times: whole
    if record.get("by") is not None:
        assert read["by"]["verified"] == record["by"]["verified"]
    if "options" in record:
        options = record["options"]
        assert len(read["options"]) == len(options[:KEPT_OPTIONS] if cut else options)
    before, after = _strings(record), _strings(read)
    kept = {path: _kept(after[path], before[path]) for path in after}
    assert kept.get("status") is None and kept.get("mode") is None
    texts = {p: k for p, k in kept.items() if p.split(".")[0] not in IDS}
    ids = {p: k for p, k in kept.items() if p.split(".")[0] in IDS}
    if any(k is not None for k in ids.values()):  # ids are cut only once the texts are at least
        assert all(k is None or k == FLOOR_CHARS for k in texts.values())
        assert all(k is None or k == KEPT_CHARS for k in ids.values())
    cap = {k for k in texts.values() if k is not None}
    assert len(cap) <= 1  # fair: every text that was cut kept the same number of characters
    if cap:
        (c,) = cap
        assert FLOOR_CHARS <= c <= KEPT_CHARS
        for path, k in texts.items():  # and those kept whole were no longer than that
            assert k is not None or len(before[path]) <= c, path


_SIZES = st.one_of(st.integers(0, 40), st.integers(0, 700_000), st.sampled_from([300_000, 600_000]))
# Characters of 1 to 4 bytes in UTF-8.
_CHARS = st.sampled_from(["a", "é", "€", "\U0001f600"])
_DECISION_STRINGS = (
    "session_id",
    "question_id",
    "question",
    "reason",
    "why",
    "answer",
    "by",
    "executor",
    "event_id",
)
_CHANGE_STRINGS = (*_DECISION_STRINGS[:6], "goal", "by", "expires_at", "event_id")
_SLOW = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))


@_SLOW
@given(
    sizes=st.fixed_dictionaries(dict.fromkeys(_DECISION_STRINGS, _SIZES)),
    char=_CHARS,
    expired=st.booleans(),
)
def test_any_decision_fits_a_produce_request_cut_fairly(
    sizes: dict[str, int], char: str, expired: bool
) -> None:
    text = {name: f"{name}:" + char * n for name, n in sizes.items()}
    decision = Decision(
        question_id=text["question_id"],
        question=text["question"],
        answer="" if expired else text["answer"],
        by=None if expired else Principal(text["by"]),
        executor=None if expired else text["executor"],
        reason=text["reason"],
        why=text["why"],
        seq=12,
        event_id=text["event_id"],
        decided_at=None if expired else AT,
        expired_at=AT if expired else None,
    )
    record = decision_record(text["session_id"], decision)
    value, cut = fit(record, CODEC.encode_decision)
    _check_fitted(record, value, cut, CODEC.decode_decision(value))


@_SLOW
@given(
    sizes=st.fixed_dictionaries(dict.fromkeys(_CHANGE_STRINGS, _SIZES)),
    options=st.lists(_SIZES, max_size=80),
    status=st.sampled_from(list(QuestionStatus)),
    char=_CHARS,
)
def test_any_question_change_fits_a_produce_request_cut_fairly(
    sizes: dict[str, int], options: list[int], status: QuestionStatus, char: str
) -> None:
    text = {name: f"{name}:" + char * n for name, n in sizes.items()}
    answered = status is QuestionStatus.ANSWERED
    change = QuestionChange(
        session_id=text["session_id"],
        status=status,
        question_id=text["question_id"],
        question=text["question"],
        options=tuple(f"{i}:" + char * n for i, n in enumerate(options)),
        reason=text["reason"],
        why=text["why"],
        expires_at=text["expires_at"],
        asked_at=AT,
        seq=3,
        mode="acknowledge",
        goal=text["goal"],
        event_id=text["event_id"],
        at=AT,
        answer=text["answer"] if answered else None,
        by=Principal(text["by"]) if answered else None,
    )
    record = change_record(change)
    value, cut = fit(record, CODEC.encode_question_change)
    read = CODEC.decode_question_change(value)
    assert (read["status"], read["mode"]) == (status.value, "acknowledge")
    _check_fitted(record, value, cut, read)
