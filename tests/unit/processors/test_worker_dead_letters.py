"""A batch's bad records go to the dead-letter topic in one publish, not one acknowledged round
trip each (4,000 of them held the fold longer than a revocation waits for it)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from processors.ports import RawRecord
from processors.worker import ProjectionWorker
from projections.memory import InMemoryProjectionStore
from session_model.projection import BatchFolder
from tests.unit.builders import started
from tests.unit.processors.test_worker_expired import CODEC, _AsyncStore, _Sink


class _Calls(_Sink):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    async def publish_many(self, records: Sequence[Any]) -> None:
        self.calls += 1
        await super().publish_many(records)


def test_a_batch_of_bad_records_is_dead_lettered_in_one_publish() -> None:
    deadletter = _Calls()
    worker = ProjectionWorker(
        _AsyncStore(InMemoryProjectionStore()),  # type: ignore[arg-type]
        BatchFolder(),
        deadletter,
        _Sink(),
        questions=_Sink(),
    )
    good = started(session_id="s1")
    raws = [
        RawRecord(b"s1", b"not avro at all", 0, offset, "sessions.events") for offset in range(5)
    ]
    raws.append(RawRecord(b"s1", CODEC.encode(good), 0, 5, "sessions.events"))

    committed = asyncio.run(worker.process(raws))

    assert [u.session_id for u in committed] == ["s1"]
    assert deadletter.calls == 1
    assert len(deadletter.published) == 5
    assert worker.stats.dead_lettered == 5
    assert sum(worker.stats.refused.values()) == 5
