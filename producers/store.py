"""`SessionStore`: the whole writer vocabulary and the reads, over an event log and a projection.

Writers declare; the fold derives. Every method validates its arguments without I/O and raises a
specific `InvalidCall`; with `checks=True` (the default) it also reads the session's projection
(waiting for this store's own last write to it, so a process reads its writes) to refuse calls the
fold would reject anyway. High-rate writers can turn the reads off: the fold remains the authority
and records every rejection.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from producers.memory import in_memory_backend
from schemas import events as ev
from schemas.errors import (
    InvalidCall,
    LateAnswerError,
    MilpaError,
    NoOpenQuestionError,
    NotYetVisibleError,
    QuestionOpenError,
    SessionAlreadyStartedError,
    SessionEndedError,
    UnauthorizedError,
    UnknownSessionError,
)
from schemas.events import Event, utc_millis
from session_model.authority import authority_fields
from session_model.canonical import argument_digest as digest_of
from session_model.compaction import CompactionPlan
from session_model.deadlines import format_instant
from session_model.intake import CONTROL_CHARACTER
from session_model.keyed_ids import KeyedIds
from session_model.modes import Mode, less_strict, parse_mode
from session_model.policy import SIGNATURE, ceiling_for, check_signature_answer
from session_model.ports import EventLog, ProjectionStore
from session_model.principal import Principal
from session_model.projection import Position
from session_model.scheduled import compacted, window_closed
from session_model.session import (
    OTHER_NAMES,
    ROLES,
    TODO_STATUSES,
    History,
    Question,
    Session,
    Todo,
    Turn,
)
from session_model.signing import Signer, TrustedKeys
from session_model.timeline import TimelineEntry


def _utc_now() -> datetime:
    return datetime.now(UTC)


def _new_id() -> str:
    return str(uuid.uuid4())


def _nonempty(value: str, what: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidCall(f"{what} must be a non-empty string")
    return value


def _counted_name(value: str, what: str) -> str:
    """A name the session counts by (a tool, a pause's reason code): never `OTHER_NAMES`, under
    which the names past the session's bound are counted together."""
    if value == OTHER_NAMES:
        raise InvalidCall(
            f"{what} {OTHER_NAMES!r} is reserved: a session counts the {what}s past its first "
            "ones together under that name"
        )
    return value


class SessionStore:
    """Append session events and read their projections."""

    def __init__(
        self,
        log: EventLog,
        projections: ProjectionStore,
        *,
        producer: str = "milpa-sessions",
        signer: Signer | None = None,
        start_mode: Mode = Mode.ASK,
        checks: bool = True,
        read_timeout: float = 5.0,
        clock: Callable[[], datetime] = _utc_now,
        new_id: Callable[[], str] = _new_id,
        id_key: bytes | None = None,
    ) -> None:
        try:  # what a transfer's ids derive under: see `transfer_open_todos`
            self._transfer_ids = KeyedIds(id_key) if id_key is not None else KeyedIds.random()
        except ValueError as e:
            raise InvalidCall(str(e)) from e
        self.log = log
        self.projections = projections
        self.producer = producer
        self.signer = signer
        self.start_mode = start_mode
        self.checks = checks
        self.read_timeout = read_timeout
        self._clock = clock
        self._new_id = new_id
        self._written: dict[str, Position] = {}

    @classmethod
    def in_memory(
        cls, *, keys: TrustedKeys | None = None, signer: Signer | None = None, **kwargs: Any
    ) -> SessionStore:
        """A store over the in-memory log and projection (projected synchronously)."""
        trusted = keys if keys is not None else (signer.trusted_keys() if signer else None)
        log, store = in_memory_backend(trusted)
        return cls(log, store, signer=signer, **kwargs)

    def close(self, timeout: float = 10.0) -> None:
        """Close the log (sending what it buffers, at most `timeout` s) and the projections'
        connections; both are closed even if the first fails, and the first error is raised."""
        try:
            self.log.close(timeout)
        except BaseException:
            with contextlib.suppress(MilpaError):  # the log's error is the one to raise
                self.projections.close()
            raise
        self.projections.close()

    # -- the low-level append ------------------------------------------------------------------

    def event(
        self,
        session_id: str,
        type_: str,
        payload: Mapping[str, Any],
        *,
        expected_seq: int | None = None,
        event_id: str | None = None,
    ) -> Event:
        """Build an event from this store's producer and clock."""
        return Event(
            event_id=event_id or self._new_id(),
            session_id=session_id,
            type=type_,
            occurred_at=utc_millis(self._clock()),
            producer=self.producer,
            payload=dict(payload),
            expected_seq=expected_seq,
        )

    def append(self, event: Event) -> Position:
        """Append one event and remember its position for read-your-writes."""
        position = self.log.append(event)
        self._written[event.session_id] = position
        return position

    def _emit(
        self,
        session_id: str,
        type_: str,
        payload: Mapping[str, Any],
        expected_seq: int | None = None,
    ) -> Position:
        return self.append(self.event(session_id, type_, payload, expected_seq=expected_seq))

    def _emit_signed(
        self, session_id: str, type_: str, payload: dict[str, Any], what: str
    ) -> Position:
        """Append an event that raises authority, signed with this store's operator key.

        Without a key the call is refused here, before anything is appended: the fold would
        reject the unsigned event (`unauthorized`) anyway, and an honest caller learns it at once.
        """
        if self.signer is None:
            raise UnauthorizedError(
                f"{what} makes session {session_id!r} less supervised: only an operator's "
                "signature may do that, and this writer has no operator key (MILPA_SIGNING_KEY)"
            )
        event_id = self._new_id()
        event = self.event(session_id, type_, {**payload, "authority": None}, event_id=event_id)
        signed = {
            **payload,
            "authority": self.signer.sign_authority(
                session_id=session_id,
                event_id=event_id,
                event_type=type_,
                fields=authority_fields(event),
            ),
        }
        return self.append(self.event(session_id, type_, signed, event_id=event_id))

    # -- reads ---------------------------------------------------------------------------------

    def find(self, session_id: str, at_least: Position | None = None) -> Session | None:
        """The session, or None; waits for `at_least` (default: this store's own last write)."""
        wait_for = at_least if at_least is not None else self._written.get(session_id)
        return self.projections.load(session_id, at_least=wait_for, timeout=self.read_timeout)

    def load(self, session_id: str, at_least: Position | None = None) -> Session:
        """The session as projected; raises `UnknownSessionError` if it was never started."""
        session = self.find(session_id, at_least)
        if session is None or not session.started:
            raise UnknownSessionError(f"no session {session_id!r}")
        return session

    def ids(self) -> list[str]:
        """Every session id."""
        return self.projections.ids()

    def timeline(
        self, session_id: str, since: int = 0, latest: int | None = None
    ) -> list[TimelineEntry]:
        """Timeline entries after `since` (for catching up and for following); the last
        `latest` of them if given."""
        return self.projections.timeline(session_id, since, latest)

    def history(self, session_id: str) -> list[Turn]:
        """Every turn of the session, summarised ones included."""
        return self.projections.history(session_id)

    def facts(self, session_id: str, kinds: Iterable[str] | None = None) -> History:
        """Every call, observation, execution, decision and rejection of the session (the state
        keeps only the recent ones); only the lists of `kinds` if given."""
        return self.projections.facts(session_id, kinds)

    def open_todos(self, session_id: str) -> tuple[Todo, ...]:
        """Cards not done and not transferred away."""
        return self.load(session_id).open_todos()

    def ceiling_for(self, session_id: str) -> Mode | None:
        """The strictest mode of the session's ancestors (resolved now); None for a root."""
        return ceiling_for(self.load(session_id), self.projections.load)

    def _live(self, session_id: str) -> Session | None:
        """The session for checks (None when checks are off); refuses unknown and ended ones."""
        if not self.checks:
            return None
        session = self.load(session_id)
        if session.ended:
            raise SessionEndedError(f"session {session_id!r} has ended: {session.ended_because}")
        return session

    def _refuse_started(self, session_id: str) -> None:
        """Refuse an id already started: projected, or expired by retention (a tombstone, read
        after the projection: a sweep between the two reads cannot let the id through)."""
        lag: NotYetVisibleError | None = None
        try:
            if self.find(session_id) is not None:
                raise SessionAlreadyStartedError(f"session {session_id!r} already exists")
        except NotYetVisibleError as e:  # this store wrote to it; no projection shows that write
            lag = e
        if self.projections.expired(session_id) is not None:
            raise SessionAlreadyStartedError(
                f"session {session_id!r} already exists: it ended and its projection expired "
                "(retention), and an id is never reused; its history is in Kafka: restore it "
                f"with `milpa-sessions replay --session {session_id}`"
            ) from lag
        if lag is not None:
            raise lag

    # -- the vocabulary ------------------------------------------------------------------------

    def start(
        self,
        session_id: str,
        goal: str,
        mode: Mode | str = Mode.ASK,
        parent_id: str | None = None,
    ) -> Position:
        """Open a session; with checks, refuses an id already started, even one whose projection
        expired (retention): its events are still the session's record."""
        _nonempty(session_id, "session id")
        if CONTROL_CHARACTER.search(session_id):
            raise InvalidCall(f"session id {session_id[:64]!r} holds a control character")
        if "/" in session_id or not session_id.strip("."):
            # A URL path segment of its own (the console's pages and API): `/` would split it,
            # and `.` or `..` is taken away by every browser before the request is sent.
            raise InvalidCall(f"session id {session_id[:64]!r}: no `/`, and not only dots")
        parsed = parse_mode(mode)
        if parsed is None:
            raise InvalidCall(f"unknown mode {mode!r}")
        if self.checks:
            self._refuse_started(session_id)
        payload: dict[str, Any] = {"goal": goal, "mode": parsed.value, "parent_id": parent_id}
        if less_strict(parsed, self.start_mode):
            what = f"starting in {parsed.value} (less supervised than {self.start_mode.value})"
            return self._emit_signed(session_id, ev.STARTED, payload, what)
        return self._emit(session_id, ev.STARTED, payload)

    def record_turn(self, session_id: str, role: str, content: str) -> Position:
        """Append a conversation turn."""
        if role not in ROLES:
            raise InvalidCall(f"role must be one of {sorted(ROLES)}, not {role!r}")
        self._live(session_id)
        return self._emit(session_id, ev.TURN, {"role": role, "content": content})

    def record_tool_call(
        self,
        session_id: str,
        tool: str,
        arguments: Mapping[str, Any],
        result: str,
        *,
        ok: bool = True,
        mutating: bool = False,
        artifact: str | None = None,
        verdict: str | None = None,
        effect_observation_id: str | None = None,
    ) -> Position:
        """Append a tool call and its (writer-bounded) result."""
        _counted_name(_nonempty(tool, "tool"), "tool")
        if verdict is not None and verdict not in ("pass", "fail", "inconclusive"):
            raise InvalidCall(f"verdict must be pass, fail or inconclusive, not {verdict!r}")
        self._live(session_id)
        payload = {
            "tool": tool,
            "arguments": dict(arguments),
            "result": result,
            "ok": ok,
            "mutating": mutating,
            "artifact": artifact,
            "verdict": verdict,
            "effect_observation_id": effect_observation_id,
        }
        return self._emit(session_id, ev.TOOL_CALLED, payload)

    def message(self, to: str, from_: str, content: str) -> Position:
        """Send a message to another session: it lands only in the recipient's stream."""
        _nonempty(from_, "sender")
        self._live(to)
        return self._emit(to, ev.MESSAGE_SENT, {"from": from_, "content": content})

    def set_plan(self, session_id: str, plan: str) -> Position:
        """Declare the plan (the fold versions it)."""
        self._live(session_id)
        return self._emit(session_id, ev.PLAN_SET, {"plan": plan})

    def set_todo(
        self,
        session_id: str,
        todo_id: str,
        text: str,
        status: str = "pending",
        *,
        replaces: str | None = None,
    ) -> Position:
        """Create or move a todo card (the fold derives its version, lineage and origin)."""
        _nonempty(todo_id, "todo id")
        if status not in TODO_STATUSES:
            raise InvalidCall(f"status must be one of {sorted(TODO_STATUSES)}, not {status!r}")
        self._live(session_id)
        payload = {"id": todo_id, "text": text, "status": status, "replaces": replaces}
        return self._emit(session_id, ev.TODO_CHANGED, payload)

    def ask(self, session_id: str, question: Question) -> Position:
        """Open a question: the session pauses until it is answered or its window closes."""
        _nonempty(question.id, "question id")
        if question.reason is not None:
            _counted_name(question.reason, "reason code")
        session = self._live(session_id)
        if session is not None and session.question is not None:
            raise QuestionOpenError(f"question {session.question.id!r} is still open")
        removed = [o for o in question.options if session and o in session.removed_options]
        if removed:
            raise InvalidCall(
                f"option(s) {', '.join(map(repr, removed))} were removed from session "
                f"{session_id!r} and cannot be offered again"
            )
        payload = {
            "question_id": question.id,
            "question": question.question,
            "options": list(question.options),
            "why": question.why,
            "expires_at": question.expires_at,
            "reason": question.reason,
        }
        return self._emit(session_id, ev.QUESTION_ASKED, payload)

    def answer(
        self,
        session_id: str,
        question_id: str,
        answer: str,
        by: Principal | None = None,
        executor: str | None = None,
        *,
        asked_seq: int | None = None,
        may_relax: bool = True,
        grant: str | None = None,
    ) -> Position:
        """Answer the open question; a verified principal is signed with this store's key.

        `grant`: an operation to grant (signed) right before the answer, once the answer's checks
        passed (a yes to «Allow X?»: the agent relies on the grant when it reads the yes). The
        grant is an act of its own: should the answer still be refused by the fold (the agent
        re-asked the same id between this read and the append), the operation stays granted,
        as the operator who said yes to it decided; a yes this read finds late grants nothing
        (a window that closes between this read and the append still leaves the grant).

        `may_relax=False` (a caller that may not make a session less supervised): an answer that
        would (`Question.relaxed_by`: a signature question's, a yes to a permission or a target
        question) is
        refused with `UnauthorizedError` on the very read that would sign it, before anything is
        appended.

        Without a signing key a claim of `verified` is appended as made and downgraded by the
        fold: this store cannot vouch for it. A late answer (the window already closed) is
        appended, so the attempt is on record, and then raises `LateAnswerError`; one naming
        another asking than the one whose window closed is not late for it, and raises
        `SessionEndedError` with nothing appended, as any write to an ended session. `asked_seq`:
        the asking the caller answers (the question's `seq` as it was shown); if the question was
        asked again since (same id, another asking: other arguments, another reason), nothing is
        appended or signed (`NoOpenQuestionError`).

        The answer's record names the asking it answers (`asked_seq`: the one this store read,
        with checks on; the caller's, without), and a verified principal's signature covers it:
        the fold rejects it as `stale_question` if it lands on another asking of the same id
        (asked again while the projection this store read lagged behind).
        """
        if self.checks:
            session = self.load(session_id)
            if session.ended and session.late_for(question_id, asked_seq) is None:
                raise SessionEndedError(f"session {session_id!r} has ended")
            if not session.ended and (
                session.question is None or session.question.id != question_id
            ):
                raise NoOpenQuestionError(f"{question_id!r} is not the open question")
            if (
                asked_seq is not None
                and not session.ended
                and session.question is not None
                and session.question.seq != asked_seq
            ):
                raise NoOpenQuestionError(
                    f"{question_id!r} was asked again (seq {session.question.seq}) since the "
                    f"asking answered (seq {asked_seq}): read it again before answering"
                )
            # A late answer is judged by the question it came late for.
            answered = session.closed_question if session.ended else session.question
            if not may_relax and answered is not None and answered.relaxed_by(answer):
                raise UnauthorizedError(
                    f"answering {answer!r} to {question_id!r} makes session {session_id!r} less "
                    "supervised: an operator's act"
                )
            if not session.ended and answered is not None:  # (a late one is recorded, refused)
                check_signature_answer(answered, answer)
            if asked_seq is None and answered is not None and answered.seq:
                asked_seq = answered.seq  # the answer names the asking judged here
        elif not may_relax:
            raise UnauthorizedError("an answer on behalf of a limited caller needs checks on")
        if grant is not None:
            if not may_relax:
                raise UnauthorizedError(f"granting {grant!r} is an operator's act")
            if not (self.checks and session.ended):  # a late yes grants nothing
                self._granted(session_id, grant)  # judged on the read above, not read again
        event_id = self._new_id()
        payload: dict[str, Any] = {
            "question_id": question_id,
            "answer": answer,
            "by": by.to_record() if by else None,
            "executor": executor,
            "signature": None,
            "approval": None,
            "asked_seq": asked_seq,
        }
        if self.checks and session.question is not None and session.question.reason == SIGNATURE:
            payload["approval"] = self._approval(session_id, session.question)
        if by is not None and by.verified and self.signer is not None:
            payload["signature"] = self.signer.sign_answer(
                session_id=session_id,
                question_id=question_id,
                answer=answer,
                principal_id=by.id,
                event_id=event_id,
                asked_seq=asked_seq,
            )
        position = self.append(
            self.event(session_id, ev.QUESTION_ANSWERED, payload, event_id=event_id)
        )
        if self.checks and session.ended:
            raise LateAnswerError(
                f"the window to answer {question_id!r} had closed; the late answer is on record"
            )
        return position

    def _approval(self, session_id: str, question: Question) -> dict[str, Any]:
        """The signature of exactly the call a signature question names (operator key only)."""
        if self.signer is None:
            raise UnauthorizedError(
                f"{question.id!r} asks for a signature over one call: only a holder of an "
                "operator key can give it, and this writer has none (MILPA_SIGNING_KEY)"
            )
        operation, digest = question.signed_call()
        signed = self.signer.sign_call(
            session_id=session_id,
            operation=operation,
            argument_digest=digest,
            question_seq=question.seq,
        )
        return {
            "operation": operation,
            "argument_digest": digest,
            "key_id": signed.key_id,
            "signature": signed.signature,
        }

    def expire_if_due(self, session_id: str, now: datetime) -> bool:
        """Close the open question's answer window if its deadline has passed (ends the session)."""
        session = self.load(session_id)
        question = session.question
        if session.ended or question is None or not question.has_expired(now):
            return False
        closing = window_closed(
            session_id, question.id, question.seq, now, self.producer, event_id=self._new_id()
        )
        self.append(closing)
        return True

    def grant(self, session_id: str, operation: str) -> Position:
        """Grant one operation in this session."""
        self._live(session_id)
        return self._granted(session_id, operation)

    def _granted(self, session_id: str, operation: str) -> Position:
        """Append the signed grant of `operation` (checks done by the caller)."""
        _nonempty(operation, "operation")
        payload = {"operation": operation}
        return self._emit_signed(
            session_id, ev.PERMISSION_GRANTED, payload, f"granting {operation}"
        )

    def revoke(self, session_id: str, operation: str) -> Position:
        """Revoke a grant (appended on top of it; the grant stays in the log)."""
        _nonempty(operation, "operation")
        self._live(session_id)
        return self._emit(session_id, ev.PERMISSION_REVOKED, {"operation": operation})

    def set_mode(self, session_id: str, mode: Mode | str, *, may_relax: bool = True) -> Position:
        """Change the autonomy mode; a less strict one is signed, unless `may_relax` is False
        (then it is refused with `UnauthorizedError`, judged on the same read)."""
        parsed = parse_mode(mode)
        if parsed is None:
            raise InvalidCall(f"unknown mode {mode!r}")
        session = self._live(session_id)
        payload = {"mode": parsed.value}
        # Without checks the current mode is unknown here: sign if we can, else the fold judges.
        relaxes = less_strict(parsed, session.mode) if session else self.signer is not None
        if relaxes:
            what = f"changing the mode to {parsed.value}"
            if not may_relax:
                raise UnauthorizedError(
                    f"{what} makes session {session_id!r} less supervised: an operator's act"
                )
            return self._emit_signed(session_id, ev.MODE_CHANGED, payload, what)
        return self._emit(session_id, ev.MODE_CHANGED, payload)

    def remove_option(
        self, session_id: str, option: str, code: str, message: str | None = None
    ) -> Position:
        """Remove an option for the rest of the session, with a reason code."""
        _nonempty(option, "option")
        _nonempty(code, "reason code")
        self._live(session_id)
        payload = {"option": option, "reason": {"code": code, "message": message}}
        return self._emit(session_id, ev.OPTION_REMOVED, payload)

    def require_first(self, session_id: str, tools: Sequence[str]) -> Position:
        """Declare what must run first (replaces the list; an empty list lifts the obligation)."""
        self._live(session_id)
        payload = {"tools": [t for t in tools if isinstance(t, str) and t.strip()]}
        return self._emit(session_id, ev.PREREQUISITE_SET, payload)

    def compact(self, session_id: str, summary: str, through: int) -> Position:
        """Append a summary of the turns through seq `through` (they stay in the history)."""
        if through < 1:
            raise InvalidCall("through must be a seq (>= 1)")
        self._live(session_id)
        plan = CompactionPlan(summary, through)
        return self.append(
            compacted(session_id, plan, self._clock(), self.producer, event_id=self._new_id())
        )

    def end(self, session_id: str, because: str) -> Position:
        """End the session."""
        self._live(session_id)
        return self._emit(session_id, ev.ENDED, {"because": because})

    def record_effect_observation(
        self,
        session_id: str,
        *,
        known: bool,
        artifacts: Sequence[str] = (),
        evidence: Sequence[str] = (),
        observer: str | None = None,
    ) -> str:
        """Record measured effects; pass the returned id as `effect_observation_id`."""
        self._live(session_id)
        event = self.event(
            session_id,
            ev.EFFECT_OBSERVED,
            {
                "known": known,
                "artifacts": list(artifacts),
                "evidence": list(evidence),
                "observer": observer,
            },
        )
        self.append(event)
        return event.event_id

    def record_execution(
        self,
        session_id: str,
        operation: str,
        arguments: Mapping[str, Any],
        *,
        artifact: str | None = None,
        executor: str | None = None,
    ) -> Position:
        """Record an execution receipt (the digest of the canonical arguments is computed here)."""
        _nonempty(operation, "operation")
        self._live(session_id)
        payload = {
            "operation": operation,
            "argument_digest": digest_of(arguments),
            "artifact": artifact,
            "executor": executor,
        }
        return self._emit(session_id, ev.EXECUTION_RECORDED, payload)

    def transfer_open_todos(self, from_: str, to: str) -> int:
        """Move every open card to `to`: target first, then the source's record of it.

        The streams live in different partitions, so the pair is not atomic; deterministic event
        ids make a re-run after an interruption complete the transfer without duplicating a card.
        They are derived under the store's `id_key` (`MILPA_ID_KEY_FILE`), so that an agent of
        either session cannot append an event under one of them first and have the transfer's
        own dropped as its duplicate. Without a key the store makes a random one: a re-run by
        the same store is exact, a re-run by another process rests on its read of the target
        (a card sent before the interruption that the target has not folded yet is sent again).
        A re-run sends the target no card it already holds from this source that it moved on
        since (or that the source did not change): the source's card may have moved too (a new
        version, so a new id), and sending it would undo the target's progress. The source's
        record then names the version the target got. A card the target holds untouched while
        the source changed it is sent again, as the source has it now.
        """
        if from_ == to:
            raise InvalidCall("cannot transfer todos to the same session")
        source = self.load(from_)
        if source.ended:
            raise SessionEndedError(f"session {from_!r} has ended; its open work stays on record")
        target = self._live(to) or self.load(to)  # read even with checks off: see above
        cards = source.open_todos()
        if not cards:
            return 0
        kept = {c.id: c.version for c in cards}
        held = {  # card id -> the source's version the target got, for cards it keeps as they are
            t.id: t.inherited_from.version
            for t in target.todos
            if t.inherited_from is not None
            and t.inherited_from.session == from_
            and (t.version > 1 or t.inherited_from.version == kept.get(t.id))
        }
        for card in cards:
            if card.id in held:
                continue
            payload: dict[str, Any] = {
                "id": card.id,
                "text": card.text,
                "status": card.status,
                "replaces": card.replaces,
                "inherited_from": {
                    "session": from_,
                    "version": card.version,
                    "origin": card.origin,
                },
            }
            event_id = self._transfer_ids.derive("transfer", from_, to, card.id, card.version)
            self.append(self.event(to, ev.TODO_CHANGED, payload, event_id=event_id))
        versions = [(c.id, held.get(c.id, c.version)) for c in cards]
        moved = [{"id": card_id, "version": version} for card_id, version in versions]
        record = {"to": to, "todos": moved}
        event_id = self._transfer_ids.derive("transferred", from_, to, [*map(list, versions)])
        self.append(self.event(from_, ev.TODOS_TRANSFERRED, record, event_id=event_id))
        return len(cards)


def deadline_in(now: datetime, seconds: float) -> str:
    """An `expires_at` text `seconds` after `now` (the model has no default window)."""
    return format_instant(now + timedelta(seconds=seconds))
