"""Autonomy modes and their strictness order."""

from __future__ import annotations

from enum import StrEnum


class Mode(StrEnum):
    """How much autonomy a session runs with."""

    ASK = "ask"
    ACKNOWLEDGE = "acknowledge"
    AUTO = "auto"


# Written out rather than derived from declaration order: the order is a rule of the model.
_STRICTNESS: dict[Mode, int] = {Mode.ASK: 0, Mode.ACKNOWLEDGE: 1, Mode.AUTO: 2}


def strictest(a: Mode, b: Mode | None) -> Mode:
    """Return the stricter of two modes (`ask` < `acknowledge` < `auto`); None: no limit."""
    if b is None:
        return a
    return a if _STRICTNESS[a] <= _STRICTNESS[b] else b


def less_strict(a: Mode, b: Mode) -> bool:
    """Whether `a` supervises less than `b` (what only an operator's signature may do)."""
    return _STRICTNESS[a] > _STRICTNESS[b]


def parse_mode(value: object) -> Mode | None:
    """Return the Mode named by `value`, or None when it names none."""
    try:
        return Mode(value) if isinstance(value, str) else None
    except ValueError:
        return None
