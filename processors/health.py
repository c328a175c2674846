"""Whether a worker or scheduler is alive and keeping up: what `/livez` and `/readyz` answer.

Alive: its event loop turned within `stall_s` (a heartbeat task stamps the time every second, and
the HTTP thread reads the stamp). A loop blocked by a call that never returns stops the stamps;
restarting the process is the cure, so an orchestrator's liveness probe reads `/livez`.

Ready: alive, past its first partition assignment, no partition parked (a record the fold
raised on, or a session whose stored state cannot be read: `BatchFolder.parked`), and not
stalled: records wait in a partition it reads (its consumer lag) and no batch finished for
`stall_s` since they were first seen waiting (a Redis that hangs, a broker that refuses its
decisions). A restart does not cure those, and every restart moves the group's partitions: that
is `/readyz`, for alerts and rollouts, not for killing the process.

A partition that waits while an operator's `replay --session` rebuilds one of its sessions is
routine, not a fault: it is a note in the verdict for `stall_s`, and a problem after that (a
replay that runs that long, or died and left the session half rebuilt, wants an operator).

A lag is seen by a probe: a stall is reported by the first probe `stall_s` after one that saw the
records waiting (the probes of an orchestrator come every few seconds).

Before all that, while the process waits for Kafka and Redis and then starts its app (Faust
serves its tasks only once it has joined the group, which may wait for a dead member's session
to time out), the same port answers `Starting`'s verdicts: alive, never ready. The wait has its
own bound (`MILPA_STARTUP_TIMEOUT`); an orchestrator bounds the rest with a start-up probe.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from schemas.errors import ConfigurationError
from session_model.projection import Fault

log = logging.getLogger(__name__)

BEAT_S = 1.0  # how often the heartbeat task stamps the time


@dataclass(frozen=True, slots=True)
class Health:
    """One probe's verdict, with what it was judged on."""

    live: bool
    ready: bool
    problems: tuple[str, ...]
    loop_s: float  # since the event loop last stamped the heartbeat
    lag: int  # records waiting in the partitions this process reads (0 without a worker)
    waiting_s: float | None  # since records were first seen waiting with no batch finished
    notes: tuple[str, ...] = ()  # what an operator may want to know that is not a problem

    def as_json(self) -> dict[str, Any]:
        """The verdict as the endpoints' JSON body."""
        return {
            "live": self.live,
            "ready": self.ready,
            "problems": list(self.problems),
            "notes": list(self.notes),
            "loop_s": round(self.loop_s, 3),
            "lag": self.lag,
            "waiting_s": None if self.waiting_s is None else round(self.waiting_s, 3),
        }


@dataclass(frozen=True, slots=True)
class Troubles:
    """What else a verdict is judged on: problems make the process unready, notes do not."""

    problems: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()


NO_TROUBLES = Troubles()


def judge(
    *,
    now: float,
    beat: float,
    assigned: bool,
    lag: int,
    waiting_since: float | None,
    stall_s: float,
    troubles: Sequence[str] = (),
    notes: Sequence[str] = (),
) -> Health:
    """The verdict at `now` (monotonic seconds), from the last heartbeat and the records waiting
    (and other `troubles` that make the process unready, e.g. a parked partition; `notes` do
    not)."""
    problems: list[str] = []
    loop_s = max(0.0, now - beat)
    live = loop_s <= stall_s
    if not live:
        problems.append(f"the event loop has not run for {loop_s:.1f}s")
    if not assigned:
        problems.append("no partition assignment yet (joining the group)")
    waiting_s = None if waiting_since is None else max(0.0, now - waiting_since)
    if waiting_s is not None and waiting_s > stall_s:
        problems.append(f"{lag} records have waited {waiting_s:.1f}s with no batch finished")
    problems.extend(troubles)
    return Health(live, not problems, tuple(problems), loop_s, lag, waiting_s, tuple(notes))


def parked_partitions(
    faults: Mapping[int, Fault],
    held: Mapping[int, Collection[str]],
    unreadable: Collection[str],
    rebuilding_since: Mapping[str, float],
    *,
    now: float,
    stall_s: float,
) -> Troubles:
    """What the parked partitions make of the verdict at `now`.

    A partition parked at a session whose state cannot be read holds the records of every such
    session in it (`held`): it is a problem while one of those that still cannot be read
    (`unreadable`) is damaged; while all of them are being rebuilt by a `replay --session`
    (`rebuilding_since`: since when, monotonic seconds), a note for `stall_s`, then a problem;
    once all read, a note until the worker reads the partition again. Only the exception's type
    is said of a fold's fault: its text may quote an agent's (the log has it whole), as may a
    session's id.
    """
    problems: list[str] = []
    notes: list[str] = []
    for p, f in sorted(faults.items()):
        at = f"partition {p} parked at offset {f.position.offset}"
        if not f.unreadable:
            problems.append(f"{at}: the fold raised {f.kind} (a bug: see the worker's log)")
            continue
        waiting = [s for s in {f.session_id, *held.get(p, ())} if s in unreadable]
        since = [t for s in waiting if (t := rebuilding_since.get(s)) is not None]
        if not waiting:
            notes.append(f"{at}: what it waited for reads now (read again at the next retry)")
        elif len(since) < len(waiting):  # one of them is damaged, not being rebuilt
            problems.append(
                f"{at}: what is stored of a session cannot be read now (see the worker's log)"
            )
        elif (waited := max(0.0, now - min(since))) <= stall_s:
            notes.append(f"{at}: a `replay --session` rebuilds a session ({waited:.1f}s)")
        else:
            problems.append(
                f"{at}: a session has been half rebuilt for {waited:.0f}s (a `replay "
                "--session` still running, or one that died: see the worker's log)"
            )
    return Troubles(tuple(problems), tuple(notes))


def checked_stall(stall_s: float) -> float:
    """`MILPA_STALL_S`, at least two heartbeats (ConfigurationError otherwise)."""
    if not stall_s >= 2 * BEAT_S:  # (NaN too) a shorter one fails between two heartbeats
        raise ConfigurationError(
            f"MILPA_STALL_S={stall_s}: must be at least {2 * BEAT_S:g} seconds"
        )
    return stall_s


class Checks(Protocol):
    """What the health endpoints ask: a verdict now."""

    def check(self) -> Health:
        """The verdict now (never raises)."""
        ...


class Starting:
    """The verdicts while the process starts, before its app serves its own (`Probe`)."""

    def __init__(self) -> None:
        self.doing = "starting"

    def waiting_for(self, what: str) -> None:
        """Say what the process waits for now (e.g. "Redis at redis://…")."""
        self.doing = f"waiting for {what}"

    def waited(self) -> None:
        """Kafka and Redis answered: the app starts now (it joins the consumer group)."""
        self.doing = "starting the app and joining the consumer group"

    def check(self) -> Health:
        """Alive, never ready, saying what it is doing."""
        return Health(True, False, (f"starting: {self.doing}",), 0.0, 0, None)


class Heartbeat:
    """The event loop's last turn, stamped by `run` and read from any thread."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.at = clock()

    def beat(self) -> None:
        """Stamp the time now."""
        self.at = self.clock()

    async def run(self, every: float = BEAT_S) -> None:
        """Stamp the time every `every` seconds, for ever (a task of the app)."""
        while True:
            self.beat()
            await asyncio.sleep(every)


class Probe:
    """Judges the process each time an endpoint asks, remembering since when records wait."""

    def __init__(
        self,
        heartbeat: Heartbeat,
        lag: Callable[[], Mapping[int, int]],
        progressed: Callable[[], float | None],
        assigned: Callable[[], bool],
        stall_s: float,
        *,
        troubles: Callable[[], Troubles] = lambda: NO_TROUBLES,
    ) -> None:
        checked_stall(stall_s)
        self.heartbeat = heartbeat
        self._troubles = troubles
        self._lag = lag
        self._progressed = progressed
        self._assigned = assigned
        self.stall_s = stall_s
        self._waiting_since: float | None = None
        self._lock = threading.Lock()  # probes may come on several server threads at once

    def check(self) -> Health:
        """The verdict now (never raises: what cannot be read makes it unready, not dead)."""
        with self._lock:
            now = self.heartbeat.clock()
            try:
                lag = max(sum(self._lag().values()), 0)
                progressed = self._progressed()
                assigned = self._assigned()
                troubles = self._troubles()
            except Exception as e:  # the consumer's state read from this thread, mid-rebalance
                log.debug("the probe could not read the consumer's progress", exc_info=True)
                lag, progressed, assigned = 0, None, True
                troubles = Troubles(
                    (f"could not read the consumer's progress: {type(e).__name__}",)
                )
            if lag == 0:
                self._waiting_since = None
            elif self._waiting_since is None or (
                progressed is not None and progressed > self._waiting_since
            ):
                # Seen waiting now, or a batch finished since they were first seen: from now.
                self._waiting_since = now
            return judge(
                now=now,
                beat=self.heartbeat.at,
                assigned=assigned,
                lag=lag,
                waiting_since=self._waiting_since,
                stall_s=self.stall_s,
                troubles=troubles.problems,
                notes=troubles.notes,
            )
