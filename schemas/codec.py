"""The wire format: session events and decisions as Avro single-object-encoded records.

Every record is `b"\\xc3\\x01"` + the 8-byte CRC-64-AVRO fingerprint of its writer schema's
parsing canonical form + the schemaless Avro body. An event is an `Envelope` record whose `payload`
field holds the type's payload record, itself single-object encoded: a reader that does not know
the payload's writer schema still reads the envelope (the event comes back with
`payload_readable=False` and the fold skips it).

Writer schemas are found by fingerprint among the current schemas (`schemas/*.avsc`) and every
released version (`schemas/released/<version>/*.avsc`), and resolved against the current reader
schema of the same full name, so old records keep decoding after the schemas evolve. Schemas are
parsed once per registry; encoding checks values with a validator compiled once per schema, and a
body written with a current schema is read by a reader compiled once for it
(`schemas.avro_reader`); fastavro reads the rest (older writer schemas, resolved).
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from importlib.resources import files
from importlib.resources.abc import Traversable
from io import BytesIO
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final

import orjson
from fastavro import schemaless_reader, schemaless_writer
from fastavro.read import SchemaResolutionError
from fastavro.repository.base import AbstractSchemaRepository, SchemaRepositoryError
from fastavro.schema import fingerprint as avro_fingerprint
from fastavro.schema import load_schema, to_parsing_canonical_form

from schemas import events
from schemas.avro_reader import (
    Reader,
    TrailingBytesError,
    TupleReader,
    compile_reader,
    compile_tuple_reader,
)
from schemas.avro_writer import Unfit, Writer, compile_writer
from schemas.errors import CodecError, CorruptRecordError, EncodeError, UnknownFingerprintError
from schemas.events import Event, utc_millis

__all__ = [
    "DECISION_SCHEMA",
    "ENVELOPE_SCHEMA",
    "HEADER_SIZE",
    "MARKER",
    "PAYLOAD_SCHEMAS",
    "QUESTION_CHANGE_SCHEMA",
    "SNAPSHOT_CHECKPOINT_SCHEMA",
    "SNAPSHOT_SCHEMA",
    "Directory",
    "EventCodec",
    "RegisteredSchema",
    "SchemaRegistry",
    "canonical_json",
    "payload_schema_name",
    "schema_fingerprint",
]

MARKER: Final = b"\xc3\x01"
"""The two marker bytes that open every single-object-encoded Avro record."""

HEADER_SIZE: Final = 10
"""Marker (2 bytes) + CRC-64-AVRO fingerprint (8 bytes, little-endian)."""

ENVELOPE_SCHEMA: Final = "milpa.sessions.Envelope"
"""Full name of the envelope record every event travels in."""

DECISION_SCHEMA: Final = "milpa.sessions.Decision"
"""Full name of the record published to `sessions.decisions`."""

QUESTION_CHANGE_SCHEMA: Final = "milpa.sessions.QuestionChange"
"""Full name of the record published to `sessions.questions`."""

SNAPSHOT_SCHEMA: Final = "milpa.sessions.Snapshot"
"""Full name of a session's snapshot on `sessions.snapshots`."""

SNAPSHOT_CHECKPOINT_SCHEMA: Final = "milpa.sessions.SnapshotCheckpoint"
"""Full name of a partition's snapshot checkpoint on `sessions.snapshots`."""

_ENVELOPE_FIELDS: Final = (
    "event_id",
    "session_id",
    "type",
    "occurred_at",
    "producer",
    "expected_seq",
    "payload",
)
_PAYLOAD_NS: Final = "milpa.sessions.payload"
_TOOL_CALLED_SCHEMA: Final = f"{_PAYLOAD_NS}.ToolCalled"

PAYLOAD_SCHEMAS: Final[Mapping[str, str]] = MappingProxyType(
    {
        events.STARTED: f"{_PAYLOAD_NS}.Started",
        events.TURN: f"{_PAYLOAD_NS}.Turn",
        events.TOOL_CALLED: _TOOL_CALLED_SCHEMA,
        events.MESSAGE_SENT: f"{_PAYLOAD_NS}.MessageSent",
        events.PLAN_SET: f"{_PAYLOAD_NS}.PlanSet",
        events.TODO_CHANGED: f"{_PAYLOAD_NS}.TodoChanged",
        events.QUESTION_ASKED: f"{_PAYLOAD_NS}.QuestionAsked",
        events.QUESTION_ANSWERED: f"{_PAYLOAD_NS}.QuestionAnswered",
        events.ANSWER_WINDOW_CLOSED: f"{_PAYLOAD_NS}.AnswerWindowClosed",
        events.PERMISSION_GRANTED: f"{_PAYLOAD_NS}.PermissionGranted",
        events.PERMISSION_REVOKED: f"{_PAYLOAD_NS}.PermissionRevoked",
        events.MODE_CHANGED: f"{_PAYLOAD_NS}.ModeChanged",
        events.OPTION_REMOVED: f"{_PAYLOAD_NS}.OptionRemoved",
        events.PREREQUISITE_SET: f"{_PAYLOAD_NS}.PrerequisiteSet",
        events.COMPACTED: f"{_PAYLOAD_NS}.Compacted",
        events.TODOS_TRANSFERRED: f"{_PAYLOAD_NS}.TodosTransferred",
        events.EFFECT_OBSERVED: f"{_PAYLOAD_NS}.EffectObserved",
        events.EXECUTION_RECORDED: f"{_PAYLOAD_NS}.ExecutionRecorded",
        events.ENDED: f"{_PAYLOAD_NS}.Ended",
    }
)
"""Event type → full name of its payload record schema."""

_PAYLOAD_SCHEMA_OF: Final = dict(PAYLOAD_SCHEMAS)  # a plain dict: a proxy's `get` costs more

Directory = Traversable | str | os.PathLike[str]
"""A schema directory: a path, or a `Traversable` from `importlib.resources`."""

# What fastavro (and the bytes under it) raise on a body that is not what its schema says.
_READ_ERRORS: Final = (
    EOFError,
    ValueError,  # includes UnicodeDecodeError
    TypeError,
    IndexError,
    KeyError,
    OverflowError,
    struct.error,
)
# The compiled check runs first, so these are unexpected; wrapped all the same.
_WRITE_ERRORS: Final = (ValueError, TypeError, OverflowError, AttributeError, struct.error)
_FAST_MISSES: Final = (Unfit, KeyError, *_WRITE_ERRORS)


def payload_schema_name(event_type: str) -> str:
    """Return the full name of the payload schema of `event_type` (CodecError if unknown)."""
    try:
        return PAYLOAD_SCHEMAS[event_type]
    except KeyError:
        raise CodecError(f"no payload schema for event type {event_type!r}") from None


def schema_fingerprint(schema: Any) -> bytes:
    """Return the 8-byte CRC-64-AVRO fingerprint of a schema's parsing canonical form."""
    return bytes.fromhex(avro_fingerprint(to_parsing_canonical_form(schema), "CRC-64-AVRO"))


# How deep a call's arguments may nest: deeper ones are refused when written (EncodeError) and at
# intake (dead-lettered), since the fold's digest and the commit's JSON recurse once per level,
# inside a worker's own deep stack.
MAX_ARGUMENT_DEPTH = 128


def canonical_json(value: Any) -> str:
    """Return JSON data as canonical JSON: sorted keys, no whitespace, raw UTF-8 (EncodeError)."""
    try:
        _check_json(value)
    except _Misfit as e:
        raise EncodeError(f"{e.where() or 'value'}: {e.problem}") from None
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    )


# -- checking values before they are written ------------------------------------------------------


class _Misfit(Exception):  # noqa: N818 - internal signal, always re-raised as EncodeError
    """A value does not fit its schema; `path` is collected innermost first while unwinding."""

    def __init__(self, problem: str) -> None:
        super().__init__(problem)
        self.problem = problem
        self.path: list[str] = []

    def at(self, step: str) -> _Misfit:
        self.path.append(step)
        return self

    def where(self) -> str:
        text = ""
        for step in reversed(self.path):
            text += step if step.startswith("[") or not text else f".{step}"
        return text


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def _expected(kind: str, value: Any) -> _Misfit:
    return _Misfit(f"expected {kind}, got {_describe(value)}")


def _check_json(value: Any, level: int = 1) -> None:
    """Refuse what `json.dumps` would alter (non-string keys) or emit as non-standard JSON, text
    UTF-8 cannot hold, and nesting deeper than `MAX_ARGUMENT_DEPTH` (what intake refuses)."""
    if value is None or isinstance(value, bool | int):
        return
    if isinstance(value, str):
        _check_text(value)
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _expected("a finite JSON number", value)
        return
    if isinstance(value, Mapping | list | tuple) and level > MAX_ARGUMENT_DEPTH:
        raise _Misfit(f"nests deeper than {MAX_ARGUMENT_DEPTH} levels")
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise _Misfit(f"object key {key!r} is not a string")
            try:
                _check_text(key)
                _check_json(item, level + 1)
            except _Misfit as e:
                raise e.at(key) from None
        return
    if isinstance(value, list | tuple):
        for index, item in enumerate(value):
            try:
                _check_json(item, level + 1)
            except _Misfit as e:
                raise e.at(f"[{index}]") from None
        return
    raise _expected("a JSON value", value)


def _check_text(text: str) -> None:
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise _Misfit("text UTF-8 cannot hold (a lone surrogate)") from None


_Check = Callable[[Any], Any]
"""Checks one value against a schema and returns it as the Avro writer should see it."""

_INT_RANGE: Final = (-(2**31), 2**31 - 1)
_LONG_RANGE: Final = (-(2**63), 2**63 - 1)


def _check_null(value: Any) -> Any:
    if value is None:
        return None
    raise _expected("null", value)


def _check_boolean(value: Any) -> Any:
    if value is True or value is False:
        return value
    raise _expected("boolean", value)


def _check_string(value: Any) -> Any:
    if isinstance(value, str):
        return value
    raise _expected("string", value)


def _check_bytes(value: Any) -> Any:
    if isinstance(value, bytes | bytearray):
        return bytes(value)
    raise _expected("bytes", value)


def _integer_check(kind: str, bounds: tuple[int, int]) -> _Check:
    low, high = bounds

    def check(value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool) and low <= value <= high:
            return value
        raise _expected(f"{kind} ({low}..{high})", value)

    return check


def _check_floating(value: Any) -> Any:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return value
    raise _expected("number", value)


def _check_instant(value: Any) -> Any:
    if isinstance(value, datetime) and value.tzinfo is not None:
        return utc_millis(value)
    raise _expected("a timezone-aware datetime", value)


_PRIMITIVE_CHECKS: Final[Mapping[str, _Check]] = MappingProxyType(
    {
        "null": _check_null,
        "boolean": _check_boolean,
        "string": _check_string,
        "bytes": _check_bytes,
        "int": _integer_check("int", _INT_RANGE),
        "long": _integer_check("long", _LONG_RANGE),
        "float": _check_floating,
        "double": _check_floating,
    }
)


def _compile(schema: Any, named: dict[str, _Check]) -> _Check:
    """Compile a parsed (fastavro) schema into a check; `named` collects named types' checks."""
    if isinstance(schema, list):
        return _compile_union(schema, named)
    if isinstance(schema, str):
        primitive = _PRIMITIVE_CHECKS.get(schema)
        if primitive is not None:
            return primitive
        try:
            return named[schema]  # defined earlier: at its first use, or the enclosing record
        except KeyError:
            raise CodecError(f"schema refers to undefined type {schema!r}") from None
    kind = schema["type"]
    if kind == "long" and schema.get("logicalType") == "timestamp-millis":
        return _check_instant
    if kind in _PRIMITIVE_CHECKS:  # other logical types: checked as their underlying type
        return _PRIMITIVE_CHECKS[kind]
    if kind in ("record", "error"):
        return _compile_record(schema, named)
    if kind == "array":
        return _compile_array(_compile(schema["items"], named))
    if kind == "map":
        return _compile_map(_compile(schema["values"], named))
    if kind == "enum":
        return _compile_enum(schema, named)
    if kind == "fixed":
        return _compile_fixed(schema, named)
    raise CodecError(f"schema type {kind!r} is not supported by the codec")


def _compile_record(schema: Mapping[str, Any], named: dict[str, _Check]) -> _Check:
    name: str = schema["name"]
    fields: list[tuple[str, _Check, bool]] = []
    known = frozenset(f["name"] for f in schema["fields"])

    def check(value: Any) -> Any:
        if not isinstance(value, Mapping):
            raise _expected(f"a {name} record (mapping)", value)
        if not value.keys() <= known:
            unknown = ", ".join(sorted(repr(k) for k in value if k not in known))
            raise _Misfit(f"unknown field(s) {unknown} (not in {name})")
        record: dict[str, Any] = {}
        for field, field_check, required in fields:
            if field in value:
                try:
                    record[field] = field_check(value[field])
                except _Misfit as e:
                    raise e.at(field) from None
            elif required:
                raise _Misfit("missing required field").at(field)
            # else: left out; the Avro writer writes the field's default
        return record

    named[name] = check  # before the fields, so a recursive reference resolves
    for f in schema["fields"]:
        fields.append((f["name"], _compile(f["type"], named), "default" not in f))
    return check


def _compile_union(branches: list[Any], named: dict[str, _Check]) -> _Check:
    checks = [_compile(branch, named) for branch in branches]
    if len(branches) == 2 and branches[0] == "null":
        inner = checks[1]

        def optional(value: Any) -> Any:
            return None if value is None else inner(value)

        return optional

    def union(value: Any) -> Any:
        problems = []
        for branch_check in checks:
            try:
                return branch_check(value)
            except _Misfit as e:
                problems.append(e.problem)
        raise _Misfit("fits no branch of the union: " + "; ".join(problems))

    return union


def _compile_array(item_check: _Check) -> _Check:
    def check(value: Any) -> Any:
        if not isinstance(value, list | tuple):
            raise _expected("array (list)", value)
        items = []
        for index, item in enumerate(value):
            try:
                items.append(item_check(item))
            except _Misfit as e:
                raise e.at(f"[{index}]") from None
        return items

    return check


def _compile_map(value_check: _Check) -> _Check:
    def check(value: Any) -> Any:
        if not isinstance(value, Mapping):
            raise _expected("map (mapping)", value)
        result = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise _Misfit(f"map key {key!r} is not a string")
            try:
                result[key] = value_check(item)
            except _Misfit as e:
                raise e.at(f"[{key!r}]") from None
        return result

    return check


def _compile_enum(schema: Mapping[str, Any], named: dict[str, _Check]) -> _Check:
    symbols = frozenset(schema["symbols"])

    def check(value: Any) -> Any:
        if isinstance(value, str) and value in symbols:
            return value
        raise _expected(f"one of {sorted(symbols)}", value)

    named[schema["name"]] = check
    return check


def _compile_fixed(schema: Mapping[str, Any], named: dict[str, _Check]) -> _Check:
    size: int = schema["size"]

    def check(value: Any) -> Any:
        if isinstance(value, bytes | bytearray) and len(value) == size:
            return bytes(value)
        raise _expected(f"{size} bytes", value)

    named[schema["name"]] = check
    return check


# -- the registry --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, eq=False)
class RegisteredSchema:
    """One parsed schema of the registry: full name, fingerprint and single-object header."""

    full_name: str
    fingerprint: bytes
    canonical_form: str
    schema: dict[str, Any]
    header: bytes


@dataclass(frozen=True, slots=True, eq=False)
class _ReadPlan:
    """How to read a body written with one writer schema: writer, and reader if it differs.

    `compiled` reads it without fastavro when writer and reader are the same schema.
    """

    full_name: str
    writer: dict[str, Any]
    reader: dict[str, Any] | None
    compiled: Reader | None = None


@dataclass(frozen=True, slots=True, eq=False)
class _WritePlan:
    """How to write a record with a current schema: its header, check and parsed schema.

    `fast` writes it header included when the value is in its plainest form (`avro_writer`).
    """

    full_name: str
    header: bytes
    check: _Check
    schema: dict[str, Any]
    fast: Writer | None = None


class _DirectoryRepository(AbstractSchemaRepository):
    """A fastavro schema repository over one directory of `<full name>.avsc` files."""

    def __init__(self, directory: Traversable) -> None:
        self._directory = directory

    def load(self, name: str) -> Any:
        """Return the JSON of `<name>.avsc` in the directory."""
        try:
            text = (self._directory / f"{name}.avsc").read_text(encoding="utf-8")
        except OSError as e:
            raise SchemaRepositoryError(f"no schema file for {name!r}") from e
        return json.loads(text)


def _as_traversable(directory: Directory) -> Traversable:
    if isinstance(directory, str | os.PathLike):
        return Path(directory)
    return directory


def _load_directory(directory: Traversable) -> dict[str, RegisteredSchema]:
    """Parse every `.avsc` of one directory (named types resolved among its siblings)."""
    repo = _DirectoryRepository(directory)
    loaded: dict[str, RegisteredSchema] = {}
    names = sorted(
        entry.name.removesuffix(".avsc")
        for entry in directory.iterdir()
        if entry.name.endswith(".avsc") and entry.is_file()
    )
    for name in names:
        try:
            schema = load_schema(name, repo=repo)
        except Exception as e:  # fastavro raises assorted exception types for bad schemas
            raise CodecError(f"schema {name}.avsc in {directory} does not load: {e}") from e
        if not isinstance(schema, dict) or schema.get("name") != name:
            raise CodecError(f"{name}.avsc in {directory} does not define the named type {name}")
        canonical = to_parsing_canonical_form(schema)
        fingerprint = bytes.fromhex(avro_fingerprint(canonical, "CRC-64-AVRO"))
        loaded[name] = RegisteredSchema(name, fingerprint, canonical, schema, MARKER + fingerprint)
    return loaded


class SchemaRegistry:
    """The current reader schemas by full name, and every known writer schema by fingerprint."""

    def __init__(self, current: Directory, writers: Iterable[Directory] = ()) -> None:
        """Load the schemas of `current` (readers and writers) and of `writers` (writers only)."""
        self._current_dir = _as_traversable(current)
        self._writer_dirs = tuple(_as_traversable(d) for d in writers)
        self._readers = _load_directory(self._current_dir)
        self._writers: dict[bytes, RegisteredSchema] = {}
        for directory in (self._current_dir, *self._writer_dirs):
            loaded = self._readers if directory is self._current_dir else _load_directory(directory)
            for schema in loaded.values():
                known = self._writers.setdefault(schema.fingerprint, schema)
                if known.canonical_form != schema.canonical_form:
                    raise CodecError(
                        f"fingerprint collision: {schema.full_name} in {directory} "
                        f"and {known.full_name}"
                    )
        self._read_plans: dict[bytes, _ReadPlan] = {}
        for fingerprint, writer in self._writers.items():
            reader = self._readers.get(writer.full_name)
            resolve = reader is not None and reader.fingerprint != fingerprint
            self._read_plans[fingerprint] = _ReadPlan(
                writer.full_name,
                writer.schema,
                reader.schema if resolve and reader else None,
                None if resolve else compile_reader(writer.schema),
            )
        self._write_plans: dict[str, _WritePlan] = {}
        for schema in self._readers.values():
            check = _compile(schema.schema, {})
            self._write_plans[schema.full_name] = _WritePlan(
                schema.full_name,
                schema.header,
                check,
                schema.schema,
                compile_writer(schema.schema, schema.header),
            )

    @classmethod
    def default(cls) -> SchemaRegistry:
        """Return the (cached) registry of the installed `schemas` package and its releases."""
        return _default_registry()

    def with_writers(self, *directories: Directory) -> SchemaRegistry:
        """Return a new registry that also knows the writer schemas in `directories`."""
        return SchemaRegistry(
            self._current_dir, (*self._writer_dirs, *(_as_traversable(d) for d in directories))
        )

    def reader(self, full_name: str) -> RegisteredSchema:
        """Return the current (reader and writer) schema named `full_name`."""
        try:
            return self._readers[full_name]
        except KeyError:
            raise CodecError(f"no current schema named {full_name!r}") from None

    def writer(self, fingerprint: bytes) -> RegisteredSchema:
        """Return the writer schema with this fingerprint (UnknownFingerprintError if none)."""
        try:
            return self._writers[fingerprint]
        except KeyError:
            raise UnknownFingerprintError(
                f"no known schema has fingerprint {fingerprint.hex()}"
            ) from None

    def knows(self, fingerprint: bytes) -> bool:
        """Whether some known writer schema has this fingerprint."""
        return fingerprint in self._read_plans

    @property
    def reader_names(self) -> frozenset[str]:
        """Full names of the current schemas."""
        return frozenset(self._readers)

    @property
    def fingerprints(self) -> frozenset[bytes]:
        """Fingerprints of every known writer schema (current, released and extra)."""
        return frozenset(self._writers)

    def _read_plan(self, fingerprint: bytes) -> _ReadPlan | None:
        return self._read_plans.get(fingerprint)

    def _write_plan(self, full_name: str) -> _WritePlan:
        try:
            return self._write_plans[full_name]
        except KeyError:
            raise CodecError(f"no current schema named {full_name!r}") from None


def _released_dirs(package: Traversable) -> list[Traversable]:
    released = package / "released"
    if not released.is_dir():
        return []
    return sorted((d for d in released.iterdir() if d.is_dir()), key=lambda d: d.name)


@functools.cache
def _default_registry() -> SchemaRegistry:
    package = files("schemas")
    return SchemaRegistry(package, _released_dirs(package))


# -- the codec -----------------------------------------------------------------------------------


class EventCodec:
    """Encodes and decodes session events and decisions (Avro single-object encoding)."""

    payload_schema_name = staticmethod(payload_schema_name)

    def __init__(self, registry: SchemaRegistry | None = None) -> None:
        """Use `registry`, or the default registry of the installed schemas."""
        self._registry = registry if registry is not None else SchemaRegistry.default()
        self._envelope = self._registry._write_plan(ENVELOPE_SCHEMA)
        self._decision = self._registry._write_plan(DECISION_SCHEMA)
        self._question_change = self._registry._write_plan(QUESTION_CHANGE_SCHEMA)
        self._snapshot = self._registry._write_plan(SNAPSHOT_SCHEMA)
        self._checkpoint = self._registry._write_plan(SNAPSHOT_CHECKPOINT_SCHEMA)
        self._payloads = {t: self._registry._write_plan(n) for t, n in PAYLOAD_SCHEMAS.items()}
        self._plans = self._registry._read_plans  # fingerprint -> plan: one lookup per record
        # The current envelope, read straight into the Event's fields.
        envelope = self._registry.reader(ENVELOPE_SCHEMA)
        self._envelope_fingerprint = envelope.fingerprint
        self._read_envelope: TupleReader | None = None
        if [f["name"] for f in envelope.schema["fields"]] == list(_ENVELOPE_FIELDS):
            self._read_envelope = compile_tuple_reader(envelope.schema)

    @property
    def registry(self) -> SchemaRegistry:
        """The schemas this codec reads and writes with."""
        return self._registry

    def encode(self, event: Event) -> bytes:
        """Encode `event` as an Envelope record (EncodeError if its type or payload misfits)."""
        plan = self._payloads.get(event.type)
        if plan is None:
            raise EncodeError(f"unknown event type {event.type!r}: no payload schema")
        what = f"{event.type} payload"
        if not event.payload_readable:
            raise EncodeError(f"{what}: was not readable when decoded; re-encoding would lose it")
        payload = event.payload
        if plan.full_name == _TOOL_CALLED_SCHEMA and isinstance(payload, Mapping):
            arguments = payload.get("arguments", {})
            if not isinstance(arguments, Mapping):
                raise EncodeError(f"{what}: arguments: expected a JSON object (mapping)")
            try:
                text = canonical_json(arguments)
            except EncodeError as e:
                raise EncodeError(f"{what}: arguments.{e}") from None
            payload = {**payload, "arguments": text}
        body = self._write(plan, payload, what)
        envelope = {
            "event_id": event.event_id,
            "session_id": event.session_id,
            "type": event.type,
            "occurred_at": event.occurred_at,
            "producer": event.producer,
            "expected_seq": event.expected_seq,
            "payload": body,
        }
        return self._write(self._envelope, envelope, f"{event.type} envelope")

    def encode_decision(self, decision: Mapping[str, Any]) -> bytes:
        """Encode a decision record (EncodeError if it does not fit the Decision schema)."""
        return self._write(self._decision, decision, "decision")

    def decode(self, data: bytes) -> Event:
        """Decode an Envelope record; an unknown payload schema gives `payload_readable=False`."""
        if (
            type(data) is bytes
            and self._read_envelope is not None
            and data[2:HEADER_SIZE] == self._envelope_fingerprint
            and data.startswith(MARKER)
        ):
            # The current envelope (every record a current writer makes): no dict in between.
            try:
                event_id, session_id, event_type, occurred_at, producer, expected_seq, body = (
                    self._read_envelope(data, HEADER_SIZE)
                )
            except TrailingBytesError as e:
                raise CorruptRecordError(f"envelope: {e}") from None
            except _READ_ERRORS as e:
                raise CorruptRecordError(f"envelope: {type(e).__name__}: {e}") from e
        else:
            _, envelope = self._read(data, ENVELOPE_SCHEMA, "envelope")
            event_id, session_id, event_type, occurred_at, producer, expected_seq, body = (
                envelope[name] for name in _ENVELOPE_FIELDS
            )
        if len(body) < HEADER_SIZE or not body.startswith(MARKER):
            raise CorruptRecordError(
                f"{event_type} payload: not a single-object-encoded Avro record"
            )
        plan = self._plans.get(body[2:HEADER_SIZE])
        if plan is None:  # a payload schema this build does not know: the fold skips the event
            return Event(
                event_id, session_id, event_type, occurred_at, producer, {}, expected_seq, False
            )
        full_name = plan.full_name
        expected = _PAYLOAD_SCHEMA_OF.get(event_type)
        if expected is not None and full_name != expected:
            raise CorruptRecordError(
                f"{event_type} payload: expected a {expected} record, got {full_name}"
            )
        read = plan.compiled
        if read is None:
            payload = self._read_resolving(body, plan, f"{event_type} payload")
        else:  # `_body` in line: this runs once per event
            try:
                payload = read(body, HEADER_SIZE)
            except TrailingBytesError as e:
                raise CorruptRecordError(f"{event_type} payload: {e}") from None
            except _READ_ERRORS as e:
                raise CorruptRecordError(f"{event_type} payload: {type(e).__name__}: {e}") from e
        if full_name == _TOOL_CALLED_SCHEMA:
            payload["arguments"] = _parse_arguments(payload["arguments"], event_type)
        return Event(
            event_id, session_id, event_type, occurred_at, producer, payload, expected_seq, True
        )

    def decode_decision(self, data: bytes) -> dict[str, Any]:
        """Decode a Decision record."""
        return self._read(data, DECISION_SCHEMA, "decision")[1]

    def encode_question_change(self, change: Mapping[str, Any]) -> bytes:
        """Encode a QuestionChange record (EncodeError if it does not fit its schema)."""
        return self._write(self._question_change, change, "question change")

    def decode_question_change(self, data: bytes) -> dict[str, Any]:
        """Decode a QuestionChange record."""
        return self._read(data, QUESTION_CHANGE_SCHEMA, "question change")[1]

    def encode_snapshot(self, snapshot: Mapping[str, Any]) -> bytes:
        """Encode a Snapshot record (EncodeError if it does not fit its schema)."""
        return self._write(self._snapshot, snapshot, "snapshot")

    def decode_snapshot(self, data: bytes) -> dict[str, Any]:
        """Decode a Snapshot record (CorruptRecordError, UnknownFingerprintError)."""
        return self._read(data, SNAPSHOT_SCHEMA, "snapshot")[1]

    def encode_checkpoint(self, checkpoint: Mapping[str, Any]) -> bytes:
        """Encode a SnapshotCheckpoint record."""
        return self._write(self._checkpoint, checkpoint, "snapshot checkpoint")

    def decode_checkpoint(self, data: bytes) -> dict[str, Any]:
        """Decode a SnapshotCheckpoint record."""
        return self._read(data, SNAPSHOT_CHECKPOINT_SCHEMA, "snapshot checkpoint")[1]

    def _write(self, plan: _WritePlan, value: Any, what: str) -> bytes:
        fast = plan.fast
        if fast is not None:
            try:
                return fast(value)
            except _FAST_MISSES:
                pass  # the checked path writes it in the same bytes, or says what does not fit
        try:
            record = plan.check(value)
        except _Misfit as e:
            where = e.where()
            problem = f"{where}: {e.problem}" if where else e.problem
            raise EncodeError(f"{what}: {problem}") from None
        buffer = BytesIO()
        buffer.write(plan.header)
        try:
            schemaless_writer(buffer, plan.schema, record)
        except _WRITE_ERRORS as e:
            raise EncodeError(f"{what}: {e}") from e
        return buffer.getvalue()

    def _read(
        self, data: bytes, expected: str | None, what: str, event_type: str | None = None
    ) -> tuple[str, dict[str, Any]]:
        """Read one single-object record; `expected` is the full name it must have, if known.

        `what` names the record in errors (prefixed with `event_type` when given); the message is
        only formatted when there is an error.
        """
        if type(data) is not bytes:
            if not isinstance(data, bytes | bytearray | memoryview):
                raise CorruptRecordError(
                    f"{_what(what, event_type)}: expected bytes, got {type(data).__name__}"
                )
            data = bytes(data)  # the compiled readers slice bytes
        if len(data) < HEADER_SIZE or not data.startswith(MARKER):
            raise CorruptRecordError(
                f"{_what(what, event_type)}: not a single-object-encoded Avro record"
            )
        fingerprint = data[2:HEADER_SIZE]
        plan = self._plans.get(fingerprint)
        if plan is None:
            raise UnknownFingerprintError(
                f"{_what(what, event_type)}: no known schema has fingerprint {fingerprint.hex()}"
            )
        if expected is not None and plan.full_name != expected:
            raise CorruptRecordError(
                f"{_what(what, event_type)}: expected a {expected} record, got {plan.full_name}"
            )
        return plan.full_name, self._body(data, plan, what, event_type)

    def _body(
        self, data: bytes, plan: _ReadPlan, what: str, event_type: str | None = None
    ) -> dict[str, Any]:
        """The record after the header: compiled reader, or fastavro when it must resolve."""
        if plan.compiled is None:
            return self._read_resolving(data, plan, _what(what, event_type))
        try:
            return plan.compiled(data, HEADER_SIZE)
        except TrailingBytesError as e:
            raise CorruptRecordError(f"{_what(what, event_type)}: {e}") from None
        except _READ_ERRORS as e:
            raise CorruptRecordError(f"{_what(what, event_type)}: {type(e).__name__}: {e}") from e

    def _read_resolving(self, data: bytes, plan: _ReadPlan, what: str) -> dict[str, Any]:
        """Read with fastavro: a body whose writer schema must be resolved against the reader."""
        stream = BytesIO(data)
        stream.seek(HEADER_SIZE)
        try:
            record = schemaless_reader(stream, plan.writer, plan.reader)
        except SchemaResolutionError as e:
            raise CodecError(
                f"{what}: writer schema {data[2:HEADER_SIZE].hex()} of {plan.full_name} does not "
                f"resolve against the current reader schema: {e}"
            ) from e
        except _READ_ERRORS as e:
            raise CorruptRecordError(f"{what}: {type(e).__name__}: {e}") from e
        if stream.tell() != len(data):
            raise CorruptRecordError(f"{what}: {len(data) - stream.tell()} trailing bytes")
        if not isinstance(record, dict):
            raise CorruptRecordError(f"{what}: {plan.full_name} is not a record")
        return record


def _what(what: str, event_type: str | None) -> str:
    return what if event_type is None else f"{event_type} {what}"


_WIDE = re.compile(r"[0-9]{19}")
_WIDE_BYTES = re.compile(rb"[0-9]{19}")


def _maybe_wide_integer(text: Any) -> bool:
    """Whether `text` holds a run of 19 digits (where an integer beyond 64 bits would be)."""
    if isinstance(text, bytes):
        return _WIDE_BYTES.search(text) is not None
    return isinstance(text, str) and _WIDE.search(text) is not None


def _parse_arguments(text: Any, event_type: str) -> dict[str, Any]:
    # orjson first (several times faster). It refuses NaN, lone surrogates and very deep nesting,
    # and reads an integer beyond 64 bits as a float: for those (any run of 19 digits may be one)
    # the standard parser decides, so the result is always `json.loads`'s.
    try:
        if _maybe_wide_integer(text):
            raise orjson.JSONDecodeError("a wide integer", "", 0)
        arguments = orjson.loads(text)
    except (orjson.JSONDecodeError, TypeError):
        try:
            arguments = json.loads(text)
            # What the standard parser takes and the projection could not write back: a lone
            # surrogate is no UTF-8 (the fold digests arguments, the commit stores them).
            json.dumps(arguments, ensure_ascii=False).encode("utf-8")
        except (TypeError, ValueError, RecursionError) as e:  # nested deeper than Python recurses
            raise CorruptRecordError(f"{event_type} payload: arguments are not JSON: {e}") from e
    if not isinstance(arguments, dict):
        raise CorruptRecordError(f"{event_type} payload: arguments are not a JSON object")
    if _nesting(text) > MAX_ARGUMENT_DEPTH and _depth(arguments) > MAX_ARGUMENT_DEPTH:
        raise CorruptRecordError(
            f"{event_type} payload: arguments nest deeper than {MAX_ARGUMENT_DEPTH} levels"
        )
    return arguments


def _nesting(text: Any) -> float:
    """An upper bound of the text's nesting: its opening brackets (counted in C)."""
    if isinstance(text, bytes):
        return text.count(b"{") + text.count(b"[")
    return text.count("{") + text.count("[") if isinstance(text, str) else math.inf


def _depth(value: Any) -> int:
    """How deep a parsed JSON value nests (iteratively: it may be deeper than Python recurses)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            items: Any = item.values()
        elif isinstance(item, list):
            items = item
        else:
            continue
        deepest = max(deepest, level)
        if deepest > MAX_ARGUMENT_DEPTH:
            return deepest
        stack.extend((child, level + 1) for child in items)
    return deepest
