"""The figures, one module each: every figure measures one thing on the real stack and emits its
`Figure`s.

Every figure gets its own topics, consumer group and Redis key prefix (named after the run's tag)
and undoes them when it ends; worker processes are always stopped (see `deploy.harness.Cleanup`).
"""

from __future__ import annotations

from collections.abc import Callable

from bench.figures.calibration import calibration
from bench.figures.common import Run, Sizes
from bench.figures.e2e import e2e
from bench.figures.expiry import expiry
from bench.figures.inbox import inbox
from bench.figures.live import live
from bench.figures.longevity import long_session
from bench.figures.memory import memory
from bench.figures.peers import peers
from bench.figures.producer import producer
from bench.figures.projector import projector
from bench.figures.projector_long import projector_long
from bench.figures.rebuild import rebuild
from bench.figures.rebuild_snapshots import rebuild_snapshots

# Measured first in every run, whatever `--only` says (see bench/run.py).
CALIBRATION = "calibration"
FIGURES: dict[str, Callable[[Run], None]] = {
    CALIBRATION: calibration,
    "producer": producer,
    "projector": projector,
    "replay": rebuild,
    "replay_snapshots": rebuild_snapshots,
    "e2e": e2e,
    "expiry": expiry,
    "memory": memory,
    "long": long_session,
    "projector_long": projector_long,
    "inbox": inbox,
    "live": live,
    "peers": peers,
}

__all__ = ["CALIBRATION", "FIGURES", "Run", "Sizes"]
