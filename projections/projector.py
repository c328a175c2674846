"""The projector loop shared by every backend: load marks, fold a batch, commit, retry conflicts."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from schemas.errors import ProjectionError
from session_model.intake import WRONG_PARTITION
from session_model.ports import ProjectionStore
from session_model.projection import BatchFolder, Folded, Record, SessionUpdate, foreign_records

MAX_CONFLICT_RETRIES = 5


@dataclass
class Projector:
    """Folds batches of records into a projection store (the same loop the Faust agent runs).

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
    _states: dict[str, Folded] = field(default_factory=dict, repr=False)

    def project(self, records: Sequence[Record]) -> tuple[SessionUpdate, ...]:
        """Fold and commit one batch; on a conflict reload those sessions and fold again."""
        done: list[SessionUpdate] = []
        pending = records
        for _ in range(MAX_CONFLICT_RETRIES):
            ids = list(dict.fromkeys(r.event.session_id for r in pending))
            known = self._known(ids)
            updates = self.folder.fold(known, pending)
            if pending is records and sum(len(u.steps) for u in updates) < len(pending):
                # Skipped: redelivered (at or below a mark) or foreign; only the latter are counted.
                self.refused[WRONG_PARTITION] += len(foreign_records(known, pending))
            result = self.store.commit(updates)
            conflicted = set(result.conflicts)
            for u in updates:
                if u.session_id in conflicted:
                    self._states.pop(u.session_id, None)
                else:
                    done.append(u)
                    if self.cache:
                        self._states[u.session_id] = Folded(u.state, u.mark)
            if not conflicted:
                self._trim()
                return tuple(done)
            pending = [r for r in pending if r.event.session_id in conflicted]
        raise ProjectionError(f"sessions kept conflicting: {sorted(conflicted)}")

    def _trim(self) -> None:
        if self.cache_limit is not None and len(self._states) > self.cache_limit:
            # In insertion order: the sessions cached first are dropped first.
            for sid in list(self._states)[: len(self._states) // 2]:
                del self._states[sid]

    def _known(self, ids: Sequence[str]) -> dict[str, Folded]:
        if not self.cache:
            return self.store.folded(ids)
        misses = [sid for sid in ids if sid not in self._states]
        if misses:
            self._states.update(self.store.folded(misses))
        return {sid: self._states[sid] for sid in ids if sid in self._states}
