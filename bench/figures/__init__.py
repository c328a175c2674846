"""The figures, one module each: every figure measures one thing on the real stack and emits its
`Figure`s.

Every figure gets its own topics, consumer group and Redis key prefix (named after the run's tag)
and undoes them when it ends; worker processes are always stopped (see `deploy.harness.Cleanup`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from bench.figures.calibration import calibration
from bench.figures.cluster import e2e_cluster, projector_cluster
from bench.figures.common import Run, Sizes
from bench.figures.e2e import e2e
from bench.figures.expiry import expiry
from bench.figures.inbox import inbox
from bench.figures.live import live
from bench.figures.longevity import long_session
from bench.figures.memory import memory
from bench.figures.paced import paced_cost
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
    "paced": paced_cost,
    "expiry": expiry,
    "memory": memory,
    "long": long_session,
    "projector_long": projector_long,
    "inbox": inbox,
    "live": live,
    "peers": peers,
}

TOPOLOGIES = ("single", "cluster")
# `--topology cluster`: the figures measured again on 3 brokers + a Redis Cluster, each right
# after its single-node figure and read against it (bench/figures/cluster.py).
CLUSTER_SUFFIX = "_cluster"
ON_CLUSTER: dict[str, Callable[[Run], None]] = {
    "projector": projector_cluster,
    "e2e": e2e_cluster,
}
STEPS: dict[str, Callable[[Run], None]] = {
    **FIGURES,
    **{name + CLUSTER_SUFFIX: measure for name, measure in ON_CLUSTER.items()},
}


def plan(names: Sequence[str], topology: str = "single") -> list[str]:
    """The steps of a run, in order: the calibration first (whatever `names` says), then the
    figures asked for in `FIGURES`' order; with topology `cluster`, each figure that has a
    cluster counterpart is followed by it (`<figure>_cluster`). Raises ValueError for an unknown
    figure or topology, or a cluster run without a figure that has a counterpart."""
    if topology not in TOPOLOGIES:
        raise ValueError(f"unknown topology {topology!r}; known: {', '.join(TOPOLOGIES)}")
    unknown = [n for n in names if n not in FIGURES]
    if unknown:
        raise ValueError(f"unknown figure(s) {unknown}; known: {', '.join(FIGURES)}")
    chosen = set(names) or set(FIGURES)
    steps: list[str] = []
    for name in FIGURES:
        if name in chosen or name == CALIBRATION:
            steps.append(name)
            if topology == "cluster" and name in ON_CLUSTER:
                steps.append(name + CLUSTER_SUFFIX)
    if topology == "cluster" and not any(n.endswith(CLUSTER_SUFFIX) for n in steps):
        raise ValueError(
            "--topology cluster measures these figures on the cluster too: "
            f"{', '.join(ON_CLUSTER)}; none of them was asked for"
        )
    return steps


__all__ = [
    "CALIBRATION",
    "FIGURES",
    "ON_CLUSTER",
    "STEPS",
    "TOPOLOGIES",
    "Run",
    "Sizes",
    "plan",
]
