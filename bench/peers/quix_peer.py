"""The Quix Streams peer: the worker's fold in a Quix Streams 3 application, state in its store.

A `StreamingDataFrame` over the events topic (raw bytes in, as the worker reads them) with one
stateful `update`: per record, `Intake.admit`, then the session's state from the record's State
(Quix keys state by the message key, which is the session id), `step`, and the new state back
(`State.get_bytes`/`set_bytes`, pickled). Everything else is Quix's documented default: RocksDB
state store in `state_dir` (here the process's scratch working directory), a changelog topic per
store, at-least-once processing, a checkpoint every 5 s (commit_interval: state flushed to RocksDB
and the changelog, offsets committed). Only `auto_offset_reset` is set, to read from the start.
Nothing is produced besides Quix's changelog: the state is readable by this process only.

Run: `python -m bench.peers.quix_peer worker` with the `MILPA_*` and `BENCH_PEER_*` environment.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import click

STATE_KEY = "session"


@click.group()
def main() -> None:
    """The Quix Streams peer (benchmark)."""


@main.command()
@click.option("--loglevel", default="warning", show_default=True)
def worker(loglevel: str) -> None:
    """Fold the events topic of the MILPA_* settings until stopped (SIGTERM)."""
    from quixstreams import Application, message_context  # noqa: PLC0415

    from bench.peers.common import PeerFold, Reporter, decode_state, encode_state  # noqa: PLC0415
    from processors.settings import WorkerSettings  # noqa: PLC0415
    from session_model.intake import Refusal  # noqa: PLC0415

    settings = WorkerSettings.from_env(os.environ)
    if settings.kafka_access().sasl or settings.kafka_access().tls:
        raise click.UsageError("the Quix peer runs on a plaintext cluster only")
    peer = PeerFold.of(settings)
    report = Reporter.from_env(os.environ)
    app = Application(
        broker_address=settings.kafka_bootstrap,
        consumer_group=settings.consumer_group,
        auto_offset_reset="earliest",
        state_dir=Path.cwd() / "state",
        loglevel=loglevel.upper(),  # type: ignore[arg-type]  # a level name
    )
    topic = app.topic(settings.events_topic, key_deserializer="bytes", value_deserializer="bytes")

    def fold(value: bytes, key: bytes, timestamp: int, headers: Any, state: Any) -> None:
        context = message_context()
        partition, offset = context.partition, context.offset
        admitted = peer.admit(key, value, partition, offset)
        if isinstance(admitted, Refusal):
            report.folded(partition, offset, admitted.code)
            return
        raw = state.get_bytes(STATE_KEY)
        result = peer.step(None if raw is None else decode_state(raw), admitted)
        state.set_bytes(STATE_KEY, encode_state(result.state))
        report.folded(partition, offset, result.outcome.kind)

    sdf = app.dataframe(topic)
    sdf = sdf.update(fold, stateful=True, metadata=True)
    app.run()


if __name__ == "__main__":
    main()
