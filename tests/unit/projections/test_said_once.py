"""Damaged entries named once each, within a bound."""

from __future__ import annotations

from projections.said_once import SaidOnce


def test_a_key_is_named_once_until_it_reads_again() -> None:
    said = SaidOnce()
    assert said.first("s1") and not said.first("s1")
    said.forget(["s1", "s2"])  # read fine again
    assert said.first("s1")


def test_past_its_limit_every_key_is_forgotten_and_named_again() -> None:
    said = SaidOnce(limit=2)
    assert said.first("a") and said.first("b")
    assert said.first("c")  # the bound: a and b forgotten
    assert said.first("a") and not said.first("c")
