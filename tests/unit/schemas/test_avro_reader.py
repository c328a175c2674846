"""The compiled Avro readers read exactly what fastavro reads, and refuse what they cannot read."""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any

import fastavro
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas.avro_reader import (
    TrailingBytesError,
    _varint,
    compile_reader,
    compile_tuple_reader,
)
from schemas.codec import HEADER_SIZE, SchemaRegistry, payload_schema_name
from schemas.events import EVENT_TYPES
from tests.unit.schemas.test_codec import FULL, PAYLOAD_STRATEGIES

REGISTRY = SchemaRegistry.default()
READ_ERRORS = (EOFError, IndexError, ValueError, OverflowError)


def _body(schema: Mapping[str, Any], record: Mapping[str, Any]) -> bytes:
    out = io.BytesIO()
    out.write(b"\x00" * HEADER_SIZE)  # where the single-object header would be
    fastavro.schemaless_writer(out, schema, dict(record))
    return out.getvalue()


def _fastavro(schema: Mapping[str, Any], data: bytes) -> Any:
    stream = io.BytesIO(data[HEADER_SIZE:])
    record = fastavro.schemaless_reader(stream, schema, None)
    if stream.tell() != len(data) - HEADER_SIZE:
        raise TrailingBytesError(len(data) - HEADER_SIZE - stream.tell())
    return record


def test_every_current_schema_compiles() -> None:
    for name in sorted(REGISTRY.reader_names):
        assert compile_reader(REGISTRY.reader(name).schema) is not None, name


@pytest.mark.parametrize("event_type", EVENT_TYPES)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_compiled_reader_reads_what_fastavro_reads(event_type: str, data: st.DataObject) -> None:
    schema = REGISTRY.reader(payload_schema_name(event_type)).schema
    payload = dict(data.draw(PAYLOAD_STRATEGIES[event_type], label="payload"))
    if "arguments" in payload:  # travels as canonical JSON text
        payload["arguments"] = str(payload["arguments"])
    body = _body(schema, payload)
    read = compile_reader(schema)
    assert read is not None
    assert read(body, HEADER_SIZE) == _fastavro(schema, body)


@settings(max_examples=400, deadline=None)
@given(
    event_type=st.sampled_from(EVENT_TYPES),
    damage=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=3),
    cut=st.integers(0, 10_000),
)
def test_on_damaged_bytes_the_compiled_reader_agrees_with_fastavro_or_refuses(
    event_type: str, damage: list[tuple[int, int]], cut: int
) -> None:
    """What the compiled reader returns, fastavro returns too; else it raises a read error."""
    schema = REGISTRY.reader(payload_schema_name(event_type)).schema
    payload = dict(FULL[event_type])
    if "arguments" in payload:
        payload["arguments"] = "{}"
    data = bytearray(_body(schema, payload))
    for index, value in damage:
        data[HEADER_SIZE + index % (len(data) - HEADER_SIZE)] = value
    damaged = bytes(data[: HEADER_SIZE + cut % (len(data) - HEADER_SIZE + 1)])
    read = compile_reader(schema)
    assert read is not None
    try:
        record = read(damaged, HEADER_SIZE)
    except READ_ERRORS:
        return
    assert record == _fastavro(schema, damaged)


def test_trailing_bytes_and_truncation_are_told_apart() -> None:
    schema = REGISTRY.reader(payload_schema_name("session.turn")).schema
    read = compile_reader(schema)
    assert read is not None
    body = _body(schema, {"role": "user", "content": "hello"})
    with pytest.raises(TrailingBytesError, match="2 trailing bytes"):
        read(body + b"\x00\x00", HEADER_SIZE)
    for cut in range(HEADER_SIZE, len(body)):
        with pytest.raises(READ_ERRORS):
            read(body[:cut], HEADER_SIZE)


def test_arrays_in_several_blocks_and_with_block_sizes_are_read() -> None:
    schema = REGISTRY.reader(payload_schema_name("session.prerequisite_set")).schema
    read = compile_reader(schema)
    assert read is not None
    # Block of 2 (count, items), then a block of -1 with its byte size, then the end (0).
    body = b"\x00" * HEADER_SIZE + b"\x04\x02a\x02b" + b"\x01\x04\x02c" + b"\x00"
    assert read(body, HEADER_SIZE) == {"tools": ["a", "b", "c"]} == _fastavro(schema, body)


def test_a_negative_length_or_an_impossible_count_is_refused() -> None:
    schema = REGISTRY.reader(payload_schema_name("session.prerequisite_set")).schema
    read = compile_reader(schema)
    assert read is not None
    with pytest.raises(EOFError):
        read(b"\x00" * HEADER_SIZE + b"\x02\x01\x00", HEADER_SIZE)  # a string of length -1
    with pytest.raises(EOFError):
        read(b"\x00" * HEADER_SIZE + b"\xfe\xff\xff\x7f\x00", HEADER_SIZE)  # 2**27 items


def test_the_envelope_reads_as_a_tuple_in_field_order() -> None:
    schema = REGISTRY.reader("milpa.sessions.Envelope").schema
    read = compile_tuple_reader(schema)
    assert read is not None
    record = {
        "event_id": "e",
        "session_id": "s",
        "type": "session.turn",
        "occurred_at": 1_750_000_000_123,
        "producer": "p",
        "expected_seq": 7,
        "payload": b"\x01\x02",
    }
    body = _body(schema, record)
    expected = _fastavro(schema, body)
    assert read(body, HEADER_SIZE) == tuple(expected[f["name"]] for f in schema["fields"])


@given(st.integers(0, 2**70))
def test_varints_of_any_length(value: int) -> None:
    encoded = bytearray()
    rest = value
    while True:
        byte, rest = rest & 0x7F, rest >> 7
        encoded.append(byte | 0x80 if rest else byte)
        if not rest:
            break
    data = bytes(encoded) + b"tail"
    if data[0] & 0x80:
        assert _varint(data, 1, data[0]) == (value, len(encoded))


def test_types_it_does_not_compile_are_left_to_fastavro() -> None:
    unsupported = [
        "double",
        {"type": "map", "values": "string"},
        {"type": "fixed", "name": "F", "size": 2},
        {"type": "int", "logicalType": "date"},
    ]
    for field_type in unsupported:
        schema = fastavro.parse_schema(
            {"type": "record", "name": "R", "fields": [{"name": "x", "type": field_type}]}
        )
        assert compile_reader(schema) is None
