"""The waiting-index contract (`session_model.ports.WaitingIndex`), run against every store.

Like `tests/contract_projection.py`: subclass `WaitingIndexContract` in a `test_*.py` module that
provides a `projection_store` fixture yielding a fresh store that is also a `WaitingIndex`.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from schemas import events as ev
from session_model.projection import BatchFolder, Position
from session_model.questions import NO_DEADLINE, Cursor
from tests.contract_projection import BASE_TIME, Log, _project


def _deadline(minutes: int) -> str:
    return (BASE_TIME + timedelta(minutes=minutes)).strftime("%Y-%m-%dT%H:%M:%SZ")


def _ms(minutes: int) -> int:
    return int((BASE_TIME + timedelta(minutes=minutes)).timestamp() * 1000)


def ask(
    log: Log,
    sid: str,
    qid: str,
    *,
    minutes: int | None = None,
    reason: str | None = None,
    options: tuple[str, ...] = ("yes", "no"),
) -> None:
    log.add(
        sid,
        ev.QUESTION_ASKED,
        {
            "question_id": qid,
            "question": f"{qid}?",
            "options": list(options),
            "why": "because",
            "expires_at": None if minutes is None else _deadline(minutes),
            "reason": reason,
        },
    )


def answer(log: Log, sid: str, qid: str, value: str = "yes") -> None:
    log.add(sid, ev.QUESTION_ANSWERED, {"question_id": qid, "answer": value, "by": None})


def _ids(page: Any) -> list[str]:
    return [w.session_id for w in page.items]


class WaitingIndexContract:
    """Contract tests of the waiting index and the fleet counts."""

    def test_an_open_question_waits_with_its_card(self, projection_store: Any) -> None:
        log = Log()
        log.started("s1", goal="ship it")
        ask(log, "s1", "q1", minutes=30, reason="permission")
        _project(projection_store, log.records)
        page = projection_store.waiting()
        assert page.total == 1 and page.next is None
        (w,) = page.items
        assert (w.session_id, w.question_id, w.question, w.options) == (
            "s1",
            "q1",
            "q1?",
            ("yes", "no"),
        )
        assert (w.reason, w.why, w.goal, w.mode, w.seq) == (
            "permission",
            "because",
            "ship it",
            "ask",
            2,
        )
        assert w.deadline_ms == _ms(30)
        assert w.expires_at == _deadline(30)
        assert w.asked_at == BASE_TIME + timedelta(seconds=2)
        assert projection_store.waiting_by_reason() == {"permission": 1}
        assert projection_store.fleet() == {("waiting", "ask"): 1}

    def test_an_answer_takes_it_out(self, projection_store: Any) -> None:
        log = Log()
        log.started("s1")
        ask(log, "s1", "q1", minutes=30, reason="permission")
        _project(projection_store, log.records)
        answer(log, "s1", "q1")
        _project(projection_store, log.records)
        assert projection_store.waiting().items == ()
        assert projection_store.waiting().total == 0
        assert projection_store.waiting_by_reason() == {}
        assert projection_store.fleet() == {("running", "ask"): 1}

    def test_soonest_deadline_first_none_last_across_pages(self, projection_store: Any) -> None:
        log = Log()
        plan = {"a": None, "b": 50, "c": 10, "d": 10, "e": 10, "f": 5}
        for sid, minutes in plan.items():
            log.started(sid)
            ask(log, sid, f"q-{sid}", minutes=minutes)
        _project(projection_store, log.records)
        expected = ["f", "c", "d", "e", "b", "a"]
        assert _ids(projection_store.waiting(limit=10)) == expected
        seen: list[str] = []
        after: Cursor | None = None
        pages = 0
        while True:  # pages of two: the cursor cuts inside the tie at 10 minutes
            page = projection_store.waiting(after=after, limit=2)
            assert page.total == 6
            seen += _ids(page)
            pages += 1
            if page.next is None:
                break
            after = Cursor.parse(str(page.next))
        assert seen == expected and pages == 3
        last = projection_store.waiting(limit=10).items[-1]
        assert last.deadline_ms is None
        assert projection_store.waiting(after=Cursor(NO_DEADLINE, "a")).items == ()

    def test_filter_by_reason(self, projection_store: Any) -> None:
        log = Log()
        for sid, reason in (
            ("s1", "permission"),
            ("s2", "signature"),
            ("s3", "permission"),
            ("s4", None),
        ):
            log.started(sid)
            ask(log, sid, "q", minutes=int(sid[1]), reason=reason)
        _project(projection_store, log.records)
        page = projection_store.waiting(reason="permission")
        assert _ids(page) == ["s1", "s3"] and page.total == 2
        assert _ids(projection_store.waiting(reason="unspecified")) == ["s4"]
        assert projection_store.waiting(reason="nothing").items == ()
        assert projection_store.waiting_by_reason() == {
            "permission": 2,
            "signature": 1,
            "unspecified": 1,
        }

    def test_the_end_makes_a_question_moot(self, projection_store: Any) -> None:
        log = Log()
        log.started("s1")
        ask(log, "s1", "q1", minutes=30, reason="permission")
        log.started("s2")
        _project(projection_store, log.records)
        log.add("s1", ev.ENDED, {"because": "stopped"})
        _project(projection_store, log.records)
        assert projection_store.waiting().items == ()
        assert projection_store.waiting_by_reason() == {}
        assert projection_store.fleet() == {("ended", "ask"): 1, ("running", "ask"): 1}

    def test_a_stale_update_changes_no_count(self, projection_store: Any) -> None:
        log = Log()
        log.started("s1")
        ask(log, "s1", "q1", minutes=30, reason="permission")
        _project(projection_store, log.records)
        (stale,) = BatchFolder().fold({}, log.records[:1])  # folded from no state: refused
        assert projection_store.commit([stale]).conflicts == ("s1",)
        assert projection_store.fleet() == {("waiting", "ask"): 1}
        assert projection_store.waiting_by_reason() == {"permission": 1}
        assert projection_store.folded(["s1"])["s1"].mark == Position(0, 1)

    def test_rebuild_after_clear_gives_the_same_index(self, projection_store: Any) -> None:
        log = Log()
        for n in range(5):
            log.started(f"s{n}")
            if n % 2:
                ask(log, f"s{n}", "q", minutes=n, reason="permission")
        _project(projection_store, log.records)
        before = (
            projection_store.waiting(),
            projection_store.waiting_by_reason(),
            projection_store.fleet(),
        )
        projection_store.clear()
        _project(projection_store, log.records)
        after = (
            projection_store.waiting(),
            projection_store.waiting_by_reason(),
            projection_store.fleet(),
        )
        assert after == before
