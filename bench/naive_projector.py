"""The naive projector, the baseline of the projector figure: one awaited Redis call per event.

A Faust app reading the same topic with `async for event in stream.events()` (Faust acks each event
after the loop body), which for every event: decodes it, folds it onto the session's cached state
(`BatchFolder.fold` over that one record: the same pure fold), and awaits
`AsyncRedisProjectionStore.commit([update])` — the product's own commit script for that single
event, pipelined with its SADD into one round trip, i.e. one awaited Redis round trip per event
and no batching. The first event of a session also awaits one read (the cache miss), like the real
worker does once per batch. It publishes no decisions and runs no scheduler, so it does strictly
less work than the real worker: the ratio against it is conservative.

Run: `python -m bench.naive_projector worker` with the `MILPA_*` settings in the environment.
"""

from __future__ import annotations

import os
from typing import Any

import click


def create_app(settings: Any) -> Any:
    """The naive Faust app for these settings."""
    import faust  # noqa: PLC0415
    import redis.asyncio as aioredis  # noqa: PLC0415

    from projections.keys import Keys  # noqa: PLC0415
    from projections.redis_store import AsyncRedisProjectionStore  # noqa: PLC0415
    from schemas.codec import EventCodec  # noqa: PLC0415
    from session_model.projection import BatchFolder, Folded, Position, Record  # noqa: PLC0415

    app = faust.App(
        settings.consumer_group,
        broker=f"kafka://{settings.kafka_bootstrap}",
        web_enabled=False,
        autodiscover=False,
        store="memory://",
        topic_partitions=settings.partitions,
        topic_replication_factor=settings.replication_factor,
        consumer_auto_offset_reset="earliest",
        producer_acks=-1,
        broker_commit_interval=0.5,
        stream_wait_empty=False,
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
    codec = EventCodec()
    folder = BatchFolder()
    cache: dict[str, Folded] = {}
    holder: dict[str, AsyncRedisProjectionStore] = {}

    def store() -> AsyncRedisProjectionStore:
        if "store" not in holder:  # created inside the running loop
            client = aioredis.Redis.from_url(settings.redis_url)
            holder["store"] = AsyncRedisProjectionStore(client, Keys(settings.redis_prefix))
        return holder["store"]

    @app.agent(topic, concurrency=1)
    async def project(stream: Any) -> None:
        s = store()
        async for event in stream.events():
            message = event.message
            decoded = codec.decode(message.value)
            sid = decoded.session_id
            known = cache.get(sid)
            if known is None:
                known = (await s.folded([sid])).get(sid)
            record = Record(decoded, Position(message.partition, message.offset))
            for update in folder.fold({sid: known} if known else {}, [record]):
                await s.commit([update])  # one awaited round trip per event
                cache[sid] = Folded(update.state, update.mark)

    return app


@click.group()
def main() -> None:
    """The naive projector (benchmark baseline)."""


@main.command()
@click.option("--loglevel", default="warning", show_default=True)
def worker(loglevel: str) -> None:
    """Run the naive projector with the MILPA_* settings from the environment."""
    import faust  # noqa: PLC0415

    from producers.settings import Settings  # noqa: PLC0415
    from producers.topics import ensure_topics  # noqa: PLC0415

    settings = Settings.from_env(os.environ)
    ensure_topics(settings)
    app = create_app(settings)
    faust.Worker(app, loglevel=loglevel, quiet=True).execute_from_commandline()


if __name__ == "__main__":
    main()
