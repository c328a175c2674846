"""The peers figure: the same pure fold inside the stream processors a Python team would pick
instead of the projector (Quix Streams with its RocksDB state, Faust with a Table), each a process
of its own, on the projector figure's pre-filled topic and e2e method; against ours, measured in
the same figure."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import infra, workload
from bench.figures.common import ROUND_SETTLE_MAX_S, TARGETS, FoldCounter, Run, paced
from bench.figures.e2e import _measure, _start_watcher, _warm_up
from bench.figures.projector import measure_projector
from bench.peers.common import DIR_ENV, EXPECT_ENV, STAMPS_ENV, latencies, parse_stamps
from bench.stats import rate, ratio, summary
from deploy.harness import Cleanup, Proc, start_python, wait_for
from deploy.host import cpu_report
from milpa_sessions.settings import Settings
from producers.kafka_log import KafkaEventLog
from producers.topics import admin_client, delete_topics

POLL_S = 0.02  # as the projector figure polls its counter
PEERS = {"quix": "bench.peers.quix_peer", "faust": "bench.peers.faust_peer"}
KEEPS = {
    "quix": "per session (Quix keys state by the message key: the session id) one value in the "
    "State of a Quix Streams 3 stateful update: the whole folded Session, pickled, in RocksDB "
    "(state_dir in the process's scratch directory) and its changelog topic at each checkpoint "
    "(commit_interval 5 s, the default)",
    "faust": "per session one entry of a Faust Table (memory:// store, the default): the folded "
    "Session as a Python object, and one changelog record per event with it pickled",
    "projector": "per session in Redis, readable by every process: the state (our codec), "
    "appended turns and timeline, event ids, indexes and analytics, per batch",
}


def _start_peer(
    run: Run, cleanup: Cleanup, peer: str, settings: Settings, *, expect: int = 0, stamps: bool
) -> Proc:
    """`python -m <peer> worker` in a scratch directory of its own; at cleanup it is stopped and
    its group, changelog and internal topics are deleted (never the events topic it read)."""
    name = f"{peer}-{'e2e' if stamps else 'tput'}"
    cwd = run.workdir / name
    cwd.mkdir(parents=True, exist_ok=True)
    env = {
        **settings.to_env(),
        **infra.FAST_GROUP_ENV,
        DIR_ENV: str(cwd / "report"),
        EXPECT_ENV: str(expect),
        STAMPS_ENV: "1" if stamps else "0",
    }
    group = settings.consumer_group

    def delete() -> None:
        admin = admin_client(settings)
        try:
            made = [t for t in admin.list_topics() if group in t and t != settings.events_topic]
        finally:
            admin.close()
        delete_topics(settings, made)

    cleanup.push(f"delete the topics and group of {name}", delete)
    log = cwd / "worker.log"
    p = start_python(name, PEERS[peer], ["worker", "--loglevel", "info"], log, env=env, cwd=cwd)
    cleanup.push(f"stop peer {name} (pid {p.pid})", p.stop)
    return p


@dataclass
class _Stamps:
    """The peer's stamps file, read as it grows: (partition, offset) → when its state was set."""

    path: Path
    updated: dict[tuple[int, int], float] = field(default_factory=dict)
    offset: int = 0
    rest: str = ""

    def read(self) -> int:
        """Read what was appended; how many records are stamped so far."""
        if self.path.exists():
            with self.path.open() as f:
                f.seek(self.offset)
                chunk = f.read()
                self.offset = f.tell()
            new, self.rest = parse_stamps(self.rest + chunk)
            self.updated.update(new)
        return len(self.updated)


def _per_cpu_s(events_per_s: float | None, cpu_pct: float | None) -> float | None:
    """Events per CPU second of the folding process (its events/s over its share of a core)."""
    return None if events_per_s is None or not cpu_pct else events_per_s * 100 / cpu_pct


def _read_json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


@dataclass
class PeerRun:
    """What one peer's throughput run saw."""

    events_per_s: float | None
    params: dict[str, Any]


def measure_peer(run: Run, peer: str, expect: int) -> PeerRun:
    """Start the peer on a fresh group over the pre-filled topic; time its first `expect` records.

    The peer stamps the first record it folded and the `expect`-th (time.perf_counter, machine-
    wide); the harness polls for the first stamp every 20 ms and meters CPU from there to the end.
    """
    prefill = run.prefilled()
    name = f"{peer}-tput"
    settings = run.settings(f"peer{peer}", events_topic=prefill.settings.events_topic)
    with run.cleanup.scope() as scope:
        proc = _start_peer(run, scope, peer, settings, expect=expect, stamps=False)
        report = run.workdir / name / "report"
        launch = time.monotonic()
        wait_for((report / "first.json").exists, 120, f"{name} started", POLL_S, [proc])
        cpu = run.cpu({"peer": proc.pid})
        cpu.start()
        first = time.monotonic()
        timeout = 60 + expect / 500
        wait_for((report / "done.json").exists, timeout, f"{name} done", POLL_S, [proc])
        usage = cpu.stop()
        done = _read_json(report / "done.json") or {}
    seconds = done["t_done"] - done["t_first"]
    value = rate(done["records"] - 1, seconds)
    run.log(f"peer {peer}: {value:.0f} events/s over {done['records']} records")
    params = {
        "events_in_topic": len(prefill.events),
        "events_timed": done["records"] - 1,
        "seconds": seconds,
        "timed": "from the peer's first folded record to its expect-th (the first records of the "
        "pre-filled topic, every partition), stamped by the peer itself",
        "startup_s": first - launch,
        "peer_cpu_pct_own": round(100 * done["cpu_s"] / seconds, 1) if seconds else None,
        "cpu_us_per_event": round(done["cpu_s"] / done["records"] * 1e6, 1),
        "outcomes": done["kinds"],
        "keeps": KEEPS[peer],
        **usage,
    }
    return PeerRun(value, params)


def _peer_e2e(run: Run, peer: str) -> dict[str, Any]:
    """e2e.py's method for a peer: the same rate, warm-up and window; the peer stamps each record
    when its session's state is updated, matched with the send by (partition, offset)."""
    s = run.sizes
    settings = run.settings(f"pe2e{peer}")
    infra.create_topics(settings, run.cleanup)
    total = int(s.e2e_rate * (s.e2e_warmup_s + s.e2e_seconds))
    sessions = math.ceil(total / 19) + 1
    tag = f"e{run.tag}{peer}"
    events = workload.sessions_workload(sessions, tag, concurrency=max(sessions // 5, 50)).events
    events = events[:total]
    name = f"{peer}-e2e"
    with run.cleanup.scope() as scope:
        proc = _start_peer(run, scope, peer, settings, stamps=True)
        log = KafkaEventLog(run.stack.kafka_bootstrap, settings.events_topic)
        scope.push(f"close the {name} producer", lambda: log.close(timeout=5))
        stamps = _Stamps(run.workdir / name / "report" / "stamps")
        log.append(workload.starts([f"{tag}-warmup"])[0])
        wait_for(lambda: stamps.read() >= 1, 120, f"{name} ready", 0.05, [proc])
        n_warm = int(s.e2e_rate * s.e2e_warmup_s)
        t_warm = time.perf_counter()
        paced(log, events[:n_warm], s.e2e_rate)
        log.flush(timeout=30)
        wait_for(lambda: stamps.read() >= 1 + n_warm, 60, f"{name} warm-up folded", 0.01, [proc])
        warm_s = time.perf_counter() - t_warm
        sends: list[tuple[int, int, float, float]] = []

        def on_ack(sid: str, sent: float, metadata: Any) -> None:
            sends.append((metadata.partition, metadata.offset, sent, time.perf_counter()))

        measured = events[n_warm:]
        cpu = run.cpu({"peer": proc.pid})
        cpu.start()
        produced_in, behind = paced(log, measured, s.e2e_rate, on_ack)
        log.flush(timeout=30)
        usage = cpu.stop()
        goal = 1 + n_warm + len(measured)
        deadline = time.monotonic() + 30
        while stamps.read() < goal and time.monotonic() < deadline and proc.alive():
            time.sleep(0.05)
        updated = stamps.updated
    lat = latencies(sends, updated)
    send = summary(lat.from_send)
    run.log(f"peer {peer} e2e: p50 {send['p50']} ms, p99 {send['p99']} ms")
    return {
        "from_send_ms": send,
        "from_ack_ms": summary(lat.from_ack),
        "produce_ack_ms": summary([(a - t) * 1000 for _, _, t, a in sends]),
        "events": len(measured),
        "unresolved": lat.unresolved,
        "sends_late_over_5ms": behind,
        "produced_in_s": produced_in,
        "warmup_all_folded_after_s": warm_s,
        **usage,
    }


def _own_e2e(run: Run) -> dict[str, Any]:
    """Ours, exactly as the e2e figure measures it (its warm-up, watcher and window)."""
    s = run.sizes
    settings = run.settings("pe2eown")
    infra.create_topics(settings, run.cleanup)
    infra.register_prefix(settings, run.cleanup)
    total = int(s.e2e_rate * (s.e2e_warmup_s + s.e2e_seconds))
    sessions = math.ceil(total / 19) + 1
    tag = f"e{run.tag}own"
    events = workload.sessions_workload(sessions, tag, concurrency=max(sessions // 5, 50)).events
    events = events[:total]
    worker = run.start("pe2eown-0", settings)
    log = KafkaEventLog(run.stack.kafka_bootstrap, settings.events_topic)
    run.cleanup.push("close the own e2e producer", lambda: log.close(timeout=5))
    n_warm = int(s.e2e_rate * s.e2e_warmup_s)
    folding = FoldCounter(run.store_client(settings), settings.redis_keys(), [worker])
    warm_s = _warm_up(run, folding, log, events[:n_warm])
    watcher = _start_watcher(run, settings)
    m = _measure(run, folding, log, watcher, events[n_warm:])
    worker.stop()
    send = summary(m.from_send)
    run.log(f"projector e2e (peers figure): p50 {send['p50']} ms, p99 {send['p99']} ms")
    return {
        "from_send_ms": send,
        "from_ack_ms": summary(m.from_ack),
        "produce_ack_ms": summary([a * 1000 for a in m.ack_times]),
        "events": len(events) - n_warm,
        "unresolved": len(events) - n_warm - len(m.from_send),
        "sends_late_over_5ms": m.behind,
        "produced_in_s": m.produced_in,
        "warmup_all_visible_after_s": warm_s,
        **m.usage,
    }


def peers(run: Run) -> None:
    """Events/s per process and e2e p99 of Quix Streams and Faust folding as the worker does,
    beside ours in the same figure; ours against the faster peer."""
    prefill = run.prefilled()
    expect = min(run.sizes.peers_events or len(prefill.events), len(prefill.events))
    own = measure_projector(run, "peersown", 1)
    run.log(f"projector (peers figure): {own.per_process:.0f} events/s")
    tput = {peer: measure_peer(run, peer, expect) for peer in PEERS}
    # Each e2e window after a settle: the peers leave their state stores' writes and topics'
    # deletions behind them (a window of ours right after them was disturbed in two runs).
    run.settle(ROUND_SETTLE_MAX_S)
    lat: dict[str, dict[str, Any]] = {"projector": _own_e2e(run)}
    for peer in PEERS:
        run.settle(ROUND_SETTLE_MAX_S)
        lat[peer] = _peer_e2e(run, peer)

    def p99(who: str) -> Any:
        return lat[who]["from_send_ms"]["p99"]

    common = {
        "e2e_rate_events_per_s": run.sizes.e2e_rate,
        "e2e_seconds": run.sizes.e2e_seconds,
        "e2e_method": "bench/figures/e2e.py's: the same workload, rate, warm-up and window; from "
        "the send call to the state updated. Ours: the mark visible in Redis to a watcher process "
        "(read on the state hash's keyspace notification: a round trip late); a peer: its own "
        "stamp when it set the session's "
        "state (exact, and in its process only; Quix's state reaches RocksDB and its changelog "
        "at the next checkpoint), matched to the send by partition and offset",
        "state_encoding": "peers: the Session pickled (protocol 5) per update; ours: "
        "projections.codec per session per batch",
    }
    for peer in PEERS:
        run.put(
            f"peers_{peer}_events_per_s",
            tput[peer].events_per_s,
            "events/s",
            baseline=own.per_process,
            params={**tput[peer].params, "baseline": "our projector, 1 worker, this figure"},
        )
    fastest = max(PEERS, key=lambda p: tput[p].events_per_s or 0.0)
    run.put(
        "peers_projector_events_per_s",
        own.per_process,
        "events/s",
        baseline=tput[fastest].events_per_s,
        params={
            **own.params,
            "baseline": f"the faster peer ({fastest})",
            "keeps": KEEPS["projector"],
        },
    )
    run.put(
        "projector_vs_fastest_peer_ratio",
        ratio(own.per_process, tput[fastest].events_per_s),
        "×",
        target=TARGETS["projector_vs_peer"],
        params={
            "projector": own.per_process,
            **{p: tput[p].events_per_s for p in PEERS},
            "fastest_peer": fastest,
            "of": "our events/s per worker process / the faster peer's per process",
            # Read beside the ratio on a busy machine, where each process gets another share.
            "events_per_cpu_second": {
                "projector": _per_cpu_s(own.per_process, own.params.get("worker0_cpu_pct")),
                **{
                    p: _per_cpu_s(tput[p].events_per_s, tput[p].params.get("peer_cpu_pct_own"))
                    for p in PEERS
                },
            },
            # The CPU reports of the runs it divides (a disturbed run disturbs the ratio).
            "cpu": {
                "projector": cpu_report(own.params),
                **{p: cpu_report(tput[p].params) for p in PEERS},
            },
            **common,
        },
    )
    for who in ("projector", *PEERS):
        run.put(
            f"peers_{who}_e2e_p99_ms",
            p99(who),
            "ms",
            baseline=None if who == "projector" else p99("projector"),
            params={**lat[who], **({} if who == "projector" else {"baseline": "ours"}), **common},
        )
