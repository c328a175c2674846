"""The timer process: a worker's child that closes answer windows at their deadlines.

It shares neither an event loop nor a GIL with folding: its loop only reads the worker's messages
(closings learned, cleared, the partitions owned), sleeps until the earliest deadline and, when
it passes, sends every closing due by then in one `publish_many` on a producer of its own. A
task awaits the acks, so a deadline falling due meanwhile is not held up by them; what the broker
refused goes back on the timetable with a backoff. It asks for real-time scheduling (see
`processors.priority`) before anything else. It ends when the worker closes the pipe or dies
(end of file); signals are the worker's to handle. What it did is counted in memory shared with
the worker (`TimerCounters`), which serves it with the worker's metrics.
"""

from __future__ import annotations

import asyncio
import bisect
import ctypes
import logging
import os
import signal
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from multiprocessing.connection import Connection
from typing import Any

from processors.histogram import LATENESS_MS_BUCKETS, Histogram
from processors.ports import OutRecord, Sink
from processors.priority import elevate
from processors.running import quiet_repeats
from processors.scheduler import SchedulerStats
from processors.sinks import LazyProducer, ProducerSink
from processors.timer import Closing, Frames, Timetable
from producers.kafka_access import KafkaAccess
from schemas.codec import EventCodec
from session_model.scheduled import ScheduledIds, window_closed

log = logging.getLogger(__name__)

# The longest the timer sleeps before it reads the clock again. Deadlines are wall-clock instants
# and the loop's sleep is monotonic: a clock stepped forward (NTP, a resumed VM) would otherwise
# leave every closing late by the step. A step back only delays a wake-up that finds nothing due.
REARM_S = 1.0
BEAT_S = 1.0  # how often the timer's loop stamps itself in the shared counters

Counters = ctypes.Array[ctypes.c_double]


def now_us() -> int:
    """The wall clock in epoch microseconds (deadlines are wall-clock instants)."""
    return time.time_ns() // 1000


@dataclass(frozen=True, slots=True)
class TimerConfig:
    """What the timer process needs: where closings go, under which name, at which priority."""

    access: KafkaAccess
    topic: str
    producer: str = "milpa-scheduler"
    realtime_priority: int = 10  # SCHED_FIFO priority (0: none)
    nice: int = -10  # used when real-time scheduling is not asked or not permitted (0: none)
    retry_initial: float = 0.1  # seconds before a refused send is tried again, doubling
    retry_max: float = 5.0
    stop_grace: float = 5.0  # seconds the acks in flight may take once the worker has gone
    # Seconds without a heartbeat after which the worker ends the timer process as hung and
    # starts another (its loop stamps one every BEAT_S).
    hang_s: float = 10.0


class TimerCounters:
    """The timer's counts in shared memory: written by the timer process, read by the worker."""

    CLOSINGS, LATENESS_SUM, SENDS, FAILED, BEAT, BUCKETS = 0, 1, 2, 3, 4, 5
    BOUNDS = LATENESS_MS_BUCKETS

    def __init__(self, array: Counters) -> None:
        self.array = array

    @classmethod
    def size(cls) -> int:
        """How many doubles the shared array holds."""
        return cls.BUCKETS + len(cls.BOUNDS) + 1

    def closed(self, lateness_ms: Iterable[float]) -> None:
        """Count acknowledged closings and how late each was."""
        a = self.array
        for value in lateness_ms:
            a[self.BUCKETS + bisect.bisect_left(self.BOUNDS, value)] += 1
            a[self.LATENESS_SUM] += value
            a[self.CLOSINGS] += 1
        a[self.SENDS] += 1

    def failed(self, closings: int) -> None:
        """Count closings whose send failed (they are tried again)."""
        self.array[self.FAILED] += closings

    def beat(self, now: float) -> None:
        """Stamp the timer's loop as turning at `now` (monotonic seconds, alike in every
        process of the machine)."""
        self.array[self.BEAT] = now

    def last_beat(self) -> float:
        """When the timer's loop last stamped itself (monotonic seconds)."""
        return float(self.array[self.BEAT])

    def snapshot(self) -> SchedulerStats:
        """The counts as scheduler stats (for the worker's metrics)."""
        a = list(self.array)
        lateness = Histogram(self.BOUNDS, [int(c) for c in a[self.BUCKETS :]], a[self.LATENESS_SUM])
        return SchedulerStats(closings=int(a[self.CLOSINGS]), lateness=lateness)


class TimerService:
    """The timer process's loop: messages in, closings out at their deadlines."""

    def __init__(
        self,
        config: TimerConfig,
        fd: int,
        counters: TimerCounters,
        *,
        sink: Sink | None = None,
        clock: Callable[[], int] = now_us,
        codec: EventCodec | None = None,
    ) -> None:
        self.config = config
        self.fd = fd
        self.counters = counters
        self.table = Timetable()
        self.codec = codec or EventCodec()
        # A key of this process's own: see `ScheduledIds` for why nobody else may know its ids.
        self._ids = ScheduledIds.random()
        self._frames = Frames()
        self._producer: LazyProducer | None = None
        if sink is None:
            self._producer = LazyProducer(config.access)
            sink = ProducerSink(self._producer, config.topic)
        self._sink = sink
        self._clock = clock
        self._retry = config.retry_initial
        self._timer: asyncio.TimerHandle | None = None
        self._beating: asyncio.TimerHandle | None = None
        self._armed_us: int | None = None
        self._sending: set[asyncio.Task[None]] = set()
        self._ended = asyncio.Event()
        self._failure: BaseException | None = None

    async def run(self) -> None:
        """Until the worker's end of the pipe closes; then wait for the acks in flight."""
        loop = asyncio.get_running_loop()
        os.set_blocking(self.fd, False)
        loop.add_reader(self.fd, self._readable)
        self._beat()
        if self._producer is not None:
            try:  # connected before the first deadline; a failure is retried by the first send
                await self._producer.started()
            except Exception as e:  # whatever aiokafka raised: the sends will try again
                log.warning("timer: the producer did not start yet: %s", e)
        try:
            await self._ended.wait()
        finally:
            loop.remove_reader(self.fd)
            if self._beating is not None:
                self._beating.cancel()
            if self._timer is not None:
                self._timer.cancel()
            if self._sending:
                await asyncio.wait(self._sending, timeout=self.config.stop_grace)
            if self._producer is not None:
                await self._producer.stop()
        if self._failure is not None:
            raise self._failure

    def _beat(self) -> None:
        """Tell the worker this loop turns (`TimerLink` ends a timer that stopped telling)."""
        self.counters.beat(time.monotonic())
        self._beating = asyncio.get_running_loop().call_later(BEAT_S, self._beat)

    def _readable(self) -> None:
        try:
            data = os.read(self.fd, 1 << 20)
        except BlockingIOError:
            return
        if not data:
            self._ended.set()  # the worker closed the pipe, or is gone
            return
        try:
            for message in self._frames.feed(data):
                self.table.apply(message)
        except Exception as e:  # a broken stream: end, and let the worker start a new process
            self._failure = e
            self._ended.set()
            return
        self._arm()

    def _arm(self) -> None:
        """Wake at the earliest deadline (the timer already set for it stays)."""
        nxt = self.table.next_us()
        if nxt == self._armed_us and self._timer is not None:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._armed_us = nxt
        if nxt is not None:
            delay = min(max(nxt - self._clock(), 0) / 1e6, REARM_S)
            self._timer = asyncio.get_running_loop().call_later(delay, self._fire)

    def _fire(self) -> None:
        self._timer = None
        self._armed_us = None
        now = self._clock()
        due = self.table.pop_due(now)
        if due:
            self._send(due, now)
        self._arm()

    def _send(self, due: Sequence[Closing], now: int) -> None:
        """Encode every due closing now; a task sends them together and awaits the acks."""
        at = datetime.fromtimestamp(now / 1e6, UTC)
        producer, encode, ids = self.config.producer, self.codec.encode, self._ids
        records: list[OutRecord] = []
        for c in due:
            event_id = ids.closing(c.session_id, c.question_seq)
            event = window_closed(
                c.session_id, c.question_id, c.question_seq, at, producer, event_id=event_id
            )
            records.append((c.session_id.encode(), encode(event), ()))
        task = asyncio.get_running_loop().create_task(self._publish(due, records))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _publish(self, due: Sequence[Closing], records: Sequence[OutRecord]) -> None:
        try:
            await self._sink.publish_many(records)
        except Exception as e:  # whatever the producer raised: nothing due may be dropped
            log.error("timer: could not append %d closing(s), retrying: %s", len(due), e)
            self.counters.failed(len(due))
            self.table.put_back(due, self._clock() + int(self._retry * 1e6))
            self._retry = min(self._retry * 2, self.config.retry_max)
            self._arm()
            return
        self._retry = self.config.retry_initial
        self.table.acknowledged(due)
        acked = self._clock()
        self.counters.closed((acked - c.deadline_us) / 1000 for c in due)


def setup_logging() -> None:
    """The timer process's log: to stderr (the worker's), repeats quieted as the worker's are."""
    logging.basicConfig(
        level=logging.INFO,
        format="[%(asctime)s] [%(process)d] [%(levelname)s] %(name)s: %(message)s",
    )
    # A broker outage makes aiokafka's producer say the same thing many times a second, from
    # this process too.
    quiet_repeats(logging.getLogger())


def serve(config: TimerConfig, reader: Connection, array: Any) -> None:
    """The timer process's entry point (spawned by `processors.timer_link.TimerLink`)."""
    setup_logging()
    # Ctrl-C and SIGTERM are the worker's: the timer ends when the worker closes the pipe.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    elevation = elevate(config.realtime_priority, config.nice)
    for note in elevation.notes:
        log.warning("timer: %s; running at %s priority", note, elevation.policy)
    log.info("timer process %d started (%s)", os.getpid(), elevation.policy)
    service = TimerService(config, reader.fileno(), TimerCounters(array))
    asyncio.run(service.run())
    reader.close()
