"""The Faust peer: the worker's fold in an idiomatic Faust agent, state in a Table.

One agent over the events topic (raw bytes, as the worker reads them) iterating
`stream.events()` (Faust acks each event after the loop body): per record, `Intake.admit`, then
`step` onto the session's state in a Table keyed by session id, and the new state set back. The
Table is Faust's default: the `memory://` store (the Python objects in a dict; the production
store, RocksDB, needs a driver not installed here), a changelog topic (`<app>-sessions-changelog`)
with one record per update, its value pickled by a codec of ours (Faust's own `pickle` codec adds
base64). Everything else is Faust's default (commit every 2.8 s, acks=all); `topic_partitions` is
set so the changelog is co-partitioned with the events, `consumer_auto_offset_reset` to read from
the start, the web server off. Nothing else is produced: the state is readable by this process.

Run: `python -m bench.peers.faust_peer worker` with the `MILPA_*` and `BENCH_PEER_*` environment.
"""

from __future__ import annotations

import os
from typing import Any

import click


def create_app(settings: Any) -> Any:
    """The Faust peer app for these settings."""
    import faust  # noqa: PLC0415
    from faust.serializers.codecs import Codec  # noqa: PLC0415

    from bench.peers.common import PeerFold, Reporter, decode_state, encode_state  # noqa: PLC0415
    from processors.app import faust_credentials  # noqa: PLC0415
    from session_model.intake import Refusal  # noqa: PLC0415

    class PickledState(Codec):
        """A session's state in the changelog."""

        def _dumps(self, obj: Any) -> bytes:
            return encode_state(obj)

        def _loads(self, s: bytes) -> Any:
            return decode_state(s)

    peer = PeerFold.of(settings)
    report = Reporter.from_env(os.environ)
    app = faust.App(
        settings.consumer_group,
        broker=f"kafka://{settings.kafka_bootstrap}",
        broker_credentials=faust_credentials(settings.kafka_access()),
        store="memory://",
        topic_partitions=settings.partitions,
        topic_replication_factor=settings.replication_factor,
        consumer_auto_offset_reset="earliest",
        web_enabled=False,
        autodiscover=False,
    )
    topic = app.topic(
        settings.events_topic,
        key_type=bytes,
        value_type=bytes,
        key_serializer="raw",
        value_serializer="raw",
        partitions=settings.partitions,
        internal=False,
    )
    schema: Any = faust.Schema(key_type=str, key_serializer="json", value_serializer=PickledState())
    sessions = app.Table("sessions", default=None, partitions=settings.partitions, schema=schema)

    @app.agent(topic)
    async def fold(stream: Any) -> None:
        async for event in stream.events():
            message = event.message
            partition, offset = message.partition, message.offset
            admitted = peer.admit(message.key, message.value, partition, offset)
            if isinstance(admitted, Refusal):
                report.folded(partition, offset, admitted.code)
                continue
            sid = admitted.event.session_id
            result = peer.step(sessions.get(sid), admitted)
            sessions[sid] = result.state
            report.folded(partition, offset, result.outcome.kind)

    return app


@click.group()
def main() -> None:
    """The Faust peer (benchmark)."""


@main.command()
@click.option("--loglevel", default="warning", show_default=True)
def worker(loglevel: str) -> None:
    """Fold the events topic of the MILPA_* settings until stopped (SIGTERM)."""
    import faust  # noqa: PLC0415

    from processors.settings import WorkerSettings  # noqa: PLC0415

    app = create_app(WorkerSettings.from_env(os.environ))
    faust.Worker(app, loglevel=loglevel, quiet=True).execute_from_commandline()


if __name__ == "__main__":
    main()
