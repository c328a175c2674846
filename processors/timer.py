"""The timer path's pure parts: closings to make, the timetable that holds them, their wire format.

The worker's projector learns each open question's deadline when it folds it and hands it on as a
`Closing` (everything the `answer_window_closed` needs, so the timer reads nothing at the
deadline). The timer process keeps them in a `Timetable`, for the partitions the worker owns, and
pops every closing whose deadline has passed in one go. Messages between the two are framed
JSON (`frame`, `Frames`). Nothing here does I/O or reads a clock.
"""

from __future__ import annotations

import heapq
import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import orjson

from schemas.errors import CodecError

_LENGTH = struct.Struct("!I")
MAX_FRAME = 64 * 1024 * 1024  # a frame longer than this is a broken stream, not a message
FORGET_SENT_OVER = 100_000  # closings remembered as sent (only ever a guard against repeats)
STALE_SLACK = 64  # superseded heap entries tolerated beyond as many as there are live ones


@dataclass(frozen=True, slots=True)
class Closing:
    """An open question's answer window, to close once its deadline has passed."""

    session_id: str
    partition: int
    deadline_us: int  # epoch microseconds
    question_id: str
    question_seq: int

    def wire(self) -> list[object]:
        """The closing as a JSON-ready list."""
        return [
            self.session_id,
            self.partition,
            self.deadline_us,
            self.question_id,
            self.question_seq,
        ]

    @classmethod
    def from_wire(cls, raw: Sequence[object]) -> Closing:
        """The closing from `wire()`'s list (CodecError when it is not one)."""
        try:
            sid, partition, deadline_us, question_id, seq = raw
        except (TypeError, ValueError) as e:
            raise CodecError(f"not a closing: {raw!r}") from e
        if not (
            isinstance(sid, str)
            and isinstance(partition, int)
            and isinstance(deadline_us, int)
            and isinstance(question_id, str)
            and isinstance(seq, int)
        ):
            raise CodecError(f"not a closing: {raw!r}")
        return cls(sid, partition, deadline_us, question_id, seq)


@dataclass(frozen=True, slots=True)
class Assign:
    """Close only for these partitions from now on (the worker's assignment changed)."""

    partitions: frozenset[int]


@dataclass(frozen=True, slots=True)
class Offer:
    """Deadlines learned or changed (a closing replaces the one of the same session)."""

    closings: tuple[Closing, ...]


@dataclass(frozen=True, slots=True)
class Clear:
    """Sessions whose question was answered, closed or replaced by one without a deadline."""

    session_ids: tuple[str, ...]


Message = Assign | Offer | Clear


def frame(message: Message) -> bytes:
    """The message as a length-prefixed JSON frame."""
    body: list[object]
    if isinstance(message, Assign):
        body = ["assign", sorted(message.partitions)]
    elif isinstance(message, Offer):
        body = ["offer", [c.wire() for c in message.closings]]
    else:
        body = ["clear", list(message.session_ids)]
    data = orjson.dumps(body)
    return _LENGTH.pack(len(data)) + data


def parse(data: bytes) -> Message:
    """One frame's body as a message (CodecError when it is not one)."""
    try:
        kind, items = orjson.loads(data)
    except (orjson.JSONDecodeError, TypeError, ValueError) as e:
        raise CodecError(f"not a timer message: {data[:80]!r}") from e
    if not isinstance(items, list):
        raise CodecError(f"not a timer message: {data[:80]!r}")
    if kind == "assign" and all(isinstance(p, int) for p in items):
        return Assign(frozenset(items))
    if kind == "offer":
        return Offer(tuple(Closing.from_wire(c) for c in items))
    if kind == "clear" and all(isinstance(s, str) for s in items):
        return Clear(tuple(items))
    raise CodecError(f"not a timer message: {data[:80]!r}")


class Frames:
    """Reassembles messages from a byte stream read in arbitrary pieces."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> Iterator[Message]:
        """Every message completed by `data`, in order."""
        self._buffer += data
        view = self._buffer
        at = 0
        try:
            while len(view) - at >= _LENGTH.size:
                (length,) = _LENGTH.unpack_from(view, at)
                if length > MAX_FRAME:
                    raise CodecError(f"a timer frame of {length} bytes: the stream is broken")
                if len(view) - at - _LENGTH.size < length:
                    break
                start = at + _LENGTH.size
                at = start + length
                yield parse(bytes(view[start:at]))
        finally:
            del self._buffer[:at]


class Timetable:
    """The closings to make, earliest first, for the partitions owned (all until assigned)."""

    def __init__(self) -> None:
        self.owned: frozenset[int] | None = None
        self._entries: dict[str, tuple[int, Closing]] = {}  # sid -> (when, closing)
        self._heap: list[tuple[int, str]] = []
        # sid -> question seq of a closing popped (sent): not offered again while the projector
        # has not folded it (the worker may offer it once more after a rebalance).
        self._sent: dict[str, int] = {}
        # The part of `_sent` whose send has not completed: never forgotten, since a failed send
        # is put back only while its closing is still here.
        self._in_flight: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def apply(self, message: Message) -> None:
        """Take in one message from the worker."""
        if isinstance(message, Assign):
            self.assign(message.partitions)
        elif isinstance(message, Offer):
            for closing in message.closings:
                self.offer(closing)
        else:
            for sid in message.session_ids:
                self.clear(sid)

    def assign(self, partitions: Iterable[int]) -> None:
        """Keep only the closings of these partitions, and accept only theirs from now on."""
        self.owned = frozenset(partitions)
        self._entries = {
            sid: entry for sid, entry in self._entries.items() if entry[1].partition in self.owned
        }
        self._prune()

    def offer(self, closing: Closing) -> None:
        """Schedule this closing at its deadline (replacing its session's earlier one)."""
        if self.owned is not None and closing.partition not in self.owned:
            return
        sid = closing.session_id
        if self._sent.get(sid) == closing.question_seq:
            return  # already sent; the projector has not folded it yet
        current = self._entries.get(sid)
        if current is not None and current[1] == closing:
            return
        if current is not None and current[1].question_seq > closing.question_seq:
            return  # an older question than the one scheduled: news that arrived late
        self._put(closing, closing.deadline_us)

    def clear(self, session_id: str) -> None:
        """Nothing to close for this session any more."""
        if self._entries.pop(session_id, None) is not None:
            self._prune()
        self._sent.pop(session_id, None)
        self._in_flight.pop(session_id, None)

    def next_us(self) -> int | None:
        """When the earliest closing is due (epoch µs), dropping replaced entries on the way."""
        heap = self._heap
        while heap:
            when, sid = heap[0]
            entry = self._entries.get(sid)
            if entry is not None and entry[0] == when:
                return when
            heapq.heappop(heap)
        return None

    def pop_due(self, now_us: int) -> list[Closing]:
        """Every closing whose deadline is strictly before `now_us`, earliest first."""
        due: list[Closing] = []
        while (when := self.next_us()) is not None and when < now_us:
            _, sid = heapq.heappop(self._heap)
            _, closing = self._entries.pop(sid)
            due.append(closing)
        if due:
            self._prune()  # fewer live entries: the stale ones may outnumber them now
            if len(self._sent) - len(self._in_flight) > FORGET_SENT_OVER:
                self._sent = dict(self._in_flight)
            sent = [(c.session_id, c.question_seq) for c in due]
            self._sent.update(sent)
            self._in_flight.update(sent)
        return due

    def acknowledged(self, closings: Iterable[Closing]) -> None:
        """Note that these closings were sent for good (they may be forgotten from now on)."""
        for closing in closings:
            if self._in_flight.get(closing.session_id) == closing.question_seq:
                del self._in_flight[closing.session_id]

    def put_back(self, closings: Iterable[Closing], at_us: int) -> None:
        """Schedule again, at `at_us`, closings whose send failed (unless news made them moot)."""
        for closing in closings:
            sid = closing.session_id
            if self._in_flight.get(sid) != closing.question_seq:
                continue  # answered, or a newer question's closing sent meanwhile
            del self._in_flight[sid]
            if sid in self._entries:
                continue  # re-offered meanwhile
            if self.owned is not None and closing.partition not in self.owned:
                continue
            del self._sent[sid]
            self._put(closing, at_us)

    def _put(self, closing: Closing, when: int) -> None:
        self._entries[closing.session_id] = (when, closing)
        heapq.heappush(self._heap, (when, closing.session_id))
        self._prune()

    def _prune(self) -> None:
        """Rebuild the heap from the live entries once the stale ones outnumber them."""
        # Replaced, cleared or revoked closings would otherwise stay until their own deadline came
        # up (years, for some). Each live entry has a heap entry, the others are stale; a rebuild
        # comes after at least as many stale entries as it costs (amortised O(1)).
        live = len(self._entries)
        if len(self._heap) - live > max(STALE_SLACK, live):
            self._heap = [(when, sid) for sid, (when, _) in self._entries.items()]
            heapq.heapify(self._heap)
