"""Every Redis key name the project uses, in one place.

Every key of a partition's sessions, indexes and counters shares that partition's hash tag
(`partition_tag`), so on Redis Cluster a partition is one hash slot: a commit script call of many
sessions of one partition, with the partition's indexes and its shard of every counter, runs on
one node, and the worker that owns the partition writes to one node for it. Readers of fleet-wide
figures merge the partitions' shards. The tags are chosen so that the partitions' slots spread
evenly over the slot range (a cluster's masters own even ranges of it after `redis-cli --cluster
create`); plain `{w:<p>}` tags would put 4 of 6 partitions on one of 3 masters.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from session_model.partitioning import partition_for
from session_model.session import HISTORY_KINDS

DEFAULT_PREFIX = "ms"
# The session's history lists are `HISTORY_KINDS` (their keys in that order).


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


# How close to the start of its share of the slot range a partition's slot must be: close enough
# that masters owning even ranges get partitions as evenly as they can (their boundaries fall
# between such slots), found in ~1,000 CRC16s per partition.
_NEAR = 16


@functools.lru_cache(maxsize=1024)
def partition_tag(partition: int, partitions: int) -> str:
    """The hash tag of a partition's keys: `w:<p>`, or `w:<p>.<n>` with the smallest `n` that
    puts its slot at the start of the partition's even share of the slot range (`p` of
    `partitions`), so that any number of masters owning even ranges get the partitions evenly."""
    if not 0 <= partition < partitions <= REDIS_CLUSTER_HASH_SLOTS:
        raise ValueError(f"partition {partition} is not one of {partitions}")
    low = partition * REDIS_CLUSTER_HASH_SLOTS // partitions
    high = min(low + _NEAR, (partition + 1) * REDIS_CLUSTER_HASH_SLOTS // partitions)
    tag, n = f"w:{partition}", 0
    while not low <= key_slot(tag.encode()) < high:
        tag, n = f"w:{partition}.{n}", n + 1
    return tag


@dataclass(frozen=True, slots=True)
class Keys:
    """Key names under one prefix (tests and parallel stacks use their own), for a topic of
    `partitions` partitions (where a session's keys live depends on its partition)."""

    prefix: str = DEFAULT_PREFIX
    partitions: int = field(kw_only=True)
    # The projection generation each partition's keys are in (empty: all 0). A live rebuild
    # (`processors.generations`) writes the next one beside the current one and moves each
    # partition over with `lua/switch.lua`; readers and workers follow `generation_key`.
    generations: tuple[int, ...] = field(default=(), kw_only=True)

    def __post_init__(self) -> None:
        if self.partitions < 1:
            raise ValueError(f"partitions={self.partitions}: expected at least 1")
        if self.generations and len(self.generations) != self.partitions:
            raise ValueError(
                f"{len(self.generations)} generations for {self.partitions} partitions"
            )

    def generation(self, partition: int) -> int:
        """The generation of a partition's keys."""
        return self.generations[partition] if self.generations else 0

    def in_generations(self, generations: tuple[int, ...]) -> Keys:
        """These keys with each partition in the given generation (all 0: none named)."""
        named = generations if any(generations) else ()
        return Keys(self.prefix, partitions=self.partitions, generations=named)

    def head(self, generation: int) -> str:
        """What every key of a generation starts with: `<prefix>:`, or `<prefix>:g<n>:`."""
        return f"{self.prefix}:" if generation == 0 else f"{self.prefix}:g{generation}:"

    def tag(self, partition: int) -> str:
        """`<head>{<partition's tag>}`: the start of every key of the partition."""
        ptag = partition_tag(partition, self.partitions)
        return f"{self.head(self.generation(partition))}{{{ptag}}}"

    def generation_key(self, partition: int) -> str:
        """Hash per partition, outside every generation but in the partition's slot: `g`, the
        generation its keys are in, and `a<n>`, the highest offset committed in generation n."""
        return f"{self.prefix}:generation:{{{partition_tag(partition, self.partitions)}}}"

    def signed_out(self, session_id: str) -> str:
        """String with a TTL: a console session signed out (`projections.sign_outs`)."""
        return f"{self.prefix}:console:signed-out:{session_id}"

    def sign_in_failures(self, bucket: str) -> str:
        """String counter with a TTL: console sign-in attempts of one bucket of names, or of one
        client address (`src-…`) (`projections.sign_ins`); `bucket` comes from a keyed hash,
        never the name or the address."""
        return f"{self.prefix}:console:sign-in-failures:{bucket}"

    def rebuild_lease(self) -> str:
        """String: the token of the live rebuild under way (`lua/lease.lua`), while it runs."""
        return f"{self.prefix}:rebuild-lease"

    def rebuild_incomplete(self) -> str:
        """String `<ISO instant> <what>`: a rebuild that clears every projection (`replay`,
        `replay --full`) began then and has not finished; set before its clear, deleted after its
        fold. Workers refuse to start while it is set (the projections are half built)."""
        return f"{self.prefix}:rebuild-incomplete"

    def generation_pattern(self, generation: int) -> str:
        """A SCAN pattern matching every key of a generation (not the generation hashes)."""
        return f"{_glob_escape(self.head(generation))}{{*"

    def in_use(self) -> tuple[int, ...]:
        """The generations some partition is in."""
        return tuple(sorted(set(self.generations))) if self.generations else (0,)

    def partition_of(self, session_id: str) -> int:
        """The partition of a session (Kafka's default partitioner over its id)."""
        return partition_for(session_id, self.partitions)

    def session(self, session_id: str, partition: int | None = None) -> SessionKeys:
        """The keys of one session (`partition`: its partition, when the caller knows it)."""
        if partition is None:
            partition = partition_for(session_id, self.partitions)
        tag = f"{self.tag(partition)}:s:{session_id}"
        return SessionKeys(
            f"{tag}:state",
            f"{tag}:turns",
            f"{tag}:timeline",
            f"{tag}:ids",
            tuple(f"{tag}:h:{kind}" for kind in HISTORY_KINDS),
        )

    def state_pattern(self, generation: int = 0) -> str:
        """A SCAN pattern matching the state hash of every session of a generation (and nothing
        else)."""
        return f"{_glob_escape(self.head(generation))}{{w:*}}:s:*:state"

    def session_of(self, state_key: str) -> str | None:
        """The session id of a state hash's key (of any generation), or None for any other key."""
        head, tail = f"{self.prefix}:", ":state"
        if not (state_key.startswith(head) and state_key.endswith(tail)):
            return None
        at = len(head)
        if state_key.startswith("g", at):  # `<prefix>:g<n>:{w:...`
            at = state_key.find(":", at) + 1
        if not state_key.startswith("{w:", at):
            return None
        tag_end = state_key.find("}:s:", at)
        if tag_end < 0:
            return None
        return state_key[tag_end + 4 : -len(tail)]

    def deadlines(self, partition: int) -> str:
        """Sorted set per partition: session id scored by its open question's deadline (epoch ms).

        Per partition so that the scheduler of a partition's owner reads only its own sessions.
        """
        return f"{self.tag(partition)}:deadlines"

    def compaction_due(self, partition: int) -> str:
        """Set per partition of session ids whose unsummarised turns exceed the threshold."""
        return f"{self.tag(partition)}:compaction-due"

    def waiting(self, partition: int) -> str:
        """Sorted set per partition: waiting session ids by deadline (`questions.NO_DEADLINE`)."""
        return f"{self.tag(partition)}:waiting"

    def waiting_reason_prefix(self, partition: int) -> str:
        """The prefix of a partition's per-reason sorted sets (the commit script adds the reason).

        Built inside the script from the old and the new reason, under the partition's hash tag.
        """
        return f"{self.tag(partition)}:waiting:r:"

    def waiting_reason(self, partition: int, reason: str) -> str:
        """Sorted set per partition and reason: waiting session ids by deadline."""
        return self.waiting_reason_prefix(partition) + reason

    def waiting_cards(self, partition: int) -> str:
        """Hash per partition: waiting session id -> its question's card (JSON)."""
        return f"{self.tag(partition)}:cards"

    def waiting_counts(self, partition: int) -> str:
        """Hash per partition: reason -> questions waiting for it."""
        return f"{self.tag(partition)}:waiting:counts"

    def fleet_counts(self, partition: int) -> str:
        """Hash per partition: status and mode letters -> sessions (`projections.cards`; each
        session's entry is its state hash's field f)."""
        return f"{self.tag(partition)}:fleet:counts"

    def retention(self, partition: int) -> str:
        """Sorted set per partition: ended session id -> the epoch ms its projection may be
        dropped (`projections.requests.Retention`; kept only while a TTL is configured)."""
        return f"{self.tag(partition)}:retention"

    def expired(self, partition: int) -> str:
        """Hash per partition: session id -> its tombstone (`<expired ms> <last mark>`), once the
        retention sweep dropped its projection (`replay --session` deletes it)."""
        return f"{self.tag(partition)}:expired"

    def retired(self, partition: int) -> str:
        """Hash per partition: session id -> `<expired ms> <last mark> <counters JSON>`, left by
        the retention sweep while snapshots are taken, until a snapshot round has replaced the
        session's snapshot with a stub (`processors.snapshots`)."""
        return f"{self.tag(partition)}:retired"

    def restoring(self, partition: int) -> str:
        """Hash per partition: session id -> `<ISO instant> <token>`, when a `replay --session` of
        it began and which one; set before it drops the session, deleted by that restore once
        its fold has ended. Reads of the session fail while it is set (what is there is half
        rebuilt), and snapshot rounds leave it out."""
        return f"{self.tag(partition)}:restoring"

    def retention_keys(self, partition: int) -> tuple[str, str]:
        """The retention index and the tombstones of a partition, in the order the commit and
        drop scripts take them (after a session's history lists)."""
        return (self.retention(partition), self.expired(partition))

    def unsnapshotted(self, partition: int) -> str:
        """Sorted set per partition: session id -> the first offset of it applied since its latest
        snapshot (`processors.snapshots`; kept only while snapshots are taken)."""
        return f"{self.tag(partition)}:unsnapshotted"

    def partition_keys(self, partition: int) -> tuple[str, ...]:
        """A partition's index keys in the order the commit script takes them (after a
        session's own): deadlines, compaction due, waiting, cards, waiting counts, fleet counts.
        """
        return _partition_keys(self, partition)

    def stat(self, name: str, partition: int) -> str:
        """A partition's shard of a counter hash for analytics (`stat("pauses", p)` → field per
        reason code); readers add up every partition's (`stat_shards`)."""
        return f"{self.tag(partition)}:stats:{name}"

    def stat_hour(self, name: str, hour: str, partition: int) -> str:
        """A partition's shard of a counter hash for one UTC hour (`YYYYMMDDHH`)."""
        return f"{self.tag(partition)}:stats:{name}:h:{hour}"

    def stat_shards(self, name: str, hour: str | None = None) -> tuple[str, ...]:
        """Every partition's shard of a counter hash (of one hour with `hour`)."""
        if hour is None:
            return tuple(self.stat(name, p) for p in range(self.partitions))
        return tuple(self.stat_hour(name, hour, p) for p in range(self.partitions))

    def stats_pattern(self, generation: int = 0) -> str:
        """A SCAN pattern matching every shard of every counter hash of a generation."""
        return f"{_glob_escape(self.head(generation))}{{w:*}}:stats:*"

    def stat_hour_pattern(self, name: str, generation: int = 0) -> str:
        """A SCAN pattern matching every hour shard of a counter in a generation (the hour is
        the key's tail)."""
        return f"{_glob_escape(self.head(generation))}{{w:*}}:stats:{_glob_escape(name)}:h:*"

    def counter_field(self, stat_key: str, field: str) -> str:
        """A session's own record of one counter (`<counter hash after ":stats:">\t<field>`),
        its state hash's field `c:` + this, and its snapshot's counter name (the same in every
        partition)."""
        return f"{stat_key[stat_key.index('}:stats:') + 8 :]}\t{field}"

    def counter_of(self, counter_field: str, partition: int) -> tuple[str, str]:
        """The counter hash (the partition's shard) and field a session's counter field names."""
        name, _, field = counter_field.partition("\t")
        return f"{self.tag(partition)}:stats:{name}", field

    def pattern(self) -> str:
        """A SCAN pattern matching every key under this prefix (the console's too: a rebuild
        deletes only those `rebuilds` names)."""
        return f"{self.prefix}:*"

    def rebuilds(self, key: str) -> bool:
        """Whether a rebuild (`replay`, `RedisProjectionStore.clear`) deletes the key: the keys of
        every generation (sessions, indexes, counters, retention entries, tombstones: all under
        `head(n)` + a partition's tag) and the generation hashes (the rebuild starts over in
        generation 0; a hash left behind would send readers to a generation it deleted, and its
        commits would be refused as stale). Nothing else under the prefix is a projection, and a
        rebuild of the log cannot bring it back: the console's sign-outs (a signed-out cookie
        would be accepted again) and sign-in counters, the live rebuild's lease (held by a
        running rebuild, expiring by itself), and the marker of a rebuild under way
        (`rebuild_incomplete`: the clear must not take it away)."""
        head = f"{self.prefix}:"
        return key.startswith(head) and _REBUILT.match(key, len(head)) is not None


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


# After `<prefix>:`, what starts a key `Keys.rebuilds` names: a generation's head (`g<n>:`, none
# for generation 0) and a partition's hash tag, or a generation hash.
_REBUILT = re.compile(r"(?:g[0-9]+:)?\{|generation:\{")


def _glob_escape(text: str) -> str:
    """`text` matched literally by a SCAN/KEYS glob."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)
