"""`fast_init`: the same dataclass, built by a cheaper `__init__`."""

from __future__ import annotations

import dataclasses
import inspect
import pickle
from dataclasses import dataclass, field

import pytest

from schemas.events import Event
from schemas.frozen import fast_init
from session_model.fold import Outcome
from session_model.projection import Position
from session_model.session import Session, Todo


@dataclass(frozen=True, slots=True)
class Plain:
    a: int
    b: str = "b"
    c: list[int] = field(default_factory=list)


@fast_init
@dataclass(frozen=True, slots=True)
class Fast:
    a: int
    b: str = "b"
    c: list[int] = field(default_factory=list)


def test_same_signature_defaults_and_values() -> None:
    assert str(inspect.signature(Fast)) == str(inspect.signature(Plain))
    assert dataclasses.astuple(Fast(1)) == dataclasses.astuple(Plain(1)) == (1, "b", [])
    assert dataclasses.astuple(Fast(1, "x", [2])) == (1, "x", [2])
    assert Fast(a=3, c=[1]) == Fast(3, "b", [1])
    assert Fast(1).c is not Fast(1).c  # a fresh value from the factory each time
    with pytest.raises(TypeError):
        Fast()  # type: ignore[call-arg]


def test_still_frozen_hashable_replaceable_and_picklable() -> None:
    position = Position(2, 7)
    with pytest.raises(dataclasses.FrozenInstanceError):
        position.offset = 8  # type: ignore[misc]
    assert hash(position) == hash(Position(2, 7))
    assert Position(1, 9) < position <= Position(2, 7)
    assert dataclasses.replace(position, offset=8) == Position(2, 8)
    assert pickle.loads(pickle.dumps(position)) == position


def test_the_hot_classes_use_it() -> None:
    for cls in (Event, Outcome, Position, Todo):
        assert cls.__init__.__code__.co_filename.startswith("<fast_init"), cls


def test_what_it_would_not_reproduce_is_refused() -> None:
    @dataclass(frozen=True, slots=True)
    class WithPostInit:
        a: int

        def __post_init__(self) -> None:
            pass

    @dataclass(frozen=True, slots=True)
    class KeywordOnly:
        a: int = field(kw_only=True)

    @dataclass(frozen=True)
    class NoSlots:
        a: int

    @dataclass(slots=True)
    class NotFrozen:
        a: int

    for cls in (WithPostInit, KeywordOnly, NoSlots, NotFrozen):
        with pytest.raises(TypeError):
            fast_init(cls)


def test_session_evolve_refuses_unknown_fields() -> None:
    session = Session("s")
    assert session.evolve(goal="g") == Session("s", goal="g")
    with pytest.raises(TypeError, match="nope"):
        session.evolve(nope=1)
