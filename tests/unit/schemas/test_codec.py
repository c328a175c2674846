"""The wire format: Avro single-object encoding of events and decisions, and schema evolution."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import math
import struct
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime, timedelta, timezone
from importlib.resources import files
from pathlib import Path
from types import MappingProxyType
from typing import Any

import fastavro
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import events
from schemas.codec import (
    DECISION_SCHEMA,
    ENVELOPE_SCHEMA,
    HEADER_SIZE,
    MARKER,
    PAYLOAD_SCHEMAS,
    EventCodec,
    SchemaRegistry,
    canonical_json,
    payload_schema_name,
    schema_fingerprint,
)
from schemas.errors import CodecError, CorruptRecordError, EncodeError, UnknownFingerprintError
from schemas.events import EVENT_TYPES, Event, utc_millis

SCHEMAS_DIR = Path(str(files("schemas")))
FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
GOLDEN = FIXTURES / "golden"
EVOLUTION = FIXTURES / "evolution"

CODEC = EventCodec()
T0 = datetime(2025, 6, 1, 9, 30, 0, 250_000, tzinfo=UTC)


def make_event(event_type: str, payload: Mapping[str, Any], **envelope: Any) -> Event:
    fields: dict[str, Any] = {
        "event_id": "6c1f0d2e-4b7a-4e39-9a52-0b8f1c2d3e4f",
        "session_id": "sess-1",
        "type": event_type,
        "occurred_at": T0,
        "producer": "agent:test",
        "payload": payload,
        "expected_seq": None,
    }
    fields.update(envelope)
    return Event(**fields)


# -- the spec, restated independently of the .avsc files ------------------------------------------

# Optional fields and their documented defaults, per event type (what decoding fills in when the
# writer left them out). A field missing here but optional in the schema fails the default tests.
DEFAULTS: dict[str, dict[str, Any]] = {
    events.STARTED: {"mode": "ask", "parent_id": None, "authority": None},
    events.TURN: {},
    events.TOOL_CALLED: {
        "arguments": {},
        "result": "",
        "ok": True,
        "mutating": False,
        "artifact": None,
        "verdict": None,
        "effect_observation_id": None,
    },
    events.MESSAGE_SENT: {},
    events.PLAN_SET: {},
    events.TODO_CHANGED: {"replaces": None, "inherited_from": None},
    events.QUESTION_ASKED: {"options": [], "why": None, "expires_at": None, "reason": None},
    events.QUESTION_ANSWERED: {
        "by": None,
        "executor": None,
        "signature": None,
        "approval": None,
        "asked_seq": None,
    },
    events.ANSWER_WINDOW_CLOSED: {"asked_seq": None},
    events.PERMISSION_GRANTED: {"authority": None},
    events.PERMISSION_REVOKED: {},
    events.MODE_CHANGED: {"authority": None},
    events.OPTION_REMOVED: {},
    events.PREREQUISITE_SET: {},
    events.COMPACTED: {},
    events.TODOS_TRANSFERRED: {},
    events.EFFECT_OBSERVED: {"artifacts": [], "evidence": [], "observer": None},
    events.EXECUTION_RECORDED: {"artifact": None, "executor": None},
    events.ENDED: {},
}

# One payload per type with every field (optional ones included) set to a non-default value.
FULL: dict[str, dict[str, Any]] = {
    events.STARTED: {
        "goal": "ship it",
        "mode": "auto",
        "parent_id": "sess-parent",
        "authority": {"key_id": "ops", "signature": b"\x01" * 64},
    },
    events.TURN: {"role": "user", "content": "hola, ¿qué tal? 🌽"},
    events.TOOL_CALLED: {
        "tool": "shell",
        "arguments": {"cmd": ["make", "test"], "env": {"CI": "1", "N": 2.5}, "dry": None},
        "result": "ok: 12 passed",
        "ok": False,
        "mutating": True,
        "artifact": "repo:/work",
        "verdict": "inconclusive",
        "effect_observation_id": "evt-obs-1",
    },
    events.MESSAGE_SENT: {"from": "sess-2", "content": "done with the schema"},
    events.PLAN_SET: {"plan": "1. read\n2. write"},
    events.TODO_CHANGED: {
        "id": "t1",
        "text": "write the codec",
        "status": "blocked",
        "replaces": "t0",
        "inherited_from": {"session": "sess-0", "version": 4, "origin": "discovered"},
    },
    events.QUESTION_ASKED: {
        "question_id": "perm:deploy",
        "question": "Allow «deploy»?",
        "options": ["yes", "no"],
        "why": '{"env":"prod"}',
        "expires_at": "not a date",
        "reason": "permission",
    },
    events.QUESTION_ANSWERED: {
        "question_id": "perm:deploy",
        "answer": "yes",
        "by": {"id": "actor:member:42", "verified": True},
        "executor": "worker-1",
        "signature": {"key_id": "k1", "signature": b"\x00\xff" * 32},
        "approval": {
            "operation": "deploy",
            "argument_digest": "ab" * 32,
            "key_id": "k2",
            "signature": b"\x02" * 64,
        },
        "asked_seq": 2**40,
    },
    events.ANSWER_WINDOW_CLOSED: {
        "question_id": "perm:deploy",
        "at": T0 + timedelta(minutes=5),
        "asked_seq": 2**40,
    },
    events.PERMISSION_GRANTED: {
        "operation": "deploy",
        "authority": {"key_id": "ops", "signature": b"\x03" * 64},
    },
    events.PERMISSION_REVOKED: {"operation": "deploy"},
    events.MODE_CHANGED: {
        "mode": "acknowledge",
        "authority": {"key_id": "ops", "signature": b"\x04" * 64},
    },
    events.OPTION_REMOVED: {"option": "rm -rf", "reason": {"code": "unsafe", "message": "no"}},
    events.PREREQUISITE_SET: {"tools": ["plan", "lint"]},
    events.COMPACTED: {"summary": "Goal: ship it.", "through": 2**40},
    events.TODOS_TRANSFERRED: {"to": "sess-3", "todos": [{"id": "t1", "version": 2}]},
    events.EFFECT_OBSERVED: {
        "known": True,
        "artifacts": ["file:a.py"],
        "evidence": ["test:t1"],
        "observer": "obs",
    },
    events.EXECUTION_RECORDED: {
        "operation": "deploy",
        "argument_digest": "ab" * 32,
        "artifact": "service:x",
        "executor": "worker-1",
    },
    events.ENDED: {"because": "the goal is met"},
}


def minimal(event_type: str) -> dict[str, Any]:
    """FULL without its optional fields."""
    return {k: v for k, v in FULL[event_type].items() if k not in DEFAULTS[event_type]}


def test_every_event_type_has_a_payload_schema() -> None:
    registry = SchemaRegistry.default()
    assert set(PAYLOAD_SCHEMAS) == set(EVENT_TYPES)
    for event_type in EVENT_TYPES:
        assert payload_schema_name(event_type) in registry.reader_names


def test_every_payload_schema_file_belongs_to_an_event_type() -> None:
    payload_files = {p.stem for p in SCHEMAS_DIR.glob("milpa.sessions.payload.*.avsc")}
    assert payload_files == set(PAYLOAD_SCHEMAS.values())


def test_these_tests_have_examples_for_every_event_type() -> None:
    assert set(FULL) == set(DEFAULTS) == set(PAYLOAD_STRATEGIES) == set(EVENT_TYPES)


def test_unknown_event_type_has_no_payload_schema() -> None:
    with pytest.raises(CodecError, match=r"session\.nope"):
        payload_schema_name("session.nope")
    assert EventCodec.payload_schema_name(events.TURN) == "milpa.sessions.payload.Turn"


def _walk_schema(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, list):
        for item in node:
            yield from _walk_schema(item)
    elif isinstance(node, dict):
        yield node
        for field in node.get("fields", []):
            yield field
            yield from _walk_schema(field["type"])
        for key in ("items", "values"):
            if key in node:
                yield from _walk_schema(node[key])


@pytest.mark.parametrize("path", sorted(SCHEMAS_DIR.glob("*.avsc")), ids=lambda p: p.stem)
def test_every_record_and_field_has_a_doc_and_no_enum_is_used(path: Path) -> None:
    schema = json.loads(path.read_text("utf-8"))
    assert f"{schema['namespace']}.{schema['name']}" == path.stem
    for node in _walk_schema(schema):
        if node.get("type") == "record" or "name" in node:
            assert node.get("doc"), f"{path.stem}: {node.get('name')} has no doc"
        # modes, roles, statuses... stay plain strings: an unknown symbol would be undecodable
        assert node.get("type") != "enum"


# -- round trips -----------------------------------------------------------------------------------


def expected_payload(event_type: str, payload: Mapping[str, Any]) -> dict[str, Any]:
    """What decoding an encoded `payload` must give: defaults filled, instants in UTC millis."""
    result = {**DEFAULTS[event_type], **payload}
    if event_type == events.ANSWER_WINDOW_CLOSED:
        result["at"] = utc_millis(result["at"])
    return result


@pytest.mark.parametrize("event_type", EVENT_TYPES)
def test_event_with_every_optional_field_set_round_trips(event_type: str) -> None:
    event = make_event(event_type, FULL[event_type], expected_seq=41)
    decoded = CODEC.decode(CODEC.encode(event))
    assert decoded == event
    assert decoded.payload_readable
    assert set(decoded.payload) == set(FULL[event_type])


@pytest.mark.parametrize("event_type", EVENT_TYPES)
def test_event_without_optional_fields_decodes_with_their_defaults(event_type: str) -> None:
    decoded = CODEC.decode(CODEC.encode(make_event(event_type, minimal(event_type))))
    assert decoded.payload == expected_payload(event_type, minimal(event_type))


def test_nested_optional_fields_take_their_defaults() -> None:
    answered = {"question_id": "q", "answer": "yes", "by": {"id": "cli:rod@laptop"}}
    removed = {"option": "x", "reason": {"code": "c"}}
    assert CODEC.decode(CODEC.encode(make_event(events.QUESTION_ANSWERED, answered))).payload[
        "by"
    ] == {"id": "cli:rod@laptop", "verified": False}
    assert CODEC.decode(CODEC.encode(make_event(events.OPTION_REMOVED, removed))).payload[
        "reason"
    ] == {"code": "c", "message": None}


def test_occurred_at_comes_back_as_utc_truncated_to_milliseconds() -> None:
    plus_five = timezone(timedelta(hours=5, minutes=30))
    moment = datetime(2025, 1, 2, 3, 4, 5, 678_999, tzinfo=plus_five)
    decoded = CODEC.decode(
        CODEC.encode(make_event(events.TURN, FULL[events.TURN], occurred_at=moment))
    )
    assert decoded.occurred_at == datetime(2025, 1, 1, 21, 34, 5, 678_000, tzinfo=UTC)
    assert decoded.occurred_at.utcoffset() == timedelta(0)


def test_tool_arguments_travel_as_canonical_json() -> None:
    arguments = {"b": [1, 2.5, None, True], "a": {"ñ": "é"}}
    data = CODEC.encode(make_event(events.TOOL_CALLED, {"tool": "t", "arguments": arguments}))
    assert b'{"a":{"\xc3\xb1":"\xc3\xa9"},"b":[1,2.5,null,true]}' in data
    assert canonical_json(arguments) == '{"a":{"ñ":"é"},"b":[1,2.5,null,true]}'


def test_mappings_that_are_not_dicts_are_accepted() -> None:
    payload = MappingProxyType({"role": "user", "content": "hi"})
    assert CODEC.decode(CODEC.encode(make_event(events.TURN, payload))).payload == dict(payload)


# -- property: every type round-trips generated payloads ------------------------------------------

TEXT = st.text(max_size=30)
OPT_TEXT = st.none() | TEXT
LONGS = st.integers(-(2**63), 2**63 - 1)
INTS = st.integers(-(2**31), 2**31 - 1)
OFFSETS = st.integers(-23 * 60, 23 * 60).map(lambda m: timezone(timedelta(minutes=m)))
INSTANTS = st.datetimes(
    min_value=datetime(1900, 1, 2), max_value=datetime(2200, 1, 1), timezones=OFFSETS
)
JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)
PRINCIPALS = st.fixed_dictionaries({"id": TEXT, "verified": st.booleans()})


def _payload(required: dict[str, Any], optional: dict[str, Any] | None = None) -> Any:
    return st.fixed_dictionaries(required, optional=optional or {})


OPT_SIGNATURE = st.none() | st.fixed_dictionaries(
    {"key_id": TEXT, "signature": st.binary(max_size=64)}
)

PAYLOAD_STRATEGIES: dict[str, Any] = {
    events.STARTED: _payload(
        {"goal": TEXT}, {"mode": TEXT, "parent_id": OPT_TEXT, "authority": OPT_SIGNATURE}
    ),
    events.TURN: _payload({"role": TEXT, "content": TEXT}),
    events.TOOL_CALLED: _payload(
        {"tool": TEXT},
        {
            "arguments": st.dictionaries(TEXT, JSON_VALUES, max_size=5),
            "result": TEXT,
            "ok": st.booleans(),
            "mutating": st.booleans(),
            "artifact": OPT_TEXT,
            "verdict": OPT_TEXT,
            "effect_observation_id": OPT_TEXT,
        },
    ),
    events.MESSAGE_SENT: _payload({"from": TEXT, "content": TEXT}),
    events.PLAN_SET: _payload({"plan": TEXT}),
    events.TODO_CHANGED: _payload(
        {"id": TEXT, "text": TEXT, "status": TEXT},
        {
            "replaces": OPT_TEXT,
            "inherited_from": st.none()
            | st.fixed_dictionaries({"session": TEXT, "version": INTS, "origin": TEXT}),
        },
    ),
    events.QUESTION_ASKED: _payload(
        {"question_id": TEXT, "question": TEXT},
        {
            "options": st.lists(TEXT, max_size=4),
            "why": OPT_TEXT,
            "expires_at": OPT_TEXT,
            "reason": OPT_TEXT,
        },
    ),
    events.QUESTION_ANSWERED: _payload(
        {"question_id": TEXT, "answer": TEXT},
        {
            "by": st.none() | PRINCIPALS,
            "executor": OPT_TEXT,
            "signature": OPT_SIGNATURE,
            "approval": st.none()
            | st.fixed_dictionaries(
                {
                    "operation": TEXT,
                    "argument_digest": TEXT,
                    "key_id": TEXT,
                    "signature": st.binary(max_size=64),
                }
            ),
        },
    ),
    events.ANSWER_WINDOW_CLOSED: _payload({"question_id": TEXT, "at": INSTANTS}),
    events.PERMISSION_GRANTED: _payload({"operation": TEXT}, {"authority": OPT_SIGNATURE}),
    events.PERMISSION_REVOKED: _payload({"operation": TEXT}),
    events.MODE_CHANGED: _payload({"mode": TEXT}, {"authority": OPT_SIGNATURE}),
    events.OPTION_REMOVED: _payload(
        {
            "option": TEXT,
            "reason": st.fixed_dictionaries({"code": TEXT, "message": OPT_TEXT}),
        }
    ),
    events.PREREQUISITE_SET: _payload({"tools": st.lists(TEXT, max_size=5)}),
    events.COMPACTED: _payload({"summary": TEXT, "through": LONGS}),
    events.TODOS_TRANSFERRED: _payload(
        {
            "to": TEXT,
            "todos": st.lists(st.fixed_dictionaries({"id": TEXT, "version": INTS}), max_size=4),
        }
    ),
    events.EFFECT_OBSERVED: _payload(
        {"known": st.booleans()},
        {
            "artifacts": st.lists(TEXT, max_size=4),
            "evidence": st.lists(TEXT, max_size=4),
            "observer": OPT_TEXT,
        },
    ),
    events.EXECUTION_RECORDED: _payload(
        {"operation": TEXT, "argument_digest": TEXT},
        {"artifact": OPT_TEXT, "executor": OPT_TEXT},
    ),
    events.ENDED: _payload({"because": TEXT}),
}


@pytest.mark.parametrize("event_type", EVENT_TYPES)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_encode_then_decode_returns_the_event_for_generated_payloads(
    event_type: str, data: st.DataObject
) -> None:
    payload = data.draw(PAYLOAD_STRATEGIES[event_type], label="payload")
    event = Event(
        event_id=data.draw(TEXT),
        session_id=data.draw(TEXT),
        type=event_type,
        occurred_at=data.draw(INSTANTS),
        producer=data.draw(TEXT),
        payload=payload,
        expected_seq=data.draw(st.none() | LONGS),
    )
    decoded = CODEC.decode(CODEC.encode(event))
    assert decoded.occurred_at == utc_millis(event.occurred_at)
    assert decoded.payload == expected_payload(event_type, payload)
    assert (decoded.event_id, decoded.session_id, decoded.type, decoded.producer) == (
        event.event_id,
        event.session_id,
        event.type,
        event.producer,
    )
    assert decoded.expected_seq == event.expected_seq
    assert decoded.payload_readable


# -- the bytes are what the Avro spec says ---------------------------------------------------------

_CRC64_EMPTY = 0xC15D213AA4D7A795


def _crc64_table() -> list[int]:
    table = []
    for i in range(256):
        fp = i
        for _ in range(8):
            fp = (fp >> 1) ^ (_CRC64_EMPTY & -(fp & 1))
        table.append(fp)
    return table


_CRC64_TABLE = _crc64_table()


def crc64_avro(data: bytes) -> int:
    """The reference Rabin fingerprint from the Avro specification ("Schema Fingerprints")."""
    fp = _CRC64_EMPTY
    for byte in data:
        fp = (fp >> 8) ^ _CRC64_TABLE[(fp ^ byte) & 0xFF]
    return fp


def test_reference_crc64_matches_the_avro_test_vectors() -> None:
    # From Avro's share/test/data/schema-tests.txt (Java prints the value as a signed long).
    vectors = {'"null"': 7195948357588979594, '"boolean"': -6970731678124411036}
    for schema, expected in vectors.items():
        assert struct.unpack("<q", crc64_avro(schema.encode()).to_bytes(8, "little")) == (expected,)


def test_record_is_marker_then_little_endian_crc64_of_canonical_form_then_body() -> None:
    registry = SchemaRegistry.default()
    envelope = registry.reader(ENVELOPE_SCHEMA)
    turn = registry.reader(payload_schema_name(events.TURN))
    data = CODEC.encode(make_event(events.TURN, FULL[events.TURN]))

    assert data[:2] == b"\xc3\x01" == MARKER
    assert data[2:HEADER_SIZE] == crc64_avro(envelope.canonical_form.encode()).to_bytes(8, "little")
    assert envelope.canonical_form == fastavro.schema.to_parsing_canonical_form(envelope.schema)
    assert '"doc"' not in envelope.canonical_form

    body = fastavro.schemaless_reader(io.BytesIO(data[HEADER_SIZE:]), envelope.schema, None)
    assert isinstance(body, dict)
    payload = body["payload"]
    assert isinstance(payload, bytes)
    assert payload[:2] == MARKER
    assert payload[2:HEADER_SIZE] == crc64_avro(turn.canonical_form.encode()).to_bytes(8, "little")
    assert (
        fastavro.schemaless_reader(io.BytesIO(payload[HEADER_SIZE:]), turn.schema, None)
        == (FULL[events.TURN])
    )


# -- decoding errors -------------------------------------------------------------------------------

TOOL_EVENT = make_event(events.TOOL_CALLED, FULL[events.TOOL_CALLED], expected_seq=3)
TOOL_BYTES = CODEC.encode(TOOL_EVENT)


def _envelope_bytes(payload: bytes, event_type: str = events.TURN) -> bytes:
    """An envelope written with the current schema around arbitrary payload bytes."""
    envelope = SchemaRegistry.default().reader(ENVELOPE_SCHEMA)
    out = io.BytesIO()
    out.write(envelope.header)
    record = {
        "event_id": "e",
        "session_id": "s",
        "type": event_type,
        "occurred_at": T0,
        "producer": "p",
        "expected_seq": None,
        "payload": payload,
    }
    fastavro.schemaless_writer(out, envelope.schema, record)
    return out.getvalue()


def _payload_bytes(event_type: str, record: Mapping[str, Any]) -> bytes:
    schema = SchemaRegistry.default().reader(payload_schema_name(event_type))
    out = io.BytesIO()
    out.write(schema.header)
    fastavro.schemaless_writer(out, schema.schema, dict(record))
    return out.getvalue()


@pytest.mark.parametrize(
    "data",
    [b"", b"\xc3", b"\xc3\x01", b"\x00\x01" + TOOL_BYTES[2:], b"\xc3\x00" + TOOL_BYTES[2:]],
    ids=["empty", "half-marker", "marker-only", "wrong-marker", "wrong-marker-2nd-byte"],
)
def test_bytes_without_the_single_object_marker_are_corrupt(data: bytes) -> None:
    with pytest.raises(CorruptRecordError):
        CODEC.decode(data)


def test_every_truncation_of_a_record_is_corrupt() -> None:
    for cut in range(len(TOOL_BYTES)):
        with pytest.raises(CorruptRecordError):
            CODEC.decode(TOOL_BYTES[:cut])


def test_trailing_bytes_after_the_record_are_corrupt() -> None:
    with pytest.raises(CorruptRecordError, match="trailing"):
        CODEC.decode(TOOL_BYTES + b"\x00")


def test_fastavro_errors_are_wrapped_with_their_cause() -> None:
    with pytest.raises(CorruptRecordError) as caught:
        CODEC.decode(TOOL_BYTES[:-3])
    assert caught.value.__cause__ is not None


def test_unknown_envelope_fingerprint_is_an_unknown_fingerprint_error() -> None:
    data = MARKER + bytes(8) + TOOL_BYTES[HEADER_SIZE:]
    with pytest.raises(UnknownFingerprintError, match="0000000000000000"):
        CODEC.decode(data)


def test_unknown_payload_fingerprint_keeps_the_envelope_readable() -> None:
    data = _envelope_bytes(MARKER + b"\x01" * 8 + b"anything at all", "session.from_the_future")
    event = CODEC.decode(data)
    assert not event.payload_readable
    assert event.payload == {}
    assert (event.event_id, event.type, event.occurred_at) == ("e", "session.from_the_future", T0)


def test_an_unreadable_event_is_not_re_encoded() -> None:
    event = CODEC.decode(_envelope_bytes(MARKER + b"\x01" * 8))
    with pytest.raises(EncodeError, match="not readable"):
        CODEC.encode(event)


def test_known_payload_fingerprint_with_a_corrupt_body_is_corrupt() -> None:
    header = SchemaRegistry.default().reader(payload_schema_name(events.TURN)).header
    for body in (
        b"",
        b"\x02h",
        b"\x02h\x04\xff\xfe",
        _payload_bytes(events.TURN, FULL[events.TURN])[10:] + b"!",
    ):
        with pytest.raises(CorruptRecordError):
            CODEC.decode(_envelope_bytes(header + body))


def test_payload_that_is_not_single_object_encoded_is_corrupt() -> None:
    with pytest.raises(CorruptRecordError):
        CODEC.decode(_envelope_bytes(b"\x02hi"))


def test_payload_of_another_type_s_schema_is_corrupt() -> None:
    started = _payload_bytes(events.STARTED, {"goal": "g", "mode": "ask", "parent_id": None})
    with pytest.raises(CorruptRecordError, match="Started"):
        CODEC.decode(_envelope_bytes(started, events.TURN))


@pytest.mark.parametrize(
    "arguments",
    [
        {"n": -(2**63) - 1, "m": [2**64, 1]},  # beyond 64 bits: exact, never a float
        {"n": -(2**63), "m": 2**64 - 1},
        {"digits": "12345678901234567890", "x": 1.5},  # a long digit run in a string
    ],
)
def test_tool_arguments_decode_exactly_whatever_the_size_of_their_integers(
    arguments: dict[str, object],
) -> None:
    event = make_event(events.TOOL_CALLED, {"tool": "t", "arguments": arguments})
    decoded = CODEC.decode(CODEC.encode(event)).payload["arguments"]
    assert decoded == arguments
    assert {k: type(v) for k, v in decoded.items()} == {k: type(v) for k, v in arguments.items()}


def test_tool_arguments_that_are_not_a_json_object_are_corrupt() -> None:
    for text in ("[1, 2]", "{not json", '"x"'):
        payload = _payload_bytes(events.TOOL_CALLED, {"tool": "t", "arguments": text})
        with pytest.raises(CorruptRecordError, match="arguments"):
            CODEC.decode(_envelope_bytes(payload, events.TOOL_CALLED))


def test_a_decision_is_not_an_event_and_an_event_is_not_a_decision() -> None:
    with pytest.raises(CorruptRecordError, match="Envelope"):
        CODEC.decode(CODEC.encode_decision(ANSWERED))
    with pytest.raises(CorruptRecordError, match="Decision"):
        CODEC.decode_decision(TOOL_BYTES)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_decode_or_raise_a_codec_error(data: bytes) -> None:
    for candidate in (data, TOOL_BYTES[:HEADER_SIZE] + data):
        with contextlib.suppress(CodecError):
            CODEC.decode(candidate)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, len(TOOL_BYTES) - 1), st.integers(0, 255))
def test_a_damaged_byte_decodes_or_raises_a_codec_error(index: int, value: int) -> None:
    data = bytearray(TOOL_BYTES)
    data[index] = value
    with contextlib.suppress(CodecError):
        CODEC.decode(bytes(data))


def test_writer_schema_that_cannot_resolve_is_a_codec_error(tmp_path: Path) -> None:
    incompatible = {
        "type": "record",
        "name": "Turn",
        "namespace": "milpa.sessions.payload",
        "doc": "role became a number: no reader can resolve it",
        "fields": [
            {"name": "role", "type": "long", "doc": "x"},
            {"name": "content", "type": "string", "doc": "x"},
        ],
    }
    (tmp_path / "milpa.sessions.payload.Turn.avsc").write_text(json.dumps(incompatible))
    schema = fastavro.parse_schema(incompatible)
    out = io.BytesIO()
    fastavro.schemaless_writer(out, schema, {"role": 7, "content": "c"})
    payload = MARKER + schema_fingerprint(schema) + out.getvalue()
    codec = EventCodec(SchemaRegistry.default().with_writers(tmp_path))
    with pytest.raises(CodecError, match="does not resolve"):
        codec.decode(_envelope_bytes(payload))


# -- encoding errors -------------------------------------------------------------------------------


def test_unknown_event_type_is_refused() -> None:
    with pytest.raises(EncodeError, match=r"session\.nope"):
        CODEC.encode(make_event("session.nope", {}))


@pytest.mark.parametrize(
    ("event_type", "payload", "message"),
    [
        (events.TURN, {"role": "user"}, "content: missing required field"),
        (events.TURN, {"role": "user", "content": 3}, "content: expected string, got int 3"),
        (events.TURN, {"role": "user", "content": "c", "mood": "x"}, "unknown field.*'mood'"),
        (events.TOOL_CALLED, {"tool": "t", "ok": "yes"}, "ok: expected boolean"),
        (
            events.TOOL_CALLED,
            {"tool": "t", "arguments": ["x"]},
            "arguments: expected a JSON object",
        ),
        (
            events.TOOL_CALLED,
            {"tool": "t", "arguments": {"x": {1, 2}}},
            r"arguments\.x: expected a JSON",
        ),
        (events.TOOL_CALLED, {"tool": "t", "arguments": {"x": [math.nan]}}, r"arguments\.x\[0\]"),
        (events.TOOL_CALLED, {"tool": "t", "arguments": {1: "x"}}, "key 1 is not a string"),
        (
            events.QUESTION_ANSWERED,
            {"question_id": "q", "answer": "a", "by": {"id": "x", "verified": 1}},
            "by.verified: expected boolean, got int 1",
        ),
        (
            events.QUESTION_ANSWERED,
            {"question_id": "q", "answer": "a", "by": {"id": "x", "admin": True}},
            "by: unknown field.*'admin'",
        ),
        (
            events.TODOS_TRANSFERRED,
            {"to": "s", "todos": [{"id": "t", "version": 1}, {"id": "u", "version": 2**31}]},
            r"todos\[1\]\.version: expected int",
        ),
        (events.COMPACTED, {"summary": "s", "through": 2**63}, "through: expected long"),
        (events.COMPACTED, {"summary": "s", "through": True}, "through: expected long"),
        (events.PREREQUISITE_SET, {"tools": "lint"}, "tools: expected array"),
        (
            events.ANSWER_WINDOW_CLOSED,
            {"question_id": "q", "at": 12},
            "at: expected a timezone-aware",
        ),
        (
            events.ANSWER_WINDOW_CLOSED,
            {"question_id": "q", "at": datetime(2025, 1, 1)},
            "at: expected a timezone-aware",
        ),
        (events.STARTED, {"goal": "g", "parent_id": 5}, "parent_id: expected string"),
        (events.STARTED, ["goal"], "expected a milpa.sessions.payload.Started record"),
    ],
)
def test_payload_that_does_not_fit_is_refused_naming_the_field(
    event_type: str, payload: Any, message: str
) -> None:
    with pytest.raises(EncodeError, match=message):
        CODEC.encode(make_event(event_type, payload))


@pytest.mark.parametrize(
    ("envelope", "message"),
    [
        ({"occurred_at": datetime(2025, 1, 1)}, "occurred_at: expected a timezone-aware"),
        ({"occurred_at": "2025-01-01T00:00:00Z"}, "occurred_at: expected a timezone-aware"),
        ({"event_id": 17}, "event_id: expected string"),
        ({"expected_seq": "3"}, "expected_seq: expected long"),
    ],
)
def test_envelope_that_does_not_fit_is_refused(envelope: dict[str, Any], message: str) -> None:
    with pytest.raises(EncodeError, match=message):
        CODEC.encode(make_event(events.TURN, FULL[events.TURN], **envelope))


def test_encode_errors_are_codec_errors() -> None:
    assert issubclass(EncodeError, CodecError)
    assert issubclass(CorruptRecordError, CodecError)
    assert issubclass(UnknownFingerprintError, CodecError)


# -- decisions -------------------------------------------------------------------------------------

ANSWERED: dict[str, Any] = {
    "session_id": "sess-1",
    "question_id": "perm:deploy",
    "question": "Allow «deploy»?",
    "reason": "permission",
    "why": '{"env":"prod"}',
    "answer": "yes",
    "by": {"id": "actor:member:42", "verified": True},
    "executor": "worker-1",
    "decided_at": T0,
    "expired_at": None,
    "seq": 8,
    "event_id": "evt-8",
}
EXPIRED: dict[str, Any] = {
    **ANSWERED,
    "answer": "",
    "by": None,
    "executor": None,
    "decided_at": None,
    "expired_at": datetime(2025, 6, 1, 12, 0, 0, 999_999, tzinfo=timezone(timedelta(hours=-3))),
    "seq": 9,
    "event_id": "evt-9",
}


@pytest.mark.parametrize("decision", [ANSWERED, EXPIRED], ids=["answered", "window-closed"])
def test_decision_round_trips(decision: dict[str, Any]) -> None:
    data = CODEC.encode_decision(decision)
    assert data[:2] == MARKER
    assert data[2:HEADER_SIZE] == SchemaRegistry.default().reader(DECISION_SCHEMA).fingerprint
    expected = dict(decision)
    for key in ("decided_at", "expired_at"):
        if expected[key] is not None:
            expected[key] = utc_millis(expected[key])
    assert CODEC.decode_decision(data) == expected


def test_decision_optional_fields_default_to_null() -> None:
    required = {
        k: ANSWERED[k]
        for k in ("session_id", "question_id", "question", "answer", "seq", "event_id")
    }
    decoded = CODEC.decode_decision(CODEC.encode_decision(required))
    assert decoded == {
        **required,
        "reason": None,
        "why": None,
        "by": None,
        "executor": None,
        "decided_at": None,
        "expired_at": None,
    }


def test_decision_that_does_not_fit_is_refused() -> None:
    with pytest.raises(EncodeError, match="decision: seq: missing required field"):
        CODEC.encode_decision({k: v for k, v in ANSWERED.items() if k != "seq"})
    with pytest.raises(EncodeError, match="decided_at: expected a timezone-aware"):
        CODEC.encode_decision({**ANSWERED, "decided_at": datetime(2025, 1, 1)})


@settings(max_examples=100, deadline=None)
@given(
    st.fixed_dictionaries(
        {
            "session_id": TEXT,
            "question_id": TEXT,
            "question": TEXT,
            "reason": OPT_TEXT,
            "why": OPT_TEXT,
            "answer": TEXT,
            "by": st.none() | PRINCIPALS,
            "executor": OPT_TEXT,
            "decided_at": st.none() | INSTANTS,
            "expired_at": st.none() | INSTANTS,
            "seq": LONGS,
            "event_id": TEXT,
        }
    )
)
def test_generated_decisions_round_trip(decision: dict[str, Any]) -> None:
    decoded = CODEC.decode_decision(CODEC.encode_decision(decision))
    for key in ("decided_at", "expired_at"):
        if decision[key] is not None:
            decision[key] = utc_millis(decision[key])
    assert decoded == decision


def as_recorded(
    payload: dict[str, Any], recorded: dict[str, Any], event_type: str
) -> dict[str, Any]:
    """`payload` less the fields added after `recorded` was written (they hold their defaults)."""
    added = set(payload) - set(recorded)
    assert {k: payload[k] for k in added} == {k: DEFAULTS[event_type][k] for k in added}
    return {k: v for k, v in payload.items() if k not in added}


# -- golden fixtures of released versions ----------------------------------------------------------


def jsonable(value: Any) -> Any:
    """Decoded values as stored in expected.json (see tests/fixtures/golden/make_golden.py)."""
    if isinstance(value, datetime):
        return {"$datetime": value.isoformat()}
    if isinstance(value, bytes):
        return {"$base64": base64.b64encode(value).decode("ascii")}
    if isinstance(value, Mapping):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


RELEASED = sorted(p.name for p in (SCHEMAS_DIR / "released").iterdir() if p.is_dir())
GOLDEN_FILES = sorted(GOLDEN.glob("*/*.bin"))


def test_every_released_version_has_golden_fixtures() -> None:
    assert RELEASED, "no released schema version"
    for version in RELEASED:
        expected = json.loads((GOLDEN / version / "expected.json").read_text("utf-8"))
        assert set(expected) == {p.stem for p in (GOLDEN / version).glob("*.bin")}


def test_golden_v1_covers_every_event_type_and_a_decision() -> None:
    assert {p.stem for p in (GOLDEN / "v1").glob("*.bin")} == {*EVENT_TYPES, "decision"}


def test_golden_v2_carries_the_operator_signatures_and_a_call_approval() -> None:
    assert {p.stem for p in (GOLDEN / "v2").glob("*.bin")} == {*EVENT_TYPES, "decision"}
    for event_type in (events.STARTED, events.PERMISSION_GRANTED, events.MODE_CHANGED):
        authority = CODEC.decode((GOLDEN / "v2" / f"{event_type}.bin").read_bytes()).payload[
            "authority"
        ]
        assert authority["key_id"] == "operator-2026"
        assert len(authority["signature"]) == 64
    answered = CODEC.decode((GOLDEN / "v2" / f"{events.QUESTION_ANSWERED}.bin").read_bytes())
    assert answered.payload["approval"]["operation"] == "deploy"
    assert answered.payload["asked_seq"] is None  # added in v3: read at its default


def test_golden_v3_binds_an_answer_to_its_asking() -> None:
    assert {p.stem for p in (GOLDEN / "v3").glob("*.bin")} == {*EVENT_TYPES, "decision"}
    answered = CODEC.decode((GOLDEN / "v3" / f"{events.QUESTION_ANSWERED}.bin").read_bytes())
    assert answered.payload["asked_seq"] == 6
    assert answered.payload["approval"]["operation"] == "deploy"


def test_golden_v4_binds_a_closing_to_its_asking() -> None:
    assert {p.stem for p in (GOLDEN / "v4").glob("*.bin")} == {*EVENT_TYPES, "decision"}
    closed = CODEC.decode((GOLDEN / "v4" / f"{events.ANSWER_WINDOW_CLOSED}.bin").read_bytes())
    assert closed.payload["asked_seq"] == 6
    older = CODEC.decode((GOLDEN / "v3" / f"{events.ANSWER_WINDOW_CLOSED}.bin").read_bytes())
    assert older.payload["asked_seq"] is None  # added in v4: read at its default


@pytest.mark.parametrize("path", GOLDEN_FILES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_golden_bytes_of_a_released_version_decode_to_the_recorded_values(path: Path) -> None:
    expected = json.loads((path.parent / "expected.json").read_text("utf-8"))[path.stem]
    data = path.read_bytes()
    if path.stem == "decision":
        assert jsonable(CODEC.decode_decision(data)) == expected
        return
    event = CODEC.decode(data)
    decoded = {
        "event_id": event.event_id,
        "session_id": event.session_id,
        "type": event.type,
        "occurred_at": event.occurred_at,
        "producer": event.producer,
        "expected_seq": event.expected_seq,
        "payload_readable": event.payload_readable,
        "payload": event.payload,
    }
    decoded["payload"] = as_recorded(event.payload, expected["payload"], event.type)
    assert jsonable(decoded) == expected


def test_every_released_schema_still_has_a_current_reader() -> None:
    current = SchemaRegistry.default().reader_names
    for version in RELEASED:
        released = {p.stem for p in (SCHEMAS_DIR / "released" / version).glob("*.avsc")}
        assert released <= current, f"{version}: {released - current} have no current reader"


# -- schema evolution ------------------------------------------------------------------------------

EVOLUTION_EXPECTED = json.loads((EVOLUTION / "expected.json").read_text("utf-8"))


@pytest.mark.parametrize("case", sorted(EVOLUTION_EXPECTED))
def test_records_of_other_writer_versions_decode_through_the_current_reader(case: str) -> None:
    registry = SchemaRegistry.default().with_writers(EVOLUTION / "older", EVOLUTION / "newer")
    event = EventCodec(registry).decode((EVOLUTION / f"{case}.bin").read_bytes())
    expected = EVOLUTION_EXPECTED[case]
    assert event.payload_readable
    assert as_recorded(event.payload, expected["payload"], event.type) == expected["payload"]
    assert (event.event_id, event.producer) == (expected["event_id"], expected["producer"])


def test_older_writer_record_gets_defaults_for_fields_added_since() -> None:
    registry = SchemaRegistry.default().with_writers(EVOLUTION / "older")
    event = EventCodec(registry).decode((EVOLUTION / "older/session.tool_called.bin").read_bytes())
    assert event.payload["artifact"] is None
    assert event.payload["verdict"] is None
    assert event.payload["effect_observation_id"] is None
    assert event.payload["mutating"] is False


def test_newer_writer_record_drops_the_fields_this_reader_does_not_know() -> None:
    registry = SchemaRegistry.default().with_writers(EVOLUTION / "newer")
    event = EventCodec(registry).decode((EVOLUTION / "newer/session.tool_called.bin").read_bytes())
    assert "duration_ms" not in event.payload
    assert event.payload["tool"] == "pytest"


@pytest.mark.parametrize("case", sorted(EVOLUTION_EXPECTED))
def test_record_of_an_unregistered_writer_version_is_read_as_payload_unreadable(case: str) -> None:
    event = CODEC.decode((EVOLUTION / f"{case}.bin").read_bytes())
    assert not event.payload_readable
    assert event.payload == {}
    assert event.event_id == EVOLUTION_EXPECTED[case]["event_id"]


# -- the registry ----------------------------------------------------------------------------------


def test_default_registry_is_built_once() -> None:
    assert SchemaRegistry.default() is SchemaRegistry.default()
    assert EventCodec().registry is SchemaRegistry.default()


def test_default_registry_knows_every_released_writer_schema() -> None:
    registry = SchemaRegistry.default()
    for version in RELEASED:
        released = SchemaRegistry(SCHEMAS_DIR / "released" / version)
        assert released.fingerprints <= registry.fingerprints


def test_registry_loads_from_package_resources_and_from_a_path_alike() -> None:
    from_resources = SchemaRegistry(files("schemas"))
    from_path = SchemaRegistry(str(SCHEMAS_DIR))
    assert from_resources.fingerprints == from_path.fingerprints
    assert from_resources.reader_names == from_path.reader_names
    assert {ENVELOPE_SCHEMA, DECISION_SCHEMA} <= from_path.reader_names


def test_with_writers_leaves_the_original_registry_untouched() -> None:
    base = SchemaRegistry.default()
    extended = base.with_writers(EVOLUTION / "older")
    assert extended is not base
    assert base.fingerprints < extended.fingerprints


def test_registry_lookup_of_an_unknown_fingerprint_raises() -> None:
    with pytest.raises(UnknownFingerprintError):
        SchemaRegistry.default().writer(bytes(8))
    with pytest.raises(CodecError):
        SchemaRegistry.default().reader("milpa.sessions.Nope")


def _nested(levels: int) -> dict[str, Any]:
    value: dict[str, Any] = {"leaf": 1}
    for _ in range(levels - 1):
        value = {"a": value}
    return value


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (_nested(129), "nests deeper than 128 levels"),
        (_nested(1_200), "nests deeper than 128 levels"),  # not a RecursionError
        ({"a": ["\udc80"]}, r"a\[0\]: text UTF-8 cannot hold"),
        ({"\udc80": 1}, "text UTF-8 cannot hold"),
    ],
)
def test_arguments_intake_would_refuse_are_refused_when_written(
    arguments: dict[str, Any], message: str
) -> None:
    call = {**FULL[events.TOOL_CALLED], "arguments": arguments}
    with pytest.raises(EncodeError, match=message):
        CODEC.encode(make_event(events.TOOL_CALLED, call))


def test_arguments_as_deep_as_allowed_are_written_and_read_back() -> None:
    call = {**FULL[events.TOOL_CALLED], "arguments": _nested(128)}
    event = make_event(events.TOOL_CALLED, call)
    assert CODEC.decode(CODEC.encode(event)).payload["arguments"] == _nested(128)
