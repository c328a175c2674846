"""The projector loop shared by every backend: load marks, fold a batch, commit, retry conflicts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from producers.ports import ProjectionStore
from schemas.errors import ProjectionError
from session_model.projection import BatchFolder, Record, SessionUpdate

MAX_CONFLICT_RETRIES = 5


@dataclass
class Projector:
    """Folds batches of records into a projection store (the same loop the Faust agent runs)."""

    store: ProjectionStore
    folder: BatchFolder

    def project(self, records: Sequence[Record]) -> tuple[SessionUpdate, ...]:
        """Fold and commit one batch; on a conflict reload those sessions and fold again."""
        done: list[SessionUpdate] = []
        pending = list(records)
        for _ in range(MAX_CONFLICT_RETRIES):
            ids = list(dict.fromkeys(r.event.session_id for r in pending))
            updates = self.folder.fold(self.store.folded(ids), pending)
            result = self.store.commit(updates)
            done.extend(u for u in updates if u.session_id not in result.conflicts)
            if not result.conflicts:
                return tuple(done)
            conflicted = set(result.conflicts)
            pending = [r for r in pending if r.event.session_id in conflicted]
        raise ProjectionError(f"sessions kept conflicting: {sorted(conflicted)}")
