"""SessionPolicy: the five rules and their order, the questions it asks, and the ancestor ceiling.

Spec: "Autonomy, policy and signatures" in session-model.md.
"""

from __future__ import annotations

import itertools
import json
from datetime import UTC, datetime

import pytest

from producers.store import SessionStore
from schemas.errors import InvalidAnswerError, MissingCeilingError, PolicyError
from session_model.modes import Mode, strictest
from session_model.policy import (
    APPROVAL,
    SessionPolicy,
    Verdict,
    ceiling_for,
    check_signature_answer,
    permission_question,
    signature_question,
)
from session_model.session import Session
from tests.unit.builders import OPERATOR

T0 = datetime(2026, 1, 1, 10, 0, 0, tzinfo=UTC)


def _store() -> SessionStore:
    counter = itertools.count(1)
    return SessionStore.in_memory(
        signer=OPERATOR, clock=lambda: T0, new_id=lambda: f"ev-{next(counter)}"
    )


def _root(mode: str = "ask", granted: tuple[str, ...] = ()) -> Session:
    store = _store()
    store.start("root", "goal", mode)
    for op in granted:
        store.grant("root", op)
    return store.load("root")


def _child(mode: str = "auto") -> Session:
    store = _store()
    store.start("parent", "goal", "auto")
    store.start("child", "goal", mode, parent_id="parent")
    return store.load("child")


POLICY = SessionPolicy()

# -- rule 1: a child without a ceiling fails closed -------------------------------------------


def test_child_without_ceiling_raises_missing_ceiling() -> None:
    child = _child("auto")
    with pytest.raises(MissingCeilingError):
        POLICY.decide(child, "deploy", mutating=True, requires_signature=False)


def test_child_without_ceiling_raises_even_when_signature_required() -> None:
    child = _child("auto")
    with pytest.raises(MissingCeilingError):
        POLICY.decide(child, "deploy", mutating=True, requires_signature=True)


def test_child_without_ceiling_raises_even_for_a_read() -> None:
    child = _child("auto")
    with pytest.raises(MissingCeilingError):
        POLICY.decide(child, "read", mutating=False, requires_signature=False)


def test_missing_ceiling_is_a_policy_error() -> None:
    assert issubclass(MissingCeilingError, PolicyError)


def test_root_without_ceiling_decides() -> None:
    root = _root("auto")
    verdict = POLICY.decide(root, "deploy", mutating=True, requires_signature=False)
    assert verdict is Verdict.ALLOW


# -- rule 2: the signature beats grants and modes ----------------------------------------------


def test_signature_required_beats_a_grant() -> None:
    root = _root("ask", granted=("deploy",))
    verdict = POLICY.decide(root, "deploy", mutating=True, requires_signature=True)
    assert verdict is Verdict.REQUIRE_SIGNATURE


def test_signature_required_beats_auto_mode() -> None:
    root = _root("auto")
    verdict = POLICY.decide(root, "deploy", mutating=True, requires_signature=True)
    assert verdict is Verdict.REQUIRE_SIGNATURE


def test_signature_required_beats_auto_mode_and_grant_for_a_child_with_ceiling() -> None:
    child = _child("auto")
    verdict = POLICY.decide(
        child, "deploy", mutating=True, requires_signature=True, ceiling=Mode.AUTO
    )
    assert verdict is Verdict.REQUIRE_SIGNATURE


def test_signature_required_even_for_a_non_mutating_operation() -> None:
    root = _root("auto")
    verdict = POLICY.decide(root, "read", mutating=False, requires_signature=True)
    assert verdict is Verdict.REQUIRE_SIGNATURE


# -- rule 3: reading is never asked ---------------------------------------------------------------


def test_reading_is_allowed_in_ask_mode() -> None:
    root = _root("ask")
    verdict = POLICY.decide(root, "read", mutating=False, requires_signature=False)
    assert verdict is Verdict.ALLOW


def test_reading_is_allowed_for_a_child_under_an_ask_ceiling() -> None:
    child = _child("ask")
    verdict = POLICY.decide(
        child, "read", mutating=False, requires_signature=False, ceiling=Mode.ASK
    )
    assert verdict is Verdict.ALLOW


# -- rule 4: a grant allows in ask mode -----------------------------------------------------------


def test_grant_allows_mutation_in_ask_mode() -> None:
    root = _root("ask", granted=("deploy",))
    verdict = POLICY.decide(root, "deploy", mutating=True, requires_signature=False)
    assert verdict is Verdict.ALLOW


def test_grant_names_only_its_operation() -> None:
    root = _root("ask", granted=("deploy",))
    verdict = POLICY.decide(root, "delete", mutating=True, requires_signature=False)
    assert verdict is Verdict.ASK_PERMISSION


def test_grant_allows_under_an_ask_ceiling() -> None:
    store = _store()
    store.start("parent", "goal", "ask")
    store.start("child", "goal", "ask", parent_id="parent")
    store.grant("child", "deploy")
    child = store.load("child")
    verdict = POLICY.decide(
        child, "deploy", mutating=True, requires_signature=False, ceiling=Mode.ASK
    )
    assert verdict is Verdict.ALLOW


def test_revoked_grant_asks_again() -> None:
    store = _store()
    store.start("root", "goal", "ask")
    store.grant("root", "deploy")
    store.revoke("root", "deploy")
    verdict = POLICY.decide(store.load("root"), "deploy", mutating=True, requires_signature=False)
    assert verdict is Verdict.ASK_PERMISSION


# -- rule 5: effective mode = strictest(mode, ceiling) --------------------------------------------


def test_ask_mode_asks_permission_for_a_mutation() -> None:
    root = _root("ask")
    verdict = POLICY.decide(root, "deploy", mutating=True, requires_signature=False)
    assert verdict is Verdict.ASK_PERMISSION


@pytest.mark.parametrize("mode", ["acknowledge", "auto"])
def test_acknowledge_and_auto_allow_a_mutation(mode: str) -> None:
    root = _root(mode)
    verdict = POLICY.decide(root, "deploy", mutating=True, requires_signature=False)
    assert verdict is Verdict.ALLOW


def test_child_auto_under_ask_ceiling_asks_permission() -> None:
    child = _child("auto")
    verdict = POLICY.decide(
        child, "deploy", mutating=True, requires_signature=False, ceiling=Mode.ASK
    )
    assert verdict is Verdict.ASK_PERMISSION


@pytest.mark.parametrize("ceiling", [Mode.ACKNOWLEDGE, Mode.AUTO])
def test_child_auto_under_acknowledge_or_auto_ceiling_is_allowed(ceiling: Mode) -> None:
    child = _child("auto")
    verdict = POLICY.decide(
        child, "deploy", mutating=True, requires_signature=False, ceiling=ceiling
    )
    assert verdict is Verdict.ALLOW


def test_child_in_ask_mode_under_auto_ceiling_still_asks() -> None:
    child = _child("ask")
    verdict = POLICY.decide(
        child, "deploy", mutating=True, requires_signature=False, ceiling=Mode.AUTO
    )
    assert verdict is Verdict.ASK_PERMISSION


def test_root_given_an_ask_ceiling_asks() -> None:
    root = _root("auto")
    verdict = POLICY.decide(
        root, "deploy", mutating=True, requires_signature=False, ceiling=Mode.ASK
    )
    assert verdict is Verdict.ASK_PERMISSION


def test_verdict_values_are_stable() -> None:
    assert [v.value for v in Verdict] == ["allow", "ask_permission", "require_signature"]


# -- strictest ------------------------------------------------------------------------------------

_ORDER = [Mode.ASK, Mode.ACKNOWLEDGE, Mode.AUTO]


@pytest.mark.parametrize("a", _ORDER)
@pytest.mark.parametrize("b", _ORDER)
def test_strictest_follows_ask_acknowledge_auto_and_is_symmetric(a: Mode, b: Mode) -> None:
    expected = _ORDER[min(_ORDER.index(a), _ORDER.index(b))]
    assert strictest(a, b) is expected
    assert strictest(b, a) is expected


def test_strictest_explicit_pairs() -> None:
    assert strictest(Mode.AUTO, Mode.ACKNOWLEDGE) is Mode.ACKNOWLEDGE
    assert strictest(Mode.ACKNOWLEDGE, Mode.ASK) is Mode.ASK
    assert strictest(Mode.AUTO, Mode.ASK) is Mode.ASK


@pytest.mark.parametrize("mode", _ORDER)
def test_strictest_with_no_ceiling_is_the_mode(mode: Mode) -> None:
    assert strictest(mode, None) is mode


# -- permission_question / signature_question -----------------------------------------------------


def test_permission_question_shape() -> None:
    q = permission_question("deploy", {"target": "prod", "force": True})
    assert q.id == "perm:deploy"
    assert q.options == ("yes", "no")
    assert q.reason == "permission"
    assert q.why == '{"force":true,"target":"prod"}'
    assert q.expires_at is None


def test_permission_question_why_is_canonical_whatever_the_key_order() -> None:
    a = permission_question("deploy", {"b": 1, "a": {"z": 2, "y": 3}})
    b = permission_question("deploy", {"a": {"y": 3, "z": 2}, "b": 1})
    assert a.why == b.why == '{"a":{"y":3,"z":2},"b":1}'
    assert json.loads(a.why) == {"a": {"y": 3, "z": 2}, "b": 1}


def test_permission_question_passes_expires_at_through() -> None:
    q = permission_question("deploy", {}, expires_at="2026-01-01T10:05:00.000Z")
    assert q.expires_at == "2026-01-01T10:05:00.000Z"
    assert q.why == "{}"


def test_signature_question_has_no_options() -> None:
    q = signature_question("transfer", {"amount": 10})
    assert q.id == "sign:transfer"
    assert q.options == ()
    assert q.reason == "signature"
    assert q.why == '{"amount":10}'


@pytest.mark.parametrize(
    "operation",
    ["drop_table\u202e\u2066staging\u2069", "rm\u200b", "a\x1b[2Jb", "x" * 513, "line\u2028two"],
)
def test_a_call_whose_operation_would_not_read_as_signed_is_not_signed(operation: str) -> None:
    """The agent names the operation: one that shows as another name (bidirectional overrides,
    zero-width or control characters) is refused before anything is signed."""
    q = signature_question(operation, {"target": "prod"})
    with pytest.raises(InvalidAnswerError, match="would not read as the name signed") as e:
        check_signature_answer(q, APPROVAL)
    assert "\u202e" not in str(e.value) and "\x1b" not in str(e.value)  # written out
    check_signature_answer(signature_question("drop_table «staging»", {}), APPROVAL)  # shows


def test_signature_question_passes_expires_at_through() -> None:
    q = signature_question("transfer", {}, expires_at="2026-01-01T10:05:00+02:00")
    assert q.expires_at == "2026-01-01T10:05:00+02:00"


def test_asked_permission_question_pauses_with_reason_permission() -> None:
    store = _store()
    store.start("root", "goal", "ask")
    store.ask("root", permission_question("deploy", {"target": "prod"}))
    s = store.load("root")
    assert s.question is not None
    assert s.question.id == "perm:deploy"
    assert s.is_runnable() is False
    assert dict(s.pauses) == {"permission": 1}


# -- ceiling_for ----------------------------------------------------------------------------------


def _chain(*modes: str) -> SessionStore:
    """s0 (root) <- s1 <- s2 ... with the given modes."""
    store = _store()
    parent = None
    for i, mode in enumerate(modes):
        store.start(f"s{i}", "goal", mode, parent_id=parent)
        parent = f"s{i}"
    return store


def _lookup(store: SessionStore):  # type: ignore[no-untyped-def]
    return store.projections.load


def test_ceiling_for_root_is_none() -> None:
    store = _chain("ask")
    assert ceiling_for(store.load("s0"), _lookup(store)) is None


def test_ceiling_for_child_is_parent_mode() -> None:
    store = _chain("acknowledge", "auto")
    assert ceiling_for(store.load("s1"), _lookup(store)) is Mode.ACKNOWLEDGE


def test_ceiling_ignores_the_child_own_mode() -> None:
    store = _chain("auto", "ask")
    assert ceiling_for(store.load("s1"), _lookup(store)) is Mode.AUTO


def test_ceiling_is_strictest_over_the_whole_chain_grandparent_ask_beats_parent_auto() -> None:
    store = _chain("ask", "auto", "auto")
    assert ceiling_for(store.load("s2"), _lookup(store)) is Mode.ASK


def test_ceiling_over_chain_middle_acknowledge() -> None:
    store = _chain("auto", "acknowledge", "auto", "auto")
    assert ceiling_for(store.load("s3"), _lookup(store)) is Mode.ACKNOWLEDGE


def test_ceiling_is_resolved_at_ask_time_not_copied_at_birth() -> None:
    store = _chain("auto", "auto", "auto")
    child = store.load("s2")
    assert ceiling_for(child, _lookup(store)) is Mode.AUTO
    store.set_mode("s0", "ask")
    # The same child value, asked again: the ancestor's new mode applies.
    assert ceiling_for(child, _lookup(store)) is Mode.ASK
    verdict = POLICY.decide(
        child,
        "deploy",
        mutating=True,
        requires_signature=False,
        ceiling=ceiling_for(child, _lookup(store)),
    )
    assert verdict is Verdict.ASK_PERMISSION


def test_ceiling_loosens_when_the_ancestor_loosens() -> None:
    store = _chain("ask", "auto")
    assert ceiling_for(store.load("s1"), _lookup(store)) is Mode.ASK
    store.set_mode("s0", "auto")
    assert ceiling_for(store.load("s1"), _lookup(store)) is Mode.AUTO


def test_ceiling_with_missing_parent_is_ask() -> None:
    store = _store()
    store.start("orphan", "goal", "auto", parent_id="ghost")
    assert ceiling_for(store.load("orphan"), _lookup(store)) is Mode.ASK


def test_ceiling_with_missing_grandparent_is_ask() -> None:
    store = _store()
    store.start("p", "goal", "auto", parent_id="ghost")
    store.start("c", "goal", "auto", parent_id="p")
    assert ceiling_for(store.load("c"), _lookup(store)) is Mode.ASK


def test_ceiling_with_a_cycle_is_ask() -> None:
    store = _store()
    store.start("a", "goal", "auto", parent_id="b")
    store.start("b", "goal", "auto", parent_id="a")
    assert ceiling_for(store.load("a"), _lookup(store)) is Mode.ASK
    assert ceiling_for(store.load("b"), _lookup(store)) is Mode.ASK


def test_ceiling_with_a_cycle_above_the_child_is_ask() -> None:
    store = _store()
    store.start("a", "goal", "auto", parent_id="b")
    store.start("b", "goal", "auto", parent_id="a")
    store.start("c", "goal", "auto", parent_id="a")
    assert ceiling_for(store.load("c"), _lookup(store)) is Mode.ASK


def test_ceiling_with_self_parent_is_ask() -> None:
    store = _store()
    store.start("me", "goal", "auto", parent_id="me")
    assert ceiling_for(store.load("me"), _lookup(store)) is Mode.ASK


def test_ceiling_with_plain_dict_lookup() -> None:
    parent = Session("p", started=True, mode=Mode.ACKNOWLEDGE)
    child = Session("c", started=True, mode=Mode.AUTO, parent_id="p")
    assert ceiling_for(child, {"p": parent}.get) is Mode.ACKNOWLEDGE
    assert ceiling_for(child, {}.get) is Mode.ASK


# -- SessionStore.ceiling_for ---------------------------------------------------------------------


def test_store_ceiling_for_root_is_none() -> None:
    store = _chain("auto")
    assert store.ceiling_for("s0") is None


def test_store_ceiling_for_grandchild_is_strictest_of_chain() -> None:
    store = _chain("ask", "auto", "auto")
    assert store.ceiling_for("s2") is Mode.ASK
    assert store.ceiling_for("s1") is Mode.ASK


def test_store_ceiling_for_follows_a_later_mode_change() -> None:
    store = _chain("auto", "auto")
    assert store.ceiling_for("s1") is Mode.AUTO
    store.set_mode("s0", "acknowledge")
    assert store.ceiling_for("s1") is Mode.ACKNOWLEDGE


def test_store_ceiling_for_missing_ancestor_is_ask() -> None:
    store = _store()
    store.start("c", "goal", "auto", parent_id="ghost")
    assert store.ceiling_for("c") is Mode.ASK


def test_store_ceiling_for_cycle_is_ask() -> None:
    store = _store()
    store.start("a", "goal", "auto", parent_id="b")
    store.start("b", "goal", "auto", parent_id="a")
    assert store.ceiling_for("a") is Mode.ASK


def test_store_ceiling_for_feeds_decide() -> None:
    store = _chain("ask", "auto")
    child = store.load("s1")
    verdict = POLICY.decide(
        child,
        "deploy",
        mutating=True,
        requires_signature=False,
        ceiling=store.ceiling_for("s1"),
    )
    assert verdict is Verdict.ASK_PERMISSION
