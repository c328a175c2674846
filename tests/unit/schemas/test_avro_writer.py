"""Compiled Avro writers write the checked path's bytes exactly, and refuse only by deferring."""

from __future__ import annotations

import enum
import io
from datetime import UTC, datetime, timedelta, timezone
from types import MappingProxyType
from typing import Any

import fastavro
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas.avro_writer import Unfit, compile_writer, zigzag_varint
from schemas.codec import EventCodec, SchemaRegistry
from schemas.errors import EncodeError

REGISTRY = SchemaRegistry.default()
NAMES = sorted(REGISTRY.reader_names)
CODEC = EventCodec()

INSTANTS = st.datetimes(
    min_value=datetime(1900, 1, 1), max_value=datetime(2200, 1, 1), timezones=st.just(UTC)
) | st.datetimes(
    min_value=datetime(1900, 1, 1),
    max_value=datetime(2200, 1, 1),
    timezones=st.integers(-23 * 60, 23 * 60).map(lambda m: timezone(timedelta(minutes=m))),
)


def _strategy(schema: Any, named: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """Values of a parsed schema, in the plain forms the codec's callers pass."""
    if isinstance(schema, list):
        return st.one_of(*(_strategy(b, named) for b in schema))
    if isinstance(schema, str):
        if schema in named:
            return st.deferred(lambda: named[schema])
        return {
            "null": st.none(),
            "boolean": st.booleans(),
            "int": st.integers(-(2**31), 2**31 - 1),
            "long": st.integers(-(2**63), 2**63 - 1) | st.integers(-200, 200),
            "string": st.text(max_size=80),
            "bytes": st.binary(max_size=80),
            "float": st.floats(width=32, allow_nan=False),
            "double": st.floats(allow_nan=False),
        }[schema]
    kind = schema["type"]
    if kind == "long" and schema.get("logicalType") == "timestamp-millis":
        return INSTANTS
    if kind == "record":
        required = {f["name"]: _strategy(f["type"], named) for f in schema["fields"]}
        optional = {f["name"]: required.pop(f["name"]) for f in schema["fields"] if "default" in f}
        strategy = st.fixed_dictionaries(required, optional=optional)
        for name in (schema["name"], schema["name"].rpartition(".")[2]):
            named[name] = strategy
        return strategy
    if kind == "array":
        return st.lists(_strategy(schema["items"], named), max_size=4) | st.just([])
    if kind == "map":
        return st.dictionaries(st.text(max_size=10), _strategy(schema["values"], named), max_size=3)
    if kind == "enum":
        return st.sampled_from(schema["symbols"])
    return _strategy(kind, named)


STRATEGIES = {name: _strategy(REGISTRY.reader(name).schema, {}) for name in NAMES}


def _checked(name: str, value: Any) -> bytes:
    """What the checked path writes: the codec's check, then fastavro (after the header)."""
    plan = REGISTRY._write_plan(name)
    out = io.BytesIO()
    out.write(plan.header)
    fastavro.schemaless_writer(out, plan.schema, plan.check(value))
    return out.getvalue()


def test_every_current_schema_compiles() -> None:
    for name in NAMES:
        assert REGISTRY._write_plan(name).fast is not None, name


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_compiled_writer_writes_what_the_checked_path_writes(name: str, data: Any) -> None:
    value = data.draw(STRATEGIES[name], label="record")
    fast = REGISTRY._write_plan(name).fast
    assert fast is not None
    assert fast(value) == _checked(name, value)


@pytest.mark.parametrize(
    "n", [0, 1, -1, 63, 64, -64, -65, 127, 128, 2**31 - 1, -(2**31), 2**63 - 1, -(2**63)]
)
def test_zigzag_varint_is_avros_long_encoding(n: int) -> None:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, "long", n)
    assert zigzag_varint(n) == out.getvalue()


CHANGE = {
    "session_id": "s-1",
    "status": "open",
    "question_id": "q-1",
    "question": "May I deploy?",
    "options": ["yes", "no"],
    "seq": 3,
    "mode": "ask",
    "goal": "ship",
    "event_id": "e-1",
    "at": datetime(2025, 1, 2, 3, 4, 5, 678_901, tzinfo=UTC),
}


class Small(enum.IntEnum):
    THREE = 3


@pytest.mark.parametrize(
    "changed",
    [
        {},
        {"options": ("yes", "no")},  # a tuple is taken as the list it stands for
        {"at": datetime(2025, 1, 2, 5, 4, 5, 678_901, tzinfo=timezone(timedelta(hours=2)))},
        {"seq": Small.THREE},  # an int subclass: the checked path writes it
        {"by": MappingProxyType({"id": "op", "verified": True})},  # a Mapping, not a dict
    ],
)
def test_values_in_other_forms_are_written_as_the_checked_path_writes_them(
    changed: dict[str, Any],
) -> None:
    value = {**CHANGE, **changed}
    assert CODEC.encode_question_change(value) == _checked("milpa.sessions.QuestionChange", value)


@pytest.mark.parametrize(
    ("changed", "message"),
    [
        ({"seq": "3"}, "question change: seq: expected long"),
        ({"seq": 2**63}, "question change: seq: expected long"),
        ({"at": datetime(2025, 1, 2)}, "question change: at: expected a timezone-aware datetime"),
        ({"options": ["yes", 1]}, "question change: options[1]: expected string"),
        ({"colour": "red"}, "question change: unknown field(s) 'colour'"),
        ({"question": None}, "question change: question: expected string"),
        ({"why": "\ud800"}, "question change: "),  # a lone surrogate: not UTF-8
    ],
)
def test_a_misfit_is_refused_by_the_checked_path_with_its_reason(
    changed: dict[str, Any], message: str
) -> None:
    value = {**CHANGE, **changed}
    fast = REGISTRY._write_plan("milpa.sessions.QuestionChange").fast
    assert fast is not None
    with pytest.raises((Unfit, ValueError)):
        fast(value)
    with pytest.raises(EncodeError) as refused:
        CODEC.encode_question_change(value)
    assert str(refused.value).startswith(message)


def test_a_missing_required_field_is_refused_with_its_name() -> None:
    value = {k: v for k, v in CHANGE.items() if k != "goal"}
    with pytest.raises(EncodeError, match="goal: missing required field"):
        CODEC.encode_question_change(value)


def test_missing_optional_fields_are_written_as_their_defaults() -> None:
    fast = REGISTRY._write_plan("milpa.sessions.QuestionChange").fast
    assert fast is not None
    full = {**CHANGE, "reason": None, "why": None, "expires_at": None, "asked_at": None}
    assert fast(CHANGE) == fast({**full, "answer": None, "by": None})


FIXED = {"type": "fixed", "name": "Id", "size": 4}


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "record", "name": "U", "fields": [{"name": "u", "type": ["string", "long"]}]},
        {"type": "record", "name": "D", "fields": [{"name": "d", "type": "bytes", "default": ""}]},
        {"type": "record", "name": "X", "fields": [{"name": "x", "type": FIXED}]},
    ],
)
def test_schemas_it_does_not_translate_are_left_to_the_checked_path(schema: Any) -> None:
    assert compile_writer(schema) is None


EDGES = {
    "type": "record",
    "name": "Edges",
    "fields": [
        {"name": "n", "type": "long"},
        {"name": "s", "type": "string"},
        {"name": "b", "type": "bytes"},
        {"name": "a", "type": {"type": "array", "items": "long"}},
    ],
}


@pytest.mark.parametrize("size", [0, 1, 63, 64, 65, 127, 128, 8191, 8192])
def test_lengths_and_numbers_at_the_varint_edges(size: int) -> None:
    """One byte of varint holds 0..63 (zig-zag); the compiled writer's short cut ends there."""
    value = {"n": size, "s": "é" * size, "b": b"x" * size, "a": [size, -size] * (size % 70)}
    fast = compile_writer(EDGES)
    assert fast is not None
    out = io.BytesIO()
    fastavro.schemaless_writer(out, fastavro.parse_schema(EDGES), value)
    assert fast(value) == out.getvalue()
