"""The Lua scripts (`projections/lua/*.lua`), loaded once with the layout's bounds filled in."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from importlib.resources import files

from projections import layout
from schemas.errors import ConfigurationError
from session_model import dedupe

_PLACEHOLDER = re.compile(r"@([A-Z_]+)@")
_VALUES = {
    "CHUNK": str(layout.CHUNK),
    "IDS_INLINE": str(layout.IDS_INLINE),
    "STATE_INLINE": str(layout.STATE_INLINE),
    "TIMELINE_INLINE": str(layout.TIMELINE_INLINE),
    "ELSEWHERE": layout.ELSEWHERE,
    "WHOLE": layout.WHOLE,
    "KEPT_GROUPS": str(dedupe.KEPT + 1),
    "STATE_CHUNKS": layout.chunk_names("s", layout.STATE_INLINE),
    "ID_CHUNKS": layout.chunk_names("i", layout.IDS_INLINE),
    "TIMELINE_CHUNKS": layout.chunk_names("t", layout.TIMELINE_INLINE),
}


@dataclass(frozen=True, slots=True)
class Script:
    """A Lua script's source and the SHA1 that EVALSHA calls it by."""

    name: str
    source: str
    # The SHA1 of the source (what `SCRIPT LOAD` returns), hashed once: every call names it.
    sha: str = field(init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.source.encode()).hexdigest())


def _text(name: str) -> str:
    return files("projections").joinpath("lua", f"{name}.lua").read_text(encoding="utf-8")


def _fill(name: str, text: str) -> str:
    def value(match: re.Match[str]) -> str:
        key = match.group(1)
        if key not in _VALUES:
            raise ConfigurationError(f"{name}.lua: unknown placeholder @{key}@")
        return _VALUES[key]

    return _PLACEHOLDER.sub(value, text)


def load(name: str, *, header: bool = False, index: bool = False) -> Script:
    """The script `lua/<name>.lua`, after `lua/header.lua` (`header`) and `lua/index.lua`
    (`index`), placeholders filled."""
    text = (_text("header") if header else "") + (_text("index") if index else "") + _text(name)
    return Script(name, _fill(name, text))


COMMIT = load("commit", header=True, index=True)
READ = load("read", header=True)
DUE = load("due")
WAITING = load("waiting")
DROP = load("drop", index=True)
SNAPPED = load("snapped")
SWITCH = load("switch")
LEASE = load("lease")
SIGN_IN_ATTEMPT = load("sign_in_attempt")
UNMARK = load("unmark")
RETIRE = load("retire")
UNRETIRE = load("unretire")
ALL = (
    COMMIT,
    READ,
    DUE,
    WAITING,
    DROP,
    SNAPPED,
    SWITCH,
    LEASE,
    SIGN_IN_ATTEMPT,
    UNMARK,
    RETIRE,
    UNRETIRE,
)
