"""Every Redis key name the project uses, in one place.

A session's keys share the hash tag `{s:<id>}`; the waiting-questions index and the fleet counts
of a partition share `{w:<partition>}`. The commit script still writes the per-partition indexes
and the counters and takes up to 64 sessions per call, so the store needs one Redis (or a primary
with replicas), not a Cluster; splitting it per slot would start from these tags.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

DEFAULT_PREFIX = "ms"
# The session's history lists, in the order of `projections.codec.HISTORY_KINDS`.
HISTORY_KINDS = ("calls", "observations", "executions", "decisions", "rejections")


@dataclass(frozen=True, slots=True)
class SessionKeys:
    """The keys of one session (layout: `projections/redis_store.py`)."""

    state: str  # hash: mark, window, state; while small also the event ids and timeline entries
    turns: str  # list: every turn, summarised ones included (JSON)
    timeline: str  # list: timeline entries, once too many for the state hash
    event_ids: str  # list: the recent event ids by chunk (`session_model.dedupe`), once spread
    history: tuple[str, ...]  # lists: every call, observation, execution, decision, rejection

    def all(self) -> tuple[str, str, str, str]:
        """The keys in the order the Lua scripts take them (the history lists after them)."""
        return (self.state, self.turns, self.timeline, self.event_ids)

    def every(self) -> tuple[str, ...]:
        """Every key of the session."""
        return (*self.all(), *self.history)


@dataclass(frozen=True, slots=True)
class Keys:
    """Key names under one prefix (tests and parallel stacks use their own)."""

    prefix: str = DEFAULT_PREFIX

    def session(self, session_id: str) -> SessionKeys:
        """The keys of one session, sharing its hash tag."""
        tag = f"{self.prefix}:{{s:{session_id}}}"
        return SessionKeys(
            f"{tag}:state",
            f"{tag}:turns",
            f"{tag}:timeline",
            f"{tag}:ids",
            tuple(f"{tag}:h:{kind}" for kind in HISTORY_KINDS),
        )

    def state_pattern(self) -> str:
        """A SCAN pattern matching the state hash of every session (and nothing else)."""
        return f"{_glob_escape(self.prefix)}:{{s:*}}:state"

    def session_of(self, state_key: str) -> str | None:
        """The session id of a state hash's key, or None for any other key."""
        head, tail = f"{self.prefix}:{{s:", "}:state"
        if state_key.startswith(head) and state_key.endswith(tail):
            return state_key[len(head) : -len(tail)]
        return None

    def deadlines(self, partition: int) -> str:
        """Sorted set per partition: session id scored by its open question's deadline (epoch ms).

        Per partition so that the scheduler of a partition's owner reads only its own sessions.
        """
        return f"{self.prefix}:deadlines:{partition}"

    def compaction_due(self, partition: int) -> str:
        """Set per partition of session ids whose unsummarised turns exceed the threshold."""
        return f"{self.prefix}:compaction-due:{partition}"

    def waiting(self, partition: int) -> str:
        """Sorted set per partition: waiting session ids by deadline (`questions.NO_DEADLINE`)."""
        return f"{self.prefix}:{{w:{partition}}}:waiting"

    def waiting_reason_prefix(self, partition: int) -> str:
        """The prefix of a partition's per-reason sorted sets (the commit script adds the reason).

        Built inside the script from the old and the new reason, under the partition's hash tag.
        """
        return f"{self.prefix}:{{w:{partition}}}:waiting:r:"

    def waiting_reason(self, partition: int, reason: str) -> str:
        """Sorted set per partition and reason: waiting session ids by deadline."""
        return self.waiting_reason_prefix(partition) + reason

    def waiting_cards(self, partition: int) -> str:
        """Hash per partition: waiting session id -> its question's card (JSON)."""
        return f"{self.prefix}:{{w:{partition}}}:cards"

    def waiting_counts(self, partition: int) -> str:
        """Hash per partition: reason -> questions waiting for it."""
        return f"{self.prefix}:{{w:{partition}}}:waiting:counts"

    def fleet_counts(self, partition: int) -> str:
        """Hash per partition: status and mode letters -> sessions (`projections.cards`; each
        session's entry is its state hash's field f)."""
        return f"{self.prefix}:{{w:{partition}}}:fleet:counts"

    def retention(self, partition: int) -> str:
        """Sorted set per partition: ended session id -> the epoch ms its projection may be
        dropped (`projections.requests.Retention`; kept only while a TTL is configured)."""
        return f"{self.prefix}:{{w:{partition}}}:retention"

    def expired(self, partition: int) -> str:
        """Hash per partition: session id -> its tombstone (`<expired ms> <last mark>`), once the
        retention sweep dropped its projection (`replay --session` deletes it)."""
        return f"{self.prefix}:{{w:{partition}}}:expired"

    def retention_keys(self, partition: int) -> tuple[str, str]:
        """The retention index and the tombstones of a partition, in the order the commit and
        drop scripts take them (after a session's history lists)."""
        return (self.retention(partition), self.expired(partition))

    def unsnapshotted(self, partition: int) -> str:
        """Sorted set per partition: session id -> the first offset of it applied since its latest
        snapshot (`processors.snapshots`; kept only while snapshots are taken)."""
        return f"{self.prefix}:{{w:{partition}}}:unsnapshotted"

    def partition_keys(self, partition: int) -> tuple[str, ...]:
        """A partition's index keys in the order the commit script takes them (after a
        session's own): deadlines, compaction due, waiting, cards, waiting counts, fleet counts.
        """
        return _partition_keys(self, partition)

    def stat(self, name: str) -> str:
        """A counter hash for analytics (`stat("pauses")` → field per reason code)."""
        return f"{self.prefix}:stats:{name}"

    def stat_hour(self, name: str, hour: str) -> str:
        """A counter hash for one UTC hour (`YYYYMMDDHH`), for `--since` queries."""
        return f"{self.prefix}:stats:{name}:h:{hour}"

    def counter_field(self, stat_key: str, field: str) -> str:
        """A session's own record of one counter (`<counter hash, less the prefix>\t<field>`),
        its state hash's field `c:` + this, and its snapshot's counter name."""
        return f"{stat_key[len(self.prefix) + 7 :]}\t{field}"

    def counter_of(self, counter_field: str) -> tuple[str, str]:
        """The counter hash and field a session's counter field names (`counter_field`)."""
        name, _, field = counter_field.partition("\t")
        return f"{self.prefix}:stats:{name}", field

    def pattern(self) -> str:
        """A SCAN pattern matching every key under this prefix."""
        return f"{self.prefix}:*"


@functools.lru_cache(maxsize=4096)
def _partition_keys(keys: Keys, partition: int) -> tuple[str, ...]:
    # Built once per (prefix, partition): every commit of every session names them.
    return (
        keys.deadlines(partition),
        keys.compaction_due(partition),
        keys.waiting(partition),
        keys.waiting_cards(partition),
        keys.waiting_counts(partition),
        keys.fleet_counts(partition),
    )


def _glob_escape(text: str) -> str:
    """`text` matched literally by a SCAN/KEYS glob."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)
