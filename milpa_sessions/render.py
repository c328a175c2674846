"""Rendering sessions for people: tables on the terminal."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from session_model.narration import sentence
from session_model.session import History, Session

out = Console()


def add_literal_row(table: Table, *cells: str) -> None:
    """Add a row whose cells print exactly as written, never read as markup or emoji codes."""
    # Agents write goals, todos, questions, ids and codes: a `[/x]` in one would raise, a tag
    # would hide text, `:x:` would print an emoji. `Text` cells are printed as they are.
    table.add_row(*(Text(c) for c in cells))


def session_summary(s: Session) -> dict[str, Any]:
    """The fields `list` and `show` print."""
    status = "ended" if s.ended else ("waiting" if s.question else "runnable")
    return {
        "id": s.id,
        "status": status,
        "mode": s.mode.value,
        "goal": s.goal,
        "seq": s.seq,
        "turns": s.turn_count,
        "plan_version": s.plan_version,
        "open_todos": len(s.open_todos()),
        "question": s.question.id if s.question else None,
        "permissions": list(s.permissions),
        "decisions": s.decision_count,
        "rejections": s.rejection_counts(),
        "downgrades": s.downgrades,
        "parent_id": s.parent_id,
        "ended_because": s.ended_because,
    }


def render_session(s: Session, history: History | None = None) -> None:
    """Print a session as an operator reads it (every decision and rejection with `history`,
    else the recent ones its state keeps)."""
    info = session_summary(s)
    out.print(
        Text.assemble((s.id, "bold"), f"  {info['status']}  mode={s.mode.value}  seq={s.seq}")
    )
    out.print(Text(f"goal: {s.goal}"))
    if s.ended_because:
        out.print(Text(f"ended: {s.ended_because}"))
    if s.todos:
        todos = Table("todo", "status", "v", "origin", "disposition", "text", title="todos")
        for t in s.todos:
            add_literal_row(todos, t.id, t.status, str(t.version), t.origin, t.disposition, t.text)
        out.print(todos)
    decisions = history.decisions if history else s.decisions
    rejections = history.rejections if history else s.rejections
    if decisions:
        table = Table("question", "answer", "by", "verified", "reason", title="decisions")
        for d in decisions:
            add_literal_row(
                table,
                d.question,
                d.answer or "(window closed)",
                d.by.id if d.by else "-",
                "yes" if d.by and d.by.verified else "no",
                d.reason or "-",
            )
        out.print(table)
    if rejections:
        table = Table("seq", "type", "code", "producer", title="rejections")
        for r in rejections:
            add_literal_row(table, str(r.seq), r.type, r.code, r.producer)
        out.print(table)


def render_timeline(entries: list[dict[str, Any]]) -> None:
    """Print timeline entries as readable sentences (`--json` prints them as recorded)."""
    table = Table("seq", "what happened")
    questions: dict[str, str] = {}
    for e in entries:
        q = e.get("question")
        if isinstance(q, dict) and isinstance(q.get("id"), str):
            questions[q["id"]] = str(q.get("question", ""))
        table.add_row(str(e["seq"]), Text(sentence(e, questions)))  # Text: no markup in it
    out.print(table)
