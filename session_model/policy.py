"""How far an automatic process may go: `SessionPolicy.decide`, questions, and the ancestor ceiling.

The order of the rules is the rule. The signature is evaluated before the grant and before the
mode: evaluated later, a grant on that operation (or an `auto` mode) would let it through, and the
only gate that names the concrete call instead of the category would be gone. Reading is never
asked. A child session with no ceiling fails closed: deciding without its ancestors would let a
child of an `ask` session run in `auto`.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final

from schemas.errors import InvalidAnswerError, MissingCeilingError
from session_model.canonical import argument_digest, canonical_json
from session_model.modes import Mode, strictest
from session_model.session import Question, Session


class Verdict(StrEnum):
    """The policy's answer for one operation."""

    ALLOW = "allow"
    ASK_PERMISSION = "ask_permission"
    REQUIRE_SIGNATURE = "require_signature"


@dataclass(frozen=True, slots=True)
class SessionPolicy:
    """Pure: calls nobody, appends nothing."""

    def decide(
        self,
        session: Session,
        operation: str,
        *,
        mutating: bool,
        requires_signature: bool,
        ceiling: Mode | None = None,
        arguments: Mapping[str, Any] | None = None,
    ) -> Verdict:
        """Apply the five rules in their order; the first that matches decides.

        Under the signature rule, an unused signed approval of exactly this call (`arguments`)
        allows it, once: the `tool_called` that makes the call consumes the approval.
        """
        if session.parent_id is not None and ceiling is None:
            raise MissingCeilingError(
                f"session {session.id!r} has a parent; pass ceiling=ceiling_for(...)"
            )
        if requires_signature:
            if arguments is not None and session.approval_for(
                operation, argument_digest(dict(arguments))
            ):
                return Verdict.ALLOW
            return Verdict.REQUIRE_SIGNATURE
        if not mutating:
            return Verdict.ALLOW
        if session.allows(operation):
            return Verdict.ALLOW
        if strictest(session.mode, ceiling) is Mode.ASK:
            return Verdict.ASK_PERMISSION
        return Verdict.ALLOW


# The options of a permission question, the affirmative one first.
PERMISSION_OPTIONS: Final = ("yes", "no")


def permission_question(
    operation: str, arguments: Mapping[str, Any], expires_at: str | None = None
) -> Question:
    """The question to ask before a mutating operation in `ask` mode."""
    return Question(
        id=f"perm:{operation}",
        question=f"Allow «{operation}» in this session?",
        options=PERMISSION_OPTIONS,
        why=canonical_json(dict(arguments)),
        expires_at=expires_at,
        reason="permission",
    )


SIGNATURE = "signature"  # the reason of a signature question
APPROVAL = "approved"  # the one answer to a signature question: answering it signs the call


def check_signature_answer(question: Question, answer: str) -> None:
    """Refuse (InvalidAnswerError) an answer to a signature question other than its approval:
    answering it signs the call, so a "no" would be signed as an approval. Nor is a call signed
    whose operation's name (the agent's) holds a character that shows nothing or moves what
    follows: the name the operator reads would not be the name signed."""
    if question.reason != SIGNATURE:
        return
    if answer != APPROVAL:
        raise InvalidAnswerError(
            f"{question.id!r} asks for a signature: it is answered only by approving the call "
            f"({APPROVAL!r}); to decline, let its window close or end the session"
        )
    operation, _ = question.signed_call()
    if not operation or len(operation) > SIGNABLE_NAME_CHARS or written_out(operation) != operation:
        raise InvalidAnswerError(
            f"{question.id!r} asks to sign an operation whose name would not read as the name "
            f"signed ({written_out(operation[:SIGNABLE_NAME_CHARS])!r}: empty, over "
            f"{SIGNABLE_NAME_CHARS} characters, or with characters that show nothing or move "
            "what follows), so it cannot be signed; let its window close or end the session"
        )


SIGNABLE_NAME_CHARS = 512  # the longest operation name a signature is given for

# What shows nothing or moves what follows: control and format characters (bidirectional
# overrides and marks, zero-width ones), private-use, surrogates, unassigned, line and paragraph
# separators.
_UNSEEN = frozenset({"Cf", "Cc", "Co", "Cs", "Cn", "Zl", "Zp"})


def written_out(text: str, keep: str = "") -> str:
    """`text` with every character that shows nothing, or moves what follows (but those in
    `keep`), written out as `<U+XXXX>`: what an operator signs must read as the bytes signed
    (`\u202e` shows `gnp.exe` for `exe.png`)."""
    return "".join(
        f"<U+{ord(c):04X}>" if c not in keep and unicodedata.category(c) in _UNSEEN else c
        for c in text
    )


def signature_question(
    operation: str, arguments: Mapping[str, Any], expires_at: str | None = None
) -> Question:
    """The question to ask for a signature: no options, because a click cannot sign."""
    return Question(
        id=f"sign:{operation}",
        question=f"«{operation}» needs a signature over this exact call.",
        options=(),
        why=canonical_json(dict(arguments)),
        expires_at=expires_at,
        reason=SIGNATURE,
    )


def target_question(
    operation: str, target: str, question: str, expires_at: str | None = None
) -> Question:
    """Ask the human to confirm the target an operation was not told; a yes names only it."""
    return Question(
        id=f"target:{operation}:{target}",
        question=question,
        options=("yes", "no"),
        why=canonical_json({"operation": operation, "target": target}),
        expires_at=expires_at,
        reason="target_not_named",
    )


def ceiling_for(session: Session, lookup: Callable[[str], Session | None]) -> Mode | None:
    """The strictest mode along the whole ancestor chain; None for a root.

    Resolved at ask time rather than copied at birth, so tightening an ancestor tightens its
    descendants. A missing ancestor or a cycle reads as `ask`: an unknown chain fails closed.
    """
    if session.parent_id is None:
        return None
    ceiling: Mode | None = None
    seen = {session.id}
    ancestor_id: str | None = session.parent_id
    while ancestor_id is not None:
        if ancestor_id in seen:
            return Mode.ASK
        seen.add(ancestor_id)
        ancestor = lookup(ancestor_id)
        if ancestor is None or not ancestor.started:
            return Mode.ASK
        ceiling = strictest(ancestor.mode, ceiling)
        ancestor_id = ancestor.parent_id
    return ceiling
