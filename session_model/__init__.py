"""The pure core: session values, the fold, policy, compaction, intake and the projection cycle.

Holds: `fold` (`apply(state, event) -> state`), `session`, `policy`, `modes`, `principal`,
`signing`, `timeline`, `narration` (timeline entries as sentences), `progress`, `compaction`
(the one compaction rule), `scheduled` (the scheduler's events), `intake` (decode-and-validate,
refusal codes), `partitioning`, `projection` (batch folding with marks), `cycle` (the fold →
commit → conflict loop, sans I/O), `questions` (the questions feed and the waiting index's
entries) and `ports` (the `EventLog`, `ProjectionStore` and `WaitingIndex` protocols).
May import: `schemas`. No I/O and no clock: time and stores come in as arguments.
"""
