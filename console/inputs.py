"""What an operator's act may carry, checked alike for the API's JSON bodies and the pages' forms.

The API declares these models as its request bodies (FastAPI validates them, a refusal is a 422
problem); the pages run the same models through `validated` (a refusal is `InvalidInputError`,
reported like any refused act). One set of limits: every text one an event can carry.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, Field, ValidationError, field_validator

from schemas.errors import InvalidCall
from session_model.modes import Mode

NAME_CHARS = 512  # a question id, an operation's name
TEXT_CHARS = 65_536  # an answer, why a session ends
# The largest body a valid act needs: its one long text at 12 bytes a character at worst (an
# astral one JSON-escaped as two `\uXXXX`, or its 4 UTF-8 bytes URL-encoded as `%XX` each), and
# room for the short fields. A larger one is refused (413) as it is read, signed in or not: a
# JSON body is read before its caller is checked, the sign-in form before its CSRF and limits.
MAX_BODY_BYTES = 12 * TEXT_CHARS + 64 * 1024
MAX_LATEST = 1_000  # timeline entries one read of the latest may ask for
FORM_FIELDS = 16  # more than any console form has (and none has a file)


class InvalidInputError(InvalidCall):
    """An act's input is outside what the console accepts (the API's 422 `invalid_request`)."""

    code = "invalid_request"


class ActRequest(BaseModel):
    """An act's input: every text one an event can carry (UTF-8 holds it: no lone surrogate)."""

    @field_validator("*", mode="after")
    @classmethod
    def _utf8(cls, value: Any) -> Any:
        if isinstance(value, str) and not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("text UTF-8 cannot hold (a lone surrogate)") from None
        return value


class AnswerRequest(ActRequest):
    """An answer to a session's open question."""

    question_id: str = Field(min_length=1, max_length=NAME_CHARS)
    answer: str = Field(max_length=TEXT_CHARS)
    # For a signature question: the operation's name, typed back as deliberate confirmation.
    confirm: str | None = Field(default=None, max_length=NAME_CHARS)
    # The `seq` of the question as the caller was shown it: refused (409) if it was asked again.
    asked_seq: int | None = Field(default=None, ge=1, le=2**63 - 1)


# An operation's name: no C0 or C1 control characters, no bidirectional overrides or marks
# (a name that reads as another on a page or in a log).
OPERATION_PATTERN = r"^[^\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]+$"
_OPERATION = re.compile(OPERATION_PATTERN)


def is_operation_name(name: str) -> bool:
    """Whether `name` may be granted (what `OperationRequest` accepts)."""
    return 0 < len(name) <= NAME_CHARS and _OPERATION.match(name) is not None


class OperationRequest(ActRequest):
    """An operation to grant (a name: no control or bidirectional formatting characters)."""

    operation: str = Field(min_length=1, max_length=NAME_CHARS, pattern=OPERATION_PATTERN)


class RevokeRequest(ActRequest):
    """An operation to revoke: any granted name, whatever it holds (taking a permission away is
    never refused for the name's form; a grant made before the limits may hold anything)."""

    operation: str = Field(min_length=1, max_length=TEXT_CHARS)


class ModeRequest(ActRequest):
    """The autonomy mode to change to."""

    mode: Mode


class EndRequest(ActRequest):
    """Why the session ends."""

    because: str = Field(min_length=1, max_length=TEXT_CHARS)


Act = TypeVar("Act", bound=ActRequest)


def error_lines(errors: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    """Pydantic's errors as `{where, problem}` (never the refused input itself)."""
    return [
        {"where": ".".join(str(p) for p in e.get("loc", ())), "problem": str(e.get("msg", ""))}
        for e in errors
    ]


def error_detail(lines: Sequence[Mapping[str, str]]) -> str:
    """One sentence of `error_lines`: `where: problem; ...`."""
    return "; ".join(f"{e['where']}: {e['problem']}" for e in lines) or "invalid request"


def validated(model: type[Act], data: Mapping[str, object]) -> Act:
    """`data` as `model` under the API's limits; InvalidInputError naming what is refused."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise InvalidInputError(error_detail(error_lines(e.errors()))) from None
