"""The calibration folds the workload the worker would: every session's events onto its state."""

from __future__ import annotations

from bench import workload
from bench.figures.calibration import fold_all
from session_model.fold import Kind
from session_model.projection import BatchFolder, Position, Record


def test_the_calibration_folds_like_one_batch_of_the_whole_workload() -> None:
    work = workload.sessions_workload(400, "calibration", 250, partitions=1)
    records = [Record(e, Position(0, i)) for i, e in enumerate(work.events)]
    assert len(records) > 4_000  # sessions straddle the calibration's batches
    folder = BatchFolder(workload.OPERATOR_KEYS)
    whole = {u.session_id: u for u in folder.fold({}, records)}

    folded = fold_all(folder, records)

    assert {sid: f.state for sid, f in folded.items()} == {sid: u.state for sid, u in whole.items()}
    assert {sid: f.mark for sid, f in folded.items()} == {sid: u.mark for sid, u in whole.items()}
    refused = [s.outcome.rejection for u in whole.values() for s in u.steps if s.outcome.rejection]
    assert all(r.code != "unknown_session" for r in refused)
    assert sum(u.count(Kind.APPLIED) for u in whole.values()) > 0.9 * len(records)
