"""Avro binary writers compiled from a schema: the fast path of every record the codec writes.

The codec's checked path — a check per field that also explains a misfit, then
`fastavro.schemaless_writer` interpreting the schema — cost about 40 µs for one QuestionChange,
and the worker writes one per question opened or closed (a tenth of its time in the bench's
profile), the producer two records per event. A writer compiled here is Python source generated
once per schema: one function per record type that checks each field's type and appends its
encoding in line, and returns bytes equal to what the checked path writes.

It takes a value only as the checked path would, and only in its plainest form: records as
`dict`, arrays as `list` or `tuple`, strings as `str`, integers as `int` in range, instants as
timezone-aware `datetime`. Anything else — a misfit, or a fit in another form (a `Mapping` that is
not a dict, `bytearray`, an `int` subclass) — raises `Unfit` (or the error its encoding raised),
and the codec takes its checked path, which writes it or says exactly what does not fit. So the
compiled writer never changes what is written or which values are refused, only how fast.

Schemas with a union other than `["null", X]`, or a default this module does not encode, are not
compiled (`compile_writer` returns None) and stay on the checked path.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any, Final

from schemas.events import utc_millis

__all__ = ["Unfit", "Writer", "compile_writer", "zigzag_varint"]

Writer = Callable[[Any], bytes]
"""Encodes one record (after the given prefix); raises `Unfit` for a value it does not take."""

_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)
_INT: Final = (-(2**31), 2**31 - 1)
_LONG: Final = (-(2**63), 2**63 - 1)
_SMALL: Final = tuple(bytes([z]) for z in range(128))  # varints of one byte


class Unfit(Exception):  # noqa: N818 - a signal: the checked path decides
    """The compiled writer does not take this value as it is."""


_UNFIT: Final = Unfit()
_MISSING: Final = object()


def zigzag_varint(n: int) -> bytes:
    """The Avro encoding of the int or long `n` (zig-zag, then a base-128 varint)."""
    z = (n << 1) ^ (n >> 63)
    if z < 128:
        return _SMALL[z]
    out = bytearray()
    while z >= 128:
        out.append((z & 0x7F) | 0x80)
        z >>= 7
    out.append(z)
    return bytes(out)


def _millis(moment: datetime) -> int:
    """A timezone-aware datetime as fastavro writes a timestamp-millis (after `utc_millis`)."""
    # In UTC already (what the decoder and the model make), `utc_millis` would change nothing
    # but the microseconds, which the floor division drops as well.
    delta = (moment if moment.tzinfo is UTC else utc_millis(moment)) - _EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1000 + delta.microseconds // 1000


class _Untranslatable(Exception):  # noqa: N818 - internal: this schema is left to fastavro
    pass


class _Compiler:
    """Generates one function per record type, appending to a bytearray `out`."""

    def __init__(self) -> None:
        self.functions: list[str] = []
        self.names: dict[str, str] = {}  # Avro full/short name -> generated function
        self.enums: dict[str, str] = {}  # Avro name -> the global holding its symbol indexes
        self.env: dict[str, Any] = {
            "UNFIT": _UNFIT,
            "MISSING": _MISSING,
            "zz": zigzag_varint,
            "millis": _millis,
            "datetime": datetime,
            "pack_float": struct.Struct("<f").pack,
            "pack_double": struct.Struct("<d").pack,
        }
        self.counter = itertools.count()

    def constant(self, value: Any) -> str:
        name = f"C{next(self.counter)}"
        self.env[name] = value
        return name

    def value(self, schema: Any, x: str, indent: str) -> list[str]:
        """Lines that check `x` against `schema` and append its encoding to `out`."""
        if isinstance(schema, list):
            return self.union(schema, x, indent)
        if isinstance(schema, str):
            if schema in self.names:
                return [f"{indent}{self.names[schema]}({x}, out)"]
            if schema in self.enums:
                return self.enum_lines(self.enums[schema], x, indent)
            return self.primitive(schema, x, indent)
        kind = schema["type"]
        if kind == "long" and schema.get("logicalType") == "timestamp-millis":
            return [
                f"{indent}if type({x}) is not datetime or {x}.tzinfo is None: raise UNFIT",
                f"{indent}out += zz(millis({x}))",
            ]
        if kind in ("record", "error"):
            return [f"{indent}{self.record(schema)}({x}, out)"]
        if kind == "enum":
            return self.enum_lines(self.enum(schema), x, indent)
        if kind == "array":
            item = f"i{next(self.counter)}"
            return [
                f"{indent}if type({x}) is not list and type({x}) is not tuple: raise UNFIT",
                f"{indent}if {x}:",
                f"{indent}    out += zz(len({x}))",
                f"{indent}    for {item} in {x}:",
                *self.value(schema["items"], item, indent + "        "),
                f"{indent}out += b'\\x00'",
            ]
        if kind == "map":
            key, item = f"k{next(self.counter)}", f"i{next(self.counter)}"
            return [
                f"{indent}if type({x}) is not dict: raise UNFIT",
                f"{indent}if {x}:",
                f"{indent}    out += zz(len({x}))",
                f"{indent}    for {key}, {item} in {x}.items():",
                *self.primitive("string", key, indent + "        "),
                *self.value(schema["values"], item, indent + "        "),
                f"{indent}out += b'\\x00'",
            ]
        if isinstance(kind, str) and kind in _PRIMITIVES:  # other logical types: as underlying
            return self.primitive(kind, x, indent)
        raise _Untranslatable(f"type {kind!r}")

    def primitive(self, name: str, x: str, indent: str) -> list[str]:
        if name == "null":
            return [f"{indent}if {x} is not None: raise UNFIT"]
        if name == "boolean":
            return [
                f"{indent}if {x} is True: out += b'\\x01'",
                f"{indent}elif {x} is False: out += b'\\x00'",
                f"{indent}else: raise UNFIT",
            ]
        if name in ("int", "long"):
            low, high = _INT if name == "int" else _LONG
            return [
                f"{indent}if type({x}) is not int or not {low} <= {x} <= {high}: raise UNFIT",
                f"{indent}if 0 <= {x} < 64: out.append({x} << 1)",
                f"{indent}else: out += zz({x})",
            ]
        if name in ("float", "double"):
            pack = "pack_float" if name == "float" else "pack_double"
            return [
                f"{indent}if type({x}) is not float and type({x}) is not int: raise UNFIT",
                f"{indent}out += {pack}({x})",
            ]
        if name == "string":
            b = f"b{next(self.counter)}"
            return [
                f"{indent}if type({x}) is not str: raise UNFIT",
                f"{indent}{b} = {x}.encode()",
                f"{indent}if len({b}) < 64: out.append(len({b}) << 1)",
                f"{indent}else: out += zz(len({b}))",
                f"{indent}out += {b}",
            ]
        if name == "bytes":
            return [
                f"{indent}if type({x}) is not bytes: raise UNFIT",
                f"{indent}out += zz(len({x}))",
                f"{indent}out += {x}",
            ]
        raise _Untranslatable(f"named type {name!r} not defined before its use")

    def union(self, branches: list[Any], x: str, indent: str) -> list[str]:
        if len(branches) != 2 or branches[0] != "null":
            raise _Untranslatable("a union other than [null, X]")
        return [
            f"{indent}if {x} is None:",
            f"{indent}    out += b'\\x00'",
            f"{indent}else:",
            f"{indent}    out += b'\\x02'",
            *self.value(branches[1], x, indent + "    "),
        ]

    def enum(self, schema: Mapping[str, Any]) -> str:
        indexes = self.constant({s: zigzag_varint(i) for i, s in enumerate(schema["symbols"])})
        for name in _names(schema):
            self.enums[name] = indexes
        return indexes

    def enum_lines(self, indexes: str, x: str, indent: str) -> list[str]:
        return [
            f"{indent}if type({x}) is not str or {x} not in {indexes}: raise UNFIT",
            f"{indent}out += {indexes}[{x}]",
        ]

    def record(self, schema: Mapping[str, Any]) -> str:
        function = f"w{next(self.counter)}"
        for name in _names(schema):
            self.names[name] = function  # before the fields: a recursive reference resolves
        fields = schema["fields"]
        known = self.constant(frozenset(f["name"] for f in fields))
        lines = [
            f"def {function}(v, out):",
            "    if type(v) is not dict or not v.keys() <= " + known + ": raise UNFIT",
        ]
        for f in fields:
            x = f"x{next(self.counter)}"
            if "default" in f:
                default = self.constant(self.default(f["type"], f["default"]))
                lines.append(f"    {x} = v.get({f['name']!r}, MISSING)")
                lines.append(f"    if {x} is MISSING:")
                lines.append(f"        out += {default}")
                lines.append("    else:")
                lines.extend(self.value(f["type"], x, "        "))
            else:
                lines.append(f"    {x} = v[{f['name']!r}]")  # KeyError: the checked path says so
                lines.extend(self.value(f["type"], x, "    "))
        self.functions.append("\n".join(lines))
        return function

    def default(self, schema: Any, value: Any) -> bytes:
        """The encoding of a field's default (what fastavro writes for the missing field)."""
        if isinstance(schema, list):  # a union's default is of its first branch
            if value is None and schema[0] == "null":
                return b"\x00"
            raise _Untranslatable("a union default other than null")
        kind = schema if isinstance(schema, str) else schema["type"]
        if kind == "boolean" and isinstance(value, bool):
            return b"\x01" if value else b"\x00"
        if kind in ("int", "long") and type(value) is int:
            return zigzag_varint(value)
        if kind == "string" and isinstance(value, str):
            data = value.encode()
            return zigzag_varint(len(data)) + data
        if kind in ("array", "map") and not value:
            return b"\x00"
        raise _Untranslatable(f"a default of type {kind!r}")


_PRIMITIVES: Final = frozenset(
    {"null", "boolean", "int", "long", "float", "double", "string", "bytes"}
)


def _names(schema: Mapping[str, Any]) -> tuple[str, ...]:
    """The names a named type is referred to by: its full name and its short name."""
    name: str = schema["name"]
    namespace = schema.get("namespace")
    if "." in name or not namespace:
        return (name, name.rpartition(".")[2])
    return (f"{namespace}.{name}", name)


def compile_writer(schema: Any, prefix: bytes = b"") -> Writer | None:
    """A writer of records of a parsed (fastavro) schema, each after `prefix`; None if this
    module does not translate the schema (the checked path then writes every record)."""
    compiler = _Compiler()
    try:
        top = compiler.value(schema, "v", "    ")
    except _Untranslatable:
        return None
    head = compiler.constant(bytes(prefix))
    write = ["def write(v):", f"    out = bytearray({head})", *top, "    return bytes(out)"]
    source = "\n\n".join([*compiler.functions, "\n".join(write)])
    namespace = dict(compiler.env)
    exec(compile(source, f"<avro writer {_title(schema)}>", "exec"), namespace)
    writer: Writer = namespace["write"]
    return writer


def _title(schema: Any) -> str:
    return str(schema.get("name", "?")) if isinstance(schema, Mapping) else "?"
