"""How a session's projection is laid out in Redis, and the bounds that decide where things live.

Commit path (lua/commit.lua): for each session an update carries the mark its state was folded from
(`base`) and the mark it reaches. The script applies state, appends turns, timeline entries and
event ids, moves the mark and updates the due-work indexes and counters only if the stored mark
still equals `base`; otherwise it writes nothing and reports a conflict (the projector reloads and
folds again). A redelivered batch never reaches the script: the folder skips records at or below
the mark.

The layout is built for memory (`docs/PERFORMANCE.md`, "Memory"). Redis keeps a small hash as a
compact listpack while every value is at most 64 bytes (`hash-max-listpack-value`), and as a
hashtable a few hundred bytes larger otherwise; every key costs its name plus ~60 bytes. So a
session with few events is COMPACT: everything in ONE hash, byte strings cut into CHUNK-byte pieces:

    mark        "partition:offset" of the last record applied
    n           the header: one character each for the state's chunks (or `w`: whole in `s`), the
                event ids' chunks (or `x`: in their own key) and the timeline's chunks (or `x`: in
                its list), counted from `0`; then the unsummarised turns (how many of the turns
                list's tail `load` reads), left out when 0. E.g. `212` or `wxx15`.
    s1, s2, …   the state (`session_to_blob`) while at most STATE_INLINE bytes; `s` when longer.
                A state that would be longer is deflated by `session_to_blob` when that is shorter
                (so a deflated state may be in chunks too); the scripts never look inside it
    i1, i2, …   the event ids (`pack_event_ids`), at most IDS_INLINE bytes
    t1, t2, …   the timeline entries, each ended by a newline, while at most TIMELINE_INLINE bytes;
                beyond, every entry is in the timeline list
    m           the latest compaction summary (`codec.summary_to_stored`: deflated when that makes
                it shorter), written only by the commit that applies a compaction

A commit reads the mark and the header (and the last chunk of a stream it appends to) and writes
the state's chunks, the new chunks and the header. When the event ids outgrow IDS_INLINE the
session is SPREAD, for good: the state whole in `s`, the ids in a string of their own (APPEND), the
timeline in its list. Both bounds apply to append-only streams and the state's form depends only
on the state and on that, so where everything lives depends on what the session holds, never on
how the records were batched: a rebuild gives byte-identical values. Turns are always in their list.

No set of session ids is kept (it cost each session ~90 bytes): `ids()` scans the state hashes.
"""

from __future__ import annotations

# Redis's default hash-max-listpack-value is 64; a listpack string shorter than 64 bytes has a
# one-byte header (two from 64), so 63-byte chunks cost the least.
CHUNK = 63
IDS_INLINE = 256  # 16 UUIDs: a session with more events is spread over keys of its own
STATE_INLINE = 1024
TIMELINE_INLINE = 512
ELSEWHERE = "x"  # in the header: the stream is in a key of its own
WHOLE = "w"  # in the header: the state is whole in field `s`


def chunk_names(letter: str, limit: int) -> str:
    """The chunk fields of a stream of at most `limit` bytes, as a Lua table of string literals."""
    return "{" + ", ".join(f"'{letter}{k}'" for k in range(1, -(-limit // CHUNK) + 1)) + "}"


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
