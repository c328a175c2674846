"""The worker's end of its timer process: start it, feed it through a pipe, restart it if it dies
or hangs.

Sending never blocks the worker's event loop: frames go to an asyncio write transport, which
buffers what the pipe cannot take at once. Starting and joining the process run in threads. If
the process ends on its own, it is started again after `restart_delay` and the `restarted`
callbacks run (the feed then sends everything it knows once more: duplicates are harmless). The
process's counts live in shared memory that outlives restarts. The process stamps a heartbeat
there every second: one that has not for `TimerConfig.hang_s` is killed (and so restarted), since
a hung timer would let every deadline pass unclosed while it looked alive.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess

from processors.histogram import Histogram
from processors.scheduler import SchedulerStats
from processors.timer import Message, frame
from processors.timer_process import BEAT_S, TimerConfig, TimerCounters, serve
from schemas.errors import ConfigurationError

log = logging.getLogger(__name__)

# Seconds a timer process may take from its spawn to its first heartbeat (or `hang_s`, if longer).
START_GRACE_S = 30.0


class TimerLink:
    """A timer process of the worker's own and the pipe that feeds it."""

    def __init__(self, config: TimerConfig, *, restart_delay: float = 1.0) -> None:
        if not config.hang_s >= 2 * BEAT_S:  # (NaN too) shorter: ended between two heartbeats
            raise ConfigurationError(
                f"MILPA_SCHEDULER_TIMER_HANG_S={config.hang_s}: must be at least "
                f"{2 * BEAT_S:g} seconds"
            )
        self.config = config
        self.restart_delay = restart_delay
        self._ctx = multiprocessing.get_context("spawn")
        self.counters = TimerCounters(self._ctx.RawArray("d", TimerCounters.size()))
        self.restarted: list[Callable[[], None]] = []
        self.starts = 0
        self._process: BaseProcess | None = None
        self._transport: asyncio.WriteTransport | None = None
        self._pending: list[bytes] = []  # frames sent before the process was started
        self._stopping = False
        self._watchdog: asyncio.Task[None] | None = None
        self._started_at = 0.0  # monotonic seconds of the last start
        self.hangs = 0  # timer processes ended for want of a heartbeat

    @property
    def pid(self) -> int | None:
        """The timer process's id while it runs."""
        return self._process.pid if self._process is not None else None

    def send(self, message: Message) -> None:
        """Hand a message to the timer process (buffered, never blocking)."""
        data = frame(message)
        transport = self._transport
        if transport is None or transport.is_closing():
            self._pending.append(data)  # a restart replays the feed's state instead
        else:
            transport.write(data)

    async def start(self) -> None:
        """Start the timer process and connect the pipe (frames sent so far go first)."""
        loop = asyncio.get_running_loop()
        reader, writer = self._ctx.Pipe(duplex=False)
        process = self._ctx.Process(
            target=serve,
            args=(self.config, reader, self.counters.array),
            name="milpa-timer",
            daemon=True,
        )
        self.counters.beat(0.0)  # not beating yet: `_watch` gives it START_GRACE_S from now
        self._started_at = time.monotonic()
        await asyncio.to_thread(process.start)
        reader.close()
        if self._stopping:  # stopped while it was being spawned (a restart): end it again
            writer.close()
            await asyncio.to_thread(process.join, self.config.stop_grace + 2)
            if process.is_alive():
                process.kill()
            return
        transport, _ = await loop.connect_write_pipe(asyncio.Protocol, writer)
        self._process, self._transport = process, transport
        self.starts += 1
        pending, self._pending = self._pending, []
        for data in pending:
            transport.write(data)
        loop.add_reader(process.sentinel, self._exited, process)
        log.info("timer process %s started", process.pid)
        if self._watchdog is None:
            self._watchdog = loop.create_task(self._watch())

    async def _watch(self) -> None:
        """End a timer process whose heartbeat stopped (the exit then starts another)."""
        hang_s = self.config.hang_s
        ended: BaseProcess | None = None
        while not self._stopping:
            await asyncio.sleep(min(1.0, hang_s / 4))
            try:
                ended = self._end_if_hung(ended, hang_s) or ended
            except Exception:  # a watchdog that stopped watching would say nothing
                log.exception("the timer process's watchdog failed; it goes on watching")

    def _end_if_hung(self, ended: BaseProcess | None, hang_s: float) -> BaseProcess | None:
        """Kill the timer process if it is silent too long; the process killed, if any."""
        process = self._process
        beat = self.counters.last_beat()
        now = time.monotonic()
        # Not beating yet: a fresh interpreter's imports, on a loaded machine, take a while.
        silent, allowed = (
            (now - beat, hang_s) if beat else (now - self._started_at, max(START_GRACE_S, hang_s))
        )
        if process is None or process is ended or silent <= allowed or not process.is_alive():
            return None
        log.error(
            "the timer process %s has not run for %.1fs (hung: no deadline closes while it "
            "is); ending it, another starts",
            process.pid,
            silent,
        )
        self.hangs += 1
        process.kill()
        return process

    def _exited(self, process: BaseProcess) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(process.sentinel)
        if self._stopping or process is not self._process:
            return
        log.error(
            "the timer process %s ended (exit code %s); starting another in %.1fs",
            process.pid,
            process.exitcode,
            self.restart_delay,
        )
        if self._transport is not None:
            self._transport.abort()
        self._transport = None
        self._pending = []  # the restarted callbacks send the whole state again
        loop.call_later(self.restart_delay, lambda: loop.create_task(self._restart()))

    async def _restart(self) -> None:
        if self._stopping:
            return
        try:
            await self.start()
        except Exception as e:  # try again later: closings wait, they are not lost
            log.error("could not start the timer process: %s", e)
            loop = asyncio.get_running_loop()
            loop.call_later(self.restart_delay, lambda: loop.create_task(self._restart()))
            return
        for callback in self.restarted:
            callback()

    async def stop(self) -> None:
        """Close the pipe (the process sends what is due in flight and ends); wait for it."""
        self._stopping = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        process, transport = self._process, self._transport
        if transport is not None:
            transport.close()  # after the buffered frames: the process then reads end of file
        if process is None:
            return
        asyncio.get_running_loop().remove_reader(process.sentinel)
        await asyncio.to_thread(process.join, self.config.stop_grace + 2)
        if process.is_alive():
            log.warning("the timer process %s did not end in time: terminating it", process.pid)
            process.kill()
            await asyncio.to_thread(process.join, 5)

    def stats(self) -> SchedulerStats:
        """What the timer process did so far (closings, lateness), and its restarts."""
        done = self.counters.snapshot()
        done.timer_restarts, done.timer_hangs = max(self.starts - 1, 0), self.hangs
        return done


def combined(loop_stats: SchedulerStats, timer_stats: SchedulerStats) -> SchedulerStats:
    """The worker's scheduler stats: compactions from its loop, closings from both paths."""
    a, b = loop_stats.lateness, timer_stats.lateness
    lateness = Histogram(
        a.bounds, [x + y for x, y in zip(a.counts, b.counts, strict=True)], a.total + b.total
    )
    return SchedulerStats(
        closings=loop_stats.closings + timer_stats.closings,
        compactions=loop_stats.compactions,
        lateness=lateness,
        wakeups=loop_stats.wakeups,
        timer_restarts=timer_stats.timer_restarts,
        timer_hangs=timer_stats.timer_hangs,
    )
