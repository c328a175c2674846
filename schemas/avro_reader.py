"""Avro binary readers compiled from a schema: the decode path of every record the codec reads.

`fastavro.schemaless_reader` interprets the schema on every call (a dispatch per field, a
`read()` on a file object per value), which made reading an event's two small records cost
about 6.5 µs. A reader compiled here is Python source generated once per schema: one function per
record type whose body reads each field in line — varints, string slices, union branches — from
the bytes and an offset, and returns the same dict fastavro returns. It reads a body written with
the very same schema; schema resolution (an older writer schema against the current reader) is
left to fastavro, and so is any type this module does not compile (`compile_reader` returns
None).

Damaged input raises `EOFError`, `IndexError`, `ValueError` (including `UnicodeDecodeError`) or
`OverflowError`, and `TrailingBytesError` when the record ends before the bytes do; the codec
wraps them all as `CorruptRecordError`. Every loop is bounded by the input: an array's declared
count can never exceed the bytes left, since every compiled item type takes at least one byte.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any, Final

__all__ = [
    "Reader",
    "TrailingBytesError",
    "TupleReader",
    "compile_reader",
    "compile_tuple_reader",
]

Reader = Callable[[bytes, int], dict[str, Any]]
"""Reads the record whose body starts at the offset and ends exactly at the end of the bytes."""

TupleReader = Callable[[bytes, int], tuple[Any, ...]]
"""The same, returning the record's fields as a tuple in schema order."""

_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)
_MILLISECOND: Final = timedelta(milliseconds=1)


class TrailingBytesError(ValueError):
    """The record ended before its bytes did."""

    def __init__(self, count: int) -> None:
        super().__init__(f"{count} trailing bytes")
        self.count = count


def _varint(buf: bytes, pos: int, first: int) -> tuple[int, int]:
    """The rest of a varint whose first byte (`first`, high bit set) was read: raw value, offset.

    Unrolled for up to six bytes (a timestamp in milliseconds takes six); IndexError past the end.
    """
    n = first & 0x7F
    b = buf[pos]
    n |= (b & 0x7F) << 7
    if b < 0x80:
        return n, pos + 1
    b = buf[pos + 1]
    n |= (b & 0x7F) << 14
    if b < 0x80:
        return n, pos + 2
    b = buf[pos + 2]
    n |= (b & 0x7F) << 21
    if b < 0x80:
        return n, pos + 3
    b = buf[pos + 3]
    n |= (b & 0x7F) << 28
    if b < 0x80:
        return n, pos + 4
    b = buf[pos + 4]
    n |= (b & 0x7F) << 35
    if b < 0x80:
        return n, pos + 5
    pos += 5
    shift = 42
    while True:
        b = buf[pos]
        pos += 1
        n |= (b & 0x7F) << shift
        if b < 0x80:
            return n, pos
        shift += 7


class _Unsupported(Exception):  # noqa: N818 - internal signal: leave this schema to fastavro
    pass


class _Compiler:
    """Generates the source of one reader function per named record of a schema."""

    def __init__(self, named: Mapping[str, Any]) -> None:
        self.named = named  # full name -> parsed schema (fastavro's `__named_schemas`)
        self.functions: dict[str, str] = {}  # full name -> generated function name
        self.sources: list[str] = []
        self.counter = itertools.count()

    def record_function(self, schema: Mapping[str, Any]) -> str:
        """The function reading a record of this type: `(buf, pos, end) -> (dict, pos)`."""
        name: str = schema["name"]
        if name in self.functions:
            return self.functions[name]
        function = f"_read_{len(self.functions)}"
        self.functions[name] = function  # before the fields: a recursive type refers to itself
        lines, value = self.fields(schema, as_tuple=False)
        body = "\n".join(lines) if lines else "    pass"
        self.sources.append(f"def {function}(buf, pos, end):\n{body}\n    return {value}, pos\n")
        return function

    def root_function(self, schema: Mapping[str, Any], as_tuple: bool) -> None:
        """`read(buf, pos)`: the top record read in line, and the check that it ends the bytes."""
        lines, value = self.fields(schema, as_tuple)
        body = "\n".join(lines)
        self.sources.append(
            "def read(buf, pos):\n"
            "    end = len(buf)\n"
            f"{body}\n"
            "    if pos != end:\n"
            "        if pos > end:\n"
            "            raise EOFError('the record is longer than its bytes')\n"
            "        raise TrailingBytesError(end - pos)\n"
            f"    return {value}\n"
        )

    def fields(self, schema: Mapping[str, Any], as_tuple: bool) -> tuple[list[str], str]:
        """The lines reading every field of a record, and the expression of the value read."""
        if not schema["fields"]:
            raise _Unsupported("a record without fields takes no bytes")
        lines: list[str] = []
        targets = []
        for field in schema["fields"]:
            target = self.var()
            self.emit(field["type"], target, lines, "    ")
            targets.append(target)
        if as_tuple:
            return lines, f"({', '.join(targets)},)"
        pairs = zip(schema["fields"], targets, strict=True)
        return lines, "{" + ", ".join(f"{f['name']!r}: {t}" for f, t in pairs) + "}"

    def var(self) -> str:
        return f"v{next(self.counter)}"

    def emit(self, schema: Any, target: str, lines: list[str], ind: str) -> None:
        """Append the lines that read one value of `schema` into `target`."""
        if isinstance(schema, list):
            self.union(schema, target, lines, ind)
            return
        if isinstance(schema, str):
            if schema in _PRIMITIVES:
                self.primitive(schema, target, lines, ind)
                return
            defined = self.named.get(schema)
            if not isinstance(defined, Mapping):
                raise _Unsupported(schema)
            schema = defined
        kind = schema["type"]
        logical = schema.get("logicalType")
        if kind == "long" and logical == "timestamp-millis":
            self.long(target, lines, ind)
            # The instant fastavro gives (epoch + the milliseconds, in UTC), and the same
            # OverflowError for one out of datetime's range; a timedelta multiplied is about five
            # times cheaper than one constructed from keywords.
            lines.append(f"{ind}{target} = _EPOCH + _MILLISECOND * {target}")
            return
        if logical is not None:
            raise _Unsupported(f"logical type {logical}")
        if kind in _PRIMITIVES:
            self.primitive(kind, target, lines, ind)
        elif kind in ("record", "error"):
            lines.append(f"{ind}{target}, pos = {self.record_function(schema)}(buf, pos, end)")
        elif kind == "array":
            self.array(schema["items"], target, lines, ind)
        else:
            raise _Unsupported(kind)

    def primitive(self, kind: str, target: str, lines: list[str], ind: str) -> None:
        if kind == "null":
            lines.append(f"{ind}{target} = None")
        elif kind == "boolean":
            # Any byte but 0 reads as true, as in fastavro.
            lines.append(f"{ind}{target} = buf[pos] != 0")
            lines.append(f"{ind}pos += 1")
        elif kind in ("int", "long"):
            self.long(target, lines, ind)
        elif kind in ("string", "bytes"):
            self.raw(target, lines, ind)  # `target` holds the end offset until it holds the value
            value = f"buf[pos:{target}]" + (".decode()" if kind == "string" else "")
            lines.append(f"{ind}{target}, pos = {value}, {target}")
        else:
            raise _Unsupported(kind)

    def long(self, target: str, lines: list[str], ind: str) -> None:
        """A zig-zag varint; the one-byte case (values -64..63) stays in line."""
        lines.append(f"{ind}{target} = buf[pos]")
        lines.append(f"{ind}pos += 1")
        lines.append(f"{ind}if {target} & 0x80:")
        lines.append(f"{ind}    {target}, pos = _varint(buf, pos, {target})")
        lines.append(f"{ind}{target} = ({target} >> 1) ^ -({target} & 1)")

    def raw(self, target: str, lines: list[str], ind: str) -> None:
        """A length prefix; leaves in `target` the offset where the bytes end."""
        lines.append(f"{ind}{target} = buf[pos]")
        lines.append(f"{ind}pos += 1")
        lines.append(f"{ind}if {target} & 0x80:")
        lines.append(f"{ind}    {target}, pos = _varint(buf, pos, {target})")
        lines.append(f"{ind}if {target} & 1:")
        lines.append(f"{ind}    raise EOFError('negative length')")
        # Not checked against the end here: a slice past the end comes back short and leaves
        # `pos` past the end, where the next read raises IndexError and `read` checks the last.
        lines.append(f"{ind}{target} = pos + ({target} >> 1)")

    def union(self, branches: list[Any], target: str, lines: list[str], ind: str) -> None:
        index = self.var()
        lines.append(f"{ind}{index} = buf[pos]")
        lines.append(f"{ind}pos += 1")
        lines.append(f"{ind}if {index} & 0x80:")
        lines.append(f"{ind}    {index}, pos = _varint(buf, pos, {index})")
        for i, branch in enumerate(branches):
            # The raw (zig-zag) varint of branch i is 2 * i.
            lines.append(f"{ind}{'if' if i == 0 else 'elif'} {index} == {2 * i}:")
            body: list[str] = []
            self.emit(branch, target, body, ind + "    ")
            lines.extend(body)
        lines.append(f"{ind}else:")
        lines.append(f"{ind}    raise IndexError('union branch out of range')")

    def array(self, items: Any, target: str, lines: list[str], ind: str) -> None:
        if self.min_size(items) < 1:
            raise _Unsupported("array items that can take no bytes")
        count, item, ignored = self.var(), self.var(), self.var()
        lines.append(f"{ind}{target} = []")
        self.long(count, lines, ind)
        lines.append(f"{ind}while {count}:")
        inner = ind + "    "
        lines.append(f"{inner}if {count} < 0:")
        lines.append(f"{inner}    {count} = -{count}")
        self.long(ignored, lines, inner + "    ")  # the block's size in bytes: not needed
        lines.append(f"{inner}if {count} > end - pos:")
        lines.append(f"{inner}    raise EOFError('array count past the end of the record')")
        lines.append(f"{inner}for _ in range({count}):")
        body: list[str] = []
        self.emit(items, item, body, inner + "    ")
        lines.extend(body)
        lines.append(f"{inner}    {target}.append({item})")
        self.long(count, lines, inner)

    def min_size(self, schema: Any, seen: frozenset[str] = frozenset()) -> int:
        """The fewest bytes a value of `schema` takes (0 or 1 is all the array check needs)."""
        if isinstance(schema, list):
            return 1  # the branch index
        if isinstance(schema, str):
            if schema in _PRIMITIVES:
                return 0 if schema == "null" else 1
            if schema in seen:
                return 1  # recursive: whatever it is, it was counted where it began
            schema = self.named.get(schema, {"type": "null"})
        kind = schema["type"]
        if kind in ("record", "error"):
            name = schema["name"]
            return min(1, sum(self.min_size(f["type"], seen | {name}) for f in schema["fields"]))
        if kind in _PRIMITIVES:
            return 0 if kind == "null" else 1
        return 1  # arrays and maps: at least the terminating zero count


_PRIMITIVES: Final = frozenset({"null", "boolean", "int", "long", "string", "bytes"})


def compile_reader(schema: Mapping[str, Any]) -> Reader | None:
    """A reader for bodies written with `schema` (a record parsed by fastavro), or None.

    None means the schema uses a type this module does not compile (floats, maps, enums, fixed,
    logical types other than timestamp-millis); read those with fastavro.
    """
    reader: Reader | None = _compile(schema, as_tuple=False)
    return reader


def compile_tuple_reader(schema: Mapping[str, Any]) -> TupleReader | None:
    """Like `compile_reader`, but the record comes back as a tuple of its fields, in order."""
    reader: TupleReader | None = _compile(schema, as_tuple=True)
    return reader


def _compile(schema: Mapping[str, Any], as_tuple: bool) -> Any:
    if schema.get("type") not in ("record", "error"):
        return None
    compiler = _Compiler(dict(schema.get("__named_schemas", {})))
    try:
        compiler.root_function(schema, as_tuple)
    except _Unsupported:
        return None
    namespace: dict[str, Any] = {
        "_varint": _varint,
        "_EPOCH": _EPOCH,
        "_MILLISECOND": _MILLISECOND,
        "TrailingBytesError": TrailingBytesError,
    }
    source = "\n".join(compiler.sources)
    exec(compile(source, f"<avro reader {schema['name']}>", "exec"), namespace)
    return namespace["read"]
