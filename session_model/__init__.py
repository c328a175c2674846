"""The pure core: session values, the fold, policy, compaction, intake and the projection cycle.

Holds: `fold` (`apply(state, event) -> state`), `session`, `policy`, `modes`, `principal`,
`signing`, `timeline`, `progress`, `compaction` (the one compaction rule), `scheduled` (the
scheduler's events), `intake` (decode-and-validate, refusal codes), `partitioning`, `projection`
(batch folding with marks), `cycle` (the fold → commit → conflict loop, sans I/O) and `ports`
(the `EventLog` and `ProjectionStore` protocols every adapter implements).
May import: `schemas`. No I/O and no clock: time and stores come in as arguments.
"""
