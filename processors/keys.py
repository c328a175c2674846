"""Every Redis key name the project uses, in one place.

A session's keys share the hash tag `{s:<id>}`, so one Lua script touches one slot and the layout
works on Redis Cluster. Global indexes are only ever updated idempotently, outside those scripts.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PREFIX = "ms"


@dataclass(frozen=True, slots=True)
class SessionKeys:
    """The keys of one session."""

    state: str  # hash: state (JSON), mark ("partition:offset"), window (unsummarised turn count)
    turns: str  # list: every turn, summarised ones included (JSON)
    timeline: str  # list: timeline entries (JSON)
    event_ids: str  # set: event ids folded (duplicates are ignored by the fold)

    def all(self) -> tuple[str, str, str, str]:
        """The keys in the order the Lua scripts take them."""
        return (self.state, self.turns, self.timeline, self.event_ids)


@dataclass(frozen=True, slots=True)
class Keys:
    """Key names under one prefix (tests and parallel stacks use their own)."""

    prefix: str = DEFAULT_PREFIX

    def session(self, session_id: str) -> SessionKeys:
        """The keys of one session, sharing its hash tag."""
        tag = f"{self.prefix}:{{s:{session_id}}}"
        return SessionKeys(f"{tag}:state", f"{tag}:turns", f"{tag}:timeline", f"{tag}:ids")

    @property
    def sessions(self) -> str:
        """Set of every projected session id."""
        return f"{self.prefix}:sessions"

    def deadlines(self, partition: int) -> str:
        """Sorted set per partition: session id scored by its open question's deadline (epoch ms).

        Per partition so that the scheduler of a partition's owner reads only its own sessions.
        """
        return f"{self.prefix}:deadlines:{partition}"

    def compaction_due(self, partition: int) -> str:
        """Set per partition of session ids whose unsummarised turns exceed the threshold."""
        return f"{self.prefix}:compaction-due:{partition}"

    def stat(self, name: str) -> str:
        """A counter hash for analytics (`stat("pauses")` → field per reason code)."""
        return f"{self.prefix}:stats:{name}"

    def stat_hour(self, name: str, hour: str) -> str:
        """A counter hash for one UTC hour (`YYYYMMDDHH`), for `--since` queries."""
        return f"{self.prefix}:stats:{name}:h:{hour}"

    def pattern(self) -> str:
        """A SCAN pattern matching every key under this prefix."""
        return f"{self.prefix}:*"
