"""Compaction: a factual summary of the old turns, appended; the recent turns stay intact.

The threshold counts turns not yet summarised, never all of them: the total never goes down, so
counting it would compact on every turn, each summary hiding the last. The default summarizer calls
no model: what compaction loses in a coding session is facts, and the facts are already in the
stream, exact. Whatever prose a custom `Summarizer` writes, the operational-facts block follows it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from schemas.errors import ConfigurationError
from session_model.canonical import canonical_json, text_digest
from session_model.cutting import cut_text
from session_model.session import Session

# 3: `artifacts` lists the latest call of the artifacts called last (`RECENT_ARTIFACTS`), not of
# every one. 4: `tools` counts the first `TOOL_NAMES` tools apart and the rest under `(other)`.
FACTS_VERSION = 4
RESULT_BOUND = 500
FACTS_HEADER = f"Operational facts (JSON, version {FACTS_VERSION}):"
# A summary's bounds, in characters (4 bytes each at most): with the event around it, well inside
# a produce request (1 MiB).
PROSE_CHARS = 48_000
FACTS_CHARS = 160_000
FACT_TEXT_CHARS = 2_000  # of each text in a facts block too long whole (then a tenth of it)
_OMITTED = "too large for a summary: the session's history holds every fact"


def _cut_key(key: str, kept: int) -> str:
    """A key cut like a text, with its digest: two long keys alike in their first `kept`
    characters stay two keys."""
    if len(key) <= kept:
        return key
    return f"{cut_text(key, kept)} #{text_digest(key)[:12]}"


def _cut_texts(value: Any, kept: int) -> Any:
    """`value` with every string longer than `kept` cut (keys included), structure kept."""
    if isinstance(value, str):
        return cut_text(value, kept)
    if isinstance(value, dict):
        return {_cut_key(k, kept): _cut_texts(v, kept) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_cut_texts(v, kept) for v in value]
    return value


def compaction_due(session: Session, max_turns: int | None) -> bool:
    """The one compaction rule: more unsummarised turns than `max_turns`, in a live session.

    The worker's due index, the scheduler and `Compactor` all ask this. `Session.turns` holds
    exactly the unsummarised turns (`seq > compacted_through`).
    """
    return max_turns is not None and not session.ended and len(session.turns) > max_turns


class CompactionTarget(Protocol):
    """Anything that can append a `compacted` event (a `SessionStore`)."""

    def compact(self, session_id: str, summary: str, through: int) -> object:
        """Append `compacted {summary, through}` to the session."""
        ...


class Summarizer(Protocol):
    """Writes the prose of a summary of `session` through seq `through`."""

    def summarize(self, session: Session, through: int) -> str:
        """Return the prose; the facts block is appended by the compactor."""
        ...


@dataclass(frozen=True, slots=True)
class SessionFacts:
    """Facts derived from a session's state for summaries (no model, no guessing)."""

    session: Session

    def operational_facts(self) -> dict[str, Any]:
        """The versioned operational-facts block; calls and executions are never joined.

        The block is bounded, so that a summary of a session's third day is as short as one of
        its first hour: the calls, executions, verdicts and evidence since the previous summary
        (at most `RECENT_FACTS` of each), the recent decisions, and what the previous summaries
        carried forward — the latest call of the `RECENT_ARTIFACTS` artifacts called last and the
        calls counted by tool. The complete record stays in the session's history
        (`SessionStore.facts`) and the log.
        """
        s = self.session
        latest = s.artifacts
        calls = [
            {
                "tool": c.tool,
                "artifact": c.artifact,
                "result": c.result[:RESULT_BOUND],
                "ok": c.ok,
                "mutating": c.mutating,
                "seq": c.seq,
                # (a call since the summary is among the RECENT_FACTS latest: its artifact among
                # the RECENT_ARTIFACTS called last, which are more)
                "latest_for_artifact": c.artifact is not None
                and c.artifact in latest
                and latest[c.artifact].seq == c.seq,
            }
            for c in s.calls
        ]
        return {
            "version": FACTS_VERSION,
            "calls": calls,
            "artifacts": [
                {
                    "artifact": name,
                    "tool": c.tool,
                    "ok": c.ok,
                    "mutating": c.mutating,
                    "verdict": c.verdict,
                    "seq": c.seq,
                }
                for name, c in sorted(latest.items())
            ],
            "tools": dict(sorted(s.tools.items())),
            "executions": [
                {
                    "operation": x.operation,
                    "argument_digest": x.argument_digest,
                    "artifact": x.artifact,
                    "executor": x.executor,
                    "seq": x.seq,
                }
                for x in s.executions
            ],
            "verdicts": [
                {"tool": c.tool, "artifact": c.artifact, "verdict": c.verdict, "seq": c.seq}
                for c in s.calls
                if c.verdict is not None
            ],
            "decisions": [
                {
                    "question_id": d.question_id,
                    "question": d.question,
                    "answer": d.answer,
                    "by": d.by.to_record() if d.by else None,
                    "reason": d.reason,
                    "why": d.why,
                    "expired": d.expired_at is not None,
                    "seq": d.seq,
                }
                for d in s.decisions
            ],
            "evidence": [
                {
                    "observation": o.event_id,
                    "known": o.known,
                    "artifacts": list(o.artifacts),
                    "evidence": list(o.evidence),
                    "observer": o.observer,
                    "seq": o.seq,
                }
                for o in s.observations
            ],
            "execution_effect_currentness": "unknown",
        }

    def turns_covered(self, through: int) -> int:
        """How many turns a summary through `through` covers, counting earlier summaries."""
        s = self.session
        summarised_before = s.turn_count - len(s.turns)
        return summarised_before + sum(1 for t in s.turns if t.seq <= through)


@dataclass(frozen=True, slots=True)
class FactualSummarizer:
    """The default summarizer: a list of facts, each one read from the stream."""

    def summarize(self, session: Session, through: int) -> str:
        """Goal, plan, tools, grants, done, pending, decisions, and what the summary covers."""
        s = session
        lines = [f"Goal: {s.goal}"]
        if s.plan is not None:
            lines.append(f"Plan (version {s.plan_version}): {s.plan}")
        if s.tools:
            lines.append(
                "Tools used: " + ", ".join(f"{t} ×{n}" for t, n in sorted(s.tools.items()))
            )
        if s.permissions:
            lines.append("Permissions granted: " + ", ".join(s.permissions))
        done = [t for t in s.todos if t.status == "done"]
        if done:
            lines.append("Done: " + "; ".join(f"{t.id}: {t.text}" for t in done))
        pending = s.pending_todos()
        if pending:
            lines.append(
                "Pending: "
                + "; ".join(
                    f"{t.id}: {t.text}" + (" [blocked]" if t.status == "blocked" else "")
                    for t in pending
                )
            )
        for d in s.decisions:
            if d.expired_at is None:
                lines.append(f"Human decision: {d.question} → «{d.answer}»")
            else:
                lines.append(f"Unanswered: {d.question} (window closed)")
        covered = SessionFacts(s).turns_covered(through)
        lines.append(
            f"This summary covers {covered} turns; the full record remains in session {s.id}."
        )
        return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class CompactionPlan:
    """A compaction that is due: the summary to append and the seq it covers through."""

    summary: str
    through: int


@dataclass(frozen=True, slots=True)
class Compactor:
    """Decides when a session is compacted and writes the summary (facts block included)."""

    max_turns: int = 40
    keep_recent: int = 12
    summarizer: Summarizer = field(default_factory=FactualSummarizer)

    def __post_init__(self) -> None:
        if self.keep_recent < 0 or self.max_turns <= self.keep_recent:
            raise ConfigurationError("Compactor needs max_turns > keep_recent >= 0")

    def cut(self, session: Session) -> int | None:
        """The seq to compact through (keeping `keep_recent` turns), or None when none is due."""
        if not compaction_due(session, self.max_turns):
            return None
        return session.turns[len(session.turns) - self.keep_recent - 1].seq

    def summary(self, session: Session, through: int) -> str:
        """The summarizer's prose followed by the operational-facts block no summarizer removes.

        Bounded (`PROSE_CHARS` + `FACTS_CHARS`): a goal, a plan, a question may each be as long
        as an event may be, and a summary that no produce request could carry would be retried
        for ever. Long texts are cut with a marker; the whole ones stay in the session's history.
        """
        prose = cut_text(self.summarizer.summarize(session, through), PROSE_CHARS)
        facts = SessionFacts(session).operational_facts()
        block = canonical_json(facts)
        for kept in (FACT_TEXT_CHARS, FACT_TEXT_CHARS // 10):
            if len(block) <= FACTS_CHARS:
                break
            block = canonical_json(_cut_texts(facts, kept))
        if len(block) > FACTS_CHARS:
            block = canonical_json({"version": FACTS_VERSION, "omitted": _OMITTED})
        return f"{prose}\n\n{FACTS_HEADER}\n{block}"

    def plan(self, session: Session) -> CompactionPlan | None:
        """What to append, or None when nothing is due (or the session has ended)."""
        through = self.cut(session)
        if through is None:
            return None
        return CompactionPlan(self.summary(session, through), through)

    def compact_if_needed(self, store: CompactionTarget, session: Session) -> str | None:
        """Append the summary when one is due and return it; None when nothing was due."""
        plan = self.plan(session)
        if plan is None:
            return None
        store.compact(session.id, plan.summary, plan.through)
        return plan.summary
