"""The ground layer: the event vocabulary, the error hierarchy and the Avro wire format.

Holds: `events` (event types and the `Event` value), `errors` (the one `MilpaError` hierarchy),
`codec` (Avro encoding with schema fingerprints, the released schema versions), `avro_reader`,
`frozen`, `secret_files` (secrets and trusted keys read from files only their owner may change),
and the `*.avsc` schemas themselves.
May import: nothing of this project (only the standard library and fastavro).
"""
