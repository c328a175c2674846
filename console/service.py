"""What the API and the pages both do: the reads they show and the operator's acts (blocking).

Every function here calls the store or the index synchronously (Kafka, Redis): handlers run the
reads in the shared thread pool and the acts on the writes' own threads (`Runtime.write`: a write
waiting on Kafka holds none of the reads'). Acts are logged with the principal who did them,
never with a secret.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from datetime import timedelta
from functools import partial
from typing import Any, TypeVar

from console.auth import Identity
from console.inputs import is_operation_name
from console.runtime import Runtime
from console.views import (
    question_texts,
    session_record,
    timeline_records,
    waiting_record,
    window_records,
)
from schemas.errors import (
    CorruptProjectionError,
    InvalidAnswerError,
    InvalidCall,
    NoOpenQuestionError,
    UnauthorizedError,
)
from session_model.modes import less_strict, parse_mode
from session_model.policy import PERMISSION_OPTIONS, SIGNATURE, check_signature_answer
from session_model.projection import Position
from session_model.questions import Cursor, WaitingPage
from session_model.session import Question, Session

log = logging.getLogger(__name__)
T = TypeVar("T")

EXECUTOR = "console"  # the `executor` of answers given here
PAUSE_WINDOW = timedelta(hours=24)
# What of the history an operator is shown: every decision (one per question: human-sized), not
# the calls and observations, which grow with the agent's work.
SHOWN_HISTORY = ("decisions",)
PAGE_TIMELINE = 300  # the session page shows at most this many timeline entries, the latest
DECISIONS, TIMELINE = "decisions", "timeline"  # what of a session a page may show without


class ConfirmationRequiredError(InvalidCall):
    """A signature question is answered only with the operation typed back as confirmation."""

    code = "confirmation_required"


def parse_cursor(text: str | None) -> Cursor | None:
    """A page cursor (`score:session_id`), or None; ValueError if it is not one."""
    return Cursor.parse(text) if text else None


def waiting(rt: Runtime, reason: str | None, after: Cursor | None, limit: int) -> WaitingPage:
    """A page of waiting questions, soonest deadline first."""
    page = rt.deps.index.waiting(reason=reason or None, after=after, limit=limit)
    for sid, why in page.unreadable:
        _say_once(rt, sid, f"{why}: left out of the inbox and named there")
    return page


def _say_once(rt: Runtime, key: str, what: str) -> None:
    """Log `what` (something damaged, left out of what is shown) once per `key`, with the remedy."""
    if not rt.unreadable_said.first(key):
        return
    log.warning("%s (rebuild the session with `milpa-sessions replay --session ID --force`)", what)


def _or_none(rt: Runtime, session_id: str, part: str, read: Callable[[], T]) -> T | None:
    """`read()`, or None (logged once) if what it reads of the session is damaged: a page shows
    the rest of the session, and its open question can still be answered."""
    try:
        return read()
    except CorruptProjectionError as e:
        _say_once(rt, f"{session_id}\x00{part}", f"{e}: the session is shown without its {part}")
        return None


def waiting_page_record(page: WaitingPage) -> dict[str, Any]:
    """`{items, total, next, unreadable}`."""
    return {
        "items": [waiting_record(i) for i in page.items],
        "total": page.total,
        "next": str(page.next) if page.next is not None else None,
        "unreadable": [sid for sid, _ in page.unreadable],
    }


def fleet(rt: Runtime) -> dict[str, Any]:
    """Sessions by status and mode, waiting by reason, pauses per hour, time to answer."""
    now = rt.deps.now()
    counts = rt.deps.index.fleet()
    by_status: Counter[str] = Counter()
    by_mode: Counter[str] = Counter()
    for (status, mode), n in counts.items():
        by_status[status] += n
        by_mode[mode] += n
    analytics = rt.deps.analytics
    hours = analytics.pauses(PAUSE_WINDOW, now, by="hour") if analytics else ()
    tta = analytics.time_to_answer() if analytics else ()
    return {
        "at": now.isoformat(),
        "sessions": [
            {"status": s, "mode": m, "count": n} for (s, m), n in sorted(counts.items()) if n
        ],
        "by_status": dict(sorted(by_status.items())),
        "by_mode": dict(sorted(by_mode.items())),
        "waiting_by_reason": dict(sorted(rt.deps.index.waiting_by_reason().items())),
        "analytics": analytics is not None,
        "pauses_by_hour": [
            {"hour": h.hour.isoformat(), "reason": h.reason, "count": h.count} for h in hours
        ],
        "time_to_answer": [
            {"reason": t.reason, "bucket": t.bucket, "le_seconds": t.le_seconds, "count": t.count}
            for t in tta
        ],
    }


def session(rt: Runtime, session_id: str) -> dict[str, Any]:
    """The session as an operator reads it (its open question, decisions, ...)."""
    return _session_record(rt, rt.deps.store.load(session_id))


def _session_record(rt: Runtime, state: Session) -> dict[str, Any]:
    """`session_record` with every decision, or the state's recent ones if those do not read
    (`unreadable` names what was left out)."""
    history = _or_none(
        rt, state.id, DECISIONS, partial(rt.deps.store.facts, state.id, SHOWN_HISTORY)
    )
    record = session_record(state, history)
    record["unreadable"] = [] if history is not None else [DECISIONS]
    return record


def window(rt: Runtime, session_id: str) -> list[dict[str, str]]:
    """What the model of the session is sent."""
    return window_records(rt.deps.store.load(session_id))


def session_view(rt: Runtime, session_id: str, recent: int | None = None) -> dict[str, Any]:
    """The session, the window the model sees and the timeline as sentences (its last `recent`
    entries' events, if given: read alone, so an old session's page costs what a young one's
    does)."""
    store = rt.deps.store
    state = store.load(session_id)
    record = _session_record(rt, state)
    since = 0
    latest = None if recent is None else recent + 1
    read = _or_none(rt, session_id, TIMELINE, partial(store.timeline, session_id, latest=latest))
    entries = read or []
    if recent is not None and len(entries) > recent:  # some left out: whole events after the cut
        since = entries[0]["seq"]
        entries = [e for e in entries if e["seq"] > since]
    if read is None:
        record["unreadable"].append(TIMELINE)
    record["window"] = window_records(state)
    record["timeline"] = timeline_records(entries, question_texts(state, entries))
    record["timeline_since"] = since
    return record


def timeline(
    rt: Runtime, session_id: str, since: int, latest: int | None = None
) -> list[dict[str, Any]]:
    """Timeline entries after `since` (the last `latest` of them if given), with sentences."""
    session = rt.deps.store.load(session_id)
    entries = rt.deps.store.timeline(session_id, since, latest)
    return timeline_records(entries, question_texts(session, entries))


def answer(
    rt: Runtime,
    caller: Identity,
    session_id: str,
    *,
    question_id: str,
    answer: str,
    confirm: str | None,
    asked_seq: int | None = None,
) -> Position:
    """Answer the open question as the caller (a signature question: only with confirmation).

    `asked_seq`: the asking the caller was shown (the question's `seq`); an answer to a question
    asked again since, under the same id, is refused rather than applied (and signed) to what
    the caller never saw. Without it, the asking checked here is the one answered, except for
    an answer that signs something (a call's approval, a grant): those must name their asking,
    since the agent may have asked again, with other arguments, after the caller read it.
    """
    store = rt.deps.store
    session = store.load(session_id)
    question = session.question
    late = session.late_for(question_id, asked_seq)  # for that asking, not an earlier one
    if late is not None and late.relaxed_by(answer):
        # Late, and refused by the fold: still no act this caller may make.
        _may_relax(caller, f"answer {answer!r} to {question_id!r}")
    granting: str | None = None
    if not session.ended:  # (a late answer is appended for the record, and refused: the store)
        if question is None or question.id != question_id:
            raise NoOpenQuestionError(f"{question_id!r} is not the open question")
        if asked_seq is not None and question.seq != asked_seq:
            raise NoOpenQuestionError(
                f"{question_id!r} was asked again since it was shown: read it again before "
                "answering"
            )
        shown = asked_seq
        asked_seq = question.seq  # the store answers this asking or nothing
        if question.relaxed_by(answer):
            _may_relax(caller, f"answer {answer!r} to {question_id!r}")
        if question.reason == SIGNATURE:
            check_signature_answer(question, answer)  # before asking for the confirmation
            operation, _ = question.signed_call()
            if (confirm or "").strip() != operation:
                raise ConfirmationRequiredError(
                    f"signing this call allows {operation!r} with exactly these arguments once: "
                    f"confirm by sending the operation name {operation!r} as `confirm`"
                )
        elif question.options and answer not in question.options:
            options = ", ".join(map(repr, question.options))
            raise InvalidAnswerError(f"{answer!r} is not an option of {question_id!r}: {options}")
        granting = granted_by_yes(question, answer)
        # What signs (a call's approval, a grant), or confirms a target (`Session.confirmed`).
        signs = (
            question.reason == SIGNATURE
            or (granting is not None and store.signer is not None)
            or (question.reason == "target_not_named" and question.options[:1] == (answer,))
        )
        if signs and shown is None:
            raise ConfirmationRequiredError(
                f"this answer signs what {question_id!r} asks now: send `asked_seq` (the "
                f"question's `seq` where you read it; now {question.seq}), so that nothing "
                "asked again since is signed"
            )
        if granting is not None and store.signer is not None:
            # «Allow X in this session?» — yes: the grant first (the operator's signed act the
            # agent then relies on), then the answer; both only once the store's own read of
            # the question passed (a question asked again meanwhile is a 409 with no grant).
            _may_relax(caller, f"grant {granting!r}")
        else:
            granting = None  # (without a signing key the yes is answered, and grants nothing)
    position = store.answer(
        session_id,
        question_id,
        answer,
        caller.principal,
        EXECUTOR,
        asked_seq=asked_seq,
        may_relax=caller.relaxes,
        grant=granting,
    )
    if granting is not None:
        log.info("%s granted %r in %s", caller.principal.id, granting, session_id)
    log.info("%s answered %r in %s at %s", caller.principal.id, question_id, session_id, position)
    return position


def granted_by_yes(question: Question, answer: str) -> str | None:
    """The operation a permission question (`perm:<op>`) grants when answered "yes"."""
    if answer != PERMISSION_OPTIONS[0]:
        return None
    return grantable(question.id, question.reason, question.options)


def grantable(question_id: str, reason: str | None, options: Sequence[str]) -> str | None:
    """The operation a "yes" to this question grants, if any (the page's hint says so too).

    Only a `perm:<op>` question with exactly the options `permission_question` gives: whoever
    asks (the agent) chooses a question's options, and the console signs the grant, so an option
    list reordered or relabelled ("No, keep waiting" first) must not turn a refusal into a signed
    grant. The operator grants such an operation explicitly, if at all. Nor does a "yes" grant a
    name the grant act itself refuses (control or bidirectional formatting characters, over
    long): the asker chose it.
    """
    if (
        reason == "permission"
        and question_id.startswith("perm:")
        and tuple(options) == PERMISSION_OPTIONS
        and is_operation_name(operation := question_id.removeprefix("perm:"))
    ):
        return operation
    return None


def _may_relax(caller: Identity, act: str) -> None:
    """Refuse (403) a caller that may not make a session less supervised."""
    if not caller.relaxes:
        raise UnauthorizedError(
            f"{caller.principal.id} may not {act}: only operators, and services whose token has "
            "the `operator` scope, make a session less supervised"
        )


def grant(rt: Runtime, caller: Identity, session_id: str, operation: str) -> Position:
    """Grant an operation (signed with the console's operator key)."""
    _may_relax(caller, f"grant {operation.strip()!r}")
    position = rt.deps.store.grant(session_id, operation.strip())
    log.info("%s granted %r in %s at %s", caller.principal.id, operation, session_id, position)
    return position


def revoke(rt: Runtime, caller: Identity, session_id: str, operation: str) -> Position:
    """Revoke a granted operation: the name as sent if it is granted so (a grant made with a
    writer of its own may hold spaces around it), else without the spaces around it."""
    store = rt.deps.store
    name = operation if store.load(session_id).allows(operation) else operation.strip()
    position = store.revoke(session_id, name)
    log.info("%s revoked %r in %s at %s", caller.principal.id, operation, session_id, position)
    return position


def set_mode(rt: Runtime, caller: Identity, session_id: str, mode: str) -> Position:
    """Change the autonomy mode (a less strict one is signed with the console's key)."""
    wanted = parse_mode(mode.strip())
    relaxing = wanted is not None and less_strict(wanted, rt.deps.store.load(session_id).mode)
    if relaxing:
        _may_relax(caller, f"relax the mode to {wanted.value!r}")  # type: ignore[union-attr]
    # The store judges again on the read it writes from: a change asked as a tightening is never
    # signed as a relaxation (the mode was tightened meanwhile), whoever asks.
    position = rt.deps.store.set_mode(
        session_id, mode.strip(), may_relax=caller.relaxes and relaxing
    )
    log.info("%s set mode %r in %s at %s", caller.principal.id, mode, session_id, position)
    return position


def end(rt: Runtime, caller: Identity, session_id: str, because: str) -> Position:
    """End the session; the reason names who ended it."""
    reason = because.strip()
    if not reason:
        raise InvalidCall("say why the session ends")
    position = rt.deps.store.end(session_id, f"{reason} (ended by {caller.principal.id})")
    log.info("%s ended %s at %s", caller.principal.id, session_id, position)
    return position
