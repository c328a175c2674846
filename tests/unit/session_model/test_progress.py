"""Effects and progress: did a window of calls measurably grow anything?

Spec: "Effects and progress" and the `session.effect_observed` / `session.tool_called` rows.
"""

from __future__ import annotations

import itertools
from datetime import UTC, datetime

from producers.store import SessionStore
from schemas import events as ev
from session_model.fold import fold
from session_model.progress import ProgressReceipt, ProgressStatus
from tests.unit.builders import OPERATOR

T0 = datetime(2026, 1, 1, 10, 0, 0, tzinfo=UTC)
GREW, NO_GROWTH, UNKNOWN = ProgressStatus.GREW, ProgressStatus.NO_GROWTH, ProgressStatus.UNKNOWN


def _store() -> SessionStore:
    counter = itertools.count(1)
    store = SessionStore.in_memory(
        signer=OPERATOR, clock=lambda: T0, new_id=lambda: f"ev-{next(counter)}"
    )
    store.start("s1", "grow things", "auto")
    return store


def _measured_call(
    store: SessionStore,
    *,
    known: bool = True,
    artifacts: tuple[str, ...] = (),
    evidence: tuple[str, ...] = (),
    mutating: bool = True,
    tool: str = "write",
) -> str:
    """An observation followed by the call it measured; returns the observation id."""
    obs = store.record_effect_observation(
        "s1", known=known, artifacts=artifacts, evidence=evidence, observer="probe"
    )
    store.record_tool_call("s1", tool, {}, "ok", mutating=mutating, effect_observation_id=obs)
    return obs


def _receipt(store: SessionStore, since: int = 0, until: int | None = None) -> ProgressReceipt:
    return ProgressReceipt.for_window(store.load("s1"), since, until)


def _seq(store: SessionStore) -> int:
    return store.load("s1").seq


# -- recording observations ---------------------------------------------------------------------


def test_record_effect_observation_returns_the_event_id() -> None:
    store = _store()
    obs = store.record_effect_observation(
        "s1", known=True, artifacts=["file:a.py"], evidence=["test:t1"], observer="probe"
    )
    event = store.log.records[-1].event
    assert obs == event.event_id
    assert event.type == ev.EFFECT_OBSERVED
    assert dict(event.payload) == {
        "known": True,
        "artifacts": ["file:a.py"],
        "evidence": ["test:t1"],
        "observer": "probe",
    }
    observation = store.load("s1").observations[-1]
    assert observation.event_id == obs
    assert observation.seq == 2
    assert observation.known is True
    assert observation.artifacts == ("file:a.py",)
    assert observation.evidence == ("test:t1",)


def test_call_keeps_its_link_to_the_observation() -> None:
    store = _store()
    obs = _measured_call(store, artifacts=("file:a.py",))
    call = store.load("s1").calls[-1]
    assert call.effect_observation_id == obs
    assert store.log.records[-1].event.payload["effect_observation_id"] == obs


# -- known observations ---------------------------------------------------------------------------


def test_known_observation_with_new_identities_grew() -> None:
    store = _store()
    _measured_call(store, artifacts=("file:a.py", "file:b.py"), evidence=("test:t1",))
    receipt = _receipt(store)
    assert receipt.status is GREW
    assert receipt.new_identities == (
        "artifact:file:a.py",
        "artifact:file:b.py",
        "evidence:test:t1",
    )
    assert (receipt.since, receipt.until) == (0, 3)


def test_known_observation_with_empty_lists_proves_no_growth() -> None:
    store = _store()
    _measured_call(store, known=True, mutating=True)
    receipt = _receipt(store)
    assert receipt.status is NO_GROWTH
    assert receipt.new_identities == ()


def test_identities_count_once_per_session_across_windows() -> None:
    store = _store()
    _measured_call(store, artifacts=("file:a.py",))
    first_end = _seq(store)
    assert _receipt(store, 0, first_end).status is GREW
    _measured_call(store, artifacts=("file:a.py",))
    second = _receipt(store, first_end)
    assert second.status is NO_GROWTH
    assert second.new_identities == ()


def test_identities_count_once_within_a_window() -> None:
    store = _store()
    _measured_call(store, artifacts=("file:a.py",))
    _measured_call(store, artifacts=("file:a.py",), evidence=("test:t1",))
    receipt = _receipt(store)
    assert receipt.status is GREW
    assert receipt.new_identities == ("artifact:file:a.py", "evidence:test:t1")


def test_second_window_with_one_new_identity_reports_only_it() -> None:
    store = _store()
    _measured_call(store, artifacts=("file:a.py",))
    first_end = _seq(store)
    _measured_call(store, artifacts=("file:a.py", "file:c.py"))
    receipt = _receipt(store, first_end)
    assert receipt.status is GREW
    assert receipt.new_identities == ("artifact:file:c.py",)


def test_a_proposal_and_its_host_application_both_count() -> None:
    store = _store()
    _measured_call(store, artifacts=("proposal:pr-7",), mutating=False, tool="propose")
    first_end = _seq(store)
    assert _receipt(store, 0, first_end).new_identities == ("artifact:proposal:pr-7",)
    _measured_call(store, artifacts=("applied:pr-7@host-1",), tool="apply")
    receipt = _receipt(store, first_end)
    assert receipt.status is GREW
    assert receipt.new_identities == ("artifact:applied:pr-7@host-1",)


def test_a_measured_non_mutating_call_with_new_identities_grew() -> None:
    store = _store()
    _measured_call(store, evidence=("behaviour:login-works",), mutating=False, tool="probe")
    receipt = _receipt(store)
    assert receipt.status is GREW
    assert receipt.new_identities == ("evidence:behaviour:login-works",)


def test_a_measured_mutating_call_with_nothing_new_is_no_growth_not_the_proxy() -> None:
    store = _store()
    _measured_call(store, artifacts=("file:a.py",))
    first_end = _seq(store)
    _measured_call(store, artifacts=("file:a.py",), mutating=True)
    assert _receipt(store, first_end).status is NO_GROWTH


# -- what cannot be believed: UNKNOWN -------------------------------------------------------------


def test_link_to_a_missing_observation_is_unknown() -> None:
    store = _store()
    store.record_tool_call("s1", "write", {}, "ok", mutating=True, effect_observation_id="nope")
    receipt = _receipt(store)
    assert receipt.status is UNKNOWN
    assert receipt.new_identities == ()


def test_link_to_an_observation_of_another_session_is_unknown() -> None:
    store = _store()
    store.start("s2", "other")
    foreign = store.record_effect_observation("s2", known=True, artifacts=["file:x"])
    store.record_tool_call("s1", "write", {}, "ok", mutating=True, effect_observation_id=foreign)
    assert _receipt(store).status is UNKNOWN


def test_known_false_observation_is_unknown() -> None:
    store = _store()
    _measured_call(store, known=False, artifacts=("file:a.py",))
    receipt = _receipt(store)
    assert receipt.status is UNKNOWN
    assert receipt.new_identities == ()


def test_observation_reused_by_two_calls_is_unknown() -> None:
    store = _store()
    obs = store.record_effect_observation("s1", known=True, artifacts=["file:a.py"])
    store.record_tool_call("s1", "write", {}, "ok", mutating=True, effect_observation_id=obs)
    store.record_tool_call("s1", "write", {}, "ok", mutating=True, effect_observation_id=obs)
    receipt = _receipt(store)
    assert receipt.status is UNKNOWN
    assert receipt.new_identities == ()


def test_observation_reused_across_windows_is_unknown_in_the_later_window() -> None:
    store = _store()
    obs = store.record_effect_observation("s1", known=True, artifacts=["file:a.py"])
    store.record_tool_call("s1", "write", {}, "ok", mutating=True, effect_observation_id=obs)
    first_end = _seq(store)
    store.record_tool_call("s1", "write", {}, "ok", mutating=True, effect_observation_id=obs)
    assert _receipt(store, first_end).status is UNKNOWN


def test_unknown_call_with_another_proven_growth_in_the_window_grew() -> None:
    store = _store()
    _measured_call(store, known=False, artifacts=("file:x",))
    _measured_call(store, artifacts=("file:a.py",))
    receipt = _receipt(store)
    assert receipt.status is GREW
    assert receipt.new_identities == ("artifact:file:a.py",)


def test_unknown_call_with_an_unlinked_mutating_call_in_the_window_grew() -> None:
    store = _store()
    store.record_tool_call("s1", "write", {}, "ok", mutating=True, effect_observation_id="nope")
    store.record_tool_call("s1", "write", {}, "ok", mutating=True)
    receipt = _receipt(store)
    assert receipt.status is GREW
    assert receipt.new_identities == ()


def test_unknown_call_with_only_no_growth_facts_stays_unknown() -> None:
    store = _store()
    _measured_call(store, known=True)  # proves no growth
    _measured_call(store, known=False, artifacts=("file:a.py",))
    store.record_tool_call("s1", "read", {}, "ok", mutating=False)
    assert _receipt(store).status is UNKNOWN


def test_identities_of_an_unbelieved_observation_are_not_seen_later() -> None:
    store = _store()
    _measured_call(store, known=False, artifacts=("file:a.py",))
    first_end = _seq(store)
    _measured_call(store, artifacts=("file:a.py",))
    receipt = _receipt(store, first_end)
    assert receipt.status is GREW
    assert receipt.new_identities == ("artifact:file:a.py",)


# -- calls nobody measured: the historical proxy ------------------------------------------------


def test_unlinked_mutating_call_counts_as_growth() -> None:
    store = _store()
    store.record_tool_call("s1", "write", {}, "ok", mutating=True)
    receipt = _receipt(store)
    assert receipt.status is GREW
    assert receipt.new_identities == ()


def test_unlinked_non_mutating_call_is_no_growth() -> None:
    store = _store()
    store.record_tool_call("s1", "read", {}, "ok", mutating=False)
    receipt = _receipt(store)
    assert receipt.status is NO_GROWTH
    assert receipt.new_identities == ()


# -- the window -----------------------------------------------------------------------------------


def test_window_is_since_exclusive_until_inclusive() -> None:
    store = _store()
    store.record_tool_call("s1", "write", {}, "ok", mutating=True)  # seq 2
    store.record_tool_call("s1", "read", {}, "ok", mutating=False)  # seq 3
    assert _receipt(store, 2).status is NO_GROWTH
    assert _receipt(store, 1, 2).status is GREW
    assert _receipt(store, 0, 1).status is NO_GROWTH


def test_until_defaults_to_the_session_seq() -> None:
    store = _store()
    store.record_tool_call("s1", "write", {}, "ok", mutating=True)
    store.record_turn("s1", "assistant", "done")
    receipt = _receipt(store, 1)
    assert receipt.until == 3
    assert receipt.since == 1


def test_progress_is_the_same_when_the_log_is_folded_again() -> None:
    store = _store()
    _measured_call(store, artifacts=("file:a.py",))
    _measured_call(store, known=False)
    replayed = fold("s1", [r.event for r in store.log.records])
    receipt = ProgressReceipt.for_window(replayed, 0)
    assert receipt == _receipt(store)
    assert receipt.status is GREW
    assert receipt.new_identities == ("artifact:file:a.py",)
