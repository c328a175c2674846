"""Running a Faust process for operators: bounded shutdown, patient start-up, quiet outages.

- **Bounded shutdown.** SIGTERM (or SIGINT) starts Faust's orderly stop and a watchdog: if the
  process has not ended `grace` seconds later (Redis or the broker down, a batch retrying for ever,
  a client waiting on a dead connection), it exits at once. Nothing is lost: offsets are committed
  only for batches Redis and the broker acknowledged, so what was not committed is redelivered to
  whoever owns the partition next.
- **Patient start-up.** A worker started before the broker or Redis waits for both with backoff,
  printing one status line every `status_every` seconds, instead of exiting.
- **Quiet outages.** While the broker is down, aiokafka logs a connection error per attempt per
  node (about 50,000 lines from two workers in 25 s). `RepeatFilter` lets the first few lines of
  each kind through per window and then one line saying how many were suppressed.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Final, NoReturn

from schemas.errors import BackendError

log = logging.getLogger(__name__)

FORCED_EXIT: Final = 70  # EX_SOFTWARE: the orderly stop did not finish within the grace period


def exit_now(why: str) -> NoReturn:
    """End the process at once, with `FORCED_EXIT`, as kill -9 would (nothing else runs; the
    timer child reads the end of its pipe and ends after the sends it has in flight)."""
    message = f"milpa-sessions: {why}; exiting now (records not committed are redelivered)\n"
    try:
        os.write(2, message.encode())
    finally:
        os._exit(FORCED_EXIT)


def start_watchdog(grace: float, why: str) -> threading.Thread:
    """Exit the process `grace` seconds from now unless it has ended by then."""

    def expire() -> None:
        time.sleep(grace)
        exit_now(f"still stopping {grace:g}s after {why}")

    thread = threading.Thread(target=expire, name="shutdown-watchdog", daemon=True)
    thread.start()
    return thread


class RepeatFilter(logging.Filter):
    """Lets at most `burst` records of one kind through per `window` seconds, then one summary.

    A kind is the logger's name, the level and the message template (its arguments, such as the
    node or the attempt number, do not make a new kind).
    """

    def __init__(
        self, burst: int = 3, window: float = 10.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__()
        self.burst = burst
        self.window = window
        self.clock = clock
        self._seen: dict[tuple[str, int, str], list[float | int]] = {}  # [window start, count]
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        """True to emit the record (maybe amended with the count suppressed before it)."""
        if record.levelno < logging.WARNING and not record.name.startswith(("aiokafka", "kafka")):
            return True
        kind = (record.name, record.levelno, str(record.msg))
        now = self.clock()
        with self._lock:
            entry = self._seen.get(kind)
            if entry is None or now - entry[0] >= self.window:
                suppressed = 0 if entry is None else int(entry[1]) - self.burst
                self._seen[kind] = [now, 1]
                if len(self._seen) > 1000:  # kinds of a long past
                    self._forget(now)
                if suppressed > 0:
                    record.msg = f"{record.msg} [{suppressed} more like this were suppressed]"
                return True
            entry[1] = int(entry[1]) + 1
            return int(entry[1]) <= self.burst

    def _forget(self, now: float) -> None:
        for kind in [k for k, (start, _) in self._seen.items() if now - start >= self.window]:
            del self._seen[kind]


def quiet_repeats(logger: logging.Logger, burst: int = 3, window: float = 10.0) -> None:
    """Put a `RepeatFilter` on every handler of `logger` (the root logger, once set up)."""
    for handler in logger.handlers:
        if not any(isinstance(f, RepeatFilter) for f in handler.filters):
            handler.addFilter(RepeatFilter(burst, window))


def wait_for(
    what: str,
    check: Callable[[], object],
    *,
    timeout: float = 0.0,
    status_every: float = 10.0,
    initial: float = 0.5,
    longest: float = 5.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    say: Callable[[str], None] | None = None,
) -> None:
    """Call `check` until it stops raising `BackendError`, with backoff (timeout 0: for ever).

    One status line when it first fails and then at most one every `status_every` seconds.
    """
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    started = clock()
    delay = initial
    last_said: float | None = None
    while True:
        try:
            check()
        except BackendError as e:
            now = clock()
            waited = now - started
            if timeout and waited >= timeout:
                raise type(e)(f"{what} not reachable after {waited:.0f}s: {e}") from e
            if last_said is None or now - last_said >= status_every:
                say(f"waiting for {what} ({waited:.0f}s so far, retrying): {e}")
                last_said = now
            sleep(delay)
            delay = min(delay * 2, longest)
            continue
        if last_said is not None:
            say(f"{what} reachable after {clock() - started:.0f}s")
        return
