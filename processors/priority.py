"""Scheduling priority for the timer process: a real-time policy, else a lower nice, else none.

A process asleep until a deadline must get a core the moment it wakes, also while the worker,
the broker and Redis keep both cores busy. Linux lets a process with CAP_SYS_NICE (root, unless a
container drops it) or a matching RLIMIT_RTPRIO / RLIMIT_NICE raise its priority; elsewhere the
attempt fails and the process goes on at normal priority, saying so. Called before the process
starts any thread: Linux keeps these per thread, and new threads inherit them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

SetScheduler = Callable[[int, int, os.sched_param], None]
SetPriority = Callable[[int, int, int], None]


@dataclass(frozen=True, slots=True)
class Elevation:
    """What the process got: its policy, and the notes to log about what was not permitted."""

    policy: str  # "SCHED_FIFO <priority>", "nice <n>" or "normal"
    notes: tuple[str, ...] = ()


def _set_scheduler(pid: int, policy: int, param: os.sched_param) -> None:
    os.sched_setscheduler(pid, policy, param)


def _set_priority(which: int, who: int, value: int) -> None:
    os.setpriority(which, who, value)


def elevate(
    realtime_priority: int,
    nice: int,
    *,
    set_scheduler: SetScheduler | None = None,
    set_priority: SetPriority | None = None,
) -> Elevation:
    """Raise the calling process's priority as far as these settings ask and the OS permits.

    `realtime_priority` 1–99 asks for SCHED_FIFO at that priority (0: not asked); failing that,
    or not asked, a `nice` below 0 asks for that nice value (0: not asked).
    """
    notes: list[str] = []
    fifo = getattr(os, "SCHED_FIFO", None)
    if realtime_priority > 0:
        if fifo is None:
            notes.append("SCHED_FIFO is not available on this platform")
        else:
            try:
                (set_scheduler or _set_scheduler)(0, fifo, os.sched_param(realtime_priority))
                return Elevation(f"SCHED_FIFO {realtime_priority}")
            except (OSError, ValueError) as e:
                notes.append(f"SCHED_FIFO {realtime_priority} not permitted ({e})")
    if nice < 0:
        try:
            (set_priority or _set_priority)(os.PRIO_PROCESS, 0, nice)
            return Elevation(f"nice {nice}", tuple(notes))
        except (OSError, ValueError) as e:
            notes.append(f"nice {nice} not permitted ({e})")
    return Elevation("normal", tuple(notes))
