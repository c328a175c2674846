"""The synchronous projector: the shared fold → commit → conflict cycle on a synchronous store."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from session_model.cycle import ProjectionCycle, run
from session_model.intake import WRONG_PARTITION
from session_model.ports import ProjectionStore
from session_model.projection import BatchFolder, Record, SessionUpdate

MAX_CONFLICT_RETRIES = 5


@dataclass
class Projector:
    """Folds batches of records into a projection store (the in-memory backend and replay).

    With `cache=True` it keeps the states it committed and reads the store only for sessions it
    has not seen (a rebuild that owns the store); a conflict drops the cached state and reloads.
    Beyond `cache_limit` sessions the older half is dropped (read back if they show up again).
    Records in another partition than their session's are never folded; `refused` counts them.
    """

    store: ProjectionStore
    folder: BatchFolder
    cache: bool = False
    cache_limit: int | None = None
    refused: Counter[str] = field(default_factory=Counter)
    cycle: ProjectionCycle = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.cycle = ProjectionCycle(
            self.folder,
            keep=self.cache,
            cache_limit=self.cache_limit,
            max_rounds=MAX_CONFLICT_RETRIES,
        )

    def project(self, records: Sequence[Record]) -> tuple[SessionUpdate, ...]:
        """Fold and commit one batch; on a conflict reload those sessions and fold again."""
        folding, committed = run(self.cycle.project(records), self.store)
        if folding.foreign or committed.foreign:
            self.refused[WRONG_PARTITION] += len(folding.foreign) + len(committed.foreign)
        return committed.updates
