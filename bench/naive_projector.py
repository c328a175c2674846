"""The naive projector, the baseline of the projector figure: one awaited Redis call per event.

A Faust app reading the same topic with `async for event in stream.events()` (Faust acks each event
after the loop body), which for every event: decodes it and runs the product's own fold → commit
cycle (`session_model.cycle.ProjectionCycle`) on that one record — the same pure fold onto the
session's cached state, then `AsyncRedisProjectionStore.commit` of that single update: one awaited
Redis round trip per event and no batching. The first event of a session also awaits one read (the
cache miss), like the real worker does once per batch. It publishes no decisions and runs no
scheduler, so it does strictly less work than the real worker: the ratio against it is
conservative.

Run: `python -m bench.naive_projector worker` with the `MILPA_*` settings in the environment.
"""

from __future__ import annotations

import os
from typing import Any

import click


def create_app(settings: Any) -> Any:
    """The naive Faust app for these settings."""
    import asyncio  # noqa: PLC0415

    import faust  # noqa: PLC0415

    from processors.app import faust_options, raw_topic  # noqa: PLC0415
    from processors.worker import drive  # noqa: PLC0415
    from projections.redis_client import async_client  # noqa: PLC0415
    from projections.redis_store import AsyncRedisProjectionStore  # noqa: PLC0415
    from schemas.codec import EventCodec  # noqa: PLC0415
    from session_model.cycle import ProjectionCycle  # noqa: PLC0415
    from session_model.projection import BatchFolder, Position, Record  # noqa: PLC0415

    app = faust.App(settings.consumer_group, **faust_options(settings))
    topic = raw_topic(app, settings.events_topic, settings.partitions)
    codec = EventCodec()
    cycle = ProjectionCycle(BatchFolder())  # the product's loop, fed one record at a time
    holder: dict[str, AsyncRedisProjectionStore] = {}

    def store() -> AsyncRedisProjectionStore:
        if "store" not in holder:  # created inside the running loop
            client = async_client(settings.redis_url, settings.redis_timeout)
            holder["store"] = AsyncRedisProjectionStore(client, settings.redis_keys())
        return holder["store"]

    @app.agent(topic, concurrency=1)
    async def project(stream: Any) -> None:
        s = store()
        async for event in stream.events():
            message = event.message
            record = Record(
                codec.decode(message.value), Position(message.partition, message.offset)
            )
            # One awaited commit per event (and one read on a cache miss).
            await drive(
                cycle.project([record]), s.folded, s.commit, lambda: asyncio.sleep(0), s.decisions
            )

    return app


@click.group()
def main() -> None:
    """The naive projector (benchmark baseline)."""


@main.command()
@click.option("--loglevel", default="warning", show_default=True)
def worker(loglevel: str) -> None:
    """Run the naive projector with the MILPA_* settings from the environment."""
    import faust  # noqa: PLC0415

    from processors.settings import WorkerSettings  # noqa: PLC0415
    from producers.topics import ensure_topics  # noqa: PLC0415

    settings = WorkerSettings.from_env(os.environ)
    ensure_topics(settings)
    app = create_app(settings)
    faust.Worker(app, loglevel=loglevel, quiet=True).execute_from_commandline()


if __name__ == "__main__":
    main()
