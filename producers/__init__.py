"""The write side: `SessionStore` (decide, then append) and the event logs it appends to.

Holds: `store` (`SessionStore`), `kafka_log` and `memory` (the Kafka and in-memory event logs),
`topics` (creating topics, describing the workers' group), `decisions` (the published decision
record and a de-duplicating subscriber) and `settings` (`StackSettings`, `WriterSettings`).
May import: `schemas`, `session_model`, `projections` (a writer reads the projection it decides on).
"""
