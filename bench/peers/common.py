"""What both peers share: the worker's admission and fold, the state's encoding, the report.

The harness reads the report from files in the peer's directory (`BENCH_PEER_DIR`): `first.json`
when the first record was folded, `done.json` when `BENCH_PEER_EXPECT` records were, and with
`BENCH_PEER_STAMPS=1` one `partition offset time` line per record as soon as its session's state
was updated (time.perf_counter: CLOCK_MONOTONIC, one clock for every process on the machine).
"""

from __future__ import annotations

import collections
import json
import os
import pickle
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from milpa_sessions.wiring import trusted_keys
from producers.settings import StackSettings
from schemas.codec import EventCodec
from session_model.authority import Authority, Cutover
from session_model.fold import Step, step
from session_model.intake import Intake, Refusal
from session_model.projection import Record
from session_model.session import Session

DIR_ENV, EXPECT_ENV, STAMPS_ENV = "BENCH_PEER_DIR", "BENCH_PEER_EXPECT", "BENCH_PEER_STAMPS"


def encode_state(state: Session) -> bytes:
    """A session's whole folded state (turns and recent event ids included), pickled."""
    return pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)


def decode_state(raw: bytes) -> Session:
    """The state `encode_state` encoded."""
    state: Session = pickle.loads(raw)
    return state


@dataclass(frozen=True, slots=True)
class PeerFold:
    """Admission and fold exactly as the worker does them: `Intake.admit`, then `step` with the
    worker's trust (its trusted keys, unsigned start mode and cut-over)."""

    intake: Intake
    trust: Authority
    legacy: Authority
    cutover: Cutover

    @classmethod
    def of(cls, settings: StackSettings) -> PeerFold:
        """The fold of a worker with these settings."""
        keys, mode = trusted_keys(settings), settings.start_mode()
        return cls(
            Intake(EventCodec(), settings.partitions),
            Authority(keys, mode),
            Authority(keys, mode, legacy=True),
            settings.cutover(),
        )

    def admit(
        self, key: bytes | None, value: bytes | None, partition: int, offset: int
    ) -> Record | Refusal:
        """The record to fold, or why it is not folded (the peers count refusals and go on)."""
        return self.intake.admit(key, value, partition, offset)

    def step(self, state: Session | None, record: Record) -> Step:
        """Fold one admitted record onto its session's state (None: not seen yet)."""
        event, position = record.event, record.position
        legacy = self.cutover.before and self.cutover.is_legacy(position.partition, position.offset)
        trust = self.legacy if legacy else self.trust
        return step(Session(event.session_id) if state is None else state, event, trust)


@dataclass
class Reporter:
    """What a peer tells the harness: when it folded its first record and its `expect`-th, with
    its CPU time and outcome kinds, and (with `stamps`) when each record's state was updated."""

    directory: Path
    expect: int = 0
    stamps: IO[str] | None = None
    count: int = 0
    first: tuple[float, float] = (0.0, 0.0)  # (perf_counter, process CPU seconds)
    kinds: collections.Counter[str] = field(default_factory=collections.Counter)

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Reporter:
        """The reporter the harness asked for in the environment."""
        directory = Path(environ[DIR_ENV])
        directory.mkdir(parents=True, exist_ok=True)
        stamps = (directory / "stamps").open("a") if environ.get(STAMPS_ENV) == "1" else None
        return cls(directory, int(environ.get(EXPECT_ENV, "0")), stamps)

    def folded(self, partition: int, offset: int, kind: str) -> None:
        """One record done (`kind`: its outcome, or the refusal code)."""
        now = time.perf_counter()
        self.count += 1
        self.kinds[kind] += 1
        if self.stamps is not None:
            self.stamps.write(f"{partition} {offset} {now!r}\n")
            self.stamps.flush()
        if self.count == 1:
            self.first = (now, time.process_time())
            self._write("first.json", {"t": now})
        if self.count == self.expect:
            t0, cpu0 = self.first
            self._write(
                "done.json",
                {
                    "t_first": t0,
                    "t_done": now,
                    "records": self.count,
                    "cpu_s": time.process_time() - cpu0,
                    "kinds": dict(self.kinds),
                },
            )

    def close(self) -> None:
        """Close the stamps file."""
        if self.stamps is not None:
            self.stamps.close()

    def _write(self, name: str, content: dict[str, Any]) -> None:
        tmp = self.directory / f".{name}"
        tmp.write_text(json.dumps(content))
        os.replace(tmp, self.directory / name)  # the harness never reads half a file


def parse_stamps(text: str) -> tuple[dict[tuple[int, int], float], str]:
    """The `partition offset time` lines of `text` by (partition, offset), and the unfinished
    last line (to be read again with what follows it)."""
    lines = text.split("\n")
    out: dict[tuple[int, int], float] = {}
    for line in lines[:-1]:
        partition, offset, at = line.split()
        out[int(partition), int(offset)] = float(at)
    return out, lines[-1]


@dataclass
class Latencies:
    """Per record sent, ms from its send and from its ack to its state being updated."""

    sent_at: list[float] = field(default_factory=list)
    from_send: list[float] = field(default_factory=list)
    from_ack: list[float] = field(default_factory=list)
    unresolved: int = 0


def latencies(
    sends: Iterable[tuple[int, int, float, float]], updated: Mapping[tuple[int, int], float]
) -> Latencies:
    """Match `(partition, offset, sent, acked)` sends with the times their states were updated."""
    out = Latencies()
    for partition, offset, sent, acked in sends:
        at = updated.get((partition, offset))
        if at is None:
            out.unresolved += 1
            continue
        out.sent_at.append(sent)
        out.from_send.append((at - sent) * 1000)
        out.from_ack.append((at - acked) * 1000)
    return out
