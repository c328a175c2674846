"""The immutable `Session` value and the values it is made of."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any, Final

from schemas.codec import MAX_ARGUMENT_DEPTH
from schemas.errors import InvalidCall
from schemas.frozen import fast_init
from session_model.canonical import text_digest
from session_model.deadlines import parse_deadline
from session_model.dedupe import EMPTY as NO_IDS
from session_model.dedupe import RecentIds
from session_model.modes import Mode
from session_model.principal import Principal

ROLES: Final = frozenset({"user", "assistant", "system"})
TODO_STATUSES: Final = frozenset({"pending", "in_progress", "done", "blocked"})
_BOXES: Final = {"done": "[x]", "in_progress": "[~]", "blocked": "[!]", "pending": "[ ]"}

# The hot state keeps at most this many of what only grows (the rest is in the stores' history,
# `SessionStore.facts`): calls, observations and executions since the last summary; the latest
# decisions and rejections.
RECENT_FACTS: Final = 64
RECENT_DECISIONS: Final = 16
RECENT_REJECTIONS: Final = 16
# The artifacts whose latest call the hot state keeps: those called last. An agent names its own
# artifacts (a coding agent, every file it touches): an index of all of them would make each
# call cost, and each summary grow, with the number of files touched so far.
RECENT_ARTIFACTS: Final = 128
# The names a session counts apart, in the order first used: tools (`tools`) and pause reason
# codes (`pauses`). The agent names both, so the counts are bounded as the artifacts are; a name
# first used after the bound is counted under `OTHER_NAMES`.
TOOL_NAMES: Final = 128
PAUSE_REASONS: Final = 64
OTHER_NAMES: Final = "(other)"


@fast_init
@dataclass(frozen=True, slots=True)
class Turn:
    """One turn of the conversation; tool calls and messages are turns too."""

    role: str
    content: str
    seq: int


@fast_init
@dataclass(frozen=True, slots=True)
class Message:
    """One entry of what the model is sent (`window()`)."""

    role: str
    content: str


@fast_init
@dataclass(frozen=True, slots=True)
class InheritedFrom:
    """Where a transferred card came from: the one cross-session fact a fold takes from a writer."""

    session: str
    version: int
    origin: str


@fast_init
@dataclass(frozen=True, slots=True)
class Todo:
    """A todo card with its lineage; every field but `text`/`status`/`replaces` is derived."""

    id: str
    text: str
    status: str
    version: int
    supersedes: int | None
    from_status: str | None
    origin: str
    mutations_at: int
    plan_version: int
    born_in_plan: int
    replaces: str | None = None
    inherited_from: InheritedFrom | None = None
    transferred_to: str | None = None

    @property
    def disposition(self) -> str:
        """`transferred` for a card handed to another session, else `open` (an observation)."""
        return "transferred" if self.transferred_to is not None else "open"


@fast_init
@dataclass(frozen=True, slots=True)
class Question:
    """A question that pauses the session until a human answers or its window closes."""

    id: str
    question: str
    options: tuple[str, ...] = ()
    why: str | None = None
    expires_at: str | None = None
    reason: str | None = None
    seq: int = 0
    asked_at: datetime | None = None

    def deadline(self) -> datetime | None:
        """The deadline as an instant, or None when there is none or it cannot be read."""
        return parse_deadline(self.expires_at)

    def has_expired(self, now: datetime) -> bool:
        """False without a readable deadline; else `now > deadline`."""
        deadline = self.deadline()
        return deadline is not None and now > deadline

    def named_by(self, question_id: object, asked_seq: object) -> bool:
        """Whether an answer naming this question id and asking answers this asking (one without
        `asked_seq`, written before answers named their asking, is taken as meant for it)."""
        return question_id == self.id and (
            asked_seq is None or (type(asked_seq) is int and asked_seq == self.seq)
        )

    def relaxed_by(self, answer: str) -> bool:
        """Whether answering `answer` makes the session less supervised (an operator's act): any
        answer to a signature question (it carries the signed call), and a yes (the first
        option, what the fold counts as affirmative) to a permission question (`perm:<op>`) or
        to a target question (`target_not_named`: the yes is what `Session.confirmed` reads)."""
        if self.reason == "signature":
            return True
        yes_relaxes = self.reason in ("permission", "target_not_named") or self.id.startswith(
            "perm:"
        )
        return yes_relaxes and bool(self.options) and answer == self.options[0]

    def signed_call(self) -> tuple[str, str]:
        """For a signature question: the operation and the argument digest it asks to approve.

        `why` is the canonical JSON of the call's arguments (`signature_question`), so its
        sha256 is their digest.
        """
        return self.id.removeprefix("sign:"), text_digest(self.why or "")


@fast_init
@dataclass(frozen=True, slots=True)
class Decision:
    """What resolved a question: an answer, or the window closing (`answer == ""`, `by is None`)."""

    question_id: str
    question: str
    answer: str
    by: Principal | None
    executor: str | None
    reason: str | None
    why: str | None
    seq: int
    event_id: str
    affirmative: bool = False
    decided_at: datetime | None = None
    expired_at: datetime | None = None
    asked_at: datetime | None = None
    asked_seq: int = 0  # the seq of the question's asking (0 in states folded before it was kept)


@fast_init
@dataclass(frozen=True, slots=True)
class Approval:
    """A human's signature over one call: the operation and its exact arguments, used once."""

    operation: str
    argument_digest: str
    key_id: str
    signature_id: str  # sha256 (hex, 32 characters) of the signature: a replay is recognised
    seq: int  # the answer that carried it
    consumed_at: int | None = None  # the seq of the `tool_called` that used it


@fast_init
@dataclass(frozen=True, slots=True)
class Rejection:
    """An event the fold could not apply: it stays in the log, takes a seq and is recorded here."""

    seq: int
    event_id: str
    type: str
    code: str
    producer: str
    occurred_at: datetime
    by: Principal | None = None


@fast_init
@dataclass(frozen=True, slots=True)
class CallFact:
    """What the operational facts keep of one tool call."""

    seq: int
    tool: str
    result: str
    ok: bool
    mutating: bool
    artifact: str | None = None
    verdict: str | None = None
    effect_observation_id: str | None = None


def with_latest(
    artifacts: Mapping[str, CallFact], name: str, call: CallFact
) -> dict[str, CallFact]:
    """`artifacts` with `call` as artifact `name`'s latest call: of the `RECENT_ARTIFACTS`
    artifacts called last (the one called longest ago leaves when a new one comes).

    The index is ordered by the latest call's seq, oldest first (`call` is the latest of all):
    the one to leave is the first.
    """
    kept = dict(artifacts)
    if kept.pop(name, None) is None and len(kept) >= RECENT_ARTIFACTS:
        del kept[next(iter(kept))]
    kept[name] = call
    return kept


def counted(counts: Mapping[str, int], name: str, bound: int) -> dict[str, int]:
    """`counts` with one more under `name`, or under `OTHER_NAMES` when `name` is new and
    `bound` names are counted already."""
    kept = dict(counts)
    if name not in kept and len(kept) >= bound:
        name = OTHER_NAMES
    kept[name] = kept.get(name, 0) + 1
    return kept


def bounded_counts(counts: Mapping[str, int], bound: int) -> dict[str, int]:
    """`counts` as `counted` keeps them: the first `bound` names, the rest under `OTHER_NAMES`
    (a state stored before the bound is read so, and folds on as one fold would)."""
    if len(counts) <= bound:
        return dict(counts)
    kept: dict[str, int] = {}
    for name, n in counts.items():
        key = name if name in kept or len(kept) < bound else OTHER_NAMES
        kept[key] = kept.get(key, 0) + n
    return kept


def latest_artifacts(calls: Iterable[CallFact]) -> dict[str, CallFact]:
    """The index of these latest calls (one per artifact) as the fold keeps it: ordered by seq,
    of the `RECENT_ARTIFACTS` artifacts called last (a state stored before that bound, or in
    another order, is read so)."""
    found = [c for c in calls if c.artifact is not None]
    if any(a.seq > b.seq for a, b in itertools.pairwise(found)):
        found.sort(key=lambda c: c.seq)
    return {c.artifact: c for c in found[-RECENT_ARTIFACTS:] if c.artifact is not None}


@fast_init
@dataclass(frozen=True, slots=True)
class ExecutionFact:
    """An execution receipt: the only proof that something materialised."""

    seq: int
    operation: str
    argument_digest: str
    artifact: str | None = None
    executor: str | None = None


@fast_init
@dataclass(frozen=True, slots=True)
class Observation:
    """An effect observation: measured artifact and behavioural-evidence identities."""

    event_id: str
    seq: int
    known: bool
    artifacts: tuple[str, ...] = ()
    evidence: tuple[str, ...] = ()
    observer: str | None = None


@fast_init
@dataclass(frozen=True, slots=True)
class OpenCard:
    """One element of the derived open-work fact."""

    id: str
    status: str
    version: int
    disposition: str
    mutations_since: int
    to: str | None = None


@dataclass(frozen=True, slots=True)
class History:
    """What a session's history holds of what only grows, in seq order (`SessionStore.facts`).

    The complete counterpart of the recent parts `Session` keeps.
    """

    session_id: str
    seq: int = 0
    calls: tuple[CallFact, ...] = ()
    observations: tuple[Observation, ...] = ()
    executions: tuple[ExecutionFact, ...] = ()
    decisions: tuple[Decision, ...] = ()
    rejections: tuple[Rejection, ...] = ()

    def extended(self, seq: int, records: Iterable[HistoryRecord]) -> History:
        """This history with `records` appended (each to its kind's list), reaching `seq`."""
        lists: dict[type, list[Any]] = {t: [] for t in _HISTORY_FIELD}
        for record in records:
            lists[type(record)].append(record)
        return History(
            self.session_id,
            seq,
            *(getattr(self, name) + tuple(lists[t]) for t, name in _HISTORY_FIELD.items()),
        )

    def only(self, kinds: frozenset[str]) -> History:
        """This history with the lists of other kinds left empty."""
        return History(
            self.session_id,
            self.seq,
            *(getattr(self, k) if k in kinds else () for k in HISTORY_KINDS),
        )


HISTORY_KINDS: Final = ("calls", "observations", "executions", "decisions", "rejections")
"""A history's kinds, in the order of its fields (and of its lists in Redis)."""


def history_kinds(kinds: Iterable[str] | None) -> frozenset[str]:
    """The history kinds asked for (every kind for None); InvalidCall for one there is not."""
    if kinds is None:
        return frozenset(HISTORY_KINDS)
    asked = frozenset(kinds)
    unknown = asked - set(HISTORY_KINDS)
    if unknown:
        raise InvalidCall(
            f"no history kind {', '.join(sorted(unknown))}: "
            f"the kinds are {', '.join(HISTORY_KINDS)}"
        )
    return asked


HistoryRecord = CallFact | Observation | ExecutionFact | Decision | Rejection
"""What a session's history holds, one list per kind."""
_HISTORY_FIELD: Final[dict[type, str]] = {
    CallFact: "calls",
    Observation: "observations",
    ExecutionFact: "executions",
    Decision: "decisions",
    Rejection: "rejections",
}


@dataclass(frozen=True)
class Session:
    """Everything the fold knows about one session after its last event.

    `turns` holds the turns not yet summarised (`seq > compacted_through`): the working set the
    window is made of. Summarised turns are never lost; the stores keep every turn in the
    session's history (`SessionStore.history`), and the log keeps every event.

    The state is bounded, so that an event costs the same in a session's first hour and its
    third day: what only grows is kept here as its recent part — `calls`, `observations` and
    `executions` since the last summary (at most `RECENT_FACTS` each), the last
    `RECENT_DECISIONS` decisions and `RECENT_REJECTIONS` rejections, the ids of the last events
    (`session_model.dedupe`) — beside exact indexes the decisions need (`decided`,
    `confirmations`, `rejected` counts, `tools` counts) and the latest call of the artifacts called
    last (`RECENT_ARTIFACTS`). The stores
    append every call, observation, execution, decision and rejection to the session's history
    (`SessionStore.facts`).
    """

    id: str
    started: bool = False
    goal: str = ""
    parent_id: str | None = None
    mode: Mode = Mode.ASK
    turns: tuple[Turn, ...] = ()
    turn_count: int = 0
    plan: str | None = None
    plan_version: int = 0
    tool_calls: int = 0
    mutations: int = 0
    todos: tuple[Todo, ...] = ()
    permissions: tuple[str, ...] = ()
    removed_options: tuple[str, ...] = ()
    run_first: tuple[str, ...] = ()
    obligation_declared: bool = False
    summary: str | None = None
    compacted_through: int = 0
    question: Question | None = None
    closed_question: Question | None = None
    decisions: tuple[Decision, ...] = ()
    ended_because: str | None = None
    open_work: tuple[OpenCard, ...] = ()
    seq: int = 0
    rejections: tuple[Rejection, ...] = ()
    pauses: Mapping[str, int] = field(default_factory=dict)
    skipped: int = 0
    downgrades: int = 0
    calls: tuple[CallFact, ...] = ()
    executions: tuple[ExecutionFact, ...] = ()
    observations: tuple[Observation, ...] = ()
    approvals: tuple[Approval, ...] = ()
    event_ids: RecentIds = NO_IDS
    decided: frozenset[str] = frozenset()  # every question id a decision resolved
    decision_count: int = 0  # every decision (`decisions` keeps the recent ones)
    confirmations: frozenset[tuple[str, str]] = frozenset()  # (operation, target) said yes to
    rejected: Mapping[str, int] = field(default_factory=dict)  # rejections by code
    tools: Mapping[str, int] = field(default_factory=dict)  # calls by tool
    # the latest call of the `RECENT_ARTIFACTS` artifacts called last, ordered by seq, its result
    # left out (its turn and the history keep it)
    artifacts: Mapping[str, CallFact] = field(default_factory=dict)
    # The ids of every applied event a signature authorised (a grant, a less strict mode or
    # start, a verified answer, a call approval): kept for good, not in the bounded window of
    # `event_ids`, because one applied again later (after a revocation, a stricter mode, a
    # re-asked question) would raise authority with nobody signing. Operators' acts: few.
    signed_ids: frozenset[str] = frozenset()

    def evolve(self, **changes: Any) -> Session:
        """A copy with some fields changed (unknown field names are an error)."""
        unknown = changes.keys() - _SESSION_FIELDS
        if unknown:
            raise TypeError(f"Session has no field(s) {', '.join(sorted(unknown))}")
        return self._derive(changes)

    def _derive(self, changes: dict[str, Any]) -> Session:
        """A copy with `changes` applied, unchecked: the fold's one way of making the next state.

        `dataclasses.replace` re-runs the frozen `__init__` over all 33 fields (about 3 µs); a
        copy of the instance dictionary with the changes laid over it costs a sixth of that and
        keeps the value immutable to everyone else. (Session has no `__slots__` for this reason.)
        The fold calls it once per event with every field the event changes.
        """
        new = _new_object(Session)
        _set_attribute(new, "__dict__", self.__dict__ | changes)  # `|`: the quickest dict copy
        return new

    # -- reading the state ---------------------------------------------------------------------

    @property
    def ended(self) -> bool:
        """True once the session has ended (by `ended` or a closed answer window)."""
        return self.ended_because is not None

    def late_for(self, question_id: object, asked_seq: object) -> Question | None:
        """The asking whose window closed, if an answer naming these came late for it (one
        naming an earlier asking is not late: a write to an ended session, as any other)."""
        closed = self.closed_question
        if self.ended and closed is not None and closed.named_by(question_id, asked_seq):
            return closed
        return None

    def is_runnable(self) -> bool:
        """Started, not ended and no open question."""
        return self.started and not self.ended and self.question is None

    def allows(self, operation: str) -> bool:
        """Whether `operation` is granted in this session."""
        return operation in self.permissions

    def approval_for(self, operation: str, argument_digest: str) -> Approval | None:
        """The unused signed approval of exactly this call, if any."""
        for a in self.approvals:
            if (
                a.consumed_at is None
                and a.operation == operation
                and a.argument_digest == argument_digest
            ):
                return a
        return None

    def todo(self, todo_id: str) -> Todo | None:
        """The card with this id, if any."""
        for card in self.todos:
            if card.id == todo_id:
                return card
        return None

    def pending_todos(self) -> tuple[Todo, ...]:
        """Cards not `done` (blocked counts as pending)."""
        return tuple(t for t in self.todos if t.status != "done")

    def open_todos(self) -> tuple[Todo, ...]:
        """Cards not `done` and not transferred to another session."""
        return tuple(t for t in self.pending_todos() if t.transferred_to is None)

    def rejection_counts(self) -> dict[str, int]:
        """Rejections counted by code (all of them, not only the recent ones kept)."""
        return dict(self.rejected)

    def state_briefing(self) -> str | None:
        """The plan and every card (closed ones too, or the agent redoes work), or None."""
        if self.plan is None and not self.todos:
            return None
        lines: list[str] = []
        if self.plan is not None:
            lines.append(f"Plan of this session: {self.plan}")
        if self.todos:
            lines.append("Todos:")
            lines.extend(f"{_BOXES.get(t.status, '[ ]')} {t.id}: {t.text}" for t in self.todos)
        return "\n".join(lines)

    def window(self) -> tuple[Message, ...]:
        """What to send the model: the summary, the briefing, then every unsummarised turn."""
        messages: list[Message] = []
        if self.summary is not None:
            messages.append(
                Message(
                    "system", "Summary of what already happened in this session:\n" + self.summary
                )
            )
        briefing = self.state_briefing()
        if briefing is not None:
            messages.append(Message("system", briefing))
        messages.extend(
            Message(t.role, t.content) for t in self.turns if t.seq > self.compacted_through
        )
        return tuple(messages)

    def confirmed(self, operation: str, target: str) -> bool:
        """True if a human said yes to a `target_not_named` question naming op and target."""
        return (operation, target) in self.confirmations


_SESSION_FIELDS = frozenset(f.name for f in fields(Session))
_new_object = object.__new__
_set_attribute = object.__setattr__  # Session's own refuses: it is frozen


def confirmation_of(decision: Decision) -> tuple[str, str] | None:
    """The (operation, target) a decision confirms: a yes to a `target_not_named` question."""
    if decision.reason != "target_not_named" or not decision.affirmative:
        return None
    named = _json_object(decision.why)
    operation, target = named.get("operation"), named.get("target")
    if isinstance(operation, str) and isinstance(target, str):
        return operation, target
    return None


def _json_object(text: str | None) -> dict[str, Any]:
    if text is None or _nests_deeper(text, MAX_ARGUMENT_DEPTH):
        # An agent's text: one nested deeper than that is no object of ours. Refused before it
        # is parsed, since where `json.loads` runs out of stack depends on how deep the caller's
        # is (a worker's and a rebuild's differ): the fold must decide alike in both.
        return {}
    try:
        value = json.loads(text, object_pairs_hook=_unique_keys)
    except (ValueError, RecursionError):  # (a repeated key too)
        return {}
    return value if isinstance(value, dict) else {}


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are all different: `{"target": "staging", "target": "prod"}`
    reads as staging to a person and as prod to `json.loads` (the last wins), so it names
    nothing."""
    found = dict(pairs)
    if len(found) != len(pairs):
        raise ValueError("a key is repeated")
    return found


def _nests_deeper(text: str, limit: int) -> bool:
    """Whether JSON text opens more than `limit` arrays or objects inside each other (brackets in
    strings not counted); scanned only when it holds that many opening brackets at all."""
    if text.count("{") + text.count("[") <= limit:
        return False
    depth, quoted, escaped = 0, False, False
    for ch in text:
        if quoted:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                quoted = False
        elif ch == '"':
            quoted = True
        elif ch in "[{":
            depth += 1
            if depth > limit:
                return True
        elif ch in "]}":
            depth -= 1
    return False
