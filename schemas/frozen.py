"""A cheaper `__init__` for the frozen, slotted dataclasses made once or more per event.

A frozen dataclass's generated `__init__` sets each field with `object.__setattr__(self, name,
value)` (its own `__setattr__` refuses), looked up and dispatched by name every time: about 0.1 µs a
field, which made `Outcome` (10 fields) cost more than a third of folding a turn. `fast_init`
replaces it with one that stores each slot through the slot's own descriptor, bound once when the
class is made. Same signature, same defaults, same instance: still frozen afterwards, equal,
hashed and printed by the dataclass's own methods. It is applied to the values the decode and the
fold build per event (`Event`, `Record`, `Position`, `Step`, `Outcome`, `Turn`, …), not to
everything.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Final, TypeVar

__all__ = ["fast_init"]

T = TypeVar("T")


class _Factory:
    def __repr__(self) -> str:
        return "<factory>"  # what `inspect.signature` shows for such a default, as dataclasses do


_FACTORY: Final = _Factory()


def fast_init(cls: type[T]) -> type[T]:
    """Give a frozen, slotted dataclass an `__init__` that sets slots by descriptor (decorator).

    Apply it above `@dataclass(frozen=True, slots=True)`. Refuses what it would not reproduce
    exactly: `__post_init__`, keyword-only or non-init fields.
    """
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen or "__slots__" not in cls.__dict__:
        raise TypeError(f"{cls.__name__}: fast_init needs a frozen dataclass with slots")
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"{cls.__name__}: fast_init does not run __post_init__")
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    for f in fields:
        if not f.init or f.kw_only:
            raise TypeError(f"{cls.__name__}.{f.name}: fast_init supports positional fields only")
    names = [f.name for f in fields]
    setters = [cls.__dict__[name].__set__ for name in names]  # the slots' member descriptors
    # A field with a default factory gets a sentinel default, replaced by a fresh value per call.
    defaults = [
        _FACTORY if f.default_factory is not dataclasses.MISSING else f.default for f in fields
    ]
    factories = [f.default_factory for f in fields]
    signature = ", ".join(
        name
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        else f"{name}=_d{i}"
        for i, (name, f) in enumerate(zip(names, fields, strict=True))
    )
    lines = []
    for i, (name, f) in enumerate(zip(names, fields, strict=True)):
        if f.default_factory is not dataclasses.MISSING:
            lines.append(f"        if {name} is _FACTORY:")
            lines.append(f"            {name} = _f{i}()")
        lines.append(f"        _s{i}(self, {name})")
    body = "\n".join(lines) or "        pass"
    count = len(names)
    source = (
        "def _make(setters, defaults, factories):\n"
        f"    ({''.join(f'_s{i}, ' for i in range(count))}) = setters\n"
        f"    ({''.join(f'_d{i}, ' for i in range(count))}) = defaults\n"
        f"    ({''.join(f'_f{i}, ' for i in range(count))}) = factories\n"
        f"    def __init__(self, {signature}):\n{body}\n"
        "    return __init__\n"
    )
    namespace: dict[str, Any] = {"_FACTORY": _FACTORY}
    exec(compile(source, f"<fast_init {cls.__qualname__}>", "exec"), namespace)
    init = namespace["_make"](setters, defaults, factories)
    original = cls.__dict__["__init__"]
    init.__qualname__ = original.__qualname__
    init.__module__ = original.__module__
    init.__annotations__ = dict(original.__annotations__)
    init.__doc__ = original.__doc__
    setattr(cls, "__init__", init)  # noqa: B010 - mypy refuses assigning a method directly
    return cls
