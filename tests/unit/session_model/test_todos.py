"""Todos: versions, lineage, origin, touches, replaces, inheritance and transfers (spec: "Todos",
`todos_transferred`, "Writes that span two sessions")."""

from __future__ import annotations

import itertools
import uuid
from datetime import UTC, datetime

import pytest

from producers.store import SessionStore
from schemas import events as ev
from schemas.errors import InvalidCall
from session_model.fold import Kind, step
from session_model.session import InheritedFrom, OpenCard, Session, Todo
from tests.unit.builders import (
    OPERATOR,
    fold_all,
    interrupted_transfer,
    make_event,
    plan,
    started,
    todo,
    tool,
)


def _card(session: Session, todo_id: str) -> Todo:
    card = session.todo(todo_id)
    assert card is not None
    return card


# -- birth ----------------------------------------------------------------------------------------


def test_card_is_born_at_version_one_with_no_lineage():
    s = fold_all([started(), todo("a", "write tests")])
    assert _card(s, "a") == Todo(
        id="a",
        text="write tests",
        status="pending",
        version=1,
        supersedes=None,
        from_status=None,
        origin="planned",
        mutations_at=0,
        plan_version=0,
        born_in_plan=0,
        replaces=None,
        inherited_from=None,
        transferred_to=None,
    )


def test_card_born_done_does_not_claim_to_come_from_pending():
    s = fold_all([started(), tool("make"), todo("a", "built", "done")])
    card = _card(s, "a")
    assert card.version == 1
    assert card.from_status is None
    assert card.supersedes is None


@pytest.mark.parametrize(
    ("status", "tools_before", "origin"),
    [
        ("pending", 0, "planned"),
        ("in_progress", 0, "planned"),
        ("blocked", 0, "planned"),
        ("pending", 1, "discovered"),
        ("in_progress", 2, "discovered"),
        ("blocked", 1, "discovered"),
        ("done", 1, "retrospective"),
        ("done", 0, "unsupported"),
    ],
)
def test_origin_is_derived_from_status_and_tool_calls_so_far(status, tools_before, origin):
    events = [started(), *[tool(f"t{i}") for i in range(tools_before)], todo("a", "A", status)]
    s = fold_all(events)
    assert _card(s, "a").origin == origin


def test_origin_counts_non_mutating_tool_calls_too():
    s = fold_all([started(), tool("ls", mutating=False), todo("a", "A")])
    assert _card(s, "a").origin == "discovered"


def test_card_born_done_without_tools_is_accepted_as_unsupported():
    s = fold_all([started(), todo("a", "claimed", "done")])
    assert s.rejections == ()
    assert _card(s, "a").origin == "unsupported"
    assert _card(s, "a").status == "done"


def test_origin_survives_every_move():
    s = fold_all(
        [
            started(),
            todo("a", "A"),  # planned
            tool("make", mutating=True),
            todo("a", "A", "in_progress"),
            todo("a", "A", "done"),
        ]
    )
    card = _card(s, "a")
    assert card.origin == "planned"
    assert card.version == 3


def test_unsupported_origin_survives_reopening():
    s = fold_all([started(), todo("a", "A", "done"), tool("x"), todo("a", "A", "pending")])
    assert _card(s, "a").origin == "unsupported"


# -- moves ----------------------------------------------------------------------------------------


def test_status_change_bumps_version_and_records_lineage():
    s = fold_all([started(), todo("a", "A"), todo("a", "A", "in_progress")])
    card = _card(s, "a")
    assert (card.version, card.supersedes, card.from_status, card.status) == (
        2,
        1,
        "pending",
        "in_progress",
    )


def test_text_change_bumps_version_and_records_lineage():
    s = fold_all([started(), todo("a", "A"), todo("a", "A, better")])
    card = _card(s, "a")
    assert (card.version, card.supersedes, card.from_status, card.text) == (
        2,
        1,
        "pending",
        "A, better",
    )


def test_successive_moves_chain_versions():
    s = fold_all(
        [
            started(),
            todo("a", "A"),
            todo("a", "A", "in_progress"),
            todo("a", "A", "blocked"),
            todo("a", "A", "done"),
        ]
    )
    card = _card(s, "a")
    assert (card.version, card.supersedes, card.from_status) == (4, 3, "blocked")


def test_same_text_and_status_keeps_version_and_nulls_lineage():
    s = fold_all(
        [started(), todo("a", "A"), todo("a", "A", "in_progress"), todo("a", "A", "in_progress")]
    )
    card = _card(s, "a")
    assert (card.version, card.supersedes, card.from_status) == (2, None, None)
    assert card.status == "in_progress"


def test_same_text_and_status_is_still_a_touch_updating_mutations_at_and_plan_version():
    s = fold_all(
        [
            started(),
            todo("a", "A"),
            tool("w", mutating=True),
            tool("w", mutating=True),
            plan("P1"),
            todo("a", "A"),
        ]
    )
    card = _card(s, "a")
    assert (card.version, card.supersedes, card.from_status) == (1, None, None)
    assert card.mutations_at == 2
    assert card.plan_version == 1
    assert card.born_in_plan == 0


def test_unchanged_touch_event_stays_in_log_as_applied():
    events = [started(), todo("a", "A"), todo("a", "A")]
    state = Session("s1")
    outcomes = []
    for e in events:
        result = step(state, e)
        outcomes.append(result.outcome)
        state = result.state
    assert outcomes[-1].kind is Kind.APPLIED
    assert outcomes[-1].seq == 3
    assert state.seq == 3


def test_mutations_at_is_session_mutations_at_last_touch():
    s = fold_all(
        [
            started(),
            tool("w", mutating=True),
            todo("a", "A"),
            tool("w", mutating=True),
            tool("r", mutating=False),
            tool("w", mutating=True),
            todo("a", "A", "done"),
        ]
    )
    assert _card(s, "a").mutations_at == 3


def test_born_in_plan_never_moves_while_plan_version_follows():
    s = fold_all(
        [
            started(),
            plan("P1"),
            todo("a", "A"),
            plan("P2"),
            plan("P3"),
            todo("a", "A", "in_progress"),
        ]
    )
    card = _card(s, "a")
    assert card.born_in_plan == 1
    assert card.plan_version == 3


def test_plan_change_alone_does_not_touch_cards():
    s = fold_all([started(), todo("a", "A"), plan("P1"), plan("P2")])
    card = _card(s, "a")
    assert card.plan_version == 0
    assert card.version == 1


def test_other_cards_untouched_by_a_move():
    s = fold_all([started(), todo("a", "A"), todo("b", "B"), todo("b", "B", "done")])
    assert _card(s, "a").version == 1
    assert _card(s, "a").status == "pending"
    assert [t.id for t in s.todos] == ["a", "b"]


# -- replaces -------------------------------------------------------------------------------------


def test_replaces_is_recorded_as_declared():
    s = fold_all([started(), todo("a", "A"), todo("b", "B", replaces="a")])
    assert _card(s, "b").replaces == "a"


def test_replaces_stays_when_a_later_change_omits_it():
    s = fold_all([started(), todo("a", "A"), todo("b", "B", replaces="a"), todo("b", "B", "done")])
    assert _card(s, "b").replaces == "a"


def test_replaces_declared_on_a_later_move_is_recorded():
    s = fold_all([started(), todo("a", "A"), todo("b", "B"), todo("b", "B", replaces="a")])
    assert _card(s, "b").replaces == "a"


def test_replaces_is_never_guessed():
    s = fold_all([started(), todo("a", "deploy"), todo("b", "deploy")])
    assert _card(s, "b").replaces is None


def test_replaced_card_is_untouched():
    s = fold_all(
        [
            started(),
            todo("a", "A", "in_progress"),
            tool("w", mutating=True),
            todo("b", "B", replaces="a"),
        ]
    )
    a = _card(s, "a")
    assert (a.status, a.version, a.mutations_at) == ("in_progress", 1, 0)
    assert [t.id for t in s.pending_todos()] == ["a", "b"]


# -- inheritance (the target side of a transfer) --------------------------------------------------


def _inherited_todo(todo_id, text, status, *, session, version, origin, **kw):
    payload = {
        "id": todo_id,
        "text": text,
        "status": status,
        "inherited_from": {"session": session, "version": version, "origin": origin},
    }
    return make_event(ev.TODO_CHANGED, payload, **kw)


def test_inherited_card_is_born_at_version_one_with_source_origin():
    s = fold_all(
        [
            started(session_id="s2"),
            _inherited_todo(
                "a",
                "A",
                "in_progress",
                session="s1",
                version=4,
                origin="discovered",
                session_id="s2",
            ),
        ]
    )
    card = _card(s, "a")
    assert (card.version, card.supersedes, card.from_status, card.origin) == (
        1,
        None,
        None,
        "discovered",
    )
    assert card.inherited_from == InheritedFrom("s1", 4, "discovered")
    assert card.status == "in_progress"


def test_inherited_origin_wins_over_the_targets_own_tool_calls():
    s = fold_all(
        [
            started(session_id="s2"),
            tool("x", session_id="s2"),
            _inherited_todo(
                "a", "A", "pending", session="s1", version=1, origin="planned", session_id="s2"
            ),
        ]
    )
    assert _card(s, "a").origin == "planned"


def test_inherited_card_keeps_origin_and_inheritance_through_moves():
    s = fold_all(
        [
            started(session_id="s2"),
            _inherited_todo(
                "a", "A", "pending", session="s1", version=2, origin="planned", session_id="s2"
            ),
            tool("x", session_id="s2"),
            todo("a", "A", "done", session_id="s2"),
        ]
    )
    card = _card(s, "a")
    assert card.origin == "planned"
    assert card.inherited_from == InheritedFrom("s1", 2, "planned")
    assert (card.version, card.supersedes, card.from_status) == (2, 1, "pending")


# -- pending vs open ------------------------------------------------------------------------------


def test_pending_todos_are_cards_not_done_blocked_included():
    s = fold_all(
        [
            started(),
            todo("a", "A"),
            todo("b", "B", "in_progress"),
            todo("c", "C", "blocked"),
            todo("d", "D", "done"),
        ]
    )
    assert [t.id for t in s.pending_todos()] == ["a", "b", "c"]
    assert [t.id for t in s.open_todos()] == ["a", "b", "c"]


def test_transferred_card_is_pending_but_not_open():
    s = fold_all(
        [
            started(),
            todo("a", "A"),
            todo("b", "B"),
            make_event(ev.TODOS_TRANSFERRED, {"to": "s2", "todos": [{"id": "a", "version": 1}]}),
        ]
    )
    assert [t.id for t in s.pending_todos()] == ["a", "b"]
    assert [t.id for t in s.open_todos()] == ["b"]


def test_todos_transferred_leaves_source_cards_unchanged_but_disposition():
    s = fold_all(
        [
            started(),
            todo("a", "A", "in_progress"),
            make_event(ev.TODOS_TRANSFERRED, {"to": "s2", "todos": [{"id": "a", "version": 1}]}),
        ]
    )
    card = _card(s, "a")
    assert (card.status, card.version, card.text) == ("in_progress", 1, "A")
    assert card.disposition == "transferred"
    assert card.transferred_to == "s2"


def test_card_not_transferred_has_open_disposition():
    s = fold_all([started(), todo("a", "A")])
    assert _card(s, "a").disposition == "open"


# -- SessionStore.transfer_open_todos -------------------------------------------------------------


def _store():
    ids = itertools.count(1)
    return SessionStore.in_memory(
        signer=OPERATOR,
        clock=lambda: datetime(2025, 1, 1, 12, 0, tzinfo=UTC),
        new_id=lambda: f"id-{next(ids)}",
    )


def _source_with_cards(store):
    store.start("src", "g")
    store.start("dst", "g")
    store.set_todo("src", "a", "A")  # planned
    store.record_tool_call("src", "make", {}, "ok", mutating=True)
    store.set_todo("src", "b", "B", "in_progress")  # discovered
    store.set_todo("src", "b", "B", "blocked")  # v2
    store.set_todo("src", "c", "C", "done")  # retrospective, not moved


def test_transfer_moves_open_cards_and_returns_count():
    store = _store()
    _source_with_cards(store)
    assert store.transfer_open_todos("src", "dst") == 2
    dst = store.load("dst")
    assert [(t.id, t.text, t.status, t.version, t.origin, t.inherited_from) for t in dst.todos] == [
        ("a", "A", "pending", 1, "planned", InheritedFrom("src", 1, "planned")),
        ("b", "B", "blocked", 1, "discovered", InheritedFrom("src", 2, "discovered")),
    ]


def test_transfer_writes_target_first_then_source_record():
    store = _store()
    _source_with_cards(store)
    before = len(store.log.records)
    store.transfer_open_todos("src", "dst")
    written = [(r.event.session_id, r.event.type) for r in store.log.records[before:]]
    assert written == [
        ("dst", ev.TODO_CHANGED),
        ("dst", ev.TODO_CHANGED),
        ("src", ev.TODOS_TRANSFERRED),
    ]
    source_record = store.log.records[-1].event.payload
    assert source_record["to"] == "dst"
    assert [dict(t) for t in source_record["todos"]] == [
        {"id": "a", "version": 1},
        {"id": "b", "version": 2},
    ]


def test_transfer_leaves_source_cards_with_transferred_disposition():
    store = _store()
    _source_with_cards(store)
    store.transfer_open_todos("src", "dst")
    src = store.load("src")
    assert [(t.id, t.status, t.version, t.disposition) for t in src.todos] == [
        ("a", "pending", 1, "transferred"),
        ("b", "blocked", 2, "transferred"),
        ("c", "done", 1, "open"),
    ]
    assert store.open_todos("src") == ()
    assert [t.id for t in store.load("src").pending_todos()] == ["a", "b"]


def test_transfer_with_no_open_cards_returns_zero_and_writes_nothing():
    store = _store()
    store.start("src", "g")
    store.start("dst", "g")
    store.set_todo("src", "a", "A", "done")
    before = len(store.log.records)
    assert store.transfer_open_todos("src", "dst") == 0
    assert len(store.log.records) == before


def test_already_transferred_cards_are_not_moved_again():
    store = _store()
    _source_with_cards(store)
    assert store.transfer_open_todos("src", "dst") == 2
    before = len(store.log.records)
    dst_before = store.load("dst")
    assert store.transfer_open_todos("src", "dst") == 0
    assert len(store.log.records) == before
    assert store.load("dst") == dst_before


def test_only_cards_open_now_are_moved_by_a_second_transfer():
    store = _store()
    _source_with_cards(store)
    store.transfer_open_todos("src", "dst")
    store.set_todo("src", "d", "D")
    assert store.transfer_open_todos("src", "dst") == 1
    assert [t.id for t in store.load("dst").todos] == ["a", "b", "d"]


def _interrupted_transfer(store, monkeypatch):
    """A transfer that wrote the target's cards and died before the source's record."""
    _source_with_cards(store)
    interrupted_transfer(store, monkeypatch, "src", "dst")


def test_rerunning_an_interrupted_transfer_completes_it_without_duplicates(monkeypatch):
    store = _store()
    _interrupted_transfer(store, monkeypatch)

    interrupted_dst = store.load("dst")
    assert [t.id for t in interrupted_dst.todos] == ["a", "b"]
    assert [t.id for t in store.open_todos("src")] == ["a", "b"]  # source not yet told

    assert store.transfer_open_todos("src", "dst") == 2
    dst = store.load("dst")
    assert [(t.id, t.version, t.inherited_from) for t in dst.todos] == [
        ("a", 1, InheritedFrom("src", 1, "planned")),
        ("b", 1, InheritedFrom("src", 2, "discovered")),
    ]
    assert dst.seq == interrupted_dst.seq  # nothing sent to the target again
    assert dst.rejections == ()
    assert store.open_todos("src") == ()
    transferred = [r for r in store.log.records if r.event.type == ev.TODOS_TRANSFERRED]
    assert len(transferred) == 1


@pytest.mark.parametrize("checks", [True, False])
def test_a_rerun_after_both_cards_moved_on_keeps_the_targets_progress(monkeypatch, checks):
    """Interrupted after the target got its cards; then the source edits one (a new version, so
    the re-run's event would have a new id) and the target finishes it. The re-run must not send
    the source's card again: it would move the target's card back to pending. (With checks off
    too: the target is read all the same.)"""
    store = _store()
    store.checks = checks
    _interrupted_transfer(store, monkeypatch)
    store.set_todo("src", "a", "A, reworded")  # v2 at the source
    store.set_todo("dst", "a", "A", "done")  # the target finished it meanwhile
    before = len(store.log.records)

    assert store.transfer_open_todos("src", "dst") == 2
    written = [(r.event.session_id, r.event.type) for r in store.log.records[before:]]
    assert written == [("src", ev.TODOS_TRANSFERRED)]  # nothing sent to the target again
    dst = store.load("dst")
    assert [(t.id, t.text, t.status, t.version, t.inherited_from) for t in dst.todos] == [
        ("a", "A", "done", 2, InheritedFrom("src", 1, "planned")),
        ("b", "B", "blocked", 1, InheritedFrom("src", 2, "discovered")),
    ]
    assert [dict(t) for t in store.log.records[-1].event.payload["todos"]] == [
        {"id": "a", "version": 1},  # the version the target holds
        {"id": "b", "version": 2},
    ]
    assert store.open_todos("src") == ()


def test_a_rerun_brings_the_target_a_source_edit_to_a_card_it_did_not_touch(monkeypatch):
    store = _store()
    _interrupted_transfer(store, monkeypatch)
    store.set_todo("src", "a", "A, reworded", "blocked")  # v2 at the source; dst's a untouched
    before = len(store.log.records)

    assert store.transfer_open_todos("src", "dst") == 2
    written = [(r.event.session_id, r.event.type) for r in store.log.records[before:]]
    assert written == [("dst", ev.TODO_CHANGED), ("src", ev.TODOS_TRANSFERRED)]  # a, then record
    dst = store.load("dst")
    assert [(t.id, t.text, t.status) for t in dst.todos] == [
        ("a", "A, reworded", "blocked"),
        ("b", "B", "blocked"),
    ]
    assert [dict(t) for t in store.log.records[-1].event.payload["todos"]] == [
        {"id": "a", "version": 2},
        {"id": "b", "version": 2},
    ]


# The derivation of a transfer's ids before they were keyed: uuid5 of a namespace in the source.
_PUBLIC_NAMESPACE = uuid.UUID("6f1c1d8e-3b0a-4c55-9a57-6d696c706121")
_NOTE = {"tool": "note", "arguments": {}, "result": "ok", "ok": True, "mutating": False}


def test_an_agent_of_the_target_cannot_squat_a_transferred_cards_id():
    """An agent that appends to the target, first, an event under the id a card's transfer will
    carry (as the public derivation let anyone work out) would have the card dropped as its
    duplicate; keyed ids cannot be foreseen, so the card arrives."""
    store = _store()
    _source_with_cards(store)
    for card_id, version in (("a", 1), ("b", 2)):
        squat = uuid.uuid5(_PUBLIC_NAMESPACE, f"transfer:src:dst:{card_id}:{version}")
        store.append(store.event("dst", ev.TOOL_CALLED, _NOTE, event_id=str(squat)))
    assert store.transfer_open_todos("src", "dst") == 2
    assert [t.id for t in store.load("dst").todos] == ["a", "b"]
    assert store.load("dst").rejections == ()


def _transfer_ids(id_key: bytes | None) -> list[str]:
    """The ids one transfer of `_source_with_cards` gets from a store with `id_key`."""
    store = SessionStore.in_memory(signer=OPERATOR, id_key=id_key)
    _source_with_cards(store)
    before = len(store.log.records)
    store.transfer_open_todos("src", "dst")
    return [r.event.event_id for r in store.log.records[before:]]


def test_stores_sharing_an_id_key_give_a_transfer_the_same_ids_and_no_one_else_does():
    """A re-run from another process with the deployment's key sends the same ids (duplicates the
    fold drops); stores without one, or with another, give other ids."""
    shared = _transfer_ids(b"k" * 32)
    assert len(shared) == len(set(shared)) == 3
    assert _transfer_ids(b"k" * 32) == shared
    assert set(_transfer_ids(b"o" * 32)).isdisjoint(shared)
    assert set(_transfer_ids(None)).isdisjoint(_transfer_ids(None))


def test_no_two_transfers_share_an_id_whatever_their_ids_hold():
    """The names ids derive from were joined with `:`, `,` and `@`: an agent of the source that
    named a card `a@1,b` made a later transfer of cards `a` and `b` carry the first one's record
    id, dropped as its duplicate (the cards stayed open at the source)."""
    store = _store()
    store.start("src", "g")
    store.start("dst", "g")
    store.set_todo("src", "a@1,b", "one card")
    assert store.transfer_open_todos("src", "dst") == 1
    store.set_todo("src", "a", "A")
    store.set_todo("src", "b", "B")
    assert store.transfer_open_todos("src", "dst") == 2
    assert store.open_todos("src") == ()
    assert [t.id for t in store.load("dst").todos] == ["a@1,b", "a", "b"]
    store.start("S", "g")
    store.start("S:dst:x", "g")
    store.set_todo("S", "x:dst:c", "C")  # transfer:S:dst:x:dst:c:1, as S:dst:x's card c below
    store.set_todo("S:dst:x", "c", "C")
    assert store.transfer_open_todos("S", "dst") == 1
    assert store.transfer_open_todos("S:dst:x", "dst") == 1
    assert [t.id for t in store.load("dst").todos][-2:] == ["x:dst:c", "c"]


def test_a_short_id_key_is_refused():
    with pytest.raises(InvalidCall, match="16 bytes"):
        SessionStore.in_memory(id_key=b"short")


def test_transferred_card_appears_in_open_work_with_target():
    store = _store()
    _source_with_cards(store)
    store.transfer_open_todos("src", "dst")
    store.set_todo("src", "e", "E")
    store.end("src", "handed over")
    src = store.load("src")
    assert src.open_work == (
        OpenCard("a", "pending", 1, "transferred", 1, to="dst"),
        OpenCard("b", "blocked", 2, "transferred", 0, to="dst"),
        OpenCard("e", "pending", 1, "open", 0),
    )
    entry = next(e for e in store.timeline("src") if e["kind"] == "open-work")
    assert entry["todos"] == [
        {
            "id": "a",
            "status": "pending",
            "version": 1,
            "disposition": "transferred",
            "mutations_since": 1,
            "to": "dst",
        },
        {
            "id": "b",
            "status": "blocked",
            "version": 2,
            "disposition": "transferred",
            "mutations_since": 0,
            "to": "dst",
        },
        {"id": "e", "status": "pending", "version": 1, "disposition": "open", "mutations_since": 0},
    ]
