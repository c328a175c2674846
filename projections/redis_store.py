"""The Redis projection store: one Lua call per 64 sessions of a batch, pipelined in one round trip.

Commit path: for each session an update carries the mark its state was folded from (`base`) and the
mark it reaches. The script applies state, appends turns, timeline entries and event ids, moves the
mark and updates the due-work indexes and counters only if the stored mark still equals `base`;
otherwise it writes nothing and reports a conflict (the projector reloads and folds again). A
redelivered batch never reaches the script: the folder skips records at or below the mark.

The layout is built for memory (`docs/PERFORMANCE.md`, "Memory"). Redis keeps a small hash as a
compact listpack while every value is at most 64 bytes (`hash-max-listpack-value`), and as a
hashtable a few hundred bytes larger otherwise; every key costs its name plus ~60 bytes. So a
session with few events is COMPACT: everything in ONE hash, byte strings cut into CHUNK-byte pieces:

    mark        "partition:offset" of the last record applied
    n           the header: one character each for the state's chunks (or `w`: whole in `s`), the
                event ids' chunks (or `x`: in their own key) and the timeline's chunks (or `x`: in
                its list), counted from `0`; then the unsummarised turns (how many of the turns
                list's tail `load` reads), left out when 0. E.g. `212` or `wxx15`.
    s1, s2, …   the state (`session_to_blob`) while at most STATE_INLINE bytes; `s` when longer
    i1, i2, …   the event ids (`pack_event_ids`), at most IDS_INLINE bytes
    t1, t2, …   the timeline entries, each ended by a newline, while at most TIMELINE_INLINE bytes;
                beyond, every entry is in the timeline list

A commit reads the mark and the header (and the last chunk of a stream it appends to) and writes
the state's chunks, the new chunks and the header. When the event ids outgrow IDS_INLINE the
session is SPREAD, for good: the state whole in `s`, the ids in a string of their own (APPEND), the
timeline in its list. Both bounds apply to append-only streams and the state's form depends only
on the state and on that, so where everything lives depends on what the session holds, never on
how the records were batched: a rebuild gives byte-identical values. Turns are always in their list.

No set of session ids is kept (it cost each session ~90 bytes): `ids()` scans the state hashes.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

from projections.codec import (
    check_version,
    entry_from_json,
    entry_to_json,
    pack_event_ids,
    session_from_blob,
    session_to_blob,
    turn_from_json,
    turn_to_json,
    unpack_event_ids,
)
from projections.indexes import index_changes
from projections.keys import Keys
from projections.redis_client import sync_client
from schemas.errors import NotYetVisibleError, ProjectionError
from session_model.fold import Kind
from session_model.ports import CommitResult
from session_model.projection import Folded, Position, SessionUpdate
from session_model.session import Session, Turn
from session_model.timeline import TimelineEntry

# Redis's default hash-max-listpack-value is 64; a listpack string shorter than 64 bytes has a
# one-byte header (two from 64), so 63-byte chunks cost the least.
CHUNK = 63
IDS_INLINE = 256  # 16 UUIDs: a session with more events is spread over keys of its own
STATE_INLINE = 1024
TIMELINE_INLINE = 512
ELSEWHERE = "x"  # in the header: the stream is in a key of its own
WHOLE = "w"  # in the header: the state is whole in field `s`


def _names(letter: str, limit: int) -> str:
    """The chunk fields of a stream of at most `limit` bytes, as a Lua table of string literals."""
    return "{" + ", ".join(f"'{letter}{k}'" for k in range(1, -(-limit // CHUNK) + 1)) + "}"


# Shared by both scripts: the header `n` (see the module docstring) and the chunk names, built as
# constants (formatting numbers into names at run time costs more than the writes).
_HEADER = f"""
local H, CHUNK = KEYS[1], {CHUNK}
local S = {_names("s", STATE_INLINE)}
local I = {_names("i", IDS_INLINE)}
local T = {_names("t", TIMELINE_INLINE)}
local ELSEWHERE, WHOLE = string.byte('{ELSEWHERE}'), string.byte('{WHOLE}')

-- The header: (state chunks or WHOLE, id chunks or ELSEWHERE, entry chunks or ELSEWHERE, window).
local function header(n)
  if not n then return 0, 0, 0, 0 end
  local s, i, t = string.byte(n, 1, 3)
  if s ~= WHOLE then s = s - 48 end
  if i ~= ELSEWHERE then i = i - 48 end
  if t ~= ELSEWHERE then t = t - 48 end
  return s, i, t, tonumber(string.sub(n, 4)) or 0
end

local function count(c)
  if c == WHOLE or c == ELSEWHERE then return string.char(c) end
  return string.char(48 + c)
end

-- HMGET names[from .. to] (as many as exist), in order.
local function chunks(names, from, to)
  if to < from then return {{}} end
  return redis.call('HMGET', H, unpack(names, from, to))
end
"""

# KEYS: per session, in order: state hash, turns list, timeline list, event-id string, deadlines
#       zset, compaction-due set, then one key per counter hash of that session.
# ARGV: per session, in order: its number of KEYS, its number of arguments, then its arguments:
#       base mark ("" = none), new mark, state blob, window, session id, deadline ms ("" = none),
#       compaction due ("1"/"0"), new event ids (packed), n_turns, turns..., n_tl, entries...,
#       n_counters, (key index among the session's KEYS, field, increment)...
# Returns one 1 (applied) or 0 (conflict: nothing written) per session, in order. The counters of
# the sessions applied are summed and written once per (key, field) at the end.
COMMIT_SCRIPT = (
    _HEADER
    + f"""
local acc = {{}}  -- counter key -> field -> increment, over the sessions applied

-- RPUSH items[first .. first + count - 1] to `key`, in slices Lua can unpack.
local function push(key, items, first, count)
  for j = first, first + count - 1, 4000 do
    redis.call('RPUSH', key, unpack(items, j, math.min(j + 3999, first + count - 1)))
  end
end

local function push_entries(key, text)  -- entries, each ended by a newline
  local all = {{}}
  for entry in string.gmatch(text, '([^\\n]*)\\n') do all[#all + 1] = entry end
  push(key, all, 1, #all)
end

-- One session: its KEYS start after `ko`, its arguments after `ao`.
local function commit(ko, ao)
  H = KEYS[ko + 1]
  local state, window, ids = ARGV[ao + 3], ARGV[ao + 4], ARGV[ao + 8]
  local turns_at = ao + 10
  local n_turns = tonumber(ARGV[ao + 9])
  local tl_at = turns_at + n_turns + 1
  local n_tl = tonumber(ARGV[tl_at - 1])
  local counters_at = tl_at + n_tl
  if window == '0' then window = '' end

  local got = redis.call('HMGET', H, 'mark', 'n')
  if (got[1] or '') ~= ARGV[ao + 1] then return 0 end
  local sc, ic, tc = header(got[2])
  local set, del = {{'mark', ARGV[ao + 2]}}, {{}}

  local function put_chunks(names, k, data)  -- data into names[k + 1], names[k + 2], ...
    for p = 1, #data, CHUNK do
      k = k + 1
      set[#set + 1] = names[k]
      set[#set + 1] = string.sub(data, p, p + CHUNK - 1)
    end
    return k
  end

  local function drop(names, from, to)
    for k = from, to do del[#del + 1] = names[k] end
  end

  -- Append `data` to the inline stream of `n` chunks whose last one is `last`.
  local function append(names, n, last, data)
    if n > 0 and #last < CHUNK then
      return put_chunks(names, n - 1, last .. data)
    end
    return put_chunks(names, n, data)
  end

  if ic == ELSEWHERE then
    -- Spread: the state whole, the ids and the timeline in keys of their own.
    if #ids > 0 then redis.call('APPEND', KEYS[ko + 4], ids) end
    if n_tl > 0 then push(KEYS[ko + 3], ARGV, tl_at, n_tl) end
    set[#set + 1] = 's'
    set[#set + 1] = state
    sc = WHOLE
  else
    local new_tl = {{}}
    for j = tl_at, tl_at + n_tl - 1 do
      new_tl[#new_tl + 1] = ARGV[j]
      new_tl[#new_tl + 1] = '\\n'
    end
    new_tl = table.concat(new_tl)
    -- The last chunk of each stream appended to.
    local want = {{}}
    if #ids > 0 and ic > 0 then want[#want + 1] = I[ic] end
    if #new_tl > 0 and tc ~= ELSEWHERE and tc > 0 then want[#want + 1] = T[tc] end
    local last = {{}}
    if #want > 0 then
      local values = redis.call('HMGET', H, unpack(want))
      for k = 1, #want do last[want[k]] = values[k] end
    end
    local id_last = ic > 0 and last[I[ic]] or ''
    if (ic > 0 and (ic - 1) * CHUNK + #(id_last or '') or 0) + #ids > {IDS_INLINE} then
      -- Too many events: spread the session out, for good.
      redis.call('SET', KEYS[ko + 4], table.concat(chunks(I, 1, ic)) .. ids)
      drop(I, 1, ic)
      ic = ELSEWHERE
      if tc ~= ELSEWHERE then
        push_entries(KEYS[ko + 3], table.concat(chunks(T, 1, tc)))
        drop(T, 1, tc)
        tc = ELSEWHERE
      end
      if n_tl > 0 then push(KEYS[ko + 3], ARGV, tl_at, n_tl) end
    else
      if #ids > 0 then ic = append(I, ic, id_last, ids) end
      if #new_tl > 0 then
        if tc == ELSEWHERE then
          push(KEYS[ko + 3], ARGV, tl_at, n_tl)
        else
          local tl_last = tc > 0 and last[T[tc]] or ''
          if (tc > 0 and (tc - 1) * CHUNK + #tl_last or 0) + #new_tl > {TIMELINE_INLINE} then
            push_entries(KEYS[ko + 3], table.concat(chunks(T, 1, tc)) .. new_tl)
            drop(T, 1, tc)
            tc = ELSEWHERE
          else
            tc = append(T, tc, tl_last, new_tl)
          end
        end
      end
    end
    local before = sc
    if ic ~= ELSEWHERE and #state <= {STATE_INLINE} then
      sc = put_chunks(S, 0, state)
      if before == WHOLE then
        del[#del + 1] = 's'
      else
        drop(S, sc + 1, before)
      end
    else
      set[#set + 1] = 's'
      set[#set + 1] = state
      if before ~= WHOLE then drop(S, 1, before) end
      sc = WHOLE
    end
  end
  set[#set + 1] = 'n'
  set[#set + 1] = count(sc) .. count(ic) .. count(tc) .. window
  if #del > 0 then redis.call('HDEL', H, unpack(del)) end
  redis.call('HSET', H, unpack(set))
  if n_turns > 0 then push(KEYS[ko + 2], ARGV, turns_at, n_turns) end
  local sid = ARGV[ao + 5]
  if ARGV[ao + 6] == '' then
    redis.call('ZREM', KEYS[ko + 5], sid)
  else
    redis.call('ZADD', KEYS[ko + 5], ARGV[ao + 6], sid)
  end
  if ARGV[ao + 7] == '1' then
    redis.call('SADD', KEYS[ko + 6], sid)
  else
    redis.call('SREM', KEYS[ko + 6], sid)
  end
  for c = 1, tonumber(ARGV[counters_at]) do
    local base = counters_at + (c - 1) * 3
    local key, f = KEYS[ko + tonumber(ARGV[base + 1])], ARGV[base + 2]
    local fields = acc[key]
    if not fields then
      fields = {{}}
      acc[key] = fields
    end
    fields[f] = (fields[f] or 0) + tonumber(ARGV[base + 3])
  end
  return 1
end

local applied, ko, ao = {{}}, 0, 0
while ao < #ARGV do
  local n_keys, n_args = tonumber(ARGV[ao + 1]), tonumber(ARGV[ao + 2])
  applied[#applied + 1] = commit(ko, ao + 2)
  ko = ko + n_keys
  ao = ao + 2 + n_args
end
for key, fields in pairs(acc) do
  for f, n in pairs(fields) do redis.call('HINCRBY', key, f, n) end
end
return applied
"""
)

# KEYS: per session, in order: state hash, turns list, event-id string. ARGV[1]: "1" to read the
# event ids too. Returns per session, in order: false (unknown) or {state blob ("" if none of this
# layout), mark, turns, packed event ids}.
# Sessions are read up to READ_GROUP per call: most reads of a busy worker are of sessions it has
# never seen, where the script call itself was most of the cost (≈ 4 µs of Redis each).
READ_SCRIPT = (
    _HEADER
    + """
local out = {}
for ko = 0, #KEYS - 1, 3 do
  H = KEYS[ko + 1]
  local got = redis.call('HMGET', H, 'mark', 'n', 's')
  if not got[1] then
    out[#out + 1] = false
  elseif not got[2] then
    out[#out + 1] = {'', got[1], {}, ''}
  else
    local sc, ic, tc, window = header(got[2])
    local state = got[3]
    if sc ~= WHOLE then state = table.concat(chunks(S, 1, sc)) end
    local turns = {}
    if window > 0 then turns = redis.call('LRANGE', KEYS[ko + 2], -window, -1) end
    local ids = ''
    if ARGV[1] == '1' then
      if ic == ELSEWHERE then
        ids = redis.call('GET', KEYS[ko + 3]) or ''
      else
        ids = table.concat(chunks(I, 1, ic))
      end
    end
    out[#out + 1] = {state, got[1], turns, ids}
  end
end
return out
"""
)


# KEYS: a partition's deadlines zset and compaction-due set. ARGV: until (epoch ms or "+inf").
# A flat reply (member, score, member, score, …) paired by the caller: redis-py's per-pair
# conversion of ZRANGEBYSCORE … WITHSCORES was most of a scheduler poll's time on the event loop.
DUE_SCRIPT = """
return {redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'WITHSCORES'),
        redis.call('SMEMBERS', KEYS[2])}
"""


COMMIT_SHA = hashlib.sha1(COMMIT_SCRIPT.encode()).hexdigest()
READ_SHA = hashlib.sha1(READ_SCRIPT.encode()).hexdigest()
DUE_SHA = hashlib.sha1(DUE_SCRIPT.encode()).hexdigest()


def commit_call(
    keys: Keys, update: SessionUpdate, compact_after: int | None, count: bool = True
) -> tuple[list[str], list[str | int | bytes]]:
    """The KEYS and ARGV of one session's commit (state, appends, indexes, counters)."""
    sid = update.session_id
    k = keys.session(sid)
    partition = update.mark.partition
    turns = [turn_to_json(t) for t in update.turns]
    timeline = [entry_to_json(e, sid) for e in update.timeline]
    ids = pack_event_ids(
        s.event.event_id for s in update.steps if s.outcome.kind is not Kind.DUPLICATE
    )
    changes = index_changes(update, keys, compact_after)
    counters = changes.counters if count else ()
    script_keys = [*k.all(), keys.deadlines(partition), keys.compaction_due(partition)]
    counter_args: list[str | int | bytes] = []
    for key, field_, increment in counters:
        if key not in script_keys[6:]:
            script_keys.append(key)
        counter_args.extend((script_keys.index(key, 6) + 1, field_, increment))
    args: list[str | int | bytes] = [
        "" if update.base is None else str(update.base),
        str(update.mark),
        session_to_blob(update.state),
        len(update.state.turns),
        sid,
        "" if changes.deadline_ms is None else changes.deadline_ms,
        "1" if changes.compaction_due else "0",
        ids,
        len(turns),
        *turns,
        len(timeline),
        *timeline,
        len(counters),
        *counter_args,
    ]
    return script_keys, args


# Sessions per commit script call: the per-call cost (KEYS and ARGV tables, the call itself) and
# the counters are paid once per group, while Redis still serves other clients between groups
# (a group of 64 runs for ~1-2 ms).
COMMIT_GROUP = 64
READ_GROUP = 64


def grouped(
    calls: Sequence[tuple[list[str], list[str | int | bytes]]], size: int = COMMIT_GROUP
) -> list[tuple[list[str], list[str | int | bytes]]]:
    """Sessions' commit calls joined into calls of COMMIT_SCRIPT of up to `size` sessions each."""
    groups: list[tuple[list[str], list[str | int | bytes]]] = []
    for at in range(0, len(calls), size):
        keys: list[str] = []
        args: list[str | int | bytes] = []
        for session_keys, session_args in calls[at : at + size]:
            keys += session_keys
            args.append(len(session_keys))
            args.append(len(session_args))
            args += session_args
        groups.append((keys, args))
    return groups


def read_groups(keys: Keys, session_ids: Sequence[str], size: int = READ_GROUP) -> list[list[str]]:
    """The KEYS of READ_SCRIPT calls reading these sessions, up to `size` per call, in order."""
    groups: list[list[str]] = []
    for at in range(0, len(session_ids), size):
        group: list[str] = []
        for sid in session_ids[at : at + size]:
            k = keys.session(sid)
            group += (k.state, k.turns, k.event_ids)
        groups.append(group)
    return groups


def parse_read(raw: Any, session_id: str) -> Folded | None:
    """Turn the read script's reply into a state and its mark."""
    if not raw:
        return None
    state, mark, turns, packed = raw
    check_version(state, session_id)
    return Folded(
        session_from_blob(
            state,
            session_id,
            tuple(turn_from_json(t) for t in turns),
            frozenset(unpack_event_ids(packed)),
        ),
        Position.parse(_text(mark)),
    )


def parse_timeline(raw: Any, session_id: str, since: int) -> list[TimelineEntry]:
    """Entries with `seq > since`, from the state hash's fields and the timeline list."""
    fields, listed = raw
    if not fields:
        return []
    header = fields.get(b"n")
    if header is None:
        check_version(b"", session_id)  # a hash of another layout
    state = fields.get(b"s", b"") if header[0] == ord(WHOLE) else fields.get(b"s1", b"")
    check_version(state, session_id)
    inline = b""
    if header[2] != ord(ELSEWHERE):
        inline = b"".join(fields[b"t%d" % k] for k in range(1, header[2] - ord("0") + 1))
    entries = [entry_from_json(e, session_id) for e in [*inline.split(b"\n")[:-1], *listed]]
    return [e for e in entries if e["seq"] > since]


def stored_sizes(fields: dict[bytes, bytes]) -> dict[str, int]:
    """What a session's state hash holds, in bytes (for benchmarks and inspection).

    `state`: the state blob; `event_ids`, `timeline`: the streams held inline (0 when in keys of
    their own, or empty); `timeline_entries`: how many entries are inline; `fields`: the hash's.
    """
    header = fields.get(b"n", b"000")
    sizes = {"fields": len(fields), "state": 0, "event_ids": 0, "timeline": 0}
    for name, letter, count in (("state", b"s", header[0]), ("event_ids", b"i", header[1])):
        if count in (ord(WHOLE), ord(ELSEWHERE)):
            sizes[name] = len(fields.get(letter, b""))
        else:
            sizes[name] = sum(len(fields[b"%s%d" % (letter, k)]) for k in range(1, count - 47))
    if header[2] != ord(ELSEWHERE):
        inline = b"".join(fields[b"t%d" % k] for k in range(1, header[2] - 47))
        sizes["timeline"] = len(inline)
        sizes["timeline_entries"] = inline.count(b"\n")
    return sizes


def _mark_reached(raw: Any, at_least: Position) -> bool:
    if raw is None:
        return False
    mark = Position.parse(raw.decode() if isinstance(raw, bytes) else raw)
    return mark.partition == at_least.partition and mark.offset >= at_least.offset


@dataclass
class RedisProjectionStore:
    """The projection store on a (synchronous) Redis client; readers and replay use this one."""

    client: redis.Redis
    keys: Keys = field(default_factory=Keys)
    poll_interval: float = 0.005
    compact_after: int | None = None
    count_stats: bool = True

    @classmethod
    def from_url(
        cls,
        url: str,
        keys: Keys | None = None,
        compact_after: int | None = None,
        timeout: float | None = None,
    ) -> RedisProjectionStore:
        """A store on `url` (`timeout`: seconds a connect or a reply may take; one retry)."""
        return cls(sync_client(url, timeout), keys or Keys(), compact_after=compact_after)

    def folded(self, session_ids: Sequence[str]) -> dict[str, Folded]:
        """State, mark and event ids of the known sessions, in one round trip."""

        def queue(pipe: Any) -> None:
            for keys in read_groups(self.keys, session_ids):
                pipe.evalsha(READ_SHA, len(keys), *keys, "1")

        try:
            replies = self._execute(queue)
        except redis.RedisError as e:
            raise ProjectionError(f"reading projections failed: {e}") from e
        raws = [raw for group in replies for raw in group]
        found = {sid: parse_read(raw, sid) for sid, raw in zip(session_ids, raws, strict=True)}
        return {sid: f for sid, f in found.items() if f is not None}

    def commit(self, updates: Sequence[SessionUpdate]) -> CommitResult:
        """Apply every update (compare-and-set on its mark) in one pipelined round trip."""
        if not updates:
            return CommitResult()
        calls = [commit_call(self.keys, u, self.compact_after, self.count_stats) for u in updates]

        def queue(pipe: Any) -> None:
            for keys, args in grouped(calls):
                pipe.evalsha(COMMIT_SHA, len(keys), *keys, *args)

        try:
            replies = self._execute(queue)
        except redis.RedisError as e:
            raise ProjectionError(f"committing projections failed: {e}") from e
        return _result(updates, replies)

    def _execute(self, queue: Callable[[Any], None]) -> list[Any]:
        """Run a pipeline of EVALSHA calls; load the scripts once if the server lost them."""
        for attempt in (1, 2):
            pipe = self.client.pipeline(transaction=False)
            queue(pipe)
            try:
                replies: list[Any] = pipe.execute()
                return replies
            except NoScriptError:
                if attempt == 2:
                    raise
                self.client.script_load(COMMIT_SCRIPT)
                self.client.script_load(READ_SCRIPT)
        raise AssertionError("unreachable")

    def load(
        self, session_id: str, at_least: Position | None = None, timeout: float = 5.0
    ) -> Session | None:
        """The session; with `at_least`, wait (bounded) until the projection applied it."""
        if at_least is not None:
            self._wait(session_id, at_least, timeout)
        found = self.folded([session_id]).get(session_id)
        return found.state if found else None

    def _wait(self, session_id: str, at_least: Position, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        key = self.keys.session(session_id).state
        delay = self.poll_interval
        while True:
            try:
                raw = self.client.hget(key, "mark")
            except redis.RedisError as e:
                raise ProjectionError(f"reading the mark of {session_id} failed: {e}") from e
            if _mark_reached(raw, at_least):
                return
            if time.monotonic() >= deadline:
                raise NotYetVisibleError(
                    f"{session_id}: position {at_least} not applied within {timeout}s"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.1)

    def ids(self) -> list[str]:
        """Every projected session id, sorted (a SCAN over the state hashes: no index is kept)."""
        found: set[str] = set()
        try:
            for key in self.client.scan_iter(
                match=self.keys.state_pattern(), count=1000, _type="hash"
            ):
                sid = self.keys.session_of(_text(key))
                if sid is not None:
                    found.add(sid)
        except redis.RedisError as e:
            raise ProjectionError(f"listing sessions failed: {e}") from e
        return sorted(found)

    def history(self, session_id: str) -> list[Turn]:
        """Every turn, summarised ones included."""
        try:
            raw = self.client.lrange(self.keys.session(session_id).turns, 0, -1)
        except redis.RedisError as e:
            raise ProjectionError(f"reading history failed: {e}") from e
        return [turn_from_json(t) for t in raw]

    def timeline(self, session_id: str, since: int = 0) -> list[TimelineEntry]:
        """Entries with `seq > since`."""
        k = self.keys.session(session_id)
        try:
            pipe = self.client.pipeline(transaction=True)  # a commit may move them in between
            pipe.hgetall(k.state)
            pipe.lrange(k.timeline, 0, -1)
            raw = pipe.execute()
        except redis.RedisError as e:
            raise ProjectionError(f"reading the timeline failed: {e}") from e
        return parse_timeline(raw, session_id, since)

    def drop(self, session_id: str) -> None:
        """Delete one session's projection."""
        try:
            self.client.unlink(*self.keys.session(session_id).all())
        except redis.RedisError as e:
            raise ProjectionError(f"dropping {session_id} failed: {e}") from e

    def clear(self) -> None:
        """Delete every key under this store's prefix."""
        try:
            batch: list[Any] = []
            for key in self.client.scan_iter(match=self.keys.pattern(), count=1000):
                batch.append(key)
                if len(batch) >= 1000:
                    self.client.unlink(*batch)
                    batch = []
            if batch:
                self.client.unlink(*batch)
        except redis.RedisError as e:
            raise ProjectionError(f"clearing projections failed: {e}") from e


def _result(updates: Sequence[SessionUpdate], replies: Sequence[Any]) -> CommitResult:
    flags = [flag for group in replies for flag in group]  # one list per group, 1 = applied
    applied = tuple(u.session_id for u, r in zip(updates, flags, strict=True) if r == 1)
    conflicts = tuple(u.session_id for u, r in zip(updates, flags, strict=True) if r != 1)
    return CommitResult(applied, conflicts)


@dataclass
class AsyncRedisProjectionStore:
    """The projector's side of the store on `redis.asyncio` (never blocks the event loop)."""

    client: aioredis.Redis
    keys: Keys = field(default_factory=Keys)
    compact_after: int | None = None

    async def folded(
        self, session_ids: Sequence[str], *, event_ids: bool = True
    ) -> dict[str, Folded]:
        """State, mark and event ids of the known sessions, in one round trip.

        `event_ids=False` leaves `Session.event_ids` empty, for readers that never fold (the
        scheduler): a session's ids are most of what a read carries once it has a long life.
        """
        flag = "1" if event_ids else "0"

        def queue(pipe: Any) -> None:
            for keys in read_groups(self.keys, session_ids):
                pipe.evalsha(READ_SHA, len(keys), *keys, flag)

        try:
            replies = await self._execute(queue)
        except redis.RedisError as e:
            raise ProjectionError(f"reading projections failed: {e}") from e
        raws = [raw for group in replies for raw in group]
        found = {sid: parse_read(raw, sid) for sid, raw in zip(session_ids, raws, strict=True)}
        return {sid: f for sid, f in found.items() if f is not None}

    async def commit(self, updates: Sequence[SessionUpdate]) -> CommitResult:
        """Apply every update (compare-and-set on its mark) in one pipelined round trip.

        The arguments are built a script call's worth of sessions at a time, with a yield to the
        event loop between (a big batch's took ≈ 30 ms: a deadline would have waited as long).
        """
        if not updates:
            return CommitResult()
        calls = []
        for at in range(0, len(updates), COMMIT_GROUP):
            if at:
                await asyncio.sleep(0)
            calls += [
                commit_call(self.keys, u, self.compact_after)
                for u in updates[at : at + COMMIT_GROUP]
            ]

        def queue(pipe: Any) -> None:
            for keys, args in grouped(calls):
                pipe.evalsha(COMMIT_SHA, len(keys), *keys, *args)

        try:
            replies = await self._execute(queue)
        except redis.RedisError as e:
            raise ProjectionError(f"committing projections failed: {e}") from e
        return _result(updates, replies)

    async def _execute(self, queue: Callable[[Any], None]) -> list[Any]:
        """Run a pipeline of EVALSHA calls; load the scripts once if the server lost them."""
        for attempt in (1, 2):
            pipe = self.client.pipeline(transaction=False)
            queue(pipe)
            try:
                replies: list[Any] = await pipe.execute()
                return replies
            except NoScriptError:
                if attempt == 2:
                    raise
                for script in (COMMIT_SCRIPT, READ_SCRIPT, DUE_SCRIPT):
                    await self.client.script_load(script)
        raise AssertionError("unreachable")

    async def due_work(
        self, partitions: Iterable[int], until_ms: int | None = None
    ) -> tuple[dict[str, tuple[int, int]], dict[str, int]]:
        """Deadlines (all, or up to `until_ms`) and compaction-due sessions of these partitions.

        One round trip. The in-worker scheduler reads everything when it takes over partitions;
        the standalone scheduler polls a window ahead.
        """
        owned = sorted(partitions)
        until: int | str = "+inf" if until_ms is None else until_ms

        def queue(pipe: Any) -> None:
            for p in owned:
                pipe.evalsha(DUE_SHA, 2, self.keys.deadlines(p), self.keys.compaction_due(p), until)

        try:
            replies = await self._execute(queue)
        except redis.RedisError as e:
            raise ProjectionError(f"reading due work failed: {e}") from e
        deadlines: dict[str, tuple[int, int]] = {}
        due: dict[str, int] = {}
        for p, (flat, members) in zip(owned, replies, strict=True):
            pairs = iter(flat)
            for member, score in zip(pairs, pairs, strict=True):
                deadlines[_text(member)] = (int(score), p)
            for member in members:
                due[_text(member)] = p
        return deadlines, due


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
